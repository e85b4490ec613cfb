"""Resumable batches of token windows, and a held-out split and evaluation set of them.

``Batches`` cuts the tokens into windows of ``seq_len + 1`` at stride ``seq_len`` (so each token
is a target once per epoch) and reads them in an order shuffled afresh each epoch. The stream is
a pure function of (seed, batch index), so ``position`` alone is enough to resume exactly.
``held_out_split`` keeps the last 1% of the tokens out of training for a held-out loss, and
``eval_batches`` cuts a fixed evaluation set from held-out tokens. Both yield ``Batch``es
(pstar_jax.data.batch) of plain data. Packed SFT rows have theirs in pstar_jax.data.rows, on the
same ``ShuffledStream``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pstar_jax.config.errors import DataError
from pstar_jax.data.batch import Batch, plain
from pstar_jax.data.token_files import check_tokens


class ShuffledStream:
    """An endless stream of items (windows of a token file, packed rows) in an order shuffled
    afresh each epoch, read ``batch_size`` global rows at a time.

    ``position`` counts the global batches already consumed, and each epoch's order is a pure
    function of (seed, epoch), so a stream made with ``position=k`` yields what the k-th batch
    onward of a fresh one would. With ``process_count`` > 1 each process gets the contiguous block
    of ``batch_size // process_count`` rows at its index.
    """

    def __init__(self, per_epoch: int, batch_size: int, seed: int, process_index: int, process_count: int,
                 position: int) -> None:
        if batch_size < 1 or min(seed, position) < 0:
            raise DataError(f"need batch_size >= 1 and seed, position >= 0, got {batch_size}, {seed}, {position}")
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index must be in [0, {process_count}), got {process_index}")
        if batch_size % process_count:
            raise DataError(f"batch_size {batch_size} must be divisible by process_count {process_count}")
        self.per_epoch, self.batch_size, self.seed = per_epoch, batch_size, seed
        self.process_index, self.position = process_index, position
        self._local_rows = batch_size // process_count
        self._perm_cache: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def _perm(self, epoch: int) -> np.ndarray:
        # Seeding by (seed, epoch) gives any epoch's order without replaying the ones before,
        # so resuming at any position costs the same as starting.
        if self._perm_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache = (epoch, rng.permutation(self.per_epoch))
        return self._perm_cache[1]

    def state(self) -> dict[str, int]:
        """JSON-able resume state: pass ``position`` back to the constructor."""
        return {"position": self.position}

    def __iter__(self) -> ShuffledStream:
        return self

    def next_items(self) -> np.ndarray:
        """Which items this process's rows of the next global batch are (and advance)."""
        # The items form one endless stream, epoch after epoch; a batch may span an epoch
        # boundary (or several, when the data holds fewer items than a batch).
        first = self.position * self.batch_size + self.process_index * self._local_rows
        self.position += 1
        return shuffled_rows(first, self._local_rows, self.per_epoch, self._perm)


class Batches(ShuffledStream):
    """Endless iterator of plain ``Batch``es of token windows; targets are inputs shifted by one."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, *,
                 process_index: int = 0, process_count: int = 1, position: int = 0) -> None:
        check_tokens(tokens)
        if seq_len < 1:
            raise DataError(f"need seq_len >= 1, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise DataError(f"data has {len(tokens)} tokens, fewer than one window of "
                            f"seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")
        super().__init__((len(tokens) - 1) // seq_len, batch_size, seed, process_index, process_count, position)
        self.tokens, self.seq_len = tokens, seq_len

    @property
    def windows_per_epoch(self) -> int:
        return self.per_epoch

    def __next__(self) -> Batch:
        starts = self.next_items() * self.seq_len
        windows = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], np.int32)
        return plain(windows[:, :-1], windows[:, 1:])


def shuffled_rows(first: int, count: int, per_epoch: int, perm: Any) -> np.ndarray:
    """Rows ``first .. first + count - 1`` of the endless stream of epochs, each epoch the order
    ``perm(epoch)`` of its ``per_epoch`` rows: which row of the data each one is."""
    epochs, slots = np.divmod(first + np.arange(count), per_epoch)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        rows = epochs == epoch
        out[rows] = perm(int(epoch))[slots[rows]]
    return out


HELD_OUT_FRACTION = 0.01  # of the training tokens, held out for the loss of --eval-every without --eval-data


def held_out_split(tokens: np.ndarray, fraction: float = HELD_OUT_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the last ``fraction`` of the tokens (at least one) held out.

    Both are views (a memmapped file stays memmapped). ``Batches`` over the first part reads no
    token of the second: its windows end within the tokens it is given."""
    check_tokens(tokens)
    held = max(1, int(len(tokens) * fraction))
    return tokens[:len(tokens) - held], tokens[len(tokens) - held:]


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, micro_batches: int, *,
                 process_index: int = 0, process_count: int = 1, what: str = "the evaluation data"
                 ) -> list[Batch]:
    """The fixed held-out set: ``micro_batches`` micro-batches of ``batch_size`` windows, taken in
    order from the start of ``tokens`` at stride ``seq_len`` (over again when the tokens hold
    fewer windows), this process's rows of each. The same set every time, so losses compare
    across steps. Raises DataError, naming ``what``, when the tokens hold no whole window."""
    check_tokens(tokens)
    if len(tokens) < seq_len + 1:
        raise DataError(f"{what} holds {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                        f"{seq_len + 1}; use more data or a shorter seq_len")
    if batch_size % process_count:
        raise DataError(f"batch_size {batch_size} must be divisible by process_count {process_count}")
    windows = (len(tokens) - 1) // seq_len
    rows = batch_size // process_count
    out = []
    for m in range(micro_batches):
        first = m * batch_size + process_index * rows
        starts = (first + np.arange(rows)) % windows * seq_len
        block = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], np.int32)
        out.append(plain(block[:, :-1], block[:, 1:]))
    return out
