"""The disk tier in pstar-train's engine (issue 31, part 5(a)): frozen chunks homed on disk are
read straight from the base's safetensors files at each fetch, through the read-ahead ring, and
train bit-identically to the same run with every frozen chunk in device and host memory; the
bytes read equal the plan's at every step, the first step compiles nothing the trace did not,
and no file of the base is written."""

import dataclasses
import os
import subprocess
import threading

import jax
import numpy as np
import pytest

from pstar_jax.config import ConfigError, EngineConfig
from pstar_jax.engine.memory import ChunkStore, Space
from pstar_jax.engine.optim import default_tx
from pstar_jax.io.frozen_disk import SafetensorsChunks
from pstar_jax.model.freeze import trainable
from pstar_jax.model.lora import WithAdapters
from pstar_jax.plan.homes import DISK_SLOTS
from pstar_jax.plan.machine import H200
from pstar_jax.planner.build import chunked_engine
from pstar_models.gpt import StagedGPT, preset
from frozen_engines import OPTIM, hf_lora_llama, mesh
from sft_batches import batches

NVME = dataclasses.replace(H200, disk_read_bytes_per_s=6e9, disk_tensor_bytes_per_s=6e9)
SEQ = 64


def base(tmp_path):
    """A tiny Llama's HF directory (fp32), its LoRA model, the checkpoint's reader and the frozen set."""
    return hf_lora_llama(tmp_path, d_ff=160, seq=SEQ)


def engines(tmp_path, clip_norm=1e6):
    """The same LoRA run twice under a device budget that moves chunks every step: host memory
    for every frozen chunk, and host memory for almost none of them beside a disk."""
    src, m, hf, frozen = base(tmp_path)

    def build(budget, host, disk=None, source=None):
        cfg = EngineConfig(device_memory=budget, precision="fp32", disk_memory=disk)
        return chunked_engine(m, cfg, default_tx(OPTIM), mesh(), (4, SEQ), NVME, clip_norm=clip_norm,
                              host_bytes=host, init_params=WithAdapters(hf, m, 0), trainable=trainable(frozen),
                              frozen_source=source)
    shape = build(None, 10**9).plan_for((4, SEQ)).shape
    reads = max(sum(shape.chunk_bytes[c] for c in cs) for cs in shape.stage_chunks)
    budget = shape.busiest_non_model_bytes + 2 * reads + max(shape.chunk_bytes)
    host_tier = build(budget, 10**9)
    plan = host_tier.plan
    homes = [c for c, h in enumerate(plan.frozen_home) if h == "host"]
    held = plan.peak_host_bytes - sum(plan.chunk_bytes[c] for c in homes)
    opened = []

    def source(layout, chunks):
        opened.append(SafetensorsChunks(hf, layout, np.float32, chunks=chunks))
        return opened[-1]
    disk_tier = build(budget, held + DISK_SLOTS * max(plan.chunk_bytes), 10**9, source)
    return src, host_tier, disk_tier, opened


def files(directory):
    return {n: (os.stat(os.path.join(directory, n)).st_size, os.stat(os.path.join(directory, n)).st_mtime_ns)
            for n in sorted(os.listdir(directory))}


