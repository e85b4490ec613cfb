"""The gated delta rule (Gated DeltaNet's linear attention, Qwen3-Next and Qwen3.5), computed in
chunks as transformers' ``torch_chunk_gated_delta_rule`` does, to fp32 rounding, plus its one-token
recurrent step for decoding.

Per value head, with a state S [K, V] and per token t a decay g_t <= 0 (log space) and a rate
beta_t in (0, 1), the recurrence is
    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t,
with q and k L2-normalised and q scaled by K ** -0.5. The chunked form runs it over chunks of C
tokens: inside a chunk a unit lower-triangular system (the UT transform, solved by forward
substitution) turns the C rank-one updates into matmuls, and one ``lax.scan`` step per chunk carries S.

Memory per token and layer (XLA's memory analysis of the compiled rule, fp32, Qwen3.5-27B's heads:
H 48, Hk 16, K = V = 128, C 64; the difference between L = 1024 and 2048): the forward's working
memory is 209 KB per token, the backward's (jax.grad, which keeps the state at each chunk's start,
H K V / C = 48 KB per token, and each chunk's C x C decay, UT and score matrices, 12 KB per token
each) 874 KB per token, against 41 KB per token of inputs (q, k, v, g, beta). In pstar_jax's
stages this is working memory of the block's backward only: between stages a block keeps its
input alone.

Packed rows (several examples in one row, ``segment_ids``): an example must start from S = 0, as
alone. Rather than a decay of -inf at each boundary (whose cumulative sums would give inf - inf),
the chunked form masks by segment: within a chunk, the pairwise decays between tokens of different
examples are zero (so the UT system is block-diagonal per example), and the state carried into a
chunk reaches only the tokens of the example that was running when the chunk began, and passes to
the next chunk only if that example is still running at its end.

Shapes: B batch, L sequence, H value heads, Hk query/key heads (H a multiple of Hk; each key head
serves H / Hk consecutive value heads, transformers' ``repeat_interleave``), K key width, V value
width, N chunks of C tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

CHUNK = 64  # transformers' chunk_size default (its tests and modules never pass another)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """transformers' l2norm: x * rsqrt(sum(x^2) + eps) over the last axis (FLA's eps placement)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _heads_first(q_BxLxHkxK, k_BxLxHkxK, v_BxLxHxV, g_BxLxH, beta_BxLxH):
    """fp32, key heads repeated to the value heads, [B, H, L, ...]; q, k L2-normalised, q scaled."""
    rep = v_BxLxHxV.shape[2] // k_BxLxHkxK.shape[2]
    q, k = (jnp.repeat(x, rep, axis=2) if rep > 1 else x for x in (q_BxLxHkxK, k_BxLxHkxK))
    q, k, v, beta, g = (jnp.swapaxes(x.astype(jnp.float32), 1, 2) for x in (q, k, v_BxLxHxV, beta_BxLxH, g_BxLxH))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


@jax.custom_vjp
def unit_lower_solve(a_NxCxC: jax.Array, rhs_NxCxW: jax.Array) -> jax.Array:
    """X with (I + strictly_lower(a)) X = rhs over the last two axes (torch's unitriangular solve).
    On a CPU by forward substitution, one row at a time, in plain XLA ops, not
    ``lax.linalg.triangular_solve``: there that is a LAPACK call into scipy's multithreaded OpenBLAS
    from XLA's worker threads, and a training step hung there for ever (every thread idle; one step
    in 5 to 10 of the tiny Qwen3.5 at 64 tokens, none with OPENBLAS_NUM_THREADS=1). Other backends
    keep their triangular solve (``_substitute``). The backward substitutes the other way
    (``_solve_bwd``), so it keeps no residuals beyond X."""
    return _solve_fwd(a_NxCxC, rhs_NxCxW)[0]


def _substitute(m_NxCxC: jax.Array, rhs_NxCxW: jax.Array, reverse: bool) -> jax.Array:
    """X with (I + m) X = rhs, m strictly lower (``reverse`` False) or strictly upper: on a CPU by
    the loop (``_substitute_rows``), elsewhere by the backend's triangular solve (cuBLAS's trsm on
    a GPU, one batched call where the loop is C dependent steps; unmeasured there)."""
    return jax.lax.platform_dependent(m_NxCxC, rhs_NxCxW, cpu=functools.partial(_substitute_rows, reverse=reverse),
                                      default=functools.partial(_substitute_trsm, reverse=reverse))


