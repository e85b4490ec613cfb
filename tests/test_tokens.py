import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pstar_jax.cli import tokens as tokens_cli
from pstar_jax.data import corpus, token_files as data, tokenizer as tokens
from pstar_jax.config.errors import DataError

EOS = "<|endoftext|>"
LINES = ["hello world, the quick brown fox", "jumps over the lazy dog\n  indented line",
         "héllo ünïcode — ✓ 123 4567", "def f(x):\n    return x * 2\n\n\nclass A: pass"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE (GPT-2 style) trained here, saved as a Hugging Face tokenizer directory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES * 4, trainer)
    path = tmp_path_factory.mktemp("bpe")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS, "special": True}}))
    return path


@pytest.fixture(scope="module")
def big_vocab_json(tmp_path_factory):
    """A WordLevel tokenizer of 70,002 ids (more than uint16 holds), without a tokenizer_config.json."""
    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("words") / "tokenizer.json"
    tok.save(str(path))
    return path


def _encode(tokenizer_dir, text: str) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _leftovers(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_byte_level_either_order_and_default_corpus(tmp_path, capsys):
    text = _write(tmp_path / "a.txt", "hello world")
    want = data.encode_bytes(b"hello world\x00hello world")
    for argv in (["-o", "named.u16.bin", str(text), str(text)], [str(text), "--output", "named2.u16.bin", str(text)],
                 ["first.u16.bin", str(text), str(text)], [str(text), str(text), "last.u16.bin"]):
        out = tmp_path / next(a for a in argv if a.endswith(".bin"))
        argv = [str(tmp_path / a) if a.endswith(".bin") else a for a in argv]
        assert tokens_cli.main(argv) == 0
        assert "wrote 23 uint16 tokens" in capsys.readouterr().out
        np.testing.assert_array_equal(data.load_tokens(out), want)
        assert data.read_token_info(out) == {"tokenizer": "bytes", "vocab_size": 256, "eos_id": 0, "max_id": 119,
                                             "num_tokens": 23, "dtype": "uint16"}
    assert tokens_cli.main([str(tmp_path / "d.u16.bin"), "--default-corpus", "--max-bytes", "5000"]) == 0
    np.testing.assert_array_equal(data.load_tokens(tmp_path / "d.u16.bin"), corpus.default_corpus(5000))
    # --max-bytes counts a document boundary as one byte, so bytes and tokens stay equal.
    assert tokens_cli.main([str(tmp_path / "m.u16.bin"), str(text), str(text), "--max-bytes", "12"]) == 0
    np.testing.assert_array_equal(data.load_tokens(tmp_path / "m.u16.bin"), want[:12])


def test_output_is_never_an_input(tmp_path, capsys):
    """`pstar-tokens OUT.u16.bin IN.u16.bin --overwrite` once overwrote IN: two token-file names without -o
    are refused, and an input is never the output, even with --overwrite."""
    a, b = tmp_path / "a.u16.bin", tmp_path / "b.u16.bin"
    a.write_bytes(b"input one")
    b.write_bytes(b"input two")
    assert tokens_cli.main([str(a), str(b), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot tell the output" in err and "pstar-tokens -o OUT.u16.bin INPUTS..." in err
    for argv in (["-o", str(a), str(a), "--overwrite"], ["-o", str(tmp_path / "." / "a.u16.bin"), str(b), str(a),
                                                         "--overwrite"]):
        assert tokens_cli.main(argv) == 2
        assert "is also an input; it is never overwritten" in capsys.readouterr().err
    middle = _write(tmp_path / "t.txt", "x")
    assert tokens_cli.main([str(middle), str(tmp_path / "o.u16.bin"), str(middle)]) == 2  # OUT in the middle
    assert "cannot tell the output" in capsys.readouterr().err
    assert a.read_bytes() == b"input one" and b.read_bytes() == b"input two"
    assert tokens_cli.main(["-o", str(tmp_path / "o.u16.bin"), str(a), str(b)]) == 0  # token files as text inputs
    np.testing.assert_array_equal(data.load_tokens(tmp_path / "o.u16.bin"), data.encode_bytes(b"input one\x00input two"))
    assert tokens_cli.main(["--seq-len", "8", "-o", str(tmp_path / "p.u16.bin"), str(middle)]) == 2
    assert "--seq-len needs --chat" in capsys.readouterr().err


def test_max_bytes_on_the_byte_path_is_a_prefix(tmp_path):
    files = [_write(tmp_path / n, t) for n, t in (("a.txt", "abc"), ("b.txt", ""), ("c.txt", "defg"))]
    joined = data.encode_bytes(b"abc\x00\x00defg")
    for max_bytes in range(2, len(joined) + 3):
        info = tokens.make_token_file(tmp_path / "o.u16.bin", files, max_bytes=max_bytes, overwrite=True)
        np.testing.assert_array_equal(data.load_tokens(tmp_path / "o.u16.bin"), joined[:max_bytes])
        assert info["num_tokens"] == min(max_bytes, len(joined))


def test_text_files_round_trip_with_eos_between(bpe_dir, tmp_path, capsys):
    a, b = _write(tmp_path / "a.txt", LINES[0] + "\n"), _write(tmp_path / "b.md", LINES[2] + "\n" + LINES[3])
    out = tmp_path / "out.u16.bin"
    assert tokens_cli.main(["--tokenizer", str(bpe_dir), str(a), str(b), str(out), "--quiet"]) == 0
    reference = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    eos, vocab_size = reference.token_to_id(EOS), reference.get_vocab_size()
    want = _encode(bpe_dir, a.read_text()) + [eos] + _encode(bpe_dir, b.read_text())
    np.testing.assert_array_equal(data.load_tokens(out), want)
    info = data.read_token_info(out)
    assert info == {"tokenizer": str(bpe_dir), "vocab_size": vocab_size, "eos_id": eos, "max_id": max(want),
                    "num_tokens": len(want), "dtype": "uint16"}
    assert f"wrote {len(want)} uint16 tokens to {out} (vocabulary {vocab_size}, eos id {eos})" in capsys.readouterr().out
    # The tokenizer.json itself works too, finding tokenizer_config.json beside it.
    assert tokens_cli.main(["--tokenizer", str(bpe_dir / "tokenizer.json"), str(a), str(b), str(out), "-q",
                        "--overwrite"]) == 0
    np.testing.assert_array_equal(data.load_tokens(out), want)


def test_large_file_pieces_encode_exactly(bpe_dir, tmp_path):
    # Many lines of varied text: blank lines, indentation, CRLF, multi-byte characters, no newline at the end.
    rng = np.random.default_rng(0)
    text = "".join(LINES[i] + ["\n", "\n\n", "\r\n", "\n    ", " "][j]
                   for i, j in zip(rng.integers(0, 4, 400), rng.integers(0, 5, 400)))
    path = _write(tmp_path / "big.txt", text)
    pieces = list(tokens.read_text(path, piece_bytes=200))
    assert len(pieces) > 20 and pieces[0].starts_document and not any(p.starts_document for p in pieces[1:])
    assert b"".join(p.text for p in pieces) == path.read_bytes()
    assert all(len(p.text) <= 400 for p in pieces)
    for p in pieces:
        p.text.decode("utf-8")  # never cut inside a character
    encoder = tokens.load_tokenizer(bpe_dir)
    out = tmp_path / "big.u16.bin"
    with data.TokenWriter(out, encoder.vocab_size, eos_id=encoder.eos_id) as writer:
        tokens.encode_into(writer, iter(pieces), encoder, batch_bytes=1000)  # many batches
        writer.commit()
    np.testing.assert_array_equal(data.load_tokens(out), _encode(bpe_dir, text))


def test_jsonl_field_and_mixed_inputs(bpe_dir, tmp_path):
    docs = ["first doc", "second ✓ doc\nwith a line", "", "third"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"id": i, "content": d}) for i, d in enumerate(docs)) + "\n\n")
    txt = _write(tmp_path / "t.txt", "plain text")
    out = tmp_path / "out.u16.bin"
    assert tokens_cli.main(["--tokenizer", str(bpe_dir), "--field", "content", str(txt), str(jsonl), str(out), "-q"]) == 0
    eos = tokens.load_tokenizer(bpe_dir).eos_id
    want = _encode(bpe_dir, "plain text")
    for d in docs:
        want += [eos] + _encode(bpe_dir, d)
    np.testing.assert_array_equal(data.load_tokens(out), want)
    assert list(data.load_tokens(out)).count(eos) == 4

    assert tokens_cli.main(["--tokenizer", str(bpe_dir), str(jsonl), str(tmp_path / "x.u16.bin")]) == 2


