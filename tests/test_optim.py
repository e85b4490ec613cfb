import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from pstar_jax.engine import host_adam
from pstar_jax.config import OptimConfig
from pstar_jax.engine.memory import Placement, Space
from pstar_jax.engine.optim import ChunkOptimizer, clip_scale, default_tx

N, N_DECAY = 96, 40  # a chunk of N elements whose first N_DECAY take weight decay
CFG = OptimConfig(lr=0.1, warmup_steps=2, total_steps=10, weight_decay=0.5)
# optax's AdamW compiled as another program (per-tensor groups) may round differently: an fp32 ulp a step.
CLOSE = dict(rtol=1e-6, atol=1e-7)


def placement(n_devices: int = 1) -> Placement:
    return Placement(Mesh(np.array(jax.devices()[:n_devices]), ("data",)))


def inputs(seed: int, n: int = N) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)


def run_steps(space: Space, grads: list[np.ndarray], master: np.ndarray, param_dtype=jnp.float32,
              scale: float = 1.0, make_tx=None, n_decay: int = N_DECAY, n_devices: int = 1,
              slice_numel: int | None = None, **opt_kw):
    """Updates in ``space``; returns numpy copies of (master, state, params) after each step.
    ``slice_numel``: cut the fused host update into slices this small."""
    where = placement(n_devices)
    opt = ChunkOptimizer(make_tx or default_tx(CFG), where, param_dtype, **opt_kw)
    if slice_numel:
        opt._host_adam.pool.min_slice_numel = slice_numel
    m = where.put(jnp.asarray(master), space)
    state = opt.init(m)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)} == {space.value}
    history = []
    for grad in grads:
        g = where.put(jnp.asarray(grad, param_dtype), space)
        s = where.put(jnp.float32(scale), Space.DEVICE)  # update() places it in ``space``
        assert opt._fused(space, g) == (space is Space.HOST and opt.fused_host)  # the path we mean to test
        m, state, params = opt.update(space, g, m, state, s, n_decay)
        for out in (m, params, *jax.tree.leaves(state)):
            assert out.sharding.memory_kind == space.value
        assert m.dtype == jnp.float32 and params.dtype == param_dtype
        history.append(jax.tree.map(lambda x: np.array(x, copy=True), (m, state, params)))
    return history


def steps3(seed: int = 0, n: int = N) -> tuple[np.ndarray, list[np.ndarray]]:
    return inputs(seed, n)[0], [inputs(s, n)[1] for s in (seed + 1, seed + 2, seed + 3)]


def assert_same(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y, strict=True), a, b)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_generic_host_and_device_paths_bitwise_equal(param_dtype):
    """The generic host update (compute_on) and the device update give identical results."""
    master, grads = steps3()
    on_device = run_steps(Space.DEVICE, grads, master, param_dtype, scale=0.75)
    on_host = run_steps(Space.HOST, grads, master, param_dtype, scale=0.75, fused_host=False)
    assert_same(on_device, on_host)
    assert not np.array_equal(on_device[-1][0], master)  # the steps did move the master


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_fused_host_equals_device_bitwise(param_dtype):
    """The fused host AdamW gives the same bits as XLA's update on a CPU (it rounds where XLA's CPU
    compiler does), on a chunk long enough for vector loops and their remainders."""
    assert ChunkOptimizer(default_tx(CFG), placement(), param_dtype).fused_host
    n = 4099
    master, grads = steps3(0, n)
    on_device = run_steps(Space.DEVICE, grads, master, param_dtype, scale=0.75, n_decay=1000)
    on_host = run_steps(Space.HOST, grads, master, param_dtype, scale=0.75, n_decay=1000, slice_numel=512)
    for dev, host in zip(on_device, on_host):
        assert_same(dev, host)
    assert int(on_host[-1][1][0].count) == 3 and int(on_host[-1][1][2].count) == 3
    assert not np.array_equal(on_host[-1][0], master)


