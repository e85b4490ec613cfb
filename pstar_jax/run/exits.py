"""How a command-line process ends: one line on stderr and an exit status, without the
interpreter's teardown where that teardown can crash or hang.

The interpreter's exit joins worker threads and runs exit-time handlers: jax's shutdown waits
for a dead peer and then aborts, orbax's threads wait forever for a save that failed, and a
teardown while XLA still compiles on its own threads crashed (a segmentation fault after
Ctrl-C during start-up, 3 of 4 trials). ``hard_exit`` flushes and leaves at once.

Ctrl-C is not left to Python's default either: a KeyboardInterrupt raised inside jaxlib (while
it initialises, or in XLA's garbage-collection callback) is swallowed, and the run went on to
its end. So while a tool starts up or finishes, ``signals_end_the_process`` makes SIGINT and
SIGTERM end it at once with one line (exit 130 and 143). Nothing is lost: no checkpoint is
written then (the training loop installs its own handler, which stops after a step with a
checkpoint), and files are written beside their target and renamed into place.

JAX-free, so that a tool can install its handlers before the seconds of importing JAX.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, what shells report for Ctrl-C


_EXITING = threading.Lock()  # held by the one thread that ends the process


def hard_exit(code: int, line: str | None = None) -> None:
    """Print ``line`` (one line on stderr) and end the process now, without exit-time handlers.
    A second caller (a signal's handler and the watcher below, both woken by one signal) waits
    for the first to end the process, so the line is printed once."""
    if not _EXITING.acquire(blocking=False):
        while True:
            time.sleep(60)
    if line:
        print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def signal_line(prog: str, signum: int) -> str:
    """``prog: interrupted`` for Ctrl-C, ``prog: terminated (SIGTERM)`` for the others."""
    if signum == signal.SIGINT:
        return f"{prog}: interrupted"
    return f"{prog}: terminated ({signal.Signals(signum).name})"


@contextlib.contextmanager
def signals_end_the_process(prog: str) -> Iterator[None]:
    """Inside, SIGINT and SIGTERM end the process at once: one line, exit 128 + the signal. The
    previous handlers come back on leaving (a test may call a tool's ``main`` in its process).

    Python runs a signal's handler only when the main thread is back in bytecode, which a long
    call into C (XLA compiling a step, minutes at a long --seq-len) delays until it returns. So
    the signal also wakes a watcher thread (``signal.set_wakeup_fd``), which ends the process at
    once while ``leave`` is still the signal's handler, or while the training loop's handler (stop
    after a step, with a checkpoint) says it has nothing to save yet (the first step compiling);
    otherwise the watcher leaves the signal to that handler, and ends the process at a second
    one only if that handler has not yet run for the first: a step that never returns (a hung
    device, a dead peer without --step-timeout) holds the main thread in C, where no handler runs."""
    def leave(signum: int, frame: object) -> None:
        hard_exit(128 + signum, signal_line(prog, signum))

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, leave)
        except ValueError:  # not the main thread: signals are not ours to handle
            pass
    watcher = _Watcher(leave) if old else None
    try:
        yield
    finally:
        if watcher:
            watcher.close()
        for sig, handler in old.items():
            signal.signal(sig, handler)


class _Watcher:
    """A daemon thread reading the signal numbers Python's C-level handler writes to a wakeup fd."""

    def __init__(self, leave: Callable[[int, object], None]) -> None:
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(leave,), name="pstar-signal-watcher", daemon=True).start()

    def _watch(self, leave: Callable[[int, object], None]) -> None:
        deferred: list[object] = []  # the training loops' handlers each signal was left to
        while True:
            try:
                got = os.read(self._read, 1)
            except OSError:  # closed
                return
            if not got:
                return
            signum = got[0]
            if signum not in (signal.SIGINT, signal.SIGTERM):
                continue
            handler = signal.getsignal(signum)
            loop = getattr(handler, "__self__", None)
            if handler is leave or getattr(loop, "nothing_to_save", False):
                leave(signum, None)
            elif hasattr(loop, "nothing_to_save"):
                deferred.append(loop)
                # A second signal to the same loop while the first is still not handled: the main
                # thread has not come back to Python since (a handled one is the loop's to act on:
                # it stops at once, after any save under way).
                if deferred.count(loop) > 1 and not loop.signum:
                    leave(signum, None)

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._write)  # the watcher's read returns b"" and it ends


__all__ = ["EXIT_INTERRUPTED", "hard_exit", "signal_line", "signals_end_the_process"]
