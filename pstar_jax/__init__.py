"""pstar_jax: PatrickStar in JAX/Flax, chunk-based training of models larger than the accelerator.

The public surface, in the order a run uses it::

    import pstar_jax as ps
    config = ps.RunConfig(train=ps.TrainConfig(steps=20, batch_size=8))
    with ps.Run(config) as run:          # model, data, plan (ConfigError if it does not fit)
        for record in run.fit():         # one dict per step: loss, grad_norm, tokens_per_s, ...
            ...
        params = run.engine.params()     # name -> numpy array

Everything not re-exported here is internal and may change.

Only the configuration is imported with the package (it needs nothing but the standard library);
the rest comes in on first use of its name, so ``import pstar_jax`` (and a CLI's ``--help`` or
config error) does not wait seconds for jax, flax, orbax and numba to load.
"""

import importlib as _importlib

from pstar_jax.config import (CheckpointConfig, ConfigError, DataConfig, DistributedConfig, EngineConfig,
                              LoraConfig, ModelConfig, OptimConfig, OutputConfig, RunConfig, TrainConfig,
                              format_bytes, parse_bytes)

# name -> the module that defines it, imported when the name is first used
_LAZY = {
    "CheckpointError": "checkpoint",
    "export_flax": "flax_io", "import_flax": "flax_io",
    "Batches": "data", "DataError": "data", "default_corpus": "data", "load_tokens": "data",
    "Batch": "batch", "PackedBatches": "rows",
    "Engine": "engine", "NonFiniteLoss": "engine", "StepResult": "engine",
    "Run": "loop", "load_model": "loop",
    "JsonlWriter": "metrics", "MetricsWriter": "metrics", "TensorBoardWriter": "metrics",
    "NNXStaged": "model", "Stage": "model", "StagedModel": "model",
    "default_tx": "optim",
    "PlanReport": "planner", "plan_report": "planner",
    "Planned": "planning", "build_engine": "planning", "plan_model": "planning",
    "resolve_engine_config": "planning",
    "ChatTemplate": "chat", "read_conversations": "chat",
    "PackedRows": "packing", "is_packed_file": "packing", "load_packed": "packing", "pack": "packing",
    "write_packed": "packing",
    "make_sft_file": "sft_file",
    "frozen_for_lora": "lora",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pstar_jax' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"pstar_jax.{module}"), name)
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "RunConfig", "ModelConfig", "TrainConfig", "OptimConfig", "EngineConfig", "DataConfig", "CheckpointConfig",
    "DistributedConfig", "OutputConfig", "ConfigError", "parse_bytes", "format_bytes",
    "StagedModel", "Stage", "NNXStaged", "load_model",
    "Engine", "StepResult", "NonFiniteLoss", "build_engine", "plan_model", "Planned", "resolve_engine_config",
    "default_tx", "Run", "plan_report", "PlanReport",
    "load_tokens", "default_corpus", "Batches", "DataError", "Batch", "PackedBatches",
    "ChatTemplate", "read_conversations", "make_sft_file", "pack", "PackedRows", "load_packed", "write_packed",
    "is_packed_file",
    "CheckpointError", "export_flax", "import_flax",
    "MetricsWriter", "JsonlWriter", "TensorBoardWriter",
    "LoraConfig", "frozen_for_lora",
]
