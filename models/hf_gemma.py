"""Gemma 3's text decoder in Hugging Face checkpoints (model_type gemma3_text, or the text tower of a
multimodal gemma3 one): its config.json fields read into a LlamaConfig and written back, in either
transformers' layout (4.x: top-level rope_theta, rope_scaling for the global layers and
rope_local_base_freq for the sliding ones; 5.x: rope_parameters holding one dict per layer type),
Gemma3TextConfig's defaults for the keys a file leaves out (the multimodal checkpoints' text_config
lists few), and its blocks' tensor names (Gemma calls the norm after attention
post_attention_layernorm, which in Llama is the norm before the MLP).

A multimodal checkpoint stores the text tower's tensors under language_model.model.* (4.x, and the
published files) or model.language_model.* (5.x) beside vision_tower.* and multi_modal_projector.*:
``tower_names`` gives a tensor's spellings there, ``other_tower`` the tensors left unread."""

from __future__ import annotations

from typing import Any, Mapping

from pstar_models.hf_fields import layer_types, refuse_unless
from pstar_models.llama_config import GEMMA, LAYER_TYPES, LinearRopeScaling, LlamaConfig, gemma_layer_types

# Gemma3TextConfig's defaults (4.57 and 5.x alike) for the keys the model needs.
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                 "sliding_window": 4096}
MULTIMODAL = "gemma3"  # the model_type of a checkpoint whose text tower is a gemma3_text
_TOWERS = ("language_model.model.", "model.language_model.")  # 4.x's spelling of our "model.", 5.x's
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                 "model.visual.", "mtp.")  # (the last two: Qwen3.5's vision tower and its multi-token prediction)

GEMMA_BLOCK = {"attn_norm.scale": "input_layernorm.weight", "attn_post_norm.scale": "post_attention_layernorm.weight",
               "mlp_norm.scale": "pre_feedforward_layernorm.weight",
               "mlp_post_norm.scale": "post_feedforward_layernorm.weight",
               **{f"attn.{x}.kernel": f"self_attn.{x}_proj.weight" for x in "qkvo"},
               **{f"attn.{x}_norm.scale": f"self_attn.{x}_norm.weight" for x in "qk"},
               **{f"mlp.{x}.kernel": f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}}


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config.json's {key} is {value!r}; it must be a positive number")
    return float(value)


def _scaling(params: Mapping[str, Any], key: str) -> LinearRopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    refuse_unless(kind == "linear", f"{key} rope_type {kind!r} (Gemma 3's global layers: only 'default' and 'linear')")
    return LinearRopeScaling(_number(params.get("factor"), f"{key} factor"))


def _rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta, rope_scaling (the global layers') and rope_local_theta from either layout."""
    params = config.get("rope_parameters")
    if config.get("rope_scaling") is None and isinstance(params, dict) and params and all(
            isinstance(v, dict) for v in params.values()):  # 5.x: one dict per layer type
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"config.json's rope_parameters holds {unknown[0]!r}, a kind of layer pstar_jax's "
                             f"gemma3_text models do not implement (known: {', '.join(LAYER_TYPES)})")
        full, local = params.get("full_attention", {}), params.get("sliding_attention", {})
        refuse_unless(_scaling(local, "rope_parameters.sliding_attention") is None,
                      "RoPE scaling on the sliding layers (rope_parameters.sliding_attention)")
        return dict(rope_theta=_number(full.get("rope_theta", config.get("rope_theta", 1e6)), "rope_theta"),
                    rope_scaling=_scaling(full, "rope_parameters.full_attention"),
                    rope_local_theta=_number(local.get("rope_theta", config.get("rope_local_base_freq", 1e4)),
                                             "rope_parameters.sliding_attention.rope_theta"))
    scaling = config.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"config.json's rope_scaling is {scaling!r}, not an object of RoPE settings")
    return dict(rope_theta=_number(config.get("rope_theta", 1e6), "rope_theta"),
                rope_scaling=_scaling(scaling, "rope_scaling"),
                rope_local_theta=_number(config.get("rope_local_base_freq", 1e4), "rope_local_base_freq"))


