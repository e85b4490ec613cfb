"""Quantized frozen kernels: NF4 (QLoRA's 4-bit NormalFloat) and int8 per output channel.

A frozen base tensor can be stored quantized in its chunks and dequantized on the device a tile
at a time inside the stage that reads it, never whole. Quantization runs once on the host
(numpy, at load); dequantization is jnp and jittable, its tile start may be traced (a loop index).

NF4 follows bitsandbytes (``quantize_4bit(quant_type="nf4", blocksize=64)``) value for value:
the tensor, flattened row-major, is cut into blocks of 64; each block keeps its absmax in float32
and each value the index of the nearest of the 16 ``NF4_CODE`` values to ``x * (1 / absmax)``
(a tie goes to the lower one); two indices share a byte, the first in the high nibble. With
double quantization (bitsandbytes' ``compress_statistics``, QLoRA's "double quantization") the
block absmaxes lose their mean (``offset``) and are stored as 8-bit indices into
``DYNAMIC_CODE`` in blocks of 256, each such block with a float32 absmax of its own:
0.5 + 1/64 + 4/(64*256) bytes a value (4.127 bits) plus 4 bytes for the offset.

int8 follows bitsandbytes' ``int8_vectorwise_quant`` (LLM.int8 without outliers) with the
output channel on the last axis, the layout of an ``nnx.Linear`` kernel [in, out]:
``codes = round(w * (127 / absmax))`` with one float32 absmax per column.

A tile is ``n_rows`` rows (and optionally ``n_cols`` columns) of the tensor viewed as the matrix
[prod(shape[:-1]), shape[-1]]; its NF4 blocks must be whole, which the functions check.

``quant_matmul`` multiplies activations by a quantized frozen kernel one output tile at a time:
each step dequantizes one tile into the activations' dtype, multiplies and drops it, so a stage
holds one tile (``quant_tile_bytes``), never the whole kernel, and its backward recomputes the
tiles rather than keeping them. Its nf4 kernel is the torch weight [out, in], the layout
bitsandbytes quantizes (blocks along ``in``); its int8 kernel is the flax one [in, out].
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pstar_jax.config import ConfigError

Kind = Literal["nf4", "int8"]

NF4_BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' valid 4-bit block sizes
SCALE_BLOCK = 256  # the block of the second quantization (bitsandbytes' compress_statistics)
_INV_127 = np.float32(7.874015718698502e-3)  # bitsandbytes' int8_vectorwise_dequant constant

# The 16 NF4 values: QLoRA's appendix E, bitsandbytes' get_4bit_type("nf4"), exactly.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)

# bitsandbytes' signed dynamic 8-bit map (create_dynamic_map()): 127 positive values, their
# negatives, 0 and 1. Its float32 bits are written out because create_dynamic_map builds them
# with torch.linspace, whose vectorised rounding no formula here reproduces exactly; each value
# is 10**(e-6) * the midpoint of two neighbours of linspace(0.1, 1, 2**e + 1), e = 0..6.
_DYNAMIC_POSITIVE_BITS = (
    "3513a3b7365a1a94370205ff37b2420638378034388aefb338ba1f4b3923d70b398ce70539c7e2833a016f013a1eecc1"
    "3a3c6a803a59e83e3a7765ff3aa7ef9d3af1a9fc3b1db22d3b428f5c3b676c8a3b8624dd3b9893743bab020d3bbd70a4"
    "3bcfdf3b3be24dd33bf4bc6a3c0395813c0ccccd3c1604183c1f3b643c3ae1483c68f5c33c8b851f3ca28f5d3cb9999a"
    "3cd0a3d73ce7ae153cfeb8523d0ae1483d1666673d21eb853d2d70a33d38f5c33d447ae13d5000003d5b851f3d670a3d"
    "3d728f5d3d7e147b3d84cccd3d8a8f5d3d9051eb3d96147b3d9bd70a3da1999a3da75c2a3dad1eb83db2e1483db8a3d7"
    "3dbe66673dc428f73dc9eb853ddb33343df800003e0a66663e18cccd3e2733333e35999a3e4400003e5266663e60cccd"
    "3e6f33333e7d99993e8600003e8d33343e9466663e9b999a3ea2cccc3eaa00003eb133333eb866663ebf999a3ec6cccc"
    "3ece00003ed533333edc66663ee3999a3eeacccc3ef200003ef933323f0033333f03cccc3f0766663f0b00003f0e999a"
    "3f1233343f15cccd3f1966663f1d00003f20999a3f2433343f27cccd3f2b66663f2f00003f32999a3f3633343f39cccd"
    "3f3d66663f4100003f44999a3f4833333f4bcccd3f4f66663f5300003f56999a3f5a33333f5dcccd3f6166663f650000"
    "3f68999a3f6c33333f6fcccd3f7366663f7700003f7a999a3f7e3333")
_POS = np.array([int(_DYNAMIC_POSITIVE_BITS[i:i + 8], 16) for i in range(0, 1016, 8)], np.uint32).view(np.float32)
DYNAMIC_CODE = np.concatenate([-_POS[::-1], [0.0], _POS, [1.0]]).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class NF4Tensor:
    """An NF4-quantized tensor. ``codes`` uint8 [numel // 2]; ``absmax`` float32 [numel // block],
    or with double quantization uint8 indices into DYNAMIC_CODE, ``absmax_scale`` float32
    [ceil(blocks / 256)] and ``offset`` float32 [] (None without)."""
    codes: Any
    absmax: Any
    absmax_scale: Any
    offset: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    block: int

    @property
    def size_bytes(self) -> int:
        return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self))


@dataclasses.dataclass(frozen=True)
class Int8Tensor:
    """An int8 tensor: ``codes`` int8 [*shape], ``absmax`` float32 [shape[-1]], one per column."""
    codes: Any
    absmax: Any
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size_bytes(self) -> int:
        return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self))


jax.tree_util.register_dataclass(NF4Tensor, data_fields=["codes", "absmax", "absmax_scale", "offset"],
                                 meta_fields=["shape", "dtype", "block"])
jax.tree_util.register_dataclass(Int8Tensor, data_fields=["codes", "absmax"], meta_fields=["shape", "dtype"])


# --- sizes, checked before anything is allocated ------------------------------------------------

def check_quantizable(shape: tuple[int, ...], kind: Kind, block: int = 64, name: str = "tensor") -> None:
    """Raise a one-line ConfigError when ``kind`` cannot store a tensor of ``shape``."""
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if kind == "nf4":
        if block not in NF4_BLOCKS:
            raise ConfigError(f"nf4 block {block} is not one of bitsandbytes' block sizes {NF4_BLOCKS}")
        if numel == 0 or numel % block:
            raise ConfigError(f"nf4 quantizes whole blocks of {block} values, but {name} {shape} has {numel} "
                              f"values ({numel % block} past the last whole block): leave it unquantized")
    elif kind == "int8":
        if len(shape) < 2 or numel == 0:
            raise ConfigError(f"int8 per output channel needs a kernel of 2 or more axes, but {name} has "
                              f"shape {shape}: leave it unquantized")
    else:
        raise ConfigError(f"unknown quantization {kind!r}: use 'nf4' or 'int8'")


def quantized_bytes(shape: tuple[int, ...], kind: Kind, block: int = 64, double_quant: bool = True,
                    name: str = "tensor") -> int:
    """The exact bytes a tensor of ``shape`` takes stored as ``kind`` (``size_bytes`` of its
    quantized form), for the planner. nf4 with double quantization: numel/2 + blocks +
    4 * ceil(blocks / 256) + 4; without: numel/2 + 4 * blocks; int8: numel + 4 * shape[-1]."""
    check_quantizable(shape, kind, block, name)
    numel = math.prod(shape)
    if kind == "int8":
        return numel + 4 * int(shape[-1])
    blocks = numel // block
    scales = blocks + 4 * -(-blocks // SCALE_BLOCK) + 4 if double_quant else 4 * blocks
    return numel // 2 + scales


def dequant_tile_bytes(n_rows: int, n_cols: int, kind: Kind, dtype: Any = jnp.bfloat16, block: int = 64) -> int:
    """Device working bytes of dequantizing one [n_rows, n_cols] tile into ``dtype``: the tile,
    plus for nf4 8 bytes a block (its float32 scale and the product before the offset is added)
    and for int8 its columns' float32 scales. XLA fuses the unpacking, lookup, multiply and cast
    into the one loop that writes the tile (the tests check this bound against the compiled
    function's memory analysis); the codes it reads are the chunk's, in ``quantized_bytes``."""
    tile = n_rows * n_cols * jnp.dtype(dtype).itemsize
    return tile + (8 * -(-n_rows * n_cols // block) if kind == "nf4" else 4 * n_cols)


# --- host-side quantization (numpy, once at load) ---------------------------------------------------

def _host_f32(w: Any) -> tuple[np.ndarray, np.dtype]:
    dtype = jnp.dtype(w.dtype)
    return np.asarray(w).astype(np.float32), dtype


def _nearest(values: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Index of the nearest ``code`` value (sorted), a tie to the lower: bitsandbytes' bucketize
    on float32 midpoints (its reference backend and the 4-bit CUDA rule)."""
    midpoints = (code[:-1] + code[1:]) / np.float32(2)
    return np.searchsorted(midpoints, values, side="left").astype(np.uint8)


def _absmax_scaled(x_BxK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row absmax and the rows times its float32 reciprocal, clipped to [-1, 1]: the order of
    operations of bitsandbytes (a multiply by 1/absmax, not a division); an all-zero row keeps
    absmax 0 and maps to 0."""
    absmax = np.abs(x_BxK).max(axis=-1)
    inv = np.float32(1) / np.maximum(absmax, np.float32(1e-38))
    return absmax, np.clip(x_BxK * inv[:, None], np.float32(-1), np.float32(1))


def quantize_nf4(w: Any, block: int = 64, double_quant: bool = True, name: str = "tensor") -> NF4Tensor:
    """NF4 of ``w`` (numpy or a JAX array, float16/bfloat16/float32), bitsandbytes' layout."""
    check_quantizable(tuple(w.shape), "nf4", block, name)
    x, dtype = _host_f32(w)
    absmax, scaled = _absmax_scaled(x.reshape(-1, block))
    idx = _nearest(scaled.reshape(-1), NF4_CODE)
    codes = (idx[0::2] << 4) | idx[1::2]
    if not double_quant:
        return NF4Tensor(jnp.asarray(codes), jnp.asarray(absmax), None, None, tuple(w.shape), dtype, block)
    # The mean in float64, rounded once: bitsandbytes takes torch's float32 mean, whose
    # summation order (and so its last bit) depends on the device and the vector width.
    offset = np.float32(absmax.astype(np.float64).mean())
    centred = absmax - offset
    n = centred.size
    padded = np.zeros(-(-n // SCALE_BLOCK) * SCALE_BLOCK, np.float32)
    padded[:n] = centred  # zeros do not change a block's absmax; the last block may be partial
    scale, scaled_c = _absmax_scaled(padded.reshape(-1, SCALE_BLOCK))
    scale_codes = _nearest(scaled_c.reshape(-1)[:n], DYNAMIC_CODE)
    return NF4Tensor(jnp.asarray(codes), jnp.asarray(scale_codes), jnp.asarray(scale), jnp.asarray(offset),
                     tuple(w.shape), dtype, block)


def quantize_int8(w: Any, name: str = "tensor") -> Int8Tensor:
    """int8 of ``w`` per output channel (the last axis), absmax symmetric: bitsandbytes'
    ``round(w * (127 / absmax))`` (half to even). A column of zeros keeps codes 0."""
    check_quantizable(tuple(w.shape), "int8", name=name)
    x, dtype = _host_f32(w)
    m = x.reshape(-1, x.shape[-1])
    absmax = np.abs(m).max(axis=0)
    with np.errstate(divide="ignore"):
        scale = np.where(absmax > 0, np.float32(127) / absmax, np.float32(0)).astype(np.float32)
    codes = np.rint(m * scale).astype(np.int8).reshape(x.shape)
    return Int8Tensor(jnp.asarray(codes), jnp.asarray(absmax), tuple(w.shape), dtype)


# --- device-side dequantization (jnp, jittable) -------------------------------------------------------

def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.prod(shape[:-1]), shape[-1]


def _check_tile(q: NF4Tensor | Int8Tensor, row0: Any, n_rows: int, col0: Any, n_cols: int, unit: int) -> None:
    """Static checks of a tile of the [R, C] view: inside it, and for nf4 made of whole blocks
    (``unit`` = its block; 1 for int8). A traced row0 or col0 is the caller's to keep aligned."""
    R, C = _matrix(q.shape)
    static = isinstance(row0, (int, np.integer))
    col_static = isinstance(col0, (int, np.integer))
    if not (0 < n_rows <= R and 0 < n_cols <= C and (not col_static or 0 <= col0 <= C - n_cols)):
        raise ValueError(f"tile of {n_rows} rows x {n_cols} columns at column {col0} is outside {q.shape}")
    if static and not 0 <= row0 <= R - n_rows:
        raise ValueError(f"tile rows [{row0}, {row0 + n_rows}) are outside the {R} rows of {q.shape}")
    if unit == 1:
        return
    if n_cols < C and (C % unit or (col_static and col0 % unit) or n_cols % unit):
        raise ValueError(f"an nf4 column tile needs columns ({C}), its start ({col0}) and width ({n_cols}) "
                         f"in whole blocks of {unit}")
    if n_cols == C and ((n_rows * C) % unit or (static and (row0 * C) % unit)):
        raise ValueError(f"nf4 tile rows [{row0}, +{n_rows}) of {C} values each do not start and end on "
                         f"blocks of {unit}")


def _block_scales(q: NF4Tensor, absmax_B: jax.Array, block_ids_B: jax.Array) -> jax.Array:
    """float32 absmax of each block: stored, or DYNAMIC_CODE[index] * its 256-block's scale plus
    the offset, two roundings in bitsandbytes' order (dequantize_blockwise, then += offset)."""
    if q.absmax_scale is None:
        return absmax_B
    scale_B = jnp.asarray(DYNAMIC_CODE)[absmax_B] * q.absmax_scale[block_ids_B // SCALE_BLOCK]
    # XLA contracts a multiply feeding an add into one fma (one rounding, not bitsandbytes' two);
    # this select, the identity on every value, stands between them and XLA cannot fold it.
    scale_B = jnp.where(jnp.isnan(scale_B), jnp.float32(jnp.nan), scale_B)
    return scale_B + q.offset


def dequantize_nf4_tile(q: NF4Tensor, row0: Any, n_rows: int, col0: int = 0, n_cols: int | None = None,
                        dtype: Any = None) -> jax.Array:
    """Rows [row0, row0 + n_rows) and columns [col0, col0 + n_cols) (default all) of ``q`` viewed
    as [prod(shape[:-1]), shape[-1]], dequantized into ``dtype`` (default the original's).
    Only the tile's codes and scales are read; ``row0`` may be traced (a loop index), then it
    must keep the tile on whole blocks (e.g. i * n_rows) and inside the tensor."""
    R, C = _matrix(q.shape)
    n_cols = C if n_cols is None else n_cols
    _check_tile(q, row0, n_rows, col0, n_cols, q.block)
    half, block = q.block // 2, q.block
    if n_cols == C:  # whole rows: a run of consecutive blocks
        n_blocks = n_rows * C // block
        unit = block // math.gcd(C, block)  # rows per run of whole blocks; row0 is a multiple
        b0 = row0 // unit * (unit * C // block)  # never forms row0 * C, which int32 may not hold
        codes = jax.lax.dynamic_slice_in_dim(q.codes.reshape(-1, half), b0, n_blocks)
        absmax = jax.lax.dynamic_slice_in_dim(q.absmax, b0, n_blocks)
        ids = b0 + jnp.arange(n_blocks)
    else:  # a window of the [R, C / block] grid of blocks
        grid = C // block
        start = (row0, col0 // block)
        codes = jax.lax.dynamic_slice(q.codes.reshape(R, grid, half), (*start, 0), (n_rows, n_cols // block, half))
        absmax = jax.lax.dynamic_slice(q.absmax.reshape(R, grid), start, (n_rows, n_cols // block))
        ids = (row0 + jnp.arange(n_rows))[:, None] * grid + (col0 // block + jnp.arange(n_cols // block))[None, :]
        codes, absmax, ids = codes.reshape(-1, half), absmax.reshape(-1), ids.reshape(-1)
    idx = jnp.stack([codes >> 4, codes & 15], axis=-1).reshape(-1, block)
    values = jnp.asarray(NF4_CODE)[idx] * _block_scales(q, absmax, ids)[:, None]
    return values.astype(dtype or q.dtype).reshape(n_rows, n_cols)


def dequantize_nf4(q: NF4Tensor, dtype: Any = None) -> jax.Array:
    """The whole tensor; a stage calls ``dequantize_nf4_tile`` instead."""
    return dequantize_nf4_tile(q, 0, _matrix(q.shape)[0], dtype=dtype).reshape(q.shape)


def dequantize_int8_tile(q: Int8Tensor, row0: Any, n_rows: int, col0: Any = 0, n_cols: int | None = None,
                         dtype: Any = None) -> jax.Array:
    """As ``dequantize_nf4_tile``: ``codes * absmax * (1/127)`` in float32, bitsandbytes' order.
    ``col0`` may be traced too (an output-channel tile of ``quant_matmul``)."""
    R, C = _matrix(q.shape)
    n_cols = C if n_cols is None else n_cols
    _check_tile(q, row0, n_rows, col0, n_cols, 1)
    codes = jax.lax.dynamic_slice(q.codes.reshape(R, C), (row0, col0), (n_rows, n_cols))
    absmax = jax.lax.dynamic_slice_in_dim(q.absmax, col0, n_cols)
    values = codes.astype(jnp.float32) * absmax[None, :] * _INV_127
    return values.astype(dtype or q.dtype)


def dequantize_int8(q: Int8Tensor, dtype: Any = None) -> jax.Array:
    return dequantize_int8_tile(q, 0, _matrix(q.shape)[0], dtype=dtype).reshape(q.shape)


# --- matmul against a quantized kernel, one output tile at a time ------------------------------------

QUANT_TILE_BYTES = 32 * 2**20  # default most working bytes of one quant_matmul tile


def in_out(q_shape: tuple[int, ...], kind: Kind) -> tuple[int, int]:
    """(in, out) of a kernel: nf4 holds the torch weight [out, in], int8 the kernel [in, out]."""
    if len(q_shape) != 2:
        raise ValueError(f"quant_matmul needs a kernel of 2 axes, but this one has shape {tuple(q_shape)}")
    return (q_shape[1], q_shape[0]) if kind == "nf4" else (q_shape[0], q_shape[1])


def kind_of(q: NF4Tensor | Int8Tensor) -> Kind:
    return "nf4" if isinstance(q, NF4Tensor) else "int8"


def quant_tile_bytes(q_shape: tuple[int, ...], kind: Kind, tile: int, dtype: Any = jnp.bfloat16,
                     block: int = 64) -> int:
    """Device working bytes of one ``quant_matmul`` tile, what the planner charges the stage:
    ``tile`` output channels dequantized into ``dtype`` with their scales, ``dequant_tile_bytes``
    of [tile, in] (nf4, ``q_shape`` [out, in]) or [in, tile] (int8, [in, out]). The tile's
    products [..., tile] are activations and counted with them."""
    n_in, _ = in_out(q_shape, kind)
    if kind == "nf4":
        return dequant_tile_bytes(tile, n_in, kind, dtype, block)
    return dequant_tile_bytes(n_in, tile, kind, dtype, block)


def quant_tile(q_shape: tuple[int, ...], kind: Kind, dtype: Any = jnp.bfloat16, block: int = 64,
               tile: int | None = None) -> int:
    """The output channels of one ``quant_matmul`` tile: ``tile`` checked (one-line ValueError),
    or by default the most whose ``quant_tile_bytes`` fit QUANT_TILE_BYTES, a divisor of ``out``
    when one lies within half of that (no remainder tile, at most twice the tiles), else that
    most with a remainder. nf4 tiles are multiples of ``unit`` rows, to hold whole blocks."""
    n_in, n_out = in_out(q_shape, kind)
    unit = block // math.gcd(n_in, block) if kind == "nf4" else 1
    if tile is not None:
        if isinstance(tile, bool) or not (isinstance(tile, (int, np.integer)) and 0 < tile <= n_out
                                          and tile % unit == 0):
            whole = f", a multiple of {unit} (whole nf4 blocks of {block})" if unit > 1 else ""
            raise ValueError(f"quant_matmul tile {tile!r} of kernel {tuple(q_shape)} must be 1 to {n_out} "
                             f"output channels{whole}: change tile or leave it None")
        return int(tile)
    # bytes are linear in the tile over multiples of unit (its nf4 blocks are whole)
    most = max(1, QUANT_TILE_BYTES // quant_tile_bytes(q_shape, kind, unit, dtype, block)) * unit
    if most >= n_out:
        return n_out
    return next((t for t in range(most, most // 2, -unit) if n_out % t == 0), most)


def tile_weights(q: NF4Tensor | Int8Tensor, o0: Any, n: int, dtype: Any) -> jax.Array:
    """Output channels [o0, o0 + n) of the kernel dequantized into ``dtype``, as [in, n]."""
    if isinstance(q, NF4Tensor):
        return dequantize_nf4_tile(q, o0, n, dtype=dtype).T
    return dequantize_int8_tile(q, 0, q.shape[0], o0, n, dtype)


def over_tiles(n_out: int, tile: int, step: Any, carry: Any) -> Any:
    """``carry = step(o0, n, carry)`` for each tile: a loop over the whole ones (o0 traced, one
    tile live at a time) and a static remainder."""
    n_full, rest = divmod(n_out, tile)
    carry = jax.lax.fori_loop(0, n_full, lambda i, c: step(i * tile, tile, c), carry)
    return step(n_full * tile, rest, carry) if rest else carry


# A custom_vjp so that autodiff saves no dequantized tile: the backward recomputes them and gives
# the frozen kernel no cotangent. The dtypes are static arguments since residuals hold only arrays.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tiled_matmul(tile: int, dtype: np.dtype, x_dtype: np.dtype, x: jax.Array, q: Any) -> jax.Array:
    _, n_out = in_out(q.shape, kind_of(q))

    def step(o0, n, y):
        y_t = jnp.matmul(x, tile_weights(q, o0, n, x_dtype))
        return jax.lax.dynamic_update_slice_in_dim(y, y_t.astype(dtype), o0, axis=y.ndim - 1)
    return over_tiles(n_out, tile, step, jnp.zeros((*x.shape[:-1], n_out), dtype))


def _tiled_matmul_fwd(tile, dtype, x_dtype, x, q):
    return _tiled_matmul(tile, dtype, x_dtype, x, q), q  # no dequantized tile is kept


def _tiled_matmul_bwd(tile, dtype, x_dtype, q, g):
    n_in, n_out = in_out(q.shape, kind_of(q))

    def step(o0, n, dx):
        g_t = jax.lax.dynamic_slice_in_dim(g, o0, n, axis=g.ndim - 1).astype(x_dtype)
        w_t = tile_weights(q, o0, n, x_dtype)  # recomputed, as in the forward
        return dx + jnp.matmul(g_t, w_t.T, preferred_element_type=jnp.float32)
    dx = over_tiles(n_out, tile, step, jnp.zeros((*g.shape[:-1], n_in), jnp.float32))
    return dx.astype(x_dtype), None  # the kernel is frozen: no cotangent (zeros, float0 for codes)


_tiled_matmul.defvjp(_tiled_matmul_fwd, _tiled_matmul_bwd)


def quant_matmul(x: jax.Array, q: NF4Tensor | Int8Tensor, tile: int | None = None, dtype: Any = None) -> jax.Array:
    """``x @ W`` for x [..., in] and a frozen quantized kernel: nf4 ``q`` of the torch weight
    [out, in] (``W = dequantize_nf4(q).T``) or int8 ``q`` of the kernel [in, out]. Returns
    [..., out] in ``dtype`` (default x's). ``tile`` output channels at a time (default: the most
    within QUANT_TILE_BYTES) are dequantized into x's dtype and multiplied as jnp.matmul does;
    the last tile may be smaller. Differentiable in ``x`` only: its backward recomputes each tile
    and sums ``g_tile @ W_tile.T`` in float32, cast to x's dtype once."""
    kind = kind_of(q)
    n_in, _ = in_out(q.shape, kind)
    if x.shape[-1] != n_in:
        raise ValueError(f"quant_matmul of x {x.shape} with kernel {q.shape} needs x's last axis to be {n_in}")
    x_dtype = jnp.dtype(x.dtype)
    tile = quant_tile(q.shape, kind, x_dtype, q.block if kind == "nf4" else 64, tile)
    return _tiled_matmul(tile, jnp.dtype(x_dtype if dtype is None else dtype), x_dtype, x, q)
