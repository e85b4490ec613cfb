"""What real files and a new user break in the Hugging Face import and export: sizes that
contradict the weights, NaN weights, unreadable files, unwritable or full export targets,
byte-identical repeat exports, and the tokenizer and chat template an export must carry."""

import contextlib
import dataclasses
import errno
import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pstar_models.gpt import StagedGPT
from pstar_models.llama import LlamaConfig, StagedLlama
from pstar_jax.config import ConfigError, ModelConfig, RunConfig
from pstar_jax.io.hf import HFCheckpointError, export_hf
from test_hf import TINY, hfmap, one_line, open_hf, read_all, tiny_params, write_family_checkpoint, write_hf

LLAMA = LlamaConfig(vocab_size=256, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=80, seq_len=32,
                    max_position_embeddings=32)
QWEN3 = dataclasses.replace(LLAMA, family="qwen3", qk_norm=True, head_dim=12, tie_embeddings=True)


def edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **changes}, f)


def load(directory):
    from pstar_jax.io.models import load_model
    return load_model(RunConfig(model=ModelConfig(init_from_hf=str(directory))))


# -- sizes against the safetensors headers -------------------------------------------------------


@pytest.mark.parametrize("family,field,wrong,right", [
    ("llama", "vocab_size", 10**12, 256),
    ("llama", "hidden_size", 96, 48),
    ("llama", "intermediate_size", 81, 80),
    ("llama", "num_hidden_layers", 3, 2),
    ("llama", "num_key_value_heads", 3, 2),
    ("qwen3", "head_dim", 16, 12),  # its q/k norms hold head_dim entries
    ("qwen3", "num_key_value_heads", 3, 2),
    ("gpt2", "vocab_size", 10**12, 256),
    ("gpt2", "n_embd", 64, 32),
    ("gpt2", "n_layer", 4, 2),
    ("gpt2", "n_positions", 128, 64),
])
def test_config_sizes_that_contradict_the_weights_are_one_line_naming_the_field(tmp_path, family, field, wrong,
                                                                                 right):
    """Before the model is built (vocab_size 1e12 used to end in a JAX OverflowError); the value the
    message suggests loads."""
    model = {"llama": StagedLlama(LLAMA), "qwen3": StagedLlama(QWEN3), "gpt2": StagedGPT(TINY)}[family]
    write_family_checkpoint(tmp_path / "src", model)
    edit_config(tmp_path / "src", **{field: wrong})
    with pytest.raises(ConfigError) as err:
        load(tmp_path / "src")
    assert f"config.json's {field}={wrong} disagrees with the weights" in one_line(err)
    assert f"set {field} to {right}" in str(err.value)
    edit_config(tmp_path / "src", **{field: right})
    assert load(tmp_path / "src").param_shapes() == model.param_shapes()


def test_heads_that_contradict_q_proj_are_named(tmp_path):
    write_family_checkpoint(tmp_path / "src", StagedLlama(LLAMA))
    edit_config(tmp_path / "src", num_attention_heads=4, head_dim=8)  # q_proj holds 6 heads of 8
    with pytest.raises(ConfigError) as err:
        load(tmp_path / "src")
    assert ("num_attention_heads=4 disagrees with the weights: model.layers.0.self_attn.q_proj.weight has 48 rows, "
            "not 4 heads of 8; set num_attention_heads to 6") in one_line(err)
    edit_config(tmp_path / "src", num_attention_heads=6)
    assert load(tmp_path / "src").param_shapes() == StagedLlama(LLAMA).param_shapes()


def test_a_qwen3_config_without_head_dim_means_128_as_in_transformers(tmp_path):
    write_family_checkpoint(tmp_path / "src", StagedLlama(QWEN3))
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load(tmp_path / "src")
    assert ("head_dim=128 disagrees with the weights: model.layers.0.self_attn.q_norm.weight has 12 entries; "
            "set head_dim to 12") in one_line(err)


