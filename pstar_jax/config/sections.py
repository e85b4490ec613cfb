"""The sections of a run's configuration: model, training, optimizer, engine, data, checkpoints,
distribution and output (LoRA's is in ``pstar_jax.config.lora``)."""

from __future__ import annotations

import re
from typing import Any

from pstar_jax.config.errors import ConfigError
from pstar_jax.config.fields import MAX_SEED, MAX_STEPS, finite, option, positive_int, section
from pstar_jax.config.sizes import (parse_chunk_numel, parse_clip_norm, parse_device_memory, parse_keep_residuals,
                                     parse_optional_bytes)


MODEL_SHAPE = ("n_layer", "d_model", "n_head", "vocab_size", "seq_len")


@section
class ModelConfig:
    """Which model: a preset of a model module, with some fields replaced, and its initial weights."""
    name: str = option("tiny", "preset name (tiny, small, GPT2_1B ... GPT3_175B, llama-3.2-1b ... llama-3.1-70b, "
                       "qwen2.5-0.5b ... qwen2.5-72b, qwen3-0.6b ... qwen3-32b, mistral-7b)", flag="--model",
                       math_changing=True)
    module: str = option("pstar_models", "module with build_model(name, **overrides) returning a staged model (and, "
                         "for Hugging Face checkpoints, build_from_hf, hf_tensors, hf_config)", flag="--model-module")
    n_layer: int | None = option(None, "override the preset's depth", math_changing=True)
    d_model: int | None = option(None, "override the preset's width", math_changing=True)
    n_head: int | None = option(None, "override the preset's attention heads", math_changing=True)
    vocab_size: int | None = option(None, "override the preset's vocabulary size", math_changing=True)
    seq_len: int | None = option(None, "override the preset's sequence length", math_changing=True)
    tie_embeddings: bool | None = option(None, "share the token embedding with the output head",
                                         math_changing=True)
    output_router_logits: bool | None = option(None, "add a mixture of experts' router load-balancing loss "
                                               "(times config.json's router_aux_loss_coef) to the training loss, "
                                               "as transformers does with output_router_logits (default: as "
                                               "config.json says)", math_changing=True)
    init_from_flax: str | None = option(None, "start from a plain Flax export (--export-flax)", metavar="DIR")
    init_from_hf: str | None = option(None, "start from a Hugging Face checkpoint directory (config.json and "
                                      "safetensors; gpt2, llama, qwen2, mistral, qwen3): the model is built from its "
                                      "config.json, --model is ignored", metavar="DIR", math_changing=True)
    init_from_lora: str | None = option(None, "continue training a Hugging Face peft LoRA adapter (adapter_config.json "
                                        "and adapter_model.safetensors) on --init-from-hf's base: its rank, alpha "
                                        "and targets become the run's LoRA settings", metavar="DIR",
                                        math_changing=True)

    def __post_init__(self) -> None:
        positive_int(self, *MODEL_SHAPE, allow_none=True, upper=MAX_STEPS)
        if self.init_from_flax and self.init_from_hf:
            raise ConfigError("ModelConfig.init_from_flax and ModelConfig.init_from_hf both give initial weights; "
                              "choose one")
        if self.init_from_lora and not self.init_from_hf:
            raise ConfigError("ModelConfig.init_from_lora needs ModelConfig.init_from_hf: the base checkpoint the "
                              "adapter was trained on")

    def overrides(self) -> dict[str, Any]:
        """The preset fields this config replaces (None: keep the preset's)."""
        fields = (*MODEL_SHAPE, "tie_embeddings", "output_router_logits")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


