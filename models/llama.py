"""A Llama-family decoder in Flax NNX (Llama 3.x, Qwen2/2.5, Mistral, Qwen3 dense), and its split into stages.

The numerics follow Hugging Face transformers, so that HF weights give HF's logits: RMSNorm
normalises in float32, casts back to the input dtype and then multiplies by its weight; RoPE
rotates the two halves of each head (``rotate_half``), so HF q/k weights load with a plain
transpose; query head h reads key/value head h // (n_head / n_kv_head) (HF's ``repeat_kv``);
attention scores are scaled after the q.k product and softmaxed in float32. Qwen3 (``qk_norm``)
RMS-normalises each head of q and k over its width, with weights of its own, before RoPE.

Module layout (parameter names are a contract with the checkpoint I/O, see models/hf.py):
``embed.embedding`` [V,D]; per block ``attn_norm.scale``, ``attn.{q,k,v}.kernel`` (+ ``.bias``
with ``qkv_bias``), ``attn.o.kernel``, ``attn.{q,k}_norm.scale`` [K] with ``qk_norm``,
``mlp_norm.scale``, ``mlp.{gate,up,down}.kernel``;
``norm.scale``; ``head.kernel`` [D,V] when the embeddings are untied.

Decoding with a KV cache (``Llama.init_cache``, ``Llama.decode``) runs the same modules on T new
tokens at positions pos..pos+T-1 (RoPE angles offset by pos) against a cache of S positions.

Shapes use nanodo's suffixes: B batch, L sequence, D model width, H query heads, N key/value
heads, G query heads per key/value head, K head width, F MLP width, V vocabulary; in decoding
T new tokens and S cached positions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pstar_models.llama_config import (DEFAULT_SEQ_LEN, FAMILIES, PRESETS, Llama3RopeScaling, LlamaConfig,  # noqa: F401
                                       _llama3, preset, projections)  # (the family's names, here too)
from pstar_models.lora import init_adapter, is_adapter, position_seeds, project
from pstar_models.moe import SparseMoE
from pstar_models.gpt import (KVCache, _linear, attention_segments, decode_blocks, head_loss_sum, logits, tiled_mlp,
                               tiled_modules, visible_TxS, write_cache)
from pstar_jax.model.attention import causal_attention
from pstar_jax.model.router_aux import RouterStats, layer_stats
from pstar_jax.model.staged import NNXStaged, cross_entropy
from pstar_jax.model.tiling import TileBudget, mlp_tile

# -- numerics --------------------------------------------------------------------------------


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """HF's LlamaRMSNorm: normalise in float32, cast back to x's dtype, then multiply by the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype).reshape((1,) * (x.ndim - 1) + scale.shape) * y.astype(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [K/2], float32, with Llama 3.1's scaling when configured (HF's formulas)."""
    K = config.d_head
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, K, 2, dtype=np.float64) / K))
    s = config.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by the factor, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(config: LlamaConfig, length: int) -> tuple[jax.Array, jax.Array]:
    """cos_LxK and sin_LxK in float32: angles position * inv_freq, the halves repeated (HF's layout)."""
    angles_LxK2 = jnp.arange(length, dtype=jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(config))[None, :]
    angles_LxK = jnp.concatenate([angles_LxK2, angles_LxK2], axis=-1)
    return jnp.cos(angles_LxK), jnp.sin(angles_LxK)


def rope_tables_of(config: LlamaConfig, positions_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos_BxLxK and sin_BxLxK at each row's own positions (packed rows restart at each example);
    for positions 0..L-1 the same float32 values as ``rope_tables``."""
    angles_BxLxK2 = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))[None, None]
    angles_BxLxK = jnp.concatenate([angles_BxLxK2, angles_BxLxK2], axis=-1)
    return jnp.cos(angles_BxLxK), jnp.sin(angles_BxLxK)


def rope_tables_at(config: LlamaConfig, pos: jax.Array | int, length: int) -> tuple[jax.Array, jax.Array]:
    """``rope_tables`` for positions pos..pos+length-1 (the same float32 angles)."""
    positions = (pos + jnp.arange(length)).astype(jnp.float32)
    angles_LxK2 = positions[:, None] * jnp.asarray(rope_inv_freq(config))[None, :]
    angles_LxK = jnp.concatenate([angles_LxK2, angles_LxK2], axis=-1)
    return jnp.cos(angles_LxK), jnp.sin(angles_LxK)


def apply_rope(x_BxLxHxK: jax.Array, cos_LxK: jax.Array, sin_LxK: jax.Array) -> jax.Array:
    """x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1]; the tables are cast to x's dtype as HF does.
    The tables are [L, K] (every row at the same positions) or [B, L, K] (``rope_tables_of``)."""
    half = x_BxLxHxK.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxLxHxK[..., half:], x_BxLxHxK[..., :half]], axis=-1)
    lead = (slice(None),) if cos_LxK.ndim == 3 else (None,)
    cos, sin = (t[(*lead, slice(None), None, slice(None))].astype(x_BxLxHxK.dtype) for t in (cos_LxK, sin_LxK))
    return x_BxLxHxK * cos + rotated * sin


def cached_attention(q_BxTxHxK: jax.Array, k_BxSxNxK: jax.Array, v_BxSxNxK: jax.Array,
                     pos: jax.Array | int) -> jax.Array:
    """pstar_jax.model.attention.causal_attention's numerics (llama's) for T new queries at positions
    pos.. over S cached keys and values."""
    B, T, H, K = q_BxTxHxK.shape
    S, N = k_BxSxNxK.shape[1], k_BxSxNxK.shape[2]
    q_BxTxNxGxK = q_BxTxHxK.reshape(B, T, N, H // N, K)
    scores_BxNxGxTxS = jnp.einsum("btngk,bsnk->bngts", q_BxTxNxGxK, k_BxSxNxK) * (K ** -0.5)
    scores32 = jnp.where(visible_TxS(pos, T, S), scores_BxNxGxTxS.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(scores32, axis=-1).astype(q_BxTxHxK.dtype)
    return jnp.einsum("bngts,bsnk->btngk", probs, v_BxSxNxK).reshape(B, T, H, K)


# -- modules ---------------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
    """Grouped-query attention through pstar_jax.model.attention (query tiles, or cuDNN on a GPU)."""

    def __init__(self, config: LlamaConfig, o_std: float, *, rngs: nnx.Rngs, tiling: TileBudget):
        self.config, self.tiling = config, tiling
        D, H, N, K = config.d_model, config.n_head, config.n_kv_head, config.d_head
        lora = config.lora
        self.q = _linear(D, H * K, rngs, bias=config.qkv_bias, lora=lora, path="attn.q")
        self.k = _linear(D, N * K, rngs, bias=config.qkv_bias, lora=lora, path="attn.k")
        self.v = _linear(D, N * K, rngs, bias=config.qkv_bias, lora=lora, path="attn.v")
        self.o = _linear(H * K, D, rngs, o_std, bias=False, lora=lora, path="attn.o")
        if config.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(K, config.norm_eps), RMSNorm(K, config.norm_eps)

    def head_modules(self) -> tuple[nnx.Module, ...]:
        """What ``heads`` reads: q, k, v, and with ``qk_norm`` q_norm and k_norm."""
        norms = (self.q_norm, self.k_norm) if self.config.qk_norm else ()
        return (self.q, self.k, self.v, *norms)

    def qkv(self, x_BxLxD: jax.Array, positions_BxL: jax.Array | None = None,
            dropout_seeds_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k (both rotated) and v of x: position-wise, so the block runs it a tile at a time."""
        c = self.config
        L = x_BxLxD.shape[1]
        cos, sin = rope_tables(c, L) if positions_BxL is None else rope_tables_of(c, positions_BxL)
        return heads(self.head_modules(), c, x_BxLxD, cos, sin, dropout_seeds_BxL)

    def attend(self, q_BxLxHxK: jax.Array, k_BxLxNxK: jax.Array, v_BxLxNxK: jax.Array,
               segment_ids_BxL: jax.Array | None) -> jax.Array:
        """The attention output before the o projection, [B, L, H, K] (query tiles, or cuDNN)."""
        return causal_attention(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, attention_segments(segment_ids_BxL),
                                tile_bytes=self.tiling.scores_bytes)

    def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        c = self.config
        B, L, _ = x_BxLxD.shape
        out = self.attend(*self.qkv(x_BxLxD, positions_BxL, dropout_seeds_BxL), segment_ids_BxL)
        return project(self.o, out.reshape(B, L, c.n_head * c.d_head), dropout_seeds_BxL)

    def decode(self, x_BxTxD: jax.Array, cache: KVCache, pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
        c = self.config
        B, T, _ = x_BxTxD.shape
        q, k, v = heads(self.head_modules(), c, x_BxTxD, *rope_tables_at(c, pos, T))
        cache = write_cache(cache, k, v, pos)
        out = cached_attention(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), pos)
        return self.o(out.reshape(B, T, c.n_head * c.d_head)), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, down_std: float, *, rngs: nnx.Rngs, tiling: TileBudget):
        self.d_ff, self.tiling = config.d_ff, tiling
        lora = config.lora
        self.gate = _linear(config.d_model, config.d_ff, rngs, bias=False, lora=lora, path="mlp.gate")
        self.up = _linear(config.d_model, config.d_ff, rngs, bias=False, lora=lora, path="mlp.up")
        self.down = _linear(config.d_ff, config.d_model, rngs, down_std, bias=False, lora=lora, path="mlp.down")

    def plain(self, x_BxLxD: jax.Array, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        seeds = dropout_seeds_BxL
        h = jax.nn.silu(project(self.gate, x_BxLxD, seeds)) * project(self.up, x_BxLxD, seeds)
        return project(self.down, h, seeds)

    def __call__(self, x_BxLxD: jax.Array, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        return tiled_mlp(self, x_BxLxD, self.d_ff, self.tiling.mlp_bytes, dropout_seeds_BxL)


def _residual_std(config: LlamaConfig) -> float:
    """GPT-2's depth scaling for the projections that write into the residual stream."""
    return 0.02 / math.sqrt(2 * config.n_layer)


def heads(modules: tuple, config: LlamaConfig, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array,
          seeds_BxT: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k and v of x in heads, q and k rotated (after Qwen3's per-head norms): the one place
    training tiles and decoding form them. ``modules`` is ``Attention.head_modules()`` (or its
    copy inside a tiled loop); the RoPE tables are [T, K] or [B, T, K]."""
    q_proj, k_proj, v_proj, *qk_norms = modules
    B, T, _ = x_BxTxD.shape
    q = project(q_proj, x_BxTxD, seeds_BxT).reshape(B, T, config.n_head, config.d_head)
    k = project(k_proj, x_BxTxD, seeds_BxT).reshape(B, T, config.n_kv_head, config.d_head)
    v = project(v_proj, x_BxTxD, seeds_BxT).reshape(B, T, config.n_kv_head, config.d_head)
    if qk_norms:
        q, k = qk_norms[0](q), qk_norms[1](k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _qkv_tile(modules: tuple, config: LlamaConfig, x_BxTxD: jax.Array, positions_BxT: jax.Array,
              seeds_BxT: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """attn_norm, then q, k, v with RoPE (Attention.qkv's numerics) on one tile of positions."""
    norm, *head_modules = modules
    return heads(tuple(head_modules), config, norm(x_BxTxD), *rope_tables_of(config, positions_BxT), seeds_BxT)


def _attended(o_proj: nnx.Module, x_BxTxD: jax.Array, out_BxTxHxK: jax.Array, seeds_BxT: jax.Array | None
              ) -> jax.Array:
    """x + o(out): the residual stream after attention, on one tile."""
    B, T = out_BxTxHxK.shape[:2]
    return x_BxTxD + project(o_proj, out_BxTxHxK.reshape(B, T, -1), seeds_BxT)


def _out_tile(modules: tuple, x_BxTxD: jax.Array, out_BxTxHxK: jax.Array,
              seeds_BxT: jax.Array | None) -> jax.Array:
    """The rest of the block on one tile: x + o(out), then + mlp(mlp_norm(.))."""
    o_proj, norm, mlp = modules
    h_BxTxD = _attended(o_proj, x_BxTxD, out_BxTxHxK, seeds_BxT)
    return h_BxTxD + mlp.plain(norm(h_BxTxD), seeds_BxT)


def _out_tile_routed(modules: tuple, x_BxTxD: jax.Array, out_BxTxHxK: jax.Array,
                     seeds_BxT: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``_out_tile`` of a mixture of experts, with the tile's router logits beside its output."""
    o_proj, norm, mlp = modules
    h_BxTxD = _attended(o_proj, x_BxTxD, out_BxTxHxK, seeds_BxT)
    y_BxTxD, logits_BxTxE = mlp.routed(norm(h_BxTxD))
    return h_BxTxD + y_BxTxD, logits_BxTxE


class Block(nnx.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, tiling: TileBudget, layer: int = 0):
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, _residual_std(config), rngs=rngs, tiling=tiling)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        ffn = SparseMoE if config.sparse_layer(layer) else MLP  # (Qwen3-MoE's mlp_only_layers are dense)
        self.mlp = ffn(config, _residual_std(config), rngs=rngs, tiling=tiling)

    def __call__(self, x_BxLxD: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, dropout_seed: jax.Array | None = None,
                 router_stats: bool = False) -> jax.Array | tuple[jax.Array, RouterStats]:
        """``segment_ids`` and ``positions`` [B, L]: packed rows (None: one example per row at 0..L-1);
        ``dropout_seed`` [B] (this stage's, pstar_jax.data.batch) draws LoRA dropout's masks (None: none).
        ``router_stats``: a mixture of experts' block also returns its router's RouterStats over the
        non-padding positions (segment id > 0; pstar_jax.model.router_aux); a dense one only h.

        Three passes, so that only a few [B, L, D]-sized arrays are ever whole: the position-wise
        parts (norm, q/k/v with RoPE; o projection, residuals, norm, MLP) run over sequence tiles,
        each recomputed in the backward (pstar_jax.model.tiling), between them attention over query
        tiles. The backward then keeps x, q, k, v and the attention output, and one tile's
        intermediates (float32 norms, the MLP's hidden, matmul copies) at a time."""
        B, L, _ = x_BxLxD.shape
        seeds = None if dropout_seed is None else position_seeds(dropout_seed, L)
        if positions is None:  # the same float32 RoPE angles as rope_tables, tileable
            positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        tile = mlp_tile(B, L, self.mlp.d_ff, self.mlp.tiling.mlp_bytes)
        config = self.attn.config
        q, k, v = tiled_modules((self.attn_norm, *self.attn.head_modules()),
                                lambda m, *x: _qkv_tile(m, config, *x), (x_BxLxD, positions, seeds), tile)
        out_BxLxHxK = self.attn.attend(q, k, v, segment_ids)
        modules = (self.attn.o, self.mlp_norm, self.mlp)
        if not (router_stats and isinstance(self.mlp, SparseMoE)):
            return tiled_modules(modules, _out_tile, (x_BxLxD, out_BxLxHxK, seeds), tile)
        h_BxLxD, logits_BxLxE = tiled_modules(modules, _out_tile_routed, (x_BxLxD, out_BxLxHxK, seeds), tile)
        mask_BxL = jnp.ones((B, L), jnp.float32) if segment_ids is None else segment_ids > 0
        return h_BxLxD, layer_stats(logits_BxLxE.reshape(B * L, -1), self.mlp.n_experts_per_tok, mask_BxL.reshape(-1))

    def decode(self, x_BxTxD: jax.Array, cache: KVCache, pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
        a, cache = self.attn.decode(self.attn_norm(x_BxTxD), cache, pos)
        x_BxTxD = x_BxTxD + a
        return x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD)), cache


class Llama(nnx.Module):
    """``embed(tokens_BxL)`` (the nnx.Embed itself) -> ``blocks`` -> ``unembed(h)`` -> logits.

    The final norm + projection is the method ``unembed``, not ``head``: ``head`` is the untied
    projection's module, whose ``head.kernel`` name the checkpoint I/O relies on. ``n_blocks``
    builds fewer blocks (0 or 1 for an adapter's shell); init scales still follow config.n_layer.
    Packed rows: ``segment_ids`` and ``positions`` [B, L] (see pstar_jax.data.batch). ``tiling``
    bounds the largest intermediate of the loss, attention and the MLP (as models/gpt.py's)."""
    supports_packing = True

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, n_blocks: int | None = None,
                 tiling: TileBudget = TileBudget()):
        self.config, self.tiling = config, tiling
        self.dropout_seeded = config.lora is not None and config.lora.dropout > 0  # see pstar_jax.data.batch
        # (coefficient, experts) of the routers' load-balancing loss when the config asks for it
        # (transformers' output_router_logits): the stages then carry RouterStats (pstar_jax.model.staged)
        self.router_aux = (config.router_aux_loss_coef, config.n_experts) if config.output_router_logits else None
        D = config.d_model
        self.embed = nnx.Embed(config.vocab_size, D, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs=rngs, tiling=tiling, layer=i)
                                for i in range(config.n_layer if n_blocks is None else n_blocks)])
        self.norm = RMSNorm(D, config.norm_eps)
        if not config.tie_embeddings:
            self.head = _linear(D, config.vocab_size, rngs, bias=False)

    def block_kind(self, i: int) -> str:
        """Which blocks are alike (pstar_jax.model.staged): a mixture of experts' and a dense one."""
        return "experts" if self.config.sparse_layer(i) else "dense"

    def unembed(self, h_BxLxD: jax.Array) -> jax.Array:
        tied = self.config.tie_embeddings
        head = self.embed.embedding[...] if tied else self.head.kernel[...]
        return logits(self.norm(h_BxLxD), head.astype(h_BxLxD.dtype), tied)

    def loss_sum(self, h_BxLxD: jax.Array, targets_BxL: jax.Array, weights_BxL: jax.Array) -> jax.Array:
        """sum of weights * token cross entropy of ``unembed(h)``, the logits a tile at a time
        (pstar_jax.model.loss): the head stage, whose memory then does not grow with L x V."""
        tied = self.config.tie_embeddings
        head = self.embed.embedding[...] if tied else self.head.kernel[...]
        # The final norm over sequence tiles too: whole, its float32 intermediates would be the
        # head's largest buffers (4 x L x D x 4 bytes).
        B, L, D = h_BxLxD.shape
        normed = tiled_modules((self.norm,), lambda m, x: m[0](x), (h_BxLxD,), mlp_tile(B, L, D, self.tiling.mlp_bytes))
        return head_loss_sum(normed, head, tied, targets_BxL, weights_BxL, self.tiling.logits_bytes)

    def embed_tokens(self, tokens_BxL: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """The first stage: token embeddings (positions enter through RoPE in the blocks)."""
        return self.embed(tokens_BxL)

    def __call__(self, tokens_BxL: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        h_BxLxD = self.embed(tokens_BxL)
        for block in self.blocks:
            h_BxLxD = block(h_BxLxD, segment_ids, positions)
        return self.unembed(h_BxLxD)

    def loss(self, tokens_BxL: jax.Array, targets_BxL: jax.Array) -> jax.Array:
        return cross_entropy(self(tokens_BxL), targets_BxL)

    # -- decoding with a KV cache (see pstar_jax.cli.generate) ---------------------------------------
    def max_decode_len(self) -> int:
        """The context the checkpoint was made for (RoPE itself has no hard limit)."""
        return max(self.config.max_position_embeddings or 0, self.config.seq_len)

    def init_cache(self, batch: int, max_len: int, dtype: Any) -> KVCache:
        c = self.config
        shape = (c.n_layer, batch, max_len, c.n_kv_head, c.d_head)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def decode_embed(self, tokens_BxT: jax.Array, pos: jax.Array | int) -> jax.Array:
        return self.embed(tokens_BxT)  # positions enter through RoPE

    def decode_logits(self, h_BxTxD: jax.Array) -> jax.Array:
        return self.unembed(h_BxTxD)

    def decode(self, tokens_BxT: jax.Array, cache: KVCache, pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
        """Logits of T new tokens at positions pos..pos+T-1, and the cache holding them too."""
        h_BxTxD, cache = decode_blocks(self.blocks, self.decode_embed(tokens_BxT, pos), cache, pos)
        return self.decode_logits(h_BxTxD), cache


# -- staging ---------------------------------------------------------------------------------


class StagedLlama(NNXStaged):
    """Llama as a chain of stages: embed, block_0..block_{n-1}, head (final norm and the tiled loss)."""

    def __init__(self, config: LlamaConfig, tiling: TileBudget = TileBudget()):
        self.config = config
        super().__init__(lambda rngs, n_blocks: Llama(config, rngs=rngs, n_blocks=n_blocks, tiling=tiling),
                         config.n_layer, seq_len=config.seq_len, vocab_size=config.vocab_size, embed="embed_tokens")

    def init_tensor(self, name: str, seed: int) -> jax.Array:
        """One fp32 tensor, made alone: normal(0.02) for matrices and embeddings, 0.02/sqrt(2*n_layer)
        for attn.o and mlp.down, zeros for biases, ones for norm scales (the module's own
        initialisers' distributions, drawn without building the module), peft's for LoRA adapters
        (models/lora.py); each tensor's key is the seed folded with its index, so values do not
        depend on which other tensors are made (nor base tensors on whether adapters exist)."""
        shape = self.param_shapes()[name]
        leaf = name.rsplit(".", 1)[-1]
        if is_adapter(name):
            return init_adapter(name, shape, jax.random.fold_in(jax.random.key(seed), self._index[name]))
        if leaf == "bias":
            return jnp.zeros(shape, jnp.float32)
        if leaf == "scale":
            return jnp.ones(shape, jnp.float32)
        residual = name.endswith(("attn.o.kernel", "down.kernel"))
        std = _residual_std(self.config) if residual else 0.02
        key = jax.random.fold_in(jax.random.key(seed), self._index[name])
        return std * jax.random.normal(key, shape, jnp.float32)

    def chunk_group(self, name: str) -> str:
        """"experts" for a mixture of experts' expert weights, which keep to chunks of their own (the
        router stays with attention's tensors); "" for every other tensor."""
        return "experts" if ".mlp.experts." in name else ""

    def flop_share(self, name: str) -> float:
        """The share of tokens whose FLOPs a tensor takes part in: k/E for an expert's weights, else 1."""
        c = self.config
        return c.n_experts_per_tok / c.n_experts if self.chunk_group(name) == "experts" else 1.0

    def flops_per_token(self) -> float:
        """6*N + 6*n_layer*seq_len*n_head*head_dim: N counts the matmul parameters a token meets
        (all but the embedding table, unless it doubles as the tied head, and but the experts it
        was not routed to); the second term is attention's two L x L matmuls, halved for the
        causal mask."""
        c = self.config
        lookup = 0 if c.tie_embeddings else c.vocab_size * c.d_model
        idle = len(c.sparse_layers) * (c.n_experts - c.n_experts_per_tok) * 3 * c.d_model * c.expert_width
        return 6.0 * (self.n_params() - lookup - idle) + 6.0 * c.n_layer * c.seq_len * c.n_head * c.d_head


def llama_from_params(config: LlamaConfig, params: Mapping[str, jax.Array]) -> Llama:
    """A Llama holding exactly ``params`` (names as in StagedLlama.param_shapes), in their dtypes."""
    return StagedLlama(config).module(params)


def build_model(name: str, **overrides: Any) -> StagedLlama:
    """A preset with some fields replaced (None values are ignored): what a CLI builds."""
    config = dataclasses.replace(preset(name), **{k: v for k, v in overrides.items() if v is not None})
    return StagedLlama(config)
