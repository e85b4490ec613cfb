"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral) in Flax NNX, with transformers' numerics.

Per token ``x``: router logits ``x @ router`` (bias-free, in the compute dtype); a float32 softmax
over the experts; the top ``n_experts_per_tok`` probabilities, renormalised to sum 1 when
``norm_topk_prob`` (Mixtral always), cast back to x's dtype; the output is the weighted sum of
the chosen experts' SwiGLU MLPs. Dropless: every token is computed by every expert it chose, with
no capacity limit, as transformers' ``Qwen3MoeSparseMoeBlock``/``MixtralSparseMoeBlock`` do.

The experts run as grouped matmuls: the (token, choice) pairs sorted by expert, each expert's
rows padded to whole tiles, and one batched matmul over the tiles with each tile's expert matrix
gathered (``grouped_matmul``; an expert no token chose has no tile, and its weights get a zero
gradient). That is the pairs' own FLOPs plus at most one partly empty tile per expert, about k/E
of a dense one-hot einsum's: at Qwen3-30B-A3B's 8 of 128 experts, 1/16.

Why not ``jax.lax.ragged_dot``, the grouped matmul JAX offers: XLA expands it into a dense
product over every expert on the CPU (measured: 8.5x the grouped FLOPs at 8 experts, one per
token, and 16x the output as temporaries) and, by upstream reports, on CUDA unless cuDNN's
grouped GEMM takes it; the trace measures what XLA compiles, so the plan would carry E/k times the
experts' FLOPs and memory. The tiles cost a gather of one expert matrix per tile (the memory of
``n_tiles`` matrices, counted by the trace like any other temporary).

Parameters (names a contract with models/hf.py): ``mlp.router.kernel`` [D, E] and per expert
``mlp.experts.{e}.{gate,up,down}.kernel`` ([D, I], [D, I], [I, D]), one tensor per expert as the
checkpoints store them. The forward stacks each matrix's E kernels before the grouped matmul,
gate kernels first, so the layout (models in first-read order) keeps each matrix's experts
together in its chunks.

Shapes: N tokens (B x T flattened), E experts, k choices per token, D model width, I expert width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pstar_models.gpt import _linear, tiled_mlp
from pstar_models.llama_config import LlamaConfig
from pstar_models.lora import LoraLinear, LoraSpec, dropout
from pstar_jax.model.quant_grouped import grouped_quant_matmul, is_quantized, stack_kernels
from pstar_jax.model.tiling import TileBudget, kept_projection

MATRICES = ("gate", "up", "down")


def route(logits_NxE: jax.Array, k: int, normalise: bool, dtype: jax.typing.DTypeLike) -> tuple[jax.Array, jax.Array]:
    """(weights_NxK in ``dtype``, experts_NxK): transformers' softmax in float32, top-k, the
    optional renormalisation, the cast back."""
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, k)
    if normalise:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK.astype(dtype), experts_NxK


