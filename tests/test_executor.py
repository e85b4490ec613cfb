"""The chunked engine against the plain engine: same numbers, budgets kept, bytes moved."""

import dataclasses
import gc
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from pstar_models.gpt import StagedGPT, preset
from pstar_jax.data.batch import plain as plain_batch
from pstar_jax.config.errors import DataError
from pstar_jax.model.staged import compose_loss
from pstar_jax.config import ConfigError, EngineConfig, OptimConfig
from pstar_jax.engine.executor import ChunkedEngine
from pstar_jax.planner.build import chunked_engine
from pstar_jax.plan.machine import H200
from pstar_jax.engine.memory import Space
from pstar_jax.engine.optim import default_tx
from pstar_jax.engine.plain import PlainEngine
from sft_batches import batches, merge, sft_steps

OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=10, weight_decay=0.1, clip_norm=None)
CHUNK = 8192  # tiny GPT: 6 chunks, two per block


def mesh1():
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def model(**overrides):
    return StagedGPT(dataclasses.replace(preset("tiny"), **overrides))


def chunked(m, budget=None, precision="fp32", micro_batches=1, optim=OPTIM, adam="auto", batch=4):
    """budget None: half the model data beside the traced working memory, so chunks move."""
    cfg = EngineConfig(chunk_numel=CHUNK, device_memory=budget, precision=precision,
                       micro_batches=micro_batches, adam_placement=adam)
    return chunked_engine(m, cfg, default_tx(optim), mesh1(), (batch, 64), H200, clip_norm=optim.clip_norm)


def plain(m, precision="fp32", micro_batches=1, optim=OPTIM):
    return PlainEngine(m, precision, default_tx(optim), micro_batches, clip_norm=optim.clip_norm)


def run_both(a, b, steps):
    la, lb = [], []
    for step in steps:
        la.append(a.step(step).loss)
        lb.append(b.step(step).loss)
    return np.array(la), np.array(lb)


def noise_only(name, value):
    """The key bias of attention has an exactly zero gradient (softmax ignores a shift shared by
    all keys), so what training does to it is rounding noise that Adam's normalisation scales
    up: not a quantity two correct engines agree on. Split it off."""
    if not name.endswith("attn.qkv.bias"):
        return value, None
    d = value.shape[-1] // 3
    return np.concatenate([value[:d], value[2 * d:]]), value[d:2 * d]


