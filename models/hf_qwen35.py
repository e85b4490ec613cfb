"""Qwen3.5 checkpoints (transformers' ``qwen3_5_text``, and the multimodal ``qwen3_5`` one's
text_config): config.json read into a Qwen35Config, and our tensor names mapped to theirs.

Both layouts of the RoPE keys are read: transformers 5.x nests them in ``rope_parameters``
(rope_type, rope_theta, partial_rotary_factor, mrope_section, mrope_interleaved); a 4.x-style file
has rope_theta and partial_rotary_factor at the top. Keys a file leaves out take
Qwen3_5TextConfig's defaults. Refused in one line, before anything is allocated: quantized
weights, a multimodal file without a text tower, an unknown layer_types entry, RoPE scaling,
attention biases, another activation.

models/hf.py's build_from_hf, hf_tensors and hf_config call these for the two model types.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from pstar_models.gated_deltanet import DeltaNetShape
from pstar_models.hf_fields import refuse_unless, require
from pstar_models.qwen35 import LAYER_TYPES, Qwen35, Qwen35Config, StagedQwen35

TEXT = "qwen3_5_text"
MULTIMODAL = "qwen3_5"  # Qwen3_5ForConditionalGeneration: the text tower under model.language_model.
# Qwen3_5TextConfig's defaults (transformers 5.x), for keys a config.json leaves out.
TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32)
DEFAULT_SEQ_LEN = 4096


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The qwen3_5_text config.json of a qwen3_5_text or multimodal qwen3_5 checkpoint."""
    refuse_unless(config.get("quantization_config") is None, "quantization_config (quantized weights)")
    model_type = config.get("model_type")
    if model_type == TEXT:
        return dict(config)
    if model_type != MULTIMODAL:
        raise ValueError(f"config.json model_type {model_type!r} is not a Qwen3.5 one ({TEXT} or {MULTIMODAL})")
    text = config.get("text_config")
    if not isinstance(text, dict) or text.get("model_type", TEXT) != TEXT:
        raise ValueError(f"config.json model_type {MULTIMODAL!r} has no {TEXT} text_config (got {str(text)[:80]}), "
                         f"so its text tower cannot be found; pass a checkpoint whose config.json has one, or a "
                         f"text-only {TEXT} checkpoint")
    refuse_unless(text.get("quantization_config") is None, "text_config.quantization_config (quantized weights)")
    return {**text, "model_type": TEXT}


