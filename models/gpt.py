"""A GPT-2 style decoder in Flax NNX, and its split into stages for a chunked training engine.

``GPT`` is the ordinary module. ``StagedGPT`` hands the same model over as a chain of pure
stages (embed, one per block, head) over flat name->tensor parameters, the names being the
module's state paths joined with '.' ('blocks.0.attn.qkv.kernel'). It satisfies the staged
model protocol structurally; this package imports no training engine.

Shapes use nanodo's suffixes: B batch, L sequence, D model width, H heads, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

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

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layer", "n_head", "seq_len", "mlp_ratio"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{field} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}; "
                             "change one of them")


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
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def embed(wte_VxD: jax.Array, wpe_LxD: jax.Array, tokens_BxL: jax.Array) -> jax.Array:
    return jnp.take(wte_VxD, tokens_BxL, axis=0) + wpe_LxD[: tokens_BxL.shape[1]]


def logits(h_BxLxD: jax.Array, head: jax.Array, tied: bool) -> jax.Array:
    """Tied: head is wte_VxD; untied: head is the kernel_DxV."""
    return h_BxLxD @ (head.T if tied else head)


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean token cross entropy, in float32 whatever the logits' dtype."""
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1).mean()


class LayerNorm(nnx.Module):
    def __init__(self, d: int):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...])


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, std: float = 0.02, bias: bool = True) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, kernel_init=nnx.initializers.normal(std),
                      bias_init=nnx.initializers.zeros_init(), rngs=rngs)


