"""The Llama family's numerics as pure functions, Hugging Face's to the rounding: RMSNorm (Llama's
and Gemma's ``1 + weight``), RoPE tables and rotation (the global layers' and Gemma's sliding
layers' own), and attention over a KV cache for decoding. models/llama.py builds its modules
from them.

Shapes use nanodo's suffixes (see models/llama.py); decoding has T new tokens and S cached positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pstar_models.gpt import visible_TxS
from pstar_models.llama_config import LinearRopeScaling, LlamaConfig


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """HF's LlamaRMSNorm: normalise in float32, cast back to x's dtype, then multiply by the weight.
    ``offset`` (Gemma3RMSNorm): multiply by 1 + weight in float32, and cast back after that."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    shape = (1,) * (x.ndim - 1) + scale.shape
    if offset:
        return (y * (1.0 + scale.astype(jnp.float32).reshape(shape))).astype(x.dtype)
    return scale.astype(x.dtype).reshape(shape) * y.astype(x.dtype)


def rope_inv_freq(config: LlamaConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [K/2], float32, with the configured scaling (HF's formulas). ``local``:
    a sliding-window layer's (Gemma's rope_local_base_freq, never scaled)."""
    K = config.d_head
    theta = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, K, 2, dtype=np.float64) / K))
    s = None if local else config.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    if isinstance(s, LinearRopeScaling):  # positions divided by the factor
        return (inv_freq.astype(np.float32) / np.float32(s.factor)).astype(np.float32)
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


def rope_tables(config: LlamaConfig, length: int, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos_LxK and sin_LxK in float32: angles position * inv_freq, the halves repeated (HF's layout)."""
    return rope_tables_at(config, 0, length, local)


def rope_tables_of(config: LlamaConfig, positions_BxL: jax.Array, local: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
    """cos_BxLxK and sin_BxLxK at each row's own positions (packed rows restart at each example);
    for positions 0..L-1 the same float32 values as ``rope_tables``."""
    inv_freq = jnp.asarray(rope_inv_freq(config, local))
    angles_BxLxK2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq[None, None]
    angles_BxLxK = jnp.concatenate([angles_BxLxK2, angles_BxLxK2], axis=-1)
    return jnp.cos(angles_BxLxK), jnp.sin(angles_BxLxK)


def rope_tables_at(config: LlamaConfig, pos: jax.Array | int, length: int, local: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
    """``rope_tables`` for positions pos..pos+length-1 (the same float32 angles)."""
    positions = (pos + jnp.arange(length)).astype(jnp.float32)
    angles_LxK2 = positions[:, None] * jnp.asarray(rope_inv_freq(config, local))[None, :]
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
                     pos: jax.Array | int, scale: float | None = None, window: int | None = None) -> jax.Array:
    """pstar_jax.model.attention.causal_attention's numerics (llama's) for T new queries at positions
    pos.. over S cached keys and values; ``scale`` and ``window`` as there."""
    B, T, H, K = q_BxTxHxK.shape
    S, N = k_BxSxNxK.shape[1], k_BxSxNxK.shape[2]
    q_BxTxNxGxK = q_BxTxHxK.reshape(B, T, N, H // N, K)
    scale = K ** -0.5 if scale is None else scale
    scores_BxNxGxTxS = jnp.einsum("btngk,bsnk->bngts", q_BxTxNxGxK, k_BxSxNxK) * scale
    seen_TxS = visible_TxS(pos, T, S)
    if window is not None:
        seen_TxS = seen_TxS & (jnp.arange(S)[None, :] > pos + jnp.arange(T)[:, None] - window)
    scores32 = jnp.where(seen_TxS, scores_BxNxGxTxS.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(scores32, axis=-1).astype(q_BxTxHxK.dtype)
    return jnp.einsum("bngts,bsnk->btngk", probs, v_BxSxNxK).reshape(B, T, H, K)