def _rope(text: Mapping[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from rope_parameters (5.x) or the top level (4.x style)."""
    params = text.get("rope_parameters")
    if params is None:
        refuse_unless(text.get("rope_scaling") is None, "rope_scaling (RoPE scaling)")
        return float(text.get("rope_theta", 10000.0)), float(text.get("partial_rotary_factor", 0.25))
    if not isinstance(params, dict):
        raise ValueError(f"config.json's rope_parameters is {str(params)[:80]}; it must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json's rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", 10000.0)), float(params.get("partial_rotary_factor",
                                                                      text.get("partial_rotary_factor", 0.25)))


def _layer_types(text: Mapping[str, Any], n_layer: int) -> tuple[str, ...]:
    """config.json's layer_types, or transformers' default: every full_attention_interval-th layer full."""
    given = text.get("layer_types")
    if given is None:
        interval = require({"full_attention_interval": 4, **text}, "full_attention_interval")
        return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layer))
    if not isinstance(given, list) or len(given) != n_layer:
        raise ValueError(f"config.json's layer_types must list num_hidden_layers={n_layer} entries, got {given!r}")
    unknown = [t for t in given if t not in LAYER_TYPES]
    if unknown:
        raise ValueError(f"config.json's layer_types has {unknown[0]!r}, which pstar_jax does not implement "
                         f"for {TEXT} (known: {', '.join(LAYER_TYPES)})")
    return tuple(given)


def qwen35_config(config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None,
                  seq_len: int | None = None) -> Qwen35Config:
    """The Qwen35Config a config.json describes. ``seq_len`` (or ``overrides["seq_len"]``) is chosen
    freely (None: min(max_position_embeddings, 4096)); ``overrides``' other fields (our config's;
    None values ignored) must agree with the file."""
    overrides = dict(overrides or {})
    seq_len = overrides.pop("seq_len", None) or seq_len
    text = {**TEXT_DEFAULTS, **text_config(config)}
    act = text["hidden_act"]
    refuse_unless(act == "silu", f"hidden_act {act!r} (only silu)")
    refuse_unless(not text["attention_bias"], "attention_bias (biases on q/k/v/o)")
    n_layer = require(text, "num_hidden_layers")
    sizes = {key: require(text, key) for key in (
        "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
        "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim")}
    layer_types = _layer_types(text, n_layer)
    rope_theta, partial = _rope(text)
    eps = float(text["rms_norm_eps"])
    max_positions = sizes["max_position_embeddings"]
    seq_len = seq_len or min(max_positions, DEFAULT_SEQ_LEN)
    linear = DeltaNetShape(d_model=sizes["hidden_size"], n_key_heads=sizes["linear_num_key_heads"],
                           n_value_heads=sizes["linear_num_value_heads"], d_key=sizes["linear_key_head_dim"],
                           d_value=sizes["linear_value_head_dim"], conv_kernel=sizes["linear_conv_kernel_dim"],
                           norm_eps=eps)
    tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    c = Qwen35Config(
        vocab_size=sizes["vocab_size"], d_model=sizes["hidden_size"], n_layer=n_layer,
        n_head=sizes["num_attention_heads"], n_kv_head=sizes["num_key_value_heads"], head_dim=sizes["head_dim"],
        d_ff=sizes["intermediate_size"], seq_len=seq_len, layer_types=layer_types, linear=linear,
        rope_theta=rope_theta, partial_rotary=partial, norm_eps=eps, tie_embeddings=bool(tie),
        max_position_embeddings=None if max_positions == seq_len else max_positions)
    for field, value in overrides.items():
        if value is not None and getattr(c, field, value) != value:
            raise ValueError(f"{field}={value!r} disagrees with config.json, which gives {getattr(c, field)!r}; "
                             f"leave {field} out to take the checkpoint's")
    return c


_BLOCK_NAMES = {
    "attn_norm.scale": "input_layernorm.weight", "mlp_norm.scale": "post_attention_layernorm.weight",
    "attn.q.kernel": "self_attn.q_proj.weight", "attn.k.kernel": "self_attn.k_proj.weight",
    "attn.v.kernel": "self_attn.v_proj.weight", "attn.o.kernel": "self_attn.o_proj.weight",
    "attn.q_norm.scale": "self_attn.q_norm.weight", "attn.k_norm.scale": "self_attn.k_norm.weight",
    **{f"linear_attn.in_{x}.kernel": f"linear_attn.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")},
    "linear_attn.conv.kernel": "linear_attn.conv1d.weight", "linear_attn.dt_bias": "linear_attn.dt_bias",
    "linear_attn.A_log": "linear_attn.A_log", "linear_attn.norm.scale": "linear_attn.norm.weight",
    "linear_attn.out.kernel": "linear_attn.out_proj.weight",
    "mlp.gate.kernel": "mlp.gate_proj.weight", "mlp.up.kernel": "mlp.up_proj.weight",
    "mlp.down.kernel": "mlp.down_proj.weight"}


def hf_name(name: str, multimodal: bool = False) -> str:
    """transformers' name of our tensor ``name`` (a Qwen35 state path joined with '.')."""
    model = "model.language_model." if multimodal else "model."
    if name == "embed.embedding":
        return model + "embed_tokens.weight"
    if name == "norm.scale":
        return model + "norm.weight"
    if name == "head.kernel":
        return "lm_head.weight"
    _, i, rest = name.split(".", 2)
    return f"{model}layers.{i}.{_BLOCK_NAMES[rest]}"


def transposed(name: str) -> bool:
    """Whether our tensor is transformers' transposed: the projections' kernels [in, out] (torch's
    Linear weight is [out, in]); the convolution's taps keep torch's layout."""
    return name.endswith("kernel") and not name.endswith("conv.kernel")


def to_hf(name: str, array: Any) -> Any:
    """Our tensor in transformers' layout."""
    return array.T if transposed(name) else array


def from_hf(name: str, array: Any) -> Any:
    """transformers' tensor for our ``name`` in our layout (to_hf's inverse)."""
    return array.T if transposed(name) else array


def params_from_hf(config: Mapping[str, Any], tensors: Mapping[str, Any], model: StagedQwen35) -> dict[str, Any]:
    """``model``'s params (our names and layout, numpy) from a checkpoint's text tensors
    (``tensors``: transformers' names and layout, e.g. a state_dict as numpy); each must be there."""
    multimodal = config.get("model_type") == MULTIMODAL
    params = {}
    for name in model.param_shapes():
        source = hf_name(name, multimodal)
        if source not in tensors:
            raise ValueError(f"the checkpoint has no {source} (our {name}); it is not a {TEXT} checkpoint of "
                             "this config.json")
        params[name] = from_hf(name, np.asarray(tensors[source]))
    return params


def qwen35_from_hf(config: Mapping[str, Any], tensors: Mapping[str, Any], seq_len: int | None = None) -> Qwen35:
    """A Qwen35 holding a checkpoint's text tensors, in their dtypes (``params_from_hf``)."""
    model = StagedQwen35(qwen35_config(config, seq_len=seq_len))
    return model.module({n: jnp.asarray(v) for n, v in params_from_hf(config, tensors, model).items()})


# Keys an export takes from the source's text config as they were (training settings and token
# ids, not the model's shape): the rest is written from our config.
_SOURCE_KEYS = ("attention_dropout", "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
                "mamba_ssm_dtype", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "attn_output_gate",
                "full_attention_interval", "rope_scaling")


def qwen35_hf_config(c: Qwen35Config, torch_dtype: str = "bfloat16", source: Mapping[str, Any] | None = None
                     ) -> dict[str, Any]:
    """The qwen3_5_text config.json (Qwen3_5ForCausalLM) of ``c``; the RoPE keys in ``source``'s
    layout (its text_config's for a multimodal source: an export is the text tower alone), 5.x's
    rope_parameters when there is none."""
    text = {} if source is None else text_config(source)
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary}
    flat = "rope_parameters" not in text and source is not None
    if not flat:
        rope = {**{k: v for k, v in (text.get("rope_parameters") or {}).items()}, **rope}
    out = {k: text[k] for k in _SOURCE_KEYS if k in text}
    out.update({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": TEXT, "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "head_dim": c.head_dim,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": c.norm_eps, "layer_types": list(c.layer_types),
        "linear_conv_kernel_dim": c.linear.conv_kernel, "linear_key_head_dim": c.linear.d_key,
        "linear_value_head_dim": c.linear.d_value, "linear_num_key_heads": c.linear.n_key_heads,
        "linear_num_value_heads": c.linear.n_value_heads, "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": c.max_position_embeddings or c.seq_len, "dtype": torch_dtype,
        **({"rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary} if flat else
           {"rope_parameters": rope})})
    return out


def hf_tensors(model: StagedQwen35) -> dict[str, str]:
    """transformers' name (a qwen3_5_text checkpoint's) of each base parameter of ``model`` (the
    adapters' are peft's, a tied head has none of its own); ``to_hf`` gives the layout."""
    return {n: hf_name(n) for n in model.param_shapes() if ".lora." not in n}