@pytest.mark.slow  # two tiny-Llama engines traced and trained: 8-20 s on 2 cores
def test_frozen_chunks_read_from_disk_train_bit_identically_to_the_host_tier(tmp_path, monkeypatch):
    src, host_tier, disk_tier, opened = engines(tmp_path)
    before = files(src)
    plan = disk_tier.plan
    on_disk = [c for c, h in enumerate(plan.frozen_home) if h == "disk"]
    assert on_disk and "disk" not in host_tier.plan.frozen_home and plan.disk_read_bytes > 0
    assert [m.fetch for m in plan.moments] == [m.fetch for m in host_tier.plan.moments]  # only the sources differ
    for c in on_disk:  # no copy anywhere but, while the plan keeps it there, the device's
        assert ("param", c) not in disk_tier.store or disk_tier.store.spaces(("param", c)) == (Space.DEVICE,)
    host_copies = []
    real_get = ChunkStore.get

    def get(store, key, space):  # spy: no host copy of a disk home is ever asked for
        if store is disk_tier.store and space is Space.HOST and key[0] == "param" and key[1] in on_disk:
            host_copies.append(key)
        return real_get(store, key, space)
    monkeypatch.setattr(ChunkStore, "get", get)
    compiled, background = [], []  # this thread's compiles; the host AdamW's worker threads'

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            thread = threading.current_thread()
            (compiled if thread is threading.main_thread() else background).append((thread.name, kw.get("fun_name")))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        def stage_fns():  # the compiled stage functions, by (kind, stage...) (helpers are named by a string)
            return {key for key in disk_tier.fns._cache if isinstance(key, tuple)}
        traced = stage_fns()  # those the trace compiled
        names = []  # per step: (the host tier's compiles, the disk tier's)
        for i, step in enumerate(batches(4, seed=5)):
            at, late = len(compiled), len(background)
            a = host_tier.step(step)
            mid = len(compiled)
            b = disk_tier.step(step)
            names.append(([n for _, n in compiled[at:mid]], [n for _, n in compiled[mid:]]))
            assert i < 2 or len(background) == late, background  # nothing compiled late either
            assert a.loss == b.loss and a.grad_norm == b.grad_norm and b.clip_scale == 1.0, i
            assert b.disk_read_bytes == b.predicted_disk_read_bytes == plan.disk_read_bytes, i
            assert b.h2d_bytes == b.predicted_h2d_bytes == a.h2d_bytes and b.d2h_bytes == a.d2h_bytes, i
        # Reading from disk compiles nothing: the disk tier's steps compile only helpers the host tier's
        # steps compile too, no stage function the trace did not make, and nothing after step 2. (The
        # host AdamW's scalars compile on its worker thread, whenever that runs: counted apart.)
        assert all(name.startswith("pstar-host") for name, _ in background), background
        host_names = [n for h, _ in names for n in h]
        disk_names = [n for _, d in names for n in d]
        assert set(disk_names) <= set(host_names) and len(disk_names) <= len(host_names), names
        assert names[2:] == [([], [])] * 2, names
        assert traced and stage_fns() == traced  # no stage function beyond the trace's
        held_out = batches(1, seed=9)[0]
        assert host_tier.evaluate(held_out) == disk_tier.evaluate(held_out)
        for name, value in host_tier.params().items():
            np.testing.assert_array_equal(disk_tier.params()[name], value, err_msg=name)
    finally:
        jax.monitoring.clear_event_listeners()
    assert host_copies == []
    assert disk_tier.store.bytes[Space.HOST] <= plan.peak_host_bytes
    disk_tier.close()
    assert not disk_tier.store.disk._thread.is_alive() and all(not r._fds for r in opened)
    assert files(src) == before  # nothing written to the base


def test_a_disk_plan_needs_a_base_to_read_and_a_rate():
    m = StagedGPT(preset("tiny"))
    cfg = EngineConfig(chunk_numel=8192, disk_memory=2**30, precision="fp32")
    with pytest.raises(ConfigError) as err:
        chunked_engine(m, cfg, default_tx(OPTIM), mesh(), (4, 64), H200, trainable=lambda name: True)
    assert "EngineConfig.disk_memory needs the disk's read rate: measure it with pstar-machine --disk" in str(err.value)
    assert "\n" not in str(err.value)
    chunked_engine(m, dataclasses.replace(cfg, disk_memory=None), default_tx(OPTIM), mesh(), (4, 64), H200)


def tight_budgets(tmp_path):
    """(device, host) budgets per device under which the LoRA run of ``base`` homes frozen chunks on
    disk, as ``engines`` finds them."""
    _, host_tier, disk_tier, _ = engines(tmp_path)
    disk_tier.close()
    host = disk_tier.replanner.host_bytes
    return disk_tier.cfg.device_budget_bytes, host, host_tier


