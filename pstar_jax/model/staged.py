"""The model protocol: a model is a chain of stages, each a pure function of its parameters.

pstar_jax never imports a model. A model hands over (``StagedModel``):
  * ``param_shapes()``: every parameter tensor by name, in model order (this order decides the
    chunk layout, so a stage's tensors land in consecutive chunks);
  * ``init_tensor(name, seed)``: one fp32 tensor, made alone (so a huge model is initialised a
    chunk at a time);
  * ``stages(compute_dtype)``: the chain. Every stage is ``apply(params, x, batch)``, ``batch``
    the micro-batch's ``Batch`` (pstar_jax.data.batch: tokens, targets, loss_mask, segment_ids,
    positions, all [B, L]; a [B] dropout seed or None, mixed with the stage's index by the
    engine, see ``stage_seeds``). The first stage gets x = batch.tokens and returns h_BxLxD,
    middle stages map h to h, the last maps h to the scalar SUM of its masked token losses (the engine
    divides once by the step's global count of trained tokens);
  * ``seq_len`` and ``vocab_size``.
Optional, with defaults here: ``decays(name)`` (whether weight decay applies; default: tensors
of two or more dimensions), ``flops_per_token()`` (forward+backward model FLOPs per token with
every tensor trained; default 6 per matmul parameter; ``flops_per_token(model, frozen)`` here
takes 2 per parameter off for frozen tensors) and ``supports_packing`` (True when attention and
positions follow ``batch.segment_ids`` and ``batch.positions``; a model without it is refused
packed rows, whose examples it would mix).

A chain may carry more than h between stages: with a mixture of experts' load-balancing loss
(``Stage.router_aux_coef`` of its last stage) every stage past the first receives and returns
(h, RouterStats) (pstar_jax.model.router_aux), and the last returns (its output, the stats); the
engines add the loss (``head_loss``).

A stage's ``apply`` receives its tensors as a tuple in ``param_names`` order, already in the
compute dtype. Stages that share one ``apply`` object (the identical transformer blocks) share
one compiled function, so ``apply`` must depend only on shapes. A tensor may be read by more
than one stage (tied embeddings); its gradients add up.

``NNXStaged`` (pstar_jax.model.nnx_staged) turns a Flax NNX decoder (an embedding, a list of
blocks, a head) into this protocol, so a model module only defines the network.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Collection, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp

from pstar_jax.data.batch import Batch, mix_seeds
from pstar_jax.model.router_aux import load_balancing_loss


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    param_names: tuple[str, ...]
    apply: Callable[..., jax.Array]
    # The last stage of a chain that carries RouterStats (pstar_jax.model.router_aux) beside the
    # activations: the load-balancing loss's coefficient, and its apply returns (loss sum, the stats).
    router_aux_coef: float | None = None


@runtime_checkable
class StagedModel(Protocol):
    seq_len: int
    vocab_size: int

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]: ...

    def init_tensor(self, name: str, seed: int) -> jax.Array: ...

    def stages(self, compute_dtype: Any) -> Sequence[Stage]: ...


def decays(model: StagedModel, name: str) -> bool:
    """Whether weight decay applies to a tensor: the model's choice, else matrices only."""
    if hasattr(model, "decays"):
        return bool(model.decays(name))
    return len(model.param_shapes()[name]) >= 2


def chunk_group(model: StagedModel, name: str) -> str:
    """The group whose chunks a tensor keeps to (engine/chunks.build_layout): the model's choice
    (a mixture of experts keeps its experts' weights apart), else one group for every tensor."""
    return str(model.chunk_group(name)) if hasattr(model, "chunk_group") else ""


def chunk_groups(model: StagedModel, slots: Iterable[Any]) -> dict[str, tuple[int, ...]]:
    """The model's chunk groups other than the default one, each with its chunks (from a layout's
    slots, which name their tensor and chunk)."""
    out: dict[str, set[int]] = {}
    for s in slots:
        if group := chunk_group(model, s.name):
            out.setdefault(group, set()).add(s.chunk)
    return {g: tuple(sorted(c)) for g, c in out.items()}


def n_params(model: StagedModel) -> int:
    return sum(math.prod(s) for s in model.param_shapes().values())


def flops_per_token(model: StagedModel, frozen: Collection[str] = ()) -> float:
    """The model's count, else 6 FLOPs (forward and backward) per parameter outside the first
    stage's lookups (attention's own matmuls are the model's to add).

    A ``frozen`` tensor needs no weight gradient: 4 FLOPs per parameter (forward 2, input
    gradient 2), so 2 per parameter less for every frozen tensor a later stage reads (a tensor
    only the first stage reads is a lookup, which no count includes), times the share of tokens
    that meet it (the model's ``flop_share(name)``, else 1: a mixture of experts' expert sees k/E
    of them). A LoRA adapter trains: its 6 cover its forward, its weight gradient and the input
    gradient through it."""
    if hasattr(model, "flops_per_token") and not frozen:
        return float(model.flops_per_token())
    shapes = model.param_shapes()
    later = {n for s in list(model.stages(jnp.float32))[1:] for n in s.param_names}
    total = float(model.flops_per_token()) if hasattr(model, "flops_per_token") else \
        6.0 * sum(math.prod(shapes[n]) for n in later)
    share = getattr(model, "flop_share", lambda name: 1.0)
    return total - 2.0 * sum(share(n) * math.prod(shapes[n]) for n in later & set(frozen))


