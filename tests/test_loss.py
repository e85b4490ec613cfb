"""The tiled head loss equals the untiled one (value and gradients) and its memory stays flat in N."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.model.loss import linear_cross_entropy_sum, tile_positions

EPS32 = float(jnp.finfo(jnp.float32).eps)
EPSBF16 = float(jnp.finfo(jnp.bfloat16).eps)


def reference_sum(h_NxD, w, targets_N, weights_N, tied=False):
    """sum(weights * -log_softmax(h @ w)[targets]) over the whole N x V logits, as
    pstar_jax.model.staged.cross_entropy computes them (compute-dtype logits, float32 softmax)."""
    logits = h_NxD @ (w.T if tied else w).astype(h_NxD.dtype)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(weights_N * -jnp.take_along_axis(logp, targets_N[:, None], axis=-1)[:, 0])


def make(N, D, V, seed=0, tied=False, keep=0.7):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (N, D), jnp.float32)
    w = 0.3 * jax.random.normal(k[1], (V, D) if tied else (D, V), jnp.float32)
    t = jax.random.randint(k[2], (N,), 0, V)
    wt = (jax.random.uniform(k[3], (N,)) < keep).astype(jnp.float32)
    return h, w, t, wt


def assert_close(actual, expected, eps, factor=64):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    atol = factor * eps * max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("N,tile_n", [(64, 16), (77, 16), (50, 64), (33, 1)])
def test_value_and_grads_equal_untiled_fp32(tied, N, tile_n):
    h, w, t, wt = make(N, 24, 40, tied=tied)
    tiled = jax.jit(jax.value_and_grad(
        lambda h, w: linear_cross_entropy_sum(h, w, t, wt, tied=tied, tile_n=tile_n), argnums=(0, 1)))
    untiled = jax.jit(jax.value_and_grad(lambda h, w: reference_sum(h, w, t, wt, tied), argnums=(0, 1)))
    (loss, (dh, dw)), (ref, (ref_dh, ref_dw)) = tiled(h, w), untiled(h, w)
    assert loss.dtype == jnp.float32 and dw.shape == w.shape and dh.shape == h.shape
    assert_close(loss, ref, EPS32)
    assert_close(dh, ref_dh, EPS32)
    assert_close(dw, ref_dw, EPS32)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_compute_equals_bf16_reference(tied):
    h, w, t, wt = make(96, 32, 64, seed=1, tied=tied)
    h, w = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    tiled = jax.jit(jax.value_and_grad(
        lambda h, w: linear_cross_entropy_sum(h, w, t, wt, tied=tied, tile_n=40), argnums=(0, 1)))
    untiled = jax.jit(jax.value_and_grad(lambda h, w: reference_sum(h, w, t, wt, tied), argnums=(0, 1)))
    (loss, (dh, dw)), (ref, (ref_dh, ref_dw)) = tiled(h, w), untiled(h, w)
    assert loss.dtype == jnp.float32 and dh.dtype == dw.dtype == jnp.bfloat16
    # The logits are the same float32-accumulated products of bf16 operands (XLA keeps the
    # reference's bf16 logits + astype in float32); the sums differ in order only.
    assert_close(loss, ref, EPS32)
    assert_close(dh, ref_dh, EPSBF16, factor=1)  # the same bf16 ops per row, at most a rounding apart
    # dW: the reference rounds one bf16 matmul once, the tiles add float32 partials and round
    # once: within two bf16 roundings of the largest entry.
    assert_close(dw, ref_dw, EPSBF16, factor=2)


def test_zero_weights_contribute_nothing_and_never_nan():
    h, w, t, wt = make(40, 16, 30, seed=2)
    t = t.at[::3].set(-1).at[1::7].set(30)  # out of range where masked (the padding's targets)
    wt = jnp.where(t < 0, 0.0, wt).at[1::7].set(0.0)
    fn = jax.jit(jax.value_and_grad(lambda h, w, wt: linear_cross_entropy_sum(h, w, t, wt, tile_n=16),
                                    argnums=(0, 1)))
    loss, (dh, dw) = fn(h, w, wt)
    keep = wt != 0
    ref, (ref_dh, ref_dw) = jax.value_and_grad(lambda h, w: reference_sum(h[keep], w, t[keep], wt[keep]),
                                               argnums=(0, 1))(h, w)
    assert_close(loss, ref, EPS32)
    assert_close(dh, ref_dh, EPS32)
    assert_close(dw, ref_dw, EPS32)
    assert not np.asarray(dh)[~np.asarray(keep)].any()
    loss0, (dh0, dw0) = fn(h, w, jnp.zeros_like(wt))
    assert float(loss0) == 0.0 and not np.asarray(dh0).any() and not np.asarray(dw0).any()


def test_fractional_weights_scale_each_position():
    h, w, t, _ = make(30, 8, 20, seed=3)
    wt = jnp.linspace(0.0, 2.0, 30)
    tiled = jax.grad(lambda h: linear_cross_entropy_sum(h, w, t, wt, tile_n=7))(h)
    assert_close(tiled, jax.grad(lambda h: reference_sum(h, w, t, wt))(h), EPS32)


def test_tile_positions_fits_the_budget():
    assert tile_positions(10_000, 1000, tile_bytes=4 * 1000 * 100) == 96  # 100 rows, down to a multiple of 8
    assert tile_positions(10_000, 1000, tile_bytes=4 * 1000 * 5) == 5
    assert tile_positions(10_000, 10**6, tile_bytes=1) == 1
    assert tile_positions(50, 10, tile_bytes=2**30) == 50
    with pytest.raises(ValueError):
        tile_positions(0, 10)


def test_bad_shapes_name_the_layout():
    h, w, t, wt = make(8, 4, 6)
    with pytest.raises(ValueError, match=r"\[V, D\] \(tied\)"):
        linear_cross_entropy_sum(h, w, t, wt, tied=True)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy_sum(h, w, t[:4], wt)


def grad_temp_bytes(fn, N, D, V):
    args = (jax.ShapeDtypeStruct((N, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((N,), jnp.int32), jax.ShapeDtypeStruct((N,), jnp.float32))
    return jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_traced_memory_stays_flat_in_tokens():
    D, V, tile_n = 64, 4096, 128
    tiled = {N: grad_temp_bytes(lambda h, w, t, wt: linear_cross_entropy_sum(h, w, t, wt, tile_n=tile_n), N, D, V)
             for N in (1024, 8192)}
    untiled = {N: grad_temp_bytes(reference_sum, N, D, V) for N in (1024, 8192)}
    # The untiled gradient holds N x V float32 logits (and their gradient): ~8x from 1k to 8k tokens.
    assert untiled[8192] >= 7 * untiled[1024] and untiled[8192] >= 8192 * V * 4
    # The tiled one: a few tile_n x V float32 buffers, the float32 dW accumulator, O(N x D) terms.
    bound = 4 * tile_n * V * 4 + 2 * D * V * 4 + 4 * 8192 * D * 4
    assert tiled[8192] <= bound, (tiled, bound)
    assert tiled[8192] - tiled[1024] <= 4 * (8192 - 1024) * D * 4, tiled
