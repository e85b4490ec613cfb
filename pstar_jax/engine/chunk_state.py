"""The chunked engine's state as checkpoints and exports see it: the trainable chunks saved and
restored (under the engine's layout or another's), and the tensors read back by name.

``ChunkState`` is a part of ``ChunkedEngine`` (pstar_jax.engine.executor), kept apart because
reading and replacing state is its own concern: it uses the engine's ``store``, ``layout``,
``placement``, ``optimizer``, ``opt_space``, ``plan`` and ``flush``. Between steps (and after
``flush``) each trainable chunk is one copy of each kind: its bf16 params in the slot
("slot", c), its fp32 master and optimizer state; a frozen chunk is its params ("param", c).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pstar_jax.engine.chunks import QUANT_KINDS, ChunkLayout, slot_value, unpack
from pstar_jax.engine.memory import Space
from pstar_jax.engine.zero import to_numpy

# State kind -> the store key kind that holds it once flushed (the bf16 slots then hold params).
_FLUSHED_KEYS = {"param": "slot", "master": "master", "opt": "opt"}


class ChunkState:
    """Saving, restoring and reading the chunked engine's state (a part of ``ChunkedEngine``)."""

    def state(self) -> dict:
        """The trainable chunks as stored (one copy each), the pending update applied first:
        {"param"|"master"|"opt": {"c": value}}. Frozen chunks are the base the engine was built
        from, not state: a checkpoint records where that base came from (pstar_jax.io.base_record) instead of
        holding it (a 70B bf16 base would be 140 GB per checkpoint)."""
        self.flush()
        kept = self.trained_chunks
        return {"param": {str(c): self.store.peek(("slot", c)) for c in kept},
                "master": {str(c): self.store.peek(("master", c)) for c in kept},
                "opt": {str(c): self.store.peek(("opt", c)) for c in kept}}

    def abstract_state(self, layout: ChunkLayout | None = None, chunks: Sequence[int] | None = None) -> dict:
        """Shapes and shardings ``state()`` has (for ``layout``, default ours; ``chunks``, default
        its trainable ones): params on the host, master and optimizer state where the plan keeps
        them (a frozen chunk, saved by earlier versions, on the host)."""
        layout = layout or self.layout
        chunks = layout.trainable_chunks if chunks is None else chunks
        init = self.optimizer.make_tx(jnp.ones((), jnp.float32)).init
        opt_of_size = {n: jax.eval_shape(init, jax.ShapeDtypeStruct((n,), jnp.float32)) for n in set(layout.numels)}

        def placed(x, space):
            spec = self.placement.sharding(space, P("data") if x.ndim else P())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec)

        def space(c):
            return self.opt_space[c] if c < len(self.opt_space) and not layout.is_frozen(c) else Space.HOST
        numel = layout.numel_of
        return {"param": {str(c): placed(jax.ShapeDtypeStruct((numel(c),), self.param_dtype), Space.HOST)
                          for c in chunks},
                "master": {str(c): placed(jax.ShapeDtypeStruct((numel(c),), jnp.float32), space(c)) for c in chunks},
                "opt": {str(c): jax.tree.map(lambda x, c=c: placed(x, space(c)), opt_of_size[numel(c)])
                        for c in chunks if not layout.is_frozen(c)}}

    def load_state(self, state: dict, step: int) -> None:
        """Replace the chunk state ``state`` holds (arrays or numpy in our layout) and set the step
        count; a pending update is discarded. Frozen chunks it lacks keep the base they hold; one it
        has (a checkpoint of an earlier version, which saved them) takes its saved params."""
        self.store.limit(None)
        self._pending_clip = None
        self._discard_begun()
        # (a frozen chunk homed on disk is read from its base there, whatever an old checkpoint saved of it)
        given = [c for c in range(self.layout.n_chunks) if str(c) in state["param"] and self.plan.home(c) != "disk"]
        for c in given:
            for kind in ("param", "slot", "master", "opt"):
                if (kind, c) in self.store:
                    self.store.drop((kind, c))
        for c in given:
            self.store.put(self._params_key(c), self.placement.put(state["param"][str(c)], Space.HOST))
            if not self.layout.is_frozen(c):  # a frozen chunk's saved master is its params again
                self.store.put(("master", c), self.placement.put(state["master"][str(c)], self.opt_space[c]))
                self.store.put(("opt", c), self.placement.put(state["opt"][str(c)], self.opt_space[c]))
        self._place_slots(self.plan)
        self.store.traffic.reset()
        self.step_count = step

    def params(self, kind: str = "master") -> dict[str, np.ndarray]:
        """Current tensors by name (fp32 master, or the compute-dtype params), as numpy; the
        pending update is applied first."""
        self.flush()
        return unpack(self.layout, [self._chunk_values(kind, c) for c in range(self.layout.n_chunks)],
                      self._values_dtype(kind))

    def _values_dtype(self, kind: str) -> np.dtype:
        """What a quantized kernel is dequantized into for ``kind``: float32, or the compute dtype."""
        return np.dtype(np.float32) if kind == "master" else np.dtype(self.param_dtype)

    def _chunk_values(self, kind: str, c: int) -> np.ndarray:
        """Chunk c's "master" (fp32; a frozen chunk's params cast up) or "param" values as numpy (a
        chunk of quantized kernels: its bytes, which ``slot_value`` dequantizes)."""
        if self.layout.is_frozen(c):
            if ("param", c) in self.store:
                value = to_numpy(self.store.peek(("param", c)))
            else:  # homed on disk: read it there (after any read under way, which shares the source)
                self.store.disk.cancel()
                value = np.empty(self.layout.numel_of(c), self.layout.dtype_of(c, self.param_dtype))
                self.store.disk.source.read_into(c, value)
            quantized = self.layout.kinds[c] in QUANT_KINDS
            return value.astype(np.float32) if kind == "master" and not quantized else value
        return to_numpy(self.store.peek((_FLUSHED_KEYS[kind], c)))

    def iter_params(self, kind: str = "master") -> Iterator[tuple[str, np.ndarray]]:
        """Tensors by name in model order, read one chunk at a time (an export streams the model
        through host memory chunk by chunk); the pending update is applied first."""
        self.flush()
        by_chunk: dict[int, list] = {}
        for s in self.layout.slots:
            by_chunk.setdefault(s.chunk, []).append(s)
        for c in range(self.layout.n_chunks):
            chunk = self._chunk_values(kind, c)
            for s in by_chunk.get(c, ()):
                yield s.name, slot_value(s, chunk, self._values_dtype(kind))
