"""The head's loss over sequence tiles: logits are never whole, forward or backward.

``cross_entropy(h @ w)`` holds N x V logits in the compute dtype, their float32 copy, the
log-softmax and, in the backward, their gradient: at N = 32k tokens and V = 128k that is tens of
GiB. ``linear_cross_entropy_sum`` computes the same sum one tile of ``tile_n`` positions at a time
inside a ``jax.custom_vjp``: the forward keeps only its inputs, the backward recomputes each
tile's logits, turns them into that tile's gradient and adds ``h_tile^T @ dlogits`` into one
float32 dW accumulator. Working memory is a few tile_n x V buffers, the N x D input and output
gradients and the D x V accumulator (4 bytes per head parameter), whatever N is.

Numerics per position equal ``pstar_jax.model.staged.cross_entropy`` of ``h @ w`` as XLA compiles it:
the compute-dtype (h's) matmul accumulated and returned in float32, log-softmax in float32. XLA
allows excess precision, so cross_entropy's bf16 logits followed by astype(float32) become that
float32-output matmul (measured on a CPU, jax 0.10.2 and 0.11.2: the tiled sum equals it
exactly); asking for float32 here keeps every tile and version the same. The gradient is
autodiff's of that reference: dlogits = weight * (softmax - onehot) in float32, cast to the
compute dtype for the two matmuls (as the reference's astype transposes); dh per tile is the
same, dW adds the tiles' float32 products and is rounded to w's dtype once.

Why not a dependency: jax-cce (PyPI, 0.1.0, one release) tiles the vocabulary rather than the
sequence (its tiles grow with N), upcasts h and w to float32 before its matmuls (a float32 copy
of the head, float32-rate matmuls on a GPU), returns a mean and has no per-position weights.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pstar_jax.model.tiling import rows_within, split_tiles, to_tiles

TILE_LOGITS_BYTES = 256 * 2**20  # one tile's float32 logits; the backward holds about 3 of them


def tile_positions(n: int, vocab_size: int, tile_bytes: int = TILE_LOGITS_BYTES) -> int:
    """Positions per tile so that one tile's float32 logits fit ``tile_bytes``."""
    return rows_within(n, 4 * vocab_size, tile_bytes)


def _position_tiles(h_NxD: jax.Array, targets_N: jax.Array, weights_N: jax.Array, tile_n: int
                    ) -> tuple[jax.Array, ...]:
    """The three inputs as [n_tiles, tile, ...]; padded rows have weight 0, so they add nothing."""
    n_tiles, tile = split_tiles(h_NxD.shape[0], tile_n)
    return tuple(to_tiles(x, 0, n_tiles, tile) for x in (h_NxD, targets_N, weights_N))


