"""Gated DeltaNet, Qwen3.5's linear-attention layer (transformers' ``Qwen3_5GatedDeltaNet``), in
Flax NNX: projections in, a short causal depthwise convolution over q, k and v with SiLU, the gated
delta rule (models/delta_rule.py) with per-head decay g = -exp(A_log) * softplus(a + dt_bias) and
rate beta = sigmoid(b), a gated RMSNorm (norm, times the weight, times silu(z)) and the projection
out. transformers' numerics: the rule and the norm in float32, cast back to the input dtype.

Packed rows: the convolution sees only its own example's earlier tokens and the rule restarts at
each example (``segment_ids``), so each example's output is its output alone.

Decoding keeps, per layer, the last ``conv_kernel - 1`` convolution inputs and the rule's state
[B, H, K, V] (``DeltaCache``): its size does not grow with the context.

Module layout (parameter names are a contract with the checkpoint I/O; transformers' in brackets):
``in_qkv.kernel`` [D, 2 Hk K + H V] (in_proj_qkv), ``in_z.kernel`` [D, H V] (in_proj_z),
``in_b.kernel`` and ``in_a.kernel`` [D, H] (in_proj_b, in_proj_a), ``conv.kernel`` [2 Hk K + H V, 1, C]
(conv1d.weight, as it is), ``dt_bias`` [H], ``A_log`` [H], ``norm.scale``
[V] (norm.weight, a plain multiplier starting at 1), ``out.kernel`` [H V, D] (out_proj).
Shapes: Hk key heads of width K, H value heads of width V, C the convolution's taps.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pstar_models.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from pstar_models.gpt import _linear
from pstar_models.limits import MAX_CONV_TAPS, check_sizes
from pstar_models.lora import LoraSpec, project


@dataclasses.dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's sizes (config.json's linear_* fields) and its norm's eps."""
    d_model: int
    n_key_heads: int  # linear_num_key_heads
    n_value_heads: int  # linear_num_value_heads
    d_key: int  # linear_key_head_dim
    d_value: int  # linear_value_head_dim
    conv_kernel: int = 4  # linear_conv_kernel_dim
    norm_eps: float = 1e-6  # rms_norm_eps

    def __post_init__(self) -> None:
        for field, key in (("d_model", "hidden_size"), ("n_key_heads", "linear_num_key_heads"),
                           ("n_value_heads", "linear_num_value_heads"), ("d_key", "linear_key_head_dim"),
                           ("d_value", "linear_value_head_dim"), ("conv_kernel", "linear_conv_kernel_dim")):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        # (the convolution's taps are added one by one in the trace)
        check_sizes("DeltaNetShape", {f: getattr(self, f) for f in ("d_model", "n_key_heads", "n_value_heads", "d_key",
                                                                     "d_value", "conv_kernel")},
                    {"conv_kernel": MAX_CONV_TAPS})
        if self.n_value_heads % self.n_key_heads:
            raise ValueError(f"linear_num_value_heads={self.n_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.n_key_heads}")
        if not self.norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.norm_eps!r}")

    def projections(self) -> dict[str, tuple[int, int]]:
        """The layer's projections that LoRA may target: block-relative path -> (in, out)."""
        D, HV = self.d_model, self.n_value_heads * self.d_value
        return {"linear_attn.in_qkv": (D, self.d_conv), "linear_attn.in_z": (D, HV),
                "linear_attn.in_b": (D, self.n_value_heads), "linear_attn.in_a": (D, self.n_value_heads),
                "linear_attn.out": (HV, D)}

    @property
    def d_conv(self) -> int:
        """The convolved channels: q and k (Hk K each), then v (H V)."""
        return 2 * self.n_key_heads * self.d_key + self.n_value_heads * self.d_value


class DeltaCache(NamedTuple):
    """One layer's decoding state: the last C - 1 convolution inputs and the rule's state."""
    conv_BxCxE: jax.Array  # E = DeltaNetShape.d_conv, in the compute dtype
    state_BxHxKxV: jax.Array  # float32


def init_delta_cache(shape: DeltaNetShape, batch: int, dtype: jnp.dtype) -> DeltaCache:
    """A layer's decoding state before any token: zeros (the convolution's left padding, S = 0)."""
    return DeltaCache(jnp.zeros((batch, shape.conv_kernel - 1, shape.d_conv), dtype),
                      jnp.zeros((batch, shape.n_value_heads, shape.d_key, shape.d_value), jnp.float32))


def causal_conv(x_BxLxE: jax.Array, kernel_CxE: jax.Array, segment_ids_BxL: jax.Array | None) -> jax.Array:
    """transformers' causal_conv1d_fn with SiLU: out_t = silu(sum_j w_j x_{t-C+1+j}), each tap that
    reaches before the row or into another example reading zero; in the kernel's dtype."""
    C = kernel_CxE.shape[0]
    L = x_BxLxE.shape[1]
    x = x_BxLxE.astype(kernel_CxE.dtype)
    padded = jnp.pad(x, ((0, 0), (C - 1, 0), (0, 0)))
    out = jnp.zeros_like(x)
    for j in range(C):  # tap j reads C - 1 - j tokens back
        tap = padded[:, j:j + L]
        if segment_ids_BxL is not None and j < C - 1:
            back = C - 1 - j
            prev_BxL = jnp.pad(segment_ids_BxL, ((0, 0), (back, 0)), constant_values=-1)[:, :L]
            tap = jnp.where((prev_BxL == segment_ids_BxL)[..., None], tap, 0)
        out = out + tap * kernel_CxE[j][None, None]
    return jax.nn.silu(out).astype(x_BxLxE.dtype)


