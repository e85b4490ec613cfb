"""Compiled stage functions over chunks: forward, backward, the loss head (with its gradient, or
forward only for a held-out loss), sharded ZeRO-style.

Every function takes the micro-batch's ``Batch`` (pstar_jax.data.batch) beside its activations,
sharded over the data axis like the tokens: each device's stage reads its own rows' side inputs."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pstar_jax import compat
from pstar_jax.model.quant_bytes import QuantSlot, slot_bytes
from pstar_jax.data.batch import Batch
from pstar_jax.model.staged import Stage, head_loss, head_sums, stage_seeds
from pstar_jax.model.tiling import keeping_tiles


# -- compiled stage functions over chunks ------------------------------------------------------
#
# A stage's tensors are views of its chunks: dynamic_slice at offsets passed in as data, so all
# identical blocks share one compiled function even though their offsets differ. What must be
# static is the *pattern*: which of the stage's chunks each tensor sits in, and its shape.
# Inside shard_map every device holds 1/W of each chunk; a stage all-gathers the chunks it
# reads and reduce-scatters the gradient chunks it writes (W=1: both are no-ops).


@dataclasses.dataclass(frozen=True)
class BoundStage:
    """A stage bound to a chunk layout."""
    stage: Stage
    chunks: tuple[int, ...]  # chunk ids the stage reads, sorted
    pattern: tuple[tuple[int, tuple[int, ...]], ...]  # per tensor: (index into chunks, shape)
    offsets: tuple[int, ...]  # per tensor: element offset in its chunk
    frozen: tuple[bool, ...] = ()  # per chunk of ``chunks``: frozen (no grad chunk); () none is
    index: int = 0  # the stage's place in the chain (mixed into its rows' dropout seeds)
    quant: tuple[str, ...] = ()  # per tensor: its quantization ("nf4", "int8") or ""; () none is

    @property
    def offset_data(self) -> tuple[int, ...]:
        """The int32 data a stage function takes as ``offsets``: each tensor's offset, then the
        stage's index (data, not static, so identical blocks share one compiled function)."""
        return (*self.offsets, self.index)

    @property
    def grad_chunks(self) -> tuple[int, ...]:
        """The chunk ids the stage writes grads into: its trainable chunks, in ``chunks`` order."""
        return tuple(c for j, c in enumerate(self.chunks) if not (self.frozen and self.frozen[j]))


def bind(stage: Stage, layout, index: int = 0) -> BoundStage:
    """``stage`` (the ``index``-th of its chain) bound to ``layout``."""
    chunks = layout.chunks_of(stage.param_names)
    slots = [layout.slot(n) for n in stage.param_names]
    pattern = tuple((chunks.index(s.chunk), s.shape) for s in slots)
    frozen = tuple(layout.is_frozen(c) for c in chunks) if any(layout.frozen) else ()
    quant = tuple(s.quant for s in slots) if any(s.quant for s in slots) else ()
    return BoundStage(stage, chunks, pattern, tuple(s.offset for s in slots), frozen, index, quant)


def _trainable_pattern(bound: BoundStage) -> tuple[tuple[int, ...], tuple[tuple[int, tuple[int, ...]], ...]]:
    """(indices of the stage's trainable tensors, their pattern over the grad chunks alone)."""
    frozen = bound.frozen or (False,) * len(bound.chunks)
    grad_index = {j: k for k, j in enumerate(j for j in range(len(bound.chunks)) if not frozen[j])}
    tensors = tuple(i for i, (j, _) in enumerate(bound.pattern) if not frozen[j])
    return tensors, tuple((grad_index[bound.pattern[i][0]], bound.pattern[i][1]) for i in tensors)


def _with(params: tuple, tensors: tuple[int, ...], trained: tuple) -> tuple:
    """The stage's tensors with the trainable ones (at ``tensors``) replaced by ``trained``."""
    out = list(params)
    for i, value in zip(tensors, trained):
        out[i] = value
    return tuple(out)


def _views(full_chunks, offsets, pattern, quant=()):
    """The stage's tensors: slices of its chunks, a quantized kernel's bytes as a QuantSlot
    (model/quant_bytes.py), which the projection reads and dequantizes a tile at a time."""
    def view(i, j, shape):
        if quant and quant[i]:
            buf = jax.lax.dynamic_slice(full_chunks[j], (offsets[i],), (slot_bytes(shape, quant[i]),))
            return QuantSlot(buf, shape, quant[i], jnp.float32)
        return jax.lax.dynamic_slice(full_chunks[j], (offsets[i],), (math.prod(shape),)).reshape(shape)
    return tuple(view(i, j, shape) for i, (j, shape) in enumerate(pattern))


