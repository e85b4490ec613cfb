"""pstar-plan's searches: the largest depth at this batch, the largest batch at this depth, the
least device (or host) memory a model fits in, and the search algorithms under them (doubling, then
bisection, over a monotone question).

The searches stay quick for any model: the largest depth lies below what host and device memory
can hold at the model's bytes per layer (its parameters' and its stage input's), and the search
starts near that bound; each probe asks only whether any placement fits (make_plan's
``first_fit``), traces of equal stages are analysed once, and the depth search stops at
``MAX_SEARCH_CHUNKS`` chunks (and says so) because a plan's cost grows with them. A search that
runs for more than a few seconds says what it tries on stderr (``Progress``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import sys
import time
from fractions import Fraction
from typing import TYPE_CHECKING, Callable

from pstar_jax.config import EngineConfig, OptimConfig
from pstar_jax.config.lora import LoraConfig
from pstar_jax.engine.chunks import build_layout
from pstar_jax.engine.memory import Placement
from pstar_jax.engine.optim import ChunkOptimizer, default_tx
from pstar_jax.engine.stages import bind
from pstar_jax.model.freeze import frozen_names, parse_patterns, trainable as make_trainable
from pstar_jax.model.lora import frozen_for_lora
from pstar_jax.model.quant_bytes import quant_rule
from pstar_jax.model.staged import StagedModel, chunk_group, decays, n_params
from pstar_jax.plan.machine import Machine
from pstar_jax.plan.placement import make_plan
from pstar_jax.plan.schedule import StepShape, kept_stages, lowest_trained_stage, scale_batch, working_moments
from pstar_jax.planner.trace import trace_step

if TYPE_CHECKING:  # only a type here: build imports planner.fit, which imports this module
    from pstar_jax.planner.build import Planned

MAX_SEARCH_CHUNKS = 512  # the depth search plans models of at most this many chunks
MAX_SEARCH_BATCH = 1 << 16  # micro-batch sequences
MAX_SEARCH_SEQ_LEN = 1 << 23  # tokens per sequence (8M): the longest-sequence search stops there
SEQ_LEN_TOLERANCE = 0.03  # the longest-sequence search stops within 3% (each probe is a new trace)
SEQ_LEN_GRANULE = 64  # its probes are multiples of this many tokens


@dataclasses.dataclass(frozen=True)
class Largest:
    """A search's answer: ``value`` (0: nothing fits), and whether the search stopped at its cap
    (``value`` is then a lower bound; ``memory_bound`` is what memory alone would allow)."""
    value: int
    capped: bool = False
    memory_bound: int | None = None


QUIET_S = 3.0  # a search says nothing for its first seconds


class Progress:
    """Lines on stderr about a search under way ("pstar-plan: searching depth: 1,536 layers fit,
    trying 2,240 ..."), from ``quiet_s`` seconds (``QUIET_S``) after it was made on: a quick
    answer stays silent."""

    def __init__(self, prog: str, quiet_s: float | None = None, write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.prog, self.quiet_s, self.clock = prog, QUIET_S if quiet_s is None else quiet_s, clock
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.start = clock()

    def __call__(self, line: str) -> None:
        if self.clock() - self.start >= self.quiet_s:
            self.write(f"{self.prog}: {line}")


def announced(fits: Callable[..., bool], what: str, unit: str, progress: Progress | None) -> Callable[..., bool]:
    """``fits``, saying before each probe what the search tries and the most it has seen fit."""
    if progress is None:
        return fits
    best = [0]

    def probe(n: int, *args) -> bool:
        known = f"{best[0]:,} {unit} fit, " if best[0] else ""
        progress(f"searching {what}: {known}trying {n:,} ...")
        ok = fits(n, *args)
        if ok:
            best[0] = max(best[0], n)
        return ok
    return probe


def largest(fits: Callable[[int], bool], start: int, limit: int = 1 << 16) -> int:
    """The largest n in [1, limit] with fits(n), assuming fits is monotone; 0 if not even 1 fits.
    Doubles from ``start``, then bisects: about 2 log2(answer / start) probes."""
    if not fits(1):
        return 0
    low, high = 1, max(2, min(start, limit))
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def largest_mixed(fits: Callable[[int, bool], bool], start: int, limit: int) -> int:
    """``largest`` for a question asked two ways: ``fits(n, mixes)`` with mixes False tries only
    PatrickStar's placements (the rest of the optimizer state all on the host or all streamed),
    True also mixes of the two, which cost far more plans and fit at least as far. The search
    runs on the cheap question, then goes on past its answer with the full one (usually a single
    probe that fails), only ever where the cheap one said no (more never fits less): a caller may
    skip the pure placements then (make_plan's ``pure_fails``)."""
    low = largest(lambda n: fits(n, False), start, limit)
    return low + largest(lambda i: fits(low + i, True), 1, limit - low) if low < limit else low


def longest_within(fits: Callable[[int], bool], start: int, granule: int, tolerance: float, limit: int,
                   guess: Callable[[int], int] | None = None) -> tuple[int, bool]:
    """(n, capped): the largest multiple n of ``granule`` in [granule, limit] with fits(n) (0: none),
    fits monotone, to within ``tolerance``: some m <= n + max(granule, tolerance * n) does not fit
    (capped: ``limit`` fits). From ``start`` (rounded to a granule) it doubles while fits (halves
    while not), then bisects, each probe a multiple of ``granule``.

    ``guess(n)``, given the longest length known to fit, estimates the answer (what memory allows
    there, from n's trace: pstar-plan's longest-sequence search). It replaces the doubling: its
    guess is probed, and guessed again from there while it fits (a few times: a guess from a short
    trace is mostly short, one from a longer trace nearer); where one does not fit the search
    steps down from it (by twice the tolerance, then twice as far each time). So a search costs
    about as many probes however long the answer is; a bracket still wider than a factor of two
    is halved geometrically."""
    def snap(n: float) -> int:
        return max(granule, min(limit, int(n)) // granule * granule)
    low = snap(start)
    high = None
    if fits(low):
        for _ in range(4 if guess is not None else 0):
            target = max(snap(guess(low)), snap(low * (1 + tolerance) + granule))  # past the tolerance at least
            if target <= low:
                break  # at the limit
            if fits(target):
                low = target
                continue
            high, below = target, 2 * tolerance  # a little long, mostly: step down, twice as far each time
            while high is not None and below < 0.5 and snap(target * (1 - below)) > low:
                nxt = snap(target * (1 - below))
                low, high, below = (nxt, high, 1.0) if fits(nxt) else (low, nxt, 2 * below)
            break
        while high is None and low < limit:
            nxt = snap(2 * low)
            low, high = (nxt, None) if fits(nxt) else (low, nxt)
        if high is None:
            return low, True
    else:
        low, high = 0, low
        while low == 0 and high > granule:
            nxt = snap(high // 2)
            low, high = (nxt, high) if fits(nxt) else (0, nxt)
    while low and high - low > max(granule, tolerance * low):
        mid = max(low + granule, snap(math.sqrt(low * high) if high > 2 * low else (low + high) // 2))
        if mid >= high:
            break  # within one granule
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, False


def trainable_for(model: StagedModel, config: EngineConfig, lora: LoraConfig | None = None,
                  strict: bool = True) -> Callable[[str], bool] | None:
    """The run's trainable predicate for ``model`` (None: everything trains), as the engine gets it:
    ``config.freeze``'s patterns and, for a LoRA run, everything but the adapters and
    ``modules_to_save``. ``strict`` False lets a pattern match nothing (the depth search's
    shallower models may lack a layer the pattern names)."""
    patterns = parse_patterns(config.freeze)
    lora_frozen = frozen_for_lora(model, lora) if lora is not None else frozenset()
    if not patterns and not lora_frozen:
        return None
    names = list(model.param_shapes())
    if strict:
        return make_trainable(frozen_names(names, patterns, lora_frozen))
    return make_trainable({n for p in patterns for n in fnmatch.filter(names, p)} | lora_frozen)


def _model_bytes_bound(shape: StepShape) -> int:
    """Every chunk's params and grad, and the largest optimizer state of a chunk for each (frozen
    ones too: a generous bound, which the searches below start from)."""
    state = max(shape.opt_state_bytes)
    return sum(2 * b + state for b in shape.chunk_bytes)


def resident_bytes(shape: StepShape) -> int:
    """Everything resident, twice the working memory of the busiest moment: a device budget that
    fits if any does."""
    return 2 * (_model_bytes_bound(shape) + shape.busiest_working_bytes)


def _least(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The least n in (low, high] (to 1/256 of it) with fits(n), fits monotone; None when not even
    ``high`` fits."""
    if low >= high or not fits(high):
        return None
    while high - low > max(high // 256, 1):
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def smallest_device_bytes(planned: Planned, host_bytes: int, machine: Machine, config: EngineConfig) -> int | None:
    """The least device memory (to 1/256 of it) at which some placement fits with ``host_bytes``, or
    None when not even everything on the device fits: the value a "does not fit" answer suggests,
    found by bisection with make_plan's ``first_fit`` (more device memory never fits less)."""
    shape = planned.shape
    return _least(lambda device_bytes: make_plan(shape, device_bytes, host_bytes, machine, config.adam_placement,
                                                 first_fit=True, disk_bytes=config.disk_memory or 0).fits,
                  planned.device_budget_bytes, resident_bytes(shape))


def smallest_host_bytes(planned: Planned, host_bytes: int, device_bytes: int, machine: Machine,
                        config: EngineConfig) -> int | None:
    """The least host memory above ``host_bytes`` (to 1/256 of it) at which some placement fits
    with ``device_bytes`` device memory, or None when not even room for every chunk's params,
    grads and optimizer state and every stage input, twice over, fits (more host memory never
    fits less): what a "does not fit" answer suggests where no device memory fits."""
    shape = planned.shape
    room = 2 * (_model_bytes_bound(shape) + shape.micro_batches * sum(shape.input_bytes))
    return _least(lambda host: make_plan(shape, device_bytes, host, machine, config.adam_placement,
                                         first_fit=True, disk_bytes=config.disk_memory or 0).fits, host_bytes, room)


def default_tx_for_shapes():
    """AdamW's state shapes (the schedule does not matter for a plan)."""
    return default_tx(OptimConfig(total_steps=1))


def largest_depth(model, model_at, planned, cfg: EngineConfig, mesh, machine, host_bytes: int, make_tx,
                  cache: dict, depth0: int, lora: LoraConfig | None = None,
                  progress: Progress | None = None) -> Largest:
    shape, device_bytes = planned.shape, planned.device_budget_bytes
    placement = Placement(mesh)
    optimizer = ChunkOptimizer(make_tx, placement, cfg.compute_dtype)
    traced_at: dict[int, object] = {}  # depth -> its step's shape (asked without mixes, then with)
    sizes = planned.layout.chunk_numels  # the run's sizes per kind at every depth

    def depth_fits(n_layer: int, mixes: bool) -> bool:
        # The trace of plan_model without its full placement search: only "does any placement fit?".
        if n_layer not in traced_at:
            deeper = model_at(n_layer)
            trains = trainable_for(deeper, cfg, lora, strict=False)
            layout = build_layout(deeper.param_shapes(), functools.partial(decays, deeper), sizes, trainable=trains,
                                  multiple=placement.n_devices,
                                  quant=quant_rule(cfg.base_quant, deeper.param_shapes(), trains),
                                  group=functools.partial(chunk_group, deeper))
            bound = [bind(stage, layout, i) for i, stage in enumerate(deeper.stages(cfg.compute_dtype))]
            traced_at[n_layer] = trace_step(bound, planned.fns, placement, layout.numels, cfg.compute_dtype,
                                            *planned.batch_shape, optimizer.chunk_state_bytes(layout),
                                            cfg.micro_batches, cache=cache,
                                            dropout_seeded=bool(getattr(deeper, "dropout_seeded", False)),
                                            dtypes=layout.dtypes(cfg.compute_dtype), objective=deeper,
                                            keep=kept_stages(len(bound), cfg.keep_residuals or 0))
        return make_plan(traced_at[n_layer], device_bytes, host_bytes, machine, cfg.adam_placement, first_fit=True,
                         mixes=mixes, pure_fails=mixes, disk_bytes=cfg.disk_memory or 0).fits  # largest_mixed asks with mixes only past the pure
    one_more = model_at(depth0 + 1)
    layer_numel = n_params(one_more) - n_params(model)
    if layer_numel <= 0:
        return Largest(depth0)
    memory_bound = depth_memory_bound(model, one_more, shape, cfg, lora, mesh.devices.size, depth0,
                                      device_bytes + host_bytes)
    # A layer adds its elements of each kind in chunks of that kind's size.
    per_kind = [_numel_by_kind(m, cfg, lora) for m in (model, one_more)]
    chunks_per_layer = sum(Fraction(per_kind[1].get(k, 0) - per_kind[0].get(k, 0), n) for k, n in sizes.items())
    chunk_bound = (depth0 + max(0, math.floor((MAX_SEARCH_CHUNKS - shape.n_chunks) / chunks_per_layer))
                   if chunks_per_layer > 0 else memory_bound)
    limit = max(1, min(memory_bound, chunk_bound))
    # From half the bound: the answer is usually near it, and deep probes cost the most.
    depth = largest_mixed(announced(depth_fits, "depth", "layers", progress), max(depth0, limit // 2), limit)
    return Largest(depth, capped=depth == limit and chunk_bound < memory_bound, memory_bound=memory_bound)


def _numel_by_kind(model, cfg: EngineConfig, lora: LoraConfig | None) -> dict[str, int]:
    trainable = trainable_for(model, cfg, lora, strict=False)
    out: dict[str, int] = {}
    for name, shape in model.param_shapes().items():
        kind = "trainable" if trainable is None or trainable(name) else "frozen"
        out[kind] = out.get(kind, 0) + math.prod(shape)
    return out


def depth_memory_bound(model, one_more, shape, cfg: EngineConfig, lora: LoraConfig | None, W: int, depth0: int,
                       memory_bytes: int) -> int:
    """The depth past which the model cannot fit in ``memory_bytes`` (device and host, per device):
    every parameter needs its bf16 item somewhere, and a trainable one its optimizer state too;
    and at the head's moment every stage input kept for the backward is alive beside the head's
    working memory (working_moments), one more per added stage. A layer adds the bytes the next
    deeper model adds; its stage input at least the smallest kept one of this model's."""
    trained = next(c for c in range(shape.n_chunks) if not shape.is_frozen(c))
    item, state = (b / W for b in shape.bytes_per_element(trained))  # (every chunk has the same of each)

    def data_bytes(m) -> float:
        trainable = trainable_for(m, cfg, lora, strict=False)
        trained = sum(math.prod(s) for n, s in m.param_shapes().items() if trainable is None or trainable(n))
        return n_params(m) * item + trained * state
    head = len(shape.stage_chunks) - 1
    head_non_model, alive = working_moments(shape)[head]
    lowest = lowest_trained_stage(shape)
    kept = [shape.input_bytes[i] for i in range(max(1, lowest), head + 1)] if shape.input_bytes else []
    new_stages = len(list(one_more.stages(cfg.compute_dtype))) - len(shape.stage_chunks)
    layer_bytes = data_bytes(one_more) - data_bytes(model) + max(0, new_stages) * min(kept, default=0)
    return depth0 + int((memory_bytes - data_bytes(model) - head_non_model - alive) // layer_bytes)


def largest_batch(planned: Planned, micro: int, machine, host_bytes: int, cfg: EngineConfig,
                  progress: Progress | None = None) -> Largest:
    shape, device_bytes = planned.shape, planned.device_budget_bytes
    # Activation memory grows with the batch: no batch whose busiest moment alone overflows fits.
    busiest = shape.busiest_non_model_bytes
    memory_limit = device_bytes * micro // max(busiest, 1)
    batch_limit = max(1, min(MAX_SEARCH_BATCH, memory_limit))

    def batch_fits(batch: int, mixes: bool) -> bool:
        return make_plan(scale_batch(shape, batch / micro), device_bytes, host_bytes, machine, cfg.adam_placement,
                         first_fit=True, mixes=mixes, pure_fails=mixes, disk_bytes=cfg.disk_memory or 0).fits
    batch = largest_mixed(announced(batch_fits, "batch", "sequences per micro-batch", progress),
                          max(micro, batch_limit // 2), batch_limit)  # from half the bound, as the depth
    return Largest(batch, capped=batch == MAX_SEARCH_BATCH < memory_limit, memory_bound=memory_limit)


__all__ = ["Progress", "announced", "depth_memory_bound", "Largest", "largest", "largest_mixed", "longest_within", "largest_depth", "largest_batch",
           "resident_bytes", "smallest_device_bytes", "smallest_host_bytes", "trainable_for", "default_tx_for_shapes",
           "MAX_SEARCH_CHUNKS", "MAX_SEARCH_BATCH",
           "MAX_SEARCH_SEQ_LEN", "SEQ_LEN_TOLERANCE", "SEQ_LEN_GRANULE"]
