"""Frozen tensors: chunks of params alone (2 bytes per parameter in bf16), no grad, master or
optimizer state; the chunked engine equals the plain one with the same frozen set, moves the
bytes its plan says and never writes a frozen chunk back."""

import dataclasses

import jax
import numpy as np
import pytest

from pstar_models.gpt import StagedGPT, preset
from pstar_jax.engine.chunks import ChunkLayout, build_layout
from pstar_jax.config import ConfigError, EngineConfig
from pstar_jax.model.freeze import frozen_names, trainable
from pstar_jax.plan.machine import H200
from pstar_jax.engine.memory import ChunkStore, Space
from pstar_jax.planner.build import build_engine
from frozen_engines import CHUNK, OPTIM, chunked, mesh, plain
from sft_batches import batches

EPS32 = float(np.finfo(np.float32).eps)
needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs conftest's 8 fake devices")


def model():
    return StagedGPT(preset("tiny"))


def base_frozen(m):
    """A LoRA-like split: embeddings and every block's matrices frozen; norms and biases train."""
    return frozen_names(list(m.param_shapes()), ["wte.*", "wpe", "blocks.*.kernel"])


class WriteBacks:
    """Spy on the store: the keys copied device -> host."""

    def __init__(self, monkeypatch):
        self.keys = []
        real = ChunkStore.get

        def get(store, key, space):
            if space is Space.HOST and space not in store.spaces(key):
                self.keys.append(key)
            return real(store, key, space)
        monkeypatch.setattr(ChunkStore, "get", get)


def test_layout_never_mixes_frozen_and_trainable_tensors():
    m = model()
    shapes = m.param_shapes()
    frozen = base_frozen(m)
    layout = build_layout(shapes, lambda n: True, CHUNK, trainable=trainable(frozen))
    assert any(layout.frozen) and not all(layout.frozen)
    for s in layout.slots:
        assert layout.is_frozen(s.chunk) == (s.name in frozen), s.name
    assert ChunkLayout.from_json(layout.to_json()) == layout
    plain_layout = build_layout(shapes, lambda n: True, CHUNK)  # no frozen tensor: today's layout
    assert plain_layout.frozen == () and "frozen_chunks" not in plain_layout.to_json()


@pytest.mark.parametrize("patterns,micro_batches", [(("wte.*", "wpe", "blocks.*.kernel"), 1),
                                                    (("wte.*", "blocks.0.*"), 2)])
def test_fp32_equals_plain_under_eviction_and_frozen_stay_bit_identical(monkeypatch, patterns, micro_batches):
    """Chunks move every step; losses and params equal plain's with the same frozen set; frozen
    tensors never change (either engine); measured bytes equal the plan's; nothing frozen is
    ever copied back to the host (the second set also writes trainable chunks back)."""
    m = model()
    frozen = frozen_names(list(m.param_shapes()), patterns)
    engine, reference = chunked(m, frozen, micro_batches=micro_batches), plain(m, frozen, micro_batches)
    before = {n: v.copy() for n, v in engine.params().items() if n in frozen}
    spy = WriteBacks(monkeypatch)
    la, lb = [], []
    for step in batches(4, micro_batches):
        r = engine.step(step)
        la.append(r.loss)
        lb.append(reference.step(step).loss)
        assert r.h2d_bytes == r.predicted_h2d_bytes and r.d2h_bytes == r.predicted_d2h_bytes
        assert r.h2d_bytes > 0, "the budget must make chunks move every step"
        assert r.device_chunk_peak_bytes <= engine.plan.peak_device_bytes
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    frozen_chunks = {c for c in range(engine.layout.n_chunks) if engine.layout.is_frozen(c)}
    assert bool(spy.keys) == (engine.plan.d2h_bytes > 0)
    assert not [k for k in spy.keys if k[0] != "act" and k[1] in frozen_chunks]  # stage inputs may go up
    pa, pb = engine.params(), reference.params()
    for name in pa:
        if name in frozen:
            np.testing.assert_array_equal(pa[name], before[name], err_msg=name)
            np.testing.assert_array_equal(pb[name], before[name], err_msg=name)
        else:
            atol = 64 * EPS32 * max(1.0, float(np.abs(pb[name]).max()))
            np.testing.assert_allclose(pa[name], pb[name], rtol=1e-5, atol=atol, err_msg=name)
    assert any(not np.array_equal(pa[n], m.init_tensor(n, 0)) for n in pa if n not in frozen), "nothing trained"


@needs_8
def test_zero_over_8_devices_equals_plain_with_frozen_tensors():
    m = model()
    frozen = base_frozen(m)
    engine, reference = chunked(m, frozen, W=8, batch=8), plain(m, frozen, W=8)
    for step in batches(3, batch=8):
        r = engine.step(step)
        np.testing.assert_allclose(r.loss, reference.step(step).loss, rtol=1e-5)
        assert r.h2d_bytes == r.predicted_h2d_bytes and r.d2h_bytes == r.predicted_d2h_bytes
        assert r.h2d_bytes > 0
    pa, pb = engine.params(), reference.params()
    for name in pa:
        atol = 64 * EPS32 * max(1.0, float(np.abs(pb[name]).max()))
        np.testing.assert_allclose(pa[name], pb[name], rtol=1e-5, atol=atol, err_msg=name)