def _gather(chunks, n_devices: int):
    """Each chunk whole from its W shards. With one device the shard is the chunk: no collective,
    which XLA's CPU backend would otherwise run in float32 and copy back, two more copies of
    each chunk in the stage's working memory."""
    if n_devices == 1:
        return list(chunks)
    return [jax.lax.all_gather(c, "data", tiled=True) for c in chunks]


def _accumulate(grad_chunks, param_grads, offsets, pattern, n_devices: int):
    """grad_chunks[j] += this stage's tensor grads, reduce-scattered to each device's shard.

    With one device the grads are added in place, touching only their own elements; with W
    devices a full-chunk buffer is reduce-scattered, since tensors do not align with shards."""
    out = []
    for j, g_chunk in enumerate(grad_chunks):
        mine = [(i, shape) for i, (k, shape) in enumerate(pattern) if k == j]
        if n_devices == 1:
            for i, shape in mine:
                old = jax.lax.dynamic_slice(g_chunk, (offsets[i],), (math.prod(shape),))
                new = old + param_grads[i].reshape(-1).astype(g_chunk.dtype)
                g_chunk = jax.lax.dynamic_update_slice(g_chunk, new, (offsets[i],))
            out.append(g_chunk)
            continue
        full = jnp.zeros((g_chunk.shape[0] * n_devices,), g_chunk.dtype)
        for i, _ in mine:
            full = jax.lax.dynamic_update_slice(full, param_grads[i].reshape(-1).astype(full.dtype), (offsets[i],))
        out.append(g_chunk + jax.lax.psum_scatter(full, "data", tiled=True))
    return tuple(out)


