"""A checkpoint's chat template: ``ChatTemplate`` renders a conversation (pstar_jax.data.chat)
exactly as transformers' ``apply_chat_template`` does (the same Jinja environment, filters, globals
and special-token variables; the text is then tokenized with ``add_special_tokens=False`` since the
template writes BOS itself), so the ids equal theirs, and finds which tokens are the assistant's.

The assistant's tokens (the trained ones) come from the template's ``{% generation %}`` marks where
it has them; otherwise from rendering the conversation's prefixes: the text between
``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i + 1])`` is assistant
turn i with its end-of-turn token(s). A template whose first turns render otherwise than the whole
conversation begins (Qwen3's drops the reasoning of turns before the last user turn) gives one
example per assistant turn instead, each the conversation through that turn as the template
renders it there (``ChatTemplate.turn_examples``). Character spans become token spans through the
tokenizer's offsets: a token overlapping a span is trained (transformers' assistant mask does the same).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from pstar_jax.config.errors import DataError
from pstar_jax.config.paths import contained
from pstar_jax.data.chat import BadExample, Conversation
from pstar_jax.data.token_files import io_errors

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                       "additional_special_tokens")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# A template is a file from a checkpoint, so rendering it is bounded: real templates render a
# conversation in milliseconds. Past RENDER_LIMIT_S seconds a render is refused (in the main thread,
# where the CLIs render: a timer signal interrupts it), and a string or list repeated past
# MAX_REPEAT items or a power of more than MAX_POWER_BITS bits is refused at once (no allocation of
# gigabytes first). The sandbox itself refuses ranges over 100,000 items.
RENDER_LIMIT_S = 10.0
MAX_REPEAT = 1 << 24
MAX_POWER_BITS = 1 << 16


class _TooSlow(Exception):
    """A render ran past RENDER_LIMIT_S (raised by the timer's signal handler)."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _TooSlow in the block once ``seconds`` pass (main thread only; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _environment() -> Any:
    """transformers' Jinja environment for chat templates (utils/chat_template_utils.py)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records the character span of its body."""
        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._blocks: list[str] | None = None
            self._spans: list[tuple[int, int]] | None = None

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context: Any, caller: Any) -> str:
            rv = caller()
            if self._blocks is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(rv)))
            return rv

        def activate_tracker(self, blocks: list[str], spans: list[tuple[int, int]]) -> None:
            self._blocks, self._spans = blocks, spans

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # theirs: no HTML escaping, unlike Jinja's own
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Sandbox(ImmutableSandboxedEnvironment):
        """transformers' sandbox, with repetition and powers bounded (MAX_REPEAT, MAX_POWER_BITS)."""
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                        raise jinja2.sandbox.SecurityError(f"repeating {len(seq):,} items {n:,} times makes more "
                                                           f"than {MAX_REPEAT:,}")
            elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                    right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
                raise jinja2.sandbox.SecurityError(f"{left} ** {right} has more than {MAX_POWER_BITS:,} bits")
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def _token_text(value: Any) -> Any:
    """A special token of tokenizer_config.json: a string, or a serialised AddedToken {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value


def _read_json(path: Path) -> dict:
    with io_errors(path, "read"):
        raw = path.read_bytes()
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise DataError(f"{path} is not a JSON object")
    return value


def _read_template(path: Path) -> str:
    with io_errors(path, "read"):
        raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"the chat template {path} is not UTF-8 text (bad byte {raw[e.start]:#04x} at offset "
                        f"{e.start}); convert it to UTF-8 first") from None


def template_text(tokenizer_dir: Path, config: dict, template_file: str | os.PathLike | None) -> tuple[str, str]:
    """(template, where it came from): --chat-template, chat_template.jinja, or tokenizer_config's."""
    if template_file is not None:
        return _read_template(Path(template_file)), str(template_file)
    beside = Path(contained(tokenizer_dir, "chat_template.jinja", "the chat template", DataError))
    if beside.is_file():  # transformers prefers the file too
        return _read_template(beside), str(beside)
    where, template = str(tokenizer_dir / "tokenizer_config.json"), config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(f"{where} has chat templates {sorted(map(str, named))} but no 'default' one; "
                            f"pass --chat-template FILE")
        template, where = named["default"], f"{where} (template 'default')"
    if not isinstance(template, str) or not template:
        raise DataError(f"the tokenizer in {tokenizer_dir} has no chat template (no chat_template in "
                        f"tokenizer_config.json, no chat_template.jinja); pass --chat-template FILE")
    return template, where


# What a chat template reads beside its extra variables; a --chat-template-kwargs key may not be one.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", *SPECIAL_TOKEN_NAMES,
                       "raise_exception", "strftime_now"})


