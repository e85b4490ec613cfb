"""tiled_over_sequence equals the function on the whole sequence, and keeps its intermediate per tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.tiling import from_tiles, rows_within, split_tiles, tiled_over_sequence, to_tiles

EPS32 = float(jnp.finfo(jnp.float32).eps)
EPSBF16 = float(jnp.finfo(jnp.bfloat16).eps)


def swiglu(params, x_BxTxD):
    """models/llama.py's MLP: down(silu(gate(x)) * up(x))."""
    gate, up, down = params
    return (jax.nn.silu(x_BxTxD @ gate) * (x_BxTxD @ up)) @ down


def make(L, D=16, F=64, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    params = tuple((0.2 * jax.random.normal(k[i], s)).astype(dtype) for i, s in enumerate([(D, F), (D, F), (F, D)]))
    x = jax.random.normal(k[3], (2, L, D)).astype(dtype)
    g = jax.random.normal(k[4], (2, L, D), jnp.float32)
    return params, x, g


def assert_close(actual, expected, eps, factor=64):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=factor * eps * float(np.abs(expected).max()))


def grads(fn, params, x, g):
    loss = lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32) * g)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


def test_split_and_round_trip():
    assert split_tiles(10, 4) == (3, 4) and split_tiles(9, 4) == (3, 3) and split_tiles(4, 8) == (1, 4)
    x = jnp.arange(2 * 10 * 3).reshape(2, 10, 3)
    tiles = to_tiles(x, 1, 3, 4)
    assert tiles.shape == (3, 2, 4, 3)
    np.testing.assert_array_equal(from_tiles(tiles, 1, 10), x)
    with pytest.raises(ValueError):
        split_tiles(0, 4)
    assert rows_within(1000, 10, 10 * 100) == 96 and rows_within(1000, 10, 50) == 5 and rows_within(3, 1, 99) == 3


@pytest.mark.parametrize("L,tile", [(48, 16), (50, 16), (7, 64)])
@pytest.mark.parametrize("explicit", [True, False])
def test_equals_whole_sequence_fp32(L, tile, explicit):
    params, x, g = make(L)
    if explicit:
        tiled = lambda p, x: tiled_over_sequence(swiglu, x, tile=tile, params=p)  # noqa: E731
    else:
        tiled = lambda p, x: tiled_over_sequence(lambda t: swiglu(p, t), x, tile=tile)  # noqa: E731
    (out, (dp, dx)), (ref, (ref_dp, ref_dx)) = grads(tiled, params, x, g), grads(swiglu, params, x, g)
    assert_close(out, ref, EPS32)
    assert_close(dx, ref_dx, EPS32)
    for a, b in zip(dp, ref_dp):
        assert_close(a, b, EPS32)


def test_bf16_weight_grads_add_up_in_float32():
    params, x, g = make(64, dtype=jnp.bfloat16, seed=1)
    tiled = lambda p, x: tiled_over_sequence(swiglu, x, tile=16, params=p)  # noqa: E731
    (_, (dp, dx)), (_, (ref_dp, ref_dx)) = grads(tiled, params, x, g), grads(swiglu, params, x, g)
    assert all(a.dtype == jnp.bfloat16 for a in dp)
    assert_close(dx, ref_dx, EPSBF16, factor=1)  # the same bf16 ops per position
    for a, b in zip(dp, ref_dp):  # 4 tiles' bf16 partials summed in float32, rounded once
        assert_close(a, b, EPSBF16, factor=4)


def grad_temp_bytes(fn, L, D=64, F=256):
    shapes = ((jax.ShapeDtypeStruct((D, F), jnp.float32),) * 2 + (jax.ShapeDtypeStruct((F, D), jnp.float32),),
              jax.ShapeDtypeStruct((1, L, D), jnp.float32))
    loss = lambda p, x: jnp.sum(fn(p, x))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_traced_memory_holds_one_tile_of_the_intermediate():
    D, F, tile = 64, 256, 128
    tiled = {L: grad_temp_bytes(lambda p, x: tiled_over_sequence(swiglu, x, tile=tile, params=p), L)
             for L in (1024, 8192)}
    whole = {L: grad_temp_bytes(swiglu, L) for L in (1024, 8192)}
    # Whole: L x F gate, up and their product kept for the backward.
    assert whole[8192] >= 7 * whole[1024] and whole[8192] >= 3 * 8192 * F * 4
    # Tiled: a few tile x F buffers, the float32 weights and their accumulators, O(L x D).
    bound = 8 * tile * F * 4 + 4 * 3 * D * F * 4 + 4 * 8192 * D * 4
    assert tiled[8192] <= bound, (tiled, bound)
    assert tiled[8192] - tiled[1024] <= 4 * (8192 - 1024) * D * 4, tiled


def test_one_tile_is_the_plain_call():
    params, x, g = make(20)
    tiled = jax.make_jaxpr(lambda p, x: tiled_over_sequence(swiglu, x, tile=64, params=p))(params, x)
    assert not any(word in str(tiled) for word in ("remat", "checkpoint", "scan"))  # with two tiles, there
    (out, (dp, dx)) = grads(lambda p, x: tiled_over_sequence(swiglu, x, tile=64, params=p), params, x, g)
    (ref, (ref_dp, ref_dx)) = grads(swiglu, params, x, g)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(dx, ref_dx)
