"""A mixture of experts' MLP three ways, side by side on this backend: the tiled grouped matmul the
models use (models/moe.grouped_swiglu), jax.lax.ragged_dot, and a dense one-hot product over every
expert. Per row: XLA's FLOPs of the compiled forward and backward (pstar_jax.model.flops, what the
trace counts), its temporaries (memory_analysis), and the median wall time of a call.

    python scripts/bench_moe.py --tokens 2048 --experts 8,64 --k 2 --d-model 256 --width 128

The routed pairs' own matmul FLOPs (forward and backward: 3 matmuls, 3x each) are the yardstick.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pstar_jax.model.flops import call_flops  # noqa: E402
from pstar_models.moe import grouped_swiglu, route  # noqa: E402


def ragged(x_NxD, experts_NxK, gate, up, down):
    N, k = experts_NxK.shape
    flat = experts_NxK.reshape(N * k)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    xs = x_NxD[order // k]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
    return jax.lax.ragged_dot(h, down, sizes)[jnp.argsort(order)].reshape(N, k, -1)


def dense(x_NxD, experts_NxK, gate, up, down):
    E = gate.shape[0]
    h = jax.nn.silu(jnp.einsum("nd,edi->nei", x_NxD, gate)) * jnp.einsum("nd,edi->nei", x_NxD, up)
    y_NxExD = jnp.einsum("nei,eid->ned", h, down)
    return jnp.einsum("ned,nke->nkd", y_NxExD, jax.nn.one_hot(experts_NxK, E, dtype=x_NxD.dtype))


WAYS = {"tiled grouped (models/moe.py)": grouped_swiglu, "jax.lax.ragged_dot": ragged, "dense one-hot": dense}


def measure(way, x, chosen, weights, repeats):
    def loss(x, *w):
        return jnp.sum(way(x, chosen, *w) ** 2)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    compiled, flops = call_flops(step, x, *weights)
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(step(x, *weights))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(x, *weights))  # sync: the measurement
        times.append(time.perf_counter() - start)
    return flops, temp, statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--experts", default="8,64", help="comma-separated expert counts")
    p.add_argument("--k", type=int, default=2, help="experts per token")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--width", type=int, default=128, help="an expert's hidden width")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    print(f"{jax.default_backend()}, {a.tokens} tokens, k={a.k}, d_model {a.d_model}, expert width {a.width}, fp32")
    print(f"{'experts':>7}  {'way':<30} {'FLOPs / pairs':>13} {'temp MiB':>9} {'ms / call':>10}")
    for E in (int(e) for e in a.experts.split(",")):
        keys = jax.random.split(jax.random.key(0), 5)
        x = jax.random.normal(keys[0], (a.tokens, a.d_model))
        weights = (jax.random.normal(keys[1], (E, a.d_model, a.width)) * 0.05,
                   jax.random.normal(keys[2], (E, a.d_model, a.width)) * 0.05,
                   jax.random.normal(keys[3], (E, a.width, a.d_model)) * 0.05)
        _, chosen = route(jax.random.normal(keys[4], (a.tokens, E)), a.k, True, x.dtype)
        pairs = 9 * 2 * a.tokens * a.k * a.d_model * a.width  # 3 matmuls, forward and 2 backward each
        for name, way in WAYS.items():
            flops, temp, seconds = measure(way, x, chosen, weights, a.repeats)
            print(f"{E:>7}  {name:<30} {flops / pairs:>13.2f} {temp / 2**20:>9.1f} {seconds * 1e3:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
