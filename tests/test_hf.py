"""Hugging Face checkpoints in and out: lazy validated loading, exact round trips, streamed export,
bounded loader memory, one-line errors, and the pstar-export CLI.

The model-agnostic machinery is tested with the tiny GPT and a test-local map (HF_MODULE): HF names
are ours with a 'transformer.' prefix, kernels are stored [out, in] as torch Linear weights are,
and the position table has more rows than the model uses, as GPT-2's has."""

import dataclasses
import json
import os
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from pstar_models.gpt import GPTConfig, StagedGPT
from pstar_jax.config import ConfigError, EngineConfig, OptimConfig
from pstar_jax.planner.build import chunked_engine
from pstar_jax.io.hf import HFCheckpoint, HFCheckpointError, export_hf, read_hf_config
from pstar_jax.plan.machine import H200
from pstar_jax.engine.optim import default_tx

HF_MODULE = '''
import dataclasses
from pstar_models.gpt import GPTConfig, StagedGPT, build_model

def hf_tensors(model):
    return {n: ("transformer." + n, n.endswith("kernel"), n == "wpe") for n in model.param_shapes()}

def hf_config(model):
    return {"model_type": "pstar-test", **dataclasses.asdict(model.config)}

def build_from_hf(config, **overrides):
    fields = {k: v for k, v in config.items() if k in GPTConfig.__dataclass_fields__}
    return StagedGPT(GPTConfig(**{**fields, **{k: v for k, v in overrides.items() if v is not None}}))
'''
hfmap: dict = {}
exec(HF_MODULE, hfmap)
TINY = GPTConfig(vocab_size=256, d_model=32, n_layer=2, n_head=2, seq_len=64)
EXTRA_ROWS = 8  # the HF position table is longer than the model's
NP = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}


