"""Traced working memory of grad(loss), attention and MLP: whole beside tiled, as L grows.

    python scripts/bench_long_seq_ops.py --lengths 1024,4096,16384,32768

Compiles only (``memory_analysis().temp_size_in_bytes`` of jit(grad(...)) on this backend);
nothing runs, so the whole-logits and L x L columns cost no memory here. One row of B=1:
the head's weighted cross entropy over V (untiled: h @ w then log_softmax; tiled:
pstar_jax.model.loss), grouped-query causal attention with segment ids (full L x L scores, llama's
numerics; tiled: pstar_jax.model.attention's query tiles) and a SwiGLU MLP of width F (whole;
tiled: pstar_jax.model.tiling.tiled_over_sequence). Tiles follow the modules' byte budgets.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pstar_jax.model.attention import causal_attention, tile_queries  # noqa: E402
from pstar_jax.model.loss import linear_cross_entropy_sum, tile_positions  # noqa: E402
from pstar_jax.model.tiling import rows_within, tiled_over_sequence  # noqa: E402


def untiled_loss(h_NxD, w_DxV, targets_N, weights_N):
    logp = jax.nn.log_softmax((h_NxD @ w_DxV).astype(jnp.float32), axis=-1)
    return jnp.sum(weights_N * -jnp.take_along_axis(logp, targets_N[:, None], axis=-1)[:, 0])


def full_attention(q, k, v, segments):
    B, L, H, K = q.shape
    N = k.shape[2]
    s = jnp.einsum("blngk,bmnk->bnglm", q.reshape(B, L, N, H // N, K), k) * (K ** -0.5)
    mask = jnp.tril(jnp.ones((L, L), bool))[None] & (segments[:, :, None] == segments[:, None, :])
    p = jax.nn.softmax(jnp.where(mask[:, None, None], s.astype(jnp.float32), -jnp.inf), axis=-1).astype(q.dtype)
    return jnp.einsum("bnglm,bmnk->blngk", p, v).reshape(B, L, H, K)


def swiglu(params, x):
    gate, up, down = params
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def temp_bytes(fn, *shapes, argnums):
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    args = [f32(*s) if isinstance(s, tuple) and all(isinstance(d, int) for d in s) else s for s in shapes]
    loss = lambda *a: jnp.sum(fn(*a))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=argnums)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,4096,16384,32768")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=1024)
    args = p.parse_args()
    D, V, H, N, F = args.d_model, args.vocab, args.heads, args.kv_heads, args.d_ff
    K = D // H
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    print(f"B=1, D={D}, V={V}, H={H}, N={N}, K={K}, F={F}, fp32, {jax.default_backend()} "
          f"(jax {jax.__version__}); temp MiB of jit(grad)")
    print(f"{'L':>6} {'loss':>9} {'tiled':>8} {'tile_n':>6} {'attn':>9} {'tiled':>8} {'tile_q':>6} "
          f"{'mlp':>8} {'tiled':>8}")
    for L in (int(x) for x in args.lengths.split(",")):
        loss_shapes = ((L, D), (D, V), i32(L), (L,))
        attn_shapes = ((1, L, H, K), (1, L, N, K), (1, L, N, K), i32(1, L))
        mlp_args = [tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((D, F), (D, F), (F, D))),
                    jax.ShapeDtypeStruct((1, L, D), jnp.float32)]
        tile_mlp = rows_within(L, 4 * 3 * F, 64 * 2**20)  # gate, up, product: 64 MiB a tile
        row = [temp_bytes(untiled_loss, *loss_shapes, argnums=(0, 1)),
               temp_bytes(lambda h, w, t, wt: linear_cross_entropy_sum(h, w, t, wt), *loss_shapes, argnums=(0, 1)),
               temp_bytes(full_attention, *attn_shapes, argnums=(0, 1, 2)),
               temp_bytes(lambda q, k, v, s: causal_attention(q, k, v, s, implementation="tiled"), *attn_shapes,
                          argnums=(0, 1, 2)),
               temp_bytes(swiglu, *mlp_args, argnums=(0, 1)),
               temp_bytes(lambda p, x: tiled_over_sequence(swiglu, x, tile=tile_mlp, params=p), *mlp_args,
                          argnums=(0, 1))]
        mib = [f"{b / 2**20:.1f}" for b in row]
        print(f"{L:>6} {mib[0]:>9} {mib[1]:>8} {tile_positions(L, V):>6} {mib[2]:>9} {mib[3]:>8} "
              f"{tile_queries(1, H, L):>6} {mib[4]:>8} {mib[5]:>8}")


if __name__ == "__main__":
    main()
