"""The largest GPT pstar_jax trains on this machine: planned, then trained for real.

    python scripts/pstar_largest.py --model GPT3_12B --host-memory 100GiB --out largest.txt

Keeps the preset's width and searches its depth with the planner (no model data), then builds
that model and trains it for a few steps, reporting step time, tokens/s and model TFLOPS.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from models.gpt import build_model  # noqa: E402
from pstar_jax.chunks import auto_chunk_numel  # noqa: E402
from pstar_jax.config import EngineConfig, OptimConfig, format_bytes, parse_bytes  # noqa: E402
from pstar_jax.executor import ChunkedEngine, plan_model  # noqa: E402
from pstar_jax.machine import H200, measure  # noqa: E402
from pstar_jax.memory import Placement, device_total_bytes  # noqa: E402
from pstar_jax.optim import ChunkOptimizer, default_tx  # noqa: E402
from pstar_jax.plan_cli import largest  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="GPT3_12B")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device-memory", default=None)
    p.add_argument("--host-memory", default="100GiB")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = jax.local_devices()[0]
    budget = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else int(
        0.95 * device_total_bytes(device))
    host = parse_bytes(args.host_memory, "--host-memory")
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    placement = Placement(mesh)
    make_tx = default_tx(OptimConfig(total_steps=args.steps))
    machine = H200 if "H200" in device.device_kind else measure(placement, ChunkOptimizer(make_tx, placement, jnp.bfloat16))
    base = build_model(args.model)
    seq = base.config.seq_len
    chunk = auto_chunk_numel(base.param_shapes(), base.decays)
    cache: dict = {}

    def fits(n_layer: int) -> bool:
        model = build_model(args.model, n_layer=n_layer)
        return plan_model(model, EngineConfig(chunk, budget, "bf16"), mesh, (args.batch_size, seq), machine, host,
                          make_tx, trace_cache=cache).plan.fits
    start = time.perf_counter()
    depth = largest(fits, base.config.n_layer)
    model = build_model(args.model, n_layer=depth)
    lines = [f"{jax.devices()[0].device_kind}: device budget {format_bytes(budget)}, host {format_bytes(host)}",
             f"largest depth at d_model {model.config.d_model}: {depth} layers, {model.n_params():,} params "
             f"(planned in {time.perf_counter() - start:.1f} s)"]
    print(lines[-1], flush=True)
    engine = ChunkedEngine(model, EngineConfig(chunk, budget, "bf16"), make_tx, mesh, (args.batch_size, seq), machine,
                           host_bytes=host)
    lines.append(engine.summary())
    print(lines[-1], flush=True)
    rng = np.random.default_rng(0)
    for i in range(args.steps):
        tok = rng.integers(0, model.config.vocab_size, (args.batch_size, seq + 1))
        r = engine.step([(tok[:, :-1], tok[:, 1:])])
        tokens = args.batch_size * seq
        lines.append(f"step {i}: loss {r.loss:.4f}, {r.step_s:.2f} s, {tokens / r.step_s:,.0f} tokens/s, "
                     f"{model.flops_per_token() * tokens / r.step_s / 1e12:.1f} model TFLOPS, "
                     f"h2d {format_bytes(r.h2d_bytes)}, d2h {format_bytes(r.d2h_bytes)} (planned "
                     f"{format_bytes(r.predicted_h2d_bytes)}, {format_bytes(r.predicted_d2h_bytes)})")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
