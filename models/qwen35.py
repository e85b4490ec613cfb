"""Qwen3.5's text decoder (transformers' ``qwen3_5`` text model) in Flax NNX: Gated DeltaNet layers
(models/gated_deltanet.py) between gated full-attention layers, each followed by a SwiGLU MLP.

The full-attention layers differ from Qwen3's in three ways: q_proj yields, per head, the query and
a gate of the same width (the attention output is multiplied by sigmoid(gate) before o_proj), RoPE
rotates only the first ``partial_rotary`` of each head's width, and every RMSNorm (the blocks', the
final one, q_norm and k_norm) multiplies by 1 + weight in float32 (Gemma's, models/llama_numerics.py).
Text positions are the same on the three M-RoPE axes, so M-RoPE reduces to plain RoPE over the
rotated width.

Module layout (transformers' names in models/hf_qwen35.py): ``embed.embedding`` [V, D]; per block
``attn_norm.scale``, then in full-attention layers ``attn.q.kernel`` [D, H 2K], ``attn.{k,v}.kernel``
[D, N K], ``attn.o.kernel`` [H K, D], ``attn.{q,k}_norm.scale`` [K], in linear-attention layers
``linear_attn.*`` (models/gated_deltanet.py); ``mlp_norm.scale``, ``mlp.{gate,up,down}.kernel``;
``norm.scale``; ``head.kernel`` [D, V] when untied. Shapes as models/llama.py's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pstar_models.gated_deltanet import DeltaCache, DeltaNetShape, GatedDeltaNet, init_delta_cache
from pstar_models.gpt import _linear, attention_segments
from pstar_models.llama import MLP, Llama, RMSNorm
from pstar_models.limits import MAX_HEAD_DIM, MAX_LAYERS, check_sizes
from pstar_models.llama_numerics import apply_rope, cached_attention
from pstar_models.lora import LoraSpec, check_spec, position_seeds, project
from pstar_jax.model.attention import causal_attention
from pstar_jax.model.nnx_staged import NNXStaged, PerLayer
from pstar_jax.model.tiling import TileBudget

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    seq_len: int
    layer_types: tuple[str, ...]  # one of LAYER_TYPES per layer
    linear: DeltaNetShape  # the linear-attention layers' sizes
    rope_theta: float = 10000000.0
    partial_rotary: float = 0.25  # the share of each head's width that RoPE rotates
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None
    lora: LoraSpec | None = None  # adapters on the projections (models/lora.py); not part of HF's config
    # (read by llama's MLP and decoder ends: SwiGLU, embeddings unscaled, no final softcap)
    gemma = False
    final_softcap = None
    family = "qwen3_5_text"  # the HF model_type it exports as

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "d_ff", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Qwen35Config.{field} must be a positive integer, got {value!r}")
        check_sizes("Qwen35Config", {f: getattr(self, f) for f in ("vocab_size", "d_model", "n_layer", "n_head",
                                                                    "n_kv_head", "head_dim", "d_ff", "seq_len")},
                    {"n_layer": MAX_LAYERS, "head_dim": MAX_HEAD_DIM})
        for field in ("rope_theta", "norm_eps"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"Qwen35Config.{field} must be a positive number, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"Qwen35Config.n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown or len(self.layer_types) != self.n_layer:
            raise ValueError(f"layer_types must name {self.n_layer} layers, each one of {', '.join(LAYER_TYPES)}; "
                             f"got {len(self.layer_types)}" + (f" with {', '.join(map(repr, unknown))}" if unknown
                                                               else ""))
        if self.rotary_dim % 2 or not 0 < self.partial_rotary <= 1:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary} must be in (0, 1] and rotate an even "
                             f"part of head_dim={self.head_dim}")
        if self.linear.d_model != self.d_model or self.linear.norm_eps != self.norm_eps:
            raise ValueError("Qwen35Config.linear must have the model's d_model and norm_eps")
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise ValueError(f"Qwen35Config.lora must be a LoraSpec or None, got {self.lora!r}")
        check_spec(self.lora, self.projections(), "qwen3_5_text")

    def projections(self) -> dict[str, tuple[int, int]]:
        """Every projection LoRA may target (either kind of block's): path -> (in, out) features."""
        D, F, HK, NK = self.d_model, self.d_ff, self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        return {"attn.q": (D, 2 * HK), "attn.k": (D, NK), "attn.v": (D, NK), "attn.o": (HK, D),
                **self.linear.projections(), "mlp.gate": (D, F), "mlp.up": (D, F), "mlp.down": (F, D)}

    @property
    def d_head(self) -> int:
        return self.head_dim

    @property
    def rotary_dim(self) -> int:
        """transformers' int(head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary)

    def linear_layer(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"


def rope_tables_of(config: Qwen35Config, positions_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, L, R] over the rotated width R in float32 (transformers' default RoPE over
    dim R: inv_freq = theta ** -(arange(0, R, 2) / R), the halves repeated)."""
    R = config.rotary_dim
    inv_freq = (1.0 / (config.rope_theta ** (np.arange(0, R, 2, dtype=np.int64).astype(np.float32) / R))
                ).astype(np.float32)
    angles = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def partial_rope(x_BxLxHxK: jax.Array, cos_BxLxR: jax.Array, sin_BxLxR: jax.Array) -> jax.Array:
    """RoPE on the first R of each head's K values, the rest passed through."""
    R = cos_BxLxR.shape[-1]
    return jnp.concatenate([apply_rope(x_BxLxHxK[..., :R], cos_BxLxR, sin_BxLxR), x_BxLxHxK[..., R:]], axis=-1)


class GatedAttention(nnx.Module):
    """transformers' Qwen3_5Attention: q and its gate from one projection, q/k norms, partial RoPE,
    attention, the output times sigmoid(gate), then o."""

    def __init__(self, config: Qwen35Config, o_std: float, *, rngs: nnx.Rngs, tiling: TileBudget):
        self.config, self.tiling = config, tiling
        D, H, N, K = config.d_model, config.n_head, config.n_kv_head, config.head_dim
        lora = config.lora
        self.q = _linear(D, H * 2 * K, rngs, bias=False, lora=lora, path="attn.q")
        self.k = _linear(D, N * K, rngs, bias=False, lora=lora, path="attn.k")
        self.v = _linear(D, N * K, rngs, bias=False, lora=lora, path="attn.v")
        self.o = _linear(H * K, D, rngs, o_std, bias=False, lora=lora, path="attn.o")
        self.q_norm, self.k_norm = (RMSNorm(K, config.norm_eps, offset=True) for _ in "qk")

    def heads(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, seeds_BxT: jax.Array | None = None
              ) -> tuple[jax.Array, ...]:
        """q and k (normed, rotated), v, and the gate [B, T, H K]."""
        c = self.config
        B, T, _ = x_BxTxD.shape
        q_and_gate = project(self.q, x_BxTxD, seeds_BxT).reshape(B, T, c.n_head, 2 * c.head_dim)
        q, gate = q_and_gate[..., :c.head_dim], q_and_gate[..., c.head_dim:].reshape(B, T, -1)
        k = project(self.k, x_BxTxD, seeds_BxT).reshape(B, T, c.n_kv_head, c.head_dim)
        v = project(self.v, x_BxTxD, seeds_BxT).reshape(B, T, c.n_kv_head, c.head_dim)
        cos, sin = rope_tables_of(c, positions_BxT)
        return partial_rope(self.q_norm(q), cos, sin), partial_rope(self.k_norm(k), cos, sin), v, gate

    def gated_out(self, out_BxTxHxK: jax.Array, gate_BxTxHK: jax.Array, seeds_BxT: jax.Array | None = None
                  ) -> jax.Array:
        B, T = out_BxTxHxK.shape[:2]
        return project(self.o, out_BxTxHxK.reshape(B, T, -1) * jax.nn.sigmoid(gate_BxTxHK), seeds_BxT)

    def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None, positions_BxL: jax.Array,
                 seeds_BxL: jax.Array | None = None) -> jax.Array:
        q, k, v, gate = self.heads(x_BxLxD, positions_BxL, seeds_BxL)
        out = causal_attention(q, k, v, attention_segments(segment_ids_BxL), tile_bytes=self.tiling.scores_bytes)
        return self.gated_out(out, gate, seeds_BxL)

    def decode(self, x_BxTxD: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array | int
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        B, T, _ = x_BxTxD.shape
        positions = jnp.broadcast_to(pos + jnp.arange(T), (B, T))
        q, k, v, gate = self.heads(x_BxTxD, positions)
        k_cache = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), pos, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), pos, axis=1)
        out = cached_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), pos)
        return self.gated_out(out, gate), (k_cache, v_cache)