def test_a_frozen_chunk_is_two_bytes_per_parameter_in_bf16():
    m = model()
    engine = chunked(m, base_frozen(m), budget=None, precision="bf16")
    engine.step(batches(1)[0])
    layout, store = engine.layout, engine.store
    for c in range(layout.n_chunks):
        if layout.is_frozen(c):
            assert [k for k in (("slot", c), ("master", c), ("opt", c)) if k in store] == []
            assert store.placement.per_device_bytes(store.peek(("param", c))) == 2 * layout.numel_of(c)
            # one home: homed on the device it has no host copy; on the host, its pinned copy stays
            assert store.spaces(("param", c)) == ((Space.DEVICE,) if engine.plan.home(c) == "device" else
                                                  (Space.HOST,) if ("param", c) not in dict(engine.plan.initial_device)
                                                  else (Space.HOST, Space.DEVICE))
        else:
            assert ("master", c) in store and ("opt", c) in store
    assert {engine.plan.home(c) for c in range(layout.n_chunks) if layout.is_frozen(c)} == {"device", "host"}
    host_homes = sum(engine.chunk_bytes(c) for c in range(layout.n_chunks) if engine.plan.home(c) == "host")
    host_state = sum(engine.plan.opt_state_bytes[c] for c in layout.trainable_chunks if not engine.plan.opt_on_device[c])
    assert store.bytes[Space.HOST] >= host_homes + host_state
    state = sum(engine.plan.opt_state_bytes[c] for c in layout.trainable_chunks)
    assert engine.model_data_bytes == sum(map(engine.chunk_bytes, range(layout.n_chunks))) + state


def test_freezing_all_but_one_tensor_moves_far_fewer_bytes():
    """Same model, same device budget: training one tensor moves a small part of what full
    training moves per step (the frozen base only comes down, never goes back up). Twelve
    blocks, so the frozen chunks too outnumber the room for them."""
    m = StagedGPT(dataclasses.replace(preset("tiny"), n_layer=12))
    full = chunked(m, frozenset())
    names = list(m.param_shapes())
    frozen = frozenset(n for n in names if n != "ln_f.scale")
    one = chunked(m, frozen, budget=full.device_budget_bytes)
    rf, ro = full.step(batches(1)[0]), one.step(batches(1)[0])
    assert ro.h2d_bytes == ro.predicted_h2d_bytes and ro.d2h_bytes == ro.predicted_d2h_bytes == 0
    full_bytes, one_bytes = rf.h2d_bytes + rf.d2h_bytes, ro.h2d_bytes + ro.d2h_bytes
    print(f"per step: full training {full_bytes} B ({rf.h2d_bytes} h2d, {rf.d2h_bytes} d2h), one tensor trained "
          f"{one_bytes} B ({ro.h2d_bytes} h2d, {ro.d2h_bytes} d2h)")
    assert 0 < one_bytes and one_bytes * 10 <= full_bytes


@pytest.mark.slow
def test_state_round_trip_keeps_every_tensor():
    """state() holds the trainable chunks alone (params, master, optimizer state; frozen chunks are
    the base, which checkpoints record instead); loading it into a new engine built from the same
    base gives the same tensors."""
    m = model()
    frozen = base_frozen(m)
    engine = chunked(m, frozen)
    for step in batches(2):
        engine.step(step)
    state = engine.state()
    layout = engine.layout
    for kind in ("param", "master", "opt"):
        assert set(state[kind]) == {str(c) for c in layout.trainable_chunks}, kind
    other = chunked(m, frozen)
    other.load_state(jax.tree.map(np.asarray, state), 2)
    for name, value in engine.params().items():
        np.testing.assert_array_equal(other.params()[name], value, err_msg=name)
    np.testing.assert_array_equal(other.step(batches(1, seed=5)[0]).loss, engine.step(batches(1, seed=5)[0]).loss)


def test_freeze_patterns_in_the_config(capsys):
    m = model()
    cfg = EngineConfig(chunk_numel=CHUNK, precision="fp32", freeze="wte.*,wpe,blocks.*.kernel")
    engine = build_engine(m, cfg, OPTIM, (4, 64), mesh=mesh(), machine=H200)
    assert {s.name for s in engine.layout.slots if engine.layout.is_frozen(s.chunk)} == base_frozen(m)
    reference = build_engine(m, dataclasses.replace(cfg, kind="plain"), OPTIM, (4, 64), mesh=mesh())
    assert reference.frozen == base_frozen(m)
    with pytest.raises(ConfigError, match="'blocks.*.nope' matches no tensor"):
        build_engine(m, dataclasses.replace(cfg, freeze="blocks.*.nope"), OPTIM, (4, 64), mesh=mesh(), machine=H200)
    with pytest.raises(ConfigError, match="nothing is left to train"):
        build_engine(m, dataclasses.replace(cfg, freeze="*"), OPTIM, (4, 64), mesh=mesh(), machine=H200)