def _substitute_trsm(m_NxCxC: jax.Array, rhs_NxCxW: jax.Array, reverse: bool) -> jax.Array:
    return jax.lax.linalg.triangular_solve(m_NxCxC, rhs_NxCxW, left_side=True, lower=not reverse,
                                           unit_diagonal=True)


def _substitute_rows(m_NxCxC: jax.Array, rhs_NxCxW: jax.Array, reverse: bool) -> jax.Array:
    """x_i = rhs_i - m_i . x, rows in order (m strictly lower) or in reverse (m strictly upper):
    the rows m_i reads are final, the others meet m_i's zeros."""
    C = m_NxCxC.shape[-1]

    def row(t, x_NxCxW):
        i = C - 1 - t if reverse else t
        m_Nx1xC = jax.lax.dynamic_slice_in_dim(m_NxCxC, i, 1, axis=-2)
        r_Nx1xW = jax.lax.dynamic_slice_in_dim(rhs_NxCxW, i, 1, axis=-2)
        return jax.lax.dynamic_update_slice_in_dim(x_NxCxW, r_Nx1xW - m_Nx1xC @ x_NxCxW, i, axis=-2)
    return jax.lax.fori_loop(0, C, row, rhs_NxCxW)


def _solve_fwd(a_NxCxC: jax.Array, rhs_NxCxW: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    x_NxCxW = _substitute(jnp.tril(a_NxCxC, -1), rhs_NxCxW, reverse=False)
    return x_NxCxW, (a_NxCxC, x_NxCxW)


def _solve_bwd(res: tuple[jax.Array, jax.Array], g_NxCxW: jax.Array) -> tuple[jax.Array, jax.Array]:
    # M X = R with M = I + L: dR = M^-T g (back substitution), dL = -dR X^T on the strict lower part.
    a_NxCxC, x_NxCxW = res
    d_rhs = _substitute(jnp.swapaxes(jnp.tril(a_NxCxC, -1), -1, -2), g_NxCxW, reverse=True)
    return -jnp.tril(d_rhs @ jnp.swapaxes(x_NxCxW, -1, -2), -1), d_rhs


unit_lower_solve.defvjp(_solve_fwd, _solve_bwd)


def chunk_gated_delta_rule(q_BxLxHkxK: jax.Array, k_BxLxHkxK: jax.Array, v_BxLxHxV: jax.Array,
                           g_BxLxH: jax.Array, beta_BxLxH: jax.Array, segment_ids_BxL: jax.Array | None = None,
                           state_BxHxKxV: jax.Array | None = None, chunk: int = CHUNK
                           ) -> tuple[jax.Array, jax.Array]:
    """The outputs o [B, L, H, V] (in v's dtype) and the final state [B, H, K, V] (fp32), as
    ``torch_chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)``. ``segment_ids`` [B, L]:
    packed rows, each run of equal ids one example starting from a zero state (None: one example
    per row, continuing ``state``, zero when None)."""
    B, L, H, V = v_BxLxHxV.shape
    K = k_BxLxHkxK.shape[-1]
    q, k, v, g, beta = _heads_first(q_BxLxHkxK, k_BxLxHkxK, v_BxLxHxV, g_BxLxH, beta_BxLxH)
    seg_BxL = jnp.zeros((B, L), jnp.int32) if segment_ids_BxL is None else segment_ids_BxL.astype(jnp.int32)
    pad = (-L) % chunk
    if pad:  # zero tokens (no decay, no update) in the last example: the final state is unchanged
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
        seg_BxL = jnp.pad(seg_BxL, ((0, 0), (0, pad)), mode="edge")
    N, C = (L + pad) // chunk, chunk
    q, k, v = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    g_BxHxNxC, beta_BxHxNxC = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
    seg_BxNxC = seg_BxL.reshape(B, N, C)
    # The example running when each chunk begins (chunk 0's: its first token's, which continues
    # ``state``); a token reads the carried state only if it belongs to that example.
    before_BxN = jnp.concatenate([seg_BxNxC[:, :1, 0], seg_BxNxC[:, :-1, -1]], axis=1)
    carries_Bx1xNxC = (seg_BxNxC == before_BxN[..., None])[:, None].astype(jnp.float32)
    same_Bx1xNxCxC = (seg_BxNxC[..., :, None] == seg_BxNxC[..., None, :])[:, None]
    lower_1x1x1xCxC = jnp.tril(jnp.ones((C, C), bool))[None, None, None]

    # Each example's decays summed from its own first token in the chunk, the others' replaced by
    # zeros (a where: no gradient, not even rounding, flows between examples); one cumsum per token
    # i over the chunk, so a one-example chunk adds in torch's order.
    g_BxHxNxCxC = jnp.where(same_Bx1xNxCxC, g_BxHxNxC[..., None, :], 0.0)
    cum_BxHxNxC = jnp.diagonal(jnp.cumsum(g_BxHxNxCxC, axis=-1), axis1=-2, axis2=-1)
    # exp(cum_i - cum_j): the decay from token j to token i of a chunk, 0 above the diagonal and
    # between examples (the -inf goes through exp, never through a subtraction).
    decay_BxHxNxCxC = jnp.exp(jnp.where(lower_1x1x1xCxC & same_Bx1xNxCxC,
                                        cum_BxHxNxC[..., :, None] - cum_BxHxNxC[..., None, :], -jnp.inf))
    k_beta, v_beta = k * beta_BxHxNxC[..., None], v * beta_BxHxNxC[..., None]
    ut = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k) * decay_BxHxNxCxC
    intra_BxHxNxCxC = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * decay_BxHxNxCxC
    # (I + strictly_lower(ut)) X = rhs: the diagonal is taken as ones, as torch's unitriangular solve.
    cum_exp = jnp.exp(cum_BxHxNxC)[..., None]
    new_v = unit_lower_solve(ut, v_beta)
    k_cumdecay = unit_lower_solve(ut, k_beta * cum_exp * carries_Bx1xNxC[..., None])
    q_decayed = q * cum_exp * carries_Bx1xNxC[..., None]
    # (the where before the exp: between examples the cumulative sums are unrelated, and their
    # difference may overflow)
    k_decayed = k * jnp.exp(jnp.where(same_Bx1xNxCxC[..., -1, :], cum_BxHxNxC[..., -1:] - cum_BxHxNxC,
                                      -jnp.inf))[..., None]
    chunk_decay_BxHxN = jnp.exp(cum_BxHxNxC[..., -1]) * carries_Bx1xNxC[..., -1]

    def step(S_BxHxKxV, xs):
        new_v, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay = xs
        v_delta = new_v - k_cumdecay @ S_BxHxKxV
        out = q_decayed @ S_BxHxKxV + intra @ v_delta
        S_BxHxKxV = S_BxHxKxV * chunk_decay[..., None, None] + jnp.swapaxes(k_decayed, -1, -2) @ v_delta
        return S_BxHxKxV, out

    S0 = jnp.zeros((B, H, K, V), jnp.float32) if state_BxHxKxV is None else state_BxHxKxV.astype(jnp.float32)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_v, k_cumdecay, q_decayed, intra_BxHxNxCxC, k_decayed,
                                               chunk_decay_BxHxN))
    S_BxHxKxV, out_NxBxHxCxV = jax.lax.scan(step, S0, xs)
    out_BxLxHxV = jnp.moveaxis(out_NxBxHxCxV, 0, 2).reshape(B, H, N * C, V)[:, :, :L].swapaxes(1, 2)
    return out_BxLxHxV.astype(v_BxLxHxV.dtype), S_BxHxKxV


