"""The placement plan: where every chunk is at every moment of a step, as plain data.

The planner replays one training step over the warm-up trace: at each moment it knows which
chunks the stage needs, how much device memory the stage's non-model data takes, and how much
the optimizer state kept on the device takes. What the stage needs but is not on the device is
fetched; when the device would overflow, the resident chunk whose next use is furthest away is
evicted (Belady's OPT, as PatrickStar): a clean one costs nothing (its host copy is still
valid), a dirty one (a gradient, or params the device optimizer wrote) is written back.

A moment's fetches and evictions may run during the previous moment (prefetch distance 1)
when both moments' chunks fit beside the larger of their non-model data; otherwise they run
right before it. The plan starts each step in the state the step ends in (iterated to a fixed
point), so every step moves exactly the predicted bytes. The executor does what the plan says
and nothing else; the planner never touches arrays.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from typing import Callable, Sequence

from pstar_jax.config import format_bytes
from pstar_jax.machine import Machine

Item = tuple[str, int]  # ("param" | "grad", chunk id)


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
    to_host: tuple[Item, ...] = ()  # must be on the host for the moment (grads for host Adam)
    consumes: tuple[Item, ...] = ()  # used up by the moment (grads by Adam)
    creates_host: tuple[Item, ...] = ()  # made on the host by the moment (params from host Adam)
    creates_device: tuple[Item, ...] = ()  # made on the device, dirty (params from device Adam)
    state_bytes_each_way: int = 0  # optimizer state streamed down and back up (streamed Adam)


@dataclasses.dataclass(frozen=True)
class PlanMoment:
    phase: str
    index: int
    micro: int
    evict: tuple[Item, ...]
    fetch: tuple[Item, ...]
    prefetch: bool  # evict/fetch run during the previous moment
    capacity_bytes: int  # device memory for chunks during the moment (beside non-model data)
    chunk_bytes: int  # chunk bytes on the device during the moment, optimizer state included
    h2d_bytes: int
    d2h_bytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    moments: tuple[PlanMoment, ...]
    initial_device: tuple[tuple[Item, bool], ...]  # (item, dirty) on the device at step start
    opt_on_device: tuple[bool, ...]
    opt_streamed: tuple[bool, ...]  # host-resident state updated on the device (streamed down and up)
    item_bytes: int
    opt_state_bytes: int  # per chunk
    device_capacity_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    peak_device_bytes: int  # chunks + non-model
    peak_host_bytes: int
    predicted_step_s: float
    fits: bool
    problem: str | None

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @property
    def resident_fraction(self) -> float:
        """Fraction of param chunks that never leave the device."""
        n = len(self.opt_on_device)
        moved = {item for m in self.moments for item in m.evict + m.fetch if item[0] == "param"}
        return sum(("param", c) not in moved for c in range(n)) / max(n, 1)


class Infeasible(Exception):
    def __init__(self, message: str, shortfall: int):
        super().__init__(message)
        self.shortfall = shortfall


class _State:
    def __init__(self, device: dict[Item, bool], host: set[Item]):
        self.device = dict(device)  # item -> dirty (no valid host copy)
        self.host = set(host)  # items with a valid host copy
        self.peak_host_items = len(self.host)

    def key(self) -> tuple:
        return tuple(sorted(self.device.items())), tuple(sorted(self.host))


def _next_uses(accesses: Sequence[Access]) -> dict[Item, list[int]]:
    uses: dict[Item, list[int]] = {}
    for t, a in enumerate(accesses):
        for item in a.needs:
            uses.setdefault(item, []).append(t)
    return uses


def _next_use(uses: dict[Item, list[int]], item: Item, t: int, period: int) -> int:
    times = uses.get(item, [])
    i = bisect.bisect_right(times, t)
    if i < len(times):
        return times[i]
    return period + times[0] if times else 2 * period  # next step, or never


Victim = Callable[[list[Item], int, _State], Item]


def belady(uses: dict[Item, list[int]], period: int) -> Victim:
    """Furthest next use first; among equals a clean chunk (free to drop), then the higher id."""
    def victim(candidates: list[Item], t: int, state: _State) -> Item:
        return max(candidates, key=lambda it: (_next_use(uses, it, t, period), not state.device[it], it[1]))
    return victim


def victim_for(rule: str, accesses: Sequence[Access]) -> Victim:
    if rule == "belady":
        return belady(_next_uses(accesses), len(accesses))
    return {"lru": lambda: _lru(accesses), "fifo": _fifo}[rule]()


def simulate(accesses: Sequence[Access], capacity: Sequence[int], item_bytes: int, state: _State,
             victim: Victim, prefetch: bool = True) -> tuple[list[PlanMoment], _State]:
    """Replay one step from ``state``; returns the moments' actions and the end state.

    ``capacity[t]`` is the device memory for chunk items at moment t. Raises Infeasible when a
    moment's own items do not fit."""
    moments: list[PlanMoment] = []
    state.peak_host_items = len(state.host)
    for t, a in enumerate(accesses):
        fetched, evicted, early = None, None, False
        if prefetch and t > 0:
            prev = accesses[t - 1]
            try:
                evicted, fetched = _actions(a, set(a.needs) | set(prev.needs),
                                            min(capacity[t], capacity[t - 1]), item_bytes, t, state, victim,
                                            extra=set(prev.drops))
                early = True
            except Infeasible:
                pass
        if not early:
            evicted, fetched = _actions(a, set(a.needs), capacity[t], item_bytes, t, state, victim)
        h2d, d2h = _apply(a, evicted, fetched, state, item_bytes)
        h2d, d2h = h2d + a.state_bytes_each_way, d2h + a.state_bytes_each_way
        moments.append(PlanMoment(a.phase, a.index, a.micro, tuple(evicted), tuple(fetched), early,
                                  capacity[t], len(state.device) * item_bytes, h2d, d2h))
        for item in a.to_host:  # host Adam: the grad goes down (it is dirty), then is used up
            if item in state.device:
                del state.device[item]
                d2h += item_bytes
                moments[-1] = dataclasses.replace(moments[-1], d2h_bytes=d2h)
        for item in a.consumes + a.drops:
            state.device.pop(item, None)
            state.host.discard(item)
        for item in a.creates_host:
            state.host.add(item)
        for item in a.creates_device:
            state.device[item] = True
            state.host.discard(item)
        state.peak_host_items = max(state.peak_host_items, len(state.host))
    return moments, state


