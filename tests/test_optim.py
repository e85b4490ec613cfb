import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from pstar_jax.config import OptimConfig
from pstar_jax.memory import Placement, Space
from pstar_jax.optim import ChunkOptimizer, clip_scale, default_tx

N, N_DECAY = 96, 40  # a chunk of N elements whose first N_DECAY take weight decay
CFG = OptimConfig(lr=0.1, warmup_steps=2, total_steps=10, weight_decay=0.5)


def one_device() -> Placement:
    return Placement(Mesh(np.array(jax.devices()[:1]), ("data",)))


def inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)


def run_steps(space: Space, cfg: OptimConfig, grads: list[np.ndarray], master: np.ndarray,
              param_dtype=jnp.float32, scale: float = 1.0):
    """Updates in ``space``; returns numpy (master, state, params) after each step."""
    placement = one_device()
    opt = ChunkOptimizer(default_tx(cfg), placement, param_dtype)
    m = placement.put(jnp.asarray(master), space)
    state = opt.init(m)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)} == {space.value}
    history = []
    for grad in grads:
        g = placement.put(jnp.asarray(grad, param_dtype), space)
        s = placement.put(jnp.float32(scale), Space.DEVICE)  # update() places it in ``space``
        m, state, params = opt.update(space, g, m, state, s, N_DECAY)
        for out in (m, params, *jax.tree.leaves(state)):
            assert out.sharding.memory_kind == space.value
        assert m.dtype == jnp.float32 and params.dtype == param_dtype
        history.append(jax.tree.map(np.asarray, (m, state, params)))
    return history


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_device_and_host_paths_bitwise_equal(param_dtype):
    """The host (compute_on) and device updates give identical master, state and params."""
    master, _ = inputs(0)
    grads = [inputs(s)[1] for s in (1, 2, 3)]
    on_device = run_steps(Space.DEVICE, CFG, grads, master, param_dtype, scale=0.75)
    on_host = run_steps(Space.HOST, CFG, grads, master, param_dtype, scale=0.75)
    for dev, host in zip(on_device, on_host):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), dev, host)
    assert not np.array_equal(on_device[-1][0], master)  # the steps did move the master


@pytest.mark.parametrize("space", list(Space), ids=[s.name for s in Space])
def test_decay_mask_is_a_prefix(space):
    """With a zero grad only elements [0, n_decay) shrink toward 0; the rest stay exact."""
    cfg = OptimConfig(lr=0.1, warmup_steps=0, total_steps=10, weight_decay=0.5)
    master, _ = inputs(4)
    (new, _, params), = run_steps(space, cfg, [np.zeros(N, np.float32)], master)
    np.testing.assert_array_equal(new[N_DECAY:], master[N_DECAY:])
    assert np.all(np.abs(new[:N_DECAY]) < np.abs(master[:N_DECAY]))
    assert np.all(np.sign(new[:N_DECAY]) == np.sign(master[:N_DECAY]))
    np.testing.assert_allclose(new[:N_DECAY], master[:N_DECAY] * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(params, new)


def test_clip_scale():
    """1 below the clip norm, clip/norm above it, all ones when clipping is off."""
    sumsq = jnp.float32(16.0)  # norm 4
    assert clip_scale(sumsq, 5.0) == 1.0
    assert clip_scale(sumsq, 4.0) == 1.0
    assert clip_scale(sumsq, 1.0) == np.float32(0.25)
    assert clip_scale(sumsq, None) == 1.0
    assert clip_scale(jnp.float32(1e12), None) == 1.0
    for clip in (5.0, 1.0, None):
        assert clip_scale(sumsq, clip).dtype == jnp.float32 and clip_scale(sumsq, clip).shape == ()


def test_clip_scale_matches_optax():
    """Grads times clip_scale equal optax.clip_by_global_norm of the same grads."""
    grads = {"a": jnp.asarray(inputs(5)[1]), "b": jnp.arange(7.0)}
    sumsq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    for clip in (0.5, 3.0, 100.0):
        clipped, _ = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())
        scale = clip_scale(sumsq, clip)
        jax.tree.map(lambda c, g: np.testing.assert_allclose(c, g * scale, rtol=1e-6), clipped, grads)


@pytest.mark.parametrize("space", list(Space), ids=[s.name for s in Space])
def test_chunk_update_equals_per_tensor_adamw(space):
    """A chunk's update equals optax AdamW run on its decayed and undecayed tensors separately."""
    master, _ = inputs(6)
    grads = [inputs(s)[1] for s in (7, 8, 9)]
    chunked = run_steps(space, CFG, grads, master)
    tx = optax.multi_transform({"decay": default_tx(CFG)(1.0), "none": default_tx(CFG)(0.0)},
                               {"w": "decay", "b": "none"})
    params = {"w": jnp.asarray(master[:N_DECAY]), "b": jnp.asarray(master[N_DECAY:])}
    state = tx.init(params)

    @jax.jit  # compiled like the chunk update, so both see the same float arithmetic
    def step(g, state, params):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for grad, (chunk_master, _, _) in zip(grads, chunked):
        params, state = step({"w": jnp.asarray(grad[:N_DECAY]), "b": jnp.asarray(grad[N_DECAY:])},
                             state, params)
        np.testing.assert_allclose(chunk_master[:N_DECAY], params["w"], rtol=1e-6)
        np.testing.assert_allclose(chunk_master[N_DECAY:], params["b"], rtol=1e-6)
    assert not np.allclose(chunked[-1][0], master)
