"""Checkpoints of runs over a frozen base (LoRA): the trained chunks alone plus a record of the base
(fingerprint); resume bit for bit, re-layout, one-line refusals onto another base; generation and
held-out loss with the adapter applied."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from pstar_models import build_model
from pstar_models.hf import hf_config, hf_tensors
from pstar_models.llama import LlamaConfig, StagedLlama
from pstar_models.lora import LoraSpec
from pstar_jax.io.base_record import base_record, checkpoint_tensors, fingerprint_files
from pstar_jax.io.checkpoint import Checkpointer
from pstar_jax.engine.chunks import ChunkLayout
from pstar_jax.config import ModelConfig, RunConfig, from_dict
from pstar_jax.model.lora import is_adapter
from pstar_jax.io.models import load_model
from pstar_jax.cli.train import main as train
from test_decode import greedy_full_forward

EPS32 = float(np.finfo(np.float32).eps)
SEQ = 32
STEPS, STOP = 4, 2  # the LoRA run: steps in all, and where it stops and resumes
LLAMA = LlamaConfig(vocab_size=256, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, seq_len=SEQ)
COMMON = ["--quiet", "--precision", "fp32", "--batch-size", "4", "--lr", "1e-2", "--data-parallel", "1",
          "--chunk-size", "8192"]


def write_base(path, seed=0, noise=0.0):
    """An HF directory of the tiny Llama (model.safetensors, config.json); ``noise`` perturbs every
    weight (a fine-tune of the same shapes). Returns the pstar-named fp32 params."""
    path.mkdir(parents=True, exist_ok=True)
    model = StagedLlama(LLAMA)
    rng = np.random.default_rng(seed)
    params = {n: 4 * np.asarray(v) + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
              for n, v in model.init_params(seed).items()}
    if noise:
        params = {n: v + noise * rng.standard_normal(v.shape).astype(np.float32) for n, v in params.items()}
    save_file({hf: np.ascontiguousarray(params[n].T if t else params[n])
               for n, (hf, t, _) in hf_tensors(model).items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(model, torch_dtype="float32")))
    return params


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    write_base(root / "base")
    write_base(root / "instruct", noise=1e-3)  # same shapes and headers, other values
    shutil.copytree(root / "base", root / "moved")
    return root


def lora_flags(base_dir, *extra):
    return [*COMMON, "--init-from-hf", str(base_dir), "--lora-rank", "4", *extra]


def records(path):
    return [json.loads(line) for line in open(path)]


def saved_state(directory):
    ckpt = Checkpointer(str(directory))
    try:
        step = ckpt.latest_step()
        meta = ckpt.meta(step)
        state = ckpt._manager.restore(step)["state"]
    finally:
        ckpt.close()
    return meta, {"/".join(str(getattr(p, "key", p)) for p in k): np.asarray(v)
                  for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_fingerprint_tells_same_shaped_bases_apart_and_ignores_where_they_live(bases):
    fp = {name: fingerprint_files(str(bases / name), ["model.safetensors"]) for name in ("base", "instruct", "moved")}
    assert fp["base"] == fp["moved"] and fp["base"] != fp["instruct"]
    config = RunConfig(model=ModelConfig(init_from_hf=str(bases / "base")))
    record = base_record(config, load_model(config))
    assert record == {"source": "hf", "path": str(bases / "base"), "fingerprint": fp["base"]}
    preset = RunConfig()
    again = base_record(preset, load_model(preset))
    assert again["source"] == "init" and again["seed"] == 0 and again["name"] == "tiny"


@pytest.fixture(scope="module")
def lora_run(bases, tmp_path_factory):
    """STEPS straight LoRA steps over the HF base, and STOP, a checkpoint, the rest resumed."""
    root = tmp_path_factory.mktemp("lora")
    flags = lora_flags(bases / "base", "--steps", str(STEPS))
    assert train([*flags, "--checkpoint-dir", str(root / "a"), "--metrics-out", str(root / "a.jsonl")]) == 0
    assert train([*flags, "--stop-after", str(STOP), "--checkpoint-dir", str(root / "b"),
                  "--metrics-out", str(root / "b.jsonl")]) == 0
    shutil.copytree(root / "b", root / "at_stop")
    assert train([*flags, "--resume", "--checkpoint-dir", str(root / "b"), "--metrics-out", str(root / "b.jsonl")]) == 0
    return root


def test_lora_resume_is_bit_for_bit_and_the_checkpoint_holds_no_base_tensor(lora_run, bases):
    la = [(r["loss"], r["grad_norm"]) for r in records(lora_run / "a.jsonl")]
    assert [(r["loss"], r["grad_norm"]) for r in records(lora_run / "b.jsonl")] == la and len(la) == STEPS
    (meta_a, arrays_a), (meta_b, arrays_b) = saved_state(lora_run / "a"), saved_state(lora_run / "b")
    assert arrays_a.keys() == arrays_b.keys()
    for name in arrays_a:
        np.testing.assert_array_equal(arrays_a[name], arrays_b[name], err_msg=name)
    layout = ChunkLayout.from_json(meta_a["layout"])
    trained = layout.trainable_chunks
    assert meta_a["saved_chunks"] == list(trained) and len(trained) < layout.n_chunks
    assert {s.name for s in layout.slots if s.chunk in trained} == {s.name for s in layout.slots if is_adapter(s.name)}
    assert {k.split("/")[1] for k in arrays_a} == {str(c) for c in trained}  # no frozen chunk saved
    numel = sum(map(layout.numel_of, trained))
    assert sum(v.size for k, v in arrays_a.items() if k.split("/")[0] in ("param", "master")) == 2 * numel
    assert meta_a["base"]["source"] == "hf" and len(meta_a["base"]["fingerprint"]) == 64
    # on disk: about the trained chunks' bytes (bf16 params, fp32 master, m, v), not the base's
    disk = sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(lora_run / "a" / str(STEPS)) for f in fs)
    print(f"step directory {disk} B on disk; trained chunks {14 * numel} B; base "
          f"{os.path.getsize(bases / 'base' / 'model.safetensors')} B")
    assert disk < 14 * numel + 256 * 1024, disk


def snapshot(directory):
    return {os.path.relpath(os.path.join(p, f), directory): (os.path.getsize(os.path.join(p, f)),
                                                            os.stat(os.path.join(p, f)).st_mtime_ns)
            for p, _, fs in os.walk(directory) for f in fs if f != ".pstar-run.lock"}


@pytest.mark.parametrize("change,words", [
    (["--init-from-hf", "instruct"], "but the weights in {bases}/instruct differ (fingerprint"),
    (["--lora-rank", "8"], "was trained with --lora-rank 4, this run has --lora-rank 8; resume with --lora-rank 4"),
    (["--lora-targets", "attn.q"], "was trained with no --lora-targets, this run has --lora-targets attn.q; resume "
                                   "without --lora-targets"),
    (["--lora-modules-to-save", "embed"], "resume without --lora-modules-to-save"),
    (["--init-from-hf", None], "was trained from --init-from-hf {bases}/base, which this run does not give; "
                               "resume with --init-from-hf {bases}/base"),
])
def test_resuming_onto_another_base_or_adapters_is_one_line_and_touches_nothing(lora_run, bases, tmp_path, capsys,
                                                                                change, words):
    """Even with --allow-config-change: the checkpoint's adapters belong to its base and shapes."""
    d = tmp_path / "ck"
    shutil.copytree(lora_run / "at_stop", d)
    before = snapshot(d)
    flags = lora_flags(bases / "base", "--steps", str(STEPS), "--resume", "--allow-config-change",
                       "--checkpoint-dir", str(d))
    flag, value = change
    at = flags.index(flag) if flag in flags else None
    if value is None:
        del flags[at:at + 2]
    elif at is not None:
        flags[at + 1] = str(bases / value) if flag == "--init-from-hf" else value
    else:
        flags += [flag, value]
    capsys.readouterr()
    assert train(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words.format(bases=bases) in err[0], err
    assert snapshot(d) == before


def test_a_moved_base_resumes_and_another_chunk_size_and_degree_relayout(lora_run, bases, tmp_path):
    """The same weights in another directory are the same base; the checkpoint at STOP resumed with
    16384-element chunks over two devices continues the straight run (to fp32 rounding: the
    reduction order differs)."""
    d = tmp_path / "ck"
    shutil.copytree(lora_run / "at_stop", d)
    metrics = tmp_path / "m.jsonl"
    flags = lora_flags(bases / "moved", "--steps", str(STEPS), "--resume", "--allow-config-change",
                       "--checkpoint-dir", str(d))
    at = flags.index("--chunk-size")
    flags[at + 1] = "16384"
    flags[flags.index("--data-parallel") + 1] = "2"
    assert train([*flags, "--device-memory", "1GiB", "--metrics-out", str(metrics)]) == 0
    want = [r["loss"] for r in records(lora_run / "a.jsonl")][STOP:]
    np.testing.assert_allclose([r["loss"] for r in records(metrics)], want, rtol=2e-5)


@pytest.mark.slow
def test_an_initialised_base_is_recorded_by_preset_and_seed(tmp_path, capsys):
    d = tmp_path / "ck"
    flags = [*COMMON, "--model", "tiny", "--lora-rank", "4", "--steps", "4", "--checkpoint-dir", str(d)]
    assert train([*flags, "--stop-after", "2"]) == 0
    meta, _ = saved_state(d)
    assert {k: meta["base"][k] for k in ("source", "name", "seed")} == {"source": "init", "name": "tiny", "seed": 0}
    before = snapshot(d)
    capsys.readouterr()
    assert train([*flags, "--resume", "--allow-config-change", "--seed", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained on the base --model tiny initialised with --seed 0, this run's base is " \
                             "--model tiny initialised with --seed 1" in err[0], err
    assert snapshot(d) == before
    assert train([*flags, "--resume"]) == 0


def test_plain_engine_lora_resume_is_bit_for_bit(bases, tmp_path):
    flags = lora_flags(bases / "base", "--engine", "plain", "--steps", "4")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert train([*flags, "--metrics-out", str(a)]) == 0
    d = tmp_path / "ck"
    assert train([*flags, "--stop-after", "2", "--checkpoint-dir", str(d), "--metrics-out", str(b)]) == 0
    assert train([*flags, "--resume", "--checkpoint-dir", str(d), "--metrics-out", str(b)]) == 0
    assert [r["loss"] for r in records(a)] == [r["loss"] for r in records(b)]
    meta, arrays = saved_state(d)  # the adapters alone, no base tensor
    adapters = sum(int(np.prod(s)) for n, s in meta["shapes"].items() if is_adapter(n))
    assert sum(v.size for k, v in arrays.items() if k.startswith("params/")) == adapters


# -- generation and the held-out loss with the adapter ------------------------------------------

def merged_params(model, params):
    """The base model's params with every adapter merged: W + scale * a @ b (float64, then fp32)."""
    scale = model.config.lora.scale
    out = {n: np.asarray(v, np.float64) for n, v in params.items() if not is_adapter(n)}
    for n in params:
        if n.endswith(".lora.lora_a"):
            proj = n[:-len(".lora.lora_a")]
            a, b = np.asarray(params[n], np.float64), np.asarray(params[proj + ".lora.lora_b"], np.float64)
            out[proj + ".kernel"] = out[proj + ".kernel"] + scale * a @ b
    return {n: jnp.asarray(v, jnp.float32) for n, v in out.items()}


@pytest.mark.slow
def test_generation_applies_the_adapter_cached_and_streamed(lora_run, capsys):
    from pstar_jax.cli.generate import main as generate
    ckpt = Checkpointer(str(lora_run / "a"))
    try:
        meta = ckpt.meta()
        config = from_dict(RunConfig, meta["config"])
        model = load_model(config)
        params = {n: jnp.asarray(v) for n, v in checkpoint_tensors(ckpt, meta, model, config)}
    finally:
        ckpt.close()
    assert params.keys() == model.param_shapes().keys()
    assert any(is_adapter(n) and n.endswith("lora_b") and np.abs(v).max() > 0 for n, v in params.items())
    base = StagedLlama(LLAMA)
    merged = merged_params(model, params)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, SEQ)), jnp.int32)
    with_adapter, want = np.asarray(model.module(params)(tokens)), np.asarray(base.module(merged)(tokens))
    np.testing.assert_allclose(with_adapter, want, rtol=0, atol=64 * EPS32 * np.abs(want).max())
    base_only = np.asarray(base.module({n: v for n, v in params.items() if not is_adapter(n)})(tokens))
    assert np.abs(base_only - want).max() > 1e3 * 64 * EPS32 * np.abs(want).max()

    prompt = "def f(x):"
    ids = np.frombuffer(prompt.encode(), np.uint8).astype(np.int32)[None]
    expected = [int(i) for i in greedy_full_forward(base, merged, ids, 8)[0]]
    expected = expected[:expected.index(0)] if 0 in expected else expected  # byte-level eos: NUL
    for extra in ((), ("--stream",)):
        capsys.readouterr()
        assert generate(["--checkpoint-dir", str(lora_run / "a"), "--prompt", prompt, "--max-new-tokens", "8",
                         "--temperature", "0", *extra]) == 0
        out, err = capsys.readouterr()
        assert out == prompt + bytes(expected).decode("utf-8", "replace") + "\n", extra
        assert ("streamed" if extra else "KV cache") in err


