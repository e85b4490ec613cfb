"""Hugging Face configs and weights: our logits equal transformers' for the same weights (fp32),
exported configs load in transformers, bad configs are refused with one line.

The comparisons need torch and transformers (a test extra); the config tests run without them.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models import build_from_hf, build_model, hf_config, hf_tensors
from pstar_models.gpt import GPTConfig, StagedGPT, gpt_from_params
from pstar_models.llama import PRESETS, LlamaConfig, StagedLlama, llama_from_params

# Tiny checkpoints with odd sizes: heads not a power of two, GQA groups of 3, odd vocabularies.
GPT2 = dict(model_type="gpt2", vocab_size=97, n_positions=40, n_embd=36, n_layer=2, n_head=3)
LLAMA = dict(model_type="llama", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
             max_position_embeddings=128, tie_word_embeddings=False,
             # head_dim 8 and a 64-token original context: the four frequencies fall in all three bands.
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64))
QWEN2 = dict(model_type="qwen2", vocab_size=103, hidden_size=30, intermediate_size=44, num_hidden_layers=2,
             num_attention_heads=3, num_key_value_heads=1, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=64, use_sliding_window=False, tie_word_embeddings=True)
MISTRAL = dict(model_type="mistral", vocab_size=107, hidden_size=36, intermediate_size=52, num_hidden_layers=2,
               num_attention_heads=6, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-5,
               max_position_embeddings=64, sliding_window=None, tie_word_embeddings=False)
# head_dim 12 with 4 heads of a width-32 model (n_head * head_dim != hidden_size), tied as the small sizes are.
QWEN3 = dict(model_type="qwen3", vocab_size=109, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=12, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=64, use_sliding_window=False, tie_word_embeddings=True)
CHECKPOINTS = {
    "gpt2": GPT2,
    "gpt2_untied": {**GPT2, "tie_word_embeddings": False},
    "llama3": LLAMA,
    "llama_head_dim": {**LLAMA, "head_dim": 12, "rope_scaling": None},  # n_head * head_dim != hidden_size
    "qwen2_tied": QWEN2,
    "qwen2_untied": {**QWEN2, "tie_word_embeddings": False},
    "mistral": MISTRAL,
    "mistral_window": {**MISTRAL, "sliding_window": 32},  # a window longer than seq_len changes nothing
    "qwen3_tied": QWEN3,
    "qwen3_untied": {**QWEN3, "tie_word_embeddings": False, "num_key_value_heads": 4},
}
SEQ_LEN = 24


def tokens_BxL(vocab_size, B=2, L=SEQ_LEN, seed=0):
    return np.random.default_rng(seed).integers(0, vocab_size, (B, L)).astype(np.int32)


def module_of(model, params):
    build = gpt_from_params if isinstance(model.config, GPTConfig) else llama_from_params
    return build(model.config, params)


def hf_reference(config, seed=0):
    """A transformers model for ``config`` with every weight random (norms and biases included)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf_cfg = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def hf_logits(hf_model, tokens):
    import torch
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens).long()).logits.numpy()


def saved_state(hf_model):
    """The tensors ``save_pretrained`` writes, as numpy: the hub's layout, which transformers 5.x
    keeps in its files while fusing a mixture of experts' weights in memory."""
    import tempfile
    from pathlib import Path
    from safetensors.numpy import load_file
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        state = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            state.update(load_file(f))
        return state


def to_pstar(model, state_dict):
    """Our parameters from an HF state dict, through hf_tensors."""
    shapes, params = model.param_shapes(), {}
    for name, (hf_name, transpose, truncate_rows) in hf_tensors(model).items():
        value = state_dict[hf_name]
        if truncate_rows:
            value = value[: shapes[name][0]]
        if transpose:
            value = value.T
        assert value.shape == shapes[name], name
        params[name] = jnp.asarray(value)
    return params


def assert_logits_match(ours, theirs):
    scale = float(np.abs(theirs).max())
    assert scale > 0.5, "random weights should give logits well away from zero"
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6 * scale)


