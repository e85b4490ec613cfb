"""A preference file's rows checked as pairs before preference tuning reads them.

pstar-tokens --preference writes each row as pairs k = 1, 2, ...: segment 2k - 1 (prompt + chosen)
then segment 2k (prompt + rejected), each one run of positions, from the row's start, padding (0)
after the last, each training at least one target (its completion), the two of a pair with the
same untrained prompt tokens before their completions, and the sidecar's ``"pairs"`` their total.
The loss reads pairs off the segment ids alone (pstar_jax.model.preference), so a file that breaks
this (edited by hand, an SFT file whose sidecar was made to say ``"preference": true``, a damaged
write) would train silently wrong: a chosen answer without its rejected one scored against a
log-prob of 0, one pair's chosen answer against another's rejected. The check reads the rows a
block at a time (a memory-mapped file stays out of memory), about 50 ns a position on one loaded
CPU core (3 s for 60M positions, measured), and names the first bad row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pstar_jax.config.errors import DataError
from pstar_jax.data.batch import trained_targets
from pstar_jax.data.packing import SCAN_POSITIONS


def _unshared_prompts(tokens_BxR: np.ndarray, seg_BxR: np.ndarray, labels_BxR: np.ndarray) -> np.ndarray:
    """[B, R + 1] bool: chosen segment ids whose prompt (the tokens before the first labelled one)
    is not their rejected partner's, in length or in a token. Segment ids must run in order, one
    run each (checked first), so a run's first position and first label index it uniquely."""
    B, R = seg_BxR.shape
    flat = seg_BxR.reshape(-1)
    pos = np.tile(np.arange(R), B)
    runs = np.flatnonzero((pos == 0) | (flat != np.roll(flat, 1)))  # each run's first flat position
    labelled_at = np.where(labels_BxR.reshape(-1) != 0, pos, R)
    start, first_label = np.full((B, R + 1), R), np.full((B, R + 1), R)
    where = (runs // R, flat[runs])
    start[where], first_label[where] = pos[runs], np.minimum.reduceat(labelled_at, runs)
    prompt = first_label - start
    ids = np.arange(R + 1)[None, :]
    partner_prompt = np.concatenate([prompt[:, 1:], np.zeros((B, 1), prompt.dtype)], axis=1)
    bad = (ids % 2 == 1) & (start < R) & (prompt != partner_prompt)
    # each prompt token of a chosen segment against the token at the same offset in its partner
    rows = np.arange(B)[:, None]
    offset = pos.reshape(B, R) - start[rows, seg_BxR]
    in_prompt = (seg_BxR % 2 == 1) & (offset < prompt[rows, seg_BxR]) & ~bad[rows, seg_BxR]
    partner = np.minimum(start[rows, np.minimum(seg_BxR + 1, R)] + offset, R - 1)
    differs = in_prompt & (tokens_BxR != np.take_along_axis(tokens_BxR, partner, axis=1))
    bad[np.nonzero(differs)[0], seg_BxR[differs]] = True
    return bad


def _row_problem(tokens_BxR: np.ndarray, seg_BxR: np.ndarray, labels_BxR: np.ndarray) -> tuple[int, str] | None:
    """(row within the block, what is wrong) for the block's first bad row, or None."""
    B, R = seg_BxR.shape
    prev, nxt = seg_BxR[:, :-1], seg_BxR[:, 1:]
    # each id follows its predecessor's run (the next id, or padding); padding ends the row
    runs = ((nxt == prev) | ((nxt == prev + 1) & (prev != 0)) | (nxt == 0)).all(axis=1) & (seg_BxR[:, 0] <= 1)
    top = seg_BxR.max(axis=1)
    trained = trained_targets(seg_BxR, labels_BxR)
    index = (np.arange(B)[:, None] * (R + 1) + prev)[trained]
    has_target = np.bincount(index, minlength=B * (R + 1)).reshape(B, R + 1) > 0
    ids = np.arange(R + 1)[None, :]
    untrained = (ids >= 1) & (ids <= top[:, None]) & ~has_target
    bad = ~runs | (top % 2 == 1) | untrained.any(axis=1)
    unshared = np.zeros((B, R + 1), bool)
    if not bad.any():
        unshared = _unshared_prompts(tokens_BxR, seg_BxR, labels_BxR)
        bad = unshared.any(axis=1)
    if not bad.any():
        return None
    r = int(np.argmax(bad))
    if not runs[r]:
        return r, "its segment ids do not run 1, 2, 3, ... from the row's start, one run each, then padding (0)"
    if top[r] % 2 == 1:
        return r, (f"it ends with sequence {top[r]}, the chosen answer of pair {(top[r] + 1) // 2}, without a "
                   "rejected one")
    if untrained[r].any():
        s = int(np.argmax(untrained[r]))
        side = "chosen" if s % 2 == 1 else "rejected"
        return r, f"sequence {s}, the {side} answer of pair {(s + 1) // 2}, trains no token (it has no completion)"
    k = (int(np.argmax(unshared[r])) + 1) // 2
    return r, (f"pair {k}'s chosen and rejected sequences ({2 * k - 1} and {2 * k}) do not share their prompt (the "
               "tokens before each completion differ)")


def check_pairs(rows: Any, what: str) -> int:
    """The number of pairs in ``rows`` (a packed preference file's rows; ``what`` names the file
    in errors); DataError (one line) for the first row that is not whole pairs, or a sidecar whose
    ``"pairs"`` differs from the rows' count."""
    R = rows.segments.shape[1]
    block = max(1, SCAN_POSITIONS // R)
    total = 0
    for lo in range(0, len(rows.segments), block):
        seg = np.asarray(rows.segments[lo:lo + block]).astype(np.int64)
        labels, tokens = np.asarray(rows.labels[lo:lo + block]), np.asarray(rows.tokens[lo:lo + block])
        if (problem := _row_problem(tokens, seg, labels)) is not None:
            raise DataError(f"{what} is not a well-formed preference file: row {lo + problem[0]:,}: {problem[1]}; "
                            "rewrite it with pstar-tokens --preference")
        total += int((seg.max(axis=1) // 2).sum())
    stated = getattr(rows, "info", {}).get("pairs", total)
    if isinstance(stated, bool) or not isinstance(stated, int) or stated != total:
        raise DataError(f"{what}'s sidecar says it holds {stated!r} pairs but its rows hold {total:,}; the file or "
                        "its sidecar is damaged: rewrite it with pstar-tokens --preference")
    return total
