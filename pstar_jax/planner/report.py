"""The planner as a library: will a model train here, and how? (pstar-plan's answers as data.)

``plan_report`` lays out, traces and plans a model for a machine without allocating model data,
then (optionally) searches the largest depth at this batch and the largest batch at this depth.
The searches are pstar_jax.planner.search's (the longest sequence, which needs a report at each
length, is here).
A step too long to plan at all (``MAX_PLAN_CHUNKS`` chunks, ``MAX_PLAN_MOMENTS`` moments) is
refused up front by ``check_plan_size``, with a chunk size or micro-batch count that answers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

from jax.sharding import Mesh

from pstar_jax.config import ConfigError, EngineConfig, format_bytes, format_seconds
from pstar_jax.config.lora import LoraConfig
from pstar_jax.engine.chunks import outgrown
from pstar_jax.model.quant_bytes import quant_rule
from pstar_jax.plan.machine import Machine, describe
from pstar_jax.plan.planned import residuals_line
from pstar_jax.model.staged import StagedModel, chunk_group, chunk_groups, decays, flops_per_token, n_params
from pstar_jax.planner.build import Planned, chunk_sizes, layout_for, plan_model, resolve_engine_config
from pstar_jax.planner.fit import any_fits
from pstar_jax.planner.search import (MAX_SEARCH_CHUNKS, MAX_SEARCH_SEQ_LEN, SEQ_LEN_GRANULE, SEQ_LEN_TOLERANCE, Largest,
                                     Progress, announced, default_tx_for_shapes, largest_batch, largest_depth,
                                     longest_within, trainable_for)

# A plan replays every moment of the step, evicting among the chunks: its cost grows with both
# (tiny at 500 one-layer chunks: 8 s; 4096 micro-batches: 40 s on a 2-core VM). The largest
# presets need far less (GPT3_175B: 98 stages; 8 micro-batches of llama-3.1-70b: 1,312 moments).
MAX_PLAN_CHUNKS = 2048
MAX_PLAN_MOMENTS = 1 << 14  # forward and backward moments: stages x micro-batches x 2


@dataclasses.dataclass
class PlanReport:
    label: str
    n_params: int
    planned: Planned
    machine: Machine
    host_bytes: int  # per device
    data_parallel: int
    batch_size: int
    micro_batches: int
    seq_len: int
    precision: str
    flops_per_token: float
    depth: Largest | None = None  # layers at this batch (None: not searched)
    batch: Largest | None = None  # sequences per step at this depth
    width: str = "this width"
    seq_len_search: Largest | None = None  # tokens per sequence at one sequence per device
    longest: "PlanReport | None" = None  # the plan at that length
    n_trainable: int | None = None  # trained params (None: all of them)
    chunk_size_forced: bool = False  # EngineConfig.chunk_numel (--chunk-size) set every kind's size
    disk_bytes: int = 0  # local disk for frozen chunks, per device (EngineConfig.disk_memory)
    groups: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # chunk_group -> its chunks

    @property
    def bytes_per_param(self) -> tuple[int, int]:
        """(trained, frozen) bytes per parameter in the run's precision: its param/grad item (2 B in
        bf16, 4 B in fp32) and, if trained, its fp32 master and optimizer state (12 B for AdamW):
        14 and 2 B in bf16, 16 and 4 B in fp32."""
        shape = self.planned.shape
        trained = next(c for c in range(shape.n_chunks) if not shape.is_frozen(c))
        frozen = next((c for c in range(shape.n_chunks) if shape.is_frozen(c)), trained)
        item, state = shape.bytes_per_element(trained)
        return round(item + state), round(shape.bytes_per_element(frozen)[0])

    @property
    def model_data_bytes(self) -> int:
        """``bytes_per_param`` over the trained and the frozen params."""
        trained = self.n_params if self.n_trainable is None else self.n_trainable
        per_trained, per_frozen = self.bytes_per_param
        quant_params, quant_bytes = self.quantized
        return per_trained * trained + per_frozen * (self.n_params - trained - quant_params) + quant_bytes

    @property
    def quantized(self) -> tuple[int, int]:
        """(params, bytes) of the frozen kernels stored quantized (EngineConfig.base_quant)."""
        slots = [s for s in self.planned.layout.slots if s.quant]
        return sum(s.n_params for s in slots), sum(s.numel for s in slots)

    @property
    def plan(self):
        return self.planned.plan

    @property
    def fits(self) -> bool:
        return self.plan.fits

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def model_tflops(self) -> float:
        return self.flops_per_token * self.tokens_per_step / self.plan.predicted_step_s / 1e12

    def to_json(self) -> dict:
        out = {"label": self.label, "n_params": self.n_params,
               "n_trainable": self.n_params if self.n_trainable is None else self.n_trainable,
               "model_data_bytes": self.model_data_bytes, **self._chunks_json(), "plan": self.plan.to_json()}
        if self.disk_bytes:
            out.update(disk_bytes=self.disk_bytes, disk_read_bytes_per_s=self.machine.disk_read_bytes_per_s)
        if self.groups:
            out["chunk_groups"] = {g: {"n_chunks": len(c), "bytes": self.group_bytes(g)} for g, c in self.groups.items()}
        for name in ("depth", "batch"):
            if getattr(self, name) is not None:
                out[f"largest_{name}"] = dataclasses.asdict(getattr(self, name))
        if self.seq_len_search is not None:
            longest = self.longest
            out["largest_seq_len"] = {**dataclasses.asdict(self.seq_len_search), "tolerance": SEQ_LEN_TOLERANCE,
                                      "batch_size": self.data_parallel,
                                      "plan": longest.plan.to_json() if longest else None,
                                      "tokens_per_s": longest.tokens_per_s if longest else None,
                                      "model_tflops": longest.model_tflops if longest else None}
        return out

    def _chunks_json(self) -> dict:
        """The chunk size and count, as before sizes were per kind while one kind holds every
        tensor; with both kinds, per kind: the size, the count, the bytes of padding (with their
        optimizer state), and the tensors in chunks of their own."""
        layout = self.planned.layout
        sizes = layout.chunk_numels
        out = {"chunk_numel": layout.numels[0]} if len(set(layout.numels)) == 1 else {}
        out["n_chunks"] = layout.n_chunks
        if len(sizes) > 1:
            out.update(chunk_numels=sizes, n_chunks_by_kind={k: layout.kinds.count(k) for k in sizes},
                       waste_bytes=self.waste_bytes, own_chunks=self._own_tensors(),
                       chunk_size_forced=self.chunk_size_forced)
        return out

    @property
    def waste_bytes(self) -> dict[str, int]:
        """Per kind: the model's bytes in chunk padding, at that kind's bytes per element (its item
        and optimizer state, as ``bytes_per_param`` rounds them: 14 and 2 B in bf16)."""
        shape, kinds = self.planned.shape, self.planned.layout.kinds
        first = {kind: kinds.index(kind) for kind in set(kinds)}
        return {kind: n * round(sum(shape.bytes_per_element(first[kind])))
                for kind, n in self.planned.layout.waste_numels().items()}

    def _chunk_data_bytes(self, chunks) -> int:
        """The model data (params and their optimizer state) in ``chunks``, padding included."""
        shape, numels = self.planned.shape, self.planned.layout.numels
        return sum(round(sum(shape.bytes_per_element(c)) * numels[c]) for c in chunks)

    def group_bytes(self, group: str) -> int:
        """The model data in ``group``'s chunks."""
        return self._chunk_data_bytes(self.groups[group])

    def _groups_lines(self) -> list[str]:
        """A line per chunk group (a mixture of experts' "experts"): its chunks and share of model data."""
        total = self._chunk_data_bytes(range(self.planned.layout.n_chunks))
        return [f"{group}: {len(chunks)} chunks of their own, {format_bytes(mine)} of model data "
                f"({100 * mine / total:.1f}%); a stage fetches them once per pass, whichever experts its tokens choose"
                for group, chunks in self.groups.items() for mine in [self.group_bytes(group)]]

    def _own_tensors(self) -> list[str]:
        layout = self.planned.layout
        own = set(layout.own_chunks)
        return [s.name for s in layout.slots if s.chunk in own]

    def _chunks_line(self) -> str:
        layout = self.planned.layout
        sizes = layout.chunk_numels
        if len(sizes) == 1:
            return (f"chunks: {layout.n_chunks} chunks of {max(sizes.values()):,} elements "
                    f"({100 * layout.numel / layout.padded_numel:.1f}% used)")
        own, waste, shape = set(layout.own_chunks), self.waste_bytes, self.planned.shape
        unused = layout.waste_numels()
        parts = []
        for i, (kind, size) in enumerate(sizes.items()):
            chunks = [c for c, k in enumerate(layout.kinds) if k == kind]
            padded = sum(layout.numels[c] for c in chunks)
            per_element = round(sum(shape.bytes_per_element(chunks[0])))
            parts.append(f"{kind} {sum(c not in own for c in chunks)} of {size:,}{' elements' if not i else ''} "
                         f"({100 * (padded - unused[kind]) / padded:.1f}%{' used' if not i else ''}, "
                         f"waste {format_bytes(waste[kind])} at {per_element} B/elem)")
        line = "chunks: " + "; ".join(parts)
        if own:
            line += f"; {len(own)} of their own ({', '.join(self._own_tensors())})"
        return line + ("; sizes set by --chunk-size" if self.chunk_size_forced else "")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.plan.predicted_step_s

    def lines(self) -> list[str]:
        """What pstar-plan prints."""
        plan, layout, W = self.plan, self.planned.layout, self.data_parallel
        disk = (f" and disk {format_bytes(self.disk_bytes)} (read at {format_bytes(self.machine.disk_read_bytes_per_s)}/s)"
                if self.disk_bytes else "")
        out = [f"planned for {describe(self.machine)}: device {format_bytes(self.planned.device_budget_bytes)}"
               f"{',' if disk else ' and'} host {format_bytes(self.host_bytes)}{disk} per device, {W} data-parallel "
               "device(s)",
               f"model {self.label}: {self.n_params:,} params ({self._data_words()}), batch "
               f"{self.batch_size}x{self.seq_len} in {self.micro_batches} micro-batch(es), {self.precision}",
               self._chunks_line(), *self._groups_lines()]
        if plan.fits:
            n, on_device, streamed = self.planned.shape.n_trainable, sum(plan.opt_on_device), sum(plan.opt_streamed)
            frozen = layout.n_chunks - n
            step_s, tflops = plan.predicted_step_s, self.model_tflops
            out += [f"fits: peak device {format_bytes(plan.peak_device_bytes)}, peak host "
                    f"{format_bytes(plan.peak_host_bytes)}",
                    f"resident: {100 * plan.resident_fraction:.0f}% of param chunks never leave the device",
                    f"adam: on the device for {on_device} chunks, on the host for {n - on_device - streamed}, "
                    f"state streamed through the device for {streamed}"
                    + (f" ({frozen} frozen chunks have none)" if frozen else ""),
                    plan.moved_line(),
                    plan.stage_inputs_line(),
                    *filter(None, [plan.frozen_line(), residuals_line(self.planned.shape, plan)]),
                    f"predicted: {format_seconds(step_s)}/step, {self.tokens_per_step / step_s:,.0f} tokens/s, "
                    f"{tflops:.0f} "
                    "model TFLOPS" + (f" ({tflops / W:.0f} per device)" if W > 1 else "")]
        if self.depth is not None:
            d = self.depth
            if d.capped:
                out.append(f"largest depth that fits with this batch: at least {d.value} layers at {self.width} (the "
                           f"search stops at {MAX_SEARCH_CHUNKS} chunks; memory alone would allow up to "
                           f"{d.memory_bound})")
            else:
                out.append(f"largest depth that fits with this batch: {d.value} layers at {self.width}" if d.value
                           else f"no depth fits at {self.width} with this batch")
        if self.batch is not None:
            b, note = self.batch, "(activation memory scaled linearly from the trace)"
            per_step = b.value * self.micro_batches
            if b.capped:
                out.append(f"largest batch that fits at this depth: at least {per_step} sequences per step "
                           f"(the search stops there) {note}")
            else:
                out.append(f"largest batch that fits at this depth: {per_step} sequences per step {note}"
                           if b.value else f"no batch fits at this depth {note}")
        if self.seq_len_search is not None:
            out.append(self._longest_line())
        return out

    def _data_words(self) -> str:
        data, (trained, frozen) = format_bytes(self.model_data_bytes), self.bytes_per_param
        if self.n_trainable is None or self.n_trainable == self.n_params:
            return f"{data} of model data at {trained} B/param"
        quant_params, quant_bytes = self.quantized
        if quant_params:
            kind = next(s.quant for s in self.planned.layout.slots if s.quant)
            frozen_words = (f"{quant_params:,} frozen in {kind} at {quant_bytes / quant_params:.3f} B/param, the "
                            f"rest frozen at {frozen} B/param")
        else:
            frozen_words = f"the rest frozen at {frozen} B/param"
        return f"{self.n_trainable:,} trained at {trained} B/param, {frozen_words}: {data} of model data"

    def _longest_line(self) -> str:
        s, longest, W = self.seq_len_search, self.longest, self.data_parallel
        rows = "1 sequence" if W == 1 else f"{W} sequences (one per device)"
        if not s.value:
            return f"longest sequence that trains at {rows}: none of {SEQ_LEN_GRANULE} tokens or more fits"
        bound = (f"at least {s.value:,} tokens (the search stops at {MAX_SEARCH_SEQ_LEN:,})" if s.capped
                 else f"{s.value:,} tokens (to {100 * SEQ_LEN_TOLERANCE:.0f}%)")
        line = f"longest sequence that trains at {rows}: {bound}"
        if longest is not None and longest.fits:
            line += (f", predicted {format_seconds(longest.plan.predicted_step_s)}/step, {longest.tokens_per_s:,.0f} "
                     f"tokens/s, {longest.model_tflops:.0f} model TFLOPS, peak device "
                     f"{format_bytes(longest.plan.peak_device_bytes)}, peak host "
                     f"{format_bytes(longest.plan.peak_host_bytes)}")
        return line


