"""pstar-tokens --chat: conversation files to a packed SFT file whose rows hold exactly the examples
ChatTemplate.encode_with_mask gives; bad lines, truncation and the summary; one-line errors."""

import errno
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
    # A cut that keeps no assistant token is a bad line naming the conversation and the --seq-len it needs.
    seq_len = min(first_short, first_long) - 1  # rows of seq_len + 1 keep no assistant token of either
    with pytest.raises(DataError) as err:
        make_sft_file(tmp_path / "p.sft.u16.bin", [path], qwen, seq_len, truncate=True)
    assert str(err.value) == (f"{path}:1 has {n_short} tokens and no assistant token among the {seq_len + 1} of a "
                              f"row, so --truncate keeps nothing of it to train; raise --seq-len to {first_short} or "
                              f"more; fix it or pass --on-bad-example skip")
    with pytest.raises(DataError, match=r"no usable conversation \(2 skipped\)"):
        make_sft_file(tmp_path / "p.sft.u16.bin", [path], qwen, seq_len, truncate=True, on_bad_example="skip")
    assert not (tmp_path / "p.sft.u16.bin").exists()
    # Rows that reach the earlier first answer keep that example and skip, naming it, the other.
    line, n, first = (1, n_short, first_short) if first_short > first_long else (2, n_long, first_long)
    seq_len = min(first_short, first_long)
    info = make_sft_file(tmp_path / "s.sft.u16.bin", [path], qwen, seq_len, truncate=True, on_bad_example="skip")
    assert (info["read"], info["skipped"], info["truncated"], info["examples"]) == (1, 1, 1, 1)
    assert info["skipped_named"] == [f"{path}:{line} has {n} tokens and no assistant token among the {seq_len + 1} "
                                     f"of a row, so --truncate keeps nothing of it to train; raise --seq-len to "
                                     f"{first} or more"]


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


def test_full_disk_is_one_line_and_leaves_nothing(qwen, tmp_path, capsys, monkeypatch):
    """The rows are written through memory maps, where a disk without room kills the process (SIGBUS);
    the file's space is taken before, so a full disk is one line, and nothing is left behind."""
    good = _jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    out = tmp_path / "o.sft.u16.bin"
    out.write_bytes(b"old")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    argv = ["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(good), "-o", str(out), "--overwrite"]
    assert tokens_cli.main(argv) == 2
    assert capsys.readouterr().err == (f"pstar-tokens: error: cannot write {out}: No space left on device; free some "
                                       f"space there or write it to another disk\n")
    assert out.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["c.jsonl", "o.sft.u16.bin"]


def test_marks_that_select_nothing_name_the_template_and_the_line(qwen, tmp_path, capsys):
    own = tmp_path / "empty-marks.jinja"  # marks there are, around nothing
    own.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% if m.role == 'assistant' %}"
                   "{% generation %}{% endgeneration %}{% endif %}{% endfor %}")
    good = _jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    out = tmp_path / "o.sft.u16.bin"
    assert tokens_cli.main(["--chat", "--tokenizer", str(qwen), "--chat-template", str(own), "--seq-len", "127",
                            str(good), "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"pstar-tokens: error: {good}:1: the {{% generation %}} marks of the chat template {own} select no token of "
        f"it, so none of its assistant turns would be trained; make the marks enclose the assistant's replies "
        f"(--chat-template FILE) or pass --train-on-prompt\n")
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "empty-marks.jinja"]


def test_assistant_first_conversation_is_one_line(qwen, tmp_path, capsys):
    """Qwen2.5's template reads messages[0] (for its default system prompt), so the empty prefix before an
    opening assistant turn does not render: the line is named, with what to change, not the Jinja error."""
    first = [{"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "Paris."}]
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": first}])
    out = tmp_path / "o.sft.u16.bin"
    argv = ["--chat", "--tokenizer", str(qwen), "--seq-len", "127", str(path), "-o", str(out)]
    assert tokens_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"pstar-tokens: error: {path}:2 opens with an assistant turn, and the chat template "
                   f"{qwen / 'tokenizer_config.json'} cannot render the empty conversation before it to find where "
                   f"that turn begins; start the conversation with a user turn, or give a template with "
                   f"{{% generation %}} marks (--chat-template); fix it or pass --on-bad-example skip\n")
    assert not out.exists()
    assert tokens_cli.main(argv + ["--on-bad-example", "skip"]) == 0
    assert "1 examples read, 1 skipped" in capsys.readouterr().out
    # After a system turn the prefix renders, so the opening assistant turn trains.
    ids, labels = ChatTemplate.from_tokenizer_dir(qwen).encode_with_mask([{"role": "system", "content": "Be brief."},
                                                                          *first])
    assert labels.any()


def test_absurd_seq_len_is_refused_before_any_work(qwen, tmp_path, capsys):
    good = _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    out = tmp_path / "o.sft.u16.bin"
    assert tokens_cli.main(["--chat", "--tokenizer", str(qwen), "--seq-len", "1000000000", str(good), "-o",
                            str(out)]) == 2
    assert capsys.readouterr().err == ("pstar-tokens: error: --seq-len 1,000,000,000 is past 16,777,216 (2**24), "
                                       "longer than any model trains at; give the sequence length the model trains "
                                       "at\n")
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]