def tile_rows(n_pairs: int, n_experts: int) -> int:
    """Rows of a tile: half the pairs an expert gets on average, rounded down to a power of two in
    [8, 256]. The static tile count, pairs / rows + experts, then costs at most 1.5x the pairs'
    FLOPs and gathers about 3 matrices per expert."""
    return int(min(256, max(8, 1 << max(0, (n_pairs // (2 * n_experts)).bit_length() - 1))))


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Where the pairs sorted by expert go when each expert's rows are padded to whole tiles of
    ``rows``: pair p (in expert order) at padded row ``dest[p]``; tile t holds expert
    ``expert_T[t]``'s rows (tiles past the last hold zeros). ``n_tiles`` = ceil(pairs / rows) +
    experts bounds any routing, so the shapes are static."""
    dest: jax.Array
    expert_T: jax.Array
    rows: int
    n_tiles: int


def tiles_for(sizes_E: jax.Array, n_pairs: int) -> Tiles:
    E = sizes_E.shape[0]
    rows = tile_rows(n_pairs, E)
    n_tiles = -(-n_pairs // rows) + E
    padded_E = -(-sizes_E // rows) * rows
    ends_E, padded_ends_E = jnp.cumsum(sizes_E), jnp.cumsum(padded_E)
    expert_P = jnp.searchsorted(ends_E, jnp.arange(n_pairs), side="right")  # each sorted pair's expert
    dest = (padded_ends_E - padded_E)[expert_P] + jnp.arange(n_pairs) - (ends_E - sizes_E)[expert_P]
    expert_T = jnp.minimum(jnp.searchsorted(padded_ends_E, jnp.arange(n_tiles) * rows, side="right"), E - 1)
    return Tiles(dest, expert_T, rows, n_tiles)


def grouped_matmul(xs_PxD: jax.Array, w_ExDxI: Any, tiles: Tiles) -> jax.Array:
    """Each row of ``xs`` (pairs sorted by expert) times its expert's matrix: [P, I]. The rows go
    to tiles of one expert each, every tile is multiplied by its expert's matrix (a batched
    matmul over the tiles, the matrices gathered per tile), and the rows come back. FLOPs: the
    pairs' own plus at most one partly empty tile per expert. Quantized frozen experts
    (``stack_kernels`` of a stage's nf4/int8 kernels) are dequantized a few tiles' experts at a
    time instead of gathered (pstar_jax.model.quant_grouped)."""
    D = xs_PxD.shape[1]
    x_TxRxD = jnp.zeros((tiles.n_tiles * tiles.rows, D), xs_PxD.dtype).at[tiles.dest].set(xs_PxD)
    x_TxRxD = x_TxRxD.reshape(tiles.n_tiles, tiles.rows, D)
    if is_quantized(w_ExDxI):
        y_TxRxI = grouped_quant_matmul(x_TxRxD, w_ExDxI, tiles.expert_T)
    else:
        y_TxRxI = jnp.einsum("trd,tdi->tri", x_TxRxD, w_ExDxI[tiles.expert_T])
    return y_TxRxI.reshape(tiles.n_tiles * tiles.rows, -1)[tiles.dest]


@dataclasses.dataclass(frozen=True)
class ExpertAdapters:
    """One matrix's LoRA adapters over all experts, stacked: a_ExDxR, b_ExRxI, peft's scale, the
    dropout rate and each expert's salt (its projection path's, as LoraLinear draws it)."""
    a_ExDxR: jax.Array
    b_ExRxI: jax.Array
    scale: float
    rate: float
    salts_E: jax.Array


def _adapted(xs_PxD: jax.Array, y_PxI: jax.Array, adapters: ExpertAdapters | None, tiles: Tiles,
             expert_P: jax.Array, seeds_P: jax.Array | None) -> jax.Array:
    """``y`` plus each pair's expert's adapter branch, as LoraLinear adds it: scale * (dropout(x) @
    a) @ b in the operands' promoted dtype (nnx.LoRA's), cast to y's; the two matmuls grouped too."""
    if adapters is None:
        return y_PxI
    if seeds_P is not None and adapters.rate > 0:  # the masks the expert's own LoraLinear draws for the token
        xs_PxD = dropout(xs_PxD[None], seeds_P[None], adapters.salts_E[expert_P][None], adapters.rate)[0]
    dtype = jnp.result_type(xs_PxD, adapters.a_ExDxR, adapters.b_ExRxI)
    low_PxR = grouped_matmul(xs_PxD.astype(dtype), adapters.a_ExDxR.astype(dtype), tiles)
    return y_PxI + (adapters.scale * grouped_matmul(low_PxR, adapters.b_ExRxI.astype(dtype), tiles)).astype(y_PxI.dtype)


def grouped_swiglu(x_NxD: jax.Array, experts_NxK: jax.Array, gate_ExDxI: jax.Array, up_ExDxI: jax.Array,
                   down_ExIxD: jax.Array, adapters: dict[str, ExpertAdapters] | None = None,
                   seeds_N: jax.Array | None = None) -> jax.Array:
    """Each (token, choice) pair through its expert's SwiGLU: [N, k, D], in the choices' order.
    ``adapters`` (by matrix name) add LoRA branches; ``seeds_N`` (each token's dropout seed) draws
    their dropout masks, per pair and expert."""
    N, k = experts_NxK.shape
    E = jax.tree.leaves(gate_ExDxI)[0].shape[0]  # (a quantized stack's arrays lead with the experts too)
    adapters = adapters or {}
    flat = experts_NxK.reshape(N * k)
    order = jnp.argsort(flat, stable=True)  # the pairs grouped by expert, tokens in order inside
    tiles = tiles_for(jnp.bincount(flat, length=E), N * k)
    expert_P = flat[order]
    seeds_P = None if seeds_N is None else seeds_N[order // k]
    xs = x_NxD[order // k]

    def matmul(x_PxD: jax.Array, w: jax.Array, name: str) -> jax.Array:
        return kept_projection(_adapted(x_PxD, grouped_matmul(x_PxD, w, tiles), adapters.get(name), tiles, expert_P,
                                        seeds_P))
    h = jax.nn.silu(matmul(xs, gate_ExDxI, "gate")) * matmul(xs, up_ExDxI, "up")
    ys = matmul(h, down_ExIxD, "down")
    return ys[jnp.argsort(order)].reshape(N, k, -1)


class Expert(nnx.Module):
    """One SwiGLU expert's weights (its forward is the grouped one of ``SparseMoE``)."""

    def __init__(self, d_model: int, width: int, down_std: float, *, rngs: nnx.Rngs, lora: LoraSpec | None = None,
                 path: str = ""):
        self.gate = _linear(d_model, width, rngs, bias=False, lora=lora, path=f"{path}.gate")
        self.up = _linear(d_model, width, rngs, bias=False, lora=lora, path=f"{path}.up")
        self.down = _linear(width, d_model, rngs, down_std, bias=False, lora=lora, path=f"{path}.down")


class SparseMoE(nnx.Module):
    """A block's MLP as a mixture of experts; ``plain``/``__call__`` as models/llama.py's MLP, so the
    block's tiled pass over positions runs it a tile at a time (routing is per token)."""

    def __init__(self, config: LlamaConfig, down_std: float, *, rngs: nnx.Rngs, tiling: TileBudget):
        self.n_experts_per_tok, self.normalise, self.tiling = config.n_experts_per_tok, config.norm_topk_prob, tiling
        self.router = _linear(config.d_model, config.n_experts, rngs, bias=False)
        self.experts = nnx.List([Expert(config.d_model, config.expert_width, down_std, rngs=rngs, lora=config.lora,
                                        path=f"mlp.experts.{e}") for e in range(config.n_experts)])
        # The hidden activations per token, for sizing the block's tiles: k experts' widths.
        self.d_ff = config.n_experts_per_tok * config.expert_width

    def stacked(self) -> tuple[Any, Any, Any]:
        """The experts' gate, up and down kernels as [E, D, I], [E, D, I], [E, I, D] (quantized ones
        stacked in their quantized form, ``stack_kernels``)."""
        return tuple(stack_kernels([getattr(e, m).kernel.get_value() for e in self.experts]) for m in MATRICES)

    def adapters(self) -> dict[str, ExpertAdapters]:
        """The experts' LoRA adapters by matrix (LlamaConfig allows all experts of a matrix or none)."""
        out = {}
        for m in MATRICES:
            layers = [getattr(e, m) for e in self.experts]
            if isinstance(layers[0], LoraLinear):
                out[m] = ExpertAdapters(jnp.stack([l.lora.lora_a[...] for l in layers]),
                                        jnp.stack([l.lora.lora_b[...] for l in layers]), layers[0].lora_scale,
                                        layers[0].lora_dropout, jnp.asarray([l.lora_salt for l in layers], jnp.uint32))
        return out

    def routed(self, x_BxTxD: jax.Array, dropout_seeds_BxT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(the output [B, T, D], the router logits [B, T, E] in x's dtype: what the load-balancing
        loss reads, pstar_jax.model.router_aux)."""
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D)
        logits_NxE = self.router(x_NxD)
        weights_NxK, experts_NxK = route(logits_NxE, self.n_experts_per_tok, self.normalise, x_NxD.dtype)
        seeds_N = None if dropout_seeds_BxT is None else dropout_seeds_BxT.reshape(B * T)
        y_NxKxD = grouped_swiglu(x_NxD, experts_NxK, *self.stacked(), self.adapters(), seeds_N)
        return jnp.sum(y_NxKxD * weights_NxK[..., None], axis=1).reshape(B, T, D), logits_NxE.reshape(B, T, -1)

    def plain(self, x_BxTxD: jax.Array, dropout_seeds_BxT: jax.Array | None = None) -> jax.Array:
        return self.routed(x_BxTxD, dropout_seeds_BxT)[0]

    def __call__(self, x_BxLxD: jax.Array, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        return tiled_mlp(self, x_BxLxD, self.d_ff, self.tiling.mlp_bytes, dropout_seeds_BxL)