def plan_report(model: StagedModel, config: EngineConfig, batch_size: int, mesh: Mesh, machine: Machine,
                host_bytes: int, *, label: str | None = None, model_at: Callable[[int], StagedModel] | None = None,
                search: bool = True, seq_len_at: Callable[[int], StagedModel] | None = None,
                cache: dict | None = None, lora: LoraConfig | None = None,
                progress: Progress | None = None, sizes: int | dict[str, int] | None = None) -> PlanReport:
    """Plan ``model`` (config resolved against ``mesh``; ``host_bytes`` per device) for a step of
    ``batch_size`` sequences; ``model_at(n_layer)`` rebuilds the model at another depth for the
    depth search (no depth search without it). ``seq_len_at(seq_len)`` rebuilds it for another
    sequence length: given, the report also answers the longest sequence that trains at one
    sequence per device (``longest_seq_len``), whatever ``search`` says. ``lora``: a LoRA run
    (``model`` built with its adapters) trains only them and ``modules_to_save``; the rest is
    frozen, as ``EngineConfig.freeze`` freezes. No model data is allocated. ``progress`` hears
    what the searches try (search.Progress: lines on stderr once they have run a few seconds).
    ``sizes``: the chunk sizes (build.chunk_sizes') instead of those ``config`` gives."""
    if batch_size < 1 or batch_size % config.micro_batches:
        raise ConfigError(f"TrainConfig.batch_size {batch_size} must be a positive multiple of "
                          f"EngineConfig.micro_batches {config.micro_batches}")
    W = mesh.devices.size
    micro = batch_size // config.micro_batches
    if micro % W:
        raise ConfigError(f"the micro-batch ({micro} sequences) must be a multiple of the data-parallel degree {W} "
                          "(DistributedConfig.data_parallel)")
    trainable = trainable_for(model, config, lora)
    resolved = resolve_engine_config(config, model, mesh, trainable)
    sizes = chunk_sizes(config, model, mesh, trainable) if sizes is None else sizes
    layout = check_plan_size(model, resolved, mesh, trainable, sizes)
    make_tx = default_tx_for_shapes()
    cache = {} if cache is None else cache
    planned = plan_model(model, resolved, mesh, (micro, model.seq_len), machine, host_bytes, make_tx,
                         layout=layout, trace_cache=cache)
    cfg = getattr(model, "config", None)
    trained = None if trainable is None else sum(math.prod(v) for n, v in model.param_shapes().items()
                                                 if trainable(n))
    report = PlanReport(label or type(model).__name__, n_params(model), planned, machine, host_bytes, W, batch_size,
                        config.micro_batches, model.seq_len, config.precision,
                        flops_per_token(model, planned.layout.frozen_names),  # frozen: no weight grads
                        width=f"d_model {cfg.d_model}" if hasattr(cfg, "d_model") else "this width",
                        n_trainable=trained, chunk_size_forced=isinstance(sizes, int),
                        disk_bytes=(config.disk_memory or 0) if machine.disk_read_bytes_per_s else 0,
                        groups=chunk_groups(model, planned.layout.slots))
    if search:
        if model_at is not None and getattr(cfg, "n_layer", None):
            report.depth = largest_depth(model, model_at, planned, resolved, mesh, machine, host_bytes, make_tx,
                                         cache, cfg.n_layer, lora, progress)
        report.batch = largest_batch(planned, micro, machine, host_bytes, resolved, progress)
    if seq_len_at is not None:
        report.seq_len_search, report.longest = longest_seq_len(seq_len_at, resolved, mesh, machine, host_bytes,
                                                                start=model.seq_len, cache=cache, lora=lora,
                                                                progress=progress)
    return report


