"""Preference pairs in TRL's formats to a packed preference file, as ``pstar-tokens --preference`` makes one.

A JSONL line holds one pair, in one of the formats TRL's DPOTrainer (0.27) reads:

- standard: ``prompt``, ``chosen``, ``rejected`` strings;
- conversational: ``prompt`` a list of messages, ``chosen`` and ``rejected`` lists of messages (the
  completions, one assistant turn as a rule);
- implicit prompt: ``chosen`` and ``rejected`` only, strings or message lists; the prompt is their
  common beginning as TRL's ``extract_prompt`` finds it (messages, or characters backing off one
  space). A text ``prompt`` beside message lists is ignored as TRL ignores it (implicit prompt).

A pair becomes tokens as TRL's ``_prepare_dataset`` makes them: a conversational one is rendered with
the checkpoint's chat template (``maybe_apply_chat_template``: the prompt with the generation prompt,
or continued where it ends with an assistant turn; prompt + chosen and prompt + rejected whole; each
completion's text the rest after their common beginning); prompt, chosen and rejected are then
tokenized apart without special tokens (``tokenize_row``; a template writes its own BOS), and a
standard pair's completions end in the EOS id. No BOS is added to a standard pair, as TRL adds none
for a decoder.

In the file a pair is two consecutive segments of one row, chosen first: prompt + chosen, then prompt +
rejected, labelled 1 exactly on the completion tokens (pstar_jax.data.packing). The row is the pair's
budget: ``2 * len(prompt) + len(chosen) + len(rejected) <= seq_len + 1``. A longer pair is dropped, or
with ``truncate`` cut as TRL's ``max_prompt_length`` and ``max_completion_length`` cut (``truncate_pair``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from pstar_jax.config.errors import DataError
from pstar_jax.data import packing
from pstar_jax.data.chat import ROLES, BadExample, BadLines, Conversation, _check_text, _turns, jsonl_records
from pstar_jax.data.sft import BATCH_EXAMPLES, Counts, check_request, write_examples  # (Counts: pairs here)
from pstar_jax.data.template import ChatTemplate

Text = str | Conversation


@dataclasses.dataclass(frozen=True)
class Pair:
    """One preference pair after prompt extraction: all three text, or all three message lists."""

    prompt: Text
    chosen: Text
    rejected: Text

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


def extract_prompt(chosen: Text, rejected: Text) -> Pair:
    """TRL's ``extract_prompt``: the longest common beginning of chosen and rejected is the prompt
    (texts back off one space, which stays with the completions). As TRL's loop does, where one is
    a beginning of the other the prompt stops one item short of the shorter."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    if idx <= 0:
        raise BadExample("has chosen and rejected that share no beginning, so no prompt; give a 'prompt' field")
    return Pair(chosen[:idx], chosen[idx:], rejected[idx:])


def _value(record: dict, field: str) -> Text:
    """A field as text or as a message list (checked as the SFT reader checks them)."""
    if field not in record:
        raise BadExample(f"has no {field!r} field")
    value = record[field]
    if isinstance(value, str):
        _check_text(value, f"field {field!r}")
        return value
    if isinstance(value, list):
        if not value:
            raise BadExample(f"field {field!r} is an empty list of messages")
        return _turns(value, field, "role", "content", {r: r for r in ROLES})
    raise BadExample(f"field {field!r} holds {type(value).__name__}, not text or a list of messages")