def test_generation_refuses_a_changed_base_in_one_line(lora_run, bases, tmp_path, capsys):
    from pstar_jax.cli.generate import main as generate
    d, base = tmp_path / "ck", tmp_path / "base"
    shutil.copytree(lora_run / "at_stop", d)
    shutil.copytree(bases / "base", base)
    ckpt = Checkpointer(str(d))
    meta = ckpt.meta()
    ckpt.close()
    # point the record at a copy of the base, then give that copy other values
    for step in os.listdir(d):
        path = d / step / "meta" / "metadata"
        if path.is_file():
            text = json.loads(path.read_text())
            text["base"]["path"] = str(base)
            path.write_text(json.dumps(text))
    write_base(base, noise=1e-3)
    capsys.readouterr()
    assert generate(["--checkpoint-dir", str(d), "--prompt", "x", "--max-new-tokens", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"but the weights in {base} differ" in err[0], err
    assert meta["step"] == STOP


@pytest.mark.slow
def test_held_out_loss_with_lora_equals_plain_and_the_base_at_step_zero():
    """The chunked engine's held-out loss of a LoRA model equals the plain engine's before and
    after training, and at step 0 the base model's (the untrained adapter adds nothing)."""
    from pstar_jax.config import EngineConfig, OptimConfig
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.model.lora import frozen_for_lora
    from pstar_jax.plan.machine import H200
    from pstar_jax.planner.build import build_engine
    from sft_batches import batches
    optim = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=10)
    m = build_model("tiny", lora=LoraSpec(rank=4, alpha=16.0))
    frozen = frozen_for_lora(m, LoraConfig(rank=4))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    cfg = EngineConfig(chunk_numel=8192, precision="fp32")
    chunked = build_engine(m, cfg, optim, (4, 64), mesh=mesh, machine=H200, frozen=frozen)
    plain = build_engine(m, EngineConfig(kind="plain", precision="fp32"), optim, (4, 64), mesh=mesh, frozen=frozen)
    held_out = [step[0] for step in batches(2, seed=9)]
    base = build_engine(build_model("tiny"), EngineConfig(kind="plain", precision="fp32"), optim, (4, 64), mesh=mesh)
    np.testing.assert_allclose(chunked.evaluate(held_out), base.evaluate(held_out), rtol=1e-6)
    for step in batches(3):
        chunked.step(step)
        plain.step(step)
    a, b = chunked.evaluate(held_out), plain.evaluate(held_out)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    assert abs(a - base.evaluate(held_out)) > 1e-4


def test_pstar_train_with_lora_reports_eval_loss(bases, tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert train([*lora_flags(bases / "base", "--steps", "4", "--eval-every", "2"), "--metrics-out", str(metrics)]) == 0
    rows = records(metrics)
    assert [r["step"] for r in rows if "eval_loss" in r] == [1, 3] and all(np.isfinite(r["eval_loss"])
                                                                            for r in rows if "eval_loss" in r)


def test_the_fingerprint_reads_a_few_kilobytes_of_a_large_file(tmp_path, monkeypatch):
    """A 4 GiB (sparse) safetensors-like file: the header and 1024 samples of 64 bytes are read."""
    import builtins

    import pstar_jax.io.base_record as base_record_module
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2**31], "data_offsets": [0, 2**32]}}).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 2**32)
    read = []

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
    monkeypatch.setattr(base_record_module, "open", lambda *a, **k: Counting(builtins.open(*a, **k)), raising=False)
    first = fingerprint_files(str(tmp_path), ["model.safetensors"])
    assert sum(read) <= 1024 * 64 + 4096, sum(read)  # the samples, the header and its probes
    with open(tmp_path / "model.safetensors", "r+b") as f:  # a change at a sampled place
        f.seek(8 + len(header) + 7 * (2**32 // 1024))
        f.write(b"\x01")
    assert fingerprint_files(str(tmp_path), ["model.safetensors"]) != first


def test_pstar_export_of_a_frozen_run_takes_the_base_from_its_record_and_merges_lora(lora_run, bases, tmp_path,
                                                                                     capsys):
    from pstar_jax.cli.export import main as export
    from pstar_jax.io.hf import HFCheckpoint
    from pstar_jax.model.lora import base_shapes
    from pstar_jax.io.peft_io import lora_scale, merge_adapter, model_family, read_adapter
    d = tmp_path / "ck"
    assert train([*COMMON, "--chunk-size", "16384", "--model", "llama-tiny", "--freeze", "blocks.*", "--steps", "1",
                  "--checkpoint-dir", str(d)]) == 0
    meta, _ = saved_state(d)
    assert meta["base"]["source"] == "init"
    capsys.readouterr()
    assert export(["--checkpoint-dir", str(d), "--hf", str(tmp_path / "out")]) == 0
    config = from_dict(RunConfig, meta["config"])
    model = load_model(config)
    exported = HFCheckpoint(str(tmp_path / "out"), hf_tensors(model), model.param_shapes())
    name = "blocks.0.attn.q.kernel"  # frozen: the preset's initial value, rounded to the export's bf16
    want = np.asarray(model.init_tensor(name, 0), np.float32)
    np.testing.assert_array_equal(exported[name], np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))
    exported.close()
    # A LoRA checkpoint: the adapter (peft's files) and the merged model, the base from its record.
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert export(["--checkpoint-dir", str(lora_run / "a"), "--hf", str(merged), "--lora", str(adapter),
                   "--export-dtype", "fp32"]) == 0
    meta, _ = saved_state(lora_run / "a")
    model = load_model(from_dict(RunConfig, meta["config"]))
    spec, adapters = read_adapter(str(adapter), model_family(model), model.param_shapes())
    shapes = base_shapes(model)  # the HF files hold the base's tensors, the adapters merged in
    base = HFCheckpoint(str(bases / "base"), hf_tensors(model), shapes)
    out = HFCheckpoint(str(merged), hf_tensors(model), shapes)
    name = "blocks.1.mlp.down.kernel"
    a, b = adapters[name.replace("kernel", "lora.lora_a")], adapters[name.replace("kernel", "lora.lora_b")]
    assert np.abs(b).max() > 0  # trained
    want = merge_adapter(np.asarray(base[name]), a, b, lora_scale(spec["alpha"], spec["rank"], spec["rslora"]))
    np.testing.assert_array_equal(np.asarray(out[name]), want)
    base.close(), out.close()
