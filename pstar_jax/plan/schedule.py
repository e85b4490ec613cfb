"""The step as a sequence of moments and the chunk accesses of each: shared by trace, plan and executor.

A *moment* is one stage call: each stage's forward, the head (forward and backward in one), each
stage's backward, and one optimizer update per chunk. ``StepShape`` is what the warm-up trace
learns of a step (which chunks each stage reads, its non-model bytes and FLOPs); ``step_accesses``
lays the step out in the executor's order, saying for each moment which items (a chunk's bf16
params or its grad, or a stage input) must be on the device, and which it drops, consumes or creates.

A *stage input* (item ("act", stage, micro-batch)) is what a stage reads from the stage below,
kept from its forward to its backward (activation checkpointing at stage boundaries; the first
stage's input is the micro-batch's tokens, part of the batch, not an item). Its times of use are
exact: made by the forward below it, read by the stage's forward, then read once more by its
backward, in reverse order, and dropped. It is an item beside the chunks, so the plan decides
whether it stays on the device or goes to pinned host memory and comes back before its backward.

A step's optimizer update is deferred into the next step's forward: the update of chunk c runs
right before the first forward stage that reads c. The update needs the global gradient norm,
known only when the backward ends, so updating during the backward would change the math;
updating during the next forward does not, and it gives the optimizer's copies (streamed state)
the forward's compute to hide under instead of a phase of their own.

A chunk updated on the host sends its grad up to the host as soon as the grad is final (after the chunk's
last backward use), so the copy hides under the rest of the backward and the grad leaves device
memory early; the executor starts every host update when the backward ends (the norm is known)
and the host computes them while the device runs the next forward. The chunk's "adam" moment is
then where the device waits for that update's new params, not where it computes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

# ("param" | "slot", chunk id): bf16 params a stage reads, or the chunk's slot (its grad, or its
# params between steps); ("act", stage, micro-batch): a stage's input kept for its backward
Item = tuple[str, int] | tuple[str, int, int]


@dataclasses.dataclass(frozen=True)
class Access:
    """One moment of a step as the planner sees it."""
    phase: str  # "fwd", "head", "bwd", "adam"
    index: int  # stage index; chunk id for "adam"
    micro: int
    needs: tuple[Item, ...]  # on the device during the moment (created if absent)
    non_model_bytes: int
    flops: float = 0.0
    drops: tuple[Item, ...] = ()  # gone after the moment (params after their last backward use)
    to_host: tuple[Item, ...] = ()  # sent to the host after the moment, leaving the device (final grads for host Adam)
    consumes: tuple[Item, ...] = ()  # used up by the moment (grads by Adam)
    creates_host: tuple[Item, ...] = ()  # made on the host by the moment (params from host Adam)
    creates_device: tuple[Item, ...] = ()  # made on the device, dirty (params from device Adam)
    state_bytes_each_way: int = 0  # optimizer state streamed down and back up (streamed Adam)
    state_lead: int = 0  # the state is sent down right after this many earlier moments are issued


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What the planner needs to know of a chunked step (no arrays)."""
    stage_chunks: tuple[tuple[int, ...], ...]  # per stage: chunk ids it reads
    fwd_non_model: tuple[int, ...]  # per stage but the last: forward moment's non-model bytes
    head_non_model: int
    bwd_non_model: tuple[int, ...]  # per stage but the last
    fwd_flops: tuple[float, ...]
    head_flops: float
    bwd_flops: tuple[float, ...]
    shard_numels: tuple[int, ...]  # per chunk: its elements on one device (the layout's numel_of(c) / W)
    chunk_bytes: tuple[int, ...]  # per chunk: its bf16 params (or grad), per device
    opt_state_bytes: tuple[int, ...]  # per chunk: its fp32 master + optimizer state, per device (0: frozen)
    micro_batches: int = 1
    frozen: tuple[bool, ...] = ()  # per chunk: frozen (params only: no grad, no update); () none is
    # Per stage: the bytes of its input kept for its backward, per device (0 for the first stage,
    # whose input is the batch); () when the shape has no stage-input items. The non-model bytes
    # above do not count them: the plan places them.
    input_bytes: tuple[int, ...] = ()
    # Per stage: of its input_bytes, the vjp residuals a stage keeping them adds (kept_stages); () none does.
    residual_bytes: tuple[int, ...] = ()

    @property
    def keeping(self) -> frozenset[int]:
        """The stages that keep their vjp residuals (in their input's item) for their backward."""
        return frozenset(i for i, r in enumerate(self.residual_bytes) if r)

    def __post_init__(self):
        if not len(self.shard_numels) == len(self.chunk_bytes) == len(self.opt_state_bytes):
            raise ValueError(f"a step shape needs elements, bytes and optimizer state bytes per chunk, got "
                             f"{len(self.shard_numels)}, {len(self.chunk_bytes)} and {len(self.opt_state_bytes)}")
        if any(self.opt_state_bytes[c] for c in range(self.n_chunks) if self.is_frozen(c)):
            raise ValueError("a frozen chunk has no optimizer state (its opt_state_bytes must be 0)")

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_bytes)

    def is_frozen(self, chunk: int) -> bool:
        return bool(self.frozen) and self.frozen[chunk]

    @property
    def n_trainable(self) -> int:
        """Chunks with a grad, a master and optimizer state."""
        return self.n_chunks - sum(self.frozen)

    def item_size(self, item: Item) -> int:
        """Per-device bytes of an item: a chunk's bf16 params or grad, or a stage input."""
        return self.input_bytes[item[1]] if item[0] == "act" else self.chunk_bytes[item[1]]

    def bytes_per_element(self, chunk: int) -> tuple[float, float]:
        """(its bf16 params or grad, its master and optimizer state) bytes per element of ``chunk``."""
        numel = self.shard_numels[chunk]
        return self.chunk_bytes[chunk] / numel, self.opt_state_bytes[chunk] / numel

    def has_input(self, stage: int) -> bool:
        return bool(self.input_bytes) and self.input_bytes[stage] > 0

    @property
    def busiest_non_model_bytes(self) -> int:
        """The non-model bytes of the step's busiest moment: where the device holds the fewest chunks."""
        return max((*self.fwd_non_model, self.head_non_model, *self.bwd_non_model))

    @property
    def busiest_moment_bytes(self) -> int:
        """The most device memory some moment needs at the least, beside the optimizer state: its
        non-model bytes and the largest chunk its stage reads (every stage reads one)."""
        largest = [max(self.chunk_bytes[c] for c in cs) for cs in self.stage_chunks]
        head = len(self.stage_chunks) - 1
        return max(self.head_non_model + largest[head],
                   *(max(f, b) + largest[i] for i, (f, b) in enumerate(zip(self.fwd_non_model, self.bwd_non_model))))

    @property
    def busiest_working_bytes(self) -> int:
        """The busiest moment's non-model bytes with every stage input kept on the device (from its
        forward to its backward): the working memory of a step that offloads no activations."""
        kept = [sum(self.input_bytes[:i + 1]) for i in range(len(self.stage_chunks))] if self.input_bytes else \
            [0] * len(self.stage_chunks)
        return max((*(n + k for n, k in zip(self.fwd_non_model, kept)), self.head_non_model + kept[-1],
                    *(n + k for n, k in zip(self.bwd_non_model, kept))))

    @property
    def input_bytes_per_step(self) -> int:
        """All stage inputs one step keeps for its backward, per device."""
        return sum(self.input_bytes) * self.micro_batches