def to_pair(record: Any) -> Pair:
    """The pair a JSON record holds, its prompt extracted as TRL's ``maybe_extract_prompt`` does;
    BadExample says what is wrong with it."""
    if not isinstance(record, dict):
        raise BadExample(f"is {type(record).__name__}, not a JSON object")
    for field in ("tools", "chat_template_kwargs", "images"):
        if record.get(field):
            raise BadExample(f"has a {field!r} field, which pstar-tokens --preference does not read (template "
                             f"variables for every line go in --chat-template-kwargs)")
    chosen, rejected = _value(record, "chosen"), _value(record, "rejected")
    if isinstance(chosen, list) != isinstance(rejected, list):
        raise BadExample("has chosen and rejected of different kinds (one text, one a list of messages)")
    if chosen == rejected:
        raise BadExample("has chosen equal to rejected, so the pair prefers nothing")
    prompt = _value(record, "prompt") if "prompt" in record else None
    if prompt is None or isinstance(prompt, list) != isinstance(chosen, list):
        pair = extract_prompt(chosen, rejected)
    else:
        pair = Pair(prompt, chosen, rejected)
    if not pair.prompt:
        raise BadExample("has an empty prompt")
    for name in ("chosen", "rejected"):
        value = getattr(pair, name)
        if not value or (isinstance(value, str) and not value.strip()) or \
                (isinstance(value, list) and any(not m["content"].strip() for m in value)):
            raise BadExample(f"has an empty {name} completion")
    if pair.conversational and pair.prompt[-1]["role"] == "system":  # TRL's ValueError
        raise BadExample("has a prompt whose last turn is the system's; end it with the user's turn the completions "
                         "answer")
    return pair


