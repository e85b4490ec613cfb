"""The host stays a few moments ahead of the devices (pstar_jax.engine.pacing): XLA's CPU client
deadlocks a multi-device collective once more than 32 programs are in flight per device, so the
chunked engine's ZeRO step and evaluation over eight devices must finish however many moments
they dispatch. Each case runs in a subprocess with XLA's collective timeouts cut to seconds, so a
deadlock ends the case at once (XLA aborts) instead of hanging the suite."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from pstar_jax.engine.pacing import AHEAD_MOMENTS, Pacer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_TIMEOUTS = ("--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_warn_stuck_timeout_seconds=5"
                  " --xla_cpu_collective_call_terminate_timeout_seconds=20")


def test_the_pacer_waits_for_the_moment_ahead_moments_back():
    waited = []
    pacer = Pacer(ahead=3)
    for k in range(7):
        x = jnp.full((4,), float(k))
        pacer.mark(None if k == 2 else x)  # a moment that dispatched nothing of its own counts too
        waited.append(pacer.pending)
    assert waited == [1, 2, 3, 3, 3, 3, 3] and Pacer().ahead == AHEAD_MOMENTS
    with pytest.raises(ValueError, match="ahead >= 1"):
        Pacer(ahead=0)


def _run(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": QUICK_TIMEOUTS, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=600)


ENGINE = """
    import dataclasses, numpy as np, jax
    from jax.sharding import Mesh
    from pstar_models.gpt import StagedGPT, preset
    from pstar_jax.config import EngineConfig, OptimConfig
    from pstar_jax.engine.optim import default_tx
    from pstar_jax.plan.machine import H200
    from pstar_jax.planner.build import chunked_engine

    mesh = Mesh(np.array(jax.devices()), ("data",))
    optim = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=10, clip_norm=1.0)
    cfg = EngineConfig(8192, None, "fp32", adam_placement="host", micro_batches=MICRO)
    engine = chunked_engine(StagedGPT(dataclasses.replace(preset("tiny"), n_layer=4)), cfg, default_tx(optim), mesh,
                            (8, 32), H200, clip_norm=optim.clip_norm)
    rng = np.random.default_rng(0)
    def batches(n):
        tok = rng.integers(0, 256, (n, 8, 33))
        return [(t[:, :-1], t[:, 1:]) for t in tok]
    for _ in range(2):
        engine.step(batches(MICRO))
    print("eval", engine.evaluate(batches(EVAL)))
"""


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs conftest's 8 fake devices")
def test_zero_over_8_devices_runs_many_moments_without_a_collective_deadlock():
    """8 micro-batches a step and an evaluation of 24: hundreds of sharded programs, each with an
    all-gather, dispatched without a sync of the engine's own (unpaced, XLA aborts here)."""
    done = _run(ENGINE.replace("MICRO", "8").replace("EVAL", "24"))
    assert done.returncode == 0 and "Termination timeout" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.startswith("eval ")
