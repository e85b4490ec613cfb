"""The models' sequence tiling (head loss, attention, MLP): equal to the untiled computation, and
the head stage's backward memory no longer grows with L x V."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models.gpt import GPTConfig, StagedGPT, attention_segments
from pstar_models.llama import Llama, LinearRopeScaling, Llama3RopeScaling, LlamaConfig, StagedLlama
from pstar_jax import compat
from pstar_jax.model.attention import causal_attention, tile_queries
from pstar_jax.data.batch import Batch, from_rows
from pstar_jax.model.loss import tile_positions
from pstar_jax.model.nnx_staged import NNXStaged
from pstar_jax.model.staged import compose_loss, masked_loss_sum, token_cross_entropy
from pstar_jax.model.tiling import TileBudget, mlp_tile

EPS32 = float(np.finfo(np.float32).eps)
B, L = 2, 37  # L is no multiple of the tiles: the last tile of each kind is padded

GPT_TINY = GPTConfig(vocab_size=97, d_model=32, n_layer=2, n_head=2, seq_len=40)
LLAMA = LlamaConfig(vocab_size=101, d_model=36, n_layer=2, n_head=6, n_kv_head=2, d_ff=56, seq_len=40,
                    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16))  # GQA, Llama 3.1 rope scaling
FAMILIES = {
    "gpt": GPT_TINY,
    "gpt_untied": dataclasses.replace(GPT_TINY, tie_embeddings=False),
    "llama": LLAMA,
    "qwen_tied": dataclasses.replace(LLAMA, qkv_bias=True, family="qwen2", tie_embeddings=True, rope_scaling=None),
    "mistral": dataclasses.replace(LLAMA, head_dim=10, family="mistral", rope_scaling=None),
    "qwen3": dataclasses.replace(LLAMA, head_dim=10, family="qwen3", qk_norm=True, rope_scaling=None),
    "gemma3": dataclasses.replace(LLAMA, head_dim=10, family="gemma3_text", qk_norm=True, rope_scaling=LinearRopeScaling(4.0),
                               layer_types=("sliding_attention", "full_attention"), sliding_window=5,
                               rope_local_theta=100.0, query_pre_attn_scalar=7.0, final_softcap=3.0),
}


def staged(config, tiling=TileBudget()):
    return (StagedGPT if isinstance(config, GPTConfig) else StagedLlama)(config, tiling)


def small_tiles(config) -> TileBudget:
    """Budgets of 8 positions (loss: 8 of the B*L tokens; attention and MLP: 8 of L per tile)."""
    d_hidden = config.mlp_ratio * config.d_model if isinstance(config, GPTConfig) else config.d_ff
    return TileBudget(logits_bytes=4 * config.vocab_size * 8, scores_bytes=4 * B * config.n_head * L * 8,
                      mlp_bytes=4 * B * d_hidden * 8)


def test_small_budgets_give_several_tiles_and_default_ones_give_one():
    for config in FAMILIES.values():
        t = small_tiles(config)
        d_hidden = config.mlp_ratio * config.d_model if isinstance(config, GPTConfig) else config.d_ff
        assert tile_positions(B * L, config.vocab_size, t.logits_bytes) == 8
        assert tile_queries(B, config.n_head, L, t.scores_bytes) == 8
        assert mlp_tile(B, L, d_hidden, t.mlp_bytes) == 8
        d = TileBudget()
        assert tile_positions(B * L, config.vocab_size, d.logits_bytes) == B * L
        assert tile_queries(B, config.n_head, L, d.scores_bytes) == L and mlp_tile(B, L, d_hidden, d.mlp_bytes) == L


def packed_batch(config, seed=0) -> Batch:
    """Row 0: two examples then padding; row 1: one example filling the row."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (B, L + 1))
    segments = np.stack([np.r_[np.full(15, 1), np.full(14, 2), np.zeros(L + 1 - 29)], np.ones(L + 1)]).astype(np.int32)
    return jax.tree.map(jnp.asarray, from_rows(tokens, segments, np.ones((B, L + 1))))


def plain_batch(config, seed=1) -> Batch:
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (B, L + 1))
    return jax.tree.map(jnp.asarray, from_rows(tokens, np.ones((B, L + 1), np.int32), np.ones((B, L + 1))))


def reference_loss(model, params, batch: Batch) -> jax.Array:
    """The untiled computation: the whole module's logits, token cross entropy, the masked mean."""
    logits = model.module(params)(batch.tokens, batch.segment_ids, batch.positions)
    count = jnp.maximum(jnp.sum(batch.loss_mask), 1.0)
    return masked_loss_sum(token_cross_entropy(logits, batch.targets), batch.loss_mask) / count


def assert_fp32_close(actual, desired, err_msg=""):
    """Equal up to fp32 rounding at the values' scale."""
    desired = np.asarray(desired)
    atol = 64 * EPS32 * float(np.max(np.abs(desired)))
    np.testing.assert_allclose(np.asarray(actual), desired, rtol=0, atol=atol, err_msg=err_msg)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("config", FAMILIES.values(), ids=FAMILIES.keys())
def test_tiled_stages_equal_the_untiled_logits_loss_and_grads(config, packed):
    batch = (packed_batch if packed else plain_batch)(config)
    reference, tiled = staged(config), staged(config, small_tiles(config))
    params = reference.init_params(0)
    # The module's logits with attention and the MLP tiled (8 positions a tile) equal the untiled ones.
    want = reference.module(params)(batch.tokens, batch.segment_ids, batch.positions)
    got = tiled.module(params)(batch.tokens, batch.segment_ids, batch.positions)
    assert_fp32_close(got, want)
    loss_fn = compose_loss(tiled.stages(jnp.float32))
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    want_loss, want_grads = jax.value_and_grad(lambda p: reference_loss(reference, p, batch))(params)
    assert_fp32_close(loss, want_loss)
    for name in params:
        assert_fp32_close(grads[name], want_grads[name], err_msg=name)