def test_pstar_generate_with_a_huge_vocab_size_is_one_line(tmp_path, capsys):
    from pstar_jax.cli.generate import main
    write_family_checkpoint(tmp_path / "src", StagedLlama(LLAMA))
    edit_config(tmp_path / "src", vocab_size=10**12)
    assert main(["--hf", str(tmp_path / "src"), "--max-new-tokens", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vocab_size=1000000000000 disagrees" in err, err


# -- NaN weights, unreadable files ---------------------------------------------------------------


def poison(directory, value=np.nan):
    """One weight of the checkpoint set to ``value``; returns the tensor's name."""
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    name = sorted(tensors)[3]
    tensors[name].flat[5] = value
    save_file(tensors, path)
    return name


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_nan_or_inf_weight_is_refused_at_import_naming_the_tensor(tmp_path, value):
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    write_hf(tmp_path, model, dtype="fp32")
    name = poison(tmp_path, value)
    with open_hf(tmp_path, model) as ckpt, pytest.raises(HFCheckpointError) as err:
        for key in ckpt:
            ckpt[key]
    assert f"tensor {name} in model.safetensors" in one_line(err) and "1 NaN or infinite" in str(err.value)


def test_pstar_generate_from_a_nan_weight_is_one_line(tmp_path, capsys):
    from pstar_jax.cli.generate import finite, main
    write_family_checkpoint(tmp_path / "src", StagedLlama(LLAMA))
    name = poison(tmp_path / "src")
    os.remove(tmp_path / "src" / "tokenizer.json")  # a 256-token vocabulary: the byte-level path
    assert main(["--hf", str(tmp_path / "src"), "--max-new-tokens", "2", "--temperature", "0", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and name in captured.err, captured
    with pytest.raises(ConfigError, match="parameter w in ck holds NaN"):
        list(finite(iter([("v", np.ones(3)), ("w", np.array([1.0, np.nan]))]), "ck"))


def test_unreadable_files_are_called_unreadable_not_missing(tmp_path, monkeypatch):
    """As root, chmod 000 does not stop a read: open itself is made to refuse. safe_open calls any
    failure to open 'No such file or directory', which is what the user used to be told."""
    import builtins
    import pstar_jax.io.hf as hf
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    write_hf(tmp_path, model)
    real_open, real_safe_open, denied = builtins.open, hf.safe_open, set()

    def guarded_open(path, *args, **kwargs):
        if os.path.basename(str(path)) in denied:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    def safetensors_open(path, **kwargs):
        if os.path.basename(str(path)) in denied:
            raise FileNotFoundError(f"No such file or directory: {path!r}")
        return real_safe_open(path, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(hf, "safe_open", safetensors_open)
    for name in ("model.safetensors", "config.json"):
        denied.add(name)
        with pytest.raises(HFCheckpointError) as err:
            open_hf(tmp_path, model)
        path = os.path.join(tmp_path, name)
        assert f"{path} cannot be read (permission denied); make it readable (chmod a+r {path})" in one_line(err)
        assert "download" not in str(err.value)


# -- export targets that cannot be written -------------------------------------------------------


@contextlib.contextmanager
def tmpfs(directory, options):
    os.makedirs(directory)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield str(directory)
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_export_into_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    model = StagedGPT(TINY)  # about 140 kB in fp32
    params, tensor_map = tiny_params(model), hfmap["hf_tensors"](model)
    with tmpfs(tmp_path / "small", "size=64k") as small:
        with pytest.raises(ConfigError) as err:
            export_hf(os.path.join(small, "out"), params.items(), tensor_map, {}, dtype="fp32")
        assert f"{small}/out could not be written (the disk is full)" in one_line(err)
        assert os.listdir(small) == []


def test_export_write_error_is_one_line_when_the_disk_fills_mid_write(tmp_path, monkeypatch):
    """The same without a tmpfs: safetensors' write raising ENOSPC."""
    import pstar_jax.io.hf as hf
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))

    def full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "save_file", full)
    with pytest.raises(ConfigError) as err:
        export_hf(str(tmp_path / "out"), tiny_params(model).items(), hfmap["hf_tensors"](model), {}, what="--hf")
    assert f"--hf {tmp_path}/out could not be written (the disk is full)" in one_line(err)
    assert os.listdir(tmp_path) == []


def test_pstar_train_probes_export_hf_before_training(tmp_path, capsys):
    from pstar_jax.cli.train import main as train_main
    write_family_checkpoint(tmp_path / "src", StagedLlama(LLAMA))
    (tmp_path / "file").write_text("")
    base = ["--init-from-hf", str(tmp_path / "src"), "--steps", "1", "--batch-size", "8", "--quiet"]
    with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        for target, words in [(f"{ro}/out", "the file system is read-only"),
                              (f"{tmp_path}/file/out", f"is under the file {tmp_path}/file")]:
            assert train_main([*base, "--export-hf", target]) == 2
            captured = capsys.readouterr()
            assert captured.out == "" and captured.err.count("\n") == 1, captured  # no training started
            assert captured.err.startswith("pstar-train: error: --export-hf") and words in captured.err


def test_pstar_export_into_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    from pstar_jax.cli.export import main as export_main
    from pstar_jax.cli.train import main as train_main
    ck = str(tmp_path / "ck")
    assert train_main(["--quiet", "--batch-size", "8", "--steps", "1", "--checkpoint-dir", ck]) == 0
    with tmpfs(tmp_path / "small", "size=64k") as small:
        assert export_main(["--checkpoint-dir", ck, "--hf", f"{small}/out", "--export-dtype", "fp32"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pstar-export: error: --hf {small}/out could not be written (the disk is full)")
        assert err.count("\n") == 1 and os.listdir(small) == []


def test_repeated_exports_are_byte_identical(tmp_path):
    """safetensors keeps metadata in a Rust HashMap whose order changes between calls."""
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    params, tensor_map = tiny_params(model), hfmap["hf_tensors"](model)
    contents = []
    for i in range(6):
        out = tmp_path / f"out{i}"
        export_hf(str(out), params.items(), tensor_map, {"b": 1, "a": 2}, max_shard_bytes=20_000)
        contents.append({n: (out / n).read_bytes() for n in sorted(os.listdir(out))})
    assert len(contents[0]) > 2 and all(c == contents[0] for c in contents)
    assert read_all(tmp_path / "out0").keys() == {t[0] for t in tensor_map.values()}


# -- the tokenizer and chat template travel with the export --------------------------------------


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_tokenizer(directory, template_file):
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<unk>", "<s>", "</s>", "<user>", "<assistant>", "<system>", "hello", "there", "how", "are", "you"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 32}
    if template_file:  # where transformers >= 4.43 saves it
        with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
            f.write(TEMPLATE)
    else:
        config["chat_template"] = TEMPLATE
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7}, f)


@pytest.mark.hf_reference
@pytest.mark.parametrize("template_file", [False, True], ids=["in_tokenizer_config", "chat_template_jinja"])
def test_export_carries_the_tokenizer_and_chat_template(tmp_path, template_file):
    transformers = pytest.importorskip("transformers")
    model = StagedGPT(dataclasses.replace(TINY, n_layer=1))
    src = tmp_path / "src"
    write_hf(src, model)
    write_tokenizer(src, template_file)
    out = tmp_path / "out"
    export_hf(str(out), tiny_params(model).items(), hfmap["hf_tensors"](model), {}, tokenizer_from=str(src))
    for name in os.listdir(src):
        if name not in ("config.json", "model.safetensors"):
            assert (out / name).read_bytes() == (src / name).read_bytes(), name
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you"}]
    ids = [transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(chat, add_generation_prompt=True)
           for d in (src, out)]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    assert ids[0] == ids[1] == [1, 3, 6, 7, 2, 4, 8, 9, 10, 2, 4]
    (src / "additional_chat_templates").mkdir()  # transformers' named templates, one file each
    (src / "additional_chat_templates" / "tool_use.jinja").write_text(TEMPLATE)
    export_hf(str(out), tiny_params(model).items(), hfmap["hf_tensors"](model), {},  # replaces the earlier export
              tokenizer_from=str(src))
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == TEMPLATE


def test_a_run_from_a_5x_config_trains_its_rope_and_exports_in_its_layout(tmp_path):
    """transformers 5.x writes no rope_theta: the run must still use the checkpoint's theta and
    Llama 3.1 scaling, and its export must say so in rope_parameters with the source's token ids."""
    import pstar_jax as ps
    src, out = tmp_path / "src", str(tmp_path / "out")
    write_family_checkpoint(src, StagedLlama(LLAMA))
    with open(src / "config.json") as f:
        config = json.load(f)
    for key in ("rope_theta", "rope_scaling", "torch_dtype"):
        config.pop(key, None)
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config.update(rope_parameters=rope, bos_token_id=1, eos_token_id=[2, 3], dtype="float32",
                  transformers_version="5.24.0")
    (src / "config.json").write_text(json.dumps(config))
    run_config = ps.RunConfig(model=ps.ModelConfig(init_from_hf=str(src)), train=ps.TrainConfig(batch_size=8),
                              engine=ps.EngineConfig(precision="fp32"), output=ps.OutputConfig(quiet=True))
    with ps.Run(run_config) as run:
        assert run.model.config.rope_theta == 500000.0 and run.model.config.rope_scaling.factor == 8.0
        run.export_hf(out, "fp32")
    with open(os.path.join(out, "config.json")) as f:
        exported = json.load(f)
    assert exported == config


# -- hostile config.json values, before anything is built ------------------------------------------


def _family_configs():
    from test_gemma import GEMMA
    from test_hf_models import GPT2, LLAMA as HF_LLAMA, QWEN3 as HF_QWEN3
    from test_moe import MIXTRAL, QWEN3_MOE
    from test_qwen35 import TEXT as QWEN35
    return dict(gpt2=GPT2, llama=HF_LLAMA, qwen3=HF_QWEN3, gemma3_text=GEMMA, qwen3_moe=QWEN3_MOE, mixtral=MIXTRAL,
                qwen3_5_text=QWEN35)


HOSTILE = [("num_hidden_layers", 10**13), ("num_hidden_layers", 100_000), ("n_layer", 10**13), ("hidden_size", 10**13),
           ("head_dim", 10**13), ("head_dim", 2**31 - 1), ("vocab_size", 10**13), ("sliding_window", 10**13),
           ("num_experts", 10**9), ("num_local_experts", 10**9), ("linear_conv_kernel_dim", 10**13),
           ("full_attention_interval", 0), ("rope_parameters", 5), ("rope_parameters", "x"), ("layer_types", "x"),
           ("intermediate_size", [1, 2]), ("num_attention_heads", True)]


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma3_text", "qwen3_moe", "mixtral", "qwen3_5_text"])
def test_hostile_config_values_are_one_line_or_build_a_model_and_never_allocate_their_size(family):
    """A config.json from the internet with absurd sizes (a layer count of 10**13 once ran the
    process out of memory building per-layer tables; a 10**13-tap convolution looped for ever; a
    10**13 head_dim asked numpy for 36 TiB): each is refused in one line, a ValueError or
    TypeError naming the field, which pstar-train prints as its error, or builds a model (a key
    the family does not read)."""
    from pstar_models import build_from_hf
    config = _family_configs()[family]
    for key, value in HOSTILE:
        try:
            build_from_hf({**config, key: value}, seq_len=16)
        except (ValueError, TypeError, KeyError) as err:
            line = str(err)
            assert "\n" not in line and len(line) < 400, (key, value, line)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "gemma-tiny", "qwen3.5-tiny"])
def test_hostile_flax_export_configs_are_one_line(preset):
    """A Flax export's config.json (pstar-generate --flax) is a downloaded file too: our config's
    fields with absurd values (n_layer 2**31 - 1 ran out of memory; norm_eps 10**13 overflowed
    in a jit) are refused in one line or build a model."""
    from pstar_models import build_model, model_from_fields
    fields = json.loads(json.dumps(dataclasses.asdict(build_model(preset).config)))
    for key in fields:
        for value in (10**13, 2**31 - 1, -1, "x", [1, 2], None):
            try:
                model_from_fields({**fields, key: value})
            except (ValueError, TypeError, KeyError) as err:
                assert "\n" not in str(err) and len(str(err)) < 400, (key, value, str(err))
