"""The replay of one step over its items: where each item (a chunk's params or grad, a stage
input) is at every moment, and the evictions and fetches that keep each moment within its device
capacity.

``simulate`` walks the step's accesses (schedule.py) from a starting state: what a moment needs
but is not on the device is fetched (from its host copy) or created (grads at their first use,
stage inputs at their forward); when the device would overflow, the eviction policy
(eviction.py) picks the victims among items the moment (and, when prefetching, the moments it is
issued during) does not use: a clean one leaves for free, a dirty one is written back. Items have sizes of their
own (``Size``), so stage inputs and chunks share one capacity. placement.py drives the replay to a
fixed point and turns its moments into a Plan. The items on the device wait in a heap by the
policy's keys (re-keyed when they arrive or are used), so a victim costs a pop.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Sequence

from pstar_jax.plan.eviction import EvictionPolicy
from pstar_jax.plan.schedule import Access, Item


@dataclasses.dataclass(frozen=True)
class PlanMoment:
    """What the plan does at one moment: its evictions and fetches and the bytes they leave."""
    phase: str
    index: int
    micro: int
    evict: tuple[Item, ...]
    fetch: tuple[Item, ...]
    prefetch: bool  # evict/fetch run during earlier moments (``lead`` of them), else right before it
    capacity_bytes: int  # device memory for items during the moment (beside non-model data)
    chunk_bytes: int  # chunk (param and grad) bytes on the device during the moment
    input_bytes: int  # stage-input bytes on the device during the moment
    h2d_bytes: int
    d2h_bytes: int
    lead: int = 1  # with prefetch: issued as moment t - lead starts, so they run during lead moments

    @property
    def issued_at(self) -> int:
        """How many moments before this one its evictions and fetches are issued (0: right before it)."""
        return self.lead if self.prefetch else 0


class Infeasible(Exception):
    """A moment's own items do not fit its capacity (``shortfall`` bytes short; 0: no fixed point)."""

    def __init__(self, message: str, shortfall: int):
        super().__init__(message)
        self.shortfall = shortfall


class HostShort(Exception):
    """A replay overflowed its host memory limit (``host_bytes`` there)."""

    def __init__(self, host_bytes: int):
        super().__init__(host_bytes)
        self.host_bytes = host_bytes


Size = Callable[[Item], int]  # an item's bytes per device


class ReplayState:
    """Where every item is during a replay, and the bytes that puts in each memory (kept as items
    come and go: a replay visits every moment of a step, many times per search); the items on the
    device wait in a heap by the eviction policy's keys.

    ``stored`` items (frozen chunks' params) have a copy off the device that never changes, which
    no replay charges to the host: where it lives (pinned host memory, a disk, or nowhere, for a
    chunk that never leaves the device) is the plan's choice after the replay (placement.py).
    ``pinned`` items stay on the device whatever the policy says (a frozen chunk whose only copy
    is there, in a replay of an evaluation between steps)."""

    def __init__(self, device: dict[Item, bool], host: set[Item], stored: frozenset[Item] = frozenset(),
                 pinned: frozenset[Item] = frozenset()):
        self.device = dict(device)  # item -> dirty (no valid host copy), in the order they arrived
        self.host = set(host)  # items with a valid host copy
        self.stored = frozenset(stored)  # items with a copy off the device outside the host's count
        self.pinned = frozenset(pinned)  # items on the device that are never evicted (no copy elsewhere)
        self.size: Size = lambda item: 0
        self.device_bytes = self.host_bytes = self.peak_host_bytes = 0
        self.policy: EvictionPolicy | None = None
        self.queue: list[tuple] = []  # heap of (key, arrival, item); an entry is live while ``entry`` holds it
        self.entry: dict[Item, tuple] = {}
        self.arrival: dict[Item, int] = {}
        self.arrivals = 0

    def measure(self, size: Size, policy: EvictionPolicy | None = None) -> None:
        """Count the bytes of the items where they are now, by ``size``, and queue those on the
        device by ``policy``'s keys, as of before the step's first moment."""
        self.size, self.policy = size, policy
        self.device_bytes = sum(map(size, self.device))
        self.host_bytes = self.peak_host_bytes = sum(map(size, self.host))
        self.queue, self.entry, self.arrival, self.arrivals = [], {}, {}, 0
        for item in self.device:
            self._arrive(item)
            self.touch(item, -1)

    def _arrive(self, item: Item) -> None:
        self.arrival[item] = self.arrivals
        self.arrivals += 1

    def touch(self, item: Item, t: int) -> None:
        """Re-key ``item`` (on the device) at moment ``t``, which uses it or brought it (a pinned
        item is never queued: no policy evicts it)."""
        if self.policy is not None and item not in self.pinned:
            e = (self.policy.key(item, t, self.device[item]), self.arrival[item], item)
            self.entry[item] = e
            heapq.heappush(self.queue, e)

    def pop_victim(self, keep: set[Item], popped: list[tuple]) -> Item | None:
        """The next item on the device the policy evicts, skipping ``keep``; None when there is none.
        Live entries popped are appended to ``popped``, for ``requeue`` to put back."""
        while self.queue:
            e = heapq.heappop(self.queue)
            if self.entry.get(e[2]) is not e:
                continue  # the item left or was re-keyed since
            popped.append(e)
            if e[2] not in keep:
                return e[2]
        return None

    def requeue(self, popped: list[tuple]) -> None:
        for e in popped:
            heapq.heappush(self.queue, e)

    def to_device(self, item: Item, dirty: bool) -> None:
        """Put ``item`` on the device (``touch`` it next, to queue it)."""
        if item not in self.device:
            self.device_bytes += self.size(item)
            self._arrive(item)
        self.device[item] = dirty

    def off_device(self, item: Item) -> bool | None:
        """Remove the device copy; whether it was dirty (None: there was none)."""
        dirty = self.device.pop(item, None)
        if dirty is not None:
            self.device_bytes -= self.size(item)
            self.entry.pop(item, None)
        return dirty

    def to_host(self, item: Item) -> None:
        if item not in self.host:
            self.host.add(item)
            self.host_bytes += self.size(item)

    def off_host(self, item: Item) -> None:
        if item in self.host:
            self.host.remove(item)
            self.host_bytes -= self.size(item)

    def key(self) -> tuple:
        return tuple(sorted(self.device.items())), tuple(sorted(self.host))


