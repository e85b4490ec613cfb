"""pstar_jax.data.chat: the four formats and their bad lines; ids equal to transformers' apply_chat_template
for Llama 3.1, Qwen2.5 and Mistral templates; the trained mask exactly the assistant's turns."""

import json

import numpy as np
import pytest

from chat_fixtures import CONVERSATIONS, TEMPLATES, tokenizer_dir
from pstar_jax.data.chat import BadExample, BadLines, read_conversations
from pstar_jax.data.template import ChatTemplate
from pstar_jax.config.errors import DataError


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    out = {name: tokenizer_dir(root, name) for name in TEMPLATES}
    out["qwen25-marks"] = tokenizer_dir(root, "qwen25", generation_marks=True)
    return out


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _hf_ids(tokenizer, conversation, **kwargs):
    out = tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _runs(template, ids, labels):
    """The decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for i, trained in zip(ids.tolist(), labels.tolist()):
        if trained:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [template.tokenizer.decode(r, skip_special_tokens=False) for r in runs]


# What each template trains of an assistant turn: its content and the tokens that end the turn.
EXPECTED_TURN = {
    "llama31": lambda content: content.strip() + "<|eot_id|>",  # the template trims the content
    "qwen25": lambda content: content + "<|im_end|>\n",
    "mistral": lambda content: " " + content + "</s>",
    "gemma3": lambda content: content.strip() + "<end_of_turn>\n",  # trimmed too; the turn's newline with it
    "qwen25-marks": lambda content: content + "<|im_end|>",  # the marks leave the newline out
}


@pytest.mark.parametrize("name", ["llama31", "qwen25", "mistral", "gemma3", "qwen25-marks"])
def test_ids_equal_transformers_and_the_mask_is_the_assistant_turns(dirs, name):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(dirs[name])
    template = ChatTemplate.from_tokenizer_dir(dirs[name])
    assert template.has_generation_marks == name.endswith("marks")
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            assert template.encode(template.render(conversation, prompt)) == \
                _hf_ids(reference, conversation, add_generation_prompt=prompt), (name, prompt)
        ids, labels = template.encode_with_mask(conversation)
        assert ids.dtype == np.uint32 and labels.dtype == np.uint8
        assert ids.tolist() == _hf_ids(reference, conversation)
        answers = [m["content"] for m in conversation if m["role"] == "assistant"]
        assert _runs(template, ids, labels) == [EXPECTED_TURN[name](a) for a in answers]
        if template.has_generation_marks:
            masked = reference.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
            assert list(masked["assistant_masks"]) == labels.tolist()
        ids_all, labels_all = template.encode_with_mask(conversation, train_on_prompt=True)
        assert ids_all.tolist() == ids.tolist() and labels_all.all()


def test_llama31_writes_its_date_header_and_bos(dirs):
    template = ChatTemplate.from_tokenizer_dir(dirs["llama31"])
    text = template.render(CONVERSATIONS[0], add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge "
                           "Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert template.encode(text)[0] == template.tokenizer.token_to_id("<|begin_of_text|>")  # once, by the template


@pytest.mark.parametrize("name", ["llama31", "qwen25", "mistral", "gemma3"])
def test_end_of_turn_token(dirs, name):
    template = ChatTemplate.from_tokenizer_dir(dirs[name])
    assert template.end_of_turn_ids() == [template.tokenizer.token_to_id(TEMPLATES[name][4])]


def test_template_sources(dirs, tmp_path):
    source = dirs["qwen25"]
    config = json.loads((source / "tokenizer_config.json").read_text())
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    # The list form: the 'default' one.
    listed = dict(config, chat_template=[{"name": "tool_use", "template": "x"},
                                         {"name": "default", "template": config["chat_template"]}])
    (d / "tokenizer_config.json").write_text(json.dumps(listed))
    assert ChatTemplate.from_tokenizer_dir(d).source == config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=[{"name": "a", "template": "x"}])))
    with pytest.raises(DataError, match="no 'default' one; pass --chat-template"):
        ChatTemplate.from_tokenizer_dir(d)
    # chat_template.jinja beside it, and --chat-template over both.
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert ChatTemplate.from_tokenizer_dir(d).render(CONVERSATIONS[0]) == "What is the capital of France?"
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}{{ m.role }}{% endfor %}")
    assert ChatTemplate.from_tokenizer_dir(d, own).render(CONVERSATIONS[0]) == "userassistant"
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match=r"has no chat template .*; pass --chat-template FILE"):
        ChatTemplate.from_tokenizer_dir(d)


def test_tojson_raise_exception_and_strftime_now_are_transformers(dirs, tmp_path):
    import datetime
    own = tmp_path / "t.jinja"
    own.write_text("{{ messages | tojson }}{% if messages | length > 2 %}{{ raise_exception('too long') }}{% endif %}"
                   "{{ strftime_now('|%Y') }}")
    template = ChatTemplate.from_tokenizer_dir(dirs["qwen25"], own)
    conv = [{"role": "user", "content": "<b>é</b>"}]
    year = datetime.datetime.now().year
    assert template.render(conv) == json.dumps(conv, ensure_ascii=False) + f"|{year}"  # no HTML escaping
    with pytest.raises(BadExample, match="is refused by the chat template .*: too long"):
        template.render(conv * 3)
    own.write_text("{{ messages[0].content + 1 }}")  # the template's own error: a bad line, not a traceback
    with pytest.raises(BadExample, match="is refused by the chat template"):
        ChatTemplate.from_tokenizer_dir(dirs["qwen25"], own).render(conv)


def test_inconsistent_template_is_refused(dirs, tmp_path):
    own = tmp_path / "bad.jinja"  # the turn count leads the text, so a prefix renders differently
    own.write_text("{{ messages | length }}{% for m in messages %}|{{ m.content }}{% endfor %}")
    template = ChatTemplate.from_tokenizer_dir(dirs["qwen25"], own)
    with pytest.raises(DataError, match=r"the chat template .*bad.jinja renders the first turns"):
        template.encode_with_mask(CONVERSATIONS[0])
    assert template.encode_with_mask(CONVERSATIONS[0], train_on_prompt=True)[1].all()


FORMATS = {
    "messages": ({"messages": CONVERSATIONS[1]}, CONVERSATIONS[1]),
    "alpaca": ({"instruction": "Say", "input": "hi", "output": "hi!", "system": "Be brief."},
               [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say\n\nhi"},
                {"role": "assistant", "content": "hi!"}]),
    "sharegpt": ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
                 [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]),
    "prompt-completion": ({"prompt": "p", "completion": "c"},
                          [{"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_formats_are_detected_and_chosen(tmp_path, fmt):
    record, want = FORMATS[fmt]
    path = _jsonl(tmp_path / "d.jsonl", ["", record, record])
    got = list(read_conversations(path))
    assert [c for c, _ in got] == [want, want] and [w for _, w in got] == [f"{path}:2", f"{path}:3"]
    assert [c for c, _ in read_conversations(path, fmt)] == [want, want]
    other = next(f for f in FORMATS if f != fmt)
    with pytest.raises(DataError, match=f"{path}:2 has no"):
        list(read_conversations(path, other))


BAD = [
    ("{not json", "is not JSON"),
    ({"messages": [{"role": "user", "content": "a"}]}, "has no assistant turn"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, "unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]}, "empty assistant turn"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]}, "holds int, not text"),
    ({"messages": "hi"}, "holds str, not a list of turns"),
    ({"messages": [{"role": "user"}]}, "has no 'content'"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "b"}]}',
     "messages[0].content holds an unpaired surrogate escape"),
    ({"text": "plain"}, "has no 'messages' field"),
]


def test_bad_lines_are_named_or_skipped(tmp_path):
    good = {"messages": CONVERSATIONS[0]}
    for record, reason in BAD:
        path = _jsonl(tmp_path / "bad.jsonl", [good, record, good])
        with pytest.raises(DataError) as err:
            list(read_conversations(path))
        assert str(err.value).startswith(f"{path}:2 ") and reason in str(err.value)
        assert str(err.value).count("\n") == 0 and "--on-bad-example skip" in str(err.value)
    path = _jsonl(tmp_path / "first.jsonl", [{"text": "plain"}, good])
    with pytest.raises(DataError, match=f"{path}:1 has none of the fields .* --chat-format"):
        list(read_conversations(path))
    path = _jsonl(tmp_path / "all.jsonl", [good] + [r for r, _ in BAD] + [good])
    bad = BadLines(skip=True, keep=3)
    assert len(list(read_conversations(path, "messages", bad))) == 2
    assert bad.count == len(BAD) and len(bad.named) == 3 and bad.named[0].startswith(f"{path}:2 is not JSON")


# The assistant's part of each template wrapped in {% generation %}: what the prefix renders find.
MARKED = {
    "llama31": ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
                "'<|eot_id|>' }}",
                "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}{% if message.role == "
                "'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
                "{% else %}{{- message['content'] | trim + '<|eot_id|>' }}{% endif %}"),
    "qwen25": ("{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
               "{{- '<|im_start|>' + message.role + '\\n' }}{% if message.role == 'assistant' %}{% generation %}"
               "{{- message.content + '<|im_end|>' + '\\n' }}{% endgeneration %}{% else %}"
               "{{- message.content + '<|im_end|>' + '\\n' }}{% endif %}"),
    "mistral": ("{{- ' ' + message['content'] + eos_token}}",
                "{% generation %}{{- ' ' + message['content'] + eos_token}}{% endgeneration %}"),
}


@pytest.mark.parametrize("name", list(MARKED))
def test_prefix_spans_equal_transformers_mask_of_the_marked_template(dirs, name):
    """The mask found from prefix renders is, token for token, transformers' own assistant mask for the
    same template with the assistant's part marked."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(dirs[name])
    old, new = MARKED[name]
    source = TEMPLATES[name][0]
    assert source.count(old) == 1
    marked = source.replace(old, new)
    template = ChatTemplate.from_tokenizer_dir(dirs[name])
    assert not template.has_generation_marks
    for conversation in CONVERSATIONS:
        ids, labels = template.encode_with_mask(conversation)
        out = reference.apply_chat_template(conversation, chat_template=marked, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert list(out["input_ids"]) == ids.tolist() and list(out["assistant_masks"]) == labels.tolist()


def test_assistant_first_conversation_names_what_to_change(dirs):
    first = [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "Paris."}]
    for name in ("llama31", "qwen25"):  # both read messages[0], so the empty prefix does not render
        template = ChatTemplate.from_tokenizer_dir(dirs[name])
        with pytest.raises(BadExample) as err:
            template.encode_with_mask(first)
        assert str(err.value).startswith(f"opens with an assistant turn, and the chat template {template.name} "
                                         f"cannot render the empty conversation before it") and "\n" not in str(err.value)
    with pytest.raises(BadExample, match="roles must alternate"):  # Mistral's template says so itself
        ChatTemplate.from_tokenizer_dir(dirs["mistral"]).encode_with_mask(first)
    template = ChatTemplate.from_tokenizer_dir(dirs["qwen25-marks"])  # marks need no prefix renders
    ids, labels = template.encode_with_mask(first)
    assert "Hello" in template.tokenizer.decode(ids[labels == 1].tolist(), skip_special_tokens=False)


