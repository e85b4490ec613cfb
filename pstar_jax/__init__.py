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

from pstar_jax import _moved

from pstar_jax.config import (CheckpointConfig, CheckpointError, ConfigError, DataConfig, DataError,
                              DistributedConfig, EngineConfig, LoraConfig, ModelConfig, OptimConfig, OutputConfig,
                              RunConfig, TrainConfig, format_bytes, parse_bytes)

_moved.install()  # the module paths of before the layers (pstar_jax.train, pstar_jax.attention, ...)

# name -> the module that defines it, imported when the name is first used
_LAZY = {
    "export_flax": "io.flax_io", "import_flax": "io.flax_io",
    "Batches": "data.stream", "default_corpus": "data.corpus", "load_tokens": "data.token_files",
    "Batch": "data.batch", "PackedBatches": "data.rows",
    "Engine": "engine.protocol", "NonFiniteLoss": "engine.protocol", "StepResult": "engine.protocol",
    "Run": "run.loop", "load_model": "io.models",
    "JsonlWriter": "run.metrics", "MetricsWriter": "run.metrics", "TensorBoardWriter": "run.metrics",
    "NNXStaged": "model.nnx_staged", "Stage": "model.staged", "StagedModel": "model.staged",
    "default_tx": "engine.optim",
    "PlanReport": "planner.report", "plan_report": "planner.report",
    "Planned": "planner.build", "build_engine": "planner.build", "plan_model": "planner.build",
    "resolve_engine_config": "planner.build",
    "ChatTemplate": "data.template", "read_conversations": "data.chat",
    "PackedRows": "data.packing", "is_packed_file": "data.packing", "load_packed": "data.packing", "pack": "data.packing",
    "write_packed": "data.packing",
    "make_sft_file": "data.sft",
    "make_preference_file": "data.preference",
    "frozen_for_lora": "model.lora",
}


__getattr__, __dir__ = _moved.lazy_attributes(__name__, _LAZY)

__all__ = [
    "RunConfig", "ModelConfig", "TrainConfig", "OptimConfig", "EngineConfig", "DataConfig", "CheckpointConfig",
    "DistributedConfig", "OutputConfig", "ConfigError", "parse_bytes", "format_bytes",
    "StagedModel", "Stage", "NNXStaged", "load_model",
    "Engine", "StepResult", "NonFiniteLoss", "build_engine", "plan_model", "Planned", "resolve_engine_config",
    "default_tx", "Run", "plan_report", "PlanReport",
    "load_tokens", "default_corpus", "Batches", "DataError", "Batch", "PackedBatches",
    "ChatTemplate", "read_conversations", "make_sft_file", "pack", "PackedRows", "load_packed", "write_packed",
    "is_packed_file", "make_preference_file",
    "CheckpointError", "export_flax", "import_flax",
    "MetricsWriter", "JsonlWriter", "TensorBoardWriter",
    "LoraConfig", "frozen_for_lora",
]