def _residual_std(config: Qwen35Config) -> float:
    return 0.02 / math.sqrt(2 * config.n_layer)


class Block(nnx.Module):
    """Pre-norm block: x + mixer(attn_norm(x)), then x + mlp(mlp_norm(x)); the mixer is layer i's
    (``linear_attn``, Gated DeltaNet, or ``attn``, gated full attention)."""

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs, tiling: TileBudget, layer: int = 0):
        self.linear = config.linear_layer(layer)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, offset=True)
        if self.linear:
            self.linear_attn = GatedDeltaNet(config.linear, _residual_std(config), rngs=rngs, lora=config.lora)
        else:
            self.attn = GatedAttention(config, _residual_std(config), rngs=rngs, tiling=tiling)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, offset=True)
        self.mlp = MLP(config, _residual_std(config), rngs=rngs, tiling=tiling)

    def __call__(self, x_BxLxD: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, dropout_seed: jax.Array | None = None) -> jax.Array:
        """``segment_ids`` and ``positions`` [B, L]: packed rows (None: one example per row at
        0..L-1); ``dropout_seed`` [B] draws LoRA dropout's masks (None: none)."""
        B, L, _ = x_BxLxD.shape
        seeds = None if dropout_seed is None else position_seeds(dropout_seed, L)
        h = self.attn_norm(x_BxLxD)
        if self.linear:
            h = self.linear_attn(h, segment_ids, seeds)
        else:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
            h = self.attn(h, segment_ids, positions, seeds)
        x_BxLxD = x_BxLxD + h
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD), seeds)

    def decode(self, x_BxTxD: jax.Array, cache: Any, pos: jax.Array | int) -> tuple[jax.Array, Any]:
        h = self.attn_norm(x_BxTxD)
        h, cache = self.linear_attn.decode(h, cache) if self.linear else self.attn.decode(h, cache, pos)
        x_BxTxD = x_BxTxD + h
        return x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD)), cache