@pytest.mark.parametrize("space", list(Space), ids=[s.name for s in Space])
def test_decay_mask_is_a_prefix(space):
    """With a zero grad only elements [0, n_decay) shrink toward 0; the rest stay exact."""
    cfg = OptimConfig(lr=0.1, warmup_steps=0, total_steps=10, weight_decay=0.5)
    master, _ = inputs(4)
    (new, _, params), = run_steps(space, [np.zeros(N, np.float32)], master, make_tx=default_tx(cfg))
    np.testing.assert_array_equal(new[N_DECAY:], master[N_DECAY:])
    assert np.all(np.abs(new[:N_DECAY]) < np.abs(master[:N_DECAY]))
    assert np.all(np.sign(new[:N_DECAY]) == np.sign(master[:N_DECAY]))
    np.testing.assert_allclose(new[:N_DECAY], master[:N_DECAY] * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(params, new)


@pytest.mark.parametrize("n_decay", [0, 1, 15, 16, 47, 48, 49, N - 1, N])
def test_fused_decay_boundary_on_shards_and_slices(n_decay):
    """A chunk sharded over 2 devices and cut into slices of 16: the decay boundary falls before,
    on, inside and after slice and shard edges, and the update equals the device path's."""
    cfg = OptimConfig(lr=0.1, warmup_steps=0, total_steps=10, weight_decay=0.5)
    master, grads = steps3(10)
    kw = dict(make_tx=default_tx(cfg), n_decay=n_decay, n_devices=2)
    on_device = run_steps(Space.DEVICE, grads[:1], master, **kw)
    on_host = run_steps(Space.HOST, grads[:1], master, host_threads=3, slice_numel=16, **kw)
    assert_same(on_host, on_device)
    zero = run_steps(Space.HOST, [np.zeros(N, np.float32)], master, host_threads=3, slice_numel=16, **kw)[0][0]
    np.testing.assert_array_equal(zero[n_decay:], master[n_decay:])
    assert np.all(np.abs(zero[:n_decay]) < np.abs(master[:n_decay]))


@pytest.mark.parametrize("n_devices", [1, 8])
def test_host_views_write_the_host_buffers(n_devices):
    """On a CPU the fused path's raw views of host arrays write the arrays' own buffers."""
    assert host_adam.host_views_work(placement(n_devices).sharding(Space.HOST))


def test_multicore_equals_single_core_exactly():
    """Slices on several threads give the same bits as one thread over the whole chunk."""
    n = 4099  # not a multiple of the slice alignment
    master, _ = inputs(20, n)
    grads = [inputs(s, n)[1] for s in (21, 22, 23)]
    spec = default_tx(CFG)
    outs = []
    for threads in (1, 2, 5):
        opt = ChunkOptimizer(spec, placement(), jnp.bfloat16, host_threads=threads)
        opt._host_adam.pool.min_slice_numel = 64  # several slices even for this small chunk
        assert len(opt._host_adam.pool.cuts(n)) == threads and opt._views_work
        m = placement().put(jnp.asarray(master), Space.HOST)
        state = opt.init(m)
        for grad in grads:
            g = placement().put(jnp.asarray(grad, jnp.bfloat16), Space.HOST)
            m, state, params = opt.update(Space.HOST, g, m, state, jnp.float32(0.5), 1000)
        outs.append(jax.tree.map(lambda x: np.array(x, copy=True), (m, state, params)))
    for other in outs[1:]:
        assert_same(outs[0], other)


def test_fused_constant_learning_rate():
    """AdamW with a constant rate (no schedule state) on the fused path equals the device path."""
    spec = host_adam.AdamW(0.01, weight_decay=0.1)
    master, grads = steps3(30)
    on_device = run_steps(Space.DEVICE, grads, master, jnp.bfloat16, make_tx=spec)
    on_host = run_steps(Space.HOST, grads, master, jnp.bfloat16, make_tx=spec)
    assert isinstance(on_host[0][1][2], optax.EmptyState)
    assert_same(on_host, on_device)


def test_non_adam_transform_takes_the_generic_path():
    """Another optax transformation (here RMSProp with masked decay) is not fused, and its host
    update equals the device update and optax on the flat chunk."""
    def make_tx(decay_mask):
        return optax.chain(optax.scale_by_rms(), optax.add_decayed_weights(0.1 * decay_mask), optax.scale(-0.01))
    opt = ChunkOptimizer(make_tx, placement(), jnp.float32)
    assert not opt.fused_host
    master, grads = steps3(40)
    on_device = run_steps(Space.DEVICE, grads, master, make_tx=make_tx)
    on_host = run_steps(Space.HOST, grads, master, make_tx=make_tx)
    tx = make_tx((jnp.arange(N) < N_DECAY).astype(jnp.float32))
    p, state = jnp.asarray(master), tx.init(jnp.asarray(master))
    for grad, dev, host in zip(grads, on_device, on_host):
        assert_same(dev, host)
        updates, state = tx.update(jnp.asarray(grad), state, p)
        p = optax.apply_updates(p, updates)
        np.testing.assert_allclose(host[0], p, rtol=1e-6)


def test_fused_update_is_a_donation():
    """Values read before an update keep their value (the kernel writes into buffers JAX handed
    over, copying one that is still viewed elsewhere), and the inputs are consumed."""
    where = placement()
    opt = ChunkOptimizer(default_tx(OptimConfig(lr=0.1, warmup_steps=0, total_steps=10)), where, jnp.bfloat16)
    master, grad = inputs(50)
    m = where.put(jnp.asarray(master), Space.HOST)
    state = opt.init(m)
    view = np.asarray(m)  # on a CPU: a zero-copy view of m's buffer
    g = where.put(jnp.asarray(grad, jnp.bfloat16), Space.HOST)
    new, _, _ = opt.update(Space.HOST, g, m, state, jnp.float32(1.0), N_DECAY)
    np.testing.assert_array_equal(view, master)
    assert not np.array_equal(np.asarray(new), master)
    assert g.is_deleted()


def test_begin_update_runs_on_a_thread_and_raises_its_errors(monkeypatch):
    """begin_update returns at once with a handle whose result equals update's; an error in the
    worker reaches result(), and the worker keeps serving later updates."""
    where = placement()
    master, grad = inputs(60)

    def fresh():
        opt_m = where.put(jnp.asarray(master), Space.HOST)
        return where.put(jnp.asarray(grad, jnp.bfloat16), Space.HOST), opt_m, opt.init(opt_m)
    opt = ChunkOptimizer(default_tx(CFG), where, jnp.bfloat16)
    want = opt.update(Space.HOST, *fresh(), jnp.float32(1.0), N_DECAY)
    pending = opt.begin_update(Space.HOST, *fresh(), jnp.float32(1.0), N_DECAY)
    got = pending.result()
    assert pending.done()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), want, got)

    def broken(*args):
        raise RuntimeError("kernel failed")
    monkeypatch.setattr(opt._host_adam, "_kernel", broken)
    with pytest.raises(RuntimeError, match="kernel failed"):
        opt.begin_update(Space.HOST, *fresh(), jnp.float32(1.0), N_DECAY).result()
    monkeypatch.undo()
    again = opt.begin_update(Space.HOST, *fresh(), jnp.float32(1.0), N_DECAY).result()
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(want[0]))


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
    """A chunk's update (with a clip scale) equals optax AdamW run on its decayed and undecayed
    tensors separately, with the scaled grads."""
    master, grads = steps3(6)
    chunked = run_steps(space, grads, master, scale=0.5)
    tx = optax.multi_transform({"decay": default_tx(CFG)(1.0), "none": default_tx(CFG)(0.0)},
                               {"w": "decay", "b": "none"})
    params = {"w": jnp.asarray(master[:N_DECAY]), "b": jnp.asarray(master[N_DECAY:])}
    state = tx.init(params)

    @jax.jit  # compiled like the chunk update, so both see the same float arithmetic
    def step(g, state, params):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for grad, (chunk_master, _, _) in zip(grads, chunked):
        g = grad * np.float32(0.5)
        params, state = step({"w": jnp.asarray(g[:N_DECAY]), "b": jnp.asarray(g[N_DECAY:])}, state, params)
        np.testing.assert_allclose(chunk_master[:N_DECAY], params["w"], **CLOSE)
        np.testing.assert_allclose(chunk_master[N_DECAY:], params["b"], **CLOSE)
    assert not np.allclose(chunked[-1][0], master)


