"""What a resume must agree on with its checkpoint beyond the training math (which
``math_differences`` compares): the weights it was started from and the data it reads, and a data
position that a run could have written. Each disagreement is one line naming both sides and the
flag to pass."""

from __future__ import annotations

import os
from typing import Any, Mapping

from pstar_jax.config import CheckpointError, ConfigError, RunConfig, from_dict


def check_resume(config: RunConfig) -> None:
    """What the latest checkpoint in ``config.checkpoint.directory`` shows a resume of ``config``
    to lack, read before any model is built: its base, its data, steps left to ``--profile``.
    (A directory with no step is refused when the run opens it.)"""
    from pstar_jax.io.checkpoint import Checkpointer
    from pstar_jax.run.preflight import check_profile
    ckpt = Checkpointer(config.checkpoint.directory)
    try:
        latest = ckpt.latest_step()
        meta = ckpt.meta(latest) if latest is not None else {}
    finally:
        ckpt.close()
    if isinstance(meta.get("config"), dict):
        saved = from_dict(RunConfig, meta["config"])
        check_sources(saved, config, meta, ckpt.directory)
        check_same_data(saved, config, ckpt.directory)
    if latest is not None:
        check_profile(config, latest)


def check_sources(saved: RunConfig, ours: RunConfig, meta: Mapping[str, Any], directory: str) -> None:
    """Refuse a resume that lacks the Hugging Face base (or the adapter) the checkpoint was started
    from, naming the flags to add; the base's recorded path (``meta['base']``, absolute) is preferred
    to the path as the first run was given it."""
    base = meta.get("base") if isinstance(meta.get("base"), Mapping) else {}
    missing = []
    if saved.model.init_from_hf and not ours.model.init_from_hf:
        path = base.get("path") if base.get("source") == "hf" and base.get("path") else saved.model.init_from_hf
        missing.append(f"ModelConfig.init_from_hf {path}")
    if not missing:
        return
    if saved.model.init_from_lora and not ours.model.init_from_lora:
        missing.append(f"ModelConfig.init_from_lora {saved.model.init_from_lora}")
    elif saved.lora.enabled and not ours.lora.enabled and not ours.model.init_from_lora:
        missing.append(f"LoraConfig.rank {saved.lora.rank}")
    raise CheckpointError(f"the checkpoint in {directory} was trained from {missing[0]}, which this run does not "
                          f"give; resume with {' '.join(missing)} (and the first run's other settings)")


def check_same_data(saved: RunConfig, ours: RunConfig, directory: str) -> None:
    """Refuse a resume that reads other training data than the checkpoint's run did (its data
    position counts batches of that data), unless ``checkpoint.allow_changes``."""
    old, new = saved.data.path, ours.data.path
    if _same_file(old, new) or ours.checkpoint.allow_changes:
        return
    name = lambda path: f"DataConfig.path {path}" if path else "the built-in corpus (no DataConfig.path)"  # noqa: E731
    raise ConfigError(f"the checkpoint in {directory} was trained on {name(old)}, this run reads {name(new)}; "
                      f"resume on the checkpoint's data, or pass CheckpointConfig.allow_changes to go on with the new "
                      "data from the checkpoint's data position")


def _same_file(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return not a and not b
    try:
        return os.path.samefile(a, b)
    except OSError:  # one is gone (a missing --data is refused on its own): compare the names
        return os.path.abspath(a) == os.path.abspath(b)


def data_position(meta: Mapping[str, Any], directory: str) -> int:
    """The data position a checkpoint step records: a whole number of at least 0 (the batches its
    run had read), else CheckpointError naming the step."""
    position = meta.get("data_position")
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise CheckpointError(f"checkpoint step {meta.get('step')} in {directory} records the data position "
                              f"{position!r}, which no run writes (a count of batches, at least 0): its metadata is "
                              f"damaged; remove {directory}/{meta.get('step')} to fall back to an earlier one")
    return position


__all__ = ["check_resume", "check_sources", "check_same_data", "data_position"]