def scale_batch(shape: StepShape, factor: float) -> StepShape:
    """The step at ``factor`` times the traced batch: activation memory and FLOPs scale linearly.

    An estimate (temporaries that do not grow with the batch are scaled too, so it errs on the
    safe side for larger batches); pstar-plan uses it to search the largest batch quickly."""
    def s(values):
        return tuple(int(v * factor) for v in values)

    def f(values):
        return tuple(v * factor for v in values)
    return dataclasses.replace(shape, fwd_non_model=s(shape.fwd_non_model), input_bytes=s(shape.input_bytes),
                               residual_bytes=s(shape.residual_bytes),
                               head_non_model=int(shape.head_non_model * factor), bwd_non_model=s(shape.bwd_non_model),
                               fwd_flops=f(shape.fwd_flops), head_flops=shape.head_flops * factor,
                               bwd_flops=f(shape.bwd_flops))


def kept_stages(n_stages: int, blocks: int) -> frozenset[int]:
    """The stages that keep their vjp residuals for their backward (EngineConfig.keep_residuals):
    the last ``blocks`` before the head, whose residuals live the fewest moments (a micro-batch's
    backward starts from the head). Never the first stage: its input is the batch, not an item
    the residuals could join."""
    head = n_stages - 1
    return frozenset(range(max(1, head - blocks), head))


