"""How fast this machine's local disk gives back frozen chunks: a reading of the files already in
a directory (a base's safetensors shards, or a chunk cache), taken by ``pstar-machine --disk DIR``
and kept with the other rates (``Machine.disk_read_bytes_per_s``, ``disk_tensor_bytes_per_s``).

Two rates, because the planner's disk tier reads two ways: whole chunks from a cache file
(contiguous reads, ``read_rate``), or tensors straight from safetensors files, each transposed and
cast into a chunk's layout on the CPU (``tensor_rate``: the read and the transpose together).

Nothing is written, and no file's contents or times change: each file is read after
``posix_fadvise(DONTNEED)`` has asked the kernel to drop its cached pages (so the reading is the
disk's, not memory's), and dropped again after, so a reading does not leave gigabytes of the base
in the page cache. Files are read largest first, at most ``READ_LIMIT`` bytes or ``READ_SECONDS``
per rate. The directory is the user's: links are not followed, and a safetensors header that is
not one is skipped (the contiguous rate still counts its bytes).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from pstar_jax.config import ConfigError

BLOCK = 64 << 20  # one read: about a chunk's piece
READ_LIMIT = 2 << 30  # bytes read per rate, at most
READ_SECONDS = 10.0  # and at most this long
MIN_BYTES = 16 << 20  # a directory with less than this to read gives no reading worth keeping
MAX_HEADER = 100 << 20  # a safetensors header longer than this is not one

_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}


def _files(directory: Path) -> list[Path]:
    """The regular files directly in ``directory`` (no links), largest first."""
    files = [p for p in directory.iterdir() if p.is_file() and not p.is_symlink()]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def _drop_cached(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):  # Linux; elsewhere the reading may include cached pages
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _read(path: Path, offset: int, nbytes: int, into: np.ndarray) -> int:
    """Read ``nbytes`` of ``path`` from ``offset`` in blocks, from the disk, into ``into`` (uint8):
    all of them when it is that long, else each block over its start; the bytes read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        _drop_cached(fd)
        done = 0
        while done < nbytes:
            at = done if len(into) >= nbytes else 0
            view = memoryview(into)[at:at + min(BLOCK, nbytes - done)]
            got = os.preadv(fd, [view], offset + done)
            if got <= 0:
                break  # the file is shorter than it said
            done += got
        _drop_cached(fd)
        return done
    finally:
        os.close(fd)


def read_rate(files: list[Path], limit: int = READ_LIMIT, seconds: float = READ_SECONDS) -> float:
    """Bytes per second of contiguous reads of ``files`` in blocks of ``BLOCK``."""
    buffer = np.empty(BLOCK, np.uint8)
    total, start = 0, time.perf_counter()
    for path in files:
        size = path.stat().st_size
        for offset in range(0, size, BLOCK):
            total += _read(path, offset, min(BLOCK, size - offset), buffer)
            if total >= limit or time.perf_counter() - start >= seconds:
                return total / (time.perf_counter() - start)
    return total / max(time.perf_counter() - start, 1e-9)


def _tensors(path: Path) -> list[tuple[int, int, tuple[int, ...], str]]:
    """(offset, nbytes, shape, dtype) of the 2-D tensors of a safetensors file in a dtype a chunk
    is built from; [] when the file is not safetensors."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(MAX_HEADER, path.stat().st_size - 8):
                return []
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return []
    out = []
    for name, entry in header.items() if isinstance(header, dict) else ():
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(x) for x in entry["shape"])
            dtype = entry["dtype"]
        except (KeyError, TypeError, ValueError):
            continue  # __metadata__, or not a tensor entry
        if len(shape) == 2 and dtype in _DTYPES and end - begin == np.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize:
            out.append((8 + n + begin, end - begin, shape, dtype))
    return out


def tensor_rate(files: list[Path], limit: int = READ_LIMIT, seconds: float = READ_SECONDS) -> float:
    """Bytes per second of reading 2-D tensors of the safetensors ``files`` and transposing each
    into a bf16 chunk's layout (a Hugging Face kernel is stored (out, in), a chunk holds (in, out));
    0.0 when no file holds one."""
    pieces = sorted((t + (path,) for path in files if path.suffix == ".safetensors" for t in _tensors(path)),
                    key=lambda t: t[1], reverse=True)
    total, start = 0, time.perf_counter()
    for offset, nbytes, shape, dtype, path in pieces:
        raw = np.empty(nbytes, np.uint8)
        if _read(path, offset, nbytes, raw) < nbytes:
            continue  # the file is shorter than its header says
        np.ascontiguousarray(raw.view(_DTYPES[dtype]).reshape(shape).T).astype(ml_dtypes.bfloat16, copy=False)
        total += nbytes
        if total >= limit or time.perf_counter() - start >= seconds:
            break
    return total / (time.perf_counter() - start) if total else 0.0


def disk_files(directory: str | os.PathLike) -> list[Path]:
    """The files ``measure_disk`` reads in ``directory``, largest first; one ConfigError line when it
    is not a directory or holds too little to read."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"--disk {directory} is not a directory; pass the directory the frozen base (or its "
                          f"chunk cache) will be read from")
    files = _files(root)
    if sum(p.stat().st_size for p in files) < MIN_BYTES:
        raise ConfigError(f"--disk {directory} holds less than {MIN_BYTES >> 20} MiB of files to read; pass the "
                          f"directory of the base's safetensors files (nothing is written there)")
    return files


def measure_disk(files: list[Path]) -> tuple[float, float]:
    """(contiguous bytes/s, safetensors tensor bytes/s) reading ``files`` (``disk_files``)."""
    return read_rate(files), tensor_rate(files)


__all__ = ["disk_files", "measure_disk", "read_rate", "tensor_rate", "BLOCK", "READ_LIMIT", "READ_SECONDS", "MIN_BYTES"]