def longest_seq_len(seq_len_at: Callable[[int], StagedModel], config: EngineConfig, mesh: Mesh, machine: Machine,
                    host_bytes: int, *, start: int, cache: dict | None = None,
                    tolerance: float = SEQ_LEN_TOLERANCE, lora: LoraConfig | None = None,
                    progress: Progress | None = None) -> tuple[Largest, PlanReport | None]:
    """The longest sequence (a multiple of SEQ_LEN_GRANULE tokens) that trains at one sequence per
    device, one micro-batch, and the report at that length (None when none fits).

    Each probe rebuilds the model at that length (``seq_len_at``), lays it out with the run's
    chunk size and frozen set, traces it (shape only; ``cache`` shares the stages' analyses) and
    asks whether any placement fits (make_plan's ``first_fit``). After ``start`` it probes what
    memory allows: the longest length at which that trace, its activation memory scaled
    linearly (schedule.scale_batch), still has a placement that fits (plans only, no trace); then
    it steps down or doubles and bisects until the answer is within ``tolerance`` of the first
    length that fails (search.longest_within): a handful of traces whether the answer is 4k or
    8M tokens, since each trace costs about the same at any length."""
    from pstar_jax.plan.schedule import scale_batch
    cache = {} if cache is None else cache
    fits_in = functools.partial(any_fits, host_bytes=host_bytes, machine=machine, adam_placement=config.adam_placement,
                                disk_bytes=config.disk_memory or 0)
    cfg = dataclasses.replace(config, micro_batches=1)
    W = mesh.devices.size
    make_tx = default_tx_for_shapes()
    first = seq_len_at(start)
    sizes = chunk_sizes(cfg, first, mesh, trainable_for(first, cfg, lora))
    first_outgrown = outgrown(first.param_shapes(), sizes, trainable_for(first, cfg, lora),
                              quant_rule(cfg.base_quant, first.param_shapes(), trainable_for(first, cfg, lora)))
    resolved = resolve_engine_config(cfg, first, mesh)
    fitted: dict[int, bool] = {}
    shapes: dict[int, tuple] = {}  # seq_len -> (its step's shape, its device budget)

    def sizes_at(model: StagedModel) -> int | dict[str, int]:
        # The run's chunk sizes at every length, unless a tensor grows past its kind's size (GPT's
        # positions): then that length's own (a forced size would not hold it).
        trainable = trainable_for(model, cfg, lora)
        quant = quant_rule(cfg.base_quant, model.param_shapes(), trainable)
        if outgrown(model.param_shapes(), sizes, trainable, quant) <= first_outgrown:
            return sizes
        return chunk_sizes(dataclasses.replace(cfg, chunk_numel=None), model, mesh, trainable)

    def fits(seq_len: int) -> bool:
        if seq_len not in fitted:
            model = seq_len_at(seq_len)
            layout = check_plan_size(model, resolved, mesh, trainable_for(model, cfg, lora), sizes_at(model))
            shape = _traced(model, resolved, mesh, (W, seq_len), layout, make_tx, cache)
            shapes[seq_len] = shape, resolved.device_budget_bytes
            fitted[seq_len] = fits_in(shape, resolved.device_budget_bytes)
        return fitted[seq_len]

    def memory_allows(seq_len: int) -> int:
        # The longest length at which seq_len's trace, scaled, fits: the search's first guess.
        shape, device_bytes = shapes[seq_len]
        if fits_in(scale_batch(shape, MAX_SEARCH_SEQ_LEN / seq_len), device_bytes):
            return MAX_SEARCH_SEQ_LEN
        low, high = seq_len, MAX_SEARCH_SEQ_LEN
        while high - low > max(SEQ_LEN_GRANULE, tolerance * low / 2):
            mid = (low + high) // 2 // SEQ_LEN_GRANULE * SEQ_LEN_GRANULE
            low, high = (mid, high) if fits_in(scale_batch(shape, mid / seq_len), device_bytes) else (low, mid)
        return low

    def report_at(seq_len: int) -> PlanReport:
        # The full plan (placement search, predicted step) at the answer: its traces are cached.
        model = seq_len_at(seq_len)
        return plan_report(model, resolved, W, mesh, machine, host_bytes, search=False, cache=cache, lora=lora,
                           sizes=sizes_at(model))

    length, capped = longest_within(announced(fits, "seq-len", "tokens", progress), start, SEQ_LEN_GRANULE,
                                    tolerance, MAX_SEARCH_SEQ_LEN, guess=memory_allows)
    return Largest(length, capped=capped), report_at(length) if length else None