@pytest.mark.hf_reference
@pytest.mark.parametrize("config", CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_hf_weights_give_hf_logits(config):
    hf_model = hf_reference(config)
    model = build_from_hf(config, seq_len=SEQ_LEN)
    state = saved_state(hf_model)
    params = to_pstar(model, state)
    used = {t.name for t in hf_tensors(model).values()}
    assert used == {k for k in state if not (k == "lm_head.weight" and model.config.tie_embeddings)}
    tokens = tokens_BxL(model.config.vocab_size)
    theirs = hf_logits(hf_model, tokens)
    assert_logits_match(np.asarray(module_of(model, params)(jnp.asarray(tokens))), theirs)

    # The staged chain (what the engines train) gives HF's loss.
    from pstar_jax.model.staged import compose_loss
    loss = compose_loss(model.stages(jnp.float32))(params, jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))
    logp = theirs[:, :-1] - np.log(np.exp(theirs[:, :-1]).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


EXPORTS = {
    "gpt2": GPTConfig(vocab_size=97, d_model=36, n_layer=2, n_head=3, seq_len=24),
    "gpt2_untied": GPTConfig(vocab_size=97, d_model=36, n_layer=2, n_head=3, seq_len=24, tie_embeddings=False),
    "llama3": build_from_hf(LLAMA, seq_len=SEQ_LEN).config,
    "llama_head_dim": LlamaConfig(vocab_size=101, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=80, seq_len=24,
                                  head_dim=12),
    "qwen2_tied": build_from_hf(QWEN2).config,
    "mistral": build_from_hf(MISTRAL).config,
    "qwen3_tied": build_from_hf(QWEN3).config,
    "qwen3_untied": build_from_hf(CHECKPOINTS["qwen3_untied"]).config,
}


@pytest.mark.hf_reference
@pytest.mark.parametrize("config", EXPORTS.values(), ids=EXPORTS.keys())
def test_export_loads_in_transformers_with_the_same_logits(config, tmp_path, source=None):
    """Our config.json and our weights under hf_tensors' names: from_pretrained loads them with no
    missing or unexpected tensor, and gives our logits."""
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import save_file
    model = StagedGPT(config) if isinstance(config, GPTConfig) else StagedLlama(config)
    rng = np.random.default_rng(1)
    params = {n: np.asarray(v) + 0.05 * rng.standard_normal(v.shape).astype(np.float32)
              for n, v in model.init_params(0).items()}  # norms and biases away from 1 and 0
    tensors = {hf: np.ascontiguousarray(params[n].T if t else params[n]) for n, (hf, t, _) in hf_tensors(model).items()}
    exported = hf_config(model, torch_dtype="float32", source=source)
    for hf, _, truncate in hf_tensors(model).values():  # the source's rows beyond seq_len, which an export puts back
        extra = exported.get("n_positions", 1024) - tensors[hf].shape[0] if truncate else 0
        if extra:
            tensors[hf] = np.concatenate([tensors[hf], rng.standard_normal((extra, tensors[hf].shape[1]), np.float32)])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(exported))
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    tokens = tokens_BxL(config.vocab_size)
    ours = np.asarray(module_of(model, {n: jnp.asarray(v) for n, v in params.items()})(jnp.asarray(tokens)))
    assert_logits_match(ours, hf_logits(hf_model.float().eval(), tokens))


# -- configs: round trips and refusals (no transformers needed) --------------------------------


@pytest.mark.parametrize("name", ["tiny", "GPT2_1B", *PRESETS])
def test_hf_config_round_trips_every_preset(name):
    model = build_model(name)
    exported = hf_config(model)
    assert json.loads(json.dumps(exported)) == exported
    assert build_from_hf(exported).config == model.config


@pytest.mark.parametrize("config", [c for n, c in CHECKPOINTS.items() if n != "mistral_window"],
                         ids=[n for n in CHECKPOINTS if n != "mistral_window"])
def test_checkpoint_configs_round_trip(config):
    model = build_from_hf(config, seq_len=SEQ_LEN)
    assert build_from_hf(hf_config(model), seq_len=SEQ_LEN).config == model.config


