"""Training data: token files, the built-in corpus, and resumable batches.

A token file is the raw output of ``np.ndarray.tofile``: tokens back to back, no header.
Its dtype is part of its name, ``NAME.u16.bin`` or ``NAME.u32.bin``, so a file can never be
read with the wrong width; a raw ``.bin`` from elsewhere (nanoGPT's ``train.bin`` is uint16)
loads with an explicit ``dtype=``. Files are memory-mapped, so a corpus larger than host
memory costs only the pages a batch touches.

``Batches`` cuts the tokens into windows of ``seq_len + 1`` at stride ``seq_len`` (so each token
is a target once per epoch) and reads them in an order shuffled afresh each epoch. The stream is
a pure function of (seed, batch index), so ``position`` alone is enough to resume exactly.
"""

from __future__ import annotations

import argparse
import builtins
import codecs
import contextlib
import io
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import numpy.typing as npt

_SUFFIX_DTYPES = {".u16.bin": np.dtype(np.uint16), ".u32.bin": np.dtype(np.uint32)}
# NUL never occurs in source text, so it marks file boundaries unambiguously.
_SEPARATOR = b"\x00"
BYTE_VOCAB_SIZE = 256
DEFAULT_CORPUS_BYTES = 4_000_000


class DataError(ValueError):
    """Training data is missing, malformed, or does not fit the requested shapes."""


def _suffix_dtype(path: Path) -> np.dtype | None:
    return next((d for s, d in _SUFFIX_DTYPES.items() if path.name.endswith(s)), None)


def _check_tokens(tokens: np.ndarray) -> None:
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"tokens must be a 1-D integer array, got {tokens.dtype}{tokens.shape}")


