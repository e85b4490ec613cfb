"""The replay of one step over its items: where each item (a chunk's params or grad, a stage
input) is at every moment, and the evictions and fetches that keep each moment within its device
capacity.

``simulate`` walks the step's accesses (schedule.py) from a starting state: what a moment needs
but is not on the device is fetched (from its host copy) or created (grads at their first use,
stage inputs at their forward); when the device would overflow, the eviction policy
(eviction.py) picks the victims among items the moment (and, when prefetching, the previous one)
does not use: a clean one leaves for free, a dirty one is written back. Items have sizes of their
own (``Size``), so stage inputs and chunks share one capacity. placement.py drives the replay to a
fixed point and turns its moments into a Plan.
"""

from __future__ import annotations

import dataclasses
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
    prefetch: bool  # evict/fetch run during the previous moment
    capacity_bytes: int  # device memory for items during the moment (beside non-model data)
    chunk_bytes: int  # chunk (param and grad) bytes on the device during the moment
    input_bytes: int  # stage-input bytes on the device during the moment
    h2d_bytes: int
    d2h_bytes: int


class Infeasible(Exception):
    """A moment's own items do not fit its capacity (``shortfall`` bytes short; 0: no fixed point)."""

    def __init__(self, message: str, shortfall: int):
        super().__init__(message)
        self.shortfall = shortfall


Size = Callable[[Item], int]  # an item's bytes per device


class ReplayState:
    """Where every item is during a replay, and the bytes that puts in each memory (kept as items
    come and go: a replay visits every moment of a step, many times per search)."""

    def __init__(self, device: dict[Item, bool], host: set[Item]):
        self.device = dict(device)  # item -> dirty (no valid host copy)
        self.host = set(host)  # items with a valid host copy
        self.size: Size = lambda item: 0
        self.device_bytes = self.host_bytes = self.peak_host_bytes = 0

    def measure(self, size: Size) -> None:
        """Count the bytes of the items where they are now, by ``size``."""
        self.size = size
        self.device_bytes = sum(map(size, self.device))
        self.host_bytes = self.peak_host_bytes = sum(map(size, self.host))

    def to_device(self, item: Item, dirty: bool) -> None:
        if item not in self.device:
            self.device_bytes += self.size(item)
        self.device[item] = dirty

    def off_device(self, item: Item) -> bool | None:
        """Remove the device copy; whether it was dirty (None: there was none)."""
        dirty = self.device.pop(item, None)
        if dirty is not None:
            self.device_bytes -= self.size(item)
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
             victim: EvictionPolicy, prefetch: bool = True) -> tuple[list[PlanMoment], ReplayState]:
    """Replay one step from ``state``; returns the moments' actions and the end state.

    ``capacity[t]`` is the device memory for items at moment t, ``size(item)`` an item's bytes.
    Raises Infeasible when a moment's own items do not fit."""
    moments: list[PlanMoment] = []
    state.measure(size)
    inputs = 0  # stage-input bytes on the device
    for t, a in enumerate(accesses):
        fetched, evicted, early = None, None, False
        if prefetch and t > 0:
            prev = accesses[t - 1]
            try:
                evicted, fetched = _actions(a, set(a.needs) | set(prev.needs),
                                            min(capacity[t], capacity[t - 1]), t, state, victim,
                                            extra=set(prev.drops) | set(prev.to_host))
                early = True
            except Infeasible:
                pass
        if not early:
            evicted, fetched = _actions(a, set(a.needs), capacity[t], t, state, victim)
        inputs -= sum(size(it) for it in evicted if it[0] == "act")
        inputs += sum(size(it) for it in a.needs if it[0] == "act" and it not in state.device)
        h2d, d2h = _apply(a, evicted, fetched, state)
        h2d, d2h = h2d + a.state_bytes_each_way, d2h + a.state_bytes_each_way
        moments.append(PlanMoment(a.phase, a.index, a.micro, tuple(evicted), tuple(fetched), early,
                                  capacity[t], state.device_bytes - inputs, inputs, h2d, d2h))
        for item in a.to_host:  # a final grad for host Adam goes up to the host (unless its host copy is valid)
            if state.off_device(item):
                d2h += size(item)
                moments[-1] = dataclasses.replace(moments[-1], d2h_bytes=d2h)
            state.to_host(item)
        for item in a.consumes + a.drops:
            if state.off_device(item) is not None and item[0] == "act":
                inputs -= size(item)
            state.off_host(item)
        for item in a.creates_host:
            state.to_host(item)
        for item in a.creates_device:
            state.to_device(item, True)
            state.off_host(item)
        state.peak_host_bytes = max(state.peak_host_bytes, state.host_bytes)
    return moments, state


def _actions(a: Access, protect: set[Item], capacity: int, t: int, state: ReplayState,
             victim: EvictionPolicy, extra: set[Item] = frozenset()) -> tuple[list[Item], list[Item]]:
    """Evictions and fetches that put ``a.needs`` on the device within ``capacity``.

    Items created at this moment (grads at first use, stage inputs at their forward) count as
    needed but are not fetched. ``extra`` are items still occupying memory (dropped or sent to the
    host after the previous moment runs)."""
    size = state.size
    missing = [it for it in a.needs if it not in state.device]
    need_bytes = (state.device_bytes + sum(map(size, missing))
                  + sum(size(e) for e in extra if e not in state.device))
    if need_bytes <= capacity:  # the common case: nothing to evict, nothing to copy
        return [], [it for it in missing if it in state.host]
    resident = dict(state.device)
    evicted = []
    while need_bytes > capacity:
        candidates = [it for it in resident if it not in protect and it not in extra]
        if not candidates:
            raise Infeasible(moment_name(a), need_bytes - capacity)
        out = victim(candidates, t, resident)
        del resident[out]
        evicted.append(out)
        need_bytes -= size(out)
    return evicted, [it for it in missing if it in state.host]


def moment_name(a: Access) -> str:
    """The moment as a message names it."""
    return f"the optimizer update of chunk {a.index}" if a.phase == "adam" else f"the {a.phase} of stage {a.index}"


def _apply(a: Access, evicted: list[Item], fetched: list[Item], state: ReplayState) -> tuple[int, int]:
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
    return sum(map(state.size, fetched)), d2h
