"""Training data: token files, the built-in corpus, and resumable batches.

A token file is the raw output of ``np.ndarray.tofile``: tokens back to back, no header.
Its dtype is part of its name, ``NAME.u16.bin`` or ``NAME.u32.bin``, so a file can never be
read with the wrong width; a raw ``.bin`` from elsewhere (nanoGPT's ``train.bin`` is uint16)
loads with an explicit ``dtype=``. ``pstar-tokens`` also writes a sidecar ``NAME.uXX.bin.json``
(tokenizer, vocab size, eos id, largest id, token count, dtype); it is optional, but when present
``load_tokens`` checks the file against it. Files are memory-mapped, so a corpus larger than host
memory costs only the pages a batch touches.

``Batches`` cuts the tokens into windows of ``seq_len + 1`` at stride ``seq_len`` (so each token
is a target once per epoch) and reads them in an order shuffled afresh each epoch. The stream is
a pure function of (seed, batch index), so ``position`` alone is enough to resume exactly.
``held_out_split`` keeps the last 1% of the tokens out of training for a held-out loss, and
``eval_batches`` cuts a fixed evaluation set from held-out tokens. Both yield ``Batch``es
(pstar_jax.batch) of plain data.

Packed SFT rows (``Rows``: tokens, segments, labels, each [rows, seq_len + 1], read from an SFT
file by pstar_jax.packing) have their own ``PackedBatches``, held-out split (the last 1% of the
rows) and evaluation set in pstar_jax.rows; ``open_training_data`` reads either kind of file, and
``training_batches``, ``held_out`` and ``evaluation_set`` take either kind of data.
"""

from __future__ import annotations

import builtins
import codecs
import contextlib
import io
import json
import os
import sysconfig
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
import numpy.typing as npt

from pstar_jax.batch import Batch, plain
from pstar_jax.config import ConfigError
from pstar_jax.paths import create_temp_beside

_SUFFIX_DTYPES = {".u16.bin": np.dtype(np.uint16), ".u32.bin": np.dtype(np.uint32)}
# NUL never occurs in source text, so it marks file boundaries unambiguously.
SEPARATOR = b"\x00"
BYTE_VOCAB_SIZE = 256
DEFAULT_CORPUS_BYTES = 4_000_000
# check_vocab reads this many tokens at a time, so a memmapped file of GBs is scanned in
# bounded memory (128 MiB of uint16) rather than as one temporary.
_SCAN_NUMEL = 1 << 26


