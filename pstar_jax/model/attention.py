"""Causal, segment-aware, grouped-query attention that never holds L x L scores per head.

Query head h reads key/value head h // G (G = H / N query heads per key/value head, HF's
``repeat_kv``, as models/llama.py). Position i sees position j when j <= i and both lie in the
same segment (packed rows: segment ids 1, 2, ... per example, padding one more id such as 0);
every position sees at least itself, so no row of the softmax is empty and nothing is NaN.

Two implementations, chosen at trace time from the backend and dtype (``implementation=None``):
  * ``"cudnn"`` (a GPU, bf16/fp16): ``jax.nn.dot_product_attention(implementation="cudnn",
    is_causal=True)``, cuDNN's flash attention: linear memory, the causal half skipped. Segment
    ids go in as ``mask=`` B x 1 x L x L, which jax turns into a dense additive bias of that size
    in the compute dtype (quadratic per row, though not per head): used only while that bias fits
    ``mask_bytes``; longer packed rows take the tiled path. cuDNN rejects some shapes (head
    widths it lacks, old cuDNN); that error at trace time also falls back to the tiled path.
  * ``"tiled"`` (a CPU, fp32, the fallbacks): queries in tiles of ``tile_q``, each recomputed
    in the backward (pstar_jax.model.tiling.map_tiles), each tile's scores against all L keys, so a
    tile holds B x H x tile_q x L scores, forward and backward. Numerics are llama's: q.k in the
    compute dtype, then scaled, softmax in float32, probabilities cast back before the product
    with v (or, with ``float32_scores``, jax.nn.dot_product_attention's: q.k and the scale in float32).
jax.nn.dot_product_attention has the same signature on jax 0.10.2 and 0.11.2 (bias, mask,
scale, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size, implementation),
so nothing here goes through pstar_jax.compat.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pstar_jax.model.tiling import map_tiles, rows_within, split_tiles, to_tiles

TILE_SCORES_BYTES = 256 * 2**20  # one query tile's float32 scores, all heads and rows
MASK_BYTES = 256 * 2**20  # the largest dense segment bias handed to cuDNN

Implementation = Literal["cudnn", "tiled"]


def visible(segments_q_BxT: jax.Array, positions_q_T: jax.Array, segments_k_BxS: jax.Array,
            window: int | None = None, first_key: jax.Array | int = 0) -> jax.Array:
    """B x T x S: query at position p sees key j when j <= p and their segments are equal, and
    with a sliding ``window`` only when p - window < j (the window's last keys, itself included:
    transformers' sliding_window_overlay). The S keys are positions first_key.. (a window's slice
    of the row). Built per query tile, so the band costs no L x L mask."""
    keys_S = first_key + jnp.arange(segments_k_BxS.shape[1])
    causal_TxS = keys_S[None, :] <= positions_q_T[:, None]
    if window is not None:
        causal_TxS = causal_TxS & (keys_S[None, :] > positions_q_T[:, None] - window)
    same_BxTxS = segments_q_BxT[:, :, None] == segments_k_BxS[:, None, :]
    return causal_TxS[None] & same_BxTxS


def tile_queries(batch: int, n_head: int, length: int, tile_bytes: int = TILE_SCORES_BYTES) -> int:
    """Queries per tile so that one tile's float32 scores (B x H x tile x L) fit ``tile_bytes``."""
    return rows_within(length, 4 * batch * n_head * length, tile_bytes)


