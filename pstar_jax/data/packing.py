"""Packed SFT data: whole examples packed into rows of ``seq_len + 1`` positions, and their file.

Each row position has a token, a segment (0 = padding, k >= 1 the k-th example of the row) and a
label (1 where the token is trained as a target); see SFT_INTERFACE.md for how a batch is built.

Packing is best-fit decreasing (at least as tight as first-fit decreasing): examples in order of
falling length go into the row with the least room that still fits them. Rows are kept in buckets
by their free positions, with a sorted list of the non-empty buckets, so n examples cost
O(n log n). Ties between equal lengths and the final row order are shuffled by the seed.

The file ``NAME.sft.u16.bin`` / ``NAME.sft.u32.bin`` (the token width by vocabulary, as plain token
files) is a 64-byte header, then tokens, segments and labels, each [rows, seq_len + 1] and
starting at a multiple of 64 bytes, so each memory-maps on its own. Header: magic ``PSTARSFT``,
then little-endian u32 version, u32 token itemsize, u32 segment itemsize, u32 zero, u64 rows,
u64 seq_len, u64 vocab_size. The JSON sidecar ``NAME.sft.uXX.bin.json`` holds the rest.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import numpy as np

from pstar_jax.data.batch import trained_targets
from pstar_jax.data.token_files import io_errors, sidecar_path, token_dtype, token_suffix, write_atomic
from pstar_jax.config.errors import DataError
from pstar_jax.config.paths import create_temp_beside

MAGIC = b"PSTARSFT"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIIIQQQ")
_ALIGN = 64
FILL_TOKENS = 1 << 22
SCAN_POSITIONS = 1 << 20  # load_packed looks for a trained target this many positions at a time
ZEROS_BYTES = 1 << 20  # a file system without posix_fallocate gets its space in writes of this many


@dataclasses.dataclass
class Examples:
    """Many examples in flat arrays (cheap for millions): example i is ``tokens[starts[i]:starts[i] + lengths[i]]``."""

    tokens: np.ndarray  # uint32
    labels: np.ndarray  # uint8
    lengths: np.ndarray  # int64

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> Examples:
        pairs = list(pairs)
        return cls.concatenate([np.asarray(t) for t, _ in pairs], [np.asarray(l) for _, l in pairs],
                               [np.asarray([len(t) for t, _ in pairs], np.int64)])

    @classmethod
    def concatenate(cls, tokens: list[np.ndarray], labels: list[np.ndarray], lengths: list[np.ndarray]) -> Examples:
        """The examples of batches, each given as flat tokens, labels and lengths."""
        def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
        return cls(cat(tokens, np.uint32), cat(labels, np.uint8), cat(lengths, np.int64))


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Packed rows: ``tokens``, ``segments``, ``labels`` of shape [rows, seq_len + 1]; ``info`` the sidecar."""

    tokens: np.ndarray
    segments: np.ndarray
    labels: np.ndarray
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def vocab_size(self) -> int:
        return int(self.info["vocab_size"])


