"""How far the host may run ahead of the devices.

JAX dispatch is asynchronous: the executor enqueues a moment's fetches and its stage and goes on
to the next moment, which is what lets a fetch overlap the stage before it. It must not go on
without bound. XLA's CPU client admits at most 32 programs in flight per device, and the parts
of one multi-device program are launched, each taking its device's slot, by tasks of a shared
thread pool: with more than 32 programs dispatched ahead, a later program's part can take a
device's last slot first, and an earlier program's collective then waits for that device's part
for ever (XLA aborts the process after its collective timeout: "Termination timeout ... Expected
8 threads to join the rendezvous"). Reproduced on jax 0.10.2 and 0.11.2 with eight CPU devices
and a chain of shard_map'ed all-gathers: every time with 40 programs ahead, never with 28. The
chunked engine over eight fake devices (ZeRO, W=8) met it in an evaluation of many micro-batches.

``Pacer`` keeps the host at most ``AHEAD_MOMENTS`` moments in front: before going past that, it
waits for the output of the moment that many back. A moment dispatches a few programs (its
stage, a sum of squares, an update, copies), so this stays well inside the 32. On a GPU, four
moments of queued work still hide the host's dispatch time behind the device's.

An output the next moment donates (a backward's activation gradient and grad chunks) cannot be
waited for once donated, so for those the pacer keeps a token instead: each device's first
element of its shard, taken by a small program of no communication, ready when the output is.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pstar_jax import compat

AHEAD_MOMENTS = 4


class Pacer:
    """Marks each moment's output; waits for the one ``ahead`` moments back before the next."""

    def __init__(self, ahead: int | None = None) -> None:
        self.ahead = AHEAD_MOMENTS if ahead is None else ahead
        if self.ahead < 1:
            raise ValueError(f"Pacer needs ahead >= 1, got {self.ahead}")
        self._outputs: collections.deque[Any] = collections.deque()

    def mark(self, output: Any, donated: bool = False) -> None:
        """``output`` (any pytree of arrays; None for a moment that dispatched nothing of its own)
        is what the moment just dispatched produced; ``donated``: a later moment may donate it.
        One array of it suffices: a program's outputs are ready together."""
        leaves = [x for x in jax.tree.leaves(output) if isinstance(x, jax.Array)]
        self._outputs.append(_token(leaves[0]) if donated and leaves else leaves[:1])
        if len(self._outputs) > self.ahead:
            jax.block_until_ready(self._outputs.popleft())  # sync: pacing, see the module docstring

    @property
    def pending(self) -> int:
        """How many marked moments the host has not waited for."""
        return len(self._outputs)


def _token(x: jax.Array) -> jax.Array:
    """A small array ready when ``x`` is: each device's first element of its shard of ``x``."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        return jnp.ravel(x)[:1]
    return _first_elements(sharding.mesh, sharding.spec)(x)


@functools.lru_cache(maxsize=None)
def _first_elements(mesh: jax.sharding.Mesh, spec: P) -> Any:
    every = P(mesh.axis_names)  # one element per device, whatever ``spec`` shards
    return jax.jit(compat.shard_map(lambda a: jnp.ravel(a)[:1], mesh, in_specs=spec, out_specs=every))


__all__ = ["AHEAD_MOMENTS", "Pacer"]
