"""Frozen chunks read from disk: straight from a base's safetensors files, or from a cache of chunks.

Both are ``pstar_jax.engine.disk.ChunkReader``s, and a chunk's bytes are the same in every tier:
``pack_chunk(layout, c, tensors).astype(dtype)``'s, as pstar-train builds it, padding zero.

``SafetensorsChunks`` turns the files' headers (a tensor's bytes start at 8 + header length + its
``data_offsets``) into pieces per chunk: file, offset, bytes, place in the chunk, transposed or
not, stored dtype, rows kept (a table cut short: GPT-2's ``wpe`` at a shorter seq_len). A read
lands a piece already in the chunk's dtype and orientation in place with ``os.preadv``; the others
go through a staging buffer per worker, in blocks of stored rows, and numpy casts or transposes
them into place. A chunk's blocks run on a thread pool (``workers``).

``ChunkCache`` writes chosen frozen chunks once into ``DIR/frozen_chunks.pstar``: a header (magic,
length, JSON: base fingerprint, layout digest, dtype, each chunk's offset and bytes, file size),
then the chunks in chunk order, each 4 KiB-aligned (for O_DIRECT), into a hidden file renamed into
place. A cache whose header matches is reused untouched; any other (another base, layout or dtype,
chunks missing, cut short, not ours) is rewritten, never read as data. The directory is the
user's: the cache file may not lead out of it, and nothing is written anywhere else.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import stat
import threading
from typing import Any, Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

from pstar_jax.config import CheckpointError, ConfigError, HFCheckpointError, format_bytes
from pstar_jax.config.paths import check_output_dir, contained, create_temp_beside, os_error_cause
from pstar_jax.engine.chunks import ChunkLayout, pack_chunk
from pstar_jax.engine.disk import ChunkReader
from pstar_jax.io.hf import HFCheckpoint

CACHE_FILE = "frozen_chunks.pstar"
ALIGN_BYTES = 4096  # chunk offsets in the cache, and its header's length
BLOCK_BYTES = 16 << 20  # one read of a worker: a staging buffer's size, and the tile a transpose walks
_MAGIC = b"PSTARFC1"
_FORMAT = 1  # bump when a chunk's bytes for the same base and layout change
_STORED = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}


def layout_digest(layout: ChunkLayout) -> str:
    """sha256 of what places a chunk's bytes: chunk sizes and kinds, each tensor's chunk, offset and shape."""
    text = json.dumps({"numels": list(layout.numels), "kinds": list(layout.kinds),
                       "slots": [[s.name, list(s.shape), s.chunk, s.offset] for s in layout.slots]})
    return hashlib.sha256(text.encode()).hexdigest()


def _frozen(layout: ChunkLayout, chunks: Iterable[int] | None) -> list[int]:
    """The chunks a reader holds: ``chunks``, each frozen (ValueError otherwise), or all the frozen ones."""
    if chunks is None:
        return [c for c in range(layout.n_chunks) if layout.is_frozen(c)]
    chosen = sorted(set(chunks))
    if any(not (0 <= c < layout.n_chunks and layout.is_frozen(c)) for c in chosen):
        raise ValueError(f"chunks {chosen} are not all frozen chunks of the layout; only those are read from disk")
    return chosen


def _pread(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill ``buf`` (contiguous) from ``fd`` at ``offset``; EOFError if the file ends first."""
    if not buf.flags.c_contiguous:  # (reshape would read into a copy)
        raise ValueError("reads go into contiguous buffers")
    view, done = memoryview(buf.reshape(-1).view(np.uint8)), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError
        done += n