def assign_rows(lengths: np.ndarray, row_len: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(row of each example, its offset in the row, number of rows): best-fit decreasing, then the
    rows shuffled. Every length must be in [1, row_len]."""
    lengths = np.asarray(lengths, np.int64)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]  # longest first, ties in seeded order
    row_of, offset_of = np.empty(len(lengths), np.int64), np.empty(len(lengths), np.int64)
    buckets: dict[int, list[int]] = {}  # free positions -> rows with exactly that many
    free_sizes: list[int] = []  # the non-empty keys of buckets, sorted
    used: list[int] = []  # positions used per row
    for i in order.tolist():
        need = int(lengths[i])
        k = bisect.bisect_left(free_sizes, need)
        if k == len(free_sizes):
            row, used_now = len(used), 0
            used.append(0)
        else:
            free = free_sizes[k]
            bucket = buckets[free]
            row = bucket.pop()
            if not bucket:
                del buckets[free]
                free_sizes.pop(k)
            used_now = used[row]
        row_of[i], offset_of[i] = row, used_now
        used[row] = used_now + need
        if (left := row_len - used[row]) > 0:
            if left not in buckets:
                buckets[left] = []
                bisect.insort(free_sizes, left)
            buckets[left].append(row)
    shuffled = rng.permutation(len(used))  # row r goes to position shuffled[r]
    return shuffled[row_of] if len(used) else row_of, offset_of, len(used)


def pack(examples: Examples | Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, seed: int = 0) -> PackedRows:
    """Packs ``examples`` (an Examples, or (ids, labels) pairs; each 1 to seq_len + 1 tokens) into rows
    (``info`` holds vocab_size: the largest id + 1)."""
    if not isinstance(examples, Examples):
        examples = Examples.from_pairs(examples)
    row_of, offset_of, rows = assign_rows(examples.lengths, seq_len + 1, seed)
    out = empty_rows(rows, seq_len + 1, int(examples.tokens.max(initial=0)) + 1)
    fill_rows(examples, row_of, offset_of, out)
    return out


def fill_rows(examples: Examples, row_of: np.ndarray, offset_of: np.ndarray, out: PackedRows) -> None:
    """Writes the examples into ``out``'s arrays (zeros, or memory maps of a file being written) at
    the places ``assign_rows`` chose."""
    row_len = out.tokens.shape[1]
    starts, lengths = examples.starts, examples.lengths
    if len(lengths) and (lengths.min() < 1 or lengths.max() > row_len):
        raise DataError(f"examples must hold 1 to seq_len + 1 = {row_len} tokens to be packed")
    # Segment number: the rank of the example's offset within its row (examples numbered in row order).
    by_place = np.lexsort((offset_of, row_of))
    first_in_row = np.searchsorted(row_of[by_place], row_of[by_place], side="left")
    segment_of = np.empty(len(lengths), np.int64)
    segment_of[by_place] = np.arange(len(lengths)) - first_in_row + 1
    flat_tokens, flat_segments, flat_labels = (a.reshape(-1) for a in (out.tokens, out.segments, out.labels))
    # About FILL_TOKENS tokens at a time: bounded index arrays for any number or length of examples.
    ends = np.cumsum(lengths)
    cuts = np.unique(np.searchsorted(ends, np.arange(FILL_TOKENS, int(ends[-1]) if len(ends) else 0, FILL_TOKENS)))
    for lo, hi in zip([0, *(cuts + 1).tolist()], [*(cuts + 1).tolist(), len(lengths)]):
        sl = slice(lo, hi)
        n = lengths[sl]
        if not len(n):
            continue
        src = np.repeat(starts[sl], n) + _ranges(n)
        dst = np.repeat(row_of[sl] * row_len + offset_of[sl], n) + _ranges(n)
        flat_tokens[dst] = examples.tokens[src]
        flat_labels[dst] = examples.labels[src]
        flat_segments[dst] = np.repeat(segment_of[sl], n)


def _ranges(n: np.ndarray) -> np.ndarray:
    """concatenate(arange(k) for k in n)."""
    ends = np.cumsum(n)
    return np.arange(ends[-1]) - np.repeat(ends - n, n)


def segment_dtype(row_len: int) -> np.dtype:
    return np.dtype(np.uint16 if row_len <= np.iinfo(np.uint16).max else np.uint32)


def empty_rows(rows: int, row_len: int, vocab_size: int) -> PackedRows:
    shape = (rows, row_len)
    return PackedRows(np.zeros(shape, token_dtype(vocab_size)), np.zeros(shape, segment_dtype(row_len)),
                      np.zeros(shape, np.uint8), {"vocab_size": vocab_size})


def real_position_fraction(segments: np.ndarray) -> float:
    return float(np.count_nonzero(segments)) / max(segments.size, 1)


# -- the file ---------------------------------------------------------------------------------


def packed_suffix(vocab_size: int) -> str:
    return ".sft" + token_suffix(token_dtype(vocab_size))


def is_packed_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is named as a packed SFT file (*.sft.u16.bin, *.sft.u32.bin) or starts with its
    header; ``load_packed`` then reads it or says what is wrong with it."""
    path = Path(path)
    if path.name.endswith((".sft.u16.bin", ".sft.u32.bin")):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:  # absent, a directory, unreadable: not one
        return False


def _layout(rows: int, row_len: int, token_size: int, segment_size: int) -> tuple[int, int, int, int]:
    """Byte offsets of tokens, segments and labels, and the file size."""
    up = lambda n: -(-n // _ALIGN) * _ALIGN  # noqa: E731
    numel = rows * row_len
    tokens_at = HEADER_BYTES
    segments_at = up(tokens_at + numel * token_size)
    labels_at = up(segments_at + numel * segment_size)
    return tokens_at, segments_at, labels_at, labels_at + numel


def check_packed_destination(path: str | os.PathLike, vocab_size: int, overwrite: bool) -> Path:
    path, suffix = Path(path), packed_suffix(vocab_size)
    if path.is_dir():
        raise DataError(f"output {path} is a directory; name a file such as {path / ('train' + suffix)}")
    if not path.name.endswith(suffix):
        stem = path.name
        for s in (".sft.u16.bin", ".sft.u32.bin", ".u16.bin", ".u32.bin", ".bin"):
            if stem.endswith(s):
                stem = stem[:-len(s)]
                break
        raise DataError(f"packed SFT file {path} would hold {token_dtype(vocab_size)} tokens (vocabulary of "
                        f"{vocab_size:,}), so its name must end in {suffix}: name it {path.with_name(stem + suffix)}")
    if path.exists() and not overwrite:
        raise DataError(f"{path} already exists; pass overwrite=True (--overwrite) to replace it")
    return path


def _allocate(f: BinaryIO, size_bytes: int) -> None:
    """Gives the open file ``f`` its ``size_bytes`` on disk now. The rows are then written through
    memory maps, and a store into a mapped page the disk has no room for kills the process with
    SIGBUS; a full disk found here is an OSError (ENOSPC) instead."""
    f.flush()
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(f.fileno(), 0, size_bytes)
            return
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # a file system without it: zeros below
                raise
    f.seek(0, os.SEEK_END)
    zeros = bytes(ZEROS_BYTES)
    for left in range(size_bytes - f.tell(), 0, -len(zeros)):
        f.write(zeros[:left])
    f.flush()


class PackedWriter:
    """A packed file being written under a hidden temporary name: ``rows`` are memory maps into it;
    ``commit`` renames it into place and writes the sidecar (a crash leaves the target as it was)."""

    def __init__(self, path: str | os.PathLike, rows: int, seq_len: int, vocab_size: int, overwrite: bool = False):
        self.path = check_packed_destination(path, vocab_size, overwrite)
        row_len = seq_len + 1
        tdt, sdt = token_dtype(vocab_size), segment_dtype(row_len)
        at_tokens, at_segments, at_labels, size = _layout(rows, row_len, tdt.itemsize, sdt.itemsize)
        with io_errors(self.path, "write"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = create_temp_beside(self.path)
        self._tmp = Path(tmp)
        try:
            with io_errors(self.path, "write"), os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, tdt.itemsize, sdt.itemsize, 0, rows, seq_len, vocab_size))
                _allocate(f, size)
            shape = (rows, row_len)
            view = lambda dtype, at: (np.memmap(tmp, dtype, "r+", at, shape) if rows  # noqa: E731
                                      else np.zeros(shape, dtype))
            self.rows = PackedRows(view(tdt, at_tokens), view(sdt, at_segments), view(np.uint8, at_labels),
                                   {"vocab_size": vocab_size})
        except BaseException:
            self.abort()
            raise

    def commit(self, info: dict) -> dict:
        side = sidecar_path(self.path)
        try:
            with io_errors(self.path, "write"):
                for array in (self.rows.tokens, self.rows.segments, self.rows.labels):
                    if isinstance(array, np.memmap):
                        array.flush()
                with open(self._tmp, "rb+") as f:
                    os.fsync(f.fileno())
            with io_errors(side, "write"):
                side.unlink(missing_ok=True)  # no sidecar beats a stale one
            with io_errors(self.path, "write"):
                os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        write_atomic(side, json.dumps(info, indent=1).encode() + b"\n")
        return info

    def abort(self) -> None:
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> PackedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def sidecar_info(rows: PackedRows, **extra: Any) -> dict:
    """The sidecar's fields that follow from the arrays; ``extra`` adds the tokenizer's and the counts."""
    return {"format": "pstar-sft", "version": VERSION, "seq_len": rows.seq_len, "rows": rows.rows,
            "token_dtype": np.dtype(rows.tokens.dtype).name, "segment_dtype": np.dtype(rows.segments.dtype).name,
            "real_position_fraction": real_position_fraction(rows.segments), **extra}


def write_packed(path: str | os.PathLike, rows: PackedRows, info: dict, overwrite: bool = False) -> dict:
    """Atomically writes ``rows`` (tokens, segments, labels [R, seq_len + 1]) and the sidecar ``info``
    (vocab_size required; format, version, seq_len, rows, dtypes filled in)."""
    if "vocab_size" not in info:
        raise DataError("the packed file's info needs its vocab_size")
    shape = np.shape(rows.tokens)
    if len(shape) != 2 or shape[1] < 2 or np.shape(rows.segments) != shape or np.shape(rows.labels) != shape:
        raise DataError(f"packed rows need tokens, segments and labels of one shape [rows, seq_len + 1], got "
                        f"{shape}, {np.shape(rows.segments)}, {np.shape(rows.labels)}")
    with PackedWriter(path, shape[0], shape[1] - 1, int(info["vocab_size"]), overwrite) as writer:
        for name in ("tokens", "segments", "labels"):
            getattr(writer.rows, name)[...] = np.asarray(getattr(rows, name))
        return writer.commit({**info, **sidecar_info(writer.rows)})


def load_packed(path: str | os.PathLike) -> PackedRows:
    """Memory-maps a packed SFT file read-only; DataError (one line) for a malformed one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"packed SFT file {path} does not exist; make one with `pstar-tokens --chat`")
    with io_errors(path, "read"), open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
        raise DataError(f"{path} is not a packed SFT file (no PSTARSFT header); make it with `pstar-tokens --chat`")
    _, version, token_size, segment_size, _, rows, seq_len, vocab_size = _HEADER.unpack(head[:_HEADER.size])
    if version != VERSION:
        raise DataError(f"{path} is a packed SFT file of version {version}; this pstar_jax reads version "
                        f"{VERSION}: rewrite it with this pstar-tokens")
    dtypes = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
    if token_size not in dtypes or segment_size not in dtypes or seq_len < 1:
        raise DataError(f"{path} has a malformed packed SFT header; rewrite it with pstar-tokens --chat")
    row_len, tdt, sdt = seq_len + 1, dtypes[token_size], dtypes[segment_size]
    at_tokens, at_segments, at_labels, size = _layout(rows, row_len, token_size, segment_size)
    if (actual := path.stat().st_size) != size:
        raise DataError(f"{path} has {actual:,} bytes but its header describes {size:,} ({rows} rows of "
                        f"{row_len}); the file is truncated or damaged: rewrite it with pstar-tokens --chat")
    info = {"format": "pstar-sft", "version": version, "seq_len": seq_len, "rows": rows, "vocab_size": vocab_size,
            "token_dtype": tdt.name}
    side = sidecar_path(path)
    if side.is_file():
        try:
            recorded = json.loads(side.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {side}: {getattr(e, 'strerror', None) or e}; delete it or rewrite "
                            f"{path.name}") from None
        if not isinstance(recorded, dict) or recorded.get("rows") != rows or recorded.get("seq_len") != seq_len:
            raise DataError(f"{side} does not describe {path} ({rows} rows of seq_len {seq_len}); it is stale: "
                            f"rewrite the file with pstar-tokens --chat")
        info = {**recorded, **info}
    shape = (rows, row_len)
    view = lambda dtype, at: np.memmap(path, dtype, "r", at, shape) if rows else np.zeros(shape, dtype)  # noqa: E731
    try:
        packed = PackedRows(view(tdt, at_tokens), view(sdt, at_segments), view(np.uint8, at_labels), info)
        trains = not rows or trains_any(packed)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    if not trains:  # its loss would be 0 over 0 targets at every step, and nothing learnt
        raise DataError(f"{path} trains no token (no position is labelled as a target within its example), so "
                        f"training on it would learn nothing; repack it with pstar-tokens --chat from conversations "
                        f"with assistant turns its chat template marks, or with --train-on-prompt")
    return packed


def trains_any(rows: PackedRows) -> bool:
    """Whether some target of ``rows`` is trained; stops at the first block that has one, so a
    memory-mapped file of GBs costs a few pages (all of them only when nothing is trained)."""
    block = max(1, SCAN_POSITIONS // rows.tokens.shape[1])
    for lo in range(0, rows.rows, block):
        labels = np.asarray(rows.labels[lo:lo + block])
        if labels[:, 1:].any() and trained_targets(np.asarray(rows.segments[lo:lo + block]), labels).any():
            return True
    return False