class Qwen35(Llama):
    """Llama's decoder ends (models/llama.py: the embedding, the final norm, here times 1 + weight,
    the head and its tiled loss, packing) around Qwen3.5's blocks; ``decode`` through a Qwen35Cache."""

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs, n_blocks: int | None = None,
                 tiling: TileBudget = TileBudget(), first_block: int = 0):
        super().__init__(config, rngs=rngs, n_blocks=n_blocks, tiling=tiling, first_block=first_block,
                         block=Block, norm_offset=True)

    def init_cache(self, batch: int, max_len: int, dtype: Any) -> PerLayer:
        """One entry per layer: (k, v) [B, S, N, K] for a full-attention layer, a DeltaCache (the
        convolution window and the rule's state, their size independent of S) for a linear one."""
        c = self.config
        kv = (batch, max_len, c.n_kv_head, c.head_dim)
        return PerLayer(init_delta_cache(c.linear, batch, dtype) if c.linear_layer(i) else
                        (jnp.zeros(kv, dtype), jnp.zeros(kv, dtype)) for i in range(c.n_layer))

    def decode(self, tokens_BxT: jax.Array, cache: PerLayer, pos: jax.Array | int) -> tuple[jax.Array, PerLayer]:
        """Logits of T new tokens at positions pos..pos+T-1, and the cache holding them too."""
        h_BxTxD = self.decode_embed(tokens_BxT, pos)
        layers = []
        for block, layer in zip(self.blocks, cache):
            h_BxTxD, layer = block.decode(h_BxTxD, layer, pos)
            layers.append(layer)
        return self.decode_logits(h_BxTxD), PerLayer(layers)


