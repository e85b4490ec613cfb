"""Rates of the machine a plan is made for: transfers, compute, optimizer updates.

The planner predicts step time from these. ``H200`` holds figures measured on the project's
GPU machine; ``measure`` takes a quick reading of the machine at hand (about a second).

A reading is noisy, and a plan made from a fresh one can differ run to run. So a machine is
measured once and its rates kept in a JSON file named by what they depend on (platform,
device kind, jax version, core count, compute dtype) under ``machines_dir()``;
``saved_machine`` reads it back, measuring only when there is none. Re-measure with
``pstar-machine --remeasure`` (pstar_jax/machine_cli.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pstar_jax.config import ConfigError

log = logging.getLogger(__name__)  # start-up phases (see cli.start_up_notes)

MACHINES_DIR_ENV = "PSTAR_MACHINES_DIR"


@dataclasses.dataclass(frozen=True)
class Machine:
    """Per-device rates."""
    name: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    flops_per_s: float  # sustained FLOP/s of stage compute, as XLA's cost analysis counts FLOPs
    device_adam_params_per_s: float
    host_adam_params_per_s: float
    call_s: float = 0.0  # fixed cost of one stage or optimizer call (dispatch, launch, sync)
    duplex: bool = False  # host->device and device->host copies run at full rate at once


# One H200, jax 0.11.2 (shared/DESIGN.md): pinned-host copies, Adam on the device and with
# compute_on('device_host') over 16 cores. The compute rate is in FLOPs as the trace counts them
# (pstar_jax.flops: XLA's cost analysis with every loop iteration, recompute included): plain GPT
# 1.3B with full remat took 0.426 s/step there, and its compiled step counts 1.739e14 FLOPs
# (scripts/calibrate_flops.py; the chunked trace of the same step counts the same), so 408e12/s.
# Not measured there: the fixed cost per call (0) and whether the two copy directions overlap
# (assumed not).
H200 = Machine("h200", 48.6 * 2**30, 49.0 * 2**30, 408e12, 119e9, 0.88e9)


# The same if the two copy directions overlap fully (scripts/bandwidth.py says whether they do).
MACHINES = {"h200": H200, "h200-duplex": dataclasses.replace(H200, name="h200-duplex", duplex=True)}


def describe(machine: Machine) -> str:
    """'h200 rates (preset)' or 'NAME rates (measured)': where a plan's rates came from."""
    preset = MACHINES.get(machine.name) == machine
    return f"{machine.name} rates ({'preset' if preset else 'measured'})"


def copies_overlap(h2d_s: float, d2h_s: float, both_s: float) -> bool:
    """Whether one copy each way at once (``both_s``) ran well below the two one after the other:
    the two directions have their own copy engines (``Machine.duplex``)."""
    return both_s < 0.75 * (h2d_s + d2h_s)


def _best_time(fn: Callable[[], object], repeats: int = 3) -> float:
    jax.block_until_ready(fn())  # warm-up: compile and first touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())  # sync: the measurement needs the work done
        best = min(best, time.perf_counter() - start)
    return best


def measure(placement, optimizer, numel: int = 1 << 22) -> Machine:
    """Time a chunk's copies each way and both at once, a matmul and a chunk's optimizer update in
    each space."""
    from pstar_jax.memory import Space  # memory imports nothing of ours but config; keep machine light

    x = placement.put(np.zeros((numel,), np.float32), Space.DEVICE)
    on_host = jax.device_put(x, x.sharding.with_memory_kind(Space.HOST.value))
    nbytes = numel * 4 // placement.n_devices
    h2d_s = _best_time(lambda: jax.device_put(on_host, x.sharding))
    d2h_s = _best_time(lambda: jax.device_put(x, on_host.sharding))
    y = placement.put(np.ones((numel,), np.float32), Space.DEVICE)
    both_s = _best_time(lambda: (jax.device_put(on_host, x.sharding), jax.device_put(y, on_host.sharding)))
    n = 1024
    a = jnp.ones((n, n), optimizer.param_dtype)  # the compute dtype: bf16 is far slower on some CPUs
    matmul = jax.jit(lambda a: a @ a)
    flops = 2 * n**3 / _best_time(lambda: matmul(a))
    adam = {}
    for space in Space:
        state = {"master": placement.put(np.zeros(numel, np.float32), space)}
        state["opt"] = optimizer.init(state["master"])
        grads = [placement.put(np.zeros(numel, optimizer.param_dtype), space) for _ in range(4)]
        clip = jnp.ones((), jnp.float32)

        def update(space=space, state=state, grads=grads):  # each call donates a fresh grad
            state["master"], state["opt"], _ = optimizer.update(space, grads.pop(), state["master"],
                                                                state["opt"], clip, 0)
            return state["master"]
        adam[space] = numel / placement.n_devices / _best_time(update)
    tiny = jnp.ones((8,), jnp.float32)
    call = jax.jit(lambda x: x + 1)
    call_s = _best_time(lambda: call(tiny), repeats=20)
    return Machine(f"{jax.devices()[0].platform} (measured)", nbytes / h2d_s, nbytes / d2h_s, flops, adam[Space.DEVICE],
                   adam[Space.HOST], call_s, duplex=copies_overlap(h2d_s, d2h_s, both_s))


