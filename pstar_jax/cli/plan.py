"""pstar-plan: will this model train here, and how? Answers from the trace alone, no model data.

Prints whether it fits, the chunk size, how many chunks stay on the device, where Adam runs,
the bytes moved per step, a predicted step time, and the largest depth and batch that fit
(``--largest-seq-len``: also the longest sequence that trains at batch 1).
The model is a preset (``pstar-plan GPT3_12B`` or ``--model GPT3_12B``) or a Hugging Face
checkpoint's config.json (``--init-from-hf DIR``); the machine is one H200 unless the flags say
otherwise, and the first line says what was planned for. Exit 0 when it fits, 1 when it does not
(one sentence why), 2 on bad input. Only wiring:
flags -> configuration -> pstar_jax.planner.report.plan_report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Sequence

from pstar_jax.cli import flags as cli
from pstar_jax.config import ConfigError, EngineConfig, ModelConfig, RunConfig, TrainConfig
from pstar_jax.config.lora import LoraConfig
from pstar_jax.config.preference import PreferenceConfig
from pstar_jax.config.sizes import parse_rate

PLOT_FORMATS = (".png", ".pdf", ".svg")
GiB = 2**30
# Each data-parallel device is a fake CPU device the stage functions are traced over: their
# number costs memory and compile time (the README's GPT3_175B plan uses 32).
MAX_DATA_PARALLEL = 1024
# What pstar-plan plans for unless told otherwise: one H200 of the project's GPU machine (it plans
# for a device it does not see, so "this machine" would be the CPU that traces).
PLAN_HELPS = {
    "device_memory": "device memory per device for chunks and activations, in bytes (2GiB, 1e9): a size, since "
                     "pstar-plan plans for a device it does not see; 128GiB is 92%% of an H200's 139.8 GiB (pstar-train "
                     "itself takes 0.9 of an accelerator, 125.8 GiB there, and on a CPU half the model data beside the "
                     "working memory)",
    "host_memory": "pinned host memory of one host for chunks, in bytes, shared by --devices-per-host devices; "
                   "by default the H200 machine's",
    "machine": "rates the plan predicts with: h200 (measured on the project's H200), h200-duplex, or a JSON "
               "file of pstar-machine (pstar-machine prints it) for this machine's",
}


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="pstar-plan", description=__doc__.splitlines()[0])
    p.add_argument("preset", nargs="?", default=None, metavar="MODEL", help="the model preset, as --model")
    cli.add_section(p, "model", skip=("init_from_flax",), defaults={"name": "GPT2_1B"})
    cli.add_section(p, "train", skip=("steps", "seed", "skip_nonfinite", "eval_every", "eval_batches"),
                    defaults={"batch_size": 8})
    cli.add_section(p, "engine", skip=("kind", "remat", "frozen_cache"),
                    defaults={"device_memory": 128 * GiB, "host_memory": 110 * GiB, "machine": "h200"},
                    helps=PLAN_HELPS)
    cli.add_section(p, "lora")
    cli.add_section(p, "preference")
    g = p.add_argument_group("pstar-plan")
    g.add_argument("--data-parallel", type=int, default=1, help="devices W that shard the chunks (ZeRO) (default: 1)")
    g.add_argument("--devices-per-host", type=int, default=None, help="devices sharing one host's --host-memory "
                   "(default: W up to 8)")
    g.add_argument("--disk-rate", default=None, metavar="RATE", help="the read rate of the local disk that "
                   "--disk-memory plans for (6GB/s: an NVMe drive; default: the rate pstar-machine --disk measured, "
                   "kept in --machine's file)")
    g.add_argument("--no-search", action="store_true", help="skip the largest depth and batch searches")
    g.add_argument("--largest-seq-len", action="store_true", help="also search the longest sequence that trains "
                   "at batch 1 (one sequence per device; a handful of traces whatever the answer, each a few seconds "
                   "to a minute)")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="draw the memory timeline (.png, .pdf, .svg)")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags, with a positional model name taken as --model (given once, one way or the other)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.preset is not None:
        if any(a == "--model" or a.startswith("--model=") for a in argv):
            raise ConfigError(f"the model is named twice ({args.preset} and --model); name it once")
        setattr(args, "model.name", args.preset)
    return args


def objective_label(config: RunConfig) -> str:
    """What the label adds under --objective dpo: the loss and where its reference comes from."""
    p = config.preference
    if p.objective != "dpo":
        return ""
    reference = ("no reference" if not p.uses_reference else "the reference: the base with the adapters off, an "
                 "extra forward in each step" if config.lora.enabled else "the reference: stored before step 0 by "
                 "one forward-only pass over the data under the evaluation's plan (2 of a step's 6 model FLOPs per "
                 "parameter and token, once), then read beside each batch (4 bytes a position)")
    return f", {p.objective.upper()} ({p.loss} loss; {reference})"


def model_label(config: ModelConfig, model, lora: LoraConfig | None = None) -> str:
    """The model by its actual shape: the preset (or HF directory), what the flags changed, the
    dimensions, and a LoRA run's adapters."""
    changed = [f"{k} {v}" for k, v in config.overrides().items() if k != "tie_embeddings"]
    dims = [f"{name} {getattr(model.config, name)}" for name in ("d_model", "n_layer", "n_head", "vocab_size",
                                                                  "seq_len") if hasattr(getattr(model, "config", None), name)]
    name = config.init_from_hf or config.name
    adapters = ""
    if lora is not None and lora.enabled:
        from pstar_jax.model.lora import adapter_names
        n = len(adapter_names(model))
        adapters = f" + LoRA rank {lora.rank} ({n} adapter tensors" + (
            f", {lora.modules_to_save} trained in full)" if lora.modules_to_save else ", the base frozen)")
    return (name + (f" with {', '.join(changed)}" if changed else "") + (f" ({', '.join(dims)})" if dims else "")
            + adapters)


