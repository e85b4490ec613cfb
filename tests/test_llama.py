"""The Llama-family model: stages equal the module, HF's numerics conventions, presets, engines."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import pstar_models
from pstar_models.llama import (PRESETS, Llama, Llama3RopeScaling, LlamaConfig, StagedLlama, apply_rope,
                          causal_attention, llama_from_params, preset, rms_norm, rope_inv_freq, rope_tables)
from pstar_jax.config import EngineConfig, OptimConfig
from pstar_jax.planner.build import chunked_engine
from pstar_jax.plan.machine import H200
from pstar_jax.engine.optim import default_tx
from pstar_jax.engine.plain import PlainEngine
from pstar_jax.data.batch import plain
from pstar_jax.model.staged import compose_loss, validate_stages

# Odd sizes: 6 query heads in 2 groups of 3, head width 6, a vocabulary of 101.
ODD = LlamaConfig(vocab_size=101, d_model=36, n_layer=2, n_head=6, n_kv_head=2, d_ff=56, seq_len=32,
                  rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16))
QWEN = dataclasses.replace(ODD, qkv_bias=True, family="qwen2", tie_embeddings=True, rope_scaling=None)
WIDE_HEADS = dataclasses.replace(ODD, head_dim=10, family="mistral", rope_scaling=None)  # H*K != D
QWEN3 = dataclasses.replace(WIDE_HEADS, family="qwen3", qk_norm=True, tie_embeddings=True)  # q/k norms
CONFIGS = {"llama": ODD, "qwen_tied": QWEN, "head_dim": WIDE_HEADS, "qwen3": QWEN3}


def assert_fp32_close(actual, desired, err_msg=""):
    """Equal up to fp32 rounding at the values' scale (sums of a few hundred terms)."""
    desired = np.asarray(desired)
    atol = 64 * np.finfo(np.float32).eps * float(np.max(np.abs(desired)))
    np.testing.assert_allclose(actual, desired, rtol=0, atol=atol, err_msg=err_msg)


def batch(config, B=2, L=16, seed=1):
    tokens = jax.random.randint(jax.random.key(seed), (B, L + 1), 0, config.vocab_size)
    return tokens[:, :-1], tokens[:, 1:]