class DataError(ConfigError):
    """Training data is missing, malformed, or does not fit the requested shapes."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    if not 1 <= vocab_size <= 2**32:
        raise DataError(f"vocab_size must be between 1 and 2**32, got {vocab_size}")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def token_suffix(dtype: npt.DTypeLike) -> str:
    dtype = np.dtype(dtype)
    return next(s for s, d in _SUFFIX_DTYPES.items() if d == dtype)


def is_token_file_name(path: str | os.PathLike) -> bool:
    return _suffix_dtype(Path(path)) is not None


def _suffix_dtype(path: Path) -> np.dtype | None:
    return next((d for s, d in _SUFFIX_DTYPES.items() if path.name.endswith(s)), None)


def sidecar_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def _check_tokens(tokens: np.ndarray) -> None:
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"tokens must be a 1-D integer array, got {tokens.dtype}{tokens.shape}")


def read_token_info(path: str | os.PathLike) -> dict[str, Any] | None:
    """The sidecar of token file ``path`` (see the module docstring), or None if it has none."""
    side = sidecar_path(path)
    try:
        info = json.loads(side.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {side}: {getattr(e, 'strerror', None) or e}; "
                        f"delete it or rewrite {Path(path).name} with pstar-tokens") from None
    if not isinstance(info, dict) or not {"dtype", "num_tokens"} <= info.keys():
        raise DataError(f"{side} is not a pstar-tokens sidecar; delete it or rewrite "
                        f"{Path(path).name} with pstar-tokens")
    return info


def load_tokens(path: str | os.PathLike, dtype: npt.DTypeLike = None) -> np.memmap:
    """Memory-maps a token file read-only; ``dtype`` is needed only for names without a suffix."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data file {path} is a directory; give a token file from `pstar-tokens`")
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; make one with `pstar-tokens`")
    with io_errors(f"data file {path}", "read"), open(path, "rb") as f:
        if f.read(8) == b"PSTARSFT":  # pstar_jax.packing.MAGIC; read as tokens it would be noise
            raise DataError(f"data file {path} is a packed SFT file (pstar-tokens --chat), not a plain token "
                            f"file; read it with pstar_jax.packing.load_packed")
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
    info = read_token_info(path)
    if info is not None and (info["dtype"] != dtype.name
                             or info["num_tokens"] != size_bytes // dtype.itemsize):
        raise DataError(f"data file {path} holds {size_bytes // dtype.itemsize} {dtype} tokens but "
                        f"its sidecar records {info['num_tokens']} {info['dtype']} tokens; the file "
                        f"is truncated or stale: rewrite it with pstar-tokens")
    try:
        return np.memmap(path, dtype=dtype, mode="r")
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None


def max_token(tokens: np.ndarray) -> int:
    """The largest id, scanned in chunks (bounded memory on a memmapped file of GBs)."""
    _check_tokens(tokens)
    top = -1
    for start in range(0, tokens.size, _SCAN_NUMEL):
        top = max(top, int(tokens[start:start + _SCAN_NUMEL].max()))
    return top


def check_vocab(tokens: np.ndarray, vocab_size: int) -> None:
    """Raises DataError if some token id is ``>= vocab_size``."""
    if (top := max_token(tokens)) >= vocab_size:
        raise DataError(f"data holds token id {top}, but the model's vocabulary has {vocab_size} "
                        f"ids (0 to {vocab_size - 1}); tokenize with the model's tokenizer or "
                        f"pass --vocab-size >= {top + 1}")


def check_destination(path: str | os.PathLike, vocab_size: int, overwrite: bool) -> Path:
    """Refuses a token file name whose suffix does not fit ``vocab_size``, or an existing file."""
    path, dtype = Path(path), token_dtype(vocab_size)
    suffix = token_suffix(dtype)
    if path.is_dir():
        raise DataError(f"output {path} is a directory; name a file such as {path / ('tokens' + suffix)}")
    if not path.name.endswith(suffix):
        stem = next((path.name[:-len(s)] for s in _SUFFIX_DTYPES if path.name.endswith(s)),
                    path.name.removesuffix(".bin"))
        raise DataError(f"token file {path} would hold {dtype} tokens (vocabulary of "
                        f"{vocab_size:,}), so its name must end in {suffix}: name it "
                        f"{path.with_name(stem + suffix)}")
    if path.exists() and not overwrite:
        raise DataError(f"{path} already exists; pass overwrite=True (--overwrite) to replace it")
    return path


@contextlib.contextmanager
def io_errors(path: str | os.PathLike, verb: str) -> Iterator[None]:
    """Turns an OSError into a one-line DataError: 'cannot VERB PATH: reason'."""
    # OSError's own text names a temporary file or nothing at all; the user needs their path.
    try:
        yield
    except OSError as e:
        raise DataError(f"cannot {verb} {path}: {e.strerror or e}") from None


class TokenWriter:
    """Streams ids into a token file under a hidden temporary name; ``commit`` renames it.

    Until ``commit`` the target keeps its old content (or does not exist), so a crash, a full disk
    or Ctrl-C never leaves a partial file under the real name. Use it as a context manager: an
    exception inside the block removes the temporary file.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int, *, overwrite: bool = False,
                 tokenizer: str = "bytes", eos_id: int | None = None) -> None:
        self.path = check_destination(path, vocab_size, overwrite)
        self.dtype, self.vocab_size = token_dtype(vocab_size), vocab_size
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.num_tokens, self.max_id = 0, -1
        with io_errors(self.path, "write"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = create_temp_beside(self.path)  # (the umask's permissions, not mkstemp's 0600)
        self._tmp = Path(tmp)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")

    def write(self, ids: npt.ArrayLike) -> None:
        ids = np.asarray(ids)
        _check_tokens(ids)
        if not ids.size:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise DataError(f"token ids must be in [0, {self.vocab_size}) for {self.path}, "
                            f"got {low if low < 0 else high}")
        with io_errors(self.path, "write"):
            self._file.write(ids.astype(self.dtype, copy=False).tobytes())
        self.num_tokens += ids.size
        self.max_id = max(self.max_id, high)

    def info(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "max_id": self.max_id, "num_tokens": self.num_tokens, "dtype": self.dtype.name}

    def commit(self) -> dict[str, Any]:
        """Renames the finished file into place, writes its sidecar, and returns the sidecar."""
        if self.num_tokens < 2:
            self.abort()
            raise DataError(f"the inputs hold {self.num_tokens} tokens; a token file needs at "
                            f"least 2, so {self.path} was not written")
        side = sidecar_path(self.path)
        try:
            with io_errors(self.path, "write"):
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
            with io_errors(side, "write"):
                # No sidecar beats a stale one: drop the old one before the new data lands.
                side.unlink(missing_ok=True)
            with io_errors(self.path, "write"):
                os.replace(self._tmp, self.path)  # atomic: the old file or the new, never half
        except BaseException:
            self.abort()
            raise
        write_atomic(side, json.dumps(self.info(), indent=1).encode() + b"\n")
        return self.info()

    def abort(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_atomic(path: Path, content: bytes) -> None:
    """``content`` into ``path`` through a file beside it renamed into place, with the umask's mode."""
    with io_errors(path, "write"):
        fd, tmp = create_temp_beside(path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)


def write_tokens(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int, *,
                 overwrite: bool = False) -> None:
    """Atomically writes uint16 tokens (vocab <= 65536) to *.u16.bin, else uint32 to *.u32.bin."""
    tokens = np.asarray(tokens)
    _check_tokens(tokens)
    with TokenWriter(path, vocab_size, overwrite=overwrite, tokenizer="array") as writer:
        writer.write(tokens)
        writer.commit()


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


class ShuffledStream:
    """An endless stream of items (windows of a token file, packed rows) in an order shuffled
    afresh each epoch, read ``batch_size`` global rows at a time.

    ``position`` counts the global batches already consumed, and each epoch's order is a pure
    function of (seed, epoch), so a stream made with ``position=k`` yields what the k-th batch
    onward of a fresh one would. With ``process_count`` > 1 each process gets the contiguous block
    of ``batch_size // process_count`` rows at its index.
    """

    def __init__(self, per_epoch: int, batch_size: int, seed: int, process_index: int, process_count: int,
                 position: int) -> None:
        if batch_size < 1 or min(seed, position) < 0:
            raise DataError(f"need batch_size >= 1 and seed, position >= 0, got {batch_size}, {seed}, {position}")
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index must be in [0, {process_count}), got {process_index}")
        if batch_size % process_count:
            raise DataError(f"batch_size {batch_size} must be divisible by process_count {process_count}")
        self.per_epoch, self.batch_size, self.seed = per_epoch, batch_size, seed
        self.process_index, self.position = process_index, position
        self._local_rows = batch_size // process_count
        self._perm_cache: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def _perm(self, epoch: int) -> np.ndarray:
        # Seeding by (seed, epoch) gives any epoch's order without replaying the ones before,
        # so resuming at any position costs the same as starting.
        if self._perm_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache = (epoch, rng.permutation(self.per_epoch))
        return self._perm_cache[1]

    def state(self) -> dict[str, int]:
        """JSON-able resume state: pass ``position`` back to the constructor."""
        return {"position": self.position}

    def __iter__(self) -> ShuffledStream:
        return self

    def next_items(self) -> np.ndarray:
        """Which items this process's rows of the next global batch are (and advance)."""
        # The items form one endless stream, epoch after epoch; a batch may span an epoch
        # boundary (or several, when the data holds fewer items than a batch).
        first = self.position * self.batch_size + self.process_index * self._local_rows
        self.position += 1
        return shuffled_rows(first, self._local_rows, self.per_epoch, self._perm)


class Batches(ShuffledStream):
    """Endless iterator of plain ``Batch``es of token windows; targets are inputs shifted by one."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, *,
                 process_index: int = 0, process_count: int = 1, position: int = 0) -> None:
        _check_tokens(tokens)
        if seq_len < 1:
            raise DataError(f"need seq_len >= 1, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise DataError(f"data has {len(tokens)} tokens, fewer than one window of "
                            f"seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")
        super().__init__((len(tokens) - 1) // seq_len, batch_size, seed, process_index, process_count, position)
        self.tokens, self.seq_len = tokens, seq_len

    @property
    def windows_per_epoch(self) -> int:
        return self.per_epoch

    def __next__(self) -> Batch:
        starts = self.next_items() * self.seq_len
        windows = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], np.int32)
        return plain(windows[:, :-1], windows[:, 1:])


def shuffled_rows(first: int, count: int, per_epoch: int, perm: Any) -> np.ndarray:
    """Rows ``first .. first + count - 1`` of the endless stream of epochs, each epoch the order
    ``perm(epoch)`` of its ``per_epoch`` rows: which row of the data each one is."""
    epochs, slots = np.divmod(first + np.arange(count), per_epoch)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        rows = epochs == epoch
        out[rows] = perm(int(epoch))[slots[rows]]
    return out


HELD_OUT_FRACTION = 0.01  # of the training tokens, held out for the loss of --eval-every without --eval-data


def held_out_split(tokens: np.ndarray, fraction: float = HELD_OUT_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the last ``fraction`` of the tokens (at least one) held out.

    Both are views (a memmapped file stays memmapped). ``Batches`` over the first part reads no
    token of the second: its windows end within the tokens it is given."""
    _check_tokens(tokens)
    held = max(1, int(len(tokens) * fraction))
    return tokens[:len(tokens) - held], tokens[len(tokens) - held:]


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, micro_batches: int, *,
                 process_index: int = 0, process_count: int = 1, what: str = "the evaluation data"
                 ) -> list[Batch]:
    """The fixed held-out set: ``micro_batches`` micro-batches of ``batch_size`` windows, taken in
    order from the start of ``tokens`` at stride ``seq_len`` (over again when the tokens hold
    fewer windows), this process's rows of each. The same set every time, so losses compare
    across steps. Raises DataError, naming ``what``, when the tokens hold no whole window."""
    _check_tokens(tokens)
    if len(tokens) < seq_len + 1:
        raise DataError(f"{what} holds {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                        f"{seq_len + 1}; use more data or a shorter seq_len")
    if batch_size % process_count:
        raise DataError(f"batch_size {batch_size} must be divisible by process_count {process_count}")
    windows = (len(tokens) - 1) // seq_len
    rows = batch_size // process_count
    out = []
    for m in range(micro_batches):
        first = m * batch_size + process_index * rows
        starts = (first + np.arange(rows)) % windows * seq_len
        block = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], np.int32)
        out.append(plain(block[:, :-1], block[:, 1:]))
    return out