def cache_dir() -> Path:
    """pstar_jax's directory under the user's cache directory ($XDG_CACHE_HOME or ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pstar_jax"


def machines_dir() -> Path:
    """Where measured machines are kept: $PSTAR_MACHINES_DIR, else machines/ in ``cache_dir()``."""
    if os.environ.get(MACHINES_DIR_ENV):
        return Path(os.environ[MACHINES_DIR_ENV])
    return cache_dir() / "machines"


def machine_key(param_dtype) -> str:
    """The file name (without .json) of this machine's rates for ``param_dtype``."""
    device = jax.devices()[0]
    parts = (device.platform, device.device_kind, f"jax{jax.__version__}", f"{os.cpu_count()}cores",
             jnp.dtype(param_dtype).name)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))


def save_machine(machine: Machine, path: str | os.PathLike) -> None:
    """Write ``machine`` as JSON (whole or not at all: written beside, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(dataclasses.asdict(machine), indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # no half-written file beside the target
        raise


def load_machine(source: str | os.PathLike) -> Machine:
    """A machine by name (``MACHINES``) or from a JSON file that ``save_machine`` wrote."""
    if str(source) in MACHINES:
        return MACHINES[str(source)]
    try:
        fields = json.loads(Path(source).read_text())
        machine = Machine(**fields)
    except OSError as err:
        raise ConfigError(f"machine {str(source)!r} is neither one of {', '.join(MACHINES)} nor a readable "
                          f"file ({err.strerror}); measure one with pstar-machine") from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"machine file {str(source)!r} is not a saved machine ({err}); measure it again "
                          f"with pstar-machine --remeasure") from None
    def number(value, low: float) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value < float("inf")
    rates = (machine.h2d_bytes_per_s, machine.d2h_bytes_per_s, machine.flops_per_s,
             machine.device_adam_params_per_s, machine.host_adam_params_per_s)
    if not all(number(r, 1e-300) for r in rates) or not number(machine.call_s, 0.0):
        raise ConfigError(f"machine file {str(source)!r} holds a rate that is not a positive number")
    return machine


def _warn(message: str) -> None:
    print(f"pstar_jax: warning: {message}", file=sys.stderr, flush=True)


def saved_machine(placement, optimizer, remeasure: bool = False, must_keep: bool = False,
                  warn: Callable[[str], None] = _warn) -> Machine:
    """This machine's saved rates, measured (with ``measure``) and saved first when there are none
    or ``remeasure`` says so: the same machine then always plans with the same rates.

    The file is a cache: one that cannot be read (not JSON, a field missing, a directory) is
    measured again and replaced, and rates that cannot be kept (a read-only or impossible
    directory) serve this run only; both with a ``warn`` line. ``must_keep`` (pstar-machine,
    whose job is to keep them) raises the OSError instead."""
    path = machines_dir() / f"{machine_key(optimizer.param_dtype)}.json"
    if path.exists() and not remeasure:
        try:
            return load_machine(path)
        except ConfigError as err:
            warn(f"{err}; measuring this machine again")
    log.info("measuring this machine's rates (once, kept in %s)", path)
    machine = dataclasses.replace(measure(placement, optimizer), name=path.stem)
    try:
        save_machine(machine, path)
    except OSError as err:
        if must_keep:
            raise
        warn(f"cannot keep this machine's rates in {path} ({err.strerror}); measured them for this run only "
             f"(set {MACHINES_DIR_ENV} to a writable directory)")
    return machine
