"""Either kind of training data, token windows (np.ndarray) or packed SFT rows
(pstar_jax.data.rows): ``open_training_data`` reads either kind of file, and ``training_batches``,
``held_out`` and ``evaluation_set`` take either kind of data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from pstar_jax.data.batch import Batch
from pstar_jax.data.corpus import default_corpus
from pstar_jax.data.packing import load_packed
from pstar_jax.data.rows import PackedBatches, held_out_rows, is_rows, packed_eval_batches
from pstar_jax.data.stream import Batches, eval_batches, held_out_split
from pstar_jax.data.token_files import check_vocab, load_tokens

SFT_SUFFIXES = (".sft.u16.bin", ".sft.u32.bin")


def open_training_data(path: str | os.PathLike | None, vocab_size: int) -> Any:
    """The data a path names, checked against the vocabulary: a packed SFT file's rows (an object
    with ``tokens``, ``segments``, ``labels`` [rows, seq_len + 1]), a token file's tokens, or
    without a path the built-in corpus."""
    if path is not None and Path(path).name.endswith(SFT_SUFFIXES):
        rows = load_packed(path)
        check_vocab(np.asarray(rows.tokens).reshape(-1), vocab_size)
        return rows
    tokens = load_tokens(path) if path else default_corpus()
    check_vocab(tokens, vocab_size)
    return tokens


def is_packed(data: Any) -> bool:
    """Whether the data is packed SFT rows (else a 1-D array of tokens)."""
    return not isinstance(data, np.ndarray) and is_rows(data)


def training_batches(data: Any, batch_size: int, seq_len: int, seed: int, ref: Any = None, **kwargs: int) -> Any:
    """``Batches`` over tokens or ``PackedBatches`` over rows (kwargs: process_index,
    process_count, position); ``ref`` a stored reference the rows' batches carry (preference rows)."""
    if is_packed(data):
        return PackedBatches(data, batch_size, seed, seq_len=seq_len, ref=ref, **kwargs)
    return Batches(data, batch_size, seq_len, seed, **kwargs)


def held_out(data: Any) -> tuple[Any, Any]:
    """(training data, held-out data): the last 1% of the tokens, or of the rows."""
    if is_packed(data):
        return held_out_rows(data)
    return held_out_split(data)


def evaluation_set(data: Any, batch_size: int, seq_len: int, micro_batches: int, **kwargs: Any) -> list[Batch]:
    """``eval_batches`` over tokens or ``packed_eval_batches`` over rows (kwargs: process_index,
    process_count, what)."""
    if is_packed(data):
        return packed_eval_batches(data, batch_size, micro_batches, seq_len=seq_len, **kwargs)
    return eval_batches(data, batch_size, seq_len, micro_batches, **kwargs)
