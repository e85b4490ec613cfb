"""Sequence tiles: run a function over tiles of positions so its intermediates are never whole.

``map_tiles`` runs a body over tiles in a loop with its own backward (a jax.custom_vjp): the
forward keeps only the tiles' inputs, the backward recomputes one tile at a time. Tensors every
tile reads (a layer's weights, attention's keys and values) are the loop's constants; their
gradients add up tile by tile in float32 sums the backward carries, rounded once at the end,
while the constants themselves stay in their own dtype. The loops' output buffers are created
where they are used (``zeros_after``), not at the start of the program.

Under ``keeping_tiles()`` (a stage keeping its residuals, pstar_jax.engine.stages.forward_keep)
the forward runs each tile under jax.vjp and keeps the tiles' residuals instead, and the backward
runs from them, with the same float32 sums and no tile recomputed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero


TILE_BYTES = 256 * 2**20

# Whether map_tiles being traced keeps its tiles' residuals. A trace-time setting, like jax's own
# contexts: the models hold their tile budgets from construction, and only the stage function
# tracing a kept forward knows that its tiles' backward must not recompute them.
_KEEPING = contextvars.ContextVar("pstar_jax_keeping_tiles", default=False)


@contextlib.contextmanager
def keeping_tiles():
    """Inside: map_tiles (where keepable) keeps every tile's vjp residuals in its forward, and its
    backward runs from them, recomputing no tile. jax caches a function's trace without knowing
    this setting: trace a function (a stage's kept forward) either always inside or never."""
    token = _KEEPING.set(True)
    try:
        yield
    finally:
        _KEEPING.reset(token)


@dataclasses.dataclass(frozen=True)
class TileBudget:
    """The largest intermediate one tile may hold, per kind, in bytes: the head's float32 logits
    (pstar_jax.model.loss), attention's float32 scores (pstar_jax.model.attention) and the MLP's hidden
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
    """(number of tiles, size of each) covering n positions with tiles of at most ``tile``.

    The fewest tiles that divide n exactly, when at most twice the fewest possible: the tiles
    are then a reshape of the sequence, where padding would copy it whole (one copy of a
    stage's input or output per tiled pass, 2 bytes x d_model per token each in bf16). Else
    equal tiles, the padding below one position per tile."""
    if n <= 0 or tile <= 0:
        raise ValueError(f"split_tiles needs positive n and tile, got {n} and {tile}")
    fewest = -(-n // tile)
    for n_tiles in range(fewest, min(2 * fewest, n) + 1):
        if n % n_tiles == 0:
            return n_tiles, n // n_tiles
    return fewest, -(-n // fewest)


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


def _floating(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _sum_dtype(x: Any) -> Any:
    """float32 for floating types narrower than it: gradients add up in float32 across tiles."""
    return jnp.float32 if jnp.finfo(x.dtype).bits < 32 else x.dtype


def zeros_after(shape: tuple[int, ...], dtype: Any, after: jax.Array) -> jax.Array:
    """Zeros that the compiler cannot create before ``after`` exists. A loop's output buffers
    (zeros a loop writes into) depend on nothing, and XLA's CPU scheduler creates them at the
    program's start: in a stage's backward every loop's buffers were then alive at once, through
    the recomputed forward (llama-3.1-8b: 10 bytes x d_model per token of them). A factor of one
    computed from ``after`` (never NaN: isfinite is 0 or 1) moves each to where it is used."""
    unit = jnp.isfinite(jnp.ravel(after)[0]).astype(dtype)
    return jnp.zeros(shape, dtype) * unit


def _first_floating(*trees: Any) -> jax.Array | None:
    return next((x for t in trees for x in jax.tree.leaves(t) if _floating(x) and x.size), None)


def _zeros(shape: tuple[int, ...], dtype: Any, after: jax.Array | None) -> jax.Array:
    return jnp.zeros(shape, dtype) if after is None else zeros_after(shape, dtype, after)


def _buffers(shapes: Any, n: int, after: jax.Array | None) -> Any:
    """Zeros shaped [n, ...] for each of ``shapes``: where a loop writes one value per tile."""
    return jax.tree.map(lambda s: _zeros((n,) + tuple(s.shape), s.dtype, after), shapes)


def _with(leaves: list, at: list[int], values: Any) -> list:
    """``leaves`` with ``values`` in the places ``at``."""
    out = list(leaves)
    for k, v in zip(at, values):
        out[k] = v
    return out


def _at(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _put(buffers: Any, values: Any, i: Any) -> Any:
    return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0), buffers, values)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Perturbed:
    """Which leaves of (consts, hoisted) and of the tiles the outer differentiation perturbs (a
    static part of the residuals): the backward takes no gradient of the others. A frozen weight's
    gradient would be 2 x its matmul's FLOPs per tile, computed and thrown away."""
    shared: tuple[bool, ...]
    tiles: tuple[bool, ...]


def _unwrap(tree: Any) -> tuple[Any, tuple[bool, ...]]:
    """A symbolic-zeros custom_vjp's primals (CustomVJPPrimal leaves): their values, and which are perturbed."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    return (jax.tree.unflatten(treedef, [x.value for x in leaves]),
            tuple(bool(x.perturbed) and _floating(x.value) for x in leaves))


def _dense(ct: Any) -> Any:
    """Cotangents with symbolic zeros made zeros (an output nothing downstream uses)."""
    return jax.tree.map(lambda c: jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c, ct,
                        is_leaf=lambda c: isinstance(c, SymbolicZero))


def _perturbed(consts: Any, hoisted: tuple, xs: Any) -> tuple[tuple, Any, Any, _Perturbed]:
    (consts, hoisted), shared = _unwrap((consts, hoisted))
    xs, tiles = _unwrap(xs)
    return consts, hoisted, xs, _Perturbed(shared, tiles)


def _forward(body: Callable[..., Any], consts: Any, hoisted: tuple, xs: Any) -> Any:
    n = jax.tree.leaves(xs)[0].shape[0]
    shapes = jax.eval_shape(lambda c, x, h: body(c, x, *h), consts, _at(xs, 0), hoisted)
    out = _buffers(shapes, n, _first_floating(xs, consts))
    return jax.lax.fori_loop(0, n, lambda i, out: _put(out, body(consts, _at(xs, i), *hoisted), i), out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _map_tiles(body: Callable[..., Any], consts: Any, hoisted: tuple, xs: Any) -> Any:
    return _forward(body, consts, hoisted, xs)


def _map_tiles_fwd(body: Callable[..., Any], consts: Any, hoisted: tuple, xs: Any) -> tuple[Any, tuple]:
    consts, hoisted, xs, perturbed = _perturbed(consts, hoisted, xs)
    return _forward(body, consts, hoisted, xs), (consts, hoisted, xs, perturbed)


def _differentiated(perturbed: _Perturbed) -> tuple[list[int], list[int]]:
    """The places of the shared and the tile leaves a tile's vjp differentiates."""
    return [k for k, p in enumerate(perturbed.shared) if p], [k for k, p in enumerate(perturbed.tiles) if p]


def _backward(body: Callable[..., Any], consts: Any, hoisted: tuple, xs: Any, perturbed: _Perturbed, ct_ys: Any,
              tile_vjp: Callable[..., Callable]) -> tuple:
    """Tile by tile in reverse order, as autodiff of the forward loop would run: each tile's vjp
    over its perturbed floating parts (``tile_vjp(j, tile_fn, shared_part, tile_part)``), its
    input's gradient written into its place, the gradients of the constants (and of what body
    closes over) added into sums carried across tiles, float32 for narrower floats and rounded
    once at the end. Integer inputs (positions, segment ids) and what the outer differentiation
    holds constant (a frozen weight) get no gradient (None, a symbolic zero)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    shared, shared_def = jax.tree.flatten((consts, hoisted))
    tiles, tiles_def = jax.tree.flatten(xs)
    shared_f, tiles_f = _differentiated(perturbed)
    ct_ys = _dense(ct_ys)
    after = _first_floating(ct_ys)

    def tile_grads(i, carry):
        sums, d_tiles = carry
        j = n - 1 - i
        x_j = _at(tiles, j)

        def tile_fn(shared_part, tile_part):
            cs, h = jax.tree.unflatten(shared_def, _with(shared, shared_f, shared_part))
            return body(cs, jax.tree.unflatten(tiles_def, _with(x_j, tiles_f, tile_part)), *h)
        vjp = tile_vjp(j, tile_fn, [shared[k] for k in shared_f], [x_j[k] for k in tiles_f])
        d_shared, d_tile = vjp(_at(ct_ys, j))
        sums = [s + d.astype(s.dtype) for s, d in zip(sums, d_shared)]
        return sums, _put(d_tiles, d_tile, j)

    sums = [_zeros(shared[k].shape, _sum_dtype(shared[k]), after) for k in shared_f]
    d_tiles = [_zeros(tiles[k].shape, tiles[k].dtype, after) for k in tiles_f]
    sums, d_tiles = jax.lax.fori_loop(0, n, tile_grads, (sums, d_tiles))
    sums = [s.astype(shared[k].dtype) for k, s in zip(shared_f, sums)]
    d_consts, d_hoisted = jax.tree.unflatten(shared_def, _with([None] * len(shared), shared_f, sums))
    return d_consts, d_hoisted, jax.tree.unflatten(tiles_def, _with([None] * len(tiles), tiles_f, d_tiles))


def _map_tiles_bwd(body: Callable[..., Any], residuals: tuple, ct_ys: Any) -> tuple:
    """Each tile's forward recomputed under jax.vjp (only the tiles' inputs were kept)."""
    return _backward(body, *residuals, ct_ys, lambda j, tile_fn, *parts: jax.vjp(tile_fn, *parts)[1])


_map_tiles.defvjp(_map_tiles_fwd, _map_tiles_bwd, symbolic_zeros=True)


# What a kept tile keeps: the projections' outputs its backward needs (``kept_projection``),
# and nothing else. A linear map's backward needs its input, not its output, so only the outputs
# that feed something nonlinear are kept (SwiGLU's gate and up, the o projection's output under
# the next norm, Qwen3's q and k before their norms). Elementwise values (activations, products,
# norms, a quantized kernel's dequantized tile) and LoRA's rank-r products x @ a are recomputed
# from them: a few FLOPs per element, or 2 x r per element, against 2 x d of a projection. The
# alternative, every matmul's output (jax.checkpoint's dots policy), also keeps a LoRA
# projection's base and adapter outputs apart, and the ones no backward reads: llama-3.1-70b,
# 4,096 tokens, 1.27 GiB per block against 0.6 GiB.
PROJECTION = "pstar_jax.projection"
_KEPT_POLICY = jax.checkpoint_policies.save_only_these_names(PROJECTION)


def kept_projection(y: jax.Array) -> jax.Array:
    """``y``, a projection's output, marked as a value a kept tile may keep instead of recomputing
    (the identity everywhere else)."""
    return checkpoint_name(y, PROJECTION)


class _KeptTiles:
    """The structure of one kept map_tiles' tile vjp: recorded when its forward is traced, read
    when its backward is (possibly in another jit: pstar_jax.engine.stages.backward_kept)."""
    treedef: Any = None
    sources: tuple = ()  # per vjp leaf: its index among the tile's known values, or None (kept)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _map_kept(body: Callable[..., Any], record: _KeptTiles, consts: Any, hoisted: tuple, xs: Any) -> Any:
    return _forward(body, consts, hoisted, xs)


def _map_kept_fwd(body: Callable[..., Any], record: _KeptTiles, consts: Any, hoisted: tuple,
                  xs: Any) -> tuple[Any, tuple]:
    """Each tile under jax.vjp in a scan, which stacks the residuals per tile (``_KEPT_POLICY``'s
    values: the projections' outputs the backward reads). Residuals that are the loop's
    constants or the tile's own inputs are left out (the backward has them): a weight is never
    copied once per tile."""
    consts, hoisted, xs, perturbed = _perturbed(consts, hoisted, xs)
    shared, shared_def = jax.tree.flatten((consts, hoisted))
    shared_f, tiles_f = _differentiated(perturbed)

    def tile(_, x):
        tiles, tiles_def = jax.tree.flatten(x)

        def tile_fn(shared_part, tile_part):
            cs, h = jax.tree.unflatten(shared_def, _with(shared, shared_f, shared_part))
            return body(cs, jax.tree.unflatten(tiles_def, _with(tiles, tiles_f, tile_part)), *h)
        y, vjp = jax.vjp(jax.checkpoint(tile_fn, policy=_KEPT_POLICY), [shared[k] for k in shared_f],
                         [tiles[k] for k in tiles_f])
        leaves, record.treedef = jax.tree.flatten(vjp)
        known = shared + tiles
        record.sources = tuple(next((k for k, a in enumerate(known) if a is leaf), None) for leaf in leaves)
        return None, (y, [leaf for leaf, s in zip(leaves, record.sources) if s is None])
    _, (ys, kept) = jax.lax.scan(tile, None, xs)
    return ys, (consts, hoisted, xs, perturbed, kept)


def _map_kept_bwd(body: Callable[..., Any], record: _KeptTiles, residuals: tuple, ct_ys: Any) -> tuple:
    """Each tile's vjp rebuilt from its kept residuals and its known values: no tile recomputed."""
    consts, hoisted, xs, perturbed, kept = residuals
    shared = jax.tree.leaves((consts, hoisted))
    tiles = jax.tree.leaves(xs)

    def tile_vjp(j, tile_fn, *parts):
        known = shared + _at(tiles, j)
        mine = iter(_at(kept, j))
        return jax.tree.unflatten(record.treedef, [next(mine) if s is None else known[s] for s in record.sources])
    return _backward(body, consts, hoisted, xs, perturbed, ct_ys, tile_vjp)


_map_kept.defvjp(_map_kept_fwd, _map_kept_bwd, symbolic_zeros=True)


def map_tiles(body: Callable[[Any, Any], Any], consts: Any, xs: Any, *, keepable: bool = True) -> Any:
    """``body(consts, x)`` for each tile x of ``xs`` (a pytree with the tiles as leading axis),
    one tile's intermediates alive at a time in the forward and the backward. A single tile is
    a plain call: the whole sequence fits, and nothing is recomputed (kept, it still keeps only
    the projections' outputs its backward reads, not every intermediate).

    The backward recomputes one tile at a time (``_map_tiles_bwd``) and adds up the gradients
    of ``consts`` and of the arrays body closes over in float32 sums, while the constants stay
    in their own dtype: autodiff of a loop would add a constant's gradient in the constant's
    dtype (one bf16 rounding per tile), so the sums would need float32 copies of every constant
    for the whole loop (attention's k and v: 2 bytes x d_model per token for llama-3.1-8b).

    Under ``keeping_tiles()`` a ``keepable`` map keeps every tile's residuals and its backward
    recomputes nothing (same sums). Attention is not keepable: its tiles' residuals are its
    whole [H, L, L] probabilities (4 GiB per llama-3.1-70b block at 4096 tokens)."""
    keep = keepable and _KEEPING.get()
    if jax.tree.leaves(xs)[0].shape[0] == 1 and not keep:  # one tile: nothing to save, so no recomputation
        out = body(consts, jax.tree.map(lambda x: x[0], xs))
        return jax.tree.map(lambda y: y[None], out)
    converted, hoisted = jax.closure_convert(body, consts, _at(xs, 0))
    if keep:
        return _map_kept(converted, _KeptTiles(), consts, tuple(hoisted), xs)
    return _map_tiles(converted, consts, tuple(hoisted), xs)


def tiled_over_sequence(fn: Callable[..., Any], x_BxLxD: Any, *, tile: int, params: Any = None) -> Any:
    """``fn`` applied to tiles of ``tile`` positions of x_BxLxD, concatenated: equal to
    ``fn(x_BxLxD)`` for a position-wise fn (an MLP), whose tokens x d_ff intermediate then
    exists one tile at a time. With ``params`` (a pytree of the weights fn reads) fn is called
    ``fn(params, x_tile)``; the gradients of params and of weights fn closes over add up in
    float32 across tiles (``map_tiles``). x may be a pytree of [B, L, ...] arrays
    (per-position side inputs beside the activations), tiled alike, and fn may return a pytree
    of [1, T, ...] arrays (several per-position outputs), each put back to [B, L, ...].

    fn must be position-wise: the B rows are laid end to end as one row of B x L positions and
    cut into tiles of B x ``tile`` of them, so that tiles are reshapes of the input, not copies
    (a [B, L] -> [tiles, B, T] move would copy it whenever B > 1); fn sees [1, T, ...] tiles.
    When no tiling divides B x L the last tile is zero-padded (fn must be finite on zeros)."""
    B, L = jax.tree.leaves(x_BxLxD)[0].shape[:2]
    n_tiles, size = split_tiles(B * L, B * min(tile, L))
    xs = jax.tree.map(lambda x: to_tiles(x.reshape((1, B * L) + x.shape[2:]), 1, n_tiles, size), x_BxLxD)
    if params is None:
        ys = map_tiles(lambda _, x: fn(x), (), xs)
    else:
        ys = map_tiles(fn, params, xs)
    return jax.tree.map(lambda y: from_tiles(y, 1, B * L).reshape((B, L) + y.shape[3:]), ys)


def mlp_tile(batch: int, length: int, d_hidden: int, tile_bytes: int) -> int:
    """Positions per MLP tile so that one tile's float32-wide hidden activations (B x tile x F)
    fit ``tile_bytes``."""
    return rows_within(length, 4 * batch * d_hidden, tile_bytes)
