"""Where a frozen chunk's params live: one home each, chosen after the replay.

A replay (replay.py) charges no memory for a frozen chunk's copy off the device (its items are
``stored``): where that copy lives is decided from the settled step. A chunk on the device at the
step's start that no moment fetches or evicts never needs another copy, so it lives on the device
alone ("device"); any other keeps a pinned host copy all step while its device copy comes and
goes ("host"). The plan counts the host homes' bytes in its host peak (placement.plan_step); the
executor carries the homes out (engine/executor.py: a device home has no host copy).
"""

from __future__ import annotations

from typing import Sequence

from pstar_jax.plan.replay import PlanMoment, ReplayState
from pstar_jax.plan.schedule import Item, StepShape


def start_items(shape: StepShape) -> tuple[set[Item], frozenset[Item]]:
    """Where a replay starts before anything is placed: each trainable chunk's slot on the host,
    each frozen chunk's params stored off the device (their home is chosen after the replay)."""
    return ({("slot", c) for c in range(shape.n_chunks) if not shape.is_frozen(c)},
            frozenset(("param", c) for c in range(shape.n_chunks) if shape.is_frozen(c)))


def frozen_homes(shape: StepShape, moments: Sequence[PlanMoment], start: ReplayState) -> tuple[str, ...]:
    """Each frozen chunk's home under a settled step's moments (() when none is frozen): "device"
    where it is on the device at the step's start and no moment fetches or evicts it (its only
    copy is there), else "host" (its pinned copy stays while the device copy comes and goes)."""
    if not shape.frozen or not any(shape.frozen):
        return ()
    moved = {it for m in moments for it in m.evict + m.fetch}
    return tuple("" if not shape.is_frozen(c) else
                 "device" if ("param", c) in start.device and ("param", c) not in moved else "host"
                 for c in range(shape.n_chunks))


__all__ = ["frozen_homes", "start_items"]
