"""ZeRO data parallelism across devices and hosts: the mesh and reading results.

Every chunk (and its fp32 master, m and v) is sharded over the ``data`` mesh axis, so each
device holds 1/W of it; stage functions all-gather what they read and reduce-scatter the grads
they write (pstar_jax.engine.stages), and each device updates only its own shard. One device is W=1
of the same code. Across hosts the mesh spans every process's devices and each process feeds
its own rows of the batch; joining the processes and surviving their faults is
pstar_jax.run.distributed.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from pstar_jax.config import ConfigError


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


def to_numpy(x: jax.Array) -> np.ndarray:
    """A global array's value on this host, gathering shards from other processes if needed."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_process_rows(batch_size: int) -> None:
    """Every process feeds an equal block of rows of each global micro-batch."""
    count = jax.process_count()
    if batch_size % count:
        raise ConfigError(f"the micro-batch ({batch_size} sequences) must be a multiple of the {count} processes")


def replicated_value(x: Any) -> float:
    return float(to_numpy(x))
