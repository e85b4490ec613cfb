"""tiled_over_sequence and map_tiles equal the function on the whole sequence, and keep its
intermediate per tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.model.tiling import (from_tiles, keeping_tiles, kept_projection, map_tiles, rows_within, split_tiles,
                                    tiled_over_sequence, to_tiles, zeros_after)

EPS32 = float(jnp.finfo(jnp.float32).eps)
EPSBF16 = float(jnp.finfo(jnp.bfloat16).eps)


def swiglu(params, x_BxTxD):
    """models/llama.py's MLP: down(silu(gate(x)) * up(x)), its projections marked as models/lora.project marks them."""
    gate, up, down = params
    project = lambda x, w: kept_projection(x @ w)  # noqa: E731
    return project(jax.nn.silu(project(x_BxTxD, gate)) * project(x_BxTxD, up), down)


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
    # The fewest tiles that divide n, up to twice the fewest possible; else equal padded tiles.
    assert split_tiles(10, 4) == (5, 2) and split_tiles(9, 4) == (3, 3) and split_tiles(4, 8) == (1, 4)
    assert split_tiles(13, 4) == (4, 4) and split_tiles(65536, 4680) == (16, 4096)
    for n in range(1, 200):
        for tile in (1, 3, 8, 64):
            n_tiles, size = split_tiles(n, tile)
            assert size <= tile and n <= n_tiles * size < n + n_tiles
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


@pytest.mark.parametrize("explicit", [True, False])
def test_bf16_weight_grads_add_up_in_float32(explicit):
    # Weights handed in as params and weights the function closes over alike.
    params, x, g = make(64, dtype=jnp.bfloat16, seed=1)
    if explicit:
        tiled = lambda p, x: tiled_over_sequence(swiglu, x, tile=16, params=p)  # noqa: E731
    else:
        tiled = lambda p, x: tiled_over_sequence(lambda t: swiglu(p, t), x, tile=16)  # noqa: E731
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


def test_map_tiles_integer_inputs_closures_and_several_outputs():
    # Integer constants and tiles (segment ids, positions) get no gradient; a closed-over weight
    # does, beside the explicit constant; a body may return a pytree. fp32: equal to the untiled
    # function to rounding.
    k = jax.random.split(jax.random.key(3), 3)
    w, scale = jax.random.normal(k[0], (8, 8)), jax.random.normal(k[1], (8,))
    x = jax.random.normal(k[2], (6, 5, 8))  # 6 tiles of 5 positions
    ids = jnp.arange(30, dtype=jnp.int32).reshape(6, 5) % 4
    table = jnp.arange(4, dtype=jnp.int32) * 2

    def body_of(w):
        def body(consts, tile):
            scale, table = consts
            x, ids = tile
            y = jnp.tanh(x @ w) * scale[None, :] + table[ids][:, None]
            return {"y": y, "norm": jnp.sum(y * y, axis=-1) + ids}
        return body

    def tiled(w, scale, x):
        return map_tiles(body_of(w), (scale, table), (x, ids))

    def whole(w, scale, x):
        out = body_of(w)((scale, table), (x.reshape(30, 8), ids.reshape(30)))
        return jax.tree.map(lambda y: y.reshape((6, 5) + y.shape[1:]), out)

    def loss_of(f):
        return lambda *a: jnp.sum(f(*a)["y"] ** 2) + jnp.sum(jnp.sin(f(*a)["norm"]))
    got = jax.grad(loss_of(tiled), argnums=(0, 1, 2))(w, scale, x)
    want = jax.grad(loss_of(whole), argnums=(0, 1, 2))(w, scale, x)
    for a, b in zip(got, want):
        assert_close(a, b, EPS32)
    assert all(bool(jnp.any(a != 0)) for a in got)


def test_zeros_after_is_zero_whatever_it_waits_for():
    for after in (jnp.array([1.5, 2.0]), jnp.array([jnp.nan]), jnp.array([-jnp.inf, 1.0])):
        z = jax.jit(lambda a: zeros_after((3, 2), jnp.bfloat16, a))(after)
        assert z.dtype == jnp.bfloat16 and z.shape == (3, 2)
        np.testing.assert_array_equal(np.asarray(z, np.float32), np.zeros((3, 2)))


