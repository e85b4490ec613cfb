"""Traced working memory per token of the gated delta rule (Qwen3.5's linear attention), forward
and backward, from two sequence lengths.

    python scripts/bench_delta_rule_memory.py              # Qwen3.5-27B's heads, 1,024 and 2,048 tokens

Compiles only (``memory_analysis().temp_size_in_bytes`` of jit(rule) and jit(grad(rule)), fp32,
B = 1, on this backend): the difference between the two lengths over the tokens between them, so
what a token adds, not the fixed part. Inputs (q, k, v, g, beta) are reported beside.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pstar_models.delta_rule import chunk_gated_delta_rule  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048", help="two sequence lengths, comma-separated")
    p.add_argument("--heads", default="48,16,128,128", help="value heads, key heads, key width, value width "
                   "(default: Qwen3.5-27B's)")
    args = p.parse_args(argv)
    try:
        short, long = (int(x) for x in args.lengths.split(","))
        H, HK, K, V = (int(x) for x in args.heads.split(","))
    except ValueError:
        p.error("--lengths takes two integers and --heads four, comma-separated")
    if not 0 < short < long or min(H, HK, K, V) < 1 or H % HK:
        p.error("--lengths must grow, and the value heads be a multiple of the key heads")

    def inputs(L):
        f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
        return f(1, L, HK, K), f(1, L, HK, K), f(1, L, H, V), f(1, L, H), f(1, L, H)

    def forward(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta)[0]

    def backward(*x):
        return jax.grad(lambda *x: jnp.sum(forward(*x)), argnums=tuple(range(5)))(*x)
    print(f"gated delta rule, fp32, heads {H} value / {HK} key, K {K}, V {V}; per token, from {short} and {long} tokens")
    print(f"inputs: {(2 * HK * K + H * V + 2 * H) * 4 / 1000:.1f} KB")
    for name, fn in (("forward", forward), ("backward", backward)):
        temp = [jax.jit(fn).lower(*inputs(L)).compile().memory_analysis().temp_size_in_bytes for L in (short, long)]
        print(f"{name}: {(temp[1] - temp[0]) / (long - short) / 1000:.1f} KB of working memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