def simulate(accesses: Sequence[Access], capacity: Sequence[int], size: Size, state: ReplayState,
             policy: EvictionPolicy, prefetch: int = 1, host_limit: int | None = None
             ) -> tuple[list[PlanMoment], ReplayState]:
    """Replay one step from ``state``; returns the moments' actions and the end state.

    ``capacity[t]`` is the device memory for items at moment t, ``size(item)`` an item's bytes.
    ``prefetch``: the most moments ahead a moment's evictions and fetches may be issued (0: none
    ahead; see ``_early``). Raises Infeasible when a moment's own items do not fit, HostShort when
    the host holds more than ``host_limit`` bytes of items after a moment."""
    moments: list[PlanMoment] = []
    state.measure(size, policy)
    inputs = 0  # stage-input bytes on the device
    lead = 0  # the previous moment's
    for t, a in enumerate(accesses):
        # issued no earlier than the previous moment's: copies go out in the replay's order
        lead, evicted, fetched = _early(accesses, capacity, state, t, min(prefetch, t, lead + 1))
        if not lead:
            evicted, fetched = _actions(a, set(a.needs), capacity[t], state)
        early = lead > 0
        if evicted:
            inputs -= sum(size(it) for it in evicted if it[0] == "act")
        inputs += sum(size(it) for it in a.needs if it[0] == "act" and it not in state.device)
        h2d, d2h = _apply(a, t, evicted, fetched, state)
        # a final grad for host Adam goes up to the host after the moment (unless its host copy is valid)
        up = sum(size(it) for it in a.to_host if state.device.get(it)) if a.to_host else 0
        moments.append(PlanMoment(a.phase, a.index, a.micro, tuple(evicted), tuple(fetched), early,
                                  capacity[t], state.device_bytes - inputs, inputs, h2d + a.state_bytes_each_way,
                                  d2h + a.state_bytes_each_way + up, max(lead, 1)))
        for item in a.to_host:
            state.off_device(item)
            state.to_host(item)
        for item in a.consumes + a.drops:
            if state.off_device(item) is not None and item[0] == "act":
                inputs -= size(item)
            state.off_host(item)
        for item in a.creates_host:
            state.to_host(item)
        for item in a.creates_device:
            state.to_device(item, True)
            state.touch(item, t)
            state.off_host(item)
        state.peak_host_bytes = max(state.peak_host_bytes, state.host_bytes)
        if host_limit is not None and state.host_bytes > host_limit:
            raise HostShort(state.host_bytes)
    return moments, state


