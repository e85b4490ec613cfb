"""LoRA adapters on a decoder's projections, with Hugging Face peft's initialisation and scaling.

A targeted projection computes ``base(x) + scale * (dropout(x) @ lora_a) @ lora_b``: the adapter
is a branch beside the base kernel, not merged into it, so a bf16 base never rounds away small
adapter updates and the backward never forms the full kernel's gradient. The adapter is
``flax.nnx.LoRA`` (its matmuls and ``LoRAParam`` variables) under the attribute ``lora`` of an
``nnx.Linear`` subclass, so the base tensors keep their names and the adapter's are
``<projection>.lora.lora_a`` [in, rank] and ``<projection>.lora.lora_b`` [rank, out].

peft's conventions: ``scale = alpha / rank`` (``rslora``: ``alpha / sqrt(rank)``); lora_a starts
as torch's ``kaiming_uniform_(a=sqrt(5))`` on peft's [rank, in] weight, which is U(-1/sqrt(in),
1/sqrt(in)), and lora_b at zero, so an untrained adapter adds exactly nothing.

Targets are module paths relative to a block ('attn.q', 'mlp.down') or glob patterns over them;
none means every projection of the family (``projections(config)`` in models/gpt.py and
models/llama.py) but a mixture of experts' experts (``NAMED_ONLY``).

Dropout: a block called with ``dropout_seed`` [B] (its stage's, see pstar_jax.data.batch) derives a
seed per position (``position_seeds``), and each targeted projection salts it with its path, so
masks differ per layer, projection, row and position and do not depend on tiling or devices.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import zlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pstar_jax.data.batch import mix_seeds
from pstar_jax.model.quant import Int8Tensor, NF4Tensor, quant_matmul
from pstar_jax.model.quant_bytes import QuantSlot
from pstar_jax.model.tiling import kept_projection

ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which projections get an adapter, and its rank, alpha (scale alpha / rank) and dropout."""
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # block-relative paths or globs; () every projection
    rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraSpec.rank must be a whole number of at least 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoraSpec.alpha must be a positive number, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not \
                0 <= self.dropout < 1:
            raise ValueError(f"LoraSpec.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.targets, tuple) or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"LoraSpec.targets must be a tuple of module paths or patterns, got {self.targets!r}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def targets_path(self, path: str) -> bool:
        """Whether the projection at block-relative ``path`` gets an adapter."""
        return targeted(self.targets, path)


def targeted(targets: Sequence[str], path: str) -> bool:
    """Whether ``targets`` (paths or globs; none: every projection but the NAMED_ONLY ones) name
    the projection at block-relative ``path``."""
    if not targets:
        return not named_only(path)
    return any(fnmatch.fnmatchcase(path, t) for t in targets)


# Projections an empty target list leaves out, adapted only where a target names them: a mixture
# of experts' experts. An adapter per expert and matrix multiplies what a block compiles (128
# experts: 1,152 adapter tensors a block, the MoE's forward and backward compiling 3x longer,
# measured) and the trained state (Qwen3-30B-A3B at r=16: 0.8B adapter parameters beside
# attention's 13M); `--lora-targets 'attn.*,mlp.experts.*'` asks for them.
NAMED_ONLY = ("mlp.experts.*",)


def named_only(path: str) -> bool:
    """Whether the projection at ``path`` gets an adapter only when a target names it."""
    return any(fnmatch.fnmatchcase(path, p) for p in NAMED_ONLY)


def check_spec(spec: LoraSpec | None, projections: dict[str, tuple[int, int]], family: str) -> None:
    """ValueError (one line) for a target that matches none of ``projections`` (path -> (in, out))
    or a rank above a targeted projection's smaller side."""
    if spec is None:
        return
    for target in spec.targets:
        if not any(fnmatch.fnmatchcase(p, target) for p in projections):
            raise ValueError(f"LoRA target {target!r} matches no projection of a {family} block; "
                             f"choose among {', '.join(projections)} (or glob patterns over them)")
    for path, (d_in, d_out) in projections.items():
        if spec.targets_path(path) and spec.rank > min(d_in, d_out):
            raise ValueError(f"LoRA rank {spec.rank} exceeds {path}'s smaller side ({min(d_in, d_out)}: "
                             f"in {d_in}, out {d_out}); choose a rank of at most {min(d_in, d_out)}")


def for_path(spec: LoraSpec | None, path: str) -> LoraSpec | None:
    """``spec`` if the projection at ``path`` is a target, else None (a plain nnx.Linear)."""
    return spec if spec is not None and spec.targets_path(path) else None


def is_adapter(name: str) -> bool:
    """Whether a tensor name is an adapter's ('blocks.0.attn.q.lora.lora_a')."""
    return name.endswith((".lora.lora_a", ".lora.lora_b"))


def peft_a_init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    """lora_a [in, rank]: U(-1/sqrt(in), 1/sqrt(in)), torch's kaiming_uniform_(a=sqrt(5)) as peft
    draws it on its [rank, in] weight (gain sqrt(1/3) times sqrt(3 / fan_in))."""
    bound = 1.0 / math.sqrt(shape[0])
    return jax.random.uniform(key, tuple(shape), dtype, -bound, bound)


def init_adapter(name: str, shape: Sequence[int], key: jax.Array) -> jax.Array:
    """An adapter tensor's fp32 initial value: peft's lora_a draw, or zeros for lora_b."""
    if name.endswith(".lora_b"):
        return jnp.zeros(tuple(shape), jnp.float32)
    return peft_a_init(key, shape)


def _peek(rngs: nnx.Rngs) -> jax.Array:
    """A key from the params stream's current state, without drawing from it: the base tensors
    then get the same values with or without adapters (init does not shift their draws)."""
    stream = rngs.params
    return jax.random.fold_in(jax.random.fold_in(stream.key[...], stream.count[...]), 0x10A)


def position_seeds(dropout_seed_B: jax.Array, length: int) -> jax.Array:
    """[B, L] uint32: each row's (stage-mixed) dropout seed mixed with each position's index, so
    a position's masks do not depend on how the sequence is tiled."""
    seed_BxL = jnp.broadcast_to(jnp.asarray(dropout_seed_B, jnp.uint32)[:, None], (dropout_seed_B.shape[0], length))
    return mix_seeds(seed_BxL, jnp.broadcast_to(jnp.arange(length, dtype=jnp.uint32)[None], seed_BxL.shape))


def dropout(x_BxTxD: jax.Array, seeds_BxT: jax.Array, salt: int | jax.Array, rate: float) -> jax.Array:
    """Inverted dropout of x (kept values scaled by 1 / (1 - rate), as torch's), each position's
    mask drawn by jax.random from its seed mixed with ``salt`` (the projection's; [B, T] where the
    positions belong to different projections, as a mixture of experts' sorted pairs do)."""
    B, T, D = x_BxTxD.shape
    seeds = mix_seeds(seeds_BxT, jnp.full(seeds_BxT.shape, salt, jnp.uint32)).reshape(-1)
    keep = jax.vmap(lambda s: jax.random.bernoulli(jax.random.key(s), 1.0 - rate, (D,)))(seeds).reshape(B, T, D)
    return jnp.where(keep, x_BxTxD / (1.0 - rate), jnp.zeros((), x_BxTxD.dtype)).astype(x_BxTxD.dtype)


def base_linear(layer: nnx.Linear, x: jax.Array, out_sharding: Any = None) -> jax.Array:
    """``nnx.Linear``'s output; with a kernel stored quantized (a frozen base under
    EngineConfig.base_quant: its stage passes the slot's bytes, pstar_jax.model.quant_bytes.QuantSlot)
    the matmul that dequantizes it one tile at a time, plus the bias."""
    kernel = layer.kernel.get_value() if hasattr(layer.kernel, "get_value") else layer.kernel.value
    if isinstance(kernel, QuantSlot):
        kernel = kernel.tensor()
    if not isinstance(kernel, (NF4Tensor, Int8Tensor)):
        return nnx.Linear.__call__(layer, x, out_sharding=out_sharding)
    y = quant_matmul(x, kernel)
    if layer.bias is not None:
        bias = layer.bias.get_value() if hasattr(layer.bias, "get_value") else layer.bias.value
        y = y + bias.astype(y.dtype)
    return y


class LoraLinear(nnx.Linear):
    """``nnx.Linear`` plus ``scale * lora(dropout(x))``, the adapter an ``nnx.LoRA`` at ``self.lora``.

    Dropout (rate ``spec.dropout``) needs ``dropout_seeds`` [B, T] (``position_seeds``); without
    them (evaluation, decoding) the adapter sees x unchanged. ``path`` (block-relative) salts
    the masks, so each projection draws its own."""

    def __init__(self, d_in: int, d_out: int, spec: LoraSpec, *, rngs: nnx.Rngs, path: str = "", **linear: Any):
        super().__init__(d_in, d_out, rngs=rngs, **linear)
        self.lora = nnx.LoRA(d_in, spec.rank, d_out, a_initializer=peft_a_init, rngs=nnx.Rngs(_peek(rngs)))
        self.lora_scale = spec.scale
        self.lora_dropout = float(spec.dropout)
        self.lora_salt = int(np.uint32(zlib.crc32(path.encode())))

    def __call__(self, x: jax.Array, out_sharding: Any = None, dropout_seeds: jax.Array | None = None) -> jax.Array:
        y = base_linear(self, x, out_sharding)
        if dropout_seeds is not None and self.lora_dropout > 0:
            x = dropout(x, dropout_seeds, self.lora_salt, self.lora_dropout)
        return y + (self.lora_scale * self.lora(x)).astype(y.dtype)


def project(layer: nnx.Module, x: jax.Array, dropout_seeds: jax.Array | None = None) -> jax.Array:
    """A projection's output: a LoraLinear gets the dropout seeds, a plain Linear only x. Marked
    as one a kept sequence tile may keep (pstar_jax.model.tiling.kept_projection)."""
    if isinstance(layer, LoraLinear):
        y = layer(x, dropout_seeds=dropout_seeds)
    else:
        y = base_linear(layer, x) if isinstance(layer, nnx.Linear) else layer(x)
    return kept_projection(y)


def adapter_names(names: Sequence[str]) -> list[str]:
    """The adapter tensors among ``names``, in their order."""
    return [n for n in names if is_adapter(n)]
