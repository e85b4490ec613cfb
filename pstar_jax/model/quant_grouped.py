"""The grouped matmul of a mixture of experts over quantized frozen expert kernels.

Each expert's kernel is stored as any quantized kernel is (model/quant.py: nf4 of the torch weight
[out, in], int8 of the kernel [in, out]), one per expert; a stage stacks the E of one matrix into
one array of their slots' bytes, [E, slot bytes] (``stack_kernels``), 1/4 (nf4) or 1/2 (int8)
of the bytes a bf16 stack would copy, read as an expert's quantized form inside the loop.

``grouped_quant_matmul`` multiplies tiles of rows, each tile one expert's (models/moe.py's
``grouped_matmul``), by their experts' kernels dequantized on the device a few tiles at a time:
a loop over groups of ``group`` tiles, inside it over ``tile`` output channels, each step
dequantizing [group, in, tile] (only those experts' codes and scales are read), multiplying and
dropping it. So the dequantized working memory is ``grouped_tile_bytes``, bounded by
QUANT_TILE_BYTES as ``quant_matmul``'s is (one expert's matrix at least, in output-channel tiles
when one is bigger), never the whole [E, in, out]; the backward recomputes the tiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pstar_jax.model import quant
from pstar_jax.model.quant import Int8Tensor, Kind, NF4Tensor, in_out, kind_of, over_tiles, tile_weights
from pstar_jax.model.quant_bytes import QUANT_BLOCK, QuantSlot, stored_shape


def is_quantized(w: Any) -> bool:
    return isinstance(w, (NF4Tensor, Int8Tensor, QuantSlot))


def stack_kernels(kernels: Sequence[Any]) -> Any:
    """E kernels of one shape as one: [E, *shape]; a stage's quantized ones (QuantSlots, a frozen
    base under EngineConfig.base_quant) as one QuantSlot of their bytes [E, slot bytes], read
    one expert at a time inside the grouped matmul's loop, so that only those bytes are copied;
    quantized tensors as one whose arrays lead with the expert axis."""
    if isinstance(kernels[0], QuantSlot):
        return dataclasses.replace(kernels[0], buf=jnp.stack([k.buf for k in kernels]))
    if not is_quantized(kernels[0]):
        return jnp.stack(kernels)
    return jax.tree.map(lambda *parts: jnp.stack(parts), *kernels)


def _form(q_E: Any) -> tuple[tuple[int, ...], Kind, int]:
    """(shape, kind, nf4 block) of one expert's quantized kernel in a stack."""
    if isinstance(q_E, QuantSlot):
        return stored_shape(q_E.kernel_shape, q_E.kind), q_E.kind, QUANT_BLOCK
    kind = kind_of(q_E)
    return q_E.shape, kind, q_E.block if kind == "nf4" else QUANT_BLOCK