def _qwen35(n_layer: int, d_model: int, n_head: int, n_kv_head: int, d_ff: int, value_heads: int,
            tie: bool = False) -> Qwen35Config:
    """A published Qwen3.5 dense text decoder: every 4th layer full attention (full_attention_interval
    4), head_dim 256, 16 linear key heads of width 128, values of width 128, conv taps 4, RoPE base
    1e7 over a quarter of each head, 248,320 tokens, 262,144 positions."""
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layer))
    return Qwen35Config(vocab_size=248320, d_model=d_model, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                        head_dim=256, d_ff=d_ff, seq_len=4096, layer_types=types,
                        linear=DeltaNetShape(d_model=d_model, n_key_heads=16, n_value_heads=value_heads, d_key=128,
                                             d_value=128, conv_kernel=4, norm_eps=1e-6),
                        tie_embeddings=tie, max_position_embeddings=262144)


# Shapes of the published checkpoints' text_config, as stored copies give them (the fields not
# listed are transformers' Qwen3_5TextConfig defaults, which those copies leave as they are):
# Qwen3.5-0.8B: hidden 1024, 24 layers, 8 heads / 2 kv, intermediate 3584, 16 linear value heads,
#   tied (a copy of Qwen/Qwen3.5-0.8B@2fc06364's config.json, and a spec table of the sizes below);
# Qwen3.5-2B: hidden 2048, 24 layers, 8 / 2, intermediate 6144, 16 value heads, tied;
# Qwen3.5-4B: hidden 2560, 32 layers, 16 / 4, intermediate 9216, 32 value heads, tied;
# Qwen3.5-9B: hidden 4096, 32 layers, 16 / 4, intermediate 12288, 32 value heads (transformers'
#   defaults, documented there as "the Qwen3.5-9B style configuration", and the spec table);
# Qwen3.5-27B: hidden 5120, 64 layers, 24 / 4, intermediate 17408, 48 value heads (config.json
#   dumps in several stored repos, THUDM/slime scripts/models/qwen3.5-27B.sh, the spec table).
PRESETS = {"qwen3.5-0.8b": _qwen35(24, 1024, 8, 2, 3584, 16, tie=True),
           "qwen3.5-2b": _qwen35(24, 2048, 8, 2, 6144, 16, tie=True),
           "qwen3.5-4b": _qwen35(32, 2560, 16, 4, 9216, 32, tie=True),
           "qwen3.5-9b": _qwen35(32, 4096, 16, 4, 12288, 32), "qwen3.5-27b": _qwen35(64, 5120, 24, 4, 17408, 48),
           # Tests' and the planner's toy: both kinds of block, in the published order.
           "qwen3.5-tiny": Qwen35Config(
               vocab_size=256, d_model=32, n_layer=4, n_head=4, n_kv_head=2, head_dim=16, d_ff=64, seq_len=64,
               layer_types=("linear_attention",) * 3 + ("full_attention",),
               linear=DeltaNetShape(d_model=32, n_key_heads=2, n_value_heads=4, d_key=8, d_value=8, norm_eps=1e-6))}


def build_model(name: str, **overrides: Any) -> "StagedQwen35":
    """A preset with some fields replaced (None values are ignored)."""
    return StagedQwen35(dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}))


class StagedQwen35(NNXStaged):
    """Qwen35 as a chain of stages: embed, block_0..block_{n-1} (two kinds, each with its own
    tensors and compiled graph: linear and full attention), head (final norm and the tiled loss)."""

    def __init__(self, config: Qwen35Config, tiling: TileBudget = TileBudget()):
        self.config = config
        super().__init__(lambda rngs, n_blocks, first_block=0: Qwen35(config, rngs=rngs, n_blocks=n_blocks,
                                                                      tiling=tiling, first_block=first_block),
                         config.n_layer, seq_len=config.seq_len, vocab_size=config.vocab_size, embed="embed_tokens",
                         logits="unembed", block_kinds=config.layer_types)


__all__ = ["DeltaCache", "Qwen35", "Qwen35Config", "StagedQwen35", "LAYER_TYPES"]
