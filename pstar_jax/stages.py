"""The model protocol: a model is a chain of stages, each a pure function of its parameters.

pstar_jax never imports a model. A model hands over:
  * ``param_shapes()``: every parameter tensor by name, in model order (this order decides the
    chunk layout, so a stage's tensors land in consecutive chunks);
  * ``init_tensor(name, seed)``: one fp32 tensor, made alone (so a huge model is initialised a
    chunk at a time), and ``init_params(seed)``: all of them;
  * ``stages(compute_dtype)``: the chain. The first stage maps int32 tokens_BxL to h_BxLxD,
    middle stages map h to h, the last maps (h, targets_BxL) to the scalar mean loss;
  * ``decays(name)``: whether weight decay applies to a tensor (norms and biases usually not);
  * ``flops_per_token()``: forward+backward model FLOPs per token, for TFLOPS figures.

A stage's ``apply(params, x[, targets])`` receives its tensors as a tuple in ``param_names``
order, already in the compute dtype. Stages that share one ``apply`` object (the identical
transformer blocks) share one compiled function, so ``apply`` must depend only on shapes.
A tensor may be read by more than one stage (tied embeddings); its gradients add up.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pstar_jax import compat


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    param_names: tuple[str, ...]
    apply: Callable[..., jax.Array]


class StagedModel(Protocol):
    def param_shapes(self) -> Mapping[str, tuple[int, ...]]: ...

    def init_tensor(self, name: str, seed: int) -> jax.Array: ...

    def init_params(self, seed: int) -> Mapping[str, jax.Array]: ...

    def stages(self, compute_dtype: Any) -> Sequence[Stage]: ...

    def decays(self, name: str) -> bool: ...

    def flops_per_token(self) -> float: ...


def validate_stages(stages: Sequence[Stage], param_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ValueError if the chain reads unknown tensors or leaves one unused."""
    if len(stages) < 2:
        raise ValueError("a staged model needs at least two stages (first and last)")
    used: set[str] = set()
    for stage in stages:
        unknown = [n for n in stage.param_names if n not in param_shapes]
        if unknown:
            raise ValueError(f"stage {stage.name} reads unknown parameters {unknown}")
        used.update(stage.param_names)
    unused = [n for n in param_shapes if n not in used]
    if unused:
        raise ValueError(f"parameters {unused} are read by no stage")


def compose_loss(stages: Sequence[Stage], remat_block: Callable[[Callable], Callable] | None = None
                 ) -> Callable[[Mapping[str, jax.Array], jax.Array, jax.Array], jax.Array]:
    """The whole model as one function of a name->tensor mapping: the plain engine's loss.

    ``remat_block`` wraps every middle stage's apply (jax.checkpoint with a policy)."""
    def loss_fn(params: Mapping[str, jax.Array], tokens: jax.Array, targets: jax.Array) -> jax.Array:
        def take(stage: Stage) -> tuple[jax.Array, ...]:
            return tuple(params[n] for n in stage.param_names)
        h = stages[0].apply(take(stages[0]), tokens)
        for stage in stages[1:-1]:
            apply = remat_block(stage.apply) if remat_block else stage.apply
            h = apply(take(stage), h)
        return stages[-1].apply(take(stages[-1]), h, targets)
    return loss_fn


def cast_params(params: Mapping[str, jax.Array], dtype: Any) -> dict[str, jax.Array]:
    return {n: p.astype(dtype) for n, p in params.items()}




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


def bind(stage: Stage, layout) -> BoundStage:
    chunks = layout.chunks_of(stage.param_names)
    slots = [layout.slot(n) for n in stage.param_names]
    pattern = tuple((chunks.index(s.chunk), s.shape) for s in slots)
    return BoundStage(stage, chunks, pattern, tuple(s.offset for s in slots))


def _views(full_chunks, offsets, pattern):
    return tuple(jax.lax.dynamic_slice(full_chunks[j], (offsets[i],), (math.prod(shape),)).reshape(shape)
                 for i, (j, shape) in enumerate(pattern))


def _gather(chunks):
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

    def _get(self, role: str, bound: BoundStage, build: Callable[[], Callable]) -> Callable:
        key = (role, bound.stage.apply, bound.pattern)
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _shard_map(self, fn, n_chunks: int, in_rest, out_specs):
        chunk_specs = tuple(P("data") for _ in range(n_chunks))
        return compat.shard_map(fn, self.mesh, in_specs=(chunk_specs, P(), *in_rest), out_specs=out_specs)

    def forward(self, bound: BoundStage) -> Callable:
        """(chunks, offsets, x) -> y."""
        apply, pattern = bound.stage.apply, bound.pattern

        def local(chunks, offsets, x):
            return apply(_views(_gather(chunks), offsets, pattern), x)
        return self._get("fwd", bound, lambda: jax.jit(
            self._shard_map(local, len(bound.chunks), (P("data"),), P("data"))))

    def backward(self, bound: BoundStage, first: bool) -> Callable:
        """(chunks, offsets, x, gy, grad_chunks) -> (gx, grad_chunks); grad chunks donated.

        The forward is recomputed (only stage inputs were kept). The first stage's input is
        tokens, which have no gradient: it returns None for gx."""
        apply, pattern = bound.stage.apply, bound.pattern

        def local(chunks, offsets, x, gy, grad_chunks):
            params = _views(_gather(chunks), offsets, pattern)
            if first:
                _, vjp = jax.vjp(lambda p: apply(p, x), params)
                (gp,), gx = vjp(gy), None
            else:
                _, vjp = jax.vjp(apply, params, x)
                gp, gx = vjp(gy)
            return gx, _accumulate(grad_chunks, gp, offsets, pattern, self.n_devices)
        n = len(bound.chunks)
        grad_specs = tuple(P("data") for _ in range(n))
        return self._get("bwd_first" if first else "bwd", bound, lambda: jax.jit(
            self._shard_map(local, n, (P("data"), P("data"), grad_specs),
                            (None if first else P("data"), grad_specs)),
            donate_argnums=(4,)))

    def head(self, bound: BoundStage) -> Callable:
        """(chunks, offsets, h, targets, grad_chunks, scale) -> (loss, gh, grad_chunks).

        The last stage's forward and backward in one call. ``scale`` is 1/(W * micro-batches):
        the gradient of the mean loss, so grads from devices and micro-batches just add up."""
        apply, pattern = bound.stage.apply, bound.pattern

        def local(chunks, offsets, h, targets, grad_chunks, scale):
            def scaled_loss(params, h):
                return apply(params, h, targets) * scale
            loss, (gp, gh) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(
                _views(_gather(chunks), offsets, pattern), h)
            return jax.lax.psum(loss, "data"), gh, _accumulate(grad_chunks, gp, offsets, pattern, self.n_devices)
        n = len(bound.chunks)
        grad_specs = tuple(P("data") for _ in range(n))
        return self._get("head", bound, lambda: jax.jit(
            self._shard_map(local, n, (P("data"), P("data"), grad_specs, P()), (P(), P("data"), grad_specs)),
            donate_argnums=(4,)))
