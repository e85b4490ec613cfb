"""The placement plan: where every chunk is at every moment of a step, as plain data.

The planner replays one training step over the warm-up trace: at each moment it knows which
chunks the stage needs, how much device memory the stage's non-model data takes, and how much
the optimizer state kept on the device takes. What the stage needs but is not on the device is
fetched; when the device would overflow, the resident chunk whose next use is furthest away is
evicted (Belady's OPT, as PatrickStar): a clean one costs nothing (its host copy is still
valid), a dirty one (a gradient, or params the device optimizer wrote) is written back.

A step's optimizer update is deferred into the next step's forward: the update of chunk c runs
right before the first forward stage that reads c. The update needs the global gradient norm,
known only when the backward ends, so updating during the backward would change the math;
updating during the next forward does not, and it gives the optimizer's copies (streamed state,
grads going to host Adam) the forward's compute to hide under instead of a phase of their own.
Between steps each chunk's bf16 slot holds its gradient (an update is pending) or its current
params (none is: after initialisation, a restore or a flush).

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
    state_lead: int = 0  # the state is sent down right after this many earlier moments are issued


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
    state_leads: tuple[int, ...]  # per chunk: moments ahead its streamed state is sent down
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
        for item in a.to_host:  # host Adam: the grad goes down unless a host copy is valid, then is used up
            if state.device.pop(item, False):
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
    for it in a.needs:  # grads are created at their first use and written at every use
        if it[0] == "grad":
            state.device[it] = True
            state.host.discard(it)
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
                  streamed: Sequence[bool] | None = None, leads: Sequence[int] | None = None) -> list[Access]:
    """The moments of one step in the executor's order, with what each needs.

    The previous step's update of chunk c (its "adam" moment) comes right before the first
    forward stage of the first micro-batch that reads c. It is one of three: state resident on
    the device; state on the host, updated there (compute_on host: the grad goes down to it); or
    state on the host, streamed to the device, updated there and streamed back (the grad stays,
    the new params stay on the device). Streamed state is sent down ``leads[c]`` moments ahead
    (default 1), so its copy hides under their compute, and goes back up during the next moment:
    its device copy is non-model memory of all those moments."""
    streamed = streamed or [False] * shape.n_chunks
    leads = leads or [1] * shape.n_chunks
    head = len(shape.stage_chunks) - 1
    first_use = {c: min(i for i, cs in enumerate(shape.stage_chunks) if c in cs) for c in range(shape.n_chunks)}
    last_bwd = first_use  # the backward visits stages in reverse
    out: list[Access] = []

    def params(i):
        return tuple(("param", c) for c in shape.stage_chunks[i])

    def grads(i):
        return tuple(("grad", c) for c in shape.stage_chunks[i])

    def drops(i, last):
        return tuple(("param", c) for c in shape.stage_chunks[i] if last and last_bwd[c] == i)

    def updates(i):
        for c in sorted(c for c in range(shape.n_chunks) if first_use[c] == i):
            g, p = ("grad", c), ("param", c)
            if opt_on_device[c]:
                yield Access("adam", c, 0, (g,), 0, consumes=(g,), creates_device=(p,))
            elif streamed[c]:
                yield Access("adam", c, 0, (g,), shape.opt_state_bytes, consumes=(g,), creates_device=(p,),
                             state_bytes_each_way=shape.opt_state_bytes, state_lead=leads[c])
            else:
                yield Access("adam", c, 0, (), 0, to_host=(g,), consumes=(g,), creates_host=(p,))

    for m in range(shape.micro_batches):
        last = m == shape.micro_batches - 1
        for i in range(head):
            if m == 0:
                out.extend(updates(i))
            out.append(Access("fwd", i, m, params(i), shape.fwd_non_model[i], shape.fwd_flops[i]))
        if m == 0:
            out.extend(updates(head))
        out.append(Access("head", head, m, params(head) + grads(head), shape.head_non_model,
                          shape.head_flops, drops(head, last)))
        for i in reversed(range(head)):
            out.append(Access("bwd", i, m, params(i) + grads(i), shape.bwd_non_model[i],
                              shape.bwd_flops[i], drops(i, last)))
    extra = [0] * len(out)  # streamed state on the device beside other moments' own data
    for u, a in enumerate(out):
        for t in range(max(0, u - a.state_lead), min(u + 2, len(out))):
            if t != u:
                extra[t] += a.state_bytes_each_way
    return [dataclasses.replace(a, non_model_bytes=a.non_model_bytes + x) if x else a for a, x in zip(out, extra)]


def plan_step(shape: StepShape, device_bytes: int, host_bytes: int, machine: Machine,
              opt_on_device: Sequence[bool], victim_rule: str = "belady",
              streamed: Sequence[bool] | None = None, hide_state: bool = True) -> Plan:
    """The plan for a given optimizer placement (see ``make_plan`` for choosing one).

    ``hide_state``: send streamed state down as far ahead as its copy takes (``state_leads``),
    else one moment ahead (less device memory)."""
    streamed = tuple(bool(s) and not d for s, d in zip(streamed or [False] * shape.n_chunks, opt_on_device))
    leads = tuple(state_leads(step_accesses(shape, opt_on_device, streamed), shape, machine) if hide_state
                  else [1] * shape.n_chunks)
    accesses = step_accesses(shape, opt_on_device, streamed, leads)
    opt_device = sum(opt_on_device) * shape.opt_state_bytes
    capacity = [device_bytes - a.non_model_bytes - opt_device for a in accesses]
    victim = victim_for(victim_rule, accesses)
    state = _State({}, {("grad", c) for c in range(shape.n_chunks)})  # every slot on the host
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
        return Plan((), (), tuple(opt_on_device), streamed, leads, shape.item_bytes, shape.opt_state_bytes,
                    device_bytes, 0, 0, 0, 0, float("inf"), False, problem)
    peak_device = max(m.chunk_bytes + a.non_model_bytes + opt_device for m, a in zip(moments, accesses))
    host_opt = (len(opt_on_device) - sum(opt_on_device)) * shape.opt_state_bytes
    peak_host = state.peak_host_items * shape.item_bytes + host_opt
    if peak_host > host_bytes:
        problem = f"host memory runs out by {format_bytes(peak_host - host_bytes)}"
    return Plan(tuple(moments), tuple(sorted(start.device.items())), tuple(opt_on_device), streamed, leads,
                shape.item_bytes, shape.opt_state_bytes, device_bytes, sum(m.h2d_bytes for m in moments),
                sum(m.d2h_bytes for m in moments), peak_device, peak_host,
                predict_step_s(moments, accesses, shape, machine), problem is None, problem)


def compute_s(a: Access, shape: StepShape, machine: Machine) -> float:
    """A moment's predicted compute time (an update runs on the device when its grad stays there)."""
    if a.phase == "adam":
        return shape.chunk_numel / (machine.device_adam_params_per_s if a.needs else machine.host_adam_params_per_s)
    return a.flops / machine.flops_per_s