def recurrent_gated_delta_rule(q_BxTxHkxK: jax.Array, k_BxTxHkxK: jax.Array, v_BxTxHxV: jax.Array,
                               g_BxTxH: jax.Array, beta_BxTxH: jax.Array, state_BxHxKxV: jax.Array
                               ) -> tuple[jax.Array, jax.Array]:
    """``torch_recurrent_gated_delta_rule``: T tokens one at a time from ``state`` (decoding's
    cache); the outputs [B, T, H, V] in v's dtype and the new state (fp32)."""
    q, k, v, g, beta = _heads_first(q_BxTxHkxK, k_BxTxHkxK, v_BxTxHxV, g_BxTxH, beta_BxTxH)

    def step(S_BxHxKxV, xs):
        q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH = xs
        S_BxHxKxV = S_BxHxKxV * jnp.exp(g_BxH)[..., None, None]
        remembered_BxHxV = jnp.sum(S_BxHxKxV * k_BxHxK[..., None], axis=-2)
        delta_BxHxV = (v_BxHxV - remembered_BxHxV) * beta_BxH[..., None]
        S_BxHxKxV = S_BxHxKxV + k_BxHxK[..., None] * delta_BxHxV[..., None, :]
        return S_BxHxKxV, jnp.sum(S_BxHxKxV * q_BxHxK[..., None], axis=-2)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    S_BxHxKxV, out_TxBxHxV = jax.lax.scan(step, state_BxHxKxV.astype(jnp.float32), xs)
    return jnp.moveaxis(out_TxBxHxV, 0, 1).astype(v_BxTxHxV.dtype), S_BxHxKxV