def grouped_tiles(q_shape: tuple[int, ...], kind: Kind, n_tiles: int, dtype: Any = jnp.bfloat16,
                  block: int = 64) -> tuple[int, int]:
    """(tiles of rows per step, output channels per step) of ``grouped_quant_matmul``: as many
    whole expert matrices as QUANT_TILE_BYTES holds (at most ``n_tiles``), else one expert in
    ``quant_tile``'s output-channel tiles."""
    _, n_out = in_out(q_shape, kind)
    whole = quant.quant_tile_bytes(q_shape, kind, n_out, dtype, block)
    if whole <= quant.QUANT_TILE_BYTES:
        return max(1, min(n_tiles, quant.QUANT_TILE_BYTES // whole)), n_out
    return 1, quant.quant_tile(q_shape, kind, dtype, block)


def grouped_tile_bytes(q_shape: tuple[int, ...], kind: Kind, n_tiles: int, dtype: Any = jnp.bfloat16,
                       block: int = 64) -> int:
    """Device working bytes of one step's dequantized experts: ``group`` times ``quant_tile_bytes``
    of ``tile`` channels (the rows' products are activations, counted with them)."""
    group, tile = grouped_tiles(q_shape, kind, n_tiles, dtype, block)
    return group * quant.quant_tile_bytes(q_shape, kind, tile, dtype, block)


def _experts_tile(q_E: Any, experts_G: jax.Array, o0: Any, n: int, dtype: Any) -> jax.Array:
    """Output channels [o0, o0 + n) of the kernels of experts ``experts_G``, dequantized: [G, in, n]."""
    def one(e):
        q = jax.tree.map(lambda a: a[e], q_E)
        return tile_weights(q.tensor() if isinstance(q, QuantSlot) else q, o0, n, dtype)
    return jax.vmap(one)(experts_G)


def _slice(x: jax.Array, start: Any, size: int, axis: int = 0) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _each_step(q_E: Any, expert_T: jax.Array, group: int, tile: int, dtype: Any, step: Any, carry: Any) -> Any:
    """``carry = step(t0, g, o0, n, w_GxINxN, carry)`` for each group of ``group`` row tiles (the
    last may be smaller) and each ``tile`` of output channels, w those tiles' experts' channels
    [o0, o0 + n) dequantized into ``dtype``: one step's tiles live at a time."""
    shape, kind, _ = _form(q_E)
    _, n_out = in_out(shape, kind)

    def tiles(t0, g, carry):
        experts_G = _slice(expert_T, t0, g)
        return over_tiles(n_out, tile, lambda o0, n, c: step(t0, g, o0, n, _experts_tile(q_E, experts_G, o0, n,
                                                                                             dtype), c), carry)
    return over_tiles(expert_T.shape[0], group, tiles, carry)


# As quant_matmul's: a custom_vjp, so that autodiff keeps no dequantized tile and the frozen
# kernels get no cotangent; group, tile and x's dtype are static.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped(group: int, tile: int, x_dtype: np.dtype, x_TxRxD: jax.Array, q_E: Any, expert_T: jax.Array) -> jax.Array:
    T, R, _ = x_TxRxD.shape

    def step(t0, g, o0, n, w_GxDxN, y):
        y_t = jnp.einsum("trd,tdi->tri", _slice(x_TxRxD, t0, g), w_GxDxN)
        return jax.lax.dynamic_update_slice(y, y_t.astype(x_dtype), (t0, 0, o0))
    n_out = in_out(*_form(q_E)[:2])[1]
    return _each_step(q_E, expert_T, group, tile, x_dtype, step, jnp.zeros((T, R, n_out), x_dtype))


def _grouped_fwd(group, tile, x_dtype, x_TxRxD, q_E, expert_T):
    return _grouped(group, tile, x_dtype, x_TxRxD, q_E, expert_T), (q_E, expert_T)  # no dequantized tile kept


def _grouped_bwd(group, tile, x_dtype, residuals, g_TxRxI):
    q_E, expert_T = residuals
    T, R, _ = g_TxRxI.shape
    n_in = in_out(*_form(q_E)[:2])[0]

    def step(t0, g, o0, n, w_GxDxN, dx):  # the tiles recomputed, as in the forward
        g_t = jax.lax.dynamic_slice(g_TxRxI, (t0, 0, o0), (g, R, n)).astype(x_dtype)
        dx_g = jax.lax.dynamic_slice(dx, (t0, 0, 0), (g, R, n_in))
        dx_g = dx_g + jnp.einsum("tri,tdi->trd", g_t, w_GxDxN, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice(dx, dx_g, (t0, 0, 0))
    dx = _each_step(q_E, expert_T, group, tile, x_dtype, step, jnp.zeros((T, R, n_in), jnp.float32))
    return dx.astype(x_dtype), None, None  # frozen kernels, integer experts: no cotangents


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_quant_matmul(x_TxRxD: jax.Array, q_E: Any, expert_T: jax.Array) -> jax.Array:
    """Tile t of rows times expert ``expert_T[t]``'s kernel: [T, R, out] in x's dtype, for a
    stack of quantized kernels ``q_E`` (``stack_kernels``). The experts are dequantized into x's
    dtype ``grouped_tiles`` at a time and multiplied as jnp.einsum does; differentiable in x only,
    its backward summing each channel tile's ``g @ W.T`` in float32, cast once."""
    shape, kind, block = _form(q_E)
    n_in, _ = in_out(shape, kind)
    if x_TxRxD.ndim != 3 or x_TxRxD.shape[-1] != n_in:
        raise ValueError(f"grouped_quant_matmul of rows {x_TxRxD.shape} with expert kernels {shape} needs "
                         f"[tiles, rows, {n_in}]")
    x_dtype = jnp.dtype(x_TxRxD.dtype)
    group, tile = grouped_tiles(shape, kind, x_TxRxD.shape[0], x_dtype, block)
    return _grouped(group, tile, x_dtype, x_TxRxD, q_E, expert_T)


__all__ = ["is_quantized", "stack_kernels", "grouped_tiles", "grouped_tile_bytes", "grouped_quant_matmul"]
