"""LoRA beside full fine-tuning under one device and host budget: the largest model each trains,
found by the planner and then trained for real, and the bytes a step moves for each.

    python scripts/bench_lora.py --tiny --out runs/lora          # this CPU, a few minutes
    python scripts/bench_lora.py --model GPT3_12B --host-memory 100GiB --batch-size 8 --modes lora

The preset's width is kept and its depth searched (as scripts/pstar_largest.py does, with the
frozen base counted as frozen chunks: 2 bytes per parameter in bf16 against full training's 14).
Runs, each trained for ``--steps`` steps on one fixed batch (so the loss must fall):
  full           full fine-tuning at its largest depth
  lora-same      LoRA of that same base model: the bytes a step moves beside full training's
  lora           LoRA at its largest depth
Bytes moved are the chunk store's own counts per step, split by what moved: frozen base chunks,
trainable param/grad chunks, optimizer state (master, m, v), and the stage inputs the plan sends to
the host and back for the backward (store key ("act", stage, micro)). Evicting a frozen chunk drops its
device copy, so frozen chunks never move device->host; the script exits 1 if one did, or if a
loss was not finite and falling. On a CPU the device is simulated (--device-memory, which the
chunk store enforces) and the copies are between labels on the same RAM.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pstar_jax as ps  # noqa: E402
from pstar_models import build_model  # noqa: E402
from pstar_models.lora import LoraSpec  # noqa: E402
from pstar_jax.engine.chunks import build_layout  # noqa: E402
from pstar_jax.model.freeze import trainable as make_trainable  # noqa: E402
from pstar_jax.config.lora import LoraConfig  # noqa: E402
from pstar_jax.model.lora import frozen_for_lora  # noqa: E402
from pstar_jax.engine.memory import Placement, host_budget_bytes  # noqa: E402
from pstar_jax.model.staged import decays  # noqa: E402
from pstar_jax.engine.optim import ChunkOptimizer  # noqa: E402
from pstar_jax.plan.placement import make_plan  # noqa: E402
from pstar_jax.planner.search import default_tx_for_shapes, largest_mixed  # noqa: E402
from pstar_jax.planner.build import default_mesh, layout_for, resolve_machine  # noqa: E402
from pstar_jax.engine.stages import StageFunctions, bind  # noqa: E402
from pstar_jax.planner.trace import trace_step  # noqa: E402

KINDS = ("frozen", "trainable", "optimizer", "inputs")  # what a chunk store key holds, for the byte split


def lora_model(preset: str, n_layer: int, rank: int):
    """The preset at ``n_layer`` layers, with rank-``rank`` adapters on every projection (0: none)."""
    return build_model(preset, n_layer=n_layer, lora=LoraSpec(rank=rank, alpha=2.0 * rank) if rank else None)


def frozen_of(model, rank: int) -> frozenset[str]:
    return frozen_for_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank)) if rank else frozenset()


@dataclasses.dataclass
class Searcher:
    """The depth search of pstar_jax.planner.report (trace and first-fit plan, no model data), with the
    LoRA run's frozen base laid out as frozen chunks."""
    preset: str
    config: ps.EngineConfig  # resolved: the preset's chunk size at every depth
    mesh: object
    machine: object
    host_bytes: int
    batch: int

    def __post_init__(self) -> None:
        self.fns, self.cache = StageFunctions(self.mesh), {}
        self.placement = Placement(self.mesh)
        self.optimizer = ChunkOptimizer(default_tx_for_shapes(), self.placement, self.config.compute_dtype)

    def fits(self, n_layer: int, rank: int, mixes: bool) -> bool:
        model = lora_model(self.preset, n_layer, rank)
        layout = build_layout(model.param_shapes(), functools.partial(decays, model), self.config.chunk_numel,
                              trainable=make_trainable(frozen_of(model, rank)))
        bound = [bind(s, layout) for s in model.stages(self.config.compute_dtype)]
        shape = trace_step(bound, self.fns, self.placement, layout.numels, self.config.compute_dtype, self.batch,
                           model.config.seq_len, self.optimizer.chunk_state_bytes(layout), self.config.micro_batches,
                           cache=self.cache)
        return make_plan(shape, self.config.device_memory, self.host_bytes, self.machine, self.config.adam_placement,
                         first_fit=True, mixes=mixes).fits

    def largest(self, rank: int, max_layers: int) -> int:
        """The deepest model that fits, up to what memory alone allows (every parameter's bf16 item,
        and for full training its 12 bytes of fp32 state, somewhere) and ``max_layers``."""
        one, two = lora_model(self.preset, 1, rank).n_params(), lora_model(self.preset, 2, rank).n_params()
        item = np.dtype(self.config.compute_dtype).itemsize
        per_param = item if rank else item + 12
        bound = int((self.config.device_memory + self.host_bytes) // (per_param * (two - one)))
        start = build_model(self.preset).config.n_layer  # the doubling starts at the preset's depth
        return largest_mixed(lambda n, mixes: self.fits(n, rank, mixes), start, max(1, min(bound, max_layers)))


@dataclasses.dataclass
class Run:
    name: str
    layers: int
    params: int
    trained_params: int
    losses: list[float] = dataclasses.field(default_factory=list)
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    h2d_bytes: int = 0  # the last step's, measured
    d2h_bytes: int = 0
    planned_h2d_bytes: int = 0
    planned_d2h_bytes: int = 0
    moved: dict = dataclasses.field(default_factory=dict)  # kind -> [h2d, d2h], the last step
    peak_device_bytes: int = 0  # chunks on the device at most, the last step
    plan_peak_bytes: tuple[int, int] = (0, 0)  # the plan's peak device and host memory


def count_by_kind(engine) -> dict[str, list[int]]:
    """The chunk store's copies since its last traffic reset, by the kind of what moved: kind ->
    [h2d bytes, d2h bytes]. Wraps the store's one copying method (evictions copy through it too)
    and its reset, so the engine runs unchanged and the split sums to the step's own counts."""
    store, layout = engine.store, engine.layout
    get, reset = store.get, store.traffic.reset
    moved = {k: [0, 0] for k in KINDS}

    def get_counted(key, space):
        h2d, d2h = store.traffic.h2d_bytes, store.traffic.d2h_bytes
        value = get(key, space)
        kind = ("inputs" if key[0] == "act" else "optimizer" if key[0] in ("master", "opt")
                else "frozen" if layout.is_frozen(key[1]) else "trainable")
        moved[kind][0] += store.traffic.h2d_bytes - h2d
        moved[kind][1] += store.traffic.d2h_bytes - d2h
        return value

    def reset_counted():
        reset()
        for pair in moved.values():
            pair[:] = [0, 0]
    store.get, store.traffic.reset = get_counted, reset_counted
    return moved


def train(name: str, preset: str, n_layer: int, rank: int, config, mesh, machine, args) -> Run:
    model = lora_model(preset, n_layer, rank)
    frozen = frozen_of(model, rank)
    run = Run(name, n_layer, model.n_params(),
              sum(math.prod(s) for n, s in model.param_shapes().items() if n not in frozen))
    seq = model.config.seq_len
    optim = ps.OptimConfig(lr=args.lr, warmup_steps=0, total_steps=args.steps)
    engine = ps.build_engine(model, config, optim, (args.batch_size, seq), mesh=mesh, machine=machine, frozen=frozen)
    moved = count_by_kind(engine)
    tok = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch_size, seq + 1))
    batch = [(tok[:, :-1], tok[:, 1:])]  # the same batch every step: its loss falls as it is learnt
    times = []
    for i in range(args.steps):
        r = engine.step(batch)
        run.losses.append(float(r.loss))
        times.append(r.step_s)
        print(f"  {name} step {i}: loss {r.loss:.4f}, {r.step_s:.2f} s, h2d {ps.format_bytes(r.h2d_bytes)}, "
              f"d2h {ps.format_bytes(r.d2h_bytes)} (planned {ps.format_bytes(r.predicted_h2d_bytes)}, "
              f"{ps.format_bytes(r.predicted_d2h_bytes)})", flush=True)
    run.step_s = float(np.median(times[1:] or times))  # the first step compiles
    run.tokens_per_s = args.batch_size * seq / run.step_s
    run.h2d_bytes, run.d2h_bytes = r.h2d_bytes, r.d2h_bytes
    run.planned_h2d_bytes, run.planned_d2h_bytes = r.predicted_h2d_bytes, r.predicted_d2h_bytes
    run.moved = {k: list(v) for k, v in moved.items()}
    run.peak_device_bytes = r.device_chunk_peak_bytes
    run.plan_peak_bytes = (engine.plan.peak_device_bytes, engine.plan.peak_host_bytes)
    return run


