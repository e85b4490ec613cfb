"""pstar-tokens --preference: TRL's preference formats to a packed preference file whose pairs are
the token ids TRL's DPOTrainer makes of them (trl is a test-only reference), whole in one row."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from chat_fixtures import tokenizer_dir
from pstar_jax.cli import tokens as tokens_cli
from pstar_jax.config.errors import DataError
from pstar_jax.data import chat, preference
from pstar_jax.data.batch import trained_targets
from pstar_jax.data.packing import load_packed
from pstar_jax.data.pairs import check_pairs


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# One data set per format, as TRL's docs list them (a data set holds one format).
FORMATS = {
    "standard": [
        {"prompt": "What is the capital of France?", "chosen": " Paris is the capital.", "rejected": " the lazy dog"},
        {"prompt": "def f(x):", "chosen": "\n    return x * 2\n", "rejected": " pass"},
        {"prompt": "héllo", "chosen": " ünïcode ✓ 123<|im_end|>", "rejected": " world"},  # TRL appends EOS even so
    ],
    "conversational": [
        {"prompt": [user("What is the capital of France?")], "chosen": [assistant("Paris is the capital.")],
         "rejected": [assistant("the lazy dog")]},
        {"prompt": [{"role": "system", "content": "You are a helpful assistant."}, user("hello world"),
                    assistant("hello!"), user("def f(x):\n    return x * 2\n")],
         "chosen": [assistant("  It doubles x ✓.  ")], "rejected": [assistant("quick brown fox")]},
        # a prompt ending with the assistant's turn: TRL continues it (continue_final_message)
        {"prompt": [user("What is the capital of France?"), assistant("The capital is")],
         "chosen": [assistant(" Paris.")], "rejected": [assistant(" London.")]},
    ],
    "conversational-implicit": [
        {"chosen": [user("héllo"), assistant("ünïcode 123")], "rejected": [user("héllo"), assistant("the dog")]},
        {"chosen": [user("hello world"), assistant("the quick brown fox"), user("and?"), assistant("Paris")],
         "rejected": [user("hello world"), assistant("the quick brown fox"), user("and?"), assistant("no")]},
        # a text prompt beside message lists is ignored, as TRL's maybe_extract_prompt ignores it
        {"prompt": "What is the capital of France?", "chosen": [user("What is it?"), assistant("Paris.")],
         "rejected": [user("What is it?"), assistant("London.")]},
    ],
    "standard-implicit": [
        {"chosen": "Q: hello world A: the quick brown fox", "rejected": "Q: hello world A: the lazy dog"},
        {"chosen": "What is the capital? Paris", "rejected": "What is the capital? London"},
        # one a beginning of the other: TRL's loop leaves the prompt one character short of the shorter
        {"chosen": "hello world", "rejected": "hello world, the quick brown fox"},
    ],
}


@pytest.fixture(scope="module")
def tokenizers_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    for name in ("llama31", "qwen25"):
        tokenizer_dir(root, name)
    return root


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def file_pairs(path):
    """(prompt, chosen, rejected) token lists of a preference file, in file order, checking on the way
    that each pair is two consecutive segments of one row, labelled exactly on its completions."""
    rows = load_packed(path)
    assert rows.info["preference"] is True
    tokens, segments, labels = (np.asarray(a) for a in (rows.tokens, rows.segments, rows.labels))
    pairs = []
    for r in range(rows.rows):
        n = int(segments[r].max())
        assert n % 2 == 0 and set(np.unique(segments[r])) <= set(range(n + 1))  # whole pairs only
        for k in range(1, n, 2):
            seqs = []
            for s in (k, k + 1):
                where = np.flatnonzero(segments[r] == s)
                assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous
                ids, mask = tokens[r, where].tolist(), labels[r, where]
                start = int(np.argmax(mask))  # the mask is the completion: zeros, then ones to the end
                assert mask[start:].all() and not mask[:start].any()
                seqs.append((ids[:start], ids[start:]))
            assert where[0] == np.flatnonzero(segments[r] == k)[-1] + 1  # rejected right after chosen
            assert seqs[0][0] == seqs[1][0]  # one prompt
            pairs.append((seqs[0][0], seqs[0][1], seqs[1][1]))
    assert rows.info["pairs"] == len(pairs) == check_pairs(rows, str(path))  # what training checks of it
    return pairs


def trl_pairs(records, tokenizer_path, max_prompt_length=None, max_completion_length=None):
    """TRL's own processing of a data set: DPOTrainer._prepare_dataset (maybe_extract_prompt,
    maybe_apply_chat_template, tokenize_row) with a transformers tokenizer."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    # trl 0.27.2 (the test extra's) imports on transformers 4.57; on 5.x its trainer module does not
    trainer_module = pytest.importorskip("trl.trainer.dpo_trainer", reason="trl's DPOTrainer does not import here")
    DPOTrainer = trainer_module.DPOTrainer
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path))
    trainer = SimpleNamespace(tokenize_row=DPOTrainer.tokenize_row, is_vision_model=False)
    args = SimpleNamespace(dataset_num_proc=None, tools=None, max_prompt_length=max_prompt_length,
                           max_completion_length=max_completion_length)
    dataset = DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(records), tokenizer, args, "train")
    return [(r["prompt_input_ids"], r["chosen_input_ids"], r["rejected_input_ids"]) for r in dataset]


