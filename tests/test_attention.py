"""Query-tiled attention equals full L x L masked attention; its memory grows linearly in L."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.model.attention import _cudnn_attention, causal_attention, choose_implementation, tile_queries

EPS32 = float(jnp.finfo(jnp.float32).eps)
EPSBF16 = float(jnp.finfo(jnp.bfloat16).eps)


def naive(q, k, v, segments):
    """Full L x L grouped-query attention with the same-segment mask (the models' code before it moved here)."""
    B, L, H, K = q.shape
    N = k.shape[2]
    s = jnp.einsum("blngk,bmnk->bnglm", q.reshape(B, L, N, H // N, K), k) * (K ** -0.5)
    mask = jnp.tril(jnp.ones((L, L), bool))[None] & (segments[:, :, None] == segments[:, None, :])
    s32 = jnp.where(mask[:, None, None], s.astype(jnp.float32), -jnp.inf)
    p = jax.nn.softmax(s32, axis=-1).astype(q.dtype)
    return jnp.einsum("bnglm,bmnk->blngk", p, v).reshape(B, L, H, K)


def packed_segments(L):
    """Row 0: three examples then padding (0); row 1: two examples, no padding."""
    a, b = L // 3, L // 2
    row0 = np.concatenate([np.full(a, 1), np.full(b - a, 2), np.full(L - b - 3, 3), np.zeros(3)])
    row1 = np.concatenate([np.full(b + 1, 1), np.full(L - b - 1, 2)])
    return jnp.asarray(np.stack([row0, row1]), jnp.int32)


def make(L, H=4, N=2, K=8, dtype=jnp.float32, seed=0):
    kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (2, L, H, K)).astype(dtype)
    k = jax.random.normal(kk, (2, L, N, K)).astype(dtype)
    v = jax.random.normal(kv, (2, L, N, K)).astype(dtype)
    g = jax.random.normal(kg, (2, L, H, K), jnp.float32)  # a cotangent: sum(o * g) as the loss
    return q, k, v, g


def assert_close(actual, expected, eps, factor=64):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=factor * eps * float(np.abs(expected).max()))


def value_and_grads(fn, q, k, v, g):
    def loss(q, k, v):
        o = fn(q, k, v)
        return jnp.sum(o.astype(jnp.float32) * g), o
    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return o, grads


@pytest.mark.parametrize("L,tile_q", [(48, 16), (50, 16), (37, 64), (20, 1)])
@pytest.mark.parametrize("H,N", [(4, 2), (4, 4), (6, 1)])
def test_equals_full_attention_with_segments_fp32(L, tile_q, H, N):
    q, k, v, g = make(L, H, N)
    segments = packed_segments(L)
    o, grads = value_and_grads(lambda q, k, v: causal_attention(q, k, v, segments, tile_q=tile_q,
                                                                implementation="tiled"), q, k, v, g)
    ref, ref_grads = value_and_grads(lambda q, k, v: naive(q, k, v, segments), q, k, v, g)
    assert o.shape == q.shape and np.isfinite(np.asarray(o)).all()
    assert_close(o, ref, EPS32)
    for a, b in zip(grads, ref_grads):
        assert np.isfinite(np.asarray(a)).all()
        assert_close(a, b, EPS32)


def test_no_segments_is_plain_causal():
    q, k, v, _ = make(40)
    o = causal_attention(q, k, v, tile_q=16, implementation="tiled")
    assert_close(o, naive(q, k, v, jnp.zeros((2, 40), jnp.int32)), EPS32)


def test_bf16_equals_bf16_full_attention():
    q, k, v, g = make(64, dtype=jnp.bfloat16, seed=1)
    segments = packed_segments(64)
    o, grads = value_and_grads(lambda q, k, v: causal_attention(q, k, v, segments, tile_q=16,
                                                                implementation="tiled"), q, k, v, g)
    ref, ref_grads = value_and_grads(lambda q, k, v: naive(q, k, v, segments), q, k, v, g)
    assert o.dtype == jnp.bfloat16
    assert_close(o, ref, EPSBF16, factor=1)  # the same bf16 ops per query row
    assert_close(grads[0], ref_grads[0], EPSBF16, factor=1)
    # dk, dv: 4 tiles' bf16 partials added in float32 and rounded once, against one bf16 product.
    for a, b in zip(grads[1:], ref_grads[1:]):
        assert_close(a, b, EPSBF16, factor=4)


def test_dot_product_attention_mask_equals_tiled():
    """The call the GPU path makes (segment ids as mask=), run with XLA's implementation."""
    q, k, v, _ = make(30)
    segments = packed_segments(30)
    fused = _cudnn_attention(q, k, v, segments, scale=8 ** -0.5, implementation="xla")
    assert_close(fused, causal_attention(q, k, v, segments, tile_q=8, implementation="tiled"), EPS32)
    causal = _cudnn_attention(q, k, v, None, scale=8 ** -0.5, implementation="xla")  # is_causal alone
    assert_close(causal, causal_attention(q, k, v, tile_q=8, implementation="tiled"), EPS32)


def test_float32_scores_match_dot_product_attention_in_bf16():
    """GPT's numerics today: jax.nn.dot_product_attention (XLA) with q.k and the scale in float32."""
    q, k, v, _ = make(40, dtype=jnp.bfloat16, seed=2)
    segments = packed_segments(40)
    fused = _cudnn_attention(q, k, v, segments, scale=8 ** -0.5, implementation="xla")
    tiled = causal_attention(q, k, v, segments, tile_q=16, implementation="tiled", float32_scores=True)
    assert_close(tiled, fused, EPSBF16, factor=0.25)  # the same ops; llama's numerics are half an ulp off


def test_choice_on_a_cpu_is_tiled():
    q = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
    assert jax.default_backend() == "cpu" and choose_implementation(q, None) == "tiled"
    assert tile_queries(2, 4, 1024, tile_bytes=4 * 2 * 4 * 1024 * 100) == 96
    assert tile_queries(1, 1, 10, tile_bytes=2**30) == 10


def test_bad_shapes_are_named():
    q, k, v, _ = make(8, H=3, N=2)
    with pytest.raises(ValueError, match="multiple"):
        causal_attention(q, k, v)
    q, k, v, _ = make(8)
    with pytest.raises(ValueError, match="segment_ids"):
        causal_attention(q, k, v, jnp.zeros((2, 7), jnp.int32))


def grad_temp_bytes(fn, L, H=4, N=2, K=16):
    shapes = [jax.ShapeDtypeStruct((1, L, H, K), jnp.float32), jax.ShapeDtypeStruct((1, L, N, K), jnp.float32),
              jax.ShapeDtypeStruct((1, L, N, K), jnp.float32), jax.ShapeDtypeStruct((1, L), jnp.int32)]
    loss = lambda q, k, v, s: jnp.sum(fn(q, k, v, s))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_traced_memory_grows_linearly_in_length():
    H, K, tile_q = 4, 16, 64
    tiled = {L: grad_temp_bytes(lambda q, k, v, s: causal_attention(q, k, v, s, tile_q=tile_q,
                                                                    implementation="tiled"), L)
             for L in (512, 4096)}
    full = {L: grad_temp_bytes(naive, L) for L in (512, 4096)}
    # Full attention keeps H x L x L float32 scores or probabilities: 64x from 512 to 4096.
    assert full[4096] >= 32 * full[512] and full[4096] >= H * 4096 * 4096 * 4
    # Tiled: a few H x tile_q x L score buffers plus O(L x H x K) inputs, outputs and gradients.
    bound = 6 * H * tile_q * 4096 * 4 + 8 * 4096 * H * K * 4  # measured: 18 MiB of 32
    assert tiled[4096] <= bound, (tiled, bound)
    assert tiled[4096] <= 16 * tiled[512], tiled  # ~8x for 8x the length, never ~64x


def banded(q, k, v, segments, window):
    """``naive`` with a sliding window: position i sees j only for i - window < j <= i."""
    B, L, H, K = q.shape
    N = k.shape[2]
    s = jnp.einsum("blngk,bmnk->bnglm", q.reshape(B, L, N, H // N, K), k) * (K ** -0.5)
    i, j = jnp.arange(L)[:, None], jnp.arange(L)[None, :]
    mask = ((j <= i) & (j > i - window))[None] & (segments[:, :, None] == segments[:, None, :])
    s32 = jnp.where(mask[:, None, None], s.astype(jnp.float32), -jnp.inf)
    p = jax.nn.softmax(s32, axis=-1).astype(q.dtype)
    return jnp.einsum("bnglm,bmnk->blngk", p, v).reshape(B, L, H, K)


@pytest.mark.parametrize("window,tile_q", [(1, 16), (5, 16), (7, 4), (64, 16)])
def test_sliding_window_equals_a_banded_full_attention_with_segments(window, tile_q):
    """Gemma's sliding layers: the band within each segment, values and gradients; a window past
    the length is plain causal attention."""
    q, k, v, g = make(40)
    segments = packed_segments(40)
    o, grads = value_and_grads(lambda q, k, v: causal_attention(q, k, v, segments, tile_q=tile_q, window=window,
                                                                implementation="tiled"), q, k, v, g)
    ref, ref_grads = value_and_grads(lambda q, k, v: banded(q, k, v, segments, window), q, k, v, g)
    assert_close(o, ref, EPS32)
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, EPS32)
    if window >= 40:
        assert_close(o, causal_attention(q, k, v, segments, tile_q=tile_q, implementation="tiled"), EPS32)
    # The GPU path's call (local_window_size), run with XLA's implementation.
    fused = _cudnn_attention(q, k, v, segments, scale=8 ** -0.5, window=window, implementation="xla")
    assert_close(fused, ref, EPS32)


def test_sliding_window_memory_grows_linearly_in_length():
    """The band is built per query tile over the tile + window - 1 keys it reaches, never as an
    L x L mask: a tile's scores do not grow with L (measured 1.9 MiB at 4096 against 18 MiB causal)."""
    tile_q = 64
    fn = lambda q, k, v, s: causal_attention(q, k, v, s, tile_q=tile_q, window=128, implementation="tiled")  # noqa: E731
    temp = {L: grad_temp_bytes(fn, L) for L in (512, 4096)}
    plain = grad_temp_bytes(lambda q, k, v, s: causal_attention(q, k, v, s, tile_q=tile_q, implementation="tiled"),
                            4096)
    assert temp[4096] <= 16 * temp[512], temp  # ~8x for 8x the length, never ~64x
    assert temp[4096] <= plain / 4, (temp, plain)  # the scores cover the window's keys, not all L
    with pytest.raises(ValueError, match="window must be a positive"):
        causal_attention(*make(8)[:3], window=0)
