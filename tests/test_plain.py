"""The plain engine: scanned blocks equal the unrolled math, donation, remat and micro-batches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from pstar_models.gpt import StagedGPT, preset
from pstar_jax.config import ConfigError, OptimConfig
from pstar_jax.engine.optim import default_tx
from pstar_jax.engine.plain import PlainEngine, segments
from pstar_jax.model.staged import Stage, compose_loss

OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=10, weight_decay=0.1, clip_norm=1.0)


def model(**overrides):
    return StagedGPT(dataclasses.replace(preset("tiny"), **overrides))


def plain(m, precision="fp32", micro_batches=1, **kw):
    return PlainEngine(m, precision, default_tx(OPTIM), micro_batches, clip_norm=OPTIM.clip_norm, **kw)


def batches(n_steps, micro_batches=1, batch=4, seq=64, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        tok = [rng.integers(0, 256, (batch, seq + 1)) for _ in range(micro_batches)]
        out.append([(t[:, :-1], t[:, 1:]) for t in tok])
    return out


def assert_params_close(a, b, rtol, atol):
    pa, pb = a.params(), b.params()
    assert list(pa) == list(pb)
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], rtol=rtol, atol=atol, err_msg=name)


def test_segments_scan_the_identical_blocks_only():
    m = model(n_layer=3)
    stages = m.stages(jnp.float32)
    segs = segments(stages, m.param_shapes(), m.decays)
    assert [[s.name for s in seg.stages] for seg in segs] == [["embed"], ["block_0", "block_1", "block_2"], ["head"]]
    assert [seg.scanned for seg in segs] == [False, True, False]
    assert segs[1].names_at(0) == ("blocks.0.ln1.scale", "blocks.1.ln1.scale", "blocks.2.ln1.scale")
    assert not any(seg.scanned for seg in segments(stages, m.param_shapes(), m.decays, scan=False))
    one = model(n_layer=1)
    assert not any(seg.scanned for seg in segments(one.stages(jnp.float32), one.param_shapes(), one.decays))


def test_segments_keep_tied_and_unlike_stages_single():
    """A middle stage reading a tensor another stage reads, or with another apply, is not stacked."""
    def f(p, h):
        return h

    def g(p, h):
        return h
    shapes = {n: (2,) for n in ("e", "a", "b", "c", "d", "t")}
    chain = [Stage("first", ("e", "t"), f), Stage("s1", ("a",), f), Stage("s2", ("b",), f),
             Stage("s3", ("c",), g), Stage("s4", ("t",), g), Stage("s5", ("d",), g), Stage("last", (), f)]
    runs = [[s.name for s in seg.stages] for seg in segments(chain, shapes, lambda n: True)]
    assert runs == [["first"], ["s1", "s2"], ["s3"], ["s4"], ["s5"], ["last"]]


@pytest.mark.parametrize("tied", [True, False])
def test_scanned_equals_unrolled_math_fp32(tied):
    """The first loss equals compose_loss on the init params; then scanned and unrolled engines
    (with and without remat on the scan) give the same losses and params over several steps."""
    m = model(tie_embeddings=tied)
    steps = batches(3)
    (tokens, targets), = steps[0]
    reference_loss = compose_loss(m.stages(jnp.float32))(m.init_params(0), tokens, targets)
    unrolled = plain(m, scan_layers=False)
    scanned = {remat: plain(m, remat=remat) for remat in ("none", "full")}
    losses = {remat: [] for remat in scanned}
    reference = []
    for step in steps:
        reference.append(unrolled.step(step).loss)
        for remat, engine in scanned.items():
            losses[remat].append(engine.step(step).loss)
    np.testing.assert_allclose(reference[0], float(reference_loss), rtol=1e-6)
    for remat, got in losses.items():
        np.testing.assert_allclose(got, reference, rtol=1e-5, err_msg=remat)
        assert_params_close(scanned[remat], unrolled, rtol=1e-5, atol=1e-6)


def test_params_round_trips_the_stacked_layout():
    """Given params come back exactly, by name and in param_shapes() order."""
    m = model(n_layer=3, tie_embeddings=False)
    rng = np.random.default_rng(1)
    given = {n: rng.standard_normal(s).astype(np.float32) for n, s in m.param_shapes().items()}
    got = plain(m, init_params=given).params()
    assert list(got) == list(m.param_shapes())
    for name, value in given.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_params_and_state_are_donated():
    """After a step the previous params and optimizer state buffers are gone (updated in place)."""
    engine = plain(model())
    engine.step(batches(1)[0])
    old = jax.tree.leaves((engine._params, engine._opt_state))
    engine.step(batches(1)[0])
    assert old and all(x.is_deleted() for x in old)
    assert engine.memory_analysis(4, 64).alias_size_in_bytes == sum(x.nbytes for x in old)


def test_full_remat_needs_less_memory_and_micro_batches_do_not_add_up():
    """XLA's analysis: full remat needs less than none, and the micro-batch scan keeps one
    micro-batch's activations at a time, so 4 micro-batches need no more than 2."""
    m = model()
    temp = {remat: plain(m, "bf16", remat=remat).memory_analysis(4, 64).temp_size_in_bytes
            for remat in ("none", "full")}
    assert temp["full"] < temp["none"]
    two, four = (plain(m, "bf16", micro, remat="full").memory_analysis(4, 64).temp_size_in_bytes for micro in (2, 4))
    assert four <= two


def test_micro_batches_equal_one_big_batch_fp32():
    """Two micro-batches of 4 accumulate to the step of one batch of 8 (mean of equal-size means)."""
    m = model()
    steps2 = batches(3, micro_batches=2)
    steps1 = [[(np.concatenate([a[0] for a in s]), np.concatenate([a[1] for a in s]))] for s in steps2]
    accumulated, big = plain(m, micro_batches=2), plain(m)
    la = [accumulated.step(s).loss for s in steps2]
    lb = [big.step(s).loss for s in steps1]
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    assert_params_close(accumulated, big, rtol=1e-5, atol=1e-6)


def test_data_parallel_equals_one_device_fp32():
    """The batch sharded over two devices: the same numbers as one device."""
    m = model()
    two = plain(m, mesh=Mesh(np.array(jax.devices()[:2]), ("data",)))
    one = plain(m)
    for step in batches(2):
        np.testing.assert_allclose(two.step(step).loss, one.step(step).loss, rtol=1e-6)
    assert_params_close(two, one, rtol=1e-5, atol=1e-6)


def test_unknown_remat_is_a_config_error():
    with pytest.raises(ConfigError, match="--remat must be one of"):
        plain(model(), remat="some")
