"""A Llama-family decoder in Flax NNX (Llama 3.x, Qwen2/2.5, Mistral, Qwen3, the mixtures of experts, Gemma 3's
text decoder), and its split into stages.

The numerics follow Hugging Face transformers, so that HF weights give HF's logits: RMSNorm
normalises in float32, casts back to the input dtype and then multiplies by its weight; RoPE
rotates the two halves of each head (``rotate_half``), so HF q/k weights load with a plain
transpose; query head h reads key/value head h // (n_head / n_kv_head) (HF's ``repeat_kv``);
attention scores are scaled after the q.k product and softmaxed in float32. Qwen3 (``qk_norm``)
RMS-normalises each head of q and k over its width, with weights of its own, before RoPE.
Gemma 3 (``config.gemma``) is the same decoder with switches rather than a module of its own,
since it shares everything that costs code (tiled attention and MLP, staging, the KV cache, LoRA,
the checkpoint names): its norms multiply by 1 + weight in float32 (models/llama_numerics.py),
its embeddings by sqrt(d_model), its MLP gates with the tanh GELU, its blocks also normalise the
attention's and the MLP's outputs (``attn_post_norm``, ``mlp_post_norm``), its scores scale by
query_pre_attn_scalar ** -0.5, and its sliding layers (``config.sliding(i)``) see a window of keys
and rotate with RoPE of their own base; those blocks differ from the global ones in what they
compute, not in their tensors, so the staged model compiles one block of each kind.

Module layout (parameter names are a contract with the checkpoint I/O, see models/hf.py):
``embed.embedding`` [V,D]; per block ``attn_norm.scale``, ``attn.{q,k,v}.kernel`` (+ ``.bias``
with ``qkv_bias``), ``attn.o.kernel``, ``attn.{q,k}_norm.scale`` [K] with ``qk_norm``,
``mlp_norm.scale``, ``mlp.{gate,up,down}.kernel``;
``norm.scale``; ``head.kernel`` [D,V] when the embeddings are untied; Gemma's blocks add
``attn_post_norm.scale`` and ``mlp_post_norm.scale``.

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
from flax import nnx

from pstar_models.llama_config import (DEFAULT_SEQ_LEN, FAMILIES, PRESETS, LinearRopeScaling,  # noqa: F401
                                       Llama3RopeScaling, LlamaConfig, _llama3, preset, projections)
from pstar_models.llama_numerics import (apply_rope, cached_attention, rms_norm, rope_inv_freq,  # noqa: F401
                                         rope_tables, rope_tables_at, rope_tables_of)  # (here too)
from pstar_models.lora import init_adapter, is_adapter, position_seeds, project
from pstar_models.moe import SparseMoE
from pstar_models.gpt import (KVCache, _linear, attention_segments, decode_blocks, head_loss_sum, head_target_logps,
                               logits, tiled_mlp, tiled_modules, write_cache)
from pstar_jax.model.attention import causal_attention
from pstar_jax.model.router_aux import RouterStats, layer_stats
from pstar_jax.model.nnx_staged import NNXStaged
from pstar_jax.model.staged import cross_entropy
from pstar_jax.model.tiling import TileBudget, mlp_tile

# -- modules ---------------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    """Llama's RMSNorm, or with ``offset`` Gemma's (times 1 + weight, the weight starting at 0)."""

    def __init__(self, d: int, eps: float, offset: bool = False):
        self.scale = nnx.Param(jnp.zeros((d,), jnp.float32) if offset else jnp.ones((d,), jnp.float32))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)


class Attention(nnx.Module):
    """Grouped-query attention through pstar_jax.model.attention (query tiles, or cuDNN on a GPU)."""

    def __init__(self, config: LlamaConfig, o_std: float, *, rngs: nnx.Rngs, tiling: TileBudget, layer: int = 0):
        self.config, self.tiling = config, tiling
        # Gemma's sliding layers: a window over the keys, and RoPE of their own base (``local``).
        self.local = config.sliding(layer)
        self.window = config.sliding_window if self.local else None
        D, H, N, K = config.d_model, config.n_head, config.n_kv_head, config.d_head
        lora = config.lora
        self.q = _linear(D, H * K, rngs, bias=config.qkv_bias, lora=lora, path="attn.q")
        self.k = _linear(D, N * K, rngs, bias=config.qkv_bias, lora=lora, path="attn.k")
        self.v = _linear(D, N * K, rngs, bias=config.qkv_bias, lora=lora, path="attn.v")
        self.o = _linear(H * K, D, rngs, o_std, bias=False, lora=lora, path="attn.o")
        if config.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(K, config.norm_eps, config.gemma) for _ in "qk")

    def head_modules(self) -> tuple[nnx.Module, ...]:
        """What ``heads`` reads: q, k, v, and with ``qk_norm`` q_norm and k_norm."""
        norms = (self.q_norm, self.k_norm) if self.config.qk_norm else ()
        return (self.q, self.k, self.v, *norms)

    def qkv(self, x_BxLxD: jax.Array, positions_BxL: jax.Array | None = None,
            dropout_seeds_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k (both rotated) and v of x: position-wise, so the block runs it a tile at a time."""
        c = self.config
        L = x_BxLxD.shape[1]
        cos, sin = rope_tables(c, L, self.local) if positions_BxL is None else rope_tables_of(c, positions_BxL,
                                                                                             self.local)
        return heads(self.head_modules(), c, x_BxLxD, cos, sin, dropout_seeds_BxL)

    def attend(self, q_BxLxHxK: jax.Array, k_BxLxNxK: jax.Array, v_BxLxNxK: jax.Array,
               segment_ids_BxL: jax.Array | None) -> jax.Array:
        """The attention output before the o projection, [B, L, H, K] (query tiles, or cuDNN)."""
        c = self.config
        return causal_attention(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, attention_segments(segment_ids_BxL),
                                scale=c.attention_scale if c.gemma else None, tile_bytes=self.tiling.scores_bytes,
                                window=self.window)

    def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        c = self.config
        B, L, _ = x_BxLxD.shape
        out = self.attend(*self.qkv(x_BxLxD, positions_BxL, dropout_seeds_BxL), segment_ids_BxL)
        return project(self.o, out.reshape(B, L, c.n_head * c.d_head), dropout_seeds_BxL)

    def decode(self, x_BxTxD: jax.Array, cache: KVCache, pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
        c = self.config
        B, T, _ = x_BxTxD.shape
        q, k, v = heads(self.head_modules(), c, x_BxTxD, *rope_tables_at(c, pos, T, self.local))
        cache = write_cache(cache, k, v, pos)
        out = cached_attention(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), pos,
                               c.attention_scale if c.gemma else None, self.window)
        return self.o(out.reshape(B, T, c.n_head * c.d_head)), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); Gemma's GeGLU: the tanh-approximated GELU for silu."""

    def __init__(self, config: LlamaConfig, down_std: float, *, rngs: nnx.Rngs, tiling: TileBudget):
        self.d_ff, self.tiling, self.gelu = config.d_ff, tiling, config.gemma
        lora = config.lora
        self.gate = _linear(config.d_model, config.d_ff, rngs, bias=False, lora=lora, path="mlp.gate")
        self.up = _linear(config.d_model, config.d_ff, rngs, bias=False, lora=lora, path="mlp.up")
        self.down = _linear(config.d_ff, config.d_model, rngs, down_std, bias=False, lora=lora, path="mlp.down")

    def plain(self, x_BxLxD: jax.Array, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        seeds = dropout_seeds_BxL
        gate = project(self.gate, x_BxLxD, seeds)
        act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)  # gelu_pytorch_tanh
        h = act * project(self.up, x_BxLxD, seeds)
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