@pytest.mark.hf_reference
@pytest.mark.parametrize("template", ["llama31", "qwen25"])
@pytest.mark.parametrize("format", list(FORMATS))
def test_each_format_gives_trls_token_ids(tokenizers_root, tmp_path, format, template):
    records, directory = FORMATS[format], tokenizers_root / template
    out = tmp_path / "p.sft.u16.bin"
    info = preference.make_preference_file(out, [write_jsonl(tmp_path / "p.jsonl", records)], directory, 256)
    assert (info["read"], info["pairs"], info["dropped"], info["truncated"]) == (len(records), len(records), 0, 0)
    want = trl_pairs(records, directory)
    assert sorted(file_pairs(out)) == sorted(want)
    if template == "llama31":  # BOS: the template writes it once; TRL adds none to a text pair
        from tokenizers import Tokenizer
        bos = Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id("<|begin_of_text|>")
        firsts = [p[0][0] == bos and bos not in p[0][1:] + p[1] + p[2] for p in want]
        assert all(firsts) if format.startswith("conversational") else not any(firsts)


@pytest.mark.hf_reference
@pytest.mark.parametrize("seq_len", [40, 63, 90])
def test_truncate_cuts_as_trls_prompt_and_completion_lengths(tokenizers_root, tmp_path, seq_len):
    """--truncate: the prompt keeps its end and the completions their start, as TRL's
    max_prompt_length and max_completion_length cut them, at the lengths that fit the pair in a row."""
    records = FORMATS["conversational"] + [
        {"prompt": [user("hello world " * 6)], "chosen": [assistant("Paris")], "rejected": [assistant("no")]},
        {"prompt": [user("hi")], "chosen": [assistant("the quick brown fox " * 5)], "rejected": [assistant("x")]}]
    directory, out = tokenizers_root / "qwen25", tmp_path / "t.sft.u16.bin"
    full = trl_pairs(records, directory)
    info = preference.make_preference_file(out, [write_jsonl(tmp_path / "t.jsonl", records)], directory, seq_len,
                                           truncate=True)
    cut = [2 * len(p) + len(c) + len(r) > seq_len + 1 for p, c, r in full]
    assert info["truncated"] == sum(cut) > 0 and info["dropped"] == 0 and info["pairs"] == len(records)
    want = []
    for record, (p, c, r), was_cut in zip(records, full, cut):
        lengths = preference.truncate_pair(len(p), len(c), len(r), seq_len + 1) if was_cut else (None, None)
        (trl,) = trl_pairs([record], directory, *lengths)
        assert 2 * len(trl[0]) + len(trl[1]) + len(trl[2]) <= seq_len + 1
        want.append(trl)
    assert sorted(file_pairs(out)) == sorted(want)


