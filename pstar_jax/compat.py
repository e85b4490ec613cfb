"""The one place that knows how JAX versions differ (0.10.2 on Python 3.11, 0.11+ on 3.12), and
how XLA's backends differ where the engines must know it.

Everything else imports these names instead of probing jax itself.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import jax
import jax.experimental.compute_on as _compute_on

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# 0.10.x: `compute_on` is a context manager and the decorator form is `compute_on2`;
# 0.11+: `compute_on` is the decorator and `compute_on2` is gone.
_compute_on_decorator = getattr(_compute_on, "compute_on2", None) or _compute_on.compute_on

HOST_SPACE = jax.memory.Space.Host
DEVICE_SPACE = jax.memory.Space.Device


def on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` as host compute inside the accelerator's jit; its outputs stay in host memory.

    Inputs must already be host-resident; arrays created inside ``fn`` (iota, constants) must be
    moved with ``to_host`` before they meet host operands, because one op cannot mix spaces."""
    return _compute_on_decorator(compute_type="device_host", out_memory_spaces=HOST_SPACE)(fn)


def to_host(x: Any) -> Any:
    return jax.device_put(x, HOST_SPACE)


def shard_map(fn: Callable[..., Any], mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any
              ) -> Callable[..., Any]:
    # check_vma=False: the stage functions gather and scatter by hand, and the replication of
    # their outputs cannot always be inferred statically.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def compiler_options(platform: str) -> dict[str, str] | None:
    """XLA options for the training functions (stages, the plain engine's step) on ``platform``.

    A CPU has no bf16 arithmetic: XLA converts around every bf16 op, and its loop-invariant
    code motion then lifts the conversion of each whole stacked input of a tile loop out of
    the loop, a float32 copy of every [tiles, ...] array a tiled stage reads (2x the bf16 bytes
    the program holds; llama-3.1-8b's block backward measured 25.9 against 17.9 bytes x d_model
    per token). Without that pass each iteration converts its own tile. A GPU computes bf16
    natively, so there is nothing to lift and nothing to change; the trace, which is taken on
    the backend that runs the step, then counts on a CPU the bf16 buffers a GPU would hold."""
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"} if platform == "cpu" else None


def cost_flops(compiled_or_lowered: Any) -> float:
    """FLOPs from cost_analysis(), which is a dict in current versions and was a list before."""
    cost = compiled_or_lowered.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def memory_stats(device: jax.Device) -> dict[str, int] | None:
    """The backend's allocator statistics, or None where it keeps none (the CPU backend)."""
    try:
        return device.memory_stats()
    except Exception:  # some plugins raise instead of returning None
        return None


def cpu_device() -> jax.Device | None:
    """A device of the CPU backend (present beside an accelerator unless JAX_PLATFORMS
    excludes it), for small host-side computations that must not queue behind accelerator work."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


# XLA's CPU collectives wait 20 s for every device of an all-reduce to arrive, warn, wait 40 s
# more and then abort the process ("Termination timeout ... Exiting to ensure a consistent
# program state"). Fake CPU devices are threads sharing the machine's cores, so with 8 devices on
# 2 busy cores the last one reaches a collective a minute or more after the first: a slow run,
# not a stuck one. These waits are long enough for any load and still end a real deadlock.
CPU_COLLECTIVE_TIMEOUTS = {"xla_cpu_collective_call_warn_stuck_timeout_seconds": 120,
                           "xla_cpu_collective_call_terminate_timeout_seconds": 600}


def patient_cpu_collectives() -> None:
    """Add ``CPU_COLLECTIVE_TIMEOUTS`` to XLA_FLAGS (a user's own setting of either wins).

    XLA reads the variable when the first backend starts; call this before that. The flags
    name the CPU client's collectives only; other backends ignore them."""
    flags = os.environ.get("XLA_FLAGS", "")
    given = set(re.findall(r"--(\w+)=", flags))
    extra = [f"--{name}={value}" for name, value in CPU_COLLECTIVE_TIMEOUTS.items() if name not in given]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
