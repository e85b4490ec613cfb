"""Token files: the raw output of ``np.ndarray.tofile``, tokens back to back, no header.

Its dtype is part of its name, ``NAME.u16.bin`` or ``NAME.u32.bin``, so a file can never be
read with the wrong width; a raw ``.bin`` from elsewhere (nanoGPT's ``train.bin`` is uint16)
loads with an explicit ``dtype=``. ``pstar-tokens`` also writes a sidecar ``NAME.uXX.bin.json``
(tokenizer, vocab size, eos id, largest id, token count, dtype); it is optional, but when present
``load_tokens`` checks the file against it. Files are memory-mapped, so a corpus larger than host
memory costs only the pages a batch touches.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
import numpy.typing as npt

from pstar_jax.config.errors import DataError
from pstar_jax.config.paths import create_temp_beside

_SUFFIX_DTYPES = {".u16.bin": np.dtype(np.uint16), ".u32.bin": np.dtype(np.uint32)}
# NUL never occurs in source text, so it marks file boundaries unambiguously.
BYTE_VOCAB_SIZE = 256
# check_vocab reads this many tokens at a time, so a memmapped file of GBs is scanned in
# bounded memory (128 MiB of uint16) rather than as one temporary.
_SCAN_NUMEL = 1 << 26


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


def check_tokens(tokens: np.ndarray) -> None:
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
        if f.read(8) == b"PSTARSFT":  # pstar_jax.data.packing.MAGIC; read as tokens it would be noise
            raise DataError(f"data file {path} is a packed SFT file (pstar-tokens --chat), not a plain token "
                            f"file; read it with pstar_jax.data.packing.load_packed")
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
    check_tokens(tokens)
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
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise DataError(f"cannot {verb} {path}: {e.strerror or e}"
                        + ("; free some space there or write it to another disk" if full else "")) from None


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
        check_tokens(ids)
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
    check_tokens(tokens)
    with TokenWriter(path, vocab_size, overwrite=overwrite, tokenizer="array") as writer:
        writer.write(tokens)
        writer.commit()


def encode_bytes(text_bytes: bytes) -> np.ndarray:
    """Byte-level tokens (vocab 256): one uint16 token per byte."""
    return np.frombuffer(text_bytes, dtype=np.uint8).astype(np.uint16)
