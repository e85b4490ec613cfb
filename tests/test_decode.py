"""Decoding: the KV cache against the full forward, the streamed path against the cached one, sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models.gpt import GPTConfig, StagedGPT
from pstar_models.llama import LlamaConfig, StagedLlama
from pstar_models.llama_config import LinearRopeScaling, _llama3
from pstar_models.qwen35 import build_model as qwen35_model
from pstar_jax.model.nnx_staged import PerLayer
from pstar_jax.engine.decode import CachedDecoder, Sampling, StreamedDecoder, cache_bytes, sample, stream_peak_bytes

MODELS = {
    "gpt": lambda: StagedGPT(GPTConfig(vocab_size=97, d_model=36, n_layer=2, n_head=3, seq_len=24,
                                       tie_embeddings=False)),
    # GQA groups of 3, head_dim not d_model / n_head, Llama 3.1 frequency scaling
    "llama_gqa": lambda: StagedLlama(LlamaConfig(vocab_size=101, d_model=48, n_layer=2, n_head=6, n_kv_head=2,
                                                 d_ff=40, seq_len=24, head_dim=10, rope_scaling=_llama3(8.0))),
    "qwen2_tied": lambda: StagedLlama(LlamaConfig(vocab_size=89, d_model=32, n_layer=3, n_head=4, n_kv_head=1,
                                                  d_ff=48, seq_len=24, qkv_bias=True, family="qwen2",
                                                  tie_embeddings=True, rope_theta=1e6)),
    "qwen3": lambda: StagedLlama(LlamaConfig(vocab_size=89, d_model=32, n_layer=2, n_head=4, n_kv_head=2,
                                             d_ff=48, seq_len=24, head_dim=12, qk_norm=True, family="qwen3",
                                             tie_embeddings=True, rope_theta=1e6)),
    # 4 experts, 2 per token (not renormalised): the cache's tokens are routed one at a time;
    # layer 1 dense (mlp_only_layers), so the streamed decoder runs two kinds of block
    "qwen3_moe": lambda: StagedLlama(LlamaConfig(vocab_size=89, d_model=32, n_layer=3, n_head=4, n_kv_head=2,
                                                 d_ff=48, seq_len=24, head_dim=12, qk_norm=True, family="qwen3_moe",
                                                 n_experts=4, n_experts_per_tok=2, d_ff_expert=20,
                                                 norm_topk_prob=False, rope_theta=1e6, mlp_only_layers=(1,))),
    # sliding layers (window 4, shorter than the prompt plus the new tokens) beside a global one
    "gemma3": lambda: StagedLlama(LlamaConfig(vocab_size=89, d_model=32, n_layer=3, n_head=4, n_kv_head=2,
                                              d_ff=48, seq_len=24, head_dim=12, qk_norm=True, family="gemma3_text",
                                              tie_embeddings=True, rope_theta=1e6, rope_scaling=LinearRopeScaling(4.0),
                                              layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                                              sliding_window=4, rope_local_theta=100.0, query_pre_attn_scalar=10,
                                              final_softcap=3.0)),
    # Qwen3.5: Gated DeltaNet layers (a conv window and the delta rule's state per layer) before a
    # gated full-attention one with partial RoPE
    "qwen3_5": lambda: qwen35_model("qwen3.5-tiny", vocab_size=89, seq_len=24),
}
PROMPT = np.array([[5, 17, 3, 60, 2]], np.int32)
N_NEW = 12


def spread_params(model, seed=0):
    """Random weights 4x the init scale, biases and norms away from 0 and 1: logits far apart, so
    that rounding cannot decide an argmax."""
    rng = np.random.default_rng(seed)
    return {n: jnp.asarray(4 * np.asarray(v) + 0.1 * rng.standard_normal(v.shape).astype(np.float32))
            for n, v in model.init_params(seed).items()}


def greedy_full_forward(model, params, prompt_BxP, n_new):
    """Greedy decoding without a cache: the whole model on the whole sequence so far for every
    token. The sequence is padded at its end to one length, so that it compiles once: causal
    attention hides the padding from the positions read."""
    B, P = prompt_BxP.shape
    forward = jax.jit(lambda p, seq_BxL, at: model.module(p)(seq_BxL)[:, at])
    seq = np.zeros((B, P + n_new), np.int32)
    seq[:, :P] = prompt_BxP
    for t in range(P, P + n_new):
        seq[:, t] = np.argmax(forward(params, seq, t - 1), -1)
    return seq[:, P:]


@pytest.fixture(scope="module", params=MODELS.keys())
def model_params(request):
    model = MODELS[request.param]()
    return model, spread_params(model)


def test_decode_logits_equal_the_full_forward(model_params):
    """Prefill then single tokens through the cache: the full forward's logits at every position."""
    model, params = model_params
    module = model.module(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (2, 9)), jnp.int32)
    cache = module.init_cache(2, 16, jnp.float32)
    layers = list(cache) if isinstance(cache, PerLayer) else [jax.tree.map(lambda x: x[i], cache)
                                                              for i in range(model.n_layer)]
    assert len(layers) == model.n_layer and all(x.shape[0] == 2 for x in jax.tree.leaves(layers))
    first, cache = module.decode(tokens[:, :6], cache, 0)
    rest = []
    for p in range(6, 9):
        logits, cache = module.decode(tokens[:, p:p + 1], cache, p)
        rest.append(logits)
    want = np.asarray(module(tokens))
    # The cache changes the order of the attention sums, so the logits differ by fp32 rounding at
    # their scale (6-8 eps here, 16 on another x86 CPU): 64 eps of the largest logit.
    scale = float(np.abs(want).max())
    assert scale > 0.5, "spread weights should give logits well away from zero"
    np.testing.assert_allclose(np.concatenate([first, *rest], axis=1), want, rtol=0,
                               atol=64 * np.finfo(np.float32).eps * scale)