class CausalConv(nnx.Module):
    """The depthwise convolution's taps, ``kernel`` [E, 1, C] in torch's Conv1d layout, so that the
    checkpoint's tensor loads as it is (transformers' default init: kaiming uniform over a fan-in of C)."""

    def __init__(self, taps: int, channels: int, *, rngs: nnx.Rngs):
        bound = taps ** -0.5
        self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (channels, 1, taps), jnp.float32, -bound, bound))

    def __call__(self, x_BxLxE: jax.Array, segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        return causal_conv(x_BxLxE, self.kernel[:, 0, :].T, segment_ids_BxL)


class GatedRMSNorm(nnx.Module):
    """transformers' Qwen3_5RMSNormGated over each head's V values: normalise in float32, cast back,
    times the weight (``scale``, starting at 1), times silu(z) in float32, cast back."""

    def __init__(self, d: int, eps: float):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        scale = self.scale[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return (scale * y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """``__call__(x_BxLxD, segment_ids_BxL)`` over whole rows, ``decode`` over T new tokens."""

    def __init__(self, shape: DeltaNetShape, out_std: float, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        self.shape = s = shape
        D, H = s.d_model, s.n_value_heads
        self.in_qkv = _linear(D, s.d_conv, rngs, bias=False, lora=lora, path="linear_attn.in_qkv")
        self.in_z = _linear(D, H * s.d_value, rngs, bias=False, lora=lora, path="linear_attn.in_z")
        self.in_b = _linear(D, H, rngs, bias=False, lora=lora, path="linear_attn.in_b")
        self.in_a = _linear(D, H, rngs, bias=False, lora=lora, path="linear_attn.in_a")
        self.conv = CausalConv(s.conv_kernel, s.d_conv, rngs=rngs)
        # transformers' init: dt_bias ones, A uniform in [0.01, 16] (kept off 0, so A_log is finite).
        self.dt_bias = nnx.Param(jnp.ones((H,), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (H,), jnp.float32, 0.01, 16.0)))
        self.norm = GatedRMSNorm(s.d_value, s.norm_eps)
        self.out = _linear(H * s.d_value, D, rngs, out_std, bias=False, lora=lora, path="linear_attn.out")

    def _inputs(self, x_BxLxD: jax.Array, mixed_BxLxE: jax.Array, seeds: jax.Array | None):
        """q, k, v in heads (from the convolved channels), g and beta, in transformers' dtypes."""
        s = self.shape
        B, L, _ = x_BxLxD.shape
        Kq = s.n_key_heads * s.d_key
        q = mixed_BxLxE[..., :Kq].reshape(B, L, s.n_key_heads, s.d_key)
        k = mixed_BxLxE[..., Kq:2 * Kq].reshape(B, L, s.n_key_heads, s.d_key)
        v = mixed_BxLxE[..., 2 * Kq:].reshape(B, L, s.n_value_heads, s.d_value)
        beta = jax.nn.sigmoid(project(self.in_b, x_BxLxD, seeds))
        a32 = project(self.in_a, x_BxLxD, seeds).astype(jnp.float32)
        A_1x1xH, dt_bias_1x1xH = (p[...].astype(jnp.float32)[None, None] for p in (self.A_log, self.dt_bias))
        g = -jnp.exp(A_1x1xH) * jax.nn.softplus(a32 + dt_bias_1x1xH)
        return q, k, v, g, beta

    def _output(self, x_BxLxD: jax.Array, core_BxLxHxV: jax.Array, seeds: jax.Array | None) -> jax.Array:
        s = self.shape
        B, L, _ = x_BxLxD.shape
        z = project(self.in_z, x_BxLxD, seeds).reshape(B, L, s.n_value_heads, s.d_value)
        normed = self.norm(core_BxLxHxV, z)
        return project(self.out, normed.reshape(B, L, -1), seeds)

    def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
                 dropout_seeds_BxL: jax.Array | None = None) -> jax.Array:
        seeds = dropout_seeds_BxL
        mixed = self.conv(project(self.in_qkv, x_BxLxD, seeds), segment_ids_BxL)
        core, _ = chunk_gated_delta_rule(*self._inputs(x_BxLxD, mixed, seeds), segment_ids_BxL)
        return self._output(x_BxLxD, core, seeds)

    def decode(self, x_BxTxD: jax.Array, cache: DeltaCache) -> tuple[jax.Array, DeltaCache]:
        """T new tokens after the cached ones: the convolution over the kept inputs and the new, then
        the rule from the kept state (one recurrent step per token for T = 1, chunked otherwise, as
        transformers decodes)."""
        T = x_BxTxD.shape[1]
        C = self.shape.conv_kernel
        window = jnp.concatenate([cache.conv_BxCxE, project(self.in_qkv, x_BxTxD).astype(cache.conv_BxCxE.dtype)], 1)
        mixed = self.conv(window)[:, C - 1:]
        inputs = self._inputs(x_BxTxD, mixed.astype(x_BxTxD.dtype), None)
        if T == 1:
            core, state = recurrent_gated_delta_rule(*inputs, cache.state_BxHxKxV)
        else:
            core, state = chunk_gated_delta_rule(*inputs, state_BxHxKxV=cache.state_BxHxKxV)
        return self._output(x_BxTxD, core, None), DeltaCache(window[:, T:], state)
