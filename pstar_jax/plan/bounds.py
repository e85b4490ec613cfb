"""What any placement of a step needs at least: bounds known without replaying the step.

The placement search asks them for every candidate (placement.make_plan), so a candidate that
cannot fit costs no replay: the host memory any plan with a given optimizer placement needs
(``host_needed_bytes``), and whether the two memories together could hold the model data at all
(``could_fit``). Chunks may differ in size (schedule.StepShape.chunk_bytes), so what the device
can hold is counted in whole chunks of their own sizes (``most_bytes_within``).
"""

from __future__ import annotations

import collections
import itertools
import math
from typing import Sequence

from pstar_jax.plan.schedule import StepShape, working_moments

MAX_COMBINATIONS = 1 << 16  # counts of each size tried by most_bytes_within before it bounds instead


def most_bytes_within(sizes: Sequence[int], room: int) -> int:
    """The most bytes a set of whole items of ``sizes`` (bytes each) fills without passing ``room``.

    Exact: every count of each size but the most frequent one is tried, the rest filled with as
    many of that one as fit (a layout has a few sizes, and all but one are rare: embedding and head
    chunks of their own). Past MAX_COMBINATIONS combinations it answers ``min(room, sum(sizes))``,
    no less than the exact answer, so a bound built on it stays a bound."""
    if room <= 0 or not sizes:
        return 0
    counts = collections.Counter(sizes)
    common, n_common = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    others = [(size, n) for size, n in counts.items() if size != common]
    if math.prod(n + 1 for _, n in others) > MAX_COMBINATIONS:
        return min(room, sum(sizes))
    best = 0
    for picks in itertools.product(*(range(n + 1) for _, n in others)):
        used = sum(size * k for (size, _), k in zip(others, picks))
        if used <= room:
            best = max(best, used + min(n_common, (room - used) // common) * common)
    return best


def host_needed_bytes(shape: StepShape, device_bytes: int, opt_on_device: Sequence[bool],
                      streamed: Sequence[bool], disk_bytes: int = 0) -> int:
    """A lower bound on the peak host memory of any plan with this optimizer placement. Every
    chunk has a bf16 item (params or grad) at every moment, on the device or the host, and so has
    every stage input from its forward to its backward (``working_moments``): what the device
    cannot hold beside a moment's non-model data is on the host then (at the moment with the most
    non-model data, counted in whole chunks: ``most_bytes_within``); and params made by host Adam
    all sit on the host once the last update has run (a copy fetched to the device leaves the
    host copy valid). A frozen chunk's params count as any chunk's item: one the device holds all
    step needs no host copy (placement.frozen_homes), and up to ``disk_bytes`` of frozen chunks
    may be on a disk instead (homes.with_disk_homes)."""
    trained = [c for c in range(shape.n_chunks) if not shape.is_frozen(c)]
    state_on_device = sum(shape.opt_state_bytes[c] for c in trained if opt_on_device[c])
    room = device_bytes - state_on_device - shape.busiest_non_model_bytes
    items = list(shape.chunk_bytes)
    host_adam = sum(shape.chunk_bytes[c] for c in trained if not opt_on_device[c] and not streamed[c])
    busiest_working = max(n + alive for n, alive in working_moments(shape))
    beside_inputs = sum(items) + busiest_working - (device_bytes - state_on_device)
    on_disk = min(disk_bytes, sum(b for c, b in enumerate(items) if shape.is_frozen(c)))
    off_device = max(sum(items) - most_bytes_within(items, room) - on_disk, host_adam, beside_inputs - on_disk)
    return off_device + sum(shape.opt_state_bytes[c] for c in trained if not opt_on_device[c])


def could_fit(shape: StepShape, device_bytes: int, host_bytes: int, disk_bytes: int = 0) -> bool:
    """Whether the two memories together could hold the model data: every chunk has its bf16
    item (params or grad) and its optimizer state somewhere at every moment, and so has every
    stage input alive then, beside the moment's non-model data on the device; a frozen chunk has
    its params alone, in one memory or both, or on up to ``disk_bytes`` of disk. False: no
    placement fits."""
    data_bytes = sum(shape.chunk_bytes) + sum(shape.opt_state_bytes)
    on_disk = min(disk_bytes, sum(b for c, b in enumerate(shape.chunk_bytes) if shape.is_frozen(c)))
    return all(data_bytes + alive <= max(0, device_bytes - n) + host_bytes + on_disk
               for n, alive in working_moments(shape))

