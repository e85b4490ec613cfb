"""pstar_jax: PatrickStar in JAX/Flax, chunk-based training of models larger than the accelerator.

The public surface, in the order a run uses it::

    import pstar_jax as ps
    config = ps.RunConfig(train=ps.TrainConfig(steps=20, batch_size=8))
    with ps.Run(config) as run:          # model, data, plan (ConfigError if it does not fit)
        for record in run.fit():         # one dict per step: loss, grad_norm, tokens_per_s, ...
            ...
        params = run.engine.params()     # name -> numpy array

Everything not re-exported here is internal and may change.
"""

from pstar_jax.batch import Batch
from pstar_jax.checkpoint import CheckpointError
from pstar_jax.flax_io import export_flax, import_flax
from pstar_jax.config import (CheckpointConfig, ConfigError, DataConfig, DistributedConfig, EngineConfig,
                              ModelConfig, OptimConfig, OutputConfig, RunConfig, TrainConfig, format_bytes,
                              parse_bytes)
from pstar_jax.data import Batches, DataError, default_corpus, load_tokens
from pstar_jax.engine import Engine, NonFiniteLoss, StepResult
from pstar_jax.loop import Run, load_model
from pstar_jax.metrics import JsonlWriter, MetricsWriter, TensorBoardWriter
from pstar_jax.rows import PackedBatches
from pstar_jax.model import NNXStaged, Stage, StagedModel
from pstar_jax.optim import default_tx
from pstar_jax.planner import PlanReport, plan_report
from pstar_jax.planning import Planned, build_engine, plan_model, resolve_engine_config

__all__ = [
    "RunConfig", "ModelConfig", "TrainConfig", "OptimConfig", "EngineConfig", "DataConfig", "CheckpointConfig",
    "DistributedConfig", "OutputConfig", "ConfigError", "parse_bytes", "format_bytes",
    "StagedModel", "Stage", "NNXStaged", "load_model",
    "Engine", "StepResult", "NonFiniteLoss", "build_engine", "plan_model", "Planned", "resolve_engine_config",
    "default_tx", "Run", "plan_report", "PlanReport",
    "load_tokens", "default_corpus", "Batches", "DataError", "Batch", "PackedBatches",
    "CheckpointError", "export_flax", "import_flax",
    "MetricsWriter", "JsonlWriter", "TensorBoardWriter",
]
