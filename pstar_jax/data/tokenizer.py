"""Text and JSONL files to a token file, byte-level or with a Hugging Face tokenizer (pstar-tokens).

A text file is one document; each line of a ``.jsonl`` file is one (its ``text`` field, or
``--field``). The end-of-text token goes between documents: the tokenizer's eos token, or NUL on
the byte-level path (vocab 256, the default). Everything streams: files are read in pieces of
about ``PIECE_BYTES`` cut at line breaks, encoded in batches (the ``tokenizers`` library spreads a
batch over threads) and appended to the output, so inputs larger than memory work.

Cutting a large file into pieces is exact for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen):
a piece ends at a newline between two non-space characters, or else before the space between two
letters, where their pre-tokenizers split anyway. SentencePiece-style ones (Llama 2, Mistral)
prepend a space marker to each piece, so a file over ``PIECE_BYTES`` may differ from a whole-file
encoding in one token per piece.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np

from pstar_jax.data import corpus, token_files as data
from pstar_jax.data.token_files import TokenWriter, io_errors
from pstar_jax.config.errors import DataError
from pstar_jax.config.paths import contained

PIECE_BYTES = 1 << 18
# One encode_batch call: many pieces for the threads to share, few enough that the Encoding
# objects (far larger than the ids they carry) stay in the low hundreds of MB.
BATCH_BYTES = 4 << 20


class Piece(NamedTuple):
    text: bytes
    starts_document: bool
    source: str  # where it came from, for error messages: a path, or "path line N"
    read_bytes: int  # input bytes consumed, for the progress bar


class Encoder(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode_batch(self, pieces: Sequence[Piece]) -> list[np.ndarray]: ...

    def truncate(self, text: bytes, size_bytes: int) -> bytes: ...


class ByteEncoder:
    """One token per byte (vocab 256); NUL separates documents."""

    name, vocab_size, eos_id = "bytes", data.BYTE_VOCAB_SIZE, corpus.SEPARATOR[0]

    def encode_batch(self, pieces: Sequence[Piece]) -> list[np.ndarray]:
        return [np.frombuffer(p.text, dtype=np.uint8) for p in pieces]

    def truncate(self, text: bytes, size_bytes: int) -> bytes:
        return text[:size_bytes]


class HFEncoder:
    """A Hugging Face ``tokenizers.Tokenizer`` with its end-of-text id; no BOS or other specials."""

    def __init__(self, tokenizer, name: str, eos_id: int) -> None:
        self.tokenizer, self.name, self.eos_id = tokenizer, name, eos_id
        # The largest id + 1, not the count: added tokens may leave holes in the ids.
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        # encode_batch_fast (tokenizers >= 0.21) skips the offsets, which are not needed here.
        self._encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def encode_batch(self, pieces: Sequence[Piece]) -> list[np.ndarray]:
        texts = []
        for p in pieces:
            try:
                texts.append(p.text.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"{p.source} is not UTF-8 text (bad byte {p.text[e.start]:#04x}); "
                                f"convert it to UTF-8 first") from None
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._encode(texts, add_special_tokens=False)]

    def truncate(self, text: bytes, size_bytes: int) -> bytes:
        return text[:_char_boundary(text, size_bytes)]


def load_tokenizer(path: str | os.PathLike, eos_token: str | None = None) -> HFEncoder:
    """Loads DIR/tokenizer.json (or the file given); eos from ``eos_token`` or tokenizer_config.json."""
    from tokenizers import Tokenizer

    path = Path(path)
    # A tokenizer directory is a download: its files may not lead outside it (a file given by
    # name is the user's own, but the config read beside it is the directory's).
    file = Path(contained(path, "tokenizer.json", "the tokenizer", DataError)) if path.is_dir() else path
    config = Path(contained(file.parent, "tokenizer_config.json", "the tokenizer's config", DataError))
    if not file.is_file():
        raise DataError(f"tokenizer {file} does not exist; give a tokenizer.json or the directory "
                        f"holding one")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises plain Exception for every kind of bad file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot load tokenizer {file}: {reason}") from None
    if eos_token is None:
        eos_token = _config_eos_token(config)
    if eos_token is not None and not isinstance(eos_token, str):
        # transformers reads only a string or an AddedToken there; an id would be a guess.
        token = tokenizer.id_to_token(eos_token) if isinstance(eos_token, int) and eos_token >= 0 else None
        hint = (f"--eos-token {shlex.quote(token)}" if token is not None
                else "--eos-token with the end-of-text token's text")
        raise DataError(f"{config} gives eos_token as {json.dumps(eos_token)}, not the token's text; pass {hint} "
                        "or write the token itself there")
    if eos_token is None:
        raise DataError(f"cannot tell the end-of-text token of {file}: {config} names no "
                        f"eos_token; pass --eos-token (for example --eos-token '<|endoftext|>')")
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise DataError(f"end-of-text token {eos_token!r} is not in the vocabulary of {file}; "
                        f"pass --eos-token with one of its special tokens")
    return HFEncoder(tokenizer, str(path.resolve()), eos_id)


def _config_eos_token(config: Path) -> object:
    if not config.exists():
        return None
    with io_errors(config, "read"):
        raw = config.read_bytes()
    try:
        eos = json.loads(raw).get("eos_token")
    except (ValueError, AttributeError):  # not JSON, not UTF-8, or not an object
        raise DataError(f"{config} is not a JSON object; fix it or pass --eos-token") from None
    # Older configs store the token as a serialised AddedToken: {"content": "</s>", ...}.
    return eos.get("content") if isinstance(eos, dict) and "content" in eos else eos


def _char_boundary(text: bytes, at: int) -> int:
    """The largest index <= ``at`` that does not split a UTF-8 character."""
    if at >= len(text):
        return len(text)
    while at > 0 and (text[at] & 0xC0) == 0x80:  # a continuation byte: its character began earlier
        at -= 1
    return at


def _cut_point(buf: bytes) -> int:
    """Where to end a piece of a large text file, in its second half: see the module docstring."""
    half, end = len(buf) // 2, len(buf) - 1
    while (i := buf.rfind(b"\n", half, end)) > half:  # a newline between two non-space bytes
        if not buf[i - 1:i].isspace() and not buf[i + 1:i + 2].isspace():
            return i + 1
        end = i
    # Before the space of "word word": a word takes its leading space in those pre-tokenizers.
    if (last := _last_match(_WORD_SPACE_WORD, buf, half)) is not None:
        return last
    if (i := buf.rfind(b"\n", half)) >= 0:
        return i + 1
    # No line break: cut before the last character, which may continue in the next block.
    return _char_boundary(buf, len(buf) - 1) or len(buf)


_WORD_SPACE_WORD = re.compile(rb"(?<=[A-Za-z]) (?=[A-Za-z])")


def _last_match(pattern: re.Pattern, buf: bytes, start: int) -> int | None:
    last = None
    for last in pattern.finditer(buf, start):
        pass
    return None if last is None else last.start()


def read_text(path: Path, piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """One document: the file's bytes in pieces of about ``piece_bytes`` (at most twice that)."""
    with io_errors(path, "read"), open(path, "rb") as f:
        rest, first = b"", True
        while block := f.read(piece_bytes):
            rest += block
            if len(rest) > piece_bytes:
                cut = _cut_point(rest)
                yield Piece(rest[:cut], first, str(path), cut)
                rest, first = rest[cut:], False
        if rest or first:  # an empty file is still a document
            yield Piece(rest, first, str(path), len(rest))


