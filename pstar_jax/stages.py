"""The model protocol: a model is a chain of stages, each a pure function of its parameters.

pstar_jax never imports a model. A model hands over:
  * ``param_shapes()``: every parameter tensor by name, in model order (this order decides the
    chunk layout, so a stage's tensors land in consecutive chunks);
  * ``init_params(seed)``: fp32 values for those names;
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
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    param_names: tuple[str, ...]
    apply: Callable[..., jax.Array]


class StagedModel(Protocol):
    def param_shapes(self) -> Mapping[str, tuple[int, ...]]: ...

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


__all__ = ["Stage", "StagedModel", "validate_stages", "compose_loss", "cast_params"]
