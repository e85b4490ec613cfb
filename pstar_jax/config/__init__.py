"""The run configuration: one tree of frozen, validated dataclasses, and the parsing of sizes.

The package's bottom layer: it imports only the standard library, and every other layer may import it.

``RunConfig`` holds everything a run needs (model, training, optimizer, engine, data,
checkpoints, distribution, output); each field carries its default, its help text and, where a
string needs parsing, its parser, so the command-line flags are derived from it in one place
(pstar_jax.cli.flags). Every user mistake that can be seen before allocating anything is raised as a
``ConfigError``: one sentence naming the field (``OptimConfig.lr``) and what to change; the CLIs
print it with the field replaced by its flag, as one line, and exit 2.
"""

from pstar_jax.config.errors import AdapterError, CheckpointError, ConfigError, DataError, HFCheckpointError
from pstar_jax.config.fields import MAX_SEED, MAX_STEPS, option, section
from pstar_jax.config.lora import DEFAULT_ALPHA, LoraConfig
from pstar_jax.config.run import SECTIONS, RunConfig, from_dict, holds_out, math_differences, to_dict
from pstar_jax.config.sections import (ADAM_PLACEMENTS, ENGINES, MODEL_SHAPE, PRECISIONS, REMATS, CheckpointConfig,
                                       DataConfig, DistributedConfig, EngineConfig, ModelConfig, OptimConfig,
                                       OutputConfig, TrainConfig)
from pstar_jax.config.sizes import (format_bytes, format_seconds, parse_bytes, parse_chunk_numel, parse_clip_norm,
                                    parse_count, parse_device_memory, parse_optional_bytes)

__all__ = [
    "RunConfig", "ModelConfig", "TrainConfig", "OptimConfig", "EngineConfig", "DataConfig", "CheckpointConfig",
    "DistributedConfig", "OutputConfig", "LoraConfig", "SECTIONS", "to_dict", "from_dict", "math_differences",
    "holds_out", "ConfigError", "DataError", "CheckpointError", "HFCheckpointError", "AdapterError",
    "option", "section", "MAX_STEPS", "MAX_SEED", "DEFAULT_ALPHA", "MODEL_SHAPE", "PRECISIONS", "ADAM_PLACEMENTS",
    "ENGINES", "REMATS", "parse_bytes", "parse_count", "format_bytes", "format_seconds", "parse_device_memory",
    "parse_optional_bytes", "parse_chunk_numel", "parse_clip_norm",
]
