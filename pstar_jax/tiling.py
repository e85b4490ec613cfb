"""Sequence tiles: run a function over tiles of positions so its intermediates are never whole.

A tile body runs under ``jax.checkpoint`` inside ``lax.map``: the forward keeps only each tile's
inputs, the backward recomputes one tile at a time. Tensors every tile reads (a layer's weights,
attention's keys and values) are closed-over constants of the loop, whose gradients the loop's
transpose adds up tile by tile in the constant's own dtype; in bf16 that is one rounding per
tile. ``map_tiles`` therefore hands them in as float32 copies and casts them back inside the
body (exact), so their gradients add up in float32 and are rounded once at the end.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp


TILE_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class TileBudget:
    """The largest intermediate one tile may hold, per kind, in bytes: the head's float32 logits
    (pstar_jax.loss), attention's float32 scores (pstar_jax.attention) and the MLP's hidden
    activations. A sequence whose whole intermediate fits runs as one tile, the plain call; the
    models take one of these so that tests can force many tiles at tiny shapes."""
    logits_bytes: int = TILE_BYTES
    scores_bytes: int = TILE_BYTES
    mlp_bytes: int = TILE_BYTES

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TileBudget.{field.name} must be a positive number of bytes, got {value!r}")


def split_tiles(n: int, tile: int) -> tuple[int, int]:
    """(number of tiles, size of each) covering n positions with tiles of at most ``tile``,
    equal in size so that the padding is below one position per tile."""
    if n <= 0 or tile <= 0:
        raise ValueError(f"split_tiles needs positive n and tile, got {n} and {tile}")
    n_tiles = -(-n // tile)
    return n_tiles, -(-n // n_tiles)


def rows_within(n: int, row_bytes: int, tile_bytes: int) -> int:
    """Rows per tile so that a tile of ``row_bytes`` rows fits ``tile_bytes``: at least 1, at most
    n, a multiple of 8 when it can be (for the matmuls)."""
    if n <= 0 or row_bytes <= 0 or tile_bytes <= 0:
        raise ValueError(f"rows_within needs positive n, row_bytes, tile_bytes; got {n}, {row_bytes}, {tile_bytes}")
    rows = max(1, tile_bytes // row_bytes)
    return min(n, rows - rows % 8 if rows >= 8 else rows)


def to_tiles(x: jax.Array, axis: int, n_tiles: int, tile: int, pad_value: Any = 0) -> jax.Array:
    """x with ``axis`` padded to n_tiles * tile and split: the tiles become a new leading axis."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n_tiles * tile - x.shape[axis])
    x = jnp.pad(x, pad, constant_values=pad_value)
    x = x.reshape(x.shape[:axis] + (n_tiles, tile) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def from_tiles(y: jax.Array, axis: int, n: int) -> jax.Array:
    """The inverse of ``to_tiles`` for a per-position output: tiles back along ``axis``, cut to n."""
    y = jnp.moveaxis(y, 0, axis)
    y = y.reshape(y.shape[:axis] + (y.shape[axis] * y.shape[axis + 1],) + y.shape[axis + 2:])
    return jax.lax.slice_in_dim(y, 0, n, axis=axis)


def _widen(x: Any) -> Any:
    """float32 for floating types narrower than it: their gradients then add up in float32."""
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return x.astype(jnp.float32)
    return x


def map_tiles(body: Callable[[Any, Any], Any], consts: Any, xs: Any) -> Any:
    """``body(consts, x)`` for each tile x of ``xs`` (a pytree with the tiles as leading axis),
    one tile's intermediates alive at a time in the forward and the backward. A single tile is
    a plain call: the whole sequence fits, and nothing is recomputed."""
    if jax.tree.leaves(xs)[0].shape[0] == 1:  # one tile: nothing to save, so no recomputation
        out = body(consts, jax.tree.map(lambda x: x[0], xs))
        return jax.tree.map(lambda y: y[None], out)
    dtypes = jax.tree.map(lambda c: c.dtype, consts)
    wide = jax.tree.map(_widen, consts)

    @jax.checkpoint
    def one(wide_consts: Any, x: Any) -> Any:
        narrow = jax.tree.map(lambda c, d: c.astype(d), wide_consts, dtypes)
        return body(narrow, x)
    return jax.lax.map(lambda x: one(wide, x), xs)


def tiled_over_sequence(fn: Callable[..., Any], x_BxLxD: Any, *, tile: int, params: Any = None) -> Any:
    """``fn`` applied to tiles of ``tile`` positions of x_BxLxD, concatenated: equal to
    ``fn(x_BxLxD)`` for a position-wise fn (an MLP), whose tokens x d_ff intermediate then
    exists one tile at a time. With ``params`` (a pytree of the weights fn reads) fn is called
    ``fn(params, x_tile)`` and their gradients add up in float32 across tiles; weights fn
    closes over instead add up in their own dtype. L need not be a multiple of tile (the last
    tile is zero-padded; fn must be finite on zeros). x may be a pytree of [B, L, ...] arrays
    (per-position side inputs beside the activations), tiled alike, and fn may return a pytree
    of [B, tile, ...] arrays (several per-position outputs), each put back to [B, L, ...]."""
    B, L = jax.tree.leaves(x_BxLxD)[0].shape[:2]
    n_tiles, size = split_tiles(L, min(tile, L))
    xs = jax.tree.map(lambda x: to_tiles(x, 1, n_tiles, size), x_BxLxD)
    if params is None:
        ys = map_tiles(lambda _, x: fn(x), (), xs)
    else:
        ys = map_tiles(fn, params, xs)
    return jax.tree.map(lambda y: from_tiles(y, 1, L), ys)


def mlp_tile(batch: int, length: int, d_hidden: int, tile_bytes: int) -> int:
    """Positions per MLP tile so that one tile's float32-wide hidden activations (B x tile x F)
    fit ``tile_bytes``."""
    return rows_within(length, 4 * batch * d_hidden, tile_bytes)