def test_truncate_pair_keeps_whole_completions_when_it_can():
    assert preference.truncate_pair(10, 3, 4, 27) == (10, 4)  # fits: nothing cut
    assert preference.truncate_pair(50, 3, 4, 27) == (10, 4)  # the prompt alone gives way
    assert preference.truncate_pair(50, 30, 4, 40) == (10, 16)  # prompt at a quarter, the long completion cut
    assert preference.truncate_pair(5, 30, 40, 40) == (5, 15)  # a short prompt stays; both completions cut
    for p, c, r, row in np.random.default_rng(0).integers(1, 60, (300, 4)):
        kept_p, kept_c = preference.truncate_pair(p, c, r, row + 1)
        assert 2 * kept_p + min(c, kept_c) + min(r, kept_c) <= row + 1 and kept_c >= 1 and kept_p <= p


def test_pairs_stay_whole_in_one_row_and_long_ones_are_dropped_and_counted(tokenizers_root, tmp_path, capsys):
    rng = np.random.default_rng(1)
    words = ["hello", "world", "the", "quick", "brown", "fox", "Paris", "dog"]
    records = [{"prompt": [user(" ".join(rng.choice(words, rng.integers(1, 30))))],
                "chosen": [assistant(" ".join(rng.choice(words, rng.integers(1, 40))))],
                "rejected": [assistant(" ".join(rng.choice(words, rng.integers(1, 40))) + " no")]}
               for _ in range(120)]
    source, out = write_jsonl(tmp_path / "many.jsonl", records), tmp_path / "many.sft.u16.bin"
    argv = ["--preference", "--tokenizer", str(tokenizers_root / "qwen25"), "--seq-len", "160", "-o", str(out),
            str(source)]
    assert tokens_cli.main(argv) == 0
    line = capsys.readouterr().out
    pairs = file_pairs(out)  # each pair in one row, chosen then rejected, masks on the completions
    info = json.loads((tmp_path / "many.sft.u16.bin.json").read_text())
    assert info["read"] == 120 and info["dropped"] > 0 and info["pairs"] == 120 - info["dropped"] == len(pairs)
    assert f"120 pairs read, 0 skipped, 0 truncated, {info['dropped']} dropped" in line
    rows = load_packed(out)
    # the trained targets are the completions' tokens but the first token of a segment, as SFT's
    assert info["trained_tokens"] == trained_targets(rows.segments, rows.labels).sum() == \
        sum(len(c) + len(r) for _, c, r in pairs)
    assert tokens_cli.main(argv + ["--truncate", "--overwrite"]) == 0
    assert f"120 pairs read, 0 skipped, {info['dropped']} truncated, 0 dropped" in capsys.readouterr().out
    assert len(file_pairs(out)) == 120


BAD = [
    ("not json", "{\"chosen\": ", "is not JSON"),
    ("missing field", {"prompt": "a", "chosen": "b"}, "has no 'rejected' field"),
    ("wrong type", {"prompt": "a", "chosen": 3, "rejected": "c"}, "field 'chosen' holds int, not text or a list"),
    ("same", {"prompt": "a", "chosen": " b", "rejected": " b"}, "has chosen equal to rejected"),
    ("empty completion", {"prompt": "a", "chosen": "  ", "rejected": " c"}, "has an empty chosen completion"),
    ("empty message", {"prompt": [user("a")], "chosen": [assistant("")], "rejected": [assistant("c")]},
     "has an empty chosen completion"),
    ("empty prompt", {"prompt": "", "chosen": "b", "rejected": "c"}, "has an empty prompt"),
    ("no common prompt", {"chosen": "b", "rejected": "c"}, "share no beginning"),
    ("mixed kinds", {"prompt": "a", "chosen": "b", "rejected": [assistant("c")]}, "of different kinds"),
    ("prompt ends with the system", {"prompt": [{"role": "system", "content": "a"}], "chosen": [assistant("c")],
                                     "rejected": [assistant("d")]}, "has a prompt whose last turn is the system's"),
    ("unknown role", {"prompt": [{"role": "robot", "content": "a"}], "chosen": [assistant("c")],
                      "rejected": [assistant("d")]}, "prompt[0] has the unknown role 'robot'"),
    ("tools", {"prompt": "a", "chosen": "b", "rejected": "c", "tools": [{"name": "f"}]}, "has a 'tools' field"),
]


