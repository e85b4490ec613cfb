"""Fake CPU devices reaching a collective late (a loaded machine) slow a run down but never end it.

XLA's CPU client aborts the process when the devices of an all-reduce arrive more than its
terminate timeout apart; the 8-device tests died that way on loaded 2-core machines."""

import os
import subprocess
import sys

import pytest

from pstar_jax.compat import CPU_COLLECTIVE_TIMEOUTS, patient_cpu_collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Device 0 reaches the psum `delay` seconds after device 1.
LATE_DEVICE = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from pstar_jax.compat import shard_map

def late(x):
    time.sleep(float(sys.argv[1]))
    return x

def step(x):
    first = jax.lax.axis_index("d") == 0
    x = jax.lax.cond(first, lambda v: jax.pure_callback(late, v, v), lambda v: v, x)
    return jax.lax.psum(x.sum(), "d")

mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
print(float(jax.jit(shard_map(step, mesh, in_specs=P("d"), out_specs=P()))(jnp.ones((4, 4)))))
"""


def run_late(flags: str, delay: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {flags}")
    return subprocess.run([sys.executable, "-c", LATE_DEVICE, str(delay)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_suite_runs_with_patient_collectives():
    flags = os.environ["XLA_FLAGS"]
    for name, seconds in CPU_COLLECTIVE_TIMEOUTS.items():
        assert f"--{name}={seconds}" in flags


def test_a_users_own_timeout_wins(monkeypatch):
    name = "xla_cpu_collective_call_terminate_timeout_seconds"
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=2 --{name}=7")
    patient_cpu_collectives()
    flags = os.environ["XLA_FLAGS"].split()
    assert f"--{name}=7" in flags and not any(f.startswith(f"--{name}=") and f != f"--{name}=7" for f in flags)
    assert "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120" in flags


@pytest.mark.slow
def test_a_late_device_aborts_under_short_timeouts_and_finishes_under_the_projects():
    short = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=1 "
             "--xla_cpu_collective_call_terminate_timeout_seconds=1")
    aborted = run_late(short, 3)
    assert aborted.returncode != 0 and "Termination timeout" in aborted.stderr, aborted.stderr[-1000:]
    terminate = CPU_COLLECTIVE_TIMEOUTS["xla_cpu_collective_call_terminate_timeout_seconds"]
    finished = run_late("--xla_cpu_collective_call_warn_stuck_timeout_seconds=1 "
                        f"--xla_cpu_collective_call_terminate_timeout_seconds={terminate}", 3)
    assert finished.returncode == 0 and finished.stdout.strip() == "16.0", finished.stderr[-1000:]
