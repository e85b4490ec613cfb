"""Supervised fine-tuning end to end, through the CLIs a user runs: a messages JSONL rendered by the
checkpoint's own chat template into a packed SFT file (pstar-tokens --chat), trained with chunks
moving (pstar-train --init-from-hf --data), evaluated on held-out packed rows, exported with its
tokenizer and template, and chatted with (pstar-generate --chat)."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from chat_fixtures import CONVERSATIONS, tokenizer_dir
from pstar_models.hf import hf_config, hf_tensors
from pstar_models.llama import LlamaConfig, StagedLlama


def chat_checkpoint(root):
    """A tiny Llama as a Hugging Face directory with Qwen2.5's chat template and a tokenizer."""
    path = tokenizer_dir(root, "qwen25")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    model = StagedLlama(LlamaConfig(vocab_size=vocab, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                    seq_len=256, max_position_embeddings=256))
    params = {n: np.asarray(model.init_tensor(n, 3), np.float32) for n in model.param_shapes()}
    save_file({hf: np.ascontiguousarray(params[n].T if t else params[n]) for n, (hf, t, _) in hf_tensors(model).items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(model, torch_dtype="float32")))
    return path


@pytest.mark.slow
def test_chat_data_trains_on_the_answers_evaluates_exports_and_chats(tmp_path, capsys):
    from pstar_jax.cli.generate import main as generate_main
    from pstar_jax.cli.tokens import main as tokens_main
    from pstar_jax.cli.train import main as train_main
    src = chat_checkpoint(tmp_path)
    data = tmp_path / "chat.jsonl"
    rng = np.random.default_rng(0)
    with open(data, "w") as f:
        for i in range(400):
            f.write(json.dumps({"messages": CONVERSATIONS[int(rng.integers(len(CONVERSATIONS)))]}) + "\n")
    packed = tmp_path / "chat.sft.u16.bin"
    assert tokens_main(["--chat", "--tokenizer", str(src), "--seq-len", "256", "-o", str(packed), str(data)]) == 0
    info = json.loads((tmp_path / "chat.sft.u16.bin.json").read_text())
    assert info["examples"] + info["dropped"] == 400 and 0 < info["trained_tokens"] < info["tokens"]
    capsys.readouterr()

    metrics, out = tmp_path / "m.jsonl", tmp_path / "export"
    code = train_main(["--init-from-hf", str(src), "--data", str(packed), "--steps", "30", "--batch-size", "8",
                       "--lr", "3e-3", "--eval-every", "15", "--metrics-out", str(metrics), "--export-hf", str(out),
                       "--quiet"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 30 and steps[-1]["loss"] < steps[0]["loss"]
    # only the answers count: fewer trained targets than positions, every step
    assert all(0 < r["trained_tokens"] < 8 * 256 for r in steps)
    assert any("eval_loss" in r and np.isfinite(r["eval_loss"]) for r in rows)
    assert all(r["h2d_bytes"] > 0 for r in steps[1:])  # the chunks moved (the CPU's default budget holds half the model data)
    assert (out / "tokenizer_config.json").is_file() and (out / "tokenizer.json").is_file()
    capsys.readouterr()

    code = generate_main(["--hf", str(out), "--chat", "--prompt", "What is the capital of France?",
                          "--max-new-tokens", "6", "--temperature", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.endswith("\n") and "Traceback" not in captured.err