# -- either kind of data: token windows (np.ndarray) or packed SFT rows (pstar_jax.rows) --------

SFT_SUFFIXES = (".sft.u16.bin", ".sft.u32.bin")


def open_training_data(path: str | os.PathLike | None, vocab_size: int) -> Any:
    """The data a path names, checked against the vocabulary: a packed SFT file's rows (an object
    with ``tokens``, ``segments``, ``labels`` [rows, seq_len + 1]), a token file's tokens, or
    without a path the built-in corpus."""
    if path is not None and Path(path).name.endswith(SFT_SUFFIXES):
        from pstar_jax.packing import load_packed
        rows = load_packed(path)
        check_vocab(np.asarray(rows.tokens).reshape(-1), vocab_size)
        return rows
    tokens = load_tokens(path) if path else default_corpus()
    check_vocab(tokens, vocab_size)
    return tokens


def is_packed(data: Any) -> bool:
    """Whether the data is packed SFT rows (else a 1-D array of tokens)."""
    from pstar_jax.rows import is_rows
    return not isinstance(data, np.ndarray) and is_rows(data)


def training_batches(data: Any, batch_size: int, seq_len: int, seed: int, **kwargs: int) -> Any:
    """``Batches`` over tokens or ``PackedBatches`` over rows (kwargs: process_index,
    process_count, position)."""
    if is_packed(data):
        from pstar_jax.rows import PackedBatches
        return PackedBatches(data, batch_size, seed, seq_len=seq_len, **kwargs)
    return Batches(data, batch_size, seq_len, seed, **kwargs)


def held_out(data: Any) -> tuple[Any, Any]:
    """(training data, held-out data): the last 1% of the tokens, or of the rows."""
    if is_packed(data):
        from pstar_jax.rows import held_out_rows
        return held_out_rows(data)
    return held_out_split(data)


def evaluation_set(data: Any, batch_size: int, seq_len: int, micro_batches: int, **kwargs: Any) -> list[Batch]:
    """``eval_batches`` over tokens or ``packed_eval_batches`` over rows (kwargs: process_index,
    process_count, what)."""
    if is_packed(data):
        from pstar_jax.rows import packed_eval_batches
        return packed_eval_batches(data, batch_size, micro_batches, seq_len=seq_len, **kwargs)
    return eval_batches(data, batch_size, seq_len, micro_batches, **kwargs)
