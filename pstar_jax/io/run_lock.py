"""A run owns its checkpoint directory: process 0 holds an flock on a file inside it, which the
kernel drops when the process dies, so a second run into the same directory is refused while the
first lives and a crashed run never blocks the next. The lock file records the holder's pid and
host, so a reader whose step a live run rotated away mid-read is told which run holds the
directory and to retry."""

from __future__ import annotations

import fcntl
import os
import socket

from pstar_jax.config.errors import CheckpointError

LOCK_NAME = ".pstar-run.lock"


def _holder_text(lock_path: str) -> str:
    """'pid 123 on host gpu7' from a lock file's record ('123 gpu7'; older runs wrote the pid alone)."""
    try:
        with open(lock_path) as f:
            pid, _, host = f.read().strip().partition(" ")
    except OSError:
        pid, host = "", ""
    return f"pid {pid or 'unknown'}" + (f" on host {host}" if host else "")


def live_holder(directory: str) -> str | None:
    """'pid 123 on host gpu7' if a live run holds ``directory``'s lock, else None. Probed with a
    shared lock (a live run holds an exclusive one), released at once; never creates the file."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _holder_text(path)
    finally:
        os.close(fd)  # (drops the shared lock if we got it)
    return None


class DirectoryLock:
    """An exclusive flock on ``directory``/.pstar-run.lock, holding the owner's pid and host for
    messages. The kernel releases it when the process ends, however it ends."""

    def __init__(self, directory: str, what: str = "--checkpoint-dir"):
        self.path = os.path.join(directory, LOCK_NAME)
        # Locked through a read-only descriptor: an open writable file would keep the file system
        # from being remounted, and the pid is only for messages.
        self._fd = -1
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise CheckpointError(f"another run ({_holder_text(self.path)}) is using {what} {directory}; wait for "
                                  "it to end or choose another directory") from None
        self._fd = fd
        with open(self.path, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}\n")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the lock
            self._fd = -1

    def __del__(self) -> None:  # a Checkpointer dropped without close() does not keep its directory
        self.release()
