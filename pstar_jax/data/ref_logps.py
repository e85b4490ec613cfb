"""A preference file's stored reference: each pair's chosen and rejected summed completion
log-probs under the model at its initial weights, for DPO and IPO with full fine-tuning (the
reference then comes from outside the step, so training holds one model).

The file ``NAME.ref.f32`` (beside the preference file ``NAME.sft.u16.bin``) is float32 [pairs, 2],
(chosen, rejected), the pairs in file order: row 0's pairs 1, 2, ... then row 1's; a row holds
``max(segment id) // 2`` pairs (pair k is segments 2k - 1 and 2k). Its sidecar ``NAME.ref.f32.json``
holds the shape and a fingerprint of what made the values, each part compared on reuse:

  * ``data``: the preference file's size, mtime (ns) and its sidecar's sha256. Not a content hash:
    hashing a file of billions of tokens costs a full read on every run that reuses the values,
    while pstar-tokens writes a file atomically (a new file, a new mtime), so a repacked file is
    seen; a copy that does not keep its mtime is refused on the safe side (recompute it).
  * ``base``: the checkpoint's base record (pstar_jax.io.base_record), or what stands for it;
  * ``model``: the model config.

Both files are written atomically (the old file or the new, never half). ``attach`` puts a row's
values into a batch's ``ref_logp`` [B, L]: each pair's sum at its segment's first trained target
and 0 elsewhere, so the segment sums the loss takes (pstar_jax.model.preference) are the stored
sums exactly. Batches are keyed by row index (``PackedBatches`` shuffles rows).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from pstar_jax.config.errors import DataError
from pstar_jax.data.batch import Batch, from_rows
from pstar_jax.data.token_files import io_errors, sidecar_path, write_atomic

SUFFIX = ".ref.f32"
FORMAT = "pstar-ref-logps"
ROW_BLOCK = 4096  # rows read at a time when counting pairs (memmapped files stay out of memory)


def ref_path(data_path: str | os.PathLike) -> Path:
    """``NAME.ref.f32`` beside the preference file ``NAME.sft.u16.bin`` (or ``.u32``)."""
    path = Path(data_path)
    name = path.name
    for suffix in (".sft.u16.bin", ".sft.u32.bin"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return path.with_name(name + SUFFIX)


def data_fingerprint(data_path: str | os.PathLike) -> dict[str, Any]:
    """The preference file's size, mtime and sidecar hash (why not a content hash: the module docstring)."""
    path = Path(data_path)
    with io_errors(path, "read"):
        stat = path.stat()
        side = sidecar_path(path)
        side_sha = hashlib.sha256(side.read_bytes()).hexdigest() if side.is_file() else None
    return {"size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sidecar_sha256": side_sha}


def pairs_per_row(segments_RxP: Any) -> np.ndarray:
    """[rows] int64: each row's pairs (its largest segment id over 2), read a block of rows at a time."""
    n = len(segments_RxP)
    out = np.empty(n, np.int64)
    for start in range(0, n, ROW_BLOCK):
        out[start:start + ROW_BLOCK] = np.asarray(segments_RxP[start:start + ROW_BLOCK]).max(axis=1) // 2
    return out


def pair_sums(logp_BxL: np.ndarray, batch: Batch, pairs_B: np.ndarray) -> np.ndarray:
    """[sum(pairs_B), 2] float32: each pair's chosen and rejected log-probs summed over its trained
    targets (float64 sums, rounded once)."""
    logp = np.asarray(logp_BxL, np.float64) * np.asarray(batch.loss_mask, np.float64)
    seg = np.asarray(batch.segment_ids)
    out = []
    for b, n in enumerate(pairs_B):
        sums = np.bincount(seg[b], weights=logp[b], minlength=2 * int(n) + 1)
        out.append(sums[1:2 * int(n) + 1].reshape(-1, 2))
    return np.concatenate(out).astype(np.float32) if out else np.zeros((0, 2), np.float32)


def reference_values(rows: Any, logps: Callable[[list[Batch]], list[np.ndarray]], rows_per_batch: int,
                     micro_batches: int = 1) -> Iterator[np.ndarray]:
    """Each group of ``micro_batches`` batches' pair sums, in file order: ``logps`` maps a list of
    batches of ``rows_per_batch`` rows to their per-position target log-probs [B, L] (a forward-only
    pass over the reference). The last group is filled by repeating row 0; its extra rows are dropped."""
    counts, n = pairs_per_row(rows.segments), len(rows.segments)
    group = rows_per_batch * micro_batches
    for start in range(0, n, group):
        index = np.arange(start, start + group)
        index = np.where(index < n, index, 0)
        batches = [from_rows(*(np.asarray(getattr(rows, f)[index[m * rows_per_batch:(m + 1) * rows_per_batch]])
                               for f in ("tokens", "segments", "labels"))) for m in range(micro_batches)]
        real = min(group, n - start)
        for m, (batch, logp) in enumerate(zip(batches, logps(batches))):
            keep = max(0, min(rows_per_batch, real - m * rows_per_batch))
            if keep:
                sub = [np.asarray(x)[:keep] for x in (logp, batch.loss_mask, batch.segment_ids)]
                yield pair_sums(sub[0], batch._replace(loss_mask=sub[1], segment_ids=sub[2]),
                                counts[start + m * rows_per_batch:][:keep])


