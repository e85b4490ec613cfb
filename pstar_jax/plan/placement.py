"""The placement plan: where every chunk is at every moment of a step, as plain data.

The planner replays one training step over the warm-up trace: at each moment it knows which
chunks the stage needs, how much device memory the stage's non-model data takes, and how much
the optimizer state kept on the device takes. What the stage needs but is not on the device is
fetched; when the device would overflow, the resident chunk whose next use is furthest away is
evicted (Belady's OPT, as PatrickStar): a clean one costs nothing (its host copy is still
valid), a dirty one (a gradient, or params the device optimizer wrote) is written back. The plan
an engine gets is Belady's unless LRU or FIFO eviction moves fewer bytes under the same placement
(``fewest_bytes``): with items of several sizes, furthest next use first is not always best.

The step's moments and what each needs come from schedule.py (where the deferred optimizer
update and the stage inputs are explained), the replay of a step from replay.py, the eviction
rule from eviction.py, the step time from predict.py, the memory any placement needs at least
from bounds.py, frozen chunks' homes from homes.py, an evaluation's plan from forward.py; the Plan
it makes, as data, is planned.py's.
Chunks may differ in size: a chunk's bytes and state are per chunk.
Between steps each chunk's bf16 slot holds its gradient (an update is pending) or its current
params (none is: after initialisation, a restore or a flush).

A frozen chunk (StepShape.frozen) has only its params, item ("param", c), which never change:
fetching it costs its bytes up, evicting it costs nothing, it has no optimizer state, and it may
stay on the device across the step boundary (its first use in the next step then fetches
nothing). It has one home (``frozen_homes``, chosen after the replay, which charges no memory for
its other copy): a chunk the settled step never moves lives on the device alone, any other in
pinned host memory, its device copy coming and going.

A stage input is an item like a chunk's, of its own size: made dirty on the device by its
forward, read again by its backward, then dropped. When the device is short, the replay may evict
it like any item (Belady: its next use, the backward, is often the furthest), sending it to pinned
host memory, and fetch it back for its backward; it never outlives the step.

A moment's fetches and evictions may run during the previous moment (prefetch distance 1)
when both moments' chunks fit beside the larger of their non-model data; otherwise they run
right before it. Where the copies still leave the step longer than its compute, the chosen plan
is replayed with copies issued up to 2, 4, ... 64 moments ahead (``deepened``), each moment as
far ahead as its fetches fit beside the moments they overlap. The plan starts each step in the
state the step ends in (iterated to a fixed point), so every step moves exactly the predicted
bytes. The executor does what the plan says and nothing else; the planner never touches arrays.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from pstar_jax.config import format_bytes
from pstar_jax.plan.bounds import could_fit, host_needed_bytes
from pstar_jax.plan.eviction import policy_for
from pstar_jax.plan.homes import DISK_SLOTS, disk_reads, frozen_homes, staging_bytes, start_items, with_disk_homes
from pstar_jax.plan.machine import Machine
from pstar_jax.plan.predict import compute_s, predict_step_s, state_leads
from pstar_jax.plan.planned import Plan, shortfall
from pstar_jax.plan.replay import HostShort, Infeasible, ReplayState, moment_name, settle
from pstar_jax.plan.schedule import StepShape, step_accesses


def plan_step(shape: StepShape, device_bytes: int, host_bytes: int, machine: Machine,
              opt_on_device: Sequence[bool], victim_rule: str = "belady",
              streamed: Sequence[bool] | None = None, hide_state: bool = True, stop_short: bool = False,
              leads: Sequence[int] | None = None, streaming: bool = False, disk_bytes: int = 0,
              prefetch_depth: int = 1) -> Plan:
    """The plan for a given optimizer placement (see ``make_plan`` for choosing one).

    ``prefetch_depth``: the most moments ahead a moment's copies may be issued (replay.simulate;
    ``deepened`` chooses it for a plan chosen at 1).

    ``hide_state``: send streamed state down as far ahead as its copy takes (``state_leads``),
    else one moment ahead (less device memory); ``leads`` gives them instead. ``stop_short``:
    stop replaying once the host is known to overflow (replay.settle's ``host_limit``): the plan
    does not fit, short of host memory by at least the bytes seen then (the searches' candidates
    need no more). ``streaming``: no plan, the baseline it beats: each moment's device holds
    only that moment's own items, fetched for it and evicted after it, with no prefetch (every
    chunk streamed at every use, under the same placement and rules; ``device_bytes`` is then
    what that takes). ``disk_bytes``: local disk for frozen chunks the host cannot hold
    (homes.with_disk_homes; used only with a measured ``machine.disk_read_bytes_per_s``)."""
    disk_bytes = disk_bytes if machine.disk_read_bytes_per_s > 0 else 0
    # A frozen chunk has no optimizer state: nothing of it is on the device or streamed.
    opt_on_device = tuple(bool(d) and not shape.is_frozen(c) for c, d in enumerate(opt_on_device))
    streamed = tuple(bool(s) and not d and not shape.is_frozen(c)
                     for c, (s, d) in enumerate(zip(streamed or [False] * shape.n_chunks, opt_on_device)))
    opt_device = sum(b for b, d in zip(shape.opt_state_bytes, opt_on_device) if d)
    busiest = shape.busiest_non_model_bytes
    short = opt_device + shape.busiest_moment_bytes - device_bytes
    if opt_device and short > 0 and not streaming:  # the state kept on the device leaves no room for a chunk:
        # say so, not a host shortfall computed as if the device could hold that state
        return Plan((), (), tuple(opt_on_device), streamed, (1,) * shape.n_chunks, shape.chunk_bytes,
                    shape.opt_state_bytes, device_bytes, 0, 0, opt_device + busiest, 0, float("inf"), False,
                    f"device memory runs out by {shortfall(short)}: the optimizer state of "
                    f"{sum(opt_on_device)} chunks kept there ({format_bytes(opt_device)}) and the busiest "
                    f"moment's working memory ({format_bytes(busiest)}) leave no room for a chunk")
    host_needed = host_needed_bytes(shape, device_bytes, opt_on_device, streamed, disk_bytes)
    if host_needed > host_bytes and not streaming:  # known without building the step, let alone replaying it
        return Plan((), (), tuple(opt_on_device), streamed, (1,) * shape.n_chunks, shape.chunk_bytes,
                    shape.opt_state_bytes, device_bytes, 0, 0, 0, host_needed, float("inf"), False,
                    f"host memory runs out by at least {shortfall(host_needed - host_bytes)}")
    if leads is None:
        leads = (state_leads(step_accesses(shape, opt_on_device, streamed), shape, machine)
                 if hide_state and any(streamed) else [1] * shape.n_chunks)
    leads = tuple(leads)
    accesses = step_accesses(shape, opt_on_device, streamed, leads)
    if streaming:
        capacity = [sum(map(shape.item_size, a.needs)) for a in accesses]
        device_bytes = max(room + a.non_model_bytes + opt_device for room, a in zip(capacity, accesses))
    else:
        capacity = [device_bytes - a.non_model_bytes - opt_device for a in accesses]
    host, stored = start_items(shape)
    state = ReplayState({}, host, stored)  # every slot on the host; frozen params stored (homes come after)
    host_opt = sum(b for b, d in zip(shape.opt_state_bytes, opt_on_device) if not d)  # (a frozen chunk's: 0)
    problem, moments = None, []
    try:
        for a, room in zip(accesses, capacity):  # a moment whose own items do not fit: the replay would stop there
            own = sum(map(shape.item_size, a.needs))
            if own > room:
                raise Infeasible(moment_name(a), own - room)
        # to the fixed point: the step ends where it started
        moments, start, state = settle(accesses, capacity, shape.item_size, state, policy_for(victim_rule, accesses),
                                       host_limit=host_bytes - host_opt if stop_short else None,
                                       prefetch=0 if streaming else prefetch_depth)
    except HostShort as err:
        return Plan((), (), tuple(opt_on_device), streamed, leads, shape.chunk_bytes, shape.opt_state_bytes,
                    device_bytes, 0, 0, 0, err.host_bytes + host_opt, float("inf"), False,
                    f"host memory runs out by at least {shortfall(err.host_bytes + host_opt - host_bytes)}")
    except Infeasible as err:
        problem = (f"device memory runs out at {err} by {shortfall(err.shortfall)}" if err.shortfall
                   else str(err))
        return Plan((), (), tuple(opt_on_device), streamed, leads, shape.chunk_bytes, shape.opt_state_bytes,
                    device_bytes, 0, 0, 0, 0, float("inf"), False, problem)
    peak_device = max(m.chunk_bytes + m.input_bytes + a.non_model_bytes + opt_device
                      for m, a in zip(moments, accesses))
    held = state.peak_host_bytes + host_opt
    homes = with_disk_homes(shape, moments, frozen_homes(shape, moments, start), host_bytes - held, disk_bytes)
    staging = staging_bytes(shape, homes)
    peak_host = held + staging + sum(b for b, h in zip(shape.chunk_bytes, homes) if h == "host")
    if peak_host > host_bytes:
        problem = f"host memory runs out by {shortfall(peak_host - host_bytes)}"
    offloaded = sum(shape.item_size(it) for m in moments for it in m.evict if it[0] == "act")
    read = sum(shape.chunk_bytes[c] for c in disk_reads(moments, homes))
    return Plan(tuple(moments), tuple(sorted(start.device.items())), tuple(opt_on_device), streamed, leads,
                shape.chunk_bytes, shape.opt_state_bytes, device_bytes, sum(m.h2d_bytes for m in moments),
                sum(m.d2h_bytes for m in moments), peak_device, peak_host,
                predict_step_s(moments, accesses, shape, machine, homes, DISK_SLOTS), problem is None, problem,
                shape.input_bytes_per_step, offloaded, "stream" if streaming else victim_rule, homes, read, staging,
                max([1, *(m.issued_at for m in moments)]))


# While the copies leave a step predicted more than 1% longer than its compute, deeper prefetch
# is tried (doubling the depth) and kept where it is predicted at least 1% faster than the best
# so far: a deeper window hides a burst of copies (a run of host-homed blocks) under the compute
# of the moments before it, at the price of holding the fetched bytes longer, which can move
# more (llama-3.1-70b LoRA, 60 blocks keeping their residuals: 887 tokens/s at depth 2, 1,051 at
# 32, 1,040 at 64 and out of host memory beyond). A depth that does not fit ends the search.
MAX_PREFETCH_DEPTH = 64
DEPTH_MARGIN = 0.01


def deepened(plan: Plan, shape: StepShape, host_bytes: int, machine: Machine, disk_bytes: int = 0) -> Plan:
    """``plan`` (one moment ahead at most), or the plan of its very placement, state leads and
    eviction rule with copies issued further ahead where that is predicted faster. The searches
    compare placements at depth 1 (a replay each) and deepen only the plan they choose: a few
    replays more, not a few per candidate."""
    if not plan.fits or plan.victim_rule == "stream":
        return plan
    accesses = step_accesses(shape, plan.opt_on_device, plan.opt_streamed, plan.state_leads)
    compute = sum(compute_s(a, shape, machine) + machine.call_s for a in accesses)
    best, depth = plan, plan.prefetch_depth
    while best.predicted_step_s > compute * (1 + DEPTH_MARGIN) and depth < MAX_PREFETCH_DEPTH:
        depth *= 2
        deeper = plan_step(shape, plan.device_capacity_bytes, host_bytes, machine, plan.opt_on_device,
                           plan.victim_rule, plan.opt_streamed, leads=plan.state_leads, disk_bytes=disk_bytes,
                           prefetch_depth=depth)
        if not deeper.fits:
            break
        if deeper.predicted_step_s < best.predicted_step_s * (1 - DEPTH_MARGIN):
            best = deeper
    return best


def fewest_bytes(plan: Plan, shape: StepShape, host_bytes: int, machine: Machine, disk_bytes: int = 0) -> Plan:
    """``plan``, or the plan of its very placement and state leads under LRU or FIFO eviction where
    that moves fewer bytes (Belady's on ties). Furthest next use first is optimal for items of one
    size that are only read; beside stage inputs of other sizes and write-backs it can lose a
    little to a simpler rule, and a plan is never to move more than one (tests/test_eviction.py).
    Bytes read from disk count as bytes moved."""
    if not plan.fits:
        return plan
    others = [plan_step(shape, plan.device_capacity_bytes, host_bytes, machine, plan.opt_on_device, victim_rule=rule,
                        streamed=plan.opt_streamed, leads=plan.state_leads, disk_bytes=disk_bytes,
                        prefetch_depth=plan.prefetch_depth)
              for rule in ("lru", "fifo")]
    return min([plan, *(p for p in others if p.fits)], key=lambda p: p.h2d_bytes + p.d2h_bytes + p.disk_read_bytes)


TIE_MARGIN = 0.05  # plans predicted within 5% of the fastest count as equally fast


def preference(plan: Plan) -> tuple:
    """How the planner orders plans predicted equally fast (within ``TIE_MARGIN``), most preferred
    last: fewer bytes moved, then more param chunks resident, then more optimizer state on the
    device, then fewer chunks streaming their state. Predictions are estimates, and the copies are
    their least certain part (whether the link copies both ways at once, how well copies overlap
    compute): among near ties the plan that moves less is the safer bet, and a fixed rule keeps
    plans reproducible."""
    return (-(plan.h2d_bytes + plan.d2h_bytes), plan.resident_fraction, sum(plan.opt_on_device),
            -sum(plan.opt_streamed))


def choose(plans: Sequence[Plan]) -> Plan:
    """The plan make_plan returns among ``plans``: a fitting one over any that does not; among those
    that fit, the most preferred (``preference``) of those predicted within ``TIE_MARGIN`` of the
    fastest; earlier in ``plans`` on full ties. When none fits: the one short of the least host
    memory (its device side worked), else the one keeping the least optimizer state on the device
    (the least the device was asked to hold); its problem is the one to report."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        host_short = [p for p in plans if p.problem.startswith("host")]
        if host_short:
            return min(host_short, key=lambda p: p.peak_host_bytes)
        return min(plans, key=lambda p: sum(p.opt_on_device))  # min keeps the first of equal keys
    fastest = min(p.predicted_step_s for p in fitting)
    near = [p for p in fitting if p.predicted_step_s <= fastest * (1 + TIE_MARGIN)]
    return max(near, key=preference)  # max keeps the first of equal keys


def make_plan(shape: StepShape, device_bytes: int, host_bytes: int, machine: Machine,
              adam_placement: str = "auto", first_fit: bool = False, mixes: bool = True,
              pure_fails: bool = False, disk_bytes: int = 0) -> Plan:
    """Choose the optimizer placement by the predicted step time of the resulting plan.

    Chunks 0..k-1 keep their state on the device (PatrickStar's margin), chunks k..b-1 stream it
    through the device for their update, chunks b..n-1 are updated on the host. Chunks are
    numbered in forward order, so the host updates are those the next forward needs last: they
    have the most time to run beside it (host updates start when the backward ends).
    ``adam_placement`` "device", "host" or "stream" forces one way for all chunks. Streamed state
    is sent down far enough ahead to hide its copy, or, when device memory is short for that, one
    moment ahead.

    The search: k on a grid of about 12 steps over 0..n with the rest all on the host or all
    streamed (PatrickStar's choice), refined around the chosen k (finer grids, a quarter of the
    spacing each time); then b along the line of that k, and k along the line of the b found, the
    same way, until the choice stays (three rounds at most). A mix can fit where neither pure
    way does (host-updated chunks need host memory for their params, streamed ones device memory
    for their state). A deep model costs a few dozen to a few hundred plans, not n squared. Near
    ties are broken by ``choose``. ``first_fit``: return the first plan that fits, the mixes tried
    in one round of coarse grids (for searches that only ask whether anything fits, as
    pstar-plan's largest depth and batch: the same candidates in the same order until then, so
    the same answer); ``mixes`` False: try only the rest all on the host or all streamed. k and b
    count trainable chunks (frozen ones have no optimizer state to place). Candidates stop
    replaying once the host overflows (plan_step's ``stop_short``: most of a search near the
    memories' limit is spent on candidates that do not fit); a plan returned that does not fit is
    replayed in full, so its problem says by how much.

    While no candidate fits, the search centres its next grids on the unfit candidate nearest to
    fitting by what is known without replaying it (``unfit_rank``: the device's room for its
    optimizer state, then its host bound), so its path does not hang on replays that fail: with
    ``pure_fails`` (first_fit and mixes only: the caller knows no candidate of the rest all on
    the host or all streamed fits, as a search past the answer without mixes) those candidates
    are not planned at all, and the mixes tried are the ones the full search would try.
    ``disk_bytes``: local disk for frozen chunks the host cannot hold (plan_step's)."""
    order = [c for c in range(shape.n_chunks) if not shape.is_frozen(c)]
    rank = {c: r for r, c in enumerate(order)}
    n = len(order)

    def ranked(low: int, high: int) -> list[bool]:  # per chunk: a trainable one ranked in [low, high)
        return [c in rank and low <= rank[c] < high for c in range(shape.n_chunks)]

    def planned(opt_on_device: Sequence[bool], streamed: Sequence[bool], stop_short: bool = True) -> Plan:
        plan = plan_step(shape, device_bytes, host_bytes, machine, opt_on_device, streamed=streamed,
                         stop_short=stop_short, disk_bytes=disk_bytes)
        if plan.fits or not any(plan.opt_streamed) or not plan.problem.startswith("device"):
            return plan  # the retry below saves device memory
        return plan_step(shape, device_bytes, host_bytes, machine, opt_on_device, streamed=streamed, hide_state=False,
                         stop_short=stop_short, disk_bytes=disk_bytes)

    def answer(plan: Plan) -> Plan:  # a candidate that does not fit, replayed in full for its exact shortfall
        return plan if plan.fits else planned(plan.opt_on_device, plan.opt_streamed, stop_short=False)

    everything = ranked(0, n)
    if adam_placement != "auto":
        return deepened(fewest_bytes(planned(everything if adam_placement == "device" else ranked(0, 0),
                                             everything if adam_placement == "stream" else ranked(0, 0),
                                             stop_short=False), shape, host_bytes, machine, disk_bytes),
                        shape, host_bytes, machine, disk_bytes)
    if first_fit and not could_fit(shape, device_bytes, host_bytes, disk_bytes):
        return planned(ranked(0, 0), ranked(0, 0), stop_short=False)  # one candidate, to say what runs out
    scores: dict[tuple[int, int], Plan | None] = {}  # (k, b) -> plan (None: known not to fit, not planned)
    state_below = [0, *itertools.accumulate(shape.opt_state_bytes[c] for c in order)]  # of ranks below k
    moment_bytes = shape.busiest_moment_bytes

    def unfit_rank(key: tuple[int, int]) -> tuple[int, int]:
        k, b = key
        device_short = max(0, state_below[k] + moment_bytes - device_bytes)
        return device_short, host_needed_bytes(shape, device_bytes, ranked(0, k), ranked(k, b), disk_bytes)

    class _Fits(Exception):
        pass

    def consider(k: int, b: int) -> None:
        if (k, b) not in scores:
            if pure_fails and b in (k, n):
                scores[k, b] = None
            else:
                scores[k, b] = planned(ranked(0, k), ranked(k, b))
            if first_fit and scores[k, b] is not None and scores[k, b].fits:
                raise _Fits

    def chosen(among: Callable[[tuple[int, int]], bool] = lambda key: True) -> tuple[int, int]:
        keys = [key for key in scores if among(key)]
        fitting = [key for key in keys if scores[key] is not None and scores[key].fits]
        if not fitting:
            return min(keys, key=unfit_rank)  # min keeps the first of equal keys
        best = choose([scores[key] for key in fitting])
        return next(key for key in fitting if scores[key] is best)

    def line(point: Callable[[int], tuple[int, int]], lo: int, hi: int, refine: bool = True) -> None:
        """Plans at point(x) for x on a grid over lo..hi, then finer grids around the best of them."""
        on_line = {point(x): x for x in range(lo, hi + 1)}
        spacing = max(1, (hi - lo) // 12)
        for x in sorted({lo, hi, *range(lo, hi, spacing)}, reverse=True):
            consider(*point(x))
        while refine and spacing > 1:
            x0, finer = on_line[chosen(lambda key: key in on_line)], max(1, spacing // 4)
            for x in range(max(lo, x0 - spacing + finer), min(hi, x0 + spacing) + 1, finer):
                consider(*point(x))
            spacing = finer

    try:
        spacing = max(1, n // 12)
        for k in sorted({n, 0, *range(0, n, spacing)}, reverse=True):
            consider(k, k)  # the rest on the host
            consider(k, n)  # the rest streamed
        k0, b0 = chosen()
        line((lambda k: (k, k)) if b0 == k0 < n else (lambda k: (k, n)), 0, n)
        for _ in range(0 if not mixes else 1 if first_fit else 3):  # mixes (for a fit alone: one round, coarse)
            before = k0, _ = chosen()
            line(lambda b: (k0, b), k0, n, refine=not first_fit)
            _, b0 = chosen()
            line(lambda k: (k, b0), 0, b0, refine=not first_fit)
            if chosen() == before:
                break
    except _Fits:
        return next(plan for plan in scores.values() if plan is not None and plan.fits)
    made = [plan for plan in scores.values() if plan is not None]
    if first_fit:  # nothing fits: the caller asks no more
        return choose(made) if made else planned(ranked(0, 0), ranked(0, 0))
    return deepened(fewest_bytes(answer(choose(made)), shape, host_bytes, machine, disk_bytes), shape, host_bytes,
                    machine, disk_bytes)