@pytest.mark.parametrize("name, line, words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_line_stops_with_its_place_or_is_skipped_and_counted(tokenizers_root, tmp_path, capsys, name,
                                                                   line, words):
    good = {"prompt": [user("hello world")], "chosen": [assistant("Paris")], "rejected": [assistant("dog")]}
    text = json.dumps(good) + "\n\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n" + json.dumps(good)
    source = tmp_path / "bad.jsonl"
    source.write_text(text + "\n")
    out = tmp_path / "bad.sft.u16.bin"
    argv = ["--preference", "--tokenizer", str(tokenizers_root / "qwen25"), "--seq-len", "256", "-o", str(out),
            str(source)]
    assert tokens_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{source}:3 " in err and words in err and "--on-bad-example skip" in err
    assert not out.exists()
    assert tokens_cli.main(argv + ["--on-bad-example", "skip"]) == 0
    printed = capsys.readouterr().out
    assert f"skipped {source}:3 " in printed and "2 pairs read, 1 skipped" in printed


def test_a_file_keeps_one_kind_and_messages_need_a_template(tokenizers_root, tmp_path, capsys):
    mixed = [FORMATS["standard"][0], FORMATS["conversational"][0]]
    with pytest.raises(DataError, match=r"mixed.jsonl:2 holds lists of messages, but the first pair of .* holds "
                                        r"text; keep one kind to a file"):
        preference.make_preference_file(tmp_path / "m.sft.u16.bin", [write_jsonl(tmp_path / "mixed.jsonl", mixed)],
                                        tokenizers_root / "qwen25", 256)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tokenizers_root / "qwen25" / "tokenizer.json").read_bytes())
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    standard = write_jsonl(tmp_path / "s.jsonl", FORMATS["standard"])
    info = preference.make_preference_file(tmp_path / "s.sft.u16.bin", [standard], bare, 256)  # no template needed
    assert info["pairs"] == 3 and info["chat_template"] is None
    with pytest.raises(DataError, match=r"c.jsonl:1 holds messages, and the tokenizer has no chat template"):
        preference.make_preference_file(tmp_path / "c.sft.u16.bin",
                                        [write_jsonl(tmp_path / "c.jsonl", FORMATS["conversational"])], bare, 256)


@pytest.mark.parametrize("reader", ["preference", "chat"])
def test_huge_and_deeply_nested_lines_are_bad_lines(tmp_path, monkeypatch, reader):
    """Untrusted files: a line past MAX_LINE_BYTES is read a bounded piece at a time and refused, and
    JSON nested a hundred thousand deep is a bad line, not a RecursionError (both readers)."""
    monkeypatch.setattr(chat, "MAX_LINE_BYTES", 200_000)
    good = ({"prompt": "a", "chosen": " b", "rejected": " c"} if reader == "preference"
            else {"messages": [user("a"), assistant("b")]})
    source = tmp_path / "u.jsonl"
    source.write_text("\n".join([json.dumps(good), "[" * 100_000, json.dumps({"pad": "x" * 500_000}),
                                 json.dumps(good)]) + "\n")
    bad = chat.BadLines(skip=True)
    read = (list(preference.read_pairs(source, bad)) if reader == "preference"
            else list(chat.read_conversations(source, None, bad)))
    assert [where for _, where in read] == [f"{source}:1", f"{source}:4"]
    assert bad.named == [f"{source}:2 nests its JSON deeper than any example does",
                         f"{source}:3 is over 200,000 bytes, longer than any example trains at"]


