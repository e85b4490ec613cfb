"""Where chunks live: memory kinds of the accelerator's own client, and the chunk store.

Every chunk array is sharded over the ``data`` mesh axis (one device is W=1 of the same
code) and lives in ``device`` or ``pinned_host`` memory. Moves are ``jax.device_put`` to the
same sharding with another memory kind: host<->device DMA, never a trip through numpy or the
CPU backend (those are 7-50x slower, see DESIGN.md).

The store is the one stateful object of the engine. It keeps up to two copies of a chunk (or of
a stage input, which it holds and counts the same way): a
device copy and a host copy. A fetched parameter chunk keeps its host copy, so evicting it
again while it is unchanged is free; a changed chunk (a gradient, new parameters) has one copy.
It counts per-device bytes in each space and refuses to let device-resident chunk bytes exceed
the budget of the moment: making room is the plan's job (pstar_jax.plan.placement), not the store's.

A frozen chunk homed on disk (``on_disk``) has no copy at all until it is fetched: the store then
takes its bytes from the disk reader (engine/disk.DiskReader, reading ahead in the plan's fetch
order) and puts them on the device; evicting it drops that copy, nothing goes back.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pstar_jax.compat import patient_cpu_collectives
from pstar_jax.config import format_bytes
from pstar_jax.engine.disk import DiskReader

# (chunk list, chunk id). Lists: "param" (bf16 params a stage reads), "slot" (the chunk's bf16
# slot: its grad, or its params between steps), "master" (fp32), "opt" (optimizer state); and
# ("act", stage, micro-batch): a stage input kept for its backward, placed by the plan like a chunk.
Key = tuple[str, int] | tuple[str, int, int]


class Space(str, enum.Enum):
    DEVICE = "device"
    HOST = "pinned_host"


class Placement:
    """The mesh and the shardings of chunks, batches and replicated scalars in each space."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.n_devices = mesh.devices.size

    def sharding(self, space: Space, spec: P = P("data")) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=space.value)

    def put(self, tree: Any, space: Space, replicated: bool = False) -> Any:
        """Place a pytree: arrays sharded on their first axis (or replicated), scalars replicated.

        Host (numpy) values are cut into each device's shard on this process, so the same code
        places a global value across many processes, each holding the same numpy array."""
        def one(x):
            sharding = self.sharding(space, P("data") if np.ndim(x) and not replicated else P())
            if isinstance(x, jax.Array):
                return jax.device_put(x, sharding)
            value = np.asarray(x)
            return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
        return jax.tree.map(one, tree)

    def per_device_bytes(self, tree: Any) -> int:
        total = 0
        for leaf in jax.tree.leaves(tree):
            replicated = np.ndim(leaf) == 0 or leaf.sharding.is_fully_replicated
            total += leaf.nbytes if replicated else leaf.nbytes // self.n_devices
        return total


def space_of(tree: Any) -> Space:
    return Space(jax.tree.leaves(tree)[0].sharding.memory_kind)


@dataclasses.dataclass
class Traffic:
    """Per-device bytes moved between host and device since the last reset, and read from disk
    (a disk read's bytes go on to the device: they count in h2d too)."""
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    disk_read_bytes: int = 0

    def reset(self) -> None:
        self.h2d_bytes = self.d2h_bytes = self.disk_read_bytes = 0


@dataclasses.dataclass
class _Entry:
    copies: dict[Space, Any]  # one or two copies; two only while both hold the same values
    nbytes: int  # per device, of one copy


