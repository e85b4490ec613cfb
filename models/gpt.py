"""A GPT-2 style decoder in Flax NNX, and its split into stages for a chunked training engine.

``GPT`` is the ordinary module. ``StagedGPT`` hands the same model over as a chain of pure
stages (embed, one per block, head) through pstar_jax's generic NNX adapter, the tensor names
being the module's state paths joined with '.' ('blocks.0.attn.qkv.kernel').

Decoding with a KV cache (``GPT.init_cache``, ``GPT.decode``) runs the same modules on T new
tokens at positions pos..pos+T-1, reading and writing a cache of S = max_len positions; the
training path does not touch it.

Shapes use nanodo's suffixes: B batch, L sequence, D model width, H heads, V vocabulary; in
decoding T new tokens, S cached positions, N key/value heads, K head width.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pstar_models.limits import MAX_LAYERS, check_sizes
from pstar_models.lora import LoraLinear, LoraSpec, check_spec, for_path, position_seeds, project
from pstar_jax.model.attention import causal_attention
from pstar_jax.model.loss import linear_cross_entropy_sum, linear_target_logps
from pstar_jax.model.nnx_staged import NNXStaged
from pstar_jax.model.staged import cross_entropy
from pstar_jax.model.tiling import TileBudget, mlp_tile, tiled_over_sequence

LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    seq_len: int
    tie_embeddings: bool = True
    mlp_ratio: int = 4
    lora: LoraSpec | None = None  # adapters on the projections (models/lora.py); not part of HF's config

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layer", "n_head", "seq_len", "mlp_ratio"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{field} must be a positive integer, got {value!r}")
        check_sizes("GPTConfig", {f: getattr(self, f) for f in ("vocab_size", "d_model", "n_layer", "n_head", "seq_len",
                                                                 "mlp_ratio")}, {"n_layer": MAX_LAYERS})
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}; "
                             "change one of them")
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise ValueError(f"GPTConfig.lora must be a LoraSpec or None, got {self.lora!r}")
        check_spec(self.lora, projections(self), "GPT-2")


def projections(config: GPTConfig) -> dict[str, tuple[int, int]]:
    """Every projection of a block (LoRA's possible targets): path -> (in, out) features."""
    d, hidden = config.d_model, config.mlp_ratio * config.d_model
    return {"attn.qkv": (d, 3 * d), "attn.proj": (d, d), "mlp.fc": (d, hidden), "mlp.proj": (hidden, d)}


_PAPER = GPTConfig(vocab_size=50257, d_model=2048, n_layer=20, n_head=16, seq_len=1024)
_PAPER_SIZES = {  # name: (d_model, n_layer, n_head), the model sizes of the PatrickStar paper
    "GPT2_1B": (2048, 20, 16), "GPT2_2B": (2048, 40, 16), "GPT2_4B": (2304, 64, 16),
    "GPT3_6B": (4096, 30, 16), "GPT3_8B": (4096, 40, 16), "GPT3_10B": (4096, 50, 16),
    "GPT3_12B": (4096, 60, 16), "GPT3_18B": (4096, 90, 16), "GPT_DS_20B": (8192, 25, 16),
    "GPT_DS_40B": (8192, 50, 16), "GPT_DS_68B": (9216, 66, 16), "GPT3_175B": (12288, 96, 96),
}
PRESETS: Mapping[str, GPTConfig] = MappingProxyType({
    "tiny": GPTConfig(vocab_size=256, d_model=32, n_layer=2, n_head=2, seq_len=64),
    "small": GPTConfig(vocab_size=256, d_model=128, n_layer=4, n_head=4, seq_len=128),
    **{name: dataclasses.replace(_PAPER, d_model=d, n_layer=n, n_head=h)
       for name, (d, n, h) in _PAPER_SIZES.items()},
})


def preset(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """LayerNorm computed in float32, returned in x's dtype: bf16 variance loses too much."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + LN_EPS)
    feature = (1,) * (x.ndim - 1) + scale.shape  # explicit: rank promotion is an error in the tests
    return (y * scale.astype(jnp.float32).reshape(feature) + bias.astype(jnp.float32).reshape(feature)).astype(x.dtype)


def embed(wte_VxD: jax.Array, wpe_LxD: jax.Array, tokens_BxL: jax.Array,
          positions_BxL: jax.Array | None = None) -> jax.Array:
    """Token plus learned position embeddings; positions default to 0..L-1 (unpacked rows)."""
    if positions_BxL is None:
        return jnp.take(wte_VxD, tokens_BxL, axis=0) + wpe_LxD[None, : tokens_BxL.shape[1]]
    return jnp.take(wte_VxD, tokens_BxL, axis=0) + jnp.take(wpe_LxD, positions_BxL, axis=0)


def attention_segments(segment_ids_BxL: jax.Array | None) -> jax.Array | None:
    """Segment ids for pstar_jax.model.attention (causal within equal ids): each padding position
    (segment 0) gets an id of its own, -1 - its index, so that padding sees only itself and no
    row of scores is empty; examples keep theirs (k >= 1). None stays None (one segment)."""
    if segment_ids_BxL is None:
        return None
    own_1xL = -1 - jnp.arange(segment_ids_BxL.shape[1], dtype=segment_ids_BxL.dtype)[None]
    return jnp.where(segment_ids_BxL == 0, own_1xL, segment_ids_BxL)


def tiled_mlp(mlp: nnx.Module, x_BxLxD: jax.Array, d_hidden: int, tile_bytes: int,
              dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
    """``mlp.plain(x)`` over tiles of positions, so its B x L x d_hidden activations exist one
    tile at a time (one tile: the plain call); the weights' gradients add up in float32. LoRA
    dropout's per-position seeds are tiled beside x."""
    graph, state = nnx.split(mlp)
    tile = mlp_tile(x_BxLxD.shape[0], x_BxLxD.shape[1], d_hidden, tile_bytes)
    if dropout_seeds_BxL is None:
        return tiled_over_sequence(lambda s, x: nnx.merge(graph, s).plain(x), x_BxLxD, tile=tile, params=state)
    return tiled_over_sequence(lambda s, xs: nnx.merge(graph, s).plain(*xs), (x_BxLxD, dropout_seeds_BxL),
                               tile=tile, params=state)


def tiled_modules(modules: tuple[nnx.Module, ...], fn: Any, xs: tuple, tile: int) -> Any:
    """``fn(modules, *x_tile)`` over sequence tiles of ``xs`` (pstar_jax.model.tiling): the modules'
    weights go in as the loop's parameters, so their gradients add up in float32."""
    graph, state = nnx.split(modules)
    return tiled_over_sequence(lambda s, x: fn(nnx.merge(graph, s), *x), xs, tile=tile, params=state)


def _qkv_tile(modules: tuple, x_BxTxD: jax.Array, seeds_BxT: jax.Array | None) -> jax.Array:
    ln, qkv = modules
    return project(qkv, ln(x_BxTxD), seeds_BxT)


def _out_tile(modules: tuple, x_BxTxD: jax.Array, out_BxTxHxK: jax.Array, seeds_BxT: jax.Array | None) -> jax.Array:
    """The rest of the block on one tile: x + proj(out), then + mlp(ln2(.))."""
    proj, ln, mlp = modules
    B, T = out_BxTxHxK.shape[:2]
    h_BxTxD = x_BxTxD + project(proj, out_BxTxHxK.reshape(B, T, -1), seeds_BxT)
    return h_BxTxD + mlp.plain(ln(h_BxTxD), seeds_BxT)


def logits(h_BxLxD: jax.Array, head: jax.Array, tied: bool) -> jax.Array:
    """Tied: head is wte_VxD; untied: head is the kernel_DxV."""
    return h_BxLxD @ (head.T if tied else head)


def head_loss_sum(x_BxLxD: jax.Array, head: jax.Array, tied: bool, targets_BxL: jax.Array,
                  weights_BxL: jax.Array, tile_bytes: int, softcap: float | None = None) -> jax.Array:
    """``linear_cross_entropy_sum`` of the normed hidden states over all B x L positions."""
    B, L, D = x_BxLxD.shape
    return linear_cross_entropy_sum(x_BxLxD.reshape(B * L, D), head, targets_BxL.reshape(B * L),
                                    weights_BxL.reshape(B * L), tied=tied, tile_bytes=tile_bytes, softcap=softcap)


def head_target_logps(x_BxLxD: jax.Array, head: jax.Array, tied: bool, targets_BxL: jax.Array,
                      mask_BxL: jax.Array, tile_bytes: int, softcap: float | None = None) -> jax.Array:
    """``linear_target_logps`` of the normed hidden states, [B, L] (0 off the mask)."""
    B, L, D = x_BxLxD.shape
    return linear_target_logps(x_BxLxD.reshape(B * L, D), head, targets_BxL.reshape(B * L), mask_BxL.reshape(B * L),
                               tied=tied, tile_bytes=tile_bytes, softcap=softcap).reshape(B, L)


class KVCache(NamedTuple):
    """Keys and values of every layer: k and v are [layers, B, S, N, K] (one layer: [B, S, N, K])."""
    k: jax.Array
    v: jax.Array


def visible_TxS(pos: jax.Array | int, T: int, S: int) -> jax.Array:
    """Which cached positions each of T new tokens (at pos..pos+T-1) attends to: those not after it.
    Positions past the tokens written so far hold zeros and stay hidden."""
    return jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None]


def write_cache(cache: KVCache, k_BxTxNxK: jax.Array, v_BxTxNxK: jax.Array, pos: jax.Array | int) -> KVCache:
    """One layer's cache with the new keys and values written at positions pos..pos+T-1."""
    at = (0, pos, 0, 0)
    return KVCache(jax.lax.dynamic_update_slice(cache.k, k_BxTxNxK.astype(cache.k.dtype), at),
                   jax.lax.dynamic_update_slice(cache.v, v_BxTxNxK.astype(cache.v.dtype), at))


def decode_blocks(blocks: Any, h_BxTxD: jax.Array, cache: KVCache, pos: jax.Array | int
                  ) -> tuple[jax.Array, KVCache]:
    """Every block's ``decode`` in turn, each on its own layer of the cache."""
    k, v = cache
    for i, block in enumerate(blocks):
        h_BxTxD, layer = block.decode(h_BxTxD, KVCache(k[i], v[i]), pos)
        k, v = k.at[i].set(layer.k), v.at[i].set(layer.v)
    return h_BxTxD, KVCache(k, v)


class LayerNorm(nnx.Module):
    def __init__(self, d: int):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...])


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, std: float = 0.02, bias: bool = True,
            lora: LoraSpec | None = None, path: str = "") -> nnx.Linear:
    """A projection; a LoraLinear where ``lora`` targets its block-relative ``path``, whose base
    tensors are named and drawn as the plain Linear's."""
    kwargs = dict(use_bias=bias, kernel_init=nnx.initializers.normal(std), bias_init=nnx.initializers.zeros_init(),
                  rngs=rngs)
    spec = for_path(lora, path)
    return nnx.Linear(d_in, d_out, **kwargs) if spec is None else LoraLinear(d_in, d_out, spec, path=path, **kwargs)