@pytest.mark.slow  # two tiny-Llama engines traced and trained: 8-20 s on 2 cores
def test_a_base_file_changed_under_the_run_is_one_line(tmp_path):
    from pstar_jax.config import CheckpointError
    src, _, disk_tier, _ = engines(tmp_path)
    step = batches(1, seed=5)[0]
    disk_tier.step(step)
    path = os.path.join(src, "model.safetensors")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError) as err:
        disk_tier.step(step)
    assert "changed while the run was reading it" in str(err.value) and "\n" not in str(err.value)
    disk_tier.close()


@pytest.mark.slow  # two tiny-Llama engines traced and trained: 8-20 s on 2 cores
def test_a_disk_plan_without_a_base_to_read_is_one_line(tmp_path):
    src, m, hf, frozen = base(tmp_path)
    device, host, _ = tight_budgets(tmp_path / "again")
    cfg = EngineConfig(device_memory=device, precision="fp32", disk_memory=10**9)
    with pytest.raises(ConfigError) as err:  # a model's own initialisation: no files to read chunks from
        chunked_engine(m, cfg, default_tx(OPTIM), mesh(), (4, SEQ), NVME, host_bytes=host,
                       trainable=trainable(frozen))
    assert "frozen chunks on disk" in str(err.value) and "ModelConfig.init_from_hf" in str(err.value)
    assert "\n" not in str(err.value)


def run_config(tmp_path, src, device, host, disk=None, cache=None, tag=""):
    import pstar_jax as ps
    from pstar_jax.plan.machine import save_machine
    machine = tmp_path / "nvme.json"
    save_machine(dataclasses.replace(NVME, name="nvme"), machine)
    per_host = jax.local_device_count()  # host memory is the host's, shared by its local devices
    return ps.RunConfig(
        model=ps.ModelConfig(init_from_hf=src), train=ps.TrainConfig(steps=3, batch_size=4),
        engine=ps.EngineConfig(precision="fp32", device_memory=device, machine=str(machine), disk_memory=disk,
                               host_memory=(host if disk else 10**9) * per_host, frozen_cache=cache),
        distributed=ps.DistributedConfig(data_parallel=1), lora=ps.LoraConfig(rank=4, alpha=16.0),
        output=ps.OutputConfig(quiet=True, metrics_out=str(tmp_path / f"m{tag}.jsonl")),
        checkpoint=ps.CheckpointConfig(export_lora=str(tmp_path / f"lora{tag}")))


@pytest.mark.slow  # four tiny-Llama runs traced and trained: about 30 s on 2 cores
def test_pstar_train_reads_a_hugging_face_base_from_disk(tmp_path):
    """Run with --init-from-hf, LoRA and EngineConfig.disk_memory (the disk's rate in the machine
    file): the steps' losses equal the same run with host memory for the whole base, each step's
    metrics record the disk's bytes as planned, and the adapter exports; the same again through
    EngineConfig.frozen_cache, written by the first run that asks and reused by the next."""
    import json

    import pstar_jax as ps
    from pstar_jax.io.frozen_disk import CACHE_FILE, ChunkCache
    src, _, _, _ = base(tmp_path)
    device, host, _ = tight_budgets(tmp_path / "budgets")
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
    cache = tmp_path / "cache"
    losses, identity = {}, []
    for tag, disk, frozen_cache in (("host", None, None), ("disk", 10**9, None), ("cache", 10**9, str(cache)),
                                    ("again", 10**9, str(cache))):
        config = run_config(tmp_path, src, device, host, disk, frozen_cache, tag)
        before = files(src)
        with ps.Run(config, tokens=tokens, verbose=False) as run:
            assert ("disk" in run.engine.plan.frozen_home) == bool(disk)
            reader = run.engine.store.disk.source if disk else None
            assert isinstance(reader, ChunkCache) == bool(frozen_cache)
            if frozen_cache:  # written once, then found: the second run writes nothing
                assert reader.written == (tag == "cache")
                identity.append(os.stat(cache / CACHE_FILE).st_mtime_ns)
            records = list(run.fit())
            losses[tag] = [r["loss"] for r in records]
            run.export_lora(config.checkpoint.export_lora)
        assert files(src) == before
        metrics = [json.loads(line) for line in open(tmp_path / f"m{tag}.jsonl")]
        if disk:
            assert all(r["disk_read_bytes"] == r["predicted_disk_read_bytes"] > 0 for r in metrics), metrics
            assert not run.engine.store.disk._thread.is_alive()  # closed with the run
        else:
            assert all("disk_read_bytes" not in r for r in metrics)
    assert losses["host"] == losses["disk"] == losses["cache"] == losses["again"]
    assert identity[0] == identity[1]
    for tag in ("disk", "cache"):
        for name in os.listdir(tmp_path / "lorahost"):
            assert open(tmp_path / "lorahost" / name, "rb").read() == open(tmp_path / f"lora{tag}" / name, "rb").read()