class ChunkStore:
    """All chunk lists, their copies, the per-space byte counts and the device budget."""

    def __init__(self, placement: Placement, device_budget_bytes: int):
        self.placement = placement
        self.device_budget_bytes = device_budget_bytes  # all the engine may hold on the device
        self._capacity_bytes: int | None = None  # this moment's room for param and grad chunks
        self.reserved_bytes = 0  # optimizer state the plan keeps on the device beside the chunks
        self.traffic = Traffic()
        self.bytes = {Space.DEVICE: 0, Space.HOST: 0}
        self.peak_device_bytes = 0
        self._entries: dict[Key, _Entry] = {}
        self.disk: DiskReader | None = None  # reads the chunks homed on disk
        self._on_disk: dict[Key, int] = {}  # key -> its bytes per device, for chunks homed on disk
        # A CPU array made from numpy may share its memory, and a staging buffer is read into again.
        self._copy_reads = placement.mesh.devices.flat[0].platform == "cpu"

    # -- the budget -----------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        """What may be on the device now: the moment's chunk capacity plus the reserved optimizer
        state, or the whole budget between steps."""
        if self._capacity_bytes is None:
            return self.device_budget_bytes
        return self._capacity_bytes + self.reserved_bytes

    def limit(self, capacity_bytes: int | None) -> None:
        """The plan's chunk capacity for the coming moment (None: between steps, the whole budget)."""
        self._capacity_bytes = capacity_bytes

    def reserve(self, nbytes: int) -> None:
        """Count optimizer state the plan brings to the device (negative: it went back up)."""
        self.reserved_bytes += nbytes

    # -- registration -------------------------------------------------------------------------
    def on_disk(self, key: Key, nbytes: int) -> None:
        """``key`` (a frozen chunk's params, ``nbytes`` per device) lives on disk: ``disk`` reads it
        at each fetch; it has no copy until then."""
        if self.disk is None:
            raise ValueError(f"{key} is homed on disk but the store has no disk reader")
        self._on_disk[key] = nbytes

    def put(self, key: Key, value: Any) -> None:
        """Take ownership of an array (or optax state pytree) already placed in one space."""
        if key in self._entries:
            self.drop(key)
        nbytes = self.placement.per_device_bytes(value)
        space = space_of(value)
        if space is Space.DEVICE:
            self._check_room(key, nbytes)
        self._entries[key] = _Entry({space: value}, nbytes)
        self._add_bytes(space, nbytes)

    def take(self, key: Key, space: Space) -> Any:
        """Remove a chunk from the store and hand its copy in ``space`` over (to be donated)."""
        value = self.get(key, space)
        self.drop(key)
        return value

    def drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        for space in entry.copies:
            self._add_bytes(space, -entry.nbytes)

    # -- queries ------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def keys(self, kind: str) -> list[Key]:
        return sorted(k for k in self._entries if k[0] == kind)

    def spaces(self, key: Key) -> tuple[Space, ...]:
        return tuple(self._entries[key].copies)

    def peek(self, key: Key) -> Any:
        """Any copy, for reading values (checkpoints, tests); does not move anything."""
        copies = self._entries[key].copies
        return copies.get(Space.DEVICE, copies.get(Space.HOST))

    # -- movement -----------------------------------------------------------------------------
    def get(self, key: Key, space: Space) -> Any:
        """The copy in ``space``, copying it there first if needed (async: returns at once; a read
        from disk waits for its read and its copy, see ``_read``)."""
        if key in self._on_disk:
            if space is not Space.DEVICE:
                raise RuntimeError(f"{key} is homed on disk: it has no host copy to make (a planner bug)")
            if key not in self._entries:
                self._read(key)
            return self._entries[key].copies[Space.DEVICE]
        entry = self._entries[key]
        if space not in entry.copies:
            (source,) = entry.copies.values()
            if space is Space.DEVICE:
                self._check_room(key, entry.nbytes)
                self.traffic.h2d_bytes += entry.nbytes
            else:
                self.traffic.d2h_bytes += entry.nbytes
            entry.copies[space] = jax.tree.map(
                lambda x: jax.device_put(x, x.sharding.with_memory_kind(space.value)), source)
            self._add_bytes(space, entry.nbytes)
        return entry.copies[space]

    def evict(self, key: Key) -> None:
        """Leave only a host copy: free if a clean host copy exists, else a device->host copy. A
        chunk homed on disk keeps no copy (it is read again at its next fetch)."""
        if key in self._on_disk:
            if key in self._entries:
                self.drop(key)
            return
        entry = self._entries[key]
        if Space.HOST not in entry.copies:
            self.get(key, Space.HOST)
        if Space.DEVICE in entry.copies:
            del entry.copies[Space.DEVICE]
            self._add_bytes(Space.DEVICE, -entry.nbytes)

    def drop_copy(self, key: Key, space: Space) -> None:
        """Forget one of two copies (e.g. the stale host copy after an in-place update)."""
        entry = self._entries[key]
        if len(entry.copies) > 1 and space in entry.copies:
            del entry.copies[space]
            self._add_bytes(space, -entry.nbytes)

    def resident_bytes(self, kind: str, space: Space = Space.DEVICE) -> int:
        """Per-device bytes of one list's copies in ``space`` (e.g. the stage inputs on the device)."""
        return sum(e.nbytes for k, e in self._entries.items() if k[0] == kind and space in e.copies)

    def device_resident(self, kinds: Iterable[str]) -> list[Key]:
        kinds = set(kinds)
        return [k for k, e in self._entries.items() if k[0] in kinds and Space.DEVICE in e.copies]

    def _read(self, key: Key) -> None:
        """Chunk ``key``'s bytes from the disk reader onto the device. The read was scheduled in the
        plan's order (a fetch outside it, as when the slots are placed between steps, is read at
        once); sync: the staging buffer goes back to the reader once its copy is on the device."""
        nbytes, c = self._on_disk[key], key[1]
        self._check_room(key, nbytes)
        if not self.disk.pending:
            self.disk.schedule([c])
        buf = self.disk.take(c)
        try:
            value = self.placement.put(np.array(buf) if self._copy_reads else buf, Space.DEVICE)
            jax.block_until_ready(value)
        finally:
            self.disk.release(c)
        self._entries[key] = _Entry({Space.DEVICE: value}, nbytes)
        self._add_bytes(Space.DEVICE, nbytes)
        self.traffic.h2d_bytes += nbytes
        self.traffic.disk_read_bytes += nbytes

    def _check_room(self, key: Key, nbytes: int) -> None:
        if self.bytes[Space.DEVICE] + nbytes > self.budget_bytes:
            raise MemoryError(
                f"placing {key} would put {format_bytes(self.bytes[Space.DEVICE] + nbytes)} of chunks on the "
                f"device, over the plan's {format_bytes(self.budget_bytes)} for this moment (a planner bug)")

    def _add_bytes(self, space: Space, nbytes: int) -> None:
        self.bytes[space] += nbytes
        if space is Space.DEVICE:
            self.peak_device_bytes = max(self.peak_device_bytes, self.bytes[Space.DEVICE])


