"""Bytes moved per step: the warm-up plan (Belady) beside streaming every chunk at every use.

    python scripts/bench_plan.py --model small --batch-size 8

The device budget holds about half the model data beside the traced working memory (the CPU
default of pstar-train). Rows: the plan pstar_jax trains with, the same capacity managed by LRU
and FIFO eviction, and streaming (each moment's chunks fetched, everything else evicted). The
plan's row is also measured: two real training steps, whose bytes must equal the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import pstar_jax as ps  # noqa: E402
from pstar_models import build_model  # noqa: E402
from pstar_jax.plan.placement import plan_step  # noqa: E402
from pstar_jax.planner.build import default_mesh  # noqa: E402
from pstar_jax.plan.schedule import step_accesses  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    model = build_model(args.model)
    cfg = model.config
    # No device memory given: on a CPU, the demo default of half the model data beside the working
    # memory. The H200's rates choose the placement, as on the machine this stands in for.
    engine = ps.build_engine(model, ps.EngineConfig(machine="h200"), ps.OptimConfig(), (args.batch_size, cfg.seq_len),
                             mesh=default_mesh(1))
    plan, shape, machine = engine.plan, engine.plan_for((args.batch_size, cfg.seq_len)).shape, engine.machine
    rng = np.random.default_rng(0)
    measured = []
    for _ in range(2):
        tok = rng.integers(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1))
        r = engine.step([(tok[:, :-1], tok[:, 1:])])
        measured.append((r.h2d_bytes, r.d2h_bytes))
    opt, streamed = plan.opt_on_device, plan.opt_streamed
    rows = [("plan (Belady), predicted", plan.h2d_bytes, plan.d2h_bytes),
            ("plan (Belady), measured step 2", *measured[-1])]
    for rule in ("lru", "fifo"):
        other = plan_step(shape, engine.device_budget_bytes, engine.host_bytes, machine, opt, victim_rule=rule,
                          streamed=streamed)
        rows.append((f"{rule.upper()} at the same capacity", other.h2d_bytes, other.d2h_bytes)
                    if other.fits else (f"{rule.upper()}: {other.problem}", 0, 0))
    # Streaming: each moment's device room is exactly what it needs, so nothing stays.
    accesses = step_accesses(shape, opt, streamed, plan.state_leads)
    tight = max(len(set(a.needs)) for a in accesses) * shape.item_bytes
    stream_shape = dataclasses.replace(shape, fwd_non_model=tuple(0 for _ in shape.fwd_non_model),
                                       bwd_non_model=tuple(0 for _ in shape.bwd_non_model), head_non_model=0)
    opt_bytes = sum(opt) * shape.opt_state_bytes
    # streamed state one moment ahead: at most three chunks' state on the device at once
    stream = plan_step(stream_shape, tight + opt_bytes + 3 * shape.opt_state_bytes * any(streamed), engine.host_bytes,
                       machine, opt, victim_rule="fifo", streamed=streamed, hide_state=False)
    rows.append(("streaming every chunk at every use", stream.h2d_bytes, stream.d2h_bytes))
    print(f"model {args.model}: {model.n_params():,} params, {shape.n_chunks} chunks of {engine.layout.chunk_numel:,}, "
          f"batch {args.batch_size}x{cfg.seq_len}, device budget {ps.format_bytes(engine.device_budget_bytes)} "
          f"for model data {ps.format_bytes(engine.model_data_bytes)}, Adam state on the device for {sum(opt)} chunks, "
          f"streamed through it for {sum(streamed)}, on the host for {len(opt) - sum(opt) - sum(streamed)}")
    print(f"{'placement':<40}{'h2d/step':>14}{'d2h/step':>14}{'total':>14}")
    for name, h2d, d2h in rows:
        print(f"{name:<40}{ps.format_bytes(h2d):>14}{ps.format_bytes(d2h):>14}{ps.format_bytes(h2d + d2h):>14}")


if __name__ == "__main__":
    main()