def test_a_frozen_cache_is_refused_in_one_line_before_any_work(tmp_path):
    """A cache without a disk tier, without a base in files, in a file or inside a Flax export,
    or where nothing can be written: one line each, before a model is built."""
    import pstar_jax as ps
    from pstar_jax.run.preflight import check_inputs
    (tmp_path / "a_file").write_text("")
    (tmp_path / "flax").mkdir()
    with pytest.raises(ConfigError, match="give the disk's share with EngineConfig.disk_memory"):
        ps.EngineConfig(frozen_cache=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="must name a directory"):
        ps.EngineConfig(frozen_cache=" ", disk_memory=10**9)
    engine = ps.EngineConfig(frozen_cache=str(tmp_path / "c"), disk_memory=10**9)
    cases = [({}, engine, "is written from a base read from files"),
             ({"init_from_flax": str(tmp_path / "flax")},
              dataclasses.replace(engine, frozen_cache=str(tmp_path / "flax" / "cache")), "is inside ModelConfig"),
             ({"init_from_flax": str(tmp_path / "flax")},
              dataclasses.replace(engine, frozen_cache=str(tmp_path / "a_file")), "is a file, not a directory"),
             ({"init_from_flax": str(tmp_path / "flax")},
              dataclasses.replace(engine, frozen_cache=str(tmp_path / "a_file" / "c")), "is under the file")]
    for model, eng, words in cases:
        with pytest.raises(ConfigError) as err:
            check_inputs(ps.RunConfig(model=ps.ModelConfig(**model), engine=eng))
        assert words in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.slow  # two tiny-Llama engines traced and a run refused: about 10 s on 2 cores
def test_a_frozen_cache_on_a_full_or_read_only_file_system_is_one_line(tmp_path):
    """Too little room for the cache is refused before a byte of it is written, and before the
    engine allocates anything; a read-only file system before the model is built."""
    import pstar_jax as ps
    from test_faults import tmpfs
    src, _, _, _ = base(tmp_path)
    device, host, _ = tight_budgets(tmp_path / "budgets")
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
    with tmpfs(tmp_path / "small", "64k") as small:
        config = run_config(tmp_path, src, device, host, 10**9, str(small / "cache"))
        with pytest.raises(ConfigError) as err:
            ps.Run(config, tokens=tokens, verbose=False)
        assert "but its file system has" in str(err.value) and "\n" not in str(err.value)
        assert os.listdir(small / "cache") == []
        subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
        with pytest.raises(ConfigError) as err:
            ps.Run(config, tokens=tokens, verbose=False)
        assert "the file system is read-only" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow  # two tiny-Llama engines traced and trained: 8-20 s on 2 cores
def test_state_saved_and_restored_under_disk_homes(tmp_path):
    """The state of a run with disk homes (the trainable chunks only) restores into a fresh one,
    which goes on exactly as the run it came from."""
    _, _, first, _ = engines(tmp_path / "a")
    _, _, second, _ = engines(tmp_path / "b")
    steps = batches(4, seed=7)
    for step in steps[:2]:
        first.step(step)
    state = first.state()
    assert set(map(int, state["param"])) == set(first.trained_chunks)
    second.load_state(jax.tree.map(np.asarray, state), 2)
    for step in steps[2:]:
        assert first.step(step).loss == second.step(step).loss
    first.close()
    second.close()