def load_tokens(path: str | os.PathLike, dtype: npt.DTypeLike = None) -> np.memmap:
    """Memory-maps a token file read-only; ``dtype`` is needed only for names without a suffix."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; make one with `pstar-tokens`")
    named = _suffix_dtype(path)
    dtype = named if dtype is None else np.dtype(dtype)
    if dtype is None or dtype not in _SUFFIX_DTYPES.values():
        raise DataError(f"cannot tell the token dtype of {path}; name it *.u16.bin or *.u32.bin, "
                        f"or pass dtype=np.uint16 or np.uint32")
    if named is not None and named != dtype:
        raise DataError(f"data file {path} is named as {named} tokens, not {dtype}; drop dtype=")
    size_bytes = path.stat().st_size
    if size_bytes % dtype.itemsize:
        raise DataError(f"data file {path} has {size_bytes} bytes, not a whole number of {dtype} "
                        f"tokens; check its dtype")
    if size_bytes < 2 * dtype.itemsize:
        raise DataError(f"data file {path} holds {size_bytes // dtype.itemsize} tokens; "
                        f"training needs at least 2")
    return np.memmap(path, dtype=dtype, mode="r")


def check_vocab(tokens: np.ndarray, vocab_size: int) -> None:
    """Raises DataError if some token id is ``>= vocab_size``."""
    if tokens.size and (top := int(tokens.max())) >= vocab_size:
        raise DataError(f"data has token id {top} but the model's vocab is {vocab_size}; "
                        f"pass --vocab-size >= {top + 1}")


def _check_destination(path: Path, dtype: np.dtype, overwrite: bool) -> None:
    suffix = next(s for s, d in _SUFFIX_DTYPES.items() if d == dtype)
    if not path.name.endswith(suffix):
        raise DataError(f"token file {path} holds {dtype} tokens, so its name must end in {suffix}")
    if path.exists() and not overwrite:
        raise DataError(f"{path} already exists; pass overwrite=True (--overwrite) to replace it")


def write_tokens(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int, *,
                 overwrite: bool = False) -> None:
    """Atomically writes uint16 tokens (vocab <= 65536) to *.u16.bin, else uint32 to *.u32.bin."""
    path, tokens = Path(path), np.asarray(tokens)
    if not 1 <= vocab_size <= 2**32:
        raise DataError(f"vocab_size must be between 1 and 2**32, got {vocab_size}")
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    _check_destination(path, dtype, overwrite)
    _check_tokens(tokens)
    if tokens.size < 2 or tokens.min() < 0:
        raise DataError(f"a token file needs at least 2 tokens, all >= 0; got {tokens.size} tokens")
    check_vocab(tokens, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: os.replace is atomic, so a crash leaves the old
    # file or the new one, never half of one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            tokens.astype(dtype).tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def encode_bytes(text_bytes: bytes) -> np.ndarray:
    """Byte-level tokens (vocab 256): one uint16 token per byte."""
    return np.frombuffer(text_bytes, dtype=np.uint8).astype(np.uint16)


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
    for path in _stdlib_sources():
        if total >= max_bytes:
            break
        with contextlib.suppress(OSError):
            chunks.append(path.read_bytes())
            total += len(chunks[-1]) + len(_SEPARATOR)
    return encode_bytes(_SEPARATOR.join(chunks or [_builtin_text()])[:max_bytes])


class Batches:
    """Endless iterator of int32 (inputs_BxL, targets_BxL); targets are inputs shifted by one.

    ``position`` counts the global batches already consumed: ``Batches(..., position=k)`` yields
    what the k-th batch onward of a fresh iterator would. With ``process_count`` > 1 each
    process gets the contiguous block of ``batch_size // process_count`` rows at its index.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, *,
                 process_index: int = 0, process_count: int = 1, position: int = 0) -> None:
        _check_tokens(tokens)
        if min(batch_size, seq_len) < 1 or min(seed, position) < 0:
            raise DataError(f"need batch_size, seq_len >= 1 and seed, position >= 0, got "
                            f"{batch_size}, {seq_len}, {seed}, {position}")
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index must be in [0, {process_count}), got {process_index}")
        if batch_size % process_count:
            raise DataError(f"batch_size {batch_size} must be divisible by process_count "
                            f"{process_count}")
        if len(tokens) < seq_len + 1:
            raise DataError(f"data has {len(tokens)} tokens, fewer than one window of "
                            f"seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.process_index, self.position = process_index, position
        self.windows_per_epoch = (len(tokens) - 1) // seq_len
        self._local_rows = batch_size // process_count
        self._perm_cache: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def _perm(self, epoch: int) -> np.ndarray:
        # Seeding by (seed, epoch) gives any epoch's order without replaying the ones before,
        # so resuming at any position costs the same as starting.
        if self._perm_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache = (epoch, rng.permutation(self.windows_per_epoch))
        return self._perm_cache[1]

    def state(self) -> dict[str, int]:
        """JSON-able resume state: pass ``position`` back to the constructor."""
        return {"position": self.position}

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        # Global rows form one endless stream of windows, epoch after epoch; a batch may span
        # an epoch boundary (or several, when the data holds fewer windows than a batch).
        first = self.position * self.batch_size + self.process_index * self._local_rows
        epochs, slots = np.divmod(first + np.arange(self._local_rows), self.windows_per_epoch)
        starts = np.empty(self._local_rows, dtype=np.int64)
        for epoch in np.unique(epochs):
            rows = epochs == epoch
            starts[rows] = self._perm(int(epoch))[slots[rows]] * self.seq_len
        windows = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], np.int32)
        self.position += 1
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def _make_token_file(args: argparse.Namespace) -> int:
    if bool(args.texts) == args.default_corpus:
        raise DataError("give either TEXT_FILEs or --default-corpus, exactly one of them")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise DataError(f"--max-bytes must be >= 1, got {args.max_bytes}")
    out = Path(args.out)
    _check_destination(out, np.dtype(np.uint16), args.overwrite)
    for text in args.texts:
        if not Path(text).is_file():
            raise DataError(f"text file {text} does not exist")
    if args.default_corpus:
        tokens = default_corpus(args.max_bytes or DEFAULT_CORPUS_BYTES)
    else:
        text_bytes = _SEPARATOR.join(Path(t).read_bytes() for t in args.texts)
        tokens = encode_bytes(text_bytes[:args.max_bytes])
    write_tokens(out, tokens, BYTE_VOCAB_SIZE, overwrite=args.overwrite)
    return tokens.size


def main(argv: Sequence[str] | None = None) -> int:
    """``pstar-tokens``: writes a byte-level token file from text files or the default corpus."""
    parser = argparse.ArgumentParser(prog="pstar-tokens",
                                     description="Make a byte-level (vocab 256) token file.")
    parser.add_argument("out", metavar="OUT.u16.bin", help="token file to write")
    parser.add_argument("texts", nargs="*", metavar="TEXT_FILE", help="text files, in order")
    parser.add_argument("--default-corpus", action="store_true", help="use Python's stdlib sources")
    parser.add_argument("--max-bytes", type=int, default=None, help="keep at most this many bytes")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help or a usage error, already printed by argparse
        return exit_.code if isinstance(exit_.code, int) else 0
    try:
        n_tokens = _make_token_file(args)
    except (DataError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n_tokens:,} tokens to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