class Attention(nnx.Module):
    """Causal self-attention with one fused qkv projection; scores per pstar_jax.model.attention (a
    query tile at a time, or cuDNN), with jax.nn.dot_product_attention's float32 q.k."""

    def __init__(self, config: GPTConfig, proj_std: float, *, rngs: nnx.Rngs, tiling: TileBudget):
        d, self.n_head, self.tiling = config.d_model, config.n_head, tiling
        self.qkv = _linear(d, 3 * d, rngs, lora=config.lora, path="attn.qkv")
        self.proj = _linear(d, d, rngs, proj_std, lora=config.lora, path="attn.proj")

    def attend(self, q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array,
               segment_ids_BxL: jax.Array | None) -> jax.Array:
        """The attention output before the output projection, [B, L, H, K]."""
        return causal_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, attention_segments(segment_ids_BxL),
                                tile_bytes=self.tiling.scores_bytes, float32_scores=True)

    def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
                 dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        B, L, D = x_BxLxD.shape
        qkv = project(self.qkv, x_BxLxD, dropout_seeds_BxL).reshape(B, L, 3, self.n_head, D // self.n_head)
        out_BxLxHxK = self.attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], segment_ids_BxL)
        return project(self.proj, out_BxLxHxK.reshape(B, L, D), dropout_seeds_BxL)

    def decode(self, x_BxTxD: jax.Array, cache: KVCache, pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
        """T new tokens at positions pos..: their keys and values join the cache, their queries
        read it."""
        B, T, D = x_BxTxD.shape
        qkv = self.qkv(x_BxTxD).reshape(B, T, 3, self.n_head, D // self.n_head)
        cache = write_cache(cache, qkv[:, :, 1], qkv[:, :, 2], pos)
        mask = visible_TxS(pos, T, cache.k.shape[1])[None, None]
        out_BxTxHxK = jax.nn.dot_product_attention(qkv[:, :, 0], cache.k.astype(x_BxTxD.dtype),
                                                   cache.v.astype(x_BxTxD.dtype), mask=mask)
        return self.proj(out_BxTxHxK.reshape(B, T, D)), cache


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, proj_std: float, *, rngs: nnx.Rngs, tiling: TileBudget):
        self.d_hidden, self.tiling = config.mlp_ratio * config.d_model, tiling
        self.fc = _linear(config.d_model, self.d_hidden, rngs, lora=config.lora, path="mlp.fc")
        self.proj = _linear(self.d_hidden, config.d_model, rngs, proj_std, lora=config.lora, path="mlp.proj")

    def plain(self, x_BxLxD: jax.Array, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        h = jax.nn.gelu(project(self.fc, x_BxLxD, dropout_seeds_BxL), approximate=True)
        return project(self.proj, h, dropout_seeds_BxL)

    def __call__(self, x_BxLxD: jax.Array, dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        return tiled_mlp(self, x_BxLxD, self.d_hidden, self.tiling.mlp_bytes, dropout_seeds_BxL)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs, tiling: TileBudget):
        # GPT-2 shrinks the projections that write into the residual stream by the depth.
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.ln1 = LayerNorm(config.d_model)
        self.attn = Attention(config, proj_std, rngs=rngs, tiling=tiling)
        self.ln2 = LayerNorm(config.d_model)
        self.mlp = MLP(config, proj_std, rngs=rngs, tiling=tiling)

    def __call__(self, x_BxLxD: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, dropout_seed: jax.Array | None = None) -> jax.Array:
        """``segment_ids`` [B, L] keep attention within each packed example (None: one per row);
        ``positions`` are read by the embedding, not here; ``dropout_seed`` [B] (this stage's,
        pstar_jax.data.batch) draws LoRA dropout's masks (None: none)."""
        seeds = None if dropout_seed is None else position_seeds(dropout_seed, x_BxLxD.shape[1])
        B, L, D = x_BxLxD.shape
        # As models/llama.py's block: the position-wise parts over sequence tiles (recomputed),
        # attention over query tiles between them, so the backward keeps no whole float32 norms.
        tile = mlp_tile(B, L, self.mlp.d_hidden, self.mlp.tiling.mlp_bytes)
        qkv = tiled_modules((self.ln1, self.attn.qkv), _qkv_tile, (x_BxLxD, seeds), tile)
        qkv = qkv.reshape(B, L, 3, self.attn.n_head, D // self.attn.n_head)
        out_BxLxHxK = self.attn.attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], segment_ids)
        return tiled_modules((self.attn.proj, self.ln2, self.mlp), _out_tile, (x_BxLxD, out_BxLxHxK, seeds), tile)

    def decode(self, x_BxTxD: jax.Array, cache: KVCache, pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
        a, cache = self.attn.decode(self.ln1(x_BxTxD), cache, pos)
        x_BxTxD = x_BxTxD + a
        return x_BxTxD + self.mlp(self.ln2(x_BxTxD)), cache


class GPT(nnx.Module):
    """``n_blocks`` builds fewer blocks than ``config.n_layer`` (the staged adapter builds one, or
    none, to read shapes and initialise tensors); init scales always follow ``config.n_layer``.
    Packed rows: ``segment_ids`` and ``positions`` [B, L] (see pstar_jax.data.batch). ``tiling``
    bounds the largest intermediate of the head's loss, attention and the MLP (one tile while
    a sequence's whole intermediate fits)."""
    supports_packing = True

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs, n_blocks: int | None = None,
                 tiling: TileBudget = TileBudget()):
        self.config, self.tiling = config, tiling
        self.dropout_seeded = config.lora is not None and config.lora.dropout > 0  # see pstar_jax.data.batch
        d, normal = config.d_model, nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(config.vocab_size, d, embedding_init=normal, rngs=rngs)
        self.wpe = nnx.Param(normal(rngs.params(), (config.seq_len, d), jnp.float32))
        n_blocks = config.n_layer if n_blocks is None else n_blocks
        self.blocks = nnx.List([Block(config, rngs=rngs, tiling=tiling) for _ in range(n_blocks)])
        self.ln_f = LayerNorm(d)
        if not config.tie_embeddings:
            self.head = _linear(d, config.vocab_size, rngs, bias=False)

    def embed(self, tokens_BxL: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        return embed(self.wte.embedding[...], self.wpe[...], tokens_BxL, positions)

    def logits(self, h_BxLxD: jax.Array) -> jax.Array:
        tied = self.config.tie_embeddings
        head = self.wte.embedding[...] if tied else self.head.kernel[...]
        return logits(self.ln_f(h_BxLxD), head, tied)

    def _normed_head(self, h_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, bool]:
        """(ln_f(h), the head's weight, tied): ln_f over sequence tiles, since whole its float32
        intermediates would dominate the head stage."""
        tied = self.config.tie_embeddings
        head = self.wte.embedding[...] if tied else self.head.kernel[...]
        B, L, D = h_BxLxD.shape
        tile = mlp_tile(B, L, D, self.tiling.mlp_bytes)
        return tiled_modules((self.ln_f,), lambda m, x: m[0](x), (h_BxLxD,), tile), head, tied

    def loss_sum(self, h_BxLxD: jax.Array, targets_BxL: jax.Array, weights_BxL: jax.Array) -> jax.Array:
        """sum of weights * token cross entropy of ``logits(h)``, the logits a tile at a time
        (pstar_jax.model.loss): the head stage, whose memory then does not grow with L x V."""
        normed, head, tied = self._normed_head(h_BxLxD)
        return head_loss_sum(normed, head, tied, targets_BxL, weights_BxL, self.tiling.logits_bytes)

    def target_logps(self, h_BxLxD: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
        """Each position's target log-prob under ``logits(h)``, [B, L] (0 off the mask), tiled as loss_sum."""
        normed, head, tied = self._normed_head(h_BxLxD)
        return head_target_logps(normed, head, tied, targets_BxL, mask_BxL, self.tiling.logits_bytes)

    def __call__(self, tokens_BxL: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        h_BxLxD = self.embed(tokens_BxL, positions)
        for block in self.blocks:
            h_BxLxD = block(h_BxLxD, segment_ids)
        return self.logits(h_BxLxD)

    def loss(self, tokens_BxL: jax.Array, targets_BxL: jax.Array) -> jax.Array:
        return cross_entropy(self(tokens_BxL), targets_BxL)

    # -- decoding with a KV cache (see pstar_jax.cli.generate) ---------------------------------------
    def max_decode_len(self) -> int:
        """Positions the learned table holds: prompt and new tokens together."""
        return self.config.seq_len

    def init_cache(self, batch: int, max_len: int, dtype: Any) -> KVCache:
        c = self.config
        shape = (c.n_layer, batch, max_len, c.n_head, c.d_model // c.n_head)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def decode_embed(self, tokens_BxT: jax.Array, pos: jax.Array | int) -> jax.Array:
        wpe_TxD = jax.lax.dynamic_slice_in_dim(self.wpe[...], pos, tokens_BxT.shape[1])
        return jnp.take(self.wte.embedding[...], tokens_BxT, axis=0) + wpe_TxD[None]

    def decode_logits(self, h_BxTxD: jax.Array) -> jax.Array:
        return self.logits(h_BxTxD)

    def decode(self, tokens_BxT: jax.Array, cache: KVCache, pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
        """Logits of T new tokens at positions pos..pos+T-1, and the cache holding them too."""
        h_BxTxD, cache = decode_blocks(self.blocks, self.decode_embed(tokens_BxT, pos), cache, pos)
        return self.decode_logits(h_BxTxD), cache


class StagedGPT(NNXStaged):
    """GPT as a chain of stages: embed, block_0..block_{n-1}, head (final LayerNorm and loss)."""

    def __init__(self, config: GPTConfig, tiling: TileBudget = TileBudget()):
        self.config = config
        super().__init__(lambda rngs, n_blocks: GPT(config, rngs=rngs, n_blocks=n_blocks, tiling=tiling), config.n_layer,
                         seq_len=config.seq_len, vocab_size=config.vocab_size)

    def flops_per_token(self) -> float:
        """Forward+backward FLOPs per token: 6*N + 6*n_layer*seq_len*d_model.

        N counts the parameters used in matmuls: all but the lookup tables, which are wpe, and wte
        unless it doubles as the tied head. The second term is attention's two L x L matmuls
        (12*n_layer*seq_len*d_model), halved because the causal mask skips the upper triangle."""
        c = self.config
        lookup = c.seq_len * c.d_model + (0 if c.tie_embeddings else c.vocab_size * c.d_model)
        return 6.0 * (self.n_params() - lookup) + 6.0 * c.n_layer * c.seq_len * c.d_model


def gpt_from_params(config: GPTConfig, params: Mapping[str, jax.Array]) -> GPT:
    """A GPT holding exactly ``params`` (names as in StagedGPT.param_shapes), in their dtypes."""
    return StagedGPT(config).module(params)


def build_model(name: str, **overrides: Any) -> StagedGPT:
    """A preset with some fields replaced (None values are ignored): what a CLI builds."""
    if overrides.pop("output_router_logits", None):
        raise ValueError("output_router_logits adds a mixture of experts' router loss, and GPT-2 has no experts; "
                         "drop it")
    config = dataclasses.replace(preset(name), **{k: v for k, v in overrides.items() if v is not None})
    return StagedGPT(config)


def load_gpt(directory: str) -> GPT:
    """A GPT from a plain export (config.json + an orbax pytree of the parameters under params/)."""
    import json
    import os

    import orbax.checkpoint as ocp

    with open(os.path.join(directory, "config.json")) as f:
        fields = json.load(f)
    if fields.get("lora") is not None:  # written by dataclasses.asdict: a dict, targets a list
        fields["lora"] = LoraSpec(**{**fields["lora"], "targets": tuple(fields["lora"].get("targets", ()))})
    config = GPTConfig(**fields)
    with ocp.StandardCheckpointer() as ckptr:
        nested = ckptr.restore(os.path.abspath(os.path.join(directory, "params")))
    flat = {".".join(str(getattr(k, "key", k)) for k in path): jnp.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(nested)[0]}
    return gpt_from_params(config, flat)
