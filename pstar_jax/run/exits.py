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
from typing import Iterator

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, what shells report for Ctrl-C


def hard_exit(code: int, line: str | None = None) -> None:
    """Print ``line`` (one line on stderr) and end the process now, without exit-time handlers."""
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
    previous handlers come back on leaving (a test may call a tool's ``main`` in its process)."""
    def leave(signum: int, frame: object) -> None:
        hard_exit(128 + signum, signal_line(prog, signum))

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, leave)
        except ValueError:  # not the main thread: signals are not ours to handle
            pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


__all__ = ["EXIT_INTERRUPTED", "hard_exit", "signal_line", "signals_end_the_process"]
