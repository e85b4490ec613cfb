"""A batch: the tokens and everything per position a stage may read beside them.

Every stage's ``apply(params, x, batch)`` gets the micro-batch's ``Batch`` as a side input; the
model reads what it uses (embeddings the positions, attention the segment ids, the loss the
targets and the loss mask). All five fields are [B, L]: int32, the mask float32 (1.0 where the
target is trained). Plain (unpacked) data has one segment per row (segment id 1), positions
0..L-1 and every target trained, so its numbers are those of a plain tokens/targets step.

Packed SFT rows (see the SFT file format, pstar_jax.data.packing) hold several whole examples per
row: segment k >= 1 is the k-th example, 0 is padding. ``from_rows`` derives the batch from the
[B, L + 1] row arrays; a model whose attention ignores segment ids would mix the examples of a
row, so it is refused for such data (``check_batches``).

LoRA dropout (models/lora.py) draws its masks from ``dropout_seed``, one uint32 per row, set by
the engines (``with_dropout_seeds``) from the run's seed, the step, the micro-batch and the row's
global index, so masks do not depend on how rows are spread over devices; each stage mixes in
its own index (``stage_seeds``), so layers differ, and a stage's recomputed forward in the
backward draws the same masks. None (the default, and always in evaluation) means no dropout.

The loss is normalised once over the whole step: the last stage returns the sum of its masked
token losses, and the engine divides by the global count of trained tokens (``loss_mask``
summed over every micro-batch and device), never averaging per-micro-batch means. An objective
with several terms (preference tuning: pairs, and the chosen tokens of its SFT term) returns one
sum per term and the counts per row (``row_counts``); each sum is divided by its global count.
``ref_logp`` carries a reference model's per-position log-probs where the objective reads them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

# Hugging Face's label for "not in the loss"; pstar_jax masks with the loss mask instead.
HF_IGNORE_INDEX = -100


class Batch(NamedTuple):
    """One micro-batch (numpy on the host, jax arrays in a stage); a pytree, as a NamedTuple."""
    tokens: Any  # [B, L] int32: the inputs
    targets: Any  # [B, L] int32: the next tokens
    loss_mask: Any  # [B, L] float32: 1.0 where the target is trained
    segment_ids: Any  # [B, L] int32: example k >= 1 within the row, 0 = padding
    positions: Any  # [B, L] int32: index within its example (restarting at 0 each example)
    dropout_seed: Any = None  # [B] uint32: each row's dropout seed (None: no dropout)
    ref_logp: Any = None  # [B, L] float32: a reference model's target log-probs (preference tuning), else None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(np.shape(self.tokens))


PER_POSITION = Batch._fields[:5]  # the [B, L] fields (what an abstract batch for tracing holds)


def mix_seeds(a: Any, b: Any) -> Any:
    """uint32 arrays (numpy or jax) -> a uint32 hash of the pair (murmur3's finaliser over a
    golden-ratio combination): distinct pairs give unrelated seeds."""
    u = np.uint32  # (numpy scalars: a Python int above 2**31 is no uint32 to jax)
    x = a ^ (b * u(0x9E3779B9) + u(0x7F4A7C15))
    x = (x ^ (x >> u(16))) * u(0x85EBCA6B)
    x = (x ^ (x >> u(13))) * u(0xC2B2AE35)
    return x ^ (x >> u(16))


def with_dropout_seeds(batch: Batch, seed: int, step: int, micro: int, first_row: int) -> Batch:
    """The batch with each row's dropout seed: a hash of (seed, step, micro-batch, global row),
    ``first_row`` being the global index of this process's first row."""
    rows = np.arange(first_row, first_row + batch.shape[0], dtype=np.uint32)
    with np.errstate(over="ignore"):  # uint32 arithmetic wraps by design
        x = np.full_like(rows, np.uint32(seed & 0xFFFFFFFF))
        for part in (step, micro):
            x = mix_seeds(x, np.full_like(rows, np.uint32(part & 0xFFFFFFFF)))
        return batch._replace(dropout_seed=mix_seeds(x, rows).astype(np.uint32))


def plain(tokens_BxL: np.ndarray, targets_BxL: np.ndarray) -> Batch:
    """Unpacked data: one segment per row, positions 0..L-1, every target trained."""
    tokens = np.asarray(tokens_BxL, np.int32)
    B, L = tokens.shape
    return Batch(tokens, np.asarray(targets_BxL, np.int32), np.ones((B, L), np.float32),
                 np.ones((B, L), np.int32), np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy())