def _actions(a: Access, protect: set[Item], capacity: int, item_bytes: int, t: int, state: _State,
             victim: Victim, extra: set[Item] = frozenset()) -> tuple[list[Item], list[Item]]:
    """Evictions and fetches that put ``a.needs`` on the device within ``capacity``.

    Items created at this moment (grads at first use) count as needed but are not fetched.
    ``extra`` are items still occupying memory (dropped after the previous moment runs)."""
    missing = [it for it in a.needs if it not in state.device]
    resident = dict(state.device)
    need_bytes = (len(resident) + len(missing) + len([e for e in extra if e not in resident])) * item_bytes
    evicted = []
    while need_bytes > capacity:
        candidates = [it for it in resident if it not in protect and it not in extra]
        if not candidates:
            where = f"the optimizer update of chunk {a.index}" if a.phase == "adam" else f"the {a.phase} of stage {a.index}"
            raise Infeasible(where, need_bytes - capacity)
        out = victim(candidates, t, _State(resident, state.host))
        del resident[out]
        evicted.append(out)
        need_bytes -= item_bytes
    return evicted, [it for it in missing if it in state.host]


def _apply(a: Access, evicted: list[Item], fetched: list[Item], state: _State, item_bytes: int
           ) -> tuple[int, int]:
    d2h = 0
    for it in evicted:
        if state.device.pop(it):
            d2h += item_bytes
            state.host.add(it)
    for it in fetched:
        state.device[it] = False
    for it in a.needs:  # created here: a grad at its first use
        if it not in state.device:
            state.device[it] = True
    return len(fetched) * item_bytes, d2h


# -- from a trace to a plan ---------------------------------------------------------------------


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
    n_chunks: int
    chunk_numel: int  # per device
    item_bytes: int  # one bf16 param (or grad) chunk, per device
    opt_state_bytes: int  # one chunk's fp32 master + optimizer state, per device
    micro_batches: int = 1


