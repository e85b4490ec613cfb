"""pstar-export: write a pstar_jax checkpoint as a Hugging Face checkpoint (safetensors + config.json) or a LoRA run's as a peft adapter.

Only wiring: the run's saved configuration rebuilds its model, the model's HF module names its tensors,
and the fp32 master tensors stream from the checkpoint into the export a chunk at a time, a frozen
base's from its source (a LoRA run's adapters merged into their kernels; --lora writes the adapters
alone, as peft does): the bytes the run's own --export-hf writes (pstar_jax.io.hf_export).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Sequence

from pstar_jax.cli import flags as cli
from pstar_jax.config import CheckpointConfig, ConfigError, RunConfig, from_dict

# Only the standard library and the configuration above this line: --help and a usage error come
# at once, and jax, numpy and safetensors load after the arguments are parsed.
_DTYPE = next(f for f in dataclasses.fields(CheckpointConfig) if f.name == "export_dtype")


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="pstar-export", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True, help="the run's --checkpoint-dir")
    p.add_argument("--hf", default=None, metavar="OUT", help="directory to write the Hugging Face checkpoint to "
                   "(new, empty or an earlier export)")
    p.add_argument("--lora", default=None, metavar="OUT", help="directory to write a LoRA run's adapters to, as a "
                   "peft adapter (new, empty or an earlier adapter export)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--export-dtype", choices=_DTYPE.metadata["choices"], default=_DTYPE.default,
                   help="dtype of the --hf export's weights")
    p.add_argument("--tokenizer-from", default=None, metavar="DIR", help="copy tokenizer files from this HF "
                   "directory (default: the run's --init-from-hf directory, if any)")
    p.add_argument("--model-module", default=None, help="module with build_model, hf_tensors and hf_config, "
                   "imported (its code run) because you name it: needed for a run trained with a module other "
                   "than pstar_models (default: pstar_models)")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.hf and not args.lora:
        raise ConfigError("pass --hf OUT (the whole model) or --lora OUT (a LoRA run's adapters), or both")
    if not os.path.isdir(args.checkpoint_dir):  # Checkpointer would create it
        raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir} is not a directory")
    from pstar_jax.io.base_record import checkpoint_tensors
    from pstar_jax.io.checkpoint import Checkpointer, CheckpointError, iter_master_tensors
    from pstar_jax.engine.chunks import ChunkLayout
    from pstar_jax.io.hf import check_export_target, tokenizer_files
    from pstar_jax.io.hf_export import export_run_hf, quant_note
    from pstar_jax.io.lora_io import export_lora
    from pstar_jax.io.models import hf_export_config, load_model, saved_run_config
    from pstar_jax.io.peft_io import check_adapter_target

    if args.hf:
        check_export_target(args.hf, "--hf")
        if args.tokenizer_from and os.path.isdir(args.tokenizer_from):
            tokenizer_files(args.tokenizer_from)  # refused (a link out of it) before the export's work
    if args.lora:
        check_adapter_target(args.lora, "--lora")
    ckpt = Checkpointer(args.checkpoint_dir)
    try:
        meta = ckpt.meta(args.step)
        if not isinstance(meta.get("config"), dict):
            raise CheckpointError(f"checkpoint in {ckpt.directory} does not record its run's configuration; "
                                  "it was not written by this version of pstar-train")
        config = from_dict(RunConfig, meta["config"])
        if meta.get("engine", "chunked") != "chunked":
            raise CheckpointError(f"checkpoint in {ckpt.directory} was written by the {meta['engine']} engine; "
                                  "pstar-export reads chunked checkpoints (export a plain run with --export-hf)")
        config = saved_run_config(config, args.model_module, ckpt.directory, "pstar-export")
        model = load_model(config)
        if args.hf:
            hf_export_config(config, model)  # a model with no HF export: refused before the --lora export
        saved = {s.name: s.shape for s in ChunkLayout.from_json(meta["layout"]).slots}
        if saved != {name: tuple(shape) for name, shape in model.param_shapes().items()}:
            raise CheckpointError(f"the model rebuilt from the run's flags does not match the checkpoint in "
                                  f"{ckpt.directory}; pass the --model-module it was trained with")

        def tensors():  # the saved tensors and a frozen base's from its record (checked against it)
            return checkpoint_tensors(ckpt, meta, model, config)

        def trained():  # the saved tensors alone: the adapters, without reading the base
            return iter_master_tensors(ckpt, meta["step"])
        if args.lora:  # first: it refuses a run without LoRA before the long export
            files = export_lora(args.lora, config, model, tensors, what="--lora", whole="--hf")
            print(f"exported the LoRA adapter of step {meta['step']} of {ckpt.directory} to "
                  f"{os.path.abspath(args.lora)}: {', '.join(files)}")
        if args.hf:
            files = export_run_hf(args.hf, config, model, tensors, args.export_dtype,
                                  args.tokenizer_from or config.model.init_from_hf, iter_adapters=trained, what="--hf")
            print(f"exported step {meta['step']} of {ckpt.directory} to {os.path.abspath(args.hf)} "
                  f"({args.export_dtype}): {', '.join(files)}{quant_note(config)}")
    finally:
        ckpt.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run_main("pstar-export", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