def _tile(consts: tuple[jax.Array, ...], x: tuple[jax.Array, ...], scale: float, float32_scores: bool,
          window: int | None) -> jax.Array:
    k_BxLxNxK, v_BxLxNxK, segments_BxL = consts
    q_BxTxNxGxK, segments_q_BxT, positions_T = x
    first = 0
    if window is not None:  # only the keys the tile's window reaches: T + window - 1 of them, not L
        T, L = positions_T.shape[0], k_BxLxNxK.shape[1]
        size = min(L, T + window - 1)
        first = jnp.clip(positions_T[0] - window + 1, 0, L - size)
        k_BxLxNxK, v_BxLxNxK, segments_BxL = (jax.lax.dynamic_slice_in_dim(a, first, size, axis=1)
                                              for a in (k_BxLxNxK, v_BxLxNxK, segments_BxL))
    scores_BxNxGxTxL = jnp.einsum("btngk,blnk->bngtl", q_BxTxNxGxK, k_BxLxNxK,
                                  preferred_element_type=jnp.float32 if float32_scores else None) * scale
    mask_BxTxL = visible(segments_q_BxT, positions_T, segments_BxL, window, first)
    scores32 = jnp.where(mask_BxTxL[:, None, None], scores_BxNxGxTxL.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(scores32, axis=-1).astype(q_BxTxNxGxK.dtype)
    return jnp.einsum("bngtl,blnk->btngk", probs, v_BxLxNxK)


def tiled_attention(q_BxLxHxK: jax.Array, k_BxLxNxK: jax.Array, v_BxLxNxK: jax.Array,
                    segment_ids_BxL: jax.Array, *, scale: float, tile_q: int,
                    float32_scores: bool = False, window: int | None = None) -> jax.Array:
    """The query-tiled path (see the module docstring); ``window`` as in causal_attention."""
    B, L, H, K = q_BxLxHxK.shape
    N = k_BxLxNxK.shape[2]
    n_tiles, tile = split_tiles(L, min(tile_q, L))
    q_BxLxNxGxK = q_BxLxHxK.reshape(B, L, N, H // N, K)
    # Padded queries repeat the last position and its segment: they see what it sees (never
    # nothing, so their softmax is finite), and their outputs are cut off below.
    positions = jnp.minimum(jnp.arange(n_tiles * tile), L - 1)
    segments_q = jnp.take(segment_ids_BxL, positions, axis=1)
    xs = (to_tiles(q_BxLxNxGxK, 1, n_tiles, tile), to_tiles(segments_q, 1, n_tiles, tile),
          positions.reshape(n_tiles, tile))
    out = map_tiles(lambda c, x: _tile(c, x, scale, float32_scores, window), (k_BxLxNxK, v_BxLxNxK, segment_ids_BxL),
                    xs, keepable=False)
    out_BxLxNxGxK = jnp.moveaxis(out, 0, 1).reshape(B, n_tiles * tile, N, H // N, K)[:, :L]
    return out_BxLxNxGxK.reshape(B, L, H, K)


def _cudnn_attention(q_BxLxHxK: jax.Array, k_BxLxNxK: jax.Array, v_BxLxNxK: jax.Array,
                     segment_ids_BxL: jax.Array | None, *, scale: float, window: int | None = None,
                     implementation: Literal["cudnn", "xla"] = "cudnn") -> jax.Array:
    """jax.nn.dot_product_attention with the segment mask as ``mask=`` (``"xla"`` builds the same
    call with full L x L scores: the tests check the mask that way on a CPU)."""
    mask = None
    if segment_ids_BxL is not None:
        mask = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
    band = None if window is None else (window - 1, 0)  # keys p - window + 1 .. p
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, mask=mask, scale=scale,
                                        is_causal=True, local_window_size=band, implementation=implementation)


def choose_implementation(q_BxLxHxK: jax.Array, segment_ids_BxL: jax.Array | None,
                          mask_bytes: int = MASK_BYTES) -> Implementation:
    """cuDNN on a GPU for half-precision inputs whose segment bias (if any) fits; else tiled."""
    if jax.default_backend() != "gpu" or q_BxLxHxK.dtype not in (jnp.bfloat16, jnp.float16):
        return "tiled"
    B, L = q_BxLxHxK.shape[:2]
    if segment_ids_BxL is not None and B * L * L * q_BxLxHxK.dtype.itemsize > mask_bytes:
        return "tiled"
    return "cudnn"


def causal_attention(q_BxLxHxK: jax.Array, k_BxLxNxK: jax.Array, v_BxLxNxK: jax.Array,
                     segment_ids_BxL: jax.Array | None = None, *, scale: float | None = None,
                     tile_q: int | None = None, implementation: Implementation | None = None,
                     tile_bytes: int = TILE_SCORES_BYTES, float32_scores: bool = False,
                     window: int | None = None) -> jax.Array:
    """o_BxLxHxK: causal attention within segments (None: one segment per row), grouped-query.

    ``scale`` defaults to K ** -0.5. ``tile_q`` queries per tile on the tiled path, else as
    many as keep one tile's float32 scores within ``tile_bytes``. ``implementation`` None picks
    per ``choose_implementation``; ``"cudnn"`` given explicitly raises where cuDNN cannot run.
    ``float32_scores`` (tiled path): q.k accumulated into float32 and scaled there, the numerics
    of jax.nn.dot_product_attention (models/gpt.py's today) instead of llama's (the product
    rounded to the compute dtype, then scaled, then upcast); the same in fp32. ``window``: each
    query sees only its ``window`` latest keys (sliding-window layers): a tile of queries reads
    the tile + window - 1 keys before it, a band masked within them, so a tile's scores and work
    do not grow with L (cuDNN takes the window as local_window_size)."""
    B, L, H, K = q_BxLxHxK.shape
    N = k_BxLxNxK.shape[2]
    if k_BxLxNxK.shape != (B, L, N, K) or v_BxLxNxK.shape != k_BxLxNxK.shape or H % N:
        raise ValueError(f"causal_attention takes q [B, L, H, K] and k, v [B, L, N, K] with H a multiple "
                         f"of N; got {q_BxLxHxK.shape}, {k_BxLxNxK.shape}, {v_BxLxNxK.shape}")
    if segment_ids_BxL is not None and segment_ids_BxL.shape != (B, L):
        raise ValueError(f"segment_ids must be [B, L] = {(B, L)}, got {segment_ids_BxL.shape}")
    scale = K ** -0.5 if scale is None else float(scale)
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be a positive number of positions or None, got {window!r}")
    chosen = implementation or choose_implementation(q_BxLxHxK, segment_ids_BxL)
    if chosen == "cudnn":
        try:
            return _cudnn_attention(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, scale=scale, window=window)
        except (NotImplementedError, ValueError, RuntimeError):
            if implementation == "cudnn":
                raise
            # cuDNN lacks this shape or version: the tiled path computes the same function.
    elif chosen != "tiled":
        raise ValueError(f"implementation must be 'cudnn', 'tiled' or None, got {implementation!r}")
    segments = jnp.zeros((B, L), jnp.int32) if segment_ids_BxL is None else segment_ids_BxL
    tile = tile_queries(B, H, L, tile_bytes) if tile_q is None else int(tile_q)
    if tile <= 0:
        raise ValueError(f"tile_q must be positive, got {tile_q}")
    return tiled_attention(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segments, scale=scale, tile_q=tile,
                           float32_scores=float32_scores, window=window)