def _gemma_layer_types(config: Mapping[str, Any], n_layer: int) -> tuple[str, ...]:
    """Each layer's attention: layer_types as 4.56+ save it, else transformers' sliding_window_pattern
    (default 6: every sixth layer global)."""
    types = layer_types(config, GEMMA, n_layer)
    if types is not None:
        return types
    pattern = config.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise ValueError(f"config.json's sliding_window_pattern is {pattern!r}; it must be a positive whole number")
    return gemma_layer_types(n_layer, pattern)


def gemma_fields(config: Mapping[str, Any], n_layer: int) -> dict[str, Any]:
    """The Gemma fields of a LlamaConfig, refusing in one line what our blocks would compute otherwise."""
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    refuse_unless(act == "gelu_pytorch_tanh", f"hidden_activation {act!r} (only gelu_pytorch_tanh)")
    refuse_unless(not config.get("attention_bias", False), "attention_bias (biases on q/k/v/o)")
    refuse_unless(not config.get("use_bidirectional_attention", False), "use_bidirectional_attention")
    window = config.get("sliding_window", 4096)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"config.json's sliding_window is {window!r}; it must be a positive whole number")
    if config.get("attn_logit_softcapping") is not None:  # Gemma 2's; transformers' Gemma 3 attention drops it
        raise ValueError(f"config.json's attn_logit_softcapping is {config['attn_logit_softcapping']!r}, which "
                         "transformers' Gemma 3 attention never applies (the published configs have null); set it "
                         "to null so that pstar_jax and transformers compute the same model")
    cap = config.get("final_logit_softcapping")
    return dict(layer_types=_gemma_layer_types(config, n_layer), sliding_window=window,
                query_pre_attn_scalar=_number(config.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar"),
                final_softcap=None if cap is None else _number(cap, "final_logit_softcapping"), **_rope(config))


def gemma_export(c: LlamaConfig, five: bool) -> dict[str, Any]:
    """The Gemma keys of an exported config.json; ``five``: 5.x's rope_parameters, else 4.x's keys."""
    scalar = c.query_pre_attn_scalar or c.d_head
    out: dict[str, Any] = dict(  # (5.x's config class types query_pre_attn_scalar int: a whole one is written so)
        head_dim=c.d_head, hidden_activation="gelu_pytorch_tanh", attention_bias=False,
        use_bidirectional_attention=False, query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        sliding_window=c.sliding_window or 4096, layer_types=list(c.layer_types or ["full_attention"] * c.n_layer),
        attn_logit_softcapping=None, final_logit_softcapping=c.final_softcap)
    scaling = None if c.rope_scaling is None else {"rope_type": "linear", "factor": c.rope_scaling.factor}
    local = c.rope_local_theta if c.rope_local_theta is not None else 10000.0
    if five:
        out["rope_parameters"] = {"full_attention": {"rope_theta": c.rope_theta, **(scaling or {"rope_type": "default"})},
                                  "sliding_attention": {"rope_theta": local, "rope_type": "default"}}
    else:
        out.update(rope_theta=c.rope_theta, rope_scaling=scaling, rope_local_base_freq=local)
    return out


def text_tower(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The gemma3_text config.json of a multimodal gemma3 checkpoint's text tower (None: not one)."""
    if config.get("model_type") != MULTIMODAL:
        return None
    text = config.get("text_config")
    if not isinstance(text, dict) or text.get("model_type", GEMMA) != GEMMA:
        raise ValueError(f"config.json model_type {MULTIMODAL!r} has no gemma3_text text_config (got "
                         f"{str(text)[:80]}), so its text tower cannot be found; pass a checkpoint whose "
                         "config.json has one, or a text-only gemma3_text checkpoint")
    return {**text, "model_type": GEMMA}


def with_text_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with Gemma3TextConfig's defaults for the keys it leaves out (None where it gives null)."""
    return {**TEXT_DEFAULTS, **config}


def tower_names(hf_name: str) -> tuple[str, ...]:
    """Where a gemma3_text tensor (``model.*``, ``lm_head.weight``) may lie in a multimodal checkpoint."""
    if hf_name.startswith("model."):
        return tuple(prefix + hf_name[len("model."):] for prefix in _TOWERS)
    return (f"language_model.{hf_name}", hf_name)


def other_tower(name: str) -> bool:
    """A multimodal checkpoint's tensor outside the text tower (the vision tower, the projector)."""
    return name.startswith(_OTHER_TOWERS)