def test_identical_blocks_share_one_compiled_backward():
    """Frozen matrices and trainable norms in every block: the blocks' backwards (vjp over the
    trainable tensors only) are still a few compiled functions, not one per block."""
    m = StagedGPT(dataclasses.replace(preset("tiny"), n_layer=6))
    engine = chunked(m, base_frozen(m), budget=None)
    engine.step(batches(1)[0])
    compiled = [key for key in engine.fns._cache if key[0] == "bwd"]
    assert 0 < len(compiled) < 6


TRAIN = ["--quiet", "--precision", "fp32", "--batch-size", "8", "--lr", "3e-3", "--chunk-size", "8192",
         "--freeze", "wte.*,blocks.*.kernel"]


@pytest.mark.slow
def test_frozen_run_stops_and_resumes_exactly(tmp_path):
    """pstar-train --freeze: six straight steps equal three, a checkpoint, and three resumed."""
    import json

    from pstar_jax.cli.train import main
    straight, split, d = tmp_path / "s.jsonl", tmp_path / "p.jsonl", tmp_path / "ck"
    assert main([*TRAIN, "--steps", "6", "--metrics-out", str(straight)]) == 0
    assert main([*TRAIN, "--steps", "6", "--stop-after", "3", "--checkpoint-dir", str(d),
                 "--metrics-out", str(split)]) == 0
    assert main([*TRAIN, "--steps", "6", "--resume", "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0

    def losses(path):
        return [json.loads(line)["loss"] for line in open(path)]
    assert losses(split) == losses(straight) and len(losses(straight)) == 6


def test_a_freeze_pattern_matching_nothing_is_one_line(capsys):
    from pstar_jax.cli.train import main
    assert main([*TRAIN[:-1], "wte.*,blocks.*.nope", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'blocks.*.nope' matches no tensor" in err[0], err


def _lora_engine(m, frozen, chunk_numel, clip_norm):
    """A tiny Llama LoRA engine whose chunks move every step (the budget of frozen_engines.chunked)."""
    from pstar_jax.engine.optim import default_tx
    from pstar_jax.planner.build import chunked_engine

    def build(budget):
        cfg = EngineConfig(chunk_numel=chunk_numel, device_memory=budget, precision="fp32")
        return chunked_engine(m, cfg, default_tx(OPTIM), mesh(), (4, 64), H200, clip_norm=clip_norm,
                              trainable=trainable(frozen))
    shape = build(None).plan_for((4, 64)).shape
    reads = max(sum(shape.chunk_bytes[c] for c in cs) for cs in shape.stage_chunks)
    return build(shape.busiest_non_model_bytes + 2 * reads + max(shape.chunk_bytes))


def test_sizes_per_kind_train_bit_identically_to_one_size():
    """Part 5(c): a tiny Llama LoRA run with each kind's own chunk size (auto) and one with one size
    forced on both (EngineConfig.chunk_numel) give bit-identical losses and weights over 5 steps,
    chunks moving in both. The clip does not bind (its scale is exactly 1), since the global norm
    sums per chunk and so regroups with the chunking in its last bits."""
    from pstar_models import build_model
    from pstar_models.lora import LoraSpec
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.model.lora import frozen_for_lora
    m = build_model("llama-tiny", lora=LoraSpec(rank=4, alpha=16.0))
    frozen = frozen_for_lora(m, LoraConfig(rank=4))
    largest = max(int(np.prod(s)) for s in m.param_shapes().values())
    per_kind, one_size = (_lora_engine(m, frozen, n, clip_norm=1e6) for n in (None, largest))
    assert len(per_kind.layout.chunk_numels) == 2 and len(set(per_kind.layout.numels)) > 1
    assert set(one_size.layout.numels) == {largest} and per_kind.layout.n_chunks > one_size.layout.n_chunks
    for step in batches(5, seed=3):
        a, b = per_kind.step(step), one_size.step(step)
        assert a.loss == b.loss and a.clip_scale == b.clip_scale == 1.0
        assert a.h2d_bytes > 0 and b.h2d_bytes > 0, "the budgets must make chunks move every step"
    for name, value in per_kind.params().items():
        np.testing.assert_array_equal(one_size.params()[name], value, err_msg=name)


def test_identical_blocks_share_compiles_under_sizes_per_kind():
    """Adapters' and base's chunks of their own sizes cut the blocks at other places, yet a deeper
    model's blocks still share a few compiled backwards, as many at 12 layers as at 6."""
    from pstar_models import build_model
    from pstar_models.lora import LoraSpec
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.model.lora import frozen_for_lora
    counts = []
    for n_layer in (6, 12):
        m = build_model("llama-tiny", n_layer=n_layer, lora=LoraSpec(rank=4, alpha=16.0))
        engine = _lora_engine(m, frozen_for_lora(m, LoraConfig(rank=4)), None, clip_norm=1.0)
        engine.step(batches(1)[0])
        counts.append(len([key for key in engine.fns._cache if key[0] == "bwd"]))
    assert 0 < counts[0] == counts[1] < 6, counts