def test_uint32_vocabulary(big_vocab_json, tmp_path, capsys):
    text = _write(tmp_path / "w.txt", "w1 w65535 w65536 w69999 nope")
    out16 = tmp_path / "out.u16.bin"
    argv = ["--tokenizer", str(big_vocab_json), "--eos-token", "</s>", str(text), str(text)]
    assert tokens_cli.main(argv + [str(out16)]) == 2
    assert (f"token file {out16} would hold uint32 tokens (vocabulary of 70,002), so its name must end in "
            f".u32.bin: name it {tmp_path / 'out.u32.bin'}\n") in capsys.readouterr().err
    out = tmp_path / "out.u32.bin"
    assert tokens_cli.main(argv + [str(out), "-q"]) == 0
    loaded = data.load_tokens(out)
    assert loaded.dtype == np.uint32
    np.testing.assert_array_equal(loaded, [1, 65535, 65536, 69999, 70000, 70001, 1, 65535, 65536, 69999, 70000])
    assert data.read_token_info(out)["vocab_size"] == 70_002 and data.read_token_info(out)["eos_id"] == 70_001
    with pytest.raises(DataError, match="token id 70001, but the model.s vocabulary has 70000 ids"):
        data.check_vocab(loaded, 70_000)
    with pytest.raises(DataError, match=r"named as uint32 tokens, not uint16"):
        data.load_tokens(out, dtype=np.uint16)