def _traced(model: StagedModel, cfg: EngineConfig, mesh: Mesh, batch_shape: tuple[int, int], layout, make_tx,
            cache: dict):
    """The step's shape (trace) of ``model`` with ``layout``, no plan."""
    from pstar_jax.engine.memory import Placement
    from pstar_jax.engine.optim import ChunkOptimizer
    from pstar_jax.engine.stages import StageFunctions, bind
    from pstar_jax.plan.schedule import kept_stages
    from pstar_jax.planner.trace import trace_step
    placement = Placement(mesh)
    bound = [bind(stage, layout, i) for i, stage in enumerate(model.stages(cfg.compute_dtype))]
    fns = StageFunctions(mesh)
    opt_state_bytes = ChunkOptimizer(make_tx, placement, cfg.compute_dtype).chunk_state_bytes(layout)
    return trace_step(bound, fns, placement, layout.numels, cfg.compute_dtype, *batch_shape, opt_state_bytes,
                      cfg.micro_batches, cache=cache, dtypes=layout.dtypes(cfg.compute_dtype),
                      keep=kept_stages(len(bound), cfg.keep_residuals or 0))


def check_plan_size(model: StagedModel, config: EngineConfig, mesh: Mesh,
                    trainable: Callable[[str], bool] | None = None, sizes: int | dict[str, int] | None = None):
    """The layout of ``model`` (``trainable`` as build_layout's; ``sizes`` as build.layout_for's),
    refusing a step too long to plan in reasonable time (MAX_PLAN_CHUNKS chunks of both kinds,
    MAX_PLAN_MOMENTS) with a value that answers when followed."""
    from pstar_jax.engine.chunks import build_layout
    W = mesh.devices.size
    decay = functools.partial(decays, model)
    layout = layout_for(model, config, mesh, trainable, sizes)
    n_stages = len(list(model.stages(config.compute_dtype)))
    moments = 2 * n_stages * config.micro_batches
    if 2 * n_stages > MAX_PLAN_MOMENTS:
        n_layer = getattr(getattr(model, "config", None), "n_layer", None)
        fewer = (f"plan a model of at most {MAX_PLAN_MOMENTS // 2 - (n_stages - n_layer)} layers (ModelConfig.n_layer)"
                 if isinstance(n_layer, int) else "plan a model of fewer stages")
        raise ConfigError(f"the model's {n_stages:,} stages are more than pstar-plan replays "
                          f"({MAX_PLAN_MOMENTS // 2:,}); {fewer}")
    if moments > MAX_PLAN_MOMENTS:
        raise ConfigError(f"{n_stages} stages x {config.micro_batches} micro-batches is {moments:,} forward and "
                          f"backward moments, more than pstar-plan replays ({MAX_PLAN_MOMENTS:,}); use "
                          f"EngineConfig.micro_batches {max(1, MAX_PLAN_MOMENTS // (2 * n_stages))} or fewer")
    if layout.n_chunks > MAX_PLAN_CHUNKS:
        larger = max(-(-layout.numel // MAX_PLAN_CHUNKS), max(math.prod(v) for v in model.param_shapes().values()))
        while True:  # packing wastes some of each chunk: grow until the count is within the cap
            larger = -(-larger // (64 * W)) * 64 * W
            if build_layout(model.param_shapes(), decay, larger, trainable=trainable,
                            quant=quant_rule(config.base_quant, model.param_shapes(), trainable),
                            group=functools.partial(chunk_group, model)).n_chunks <= MAX_PLAN_CHUNKS:
                break
            larger = larger * 9 // 8
        sizes = layout.chunk_numels
        of = (f"of {max(sizes.values()):,} elements" if len(sizes) == 1 else
              "(" + ", ".join(f"{kind} {layout.kinds.count(kind):,} of {n:,}" for kind, n in sizes.items()) + ")")
        raise ConfigError(f"{layout.n_chunks:,} chunks {of} are more than pstar-plan plans ({MAX_PLAN_CHUNKS:,}); "
                          f"use EngineConfig.chunk_numel {larger} or more")
    return layout


__all__ = ["PlanReport", "plan_report", "longest_seq_len", "check_plan_size", "MAX_PLAN_CHUNKS", "MAX_PLAN_MOMENTS"]
