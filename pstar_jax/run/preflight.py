"""What a run is refused or warned for before it trains, as early as each can be known.

``check_inputs`` needs no JAX and reads no more than a file header, so pstar-train runs it before
the seconds of importing JAX (and ``Run`` again, for the Python API): a weights or data path that
is not there, an output that is a file where a directory is written, a packed SFT file packed for
another ``--seq-len``, a ``--profile`` of a run too short to reach the steps it traces.
``check_profile`` asks the last again once a resume knows its first step, and ``positions_warning``
says when a model is trained past the positions it was made for.
"""

from __future__ import annotations

import os
from typing import Any

from pstar_jax.config import AdapterError, ConfigError, DataError, HFCheckpointError, RunConfig
from pstar_jax.config.paths import check_output_dir, check_output_file

PROFILE_SKIPS = 2  # the --profile trace starts after the run's first two steps, which compile


def check_inputs(config: RunConfig) -> None:
    """Refuse (one line) what the configuration alone shows to be missing or misplaced."""
    m, c, o = config.model, config.checkpoint, config.output
    if m.init_from_hf:
        _directory(m.init_from_hf, "ModelConfig.init_from_hf", HFCheckpointError,
                   "a Hugging Face checkpoint directory (config.json and safetensors)", "config.json")
    if m.init_from_lora:
        _directory(m.init_from_lora, "ModelConfig.init_from_lora", AdapterError,
                   "a peft adapter directory (adapter_config.json and adapter_model.safetensors)",
                   "adapter_config.json")
    if m.init_from_flax:
        _directory(m.init_from_flax, "ModelConfig.init_from_flax", ConfigError,
                   "a directory written by CheckpointConfig.export_flax", None)
    for what, path in (("DataConfig.path", config.data.path), ("DataConfig.eval_path", config.data.eval_path)):
        if path:
            _data_file(path, what, m.seq_len)
    for what, path in (("CheckpointConfig.export_hf", c.export_hf), ("CheckpointConfig.export_flax", c.export_flax),
                       ("CheckpointConfig.export_lora", c.export_lora), ("OutputConfig.tensorboard", o.tensorboard),
                       ("OutputConfig.profile", o.profile)):
        if path:
            check_output_dir(path, what)
    if o.metrics_out:
        check_output_file(o.metrics_out, "OutputConfig.metrics_out")
    if config.engine.frozen_cache:
        check_frozen_cache(config)
    check_profile(config, 0)


def check_frozen_cache(config: RunConfig) -> None:
    """The cache of disk-homed frozen chunks is written from a base read from files, in a writable
    place (beside a Hugging Face base's own files, for one, but not inside a Flax export)."""
    cache, m = os.path.realpath(config.engine.frozen_cache), config.model
    if not (m.init_from_hf or m.init_from_flax):
        raise ConfigError("EngineConfig.frozen_cache is written from a base read from files: start from "
                          "ModelConfig.init_from_hf or init_from_flax, or drop it")
    if m.init_from_flax and (cache + os.sep).startswith(os.path.realpath(m.init_from_flax) + os.sep):
        raise ConfigError(f"EngineConfig.frozen_cache {config.engine.frozen_cache} is inside ModelConfig."
                          f"init_from_flax {m.init_from_flax}, whose fingerprint covers every file there; put the "
                          "cache elsewhere")
    check_output_dir(config.engine.frozen_cache, "EngineConfig.frozen_cache")


def _directory(path: str, what: str, error: type[ConfigError], kind: str, marker: str | None) -> None:
    if not os.path.exists(path):
        raise error(f"{what} {path} does not exist; pass {kind}")
    if not os.path.isdir(path):
        raise error(f"{what} {path} is a file, not a directory; pass {kind}")
    if marker and not os.path.isfile(os.path.join(path, marker)):
        raise error(f"{what} {path} holds no {marker}; pass {kind}")


def _data_file(path: str, what: str, seq_len: int | None) -> None:
    """A data file that is not there, or a packed SFT file packed for another ``seq_len`` (when the
    run gives one; a preset's or a checkpoint's is known once the model is built) or holding no
    rows: data.rows.check_rows on its header."""
    if not os.path.exists(path):
        raise DataError(f"{what} {path} does not exist; make it with `pstar-tokens`")
    from pstar_jax.data.training import SFT_SUFFIXES
    if seq_len is None or not os.path.basename(path).endswith(SFT_SUFFIXES):
        return
    from pstar_jax.data.packing import load_packed  # a memory map: the header, not the rows
    from pstar_jax.data.rows import check_rows
    check_rows(load_packed(path), seq_len, f"{what} {path}")


def check_profile(config: RunConfig, first_step: int) -> None:
    """Refuse an ``OutputConfig.profile`` that would trace nothing: the run (from ``first_step``,
    where a resume starts) ends before the trace's first step."""
    if not config.output.profile:
        return
    steps = config.train.steps - first_step
    if config.checkpoint.stop_after:
        steps = min(steps, config.checkpoint.stop_after)
    if steps <= PROFILE_SKIPS:
        start = f" from step {first_step}" if first_step else ""
        raise ConfigError(f"OutputConfig.profile traces from a run's third step (the first two compile), but this "
                          f"run has {steps} step{'s' if steps != 1 else ''}{start}; run at least "
                          f"{PROFILE_SKIPS + 1} steps (TrainConfig.steps, CheckpointConfig.stop_after) or drop "
                          "OutputConfig.profile")


def positions_warning(model: Any) -> str | None:
    """A sentence when ``model`` trains past the positions its config says it was made for
    (``max_position_embeddings`` of a Llama-family config below its seq_len), else None."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    seq_len = getattr(model, "seq_len", None)
    if not isinstance(limit, int) or not isinstance(seq_len, int) or seq_len <= limit:
        return None
    return (f"ModelConfig.seq_len {seq_len} is past the model's max_position_embeddings {limit}: its rotary "
            f"positions beyond {limit} were never trained (no RoPE scaling is added for them), so the model may "
            f"train and generate worse there; choose ModelConfig.seq_len {limit} or less to stay within them")


__all__ = ["check_inputs", "check_profile", "positions_warning", "PROFILE_SKIPS"]