@pytest.mark.parametrize("flag, words", [
    (["--chat"], "--chat does not apply to --preference: pass one of --chat (conversations) and --preference"),
    (["--train-on-prompt"], "--train-on-prompt does not apply to --preference: DPO trains on the completions only"),
    (["--chat-format", "messages"], "--chat-format does not apply to --preference"),
    (["--field", "body"], "--field does not apply to --preference"),
    (["--max-bytes", "9"], "--max-bytes does not apply to --preference"),
])
def test_flags_that_make_no_sense_for_preference_are_one_line(tokenizers_root, tmp_path, capsys, flag, words):
    source = write_jsonl(tmp_path / "p.jsonl", FORMATS["standard"])
    argv = ["--preference", "--tokenizer", str(tokenizers_root / "qwen25"), "--seq-len", "64",
            "-o", str(tmp_path / "p.sft.u16.bin"), str(source), *flag]
    assert tokens_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err
    assert tokens_cli.main(["--preference", "-o", str(tmp_path / "p.sft.u16.bin"), str(source)]) == 2
    assert "--preference needs --tokenizer DIR" in capsys.readouterr().err


def test_a_template_that_renders_chosen_and_rejected_alike_is_a_bad_line(tokenizers_root, tmp_path):
    roles_only = tmp_path / "roles.jinja"
    roles_only.write_text("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}")
    source = write_jsonl(tmp_path / "c.jsonl", FORMATS["conversational"][:1])
    with pytest.raises(DataError, match=r"c.jsonl:1 renders chosen and rejected as the same tokens with the chat "
                                        r"template .*roles.jinja; fix it or pass --on-bad-example skip"):
        preference.make_preference_file(tmp_path / "c.sft.u16.bin", [source], tokenizers_root / "qwen25", 256,
                                        chat_template=roles_only)


@pytest.mark.slow
def test_the_readme_example_from_pairs_to_a_chat(tmp_path, capsys):
    """README's "Preference tuning" example at a tiny size: conversational pairs -> pstar-tokens
    --preference -> pstar-train --objective dpo with LoRA (chunks moving) -> the merged export
    answers through pstar-generate --chat. DPO starts at ln 2 with rewards 0 (the adapters add
    nothing at step 0, so policy = reference) and learns to prefer the chosen answers."""
    from pstar_jax.cli.generate import main as generate_main
    from pstar_jax.cli.train import main as train_main
    from test_sft import chat_checkpoint
    src = chat_checkpoint(tmp_path)
    prompts = ["What is the capital of France?", "hello world", "héllo", "def f(x): return x * 2"]
    write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": [user(p)], "chosen": [assistant("Paris is the capital.")],
         "rejected": [assistant(f"the lazy dog {i}")]} for i, p in enumerate(prompts * 25)])
    packed = tmp_path / "pairs.sft.u16.bin"
    assert tokens_cli.main(["--preference", "--tokenizer", str(src), "--seq-len", "128", "--truncate",
                            str(tmp_path / "pairs.jsonl"), "-o", str(packed)]) == 0
    capsys.readouterr()
    metrics, out = tmp_path / "dpo.jsonl", tmp_path / "merged"
    code = train_main(["--init-from-hf", str(src), "--data", str(packed), "--seq-len", "128", "--objective", "dpo",
                       "--lora-rank", "4", "--batch-size", "8", "--steps", "12", "--lr", "3e-3",
                       "--metrics-out", str(metrics), "--export-lora", str(tmp_path / "adapter"),
                       "--export-hf", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert len(steps) == 12
    assert abs(steps[0]["loss"] - np.log(2)) < 1e-5 and steps[0]["rewards/margins"] == 0
    assert steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["rewards/accuracies"] > 0.5
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    capsys.readouterr()
    code = generate_main(["--hf", str(out), "--chat", "--prompt", "What color is the sky?", "--max-new-tokens", "6",
                          "--temperature", "0"])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err, captured.err
