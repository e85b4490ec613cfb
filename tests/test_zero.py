"""ZeRO: sharded chunks over 8 fake devices and over 2 processes equal single-device training."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from pstar_models.gpt import StagedGPT, preset
from pstar_jax.config import ConfigError, EngineConfig, OptimConfig
from pstar_jax.planner.build import chunked_engine
from pstar_jax.plan.machine import H200
from pstar_jax.engine.optim import default_tx
from pstar_jax.engine.zero import data_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=10, clip_norm=1.0)
needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs conftest's 8 fake devices")


def engine(W, adam="auto", budget=None, n_layer=2):
    mesh = Mesh(np.array(jax.devices()[:W]), ("data",))
    cfg = EngineConfig(8192, budget, "fp32", adam_placement=adam)
    return chunked_engine(StagedGPT(dataclasses.replace(preset("tiny"), n_layer=n_layer)), cfg, default_tx(OPTIM), mesh,
                          (8, 64), H200, clip_norm=OPTIM.clip_norm)


def train(e, steps=3):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        tok = rng.integers(0, 256, (8, 65))
        out.append(e.step([(tok[:, :-1], tok[:, 1:])]))
    return out


@pytest.mark.slow
@needs_8
@pytest.mark.parametrize("adam", ["host", "device"])
def test_zero_over_8_devices_equals_one_device(adam):
    """Same global batch: same losses and params; with host offload (chunks move) and without."""
    single, sharded = engine(1, adam, None if adam == "host" else 10**8), engine(8, adam, None if adam == "host" else 10**8)
    a, b = train(single), train(sharded)
    np.testing.assert_allclose([r.loss for r in a], [r.loss for r in b], rtol=1e-5)
    if adam == "host":
        assert min(r.h2d_bytes for r in b) > 0
    pa, pb = single.params(), sharded.params()
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], rtol=1e-5, atol=1e-6, err_msg=name)


@needs_8
def test_per_device_chunk_bytes_are_one_eighth():
    single, sharded = engine(1, "host"), engine(8, "host")
    assert sharded.chunk_bytes(0) * 8 == single.chunk_bytes(0)
    for key in single.store.keys("param") + single.store.keys("master") + single.store.keys("opt"):
        a = single.placement.per_device_bytes(single.store.peek(key))
        b = sharded.placement.per_device_bytes(sharded.store.peek(key))
        scalars = sum(x.nbytes for x in jax.tree.leaves(single.store.peek(key)) if x.ndim == 0)  # step counts
        assert (b - scalars) * 8 == a - scalars, key
    chunk = sharded.store.peek(("master", 0))
    assert len(chunk.addressable_shards) == 8 and chunk.addressable_shards[0].data.size == 8192 // 8
    assert [b * 8 for b in sharded.plan.chunk_bytes] == list(single.plan.chunk_bytes)


def test_mesh_errors():
    with pytest.raises(ConfigError, match="needs 64 devices"):
        data_mesh(64)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(i, port, extra, log):
    env = dict(os.environ, PSTAR_COORDINATOR=f"127.0.0.1:{port}", PSTAR_NUM_PROCESSES="2", PSTAR_PROCESS_ID=str(i),
               PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # each process makes its own 2 devices
    cmd = [sys.executable, "-m", "pstar_jax.cli.train", "--local-devices", "2", "--quiet", "--precision", "fp32",
           "--batch-size", "8", "--heartbeat-timeout", "5", *extra]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path):
    """2 processes x 2 devices through jax.distributed train like 1 process x 4 devices."""
    multi, single = tmp_path / "multi.jsonl", tmp_path / "single.jsonl"
    port = free_port()
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [spawn(i, port, ["--steps", "4", "--metrics-out", str(multi)], logs[i]) for i in range(2)]
    codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0], (tmp_path / "p0.log").read_text()[-2000:] + (tmp_path / "p1.log").read_text()[-2000:]
    ref = subprocess.run([sys.executable, "-m", "pstar_jax.cli.train", "--local-devices", "4", "--quiet", "--precision",
                          "fp32", "--batch-size", "8", "--steps", "4", "--metrics-out", str(single)],
                         cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                         capture_output=True, text=True, timeout=240)
    assert ref.returncode == 0, ref.stderr[-2000:]
    np.testing.assert_allclose(losses(multi), losses(single), rtol=1e-5)
    assert len(losses(multi)) == 4  # only process 0 wrote metrics


@pytest.mark.slow
def test_checkpoint_from_two_processes_resumes_in_one(tmp_path):
    """Saved by 2 processes x 2 devices (W=4), resumed by 1 process with 1 device: same losses."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    port = free_port()
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [spawn(i, port, ["--steps", "4", "--stop-after", "2", "--checkpoint-dir", str(ck),
                             "--metrics-out", str(metrics), "--export-flax", str(tmp_path / "export")], logs[i])
             for i in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0], (tmp_path / "p0.log").read_text()[-2000:]
    assert sorted(os.listdir(tmp_path / "export")) == ["config.json", "params"]  # written once, by all
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    base = [sys.executable, "-m", "pstar_jax.cli.train", "--quiet", "--precision", "fp32", "--batch-size", "8",
            "--steps", "4"]
    resumed = subprocess.run([*base, "--resume", "--checkpoint-dir", str(ck), "--metrics-out", str(metrics)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    straight = tmp_path / "s.jsonl"
    ref = subprocess.run([*base, "--metrics-out", str(straight)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert ref.returncode == 0, ref.stderr[-2000:]
    np.testing.assert_allclose(losses(metrics), losses(straight), rtol=1e-5)


@needs_8
def test_sft_zero_over_8_devices_equals_one_device_both_engines():
    """Packed rows with uneven trained tokens per device (one row each) and per micro-batch: the
    loss is divided once by the global count, so 8 devices equal 1 (losses, clipped AdamW params
    after 3 steps), in the chunked and the plain engine."""
    from pstar_jax.engine.plain import PlainEngine
    from sft_batches import sft_steps
    steps = sft_steps(3, micro_batches=2, batch=8)
    per_row = [b.loss_mask.sum(axis=1) for s in steps for b in s]
    assert all(len(set(c)) > 4 for c in per_row), "devices must hold uneven counts"
    cfg = EngineConfig(8192, None, "fp32", micro_batches=2, adam_placement="host")
    tx = default_tx(OPTIM)

    def chunked(W):
        mesh = Mesh(np.array(jax.devices()[:W]), ("data",))
        return chunked_engine(StagedGPT(preset("tiny")), cfg, tx, mesh, (8, 64), H200, clip_norm=0.05)

    def plain(W):
        mesh = Mesh(np.array(jax.devices()[:W]), ("data",))
        return PlainEngine(StagedGPT(preset("tiny")), "fp32", tx, 2, clip_norm=0.05, mesh=mesh)
    for make in (chunked, plain):
        single, sharded = make(1), make(8)
        a, b = [single.step(s) for s in steps], [sharded.step(s) for s in steps]
        np.testing.assert_allclose([r.loss for r in a], [r.loss for r in b], rtol=1e-5)
        assert [r.trained_tokens for r in a] == [r.trained_tokens for r in b]
        pa, pb = single.params(), sharded.params()
        for name in pa:
            np.testing.assert_allclose(pa[name], pb[name], rtol=1e-5, atol=1e-6, err_msg=f"{make.__name__} {name}")


@needs_8
def test_stage_inputs_sharded_over_8_devices_go_to_the_host_and_back_as_planned():
    """Stage inputs are sharded over the data axis like the batch: each device's item is 1/8 of
    one device's, and a budget that makes the plan offload them moves exactly the planned bytes,
    with the losses of the same 8 devices keeping everything on the device, bit for bit."""
    roomy = engine(8, "device", 10**8, n_layer=8)
    planned = roomy.plan_for((8, 64))
    shape, accesses = planned.shape, planned.accesses
    assert shape.input_bytes[1] == 8 * 64 * 32 * 4 // 8  # fp32 rows of d_model 32, an eighth per device
    least = max(a.non_model_bytes + sum(map(shape.item_size, a.needs)) for a in accesses)
    tight = engine(8, "auto", least + 2 * max(shape.chunk_bytes), n_layer=8)
    assert tight.plan.input_offload_bytes > 0
    for a, b in zip(train(tight), train(roomy)):
        assert a.loss == b.loss and (a.h2d_bytes, a.d2h_bytes) == (a.predicted_h2d_bytes, a.predicted_d2h_bytes)