def test_padding_attends_only_to_itself_and_examples_stay_apart():
    """attention_segments gives each padding position its own segment: the old models' mask."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 9, 2, 4)), jnp.float32) for _ in range(3))
    segments = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0, 0]], jnp.int32)
    out = causal_attention(q, k, v, attention_segments(segments), tile_q=4)
    np.testing.assert_allclose(out[0, 5:], v[0, 5:], rtol=1e-6, atol=1e-6)  # softmax over one key
    alone = causal_attention(q[:, 3:5], k[:, 3:5], v[:, 3:5])
    np.testing.assert_allclose(out[0, 3:5], alone[0], rtol=1e-5, atol=1e-6)
    assert attention_segments(None) is None


def head_backward_temp_bytes(model, length: int) -> int:
    """Compiled temp bytes of the head stage's forward + backward at batch 1, ``length`` tokens."""
    stage = model.stages(jnp.float32)[-1]
    shapes = model.param_shapes()
    params = tuple(jax.ShapeDtypeStruct(shapes[n], jnp.float32) for n in stage.param_names)
    h = jax.ShapeDtypeStruct((1, length, model.config.d_model), jnp.float32)
    i32 = jax.ShapeDtypeStruct((1, length), jnp.int32)
    batch = Batch(i32, i32, jax.ShapeDtypeStruct((1, length), jnp.float32), i32, i32)
    grad = jax.jit(jax.grad(stage.apply, argnums=(0, 1)))
    return int(grad.lower(params, h, batch).compile().memory_analysis().temp_size_in_bytes)


class WholeLogitsLlama(NNXStaged):
    """The head as it was: the module's logits [B, L, V], then token cross entropy (NNXStaged's
    path for a module without ``loss_sum``)."""

    def __init__(self, config: LlamaConfig):
        self.config = config
        super().__init__(lambda rngs, n: Llama(config, rngs=rngs, n_blocks=n), config.n_layer, seq_len=config.seq_len,
                         vocab_size=config.vocab_size, embed="embed_tokens", logits="unembed", loss_sum="absent")


def test_head_backward_memory_stays_flat_in_length_where_whole_logits_grew_with_l_times_v():
    config = LlamaConfig(vocab_size=4096, d_model=64, n_layer=1, n_head=4, n_kv_head=2, d_ff=128, seq_len=8192)
    tile_bytes = 4 * config.vocab_size * 256  # 256 positions a tile: 4 MiB of float32 logits
    tiled = StagedLlama(config, TileBudget(logits_bytes=tile_bytes))
    old = WholeLogitsLlama(config)
    new_1k, new_8k = (head_backward_temp_bytes(tiled, n) for n in (1024, 8192))
    old_1k, old_8k = (head_backward_temp_bytes(old, n) for n in (1024, 8192))
    logits_growth = 4 * (8192 - 1024) * config.vocab_size  # one float32 copy of the added logits
    assert old_8k - old_1k >= logits_growth  # the old head held several L x V buffers
    # The tiled head grows only with L x D (h, its norm, their gradients, the tiles' copies): at
    # most eight float32 L x D buffers, an eighth of one L x V copy at V = 64 D.
    assert new_8k - new_1k <= 8 * 4 * (8192 - 1024) * config.d_model, (new_1k, new_8k, old_1k, old_8k)
    assert new_8k <= 8 * tile_bytes


def block_backward_temp_bytes(model: NNXStaged, length: int, dtype=jnp.bfloat16) -> int:
    """Temp bytes of one block stage's compiled vjp (recomputed forward and backward), batch 1,
    compiled as pstar_jax.engine.stages compiles it (compat.compiler_options)."""
    stage = model.stages(dtype)[1]
    shapes = model.param_shapes()
    params = tuple(jax.ShapeDtypeStruct(shapes[n], dtype) for n in stage.param_names)
    h = jax.ShapeDtypeStruct((1, length, model.config.d_model), dtype)
    i32 = jax.ShapeDtypeStruct((1, length), jnp.int32)
    batch = Batch(i32, i32, jax.ShapeDtypeStruct((1, length), jnp.float32), i32, i32)

    def backward(p, x, gy, b):
        _, vjp = jax.vjp(lambda p, x: stage.apply(p, x, b), p, x)
        return vjp(gy)
    compiled = jax.jit(backward, compiler_options=compat.compiler_options("cpu")).lower(params, h, h, batch).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_block_backward_memory_grows_by_a_few_activations_per_token():
    # Llama 3.1 8B's proportions (GQA 4:1, d_ff 3.5 d) at d_model 128; tiles of fixed bytes, so
    # what grows with L is what the backward keeps per position, not one tile's intermediates.
    config = LlamaConfig(vocab_size=256, d_model=128, n_layer=1, n_head=8, n_kv_head=2, d_ff=448, seq_len=8192)
    budget = TileBudget(scores_bytes=4 * 8 * 4096 * 16, mlp_bytes=4 * 448 * 64)
    model = StagedLlama(config, budget)
    short, long = (block_backward_temp_bytes(model, n) for n in (2048, 4096))
    per_token = (long - short) / 2048
    # The gradient, q, k, v, the attention output and their gradients in bf16, k/v's float32
    # gradient sums: 12.1 bytes per d_model measured (2026-12-02). It was 26 while every loop's
    # output buffers were created at the program's start and k, v were widened to float32 for
    # the attention loop, 73 when the norms, q/k/v projections and RoPE tables were whole.
    assert per_token <= 15 * config.d_model, per_token / config.d_model