def _early(accesses: Sequence[Access], capacity: Sequence[int], state: ReplayState, t: int, most: int
           ) -> tuple[int, list[Item], list[Item]]:
    """(lead, evictions, fetches) of moment t issued ``lead`` moments ahead, as the moment t - lead
    starts: the most moments ahead (at most ``most``) at which they fit and what they fetch
    exists; (0, [], []) if at none.

    Issued ahead, moment t's fetches share the device with moments t - lead .. t - 1: they must fit
    the least capacity of those moments and t, evict nothing those moments use, and count what
    those moments drop or send up after they run as still there. Deeper leads hide a copy longer
    than one moment's compute (a 70B block's 1.6 GiB takes 33 ms to fetch, its forward 19 ms) at
    the price of holding the fetched bytes longer."""
    a = accesses[t]
    missing = {it for it in a.needs if it not in state.device}
    for lead in range(most, 0, -1):
        window = accesses[t - lead:t]
        # the window's first moment has run when the copies are issued, the others have not: what
        # they create or send up (an update's new params, a final grad) is not there to fetch yet
        # (nor to evict)
        unborn = set().union(*(set(w.creates_host) | set(w.creates_device) | set(w.to_host) for w in window[1:]))
        if missing & unborn:
            continue
        protect = set(a.needs).union(*(w.needs for w in window)) | unborn
        extra = set().union(*(set(w.drops) | set(w.to_host) for w in window))
        try:
            return (lead, *_actions(a, protect, min(capacity[t - lead:t + 1]), state, extra=extra))
        except Infeasible:
            pass
    return 0, [], []


def settle(accesses: Sequence[Access], capacity: Sequence[int], size: Size, state: ReplayState,
           policy: EvictionPolicy, rounds: int = 8, host_limit: int | None = None, prefetch: int = 1
           ) -> tuple[list[PlanMoment], ReplayState, ReplayState]:
    """Replay the step from ``state`` until it ends in the state it started in: (moments, start,
    end). Raises Infeasible when a moment's own items do not fit, or after ``rounds`` replays.

    ``host_limit``: raise HostShort as soon as a replay after the first holds more items on the
    host (the first starts from a made-up state, everything on the host; the second, from where
    the first ended, has in practice always been the one that repeats, so it overflowing means
    the plan's step does)."""
    for round_ in range(rounds):
        start = ReplayState(state.device, state.host, state.stored, state.pinned)
        moments, state = simulate(accesses, capacity, size, state, policy, prefetch,
                                  host_limit=host_limit if round_ else None)
        if state.key() == start.key():
            return moments, start, state
    raise Infeasible("the placement does not settle into a repeating step", 0)


def _actions(a: Access, protect: set[Item], capacity: int, state: ReplayState,
             extra: set[Item] = frozenset()) -> tuple[list[Item], list[Item]]:
    """Evictions and fetches that put ``a.needs`` on the device within ``capacity``.

    Items created at this moment (grads at first use, stage inputs at their forward) count as
    needed but are not fetched. ``extra`` are items still occupying memory (dropped or sent to the
    host after the previous moment runs)."""
    size = state.size
    missing = [it for it in a.needs if it not in state.device]
    need_bytes = (state.device_bytes + sum(map(size, missing))
                  + sum(size(e) for e in extra if e not in state.device))
    if need_bytes <= capacity:  # the common case: nothing to evict, nothing to copy
        return [], [it for it in missing if it in state.host or it in state.stored]
    keep, popped, evicted = protect | extra, [], []
    try:
        while need_bytes > capacity:
            out = state.pop_victim(keep, popped)
            if out is None:
                raise Infeasible(moment_name(a), need_bytes - capacity)
            evicted.append(out)
            need_bytes -= size(out)
    finally:
        state.requeue(popped)  # the moment may yet run without prefetch: the victims are not gone yet
    return evicted, [it for it in missing if it in state.host or it in state.stored]


def moment_name(a: Access) -> str:
    """The moment as a message names it."""
    return f"the optimizer update of chunk {a.index}" if a.phase == "adam" else f"the {a.phase} of stage {a.index}"


def _apply(a: Access, t: int, evicted: list[Item], fetched: list[Item], state: ReplayState) -> tuple[int, int]:
    d2h = 0
    for it in evicted:
        if state.off_device(it):
            d2h += state.size(it)
            state.to_host(it)
    for it in fetched:
        state.to_device(it, False)
    for it in a.needs:
        if it[0] == "slot":  # grads are created at their first use and written at every use
            state.to_device(it, True)
            state.off_host(it)
        elif it[0] == "act" and it not in state.device:  # a stage input, made by the forward below: no host copy yet
            state.to_device(it, True)
        if it in state.device:  # used now: queued by its next use
            state.touch(it, t)
    return sum(map(state.size, fetched)), d2h