def init_params(model: StagedModel, seed: int) -> dict[str, jax.Array]:
    """All tensors by name, from ``init_tensor``."""
    return {name: model.init_tensor(name, seed) for name in model.param_shapes()}


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
                 ) -> Callable[..., jax.Array]:
    """The whole model as one function ``loss_fn(params, batch)`` of a name->tensor mapping: the
    mean loss over the batch's trained tokens. ``loss_fn(params, tokens, targets)`` is plain data.

    ``remat_block`` wraps every middle stage's apply (jax.checkpoint with a policy)."""
    def loss_fn(params: Mapping[str, jax.Array], batch: Any, targets: Any = None) -> jax.Array:
        if targets is not None:  # plain data, made with jnp so that it traces under jit
            B, L = jnp.shape(batch)
            batch = Batch(jnp.asarray(batch, jnp.int32), jnp.asarray(targets, jnp.int32), jnp.ones((B, L)),
                          jnp.ones((B, L), jnp.int32), jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)))

        h = hidden(stages, params, batch, remat_block)
        count = jnp.maximum(jnp.sum(jnp.asarray(batch.loss_mask, jnp.float32)), 1.0)
        last = stages[-1]
        out = last.apply(tuple(params[n] for n in last.param_names), h, stage_seeds(batch, len(stages) - 1))
        return head_loss(last, out, 1.0 / count)[0]
    return loss_fn


def hidden(stages: Sequence[Stage], params: Mapping[str, jax.Array], batch: Batch,
           remat_block: Callable[[Callable], Callable] | None = None) -> jax.Array:
    """What the last stage receives: every stage but the last applied to the batch's tokens."""
    def take(stage: Stage) -> tuple[jax.Array, ...]:
        return tuple(params[n] for n in stage.param_names)
    h = stages[0].apply(take(stages[0]), batch.tokens, stage_seeds(batch, 0))
    for i, stage in enumerate(stages[1:-1], 1):
        apply = remat_block(stage.apply) if remat_block else stage.apply
        h = apply(take(stage), h, stage_seeds(batch, i))
    return h


def head_sums(last: Stage, out: Any) -> jax.Array:
    """The last stage's K loss sums alone (a held-out loss: without a router loss)."""
    return loss_terms(out if last.router_aux_coef is None else out[0])[0]


def head_loss(last: Stage, out: Any, scale: Any, counts_E: Any = None, rows: Any = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metric sums) of the last stage's output: its K loss sums (``loss_terms``) times
    ``scale`` (1 / the step's global counts, [K] or a scalar), added up; where the chain carries
    RouterStats, plus the coefficient times their load-balancing loss, which the metrics carry as
    ``aux_loss``. ``counts_E`` and ``rows``: the stats' totals over every device's rows (None:
    these stats' own, one device or a whole-batch jit)."""
    if last.router_aux_coef is None:
        sums, metrics = loss_terms(out)
        return jnp.sum(sums * scale), metrics
    (sums, metrics), stats = loss_terms(out[0]), out[1]
    if counts_E is None:
        counts_E, rows = jnp.sum(stats.counts_1xE, axis=0), jnp.sum(stats.rows_1)
    aux = load_balancing_loss(stats, counts_E, rows)
    return jnp.sum(sums * scale) + last.router_aux_coef * aux, {**metrics, "aux_loss": aux}


def stage_seeds(batch: Batch, stage_index: Any) -> Batch:
    """The batch a stage sees: each row's dropout seed mixed with the stage's index (data, so
    identical blocks still share one compiled function), so every layer draws its own masks."""
    if batch.dropout_seed is None:
        return batch
    index = jnp.full(jnp.shape(batch.dropout_seed), stage_index, jnp.uint32)
    return batch._replace(dropout_seed=mix_seeds(jnp.asarray(batch.dropout_seed, jnp.uint32), index))


def cast_params(params: Mapping[str, jax.Array], dtype: Any) -> dict[str, jax.Array]:
    return {n: p.astype(dtype) for n, p in params.items()}


def token_cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Cross entropy of every token, [B, L], in float32 whatever the logits' dtype."""
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean token cross entropy, in float32 whatever the logits' dtype."""
    return token_cross_entropy(logits_BxLxV, targets_BxL).mean()


def loss_terms(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A last stage's output as (its loss sums [K], its metric sums): a plain head returns its loss
    sum alone (K = 1, no metrics); an objective of K terms (pstar_jax.model.preference) returns
    (sums, metrics). The engines divide sum k by the step's global count k (``row_counts``)."""
    if isinstance(out, tuple):
        sums, metrics = out
        return jnp.reshape(sums, (-1,)), dict(metrics)
    return jnp.reshape(out, (1,)), {}


def masked_loss_sum(token_losses_BxL: jax.Array, loss_mask_BxL: jax.Array) -> jax.Array:
    """The sum of the trained tokens' losses (what the last stage returns)."""
    return jnp.sum(token_losses_BxL * loss_mask_BxL.astype(token_losses_BxL.dtype))
