"""pstar-generate: a pstar checkpoint, a Flax export and an HF directory, each against a reference
decoding without a cache; the streamed path; sampling; bad input."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pstar_models.hf import hf_config, hf_tensors
from pstar_models.llama import LlamaConfig, StagedLlama
from pstar_jax.io.checkpoint import Checkpointer, iter_master_tensors
from pstar_jax.config import RunConfig, from_dict
from pstar_jax.engine.decode import StreamedDecoder, cache_bytes, params_bytes, stream_peak_bytes
from pstar_jax.cli.generate import main
from pstar_jax.io.models import load_model
from test_decode import greedy_full_forward, spread_params

PROMPT = "def f(x):"
N_NEW = 12
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny byte-level GPT trained 3 steps: its checkpoint directory and its Flax export."""
    from pstar_jax.cli.train import main as train
    root = tmp_path_factory.mktemp("run")
    assert train(["--quiet", "--precision", "fp32", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--data-parallel", "1",
                  "--lr", "3e-2", "--checkpoint-dir", str(root / "ckpt"), "--export-flax", str(root / "flax")]) == 0
    return root / "ckpt", root / "flax"


def write_weights(path, model):
    """model.safetensors and config.json of ``model`` (spread-out fp32 params) into ``path``; the params."""
    params = {n: np.asarray(v) for n, v in spread_params(model).items()}
    save_file({hf: np.ascontiguousarray(params[n].T if t else params[n]) for n, (hf, t, _) in hf_tensors(model).items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(model, torch_dtype="float32")))
    return params


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Llama (GQA groups of 3) as an HF directory: safetensors, config.json and a BPE tokenizer."""
    path = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the model speaks", "def f(x): return x * 2"] * 8, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    model = StagedLlama(LlamaConfig(vocab_size=320, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=64,
                                    seq_len=64))
    return path, model, write_weights(path, model), tok


def generate(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def checkpoint_model(directory):
    ckpt = Checkpointer(str(directory))
    try:
        model = load_model(from_dict(RunConfig, ckpt.meta()["config"]))
        params = {n: jnp.asarray(v) for n, v in iter_master_tensors(ckpt)}
    finally:
        ckpt.close()
    return model, params


def until_eos(ids, eos):
    ids = [int(i) for i in ids]
    return ids[:ids.index(eos)] if eos in ids else ids


def test_checkpoint_greedy_is_the_full_forward(trained, capsys):
    model, params = checkpoint_model(trained[0])
    prompt = np.frombuffer(PROMPT.encode(), np.uint8).astype(np.int32)[None]
    want = until_eos(greedy_full_forward(model, params, prompt, N_NEW)[0], 0)  # byte-level eos: NUL
    code, out, err = generate(capsys, "--checkpoint-dir", trained[0], "--prompt", PROMPT, "--max-new-tokens", N_NEW,
                              "--temperature", 0)
    assert code == 0
    assert out == PROMPT + bytes(want).decode("utf-8", "replace") + "\n"
    last = err.strip().splitlines()[-1]
    assert last.startswith("pstar-generate: ") and "tokens/s" in last and "KV cache on the device" in last


def test_streamed_path_gives_the_same_text(trained, capsys):
    base = ["--checkpoint-dir", trained[0], "--prompt", PROMPT, "--max-new-tokens", N_NEW, "--temperature", 0.8,
            "--top-p", 0.9, "--seed", 5]
    _, cached, _ = generate(capsys, *base)
    code, streamed, err = generate(capsys, *base, "--stream")
    assert code == 0 and streamed == cached and "streamed stage by stage" in err
    # a device budget under the parameters but over what one streamed stage pair needs
    model, _ = checkpoint_model(trained[0])
    layer = cache_bytes(model, 1, len(PROMPT) + N_NEW, jnp.float32) // model.n_layer
    peak = stream_peak_bytes(StreamedDecoder(model, jnp.float32).stage_bytes(), layer)
    total = params_bytes(model, jnp.float32)
    assert peak < total
    code, small, err = generate(capsys, *base, "--device-memory", (peak + total) // 2)
    assert code == 0 and small == cached
    assert "exceeds the device budget" in err and "tokens/s (streamed stage by stage" in err


def test_flax_export_gives_the_checkpoint_text(trained, capsys):
    args = ["--prompt", PROMPT, "--max-new-tokens", N_NEW, "--temperature", 0, "--precision", "fp32"]
    _, from_ckpt, _ = generate(capsys, "--checkpoint-dir", trained[0], *args)
    code, from_flax, _ = generate(capsys, "--flax", trained[1], *args)
    assert code == 0 and from_flax == from_ckpt


def test_seeded_sampling_is_reproducible(trained, capsys):
    args = ["--checkpoint-dir", trained[0], "--prompt", PROMPT, "--max-new-tokens", 20, "--temperature", 1.0]
    outs = [generate(capsys, *args, "--seed", seed)[1] for seed in (1, 1, 2)]
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_bf16_default_of_an_hf_directory_runs_both_paths(hf_dir, capsys):
    for extra in ((), ("--stream",)):
        code, out, err = generate(capsys, "--hf", hf_dir[0], "--prompt", "hello", "--max-new-tokens", 4, *extra)
        assert code == 0 and out.startswith("hello") and "tokens/s" in err


def test_run_from_hf_finds_the_tokenizer_of_its_source(hf_dir, tmp_path, capsys):
    """A checkpoint of a run started with --init-from-hf decodes with that directory's tokenizer."""
    from pstar_jax.cli.train import main as train
    assert train(["--quiet", "--precision", "fp32", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                  "--data-parallel", "1", "--init-from-hf", str(hf_dir[0]), "--checkpoint-dir",
                  str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    code, out, _ = generate(capsys, "--checkpoint-dir", tmp_path / "ckpt", "--prompt", "hello world",
                            "--max-new-tokens", 4, "--temperature", 0)
    assert code == 0 and out.startswith("hello world")


def test_hf_directory_with_its_tokenizer(hf_dir, capsys):
    path, model, params, tok = hf_dir
    prompt_ids = tok.encode("hello world", add_special_tokens=True).ids
    assert tok.decode(prompt_ids) == "hello world"
    eos = tok.token_to_id(EOS)
    want = until_eos(greedy_full_forward(model, {n: jnp.asarray(v) for n, v in params.items()},
                                         np.asarray([prompt_ids], np.int32), N_NEW)[0], eos)
    args = ["--hf", path, "--prompt", "hello world", "--max-new-tokens", N_NEW, "--temperature", 0,
            "--precision", "fp32"]
    code, out, _ = generate(capsys, *args)
    assert code == 0 and out == tok.decode(prompt_ids + want) + "\n"
    assert generate(capsys, *args, "--stream")[1] == out


def test_bad_input_is_one_line_and_exit_2(trained, hf_dir, tmp_path, capsys):
    ckpt, flax = map(str, trained)
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_dir[0] / name, no_tokenizer / name)
    own = tmp_path / "own"  # a directory of the user's own folders, none a checkpoint step
    for name in ("1", "2", "7"):
        (own / name).mkdir(parents=True)
    cases = {
        (): "one of the arguments",
        ("--checkpoint-dir", ckpt, "--flax", flax): "not allowed with",
        ("--checkpoint-dir", str(tmp_path / "missing")): "is not a directory",
        ("--flax", str(tmp_path)): "does not describe a GPT, Llama-family or Qwen3.5 model",
        ("--checkpoint-dir", ckpt, "--temperature", "-1"): "--temperature must be",
        ("--checkpoint-dir", ckpt, "--top-p", "0"): "--top-p must be in (0, 1]",
        ("--checkpoint-dir", ckpt, "--top-p", "1.5"): "--top-p must be in (0, 1]",
        ("--checkpoint-dir", ckpt, "--max-new-tokens", "0"): "--max-new-tokens must be at least 1",
        ("--checkpoint-dir", ckpt, "--seed", "-1"): "--seed must be",
        ("--checkpoint-dir", ckpt, "--max-new-tokens", "30", "--prompt", "abc"): "exceed the model's 32 positions",
        ("--checkpoint-dir", ckpt, "--device-memory", "lots"): "--device-memory",
        ("--checkpoint-dir", ckpt, "--device-memory", "1KiB", "--max-new-tokens", "8"): "raise --device-memory",
        ("--checkpoint-dir", ckpt, "--tokenizer", str(tmp_path / "nope.json")): "does not exist",
        ("--hf", str(no_tokenizer)): "vocabulary of 320 tokens and no tokenizer",
        ("--hf", str(tmp_path / "missing")): "is not a directory",
        ("--checkpoint-dir", str(own)): f"{own}/7 is not a pstar checkpoint step",
        ("--checkpoint-dir", ckpt, "--step", "999"): f"no checkpoint step 999 in {ckpt}; the steps there are 3",
    }
    for argv, message in cases.items():
        code, out, err = generate(capsys, *argv, "--quiet")  # (without it, the start-up lines come first)
        assert code == 2 and out == "", argv
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pstar-generate: error: ") and message in lines[0], (argv, err)
        assert "remove" not in err, (argv, err)


def test_start_up_says_what_it_does_one_line_per_phase_and_quiet_silences_it(hf_dir, capsys):
    """Loading and compiling take seconds to minutes for a large model: each phase is one stderr line
    (the cached path and the streamed one), the text alone on stdout; --quiet keeps the last line only."""
    base = ["--hf", hf_dir[0], "--prompt", "hello", "--max-new-tokens", 2, "--temperature", 0]
    for extra, phases in (((), ["building the model of", "compiling the decoder (", "loading the weights onto the "
                                "device", "decoding"]),
                          (("--stream",), ["building the model of", "loading the weights into host memory",
                                           "decoding (each stage compiles"])):
        code, out, err = generate(capsys, *base, *extra)
        lines = err.splitlines()
        assert code == 0 and out.startswith("hello") and len(lines) == len(phases) + 1, err
        assert all(line.startswith(phase) for line, phase in zip(lines, phases)), err
        assert lines[-1].startswith("pstar-generate: 2 new tokens")
    code, _, err = generate(capsys, *base, "--quiet")
    assert code == 0 and err.count("\n") == 1 and err.startswith("pstar-generate: 2 new tokens"), err


def test_registered_as_a_script():
    import tomllib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["pstar-generate"] == "pstar_jax.cli.generate:main"


@pytest.fixture(scope="module")
def chat_hf_dir(tmp_path_factory):
    """A tiny Llama as an HF directory with a Qwen2.5 chat template and its tokenizer."""
    from chat_fixtures import tokenizer_dir
    path = tokenizer_dir(tmp_path_factory.mktemp("chat"), "qwen25")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    model = StagedLlama(LlamaConfig(vocab_size=vocab, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                    seq_len=128))
    return path, model, write_weights(path, model), tok


@pytest.mark.slow
def test_chat_applies_the_template_and_stops_at_the_end_of_turn(chat_hf_dir, tmp_path, capsys):
    from pstar_jax.data.template import ChatTemplate
    path, model, params, tok = chat_hf_dir
    template = ChatTemplate.from_tokenizer_dir(path)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hello"}]
    prompt_ids = template.encode(template.render(messages, add_generation_prompt=True))
    assert tok.decode(prompt_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    reference = [int(i) for i in greedy_full_forward(model, {n: jnp.asarray(v) for n, v in params.items()},
                                                     np.asarray([prompt_ids], np.int32), N_NEW)[0]]
    im_end = tok.token_to_id("<|im_end|>")
    want = until_eos(reference, im_end)
    (tmp_path / "m.json").write_text(json.dumps(messages))
    args = ["--hf", path, "--chat", "--max-new-tokens", N_NEW, "--temperature", 0, "--precision", "fp32"]
    code, out, _ = generate(capsys, *args, "--messages", tmp_path / "m.json")
    assert code == 0 and out == tok.decode(want, skip_special_tokens=True) + "\n"
    # --prompt is one user message (Qwen's template adds its default system message).
    code, out_prompt, _ = generate(capsys, *args, "--prompt", "hello")
    one = template.encode(template.render([{"role": "user", "content": "hello"}], add_generation_prompt=True))
    ref = greedy_full_forward(model, {n: jnp.asarray(v) for n, v in params.items()}, np.asarray([one], np.int32), N_NEW)
    assert code == 0 and out_prompt == tok.decode(until_eos(ref[0], im_end), skip_special_tokens=True) + "\n"
    # An id of generation_config.json's eos_token_id list stops it too: the reference's fourth new token.
    assert len(want) > 3 and want.index(want[3]) == 3  # the random model says enough for the test
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, want[3]]}))
    try:
        code, out_stop, _ = generate(capsys, *args, "--messages", tmp_path / "m.json")
    finally:
        (path / "generation_config.json").unlink()
    assert code == 0 and out_stop == tok.decode(want[:3], skip_special_tokens=True) + "\n"
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "bot", "content": "x"}]))
    for extra, message in (((("--messages", tmp_path / "bad.json")), "must hold a non-empty JSON list"),
                           (("--messages", tmp_path / "none.json"), "cannot read --messages")):
        code, out, err = generate(capsys, *args, *extra, "--quiet")  # the error alone, without the phases
        assert code == 2 and message in err and err.count("\n") == 1
    code, _, err = generate(capsys, "--hf", path, "--messages", tmp_path / "m.json")
    assert code == 2 and "need --chat" in err


def test_text_that_cannot_be_utf8_is_one_line_before_any_model_is_loaded(tmp_path, capsys):
    from pstar_jax.cli.generate import read_messages
    from pstar_jax.config import ConfigError
    # a command-line argument of bytes that are not UTF-8 arrives with surrogate escapes
    assert main(["--hf", str(tmp_path / "absent"), "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pstar-generate: error: --prompt is not UTF-8 text (character 3 is ed b3 a9); give UTF-8 text", err
    messages = tmp_path / "m.json"
    messages.write_text('[{"role": "user", "content": "a\\ud800b"}]')  # JSON's escape of an unpaired surrogate
    with pytest.raises(ConfigError, match=r"message 0's content is not UTF-8 text \(character 1 is ed a0 80\)"):
        read_messages(str(messages))