def read_jsonl(path: Path, field: str) -> Iterator[Piece]:
    """One document per non-blank line: the string in its ``field``."""
    with io_errors(path, "read"), open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where} is not JSON ({getattr(e, 'msg', e)}); a .jsonl file "
                                f"holds one JSON object per line") from None
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(map(repr, record)) if isinstance(record, dict) else "not an object"
                raise DataError(f"{where} has no {field!r} field ({keys or 'no fields'}); "
                                f"choose one with --field")
            if not isinstance(text := record[field], str):
                raise DataError(f"{where}: field {field!r} holds {type(text).__name__}, not text")
            try:
                yield Piece(text.encode(), True, where, len(line))
            except UnicodeEncodeError:
                raise DataError(f"{where}: field {field!r} holds an unpaired surrogate "
                                f"escape, not text") from None


def input_pieces(inputs: Sequence[Path], field: str) -> Iterator[Piece]:
    for path in inputs:
        yield from read_jsonl(path, field) if path.name.endswith(".jsonl") else read_text(path)


def default_corpus_pieces(encoder: Encoder) -> Iterator[Piece]:
    for document in corpus.default_corpus_documents():
        if not isinstance(encoder, ByteEncoder):  # a few stdlib test files are not UTF-8
            document = document.decode("utf-8", "replace").encode()
        yield Piece(document, True, "the default corpus", len(document))