class StageFunctions:
    """Compiled forward / backward functions per (apply, pattern, role), built on first use."""

    def __init__(self, mesh: jax.sharding.Mesh):
        self.mesh = mesh
        self.n_devices = mesh.devices.size
        self._cache: dict[tuple, Callable] = {}
        # per stage pattern: the vjp residuals' structure, which come from the known values, and
        # the kept ones' shapes (forward_keep records them as it traces; backward_kept reads them)
        self._residuals: dict[tuple, tuple] = {}
        self._options = compat.compiler_options(mesh.devices.flat[0].platform)

    def _params(self, chunks, offsets, pattern, quant=()) -> tuple[jax.Array, ...]:
        """The stage's tensors, viewed out of its whole chunks."""
        return _views(_gather(chunks, self.n_devices), offsets, pattern, quant)

    def _get(self, role: str, bound: BoundStage, build: Callable[[], Callable]) -> Callable:
        key = (role, bound.stage.apply, bound.pattern, bound.frozen, bound.quant)
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _shard_map(self, fn, n_chunks: int, in_rest, out_specs):
        chunk_specs = tuple(P("data") for _ in range(n_chunks))
        return compat.shard_map(fn, self.mesh, in_specs=(chunk_specs, P(), *in_rest), out_specs=out_specs)

    def count(self, row_counts_MxBxK: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(counts, 1 / counts), [K] each: the objective's divisors (K = 1: trained targets) over
        every micro-batch and device, replicated (at least one, so a batch with nothing to train
        gives a zero loss and zero grads)."""
        if "count" not in self._cache:
            def count(rows_MxBxK):
                total = jnp.sum(rows_MxBxK, axis=(0, 1))
                return total, 1.0 / jnp.maximum(total, 1.0)
            replicated = jax.sharding.NamedSharding(self.mesh, P())
            self._cache["count"] = jax.jit(count, out_shardings=(replicated, replicated))
        return self._cache["count"](row_counts_MxBxK)

    def forward(self, bound: BoundStage) -> Callable:
        """(chunks, offsets, x, batch) -> y."""
        apply, pattern = bound.stage.apply, bound.pattern

        def local(chunks, offsets, x, batch):
            return apply(self._params(chunks, offsets, pattern, bound.quant), x, stage_seeds(batch, offsets[-1]))
        return self._get("fwd", bound, lambda: jax.jit(
            self._shard_map(local, len(bound.chunks), (P("data"), P("data")), P("data")),
            compiler_options=self._options))

    def backward(self, bound: BoundStage, first: bool) -> Callable:
        """(chunks, offsets, x, batch, gy, grad_chunks) -> (gx, grad_chunks); grad chunks donated,
        and gy, whose buffer gx takes (one activation-sized buffer less per backward).

        The forward is recomputed (only stage inputs were kept). The first stage's input is
        tokens, which have no gradient: it returns None for gx (and gy is not donated: nothing
        could take its buffer). ``grad_chunks`` are those of the
        stage's trainable chunks (``bound.grad_chunks``): the vjp is taken over the trainable
        tensors only, while the activations' gradient flows through frozen ones too."""
        apply, pattern = bound.stage.apply, bound.pattern
        tensors, grad_pattern = _trainable_pattern(bound)

        def local(chunks, offsets, x, batch, gy, grad_chunks):
            params = self._params(chunks, offsets, pattern, bound.quant)
            batch = stage_seeds(batch, offsets[-1])  # the forward's masks again
            trained = tuple(params[i] for i in tensors)
            if first:
                _, vjp = jax.vjp(lambda p: apply(_with(params, tensors, p), x, batch), trained)
                (gp,), gx = vjp(gy), None
            else:
                _, vjp = jax.vjp(lambda p, x: apply(_with(params, tensors, p), x, batch), trained, x)
                gp, gx = vjp(gy)
            return gx, _accumulate(grad_chunks, gp, [offsets[i] for i in tensors], grad_pattern, self.n_devices)
        n = len(bound.chunks)
        grad_specs = tuple(P("data") for _ in bound.grad_chunks)
        return self._get("bwd_first" if first else "bwd", bound, lambda: jax.jit(
            self._shard_map(local, n, (P("data"), P("data"), P("data"), grad_specs),
                            (None if first else P("data"), grad_specs)),
            donate_argnums=(5,) if first else (4, 5), compiler_options=self._options))

    def forward_keep(self, bound: BoundStage) -> Callable:
        """(chunks, offsets, x, batch) -> (y, residuals): the forward under jax.vjp, returning the
        residuals its backward (``backward_kept``) needs instead of recomputing it, each flattened
        to 1-D (sharded over the data axis like the activations). Residuals that are the stage's
        tensors, its input or its batch fields are left out: the backward has them already, so
        only the activations are kept (a frozen weight is never copied into them), with those
        of its sequence tiles (pstar_jax.model.tiling.keeping_tiles). Not for the
        first stage, whose input is the batch's tokens (schedule.kept_stages)."""
        key = ("res", bound.stage.apply, bound.pattern, bound.frozen, bound.quant)

        def local(chunks, offsets, x, batch):
            params, batch, known = self._known(bound, chunks, offsets, x, batch)
            tensors, _ = _trainable_pattern(bound)
            with keeping_tiles():  # the tiles' residuals too: the backward recomputes nothing
                y, vjp = jax.vjp(lambda p, x: bound.stage.apply(_with(params, tensors, p), x, batch),
                                 tuple(params[i] for i in tensors), x)
            leaves, treedef = jax.tree_util.tree_flatten(vjp)
            sources = tuple(next((k for k, a in enumerate(known) if a is leaf), None) for leaf in leaves)
            kept = [leaf for leaf, s in zip(leaves, sources) if s is None]
            self._residuals[key] = (treedef, sources, tuple(leaf.shape for leaf in kept))
            return y, tuple(leaf.reshape(-1) for leaf in kept)
        return self._get("fwd_keep", bound, lambda: jax.jit(
            self._shard_map(local, len(bound.chunks), (P("data"), P("data")), (P("data"), P("data"))),
            compiler_options=self._options))

    def backward_kept(self, bound: BoundStage) -> Callable:
        """(chunks, offsets, x, batch, gy, residuals, grad_chunks) -> (gx, grad_chunks): ``backward``
        from the residuals ``forward_keep`` returned, no forward run again (grad chunks and gy
        donated, as there). The stage's tensors, input and batch fill the residuals left out."""
        tensors, grad_pattern = _trainable_pattern(bound)
        key = ("res", bound.stage.apply, bound.pattern, bound.frozen, bound.quant)

        def local(chunks, offsets, x, batch, gy, residuals, grad_chunks):
            treedef, sources, shapes = self._residuals[key]  # recorded when the forward was traced
            known = self._known(bound, chunks, offsets, x, batch)[2]
            kept = iter(r.reshape(shape) for r, shape in zip(residuals, shapes))
            vjp = jax.tree_util.tree_unflatten(treedef, [next(kept) if s is None else known[s] for s in sources])
            gp, gx = vjp(gy)
            return gx, _accumulate(grad_chunks, gp, [offsets[i] for i in tensors], grad_pattern, self.n_devices)
        grad_specs = tuple(P("data") for _ in bound.grad_chunks)
        return self._get("bwd_kept", bound, lambda: jax.jit(
            self._shard_map(local, len(bound.chunks), (P("data"), P("data"), P("data"), P("data"), grad_specs),
                            (P("data"), grad_specs)),
            donate_argnums=(4, 6), compiler_options=self._options))

    def _known(self, bound: BoundStage, chunks, offsets, x, batch) -> tuple[tuple, Batch, list]:
        """(the stage's tensors, its batch with the forward's dropout seeds, and the values its vjp
        residuals may be without being kept: those tensors, its input and that batch, flattened)."""
        params = self._params(chunks, offsets, bound.pattern, bound.quant)
        batch = stage_seeds(batch, offsets[-1])
        return params, batch, jax.tree_util.tree_leaves((params, x, batch))

    def head(self, bound: BoundStage) -> Callable:
        """(chunks, offsets, h, batch, grad_chunks, scale) -> (loss, metrics, gh, grad_chunks).

        ``grad_chunks``: those of the stage's trainable chunks, as in ``backward``.

        The last stage's forward and backward in one call. The stage returns the sum of its
        rows' trained token losses (or K sums and metric sums: ``loss_terms``); ``scale`` [K] is
        1 / the step's global counts (every micro-batch and device), so the loss and grads of
        devices and micro-batches just add up to those of the mean over the whole step. The
        metric sums are added over the devices.

        Where the chain carries RouterStats (``Stage.router_aux_coef``), h is (h, stats) and the
        loss adds the coefficient times the micro-batch's load-balancing loss (the metric
        ``aux_loss``), over the rows of every device: the counts are summed over the data axis
        first, and each device adds its share (pstar_jax.model.router_aux)."""
        apply, pattern, last = bound.stage.apply, bound.pattern, bound.stage
        tensors, grad_pattern = _trainable_pattern(bound)

        def local(chunks, offsets, h, batch, grad_chunks, scale):
            params = self._params(chunks, offsets, pattern, bound.quant)
            batch = stage_seeds(batch, offsets[-1])
            totals = (None, None) if last.router_aux_coef is None else (
                jax.lax.psum(jnp.sum(h[1].counts_1xE, axis=0), "data"), jax.lax.psum(jnp.sum(h[1].rows_1), "data"))

            def scaled_loss(trained, h):
                return head_loss(last, apply(_with(params, tensors, trained), h, batch), scale, *totals)
            (loss, metrics), (gp, gh) = jax.value_and_grad(scaled_loss, argnums=(0, 1), has_aux=True)(
                tuple(params[i] for i in tensors), h)
            return (jax.lax.psum(loss, "data"), jax.lax.psum(metrics, "data"), gh,
                    _accumulate(grad_chunks, gp, [offsets[i] for i in tensors], grad_pattern, self.n_devices))
        n = len(bound.chunks)
        grad_specs = tuple(P("data") for _ in bound.grad_chunks)
        return self._get("head", bound, lambda: jax.jit(
            self._shard_map(local, n, (P("data"), P("data"), grad_specs, P()), (P(), P(), P("data"), grad_specs)),
            donate_argnums=(4,), compiler_options=self._options))

    def loss(self, bound: BoundStage) -> Callable:
        """(chunks, offsets, h, batch) -> loss sums [K]: the last stage's forward only (held-out loss).

        No gradient and nothing donated; the sums of every device's rows (``loss_terms``: K = 1,
        the trained token losses, for a plain head); the caller divides by the counts."""
        apply, pattern = bound.stage.apply, bound.pattern

        def local(chunks, offsets, h, batch):
            params = self._params(chunks, offsets, pattern, bound.quant)
            return jax.lax.psum(head_sums(bound.stage, apply(params, h, stage_seeds(batch, offsets[-1]))), "data")
        return self._get("loss", bound, lambda: jax.jit(
            self._shard_map(local, len(bound.chunks), (P("data"), P("data")), P()),
            compiler_options=self._options))
