"""Packed SFT rows as training data: resumable batches, the held-out split and an evaluation set.

A packed SFT file (pstar_jax.data.packing) holds ``rows`` of ``seq_len + 1`` positions, each row
several whole examples, as three arrays [rows, seq_len + 1]: tokens, segments (0 padding, k for
the k-th example) and labels (1 where the token is trained as a target). Any object with those
three attributes serves (``packing.PackedRows``, or ``Rows`` here); the arrays may be memmaps,
and only the rows a batch reads are touched. A row is one training sequence: ``PackedBatches``
reads rows in an order shuffled afresh each epoch, as ``Batches`` reads windows, and yields
``Batch``es (pstar_jax.data.batch.from_rows).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pstar_jax.data.batch import Batch, from_rows
from pstar_jax.data.stream import HELD_OUT_FRACTION, ShuffledStream
from pstar_jax.config.errors import DataError


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
                        f"repack it with `pstar-tokens --chat --seq-len {seq_len}` or train at ModelConfig.seq_len "
                        f"{first[1] - 1}")
    return first[0]


def _take(rows: Any, index: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.asarray(getattr(rows, name)[index]) for name in Rows._fields)


class PackedBatches(ShuffledStream):
    """Endless iterator of ``Batch``es of packed rows, ``batch_size`` rows each (this process's
    block of ``batch_size // process_count`` rows at its index), resumable from ``position``."""

    def __init__(self, rows: Any, batch_size: int, seed: int, *, seq_len: int | None = None,
                 process_index: int = 0, process_count: int = 1, position: int = 0, ref: Any = None) -> None:
        super().__init__(check_rows(rows, seq_len), batch_size, seed, process_index, process_count, position)
        self.rows, self.seq_len = rows, np.shape(rows.tokens)[1] - 1
        self.ref = ref  # a stored reference (pstar_jax.data.ref_logps.RefLogps) whose values each batch carries

    @property
    def rows_per_epoch(self) -> int:
        return self.per_epoch

    def __next__(self) -> Batch:
        items = self.next_items()
        batch = from_rows(*_take(self.rows, items))
        return batch if self.ref is None else self.ref.attach(batch, items)  # keyed by row: rows are shuffled


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
    return [from_rows(*_take(rows, index))
            for index in eval_row_index(n, batch_size, micro_batches, process_index, process_count)]


def eval_row_index(n: int, batch_size: int, micro_batches: int, process_index: int = 0, process_count: int = 1
                   ) -> list[np.ndarray]:
    """The rows (of ``n``) that ``packed_eval_batches`` takes for each micro-batch, this process's."""
    if batch_size % process_count:
        raise DataError(f"batch_size {batch_size} must be divisible by process_count {process_count}")
    local = batch_size // process_count
    return [(m * batch_size + process_index * local + np.arange(local)) % n for m in range(micro_batches)]
