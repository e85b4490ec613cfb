"""A quantized frozen kernel as the bytes of its chunk slot, and back.

A frozen base stored as nf4 or int8 (EngineConfig.base_quant) keeps each quantized kernel in a
uint8 chunk, as one run of bytes: for nf4 the codes, the block scales (uint8 indices with double
quantization, else float32), the 256-block scales (float32) and the offset (float32); for int8
the codes, then one float32 absmax per output channel. The float32 parts are read back with a
bitcast, so every byte the stage sees is the byte quantization wrote, in every memory tier.

Layouts, so that a base quantized here equals the one bitsandbytes makes of the same Hugging
Face weights (QLoRA's ``Linear4bit``, LLM.int8's per-channel codes): nf4 quantizes the torch
weight [out, in], the transpose of the flax kernel [in, out], in blocks of 64 along ``in``;
int8 quantizes the flax kernel [in, out] per column, which is per output channel as well.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pstar_jax.config import ConfigError
from pstar_jax.model.quant import (SCALE_BLOCK, Int8Tensor, Kind, NF4Tensor, check_quantizable, dequantize_int8,
                                   dequantize_nf4, quantize_int8,
                                   quantize_nf4, quantized_bytes)

QUANT_BLOCK = 64  # nf4's block, as QLoRA and bitsandbytes' default
ROUTER = ".mlp.router.kernel"  # a mixture of experts' router (models/moe.py), kept unquantized


def stored_shape(kernel_shape: tuple[int, ...], kind: Kind) -> tuple[int, ...]:
    """The shape of the tensor ``kind`` quantizes for a flax kernel [in, out]: its transpose for nf4."""
    return tuple(reversed(kernel_shape)) if kind == "nf4" else tuple(kernel_shape)


def slot_bytes(kernel_shape: tuple[int, ...], kind: Kind, name: str = "tensor") -> int:
    """Bytes of a kernel's slot: quantized_bytes of its stored shape (a one-line ConfigError where
    ``kind`` cannot hold it, as for nf4 of a size that is not a multiple of the block)."""
    if len(kernel_shape) != 2:
        check_quantizable(tuple(kernel_shape), "int8", name=name)  # (refuses anything but a matrix)
    try:
        return quantized_bytes(stored_shape(tuple(kernel_shape), kind), kind, QUANT_BLOCK, True, name)
    except ConfigError as err:  # the one kernel cannot be left out of --base-quant: say what can change
        if kind != "nf4":
            raise
        raise ConfigError(f"{err} (EngineConfig.base_quant nf4 quantizes every frozen block kernel: use int8, "
                          "which has no block, or drop --base-quant)") from None


def quant_rule(kind: str | None, shapes: Mapping[str, Sequence[int]],
               trainable: Callable[[str], bool] | None) -> Callable[[str], str] | None:
    """What EngineConfig.base_quant stores quantized (chunks.build_layout's ``quant``): every
    frozen 2-D kernel of a block ("blocks.N.<projection>.kernel"), a mixture of experts' expert
    kernels each on its own (model/quant_grouped.py); norms, biases, embeddings, the head and a
    mixture of experts' router ("blocks.N.mlp.router.kernel") stay in the compute dtype. None
    without a kind. A kind with no frozen kernel to hold is a one-line ConfigError.

    The router: transformers 4.57's BitsAndBytesConfig would quantize it (an nn.Linear, ``gate``)
    unless ``llm_int8_skip_modules`` names it, as QLoRA recipes for MoE models do (Unsloth skips
    "gate"). Kept here: it is D x E, under 0.1% of a layer, and its logits choose the experts,
    so its rounding would change which experts a token meets, not only their outputs."""
    if not kind:
        return None
    chosen = {n for n, s in shapes.items() if n.startswith("blocks.") and n.endswith(".kernel") and len(s) == 2
              and not n.endswith(ROUTER) and trainable is not None and not trainable(n)}
    if not chosen:
        raise ConfigError(f"EngineConfig.base_quant {kind} quantizes a frozen base, but no block kernel is frozen: "
                          "train LoRA adapters (--lora-rank) or freeze the blocks (--freeze), or drop --base-quant")
    return lambda name: kind if name in chosen else ""


def _u8(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def to_bytes(kernel: Any, kind: Kind, name: str = "tensor") -> np.ndarray:
    """The slot's bytes of a kernel [in, out] (numpy or jax, any float dtype), quantized on the host."""
    if kind == "nf4":
        q = quantize_nf4(np.asarray(kernel).T, QUANT_BLOCK, True, name)
        parts = (q.codes, q.absmax, q.absmax_scale, q.offset)
    else:
        q = quantize_int8(np.asarray(kernel), name)
        parts = (q.codes, q.absmax)
    return np.concatenate([_u8(p) for p in parts])


def _f32(buf_u8: jax.Array, start: int, n: int) -> jax.Array:
    """n float32 values from the bytes [start, start + 4n) of ``buf_u8``."""
    return jax.lax.bitcast_convert_type(buf_u8[start:start + 4 * n].reshape(n, 4), jnp.float32)


def from_bytes(buf_u8: jax.Array, kernel_shape: tuple[int, ...], kind: Kind, dtype: Any) -> NF4Tensor | Int8Tensor:
    """The quantized tensor in a slot's bytes (a jax uint8 vector, of ``slot_bytes``), jittable:
    views and bitcasts, no arithmetic. ``dtype`` is what dequantization gives (the compute dtype)."""
    shape = stored_shape(tuple(kernel_shape), kind)
    numel = math.prod(shape)
    if kind == "int8":
        codes = jax.lax.bitcast_convert_type(buf_u8[:numel], jnp.int8).reshape(shape)
        return Int8Tensor(codes, _f32(buf_u8, numel, shape[-1]), shape, jnp.dtype(dtype))
    blocks = numel // QUANT_BLOCK
    scales = -(-blocks // SCALE_BLOCK)
    codes = buf_u8[:numel // 2]
    absmax = buf_u8[numel // 2:numel // 2 + blocks]
    at = numel // 2 + blocks
    return NF4Tensor(codes, absmax, _f32(buf_u8, at, scales), _f32(buf_u8, at + 4 * scales, 1).reshape(()), shape,
                     jnp.dtype(dtype), QUANT_BLOCK)


@dataclasses.dataclass(frozen=True)
class QuantSlot:
    """A quantized kernel as a stage reads it: its slot's bytes (uint8 [slot_bytes]), read as its
    quantized form where it is used (``tensor``). Kept as bytes until then so that a mixture of
    experts stacks a matrix's E kernels as one array of bytes (model/quant_grouped.stack_kernels):
    a block's 384 nf4 expert views (128 experts) compiled in 27 s stacked part by part, 4 s so."""
    buf: Any
    kernel_shape: tuple[int, ...]
    kind: str
    dtype: Any

    def tensor(self) -> NF4Tensor | Int8Tensor:
        return from_bytes(self.buf, self.kernel_shape, self.kind, self.dtype)


jax.tree_util.register_dataclass(QuantSlot, data_fields=["buf"], meta_fields=["kernel_shape", "kind", "dtype"])


def dequantized(buf_u8: np.ndarray, kernel_shape: tuple[int, ...], kind: Kind, dtype: Any) -> np.ndarray:
    """The kernel [in, out] a slot's bytes hold, dequantized in full into ``dtype`` (numpy): what
    exports and ``params()`` read, the values the stages compute with."""
    q = from_bytes(jnp.asarray(buf_u8), kernel_shape, kind, jnp.float32)
    whole = dequantize_nf4(q).T if kind == "nf4" else dequantize_int8(q)
    return np.asarray(whole.astype(dtype))


__all__ = ["QUANT_BLOCK", "QuantSlot", "quant_rule", "dequantized", "stored_shape", "slot_bytes", "to_bytes",
           "from_bytes"]