def read_pairs(path: str | os.PathLike, bad: BadLines) -> Iterator[tuple[Pair, str]]:
    """(pair, "FILE:LINE") for each usable line of a JSONL file. As TRL decides for a whole data set
    from its first example, the file's first pair says whether its pairs are conversational; a line
    of the other kind is a bad line."""
    conversational = None
    for record, where in jsonl_records(path, bad):
        try:
            pair = to_pair(record)
            if conversational is None:
                conversational = pair.conversational
            elif pair.conversational != conversational:
                kinds = ("text", "lists of messages")
                raise BadExample(f"holds {kinds[pair.conversational]}, but the first pair of {path} holds "
                                 f"{kinds[conversational]}; keep one kind to a file")
        except BadExample as e:
            bad.add(where, str(e))
            continue
        yield pair, where


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def rendered(pair: Pair, template: ChatTemplate | None, where: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) texts as TRL's ``maybe_apply_chat_template`` gives them."""
    if not pair.conversational:
        return pair.prompt, pair.chosen, pair.rejected
    if template is None:
        raise DataError(f"{where} holds messages, and the tokenizer has no chat template to render them; pass "
                        f"--chat-template FILE")
    # TRL continues a prompt's final assistant turn (a prefilled answer), otherwise adds the generation prompt
    prompt = (_render_continued(template, pair.prompt) if pair.prompt[-1]["role"] == "assistant"
              else template.render(pair.prompt, add_generation_prompt=True))
    prompt_chosen = template.render(pair.prompt + pair.chosen)
    prompt = _common_prefix(prompt, prompt_chosen)  # TRL's order: chosen is cut after this prompt
    chosen = prompt_chosen[len(prompt):]
    prompt_rejected = template.render(pair.prompt + pair.rejected)
    prompt = _common_prefix(prompt, prompt_rejected)
    return prompt, chosen, prompt_rejected[len(prompt):]


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _render_continued(template: ChatTemplate, conversation: Conversation) -> str:
    """transformers' ``apply_chat_template(continue_final_message=True)``: the text up to the end of
    the final message, without what the template closes it with (found by a tag rendered after it)."""
    final = conversation[-1]["content"]
    text = template.render(conversation[:-1] + [{**conversation[-1], "content": final + _CONTINUE_TAG}])
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise BadExample(f"ends its prompt with an assistant turn that the chat template {template.name} does not "
                         f"render whole, so it cannot be continued")
    at = text.rindex(_CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def truncate_pair(prompt_len: int, chosen_len: int, rejected_len: int, row_len: int) -> tuple[int, int]:
    """(max_prompt_length, max_completion_length) that fit a pair in a row of ``row_len``, as TRL's
    ``tokenize_row`` applies them: the prompt keeps its last tokens, each completion its first. The
    prompt is cut only as far as whole completions need, and not below a quarter of the row; the
    completions then keep the most tokens that fit."""
    if 2 * prompt_len + chosen_len + rejected_len <= row_len:
        return prompt_len, max(chosen_len, rejected_len)
    kept_prompt = min(prompt_len, max(row_len // 4, (row_len - chosen_len - rejected_len) // 2))
    room = row_len - 2 * kept_prompt  # for both completions
    if chosen_len + rejected_len <= room:
        return kept_prompt, max(chosen_len, rejected_len)
    # the largest C with min(chosen, C) + min(rejected, C) <= room
    return kept_prompt, max(room // 2, room - min(chosen_len, rejected_len))


def _batches(pairs: Iterable[tuple[Pair, str]], template: ChatTemplate | None, bad: BadLines
             ) -> Iterator[list[tuple[tuple[str, str, str], bool, str]]]:
    batch = []
    for pair, where in pairs:
        try:
            texts = rendered(pair, template, where)
        except BadExample as e:
            bad.add(where, str(e))
            continue
        batch.append((texts, pair.conversational, where))
        if len(batch) >= BATCH_EXAMPLES:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_pairs(pairs: Iterable[tuple[Pair, str]], tokenizer: Any, eos_id: int, row_len: int, *,
                 template: ChatTemplate | None = None, truncate: bool = False, bad: BadLines | None = None,
                 counts: Counts | None = None) -> packing.Examples:
    """The sequences of the pairs that fit ``row_len`` positions, prompt + chosen then prompt +
    rejected for each, labelled on the completions (``tokenizer`` a ``tokenizers.Tokenizer``)."""
    bad, counts = bad if bad is not None else BadLines(), counts if counts is not None else Counts()
    tokens, labels, lengths = [], [], []  # flat per batch: a few bytes a token for millions of pairs
    for batch in _batches(pairs, template, bad):
        texts = [t for texts, _, _ in batch for t in texts]
        encoded = [np.asarray(e.ids, np.uint32) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        kept: list[np.ndarray] = []
        for i, (_, conversational, where) in enumerate(batch):
            prompt, chosen, rejected = encoded[3 * i:3 * i + 3]
            if not conversational:  # TRL appends the EOS id to a text completion, always
                chosen, rejected = (np.append(ids, np.uint32(eos_id)) for ids in (chosen, rejected))
            reason = ("renders its chosen completion as no token" if not len(chosen) else
                      "renders its rejected completion as no token" if not len(rejected) else
                      "renders chosen and rejected as the same tokens" if np.array_equal(chosen, rejected) else None)
            if reason:
                bad.add(where, f"{reason}{' with the chat template ' + template.name if conversational else ''}")
                continue
            counts.read += 1
            if 2 * len(prompt) + len(chosen) + len(rejected) > row_len:
                if not truncate:
                    counts.dropped += 1
                    continue
                max_prompt, max_completion = truncate_pair(len(prompt), len(chosen), len(rejected), row_len)
                prompt, chosen, rejected = prompt[len(prompt) - max_prompt:], chosen[:max_completion], \
                    rejected[:max_completion]
                counts.truncated += 1
            kept += [prompt, chosen, prompt, rejected]
        if kept:
            tokens.append(np.concatenate(kept))
            labels.append(np.concatenate([np.full(len(part), i % 2, np.uint8) for i, part in enumerate(kept)]))
            lengths.append(np.add.reduceat([len(part) for part in kept], np.arange(0, len(kept), 2)))
    counts.skipped = bad.count
    return packing.Examples.concatenate(tokens, labels, lengths)


def place_pairs(lengths: np.ndarray, row_len: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``packing.assign_rows`` for pairs: ``lengths`` alternate chosen, rejected; each pair is placed
    as one whole, its rejected sequence right after its chosen one (so segments 2k - 1 and 2k)."""
    chosen, rejected = lengths[0::2], lengths[1::2]
    pair_row, pair_offset, rows = packing.assign_rows(chosen + rejected, row_len, seed)
    row_of, offset_of = np.repeat(pair_row, 2), np.repeat(pair_offset, 2)
    offset_of[1::2] += chosen
    return row_of, offset_of, rows


def make_preference_file(out: str | os.PathLike, inputs: Sequence[str | os.PathLike], tokenizer_dir: str | os.PathLike,
                         seq_len: int, *, chat_template: str | os.PathLike | None = None, truncate: bool = False,
                         on_bad_example: str = "error", seed: int = 0, eos_token: str | None = None,
                         overwrite: bool = False, chat_template_kwargs: dict | None = None) -> dict:
    """Writes packed preference file ``out`` from preference JSONL ``inputs``; returns its sidecar,
    with ``skipped_named`` (the first bad lines) and ``seconds``."""
    from pstar_jax.data.tokenizer import load_tokenizer
    start = time.perf_counter()
    out, inputs = Path(out), [Path(p) for p in inputs]
    check_request(out, inputs, seq_len, seed, on_bad_example, "preference JSONL")
    encoder = load_tokenizer(tokenizer_dir, eos_token)
    template = (ChatTemplate.from_tokenizer_dir(tokenizer_dir, chat_template, eos_token, chat_template_kwargs)
                if chat_template is not None or _has_template(Path(tokenizer_dir)) else None)
    packing.check_packed_destination(out, encoder.vocab_size, overwrite)  # before the work, not after
    bad, counts = BadLines(skip=on_bad_example == "skip"), Counts()
    pairs = (item for path in inputs for item in read_pairs(path, bad))
    examples = encode_pairs(pairs, encoder.tokenizer, encoder.eos_id, seq_len + 1, template=template,
                            truncate=truncate, bad=bad, counts=counts)
    if not counts.read:
        raise DataError(f"the inputs hold no usable pair ({counts.skipped} skipped), so {out} was not written")
    if not len(examples.lengths):
        raise DataError(f"no pair fits --seq-len {seq_len} ({counts.read} read, {counts.skipped} skipped, "
                        f"{counts.dropped} dropped; a pair takes 2 prompts and both completions), so {out} was not "
                        f"written; raise --seq-len or pass --truncate")
    placement = place_pairs(examples.lengths, seq_len + 1, seed)
    info = write_examples(
        out, examples, placement, seq_len, encoder.vocab_size, overwrite, preference=True,
        pairs=int(len(examples.lengths) // 2), eos_id=encoder.eos_id, tokenizer=str(Path(tokenizer_dir).resolve()),
        chat_template=template.name if template else None, chat_template_sha256=template.sha256 if template else None,
        chat_template_kwargs=template.kwargs if template else {}, read=counts.read, skipped=counts.skipped,
        dropped=counts.dropped, truncated=counts.truncated, truncation="prompt keeps its end, completions their start",
        seed=seed, end_of_turn_ids=template.end_of_turn_ids() if template else [])
    return {**info, "skipped_named": bad.named, "seconds": time.perf_counter() - start}


def _has_template(tokenizer_dir: Path) -> bool:
    """Whether the tokenizer directory has a chat template of its own (a standard-format file needs none)."""
    from pstar_jax.data.template import _read_json
    directory = tokenizer_dir.parent if tokenizer_dir.is_file() else tokenizer_dir
    if (directory / "chat_template.jinja").is_file():
        return True
    config = directory / "tokenizer_config.json"
    return config.is_file() and bool(_read_json(config).get("chat_template"))


def summary(out: str | os.PathLike, info: dict) -> str:
    """The one line pstar-tokens --preference prints."""
    seconds = max(info["seconds"], 1e-9)
    return (f"wrote {out}: {info['read']:,} pairs read, {info['skipped']:,} skipped, {info['truncated']:,} "
            f"truncated, {info['dropped']:,} dropped; {info['pairs']:,} pairs in {info['rows']:,} rows of "
            f"{info['seq_len'] + 1:,}, {info['tokens']:,} tokens, {info['trained_tokens']:,} trained; packing "
            f"efficiency {100 * info['real_position_fraction']:.1f}%; {info['read'] / seconds:,.0f} pairs/s")
