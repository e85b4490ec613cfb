"""The process runtime of a multi-process run: joining, noticing dead peers, stopping together.

Processes join through jax.distributed (flags or PSTAR_* variables). Three ways a run can end
badly, each turned into one line on stderr and a non-zero exit instead of a hang or a native
stack:

- the coordinator never answers: a deadline thread ends the process after ``timeout_s``, before
  jax's own (fatal, native-stack) initialization timeout;
- a peer dies: the next collective fails with a runtime error; ``peer_failures_end_the_process``
  reports it and leaves with ``hard_exit``, skipping jax's exit-time shutdown barrier, which
  would otherwise abort the process waiting for the dead peer;
- a step hangs (a peer stopped but its sockets are open): the ``Watchdog`` thread only measures
  time, and ends the process when a step after the first makes no progress for its limit.

A signal that reaches the processes at different steps, or only one of them, must not split the
run (one process saving, the other inside the next step's collectives): every step the processes
share their stop flags (``agree_to_stop``) and all stop after the same step.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import traceback
from typing import Iterator

import jax
import numpy as np

from pstar_jax.config import ConfigError
from pstar_jax.run.exits import hard_exit

ENV = {"coordinator": "PSTAR_COORDINATOR", "num_processes": "PSTAR_NUM_PROCESSES", "process_id": "PSTAR_PROCESS_ID"}
EXIT_PEER_FAILED = 3  # the exit status of a process ended by a dead peer, a hang or an unreachable coordinator


def _env_int(name: str, flag: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer; set it like {flag} (e.g. {name}=2)") from None


def resolve(coordinator: str | None, num_processes: int | None,
            process_id: int | None) -> tuple[str, int, int] | None:
    """Flags, else PSTAR_* variables, checked: (coordinator, processes, id), or None for one process."""
    coordinator = coordinator or os.environ.get(ENV["coordinator"]) or None
    if num_processes is None:
        num_processes = _env_int(ENV["num_processes"], "--num-processes")
    if process_id is None:
        process_id = _env_int(ENV["process_id"], "--process-id")
    if coordinator is None and num_processes is None and process_id is None:
        return None
    if coordinator is None or num_processes is None or process_id is None:
        raise ConfigError("multi-host training needs --coordinator HOST:PORT, --num-processes N and "
                          "--process-id I (or PSTAR_COORDINATOR, PSTAR_NUM_PROCESSES, PSTAR_PROCESS_ID)")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator must be HOST:PORT with a port in 1..65535, got {coordinator!r}")
    if num_processes < 1:
        raise ConfigError(f"--num-processes must be at least 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id must be in 0..{num_processes - 1} for --num-processes {num_processes}, "
                          f"got {process_id}")
    return coordinator, num_processes, process_id


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               timeout_s: float = 120, heartbeat_timeout_s: int = 60, prog: str = "pstar-train") -> None:
    """jax.distributed.initialize from flags or PSTAR_* variables; nothing when neither is given.

    If the processes have not all joined within ``timeout_s`` the process ends with one line
    (exit 3): jax's own timeout, set later than ours, would abort with a native stack."""
    if not timeout_s > 0 or not math.isfinite(timeout_s):
        raise ConfigError(f"the coordinator timeout must be a positive number of seconds, got {timeout_s}")
    if not heartbeat_timeout_s >= 1:
        raise ConfigError(f"--heartbeat-timeout must be at least 1 second, got {heartbeat_timeout_s}")
    resolved = resolve(coordinator, num_processes, process_id)
    if resolved is None:
        return
    coordinator, num_processes, process_id = resolved
    joined = threading.Event()

    def deadline() -> None:
        if not joined.wait(timeout_s):
            hard_exit(EXIT_PEER_FAILED, f"{prog}: error: process {process_id}: the {num_processes} processes did "
                      f"not all join through the coordinator {coordinator} within {timeout_s:.0f} s; check "
                      "that process 0 runs there and every process has the same --coordinator")

    threading.Thread(target=deadline, daemon=True, name="pstar-join-deadline").start()
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=int(timeout_s) + 60,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    joined.set()


def is_main_process() -> bool:
    return jax.process_index() == 0


