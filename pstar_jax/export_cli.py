"""pstar-export: write a pstar_jax checkpoint as a Hugging Face checkpoint (safetensors + config.json).

Only wiring: the run's saved flags rebuild its model, the model's HF module names its tensors,
and the fp32 master tensors stream from the checkpoint into the export a chunk at a time.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import Any, Sequence

from pstar_jax.config import ConfigError
from pstar_jax.hf import EXPORT_DTYPES

_OVERRIDES = ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "tie_embeddings")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pstar-export", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True, help="the run's --checkpoint-dir")
    p.add_argument("--hf", required=True, metavar="OUT", help="directory to write (new, empty or an earlier export)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--export-dtype", choices=tuple(EXPORT_DTYPES), default="bf16")
    p.add_argument("--tokenizer-from", default=None, metavar="DIR", help="copy tokenizer files from this HF "
                   "directory (default: the run's --init-from-hf directory, if any)")
    p.add_argument("--model-module", default=None, help="module with build_model(name, **overrides) "
                   "(default: the run's)")
    p.add_argument("--hf-module", default="models.hf", help="module with hf_tensors(model), hf_config(model) "
                   "and build_from_hf(config, **overrides)")
    return p


def _import(name: str, flag: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ConfigError(f"{flag} {name} cannot be imported ({err})") from None


def _model(run_args: dict, model_module: str | None, hf: ModuleType) -> Any:
    """The run's model, rebuilt from its saved flags as pstar-train built it."""
    if run_args.get("init_from_hf"):
        from pstar_jax.hf import read_hf_config
        return hf.build_from_hf(read_hf_config(run_args["init_from_hf"]), seq_len=run_args.get("seq_len"))
    module = _import(model_module or run_args.get("model_module", "models.gpt"), "--model-module")
    return module.build_model(run_args["model"], **{k: run_args.get(k) for k in _OVERRIDES})


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isdir(args.checkpoint_dir):  # Checkpointer would create it
        raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir} is not a directory")
    from pstar_jax.checkpoint import Checkpointer, CheckpointError, iter_master_tensors
    from pstar_jax.chunks import ChunkLayout
    from pstar_jax.hf import check_export_target, export_hf

    check_export_target(os.path.abspath(args.hf))
    ckpt = Checkpointer(args.checkpoint_dir)
    try:
        meta = ckpt.meta(args.step)
        if not isinstance(meta.get("args"), dict) or "model" not in meta["args"]:
            raise CheckpointError(f"checkpoint in {ckpt.directory} does not record the run's flags; "
                                  "it was not written by pstar-train")
        hf = _import(args.hf_module, "--hf-module")
        try:
            model = _model(meta["args"], args.model_module, hf)
            tensor_map, config = hf.hf_tensors(model), hf.hf_config(model)
        except ValueError as err:  # models/ refuses in one sentence too, without pstar_jax's error type
            raise ConfigError(str(err)) from None
        saved = {s.name: s.shape for s in ChunkLayout.from_json(meta["layout"]).slots}
        if saved != {name: tuple(shape) for name, shape in model.param_shapes().items()}:
            raise CheckpointError(f"the model rebuilt from the run's flags does not match the checkpoint in "
                                  f"{ckpt.directory}; pass the --model-module it was trained with")
        files = export_hf(args.hf, iter_master_tensors(ckpt, meta["step"]), tensor_map, config, args.export_dtype,
                          args.tokenizer_from or meta["args"].get("init_from_hf"))
    finally:
        ckpt.close()
    print(f"exported step {meta['step']} of {ckpt.directory} to {os.path.abspath(args.hf)} "
          f"({args.export_dtype}): {', '.join(files)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(argv)
    except ConfigError as err:
        print(f"pstar-export: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