@section
class TrainConfig:
    steps: int = option(300, "optimizer steps in all (also when resuming)", math_changing=True)
    batch_size: int = option(16, "sequences per step, over all micro-batches", math_changing=True)
    seed: int = option(0, "seed of the initial weights and the data order", math_changing=True)
    skip_nonfinite: bool = option(False, "skip steps whose loss or grads are not finite (default: stop with "
                                  "an error naming the step)")
    eval_every: int = option(0, "report a held-out loss (forward only) after steps N, 2N, ... (counted from 1) "
                             "and at the end, on "
                             "--eval-data or else the last 1%% of the training tokens, which are then not "
                             "trained on; 0: never", metavar="N")
    eval_batches: int = option(8, "micro-batches (of the training micro-batch shape) each held-out loss "
                               "averages over", metavar="N")

    def __post_init__(self) -> None:
        positive_int(self, "steps", "batch_size", "eval_batches", upper=MAX_STEPS)
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or not \
                0 <= self.eval_every <= MAX_STEPS:
            raise ConfigError(f"TrainConfig.eval_every must be a whole number of at least 0 (0: never), "
                              f"got {self.eval_every!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"TrainConfig.seed must be a whole number in [0, {MAX_SEED}], got {self.seed!r}")


@section
class OptimConfig:
    """AdamW with warmup + cosine decay to ``lr * final_lr_fraction`` and global-norm clipping."""
    lr: float = option(1e-3, "peak learning rate", math_changing=True)
    warmup_steps: int | None = option(None, "linear warmup steps (default: 5%% of the steps)", math_changing=True)
    total_steps: int | None = option(None, "steps of the cosine schedule (default: the run's steps)", cli=False,
                                     math_changing=True)
    final_lr_fraction: float = option(0.1, "the cosine decay ends at lr times this", math_changing=True)
    weight_decay: float = option(0.1, "AdamW weight decay of matrices (norms and biases: none)",
                                 math_changing=True)
    b1: float = option(0.9, "Adam beta1", flag="--adam-b1", math_changing=True)
    b2: float = option(0.95, "Adam beta2", flag="--adam-b2", math_changing=True)
    eps: float = option(1e-8, "Adam epsilon", flag="--adam-eps", math_changing=True)
    clip_norm: float | None = option(1.0, "global gradient-norm clip; 0 disables", parse=parse_clip_norm,
                                     math_changing=True)

    def __post_init__(self) -> None:
        finite(self, "lr", 0)
        finite(self, "weight_decay", 0, low_open=False)
        finite(self, "final_lr_fraction", 0, 1, low_open=False, high_open=False)
        finite(self, "b1", 0, 1, low_open=False)
        finite(self, "b2", 0, 1, low_open=False)
        finite(self, "eps", 0)
        if self.clip_norm is not None:
            finite(self, "clip_norm", 0)
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool) or not isinstance(
                self.warmup_steps, int) or not 0 <= self.warmup_steps <= MAX_STEPS):
            raise ConfigError(f"OptimConfig.warmup_steps must be a whole number of at least 0, got {self.warmup_steps!r}")
        positive_int(self, "total_steps", allow_none=True, upper=MAX_STEPS)

    def schedule_steps(self) -> tuple[int, int | None]:
        """(warmup, total) steps of the schedule. Without ``total_steps`` (a RunConfig sets it to
        the run's steps) the learning rate stays at its peak after the warmup."""
        if self.warmup_steps is not None:
            return self.warmup_steps, self.total_steps
        return (max(1, self.total_steps // 20) if self.total_steps else 0), self.total_steps


PRECISIONS = ("bf16", "fp32")
ADAM_PLACEMENTS = ("auto", "device", "host", "stream")
ENGINES = ("chunked", "plain")
REMATS = ("none", "dots", "full", "offload")
BASE_QUANTS = ("nf4", "int8")


@section
class EngineConfig:
    """How the model is run. Sizes are per device.

    ``device_memory``: all the device memory the engine may use, chunks and working memory
    together: bytes (int), a fraction of the device (float in (0, 1]), or None for automatic
    (0.9 of an accelerator; on a CPU half the model data beside the working memory, so that
    chunks move). ``chunk_numel`` is one size for trained and frozen chunks alike; None picks, for
    each of the two, the size that wastes least (a larger tensor then gets a chunk of its own)."""
    chunk_numel: int | None = option(None, "elements per chunk, trained and frozen alike (4M, 65536), or auto: "
                                     "for each the size that wastes least", flag="--chunk-size",
                                     parse=parse_chunk_numel)
    device_memory: int | float | None = option(
        None, "device memory for chunks and activations: bytes (2GiB, 1e9), a fraction of the device "
        "(0.8), or auto (0.9 on an accelerator; on a CPU half the model data, so chunks move)",
        parse=parse_device_memory)
    precision: str = option("bf16", "compute dtype of params, activations and grads (master and Adam: fp32)",
                            choices=PRECISIONS, math_changing=True)
    micro_batches: int = option(1, "gradient accumulation steps per optimizer step")
    keep_residuals: int | None = option(0, "chunked engine: the last N blocks keep their backward's activations "
                                        "(the jax.vjp residuals) from their forward instead of computing the "
                                        "forward again: fewer FLOPs, more memory, placed like the stage inputs; "
                                        "auto: of none, a quarter, half, three quarters and all of the blocks, the "
                                        "count the plan predicts fastest", parse=parse_keep_residuals)
    adam_placement: str = option("auto", "where fp32 master and Adam state live: device, host (updated there), "
                                 "stream (kept on the host, updated on the device); auto: per chunk, the mix of the "
                                 "three the plan predicts fastest", choices=ADAM_PLACEMENTS)
    kind: str = option("chunked", "chunked (pstar) or plain (one whole-model jit, the baseline)", flag="--engine",
                       choices=ENGINES)
    remat: str = option("none", "plain engine: XLA rematerialisation of the blocks", choices=REMATS)
    host_memory: int | None = option(None, "pinned host memory pool for chunks (bytes; default: 85%% of what "
                                     "the machine has available)", parse=parse_optional_bytes)
    disk_memory: int | None = option(None, "local disk per device for frozen chunks the host cannot hold, read "
                                     "ahead of each use (bytes; default: none, the base stays in device and host "
                                     "memory; needs the disk's read rate: pstar-machine --disk DIR)",
                                     parse=parse_optional_bytes)
    frozen_cache: str | None = option(None, "directory for one chunk-ordered file of the frozen chunks the plan "
                                      "homes on disk, written once at load and reused by later runs of the same "
                                      "base and layout (default: read them straight from the base's safetensors "
                                      "files)", metavar="DIR")
    base_quant: str | None = option(None, "store the frozen base's projection kernels quantized, dequantized a "
                                    "tile at a time in each stage (QLoRA): nf4 (blocks of 64, double-quantized "
                                    "scales, as bitsandbytes) or int8 (per output channel); norms, embeddings and "
                                    "the head stay in the compute dtype", choices=BASE_QUANTS, math_changing=True)
    machine: str | None = option(None, "rates the plan predicts with: h200, h200-duplex or a JSON file; default: "
                                 "this machine's, measured once and kept (pstar-machine "
                                 "--remeasure measures again)", metavar="NAME_OR_FILE")
    freeze: str | None = option(None, "tensors to freeze (not trained: no grad, no optimizer state; the chunked "
                                "engine keeps them as compute-dtype params only): comma-separated glob patterns "
                                "over tensor names, e.g. 'blocks.*'", metavar="PATTERNS", math_changing=True)

    def __post_init__(self) -> None:
        for name, choices in (("precision", PRECISIONS), ("adam_placement", ADAM_PLACEMENTS), ("kind", ENGINES),
                              ("remat", REMATS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"EngineConfig.{name} must be one of {', '.join(choices)}, got "
                                  f"{getattr(self, name)!r}")
        positive_int(self, "chunk_numel", "host_memory", "disk_memory", allow_none=True, upper=2**62)
        positive_int(self, "micro_batches", upper=MAX_STEPS)
        keep = self.keep_residuals
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise ConfigError(f"EngineConfig.keep_residuals must be a whole number of blocks, 0 or more, got "
                              f"{self.keep_residuals!r}")
        if keep != 0 and self.kind == "plain":
            raise ConfigError("EngineConfig.keep_residuals is the chunked engine's (the plain engine keeps what XLA "
                              "and EngineConfig.remat decide): drop --keep-residuals or use --engine chunked")
        if self.base_quant is not None and self.base_quant not in BASE_QUANTS:
            raise ConfigError(f"EngineConfig.base_quant must be one of {', '.join(BASE_QUANTS)}, got {self.base_quant!r}")
        if self.base_quant and self.disk_memory:
            raise ConfigError("EngineConfig.base_quant keeps the quantized base in device and host memory (the disk "
                              "tier reads a bf16 base's own files): drop EngineConfig.disk_memory or "
                              "EngineConfig.base_quant")
        if self.frozen_cache is not None and not (isinstance(self.frozen_cache, str) and self.frozen_cache.strip()):
            raise ConfigError("EngineConfig.frozen_cache must name a directory")
        if self.frozen_cache and not self.disk_memory:
            raise ConfigError("EngineConfig.frozen_cache holds the frozen chunks the plan homes on disk: give the "
                              "disk's share with EngineConfig.disk_memory (--disk-memory) too, or drop it")
        memory = self.device_memory
        if isinstance(memory, float):
            finite(self, "device_memory", 0, 1, high_open=False)
        elif memory is not None:
            positive_int(self, "device_memory", upper=2**62)

    @property
    def compute_dtype(self):
        import jax.numpy as jnp
        return jnp.bfloat16 if self.precision == "bf16" else jnp.float32

    @property
    def device_budget_bytes(self) -> int | None:
        """The resolved device budget (an engine's config holds bytes or None, never a fraction)."""
        if isinstance(self.device_memory, float):
            raise ConfigError("EngineConfig.device_memory is a fraction; resolve it against the device first "
                              "(pstar_jax.build_engine does)")
        return self.device_memory


@section
class DataConfig:
    path: str | None = option(None, "token file from pstar-tokens, or a packed SFT file (NAME.sft.u16.bin, "
                              "pstar-tokens --chat); default: the Python standard library's sources as bytes",
                              flag="--data", metavar="FILE")
    eval_path: str | None = option(None, "token file or packed SFT file for the held-out loss of --eval-every "
                                   "(default: the last 1%% of the training tokens or rows, held out)",
                                   flag="--eval-data", metavar="FILE")


@section
class CheckpointConfig:
    directory: str | None = option(None, "orbax checkpoints of all engine state", flag="--checkpoint-dir",
                                   metavar="DIR")
    every: int = option(0, "save every K steps (and always at the end); 0: only at the end",
                        flag="--checkpoint-every", metavar="K")
    keep: int = option(3, "checkpoints to keep (the latest is always kept)", flag="--keep-checkpoints")
    resume: bool = option(False, "continue from the latest checkpoint; --steps counts all steps, so a resumed "
                          "run stops where a straight one would")
    allow_changes: bool = option(False, "resume even when a setting that changes the training math (model "
                                 "shape, steps, learning rate, precision...) differs from the checkpoint's",
                                 flag="--allow-config-change")
    stop_after: int | None = option(None, "stop (and save) after K steps of this run, e.g. to fit a job's time "
                                    "limit; --resume continues", metavar="K")
    export_flax: str | None = option(None, "at the end, write the parameters as a plain Flax pytree that "
                                     "models/ loads without pstar_jax", metavar="DIR")
    export_hf: str | None = option(None, "at the end, write a Hugging Face checkpoint (config.json, safetensors "
                                   "shards of at most 5 GB, tokenizer files of --init-from-hf; a LoRA run's "
                                   "adapters merged into the weights)", metavar="DIR")
    export_dtype: str = option("bf16", "dtype of --export-hf's weights", choices=("bf16", "fp16", "fp32"))
    export_lora: str | None = option(None, "at the end, write a LoRA run's adapters (and its modules_to_save) as a "
                                     "Hugging Face peft adapter (adapter_config.json, adapter_model.safetensors, "
                                     "fp32) for --init-from-hf's base", metavar="DIR")

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or not 0 <= self.every <= MAX_STEPS:
            raise ConfigError(f"CheckpointConfig.every must be a whole number of at least 0, got {self.every!r}")
        positive_int(self, "keep", upper=MAX_STEPS)
        positive_int(self, "stop_after", allow_none=True, upper=MAX_STEPS)
        if self.export_dtype not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"CheckpointConfig.export_dtype must be one of bf16, fp16, fp32, got {self.export_dtype!r}")


@section
class DistributedConfig:
    data_parallel: int | None = option(None, "devices W to shard chunks and the batch over (default: all "
                                       "devices of all processes)")
    coordinator: str | None = option(None, "HOST:PORT of process 0 (or PSTAR_COORDINATOR)")
    num_processes: int | None = option(None, "processes in the run (or PSTAR_NUM_PROCESSES)")
    process_id: int | None = option(None, "this process's index (or PSTAR_PROCESS_ID)")
    heartbeat_timeout: int = option(60, "seconds before a silent process counts as dead and the others stop")
    coordinator_timeout: float = option(120.0, "seconds for every process to join through the coordinator before "
                                        "giving up with one line")
    step_timeout: float | None = option(None, "end with an error if a step makes no progress for this many "
                                        "seconds (timed from the end of the second step: the first two "
                                        "compile)")
    local_devices: int | None = option(None, "CPU only: fake this many devices per process (for trying data "
                                       "parallelism)")

    def __post_init__(self) -> None:
        positive_int(self, "data_parallel", "num_processes", "local_devices", allow_none=True, upper=1 << 20)
        positive_int(self, "heartbeat_timeout", upper=10**6)
        if self.step_timeout is not None:
            finite(self, "step_timeout", 0)
        finite(self, "coordinator_timeout", 0)
        if self.process_id is not None and (isinstance(self.process_id, bool) or not isinstance(self.process_id, int)
                                            or self.process_id < 0):
            raise ConfigError(f"DistributedConfig.process_id must be a whole number of at least 0, "
                              f"got {self.process_id!r}")
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ConfigError(f"DistributedConfig.process_id must be below DistributedConfig.num_processes "
                              f"({self.num_processes}), got {self.process_id}")
        if self.coordinator is not None and not re.fullmatch(r"[^\s:]+:[0-9]{1,5}", self.coordinator):
            raise ConfigError(f"DistributedConfig.coordinator must be HOST:PORT, got {self.coordinator!r}")


@section
class OutputConfig:
    metrics_out: str | None = option(None, "JSON lines, one per step", metavar="FILE")
    tensorboard: str | None = option(None, "TensorBoard event files of the same metrics (needs tensorboardX: "
                                     "pip install 'pstar_jax[tensorboard]')", metavar="DIR")
    quiet: bool = option(False, "no progress bar and no start-up lines (what the run is doing before its first "
                         "step: measuring, tracing, planning, compiling); warnings and errors still print")
    profile: str | None = option(None, "write a jax.profiler trace (TensorBoard's profile plugin, Perfetto) of "
                                 "--profile-steps steps to this directory, from the run's third step (the first "
                                 "two compile): stages, copies, host optimizer updates", metavar="DIR")
    profile_steps: int = option(2, "steps the --profile trace covers", metavar="N")

    def __post_init__(self) -> None:
        positive_int(self, "profile_steps", upper=MAX_STEPS)