def test_eos_must_be_found(bpe_dir, big_vocab_json, tmp_path, capsys):
    text = _write(tmp_path / "a.txt", "w1")
    out = tmp_path / "o.u32.bin"
    assert tokens_cli.main(["--tokenizer", str(big_vocab_json), str(text), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot tell the end-of-text token of" in err and "pass --eos-token" in err
    assert tokens_cli.main(["--tokenizer", str(bpe_dir), "--eos-token", "<eos>", str(text), str(out)]) == 2
    assert "'<eos>' is not in the vocabulary of" in capsys.readouterr().err
    assert _leftovers(tmp_path) == ["a.txt"]


def test_max_bytes_cuts_at_a_character(bpe_dir, tmp_path, capsys):
    text = _write(tmp_path / "a.txt", "héllo")  # é is two bytes
    out = tmp_path / "o.u16.bin"
    # Two bytes keep "h" and drop half of "é" (no decoding error); one token is too few for a file.
    assert tokens_cli.main(["--tokenizer", str(bpe_dir), str(text), str(out), "--max-bytes", "2", "-q"]) == 2
    assert f"the inputs hold 1 tokens; a token file needs at least 2, so {out} was not written" in capsys.readouterr().err
    assert tokens_cli.main(["--tokenizer", str(bpe_dir), str(text), str(out), "--max-bytes", "3", "-q"]) == 0
    np.testing.assert_array_equal(data.load_tokens(out), _encode(bpe_dir, "hé"))


def _bad_cases(tmp: Path, bpe_dir: Path):
    """(argv, text the one error line must hold): each names the file at fault."""
    txt = _write(tmp / "in.txt", "some text")
    (tmp / "dir").mkdir()
    bad_json = tmp / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": \n')
    no_field = tmp / "nf.jsonl"
    no_field.write_text('{"body": "x"}\n')
    latin1 = tmp / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    broken_tok = tmp / "broken" / "tokenizer.json"
    broken_tok.parent.mkdir()
    broken_tok.write_text("{not json")
    out = str(tmp / "out.u16.bin")
    tok = ["--tokenizer", str(bpe_dir)]
    return [
        ([str(tmp / "missing.txt"), out], f"input file {tmp / 'missing.txt'} does not exist"),
        ([str(tmp / "dir"), out], f"input {tmp / 'dir'} is a directory"),
        (["/proc/self/mem", out], "cannot read /proc/self/mem: Input/output error"),  # unreadable even as root
        (["-o", str(tmp / "dir"), str(txt)], f"output {tmp / 'dir'} is a directory"),
        ([str(txt), str(tmp / "dir")], "cannot tell the output among"),
        ([str(txt), str(txt / "x.u16.bin")], f"cannot write {txt / 'x.u16.bin'}: "),  # under a file
        (tok + [str(bad_json), out], f"{bad_json} line 2 is not JSON"),
        (tok + [str(no_field), out], f"{no_field} line 1 has no 'text' field ('body'); choose one with --field"),
        (tok + [str(latin1), out], f"{latin1} is not UTF-8 text (bad byte 0xe9)"),
        (["--tokenizer", str(tmp / "nowhere"), str(txt), out], f"tokenizer {tmp / 'nowhere'} does not exist"),
        (["--tokenizer", str(tmp / "dir"), str(txt), out], f"tokenizer {tmp / 'dir' / 'tokenizer.json'} does not exist"),
        (["--tokenizer", str(broken_tok), str(txt), out], f"cannot load tokenizer {broken_tok}: "),
        ([out], "give either input files or --default-corpus"),
    ]


def test_error_lines_name_the_file_and_write_nothing(bpe_dir, tmp_path, capsys):
    for argv, want in _bad_cases(tmp_path, bpe_dir):
        before = _leftovers(tmp_path)
        assert tokens_cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err == f"pstar-tokens: error: {err.split('error: ', 1)[1]}" and err.count("\n") == 1, err
        assert want in err, (want, err)
        assert _leftovers(tmp_path) == before, argv  # no output, no temporary file


def test_existing_output_kept_on_error_and_interrupt(bpe_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.u16.bin"
    out.write_bytes(b"keep")
    txt = _write(tmp_path / "in.txt", "text")
    assert tokens_cli.main([str(txt), str(out)]) == 2
    assert f"{out} already exists; pass --overwrite to replace it\n" in capsys.readouterr().err

    def interrupted(self, pieces):
        raise KeyboardInterrupt
    monkeypatch.setattr(tokens.ByteEncoder, "encode_batch", interrupted)
    assert tokens_cli.main([str(txt), str(out), "--overwrite"]) == 130
    assert f"interrupted; {out} was left as it was" in capsys.readouterr().err
    assert out.read_bytes() == b"keep" and _leftovers(tmp_path) == ["in.txt", "out.u16.bin"]


def test_read_only_output_names_the_file(tmp_path, capsys, monkeypatch):
    txt = _write(tmp_path / "in.txt", "text")
    out = tmp_path / "out.u16.bin"

    def refuse(*args, **kwargs):  # what a read-only directory does (root ignores chmod, so fake it)
        raise PermissionError(13, "Permission denied", str(tmp_path / ".out.u16.bin.x.tmp"))
    monkeypatch.setattr(data, "create_temp_beside", refuse)
    assert tokens_cli.main([str(txt), str(out)]) == 2
    assert capsys.readouterr().err == f"pstar-tokens: error: cannot write {out}: Permission denied\n"


def test_full_disk_subprocess_leaves_no_partial_file(tmp_path):
    # A file-size limit makes writes fail past 64 KiB, as a full disk would, with no root needed.
    txt = tmp_path / "in.txt"
    txt.write_bytes(b"x" * 200_000)
    out = tmp_path / "out.u16.bin"
    out.write_bytes(b"old!")
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
              "from pstar_jax.cli.tokens import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", script, str(txt), str(out), "--overwrite"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"pstar-tokens: error: cannot write {out}: File too large\n"
    assert out.read_bytes() == b"old!" and _leftovers(tmp_path) == ["in.txt", "out.u16.bin"]


def test_progress_bar(tmp_path, capsys):
    txt = _write(tmp_path / "in.txt", "text " * 100)
    info = tokens.make_token_file(tmp_path / "o.u16.bin", [txt], progress=True)
    assert info["num_tokens"] == 500 and "tokenizing" in capsys.readouterr().err


def test_module_entry_point_has_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "pstar_jax.cli.tokens", str(tmp_path / "missing.txt"),
                           str(tmp_path / "out.u16.bin")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"pstar-tokens: error: input file {tmp_path / 'missing.txt'} does not exist\n"


@pytest.mark.parametrize("eos,words", [
    (0, "gives eos_token as 0, not the token's text; pass --eos-token '<|endoftext|>'"),
    (10**9, "gives eos_token as 1000000000, not the token's text; pass --eos-token with the end-of-text token's"),
    (["</s>"], 'gives eos_token as ["</s>"], not the token'),
    ({"special": True}, 'gives eos_token as {"special": true}'),
])
def test_eos_token_that_is_not_a_token_string_is_one_line(bpe_dir, tmp_path, eos, words):
    """transformers reads a string or an AddedToken dict there; an id is refused with the token to pass."""
    import shutil
    from pstar_jax.data.tokenizer import load_tokenizer
    directory = tmp_path / "tok"
    shutil.copytree(bpe_dir, directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    with pytest.raises(DataError) as err:
        load_tokenizer(directory)
    assert words in str(err.value) and "\n" not in str(err.value)
    if eos == 0:  # the suggestion works
        assert load_tokenizer(directory, EOS).eos_id == 0
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"__type": "AddedToken",
                                                                               "content": EOS, "lstrip": False}}))
    assert load_tokenizer(directory).eos_id == load_tokenizer(bpe_dir).eos_id


def test_help_names_every_default(capsys):
    assert tokens_cli.main(["--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps its lines
    for flag, default in [("--field FIELD", "(default: text)"), ("--max-bytes MAX_BYTES", "default: all)"),
                          ("--tokenizer DIR_OR_JSON", "(default: bytes)"), ("--seed SEED", "(default: 0)")]:
        assert flag in help_text and default in help_text.split(flag, 1)[1].split(" --", 1)[0], flag


@pytest.mark.parametrize("argv", [["--chat", "--seq-len", "1e9", "-o", "x.sft.u16.bin", "a.jsonl"], ["--bogus"]])
def test_a_usage_error_is_one_line(capsys, argv):
    assert tokens_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pstar-tokens: error: "), err
