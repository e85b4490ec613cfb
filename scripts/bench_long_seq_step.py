"""Traced non-model memory of one training step against sequence length (batch 1), from the
plan's trace (compile-time analysis on this backend; nothing runs). The busiest moment, the head
stage's forward+backward and the largest block backward, per length:

    python3 scripts/bench_long_seq_step.py --model llama-tiny --vocab-size 32768 --lengths 1k,2k,4k
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import pstar_models  # noqa: E402
from pstar_jax.config import EngineConfig  # noqa: E402
from pstar_jax.machine import H200  # noqa: E402
from pstar_jax.planner import plan_report  # noqa: E402

GiB = 2**30


def length(text: str) -> int:
    return int(text[:-1]) * 1024 if text.lower().endswith("k") else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--lengths", default="1k,2k,4k,8k,16k,32k")
    args = p.parse_args()
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    print("| positions | busiest moment (MiB) | head fwd+bwd (MiB) | largest block bwd (MiB) | trace s |")
    print("|---:|---:|---:|---:|---:|")
    for n in (length(t) for t in args.lengths.split(",")):
        model = pstar_models.build_model(args.model, vocab_size=args.vocab_size, seq_len=n)
        start = time.perf_counter()
        report = plan_report(model, EngineConfig(device_memory=128 * GiB), 1, mesh, H200, 110 * GiB, search=False)
        shape = report.planned.shape
        print(f"| {n} | {shape.busiest_non_model_bytes / 2**20:.1f} | {shape.head_non_model / 2**20:.1f} | "
              f"{max(shape.bwd_non_model) / 2**20:.1f} | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