def scale_batch(shape: StepShape, factor: float) -> StepShape:
    """The step at ``factor`` times the traced batch: activation memory and FLOPs scale linearly.

    An estimate (temporaries that do not grow with the batch are scaled too, so it errs on the
    safe side for larger batches); pstar-plan uses it to search the largest batch quickly."""
    def s(values):
        return tuple(int(v * factor) for v in values)

    def f(values):
        return tuple(v * factor for v in values)
    return dataclasses.replace(shape, fwd_non_model=s(shape.fwd_non_model), head_non_model=int(shape.head_non_model * factor),
                               bwd_non_model=s(shape.bwd_non_model), fwd_flops=f(shape.fwd_flops),
                               head_flops=shape.head_flops * factor, bwd_flops=f(shape.bwd_flops))


def step_accesses(shape: StepShape, opt_on_device: Sequence[bool],
                  streamed: Sequence[bool] | None = None) -> list[Access]:
    """The moments of one step in the executor's order, with what each needs.

    Each chunk's optimizer update is one of three: state resident on the device; state on the
    host, updated there (compute_on host: the grad goes down to it); or state on the host,
    streamed to the device, updated there and streamed back (the grad stays, the new params
    stay on the device, and the state's device copy is non-model memory of that moment)."""
    streamed = streamed or [False] * shape.n_chunks
    head = len(shape.stage_chunks) - 1
    last_bwd = {c: min(i for i, cs in enumerate(shape.stage_chunks) if c in cs) for c in range(shape.n_chunks)}
    out: list[Access] = []

    def params(i):
        return tuple(("param", c) for c in shape.stage_chunks[i])

    def grads(i):
        return tuple(("grad", c) for c in shape.stage_chunks[i])

    def drops(i, last):
        return tuple(("param", c) for c in shape.stage_chunks[i] if last and last_bwd[c] == i)

    for m in range(shape.micro_batches):
        last = m == shape.micro_batches - 1
        for i in range(head):
            out.append(Access("fwd", i, m, params(i), shape.fwd_non_model[i], shape.fwd_flops[i]))
        out.append(Access("head", head, m, params(head) + grads(head), shape.head_non_model,
                          shape.head_flops, drops(head, last)))
        for i in reversed(range(head)):
            out.append(Access("bwd", i, m, params(i) + grads(i), shape.bwd_non_model[i],
                              shape.bwd_flops[i], drops(i, last)))
    for c in range(shape.n_chunks):
        g, p = ("grad", c), ("param", c)
        if opt_on_device[c]:
            out.append(Access("adam", c, shape.micro_batches - 1, (g,), 0, consumes=(g,), creates_device=(p,)))
        elif streamed[c]:
            out.append(Access("adam", c, shape.micro_batches - 1, (g,), shape.opt_state_bytes, consumes=(g,),
                              creates_device=(p,), state_bytes_each_way=shape.opt_state_bytes))
        else:
            out.append(Access("adam", c, shape.micro_batches - 1, (), 0, to_host=(g,), consumes=(g,),
                              creates_host=(p,)))
    return out


def plan_step(shape: StepShape, device_bytes: int, host_bytes: int, machine: Machine,
              opt_on_device: Sequence[bool], victim_rule: str = "belady",
              streamed: Sequence[bool] | None = None) -> Plan:
    """The plan for a given optimizer placement (see ``make_plan`` for choosing one)."""
    streamed = tuple(bool(s) and not d for s, d in zip(streamed or [False] * shape.n_chunks, opt_on_device))
    accesses = step_accesses(shape, opt_on_device, streamed)
    opt_device = sum(opt_on_device) * shape.opt_state_bytes
    capacity = [device_bytes - a.non_model_bytes - opt_device for a in accesses]
    victim = victim_for(victim_rule, accesses)
    state = _State({}, {("param", c) for c in range(shape.n_chunks)})
    problem, moments = None, []
    try:
        for _ in range(8):  # to the fixed point: the step ends where it started
            start = _State(state.device, state.host)
            moments, state = simulate(accesses, capacity, shape.item_bytes, state, victim)
            if state.key() == start.key():
                break
        else:
            raise Infeasible("the placement does not settle into a repeating step", 0)
    except Infeasible as err:
        problem = (f"device memory runs out at {err} by {format_bytes(err.shortfall)}" if err.shortfall
                   else str(err))
        return Plan((), (), tuple(opt_on_device), streamed, shape.item_bytes, shape.opt_state_bytes, device_bytes,
                    0, 0, 0, 0, float("inf"), False, problem)
    peak_device = max(m.chunk_bytes + a.non_model_bytes + opt_device for m, a in zip(moments, accesses))
    host_opt = (len(opt_on_device) - sum(opt_on_device)) * shape.opt_state_bytes
    peak_host = state.peak_host_items * shape.item_bytes + host_opt
    if peak_host > host_bytes:
        problem = f"host memory runs out by {format_bytes(peak_host - host_bytes)}"
    return Plan(tuple(moments), tuple(sorted(start.device.items())), tuple(opt_on_device), streamed, shape.item_bytes,
                shape.opt_state_bytes, device_bytes, sum(m.h2d_bytes for m in moments),
                sum(m.d2h_bytes for m in moments), peak_device, peak_host,
                predict_step_s(moments, accesses, shape, machine), problem is None, problem)