def parse_template_kwargs(text: str | None) -> dict[str, Any]:
    """``--chat-template-kwargs``: a JSON object of extra template variables, as transformers'
    ``apply_chat_template(**kwargs)`` passes them (``{"enable_thinking": false}`` for Qwen3)."""
    if text is None:
        return {}
    if len(text) > 1 << 16:
        raise DataError(f"--chat-template-kwargs is {len(text):,} characters; give a JSON object of a few variables")
    try:
        kwargs = json.loads(text)
    except ValueError as e:
        raise DataError(f"--chat-template-kwargs is not JSON ({e}); give an object such as "
                        "'{\"enable_thinking\": false}'") from None
    if not isinstance(kwargs, dict):
        raise DataError(f"--chat-template-kwargs must be a JSON object of variables, got {type(kwargs).__name__}")
    for key in kwargs:
        if not key.isidentifier():
            raise DataError(f"--chat-template-kwargs key {key[:40]!r} is not a template variable name")
        if key in _RESERVED:
            raise DataError(f"--chat-template-kwargs may not set {key!r}, which the commands give the template "
                            "themselves")
    return kwargs


@dataclasses.dataclass
class ChatTemplate:
    """A checkpoint's chat template with its tokenizer (a ``tokenizers.Tokenizer``)."""

    source: str
    name: str  # where the template came from, for messages
    tokenizer: Any
    variables: dict[str, Any]  # the special tokens, as template variables
    eos_id: int | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # parse_template_kwargs'

    def __post_init__(self) -> None:
        import jinja2
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template {self.name} is not valid Jinja: {e}") from None
        self.has_generation_marks = bool(_GENERATION_TAG.search(self.source))
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @classmethod
    def from_tokenizer_dir(cls, tokenizer_dir: str | os.PathLike, template_file: str | os.PathLike | None = None,
                           eos_token: str | None = None, kwargs: dict[str, Any] | None = None) -> ChatTemplate:
        from pstar_jax.data.tokenizer import load_tokenizer
        tokenizer_dir = Path(tokenizer_dir)
        if tokenizer_dir.is_file():
            tokenizer_dir = tokenizer_dir.parent
        encoder = load_tokenizer(tokenizer_dir, eos_token)
        config_path = Path(contained(tokenizer_dir, "tokenizer_config.json", "the tokenizer's config", DataError))
        config = _read_json(config_path) if config_path.is_file() else {}
        source, where = template_text(tokenizer_dir, config, template_file)
        variables = {k: _token_text(config[k]) for k in SPECIAL_TOKEN_NAMES if config.get(k)}
        return cls(source, where, encoder.tokenizer, variables, encoder.eos_id, dict(kwargs or {}))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    def _render(self, conversation: Conversation, add_generation_prompt: bool,
                spans: list[tuple[int, int]] | None = None) -> str:
        import jinja2
        kwargs = dict(self.variables, **self.kwargs, messages=conversation, tools=None, documents=None,
                      add_generation_prompt=add_generation_prompt)
        try:
            with _time_limit(RENDER_LIMIT_S):
                if spans is None:
                    return self._template.render(**kwargs)
                blocks: list[str] = []
                self._template.environment.activate_tracker(blocks, spans)
                try:
                    for block in self._template.generate(**kwargs):
                        blocks.append(block)
                finally:
                    self._template.environment.activate_tracker(None, None)
                return "".join(blocks)
        except _TooSlow:
            raise DataError(f"the chat template {self.name} took over {RENDER_LIMIT_S:g} s to render one "
                            f"conversation (real templates take milliseconds); give another (--chat-template FILE)"
                            ) from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                RecursionError, MemoryError) as e:
            # raise_exception's refusals, and a template's own failures on this conversation (a
            # division by zero, a range or repetition past the sandbox's bounds, endless recursion)
            reason = f"{type(e).__name__}: {e}" if not isinstance(e, jinja2.TemplateError) else str(e)
            raise BadExample(f"is refused by the chat template {self.name}: {reason}") from None

    def render(self, conversation: Conversation, add_generation_prompt: bool = False) -> str:
        return self._render(conversation, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def assistant_spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character span of each assistant turn (with its end-of-turn)."""
        full, spans = self._spans(conversation)
        if spans is None:
            raise DataError(f"the chat template {self.name} renders the first turns of a conversation as "
                            f"other text than the whole conversation begins with (it trains as one example per "
                            f"assistant turn: turn_examples), so the assistant's tokens of the whole cannot be found")
        return full, spans

    def turn_examples(self, conversation: Conversation) -> list[tuple[str, list[tuple[int, int]]]]:
        """The examples that train ``conversation``'s assistant turns, each (text, trained spans).

        One, the whole conversation, where the template renders its first turns as the whole
        begins. Otherwise (Qwen3's template, say, drops the reasoning of every assistant turn
        before the last user turn, and writes an empty think block into the last) one example
        per assistant turn: the conversation through that turn as the template renders it there,
        that turn alone trained, so every turn is learnt in the text the model sees when it
        writes that turn (at the cost of repeating the earlier turns)."""
        full, spans = self._spans(conversation)
        if spans is not None:
            return [(full, spans)]
        examples = []
        for i, message in enumerate(conversation):
            if message["role"] == "assistant":
                before, through = self._render_before(conversation, i), self._render(conversation[:i + 1], False)
                examples.append((through, [self._turn_span(message, before, through)]))
        return examples

    def _spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]] | None]:
        """The rendered text and its assistant spans; None for the spans where a turn's prefixes
        render otherwise than the whole begins."""
        if self.has_generation_marks:
            spans: list[tuple[int, int]] = []
            return self._render(conversation, False, spans), spans
        full, spans = self._render(conversation, False), []
        for i, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            before = self._render_before(conversation, i)
            through = full if i == len(conversation) - 1 else self._render(conversation[:i + 1], False)
            if not (full.startswith(through) and through.startswith(before)):
                return full, None
            spans.append(self._turn_span(message, before, through))
        return full, spans

    def _turn_span(self, message: dict, before: str, through: str) -> tuple[int, int]:
        """The span of the assistant turn rendered between prefixes ``before`` and ``through``."""
        # A reasoning model's template rewrites "<think>...</think>answer" (whitespace, or drops
        # the reasoning): the visible answer after the last </think> is what every such one keeps.
        if not through.startswith(before):
            raise DataError(f"the chat template {self.name} renders the first turns of a conversation as "
                            f"other text than the whole conversation begins with, so the assistant's tokens "
                            f"cannot be found; give a template with {{% generation %}} marks (--chat-template) "
                            f"or pass --train-on-prompt")
        answer = message["content"].rsplit("</think>", 1)[-1].strip()
        if answer not in through[len(before):]:
            raise DataError(f"the chat template {self.name} does not render an assistant turn where its "
                            f"prefixes say, so the assistant's tokens cannot be found; give a template with "
                            f"{{% generation %}} marks (--chat-template) or pass --train-on-prompt")
        return len(before), len(through)

    def _render_before(self, conversation: Conversation, i: int) -> str:
        """The text before assistant turn ``i``: its prefix with the generation prompt."""
        try:
            return self._render(conversation[:i], True)
        except BadExample:
            if i:
                raise
            # Most templates read messages[0] whatever it is, so an empty conversation fails
            # with an error of their own ("list object has no element 0") that names nothing.
            raise BadExample(f"opens with an assistant turn, and the chat template {self.name} cannot render the "
                             f"empty conversation before it to find where that turn begins; start the "
                             f"conversation with a user turn, or give a template with {{% generation %}} marks "
                             f"(--chat-template)") from None

    def encode_with_mask(self, conversation: Conversation, train_on_prompt: bool = False
                         ) -> tuple[np.ndarray, np.ndarray]:
        """(ids uint32, labels uint8): 1 on the tokens of the assistant's turns (all with
        train_on_prompt), for a conversation that is one example (see ``prepare``)."""
        examples = self.prepare(conversation, train_on_prompt)
        if len(examples) != 1:
            raise DataError(f"the chat template {self.name} trains this conversation as {len(examples)} examples, "
                            f"one per assistant turn: encode them with encode_batch_with_mask(prepare(...))")
        return self.encode_batch_with_mask(examples)[0]

    def prepare(self, conversation: Conversation, train_on_prompt: bool = False
                ) -> list[tuple[str, list[tuple[int, int]] | None]]:
        """The examples of ``conversation``: rendered text and trained character spans, None for
        all (BadExample if the template refuses the conversation): one, or one per assistant turn
        where the template is not prefix-stable (``turn_examples``)."""
        if train_on_prompt:
            return [(self.render(conversation), None)]
        return self.turn_examples(conversation)

    def encode_batch_with_mask(self, prepared: list[tuple[str, list[tuple[int, int]] | None]]
                               ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tokenizes many ``prepare``d texts at once (the tokenizers library spreads them over threads)."""
        out = []
        for (_, spans), encoding in zip(prepared, self.tokenizer.encode_batch([t for t, _ in prepared],
                                                                               add_special_tokens=False)):
            ids = np.asarray(encoding.ids, np.uint32)
            labels = np.full(len(ids), spans is None, np.uint8)
            if spans and len(ids):
                offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
                for start, end in spans:  # a token overlapping [start, end) is trained
                    labels[(offsets[:, 1] > start) & (offsets[:, 0] < end)] = 1
            out.append((ids, labels))
        return out

    def end_of_turn_ids(self) -> list[int]:
        """The special tokens that close an assistant turn, found on a probe conversation."""
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        try:
            text, spans = self.assistant_spans(probe)
        except (BadExample, DataError):
            return []
        specials = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        found = []
        for start, end in spans:
            tail = text[start:end]
            if "Hello" not in tail:
                continue
            tail = tail[tail.index("Hello") + len("Hello"):]
            for token in self.encode(tail):
                if self.tokenizer.id_to_token(token) in specials:
                    found.append(token)
                    break
        return sorted(set(found))