def write_ref_logps(path: str | os.PathLike, values_Px2: np.ndarray, fingerprint: dict[str, Any]) -> None:
    """Writes the values and their sidecar (the data, base and model fingerprint), each atomically;
    the sidecar last, so a file without a matching sidecar is never taken for a whole one."""
    path, values = Path(path), np.ascontiguousarray(values_Px2, np.float32)
    if values.ndim != 2 or values.shape[1] != 2:
        raise DataError(f"reference log-probs must be [pairs, 2], got {values.shape}")
    side = sidecar_path(path)
    side.unlink(missing_ok=True)
    write_atomic(path, values.tobytes())
    info = {"format": FORMAT, "pairs": int(values.shape[0]), "dtype": "float32", "fingerprint": fingerprint}
    write_atomic(side, json.dumps(info, indent=1).encode() + b"\n")


def _first_difference(stored: Any, expected: Any, where: str) -> str | None:
    if isinstance(stored, dict) and isinstance(expected, dict):
        for key in sorted(set(stored) | set(expected)):
            if key not in stored or key not in expected:
                return f"{where}.{key}"
            if (d := _first_difference(stored[key], expected[key], f"{where}.{key}")) is not None:
                return d
        return None
    return None if stored == expected else where


class RefLogps:
    """A stored reference read back and checked: ``values`` [pairs, 2], ``offsets`` [rows + 1] (row
    r's pairs are values[offsets[r]:offsets[r + 1]])."""

    def __init__(self, values_Px2: np.ndarray, pairs_per_row_R: np.ndarray):
        self.values = np.asarray(values_Px2, np.float32)
        self.offsets = np.concatenate([[0], np.cumsum(pairs_per_row_R)]).astype(np.int64)

    def attach(self, batch: Batch, row_index_B: np.ndarray) -> Batch:
        """The batch (rows ``row_index_B`` of the file) with ``ref_logp`` [B, L]: each pair's stored
        sums at the first trained target of its segments, 0 elsewhere."""
        mask = np.asarray(batch.loss_mask) != 0
        seg = np.asarray(batch.segment_ids).astype(np.int64)
        first = mask.copy()
        first[:, 1:] &= ~(mask[:, :-1] & (seg[:, 1:] == seg[:, :-1]))
        b, p = np.nonzero(first)
        s = seg[b, p]
        rows = np.asarray(row_index_B, np.int64)[b]
        pair = self.offsets[rows] + (s - 1) // 2
        if len(pair) and (np.any(pair >= self.offsets[rows + 1]) or np.any(s < 1)):
            raise DataError("a batch holds a trained segment that the stored reference has no pair for; the "
                            "reference file does not belong to these rows: delete it to recompute it")
        ref = np.zeros(mask.shape, np.float32)
        ref[b, p] = self.values[pair, (s - 1) % 2]
        return batch._replace(ref_logp=ref)


def load_ref_logps(path: str | os.PathLike, rows: Any, fingerprint: dict[str, Any]) -> RefLogps:
    """The stored reference for ``rows`` (the preference file's rows), checked against the
    ``fingerprint`` of the data, base and model that training uses; DataError (one line) naming what
    differs, for a missing sidecar, a truncated or corrupt file."""
    path = Path(path)
    side = sidecar_path(path)
    redo = "delete it (pstar-train computes it again) or pass the --ref-logps file made for this run"
    if not path.is_file():
        raise DataError(f"reference log-probs file {path} does not exist; leave --ref-logps out to compute it")
    if not side.is_file():
        raise DataError(f"reference log-probs file {path} has no sidecar {side.name} (its write did not finish); "
                        f"{redo}")
    try:
        info = json.loads(side.read_text())
        stored_pairs, stored_fp = int(info["pairs"]), info["fingerprint"]
        if info.get("format") != FORMAT or info.get("dtype") != "float32" or not isinstance(stored_fp, dict):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{side} is not a reference log-probs sidecar (format {FORMAT}); {redo}") from None
    if (diff := _first_difference(stored_fp, fingerprint, "fingerprint")) is not None:
        part = {"data": "other data", "base": "another base", "model": "another model"}.get(diff.split(".")[1],
                                                                                         "another run")
        raise DataError(f"reference log-probs file {path} was made for {part} ({diff} differs); {redo}")
    counts = pairs_per_row(rows.segments)
    if stored_pairs != int(counts.sum()):
        raise DataError(f"reference log-probs file {path} holds {stored_pairs:,} pairs but the data has "
                        f"{int(counts.sum()):,}; {redo}")
    with io_errors(path, "read"):
        size = path.stat().st_size
        if size != stored_pairs * 8:
            raise DataError(f"reference log-probs file {path} has {size:,} bytes but its sidecar describes "
                            f"{stored_pairs * 8:,} ({stored_pairs:,} pairs); it is truncated or damaged: {redo}")
        values = np.fromfile(path, np.float32).reshape(-1, 2)
    if not np.all(np.isfinite(values)):
        raise DataError(f"reference log-probs file {path} holds non-finite values; it is damaged: {redo}")
    return RefLogps(values, counts)
