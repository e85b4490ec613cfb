"""pstar-plan: will this model train here, and how? Answers from the trace alone, no model data.

Prints whether it fits, the chunk size, how many chunks stay on the device, where Adam runs,
the bytes moved per step, a predicted step time, and the largest depth and batch that fit.
Exit 0 when it fits, 1 when it does not (one sentence why), 2 on bad input. Only wiring:
flags -> configuration -> pstar_jax.planner.plan_report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence

from pstar_jax import cli
from pstar_jax.config import ConfigError, EngineConfig, ModelConfig, RunConfig, TrainConfig

PLOT_FORMATS = (".png", ".pdf", ".svg")
GiB = 2**30


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="pstar-plan", description=__doc__.splitlines()[0])
    cli.add_section(p, "model", skip=("init_from_flax",), defaults={"name": "GPT2_1B"})
    cli.add_section(p, "train", skip=("steps", "seed", "skip_nonfinite", "eval_every", "eval_batches"),
                    defaults={"batch_size": 8})
    cli.add_section(p, "engine", skip=("kind", "remat"),
                    defaults={"device_memory": 128 * GiB, "host_memory": 110 * GiB, "machine": "h200"})
    g = p.add_argument_group("pstar-plan")
    g.add_argument("--data-parallel", type=int, default=1, help="devices W that shard the chunks (ZeRO) (default: 1)")
    g.add_argument("--devices-per-host", type=int, default=None, help="devices sharing one host's --host-memory "
                   "(default: W up to 8)")
    g.add_argument("--no-search", action="store_true", help="skip the largest depth and batch searches")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="draw the memory timeline (.png, .pdf, .svg)")
    return p


def model_label(config: ModelConfig, model) -> str:
    """The model by its actual shape: the preset (or HF directory), what the flags changed, the dimensions."""
    changed = [f"{k} {v}" for k, v in config.overrides().items() if k != "tie_embeddings"]
    dims = [f"{name} {getattr(model.config, name)}" for name in ("d_model", "n_layer", "n_head", "vocab_size",
                                                                  "seq_len") if hasattr(getattr(model, "config", None), name)]
    name = config.init_from_hf or config.name
    return name + (f" with {', '.join(changed)}" if changed else "") + (f" ({', '.join(dims)})" if dims else "")


def _check(args) -> None:
    if args.data_parallel < 1:
        raise ConfigError(f"--data-parallel must be at least 1, got {args.data_parallel}")
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
            jax.config.update("jax_num_cpu_devices", W)
    if jax.config.jax_compilation_cache_dir is None:
        from pstar_jax.machine import cache_dir
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if len(jax.devices()) < W:
        raise ConfigError(f"--data-parallel {W} needs {W} devices to trace with; {len(jax.devices())} are here")


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check(args)
    engine = cli.build(EngineConfig, args, "engine")
    if not isinstance(engine.device_memory, int):  # a fraction would be of this machine, not the planned one
        raise ConfigError("EngineConfig.device_memory must be a size in bytes here (e.g. 80GiB): pstar-plan plans "
                          "for a device it does not see")
    config = RunConfig(model=cli.build(ModelConfig, args, "model"), engine=engine,
                       train=cli.build(TrainConfig, args, "train"))
    W = args.data_parallel
    host_bytes = engine.host_memory // (args.devices_per_host or min(W, 8))  # the plan is per device
    _backend(W)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pstar_jax.loop import load_model
    from pstar_jax.machine import load_machine
    from pstar_jax.planner import plan_report

    machine = load_machine(engine.machine)
    model = load_model(config)

    def model_at(n_layer: int):
        return load_model(dataclasses.replace(config, model=dataclasses.replace(config.model, n_layer=n_layer)))
    mesh = Mesh(np.array(jax.devices()[:W]), ("data",))
    report = plan_report(model, engine, config.train.batch_size, mesh, machine, host_bytes,
                         label=model_label(config.model, model), model_at=model_at,
                         search=not args.no_search and not args.json)
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(model.config) if hasattr(model, "config") else {},
                          **report.to_json()}))
    else:
        print("\n".join(report.lines()))
    if args.plot:
        plot_timeline(report.planned, args.plot)
    if not report.fits:
        print(f"pstar-plan: does not fit: {report.plan.problem}", file=sys.stderr)
        return 1
    return 0


def plot_timeline(planned, path: str) -> None:
    """Model data and non-model data per moment, stacked, against the device capacity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan, accesses = planned.plan, planned.accesses
    opt = sum(plan.opt_on_device) * plan.opt_state_bytes
    gib = 2**30
    non_model = [a.non_model_bytes / gib for a in accesses]
    chunks = [(m.chunk_bytes + opt) / gib for m in plan.moments] or [0.0] * len(accesses)
    x = range(len(accesses))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(x, chunks, non_model, labels=["model data (chunks + device Adam state)", "non-model data"],
                 colors=["#4c72b0", "#dd8452"])
    ax.axhline(plan.device_capacity_bytes / gib, color="black", linestyle="--", label="device capacity")
    ax.set_xlabel("moment (forward, backward, optimizer per chunk)")
    ax.set_ylabel("GiB per device")
    ax.set_title(f"pstar plan: {'fits' if plan.fits else 'does not fit'}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run_main("pstar-plan", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
