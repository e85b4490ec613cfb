"""pstar-plan: will this model train here, and how? Answers from the trace alone, no model data.

Prints whether it fits, the chunk size, how many chunks stay on the device, where Adam runs,
the bytes moved per step, a predicted step time, and the largest depth and batch that fit.
Exit 0 when it fits, 1 when it does not (one sentence why), 2 on bad input.

The searches stay quick for any model: the largest depth lies below what host and device memory
can hold at the model's bytes per layer, each probe asks only whether any placement fits
(make_plan's ``first_fit``), traces of equal stages are analysed once, and the depth search
stops at ``MAX_SEARCH_CHUNKS`` chunks (and says so) because a plan's cost grows with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

from pstar_jax.cli import Parser as _Parser
from pstar_jax.config import ConfigError, ModelConfig, RunConfig, format_bytes, parse_bytes, parse_count


def _model(args):
    from pstar_jax.loop import load_model
    return load_model(RunConfig(model=ModelConfig(
        name=args.model, module=args.model_module, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
        vocab_size=args.vocab_size, seq_len=args.seq_len, tie_embeddings=args.tie_embeddings)))

MAX_SEARCH_CHUNKS = 512  # the depth search plans models of at most this many chunks
MAX_SEARCH_BATCH = 1 << 16  # micro-batch sequences
PLOT_FORMATS = (".png", ".pdf", ".svg")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pstar-plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="GPT2_1B")
    p.add_argument("--model-module", default="models.gpt")
    for flag in ("--n-layer", "--d-model", "--n-head", "--vocab-size", "--seq-len"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device-memory", default="128GiB", help="per device (default: an H200 at 0.95)")
    p.add_argument("--host-memory", default="110GiB", help="pinned host memory for chunks, per host")
    p.add_argument("--data-parallel", type=int, default=1, help="devices W that shard the chunks (ZeRO)")
    p.add_argument("--devices-per-host", type=int, default=None, help="devices sharing one host's memory "
                   "(default: W up to 8)")
    p.add_argument("--chunk-size", default="auto")
    p.add_argument("--adam-placement", choices=("auto", "device", "host", "stream"), default="auto")
    p.add_argument("--machine", default="h200",
                   help="rates for the predicted step time: h200, h200-duplex (copies both ways at once at full "
                        "rate), or a file that python -m pstar_jax.machine wrote")
    p.add_argument("--no-search", action="store_true", help="skip the largest depth and batch searches")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the memory timeline")
    return p


def largest(fits: Callable[[int], bool], start: int, limit: int = 1 << 16) -> int:
    """The largest n in [1, limit] with fits(n), assuming fits is monotone; 0 if not even 1 fits.
    Doubles from ``start``, then bisects: about 2 log2(answer / start) probes."""
    if not fits(1):
        return 0
    low, high = 1, max(2, min(start, limit))
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def model_label(args, cfg) -> str:
    """The model by its actual shape: the preset, what the flags changed, and the dimensions."""
    changed = [f"{flag} {getattr(args, flag)}" for flag in ("d_model", "n_layer", "n_head", "vocab_size", "seq_len")
               if getattr(args, flag) is not None]
    dims = [f"{name} {getattr(cfg, name)}" for name in ("d_model", "n_layer", "n_head", "vocab_size", "seq_len")
            if hasattr(cfg, name)]
    return args.model + (f" with {', '.join(changed)}" if changed else "") + (f" ({', '.join(dims)})" if dims else "")


def _validate(args) -> None:
    if args.micro_batches < 1:
        raise ConfigError(f"--micro-batches must be at least 1, got {args.micro_batches}")
    if args.devices_per_host is not None and args.devices_per_host < 1:
        raise ConfigError(f"--devices-per-host must be at least 1, got {args.devices_per_host}")
    if args.plot is not None:
        folder = os.path.dirname(args.plot) or "."
        if os.path.isdir(args.plot) or not os.path.splitext(args.plot)[1].lower() in PLOT_FORMATS:
            raise ConfigError(f"--plot {args.plot} must name an image file ending in {', '.join(PLOT_FORMATS)}")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError(f"--plot {args.plot}: {folder} is not a directory this process can write to")


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    if args.batch_size < 1 or args.batch_size % args.micro_batches:
        raise ConfigError(f"--batch-size {args.batch_size} must be a positive multiple of --micro-batches")
    device_bytes = parse_bytes(args.device_memory, "--device-memory")
    W = args.data_parallel
    if W < 1 or args.batch_size // args.micro_batches % W:
        raise ConfigError(f"the micro-batch ({args.batch_size // args.micro_batches} sequences) must be a "
                          f"multiple of --data-parallel {W}")
    per_host = args.devices_per_host or min(W, 8)
    host_bytes = parse_bytes(args.host_memory, "--host-memory") // per_host  # the plan is per device
    if args.chunk_size != "auto":
        parse_count(args.chunk_size, "--chunk-size")

    import dataclasses

    import jax
    from jax._src import xla_bridge
    if not xla_bridge.backends_are_initialized():
        # Plans are traced on the CPU backend (its memory analysis stands in for the accelerator's),
        # with W fake devices for the sharded stage functions.
        jax.config.update("jax_platforms", "cpu")
        if W > 1:
            jax.config.update("jax_num_cpu_devices", W)
    if jax.config.jax_compilation_cache_dir is None:
        # The trace compiles each distinct stage once; keeping the compiled stages makes the same
        # question asked again answer in a few seconds (most of a first answer is compiling).
        from pstar_jax.machine import cache_dir
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if len(jax.devices()) < W:
        raise ConfigError(f"--data-parallel {W} needs {W} devices to trace with; {len(jax.devices())} are here")
    import numpy as np
    from jax.sharding import Mesh

    from pstar_jax.chunks import auto_chunk_numel
    from pstar_jax.config import EngineConfig, OptimConfig
    from pstar_jax.machine import load_machine
    from pstar_jax.planning import plan_model
    from pstar_jax.optim import default_tx

    machine = load_machine(args.machine)
    model = _model(args)
    cfg = model.config
    chunk_numel = (auto_chunk_numel(model.param_shapes(), model.decays, multiple=W) if args.chunk_size == "auto"
                   else parse_count(args.chunk_size, "--chunk-size"))
    engine_cfg = EngineConfig(chunk_numel, device_bytes, args.precision, args.micro_batches, args.adam_placement)
    mesh = Mesh(np.array(jax.devices()[:W]), ("data",))
    make_tx = default_tx(OptimConfig())
    micro = args.batch_size // args.micro_batches
    cache: dict = {}
    planned = plan_model(model, engine_cfg, mesh, (micro, cfg.seq_len), machine, host_bytes, make_tx,
                         trace_cache=cache)
    plan = planned.plan

    if args.json:
        print(json.dumps({"model": dataclasses.asdict(cfg), "label": model_label(args, cfg),
                          "chunk_numel": planned.layout.chunk_numel, "n_chunks": planned.layout.n_chunks,
                          "plan": plan.to_json()}))
    else:
        n = planned.layout.n_chunks
        on_device, streamed = sum(plan.opt_on_device), sum(plan.opt_streamed)
        tokens = args.batch_size * cfg.seq_len
        print(f"model {model_label(args, cfg)}: {model.n_params():,} params "
              f"({format_bytes(14 * model.n_params())} of model data at 14 B/param), batch "
              f"{args.batch_size}x{cfg.seq_len} in {args.micro_batches} micro-batch(es), {args.precision}")
        print(f"capacity per device: device {format_bytes(device_bytes)}, host {format_bytes(host_bytes)}; "
              f"{W} data-parallel device(s); rates: {machine.name}")
        print(f"chunks: {n} of {planned.layout.chunk_numel:,} elements "
              f"({100 * planned.layout.numel / planned.layout.padded_numel:.1f}% used)")
        if plan.fits:
            step_s = plan.predicted_step_s
            print(f"fits: peak device {format_bytes(plan.peak_device_bytes)}, peak host "
                  f"{format_bytes(plan.peak_host_bytes)}")
            print(f"resident: {100 * plan.resident_fraction:.0f}% of param chunks never leave the device")
            print(f"adam: on the device for {on_device} chunks, on the host for {n - on_device - streamed}, "
                  f"state streamed through the device for {streamed}")
            print(f"moved per step: {format_bytes(plan.h2d_bytes)} host->device, {format_bytes(plan.d2h_bytes)} "
                  f"device->host")
            tflops = model.flops_per_token() * tokens / step_s / 1e12
            print(f"predicted: {step_s:.3f} s/step, {tokens / step_s:,.0f} tokens/s, {tflops:.0f} model TFLOPS"
                  + (f" ({tflops / W:.0f} per device)" if W > 1 else ""))
    if not args.no_search and not args.json:
        search(args, model, planned, engine_cfg, mesh, machine, host_bytes, make_tx, cache)
    if args.plot:
        plot_timeline(planned, args.plot)
    if not plan.fits:
        print(f"pstar-plan: does not fit: {plan.problem}", file=sys.stderr)
        return 1
    return 0


def search(args, model, planned, engine_cfg, mesh, machine, host_bytes: int, make_tx, cache: dict) -> None:
    """Print the largest depth (at this batch) and the largest batch (at this depth) that fit."""
    from pstar_jax.chunks import build_layout
    from pstar_jax.memory import Placement
    from pstar_jax.optim import ChunkOptimizer
    from pstar_jax.plan import make_plan
    from pstar_jax.schedule import scale_batch
    from pstar_jax.stages import bind
    from pstar_jax.trace import trace_step

    cfg, shape = model.config, planned.shape
    micro = args.batch_size // args.micro_batches
    placement = Placement(mesh)
    device_bytes = planned.device_budget_bytes
    optimizer = ChunkOptimizer(make_tx, placement, engine_cfg.compute_dtype)
    opt_state_bytes = optimizer.state_bytes(planned.layout.chunk_numel)

    def model_at(n_layer: int):
        return _model(argparse.Namespace(**{**vars(args), "n_layer": n_layer}))

    def depth_fits(n_layer: int) -> bool:
        # The trace of plan_model without its full placement search: only "does any placement fit?".
        deeper = model_at(n_layer)
        layout = build_layout(deeper.param_shapes(), deeper.decays, planned.layout.chunk_numel)
        bound = [bind(stage, layout) for stage in deeper.stages(engine_cfg.compute_dtype)]
        traced = trace_step(bound, planned.fns, placement, layout.chunk_numel, engine_cfg.compute_dtype,
                            micro, cfg.seq_len, opt_state_bytes, engine_cfg.micro_batches, cache=cache)
        return make_plan(traced, device_bytes, host_bytes, machine, args.adam_placement, first_fit=True).fits

    # Every parameter needs its bf16 item and its optimizer state somewhere: no deeper model fits
    # in device and host memory together. The search also stops at MAX_SEARCH_CHUNKS chunks.
    depth0 = getattr(cfg, "n_layer", None)
    layer_numel = model_at(depth0 + 1).n_params() - model.n_params() if depth0 else 0
    if layer_numel > 0:
        bytes_per_numel = (shape.item_bytes + shape.opt_state_bytes) / shape.chunk_numel / mesh.devices.size
        memory_bound = depth0 + int((device_bytes + host_bytes - model.n_params() * bytes_per_numel)
                                    // (layer_numel * bytes_per_numel))
        chunk_bound = depth0 + max(0, (MAX_SEARCH_CHUNKS - shape.n_chunks) * planned.layout.chunk_numel // layer_numel)
        limit = max(1, min(memory_bound, chunk_bound))
        depth = largest(depth_fits, depth0, limit)
        capped = depth == limit and chunk_bound < memory_bound
        d = f"d_model {cfg.d_model}" if hasattr(cfg, "d_model") else "this width"
        if capped:
            print(f"largest depth that fits with this batch: at least {depth} layers at {d} (the search stops at "
                  f"{MAX_SEARCH_CHUNKS} chunks; memory alone would allow up to {memory_bound})")
        else:
            print(f"largest depth that fits with this batch: {depth} layers at {d}" if depth
                  else f"no depth fits at {d} with this batch")

    # Activation memory grows with the batch: no batch whose busiest moment alone overflows fits.
    busiest = max((*shape.fwd_non_model, shape.head_non_model, *shape.bwd_non_model))
    memory_limit = device_bytes * micro // max(busiest, 1)
    batch_limit = max(1, min(MAX_SEARCH_BATCH, memory_limit))

    def batch_fits(batch: int) -> bool:
        return make_plan(scale_batch(shape, batch / micro), device_bytes, host_bytes, machine, args.adam_placement,
                         first_fit=True).fits
    batch = largest(batch_fits, micro, batch_limit)
    note = "(activation memory scaled linearly from the trace)"
    if batch == MAX_SEARCH_BATCH < memory_limit:
        print(f"largest batch that fits at this depth: at least {batch * args.micro_batches} sequences per step "
              f"(the search stops there) {note}")
    else:
        print(f"largest batch that fits at this depth: {batch * args.micro_batches} sequences per step {note}"
              if batch else f"no batch fits at this depth {note}")


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
    try:
        return run(argv)
    except ConfigError as err:
        print(f"pstar-plan: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
