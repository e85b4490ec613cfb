"""The whole run's configuration (``RunConfig``), as checkpoints store it and compare it."""

from __future__ import annotations

import dataclasses
from typing import Any

from pstar_jax.config.errors import ConfigError
from pstar_jax.config.fields import section
from pstar_jax.config.lora import LoraConfig
from pstar_jax.config.preference import PreferenceConfig
from pstar_jax.config.sections import (CheckpointConfig, DataConfig, DistributedConfig, EngineConfig, ModelConfig,
                                       OptimConfig, OutputConfig, TrainConfig)


@section
class RunConfig:
    """Everything a training run needs; pstar-train's flags are derived from it."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)

    def __post_init__(self) -> None:
        if self.optim.total_steps is None:  # the schedule spans the run unless told otherwise
            object.__setattr__(self, "optim", dataclasses.replace(self.optim, total_steps=self.train.steps))
        if self.train.batch_size % self.engine.micro_batches:
            raise ConfigError(f"TrainConfig.batch_size {self.train.batch_size} must be a multiple of "
                              f"EngineConfig.micro_batches {self.engine.micro_batches}")
        if self.data.eval_path and not self.train.eval_every:
            raise ConfigError("DataConfig.eval_path is set but TrainConfig.eval_every is 0; pass how often to "
                              "evaluate, or drop DataConfig.eval_path")
        if self.checkpoint.resume and not self.checkpoint.directory:
            raise ConfigError("CheckpointConfig.resume needs CheckpointConfig.directory")
        if self.checkpoint.resume and self.model.init_from_flax:
            raise ConfigError("ModelConfig.init_from_flax and CheckpointConfig.resume conflict: a resumed run "
                              "continues from its checkpoint; drop one of them")
        if self.checkpoint.export_lora and not self.lora.enabled and not self.model.init_from_lora:
            raise ConfigError("CheckpointConfig.export_lora needs a LoRA run: give LoraConfig.rank (or "
                              "ModelConfig.init_from_lora), or export the whole model with CheckpointConfig.export_hf")
        given = self.lora.given()
        if given and not self.lora.enabled and not self.model.init_from_lora:  # (an adapter gives the rank)
            raise ConfigError(f"LoraConfig.{given[0]} is set but LoraConfig.rank is 0 (no LoRA); give "
                              "LoraConfig.rank too, or ModelConfig.init_from_lora")
        self._check_preference()
        if self.lora.enabled and self.model.init_from_flax:
            raise ConfigError("LoraConfig.rank and ModelConfig.init_from_flax conflict: a LoRA run starts from a "
                              "base model (ModelConfig.init_from_hf, or the preset's initialisation); drop one")

    def _check_preference(self) -> None:
        """Preference tuning's settings against the rest (pstar_jax.model.preference runs it)."""
        p = self.preference
        if p.objective == "sft":
            if given := p.given():
                raise ConfigError(f"PreferenceConfig.{given[0]} is set but PreferenceConfig.objective is sft; pass "
                                  "PreferenceConfig.objective dpo to tune on preference pairs")
            return
        if not p.uses_reference:
            return
        if not self.lora.enabled:  # full fine-tuning: the reference is stored before training (data.ref_logps)
            return
        if p.ref_logps is not None:
            raise ConfigError(f"PreferenceConfig.ref_logps names a stored reference, but a LoRA run's {p.loss} "
                              "reference is the base with the adapters off, in the same step; drop --ref-logps")
        if self.lora.modules_to_save:
            raise ConfigError(f"LoraConfig.modules_to_save trains base tensors in full, but the {p.loss} loss's "
                              "reference is the base with the adapters off, which needs them frozen; drop "
                              "LoraConfig.modules_to_save or use PreferenceConfig.loss simpo")
        if self.model.init_from_lora:
            raise ConfigError(f"ModelConfig.init_from_lora continues an adapter, but the {p.loss} loss's reference "
                              "would be the base without it, not the model you start from; start new adapters on "
                              "ModelConfig.init_from_hf, or use PreferenceConfig.loss simpo")

    @property
    def micro_batch_size(self) -> int:
        return self.train.batch_size // self.engine.micro_batches


def to_dict(config: Any) -> dict:
    """A config tree as plain JSON-able dicts (what checkpoints store)."""
    return dataclasses.asdict(config)


def from_dict(cls: type, data: dict) -> Any:
    """The inverse of ``to_dict``; unknown keys (from a newer version) are ignored."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if isinstance(value, dict):  # a section
            value = from_dict(SECTIONS[f.name], value)
        elif cls is ModelConfig and f.name == "module" and value == "models":
            value = "pstar_models"  # checkpoints written before the families were installed under this name
        kwargs[f.name] = value
    return cls(**kwargs)


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "optim": OptimConfig, "engine": EngineConfig,
             "data": DataConfig, "checkpoint": CheckpointConfig, "distributed": DistributedConfig,
             "output": OutputConfig, "lora": LoraConfig, "preference": PreferenceConfig}


def math_differences(saved: RunConfig, current: RunConfig) -> list[str]:
    """'Section.field: saved -> current' for each setting that changes the training math."""
    out = []
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if not f.metadata.get("math_changing"):
                continue
            old, new = getattr(getattr(saved, name), f.name), getattr(getattr(current, name), f.name)
            derived = name == "optim" and f.name == "total_steps" and (old, new) == (saved.train.steps,
                                                                                  current.train.steps)
            if old != new and not derived:  # (the schedule following --steps is reported as steps)
                out.append(f"{cls.__name__}.{f.name} was {old!r}, now {new!r}")
    if holds_out(saved) != holds_out(current):
        out.append(f"TrainConfig.eval_every was {saved.train.eval_every!r}, now {current.train.eval_every!r}, so the "
                   f"last 1% of the training tokens {'is no longer' if holds_out(saved) else 'is now'} held out")
    return out


def holds_out(config: RunConfig) -> bool:
    """Whether the run trains on all but the last 1% of its tokens (evaluation on, no eval data)."""
    return bool(config.train.eval_every) and not config.data.eval_path