def lowest_trained_stage(shape: StepShape) -> int:
    """The stage the backward ends at: the lowest with a trainable chunk (the head when none has)."""
    return min((i for i, cs in enumerate(shape.stage_chunks) if any(not shape.is_frozen(c) for c in cs)),
               default=len(shape.stage_chunks) - 1)


@functools.lru_cache(maxsize=8)  # asked for every candidate placement of a search
def working_moments(shape: StepShape) -> tuple[tuple[int, int], ...]:
    """(non-model bytes, bytes of the stage inputs alive) at each forward, head and backward moment
    of a micro-batch, as ``step_accesses`` lays them out (one micro-batch's inputs are alive at a
    time): an input lives from its stage's forward to its backward, and only its forward below
    the lowest trainable stage, where no backward reads it. The planner's memory bounds read it."""
    head = len(shape.stage_chunks) - 1
    lowest = lowest_trained_stage(shape)
    own = list(shape.input_bytes) if shape.input_bytes else [0] * (head + 1)
    kept = [0] * (head + 2)  # kept[i]: inputs of the stages below i still held for their backward
    for i in range(head + 1):
        kept[i + 1] = kept[i] + (own[i] if i >= lowest else 0)
    out = [(shape.fwd_non_model[i], kept[i] + own[i] * (i < lowest)) for i in range(head)]
    out.append((shape.head_non_model, kept[head + 1] if head >= lowest else own[head]))
    out += [(shape.bwd_non_model[i], kept[i + 1] if i >= lowest else 0) for i in reversed(range(head))]
    return tuple(out)


def step_accesses(shape: StepShape, opt_on_device: Sequence[bool],
                  streamed: Sequence[bool] | None = None, leads: Sequence[int] | None = None) -> list[Access]:
    """The moments of one step in the executor's order, with what each needs.

    The previous step's update of chunk c (its "adam" moment) comes right before the first
    forward stage of the first micro-batch that reads c. It is one of three: state resident on
    the device; state on the host, updated there (compute_on host: the grad goes down to it); or
    state on the host, streamed to the device, updated there and streamed back (the grad stays,
    the new params stay on the device). A host-updated chunk's grad goes up to the host after its last
    backward use (``to_host`` of that moment) and its update moment consumes it on the host.
    Streamed state is sent down ``leads[c]`` moments ahead
    (default 1), so its copy hides under their compute, and goes back up during the next moment:
    its device copy is non-model memory of all those moments.

    A frozen chunk has one item, ("param", c): read by its stages' forwards and backwards, never
    dropped, written or updated, so it always has a valid host copy (evicting it is free). A
    stage's backward runs only while some stage at or below it has trainable chunks: below the
    lowest one no gradient is wanted, and those moments need nothing (the executor skips them).

    A stage input ("act", i, m) is needed by stage i's forward (which creates it: the forward
    below made it) and by its backward (the head's own, for the last stage), and dropped after the
    backward; below the lowest trainable stage no backward reads it, so it is dropped after the
    forward."""
    streamed = streamed or [False] * shape.n_chunks
    leads = leads or [1] * shape.n_chunks
    on_host = [not opt_on_device[c] and not streamed[c] for c in range(shape.n_chunks)]

    def updates(chunks):
        for c in chunks:
            g, p = ("slot", c), ("param", c)
            if opt_on_device[c]:
                yield Access("adam", c, 0, (g,), 0, consumes=(g,), creates_device=(p,))
            elif streamed[c]:
                yield Access("adam", c, 0, (g,), shape.opt_state_bytes[c], consumes=(g,), creates_device=(p,),
                             state_bytes_each_way=shape.opt_state_bytes[c], state_lead=leads[c])
            else:
                yield Access("adam", c, 0, (), 0, consumes=(g,), creates_host=(p,))

    out: list[Access] = []
    for a, updated, finished in _passes(shape):
        out.extend(updates(updated))
        up = tuple(("slot", c) for c in finished if on_host[c])  # final grads bound for host Adam
        out.append(dataclasses.replace(a, to_host=up) if up else a)
    if not any(streamed):
        return out
    extra = [0] * len(out)  # streamed state on the device beside other moments' own data
    for u, a in enumerate(out):
        for t in range(max(0, u - a.state_lead), min(u + 2, len(out))):
            if t != u:
                extra[t] += a.state_bytes_each_way
    return [dataclasses.replace(a, non_model_bytes=a.non_model_bytes + x) if x else a for a, x in zip(out, extra)]