def problems(run: Run) -> list[str]:
    """What would make the run's figures wrong: a loss not finite or not falling, frozen chunks
    copied device->host, or the split not adding up to the step's own counts."""
    out = []
    if not all(math.isfinite(v) for v in run.losses) or run.losses[-1] >= run.losses[0]:
        out.append(f"{run.name}: the loss is not finite and falling ({run.losses})")
    if run.moved["frozen"][1]:
        out.append(f"{run.name}: frozen chunks moved {run.moved['frozen'][1]} bytes device->host")
    if [sum(v[i] for v in run.moved.values()) for i in (0, 1)] != [run.h2d_bytes, run.d2h_bytes]:
        out.append(f"{run.name}: the bytes by kind {run.moved} do not add up to the step's {run.h2d_bytes} h2d, "
                   f"{run.d2h_bytes} d2h")
    return out


def table(runs: list[Run], header: str) -> list[str]:
    f = ps.format_bytes
    lines = [header, "", "| run | layers | params | trained | loss first -> last | step s | tokens/s | h2d/step "
             "(planned) | d2h/step (planned) | frozen h2d / d2h | trainable h2d / d2h | optimizer h2d / d2h | "
             "stage inputs h2d / d2h | plan peak device / host |", "|" + " --- |" * 14]
    for r in runs:
        m = r.moved
        lines.append(f"| {r.name} | {r.layers} | {r.params:,} | {r.trained_params:,} | {r.losses[0]:.4f} -> "
                     f"{r.losses[-1]:.4f} | {r.step_s:.3f} | {r.tokens_per_s:,.0f} | {f(r.h2d_bytes)} "
                     f"({f(r.planned_h2d_bytes)}) | {f(r.d2h_bytes)} ({f(r.planned_d2h_bytes)}) | "
                     + " | ".join(f"{f(m[k][0])} / {f(m[k][1])}" for k in KINDS)
                     + f" | {f(r.plan_peak_bytes[0])} / {f(r.plan_peak_bytes[1])} |")
    by_name = {r.name: r for r in runs}
    if "full" in by_name and "lora" in by_name:
        full, lora = by_name["full"], by_name["lora"]
        lines += ["", f"LoRA trains {lora.layers} layers ({lora.params:,} params) where full fine-tuning trains "
                  f"{full.layers} ({full.params:,}): {lora.params / full.params:.2f}x the parameters"]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="this CPU's sizes: the small preset (d_model 128), a "
                   "simulated 12 MiB device, 48 MiB host, batch 2")
    p.add_argument("--model", default=None, help="a GPT or Llama-family preset (its width is kept)")
    p.add_argument("--lora-rank", type=int, default=None, help="default 16 (2 with --tiny: at d_model 128 a "
                   "rank-16 adapter is 16%% of its layer, at 12-14 B/param, where at d_model 4096 it is 0.5%%)")
    p.add_argument("--modes", default="full,lora-same,lora", help="comma list of full, lora-same, lora")
    p.add_argument("--device-memory", default=None, help="device budget (default: 0.95 of the device; 12MiB "
                   "with --tiny)")
    p.add_argument("--host-memory", default=None, help="host budget (default: 48MiB with --tiny, else 100GiB)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 2 with --tiny, else 8)")
    p.add_argument("--max-layers", type=int, default=4096, help="the depth search stops here")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None, help="directory for results.md and results.json")
    args = p.parse_args(argv)
    preset = args.model or ("small" if args.tiny else "GPT3_12B")
    args.batch_size = args.batch_size or (2 if args.tiny else 8)
    args.lora_rank = args.lora_rank if args.lora_rank is not None else (2 if args.tiny else 16)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - {"full", "lora-same", "lora"})
    if unknown or args.lora_rank < 1:
        p.error(f"--modes takes full, lora-same, lora (got {', '.join(unknown)})" if unknown
                else "--lora-rank must be at least 1")
    device = jax.local_devices()[0]
    mesh = default_mesh(1)
    on_h200 = "H200" in device.device_kind
    device_memory = args.device_memory or ("12MiB" if args.tiny else None)
    config = ps.EngineConfig(device_memory=ps.parse_bytes(device_memory, "--device-memory") if device_memory else 0.95,
                             host_memory=ps.parse_bytes(args.host_memory or ("48MiB" if args.tiny else "100GiB"),
                                                        "--host-memory"),
                             machine="h200" if on_h200 else None)  # else this machine's saved rates
    # One chunk size for every run and depth: the preset's with full training (adapters are small
    # tensors packed like any other, so the LoRA layout differs only in which chunks are frozen).
    config = ps.resolve_engine_config(config, build_model(preset), mesh)
    config = dataclasses.replace(config, chunk_numel=layout_for(build_model(preset), config, mesh).numels[0])
    machine = resolve_machine(config, mesh)
    host_bytes = host_budget_bytes(config.host_memory)
    load = os.getloadavg()
    header = (f"{time.strftime('%Y-%m-%d %H:%M')} on {device.device_kind} ({device.platform}), jax {jax.__version__}, "
              f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores; {preset} at "
              f"d_model {build_model(preset).config.d_model}, LoRA rank {args.lora_rank} on every projection; device "
              f"budget {ps.format_bytes(config.device_memory)}, host {ps.format_bytes(host_bytes)}; chunks of "
              f"{config.chunk_numel:,} elements; batch {args.batch_size} x {build_model(preset).config.seq_len}; "
              f"bf16; {args.steps} steps on one batch, step time the median after the first")
    print(header, flush=True)
    search = Searcher(preset, config, mesh, machine, host_bytes, args.batch_size)
    depths = {}
    for rank, wanted in ((0, {"full", "lora-same"}), (args.lora_rank, {"lora"})):
        if wanted & set(modes):
            start = time.perf_counter()
            depths[rank] = search.largest(rank, args.max_layers)
            print(f"largest depth {'with LoRA' if rank else 'full fine-tuning'}: {depths[rank]} layers (planned in "
                  f"{time.perf_counter() - start:.1f} s)", flush=True)
            if not depths[rank]:
                print(f"no depth of {preset} fits; raise --device-memory or --host-memory", file=sys.stderr)
                return 1
    runs = []
    for mode in ("full", "lora-same", "lora"):
        if mode in modes:
            start = time.perf_counter()
            rank = 0 if mode == "full" else args.lora_rank
            runs.append(train(mode, preset, depths[args.lora_rank if mode == "lora" else 0], rank, config, mesh,
                              machine, args))
            print(f"  {mode}: {time.perf_counter() - start:.1f} s", flush=True)
    lines = table(runs, header)
    bad = [line for r in runs for line in problems(r)]
    print("\n".join(lines[2:] + bad), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"header": header, "runs": [dataclasses.asdict(r) for r in runs]}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