def test_cached_greedy_is_the_full_forward_on_the_growing_sequence(model_params):
    model, params = model_params
    got = CachedDecoder(model, jnp.float32, 1, PROMPT.shape[1], N_NEW, Sampling(temperature=0))(params, PROMPT)
    want = greedy_full_forward(model, params, PROMPT, N_NEW)
    assert got.shape == (1, N_NEW) and len(set(want[0])) > 2  # not a degenerate repetition
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=0.9, top_p=0.8, seed=7)],
                         ids=["greedy", "nucleus"])
def test_streamed_gives_the_cached_tokens(model_params, sampling):
    model, params = model_params
    cached = CachedDecoder(model, jnp.float32, 1, PROMPT.shape[1], N_NEW, sampling)(params, PROMPT)
    streamed = StreamedDecoder(model, jnp.float32)
    streamed.load((n, np.asarray(v)) for n, v in params.items())
    assert all(x.sharding.memory_kind == "pinned_host" for stage in streamed.host for x in stage)
    np.testing.assert_array_equal(streamed(PROMPT, N_NEW, sampling), cached)


def test_eos_stops_both_paths(model_params):
    model, params = model_params
    free = CachedDecoder(model, jnp.float32, 1, PROMPT.shape[1], N_NEW, Sampling(temperature=0))(params, PROMPT)[0]
    eos = int(free[4])
    stop = list(free).index(eos) + 1
    s = Sampling(temperature=0, eos_id=eos)
    cached = CachedDecoder(model, jnp.float32, 1, PROMPT.shape[1], N_NEW, s)(params, PROMPT)
    streamed = StreamedDecoder(model, jnp.float32)
    streamed.load(params.items())
    np.testing.assert_array_equal(cached[0], free[:stop])
    np.testing.assert_array_equal(streamed(PROMPT, N_NEW, s), cached)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    model = MODELS["gpt"]()
    params = spread_params(model)
    def run(seed):
        return CachedDecoder(model, jnp.float32, 1, PROMPT.shape[1], 16,
                             Sampling(temperature=1.5, seed=seed))(params, PROMPT)
    np.testing.assert_array_equal(run(3), run(3))
    assert not np.array_equal(run(3), run(4))


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = jnp.asarray(np.log(probs)[None], jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4000)
    draw = jax.vmap(lambda k, p: sample(logits, k, 1.0, p)[0], in_axes=(0, None))
    for top_p, kept in ((0.5, {1}), (0.7, {1, 3}), (0.79, {1, 3}), (0.81, {1, 2, 3}), (1.0, {0, 1, 2, 3})):
        tokens = np.asarray(draw(keys, top_p))
        assert set(np.unique(tokens)) == kept, top_p
        share = probs[sorted(kept)] / probs[sorted(kept)].sum()
        np.testing.assert_allclose(np.bincount(tokens, minlength=4)[sorted(kept)] / len(tokens), share, atol=0.03)
    assert int(sample(logits, keys[0], 0.0, 0.3)[0]) == 1  # temperature 0: argmax


def test_memory_figures():
    model = MODELS["llama_gqa"]()
    c = model.config
    assert cache_bytes(model, 3, 20, jnp.bfloat16) == 2 * c.n_layer * 3 * 20 * c.n_kv_head * c.d_head * 2
    streamed = StreamedDecoder(model, jnp.bfloat16)
    stage_bytes = streamed.stage_bytes()
    assert sum(stage_bytes) == 2 * sum(int(np.prod(s)) for s in model.param_shapes().values())  # untied
    assert stream_peak_bytes(stage_bytes, 100) == max(a + b for a, b in zip(stage_bytes, stage_bytes[1:])) + 100
    dec = CachedDecoder(model, jnp.float32, 1, 4, 4, Sampling(temperature=0))
    assert dec.device_bytes() >= 4 * sum(int(np.prod(s)) for s in model.param_shapes().values())
