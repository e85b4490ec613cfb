"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral) in Flax NNX, with transformers' numerics.

Per token ``x``: router logits ``x @ router`` (bias-free, in the compute dtype); a float32 softmax
over the experts; the top ``n_experts_per_tok`` probabilities, renormalised to sum 1 when
``norm_topk_prob`` (Mixtral always), cast back to x's dtype; the output is the weighted sum of
the chosen experts' SwiGLU MLPs. Dropless: every token is computed by every expert it chose, with
no capacity limit, as transformers' ``Qwen3MoeSparseMoeBlock``/``MixtralSparseMoeBlock`` do.

The experts run as grouped matmuls: the (token, choice) pairs sorted by expert and
``jax.lax.ragged_dot`` with one group per expert (on a GPU, grouped GEMMs; an expert no token
chose is an empty group, whose weights get a zero gradient). That is k/E of a dense one-hot
einsum's FLOPs: at Qwen3-30B-A3B's 8 of 128 experts, 1/16.

Parameters (names a contract with models/hf.py): ``mlp.router.kernel`` [D, E] and per expert
``mlp.experts.{e}.{gate,up,down}.kernel`` ([D, I], [D, I], [I, D]), one tensor per expert as the
checkpoints store them. The forward stacks each matrix's E kernels before the grouped matmul,
gate kernels first, so the layout (models in first-read order) keeps each matrix's experts
together in its chunks.

Shapes: N tokens (B x T flattened), E experts, k choices per token, D model width, I expert width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pstar_models.gpt import _linear, tiled_mlp
from pstar_models.llama_config import LlamaConfig
from pstar_jax.model.tiling import TileBudget


def route(logits_NxE: jax.Array, k: int, normalise: bool, dtype: jax.typing.DTypeLike) -> tuple[jax.Array, jax.Array]:
    """(weights_NxK in ``dtype``, experts_NxK): transformers' softmax in float32, top-k, the
    optional renormalisation, the cast back."""
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, k)
    if normalise:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK.astype(dtype), experts_NxK


def grouped_swiglu(x_NxD: jax.Array, experts_NxK: jax.Array, gate_ExDxI: jax.Array, up_ExDxI: jax.Array,
                   down_ExIxD: jax.Array) -> jax.Array:
    """Each (token, choice) pair through its expert's SwiGLU: [N, k, D], in the choices' order."""
    N, k = experts_NxK.shape
    E = gate_ExDxI.shape[0]
    flat = experts_NxK.reshape(N * k)
    order = jnp.argsort(flat, stable=True)  # the pairs grouped by expert, tokens in order inside
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x_NxD[order // k]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate_ExDxI, sizes)) * jax.lax.ragged_dot(xs, up_ExDxI, sizes)
    ys = jax.lax.ragged_dot(h, down_ExIxD, sizes)
    return ys[jnp.argsort(order)].reshape(N, k, -1)


class Expert(nnx.Module):
    """One SwiGLU expert's weights (its forward is the grouped one of ``SparseMoE``)."""

    def __init__(self, d_model: int, width: int, down_std: float, *, rngs: nnx.Rngs):
        self.gate = _linear(d_model, width, rngs, bias=False)
        self.up = _linear(d_model, width, rngs, bias=False)
        self.down = _linear(width, d_model, rngs, down_std, bias=False)


class SparseMoE(nnx.Module):
    """A block's MLP as a mixture of experts; ``plain``/``__call__`` as models/llama.py's MLP, so the
    block's tiled pass over positions runs it a tile at a time (routing is per token)."""

    def __init__(self, config: LlamaConfig, down_std: float, *, rngs: nnx.Rngs, tiling: TileBudget):
        self.n_experts_per_tok, self.normalise, self.tiling = config.n_experts_per_tok, config.norm_topk_prob, tiling
        self.router = _linear(config.d_model, config.n_experts, rngs, bias=False)
        self.experts = nnx.List([Expert(config.d_model, config.expert_width, down_std, rngs=rngs)
                                 for _ in range(config.n_experts)])
        # The hidden activations per token, for sizing the block's tiles: k experts' widths.
        self.d_ff = config.n_experts_per_tok * config.expert_width

    def stacked(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The experts' gate, up and down kernels as [E, D, I], [E, D, I], [E, I, D]."""
        return tuple(jnp.stack([getattr(e, m).kernel[...] for e in self.experts]) for m in ("gate", "up", "down"))

    def plain(self, x_BxTxD: jax.Array, dropout_seeds_BxT: jax.Array | None = None) -> jax.Array:
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D)
        weights_NxK, experts_NxK = route(self.router(x_NxD), self.n_experts_per_tok, self.normalise, x_NxD.dtype)
        y_NxKxD = grouped_swiglu(x_NxD, experts_NxK, *self.stacked())
        return jnp.sum(y_NxKxD * weights_NxK[..., None], axis=1).reshape(B, T, D)

    def __call__(self, x_BxLxD: jax.Array, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        return tiled_mlp(self, x_BxLxD, self.d_ff, self.tiling.mlp_bytes, dropout_seeds_BxL)
