"""The optimizer updates of the chunked engine's chunks, where the plan runs them.

``ChunkUpdates`` is a part of ``ChunkedEngine`` (pstar_jax.engine.executor), kept apart because
the update of a chunk is its own concern: on the device, on the host (begun on a worker thread
once a step's norm is known, taken at the chunk's moment of the next step), or on the device
with its state streamed down ahead of the moment (``_stage``) and back up after it. It uses the
engine's ``store``, ``plan``, ``layout``, ``optimizer`` and ``opt_space``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import jax

from pstar_jax.engine.memory import Space
from pstar_jax.plan.schedule import Access


class ChunkUpdates:
    """Updating the trainable chunks (a part of ``ChunkedEngine``)."""

    def _stage(self, chunks: Iterable[int]) -> None:
        """Send these chunks' streamed optimizer state down ahead of their updates; the plan counts
        it as device memory of the moments in between."""
        for c in chunks:
            self._staged.add(c)
            self.store.reserve(self.plan.opt_state_bytes[c])
            for kind in ("master", "opt"):
                self.store.get((kind, c), Space.DEVICE)

    def _update_space(self, c: int) -> Space:
        """Where chunk c's update runs: where its state lives, or the device when it is streamed."""
        return Space.DEVICE if self.plan.opt_streamed[c] else self.opt_space[c]

    def _begin_host_updates(self, accesses: Sequence[Access], clip: jax.Array) -> None:
        """Start the pending update of every host-updated chunk, in the order the next step needs
        their params; their grads, masters and states leave the store until ``_adam`` takes the
        results. The grads went up to the host during the backward (the plan's ``to_host``)."""
        for a in accesses:
            c = a.index
            if a.phase == "adam" and self._update_space(c) is Space.HOST and c not in self._begun:
                inputs = (self.store.take((kind, c), Space.HOST) for kind in ("slot", "master", "opt"))
                self._begun[c] = self.optimizer.begin_update(Space.HOST, *inputs, clip, self.layout.n_decay[c])

    def _discard_begun(self) -> None:
        """Wait for the host updates under way and forget their results (the state is being
        replaced); their buffers are the updates' own until they end."""
        begun, self._begun = self._begun, {}
        for pending in begun.values():
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - the results are discarded either way
                pass

    def _adam(self, c: int, clip: jax.Array | None) -> jax.Array:
        """Chunk c's update from the grad in its slot, or the result of the one begun after the
        last step; with ``clip`` None nothing is pending (the slot holds params): the same moves,
        and the params are cast from the master again. Returns the new params."""
        home, space = self.opt_space[c], self._update_space(c)
        if c in self._begun:
            master, state, params = self._begun.pop(c).result()
        else:
            grad = self.store.take(("slot", c), space)
            master = self.store.take(("master", c), space)  # streamed: staged already
            state = self.store.take(("opt", c), space)
            if clip is None:
                master, state, params = self.optimizer.keep(space, grad, master, state)
            else:
                master, state, params = self.optimizer.update(space, grad, master, state, clip,
                                                              self.layout.n_decay[c])
        for key, value in ((("master", c), master), (("opt", c), state)):
            self.store.put(key, value)
            if space is not home:  # streamed: back up at once (the plan counts both trips)
                self.store.evict(key)
        if c in self._staged:
            self._staged.discard(c)
            self.store.reserve(-self.plan.opt_state_bytes[c])
        self.store.put(("param", c), params)
        return params


__all__ = ["ChunkUpdates"]
