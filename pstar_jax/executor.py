"""The chunked engine: one training step run stage by stage over chunks.

Per micro-batch: forward through the stages, keeping only each stage's input (activation
checkpointing at stage boundaries); the last stage computes loss and its gradient in one call;
backward in reverse, recomputing each stage's forward under jax.vjp and adding its tensor grads
into gradient chunks. Before a stage runs, its chunks are fetched to the device and the next
stage's are requested too: JAX dispatch is asynchronous, so that copy overlaps the current
stage's compute. After a chunk's last backward use in the last micro-batch its bf16 params are
dropped and its grad takes their place (14 bytes per parameter in all). Then the optimizer
updates each chunk where its fp32 state lives and yields the next bf16 params.

The executor asks the store for chunks; it never decides placement by itself. Which chunks the
store evicts is the policy's business (LRU here; the warm-up planner supplies a better one).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pstar_jax.chunks import ChunkLayout, build_layout, pack, unpack
from pstar_jax.config import ConfigError, EngineConfig, format_bytes
from pstar_jax.memory import ChunkStore, EvictionPolicy, LeastRecentlyUsed, Placement, Space
from pstar_jax.optim import ChunkOptimizer, TxFactory, clip_scale, sum_of_squares, zeros_chunk
from pstar_jax.stages import BoundStage, StagedModel, StageFunctions, bind, validate_stages
from pstar_jax.trace import trace_step


@dataclasses.dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_s: float
    optimizer_s: float
    h2d_bytes: int
    d2h_bytes: int
    device_chunk_peak_bytes: int


class ChunkedEngine:
    def __init__(self, model: StagedModel, cfg: EngineConfig, make_tx: TxFactory, mesh: Mesh,
                 seed: int = 0, clip_norm: float | None = 1.0,
                 policy: EvictionPolicy | None = None, layout: ChunkLayout | None = None,
                 batch_shape: tuple[int, int] | None = None):
        """``cfg.device_budget_bytes`` is all the device memory the engine may use. With
        ``batch_shape`` (global micro-batch, seq_len) the warm-up trace measures the non-model
        memory and chunks get the rest; without it chunks get the whole budget."""
        self.cfg = cfg
        self.clip_norm = clip_norm
        self.placement = Placement(mesh)
        self.n_devices = self.placement.n_devices
        self.param_dtype = cfg.compute_dtype
        stages = list(model.stages(self.param_dtype))
        validate_stages(stages, model.param_shapes())
        chunk_numel = -(-cfg.chunk_numel // self.n_devices) * self.n_devices  # shardable
        self.layout = layout or build_layout(model.param_shapes(), model.decays, chunk_numel)
        self.bound: list[BoundStage] = [bind(s, self.layout) for s in stages]
        self.fns = StageFunctions(mesh)
        self.optimizer = ChunkOptimizer(make_tx, self.placement, self.param_dtype)
        self.trace = (trace_step(self.bound, self.fns, self.placement, self.layout.chunk_numel,
                                 self.param_dtype, *batch_shape) if batch_shape else None)
        self.working_bytes = self.trace.peak_non_model_bytes if self.trace else 0
        self.min_chunk_bytes = max(2 * len(b.chunks) for b in self.bound) * self.chunk_bytes(self.param_dtype)
        if cfg.device_budget_bytes is None:
            self.device_budget_bytes = self.working_bytes + max(self.model_data_bytes // 2, self.min_chunk_bytes)
        else:
            self.device_budget_bytes = cfg.device_budget_bytes
        self.chunk_budget_bytes = self.device_budget_bytes - self.working_bytes
        self.store = ChunkStore(self.placement, self.chunk_budget_bytes, policy or LeastRecentlyUsed())
        # Backward runs stages in reverse: a chunk's last backward use is its lowest stage.
        self.last_bwd_stage = {c: min(i for i, b in enumerate(self.bound) if c in b.chunks)
                               for c in range(self.layout.n_chunks)}
        self._check_budget()
        self.opt_space = self._place_optimizer_state()
        self._init_chunks(model.init_params(seed))
        # Replicated exactly as in the trace, so the step reuses the trace's compilations.
        self._offset_arrays = [self.placement.put(np.asarray(b.offsets, np.int32), Space.DEVICE, replicated=True)
                               for b in self.bound]
        self.step_count = 0

    # -- sizes and placement ------------------------------------------------------------------
    def chunk_bytes(self, dtype: Any) -> int:
        return self.layout.chunk_numel * jnp.dtype(dtype).itemsize // self.n_devices

    @property
    def model_data_bytes(self) -> int:
        """Per device: params (their grads take their place) + fp32 master, m, v: 14 B/param in bf16."""
        return self.layout.n_chunks * (self.chunk_bytes(self.param_dtype) + 3 * self.chunk_bytes(jnp.float32))

    def _check_budget(self) -> None:
        # During a stage's backward its param chunks and grad chunks are all on the device,
        # and the next stage's param chunks may already be coming in.
        need = self.min_chunk_bytes
        if need > self.chunk_budget_bytes:
            raise ConfigError(
                f"--device-memory {format_bytes(self.device_budget_bytes)} cannot hold the largest "
                f"stage's params and grads ({format_bytes(need)}) plus its working memory "
                f"({format_bytes(self.working_bytes)}); raise it to at least "
                f"{format_bytes(need + self.working_bytes)} or lower --chunk-size or the batch")

    def _place_optimizer_state(self) -> list[Space]:
        """Device for as many chunks as fit beside all bf16 params (the margin), host for the rest.

        PatrickStar's margin: the chunk budget less the params' chunks and one stage's grads."""
        n = self.layout.n_chunks
        margin = self.chunk_budget_bytes - n * self.chunk_bytes(self.param_dtype) - self.min_chunk_bytes // 2
        state_bytes = 3 * self.chunk_bytes(jnp.float32)  # master, m, v
        on_device = int(np.clip(margin // state_bytes, 0, n)) if margin > 0 else 0
        return [Space.DEVICE if c < on_device else Space.HOST for c in range(n)]

    def _init_chunks(self, params: Any) -> None:
        host = {name: np.asarray(value, np.float32) for name, value in params.items()}
        for c, chunk in enumerate(pack(self.layout, host, np.float32)):
            space = self.opt_space[c]
            master = self.placement.put(jnp.asarray(chunk), space)
            self.store.put(("opt", c), self.optimizer.init(master))
            self.store.put(("master", c), master)
            # bf16 params start where there is room; the first forward fetches the rest.
            fits = self.store.bytes[Space.DEVICE] + self.chunk_bytes(self.param_dtype) <= self.store.budget_bytes
            self.store.put(("param", c), self.placement.put(
                jnp.asarray(chunk).astype(self.param_dtype), Space.DEVICE if fits else Space.HOST))

    def summary(self) -> str:
        n_dev = sum(s is Space.DEVICE for s in self.opt_space)
        params = self.layout.numel
        return "\n".join([
            f"chunked engine: {params:,} params in {self.layout.n_chunks} chunks of {self.layout.chunk_numel:,} "
            f"elements ({100 * params / self.layout.padded_numel:.1f}% used), {self.n_devices} device(s)",
            f"device memory {format_bytes(self.device_budget_bytes)} = working {format_bytes(self.working_bytes)}"
            f" + chunks {format_bytes(self.chunk_budget_bytes)}; model data "
            f"{format_bytes(self.model_data_bytes)}",
            f"optimizer state: {n_dev} chunks on the device, {len(self.opt_space) - n_dev} on the host"])

    # -- one step -----------------------------------------------------------------------------
    def step(self, micro_batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> StepResult:
        if len(micro_batches) != self.cfg.micro_batches:
            raise ValueError(f"expected {self.cfg.micro_batches} micro-batches, got {len(micro_batches)}")
        start = time.perf_counter()
        self.store.traffic.reset()
        self.store.peak_device_bytes = self.store.bytes[Space.DEVICE]
        scale = self.placement.put(np.float32(1.0 / (self.n_devices * len(micro_batches))), Space.DEVICE)
        losses, sumsq = [], []
        for m, (tokens, targets) in enumerate(micro_batches):
            loss, sq = self._micro_batch(tokens, targets, scale, last=(m == len(micro_batches) - 1))
            losses.append(loss)
            sumsq.extend(sq)
        grad_sumsq = sum(sumsq)
        jax.block_until_ready(grad_sumsq)  # sync: optimizer_s measures the optimizer phase alone
        opt_start = time.perf_counter()
        self._optimizer_phase(clip_scale(grad_sumsq, self.clip_norm))
        jax.block_until_ready([self.store.peek(k) for k in self.store.keys("param")])
        end = time.perf_counter()
        self.step_count += 1
        return StepResult(loss=float(sum(losses)), grad_norm=float(jnp.sqrt(grad_sumsq)),
                          step_s=end - start, optimizer_s=end - opt_start,
                          h2d_bytes=self.store.traffic.h2d_bytes, d2h_bytes=self.store.traffic.d2h_bytes,
                          device_chunk_peak_bytes=self.store.peak_device_bytes)

    def _put_batch(self, array: np.ndarray) -> jax.Array:
        return jax.device_put(jnp.asarray(array, jnp.int32), self.placement.sharding(Space.DEVICE))

    def _micro_batch(self, tokens, targets, scale, last: bool) -> tuple[jax.Array, list[jax.Array]]:
        x = self._put_batch(tokens)
        stash = []
        for i, bound in enumerate(self.bound[:-1]):
            stash.append(x)
            x = self.fns.forward(bound)(self._fetch(i, i + 1), self._offsets(i), x)
        head = len(self.bound) - 1
        params = self._fetch(head, head - 1)
        loss, g, grads = self.fns.head(self.bound[head])(
            params, self._offsets(head), x, self._put_batch(targets), self._grads(head), scale)
        sumsq = self._after_backward(head, grads, last)
        for i in reversed(range(head)):
            params = self._fetch(i, i - 1 if i else None)
            g, grads = self.fns.backward(self.bound[i], first=(i == 0))(
                params, self._offsets(i), stash.pop(), g, self._grads(i))
            sumsq += self._after_backward(i, grads, last)
        return loss, sumsq

    def _offsets(self, i: int) -> jax.Array:
        return self._offset_arrays[i]

    def _fetch(self, i: int, nxt: int | None) -> tuple[jax.Array, ...]:
        """Stage i's param chunks on the device, and a prefetch of stage ``nxt``'s."""
        keys = [("param", c) for c in self.bound[i].chunks]
        arrays = tuple(self.store.get(k, Space.DEVICE, protect=keys) for k in keys)
        if nxt is not None:
            ahead = [("param", c) for c in self.bound[nxt].chunks if ("param", c) in self.store]
            need = sum(1 for k in ahead if Space.DEVICE not in self.store.spaces(k))
            room = self.store.budget_bytes - self.store.bytes[Space.DEVICE]
            # Prefetch only into free room: evicting for a prefetch could push out what runs now.
            if need and need * self.chunk_bytes(self.param_dtype) <= room:
                for k in ahead:
                    self.store.get(k, Space.DEVICE, protect=keys + ahead)
        return arrays

    def _grads(self, i: int) -> tuple[jax.Array, ...]:
        """Stage i's grad chunks on the device (zeros at first use), taken out to be donated."""
        out = []
        for c in self.bound[i].chunks:
            key = ("grad", c)
            if key in self.store:
                out.append(self.store.take(key, Space.DEVICE))
            else:
                out.append(zeros_chunk(self.layout.chunk_numel, self.param_dtype,
                                       self.placement.sharding(Space.DEVICE)))
        return tuple(out)

    def _after_backward(self, i: int, grads: tuple[jax.Array, ...], last: bool) -> list[jax.Array]:
        sumsq = []
        for c, grad in zip(self.bound[i].chunks, grads):
            self.store.put(("grad", c), grad)
            if last and self.last_bwd_stage[c] == i:
                # Final grad: count it for the global norm and let it take the params' place.
                sumsq.append(sum_of_squares(grad))
                self.store.drop(("param", c))
        return sumsq

    def _optimizer_phase(self, scale: jax.Array) -> None:
        for c in range(self.layout.n_chunks):
            space = self.opt_space[c]
            grad = self.store.take(("grad", c), space)
            master = self.store.take(("master", c), space)
            state = self.store.take(("opt", c), space)
            master, state, params = self.optimizer.update(space, grad, master, state, scale,
                                                          self.layout.n_decay[c])
            self.store.put(("master", c), master)
            self.store.put(("opt", c), state)
            self.store.put(("param", c), params)

    # -- reading state ------------------------------------------------------------------------
    def params(self, kind: str = "master") -> dict[str, np.ndarray]:
        """Current tensors by name (fp32 master, or the compute-dtype params), as numpy."""
        chunks = [np.asarray(jax.device_get(self.store.peek((kind, c)))) for c in range(self.layout.n_chunks)]
        return unpack(self.layout, chunks)