def write_hf(directory, model, dtype="bf16", n_files=1, seed=0, extra=None, drop=(), names=None):
    """A tiny HF checkpoint of ``model`` in ``dtype``: returns the fp32 values it holds per pstar
    name and the tensors as stored per HF name. ``extra``: more HF tensors; ``drop``: HF names left out;
    ``names``: HF name -> stored name."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    expected, stored = {}, {}
    for name, (hf, transpose, truncate) in hfmap["hf_tensors"](model).items():
        shape = model.param_shapes()[name]
        full = (shape[0] + EXTRA_ROWS, *shape[1:]) if truncate else shape
        value = rng.normal(0, 0.5, full).astype(NP[dtype])
        expected[name] = value[:shape[0]].astype(np.float32) if truncate else value.astype(np.float32)
        if hf not in drop:
            stored[(names or {}).get(hf, hf)] = np.ascontiguousarray(value.T if transpose else value)
    stored.update(extra or {})
    hf_names = list(stored)
    if n_files == 1:
        save_file(stored, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(n_files):
            filename = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
            part = hf_names[i::n_files]
            save_file({n: stored[n] for n in part}, os.path.join(directory, filename), metadata={"format": "pt"})
            weight_map.update((n, filename) for n in part)
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hfmap["hf_config"](model), f)
    return expected, stored


def read_all(directory):
    """Every tensor of an HF directory as stored, by name."""
    out = {}
    for filename in sorted(os.listdir(directory)):
        if filename.endswith(".safetensors"):
            with safe_open(os.path.join(directory, filename), framework="numpy") as f:
                out.update((n, f.get_tensor(n)) for n in f.keys())
    return out


def engine_from(model, source, chunk_numel=8192, precision="bf16"):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    cfg = EngineConfig(chunk_numel=chunk_numel, device_memory=None, precision=precision)
    return chunked_engine(model, cfg, default_tx(OptimConfig()), mesh, (2, model.config.seq_len), H200,
                         init_params=source)


def open_hf(directory, model):
    return HFCheckpoint(str(directory), hfmap["hf_tensors"](model), model.param_shapes())


# -- in and out -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,n_files", [("bf16", 3), ("fp32", 1)])
def test_hf_to_pstar_to_hf_is_byte_identical(tmp_path, dtype, n_files):
    """Loaded through the lazy source into a chunked engine, read back, exported in the same dtype:
    every tensor's bytes equal the source's (the position table's kept rows); buffers and the tied
    head are not written; shards respect the size limit and the index names them all."""
    model = StagedGPT(TINY)
    extra = {"transformer.blocks.0.attn.bias": np.ones((1, 1, 64, 64), np.float32),
             "lm_head.weight": np.zeros((256, 32), NP[dtype])}
    expected, stored = write_hf(tmp_path / "src", model, dtype, n_files, extra=extra)
    for name in ("tokenizer.json", "merges.txt", "README.md"):
        (tmp_path / "src" / name).write_text(name)
    source = open_hf(tmp_path / "src", model)
    assert source.truncated == {"wpe": (TINY.seq_len + EXTRA_ROWS, TINY.seq_len)}
    engine = engine_from(model, source)
    assert engine.layout.n_chunks > 1
    params = engine.params()
    assert list(params) == list(expected)
    for name in expected:
        np.testing.assert_array_equal(params[name], expected[name], err_msg=name)

    limit = 30_000
    files = export_hf(str(tmp_path / "out"), params.items(), hfmap["hf_tensors"](model), hfmap["hf_config"](model),
                      dtype=dtype, tokenizer_from=str(tmp_path / "src"), max_shard_bytes=limit)
    written = read_all(tmp_path / "out")
    assert set(written) == set(stored) - set(extra)
    for hf, value in written.items():
        source = stored[hf][:TINY.seq_len] if hf == "transformer.wpe" else stored[hf]
        assert value.dtype == source.dtype and value.shape == source.shape, hf
        assert value.tobytes() == source.tobytes(), hf
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and files == sorted([*shards, "config.json", "model.safetensors.index.json",
                                                "tokenizer.json", "merges.txt"])
    assert set(index["weight_map"]) == set(written)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in written.values())
    largest = max(v.nbytes for v in written.values())
    for shard in shards:
        with safe_open(str(tmp_path / "out" / shard), framework="numpy") as f:
            size = sum(f.get_tensor(n).nbytes for n in f.keys())
            assert size <= max(limit, largest) and f.metadata()["format"] == "pt"
    config = read_hf_config(str(tmp_path / "out"))
    assert config == {**hfmap["hf_config"](model), "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype]}
    assert (tmp_path / "out" / "merges.txt").read_text() == "merges.txt"
    # and back in: the export loads to the same values
    back = open_hf(tmp_path / "out", model)
    for name in expected:
        np.testing.assert_array_equal(back[name], expected[name], err_msg=name)


def test_fp16_source_and_export(tmp_path):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1, tie_embeddings=False))
    expected, stored = write_hf(tmp_path / "src", model, "fp16")
    source = open_hf(tmp_path / "src", model)
    assert len(source) == len(expected) and set(source) == set(expected)
    loaded = {name: source[name] for name in source}
    for name in expected:
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], expected[name], err_msg=name)
    export_hf(str(tmp_path / "out"), loaded.items(), hfmap["hf_tensors"](model), {}, dtype="fp16")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]  # one shard: no index
    written = read_all(tmp_path / "out")
    assert "transformer.head.kernel" in written  # untied: the head is written
    for hf, value in written.items():
        source_value = stored[hf][:TINY.seq_len] if hf == "transformer.wpe" else stored[hf]
        assert value.tobytes() == source_value.tobytes(), hf


def test_base_model_names_without_prefix_load(tmp_path):
    """Files saved from the base model ('h.0...' for 'transformer.h.0...') are read too."""
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    names = {"transformer." + n: n for n in model.param_shapes()}
    expected, _ = write_hf(tmp_path, model, names=names)
    source = open_hf(tmp_path, model)
    for name in expected:
        np.testing.assert_array_equal(source[name], expected[name])


def test_loader_peak_host_memory_is_one_tensor_not_the_model(tmp_path):
    """Opening a checkpoint allocates only its headers, and initialising an engine of 8 chunks from it
    raises host allocations (numpy and Python, traced) by a few tensors at most, not the model."""
    model = StagedGPT(GPTConfig(vocab_size=1024, d_model=128, n_layer=8, n_head=4, seq_len=64))
    write_hf(tmp_path, model, "bf16")
    model_fp32_bytes = 4 * model.n_params()
    largest_fp32_bytes = 4 * max(int(np.prod(s)) for s in model.param_shapes().values())

    class Traced:  # the peak from the first read on, less what was held before it
        def __init__(self, source):
            self.source, self.reads, self.base_bytes = source, 0, 0

        def __getitem__(self, name):
            if not self.reads:
                self.base_bytes = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
            self.reads += 1
            return self.source[name]

    tracemalloc.start()
    try:
        source = open_hf(tmp_path, model)
        opened_bytes = tracemalloc.get_traced_memory()[0]
        traced = Traced(source)
        engine = engine_from(model, traced, chunk_numel=262_144, precision="fp32")
        peak_bytes = tracemalloc.get_traced_memory()[1] - traced.base_bytes
    finally:
        tracemalloc.stop()
    assert engine.layout.n_chunks >= 8 and traced.reads == len(model.param_shapes())
    assert opened_bytes < largest_fp32_bytes / 4  # opening reads headers only
    print(f"opened {opened_bytes / 2**10:.0f} KiB; loader peak {peak_bytes / 2**20:.2f} MiB; largest tensor "
          f"{largest_fp32_bytes / 2**20:.2f} MiB fp32, model {model_fp32_bytes / 2**20:.2f} MiB fp32")
    assert peak_bytes < 2 * largest_fp32_bytes + 2**19 < model_fp32_bytes / 4


# -- one-line errors before anything is allocated ------------------------------------------------


def one_line(err):
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, ConfigError)
    return message


def test_missing_directory_config_and_weights(tmp_path):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    with pytest.raises(HFCheckpointError) as err:
        open_hf(tmp_path / "nope", model)
    assert "nope is not a directory" in one_line(err)
    with pytest.raises(HFCheckpointError) as err:
        open_hf(tmp_path, model)
    assert "no config.json" in one_line(err)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError) as err:
        read_hf_config(str(tmp_path))
    assert "not readable JSON" in one_line(err)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(HFCheckpointError) as err:
        open_hf(tmp_path, model)
    assert "neither model.safetensors nor model.safetensors.index.json" in one_line(err)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    with pytest.raises(HFCheckpointError) as err:
        open_hf(tmp_path, model)
    assert "model.safetensors is not a readable safetensors file" in one_line(err)


def test_index_naming_a_missing_file_or_a_tensor_not_in_its_file(tmp_path):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    write_hf(tmp_path, model, n_files=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    os.rename(tmp_path / "model-00002-of-00002.safetensors", tmp_path / "elsewhere")
    with pytest.raises(HFCheckpointError) as err:
        open_hf(tmp_path, model)
    assert "lists model-00002-of-00002.safetensors, which is not in" in one_line(err)
    os.rename(tmp_path / "elsewhere", tmp_path / "model-00002-of-00002.safetensors")
    index["weight_map"]["transformer.wpe"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["transformer.ghost"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError) as err:
        open_hf(tmp_path, model)
    assert "which does not hold it" in one_line(err)


@pytest.mark.parametrize("case,words", [
    ("missing", ["lacks tensor transformer.blocks.0.mlp.fc.kernel"]),
    ("shape", ["tensor transformer.blocks.0.mlp.fc.kernel in model.safetensors", "shape (128, 32)",
               "expects (32, 128)"]),
    ("dtype", ["tensor transformer.ln_f.scale in model.safetensors", "is F64"]),
    ("unexpected", ["model.safetensors", "holds transformer.blocks.7.mlp.fc.kernel", "no parameter"]),
    ("rows", ["tensor transformer.wpe", "has 56 rows, the model needs 64", "--seq-len"]),
])
def test_bad_tensors_are_one_line_naming_file_and_tensor(tmp_path, case, words):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    fc = "transformer.blocks.0.mlp.fc.kernel"
    extra, drop = {}, ()
    if case == "missing":
        drop = (fc,)
    elif case == "shape":  # stored as ours, not transposed as HF does
        extra = {fc: np.zeros((32, 128), np.float32)}
    elif case == "dtype":
        extra = {"transformer.ln_f.scale": np.ones((32,), np.float64)}
    elif case == "unexpected":
        extra = {"transformer.blocks.7.mlp.fc.kernel": np.zeros((128, 32), np.float32)}
    elif case == "rows":
        extra = {"transformer.wpe": np.zeros((56, 32), np.float32)}
    write_hf(tmp_path, model, extra=extra, drop=drop)
    with pytest.raises(HFCheckpointError) as err:
        open_hf(tmp_path, model)
    message = one_line(err)
    for w in words:
        assert w in message


def test_buffers_and_tied_head_are_ignored(tmp_path):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    extra = {"transformer.blocks.0.attn.bias": np.ones((4,), np.float32),
             "transformer.blocks.0.attn.masked_bias": np.ones((1,), np.float32),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones((8,), np.float32),
             "lm_head.weight": np.ones((256, 32), np.float32)}
    expected, _ = write_hf(tmp_path, model, extra=extra)
    assert set(open_hf(tmp_path, model)) == set(expected)


# -- export ---------------------------------------------------------------------------------------


def tiny_params(model, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 1, s).astype(np.float32) for n, s in model.param_shapes().items()}


def test_export_refuses_a_foreign_directory_and_replaces_an_earlier_export(tmp_path):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    params, tensor_map = tiny_params(model), hfmap["hf_tensors"](model)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError) as err:
        export_hf(str(tmp_path / "mine"), params.items(), tensor_map, {})
    assert "is not empty and is not an earlier pstar_jax Hugging Face export" in one_line(err)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    # a real HF checkpoint (not written by us) is refused too: it may be the user's download
    write_hf(tmp_path / "download", model)
    with pytest.raises(ConfigError):
        export_hf(str(tmp_path / "download"), params.items(), tensor_map, {})
    out = str(tmp_path / "out")
    export_hf(out, params.items(), tensor_map, {}, dtype="fp32", max_shard_bytes=10_000)
    assert any(n.startswith("model-0000") for n in os.listdir(out))
    export_hf(out, params.items(), tensor_map, {}, dtype="bf16")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # no stale shards, no index
    assert read_hf_config(out)["torch_dtype"] == "bfloat16"
    (tmp_path / "probe").write_text("")  # exported files get the permissions any new file gets
    (tmp_path / "probe_dir").mkdir()
    for name in os.listdir(out):
        assert os.stat(os.path.join(out, name)).st_mode == os.stat(tmp_path / "probe").st_mode, name
    assert os.stat(out).st_mode == os.stat(tmp_path / "probe_dir").st_mode
    os.remove(tmp_path / "probe"), os.rmdir(tmp_path / "probe_dir")
    assert sorted(os.listdir(tmp_path)) == ["download", "mine", "out"]  # nothing left beside


def test_export_crash_leaves_no_directory(tmp_path):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    params = tiny_params(model)

    def failing():
        for i, item in enumerate(params.items()):
            if i == 5:
                raise RuntimeError("the engine died")
            yield item

    with pytest.raises(RuntimeError):
        export_hf(str(tmp_path / "out"), failing(), hfmap["hf_tensors"](model), {}, max_shard_bytes=4096)
    assert os.listdir(tmp_path) == []


def test_export_input_errors(tmp_path):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    params, tensor_map = tiny_params(model), hfmap["hf_tensors"](model)
    cases = [
        (dict(named_tensors=[*params.items(), ("stray", np.zeros(2))]), "tensor stray has no Hugging Face name"),
        (dict(named_tensors=list(params.items())[1:]), "the export got no tensor wte.embedding"),
        (dict(named_tensors=[*params.items(), ("wpe", params["wpe"])]), "tensor wpe was given twice"),
        (dict(dtype="int8"), "export dtype 'int8' is not one of bf16, fp16, fp32"),
        (dict(tokenizer_from=str(tmp_path / "none")), "none is not a directory"),
        (dict(named_tensors=[(n, v * (1e6 if n == "wpe" else 1)) for n, v in params.items()], dtype="fp16"),
         "tensor wpe overflows fp16"),
    ]
    for kwargs, words in cases:
        kwargs = {"named_tensors": params.items(), "tensor_map": tensor_map, "config": {}, **kwargs}
        with pytest.raises(ConfigError) as err:
            export_hf(str(tmp_path / "out"), **kwargs)
        assert words in one_line(err)
        assert os.listdir(tmp_path) == []


# -- pstar-export -------------------------------------------------------------------------------------


def test_export_cli_writes_a_checkpoints_master_tensors(tmp_path, monkeypatch, capsys):
    from pstar_jax.io.checkpoint import Checkpointer
    from pstar_jax.engine.chunks import ChunkLayout, unpack
    from pstar_jax.cli.export import main as export_main
    from pstar_jax.cli.train import main as train_main

    (tmp_path / "hfmap_test.py").write_text(HF_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    ck = str(tmp_path / "ck")
    assert train_main(["--quiet", "--precision", "fp32", "--batch-size", "8", "--steps", "2", "--chunk-size", "8192",
                       "--model-module", "hfmap_test", "--checkpoint-dir", ck]) == 0
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    capsys.readouterr()
    out = str(tmp_path / "hf")
    assert export_main(["--checkpoint-dir", ck, "--hf", out, "--export-dtype", "fp32",
                        "--tokenizer-from", str(tok), "--model-module", "hfmap_test"]) == 0  # trusted: named
    assert "exported step 2" in capsys.readouterr().out
    ckpt = Checkpointer(ck)
    meta = ckpt.meta()
    layout = ChunkLayout.from_json(meta["layout"])
    state = ckpt._manager.restore(meta["step"])["state"]
    ckpt.close()
    master = unpack(layout, [np.asarray(state["master"][str(c)]) for c in range(layout.n_chunks)])
    model = StagedGPT(TINY)
    written = read_all(out)
    assert len(written) == len(master)
    for name, (hf, transpose, _) in hfmap["hf_tensors"](model).items():
        np.testing.assert_array_equal(written[hf], master[name].T if transpose else master[name], err_msg=name)
    assert read_hf_config(out)["model_type"] == "pstar-test" and os.path.isfile(os.path.join(out, "tokenizer.json"))

    for argv, words in [
        (["--checkpoint-dir", str(tmp_path / "none"), "--hf", out], "is not a directory"),
        (["--checkpoint-dir", ck, "--hf", str(tok)], "not an earlier pstar_jax Hugging Face export"),
        (["--checkpoint-dir", ck, "--hf", out, "--model-module", "no_such_module"], "cannot be imported"),
        (["--checkpoint-dir", ck, "--hf", out, "--export-dtype", "int4"], "invalid choice"),
    ]:
        assert export_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("pstar-export: error:") and err.count("\n") == 1 and words in err, err


# -- against transformers' own files (runs where models/hf.py and transformers are installed) ---------


@pytest.mark.slow
@pytest.mark.hf_reference
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_transformers_checkpoint_round_trips_through_an_engine(tmp_path, family):
    """A checkpoint that transformers' save_pretrained writes (bf16, sharded, GPT-2's head tied and
    its position table longer than our seq_len) loads through the models' map into a chunked engine
    and exports back byte-identical per tensor; from_pretrained loads the export completely."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    models_hf = pytest.importorskip("pstar_models.hf")
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_positions=80, n_embd=48, n_layer=2, n_head=3)
    elif family == "llama":  # GQA groups of 3, untied head
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                          num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    else:  # q/k norms, head_dim 12 (not 48 / 6), tied head
        config = transformers.Qwen3Config(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                          num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                                          tie_word_embeddings=True)
    torch.manual_seed(0)
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(
        src, max_shard_size="40KB", safe_serialization=True)
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json"))
    model = models_hf.build_from_hf(read_hf_config(src), seq_len=64)
    engine = engine_from(model, HFCheckpoint(src, models_hf.hf_tensors(model), model.param_shapes()), 16384)
    export_hf(out, engine.params().items(), models_hf.hf_tensors(model), models_hf.hf_config(model),
              tokenizer_from=src, max_shard_bytes=40_000)
    original, written = read_all(src), read_all(out)
    assert set(original) - set(written) <= {"lm_head.weight"}  # tied: not written
    for name, value in written.items():
        source = original[name][:64] if name == "transformer.wpe.weight" else original[name]
        assert value.dtype == source.dtype and value.tobytes() == source.tobytes(), name
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype="auto",
                                                                     output_loading_info=True)
    assert not any(info.values()), info
    for name, value in loaded.state_dict().items():
        if name in written:
            assert value.dtype == torch.bfloat16
            assert value.view(torch.int16).numpy().tobytes() == written[name].tobytes(), name


