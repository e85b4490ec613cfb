"""Traced device memory of one training step against sequence length (batch 1), from the
plan's trace (compile-time analysis on this backend; nothing runs). Per length: the busiest
moment's non-model memory, the head stage's forward+backward and the largest block backward; the
stage inputs one step keeps for its backward; and the least device memory any placement needs
with those stage inputs kept on the device (the engine before they were plan items) and with
them placed by the plan (sent to pinned host memory between their forward and backward): the
busiest moment's working memory plus the items it reads itself.

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
from pstar_jax.plan.machine import H200  # noqa: E402
from pstar_jax.planner.report import plan_report  # noqa: E402

GiB = 2**30


def length(text: str) -> int:
    return int(text[:-1]) * 1024 if text.lower().endswith("k") else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--lengths", default="1k,2k,4k,8k,16k,32k")
    args = p.parse_args()
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    print("| positions | busiest non-model (MiB) | head fwd+bwd (MiB) | largest block bwd (MiB) | stage inputs (MiB) "
          "| least device, inputs kept (MiB) | least device, inputs placed (MiB) | trace s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (length(t) for t in args.lengths.split(",")):
        model = pstar_models.build_model(args.model, vocab_size=args.vocab_size, seq_len=n, d_model=args.d_model,
                                         n_layer=args.n_layer)
        start = time.perf_counter()
        report = plan_report(model, EngineConfig(device_memory=128 * GiB), 1, mesh, H200, 110 * GiB, search=False)
        shape, accesses = report.planned.shape, report.planned.accesses
        kept, placed = least_device_bytes(shape, accesses)
        print(f"| {n} | {shape.busiest_non_model_bytes / 2**20:.1f} | {shape.head_non_model / 2**20:.1f} | "
              f"{max(shape.bwd_non_model) / 2**20:.1f} | {shape.input_bytes_per_step / 2**20:.1f} | "
              f"{kept / 2**20:.1f} | {placed / 2**20:.1f} | {time.perf_counter() - start:.0f} |", flush=True)


def least_device_bytes(shape, accesses) -> tuple[int, int]:
    """(stage inputs kept on the device, placed by the plan): the most any moment needs at once,
    its working memory and the chunks it reads, with every live stage input beside it or only its
    own. A lower bound (no prefetch, no optimizer state on the device)."""
    live: set = set()  # stage inputs made and not yet dropped
    kept = placed = 0
    for a in accesses:
        live |= {it for it in a.needs if it[0] == "act"}
        chunks = sum(shape.item_size(it) for it in a.needs if it[0] != "act")
        kept = max(kept, a.non_model_bytes + chunks + sum(map(shape.item_size, live)))
        placed = max(placed, a.non_model_bytes + sum(map(shape.item_size, a.needs)))
        live -= set(a.drops)
    return kept, placed


if __name__ == "__main__":
    main()
