"""Where a frozen chunk's params live: one home each, chosen after the replay.

A replay (replay.py) charges no memory for a frozen chunk's copy off the device (its items are
``stored``): where that copy lives is decided from the settled step. A chunk on the device at the
step's start that no moment fetches or evicts never needs another copy, so it lives on the device
alone ("device"); any other keeps a pinned host copy all step while its device copy comes and
goes ("host"). The plan counts the host homes' bytes in its host peak (placement.plan_step); the
executor carries the homes out (engine/executor.py: a device home has no host copy).

When host memory cannot hold every host home, some live on local disk instead ("disk"): no copy in
host memory outside a ring of ``DISK_SLOTS`` staging buffers, read ahead of each fetch in the
order the step fetches them (``disk_reads``; engine/disk.DiskReader), evicting them free as any
frozen chunk. Those fetched least go first (each fetch of a disk home is a read), and the ring's
bytes count in the host peak. Homes change only the sources of fetches, not the moments: a plan
with disk homes moves the same bytes over the link, and more from the disk.
"""

from __future__ import annotations

import collections
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


DISK_SLOTS = 4  # the disk reader's staging buffers: reads done or in flight ahead of their fetches


def disk_reads(moments: Sequence[PlanMoment], homes: Sequence[str]) -> tuple[int, ...]:
    """The disk-homed chunks a step's moments fetch, in the order they fetch them (one read each)."""
    if "disk" not in homes:
        return ()
    return tuple(it[1] for m in moments for it in m.fetch if it[0] == "param" and homes[it[1]] == "disk")


def staging_bytes(shape: StepShape, homes: Sequence[str]) -> int:
    """Host memory the disk reader's ring takes: DISK_SLOTS buffers of the largest disk-homed chunk."""
    return DISK_SLOTS * max((shape.chunk_bytes[c] for c, h in enumerate(homes) if h == "disk"), default=0)


def with_disk_homes(shape: StepShape, moments: Sequence[PlanMoment], homes: tuple[str, ...], room: int,
                    disk_bytes: int) -> tuple[str, ...]:
    """``homes`` with host homes moved to disk until the host homes and the reader's ring fit in
    ``room`` bytes (what the host holds beside the replay's items and the optimizer state), at
    most ``disk_bytes`` of them. The ring is DISK_SLOTS buffers of the largest chunk on disk, so
    each size of chunk is tried as the largest allowed there (an embedding on disk would make
    every buffer its size); under each, the chunks fetched least go first (larger first among
    equals). Of the choices that fit, the one reading the fewest bytes per step, then with the
    smallest ring. ``homes`` unchanged when they fit already or no disk is given; when nothing
    fits, the choice that leaves the host least short (the caller reports it)."""
    host = [c for c, h in enumerate(homes) if h == "host"]
    held = sum(shape.chunk_bytes[c] for c in host)
    if held <= room or disk_bytes <= 0:
        return homes
    fetches = collections.Counter(it[1] for m in moments for it in m.fetch if it[0] == "param")
    order = sorted(host, key=lambda c: (fetches[c], -shape.chunk_bytes[c], c))

    def moved(cap: int) -> tuple[tuple[str, ...], int, int]:  # (homes, host short by, bytes read)
        out, left, on_disk = list(homes), held, 0
        for c in order:
            if left + staging_bytes(shape, out) <= room:
                break
            if shape.chunk_bytes[c] > cap or on_disk + shape.chunk_bytes[c] > disk_bytes:
                continue
            out[c] = "disk"
            on_disk += shape.chunk_bytes[c]
            left -= shape.chunk_bytes[c]
        return tuple(out), max(0, left + staging_bytes(shape, out) - room), sum(
            fetches[c] * shape.chunk_bytes[c] for c, h in enumerate(out) if h == "disk")
    tried = [moved(cap) for cap in sorted({shape.chunk_bytes[c] for c in host})]
    return min(tried, key=lambda t: (t[1], t[2], staging_bytes(shape, t[0])))[0]


__all__ = ["DISK_SLOTS", "disk_reads", "frozen_homes", "staging_bytes", "start_items", "with_disk_homes"]
