"""pstar_jax.model.quant: NF4 and int8 frozen kernels.

Two references. Always: the rules of the QLoRA paper (Dettmers et al. 2023, "QLoRA: Efficient
Finetuning of Quantized LLMs"), restated below and recomputed here in float64. Where torch and
bitsandbytes import (CPU backend): bitsandbytes' quantize_4bit / dequantize_4bit (nf4, blocksize
64, compress_statistics) and int8_vectorwise_quant / _dequant, compared bit for bit.
"""

from __future__ import annotations

from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.config import ConfigError
from pstar_jax.model import quant
from pstar_jax.model.quant import (DYNAMIC_CODE, NF4_CODE, NF4Tensor, dequant_tile_bytes, dequantize_int8,
                                   dequantize_int8_tile, dequantize_nf4, dequantize_nf4_tile, quant_matmul,
                                   quant_tile, quant_tile_bytes, quantize_int8, quantize_nf4, quantized_bytes)

F32_EPS = float(np.finfo(np.float32).eps)


def normal(shape, scale=0.02, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def unpack(q: NF4Tensor) -> np.ndarray:
    """The 4-bit indices in element order: element 2i in the high nibble of byte i."""
    codes = np.asarray(q.codes)
    return np.stack([codes >> 4, codes & 15], axis=-1).reshape(-1)


# --- the paper's rules, no bitsandbytes ----------------------------------------------------------

def test_nf4_code_is_the_papers_normal_quantiles():
    """QLoRA section 3 and appendix E: NF4 is asymmetric, 8 positive and 7 negative quantiles of
    N(0, 1) and an exact zero, normalised into [-1, 1]: with delta = (1 - 1/30 + 1 - 1/32) / 2 =
    0.9677083, the positive values are Phi^-1 of 8 evenly spaced probabilities from delta down
    to 1/2 (linspace(delta, 1/2, 9) without its end), the negative ones -Phi^-1 of 7 (linspace
    (delta, 1/2, 8) without its end). bitsandbytes built its table with float32 linspace and
    division: within 2e-7 (under 2 ulp at 1.0) of the float64 quantiles."""
    delta = (1 - 1 / 30 + 1 - 1 / 32) / 2
    phi_inv = NormalDist().inv_cdf
    pos = [phi_inv(delta + (0.5 - delta) * i / 8) for i in range(8)]
    neg = [-phi_inv(delta + (0.5 - delta) * i / 7) for i in range(7)]
    paper = np.sort(np.array(pos + [0.0] + neg))
    paper /= paper.max()
    assert NF4_CODE.dtype == np.float32 and NF4_CODE.shape == (16,)
    np.testing.assert_allclose(NF4_CODE, paper, rtol=0, atol=2e-7)
    assert NF4_CODE[0] == -1 and NF4_CODE[7] == 0 and NF4_CODE[15] == 1


def test_dynamic_code_rule():
    """The double quantization's 8-bit map (bitsandbytes' create_dynamic_map; the paper says
    "8-bit floats"): 0, 1, and for e = 0..6 the 2**e midpoints of linspace(0.1, 1, 2**e + 1)
    times 10**(e - 6), with their negatives. bitsandbytes rounds each step in float32: within
    2 ulp of the float64 values."""
    rule = []
    for e in range(7):
        edges = np.linspace(0.1, 1.0, 2 ** e + 1)
        rule += list(10.0 ** (e - 6) * (edges[:-1] + edges[1:]) / 2)
    rule = np.sort(np.array(rule))
    assert DYNAMIC_CODE.shape == (256,) and np.all(np.diff(DYNAMIC_CODE) > 0)
    assert DYNAMIC_CODE[127] == 0 and DYNAMIC_CODE[255] == 1
    pos = DYNAMIC_CODE[128:255]
    np.testing.assert_array_equal(DYNAMIC_CODE[:127], -pos[::-1])
    np.testing.assert_allclose(pos, rule, rtol=2 * F32_EPS, atol=0)


def paper_nf4(w: np.ndarray, block: int = 64):
    """QLoRA's block-wise absmax rule in float64: flatten row-major, cut into blocks of ``block``
    contiguous values, scale each by 1 / its absmax into [-1, 1], keep the nearest NF4 value."""
    x = w.astype(np.float64).reshape(-1, block)
    absmax = np.abs(x).max(axis=1)
    normed = (x / absmax[:, None]).reshape(-1)
    idx = np.abs(normed[:, None] - NF4_CODE.astype(np.float64)[None, :]).argmin(axis=1)
    mids = (NF4_CODE[:-1].astype(np.float64) + NF4_CODE[1:]) / 2
    clear = np.abs(normed[:, None] - mids[None, :]).min(axis=1) > 1e-6  # float32 vs float64 near a tie
    return idx, absmax, clear


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_follows_the_papers_block_rule(double_quant):
    w = normal((40, 384))  # 240 blocks: the second quantization's last block of 256 is partial
    q = quantize_nf4(w, double_quant=double_quant)
    idx, absmax, clear = paper_nf4(w)
    assert clear.mean() > 0.999
    np.testing.assert_array_equal(unpack(q)[clear], idx[clear])
    deq = np.asarray(dequantize_nf4(q)).reshape(-1, 64).astype(np.float64)
    if not double_quant:
        np.testing.assert_array_equal(np.asarray(q.absmax), absmax.astype(np.float32))
        scales = absmax
    else:
        # The paper's double quantization: the absmaxes less their mean, in blocks of 256, each
        # scaled by its block's absmax and stored as the nearest 8-bit value (bitsandbytes'
        # dynamic map); a block's scale comes back as code * block absmax + mean.
        mean = absmax.mean()
        c = np.zeros(-(-absmax.size // 256) * 256)
        c[:absmax.size] = absmax - mean
        absmax2 = np.abs(c.reshape(-1, 256)).max(axis=1)
        np.testing.assert_allclose(np.asarray(q.offset), mean, rtol=F32_EPS)
        np.testing.assert_allclose(np.asarray(q.absmax_scale), absmax2, rtol=2 * F32_EPS)
        normed = (absmax - mean) / absmax2[np.arange(absmax.size) // 256]
        idx8 = np.abs(normed[:, None] - DYNAMIC_CODE.astype(np.float64)[None, :]).argmin(axis=1)
        mids8 = (DYNAMIC_CODE[:-1].astype(np.float64) + DYNAMIC_CODE[1:]) / 2
        clear8 = np.abs(normed[:, None] - mids8[None, :]).min(axis=1) > 1e-6
        np.testing.assert_array_equal(np.asarray(q.absmax)[clear8], idx8[clear8])
        scales = DYNAMIC_CODE[np.asarray(q.absmax)].astype(np.float64) * absmax2[np.arange(absmax.size) // 256] + mean
        # the second quantization costs at most half the largest gap of the map (near +-1:
        # 0.0175) times the 256-block's absmax
        assert np.all(np.abs(scales - absmax) <= 0.0088 * absmax2.max())
    # bitsandbytes' float32 roundings, one per operation in its order (numpy fuses nothing):
    # scale = code * block absmax, then + offset; value = NF4[index] * scale
    scale32 = np.asarray(q.absmax)
    if double_quant:
        scale32 = DYNAMIC_CODE[scale32] * np.asarray(q.absmax_scale)[np.arange(scale32.size) // 256]
        scale32 = scale32 + np.asarray(q.offset)
    np.testing.assert_array_equal(deq, NF4_CODE[unpack(q)].reshape(-1, 64) * scale32[:, None])
    # value = NF4[index] * the block's scale, one float32 rounding (of the scale, and then of
    # the product) at the values' scale
    want = NF4_CODE[unpack(q)].reshape(-1, 64).astype(np.float64) * scales[:, None]
    np.testing.assert_allclose(deq, want, rtol=0, atol=2 * F32_EPS * scales.max())
    # and the tensor itself within half the largest NF4 gap (0.139) times its block's absmax,
    # plus what the second quantization moved the scale
    gap = np.max(np.diff(NF4_CODE)) / 2
    err = np.abs(deq - w.reshape(-1, 64)).max(axis=1)
    assert np.all(err <= gap * absmax + np.abs(scales - absmax) + 1e-7)


def test_int8_follows_the_absmax_rule():
    """Per output channel (the last axis of an [in, out] kernel): codes = round(127 / absmax *
    w), the paper's int8 absmax rule (section 2) with one absmax a column."""
    w = normal((64, 48))
    w[:, 5] = 0.0
    q = quantize_int8(w)
    absmax = np.abs(w).max(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.rint(w.astype(np.float64) * (127 / absmax))
    want[:, 5] = 0
    assert q.codes.dtype == jnp.int8 and q.absmax.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q.codes), want)
    deq = np.asarray(dequantize_int8(q))
    np.testing.assert_array_equal(deq[:, 5], 0)
    assert np.all(np.abs(deq - w) <= absmax / 254 + 2 * F32_EPS * absmax)


# --- tiles ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,double_quant", [((48, 192), True), ((40, 96), False)])
def test_nf4_tiles_equal_rows_of_the_whole(shape, double_quant):
    """A tile is exactly the same rows (and columns) of the whole dequantization, with a static
    start and with a traced one in a loop. 96 columns: a whole-rows tile starts on even rows."""
    q = quantize_nf4(normal(shape), double_quant=double_quant)
    full = np.asarray(dequantize_nf4(q, jnp.bfloat16))
    R, C = shape
    n_rows = 8
    for row0 in (0, 8, R - 8):
        tile = dequantize_nf4_tile(q, row0, n_rows, dtype=jnp.bfloat16)
        assert tile.shape == (n_rows, C) and tile.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(tile), full[row0:row0 + n_rows])

    @jax.jit
    def by_tiles(q):
        def body(i, acc):
            return jax.lax.dynamic_update_slice(acc, dequantize_nf4_tile(q, i * n_rows, n_rows, dtype=jnp.bfloat16),
                                                (i * n_rows, 0))
        return jax.lax.fori_loop(0, R // n_rows, body, jnp.zeros(shape, jnp.bfloat16))

    np.testing.assert_array_equal(np.asarray(by_tiles(q)), full)
    if C % 64 == 0:  # a window of whole blocks
        tile = jax.jit(lambda q, r: dequantize_nf4_tile(q, r, 16, 64, 128, jnp.bfloat16))(q, 24)
        np.testing.assert_array_equal(np.asarray(tile), full[24:40, 64:192])
    with pytest.raises(ValueError, match="blocks of 64"):
        dequantize_nf4_tile(q, 1, 8) if C % 64 else dequantize_nf4_tile(q, 0, 8, 32, 64)


def test_int8_tiles_equal_rows_of_the_whole():
    q = quantize_int8(normal((32, 40)))
    full = np.asarray(dequantize_int8(q, jnp.bfloat16))
    tile = jax.jit(lambda q, r: dequantize_int8_tile(q, r, 8, 16, 24, jnp.bfloat16))(q, 12)
    np.testing.assert_array_equal(np.asarray(tile), full[12:20, 16:40])
    assert dequantize_int8(q).dtype == jnp.float32  # the original's dtype by default


# --- bytes and errors ------------------------------------------------------------------------------------

def test_quantized_bytes_are_exact():
    """Stored bytes: nf4 with double quantization n/2 + n/64 + 4 * ceil(n / 16384) + 4, that is
    0.5 + 1/64 + 1/4096 = 0.515869140625 bytes (4.127 bits) a parameter plus 4 bytes (the
    issue's "about 0.53"); without it 0.5625; int8 1 + 4 / rows."""
    for shape in [(256, 1024), (40, 384), (3, 64, 128)]:
        w = normal(shape)
        for dq in (True, False):
            assert quantize_nf4(w, double_quant=dq).size_bytes == quantized_bytes(shape, "nf4", double_quant=dq)
        assert quantize_int8(w).size_bytes == quantized_bytes(shape, "int8")
    n = 4096 * 4096
    assert quantized_bytes((4096, 4096), "nf4") == n // 2 + n // 64 + 4 * (n // 16384) + 4 == 8_654_852
    assert quantized_bytes((4096, 4096), "nf4") / n == 0.515869140625 + 4 / n
    assert quantized_bytes((4096, 4096), "nf4", double_quant=False) / n == 0.5625
    assert quantized_bytes((4096, 4096), "int8") == n + 4 * 4096


def test_dequant_tile_bytes_bound_the_compiled_tile():
    """The working bytes the planner counts for one tile cover what XLA allocates for it (the
    output and its temporaries, from the compiled function's memory analysis)."""
    q4, q8 = quantize_nf4(normal((256, 512))), quantize_int8(normal((256, 512)))
    cases = [(lambda q, r: dequantize_nf4_tile(q, r, 64, dtype=jnp.bfloat16), q4, (64, 512), "nf4"),
             (lambda q, r: dequantize_nf4_tile(q, r, 64, 128, 256, jnp.float32), q4, (64, 256), "nf4"),
             (lambda q, r: dequantize_int8_tile(q, r, 64, dtype=jnp.bfloat16), q8, (64, 512), "int8")]
    for fn, q, (n_rows, n_cols), kind in cases:
        dtype = jnp.float32 if n_cols == 256 else jnp.bfloat16
        stats = jax.jit(fn).lower(q, 0).compile().memory_analysis()
        if stats is None:
            pytest.skip("this backend reports no memory analysis")
        used = stats.output_size_in_bytes + stats.temp_size_in_bytes
        assert stats.output_size_in_bytes == n_rows * n_cols * jnp.dtype(dtype).itemsize
        assert used <= dequant_tile_bytes(n_rows, n_cols, kind, dtype)


def test_bad_sizes_fail_in_one_line_before_any_array():
    for call in (lambda: quantized_bytes((3, 7), "nf4", name="blocks.0.attn.q.kernel"),
                 lambda: quantize_nf4(np.zeros((3, 7), np.float32), name="blocks.0.attn.q.kernel")):
        with pytest.raises(ConfigError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and "blocks.0.attn.q.kernel (3, 7)" in msg and "21 values" in msg
        assert "blocks of 64" in msg
    with pytest.raises(ConfigError, match="block 48 is not one of"):
        quantized_bytes((64, 64), "nf4", block=48)
    with pytest.raises(ConfigError, match="2 or more axes.*shape \\(64,\\)"):
        quantize_int8(np.zeros((64,), np.float32))
    with pytest.raises(ConfigError, match="unknown quantization 'nf3'"):
        quantized_bytes((64, 64), "nf3")


# --- quant_matmul: one output tile at a time -------------------------------------------------------

def kernels(n_out=200, n_in=96, seed=1):
    """The same weight as an nf4 torch weight [out, in] (96 values a row: its tiles are even rows,
    whole blocks) and an int8 kernel [in, out], each with its dense kernel K [in, out]: y = x @ K."""
    w = normal((n_out, n_in), seed=seed)
    q4, q8 = quantize_nf4(w), quantize_int8(np.ascontiguousarray(w.T))
    return [(q4, np.asarray(dequantize_nf4(q4)).T), (q8, np.asarray(dequantize_int8(q8)))]


def product_bound(a, b, eps=F32_EPS):
    """Higham's bound on a floating-point matrix product (Accuracy and Stability of Numerical
    Algorithms, section 3.1): |fl(a @ b) - a @ b| <= gamma_n * |a| @ |b| elementwise, gamma_n =
    n u / (1 - n u), u = eps / 2, n the contracted length, in any order of summation (a fused
    multiply-add only rounds less). A wrong or misplaced tile is off by about |a| @ |b| / sqrt(n)."""
    n, u = a.shape[-1], eps / 2
    return n * u / (1 - n * u) * (np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64)))


def assert_within(got, want, bound):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"error up to {(err / bound).max():.3g} times the bound"


@pytest.mark.parametrize("tile", [8, 48, 200, None])
def test_quant_matmul_equals_the_dense_product(tile):
    """x [B, L, in] @ K with q's arrays traced (jit): tiles of 8 (25 of them), 48 (4, and a
    remainder of 8), 200 (one) and the default; float32 within rounding of the exact product."""
    x = jnp.asarray(normal((2, 3, 96), 1.0, seed=2))
    matmul = jax.jit(quant_matmul, static_argnames="tile")
    for q, K in kernels():
        y = matmul(x, q, tile=tile)
        assert y.shape == (2, 3, 200) and y.dtype == jnp.float32
        assert_within(y, np.asarray(x, np.float64) @ K, product_bound(x, K))


def test_quant_matmul_gradient_is_the_dense_one():
    """d/dx sum(c * quant_matmul(x, q)) = c @ K.T, jitted, with tiles of 48 and a remainder: its
    float32 sum over 200 output channels (in tiles, then across them) is within gamma_200 of the
    exact one, as is the dense product's gradient. The frozen kernel gets a zero gradient when
    one is asked for (allow_int: float0 for its integer codes, 0.0 for float scales)."""
    x, c = jnp.asarray(normal((2, 3, 96), 1.0, seed=2)), jnp.asarray(normal((2, 3, 200), 1.0, seed=3))
    for q, K in kernels():
        def loss(x, q):
            return jnp.sum(c * quant_matmul(x, q, 48))
        grad = jax.jit(jax.grad(loss))(x, q)
        dense = jax.grad(lambda x: jnp.sum(c * (x @ jnp.asarray(K))))(x)
        want, bound = np.asarray(c, np.float64) @ K.T, product_bound(c, K.T)
        assert grad.dtype == jnp.float32 and grad.shape == x.shape
        assert_within(grad, want, bound)
        assert_within(grad, np.asarray(dense, np.float64), 2 * bound)
        grad_x, grad_q = jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))(x, q)
        np.testing.assert_array_equal(np.asarray(grad_x), np.asarray(grad))
        assert type(grad_q) is type(q) and grad_q.codes.dtype == jax.dtypes.float0
        for leaf in jax.tree_util.tree_leaves(grad_q):
            assert leaf.dtype == jax.dtypes.float0 or not np.any(np.asarray(leaf))


def test_quant_matmul_in_bfloat16():
    """bf16 x: the tiles are dequantized into bf16 (one rounding of each weight) and multiplied
    as jnp.matmul does, out in bf16; within one bf16 rounding at the values' scale of the exact
    product of those bf16 weights. The gradient is bf16 too, summed in float32."""
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    x = jnp.asarray(normal((2, 3, 96), 1.0, seed=2), jnp.bfloat16)
    c = jnp.asarray(normal((2, 3, 200), 1.0, seed=3), jnp.bfloat16)
    for q, K in kernels():
        K16 = np.asarray(jnp.asarray(K).astype(jnp.bfloat16), np.float64)
        x64, c64 = np.asarray(x, np.float64), np.asarray(c, np.float64)
        y = jax.jit(quant_matmul, static_argnames="tile")(x, q, tile=48)
        assert y.dtype == jnp.bfloat16
        assert_within(y, x64 @ K16, eps * (np.abs(x64) @ np.abs(K16)))
        assert quant_matmul(x, q, 48, jnp.float32).dtype == jnp.float32
        grad = jax.grad(lambda x: jnp.sum(c.astype(jnp.float32) * quant_matmul(x, q, 48, jnp.float32)))(x)
        assert grad.dtype == jnp.bfloat16
        assert_within(grad, c64 @ K16.T, eps * (np.abs(c64) @ np.abs(K16.T)))


def test_quant_tile_default_fits_the_budget(monkeypatch):
    """The default tile: all of ``out`` when it fits QUANT_TILE_BYTES, else the most output
    channels that fit, or a divisor of ``out`` within half of that; nf4 on whole blocks."""
    row = quant_tile_bytes((200, 96), "nf4", 2, jnp.float32) // 2  # bytes a row, rows in pairs
    col = quant_tile_bytes((96, 97), "int8", 1, jnp.float32)
    assert row == 96 * 4 + 8 * 96 // 64 and col == 96 * 4 + 4
    assert quant_tile((200, 96), "nf4", jnp.float32) == 200  # 32 MiB hold it all
    for budget, kind, shape, want in [(45 * row, "nf4", (200, 96), 40),  # 44 fit (even); 40 divides 200
                                      (45 * col, "int8", (96, 97), 45),  # 97 is prime: 2 tiles of 45 and 7
                                      (0, "int8", (96, 97), 1)]:  # never under one channel
        monkeypatch.setattr(quant, "QUANT_TILE_BYTES", budget)
        tile = quant_tile(shape, kind, jnp.float32)
        assert tile == want and quant_tile_bytes(shape, kind, tile, jnp.float32) <= max(budget, col)
    q = quantize_int8(normal((96, 97)))
    x = jnp.asarray(normal((3, 96), 1.0, seed=2))
    K = np.asarray(dequantize_int8(q))
    monkeypatch.setattr(quant, "QUANT_TILE_BYTES", 45 * col)
    assert_within(quant_matmul(x, q), np.asarray(x, np.float64) @ K, product_bound(x, K))


def test_quant_matmul_bad_arguments_fail_in_one_line():
    (q4, _), (q8, _) = kernels()
    x = jnp.zeros((3, 96))
    for q, tile, match in [(q4, 7, "tile 7 of kernel \\(200, 96\\) must be 1 to 200 .*multiple of 2"),
                           (q4, 0, "tile 0 "), (q8, 201, "tile 201 of kernel \\(96, 200\\) must be 1 to 200"),
                           (q8, 2.5, "tile 2.5 ")]:
        with pytest.raises(ValueError, match=match) as err:
            quant_matmul(x, q, tile)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs x's last axis to be 96"):
        quant_matmul(jnp.zeros((3, 200)), q4)
    with pytest.raises(ValueError, match="kernel of 2 axes"):
        quant_matmul(x, quantize_int8(normal((2, 48, 8))))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quant_matmul_keeps_one_tile_live(kind):
    """The compiled forward and backward of a kernel 16 tiles large (out 4096, in 1024, tiles of
    256: 16 MiB dequantized in float32, a tile 1 MiB) allocate temporaries within two tiles'
    working bytes (the tile and room for, say, a transposed copy of it) plus the activations'
    buffers (x, y and the float32 dx). Dequantizing the whole kernel would take its 16 MiB,
    several times that bound; so would keeping every tile for the backward."""
    w = normal((4096, 1024))
    q = quantize_nf4(w) if kind == "nf4" else quantize_int8(np.ascontiguousarray(w.T))
    x = jnp.asarray(normal((2, 8, 1024), 1.0))
    whole = 4096 * 1024 * 4
    bound = 2 * quant_tile_bytes(q.shape, kind, 256, jnp.float32) + 4 * (2 * x.size + 2 * 8 * 4096)
    assert bound < whole / 4
    forward = jax.jit(lambda x, q: quant_matmul(x, q, 256))
    backward = jax.jit(jax.grad(lambda x, q: jnp.sum(quant_matmul(x, q, 256))))
    for fn in (forward, backward):
        stats = fn.lower(x, q).compile().memory_analysis()
        if stats is None:
            pytest.skip("this backend reports no memory analysis")
        assert stats.temp_size_in_bytes <= bound


# --- bitsandbytes, bit for bit -------------------------------------------------------------------

@pytest.fixture(scope="module")
def bnb():
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    return torch, functional


def from_bnb(packed, state, dtype) -> NF4Tensor:
    """bitsandbytes' quantize_4bit output as an NF4Tensor (the same arrays)."""
    nested = state.state2 is not None
    return NF4Tensor(jnp.asarray(packed.numpy().reshape(-1)), jnp.asarray(state.absmax.numpy()),
                     jnp.asarray(state.state2.absmax.numpy()) if nested else None,
                     jnp.asarray(state.offset.numpy()) if nested else None, tuple(state.shape), jnp.dtype(dtype), 64)


def test_tables_equal_bitsandbytes(bnb):
    _, F = bnb
    np.testing.assert_array_equal(NF4_CODE, F.get_4bit_type("nf4", device="cpu").numpy())
    np.testing.assert_array_equal(DYNAMIC_CODE, F.create_dynamic_map().numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_nf4_equals_bitsandbytes(bnb, dtype):
    """Codes and absmax of quantize_4bit bit for bit, and dequantize_4bit of its own state
    (with and without compress_statistics) bit for bit."""
    torch, F = bnb
    w = jnp.asarray(normal((40, 384)), dtype)
    t = torch.from_numpy(np.array(w.astype(jnp.float32))).to(getattr(torch, dtype))
    for dq in (False, True):
        packed, state = F.quantize_4bit(t, blocksize=64, compress_statistics=dq, quant_type="nf4")
        q = quantize_nf4(w, double_quant=dq)
        np.testing.assert_array_equal(np.asarray(q.codes), packed.numpy().reshape(-1))
        if not dq:
            np.testing.assert_array_equal(np.asarray(q.absmax), state.absmax.numpy())
        theirs = F.dequantize_4bit(packed, state).float().numpy()
        ours = jax.jit(dequantize_nf4)(from_bnb(packed, state, dtype))
        assert ours.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), theirs)


def test_nf4_double_quant_equals_bitsandbytes(bnb):
    """compress_statistics: the offset is the absmaxes' mean (ours in float64, rounded once;
    torch's float32 mean may differ in the last bit, so the data here has an exact mean:
    multiples of 2**-12, 1024 blocks). Then the second level's absmax equals bitsandbytes' bit
    for bit, and its 8-bit codes equal those of bitsandbytes' reference (pure torch) backend.
    Its CPU kernel instead rounds through a 65536-entry lookup table: it may differ by one step
    where a value lies within a table bin (2/65535) of a midpoint between two codes."""
    torch, F = bnb
    w = np.clip(np.round(normal((256, 256), 0.25) * 4096) / 4096, -0.999, 0.999).astype(np.float32)
    t = torch.from_numpy(w)
    packed, state = F.quantize_4bit(t, blocksize=64, compress_statistics=True, quant_type="nf4")
    q = quantize_nf4(w)
    assert np.asarray(q.offset) == state.offset.item()
    np.testing.assert_array_equal(np.asarray(q.absmax_scale), state.state2.absmax.numpy())
    _, plain = F.quantize_4bit(t, blocksize=64, compress_statistics=False, quant_type="nf4")
    centred = plain.absmax - state.offset
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    reference = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    ref_codes, ref_absmax = op.redispatch(reference, centred, F.create_dynamic_map(), 256)
    np.testing.assert_array_equal(ref_absmax.numpy(), state.state2.absmax.numpy())
    np.testing.assert_array_equal(np.asarray(q.absmax), ref_codes.numpy())
    ours, cpu = np.asarray(q.absmax).astype(int), state.absmax.numpy().astype(int)
    off = ours != cpu
    assert off.mean() < 0.01 and np.all(np.abs(ours - cpu)[off] == 1)
    normed = (centred.view(-1, 256) * (1 / state.state2.absmax[:, None])).reshape(-1).numpy()
    mids = (DYNAMIC_CODE[:-1] + DYNAMIC_CODE[1:]) / 2
    assert np.all(np.abs(normed[off] - mids[np.minimum(ours, cpu)[off]]) <= 2 / 65535)
    # our dequantization of our state equals bitsandbytes' wherever the codes agree
    theirs = F.dequantize_4bit(packed, state).numpy().reshape(-1, 64)
    np.testing.assert_array_equal(np.asarray(dequantize_nf4(q)).reshape(-1, 64)[~off], theirs[~off])


def test_int8_equals_bitsandbytes(bnb):
    """int8_vectorwise_quant on the torch layout [out, in] (our kernel's transpose)."""
    torch, F = bnb
    w = normal((64, 48))
    codes, absmax, _ = F.int8_vectorwise_quant(torch.from_numpy(np.ascontiguousarray(w.T)))
    q = quantize_int8(w)
    np.testing.assert_array_equal(np.asarray(q.codes), codes.numpy().T)
    np.testing.assert_array_equal(np.asarray(q.absmax), absmax.numpy())
    np.testing.assert_array_equal(np.asarray(dequantize_int8(q)), F.int8_vectorwise_dequant(codes, absmax).numpy().T)
