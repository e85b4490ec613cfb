"""Bytes moved per step and predicted step time: the warm-up plan beside LRU, FIFO and streaming.

    python scripts/bench_plan.py --model small --batch-size 8

The device budget holds about half the model data beside the traced working memory (the CPU
default of pstar-train); the H200's rates choose the placement and predict the times, as on the
machine this stands in for. Every row has the plan's own optimizer placement (state on the
device, streamed through it or updated on the host, per chunk) and state leads, so the rows differ
only in where chunks and stage inputs are at each moment: the plan pstar_jax trains with, the same
capacity managed by Belady, LRU and FIFO eviction, and streaming (each moment's chunks and stage
inputs fetched for it and evicted after it, no prefetch). The plan's row is also measured: two
real training steps, whose bytes must equal the prediction. No row moves fewer bytes than the
plan (tests/test_plan.py).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import pstar_jax as ps  # noqa: E402
from pstar_models import build_model  # noqa: E402
from pstar_jax.plan.machine import Machine  # noqa: E402
from pstar_jax.plan.placement import plan_step  # noqa: E402
from pstar_jax.plan.planned import Plan  # noqa: E402
from pstar_jax.plan.schedule import StepShape  # noqa: E402
from pstar_jax.planner.build import default_mesh  # noqa: E402
from pstar_jax.config import format_seconds  # noqa: E402


def placement_rows(shape: StepShape, host_bytes: int, machine: Machine, plan: Plan) -> list[tuple[str, Plan]]:
    """(name, plan) per row: ``plan``, then its placement and state leads at its capacity under
    each other eviction rule, and streamed."""
    same = dict(streamed=plan.opt_streamed, leads=plan.state_leads)
    rows = [(f"plan ({plan.victim_rule.upper() if plan.victim_rule != 'belady' else 'Belady'})", plan)]
    for rule in ("belady", "lru", "fifo"):
        if rule != plan.victim_rule:
            other = plan_step(shape, plan.device_capacity_bytes, host_bytes, machine, plan.opt_on_device,
                              victim_rule=rule, **same)
            rows.append((f"{'Belady' if rule == 'belady' else rule.upper()} at the same capacity", other))
    rows.append(("streaming every chunk at every use",
                 plan_step(shape, plan.device_capacity_bytes, host_bytes, machine, plan.opt_on_device, streaming=True,
                           **same)))
    return rows


def table(rows: list[tuple[str, int, int, float | None]]) -> list[str]:
    """Rows of (name, h2d bytes, d2h bytes, predicted seconds or None) as text."""
    out = [f"{'placement':<40}{'h2d/step':>13}{'d2h/step':>13}{'total':>13}{'predicted':>13}"]
    for name, h2d, d2h, step_s in rows:
        when = format_seconds(step_s) if step_s is not None else ""
        out.append(f"{name:<40}{ps.format_bytes(h2d):>13}{ps.format_bytes(d2h):>13}{ps.format_bytes(h2d + d2h):>13}"
                   f"{when:>13}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    model = build_model(args.model)
    cfg = model.config
    engine = ps.build_engine(model, ps.EngineConfig(machine="h200"), ps.OptimConfig(), (args.batch_size, cfg.seq_len),
                             mesh=default_mesh(1))
    plan, shape, machine = engine.plan, engine.plan_for((args.batch_size, cfg.seq_len)).shape, engine.machine
    rng = np.random.default_rng(0)
    measured = []
    for _ in range(2):
        tok = rng.integers(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1))
        r = engine.step([(tok[:, :-1], tok[:, 1:])])
        measured.append((r.h2d_bytes, r.d2h_bytes))
    rows = []
    for name, planned in placement_rows(shape, engine.host_bytes, machine, plan):
        if planned.fits:
            rows.append((name + (", predicted" if planned is plan else ""), planned.h2d_bytes, planned.d2h_bytes,
                         planned.predicted_step_s))
        else:
            rows.append((f"{name}: does not fit", 0, 0, None))
        if planned is plan:
            rows.append((f"{name}, measured step 2", *measured[-1], None))
    opt, streamed = plan.opt_on_device, plan.opt_streamed
    print(f"model {args.model}: {model.n_params():,} params, {shape.n_chunks} chunks of "
          f"{' or '.join(f'{n:,}' for n in engine.layout.chunk_numels.values())}, "
          f"batch {args.batch_size}x{cfg.seq_len}, device budget {ps.format_bytes(engine.device_budget_bytes)} "
          f"for model data {ps.format_bytes(engine.model_data_bytes)}; every row: Adam state on the device for "
          f"{sum(opt)} chunks, streamed through it for {sum(streamed)}, on the host for "
          f"{shape.n_trainable - sum(opt) - sum(streamed)}")
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