class _Reads:
    """What both readers share: chunk sizes, the check of a caller's buffer, the worker pool."""

    def __init__(self, numels: Mapping[int, int], dtype: Any, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.dtype = np.dtype(dtype)
        self._numels = dict(numels)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "pstar-disk") if workers > 1 else None
        self._local = threading.local()  # each thread's staging buffer

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(sorted(self._numels))

    def nbytes(self, c: int) -> int:
        return self._numels[c] * self.dtype.itemsize

    def _check_out(self, c: int, out: np.ndarray) -> None:
        if c not in self._numels:
            raise ValueError(f"chunk {c} is not one this reader holds ({list(self.chunks)[:8]}...)")
        if out.dtype != self.dtype or out.shape != (self._numels[c],) or not out.flags.c_contiguous:
            raise ValueError(f"chunk {c} reads into a contiguous ({self._numels[c]},) {self.dtype} array, "
                             f"got {out.shape} {out.dtype}")

    def _staging(self, size_bytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < size_bytes:
            buf = self._local.buf = np.empty(max(size_bytes, BLOCK_BYTES), np.uint8)
        return buf[:size_bytes]

    def _run(self, tasks: list[Callable[[], None]]) -> None:
        if self._pool is None or len(tasks) < 2:
            for task in tasks:
                task()
            return
        futures = [self._pool.submit(task) for task in tasks]
        concurrent.futures.wait(futures)  # all of them: none may write into ``out`` after we return
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class Piece:
    """One tensor's bytes in a safetensors file and their place in a chunk."""
    name: str  # ours
    hf_name: str  # as stored
    file: str  # relative to the checkpoint directory
    offset_bytes: int  # in the file
    size_bytes: int  # read: the kept rows only when rows are cut from an untransposed tensor
    slot_offset: int  # elements into the chunk
    shape: tuple[int, ...]  # as read, in the file's orientation (a scalar: (1,))
    transpose: bool
    dtype: np.dtype  # as stored
    rows: int  # rows kept, in our orientation (fewer than stored when cut)
    slot_shape: tuple[int, ...]  # ours

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def _headers(fd: int, path: str) -> tuple[int, dict, int]:
    """(data start, header, file size) of a safetensors file; HFCheckpointError if it is not one."""
    size = os.fstat(fd).st_size
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    try:
        header = json.loads(os.pread(fd, n, 8)) if 0 < n <= size - 8 else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{path} is not a readable safetensors file (its header); download it again")
    return 8 + n, header, size


def _piece(hf: HFCheckpoint, slot: Any, headers: Mapping[str, tuple[int, dict, int]]) -> Piece:
    file, hf_name, transpose = hf.location(slot.name)
    start, header, size = headers[file]
    entry = header.get(hf_name, {})
    dtype = _STORED.get(entry.get("dtype"))
    stored = tuple(entry.get("shape", ()))
    begin, end = entry.get("data_offsets", (0, -1))
    ours = stored[::-1] if transpose else stored
    if dtype is None or end - begin != math.prod(stored) * np.dtype(dtype).itemsize or start + end > size \
            or len(ours) != len(slot.shape) or ours[1:] != slot.shape[1:] or (ours and ours[0] < slot.shape[0]):
        raise HFCheckpointError(f"tensor {hf_name} in {file} in {hf.directory} is {entry.get('dtype')} {list(stored)} "
                                f"at {[begin, end]}, not the tensor of shape {slot.shape} the layout expects; the "
                                "file changed since it was opened")
    rows, stored = (slot.shape[0] if slot.shape else 1), stored or (1,)  # a scalar is read as one row
    shape = stored if transpose else (rows, *stored[1:])  # only the kept rows are read
    return Piece(slot.name, hf_name, file, start + begin, math.prod(shape) * np.dtype(dtype).itemsize, slot.offset,
                 shape, transpose, np.dtype(dtype), rows, slot.shape)


class SafetensorsChunks(_Reads):
    """Frozen chunks of ``layout`` (default: all of them) read from ``hf``'s safetensors files."""

    def __init__(self, hf: HFCheckpoint, layout: ChunkLayout, dtype: Any = ml_dtypes.bfloat16,
                 chunks: Iterable[int] | None = None, workers: int = 1):
        chosen = _frozen(layout, chunks)
        super().__init__({c: layout.numel_of(c) for c in chosen}, dtype, workers)
        self.directory = hf.directory
        slots = [s for s in layout.slots if s.chunk in self._numels]
        paths = {f: os.path.join(self.directory, f) for f in sorted({hf.location(s.name)[0] for s in slots})}
        self._fds: dict[str, int] = {}
        try:
            for f, p in paths.items():
                self._fds[f] = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            self._stats = {f: _identity(os.stat(p)) for f, p in paths.items()}  # before reading the headers
            headers = {f: _headers(self._fds[f], p) for f, p in paths.items()}
            self.pieces: dict[int, list[Piece]] = {c: [] for c in chosen}
            for s in slots:
                self.pieces[s.chunk].append(_piece(hf, s, headers))
        except BaseException:
            self.close()
            raise
        self._padding = {c: _gaps(sorted((p.slot_offset, p.slot_offset + math.prod(p.slot_shape)) for p in ps),
                                  self._numels[c]) for c, ps in self.pieces.items()}
        self._verified: set[int] = set()  # chunks read once and found finite

    def read_into(self, c: int, out: np.ndarray) -> None:
        self._check_out(c, out)
        for start, end in self._padding[c]:
            out[start:end] = 0
        verify = c not in self._verified
        tasks = []
        for p in self.pieces[c]:
            n_rows = p.shape[0]
            step = max(1, BLOCK_BYTES // max(1, p.row_bytes)) if len(p.shape) == 2 or not p.transpose else n_rows
            tasks += [(lambda p=p, r=r, k=min(step, n_rows - r): self._block(p, out, r, k, verify))
                      for r in range(0, n_rows, step)]
        self._run(tasks)
        self._verified.add(c)

    def _block(self, p: Piece, out: np.ndarray, r0: int, k: int, verify: bool) -> None:
        """Stored rows [r0, r0 + k) of piece ``p`` into their place in ``out``."""
        dst = out[p.slot_offset:p.slot_offset + math.prod(p.slot_shape)].reshape(p.slot_shape or (1,))
        offset = p.offset_bytes + r0 * p.row_bytes
        try:
            if p.dtype == self.dtype and not p.transpose:  # already the chunk's bytes: read them in place
                src = dst[r0:r0 + k]
                _pread(self._fds[p.file], src, offset)
            else:
                src = self._staging(k * p.row_bytes).view(p.dtype).reshape((k, *p.shape[1:]))
                _pread(self._fds[p.file], src, offset)
                if not p.transpose:
                    np.copyto(dst[r0:r0 + k], src, casting="unsafe")
                elif src.ndim == 2:  # stored rows are our columns
                    np.copyto(dst[:, r0:r0 + k], src[:, :p.rows].T, casting="unsafe")
                else:
                    np.copyto(dst, src.T[:p.rows], casting="unsafe")
        except EOFError:
            raise CheckpointError(_changed(p.file, self.directory)) from None
        # Checked once per chunk, as HFCheckpoint checks each tensor it reads: a corrupt weight
        # would otherwise surface as a NaN loss.
        if verify and not np.isfinite(src).all():
            raise HFCheckpointError(f"tensor {p.hf_name} in {p.file} in {self.directory} holds NaN or infinite "
                                    "values; the checkpoint is corrupt: download it again")

    def check_unchanged(self) -> None:
        for f, saved in self._stats.items():
            try:
                now = _identity(os.stat(os.path.join(self.directory, f)))
            except OSError:
                now = None
            if now != saved:
                raise CheckpointError(_changed(f, self.directory))

    def close(self) -> None:
        super().close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def _changed(name: str, directory: str) -> str:
    return (f"the base file {name} in {directory} changed while the run was reading it; put back the base it "
            "started from and resume from the last checkpoint")


def _gaps(spans: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The ranges of [0, numel) outside ``spans`` (sorted, disjoint): a chunk's padding."""
    out, end = [], 0
    for start, stop in spans:
        if start > end:
            out.append((end, start))
        end = max(end, stop)
    return out + ([(end, numel)] if end < numel else [])


def _round_up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class ChunkCache(_Reads):
    """Frozen chunks of ``layout`` (default: all of them) kept in one file in ``directory``, written
    from ``source`` (a ChunkReader, or tensors by name as pstar-train packs them) unless a cache
    of this base (``fingerprint``), layout and dtype holding those chunks is there already."""

    def __init__(self, directory: str, layout: ChunkLayout, source: ChunkReader | Mapping[str, Any],
                 fingerprint: str, dtype: Any = ml_dtypes.bfloat16, chunks: Iterable[int] | None = None,
                 workers: int = 1):
        chosen = _frozen(layout, chunks)
        super().__init__({c: layout.numel_of(c) for c in chosen}, dtype, workers)
        self.directory = os.path.abspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ConfigError(f"EngineConfig.frozen_cache {self.directory} is a file, not a directory; pass a "
                              "directory for the frozen chunks' cache")
        self.path = os.path.join(self.directory, CACHE_FILE)
        self._want = {"format": _FORMAT, "fingerprint": fingerprint, "layout": layout_digest(layout),
                      "dtype": self.dtype.name}
        self.written = False  # whether this cache was (re)written here, not found
        self._fd = -1
        opened = self._open_matching()
        if opened is None:
            self._write(layout, source, chosen)
            self.written = True
            opened = self._open_matching()
            if opened is None:
                raise CheckpointError(f"the frozen-chunk cache {self.path} does not read back as written (another "
                                      "run replaced it?); give each run its own EngineConfig.frozen_cache")
        self._fd, self._offsets, self._stat = opened

    def _open_matching(self) -> tuple[int, dict[int, int], tuple] | None:
        """(fd, chunk -> offset, identity) of the cache file if it is ours and matches, else None."""
        if not os.path.lexists(self.path):
            return None
        contained(self.directory, CACHE_FILE, "the frozen-chunk cache", ConfigError)  # a link out: refused
        if not os.path.exists(self.path):  # a dangling link inside: replaced like a stale cache
            return None
        target = os.path.realpath(self.path)
        if not stat.S_ISREG(os.stat(target).st_mode):  # (a fifo would block the open)
            raise ConfigError(f"the frozen-chunk cache {self.path} is not a file; remove it or choose another "
                              "EngineConfig.frozen_cache")
        try:
            fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as err:
            raise ConfigError(f"the frozen-chunk cache {self.path} cannot be read ({os_error_cause(err)}); "
                              "remove it or choose another EngineConfig.frozen_cache") from None
        header, st = _read_header(fd), os.fstat(fd)
        if header is None or not self._matches(header, st.st_size):
            os.close(fd)
            return None
        return fd, {int(c): o for c, (o, _) in header["chunks"].items()}, _identity(st)

    def _matches(self, header: dict, size_bytes: int) -> bool:
        try:
            chunks = {int(c): (int(o), int(n)) for c, (o, n) in header["chunks"].items()}
            return (all(header.get(k) == v for k, v in self._want.items()) and header["size_bytes"] == size_bytes
                    and all(c in chunks and chunks[c][1] == self.nbytes(c) and chunks[c][0] % ALIGN_BYTES == 0
                            and sum(chunks[c]) <= size_bytes for c in self._numels))
        except (KeyError, TypeError, ValueError, AttributeError):
            return False

    def _write(self, layout: ChunkLayout, source: ChunkReader | Mapping[str, Any], chosen: list[int]) -> None:
        check_output_dir(self.directory, "EngineConfig.frozen_cache")  # one line: a file above, read-only
        os.makedirs(self.directory, exist_ok=True)  # (os.replace below renames a link, never writes through it)
        header, first = {**self._want, "chunks": {}}, ALIGN_BYTES
        while True:  # the offsets depend on the header's length, which depends on the offsets
            offset = first
            for c in chosen:
                header["chunks"][str(c)] = [offset, self.nbytes(c)]
                offset = _round_up(offset + self.nbytes(c))
            header["size_bytes"] = offset
            text = json.dumps(header, sort_keys=True).encode()
            if 16 + len(text) <= first:
                break
            first = _round_up(16 + len(text))
        free = (fs := os.statvfs(self.directory)).f_bavail * fs.f_frsize
        if free < header["size_bytes"]:  # refused before a byte is written
            raise ConfigError(f"the frozen-chunk cache in {self.directory} needs {format_bytes(header['size_bytes'])} "
                              f"but its file system has {format_bytes(free)} free; free space there or choose "
                              "another EngineConfig.frozen_cache")
        fd, tmp = create_temp_beside(self.path)
        try:
            _pwrite(fd, _MAGIC + len(text).to_bytes(8, "little") + text, 0)
            buf = np.empty(max(self._numels.values(), default=0), self.dtype)
            for c in chosen:
                out = buf[:self._numels[c]]
                _fill(layout, c, source, out)
                _pwrite(fd, out.view(np.uint8), header["chunks"][str(c)][0])
            os.ftruncate(fd, header["size_bytes"])
            os.fsync(fd)
            check = getattr(source, "check_unchanged", None)
            if callable(check):  # the base stayed put while it was copied
                check()
            os.replace(tmp, self.path)
        except OSError as err:
            raise ConfigError(f"the frozen-chunk cache in {self.directory} could not be written "
                              f"({os_error_cause(err)}); it needs {format_bytes(header['size_bytes'])}: free that "
                              "or choose another EngineConfig.frozen_cache") from None
        finally:
            os.close(fd)
            if os.path.lexists(tmp):
                os.remove(tmp)

    def read_into(self, c: int, out: np.ndarray) -> None:
        self._check_out(c, out)
        flat, offset, step = out.view(np.uint8), self._offsets[c], 4 * BLOCK_BYTES

        def block(start: int) -> None:
            try:
                _pread(self._fd, flat[start:start + step], offset + start)
            except EOFError:
                raise CheckpointError(self._changed()) from None
        self._run([lambda s=s: block(s) for s in range(0, flat.size, step)])

    def check_unchanged(self) -> None:
        """The file this cache holds open keeps its size and mtime (another run may rename a cache of
        its own over the name: this one's file stays as it was)."""
        if _identity(os.fstat(self._fd)) != self._stat:
            raise CheckpointError(self._changed())

    def _changed(self) -> str:
        return (f"the frozen-chunk cache {CACHE_FILE} in {self.directory} changed while the run was reading it; "
                "leave it alone while a run uses it and resume from the last checkpoint (it is rewritten)")

    def close(self) -> None:
        super().close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read_header(fd: int) -> dict | None:
    """A cache file's JSON header, or None if the file is not one (too short, another kind, corrupt)."""
    try:
        head = os.pread(fd, 16, 0)
        if len(head) < 16 or head[:8] != _MAGIC:
            return None
        n = int.from_bytes(head[8:], "little")
        text = os.pread(fd, n, 16) if n <= 64 << 20 else b""
        header = json.loads(text) if len(text) == n else None
        return header if isinstance(header, dict) else None
    except (OSError, ValueError):
        return None


def _pwrite(fd: int, data: bytes | np.ndarray, offset: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _fill(layout: ChunkLayout, c: int, source: ChunkReader | Mapping[str, Any], out: np.ndarray) -> None:
    """Chunk ``c`` into ``out``: read from a reader, or packed from tensors by pstar-train's own path."""
    if hasattr(source, "read_into"):
        source.read_into(c, out)
        return
    import jax.numpy as jnp  # packed as the engine packs: the same cast, so the same bytes
    out[...] = np.asarray(pack_chunk(layout, c, source.__getitem__).astype(jnp.dtype(out.dtype)))


__all__ = ["SafetensorsChunks", "ChunkCache", "Piece", "CACHE_FILE", "layout_digest"]
