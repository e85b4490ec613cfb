"""The largest GPT pstar_jax trains on this machine: planned, then trained for real.

    python scripts/pstar_largest.py --model GPT3_12B --host-memory 100GiB --out largest.txt

Keeps the preset's width and searches its depth with the planner (no model data), then builds
that model and trains it for a few steps, reporting step time, tokens/s and model TFLOPS.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pstar_jax as ps  # noqa: E402
from pstar_models import build_model  # noqa: E402
from pstar_jax.engine.memory import host_budget_bytes  # noqa: E402
from pstar_jax.planner.build import default_mesh, layout_for, resolve_machine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="GPT3_12B")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device-memory", default=None)
    p.add_argument("--host-memory", default="100GiB")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    mesh = default_mesh(1)
    on_h200 = "H200" in jax.local_devices()[0].device_kind
    config = ps.EngineConfig(device_memory=ps.parse_bytes(args.device_memory, "--device-memory")
                             if args.device_memory else 0.95,
                             host_memory=ps.parse_bytes(args.host_memory, "--host-memory"),
                             machine="h200" if on_h200 else None)  # else this machine's saved rates
    config = ps.resolve_engine_config(config, build_model(args.model), mesh)
    # The preset's chunk size at every depth (full training: one kind, one size).
    config = dataclasses.replace(config, chunk_numel=layout_for(build_model(args.model), config, mesh).numels[0])
    machine = resolve_machine(config, mesh)
    host_bytes = host_budget_bytes(config.host_memory)  # what the engine will get (a pool limit may lower it)
    start = time.perf_counter()
    report = ps.plan_report(build_model(args.model), config, args.batch_size, mesh, machine, host_bytes,
                            model_at=lambda n_layer: build_model(args.model, n_layer=n_layer))
    depth = report.depth.value
    model = build_model(args.model, n_layer=depth)
    seq = model.config.seq_len
    lines = [f"{jax.devices()[0].device_kind}: device budget {ps.format_bytes(config.device_memory)}, host "
             f"{ps.format_bytes(host_bytes)}",
             f"largest depth at d_model {model.config.d_model}: {depth} layers, {model.n_params():,} params "
             f"(planned in {time.perf_counter() - start:.1f} s)"]
    print(lines[-1], flush=True)
    engine = ps.build_engine(model, config, ps.OptimConfig(total_steps=args.steps), (args.batch_size, seq), mesh=mesh,
                             machine=machine)
    lines.append(engine.summary())
    print(lines[-1], flush=True)
    rng = np.random.default_rng(0)
    for i in range(args.steps):
        tok = rng.integers(0, model.config.vocab_size, (args.batch_size, seq + 1))
        r = engine.step([(tok[:, :-1], tok[:, 1:])])
        tokens = args.batch_size * seq
        lines.append(f"step {i}: loss {r.loss:.4f}, {r.step_s:.2f} s, {tokens / r.step_s:,.0f} tokens/s, "
                     f"{model.flops_per_token() * tokens / r.step_s / 1e12:.1f} model TFLOPS, "
                     f"h2d {ps.format_bytes(r.h2d_bytes)}, d2h {ps.format_bytes(r.d2h_bytes)} (planned "
                     f"{ps.format_bytes(r.predicted_h2d_bytes)}, {ps.format_bytes(r.predicted_d2h_bytes)})")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
