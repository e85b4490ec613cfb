"""The grouped expert matmul over quantized frozen kernels (pstar_jax/model/quant_grouped.py):
equal to the plain grouped matmul over the same kernels dequantized in full, forward and
backward, for every split into groups of experts and output-channel tiles; its compiled
working memory is a few tiles', never the stack of dequantized experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.model import quant
from pstar_jax.model.quant import quant_tile_bytes
from pstar_jax.model.quant_grouped import grouped_quant_matmul, grouped_tile_bytes, grouped_tiles, stack_kernels
from pstar_jax.model.quant_bytes import QuantSlot, dequantized, from_bytes, stored_shape, to_bytes
from pstar_models.moe import grouped_swiglu, route

EPS32 = float(np.finfo(np.float32).eps)


def experts(kind, E, D, I, seed=0, slots=True):
    """E quantized kernels [D, I] stacked as a stage stacks them (their slots' bytes, QuantSlot), or
    as quantized tensors, and their full dequantization [E, D, I]."""
    rng = np.random.default_rng(seed)
    stored = [to_bytes(rng.standard_normal((D, I)).astype(np.float32), kind) for _ in range(E)]
    if slots:
        stacked = stack_kernels([QuantSlot(jnp.asarray(s), (D, I), kind, jnp.float32) for s in stored])
    else:
        stacked = stack_kernels([from_bytes(jnp.asarray(s), (D, I), kind, jnp.float32) for s in stored])
    return stacked, jnp.stack([dequantized(s, (D, I), kind, np.float32) for s in stored])


@pytest.mark.parametrize("slots", [True, False], ids=["slots", "tensors"])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_grouped_quant_matmul_equals_the_dequantized_experts_in_every_split(kind, slots, monkeypatch):
    E, D, I, T, R = 5, 64, 48, 7, 8
    q_E, w_ExDxI = experts(kind, E, D, I, slots=slots)
    shape = stored_shape((D, I), kind)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((T, R, D)), jnp.float32)
    expert_T = jnp.asarray([0, 2, 2, 4, 1, 4, 4])  # expert 3 has no tile
    probe = jnp.asarray(rng.standard_normal((T, R, I)), jnp.float32)
    want = jnp.einsum("trd,tdi->tri", x, w_ExDxI[expert_T])
    want_dx = jax.grad(lambda x: jnp.sum(jnp.einsum("trd,tdi->tri", x, w_ExDxI[expert_T]) * probe))(x)
    one = quant_tile_bytes(shape, kind, I, jnp.float32)
    # every tile at once; 3 experts a step (a remainder of 1); one expert in channel tiles of 16
    for budget, split in [(32 * 2**20, (7, I)), (3 * one, (3, I)), (quant_tile_bytes(shape, kind, 16, jnp.float32),
                                                                      (1, 16))]:
        monkeypatch.setattr(quant, "QUANT_TILE_BYTES", budget)
        assert grouped_tiles(shape, kind, T, jnp.float32) == split
        got = jax.jit(lambda x, q, e: grouped_quant_matmul(x, q, e))(x, q_E, expert_T)
        # sums over D of the same products, in whatever order XLA's dot takes: float32 roundings
        np.testing.assert_allclose(got, want, rtol=0, atol=D * EPS32 * float(jnp.abs(want).max()), err_msg=str(split))
        dx = jax.jit(jax.grad(lambda x, q, e: jnp.sum(grouped_quant_matmul(x, q, e) * probe)))(x, q_E, expert_T)
        np.testing.assert_allclose(dx, want_dx, rtol=0, atol=I * EPS32 * float(jnp.abs(want_dx).max()))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_grouped_swiglu_over_quantized_experts_equals_it_over_their_dequantization(kind):
    """Routing, tiles and the three matrices: the quantized stacks give the dequantized ones'
    output and input gradient."""
    N, D, I, E, k = 24, 32, 64, 4, 2
    (gate, gate_w), (up, up_w) = experts(kind, E, D, I, 2), experts(kind, E, D, I, 3)
    rng = np.random.default_rng(4)
    down, down_w = experts(kind, E, I, D, 4)
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    _, chosen = route(jnp.asarray(rng.standard_normal((N, E))).at[:, 1].set(-30.0), k, True, x.dtype)
    probe = jnp.asarray(rng.standard_normal((N, k, D)), jnp.float32)

    def loss(x, *w):
        return jnp.sum(grouped_swiglu(x, chosen, *w) * probe)
    want, want_dx = jax.value_and_grad(loss)(x, gate_w, up_w, down_w)
    got, got_dx = jax.jit(jax.value_and_grad(loss))(x, gate, up, down)
    assert abs(float(got) - float(want)) <= 1e-5 * float(jnp.abs(probe).sum())
    np.testing.assert_allclose(got_dx, want_dx, rtol=0, atol=1e-5 * float(jnp.abs(want_dx).max()))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_grouped_quant_matmul_keeps_a_few_tiles_live(kind, monkeypatch):
    """16 experts [512, 1024] (32 MiB dequantized in float32, 2 MiB each), 12 tiles of 8 rows: the
    compiled forward and backward allocate temporaries within two steps' dequantized tiles
    (``grouped_tile_bytes``) plus the activations (x, y, dx), whether a step holds whole experts
    or a channel tile of one; never the 32 MiB of all experts, nor each tile's gathered matrix."""
    E, D, I, T, R = 16, 512, 1024, 12, 8
    q_E, _ = experts(kind, E, D, I, 5)
    shape = stored_shape((D, I), kind)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((T, R, D)), jnp.float32)
    expert_T = jnp.asarray(rng.integers(0, E, T))
    whole = E * D * I * 4
    for budget in (2 * 2**21 + 2**17, 2**19):
        monkeypatch.setattr(quant, "QUANT_TILE_BYTES", budget)
        bound = 2 * grouped_tile_bytes(shape, kind, T, jnp.float32) + 4 * 2 * T * R * (D + I)
        assert bound < whole / 3
        forward = jax.jit(lambda x, q, e: grouped_quant_matmul(x, q, e))
        backward = jax.jit(jax.grad(lambda x, q, e: jnp.sum(grouped_quant_matmul(x, q, e))))
        for fn in (forward, backward):
            stats = fn.lower(x, q_E, expert_T).compile().memory_analysis()
            if stats is None:
                pytest.skip("this backend reports no memory analysis")
            assert stats.temp_size_in_bytes <= bound, (budget, stats.temp_size_in_bytes, bound)


def test_grouped_quant_matmul_refuses_rows_of_the_wrong_width_in_one_line():
    q_E, _ = experts("nf4", 2, 64, 32)
    with pytest.raises(ValueError, match=r"needs \[tiles, rows, 64\]") as err:
        grouped_quant_matmul(jnp.zeros((3, 8, 32)), q_E, jnp.zeros(3, jnp.int32))
    assert "\n" not in str(err.value)
