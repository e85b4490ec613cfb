"""Conversations for supervised fine-tuning: the formats people have (the checkpoint's chat template
that renders them is pstar_jax.data.template).

A conversation is a list of ``{"role": "system"|"user"|"assistant", "content": str}``. JSONL files
hold one per line in one of four formats (``FORMATS``): ``messages`` (OpenAI/HF), alpaca
(``instruction``, optional ``input``, ``output``, optional ``system``), ShareGPT (``conversations``
of ``{"from": "system"|"human"|"gpt", "value"}``) or prompt/completion.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterator


from pstar_jax.data.token_files import io_errors
from pstar_jax.config.errors import DataError

FORMATS = ("messages", "alpaca", "sharegpt", "prompt-completion")
ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
# The longest line read: 64 MiB, some 16M tokens of text, past any context a model trains at. A
# longer line is a bad line, read a bounded piece at a time (never whole into memory).
MAX_LINE_BYTES = 1 << 26
# Variables transformers passes to every template (its special_tokens_map), when the config sets them.

Conversation = list[dict[str, str]]


class BadExample(ValueError):
    """One input line that is not a usable conversation; its text says what is wrong."""


# -- formats ----------------------------------------------------------------------------------


def detect_format(record: Any) -> str | None:
    """The format a JSON record's keys name, or None."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt-completion"
    return None


def _text(record: dict, field: str, optional: bool = False) -> str | None:
    if field not in record or (optional and record[field] is None):
        if optional:
            return None
        raise BadExample(f"has no {field!r} field")
    if not isinstance(value := record[field], str):
        raise BadExample(f"field {field!r} holds {type(value).__name__}, not text")
    _check_text(value, f"field {field!r}")
    return value


def _check_text(text: str, what: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:  # JSON allows "\ud800"; no tokenizer takes it
        raise BadExample(f"{what} holds an unpaired surrogate escape, not text") from None


def _turns(items: Any, field: str, role_key: str, text_key: str, roles: dict[str, str]) -> Conversation:
    if not isinstance(items, list):
        raise BadExample(f"field {field!r} holds {type(items).__name__}, not a list of turns")
    turns = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadExample(f"{field}[{i}] is {type(item).__name__}, not an object")
        for key in (role_key, text_key):
            if key not in item:
                raise BadExample(f"{field}[{i}] has no {key!r}")
        role, content = item[role_key], item[text_key]
        if not isinstance(role, str) or role not in roles:
            raise BadExample(f"{field}[{i}] has the unknown {role_key} {role!r} (known: {', '.join(roles)})")
        if not isinstance(content, str):
            raise BadExample(f"{field}[{i}].{text_key} holds {type(content).__name__}, not text")
        _check_text(content, f"{field}[{i}].{text_key}")
        turns.append({"role": roles[role], "content": content})
    return turns


def to_conversation(record: Any, format: str) -> Conversation:
    """The conversation a record of ``format`` holds; BadExample says what is wrong with it."""
    if not isinstance(record, dict):
        raise BadExample(f"is {type(record).__name__}, not a JSON object")
    if format == "messages":
        if "messages" not in record:
            raise BadExample("has no 'messages' field")
        conv = _turns(record["messages"], "messages", "role", "content", {r: r for r in ROLES})
    elif format == "sharegpt":
        if "conversations" not in record:
            raise BadExample("has no 'conversations' field")
        conv = _turns(record["conversations"], "conversations", "from", "value", _SHAREGPT_ROLES)
    elif format == "alpaca":
        system, instruction = _text(record, "system", True), _text(record, "instruction")
        extra, output = _text(record, "input", True), _text(record, "output")
        conv = [{"role": "system", "content": system}] if system else []
        conv += [{"role": "user", "content": instruction + (f"\n\n{extra}" if extra else "")},
                 {"role": "assistant", "content": output}]
    elif format == "prompt-completion":
        conv = [{"role": "user", "content": _text(record, "prompt")},
                {"role": "assistant", "content": _text(record, "completion")}]
    else:
        raise DataError(f"unknown chat format {format!r}; choose one of {', '.join(FORMATS)}")
    answers = [m for m in conv if m["role"] == "assistant"]
    if not answers:
        raise BadExample("has no assistant turn, so nothing would be trained")
    if any(not m["content"].strip() for m in answers):
        raise BadExample("has an empty assistant turn")
    return conv


@dataclasses.dataclass
class BadLines:
    """Counts the bad lines; ``skip=False`` makes the first one an error."""

    skip: bool = False
    count: int = 0
    named: list[str] = dataclasses.field(default_factory=list)
    keep: int = 5

    def add(self, where: str, reason: str) -> None:
        line = f"{where} {reason}"
        if not self.skip:
            raise DataError(f"{line}; fix it or pass --on-bad-example skip")
        self.count += 1
        if len(self.named) < self.keep:
            self.named.append(line)


def jsonl_records(path: str | os.PathLike, bad: BadLines) -> Iterator[tuple[Any, str]]:
    """(JSON value, "FILE:LINE") for each non-blank line of a JSONL file. The file is untrusted: a line
    past MAX_LINE_BYTES, one that is not JSON, or one nested deeper than Python's parser recurses
    goes to ``bad``, never a MemoryError or a traceback."""
    path = Path(path)
    with io_errors(path, "read"), open(path, "rb") as f:
        line_no = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            line_no += 1
            where = f"{path}:{line_no}"
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # the rest of it, a bounded piece at a time
                    line = f.readline(MAX_LINE_BYTES)
                bad.add(where, f"is over {MAX_LINE_BYTES:,} bytes, longer than any example trains at")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                bad.add(where, f"is not JSON ({getattr(e, 'msg', e)})")
                continue
            except RecursionError:  # "[[[[..." a hundred thousand deep
                bad.add(where, "nests its JSON deeper than any example does")
                continue
            yield record, where


def read_conversations(path: str | os.PathLike, format: str | None = None,
                       bad: BadLines | None = None) -> Iterator[tuple[Conversation, str]]:
    """(conversation, "FILE:LINE") for each usable line of a JSONL file; the format is detected from
    the first valid line unless given. A bad line goes to ``bad`` (default: an error)."""
    bad = bad if bad is not None else BadLines()
    if format is not None and format not in FORMATS:
        raise DataError(f"unknown chat format {format!r}; choose one of {', '.join(FORMATS)}")
    for record, where in jsonl_records(path, bad):
        if format is None and (format := detect_format(record)) is None:
            bad.add(where, "has none of the fields messages, conversations, instruction+output, "
                    "prompt+completion (choose a format with --chat-format)")
            continue
        try:
            yield to_conversation(record, format), where
        except BadExample as e:
            bad.add(where, str(e))