# -- pstar-train --init-from-hf / --export-hf with the real model families --------------------------------


def write_family_checkpoint(directory, model, dtype=np.float32):
    """A Hugging Face directory for ``model`` through models.hf's own maps: config.json, weights, a tokenizer."""
    from pstar_models import hf as mhf
    os.makedirs(directory)
    tensors = {}
    for name, (hf_name, transpose, _) in mhf.hf_tensors(model).items():
        value = np.asarray(model.init_tensor(name, 7), np.float32)
        tensors[hf_name] = np.ascontiguousarray(value.T if transpose else value).astype(dtype)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(mhf.hf_config(model, torch_dtype="float32"), f)
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write("{}")
    return tensors


def lora_run_exports(tmp_path, config, capsys, steps=2, extra=()):
    """pstar-train --lora-rank 4 (and ``extra`` flags) from a checkpoint of ``config`` (a config.json
    dict) written to tmp_path/src, exporting the adapter to tmp_path/adapter and the merged model to
    tmp_path/merged: (the source's tensors, the adapter's adapter_config.json)."""
    from pstar_jax.cli.train import main as train_main
    from pstar_models import build_from_hf
    source = write_family_checkpoint(str(tmp_path / "src"), build_from_hf(config, seq_len=16))
    # token 0 left out: Gemma's pad, whose lookup gradient transformers drops (see README, Gemma 3)
    np.random.default_rng(0).integers(1, config["vocab_size"], 4000).astype(np.uint16).tofile(tmp_path / "d.u16.bin")
    code = train_main(["--init-from-hf", str(tmp_path / "src"), "--data", str(tmp_path / "d.u16.bin"), "--steps",
                       str(steps), "--batch-size", "8", "--seq-len", "16", "--lora-rank", "4", "--lr", "1e-2",
                       "--quiet", "--export-lora", str(tmp_path / "adapter"), "--export-hf", str(tmp_path / "merged"),
                       "--export-dtype", "fp32", *extra])
    assert code == 0, capsys.readouterr().err
    return source, json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