def test_hf_tensors_names_every_parameter_once():
    for name in ("tiny", "llama-tiny", "qwen2.5-0.5b", "llama-3.1-8b"):
        model = build_model(name, n_layer=3)
        names = hf_tensors(model)
        assert list(names) == list(model.param_shapes())
        assert len({t.name for t in names.values()}) == len(names)
    gpt = hf_tensors(build_model("tiny", tie_embeddings=False))
    assert gpt["wpe"] == ("transformer.wpe.weight", False, True)
    assert gpt["blocks.1.attn.qkv.kernel"] == ("transformer.h.1.attn.c_attn.weight", False, False)
    assert gpt["head.kernel"] == ("lm_head.weight", True, False)
    qwen = hf_tensors(build_model("qwen2.5-7b", n_layer=1))
    assert qwen["blocks.0.attn.k.bias"] == ("model.layers.0.self_attn.k_proj.bias", False, False)
    assert qwen["blocks.0.mlp.down.kernel"] == ("model.layers.0.mlp.down_proj.weight", True, False)
    assert qwen["embed.embedding"] == ("model.embed_tokens.weight", False, False)


def test_defaults_follow_transformers_and_seq_len_is_chosen():
    published_like = {k: v for k, v in LLAMA.items() if k not in ("rms_norm_eps", "num_key_value_heads",
                                                                 "max_position_embeddings")}
    c = build_from_hf(published_like).config
    assert (c.norm_eps, c.n_kv_head, c.seq_len) == (1e-6, 6, 2048)  # LlamaConfig's defaults
    long = build_from_hf({**LLAMA, "max_position_embeddings": 131072}).config
    assert (long.seq_len, long.max_position_embeddings) == (4096, 131072)
    assert build_from_hf(GPT2).config.seq_len == 40
    assert build_from_hf(GPT2, seq_len=16, d_model=36, n_layer=None).config.seq_len == 16