def _qkv_tile(modules: tuple, config: LlamaConfig, local: bool, x_BxTxD: jax.Array, positions_BxT: jax.Array,
              seeds_BxT: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """attn_norm, then q, k, v with RoPE (Attention.qkv's numerics) on one tile of positions."""
    norm, *head_modules = modules
    return heads(tuple(head_modules), config, norm(x_BxTxD), *rope_tables_of(config, positions_BxT, local),
                 seeds_BxT)


def _attended(modules: tuple, x_BxTxD: jax.Array, out_BxTxHxK: jax.Array, seeds_BxT: jax.Array | None
              ) -> jax.Array:
    """x + o(out) (Gemma: x + attn_post_norm(o(out))): the residual stream after attention, on one tile."""
    o_proj, _, _, *post = modules
    B, T = out_BxTxHxK.shape[:2]
    a_BxTxD = project(o_proj, out_BxTxHxK.reshape(B, T, -1), seeds_BxT)
    return x_BxTxD + (post[0](a_BxTxD) if post else a_BxTxD)


def _out_tile(modules: tuple, x_BxTxD: jax.Array, out_BxTxHxK: jax.Array,
              seeds_BxT: jax.Array | None) -> jax.Array:
    """The rest of the block on one tile: x + o(out), then + mlp(mlp_norm(.)); with Gemma's post-norms
    (two more modules) x + attn_post_norm(o(out)), then + mlp_post_norm(mlp(mlp_norm(.)))."""
    _, norm, mlp, *post = modules
    h_BxTxD = _attended(modules, x_BxTxD, out_BxTxHxK, seeds_BxT)
    y_BxTxD = mlp.plain(norm(h_BxTxD), seeds_BxT)
    return h_BxTxD + (post[1](y_BxTxD) if post else y_BxTxD)


def _out_tile_routed(modules: tuple, x_BxTxD: jax.Array, out_BxTxHxK: jax.Array,
                     seeds_BxT: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``_out_tile`` of a mixture of experts (no post-norms: Gemma has no experts), with the tile's
    router logits beside its output."""
    _, norm, mlp = modules
    h_BxTxD = _attended(modules, x_BxTxD, out_BxTxHxK, seeds_BxT)
    y_BxTxD, logits_BxTxE = mlp.routed(norm(h_BxTxD), seeds_BxT)
    return h_BxTxD + y_BxTxD, logits_BxTxE


class Block(nnx.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)); Gemma's normalises the
    attention's and the MLP's outputs too (attn_post_norm, mlp_post_norm) before adding them.
    ``layer``: the block's index, which says whether a Gemma block slides."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, tiling: TileBudget, layer: int = 0):
        D, eps, gemma = config.d_model, config.norm_eps, config.gemma
        self.attn_norm = RMSNorm(D, eps, gemma)
        self.attn = Attention(config, _residual_std(config), rngs=rngs, tiling=tiling, layer=layer)
        if gemma:
            self.attn_post_norm = RMSNorm(D, eps, gemma)
        self.mlp_norm = RMSNorm(D, eps, gemma)
        ffn = SparseMoE if config.sparse_layer(layer) else MLP  # (Qwen3-MoE's mlp_only_layers are dense)
        self.mlp = ffn(config, _residual_std(config), rngs=rngs, tiling=tiling)
        if gemma:
            self.mlp_post_norm = RMSNorm(D, eps, gemma)

    def out_modules(self) -> tuple[nnx.Module, ...]:
        """What ``_out_tile`` reads: o, mlp_norm, mlp, and Gemma's two post-norms."""
        post = (self.attn_post_norm, self.mlp_post_norm) if self.attn.config.gemma else ()
        return (self.attn.o, self.mlp_norm, self.mlp, *post)

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
        local = self.attn.local
        q, k, v = tiled_modules((self.attn_norm, *self.attn.head_modules()),
                                lambda m, *x: _qkv_tile(m, config, local, *x), (x_BxLxD, positions, seeds), tile)
        out_BxLxHxK = self.attn.attend(q, k, v, segment_ids)
        if not (router_stats and isinstance(self.mlp, SparseMoE)):
            return tiled_modules(self.out_modules(), _out_tile, (x_BxLxD, out_BxLxHxK, seeds), tile)
        h_BxLxD, logits_BxLxE = tiled_modules(self.out_modules(), _out_tile_routed, (x_BxLxD, out_BxLxHxK, seeds),
                                              tile)
        mask_BxL = jnp.ones((B, L), jnp.float32) if segment_ids is None else segment_ids > 0
        return h_BxLxD, layer_stats(logits_BxLxE.reshape(B * L, -1), self.mlp.n_experts_per_tok, mask_BxL.reshape(-1))

    def decode(self, x_BxTxD: jax.Array, cache: KVCache, pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
        a, cache = self.attn.decode(self.attn_norm(x_BxTxD), cache, pos)
        gemma = self.attn.config.gemma
        x_BxTxD = x_BxTxD + (self.attn_post_norm(a) if gemma else a)
        m = self.mlp(self.mlp_norm(x_BxTxD))
        return x_BxTxD + (self.mlp_post_norm(m) if gemma else m), cache


class Llama(nnx.Module):
    """``embed(tokens_BxL)`` (the nnx.Embed itself) -> ``blocks`` -> ``unembed(h)`` -> logits.

    The final norm + projection is the method ``unembed``, not ``head``: ``head`` is the untied
    projection's module, whose ``head.kernel`` name the checkpoint I/O relies on. ``n_blocks``
    builds fewer blocks (0 or 1 for an adapter's shell); init scales still follow config.n_layer.
    Packed rows: ``segment_ids`` and ``positions`` [B, L] (see pstar_jax.data.batch). ``tiling``
    bounds the largest intermediate of the loss, attention and the MLP (as models/gpt.py's)."""
    supports_packing = True

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, n_blocks: int | None = None,
                 tiling: TileBudget = TileBudget(), first_block: int = 0, block: type = Block,
                 norm_offset: bool | None = None):
        """``block`` and ``norm_offset`` (None: Gemma's) let a decoder of other blocks reuse the rest
        (models/qwen35.py)."""
        self.config, self.tiling = config, tiling
        self.dropout_seeded = config.lora is not None and config.lora.dropout > 0  # see pstar_jax.data.batch
        # (coefficient, experts) of the routers' load-balancing loss when the config asks for it
        # (transformers' output_router_logits): the stages then carry RouterStats (pstar_jax.model.staged)
        # (a Qwen35Config has no experts, so no such field)
        self.router_aux = ((config.router_aux_loss_coef, config.n_experts)
                           if getattr(config, "output_router_logits", False) else None)
        D = config.d_model
        self.embed = nnx.Embed(config.vocab_size, D, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.blocks = nnx.List([block(config, rngs=rngs, tiling=tiling, layer=first_block + i)
                                for i in range(config.n_layer if n_blocks is None else n_blocks)])
        self.norm = RMSNorm(D, config.norm_eps, config.gemma if norm_offset is None else norm_offset)
        if not config.tie_embeddings:
            self.head = _linear(D, config.vocab_size, rngs, bias=False)

    def unembed(self, h_BxLxD: jax.Array) -> jax.Array:
        tied = self.config.tie_embeddings
        head = self.embed.embedding[...] if tied else self.head.kernel[...]
        logits_BxLxV = logits(self.norm(h_BxLxD), head.astype(h_BxLxD.dtype), tied)
        cap = self.config.final_softcap  # Gemma's final_logit_softcapping
        return logits_BxLxV if cap is None else jnp.tanh(logits_BxLxV / cap) * cap

    def _normed_head(self, h_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, bool]:
        """(norm(h), the head's weight, tied): the final norm over sequence tiles too, since whole
        its float32 intermediates would be the head's largest buffers (4 x L x D x 4 bytes)."""
        tied = self.config.tie_embeddings
        head = self.embed.embedding[...] if tied else self.head.kernel[...]
        B, L, D = h_BxLxD.shape
        tile = mlp_tile(B, L, D, self.tiling.mlp_bytes)
        return tiled_modules((self.norm,), lambda m, x: m[0](x), (h_BxLxD,), tile), head, tied

    def loss_sum(self, h_BxLxD: jax.Array, targets_BxL: jax.Array, weights_BxL: jax.Array) -> jax.Array:
        """sum of weights * token cross entropy of ``unembed(h)``, the logits a tile at a time
        (pstar_jax.model.loss): the head stage, whose memory then does not grow with L x V."""
        normed, head, tied = self._normed_head(h_BxLxD)
        return head_loss_sum(normed, head, tied, targets_BxL, weights_BxL, self.tiling.logits_bytes,
                             self.config.final_softcap)

    def target_logps(self, h_BxLxD: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
        """Each position's target log-prob under ``unembed(h)``, [B, L] (0 off the mask), tiled as loss_sum."""
        normed, head, tied = self._normed_head(h_BxLxD)
        return head_target_logps(normed, head, tied, targets_BxL, mask_BxL, self.tiling.logits_bytes,
                                 self.config.final_softcap)

    def embed_tokens(self, tokens_BxL: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """The first stage: token embeddings (positions enter through RoPE in the blocks); Gemma's
        times sqrt(d_model), that factor rounded to the table's dtype first as transformers does."""
        h_BxLxD = self.embed(tokens_BxL)
        if not self.config.gemma:
            return h_BxLxD
        return h_BxLxD * jnp.asarray(math.sqrt(self.config.d_model), jnp.float32).astype(h_BxLxD.dtype)

    def __call__(self, tokens_BxL: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        h_BxLxD = self.embed_tokens(tokens_BxL)
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
        return self.embed_tokens(tokens_BxT)  # positions enter through RoPE

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
        super().__init__(lambda rngs, n_blocks, first_block=0: Llama(config, rngs=rngs, n_blocks=n_blocks,
                                                                      tiling=tiling, first_block=first_block),
                         config.n_layer, seq_len=config.seq_len, vocab_size=config.vocab_size, embed="embed_tokens",
                         block_kinds=tuple(map(config.block_kind, range(config.n_layer))))

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
        if leaf == "scale":  # Gemma's norms multiply by 1 + scale
            return (jnp.zeros if self.config.gemma else jnp.ones)(shape, jnp.float32)
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
        """6*N + 12*n_head*head_dim*(keys a query attends to, summed over the layers): N counts the
        matmul parameters a token meets (all but the embedding table, unless it doubles as the tied
        head, and but the experts, with their adapters, it was not routed to); the second term is
        attention's two matmuls, over L/2 keys on average under the causal mask (6*n_layer*seq_len*n_head*head_dim
        in all), and over w - w^2/(2L) in a sliding layer whose window w is shorter than L."""
        c = self.config
        lookup = 0 if c.tie_embeddings else c.vocab_size * c.d_model
        idle = sum(math.prod(shape) * (1.0 - self.flop_share(name)) for name, shape in self.param_shapes().items())
        L = c.seq_len
        windows = [c.sliding_window if c.sliding(i) else None for i in range(c.n_layer)]
        keys = sum(L / 2 if w is None or w >= L else w - w * w / (2 * L) for w in windows)
        return 6.0 * (self.n_params() - lookup - idle) + 12.0 * keys * c.n_head * c.d_head


def llama_from_params(config: LlamaConfig, params: Mapping[str, jax.Array]) -> Llama:
    """A Llama holding exactly ``params`` (names as in StagedLlama.param_shapes), in their dtypes."""
    return StagedLlama(config).module(params)


def build_model(name: str, **overrides: Any) -> StagedLlama:
    """A preset with some fields replaced (None values are ignored): what a CLI builds."""
    config = dataclasses.replace(preset(name), **{k: v for k, v in overrides.items() if v is not None})
    return StagedLlama(config)
