"""Output paths, checked before any work: a run never trains for an hour to find that it cannot
write its metrics, checkpoints or exports. As root, os.access says yes even on a read-only file
system, so writability is tried with a probe file."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import tempfile
from typing import Iterator

from pstar_jax.config.errors import ConfigError


def contained(directory: str | os.PathLike, name: str, what: str, error: type[Exception] = ConfigError) -> str:
    """``directory``/``name``, refused (``error``, one line) when it resolves outside ``directory``:
    a file of a downloaded directory (a checkpoint, a tokenizer) never has another file read or
    copied through a link or a ``..`` in a name. The one layout of links allowed is Hugging Face's
    hub cache, whose snapshot files link into their repository's ``blobs/``."""
    root = os.path.realpath(directory)
    path = os.path.join(directory, name)
    target = os.path.realpath(path)
    allowed = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":  # <cache>/models--org--name/snapshots/<rev>
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    if not any(target == a or target.startswith(os.path.join(a, "")) for a in allowed):  # (a may be '/')
        raise error(f"{what} {path} leads to {target}, outside {directory}; put the file itself in {directory}")
    return path


def check_output_dir(path: str, what: str) -> None:
    """Refuse, before any work, a directory that could not be written: a file, a path under a
    file, or a place this process cannot write. Creates nothing."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{what} {path} is a file, not a directory; choose a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{what} {path} is under the file {existing}; choose a directory")
    try:  # os.access says yes to root on a read-only file system: try it
        fd, probe = tempfile.mkstemp(prefix=".pstar-probe-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be written ({existing}: {os_error_cause(err)}); "
                          "choose a writable place") from None


def create_temp_beside(path: str | os.PathLike) -> tuple[int, str]:
    """(fd, name) of a new hidden file beside ``path``, open for writing, to be renamed over it.
    It gets the permissions the umask gives any new file: tempfile's are private (0600), which a
    rename would carry over to a token or metrics file the user's group then cannot read."""
    directory, name = os.path.split(os.path.abspath(path))
    while True:
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:  # (2**32 names: another writer's, try the next)
            continue


def os_error_cause(err: BaseException) -> str:
    """What went wrong on the file system, in words, from an exception chain or its message."""
    text = ""
    while err is not None:
        if isinstance(err, OSError) and err.errno is not None:
            return {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                    errno.EACCES: "permission denied", errno.EDQUOT: "the disk quota is exceeded",
                    errno.ENOENT: "a directory vanished"}.get(err.errno, os.strerror(err.errno).lower())
        text += f" {err}"
        err = err.__cause__ or err.__context__
    for words, cause in (("No space left", "the disk is full"), ("os_error_code='28'", "the disk is full"),
                         ("Read-only file system", "the file system is read-only"),
                         ("Permission denied", "permission denied"), ("quota", "the disk quota is exceeded")):
        if words in text:
            return cause
    first = " ".join(text.split())
    return first[:160] or "unknown error"


def check_output_file(path: str, what: str) -> None:
    """Refuse a file path that names a directory, lies under a file, or cannot be written."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path} is a directory; name a file")
    check_output_dir(os.path.dirname(path), what)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{what} {path} cannot be written (permission denied); choose another path")


def new_dir(parent: str, prefix: str) -> str:
    """A fresh directory ``parent/prefix<hex>`` with the umask's permissions (tempfile.mkdtemp's are
    private, which a rename would carry over to an export the user's group then cannot read)."""
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:  # (2**32 names: another writer's, try the next)
            continue


def replace_dir(staging: str, directory: str) -> None:
    """Rename a finished ``staging`` directory to ``directory``; one already there (an earlier export
    or an empty directory) is moved aside first and removed after, so the target is always absent,
    the old one or the new one, never half of each."""
    old = None
    if os.path.isdir(directory):
        old = new_dir(os.path.dirname(directory), f".{os.path.basename(directory)}.old-")
        os.rename(directory, os.path.join(old, "export"))
    os.rename(staging, directory)
    if old:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(directory: str, what: str) -> Iterator[str]:
    """A fresh directory beside ``directory`` to write an export into, put in its place
    (``replace_dir``) when the block ends; on any error it is removed and the target is left as it
    was, and a file-system error is one ConfigError naming ``what`` and the cause."""
    from safetensors import SafetensorError
    parent, base = os.path.split(os.path.abspath(directory))
    staging = None
    try:
        os.makedirs(parent, exist_ok=True)
        staging = new_dir(parent, f".{base}.partial-")
        yield staging
        replace_dir(staging, directory)
    except (OSError, SafetensorError) as err:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(f"{what} {directory} could not be written ({os_error_cause(err)}); nothing was "
                          "changed there: free space or choose a writable place") from None
    except BaseException:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        raise