def _split_vjp(fn, params, x):
    """(y, grads function) with the forward and the backward in two jits, as a kept stage runs
    them (pstar_jax.engine.stages.forward_keep / backward_kept): the vjp's leaves cross between them."""
    structure = []

    def forward(p, x):
        y, vjp = jax.vjp(fn, p, x)
        leaves, treedef = jax.tree.flatten(vjp)
        structure.append(treedef)
        return y, leaves
    y, leaves = jax.jit(forward)(params, x)
    return y, jax.jit(lambda leaves, g: jax.tree.unflatten(structure[0], leaves)(g)), leaves


@pytest.mark.parametrize("dtype,eps", [(jnp.float32, EPS32), (jnp.bfloat16, EPSBF16)])
def test_kept_tiles_equal_recomputed_tiles(dtype, eps):
    # Under keeping_tiles the forward keeps each tile's residuals and the backward recomputes no
    # tile: the same values and sums (float32 across tiles for bf16), from a backward traced in
    # another jit; a MLP's backward then runs its 3 matmuls' transposes only (6 dots, not 9).
    params, x, g = make(64, dtype=dtype, seed=2)
    fn = lambda p, x: tiled_over_sequence(swiglu, x, tile=16, params=p)  # noqa: E731
    y_ref, (dp_ref, dx_ref) = jax.vjp(fn, params, x)[0], jax.vjp(fn, params, x)[1](g.astype(dtype))
    with keeping_tiles():
        y, backward, leaves = _split_vjp(fn, params, x)
    dp, dx = backward(leaves, g.astype(dtype))
    assert all(a.dtype == dtype for a in dp)
    assert_close(y, y_ref, eps, factor=1)
    assert_close(dx, dx_ref, eps, factor=1)
    for a, b in zip(dp, dp_ref):
        assert_close(a, b, eps, factor=4)
    # per tile (4 tiles of [1, 32, ...]) the tiles' input and the projections' outputs that feed
    # something nonlinear, x @ gate and x @ up (silu and the product are recomputed: elementwise,
    # no FLOPs to speak of), not down's; the weights once (a stage leaves those out: they are its
    # own tensors)
    per_tile = sorted(leaf.shape for leaf in leaves if leaf.ndim == 4)
    assert per_tile == [(4, 1, 32, 16), (4, 1, 32, 64), (4, 1, 32, 64)], per_tile
    assert sorted(leaf.shape for leaf in leaves if leaf.ndim == 2) == [(16, 64), (16, 64), (64, 16)]
    dots = lambda f, *a: str(jax.make_jaxpr(f)(*a)).count("dot_general")  # noqa: E731
    assert dots(backward, leaves, g.astype(dtype)) == 6
    assert dots(lambda p, x, g: jax.vjp(fn, p, x)[1](g), params, x, g.astype(dtype)) == 3 + 9


def test_keeping_tiles_leaves_unkeepable_maps_and_the_outside_as_they_were():
    params, x, g = make(64, seed=4)
    fn = lambda p, x: tiled_over_sequence(swiglu, x, tile=16, params=p)  # noqa: E731
    unkept = lambda p, x: map_tiles(lambda p, t: swiglu(p, t), p, x.reshape(4, 32, 16), keepable=False)  # noqa: E731
    with keeping_tiles():
        kept_jaxpr, unkept_jaxpr = str(jax.make_jaxpr(fn)(params, x)), str(jax.make_jaxpr(unkept)(params, x))
    assert "_map_kept" in kept_jaxpr and "_map_tiles" in unkept_jaxpr and "_map_kept" not in unkept_jaxpr
    # outside, the recompute (a new function: jax caches a function's trace, not knowing the context)
    assert "_map_tiles" in str(jax.make_jaxpr(lambda p, x: tiled_over_sequence(swiglu, x, tile=16, params=p))(params, x))