def as_batch(micro_batch: Batch | Sequence[np.ndarray]) -> Batch:
    """A Batch as is; a (tokens, targets) pair as plain data."""
    if isinstance(micro_batch, Batch):
        return micro_batch
    tokens, targets = micro_batch
    return plain(tokens, targets)


def from_rows(tokens_BxR: np.ndarray, segments_BxR: np.ndarray, labels_BxR: np.ndarray) -> Batch:
    """The batch of packed rows of R = L + 1 positions (the SFT file's three arrays)."""
    tokens = np.asarray(tokens_BxR, np.int32)
    segments = np.asarray(segments_BxR, np.int32)
    inputs, mask = segments[:, :-1], trained_targets(segments, labels_BxR)
    return Batch(np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:]),
                 mask.astype(np.float32), np.ascontiguousarray(inputs), positions_in_segments(inputs))


def trained_targets(segments_BxR: np.ndarray, labels_BxR: np.ndarray) -> np.ndarray:
    """[B, R - 1] bool: which targets of packed rows are trained."""
    segments = np.asarray(segments_BxR)
    inputs, following = segments[:, :-1], segments[:, 1:]
    # A target is trained when labelled and in the same example as its input (never across a
    # boundary into the next example or padding, never from padding).
    return (np.asarray(labels_BxR)[:, 1:] != 0) & (following == inputs) & (inputs != 0)


def positions_in_segments(segment_ids_BxL: np.ndarray) -> np.ndarray:
    """Each position's index within its run of equal segment ids (padding: 0)."""
    seg = np.asarray(segment_ids_BxL)
    B, L = seg.shape
    index = np.broadcast_to(np.arange(L), (B, L))
    starts = np.ones((B, L), bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    # The start of each position's run: the last start at or before it.
    run_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return np.where(seg != 0, index - run_start, 0).astype(np.int32)


def stack(micro_batches: Sequence[Batch]) -> Batch:
    """[M, B, L] per field (the plain engine's scanned micro-batches)."""
    return Batch(*(None if field[0] is None else np.stack(field) for field in zip(*micro_batches)))


def row_counts(micro_batches: Sequence[Batch], model: Any = None) -> np.ndarray:
    """[M, B, K] float32: each row's counts, the divisors of the objective's K loss sums (summed to
    the global counts on the device, so every process sees the count of every process's rows).
    The model's ``row_counts(batch) -> [B, K]`` where it has one (a preference objective counts
    pairs), else K = 1: the trained targets. The last count is always the trained targets."""
    per_row = getattr(model, "row_counts", None)
    if per_row is not None:
        return np.stack([np.asarray(per_row(b), np.float32) for b in micro_batches])
    return np.stack([np.asarray(b.loss_mask, np.float32).sum(axis=1)[:, None] for b in micro_batches])


def trained_count(count: float) -> int:
    """The count as a whole number (0 for a non-finite one: a step the loss check stops)."""
    return int(count) if np.isfinite(count) else 0


def supports_packing(model: Any) -> bool:
    """Whether the model's attention and positions follow segment ids and positions."""
    return bool(getattr(model, "supports_packing", False))


def model_name(model: Any) -> str:
    return str(getattr(model, "name", None) or type(model).__name__)


def check_batches(micro_batches: Sequence[Batch], model: Any) -> None:
    """Raise DataError (one line) for ids outside the vocabulary, or for packed rows handed to a
    model that would mix their examples. Host numpy, before anything reaches the device."""
    from pstar_jax.config.errors import DataError
    vocab_size = int(model.vocab_size)
    for b in micro_batches:
        for field in ("tokens", "targets"):
            ids = np.asarray(getattr(b, field))
            low, high = int(ids.min()), int(ids.max())
            if low == HF_IGNORE_INDEX and field == "targets":
                raise DataError(f"targets hold {HF_IGNORE_INDEX} (Hugging Face's 'not in the loss' label); pstar_jax "
                                "takes what is trained from the loss mask of an SFT file (pstar-tokens --chat), "
                                "so give the real next tokens as targets")
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                raise DataError(f"{field} hold id {bad}, outside the model's vocabulary of {vocab_size} ids "
                                f"(0 to {vocab_size - 1}); tokenize with the model's tokenizer")
        if not supports_packing(model) and int(np.max(b.segment_ids)) > 1:
            raise DataError(f"model {model_name(model)} does not follow segment ids (it has no supports_packing), "
                            "so packed SFT rows would mix their examples in attention; use a model that supports "
                            "packing (the gpt and llama families do) or plain token data")