def depth_builder(config: RunConfig, model) -> Callable[[int], Any] | None:
    """How the depth search rebuilds the model at another depth (see ``shape_builder``)."""
    build = shape_builder(config, model)
    return None if build is None else (lambda n_layer: build(n_layer=n_layer))


def seq_len_builder(config: RunConfig, model) -> Callable[[int], Any] | None:
    """How the longest-sequence search rebuilds the model for another sequence length."""
    build = shape_builder(config, model)
    return None if build is None else (lambda seq_len: build(seq_len=seq_len))


def shape_builder(config: RunConfig, model) -> Callable[..., Any] | None:
    """``build(**changes)``: the model with other shape fields (n_layer, seq_len): the preset with
    those flags, or, for an imported checkpoint (whose config.json fixes the shape), its own shape
    with those fields replaced; None for a model whose shape pstar-plan cannot vary."""
    from pstar_jax.io.models import load_model
    if not config.model.init_from_hf:
        return lambda **changes: load_model(dataclasses.replace(
            config, model=dataclasses.replace(config.model, **changes)))
    shape = getattr(model, "config", None)
    if not (dataclasses.is_dataclass(shape) and hasattr(shape, "n_layer")):
        return None
    try:  # a model module's own class may not be built from its config alone
        type(model)(shape)
    except (TypeError, ValueError):
        return None
    return lambda **changes: type(model)(dataclasses.replace(shape, **changes))


def _check(args, config: RunConfig) -> None:
    """Everything the flags alone can refuse, before a backend (with W fake devices) starts."""
    W, micro = args.data_parallel, config.train.batch_size // config.engine.micro_batches
    if not 1 <= W <= MAX_DATA_PARALLEL:
        raise ConfigError(f"--data-parallel must be in [1, {MAX_DATA_PARALLEL}], got {W}")
    if config.train.batch_size % config.engine.micro_batches:
        raise ConfigError(f"TrainConfig.batch_size {config.train.batch_size} must be a positive multiple of "
                          f"EngineConfig.micro_batches {config.engine.micro_batches}")
    if micro % W:
        raise ConfigError(f"the micro-batch ({micro} sequences) must be a multiple of --data-parallel {W}: use "
                          f"--data-parallel {max(d for d in range(1, min(W, micro) + 1) if micro % d == 0)} "
                          f"or TrainConfig.batch_size {-(-micro // W) * W * config.engine.micro_batches}")
    if args.devices_per_host is not None and args.devices_per_host < 1:
        raise ConfigError(f"--devices-per-host must be at least 1, got {args.devices_per_host}")
    if args.plot is not None:
        folder = os.path.dirname(args.plot) or "."
        if os.path.isdir(args.plot) or not os.path.splitext(args.plot)[1].lower() in PLOT_FORMATS:
            raise ConfigError(f"--plot {args.plot} must name an image file ending in {', '.join(PLOT_FORMATS)}")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError(f"--plot {args.plot}: {folder} is not a directory this process can write to")
        try:  # an optional dependency, checked before the planning rather than after it
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib: pip install 'pstar_jax[plot]'") from None