class Attention(nnx.Module):
    """Causal self-attention with one fused qkv projection."""

    def __init__(self, config: GPTConfig, proj_std: float, *, rngs: nnx.Rngs):
        d, self.n_head = config.d_model, config.n_head
        self.qkv = _linear(d, 3 * d, rngs)
        self.proj = _linear(d, d, rngs, proj_std)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        B, L, D = x_BxLxD.shape
        qkv = self.qkv(x_BxLxD).reshape(B, L, 3, self.n_head, D // self.n_head)
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True)
        return self.proj(out_BxLxHxK.reshape(B, L, D))


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, proj_std: float, *, rngs: nnx.Rngs):
        d_hidden = config.mlp_ratio * config.d_model
        self.fc = _linear(config.d_model, d_hidden, rngs)
        self.proj = _linear(d_hidden, config.d_model, rngs, proj_std)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x_BxLxD), approximate=True))


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        # GPT-2 shrinks the projections that write into the residual stream by the depth.
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.ln1 = LayerNorm(config.d_model)
        self.attn = Attention(config, proj_std, rngs=rngs)
        self.ln2 = LayerNorm(config.d_model)
        self.mlp = MLP(config, proj_std, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.ln1(x_BxLxD))
        return x_BxLxD + self.mlp(self.ln2(x_BxLxD))


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, normal = config.d_model, nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(config.vocab_size, d, embedding_init=normal, rngs=rngs)
        self.wpe = nnx.Param(normal(rngs.params(), (config.seq_len, d), jnp.float32))
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(d)
        if not config.tie_embeddings:
            self.head = _linear(d, config.vocab_size, rngs, bias=False)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        h_BxLxD = embed(self.wte.embedding[...], self.wpe[...], tokens_BxL)
        for block in self.blocks:
            h_BxLxD = block(h_BxLxD)
        tied = self.config.tie_embeddings
        head = self.wte.embedding[...] if tied else self.head.kernel[...]
        return logits(self.ln_f(h_BxLxD), head, tied)

    def loss(self, tokens_BxL: jax.Array, targets_BxL: jax.Array) -> jax.Array:
        return cross_entropy(self(tokens_BxL), targets_BxL)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Same fields as pstar_jax.stages.Stage; the engine reads only the attributes."""
    name: str
    param_names: tuple[str, ...]
    apply: Callable[..., jax.Array]


# Forward order of tensors within their module: the chunk layout follows this order, and a
# stage's tensors should sit together in the order they are used.
_RANK = {"wte": 0, "wpe": 1, "blocks": 2, "ln_f": 3, "head": 4, "ln1": 0, "attn": 1, "ln2": 2,
         "mlp": 3, "qkv": 0, "fc": 0, "proj": 1, "embedding": 0, "kernel": 0, "scale": 0, "bias": 1}


def _order_key(name: str) -> list[int]:
    return [int(k) if k.isdigit() else _RANK[k] for k in name.split(".")]


def _flat_state(state: nnx.State) -> dict[str, Any]:
    """State leaves by dotted path, in forward order."""
    flat = {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state)}
    return {name: flat[name] for name in sorted(flat, key=_order_key)}


def _state_of(names: tuple[str, ...], values: tuple[jax.Array, ...]) -> nnx.State:
    paths = [tuple(int(k) if k.isdigit() else k for k in n.split(".")) for n in names]
    return nnx.from_flat_state(list(zip(paths, values)))


def _abstract_gpt(config: GPTConfig) -> GPT:
    return nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))


def gpt_from_params(config: GPTConfig, params: Mapping[str, jax.Array]) -> GPT:
    """A GPT holding exactly ``params`` (names as in StagedGPT.param_shapes), in their dtypes."""
    model = _abstract_gpt(config)
    expected = set(_flat_state(nnx.state(model, nnx.Param)))
    if set(params) != expected:
        raise ValueError(f"params do not match the model: missing {sorted(expected - set(params))}, "
                         f"unexpected {sorted(set(params) - expected)}")
    names = tuple(params)
    nnx.update(model, _state_of(names, tuple(params[n] for n in names)))
    return model


class StagedGPT:
    """GPT as a chain of stages: embed, block_0..block_{n-1}, head (final LayerNorm and loss)."""

    def __init__(self, config: GPTConfig):
        self.config = config
        # One traced block stands for all: tracing GPT3_175B's 96 blocks takes seconds.
        one_block = _abstract_gpt(dataclasses.replace(config, n_layer=1))
        shapes = {n: tuple(v.shape) for n, v in _flat_state(nnx.state(one_block, nnx.Param)).items()}
        block_graph, block_state = nnx.split(one_block.blocks[0])
        self._block_names = block_names = tuple(_flat_state(block_state))
        shapes.update({f"blocks.{i}.{n}": shapes[f"blocks.0.{n}"]
                       for i in range(config.n_layer) for n in block_names})
        self._shapes = {n: shapes[n] for n in sorted(shapes, key=_order_key)}
        self._index = {n: i for i, n in enumerate(self._shapes)}

        # Built once: every block stage shares this object, the engine's compile-cache key.
        def block_apply(params: tuple[jax.Array, ...], h_BxLxD: jax.Array) -> jax.Array:
            return nnx.merge(block_graph, _state_of(block_names, params))(h_BxLxD)

        tied = config.tie_embeddings

        def head_apply(params: tuple[jax.Array, ...], h_BxLxD: jax.Array,
                       targets_BxL: jax.Array) -> jax.Array:
            scale, bias, head = params
            return cross_entropy(logits(layer_norm(h_BxLxD, scale, bias), head, tied), targets_BxL)

        self._block_apply, self._head_apply = block_apply, head_apply
        self._embed_applies: dict[Any, Callable[..., jax.Array]] = {}

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return dict(self._shapes)

    def init_tensor(self, name: str, seed: int) -> jax.Array:
        """One fp32 tensor, made alone (a 175B model is initialised a chunk at a time).

        GPT-2's scheme, as GPT's own initialisers: normal(0.02) for matrices and embeddings,
        0.02/sqrt(2*n_layer) for the two residual projections, zeros for biases, ones for norm
        scales. Each tensor has its own key (the seed folded with the tensor's index), so values
        do not depend on which other tensors are made."""
        shape = self._shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            return jnp.zeros(shape, jnp.float32)
        if leaf == "scale":
            return jnp.ones(shape, jnp.float32)
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("proj.kernel") else 0.02
        key = jax.random.fold_in(jax.random.key(seed), self._index[name])
        return std * jax.random.normal(key, shape, jnp.float32)

    def init_params(self, seed: int) -> dict[str, jax.Array]:
        """All tensors by name, from ``init_tensor``."""
        return {name: self.init_tensor(name, seed) for name in self._shapes}

    def stages(self, compute_dtype: Any) -> list[Stage]:
        dtype = jnp.dtype(compute_dtype)
        if dtype not in self._embed_applies:
            def embed_apply(params: tuple[jax.Array, jax.Array], tokens_BxL: jax.Array) -> jax.Array:
                return embed(*params, tokens_BxL).astype(dtype)
            self._embed_applies[dtype] = embed_apply
        head_weight = "wte.embedding" if self.config.tie_embeddings else "head.kernel"
        blocks = [Stage(f"block_{i}", tuple(f"blocks.{i}.{n}" for n in self._block_names),
                        self._block_apply) for i in range(self.config.n_layer)]
        return [Stage("embed", ("wte.embedding", "wpe"), self._embed_applies[dtype]), *blocks,
                Stage("head", ("ln_f.scale", "ln_f.bias", head_weight), self._head_apply)]

    def decays(self, name: str) -> bool:
        """nanoGPT's rule: matrices (kernels, embeddings) decay, vectors (norms, biases) do not."""
        return len(self._shapes[name]) >= 2

    def n_params(self) -> int:
        return sum(math.prod(shape) for shape in self._shapes.values())

    def flops_per_token(self) -> float:
        """Forward+backward FLOPs per token: 6*N + 6*n_layer*seq_len*d_model.

        N counts the parameters used in matmuls: all but the lookup tables, which are wpe, and wte
        unless it doubles as the tied head. The second term is attention's two L x L matmuls (12*n_layer*seq_len*d_model),
        halved because the causal mask skips the upper triangle."""
        c = self.config
        lookup = c.seq_len * c.d_model + (0 if c.tie_embeddings else c.vocab_size * c.d_model)
        return 6.0 * (self.n_params() - lookup) + 6.0 * c.n_layer * c.seq_len * c.d_model


def build_model(name: str, **overrides: Any) -> StagedGPT:
    """A preset with some fields replaced (None values are ignored): what a CLI builds."""
    config = dataclasses.replace(preset(name), **{k: v for k, v in overrides.items() if v is not None})
    return StagedGPT(config)


def load_gpt(directory: str) -> GPT:
    """A GPT from a plain export (config.json + an orbax pytree of the parameters under params/)."""
    import json
    import os

    import orbax.checkpoint as ocp

    with open(os.path.join(directory, "config.json")) as f:
        config = GPTConfig(**json.load(f))
    with ocp.StandardCheckpointer() as ckptr:
        nested = ckptr.restore(os.path.abspath(os.path.join(directory, "params")))
    flat = {".".join(str(getattr(k, "key", k)) for k in path): jnp.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(nested)[0]}
    return gpt_from_params(config, flat)
