"""Conversation JSONL files to a packed SFT file (pstar_jax.data.packing), as ``pstar-tokens --chat`` makes one.

Conversations are read (pstar_jax.data.chat), rendered with the checkpoint's chat template and tokenized
in batches; an example longer than a row (seq_len + 1 positions) is dropped, or with ``truncate``
cut to its first seq_len + 1 tokens (a bad line if no trained target remains). An example with no
trained target at all is the template's fault, an error naming both. The examples are held as flat
numpy arrays (a few bytes a token), packed, and written straight into the memory-mapped file.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from pstar_jax.data import packing
from pstar_jax.data.chat import BadExample, BadLines, Conversation, read_conversations
from pstar_jax.data.template import ChatTemplate
from pstar_jax.config.errors import DataError

BATCH_EXAMPLES = 512  # conversations per encode_batch call
# The longest training sequence a packed file is made for: 2**24 = 16.8M positions, past the longest
# context released (10M), and one row of it already takes 112 MiB on disk.
MAX_SEQ_LEN = 1 << 24


@dataclasses.dataclass
class Counts:
    read: int = 0
    skipped: int = 0
    truncated: int = 0
    dropped: int = 0
    split: int = 0  # conversations trained as one example per assistant turn (ChatTemplate.turn_examples)


def _prepared(conversations: Iterable[tuple[Conversation, str]], template: ChatTemplate, train_on_prompt: bool,
              bad: BadLines, counts: Counts) -> Iterator[list[tuple[tuple[str, list | None], str]]]:
    """Batches of (rendered text and trained spans, "FILE:LINE")."""
    batch = []
    for conversation, where in conversations:
        try:
            examples = template.prepare(conversation, train_on_prompt)
        except BadExample as e:
            bad.add(where, str(e))
            continue
        counts.split += len(examples) > 1
        batch += [(example, where) for example in examples]
        if len(batch) >= BATCH_EXAMPLES:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_examples(conversations: Iterable[tuple[Conversation, str]], template: ChatTemplate, row_len: int, *,
                    train_on_prompt: bool = False, truncate: bool = False, bad: BadLines | None = None,
                    counts: Counts | None = None) -> packing.Examples:
    """The examples (ids, labels) of ``conversations`` that fit ``row_len`` positions, counted in ``counts``."""
    bad, counts = bad if bad is not None else BadLines(), counts if counts is not None else Counts()
    tokens, labels, lengths = [], [], []
    for batch in _prepared(conversations, template, train_on_prompt, bad, counts):
        kept_ids, kept_labels = [], []
        prepared, wheres = zip(*batch)
        for (ids, mask), where in zip(template.encode_batch_with_mask(list(prepared)), wheres):
            if not mask[1:].any():  # position 0 is never a target
                raise DataError(_nothing_trained(where, template, train_on_prompt, len(ids)))
            if truncate and len(ids) > row_len and not mask[1:row_len].any():
                first = int(np.argmax(mask[1:])) + 1  # the first target: a row must reach it
                bad.add(where, f"has {len(ids):,} tokens and no assistant token among the {row_len:,} of a row, so "
                               f"--truncate keeps nothing of it to train; raise --seq-len to {first:,} or more")
                continue
            counts.read += 1
            if len(ids) > row_len:
                if not truncate:
                    counts.dropped += 1
                    continue
                ids, mask = ids[:row_len], mask[:row_len]
                counts.truncated += 1
            kept_ids.append(ids)
            kept_labels.append(mask)
        if kept_ids:
            tokens.append(np.concatenate(kept_ids))
            labels.append(np.concatenate(kept_labels))
            lengths.append(np.asarray([len(i) for i in kept_ids], np.int64))
    counts.skipped = bad.count
    return packing.Examples.concatenate(tokens, labels, lengths)


def _nothing_trained(where: str, template: ChatTemplate, train_on_prompt: bool, n_tokens: int) -> str:
    """Why ``where`` has no trained target (its assistant turns are never empty) and what to change."""
    if train_on_prompt:
        return (f"{where} renders as {n_tokens} token(s) with the chat template {template.name}, too few to train "
                f"on; the template drops its turns: give another (--chat-template FILE)")
    if template.has_generation_marks:
        return (f"{where}: the {{% generation %}} marks of the chat template {template.name} select no token of it, "
                f"so none of its assistant turns would be trained; make the marks enclose the assistant's replies "
                f"(--chat-template FILE) or pass --train-on-prompt")
    return (f"{where}: the chat template {template.name} renders none of its assistant turns as tokens to train; "
            f"give a template with {{% generation %}} marks (--chat-template FILE) or pass --train-on-prompt")


def make_sft_file(out: str | os.PathLike, inputs: Sequence[str | os.PathLike], tokenizer_dir: str | os.PathLike,
                  seq_len: int, *, chat_format: str | None = None, chat_template: str | os.PathLike | None = None,
                  train_on_prompt: bool = False, truncate: bool = False, on_bad_example: str = "error",
                  seed: int = 0, eos_token: str | None = None, overwrite: bool = False,
                  chat_template_kwargs: dict | None = None) -> dict:
    """Writes packed SFT file ``out`` from conversation JSONL ``inputs``; returns its sidecar, with
    ``skipped_named`` (the first bad lines) and ``seconds``."""
    start = time.perf_counter()
    out, inputs = Path(out), [Path(p) for p in inputs]
    check_request(out, inputs, seq_len, seed, on_bad_example, "conversation JSONL")
    template = ChatTemplate.from_tokenizer_dir(tokenizer_dir, chat_template, eos_token, chat_template_kwargs)
    packing.check_packed_destination(out, template.vocab_size, overwrite)  # before the work, not after
    bad, counts = BadLines(skip=on_bad_example == "skip"), Counts()
    conversations = (item for path in inputs for item in read_conversations(path, chat_format, bad))
    examples = encode_examples(conversations, template, seq_len + 1, train_on_prompt=train_on_prompt,
                               truncate=truncate, bad=bad, counts=counts)
    if not counts.read:
        raise DataError(f"the inputs hold no usable conversation ({counts.skipped} skipped), so {out} was not written")
    if not len(examples.lengths):
        raise DataError(f"no example fits --seq-len {seq_len} ({counts.read} read, {counts.skipped} skipped, "
                        f"{counts.dropped} dropped), so {out} was not written; raise --seq-len or pass --truncate")
    placement = packing.assign_rows(examples.lengths, seq_len + 1, seed)
    info = write_examples(
        out, examples, placement, seq_len, template.vocab_size, overwrite, eos_id=template.eos_id,
        tokenizer=str(Path(tokenizer_dir).resolve()), chat_template=template.name,
        chat_template_sha256=template.sha256, chat_template_kwargs=template.kwargs, read=counts.read,
        skipped=counts.skipped, dropped=counts.dropped, truncated=counts.truncated, split=counts.split,
        train_on_prompt=train_on_prompt, seed=seed, end_of_turn_ids=template.end_of_turn_ids())
    return {**info, "skipped_named": bad.named, "seconds": time.perf_counter() - start}


def check_request(out: Path, inputs: list[Path], seq_len: int, seed: int, on_bad_example: str, what: str) -> None:
    """The checks of a packed file's arguments, before any work (``what``: the inputs' kind)."""
    from pstar_jax.data.tokenizer import _check_input, check_not_an_input
    if not inputs:
        raise DataError(f"give the {what} files to read")
    if seq_len < 1:
        raise DataError(f"--seq-len must be >= 1, got {seq_len}")
    if seq_len > MAX_SEQ_LEN:
        raise DataError(f"--seq-len {seq_len:,} is past {MAX_SEQ_LEN:,} (2**24), longer than any model trains at; "
                        f"give the sequence length the model trains at")
    if not 0 <= seed < 2**63:
        raise DataError(f"--seed must be a whole number >= 0, got {seed}")
    if on_bad_example not in ("skip", "error"):
        raise DataError(f"--on-bad-example must be skip or error, got {on_bad_example!r}")
    for path in inputs:
        _check_input(path)
    check_not_an_input(out, inputs)


def write_examples(out: Path, examples: packing.Examples, placement: tuple[np.ndarray, np.ndarray, int], seq_len: int,
                   vocab_size: int, overwrite: bool, **info: Any) -> dict:
    """Writes ``examples`` at ``placement`` (row of each, offset in it, rows) into packed file ``out``;
    returns its sidecar: the arrays' fields, the example and token counts, and ``info``."""
    row_of, offset_of, rows = placement
    with packing.PackedWriter(out, rows, seq_len, vocab_size, overwrite) as writer:
        packing.fill_rows(examples, row_of, offset_of, writer.rows)
        first = np.zeros_like(examples.labels)
        first[examples.starts] = 1  # an example's first token is never a target
        return writer.commit(packing.sidecar_info(
            writer.rows, vocab_size=vocab_size, examples=int(len(examples.lengths)),
            tokens=int(examples.lengths.sum()), trained_tokens=int(np.count_nonzero(examples.labels & (1 - first))),
            **info))


def summary(out: str | os.PathLike, info: dict) -> str:
    """The one line pstar-tokens --chat prints."""
    seconds = max(info["seconds"], 1e-9)
    return (f"wrote {out}: {info['read']:,} examples read, {info['skipped']:,} skipped, {info['truncated']:,} "
            f"truncated, {info['dropped']:,} dropped; {info['rows']:,} rows of {info['seq_len'] + 1:,}, "
            f"{info['tokens']:,} tokens, {info['trained_tokens']:,} trained; "
            + (f"{info['split']:,} conversations as one example per assistant turn (the chat template renders "
               f"earlier turns otherwise once a later turn follows); " if info.get("split") else "")
            + f"packing efficiency "
            f"{100 * info['real_position_fraction']:.1f}%; {info['read'] / seconds:,.0f} examples/s, "
            f"{info['tokens'] / seconds:,.0f} tokens/s")