def predict_step_s(moments: Sequence[PlanMoment], accesses: Sequence[Access], shape: StepShape,
                   machine: Machine) -> float:
    """Compute and transfers per moment, plus a fixed cost per call; a prefetched moment's copies
    hide under the previous moment's compute."""
    def transfer(m: PlanMoment) -> float:
        return m.h2d_bytes / machine.h2d_bytes_per_s + m.d2h_bytes / machine.d2h_bytes_per_s

    total = 0.0
    for t, (m, a) in enumerate(zip(moments, accesses)):
        if a.phase == "adam":  # on the device when the grad stays there (resident or streamed state)
            rate = machine.device_adam_params_per_s if a.needs else machine.host_adam_params_per_s
            compute = shape.chunk_numel / rate
        else:
            compute = a.flops / machine.flops_per_s
        ahead = transfer(moments[t + 1]) if t + 1 < len(moments) and moments[t + 1].prefetch else 0.0
        total += max(compute, ahead) + (0.0 if m.prefetch else transfer(m)) + machine.call_s
    return total


def make_plan(shape: StepShape, device_bytes: int, host_bytes: int, machine: Machine,
              adam_placement: str = "auto") -> Plan:
    """Choose the optimizer placement by the predicted step time of the resulting plan.

    How many chunks keep their state on the device (PatrickStar's margin), and whether the
    others update on the host or stream their state through the device. ``adam_placement``
    "device", "host" or "stream" forces one way for all chunks."""
    n = shape.n_chunks
    if adam_placement != "auto":
        return plan_step(shape, device_bytes, host_bytes, machine, [adam_placement == "device"] * n,
                         streamed=[adam_placement == "stream"] * n)
    step = max(1, n // 12)
    best, best_key, scores = None, None, {}

    def consider(k: int, stream: bool) -> None:
        nonlocal best, best_key
        if (k, stream) in scores:
            return
        plan = plan_step(shape, device_bytes, host_bytes, machine, [c < k for c in range(n)],
                         streamed=[stream] * n)
        scores[k, stream] = plan
        if best is None or (plan.fits, -plan.predicted_step_s) > (best.fits, -best.predicted_step_s):
            best, best_key = plan, (k, stream)

    for k in sorted({n, 0, *range(0, n, step)}, reverse=True):
        for stream in (False, True):
            consider(k, stream)
    k0, stream0 = best_key
    for k in range(max(0, k0 - step + 1), min(n, k0 + step) + 1):  # refine around the best
        consider(k, stream0)
    return best


def _lru(accesses: Sequence[Access]) -> Victim:
    """Least recently used (for comparison)."""
    uses = _next_uses(accesses)

    def victim(candidates: list[Item], t: int, state: _State) -> Item:
        def last_use(it):
            times = uses.get(it, [])
            i = bisect.bisect_right(times, t)
            return times[i - 1] if i else -1
        return min(candidates, key=lambda it: (last_use(it), it[1]))
    return victim


def _fifo() -> Victim:
    """First in, first out: the chunk that came to the device earliest (for comparison)."""
    def victim(candidates: list[Item], t: int, state: _State) -> Item:
        return next(it for it in state.device if it in candidates)
    return victim


VICTIM_RULES = ("belady", "lru", "fifo")
