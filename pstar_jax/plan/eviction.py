"""Which resident chunk item leaves the device when a moment needs room.

The planner knows the whole step in advance, so it evicts as Belady's OPT (as PatrickStar): the
item whose next use is furthest away. LRU and FIFO are here to compare against (scripts/bench_plan.py,
tests/test_eviction.py): for items of one size that are only read, Belady never moves more bytes
than either; beside stage inputs of other sizes and write-backs it can lose a little, so the plan
an engine gets is whichever of the three moves least (placement.fewest_bytes).

A policy gives each item on the device a key; the item of the lowest key leaves first, and among
equal keys the one that arrived first. A key holds from the moment the item arrives or a moment
uses it until its next use, so the replay (replay.py) keeps the keys in a heap, asking the policy
only when an item arrives or is used: a victim then costs a heap pop, not a scan of every item on
the device (a deep model keeps hundreds there, and a search replays thousands of moments).
"""

from __future__ import annotations

import bisect
from typing import Mapping, Protocol, Sequence

from pstar_jax.plan.schedule import Access, Item


class EvictionPolicy(Protocol):
    def key(self, item: Item, t: int, dirty: bool) -> tuple:
        """``item``'s place in the queue to leave the device, from moment ``t`` (when it arrived or
        a moment used it; ``dirty``: it has no valid host copy) until its next use: the lowest key
        leaves first. It must not change before that next use."""
        ...


def uses_of(accesses: Sequence[Access]) -> dict[Item, list[int]]:
    """Item -> the moments that need it, in order."""
    uses: dict[Item, list[int]] = {}
    for t, a in enumerate(accesses):
        for item in a.needs:
            uses.setdefault(item, []).append(t)
    return uses


def next_use(uses: dict[Item, list[int]], item: Item, t: int, period: int) -> int:
    """The first moment after ``t`` that needs ``item``, counting into the next step (``period``
    moments later); ``2 * period`` when no moment needs it."""
    times = uses.get(item, [])
    i = bisect.bisect_right(times, t)
    if i < len(times):
        return times[i]
    return period + times[0] if times else 2 * period


class Belady:
    """Furthest next use first; among equals a clean item (free to drop), then the higher chunk id."""

    def __init__(self, accesses: Sequence[Access]):
        self.uses, self.period = uses_of(accesses), len(accesses)

    def key(self, item: Item, t: int, dirty: bool) -> tuple:
        return -next_use(self.uses, item, t, self.period), dirty, -item[1]


class LRU:
    """Least recently used first, then the lower chunk id (for comparison)."""

    def __init__(self, accesses: Sequence[Access]):
        self.uses = uses_of(accesses)

    def key(self, item: Item, t: int, dirty: bool) -> tuple:
        times = self.uses.get(item, [])
        i = bisect.bisect_right(times, t)
        return times[i - 1] if i else -1, item[1]


class FIFO:
    """First in, first out: the item that came to the device earliest (for comparison)."""

    def __init__(self, accesses: Sequence[Access]):
        pass

    def key(self, item: Item, t: int, dirty: bool) -> tuple:
        return ()  # equal keys: the arrival order decides


def victim(policy: EvictionPolicy, candidates: Sequence[Item], t: int, resident: Mapping[Item, bool]) -> Item:
    """The item ``policy`` evicts among ``candidates`` at moment ``t``; ``resident`` maps each item on
    the device to whether it is dirty, in the order the items arrived (a scan, for tests and
    readers: the replay keeps the same keys in a heap)."""
    arrival = {item: i for i, item in enumerate(resident)}
    return min(candidates, key=lambda it: (policy.key(it, t, resident[it]), arrival[it]))


POLICIES = {"belady": Belady, "lru": LRU, "fifo": FIFO}
VICTIM_RULES = tuple(POLICIES)


def policy_for(rule: str, accesses: Sequence[Access]) -> EvictionPolicy:
    """The policy named ``rule`` ("belady", "lru" or "fifo") for one step's accesses."""
    return POLICIES[rule](accesses)