def _backend(W: int) -> None:
    """Plans are traced on the CPU backend (its memory analysis stands in for the accelerator's),
    with W fake devices for the sharded stage functions; compiled stages are kept, so the same
    question asked again answers in a few seconds (most of a first answer is compiling)."""
    import jax
    from jax._src import xla_bridge
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        if W > 1:
            from pstar_jax.compat import patient_cpu_collectives
            patient_cpu_collectives()
            jax.config.update("jax_num_cpu_devices", W)
    if jax.config.jax_compilation_cache_dir is None:
        from pstar_jax.planner.measure import cache_dir
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if len(jax.devices()) < W:
        raise ConfigError(f"--data-parallel {W} needs {W} devices to trace with; {len(jax.devices())} are here")


def run(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    engine = cli.build(EngineConfig, args, "engine")
    if not isinstance(engine.device_memory, int):  # a fraction would be of this machine, not the planned one
        raise ConfigError("EngineConfig.device_memory must be a size in bytes here (e.g. 80GiB): pstar-plan plans "
                          "for a device it does not see")
    config = RunConfig(model=cli.build(ModelConfig, args, "model"), engine=engine,
                       train=cli.build(TrainConfig, args, "train"), lora=cli.build(LoraConfig, args, "lora"),
                       preference=cli.build(PreferenceConfig, args, "preference"))
    _check(args, config)
    rate = None if args.disk_rate is None else parse_rate(args.disk_rate, "--disk-rate")
    W = args.data_parallel
    per_host = args.devices_per_host or min(W, 8)  # the devices sharing --host-memory
    host_bytes = engine.host_memory // per_host  # the plan is per device
    _backend(W)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pstar_jax.io.models import load_model
    from pstar_jax.plan.machine import load_machine
    from pstar_jax.planner.report import plan_report
    from pstar_jax.planner.search import Progress

    machine = load_machine(engine.machine)
    if rate is not None:
        machine = dataclasses.replace(machine, disk_read_bytes_per_s=rate, disk_tensor_bytes_per_s=rate)
    if engine.disk_memory and not machine.disk_read_bytes_per_s:
        raise ConfigError("EngineConfig.disk_memory needs the disk's read rate: pass --disk-rate (6GB/s for an NVMe "
                          "drive) or a --machine file where pstar-machine --disk DIR measured it")
    model = load_model(config)

    seq_len_at = seq_len_builder(config, model) if args.largest_seq_len else None
    if args.largest_seq_len and seq_len_at is None:
        raise ConfigError("--largest-seq-len needs a model whose sequence length pstar-plan can vary (a preset or a "
                          "Hugging Face config.json); this model's class cannot be rebuilt from its config")
    mesh = Mesh(np.array(jax.devices()[:W]), ("data",))
    # what a step trains: under --objective dpo the preference head, and a LoRA run's in-step reference
    from pstar_jax.run.objective import trained_model
    at_depth = depth_builder(config, model)
    report = plan_report(trained_model(config, model), engine, config.train.batch_size, mesh, machine, host_bytes,
                         label=model_label(config.model, model, config.lora) + objective_label(config),
                         model_at=at_depth and (lambda n: trained_model(config, at_depth(n))),
                         search=not args.no_search and not args.json,
                         seq_len_at=seq_len_at and (lambda n: trained_model(config, seq_len_at(n))),
                         lora=config.lora, progress=Progress("pstar-plan"))
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(model.config) if hasattr(model, "config") else {},
                          **report.to_json()}))
    else:
        print("\n".join(report.lines()))
    if args.plot:
        from pstar_jax.planner.plot import plot_timeline
        plot_timeline(report.planned, args.plot)
        print(f"pstar-plan: memory timeline written to {os.path.abspath(args.plot)}", file=sys.stderr)  # stdout: the plan
    if not report.fits:
        from pstar_jax.planner.fit import misfit_fixes
        fix = misfit_fixes(report.planned, host_bytes, machine, engine, devices_per_host=per_host)
        print(cli.with_flags(f"pstar-plan: does not fit: {report.plan.problem}; {fix}"), file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run_main("pstar-plan", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
