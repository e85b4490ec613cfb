"""The disk tier's source of frozen chunks, as the engine sees it.

A disk-homed frozen chunk has no copy in host memory outside a staging buffer: the engine asks a
``ChunkReader`` for its bytes each time it fetches it. The bytes are the chunk's in every tier
(``pack_chunk(...).astype(compute dtype)``, padding zero), so stages, trace and numerics do not
change. The readers themselves read files, so they live in the io layer
(pstar_jax.io.frozen_disk: straight from safetensors, or from a cache of chunks); the run passes
one down to the engine.

``DiskReader`` reads those chunks ahead of their fetches, on one background thread, into a ring
of staging buffers: the plan gives the order the step fetches its disk-homed chunks
(plan/homes.disk_reads), the executor schedules it, takes each chunk's buffer when it fetches
the chunk and releases it once the device copy is made. A ring slot holds one chunk from the
start of its read to its release, so the host never holds more than ``slots`` of them (what the
plan counts: plan/homes.staging_bytes), and the disk runs ahead of the fetches by as much.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Protocol, Sequence

import numpy as np

ALIGN_BYTES = 4096  # a staging buffer's start: a page, as O_DIRECT reads and host pinning want


class ChunkReader(Protocol):
    """Frozen chunks read from files into buffers the caller owns."""

    def nbytes(self, c: int) -> int:
        """Bytes of chunk ``c`` (its numel times the chunk dtype's itemsize)."""
        ...

    def read_into(self, c: int, out: np.ndarray) -> None:
        """Fill ``out`` (1-D, C-contiguous, the chunk's numel of the chunk dtype) with chunk ``c``."""
        ...

    def check_unchanged(self) -> None:
        """CheckpointError (one line) if a file read from changed since the reader was made."""
        ...


def aligned_empty(numel: int, dtype: Any) -> np.ndarray:
    """An uninitialised 1-D array of ``numel`` ``dtype`` elements starting on an ALIGN_BYTES boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(numel * dtype.itemsize + ALIGN_BYTES, np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start:start + numel * dtype.itemsize].view(dtype)  # (the view keeps ``raw`` alive)


class DiskReader:
    """Chunks of ``source`` read ahead, in the order scheduled, into a ring of ``slots`` buffers.

    ``schedule`` appends chunks to read; the thread reads each into a free slot as soon as one is
    free, strictly in that order. ``take(c)`` waits for the next read, which must be chunk ``c``,
    and returns its buffer; ``release(c)`` gives the slot back once its bytes are copied out. An
    error a read raised is raised by the take of that chunk. ``cancel`` drops the reads not yet
    taken (a step that ends early), ``close`` stops the thread. Buffers are ``dtype``, page
    aligned, each as large as the largest chunk scheduled so far (grown when a larger one is
    scheduled, at its slot's next read); a chunk's numel is ``numel_of(c)``, by default
    ``source.nbytes(c)`` over the itemsize.
    """

    def __init__(self, source: ChunkReader, dtype: Any, slots: int = 4,
                 numel_of: Callable[[int], int] | None = None):
        if slots < 1:
            raise ValueError(f"the disk reader needs at least 1 staging slot, got slots={slots}")
        self.source = source
        self.dtype = np.dtype(dtype)
        self.slots = slots
        self.read_bytes = 0  # bytes read so far, counted as each read completes
        self._numel_of = numel_of or self._numel_from_bytes
        self._cv = threading.Condition()  # guards everything below; every change notifies all
        self._buffers: list[np.ndarray | None] = [None] * slots
        self._free = list(range(slots))
        self._numel_cap = 0  # the largest chunk scheduled: the size a buffer grows to
        self._queue: collections.deque[tuple[int, int]] = collections.deque()  # (chunk, numel) not started
        self._inflight: tuple[int, int] | None = None  # (chunk, generation) being read
        self._done: collections.deque[tuple[int, int, int, BaseException | None]] = collections.deque()
        self._taken: dict[int, list[int]] = {}  # chunk -> its slots taken, not released (oldest first)
        self._gen = 0  # bumped by cancel and close: a read of an older generation is dropped
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pstar-disk-reader", daemon=True)
        self._thread.start()

    def _numel_from_bytes(self, c: int) -> int:
        nbytes = self.source.nbytes(c)
        if nbytes % self.dtype.itemsize:
            raise ValueError(f"chunk {c} has {nbytes} bytes, not a whole number of {self.dtype} elements; "
                             "the reader's dtype must be the chunks' dtype")
        return nbytes // self.dtype.itemsize

    @property
    def pending(self) -> tuple[int, ...]:
        """The chunks scheduled and not yet taken, in order (read, being read, waiting)."""
        with self._cv:
            return tuple(self._pending())

    def _pending(self) -> list[int]:
        inflight = [self._inflight[0]] if self._inflight and self._inflight[1] == self._gen else []
        return [d[0] for d in self._done] + inflight + [c for c, _ in self._queue]

    def schedule(self, order: Sequence[int]) -> None:
        """Read the chunks of ``order`` after those scheduled already, in this order."""
        reads = [(c, self._numel_of(c)) for c in order]  # (an unknown chunk raises here, before any is queued)
        with self._cv:
            if self._closed:
                raise RuntimeError("the disk reader is closed")
            self._numel_cap = max([self._numel_cap] + [n for _, n in reads])
            self._queue.extend(reads)
            self._cv.notify_all()

    def take(self, c: int) -> np.ndarray:
        """Chunk ``c``'s bytes: a 1-D view of its numel into its slot's buffer, once its read is done.

        ``c`` must be the next chunk scheduled; anything else is a bug in whoever scheduled or
        takes (RuntimeError naming both), raised at once rather than waiting for a read that never
        comes. The buffer stays the caller's until ``release(c)``."""
        with self._cv:
            gen = self._gen
            while True:
                if self._closed:
                    raise RuntimeError("the disk reader is closed")
                if self._gen != gen:
                    raise RuntimeError(f"the read of chunk {c} was cancelled while take({c}) waited for it")
                order = self._pending()
                if not order:
                    raise RuntimeError(f"take({c}) but no read is scheduled: chunk {c} must be scheduled first")
                if order[0] != c:
                    raise RuntimeError(f"take({c}) but the next read scheduled is chunk {order[0]}: the fetches "
                                       "left the order the reads were scheduled in")
                if self._done:
                    break
                self._cv.wait()
            _, slot, numel, err = self._done.popleft()
            if err is not None:  # no buffer goes out: the slot is free again
                self._free.append(slot)
                self._cv.notify_all()
                raise err
            self._taken.setdefault(c, []).append(slot)
            return self._buffers[slot][:numel]

    def release(self, c: int) -> None:
        """The buffer ``take(c)`` returned may be read into again (its bytes are copied out)."""
        with self._cv:
            slots = self._taken.get(c)
            if not slots:
                raise RuntimeError(f"release({c}) but chunk {c} is not taken: each release follows its take")
            self._free.append(slots.pop(0))
            if not slots:
                del self._taken[c]
            self._cv.notify_all()

    def cancel(self) -> None:
        """Drop every read not yet taken and wait for the one in flight to end; taken buffers stay
        taken until released. The reader takes a new schedule afterwards."""
        with self._cv:
            self._drop()
            while self._inflight is not None:  # its buffer may not be written once we return
                self._cv.wait()

    def _drop(self) -> None:
        self._gen += 1
        self._queue.clear()
        self._free.extend(d[1] for d in self._done)
        self._done.clear()
        self._cv.notify_all()

    def close(self) -> None:
        """Cancel, stop the thread and wait for it (after the read in flight, if any). Idempotent."""
        with self._cv:
            self._closed = True
            self._drop()
        self._thread.join()

    def __enter__(self) -> DiskReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        """The thread: the next scheduled chunk into the next free slot, one read at a time."""
        while True:
            with self._cv:
                while not self._closed and not (self._queue and self._free):
                    self._cv.wait()
                if self._closed:
                    return
                (c, numel), slot, gen = self._queue.popleft(), self._free.pop(), self._gen
                self._inflight = (c, gen)
                buf, cap = self._buffers[slot], self._numel_cap
            err = None
            try:  # outside the lock: takes, releases and schedules go on while the disk reads
                if buf is None or buf.size < numel:
                    buf = aligned_empty(cap, self.dtype)
                self.source.read_into(c, buf[:numel])
            except BaseException as e:  # any failure goes to its take: unreported, that take would wait forever
                err = e
            with self._cv:
                self._inflight = None
                self._buffers[slot] = buf
                if err is None:
                    self.read_bytes += numel * self.dtype.itemsize
                if gen == self._gen:
                    self._done.append((c, slot, numel, err))
                else:  # cancelled while it was read
                    self._free.append(slot)
                self._cv.notify_all()


__all__ = ["ALIGN_BYTES", "ChunkReader", "DiskReader", "aligned_empty"]
