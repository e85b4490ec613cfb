"""Step time of the chunked engine (everything resident) beside the plain engine, one run.

    python scripts/bench_engine.py --model small --batch-size 16 --steps 20

Both engines train the same model on the same batches; the figure is the median step time
after warm-up steps (compilation excluded). Target on a CPU: chunked within 1.25x of plain.
Plain runs twice: without remat, and with full remat, which recomputes the forward in the
backward as the chunked engine does at stage boundaries.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import pstar_jax as ps  # noqa: E402
from pstar_models import build_model  # noqa: E402
from pstar_jax.planner.build import default_mesh  # noqa: E402
from scripts.benchlib import median_step_s, random_batches  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default="bf16")
    args = p.parse_args()

    model = build_model(args.model, n_layer=args.n_layer)
    cfg = model.config
    steps = random_batches(cfg.vocab_size, args.batch_size, cfg.seq_len, args.steps)
    optim = ps.OptimConfig(total_steps=args.steps)
    shape, mesh = (args.batch_size, cfg.seq_len), default_mesh(1)
    # Room for everything, so nothing moves: the figure is the engine's own overhead.
    chunked = ps.build_engine(model, ps.EngineConfig(device_memory=2 ** 40, precision=args.precision, machine="h200"),
                              optim, shape, mesh=mesh)
    t_chunked, r = median_step_s(chunked, steps, args.warmup)
    t_plain = {remat: median_step_s(ps.build_engine(model, ps.EngineConfig(precision=args.precision, kind="plain",
                                                                           remat=remat), optim, shape, mesh=mesh),
                                    steps, args.warmup)[0] for remat in ("none", "full")}
    tokens = args.batch_size * cfg.seq_len
    print(f"model {args.model}: {model.n_params():,} params, batch {args.batch_size}x{cfg.seq_len}, "
          f"{args.precision}, {jax.devices()[0].platform}, {chunked.layout.n_chunks} chunks, "
          f"median of {args.steps - args.warmup} steps")
    print(f"{'engine':<28}{'step_s':>10}{'tokens/s':>12}{'h2d+d2h/step':>15}")
    print(f"{'chunked (all resident)':<28}{t_chunked:>10.4f}{tokens / t_chunked:>12,.0f}"
          f"{r.h2d_bytes + r.d2h_bytes:>15,}")
    for remat, t in t_plain.items():
        print(f"{'plain (remat ' + remat + ')':<28}{t:>10.4f}{tokens / t:>12,.0f}{0:>15,}")
    # The chunked engine keeps only stage inputs and recomputes each stage's forward in the
    # backward, which is what plain does with remat full; remat none recomputes nothing.
    for remat, t in t_plain.items():
        print(f"chunked / plain (remat {remat}) = {t_chunked / t:.3f} (target <= 1.25)")


if __name__ == "__main__":
    main()