def _capped(pieces: Iterable[Piece], max_bytes: int, encoder: Encoder) -> Iterator[Piece]:
    """The first ``max_bytes`` of input; a document boundary counts as one byte, so that on the
    byte-level path tokens == bytes (as with one NUL between documents)."""
    left = max_bytes
    for i, piece in enumerate(pieces):
        left -= piece.starts_document and i > 0
        if left < 0:
            return
        if len(piece.text) >= left:
            yield piece._replace(text=encoder.truncate(piece.text, left))
            return
        left -= len(piece.text)
        yield piece


def _batches(pieces: Iterable[Piece], batch_bytes: int) -> Iterator[list[Piece]]:
    batch, size_bytes = [], 0
    for piece in pieces:
        batch.append(piece)
        size_bytes += len(piece.text)
        if size_bytes >= batch_bytes:
            yield batch
            batch, size_bytes = [], 0
    if batch:
        yield batch


def encode_into(writer: TokenWriter, pieces: Iterable[Piece], encoder: Encoder, *,
                max_bytes: int | None = None, batch_bytes: int = BATCH_BYTES, progress=None) -> None:
    """Encodes ``pieces`` batch by batch into ``writer``, eos between documents."""
    if max_bytes is not None:
        pieces = _capped(pieces, max_bytes, encoder)
    eos, first = np.array([encoder.eos_id], np.uint32), True
    for batch in _batches(pieces, batch_bytes):
        parts = []
        for piece, ids in zip(batch, encoder.encode_batch(batch)):
            if piece.starts_document and not first:
                parts.append(eos)
            parts.append(ids)
            first = False
        writer.write(np.concatenate(parts))
        if progress is not None:
            progress.update(sum(p.read_bytes for p in batch))


def _check_input(path: Path) -> None:
    if path.is_dir():
        raise DataError(f"input {path} is a directory; give the text or .jsonl files in it")
    if not path.exists():
        raise DataError(f"input file {path} does not exist")
    if not os.access(path, os.R_OK):
        raise DataError(f"cannot read input file {path}: permission denied")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_not_an_input(out: Path, inputs: Sequence[Path]) -> None:
    for path in inputs:
        if _same_file(out, path):
            raise DataError(f"the output {out} is also an input; it is never overwritten: name another output "
                            f"with -o/--output")


def make_token_file(out: str | os.PathLike, inputs: Sequence[str | os.PathLike] = (), *,
                    tokenizer: str | os.PathLike | None = None, eos_token: str | None = None,
                    field: str = "text", default_corpus: bool = False, max_bytes: int | None = None,
                    overwrite: bool = False, progress: bool | None = False) -> dict:
    """Writes token file ``out`` from ``inputs`` (or the default corpus); returns its sidecar.

    ``progress``: a bar on stderr; None shows it only on a terminal.
    """
    inputs = [Path(p) for p in inputs]
    if bool(inputs) == default_corpus:
        raise DataError("give either input files or --default-corpus, exactly one of them")
    if max_bytes is not None and max_bytes < 1:
        raise DataError(f"--max-bytes must be >= 1, got {max_bytes}")
    for path in inputs:
        _check_input(path)
    check_not_an_input(Path(out), inputs)
    encoder = ByteEncoder() if tokenizer is None else load_tokenizer(tokenizer, eos_token)
    if default_corpus:
        pieces, max_bytes = default_corpus_pieces(encoder), max_bytes or corpus.DEFAULT_CORPUS_BYTES
        total_bytes = max_bytes
    else:
        pieces = input_pieces(inputs, field)
        total_bytes = sum(p.stat().st_size for p in inputs)
        total_bytes = min(total_bytes, max_bytes or total_bytes)
    from tqdm import tqdm
    with TokenWriter(out, encoder.vocab_size, overwrite=overwrite, tokenizer=encoder.name,
                     eos_id=encoder.eos_id) as writer, \
            tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", leave=False,
                 disable=None if progress is None else not progress) as bar:
        encode_into(writer, pieces, encoder, max_bytes=max_bytes, progress=bar)
        return writer.commit()