def assert_params_close(engine, reference, rtol, atol, lr=3e-3, steps=5):
    pa, pb = engine.params(), reference.params()
    assert pa.keys() == pb.keys()
    for name in pa:
        (a, noise_a), (b, noise_b) = noise_only(name, pa[name]), noise_only(name, pb[name])
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
        if noise_a is not None:  # both stay where noise-driven Adam steps (at most lr each) can take them
            assert np.abs(noise_a).max() <= lr * steps and np.abs(noise_b).max() <= lr * steps


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_fp32_equals_plain_under_eviction(tied):
    """fp32: same per-step losses (rtol 1e-5) and final params as plain, with chunks moving."""
    m = model(tie_embeddings=tied)
    engine = chunked(m)
    reference = plain(m)
    steps = batches(5)
    moved = []
    la, lb = [], []
    for step in steps:
        r = engine.step(step)
        la.append(r.loss)
        lb.append(reference.step(step).loss)
        moved.append(r.h2d_bytes + r.d2h_bytes)
        assert r.h2d_bytes == r.predicted_h2d_bytes and r.d2h_bytes == r.predicted_d2h_bytes
        assert r.device_chunk_peak_bytes <= engine.plan.peak_device_bytes
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    assert min(moved) > 0, "a budget below the model size must move chunks"
    assert_params_close(engine, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bf16_close_to_plain():
    """bf16 compute with fp32 master: losses within 1e-3 relative, params within bf16 rounding."""
    m = model()
    engine, reference = chunked(m, precision="bf16"), plain(m, "bf16")
    la, lb = run_both(engine, reference, batches(5))
    np.testing.assert_allclose(la, lb, rtol=1e-3)
    assert_params_close(engine, reference, rtol=0, atol=2e-2)


def test_everything_resident_moves_nothing():
    """With room for all model data, no bytes cross after the first step and Adam runs on the device."""
    engine = chunked(model(), budget=10**8)
    assert all(s is Space.DEVICE for s in engine.opt_space)
    results = [engine.step(step) for step in batches(2)]
    assert results[-1].h2d_bytes == 0 and results[-1].d2h_bytes == 0


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch():
    """Two micro-batches of 4 equal one batch of 8 (mean of equal-size means), and plain with 2."""
    m = model()
    steps2 = batches(3, micro_batches=2)
    steps1 = [[(np.concatenate([a[0] for a in s]), np.concatenate([a[1] for a in s]))] for s in steps2]
    accumulated = chunked(m, micro_batches=2)
    big = plain(m)
    la, lb = run_both_separately(accumulated, steps2, big, steps1)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    assert_params_close(accumulated, big, rtol=1e-5, atol=1e-6)
    reference = plain(m, micro_batches=2)
    lc = [reference.step(s).loss for s in steps2]
    np.testing.assert_allclose(la, lc, rtol=1e-5)


def run_both_separately(a, steps_a, b, steps_b):
    return np.array([a.step(s).loss for s in steps_a]), np.array([b.step(s).loss for s in steps_b])


def test_clipping_matches_plain_and_bites():
    """Global-norm clipping: same as plain, and different from not clipping."""
    m = model()
    clipped = dataclasses.replace(OPTIM, clip_norm=0.05)
    engine, reference = chunked(m, optim=clipped), plain(m, optim=clipped)
    unclipped = chunked(m)
    steps = batches(3)
    norms = []
    for step in steps:
        r = engine.step(step)
        norms.append(r.grad_norm)
        reference.step(step)
        unclipped.step(step)
    assert min(norms) > 0.05, "the test must actually clip"
    assert_params_close(engine, reference, rtol=1e-5, atol=1e-6)
    diff = max(np.abs(engine.params()[n] - unclipped.params()[n]).max() for n in engine.params())
    assert diff > 1e-4


@pytest.mark.slow
def test_weight_decay_mask_matches_plain():
    """Strong decay: chunks (decay prefix per chunk) equal plain (decay by tensor group)."""
    m = model()
    decayed = dataclasses.replace(OPTIM, weight_decay=2.0)
    engine, reference = chunked(m, optim=decayed), plain(m, optim=decayed)
    run_both(engine, reference, batches(3))
    assert_params_close(engine, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_host_and_device_adam_agree():
    """The same training with optimizer state all on the host and all on the device: equal params."""
    m = model()
    host = chunked(m, adam="host")
    device = chunked(m, budget=10**8, adam="device")
    assert all(s is Space.HOST for s in host.opt_space)
    la, lb = run_both(host, device, batches(3))
    np.testing.assert_array_equal(la, lb)
    for name, value in host.params().items():
        np.testing.assert_array_equal(value, device.params()[name], err_msg=name)


@pytest.mark.slow
def test_host_updates_run_beside_the_next_step(monkeypatch):
    """A step ends with its host updates begun, not done: its grads went to the host during the
    backward, and the update of every host chunk runs on the optimizer's worker while the caller
    goes on; the next step waits for each one only where it needs that chunk's params. Held up
    here by a gate, the updates are still under way when step() returns; the numbers equal
    device Adam's, and the bytes the plan's."""
    from pstar_jax.engine import host_adam
    m = model()
    host, device = chunked(m, precision="bf16", adam="host"), chunked(m, precision="bf16", budget=10**8, adam="device")
    assert host.optimizer.fused_host
    gate, real_run = threading.Event(), host_adam.HostAdamW.run

    def gated(self, *args):
        assert gate.wait(timeout=120), "the gate was never opened"
        return real_run(self, *args)
    monkeypatch.setattr(host_adam.HostAdamW, "run", gated)
    steps = batches(3)
    for i, step in enumerate(steps):
        a, b = host.step(step), device.step(step)
        assert a.loss == b.loss and (a.h2d_bytes, a.d2h_bytes) == (a.predicted_h2d_bytes, a.predicted_d2h_bytes)
        assert sorted(host._begun) == list(range(host.layout.n_chunks))  # every update begun at the step's end
        if i == 0:
            assert not any(p.done() for p in host._begun.values()), "step() waited for a host update"
            assert all(("master", c) not in host.store for c in host._begun)  # the updates own their state
            gate.set()
    for name, value in host.params().items():  # reading flushes: waits for the updates under way
        np.testing.assert_array_equal(value, device.params()[name], err_msg=name)
    assert not host._begun


def test_mixed_adam_placement_runs_as_planned(monkeypatch):
    """One plan with state on the device for some chunks, streamed for others and updated on the
    host for the rest (the planner's mix, forced here): bytes moved equal the plan's every step,
    the numbers equal device Adam's."""
    from pstar_jax.planner import build as planning
    from pstar_jax.plan.placement import plan_step

    def mixed(shape, budget, host_bytes, machine, adam_placement, disk_bytes=0):
        n = shape.n_chunks
        return plan_step(shape, budget, host_bytes, machine, [c < 1 for c in range(n)],
                         streamed=[1 <= c < 3 for c in range(n)])
    monkeypatch.setattr(planning, "make_plan", mixed)
    m = model()
    engine = chunked(m, precision="bf16")
    monkeypatch.undo()
    device = chunked(m, precision="bf16", budget=10**8, adam="device")
    assert engine.plan.opt_on_device[:3] == (True, False, False) and engine.plan.opt_streamed[:4] == (False, True, True, False)
    for step in batches(3):
        a, b = engine.step(step), device.step(step)
        assert a.loss == b.loss and (a.h2d_bytes, a.d2h_bytes) == (a.predicted_h2d_bytes, a.predicted_d2h_bytes)
        assert sorted(engine._begun) == list(range(3, engine.layout.n_chunks))
    for name, value in engine.params().items():
        np.testing.assert_array_equal(value, device.params()[name], err_msg=name)


def test_streamed_adam_equals_device_adam_and_moves_as_planned():
    """State kept on the host but updated on the device: the same numbers as device-resident
    state, and the state's trips down and up are in the plan's bytes, step by step."""
    m = model()
    streamed = chunked(m, adam="stream")
    device = chunked(m, budget=10**8, adam="device")
    assert all(streamed.plan.opt_streamed) and not any(streamed.plan.opt_on_device)
    for step in batches(3):
        a, b = streamed.step(step), device.step(step)
        assert a.loss == b.loss
        assert (a.h2d_bytes, a.d2h_bytes) == (a.predicted_h2d_bytes, a.predicted_d2h_bytes)
        assert a.h2d_bytes >= sum(streamed.plan.opt_state_bytes)
    for name, value in streamed.params().items():
        np.testing.assert_array_equal(value, device.params()[name], err_msg=name)
    assert all(streamed.store.spaces(("master", c)) == (Space.HOST,) for c in range(streamed.layout.n_chunks))


def test_params_and_grads_never_both_alive_after_last_use():
    """Between steps each chunk has one bf16 slot (its pending grad), master and opt state, and no
    separate params (a host update under way holds its chunk's three); after a flush the slots
    hold the params, equal to the master cast down."""
    engine = chunked(model(), precision="bf16")
    engine.step(batches(1)[0])
    n = engine.layout.n_chunks
    for kind in ("slot", "master", "opt"):
        assert sorted([*(c for _, c in engine.store.keys(kind)), *engine._begun]) == list(range(n))
    assert engine.store.keys("param") == []
    engine.flush()
    assert engine.store.keys("param") == [] and len(engine.store.keys("slot")) == n
    master, params = engine.params("master"), engine.params("param")
    for name in master:
        np.testing.assert_array_equal(params[name], master[name].astype(params[name].dtype), err_msg=name)


def test_budget_too_small_is_a_config_error_before_allocating():
    """A budget that cannot hold one stage plus its working memory: ConfigError, nothing allocated."""
    gc.collect()  # earlier tests' arrays must not vanish during the count
    before = {id(x) for x in jax.live_arrays()}
    with pytest.raises(ConfigError, match="does not fit: device memory runs out at"):
        chunked(model(), budget=100_000)
    assert {id(x) for x in jax.live_arrays()} <= before


def test_moved_bytes_equal_the_plan_every_step_bf16_accumulating():
    """bf16, two micro-batches, host and device Adam mixed: measured traffic == predicted, each step."""
    engine = chunked(model(), precision="bf16", micro_batches=2)
    assert engine.plan.h2d_bytes > 0
    for step in batches(3, micro_batches=2):
        r = engine.step(step)
        assert (r.h2d_bytes, r.d2h_bytes) == (r.predicted_h2d_bytes, r.predicted_d2h_bytes)


def test_new_batch_shape_makes_a_new_plan():
    """A new shape: a new plan with the same Adam placement; after the switch, traffic as planned."""
    engine = chunked(model())
    engine.step(batches(1)[0])
    for step in batches(2, batch=2) + batches(1):
        engine.step(step)
    r = engine.step(batches(1, batch=2)[0])
    r = engine.step(batches(1, batch=2)[0])
    assert (r.h2d_bytes, r.d2h_bytes) == (r.predicted_h2d_bytes, r.predicted_d2h_bytes)
    assert set(engine._plans) == {(4, 64), (2, 64)}
    assert engine.plan_for((2, 64)).plan.opt_on_device == engine.plan.opt_on_device


def test_update_is_deferred_into_the_next_step_and_flush_applies_it():
    """A step leaves its update pending (the params read after it include it: reading flushes);
    flushing between steps changes nothing in the numbers, and the next step moves as planned."""
    m = model()
    flushed, straight, reference = chunked(m), chunked(m), plain(m)
    for step in batches(3):
        a, b, c = flushed.step(step), straight.step(step), reference.step(step)
        assert a.loss == b.loss
        np.testing.assert_allclose(a.loss, c.loss, rtol=1e-5)
        assert_params_close(flushed, reference, rtol=1e-5, atol=1e-6)  # params() flushes
        assert (a.h2d_bytes, a.d2h_bytes) == (a.predicted_h2d_bytes, a.predicted_d2h_bytes)
    for name, value in straight.params().items():
        np.testing.assert_array_equal(value, flushed.params()[name], err_msg=name)


@pytest.mark.slow
def test_nonfinite_step_is_skipped_without_changing_anything():
    """A batch whose loss is NaN (a NaN loss mask; out-of-range targets are refused before the
    step): with skip_nonfinite the step reports it and applies no update, so training goes on as
    if it had not happened; without, it raises."""
    m = model()
    skipping, reference = chunked(m), chunked(m)
    skipping.skip_nonfinite = True
    good = batches(2)
    tokens, targets = good[0][0]
    bad = [plain_batch(tokens, targets)._replace(loss_mask=np.full(targets.shape, np.nan, np.float32))]
    skipping.step(good[0])
    reference.step(good[0])
    r = skipping.step(bad)
    assert r.skipped and not np.isfinite(r.loss)
    assert (r.h2d_bytes, r.d2h_bytes) == (r.predicted_h2d_bytes, r.predicted_d2h_bytes)
    a, b = skipping.step(good[1]), reference.step(good[1])
    assert a.loss == b.loss and not a.skipped
    for name, value in skipping.params().items():
        np.testing.assert_array_equal(value, reference.params()[name], err_msg=name)
    raising = chunked(m)
    raising.step(good[0])
    with pytest.raises(FloatingPointError, match="not finite at step 1"):
        raising.step(bad)
    once = chunked(m)  # the state is the one before the bad step: the first step's update applied
    once.step(good[0])
    for name, value in raising.params().items():
        np.testing.assert_array_equal(value, once.params()[name], err_msg=name)


SFT_OPTIM = dataclasses.replace(OPTIM, clip_norm=0.05)  # clipping bites at every step


@pytest.mark.slow
def test_sft_loss_is_one_mean_over_the_step_whatever_the_micro_batches():
    """Uneven trained tokens: 4 micro-batches of 2 rows equal 1 of 8 (the loss sums divided once
    by the global count, not a mean of means), in both engines, clipping and AdamW included; the
    first loss is the mean over the trained tokens of the merged batch."""
    m = model()
    steps4 = sft_steps(3, micro_batches=4, batch=2)
    counts = [[b.loss_mask.sum() for b in s] for s in steps4]
    assert len({c for s in counts for c in s}) > 4, "micro-batches must hold uneven counts"
    steps1 = [merge(s) for s in steps4]
    accumulated, big = chunked(m, micro_batches=4, optim=SFT_OPTIM, batch=2), plain(m, optim=SFT_OPTIM)
    la, lb = run_both_separately(accumulated, steps4, big, steps1)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    assert_params_close(accumulated, big, rtol=1e-5, atol=1e-6, steps=3)
    plain4 = plain(m, micro_batches=4, optim=SFT_OPTIM)
    results = [plain4.step(s) for s in steps4]
    np.testing.assert_allclose([r.loss for r in results], la, rtol=1e-5)
    assert [r.trained_tokens for r in results] == [int(sum(c)) for c in counts]
    assert_params_close(plain4, big, rtol=1e-5, atol=1e-6, steps=3)
    first = compose_loss(m.stages(np.float32))(m.init_params(0), jax.tree.map(np.asarray, steps1[0][0]))
    np.testing.assert_allclose(la[0], float(first), rtol=1e-6)
    np.testing.assert_allclose(accumulated.evaluate(steps4[0]), big.evaluate(steps1[0]), rtol=1e-5)


def test_out_of_range_targets_are_refused_before_the_step():
    """-100 (HF's ignore label) or an id >= vocab: one-line DataError from step and evaluate of
    both engines, nothing run."""
    m = model()
    (tokens, targets), = batches(1)[0]
    engines = [chunked(m, budget=10**8), plain(m)]
    for engine in engines:
        for bad, message in ((np.full_like(targets, -100), "-100 .*pstar-tokens --chat"),
                             (targets + 256, "targets hold id [2-5][0-9][0-9], outside the model's vocabulary of 256 ids")):
            for call in (engine.step, engine.evaluate):
                with pytest.raises(DataError, match=message):
                    call([(tokens, bad)])
        assert engine.step_count == 0


def deep(n_layer=8):
    """Eight tiny blocks: at a batch of 8 their stage inputs outweigh a few chunks."""
    return model(n_layer=n_layer)


def record_input_bytes(engine, monkeypatch):
    """Per moment of each step: the stage-input bytes the store holds on the device once the
    moment has run (before the next moment's placement), as the plan's ``input_bytes`` counts them."""
    seen = []
    for name in ("_run", "_adam"):
        real = getattr(engine, name)

        def recorded(*args, real=real):
            real(*args)
            seen.append(engine.store.resident_bytes("act"))
        monkeypatch.setattr(engine, name, recorded)
    return seen


@pytest.mark.slow
def test_stage_inputs_offloaded_as_planned_train_exactly_as_kept_on_the_device(monkeypatch):
    """A budget below the working memory of a step that keeps every stage input on the device (the
    old engine's least): the plan sends stage inputs to pinned host memory after their forward and
    fetches them back for their backward, the store holds exactly the planned stage-input bytes at
    every moment, traffic equals the plan's, and losses and params equal those of an engine that
    keeps everything on the device, bit for bit."""
    m = deep()
    probe = chunked(m, batch=8)
    planned = probe.plan_for((8, 64))
    shape, accesses = planned.shape, planned.accesses
    least = max(a.non_model_bytes + sum(map(shape.item_size, a.needs)) for a in accesses)
    budget = least + 2 * max(shape.chunk_bytes)
    assert budget < shape.busiest_working_bytes, "keeping the stage inputs on the device cannot fit this budget"
    del probe
    engine, reference = chunked(m, budget=budget, batch=8), chunked(m, budget=10**8, batch=8)
    plan = engine.plan
    assert plan.fits and plan.input_offload_bytes > 0 and plan.input_bytes == shape.input_bytes_per_step
    assert reference.plan.input_offload_bytes == 0
    seen = record_input_bytes(engine, monkeypatch)
    for step in batches(3, batch=8):
        seen.clear()
        r, ref = engine.step(step), reference.step(step)
        assert r.loss == ref.loss
        assert (r.h2d_bytes, r.d2h_bytes) == (r.predicted_h2d_bytes, r.predicted_d2h_bytes)
        assert seen == [mo.input_bytes for mo in plan.moments]
        assert r.device_chunk_peak_bytes <= plan.peak_device_bytes - min(a.non_model_bytes for a in accesses)
        assert engine.store.resident_bytes("act") == engine.store.resident_bytes("act", Space.HOST) == 0
    for name, value in engine.params().items():
        np.testing.assert_array_equal(value, reference.params()[name], err_msg=name)


@pytest.mark.slow
def test_the_engine_carries_out_a_finished_plan_and_asks_planning_only_through_its_replanner():
    """Data flows config -> plan -> executor: importing the executor loads neither the planning
    module nor the trace (and predict.py does not load plan.py); an engine built from a plan made
    beforehand trains as planned, and a new batch shape or an evaluation is asked of its
    replanner, once each."""
    import subprocess
    import sys
    code = ("import sys; import pstar_jax.plan.predict; assert 'pstar_jax.plan.placement' not in sys.modules; "
            "import pstar_jax.engine.executor; loaded = [m for m in ('pstar_jax.planner.build', 'pstar_jax.planner.report', 'pstar_jax.planner.search', "
            "'pstar_jax.planner.trace') if m in sys.modules]; assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=__file__.rsplit("/tests/", 1)[0])

    from pstar_jax.planner.build import EnginePlanner, plan_model

    class Recording(EnginePlanner):
        asked: list = []

        def for_batch(self, batch_shape):
            self.asked.append(("batch", batch_shape))
            return super().for_batch(batch_shape)

        def for_evaluation(self, training, batch_shape, micro_batches):
            self.asked.append(("eval", batch_shape))
            return super().for_evaluation(training, batch_shape, micro_batches)
    m, tx = model(), default_tx(OPTIM)
    cfg = EngineConfig(chunk_numel=CHUNK, device_memory=None, precision="fp32")
    planned = plan_model(m, cfg, mesh1(), (4, 64), H200, 10**10, tx)
    engine = ChunkedEngine(m, cfg, planned, Recording(m, cfg, H200, 10**10, tx, planned), tx, clip_norm=None)
    assert engine.plan is planned.plan
    for i, step in enumerate(batches(2) + batches(2, batch=2)):
        r = engine.step(step)
        if i != 2:  # the first step of a new shape also moves the slots to where its plan starts
            assert (r.h2d_bytes, r.d2h_bytes) == (r.predicted_h2d_bytes, r.predicted_d2h_bytes)
    engine.evaluate(batches(1)[0])
    engine.evaluate(batches(1)[0])
    assert Recording.asked == [("batch", (2, 64)), ("eval", (4, 64))]


def test_copies_issued_moments_ahead_run_as_planned(monkeypatch):
    """A plan whose moments issue their copies up to three moments ahead (PlanMoment.lead, forced
    here: the planner goes deeper only when it predicts a gain): the store keeps every moment's
    budget over the moments the copies share the device with (it raises otherwise), traffic equals
    the plan's each step, and losses and params equal those of the plan one moment ahead, bit for bit."""
    from pstar_jax.planner import build as planning
    from pstar_jax.plan.placement import plan_step

    def at_depth(depth):
        def planned(shape, budget, host_bytes, machine, adam_placement, disk_bytes=0):
            return plan_step(shape, budget, host_bytes, machine, [False] * shape.n_chunks, prefetch_depth=depth)
        return planned
    m = deep()
    engines = []
    for depth in (3, 1):
        monkeypatch.setattr(planning, "make_plan", at_depth(depth))
        engines.append(chunked(m, precision="bf16", micro_batches=2))
        monkeypatch.undo()
    deeper, shallow = engines
    leads = [mo.issued_at for mo in deeper.plan.moments]
    assert max(leads) == deeper.plan.prefetch_depth == 3 and max(mo.issued_at for mo in shallow.plan.moments) == 1
    assert deeper.plan.h2d_bytes > 0
    for step in batches(3, micro_batches=2):
        a, b = deeper.step(step), shallow.step(step)
        assert a.loss == b.loss
        assert (a.h2d_bytes, a.d2h_bytes) == (a.predicted_h2d_bytes, a.predicted_d2h_bytes)
    for name, value in deeper.params().items():
        np.testing.assert_array_equal(value, shallow.params()[name], err_msg=name)
