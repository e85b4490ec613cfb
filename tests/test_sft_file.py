"""pstar-tokens --chat: conversation files to a packed SFT file whose rows hold exactly the examples
ChatTemplate.encode_with_mask gives; bad lines, truncation and the summary; one-line errors."""

import json
import os

import numpy as np
import pytest

from chat_fixtures import CONVERSATIONS, tokenizer_dir
from pstar_jax.cli import tokens as tokens_cli
from pstar_jax.data import packing
from pstar_jax.data.template import ChatTemplate
from pstar_jax.config.errors import DataError
from pstar_jax.data.sft import make_sft_file


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("tok"), "qwen25")


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _examples_in(rows):
    out = []
    for t, s, lab in zip(rows.tokens, rows.segments, rows.labels):
        for k in range(1, int(s.max(initial=0)) + 1):
            out.append((tuple(t[s == k].tolist()), tuple(lab[s == k].tolist())))
    return sorted(out)


def test_rows_hold_the_encoded_conversations(qwen, tmp_path, capsys):
    messages = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 5])
    alpaca = _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "What is the capital of France?",
                                                  "output": "Paris."}] * 3)
    out = tmp_path / "train.sft.u16.bin"
    assert tokens_cli.main(["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(messages), str(alpaca),
                        "-o", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: 18 examples read, 0 skipped, 0 truncated, 0 dropped; ")
    assert "packing efficiency" in line and "examples/s" in line and "tokens/s" in line
    template = ChatTemplate.from_tokenizer_dir(qwen)
    convs = CONVERSATIONS * 5 + [[{"role": "user", "content": "What is the capital of France?"},
                                  {"role": "assistant", "content": "Paris."}]] * 3
    want = sorted((tuple(i.tolist()), tuple(m.tolist())) for i, m in map(template.encode_with_mask, convs))
    rows = packing.load_packed(out)
    assert rows.seq_len == 127 and _examples_in(rows) == want
    info = rows.info
    assert info["examples"] == 18 and info["tokens"] == sum(len(t) for t, _ in want) == np.count_nonzero(rows.segments)
    assert info["trained_tokens"] == sum(sum(m[1:]) for _, m in want)
    assert info["chat_template_sha256"] == template.sha256 and info["train_on_prompt"] is False
    assert info["eos_id"] == template.eos_id and info["vocab_size"] == template.vocab_size
    assert info["end_of_turn_ids"] == [template.tokenizer.token_to_id("<|im_end|>")]
    assert info["real_position_fraction"] == pytest.approx(info["tokens"] / (rows.rows * 128))
    # --train-on-prompt: every token trained; the same tokens.
    assert tokens_cli.main(["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(messages), "-o",
                        str(tmp_path / "all.sft.u16.bin"), "--train-on-prompt"]) == 0
    every = packing.load_packed(tmp_path / "all.sft.u16.bin")
    assert (every.labels == (every.segments > 0)).all() and every.info["train_on_prompt"] is True


def test_bad_lines_error_or_skip(qwen, tmp_path, capsys):
    good = {"messages": CONVERSATIONS[0]}
    path = _jsonl(tmp_path / "mixed.jsonl", [good, "{oops", {"messages": [{"role": "user", "content": "x"}]},
                                             good, {"messages": [{"role": "robot", "content": "x"}]}])
    out = tmp_path / "t.sft.u16.bin"
    base = ["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(path), "-o", str(out)]
    assert tokens_cli.main(base) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pstar-tokens: error: {path}:2 is not JSON")
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["mixed.jsonl"]
    assert tokens_cli.main(base + ["--on-bad-example", "skip"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"skipped {path}:2 is not JSON") and printed[1].startswith(f"skipped {path}:3 has no")
    assert printed[2].startswith(f"skipped {path}:5 messages[0] has the unknown role 'robot'")
    assert "2 examples read, 3 skipped" in printed[3]
    assert packing.load_packed(out).info["skipped"] == 3


def test_long_examples_dropped_or_truncated(qwen, tmp_path):
    template = ChatTemplate.from_tokenizer_dir(qwen)
    short, long = CONVERSATIONS[0], CONVERSATIONS[2]
    (n_short, first_short), (n_long, first_long) = (
        (len(ids), int(np.argmax(labels))) for ids, labels in map(template.encode_with_mask, (short, long)))
    assert n_short < n_long - 2
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": short}, {"messages": long}])
    seq_len = n_long - 3
    info = make_sft_file(tmp_path / "d.sft.u16.bin", [path], qwen, seq_len)
    assert (info["read"], info["dropped"], info["truncated"], info["examples"]) == (2, 1, 0, 1)
    info = make_sft_file(tmp_path / "t.sft.u16.bin", [path], qwen, seq_len, truncate=True)
    assert (info["dropped"], info["truncated"], info["examples"]) == (0, 1, 2)
    ids, labels = template.encode_with_mask(long)
    got = _examples_in(packing.load_packed(tmp_path / "t.sft.u16.bin"))
    assert (tuple(ids[:seq_len + 1].tolist()), tuple(labels[:seq_len + 1].tolist())) in got
    # A cut that keeps no assistant token drops the example even with --truncate.
    seq_len = min(first_short, first_long) - 1  # rows of seq_len + 1 keep no assistant token of either
    with pytest.raises(DataError, match=f"no example fits --seq-len {seq_len} \\(2 read, 0 skipped, 2 dropped\\)"):
        make_sft_file(tmp_path / "p.sft.u16.bin", [path], qwen, seq_len, truncate=True)


def test_errors_are_one_line(qwen, tmp_path, capsys):
    good = _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    empty = _jsonl(tmp_path / "e.jsonl", [])
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((qwen / "tokenizer.json").read_bytes())
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    out = str(tmp_path / "o.sft.u16.bin")
    cases = [
        (["--chat", str(good), "-o", out], "--chat needs --tokenizer DIR"),
        (["--chat", "--tokenizer", str(qwen), str(good), "-o", out], "and --seq-len"),
        (["--chat", "--tokenizer", str(plain), "--seq-len", "64", str(good), "-o", out], "has no chat template"),
        (["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(good), "-o", str(tmp_path / "o.u16.bin")],
         f"must end in .sft.u16.bin: name it {tmp_path / 'o.sft.u16.bin'}"),
        (["--chat", "--tokenizer", str(qwen), "--seq-len", "4", str(good), "-o", out], "no example fits --seq-len 4"),
        (["--chat", "--tokenizer", str(qwen), "--seq-len", "127", "--chat-format", "alpaca", str(good), "-o", out],
         f"{good}:1 has no 'instruction' field"),
        (["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(good), "-o", str(good)], "is also an input"),
        (["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(empty), "-o", out],
         "the inputs hold no usable conversation (0 skipped)"),
        (["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(good), "--seed", "-1", "-o", out],
         "--seed must be a whole number >= 0"),
        (["--chat", "--tokenizer", str(qwen), "--seq-len", "0", str(good), "-o", out], "--seq-len must be >= 1"),
        (["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(good), "--max-bytes", "9", "-o", out],
         "--max-bytes does not apply to --chat"),
    ]
    for argv, message in cases:
        assert tokens_cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (message, err)
        assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "e.jsonl", "plain"], argv
