"""This machine's rates, measured once and kept: a quick reading of a chunk's copies each way, a
matmul and a chunk's optimizer update in each space (about a second).

A reading is noisy, and a plan made from a fresh one can differ run to run. So a machine is
measured once and its rates kept in a JSON file named by what they depend on (platform,
device kind, jax version, core count, compute dtype) under ``machines_dir()``;
``saved_machine`` reads it back, measuring only when there is none. Re-measure with
``pstar-machine --remeasure`` (pstar_jax/cli/machine.py).

A reading on a busy CPU can be many times off, so it keeps the load it was taken at
(``measuring_conditions``): start-up notes a kept reading from a busy machine or from a load far
from today's (``load_note``), and a first step that compiles nothing yet runs far from the plan's prediction
(``step_gap_note``).
"""

from __future__ import annotations

import dataclasses
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

from pstar_jax.config import ConfigError, format_seconds
from pstar_jax.engine.memory import Space
from pstar_jax.plan.machine import DISK_FIELDS, Machine, copies_overlap, load_machine, load_note, provenance, save_machine

log = logging.getLogger(__name__)  # start-up phases (see pstar_jax.cli.flags.start_up_notes)

MACHINES_DIR_ENV = "PSTAR_MACHINES_DIR"


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
    conditions = measuring_conditions()  # before our own work adds to the load
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
    call_s = _stage_call_s()
    return Machine(f"{jax.devices()[0].platform} (measured)", nbytes / h2d_s, nbytes / d2h_s, flops, adam[Space.DEVICE],
                   adam[Space.HOST], call_s, duplex=copies_overlap(h2d_s, d2h_s, both_s), **conditions)


def _stage_call_s(calls: int = 20) -> float:
    """The fixed cost of one stage call: a forward and backward of a block too small for its work
    to count (an RMS norm, attention and an MLP over 16 tokens of width 64: the dozens of ops a
    stage launches, each with its own dispatch and launch), called back to back as the executor
    calls stages. A call of one op (x + 1) costs a tenth of that on a CPU."""
    def block(params, x):
        w_in, w_out, gain, wq = params
        h = x * gain[None, :] / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        q = h @ wq
        mixed = jax.nn.softmax(q @ q.T / 8.0, -1) @ h
        return x + jax.nn.gelu(mixed @ w_in) @ w_out

    def forward_backward(params, x, cotangent):
        y, pullback = jax.vjp(block, params, x)
        return y, pullback(cotangent)
    call = jax.jit(forward_backward)
    d = 64
    params = tuple(jnp.full(shape, 0.01, jnp.float32) for shape in [(d, 4 * d), (4 * d, d), (d,), (d, d)])
    x = jnp.ones((16, d), jnp.float32)

    def back_to_back():
        return [call(params, x, x) for _ in range(calls)]
    return _best_time(back_to_back) / calls


def load_now() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def measuring_conditions() -> dict:
    """The ``Machine.measured_*`` fields of a reading taken now."""
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "measured_load": load_now(),
            "measured_cores": os.cpu_count()}


STEP_GAP = 3.0  # a timed step this many times slower or faster than predicted: the rates are wrong


MOMENT_SLACK_S = 5e-3  # the executor's own time per moment that no rate covers (see step_gap_note)


def step_gap_note(step: int, step_s: float, predicted_s: float, machine: Machine, moments: int = 0) -> str | None:
    """One line when step ``step`` (0-based) took ``step_s`` and the plan made with ``machine``
    predicted ``predicted_s``, more than ``STEP_GAP`` times apart either way: the rates do not
    describe the machine now (measured under another load, or another machine's); None otherwise.

    A plan of ``moments`` moments is also allowed ``MOMENT_SLACK_S`` per moment either way: the
    executor's own work per moment (its bookkeeping, the syncs on the loss, ops too small to run
    at the rates), which no rate covers. On this project's 2-core CPU the tiny default model's 12
    moments took 2 ms each at load 1 and 4 ms at load 2 against 0.16 ms predicted: a gap that
    size says nothing about the rates, and measuring them again would not close it."""
    if not (0 < predicted_s < float("inf") and step_s > 0):
        return None
    gap = max(step_s / predicted_s, predicted_s / step_s)
    if gap <= STEP_GAP or abs(step_s - predicted_s) <= moments * MOMENT_SLACK_S:
        return None
    now = load_now()
    how = (f"measured {machine.measured_at} at load {machine.measured_load:.1f}" if machine.measured_load is not None
           else provenance(machine))
    fix = ("without --machine it plans with this machine's own, measured rates" if how == "preset" else
           "pstar-machine --remeasure measures them again")
    return (f"step {step + 1} took {format_seconds(step_s)}, the plan predicted {format_seconds(predicted_s)} "
            f"({gap:.0f}x {'slower' if step_s > predicted_s else 'faster'}): the {machine.name} rates ({how}"
            f"{f', load now {now:.1f}' if now is not None else ''}) do not describe this machine now; {fix}")


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




def _warn(message: str) -> None:
    print(f"pstar_jax: warning: {message}", file=sys.stderr, flush=True)


def saved_machine(placement, optimizer, remeasure: bool = False, must_keep: bool = False,
                  warn: Callable[[str], None] = _warn) -> Machine:
    """This machine's saved rates, measured (with ``measure``) and saved first when there are none
    or ``remeasure`` says so: the same machine then always plans with the same rates. Measuring
    again keeps the disk rates a kept file has (``pstar-machine --disk DIR`` reads those).

    The file is a cache: one that cannot be read (not JSON, a field missing, a directory) is
    measured again and replaced, and rates that cannot be kept (a read-only or impossible
    directory) serve this run only; both with a ``warn`` line. ``must_keep`` (pstar-machine,
    whose job is to keep them) raises the OSError instead. Rates measured on a busy machine, or
    under a load far from today's, are said so in a start-up note (``load_note``)."""
    path = machines_dir() / f"{machine_key(optimizer.param_dtype)}.json"
    kept = None
    if path.exists():
        try:
            kept = load_machine(path)
        except ConfigError as err:
            warn(f"{err}; measuring this machine again")
        else:
            if not remeasure:
                if note := load_note(machine=kept, load_now=load_now()):
                    log.info("kept %s", note)
                return kept
    log.info("measuring this machine's rates (once, kept in %s)", path)
    machine = dataclasses.replace(measure(placement, optimizer), name=path.stem,
                                  **({f: getattr(kept, f) for f in DISK_FIELDS} if kept else {}))  # not re-read here
    try:
        save_machine(machine, path)
    except OSError as err:
        if must_keep:
            raise
        warn(f"cannot keep this machine's rates in {path} ({err.strerror}); measured them for this run only "
             f"(set {MACHINES_DIR_ENV} to a writable directory)")
    if note := load_note(machine, load_now()):
        log.info(note)
    return machine