@pytest.mark.parametrize("config,overrides,match", [
    ({**LLAMA, "model_type": "gemma"}, {}, "model_type 'gemma'"),
    ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, {}, "yarn"),
    ({**LLAMA, "attention_bias": True}, {}, "attention_bias"),
    ({**LLAMA, "hidden_act": "gelu"}, {}, "hidden_act"),
    ({**MISTRAL, "sliding_window": 16}, {"seq_len": 24}, "sliding_window=16"),
    ({k: v for k, v in MISTRAL.items() if k != "sliding_window"}, {"seq_len": 8192}, "sliding_window=4096"),
    ({**QWEN2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, {"seq_len": 24},
     "sliding-window"),
    ({**QWEN3, "attention_bias": True}, {}, "attention_bias"),
    ({**QWEN3, "layer_types": ["full_attention", "linear_attention"]}, {}, "layer_types holds 'linear_attention'"),
    ({**QWEN2, "layer_types": ["full_attention"]}, {}, "layer_types must list one attention type for each of the 2"),
    ({**QWEN3, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, {"seq_len": 24},
     "sliding-window"),
    ({**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, {},
     "yarn"),  # what Qwen3's model cards suggest beyond 32k positions
    ({**GPT2, "activation_function": "relu"}, {}, "activation_function"),
    ({**GPT2, "scale_attn_by_inverse_layer_idx": True}, {}, "scale_attn_by_inverse_layer_idx"),
    ({**GPT2, "layer_norm_epsilon": 1e-6}, {}, "layer_norm_epsilon"),
    (GPT2, {"seq_len": 41}, "n_positions=40"),
    (GPT2, {"d_model": 64}, "d_model=64 contradicts config.json's n_embd"),
    (LLAMA, {"n_layer": 3}, "n_layer=3 contradicts config.json's num_hidden_layers"),
    (LLAMA, {"tie_embeddings": True}, "tie_word_embeddings"),
    (LLAMA, {"dropout": 0.1}, "unknown model setting 'dropout'"),
    ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, {}, "'hidden_size'"),
])
def test_unsupported_configs_are_one_line(config, overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        build_from_hf(config, **overrides)
    assert "\n" not in str(err.value)


def test_qwen2_window_inside_full_attention_layers_is_accepted():
    """Qwen2 slides only layers from max_window_layers on: with all layers below it, nothing slides."""
    config = {**QWEN2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    assert build_from_hf(config, seq_len=SEQ_LEN).config == dataclasses.replace(
        build_from_hf(QWEN2).config, seq_len=SEQ_LEN, max_position_embeddings=64)


# -- config.json as transformers 4.57 and 5.x write it ------------------------------------------

from hf_configs import V4, V5  # noqa: E402

ROPE = {"llama": (500000.0, (8.0, 1.0, 4.0, 64)), "qwen2": (1000000.0, None), "mistral": (1000000.0, None),
        "qwen3": (1000000.0, None)}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_keys_left_out_mean_what_transformers_makes_of_them(family):
    """head_dim, num_key_value_heads, rms_norm_eps and max_position_embeddings absent: transformers'
    own config class fills them (Qwen3: head_dim 128, not hidden_size / num_attention_heads; Qwen2
    and Qwen3 32 key/value heads, Mistral 8), and so do we."""
    transformers = pytest.importorskip("transformers")
    left_out = ("head_dim", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings")
    sparse = {k: v for k, v in {**V4[family], "num_attention_heads": 64, "hidden_size": 64 * 16}.items()
              if k not in left_out}
    theirs = transformers.AutoConfig.for_model(**sparse)
    ours = build_from_hf(sparse).config
    assert (ours.d_head, ours.n_kv_head, ours.norm_eps) == (getattr(theirs, "head_dim", None) or 16,
                                                            theirs.num_key_value_heads, theirs.rms_norm_eps)
    assert (ours.max_position_embeddings or ours.seq_len) == theirs.max_position_embeddings


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gpt2"])
def test_saved_configs_of_both_layouts_read_the_same(family):
    """5.x writes RoPE only as rope_parameters; 4.57 as rope_theta/rope_scaling: the same model."""
    four, five = build_from_hf(V4[family]).config, build_from_hf(V5[family]).config
    assert four == five
    if family in ROPE:
        theta, scaling = ROPE[family]
        assert five.rope_theta == theta
        assert (None if five.rope_scaling is None else tuple(dataclasses.astuple(five.rope_scaling))) == scaling


@pytest.mark.parametrize("version", ["V4", "V5"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gpt2"])
def test_export_config_keeps_the_source_fields_and_layout(family, version):
    source = {"V4": V4, "V5": V5}[version][family]
    exported = hf_config(build_from_hf(source), torch_dtype=source["dtype"], source=source)
    if family == "gpt2":  # null means 4 * n_embd, which we write out; 4.57 leaves the default tie out
        assert exported.pop("n_inner") == 4 * source["n_embd"] and source["n_inner"] is None
        assert exported.pop("tie_word_embeddings") is source.get("tie_word_embeddings", True) is True
        source = {k: v for k, v in source.items() if k not in ("n_inner", "tie_word_embeddings")}
    assert exported == source  # bos/eos ids, dtype, rope layout, everything
    assert json.loads(json.dumps(exported)) == exported


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope_parameters rope_type 'yarn'"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "rope_type 'linear'"),
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}, "rope_type 'dynamic'"),
    ({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"full_attention": {"rope_type": "default", "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "per layer type"),
    ({"rope_type": "default", "rope_theta": "big"}, "rope_theta is 'big'"),
])
def test_unsupported_rope_parameters_are_refused_by_name(rope, match):
    with pytest.raises(ValueError, match=match) as err:
        build_from_hf({**V5["qwen2"], "rope_parameters": rope})
    assert "\n" not in str(err.value)


def test_quantized_and_non_integer_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="quantization_config"):
        build_from_hf({**V5["llama"], "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ValueError, match="vocab_size is 1000000000000.0; it must be a positive whole number"):
        build_from_hf({**V5["llama"], "vocab_size": 1e12})


def _needs_layout(version):
    transformers = pytest.importorskip("transformers")
    if version == "V5" and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x does not read rope_parameters (CI's second pass runs 5.x)")


@pytest.mark.hf_reference
@pytest.mark.parametrize("version", ["V4", "V5"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gpt2"])
def test_saved_configs_give_transformers_logits(family, version):
    _needs_layout(version)
    test_hf_weights_give_hf_logits({"V4": V4, "V5": V5}[version][family])


@pytest.mark.hf_reference
@pytest.mark.parametrize("version", ["V4", "V5"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gpt2"])
def test_export_in_the_source_layout_loads_in_transformers(family, version, tmp_path):
    _needs_layout(version)
    source = {"V4": V4, "V5": V5}[version][family]
    test_export_loads_in_transformers_with_the_same_logits(build_from_hf(source, seq_len=SEQ_LEN).config, tmp_path,
                                                           source)