def test_init_from_hf_then_export_hf_is_byte_identical(tmp_path, family):
    """HF -> pstar (Run with init_from_hf, chunks moving) -> HF with no training step: every tensor's
    bytes are equal, config.json describes the same model, the tokenizer files come along."""
    import pstar_jax as ps
    from pstar_models import hf as mhf
    from pstar_models.llama import LlamaConfig, StagedLlama
    if family == "gpt2":
        model = StagedGPT(dataclasses.replace(TINY, vocab_size=300))
    else:
        model = StagedLlama(LlamaConfig(vocab_size=300, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=80,
                                        seq_len=32, family=family, qkv_bias=family == "qwen2",
                                        qk_norm=family == "qwen3", head_dim=12 if family == "qwen3" else None,
                                        tie_embeddings=family != "llama", max_position_embeddings=32))
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    written = write_family_checkpoint(src, model)
    config = ps.RunConfig(model=ps.ModelConfig(init_from_hf=src), train=ps.TrainConfig(batch_size=8),
                          engine=ps.EngineConfig(precision="fp32"), output=ps.OutputConfig(quiet=True))
    with ps.Run(config) as run:
        assert run.model.param_shapes() == model.param_shapes()
        run.export_hf(out, "fp32")
    back = read_all(out)
    assert back.keys() == written.keys()
    for name, value in written.items():
        assert back[name].tobytes() == value.tobytes(), name
    assert mhf.build_from_hf(read_hf_config(out)).param_shapes() == model.param_shapes()
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))


def test_pstar_train_fine_tunes_an_hf_checkpoint_and_refuses_contradictions(tmp_path, capsys):
    from pstar_models.llama import LlamaConfig, StagedLlama
    from pstar_jax.cli.train import main as train_main
    model = StagedLlama(LlamaConfig(vocab_size=300, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=80,
                                    seq_len=32, max_position_embeddings=32))
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    write_family_checkpoint(src, model)
    base = ["--init-from-hf", src, "--steps", "3", "--batch-size", "8", "--quiet"]
    assert train_main([*base, "--export-hf", out]) == 0
    assert "exported to" in capsys.readouterr().out
    assert read_hf_config(out)["model_type"] == "llama" and os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert train_main([*base, "--d-model", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pstar-train: error:") and err.count("\n") == 1 and "d_model" in err, err
    assert train_main([*base, "--export-hf", src]) == 2  # a foreign, non-empty directory: refused before training
    assert "pstar-train: error:" in capsys.readouterr().err