def module_params(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_stages_compose_to_module_loss_and_grads(config):
    staged = StagedLlama(config)
    stages = staged.stages(jnp.float32)
    validate_stages(stages, staged.param_shapes())
    params = staged.init_params(0)
    tokens, targets = batch(config)
    loss = compose_loss(stages)(params, tokens, targets)
    # The head stage's loss is tiled (pstar_jax.model.loss), the module's the whole-logits mean: equal
    # to fp32 rounding, not bit for bit.
    assert_fp32_close(loss, llama_from_params(config, params).loss(tokens, targets))
    grads = jax.grad(compose_loss(stages))(params, tokens, targets)
    module_grads = jax.grad(lambda p: llama_from_params(config, p).loss(tokens, targets))(params)
    for name in params:
        assert_fp32_close(grads[name], module_grads[name], err_msg=name)
    assert len({id(s.apply) for s in stages[1:-1]}) == 1, "blocks must share one apply (one compile)"


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_parameter_names_and_shapes_are_the_contract(config):
    staged = StagedLlama(config)
    D, V, F, K = config.d_model, config.vocab_size, config.d_ff, config.d_head
    HK, NK = config.n_head * K, config.n_kv_head * K
    block = {"attn_norm.scale": (D,), "attn.q.kernel": (D, HK), "attn.k.kernel": (D, NK),
             "attn.v.kernel": (D, NK), "attn.o.kernel": (HK, D), "mlp_norm.scale": (D,),
             "mlp.gate.kernel": (D, F), "mlp.up.kernel": (D, F), "mlp.down.kernel": (F, D)}
    if config.qkv_bias:
        block.update({"attn.q.bias": (HK,), "attn.k.bias": (NK,), "attn.v.bias": (NK,)})
    if config.qk_norm:  # over each head's width
        block.update({"attn.q_norm.scale": (K,), "attn.k_norm.scale": (K,)})
    expected = {"embed.embedding": (V, D), "norm.scale": (D,),
                **{f"blocks.{i}.{n}": s for i in range(config.n_layer) for n, s in block.items()}}
    if not config.tie_embeddings:
        expected["head.kernel"] = (D, V)
    assert staged.param_shapes() == expected
    names = list(staged.param_shapes())
    assert names[0] == "embed.embedding" and names[-1] == ("norm.scale" if config.tie_embeddings else "head.kernel")
    assert names.index("blocks.0.attn.q.kernel") < names.index("blocks.0.mlp.down.kernel") < names.index(
        "blocks.1.attn_norm.scale"), "forward order decides the chunk layout"
    assert set(module_params(Llama(config, rngs=nnx.Rngs(0)))) == set(expected)


def test_init_tensor_alone_deterministic_and_scaled():
    staged = StagedLlama(dataclasses.replace(ODD, vocab_size=4096, n_layer=8))
    params = staged.init_params(3)
    for name, value in params.items():
        assert value.dtype == jnp.float32, name
        np.testing.assert_array_equal(value, staged.init_tensor(name, 3), err_msg=name)
    assert np.all(np.asarray(params["norm.scale"]) == 1)
    emb = np.asarray(params["embed.embedding"])
    assert abs(emb.std() - 0.02) < 1e-3
    down = np.asarray(params["blocks.0.mlp.down.kernel"])
    assert abs(down.std() - 0.02 / 4) < 2e-3, "residual projections shrink with depth (n_layer=8)"
    assert not np.array_equal(params["blocks.0.attn.q.kernel"], params["blocks.1.attn.q.kernel"])
    assert not np.array_equal(params["embed.embedding"], staged.init_tensor("embed.embedding", 4))
    qwen = StagedLlama(QWEN).init_params(0)
    assert not np.any(np.asarray(qwen["blocks.0.attn.q.bias"]))
    qwen3 = StagedLlama(QWEN3).init_params(0)
    assert np.all(np.asarray(qwen3["blocks.1.attn.k_norm.scale"]) == 1)  # as HF's Qwen3RMSNorm starts


def test_n_blocks_builds_a_shell_with_the_full_depth_init_scale():
    shell = Llama(dataclasses.replace(ODD, n_layer=50), rngs=nnx.Rngs(0), n_blocks=1)
    assert len(shell.blocks) == 1
    std = np.asarray(shell.blocks[0].mlp.down.kernel[...]).std()
    assert abs(std - 0.02 / 10) < 5e-4
    assert len(Llama(ODD, rngs=nnx.Rngs(0), n_blocks=0).blocks) == 0


def test_rms_norm_multiplies_the_weight_after_casting_back():
    x = jax.random.normal(jax.random.key(0), (3, 7), jnp.bfloat16) * 5
    w = (1 + jax.random.normal(jax.random.key(1), (7,))).astype(jnp.bfloat16)
    x32 = x.astype(jnp.float32)
    normed = (x32 / jnp.sqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, w[None, :] * normed)


def test_llama3_rope_scaling_keeps_high_slows_low_and_blends_between():
    config = dataclasses.replace(ODD, d_model=96, n_head=6, head_dim=16, rope_theta=10000.0, rope_scaling=None)
    plain = rope_inv_freq(config)
    np.testing.assert_allclose(plain, 10000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)
    s = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    scaled = rope_inv_freq(dataclasses.replace(config, rope_scaling=s))
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 64 / 4, wavelen > 64 / 1
    assert high.any() and low.any() and (~high & ~low).any(), "the test must cover all three bands"
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-6)
    mid = ~high & ~low
    assert np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)


def test_rope_scores_depend_only_on_relative_position():
    """q.k after RoPE at positions (i, j) equals that at (i+s, j+s): the rotate_half pairing is a rotation."""
    cos, sin = rope_tables(ODD, 20)
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, ODD.d_head))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, ODD.d_head))

    def score(i, j):
        return float(jnp.sum(apply_rope(q, cos[i:i + 1], sin[i:i + 1]) * apply_rope(k, cos[j:j + 1], sin[j:j + 1])))
    for i, j, s in [(5, 2, 7), (3, 3, 11), (9, 0, 4)]:
        np.testing.assert_allclose(score(i, j), score(i + s, j + s), rtol=1e-5, atol=1e-6)
    assert abs(score(5, 2) - score(6, 2)) > 1e-4