def state_leads(accesses: Sequence[Access], shape: StepShape, machine: Machine) -> list[int]:
    """Per chunk: how many moments ahead its streamed state must be sent down for the copy to hide
    under their compute (at least 1; the step's start at most)."""
    leads = [1] * shape.n_chunks
    copy_s = shape.opt_state_bytes / machine.h2d_bytes_per_s
    for u, a in enumerate(accesses):
        if a.state_bytes_each_way:
            covered, lead = 0.0, 0
            while lead < u and (lead == 0 or covered < copy_s):
                lead += 1
                covered += compute_s(accesses[u - lead], shape, machine)
            leads[a.index] = max(lead, 1)
    return leads


def staged_after(accesses: Sequence[Access]) -> dict[int, list[int]]:
    """Moment t -> the streamed updates whose state is sent down right after t is issued (-1: at
    the step's start)."""
    out: dict[int, list[int]] = {}
    for u, a in enumerate(accesses):
        if a.state_bytes_each_way:
            out.setdefault(max(u - a.state_lead, -1), []).append(u)
    return out


def predict_step_s(moments: Sequence[PlanMoment], accesses: Sequence[Access], shape: StepShape,
                   machine: Machine) -> float:
    """Replay the step on the device's compute stream and its copy engines, in the executor's order.

    Each moment computes after the previous one and after its own inputs have arrived. Copies
    are issued when the executor issues them: a moment's evictions and fetches during the
    previous moment when the plan prefetches it, else after it (evictions and grads bound for
    host Adam go up first, then fetches come down into the room they freed); streamed state
    ``state_lead`` moments ahead, and back up after its update. A copy waits for the copy engine
    of its direction; with ``machine.duplex`` False both directions share one, so a step never
    looks faster than one serial PCIe link allows."""
    free = {"up": 0.0, "down": 0.0}  # when each copy engine is next free

    def copy(direction: str, after: float, seconds: float) -> float:
        start = max(after, free[direction] if machine.duplex else max(free.values()))
        for d in ((direction,) if machine.duplex else tuple(free)):
            free[d] = start + seconds
        return start + seconds

    def own_copies(t: int, at: float) -> float:
        m, a = moments[t], accesses[t]
        up = m.d2h_bytes - a.state_bytes_each_way
        if up:
            at = copy("up", at, up / machine.d2h_bytes_per_s)
        fetch = m.h2d_bytes - a.state_bytes_each_way
        return copy("down", at, fetch / machine.h2d_bytes_per_s) if fetch else at

    staging = staged_after(accesses)
    state_ready: dict[int, float] = {}

    def stage(t: int, at: float) -> None:
        for u in staging.get(t, ()):
            state_ready[u] = copy("down", at, accesses[u].state_bytes_each_way / machine.h2d_bytes_per_s)

    stage(-1, 0.0)
    compute_start = compute_end = 0.0
    ready = 0.0  # when the current moment's own copies are done
    for t, (m, a) in enumerate(zip(moments, accesses)):
        compute = compute_s(a, shape, machine)
        if not m.prefetch:
            ready = own_copies(t, compute_end)
        compute_start = max(compute_end, ready, state_ready.get(t, 0.0))
        compute_end = compute_start + compute + machine.call_s
        if a.state_bytes_each_way:
            copy("up", compute_end, a.state_bytes_each_way / machine.d2h_bytes_per_s)
        if t + 1 < len(moments) and moments[t + 1].prefetch:
            ready = own_copies(t + 1, compute_start)
        stage(t, compute_start)
    return max(compute_end, *free.values())


def make_plan(shape: StepShape, device_bytes: int, host_bytes: int, machine: Machine,
              adam_placement: str = "auto") -> Plan:
    """Choose the optimizer placement by the predicted step time of the resulting plan.

    How many chunks keep their state on the device (PatrickStar's margin), and whether the
    others update on the host or stream their state through the device. ``adam_placement``
    "device", "host" or "stream" forces one way for all chunks. Streamed state is sent down far
    enough ahead to hide its copy, or, when no such plan fits, one moment ahead."""
    n = shape.n_chunks

    def planned(opt_on_device: Sequence[bool], stream: bool) -> Plan:
        plan = plan_step(shape, device_bytes, host_bytes, machine, opt_on_device, streamed=[stream] * n)
        if plan.fits or not stream:
            return plan
        return plan_step(shape, device_bytes, host_bytes, machine, opt_on_device, streamed=[stream] * n,
                         hide_state=False)

    if adam_placement != "auto":
        return planned([adam_placement == "device"] * n, adam_placement == "stream")
    step = max(1, n // 12)
    best, best_key, scores = None, None, {}

    def consider(k: int, stream: bool) -> None:
        nonlocal best, best_key
        if (k, stream) in scores:
            return
        plan = planned([c < k for c in range(n)], stream)
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