def total_host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping or the OOM killer)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_host_bytes()


def device_total_bytes(device: jax.Device) -> int:
    """What the backend lets JAX allocate on ``device``; host RAM for the CPU backend."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return total_host_bytes()


def host_budget_bytes(host_memory: str | int | None) -> int:
    """Pinned host memory this process may fill with chunks: --host-memory, else 85% of what
    the machine has available now (room stays for Python, data and the page cache); never more
    than a pool limit the user set in XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB."""
    from pstar_jax.config import parse_bytes
    size = parse_bytes(host_memory, "--host-memory") if host_memory else int(0.85 * available_host_bytes())
    user_limit = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    if user_limit:
        size = min(size, int(float(user_limit) * 10**9))
    return size


def configure_backend(device_memory: int | float | str | None, host_bytes: int) -> None:
    """Set the GPU client's memory fraction and pinned-host pool before the backend starts.

    ``device_memory`` as in EngineConfig: a fraction of the device, bytes, or None (automatic:
    0.9). Both settings are read once when the backend initialises, so this must run before any
    JAX operation: without the pool setting the client keeps a fixed 64 GB of pinned memory,
    whatever the plan needs. A user's own setting of either variable wins. On a CPU both are
    ignored."""
    if jax._src.xla_bridge.backends_are_initialized():  # noqa: SLF001 - no public query exists
        return
    patient_cpu_collectives()  # fake CPU devices (--local-devices) reach collectives late under load
    from pstar_jax.config import parse_device_memory
    memory = parse_device_memory(device_memory) if isinstance(device_memory, str) else device_memory
    if memory is None:
        fraction = 0.9
    elif isinstance(memory, float):
        fraction = memory
    else:
        fraction = 0.95  # a byte budget: let the client take most of the card, the budget limits
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{min(fraction, 0.95):.3f}")
    os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(max(1, -(-host_bytes // 10**9))))