@pytest.mark.parametrize("space", list(Space), ids=[s.name for s in Space])
def test_chunk_update_equals_torch_adamw(space):
    """The default optimizer against an implementation nobody here wrote: torch.optim.AdamW with
    the same schedule (LambdaLR of optax's warmup-cosine), decay on the decayed tensors only, and
    the grads pre-multiplied by the clip scale. fp32 both ways; the two order their float
    arithmetic differently, so they agree to a few ulps, step after step."""
    torch = pytest.importorskip("torch")
    master, grads = steps3(7)
    grads = grads + [inputs(s)[1] for s in (11, 12, 13)]  # six steps: through warmup into the decay
    scale = 0.5
    chunked = run_steps(space, grads, master, scale=scale)
    w = torch.nn.Parameter(torch.tensor(master[:N_DECAY]))
    b = torch.nn.Parameter(torch.tensor(master[N_DECAY:]))
    warmup, total = CFG.schedule_steps()
    schedule = optax.warmup_cosine_decay_schedule(0.0, CFG.lr, warmup, max(total, warmup + 1), CFG.lr * CFG.final_lr_fraction)
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": CFG.weight_decay}, {"params": [b], "weight_decay": 0.0}],
                            lr=CFG.lr, betas=(CFG.b1, CFG.b2), eps=CFG.eps)
    lr_at = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float(schedule(step)) / CFG.lr)
    for grad, (chunk_master, _, _) in zip(grads, chunked):
        g = grad * np.float32(scale)
        w.grad, b.grad = torch.tensor(g[:N_DECAY]), torch.tensor(g[N_DECAY:])
        opt.step()
        lr_at.step()
        np.testing.assert_allclose(chunk_master[:N_DECAY], w.detach().numpy(), rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(chunk_master[N_DECAY:], b.detach().numpy(), rtol=2e-6, atol=1e-6)
    assert not np.allclose(chunked[-1][0], master, atol=1e-2)