@functools.lru_cache(maxsize=4)
def _passes(shape: StepShape) -> tuple[tuple[Access, tuple[int, ...], tuple[int, ...]], ...]:
    """The forward, head and backward moments of ``step_accesses`` before any optimizer placement,
    each with the chunks whose update comes right before it and those whose grad it finishes (in
    the last micro-batch): what step_accesses adds per placement. Kept for the last few shapes: a
    search plans one shape many times, and these moments are most of a step."""
    head = len(shape.stage_chunks) - 1
    first_use: dict[int, int] = {}
    for i, cs in enumerate(shape.stage_chunks):
        for c in cs:
            first_use.setdefault(c, i)
    updated_at: dict[int, list[int]] = {}  # stage -> chunks whose update comes right before it
    for c in range(shape.n_chunks):
        if not shape.is_frozen(c):
            updated_at.setdefault(first_use[c], []).append(c)
    last_bwd = first_use  # the backward visits stages in reverse
    trained = [tuple(c for c in cs if not shape.is_frozen(c)) for cs in shape.stage_chunks]
    lowest = lowest_trained_stage(shape)  # the backward's last stage
    params = [tuple(("param", c) for c in cs) for cs in shape.stage_chunks]
    both = [params[i] + tuple(("slot", c) for c in cs) if i >= lowest else () for i, cs in enumerate(trained)]
    last_chunks = [tuple(c for c in cs if last_bwd[c] == i) for i, cs in enumerate(trained)]
    last_drops = [tuple(("param", c) for c in cs) for cs in last_chunks]

    def inputs(i, m):  # the stage input of stage i, micro-batch m, as an item
        return (("act", i, m),) if shape.has_input(i) else ()

    out = []
    for m in range(shape.micro_batches):
        last = m == shape.micro_batches - 1
        finished = (lambda i: last_chunks[i]) if last else (lambda i: ())
        dropped = (lambda i: last_drops[i]) if last else (lambda i: ())  # params after their last backward use
        for i in range(head):
            out.append((Access("fwd", i, m, params[i] + inputs(i, m), shape.fwd_non_model[i], shape.fwd_flops[i],
                               drops=inputs(i, m) if i < lowest else ()), tuple(updated_at.get(i, ())) * (m == 0), ()))
        out.append((Access("head", head, m, both[head] + inputs(head, m), shape.head_non_model, shape.head_flops,
                           dropped(head) + inputs(head, m)), tuple(updated_at.get(head, ())) * (m == 0), finished(head)))
        for i in reversed(range(head)):
            read = inputs(i, m) if i >= lowest else ()
            out.append((Access("bwd", i, m, both[i] + read, shape.bwd_non_model[i],
                               shape.bwd_flops[i] if i >= lowest else 0.0, dropped(i) + read), (), finished(i)))
    return tuple(out)


def staged_after(accesses: Sequence[Access]) -> dict[int, list[int]]:
    """Moment t -> the streamed updates whose state is sent down right after t is issued (-1: at
    the step's start)."""
    out: dict[int, list[int]] = {}
    for u, a in enumerate(accesses):
        if a.state_bytes_each_way:
            out.setdefault(max(u - a.state_lead, -1), []).append(u)
    return out


def forward_accesses(shape: StepShape, resident: Sequence[Item] = ()) -> list[Access]:
    """The moments of a forward-only pass (held-out loss) over ``shape.micro_batches`` micro-batches,
    then one "restore" moment that needs ``resident``: the items on the device where the training
    plan starts a step, so the pass hands the next step the placement it expects.

    ``shape`` is a forward-only shape (trace.trace_forward): its forward and head figures are
    those of a forward that stashes nothing and a head that computes only the loss. No gradients
    and no optimizer updates exist, so each moment needs only its stage's params, and nothing is
    dropped. The items are ("param", c): chunk c's current params, which between steps (after a
    flush) sit in the chunk's bf16 slot, the store key ("slot", c); nothing here writes them."""
    head = len(shape.stage_chunks) - 1
    slots = [tuple(("param", c) for c in cs) for cs in shape.stage_chunks]
    out: list[Access] = []
    for m in range(shape.micro_batches):
        for i in range(head):
            out.append(Access("fwd", i, m, slots[i], shape.fwd_non_model[i], shape.fwd_flops[i]))
        out.append(Access("loss", head, m, slots[head], shape.head_non_model, shape.head_flops))
    out.append(Access("restore", -1, 0, tuple(sorted(resident)), 0))
    return out
