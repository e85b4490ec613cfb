"""Packed SFT rows as training data: resumable batches, the held-out split and an evaluation set.

A packed SFT file (pstar_jax.packing) holds ``rows`` of ``seq_len + 1`` positions, each row
several whole examples, as three arrays [rows, seq_len + 1]: tokens, segments (0 padding, k for
the k-th example) and labels (1 where the token is trained as a target). Any object with those
three attributes serves (``packing.PackedRows``, or ``Rows`` here); the arrays may be memmaps,
and only the rows a batch reads are touched. A row is one training sequence: ``PackedBatches``
reads rows in an order shuffled afresh each epoch, as ``Batches`` reads windows, and yields
``Batch``es (pstar_jax.batch.from_rows).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pstar_jax.batch import Batch, from_rows
from pstar_jax.data import HELD_OUT_FRACTION, DataError, shuffled_rows


class Rows(NamedTuple):
    """Packed rows: three arrays [rows, seq_len + 1] (see the module docstring)."""
    tokens: Any
    segments: Any
    labels: Any


def is_rows(data: Any) -> bool:
    return all(hasattr(data, name) for name in Rows._fields)


def check_rows(rows: Any, seq_len: int | None = None, what: str = "the SFT data") -> int:
    """The number of rows; DataError when the arrays disagree or were packed for another seq_len."""
    shapes = {name: np.shape(getattr(rows, name)) for name in Rows._fields}
    first = shapes["tokens"]
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise DataError(f"{what} must be three arrays [rows, seq_len + 1] of one shape, got "
                        + ", ".join(f"{n} {s}" for n, s in shapes.items()))
    if first[0] < 1:
        raise DataError(f"{what} holds no rows; pack more examples")
    if seq_len is not None and first[1] != seq_len + 1:
        raise DataError(f"{what} was packed for seq_len {first[1] - 1}, but the model trains at seq_len {seq_len}; "
                        f"repack it with --seq-len {seq_len} or train at --seq-len {first[1] - 1}")
    return first[0]


def _take(rows: Any, index: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.asarray(getattr(rows, name)[index]) for name in Rows._fields)


class PackedBatches:
    """Endless iterator of ``Batch``es of packed rows, ``batch_size`` rows each (this process's
    block of ``batch_size // process_count`` rows at its index).

    ``position`` counts the global batches already consumed, and the order of each epoch is a
    pure function of (seed, epoch), so ``PackedBatches(..., position=k)`` resumes exactly."""

    def __init__(self, rows: Any, batch_size: int, seed: int, *, seq_len: int | None = None,
                 process_index: int = 0, process_count: int = 1, position: int = 0) -> None:
        self.rows_per_epoch = check_rows(rows, seq_len)
        if batch_size < 1 or min(seed, position) < 0:
            raise DataError(f"need batch_size >= 1 and seed, position >= 0, got {batch_size}, {seed}, {position}")
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index must be in [0, {process_count}), got {process_index}")
        if batch_size % process_count:
            raise DataError(f"batch_size {batch_size} must be divisible by process_count {process_count}")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.seq_len = np.shape(rows.tokens)[1] - 1
        self.process_index, self.position = process_index, position
        self._local_rows = batch_size // process_count
        self._perm_cache: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def _perm(self, epoch: int) -> np.ndarray:
        if self._perm_cache[0] != epoch:  # any epoch's order without replaying the ones before
            self._perm_cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.rows_per_epoch))
        return self._perm_cache[1]

    def state(self) -> dict[str, int]:
        """JSON-able resume state: pass ``position`` back to the constructor."""
        return {"position": self.position}

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> Batch:
        first = self.position * self.batch_size + self.process_index * self._local_rows
        index = shuffled_rows(first, self._local_rows, self.rows_per_epoch, self._perm)
        self.position += 1
        return from_rows(*_take(self.rows, index))


def held_out_rows(rows: Any, fraction: float = HELD_OUT_FRACTION) -> tuple[Rows, Rows]:
    """(training rows, held-out rows): the last ``fraction`` of the rows (at least one) held out.
    Views of the arrays (memmaps stay memmapped); rows hold whole examples, so no example is in both."""
    n = check_rows(rows)
    if n < 2:
        raise DataError("the SFT data holds 1 row, too few to hold some out for --eval-every; pack more "
                        "examples or give --eval-data")
    held = max(1, int(n * fraction))
    return (Rows(*(getattr(rows, f)[:n - held] for f in Rows._fields)),
            Rows(*(getattr(rows, f)[n - held:] for f in Rows._fields)))


def packed_eval_batches(rows: Any, batch_size: int, micro_batches: int, *, seq_len: int | None = None,
                        process_index: int = 0, process_count: int = 1, what: str = "the evaluation data"
                        ) -> list[Batch]:
    """The fixed held-out set: ``micro_batches`` micro-batches of ``batch_size`` rows taken in order
    from the first row (over again when there are fewer), this process's rows of each."""
    n = check_rows(rows, seq_len, what)
    if batch_size % process_count:
        raise DataError(f"batch_size {batch_size} must be divisible by process_count {process_count}")
    local = batch_size // process_count
    out = []
    for m in range(micro_batches):
        first = m * batch_size + process_index * local
        out.append(from_rows(*_take(rows, (first + np.arange(local)) % n)))
    return out