def test_grouped_attention_equals_repeated_kv_heads():
    """Head h reads kv head h // 3 (HF's repeat_kv), causally, with softmax in float32."""
    B, L, H, N, K = 2, 5, 6, 2, 4
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, L, H, K))
    k = jax.random.normal(keys[1], (B, L, N, K))
    v = jax.random.normal(keys[2], (B, L, N, K))
    out = np.asarray(causal_attention(q, k, v))
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    for h in range(H):
        s = np.einsum("blk,bmk->blm", qn[:, :, h], kn[:, :, h // 3]) / np.sqrt(K)
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[:, :, h], np.einsum("blm,bmk->blk", p, vn[:, :, h // 3]), rtol=1e-5, atol=1e-6)


def test_logits_are_causal():
    model = Llama(ODD, rngs=nnx.Rngs(0))
    tokens, _ = batch(ODD, B=1, L=12)
    changed = tokens.at[0, 8].set((tokens[0, 8] + 1) % ODD.vocab_size)
    a, b = model(tokens), model(changed)
    np.testing.assert_array_equal(a[0, :8], b[0, :8])
    assert not np.allclose(a[0, 8:], b[0, 8:])


@pytest.mark.parametrize("field,value", [("n_kv_head", 4), ("d_model", 35), ("head_dim", 7), ("family", "gemma"),
                                         ("qkv_bias", True), ("norm_eps", 0.0), ("vocab_size", 0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(ODD, **{field: value})


def test_rope_scaling_validated():
    with pytest.raises(ValueError, match="high_freq_factor"):
        Llama3RopeScaling(8.0, 4.0, 1.0, 8192)


# Published sizes (safetensors totals of the HF checkpoints).
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
             "llama-3.1-70b": 70_553_706_496, "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512,
             "qwen2.5-14b": 14_770_033_664, "qwen2.5-32b": 32_763_876_352, "qwen2.5-72b": 72_706_203_648,
             "mistral-7b": 7_248_023_552,
             # Qwen3: the counts keras-team/keras-hub's qwen3_presets.py gives its conversions of the HF
             # checkpoints (each tensor once; a tied model's file may hold lm_head.weight as well).
             "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096,
             "qwen3-8b": 8_190_735_360, "qwen3-14b": 14_768_307_200, "qwen3-32b": 32_762_123_264}


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_sizes_match_the_published_models(name):
    model = pstar_models.build_model(name)
    assert model.n_params() == PUBLISHED[name]
    assert model.config.seq_len == 4096
    c = model.config  # attention's width is n_head * head_dim (Qwen3: up to twice d_model)
    assert 0 < model.flops_per_token() < 6.2 * model.n_params() + 6 * c.n_layer * 4096 * c.n_head * c.d_head


def test_build_model_serves_every_preset_and_overrides():
    assert set(PRESETS) <= set(pstar_models.PRESET_NAMES) and "GPT2_1B" in pstar_models.PRESET_NAMES
    short = pstar_models.build_model("llama-3.1-8b", seq_len=2048, n_layer=2, d_model=None)
    assert short.config == dataclasses.replace(preset("llama-3.1-8b"), seq_len=2048, n_layer=2)
    assert type(pstar_models.build_model("tiny")).__name__ == "StagedGPT"
    with pytest.raises(ValueError, match="unknown model preset"):
        pstar_models.build_model("llama-9")


def test_flops_per_token_counts_matmul_params_and_attention():
    c = ODD
    m = StagedLlama(c)
    expected = 6 * (m.n_params() - c.vocab_size * c.d_model) + 6 * c.n_layer * c.seq_len * c.n_head * c.d_head
    assert m.flops_per_token() == expected
    tied = StagedLlama(QWEN)
    assert tied.flops_per_token() == 6 * tied.n_params() + 6 * c.n_layer * c.seq_len * c.n_head * c.d_head


# -- the engines train it ----------------------------------------------------------------------

OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=10, weight_decay=0.1, clip_norm=1.0)


def _steps(config, n, batch_size=4, seed=0):
    """The same batch n times, so that a working step visibly lowers its loss."""
    tok = np.random.default_rng(seed).integers(0, config.vocab_size, (batch_size, config.seq_len + 1))
    return [[(tok[:, :-1], tok[:, 1:])]] * n


@pytest.mark.parametrize("config", [ODD, QWEN], ids=["untied", "qwen_tied"])
def test_chunked_engine_equals_plain_engine_fp32(config):
    """Odd sizes, a chunk that is no multiple of the vocabulary, chunks moving: equal losses and params."""
    model = StagedLlama(config)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    engine = chunked_engine(model, EngineConfig(chunk_numel=4000, device_memory=None, precision="fp32"),
                           default_tx(OPTIM), mesh, (4, config.seq_len), H200, clip_norm=OPTIM.clip_norm)
    reference = PlainEngine(model, "fp32", default_tx(OPTIM), clip_norm=OPTIM.clip_norm)
    moved, la, lb = 0, [], []
    for step in _steps(config, 4):
        r = engine.step(step)
        moved += r.h2d_bytes + r.d2h_bytes
        la.append(r.loss)
        lb.append(reference.step(step).loss)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    assert la[-1] < la[0], "training lowers the loss"
    assert moved > 0, "the default budget holds half the model: chunks must move"
    pa, pb = engine.params(), reference.params()
    assert pa.keys() == pb.keys()
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_bf16_stages_stay_close_to_fp32():
    """bf16 compute (params cast by the engine) keeps the dtype through the blocks and the loss near fp32's."""
    staged = StagedLlama(ODD)
    params = staged.init_params(0)
    tokens, targets = batch(ODD)
    stages16 = staged.stages(jnp.bfloat16)
    side = plain(np.asarray(tokens), np.asarray(targets))
    h = stages16[0].apply((params["embed.embedding"].astype(jnp.bfloat16),), side.tokens, side)
    for stage in stages16[1:-1]:
        h = stage.apply(tuple(params[n].astype(jnp.bfloat16) for n in stage.param_names), h, side)
    assert h.dtype == jnp.bfloat16
    loss16 = compose_loss(stages16)({n: p.astype(jnp.bfloat16) for n, p in params.items()}, tokens, targets)
    loss32 = compose_loss(staged.stages(jnp.float32))(params, tokens, targets)
    assert loss16.dtype == jnp.float32
    np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
