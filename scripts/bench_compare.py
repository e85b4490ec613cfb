"""Memory-saving methods side by side: XLA remat, XLA host offload, pstar_jax chunk eviction.

    python scripts/bench_compare.py --tiny --out runs/compare          # a CPU, under 5 minutes
    python scripts/bench_compare.py --sizes GPT2_1B,GPT3_12B --batch-sizes 32 --out runs/gpu

For every model size and batch size, each method trains the same model on the same data from
the same seed, in this one process:
  plain-none / plain-dots / plain-full   whole-model jit, everything on the device, XLA remat policy
  xla-offload                           activations offloaded by XLA's checkpoint policy, optimizer
                                        state in pinned host memory updated on the device
  pstar                                 chunks placed by the warm-up plan
A point that cannot fit is reported as such: plain and offload from XLA's compile-time memory
analysis against the device capacity (or an out-of-memory error caught at run time), pstar from
its plan. pstar's rows also give the plan's predicted step time, with copies sharing the link
and with both directions at once (checks the planner's time model where it matters: on the GPU).
Output: results.json, results.md (a table) and two plots (throughput against model size,
largest trainable size per method). On a CPU the device capacity is simulated
(--device-memory) and memory kinds are labels, so offload saves nothing there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import pstar_jax as ps  # noqa: E402
from pstar_models import build_model  # noqa: E402
from pstar_jax.config import format_bytes, parse_bytes  # noqa: E402
from pstar_jax.engine.memory import device_total_bytes, host_budget_bytes  # noqa: E402
from pstar_jax.planner.build import default_mesh, resolve_machine  # noqa: E402
from pstar_jax.plan.predict import predict_step_s  # noqa: E402
from scripts.benchlib import median_step_s, random_batches  # noqa: E402

METHODS = ("plain-none", "plain-dots", "plain-full", "xla-offload", "pstar")
TINY_SIZES = ("tiny", "tiny-4x64", "small", "small-8x128", "small-16x128")


def model_for(name: str):
    """A preset, or PRESET-LxD: the preset with L layers of width D (heads kept)."""
    base, _, dims = name.partition("-")
    if not dims:
        return build_model(base)
    layers, width = (int(v) for v in dims.split("x"))
    return build_model(base, n_layer=layers, d_model=width)


@dataclasses.dataclass
class Point:
    model: str
    params: int
    batch: int
    method: str
    fits: bool
    why: str = ""
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    model_tflops: float = 0.0
    mfu: float = 0.0
    peak_device_bytes: int = 0
    host_bytes: int = 0
    moved_bytes_per_step: int = 0
    loss: float = 0.0
    predicted_step_s: tuple[float, float] = (0.0, 0.0)  # pstar: copies sharing the link, both ways at once
    layout: str = ""  # plain: blocks under lax.scan ("scan") or "unrolled", whichever needs less


def is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def device_peak() -> int:
    stats = jax.local_devices()[0].memory_stats()
    return int(stats.get("peak_bytes_in_use", 0)) if stats else 0


def plain_need_bytes(mem) -> int:
    """Device bytes one plain step needs by XLA's compile-time analysis: arguments and outputs
    (donated outputs alias their arguments, so counted once) plus temporaries."""
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
               + mem.temp_size_in_bytes)


def run_plain(model, name, batch, method, capacity, args, steps) -> Point:
    remat = {"plain-none": "none", "plain-dots": "dots", "plain-full": "full", "xla-offload": "offload"}[method]
    point = Point(name, model.n_params(), batch, method, False)
    try:
        # The best plain baseline: blocks scanned or unrolled, whichever XLA says needs less
        # (the scan wins under remat; without remat the unrolled step can need less).
        candidates = []
        config = ps.EngineConfig(precision=args.precision, kind="plain", remat=remat)
        shape = (batch, model.config.seq_len)
        for scan in (True, False):
            engine = ps.build_engine(model, config, ps.OptimConfig(total_steps=args.steps), shape, mesh=default_mesh(1),
                                     opt_on_host=(method == "xla-offload"), scan_layers=scan)
            mem = engine.memory_analysis(batch, model.config.seq_len)
            candidates.append((plain_need_bytes(mem), not scan, engine, mem))
        need, unrolled, engine, mem = min(candidates, key=lambda c: c[:2])
        candidates = None
        point.layout = "unrolled" if unrolled else "scan"
        host = mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes + mem.host_temp_size_in_bytes
        point.host_bytes = int(host)
        if need > capacity:
            point.why = f"predicted OOM: needs {format_bytes(need)}"
            return point
        t, last = median_step_s(engine, steps, args.warmup)
    except Exception as err:  # noqa: BLE001 - an OOM at any stage is a result, anything else is not
        if not is_oom(err):
            raise
        point.why = "OOM at run time"
        return point
    finally:
        engine = None  # noqa: F841 - free the device before the next method
    point.fits, point.step_s, point.loss = True, t, last.loss
    point.peak_device_bytes = device_peak() or int(need)
    # The offload moves its opt state both ways every step, plus the offloaded activations.
    opt_bytes = 2 * 8 * model.n_params() if method == "xla-offload" else 0
    point.moved_bytes_per_step = opt_bytes + 2 * int(mem.host_temp_size_in_bytes)
    return point


def run_pstar(model, name, batch, config: ps.EngineConfig, machine, args, steps) -> Point:
    point = Point(name, model.n_params(), batch, "pstar", False)
    try:
        engine = ps.build_engine(model, config, ps.OptimConfig(total_steps=args.steps), (batch, model.config.seq_len),
                                 mesh=default_mesh(1), machine=machine)
    except ps.ConfigError as err:
        point.why = str(err).split(";")[0].replace("the model does not fit: ", "plan: ")
        return point
    try:
        t, last = median_step_s(engine, steps, args.warmup)
    except Exception as err:  # noqa: BLE001
        if not is_oom(err):
            raise
        point.why = "OOM at run time"
        return point
    point.fits, point.step_s, point.loss = True, t, last.loss
    point.peak_device_bytes = device_peak() or engine.plan.peak_device_bytes
    point.host_bytes = engine.plan.peak_host_bytes
    point.moved_bytes_per_step = last.h2d_bytes + last.d2h_bytes
    planned = engine.plan_for((batch, model.config.seq_len))
    point.predicted_step_s = tuple(predict_step_s(planned.plan.moments, planned.accesses, planned.shape,
                                                  dataclasses.replace(machine, duplex=duplex))
                                   for duplex in (False, True))
    return point


def write_outputs(points: list[Point], out: str, header: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump([dataclasses.asdict(p) for p in points], f, indent=1)
    lines = [header, "", "| model | params | batch | method | fits | step s | predicted s (shared / duplex copies) | "
             "tokens/s | model TFLOPS | MFU | peak device | host | moved/step |", "|" + " --- |" * 13]
    for p in points:
        method = f"{p.method} ({p.layout})" if p.layout else p.method
        if p.fits:
            predicted = (f"{p.predicted_step_s[0]:.4f} / {p.predicted_step_s[1]:.4f}" if p.method == "pstar"
                         else "")
            lines.append(f"| {p.model} | {p.params:,} | {p.batch} | {method} | yes | {p.step_s:.4f} | {predicted} | "
                         f"{p.tokens_per_s:,.0f} | {p.model_tflops:.3g} | {100 * p.mfu:.1f}% | "
                         f"{format_bytes(p.peak_device_bytes)} | {format_bytes(p.host_bytes)} | "
                         f"{format_bytes(p.moved_bytes_per_step)} |")
        else:
            lines.append(f"| {p.model} | {p.params:,} | {p.batch} | {method} | no: {p.why} |" + "  |" * 8)
    largest = {m: max((p.params for p in points if p.method == m and p.fits), default=0) for m in METHODS}
    lines += ["", "Largest trainable model per method: " +
              ", ".join(f"{m} {v:,}" for m, v in largest.items())]
    ratio = ratio_line(points, largest)
    if ratio:
        lines.append(ratio)
        print(ratio, flush=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(points, largest, out, ratio)


def ratio_line(points: list[Point], largest: dict) -> str:
    """pstar's largest model against the best baseline's; a lower bound when pstar trained even the
    largest size tried (a larger one might fit too)."""
    best = max((m for m in largest if m != "pstar"), key=largest.get, default=None)
    if not (best and largest[best] and largest.get("pstar")):
        return ""
    tried = max(p.params for p in points)
    text = f"pstar against the best baseline ({best}): {largest['pstar'] / largest[best]:.2f}x the parameters"
    if largest["pstar"] == tried:
        text = text.replace(": ", ": at least ", 1) + (f" (pstar trained the largest size tried, {tried:,}: that "
                                                       "size bounds the ratio; try larger --sizes)")
    return text


def _params_unit(n: float) -> tuple[str, float]:
    for unit, scale in (("billions", 1e9), ("millions", 1e6), ("thousands", 1e3)):
        if n >= scale:
            return unit, scale
    return "", 1.0


def plot(points: list[Point], largest: dict, out: str, ratio: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = _params_unit(max(p.params for p in points))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for method in METHODS:
        ok = sorted((p.params, p.tokens_per_s) for p in points if p.method == method and p.fits)
        if ok:
            ax.plot([x / scale for x, _ in ok], [y for _, y in ok], marker="o", label=method)
    ax.set_xscale("log")
    sizes = sorted({p.params / scale for p in points})
    ax.set_xticks(sizes, [f"{v:.3g}" for v in sizes])  # the sizes tried, in plain numbers
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(f"model parameters ({unit})" if unit else "model parameters")
    ax.set_ylabel("tokens per second (best batch)")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_title("Training throughput per method (a missing point: the model did not fit)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(largest)
    ax.barh(names, [largest[m] / scale for m in names], color=["#dd8452" if m == "pstar" else "#4c72b0" for m in names])
    tried = max(p.params for p in points) / scale
    ax.axvline(tried, color="black", linestyle="--", linewidth=1, label="largest size tried")
    ax.set_xlim(0, tried * 1.15)
    ax.set_xlabel(f"largest trainable model (parameters, {unit})" if unit else "largest trainable model (parameters)")
    ax.set_title("Largest model each method trained", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    if ratio:
        fig.text(0.01, 0.01, ratio, fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.08 if ratio else 0, 1, 1))
    fig.savefig(os.path.join(out, "largest.png"), dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized models and a simulated 48 MiB device")
    p.add_argument("--sizes", default=None, help="comma list of presets or PRESET-LAYERSxWIDTH")
    p.add_argument("--batch-sizes", default=None, help="comma list of sequences per step")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--device-memory", default=None, help="device capacity (default: the device's, 48MiB with --tiny)")
    p.add_argument("--host-memory", default=None)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default: 989 on an H200, "
                   "measured matmul rate on a CPU)")
    p.add_argument("--out", default="runs/compare")
    args = p.parse_args(argv)
    try:  # the plots' optional dependency, checked before the benchmarks rather than after them
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("the plots need matplotlib: pip install 'pstar_jax[plot]'")
    sizes = (args.sizes or ",".join(TINY_SIZES if args.tiny else ("GPT2_1B",))).split(",")
    batch_sizes = [int(b) for b in (args.batch_sizes or ("8" if args.tiny else "16")).split(",")]
    methods = args.methods.split(",")
    device = jax.local_devices()[0]
    capacity = parse_bytes(args.device_memory or ("48MiB" if args.tiny else str(int(0.95 * device_total_bytes(device)))),
                           "--device-memory")
    pstar = ps.EngineConfig(device_memory=capacity, precision=args.precision,
                            host_memory=parse_bytes(args.host_memory, "--host-memory") if args.host_memory else None,
                            machine="h200" if "H200" in device.device_kind else None)  # else this machine's saved rates
    host = host_budget_bytes(pstar.host_memory)
    machine = resolve_machine(pstar, default_mesh(1))
    peak = (args.peak_tflops or (989.0 if "H200" in device.device_kind else machine.flops_per_s / 1e12)) * 1e12
    header = (f"{time.strftime('%Y-%m-%d')} on {device.device_kind} ({device.platform}), jax {jax.__version__}; "
              f"device capacity {format_bytes(capacity)}, host {format_bytes(host)}; {args.precision}; "
              f"median of {args.steps - args.warmup} steps after {args.warmup} warm-up")
    print(header, flush=True)
    points = []
    for name in sizes:
        model = model_for(name)
        for batch in batch_sizes:
            steps = random_batches(model.config.vocab_size, batch, model.config.seq_len, args.steps)
            for method in methods:
                start = time.perf_counter()
                point = (run_pstar(model, name, batch, pstar, machine, args, steps) if method == "pstar"
                         else run_plain(model, name, batch, method, capacity, args, steps))
                if point.fits:
                    tokens = batch * model.config.seq_len
                    point.tokens_per_s = tokens / point.step_s
                    point.model_tflops = model.flops_per_token() * tokens / point.step_s / 1e12
                    point.mfu = point.model_tflops * 1e12 / peak
                print(f"{name:>14} b{batch:<4} {method + (f' ({point.layout})' if point.layout else ''):<23} "
                      + (f"{point.step_s:8.4f} s  {point.tokens_per_s:10,.0f} tok/s  loss {point.loss:.4f}  "
                         f"moved {format_bytes(point.moved_bytes_per_step)}" if point.fits else f"no: {point.why}")
                      + f"  ({time.perf_counter() - start:.1f} s)", flush=True)
                points.append(point)
    write_outputs(points, args.out, header)
    print(f"wrote {args.out}/results.md, results.json, throughput.png, largest.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
