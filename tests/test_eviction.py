"""Eviction: Belady never moves more than LRU or FIFO, and equals the brute-force optimum."""

import dataclasses as dc
import itertools

from hypothesis import given, settings, strategies as st

from pstar_jax.plan.eviction import policy_for, victim
from pstar_jax.plan.replay import ReplayState, simulate
from pstar_jax.plan.schedule import Access


def read_trace(draw_needs):
    return [Access("fwd", t, 0, tuple(("param", c) for c in needs), 0) for t, needs in enumerate(draw_needs)]


@st.composite
def traces(draw, max_items=6, max_len=10):
    n_items = draw(st.integers(2, max_items))
    width = draw(st.integers(1, 2))
    needs = draw(st.lists(st.lists(st.integers(0, n_items - 1), min_size=1, max_size=width, unique=True),
                          min_size=1, max_size=max_len))
    capacity = draw(st.integers(width, n_items))
    return read_trace(needs), n_items, capacity


def fetched_bytes(accesses, n_items, capacity, rule):
    state = ReplayState({}, {("param", c) for c in range(n_items)})
    moments, _ = simulate(accesses, [capacity] * len(accesses), lambda item: 1, state, policy_for(rule, accesses),
                          prefetch=False)
    resident = set()
    for a, m in zip(accesses, moments):
        resident = (resident - set(m.evict)) | set(m.fetch)
        assert set(a.needs) <= resident, "a moment ran without its chunks"
        assert m.chunk_bytes == len(resident) <= capacity, "the plan overflowed the device"
    return sum(m.h2d_bytes for m in moments)


def brute_force(accesses, n_items, capacity):
    """The fewest fetches over every eviction choice (read-only trace: evictions are free)."""
    best = [float("inf")]

    def go(t, resident, cost):
        if cost >= best[0]:
            return
        if t == len(accesses):
            best[0] = cost
            return
        needs = set(accesses[t].needs)
        missing = needs - resident
        keep = resident | missing
        over = len(keep) - capacity
        if over <= 0:
            go(t + 1, keep, cost + len(missing))
            return
        for out in itertools.combinations(sorted(resident - needs), over):
            go(t + 1, keep - set(out), cost + len(missing))
    go(0, frozenset(), 0)
    return best[0]


@settings(max_examples=150, deadline=None)
@given(traces())
def test_belady_moves_no_more_than_lru_or_fifo(trace):
    accesses, n, cap = trace
    opt = fetched_bytes(accesses, n, cap, "belady")
    assert opt <= fetched_bytes(accesses, n, cap, "lru")
    assert opt <= fetched_bytes(accesses, n, cap, "fifo")


@settings(max_examples=100, deadline=None)
@given(traces(max_items=5, max_len=8))
def test_belady_equals_brute_force_optimum(trace):
    accesses, n, cap = trace
    assert fetched_bytes(accesses, n, cap, "belady") == brute_force(accesses, n, cap)


def test_policies_choose_as_named():
    """Needs 0, 1, 2, then 0 again: Belady keeps 0 (used next), LRU and FIFO evict it."""
    accesses = read_trace([[0], [1], [2], [0], [1]])
    resident = {("param", 0): False, ("param", 1): False}
    candidates = list(resident)
    assert victim(policy_for("belady", accesses), candidates, 2, resident) == ("param", 1)
    assert victim(policy_for("lru", accesses), candidates, 2, resident) == ("param", 0)
    assert victim(policy_for("fifo", accesses), candidates, 2, resident) == ("param", 0)


@settings(max_examples=100, deadline=None)
@given(traces(), st.lists(st.integers(0, 9), min_size=1, max_size=12))
def test_belady_keys_are_next_uses_at_any_moment(trace, moments):
    """Asked at moments in any order (replays start over), Belady picks the furthest next use."""
    from pstar_jax.plan.eviction import next_use, uses_of
    accesses, n, _ = trace
    policy = policy_for("belady", accesses)
    uses, period = uses_of(accesses), len(accesses)
    items = [("param", c) for c in range(n)]
    for t in moments:
        t = t % period
        candidates = [it for it in items if it not in accesses[t].needs]
        if candidates:
            resident = {it: bool(it[1] % 2) for it in candidates}
            expected = max(candidates, key=lambda it: (next_use(uses, it, t, period), not resident[it], it[1]))
            assert victim(policy, candidates, t, resident) == expected


class ScanReplay:
    """The replay's victims picked by scanning every candidate (as before the heap): each call
    returns the lowest (key, arrival) among the items on the device the moment may evict."""

    def __init__(self, rule, accesses):
        self.policy = policy_for(rule, accesses)
        self.picks = []

    def __call__(self, candidates, t, resident):
        self.picks.append(victim(self.policy, candidates, t, resident))
        return self.picks[-1]


@settings(max_examples=150, deadline=None)
@given(traces(), st.sampled_from(["belady", "lru", "fifo"]), st.booleans())
def test_the_replays_heap_evicts_what_a_scan_of_every_item_would(trace, rule, prefetch):
    """Keys kept in a heap between an item's uses pick the very victims a scan at each eviction picks."""
    accesses, n, cap = trace
    accesses = [dc.replace(a, needs=a.needs + (("slot", a.needs[0][1]),) if t % 3 == 0 else a.needs)
                for t, a in enumerate(accesses)]  # dirty items too
    scan = ScanReplay(rule, accesses)
    size = lambda item: 1
    expected = []
    state = ReplayState({}, {("param", c) for c in range(n)})
    for t, a in enumerate(accesses):  # the scan: the items on the device in arrival order
        missing = [it for it in a.needs if it not in state.device]
        over = len(state.device) + len(missing) - (cap + 1)
        resident = dict(state.device)
        for _ in range(max(over, 0)):
            out = scan([it for it in resident if it not in a.needs], t, resident)
            del resident[out]
            expected.append(out)
        for it in list(state.device):
            if it not in resident:
                del state.device[it]
        for it in a.needs:
            state.device[it] = it[0] == "slot" or state.device.get(it, False)
    state = ReplayState({}, {("param", c) for c in range(n)})
    moments, _ = simulate(accesses, [cap + 1] * len(accesses), size, state, policy_for(rule, accesses),
                          prefetch=False)
    assert [it for m in moments for it in m.evict] == expected


@given(traces(), st.sampled_from(["belady", "lru", "fifo"]), st.booleans())
def test_items_stored_off_the_device_replay_as_host_copies_do_but_cost_the_host_nothing(trace, rule, prefetch):
    """A frozen chunk's params kept off the device outside the host's count (``stored``) are fetched
    and evicted exactly as if the host held them, and the host's bytes never count them."""
    accesses, n, cap = trace
    items = {("param", c) for c in range(n)}
    on_host, _ = simulate(accesses, [cap] * len(accesses), lambda item: 1, ReplayState({}, items),
                          policy_for(rule, accesses), prefetch=prefetch)
    stored, end = simulate(accesses, [cap] * len(accesses), lambda item: 1, ReplayState({}, set(), frozenset(items)),
                           policy_for(rule, accesses), prefetch=prefetch)
    assert [(m.evict, m.fetch, m.h2d_bytes, m.d2h_bytes) for m in stored] == [
        (m.evict, m.fetch, m.h2d_bytes, m.d2h_bytes) for m in on_host]
    assert end.host_bytes == end.peak_host_bytes == 0 and end.stored == items
