"""Signals during training: SIGINT and SIGTERM ask the loop to save and stop after the current
step (a second one stops at once)."""

from __future__ import annotations

import signal


class StopSignal:
    """SIGINT/SIGTERM ask the training loop to save and stop after the current step; a second
    signal stops at once."""

    def __init__(self) -> None:
        self.signum = 0
        # True until the loop's first step has returned: a signal then ends the process at once,
        # even inside a call into C that delays Python's handlers (see run.exits).
        self.nothing_to_save = True
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside some test runners)
                pass

    def _handle(self, signum, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
