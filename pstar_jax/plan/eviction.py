"""Which resident chunk item leaves the device when a moment needs room.

The planner knows the whole step in advance, so it evicts as Belady's OPT (as PatrickStar): the
item whose next use is furthest away. LRU and FIFO are here to compare against (scripts/bench_plan.py,
tests/test_eviction.py): Belady never moves more bytes than either.
"""

from __future__ import annotations

import bisect
from typing import Mapping, Protocol, Sequence

from pstar_jax.plan.schedule import Access, Item


class EvictionPolicy(Protocol):
    def __call__(self, candidates: list[Item], t: int, resident: Mapping[Item, bool]) -> Item:
        """The item to evict among ``candidates`` at moment ``t``; ``resident`` maps each item on the
        device to whether it is dirty (no valid host copy), in the order the items arrived."""
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


def belady(accesses: Sequence[Access]) -> EvictionPolicy:
    """Furthest next use first; among equals a clean item (free to drop), then the higher chunk id.

    The planner asks at moments in increasing order (starting over for each replay of the step),
    so the next use of every item is kept up to date as moments pass instead of searched for each
    candidate: the key of a candidate is ``next_use(uses, item, t, period)``, read from a dict."""
    uses, period = uses_of(accesses), len(accesses)
    after = [[(item, next_use(uses, item, t, period)) for item in a.needs] for t, a in enumerate(accesses)]
    first = {item: times[0] for item, times in uses.items()}
    upcoming = dict(first)  # item -> its next use after the moments seen so far
    seen = [-1]  # the last moment whose uses ``upcoming`` reflects

    def victim(candidates: list[Item], t: int, resident: Mapping[Item, bool]) -> Item:
        if t < seen[0]:  # a new replay of the step
            upcoming.clear()
            upcoming.update(first)
            seen[0] = -1
        for u in range(seen[0] + 1, t + 1):
            upcoming.update(after[u])
        seen[0] = max(seen[0], t)
        never = 2 * period
        return max(candidates, key=lambda it: (upcoming.get(it, never), not resident[it], it[1]))
    return victim


def lru(accesses: Sequence[Access]) -> EvictionPolicy:
    """Least recently used (for comparison)."""
    uses = uses_of(accesses)

    def last_use(it: Item, t: int) -> int:
        times = uses.get(it, [])
        i = bisect.bisect_right(times, t)
        return times[i - 1] if i else -1

    def victim(candidates: list[Item], t: int, resident: Mapping[Item, bool]) -> Item:
        return min(candidates, key=lambda it: (last_use(it, t), it[1]))
    return victim


def fifo(accesses: Sequence[Access]) -> EvictionPolicy:
    """First in, first out: the item that came to the device earliest (for comparison)."""
    def victim(candidates: list[Item], t: int, resident: Mapping[Item, bool]) -> Item:
        allowed = set(candidates)
        return next(it for it in resident if it in allowed)
    return victim


POLICIES = {"belady": belady, "lru": lru, "fifo": fifo}
VICTIM_RULES = tuple(POLICIES)


def policy_for(rule: str, accesses: Sequence[Access]) -> EvictionPolicy:
    """The policy named ``rule`` ("belady", "lru" or "fifo") for one step's accesses."""
    return POLICIES[rule](accesses)
