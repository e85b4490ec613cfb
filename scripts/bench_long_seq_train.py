"""One long sequence per step, trained for real: step time, tokens/s and peak memory.

    python scripts/bench_long_seq_train.py --model llama-3.2-1b --seq-len 65536 --steps 3   # a GPU
    python scripts/bench_long_seq_train.py --model llama-tiny --seq-len 2048 --device-memory 64MiB

Batch 1, the chunked engine planned for this machine (pstar-plan answers the same question
without model data; a length that does not fit is its one-line answer). Peak device memory is
the accelerator's own count (memory_stats) where it has one, beside the plan's prediction; on a
CPU only the plan's and the chunk store's figures exist. ``--lora-rank`` trains adapters on a
frozen base instead of the whole model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pstar_jax as ps  # noqa: E402
from pstar_models import build_model  # noqa: E402
from pstar_models.lora import LoraSpec  # noqa: E402
from pstar_jax.config.lora import LoraConfig  # noqa: E402
from pstar_jax.model.lora import frozen_for_lora  # noqa: E402
from pstar_jax.planner.build import default_mesh  # noqa: E402


def device_peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--device-memory", default=None, help="device budget (default: 0.95 of the device)")
    p.add_argument("--host-memory", default="100GiB")
    args = p.parse_args(argv)
    on_h200 = "H200" in jax.local_devices()[0].device_kind
    spec = LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None
    model = build_model(args.model, seq_len=args.seq_len, lora=spec)
    frozen = frozen_for_lora(model, LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)) if spec else ()
    config = ps.EngineConfig(device_memory=ps.parse_bytes(args.device_memory, "--device-memory")
                             if args.device_memory else 0.95,
                             host_memory=ps.parse_bytes(args.host_memory, "--host-memory"),
                             machine="h200" if on_h200 else None)  # else this machine's saved rates
    start = time.perf_counter()
    try:
        engine = ps.build_engine(model, config, ps.OptimConfig(total_steps=args.steps), (1, args.seq_len),
                                 mesh=default_mesh(1), frozen=frozen)
    except ps.ConfigError as err:
        print(f"bench_long_seq_train: {err}", file=sys.stderr)
        return 2
    plan = engine.plan
    print(f"{args.model}{f' LoRA rank {args.lora_rank}' if spec else ''}: {model.n_params():,} params, 1 x "
          f"{args.seq_len:,} tokens per step on {jax.local_devices()[0].device_kind}; built in "
          f"{time.perf_counter() - start:.1f} s; plan: peak device {ps.format_bytes(plan.peak_device_bytes)} of "
          f"{ps.format_bytes(engine.device_budget_bytes)}, peak host {ps.format_bytes(plan.peak_host_bytes)}, "
          f"moves {ps.format_bytes(plan.h2d_bytes)} h2d and {ps.format_bytes(plan.d2h_bytes)} d2h per step, "
          f"predicted {plan.predicted_step_s:.3f} s/step", flush=True)
    rng = np.random.default_rng(0)
    times = []
    for i in range(args.steps):
        tok = rng.integers(0, model.config.vocab_size, (1, args.seq_len + 1))
        r = engine.step([(tok[:, :-1], tok[:, 1:])])
        times.append(r.step_s)
        peak = device_peak_bytes()
        print(f"step {i}: loss {r.loss:.4f}, {r.step_s:.2f} s, {args.seq_len / r.step_s:,.0f} tokens/s, chunks on "
              f"the device at most {ps.format_bytes(r.device_chunk_peak_bytes)}"
              + (f", device peak {ps.format_bytes(peak)}" if peak is not None else ""), flush=True)
        if not np.isfinite(r.loss):
            return 1
    best = min(times[1:] or times)  # the first step compiles
    print(f"summary: {args.model} at {args.seq_len:,} tokens: {best:.2f} s/step, {args.seq_len / best:,.0f} tokens/s "
          f"(best step after the first)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