QWEN3_REASONING = [{"role": "user", "content": "héllo"},
                   {"role": "assistant", "content": "<think>the lazy dog</think>ünïcode 123"},
                   {"role": "user", "content": "and?"},
                   {"role": "assistant", "content": "<think>\nhello world\n</think>\n\nthe quick brown fox"}]


def test_qwen3_trains_each_assistant_turn_in_the_text_the_model_writes_it_in(dirs):
    """Qwen3's template renders an assistant turn before the last user turn bare (its reasoning
    dropped) and the last one after a think block (empty without reasoning), so no render of a
    prefix begins the whole conversation: each assistant turn becomes an example of its own, the
    conversation through that turn, token for token transformers' apply_chat_template of it, with
    only that turn trained (think block and end of turn included)."""
    from pstar_jax.data.sft import Counts, encode_examples
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(dirs["qwen3"])
    template = ChatTemplate.from_tokenizer_dir(dirs["qwen3"])
    ids, labels = template.encode_with_mask(CONVERSATIONS[0])  # one assistant turn: one example
    assert ids.tolist() == _hf_ids(reference, CONVERSATIONS[0])
    assert _runs(template, ids, labels) == ["<think>\n\n</think>\n\nParis is the capital.<|im_end|>\n"]
    empty = "<think>\n\n</think>\n\n"
    for conversation, turns in ((CONVERSATIONS[2], [empty + "ünïcode 123", empty + "the lazy dog"]),
                                (QWEN3_REASONING, ["<think>\nthe lazy dog\n</think>\n\nünïcode 123",
                                                   "<think>\nhello world\n</think>\n\nthe quick brown fox"])):
        examples = template.encode_batch_with_mask(template.prepare(conversation))
        ends = [i + 1 for i, m in enumerate(conversation) if m["role"] == "assistant"]
        assert len(examples) == len(ends) == 2
        for (ids, labels), end, turn in zip(examples, ends, turns):
            assert ids.tolist() == _hf_ids(reference, conversation[:end])
            assert _runs(template, ids, labels) == [turn + "<|im_end|>\n"]
        with pytest.raises(DataError, match="as 2 examples, one per assistant turn"):
            template.encode_with_mask(conversation)
    history = template.tokenizer.decode(examples[1][0][examples[1][1] == 0].tolist(), skip_special_tokens=False)
    assert "ünïcode 123" in history and "lazy" not in history  # the first turn's reasoning left out, as Qwen3 does
    ids, labels = template.encode_with_mask(CONVERSATIONS[2], train_on_prompt=True)  # the whole text, once
    assert ids.tolist() == _hf_ids(reference, CONVERSATIONS[2]) and labels.all()
    counts = Counts()
    got = encode_examples([(c, f"x.jsonl:{n}") for n, c in enumerate(CONVERSATIONS, 1)], template, 4096, counts=counts)
    assert (counts.read, counts.split, len(got.lengths)) == (5, 2, 5)  # 1 + 2 + 2 examples
    qwen25 = ChatTemplate.from_tokenizer_dir(dirs["qwen25"])  # a prefix-stable template: one example each
    assert [len(qwen25.prepare(c)) for c in CONVERSATIONS] == [1, 1, 1]


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(dirs, tmp_path):
    """--chat-template-kwargs '{"enable_thinking": false}': Qwen3's generation prompt ends with the
    empty think block, as transformers' apply_chat_template(..., enable_thinking=False) writes it,
    so the block is prompt and the trained tokens are the answer and its end of turn; bad values
    are one line before any work."""
    from pstar_jax.data.template import parse_template_kwargs
    from pstar_jax.cli.tokens import main as tokens_main
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(dirs["qwen3"])
    kwargs = parse_template_kwargs('{"enable_thinking": false}')
    template = ChatTemplate.from_tokenizer_dir(dirs["qwen3"], kwargs=kwargs)
    prompt = template.render(CONVERSATIONS[0][:1], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.encode(prompt) == _hf_ids(reference, CONVERSATIONS[0][:1], add_generation_prompt=True,
                                              enable_thinking=False)
    ids, labels = template.encode_with_mask(CONVERSATIONS[0])
    assert _runs(template, ids, labels) == ["Paris is the capital.<|im_end|>\n"]
    examples = template.encode_batch_with_mask(template.prepare(CONVERSATIONS[2]))
    assert [_runs(template, i, m) for i, m in examples] == [["ünïcode 123<|im_end|>\n"], ["the lazy dog<|im_end|>\n"]]
    for text, words in (("{", "is not JSON"), ("[1]", "must be a JSON object"),
                        ('{"messages": []}', "may not set 'messages'"), ('{"a b": 1}', "is not a template variable name")):
        with pytest.raises(DataError, match=words) as err:
            parse_template_kwargs(text)
        assert "\n" not in str(err.value)
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    assert tokens_main(["--chat", "--tokenizer", str(dirs["qwen3"]), "--seq-len", "256", str(data), "-o",
                        str(tmp_path / "x.sft.u16.bin"), "--chat-template-kwargs", "{nope"]) == 2
    assert not (tmp_path / "x.sft.u16.bin").exists()
    assert tokens_main(["--chat", "--tokenizer", str(dirs["qwen3"]), "--seq-len", "256", str(data), "-o",
                        str(tmp_path / "x.sft.u16.bin"), "--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    sidecar = json.loads((tmp_path / "x.sft.u16.bin.json").read_text())
    assert sidecar["chat_template_kwargs"] == {"enable_thinking": False} and sidecar["split"] == 2
