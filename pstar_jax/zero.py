"""ZeRO data parallelism across devices and hosts: the mesh, jax.distributed, reading results.

Every chunk (and its fp32 master, m and v) is sharded over the ``data`` mesh axis, so each
device holds 1/W of it; stage functions all-gather what they read and reduce-scatter the grads
they write (pstar_jax.stages), and each device updates only its own shard. One device is W=1
of the same code. Across hosts the mesh spans every process's devices; each process feeds its
own rows of the batch and only process 0 talks to the user.

A dead peer must not leave the others hanging: jax.distributed's heartbeat stops the survivors
(the process is terminated with "the JAX distributed service detected fatal errors") and a
watchdog ends a process whose step makes no progress within a time limit.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from pstar_jax.config import ConfigError

ENV = {"coordinator": "PSTAR_COORDINATOR", "num_processes": "PSTAR_NUM_PROCESSES", "process_id": "PSTAR_PROCESS_ID"}


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               timeout_s: int = 120, heartbeat_timeout_s: int = 60) -> None:
    """jax.distributed.initialize from flags or PSTAR_* variables; nothing when neither is given."""
    coordinator = coordinator or os.environ.get(ENV["coordinator"])
    if num_processes is None and os.environ.get(ENV["num_processes"]):
        num_processes = int(os.environ[ENV["num_processes"]])
    if process_id is None and os.environ.get(ENV["process_id"]):
        process_id = int(os.environ[ENV["process_id"]])
    if coordinator is None and num_processes is None and process_id is None:
        return
    if coordinator is None or num_processes is None or process_id is None:
        raise ConfigError("multi-host training needs --coordinator HOST:PORT, --num-processes N and "
                          "--process-id I (or PSTAR_COORDINATOR, PSTAR_NUM_PROCESSES, PSTAR_PROCESS_ID)")
    if ":" not in coordinator:
        raise ConfigError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)


def data_mesh(data_parallel: int | None) -> Mesh:
    """A 1-D ``data`` mesh over the first W devices of all processes (all of them by default)."""
    devices = jax.devices()
    W = data_parallel or len(devices)
    if W > len(devices):
        raise ConfigError(f"--data-parallel {W} needs {W} devices, but {len(devices)} are visible")
    if jax.process_count() > 1 and W != len(devices):
        raise ConfigError("across hosts --data-parallel must use every device of every process")
    # Mesh(...) and not jax.make_mesh: its axes would default to Explicit sharding.
    return Mesh(np.array(devices[:W]), ("data",))


def is_main_process() -> bool:
    return jax.process_index() == 0


def to_numpy(x: jax.Array) -> np.ndarray:
    """A global array's value on this host, gathering shards from other processes if needed."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class Watchdog:
    """Ends the process with one clear line if a step makes no progress for ``limit_s`` seconds.

    Collectives over a dead peer can block inside the runtime, where Python cannot interrupt
    them; a daemon thread that watches a progress clock can still report and exit."""

    def __init__(self, limit_s: float | None, prog: str = "pstar-train"):
        self.limit_s = limit_s
        self.prog = prog
        self._last = time.monotonic()
        self._step = 0
        if limit_s:
            threading.Thread(target=self._watch, daemon=True).start()

    def progress(self, step: int) -> None:
        self._step, self._last = step, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit_s / 4))
            if time.monotonic() - self._last > self.limit_s:
                print(f"{self.prog}: error: step {self._step} made no progress for {self.limit_s:.0f} s "
                      f"(process {jax.process_index()}); another process probably died", file=sys.stderr, flush=True)
                os._exit(3)


def check_process_rows(batch_size: int) -> None:
    """Every process feeds an equal block of rows of each global micro-batch."""
    count = jax.process_count()
    if batch_size % count:
        raise ConfigError(f"the micro-batch ({batch_size} sequences) must be a multiple of the {count} processes")


def replicated_value(x: Any) -> float:
    return float(to_numpy(x))
