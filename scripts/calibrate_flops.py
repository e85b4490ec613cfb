"""The compute rate of a Machine, in FLOPs as XLA's cost analysis counts them.

    python scripts/calibrate_flops.py --step-s 0.426            # from a measured plain step time
    python scripts/calibrate_flops.py --run --steps 5           # time it here (on the accelerator)

The planner divides each moment's counted FLOPs (what the trace records, recompute included)
by ``Machine.flops_per_s``, so that rate must be in the same units: counted FLOPs of a measured
step over its time, loops counted as often as they run (pstar_jax.model.flops; XLA's cost analysis
alone counts the plain step's layer scan once, 1/24 of the step). The reference step is the plain engine's GPT 1.3B (d 2048, 24 layers,
16x1024 tokens, bf16, full remat), the step DESIGN.md measured on the H200 at 0.426 s. Without
``--run`` nothing is allocated: the step is compiled on abstract arguments.
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
    p.add_argument("--model", default="GPT2_1B")
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--remat", default="full")
    p.add_argument("--step-s", type=float, default=None, help="a measured step time to convert")
    p.add_argument("--run", action="store_true", help="measure the step time here")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if args.step_s is None and not args.run:
        p.error("give --step-s SECONDS or --run")
    model = build_model(args.model, n_layer=args.n_layer)
    cfg = model.config
    engine = ps.build_engine(model, ps.EngineConfig(kind="plain", remat=args.remat), ps.OptimConfig(),
                             (args.batch_size, cfg.seq_len), mesh=default_mesh(1))
    counted = engine.counted_flops(args.batch_size, cfg.seq_len)
    model_flops = model.flops_per_token() * args.batch_size * cfg.seq_len
    step_s = args.step_s
    if args.run:
        step_s, _ = median_step_s(engine, random_batches(cfg.vocab_size, args.batch_size, cfg.seq_len,
                                                          args.steps + 1), warmup=1)
    print(f"{args.model} {args.n_layer} layers, {model.n_params():,} params, batch {args.batch_size}x{cfg.seq_len}, "
          f"remat {args.remat}, on {jax.devices()[0].platform}")
    print(f"counted FLOPs per step {counted:.4g}, model FLOPs {model_flops:.4g} (ratio {counted / model_flops:.3f})")
    print(f"step {step_s:.4f} s: {model_flops / step_s / 1e12:.1f} model TFLOPS, "
          f"flops_per_s = {counted / step_s:.4g} counted FLOP/s")


if __name__ == "__main__":
    main()