PEER_WORDS = ("gloo", "connection", "peer", "unavailable", "heartbeat", "deadline", "socket", "closed", "nccl")


@contextlib.contextmanager
def peer_failures_end_the_process(prog: str = "pstar-train") -> Iterator[None]:
    """In a multi-process run, a failed collective (most often: its peer died) or any other runtime
    error from the backend ends this process with one line and exit 3, skipping every cleanup
    that would wait for the peer (jax's exit-time shutdown would abort with a native stack); any
    other error ends it the same way with its own line, exit 2 for a user error (ConfigError),
    else 1. A failed collective is told by its message, not its type: jax raises a dead peer's
    gloo error as a JaxRuntimeError from an asynchronous computation but as a ValueError from a
    jit call that ran it at once (seen with jax 0.11.2 in process_allgather)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - every error of a multi-process run ends here
        if jax.process_count() == 1:
            raise
        # Leaving through the interpreter's exit would join worker threads (a host optimizer update
        # may wait on a dead peer's data) and run jax's shutdown barrier (which aborts with a
        # native stack when a peer is gone): end now, with one line.
        cause = " ".join(str(err).split())
        short = cause[:200] + ("..." if len(cause) > 200 else "")
        where = f"{prog}: error: process {jax.process_index()}"
        ours = type(err).__module__.startswith("pstar_jax")  # ours name the problem; others keep their trace
        if isinstance(err, ConfigError):
            hard_exit(2, f"{where}: {cause}")
        if any(w in cause.lower() for w in PEER_WORDS) and not ours:
            hard_exit(EXIT_PEER_FAILED, f"{where}: a collective with another process failed; another process "
                      f"probably died ({short})")
        if isinstance(err, jax.errors.JaxRuntimeError):
            hard_exit(EXIT_PEER_FAILED, f"{where}: the backend failed ({short}); the other processes stop too")
        if not ours:
            traceback.print_exc()
        hard_exit(1, f"{where}: {cause}")


def agree_to_stop(local_stop: bool) -> bool:
    """Whether any process wants to stop; every process gets the same answer at the same step.

    One small all-gather per step (the loop already waits for each step's loss, so it adds a
    message, not a synchronisation); a single process just returns its own flag."""
    if jax.process_count() == 1:
        return local_stop
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.array([int(local_stop)], np.int32))
    return bool(np.any(flags))


class Watchdog:
    """Ends the process with one clear line if a step makes no progress for ``limit_s`` seconds.

    Collectives over a stuck peer can block inside the runtime, where Python cannot interrupt
    them; a daemon thread that watches a progress clock can still report and exit. It never
    calls into JAX: the backend may be what is stuck, or already failed.

    The clock starts at the first ``progress``: the loop calls it from the end of the second step
    on, since the first two steps compile (the first every stage, the second the optimizer update
    again for the layout the first step's outputs have), which takes as long as it takes on a
    loaded machine and is no sign of a dead peer. ``untimed()`` covers other work that compiles
    (the first evaluation)."""

    def __init__(self, limit_s: float | None, prog: str = "pstar-train", process_index: int = 0):
        if limit_s is not None and not (limit_s > 0 and math.isfinite(limit_s)):
            raise ConfigError(f"--step-timeout must be a positive number of seconds, got {limit_s}")
        self.limit_s = limit_s
        self.prog = prog
        self.process_index = process_index
        self._last: float | None = None  # None: not timing
        self._step = 0
        self._stopped = threading.Event()
        if limit_s:
            threading.Thread(target=self._watch, daemon=True, name="pstar-watchdog").start()

    def progress(self, step: int) -> None:
        """``step`` steps are done; the next must make progress within the limit."""
        self._step, self._last = step, time.monotonic()

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """No limit inside (work that compiles); the clock restarts when it ends, if it ran before."""
        timing, self._last = self._last is not None, None
        try:
            yield
        finally:
            self._last = time.monotonic() if timing else None

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.limit_s / 4)):
            last = self._last
            if last is not None and time.monotonic() - last > self.limit_s:
                hard_exit(EXIT_PEER_FAILED, f"{self.prog}: error: step {self._step} made no progress for "
                          f"{self.limit_s:g} s (process {self.process_index}); another process probably died "
                          "or hangs")
