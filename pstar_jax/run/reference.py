"""Full fine-tuning's DPO and IPO reference: the model at its initial weights, stored before
training beside the preference file (pstar_jax.data.ref_logps), so training holds one model.

``stored_reference`` runs before step 0 (and before a resume restores its checkpoint, so the
engine still holds the initial weights): it reuses ``--ref-logps FILE`` or ``NAME.ref.f32`` when
present and made for this data, base and model, refuses one that is not, and otherwise computes it
by the engine's forward-only pass over every row of the file (its chunks streamed by the
evaluation's plan), saying so on stderr with the time it took.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pstar_jax.config import ConfigError, RunConfig, to_dict
from pstar_jax.config.errors import DataError
from pstar_jax.data.batch import Batch
from pstar_jax.data.ref_logps import (RefLogps, data_fingerprint, load_ref_logps, ref_path, reference_values,
                                      write_ref_logps)
from pstar_jax.data.rows import check_rows, eval_row_index


def uses_stored_reference(config: RunConfig) -> bool:
    """Whether the run reads a stored reference: sigmoid or ipo without LoRA."""
    p = config.preference
    return p.objective == "dpo" and p.uses_reference and not config.lora.enabled


def fingerprint(config: RunConfig, model: Any, data_path: str) -> dict[str, Any]:
    """What the stored values depend on: the data file, the base weights (the base record without its
    path: its fingerprint reads the weights) and the model config with the compute precision."""
    from pstar_jax.io.base_record import base_record
    base = {k: v for k, v in base_record(config, model).items() if k != "path"}
    weights = ("init_from_flax", "init_from_hf", "init_from_lora")  # where from is the base's part
    arch = {k: v for k, v in to_dict(config.model).items() if k not in weights}
    return {"data": data_fingerprint(data_path), "base": base, "model": {**arch, "precision": config.engine.precision}}


def stored_reference(config: RunConfig, model: Any, engine: Any, micro_batch_rows: int,
                     verbose: bool = True) -> RefLogps | None:
    """The run's stored reference (None when it reads none), reused or computed now by ``engine``
    (at its initial weights) over the whole preference file, ``micro_batch_rows`` rows at a time."""
    if not uses_stored_reference(config):
        return None
    if config.data.path is None:
        raise ConfigError(f"the {config.preference.loss} loss of full fine-tuning reads the reference's log-probs "
                          "stored beside a preference file; give DataConfig.path (--data)")
    return _stored(config, model, engine, micro_batch_rows, verbose, config.data.path, config.preference.ref_logps)


def held_out_reference(config: RunConfig, model: Any, engine: Any, ref: RefLogps | None, eval_set: list[Batch],
                       eval_rows: Any, micro_batch_rows: int, verbose: bool = True) -> list[Batch]:
    """The held-out micro-batches (``evaluation_set`` of ``eval_rows``) with their reference values:
    the last rows of the training file are in its stored reference; DataConfig.eval_path's file has
    its own (``NAME.ref.f32`` beside it), reused or computed as the training file's."""
    if ref is None or not eval_set:
        return eval_set
    n = check_rows(eval_rows)
    if config.data.eval_path:
        ref, offset = _stored(config, model, engine, micro_batch_rows, verbose, config.data.eval_path, None), 0
    else:  # held_out_rows: the file's last n rows
        from pstar_jax.data.packing import load_packed
        offset = len(ref.offsets) - 1 - n
        if not np.array_equal(np.asarray(eval_rows.tokens), np.asarray(load_packed(config.data.path).tokens[offset:])):
            raise DataError("the held-out rows are not the last rows of DataConfig.path, so the stored reference "
                            "has no values for them; give them as a preference file in DataConfig.eval_path")
    index = eval_row_index(n, micro_batch_rows, len(eval_set), jax.process_index(), jax.process_count())
    return [ref.attach(batch, offset + rows) for batch, rows in zip(eval_set, index)]


def _stored(config: RunConfig, model: Any, engine: Any, micro_batch_rows: int, verbose: bool, data_path: str,
            named: str | None) -> RefLogps:
    """The stored reference of the preference file ``data_path``: ``named`` or ``NAME.ref.f32``
    beside it when present (checked), else computed and written."""
    from pstar_jax.data.packing import load_packed
    rows = load_packed(data_path)
    path = Path(named) if named else ref_path(data_path)
    expected = fingerprint(config, model, data_path)
    if named or path.exists():
        ref = load_ref_logps(path, rows, expected)
        if verbose:
            print(f"reference log-probs: reusing {path} ({len(ref.values):,} pairs)", file=sys.stderr, flush=True)
        return ref
    if jax.process_count() > 1:
        raise ConfigError(f"the reference log-probs {path} are computed by one process; run pstar-train once on "
                          "one process to write them (or pass --ref-logps FILE), then start the multi-process run")
    start = time.perf_counter()
    micro_batches = config.engine.micro_batches
    values = np.concatenate(list(reference_values(rows, engine.reference_logps, micro_batch_rows, micro_batches)))
    write_ref_logps(path, values, expected)
    if verbose:
        print(f"reference log-probs: computed {len(values):,} pairs over {len(rows.segments):,} rows in "
              f"{time.perf_counter() - start:.1f} s (a forward-only pass at the initial weights) -> {path}",
              file=sys.stderr, flush=True)
    return load_ref_logps(path, rows, expected)
