"""Keeping orbax's failure noise to the one line pstar_jax reports for a failed save.

A failed save (full disk, read-only file system) makes orbax log a traceback per writer thread, and
tensorstore's remaining callbacks print one each when they find orbax's event loop closed; the
checkpoint module reports the failure itself, once, naming the cause and the latest good step.
"""

from __future__ import annotations

import logging
import sys


class _DropOrbaxErrors(logging.Filter):
    """orbax logs a traceback per failed save thread; the caller reports the failure as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("orbax" in record.pathname and record.levelno >= logging.ERROR)


def silence_orbax_errors() -> None:
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropOrbaxErrors) for f in logger.filters):
        logger.addFilter(_DropOrbaxErrors())


def _is_closed_loop(kind, value) -> bool:
    return kind is RuntimeError and str(value) == "Event loop is closed"


def drop_closed_loop_errors() -> None:
    """After a failed save, tensorstore's remaining write callbacks (native threads) find orbax's
    event loop closed and print a traceback each; the failure itself is reported as one line.
    Both hooks are wrapped (the callbacks report through one or the other), for that error only."""
    if getattr(sys.unraisablehook, "pstar_drops_closed_loop", False):
        return
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def on_exception(kind, value, tb) -> None:
        if not _is_closed_loop(kind, value):
            excepthook(kind, value, tb)

    def on_unraisable(args) -> None:
        if not _is_closed_loop(args.exc_type, args.exc_value):
            unraisablehook(args)

    on_unraisable.pstar_drops_closed_loop = True
    sys.excepthook, sys.unraisablehook = on_exception, on_unraisable