def _logits32(h_TxD: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
    """Float32 logits of compute-dtype operands (h's dtype), accumulated in float32."""
    w_DxV = w.T if tied else w
    return jnp.matmul(h_TxD, w_DxV.astype(h_TxD.dtype), preferred_element_type=jnp.float32)


def _capped(logits32_TxV: jax.Array, softcap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) (Gemma's final_logit_softcapping), or the logits as they are."""
    return logits32_TxV if softcap is None else jnp.tanh(logits32_TxV / softcap) * softcap


def _picked(logp_TxV: jax.Array, t_T: jax.Array) -> jax.Array:
    """Each position's log-prob of its target. Clipped: a masked position may carry any target
    (-1, V); its value is masked to zero and must stay so."""
    return jnp.take_along_axis(logp_TxV, jnp.clip(t_T, 0, logp_TxV.shape[-1] - 1)[:, None], axis=-1)[:, 0]


def _tile_logps(h_TxD: jax.Array, w: jax.Array, t_T: jax.Array, m_T: jax.Array, tied: bool,
                softcap: float | None) -> jax.Array:
    """Each position's target log-prob, 0 where the mask is 0."""
    logp_TxV = jax.nn.log_softmax(_capped(_logits32(h_TxD, w, tied), softcap), axis=-1)
    return jnp.where(m_T != 0, _picked(logp_TxV, t_T), 0.0)


def _tile_sum(h_TxD: jax.Array, w: jax.Array, t_T: jax.Array, wt_T: jax.Array, tied: bool,
              softcap: float | None) -> jax.Array:
    picked_T = _picked(jax.nn.log_softmax(_capped(_logits32(h_TxD, w, tied), softcap), axis=-1), t_T)
    return jnp.sum(jnp.where(wt_T != 0, -wt_T * picked_T, 0.0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled_sum(h_NxD: jax.Array, w: jax.Array, targets_N: jax.Array, weights_N: jax.Array,
               tied: bool, tile_n: int, softcap: float | None) -> jax.Array:
    xs = _position_tiles(h_NxD, targets_N, weights_N, tile_n)

    def step(total: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        return total + _tile_sum(x[0], w, x[1], x[2], tied, softcap), None
    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), xs)
    return total


def _tiled_sum_fwd(h_NxD, w, targets_N, weights_N, tied, tile_n, softcap):
    # Only the inputs are kept: the backward recomputes each tile's logits.
    return _tiled_sum(h_NxD, w, targets_N, weights_N, tied, tile_n, softcap), (h_NxD, w, targets_N, weights_N)


def _tiled_backward(h_NxD: jax.Array, w: jax.Array, targets_N: jax.Array, a_N: jax.Array, b: jax.Array,
                    coef: Callable[[jax.Array, jax.Array], jax.Array], tied: bool, tile_n: int,
                    softcap: float | None) -> tuple[jax.Array, jax.Array]:
    """(dh, dw) of a loss whose gradient with respect to each position's logits is
    ``coef(a, b) * (softmax - onehot)``, both heads' backward: ``a_N`` per position (tiled with h),
    ``b`` a scalar or per position too; coef gives a tile's float32 factors, 0 where untrained
    (computed a tile at a time, so no whole [N] array is added to the head's memory)."""
    N, D = h_NxD.shape
    V = w.shape[0] if tied else w.shape[1]
    per_position = jnp.ndim(b) == 1
    xs = _position_tiles(h_NxD, targets_N, a_N, tile_n)
    if per_position:
        n_tiles, tile = split_tiles(N, tile_n)
        xs = (*xs, to_tiles(b, 0, n_tiles, tile))
    w_c = w.astype(h_NxD.dtype)

    def step(dw32: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        h_TxD, t_T, a_T = x[:3]
        coef_T = coef(a_T, x[3] if per_position else b)
        logits32_TxV = _logits32(h_TxD, w, tied)
        probs_TxV = jax.nn.softmax(_capped(logits32_TxV, softcap), axis=-1)
        onehot_TxV = jnp.arange(V, dtype=t_T.dtype)[None, :] == t_T[:, None]
        dcapped_TxV = coef_T[:, None] * (probs_TxV - onehot_TxV)
        if softcap is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh(z / cap)^2
            dcapped_TxV = dcapped_TxV * (1.0 - jnp.square(jnp.tanh(logits32_TxV / softcap)))
        dlogits_TxV = dcapped_TxV.astype(h_TxD.dtype)
        dh_TxD = dlogits_TxV @ (w_c if tied else w_c.T)
        if tied:  # dw is [V, D]
            dw32 = dw32 + jnp.matmul(dlogits_TxV.T, h_TxD, preferred_element_type=jnp.float32)
        else:  # dw is [D, V]
            dw32 = dw32 + jnp.matmul(h_TxD.T, dlogits_TxV, preferred_element_type=jnp.float32)
        return dw32, dh_TxD
    dw32, dh = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32), xs)
    return dh.reshape(-1, D)[:N], dw32.astype(w.dtype)


def _tiled_sum_bwd(tied, tile_n, softcap, residuals, g):
    h_NxD, w, targets_N, weights_N = residuals

    def coef(wt_T: jax.Array, scale: jax.Array) -> jax.Array:
        return jnp.where(wt_T != 0, wt_T.astype(jnp.float32) * scale, 0.0)
    dh_NxD, dw = _tiled_backward(h_NxD, w, targets_N, weights_N, g.astype(jnp.float32), coef, tied, tile_n, softcap)
    return dh_NxD, dw, None, None  # targets and weights get none


_tiled_sum.defvjp(_tiled_sum_fwd, _tiled_sum_bwd)


def linear_cross_entropy_sum(h_NxD: jax.Array, w: jax.Array, targets_N: jax.Array, weights_N: jax.Array, *,
                             tied: bool = False, tile_n: int | None = None,
                             tile_bytes: int = TILE_LOGITS_BYTES, softcap: float | None = None) -> jax.Array:
    """sum_i weights[i] * -log_softmax(h @ w)[i, targets[i]] in float32, tile by tile (with
    ``softcap``, of cap * tanh((h @ w) / cap), Gemma's final_logit_softcapping, in float32).

    ``w`` is the head kernel w_DxV, or with ``tied`` the embedding table w_VxD (logits h @ w.T);
    it is cast to h's dtype, the compute dtype. ``tile_n`` positions per tile, else as many as
    keep one tile's float32 logits within ``tile_bytes``; N need not be a multiple (the last
    tile is padded with zero-weight rows). Positions of weight 0 contribute exactly 0 and no
    gradient, whatever their target; elsewhere targets must lie in [0, V). The weights get no
    gradient (they are a mask, not a parameter)."""
    tile = _checked_tile(h_NxD, w, targets_N, weights_N, tied, tile_n, tile_bytes, "linear_cross_entropy_sum")
    return _tiled_sum(h_NxD, w, targets_N, weights_N.astype(jnp.float32), tied, tile, softcap)


def _checked_tile(h_NxD: jax.Array, w: jax.Array, targets_N: jax.Array, weights_N: jax.Array, tied: bool,
                  tile_n: int | None, tile_bytes: int, what: str) -> int:
    """The positions per tile, after checking the shapes (ValueError naming ``what``)."""
    if h_NxD.ndim != 2 or targets_N.shape != h_NxD.shape[:1] or weights_N.shape != h_NxD.shape[:1]:
        raise ValueError(f"{what} takes h [N, D], targets [N], weights [N]; got "
                         f"{h_NxD.shape}, {targets_N.shape}, {weights_N.shape}")
    D = h_NxD.shape[1]
    if w.ndim != 2 or (w.shape[1] if tied else w.shape[0]) != D:
        layout = "[V, D] (tied)" if tied else "[D, V]"
        raise ValueError(f"the head must be {layout} with D={D}, got {w.shape}")
    V = w.shape[0] if tied else w.shape[1]
    tile = tile_positions(h_NxD.shape[0], V, tile_bytes) if tile_n is None else min(int(tile_n), h_NxD.shape[0])
    if tile <= 0:
        raise ValueError(f"tile_n must be positive, got {tile_n}")
    return tile


# -- per-position log-probabilities (the preference head, pstar_jax.model.preference) -----------

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled_logps(h_NxD: jax.Array, w: jax.Array, targets_N: jax.Array, mask_N: jax.Array,
                 tied: bool, tile_n: int, softcap: float | None) -> jax.Array:
    xs = _position_tiles(h_NxD, targets_N, mask_N, tile_n)
    logp = jax.lax.map(lambda x: _tile_logps(x[0], w, x[1], x[2], tied, softcap), xs)
    return logp.reshape(-1)[:h_NxD.shape[0]]


def _tiled_logps_fwd(h_NxD, w, targets_N, mask_N, tied, tile_n, softcap):
    # As the sum: only the inputs are kept, each tile's logits are recomputed in the backward.
    return _tiled_logps(h_NxD, w, targets_N, mask_N, tied, tile_n, softcap), (h_NxD, w, targets_N, mask_N)


def _tiled_logps_bwd(tied, tile_n, softcap, residuals, g_N):
    h_NxD, w, targets_N, mask_N = residuals

    def coef(m_T: jax.Array, g_T: jax.Array) -> jax.Array:
        # d logp_i / d logits_i = onehot - softmax: the sum's backward with coef = -g.
        return jnp.where(m_T != 0, -g_T.astype(jnp.float32), 0.0)
    dh_NxD, dw = _tiled_backward(h_NxD, w, targets_N, mask_N, g_N, coef, tied, tile_n, softcap)
    return dh_NxD, dw, None, None


_tiled_logps.defvjp(_tiled_logps_fwd, _tiled_logps_bwd)


def linear_target_logps(h_NxD: jax.Array, w: jax.Array, targets_N: jax.Array, mask_N: jax.Array, *,
                        tied: bool = False, tile_n: int | None = None,
                        tile_bytes: int = TILE_LOGITS_BYTES, softcap: float | None = None) -> jax.Array:
    """log_softmax(h @ w)[i, targets[i]] per position, [N] float32, 0 where ``mask`` is 0, tile by
    tile as ``linear_cross_entropy_sum`` (same numerics, same memory): what a preference loss sums
    per sequence. Its backward takes any cotangent per position (the loss's weight on each
    log-prob) and, like the sum's, never holds N x V logits; the mask gets no gradient."""
    tile = _checked_tile(h_NxD, w, targets_N, mask_N, tied, tile_n, tile_bytes, "linear_target_logps")
    return _tiled_logps(h_NxD, w, targets_N, mask_N.astype(jnp.float32), tied, tile, softcap)
