"""The built-in corpus: this Python's standard library sources as bytes, the data a run trains
on when it names none. It needs no download and is the same on every run of one Python install."""

from __future__ import annotations

import builtins
import codecs
import contextlib
import io
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import numpy as np

from pstar_jax.config.errors import DataError
from pstar_jax.data.token_files import encode_bytes

SEPARATOR = b"\x00"  # between documents
DEFAULT_CORPUS_BYTES = 4_000_000


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Installed packages differ between machines; only the stdlib itself is fixed per version.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _builtin_text() -> bytes:
    # `this.s` is a string constant, so it survives python -OO; importing it prints it once.
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    docs = (getattr(builtins, name).__doc__ or "" for name in sorted(dir(builtins)))
    return "\n\n".join([codecs.decode(this.s, "rot13"), *docs]).encode()


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """Byte-level tokens of this Python's standard library sources, in sorted path order.

    Needs no download and is the same on every run of one Python install. Falls back to
    built-in text (the zen of Python, builtin docstrings) where no sources are installed.
    """
    if max_bytes < 1:
        raise DataError(f"max_bytes must be >= 1, got {max_bytes}")
    chunks, total = [], 0
    for document in default_corpus_documents():
        if total >= max_bytes:
            break
        chunks.append(document)
        total += len(document) + len(SEPARATOR)
    return encode_bytes(SEPARATOR.join(chunks)[:max_bytes])


def default_corpus_documents() -> Iterator[bytes]:
    """The default corpus as documents: each stdlib source file, read lazily, in sorted order."""
    found = False
    for path in _stdlib_sources():
        with contextlib.suppress(OSError):
            document = path.read_bytes()
            found = True
            yield document
    if not found:
        yield _builtin_text()
