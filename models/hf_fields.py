"""Reading config.json fields as transformers does: its defaults for keys a file leaves out, and
one-line refusals of sizes that are missing or not whole numbers and of settings our models do
not implement, and each layer's attention (layer_types). Shared by models/hf.py (the families),
models/hf_moe.py (their experts) and models/hf_gemma.py (Gemma 3's fields)."""

from __future__ import annotations

from typing import Any, Mapping

from pstar_models.limits import MAX_EXPERTS, MAX_LAYERS, MAX_SIZE
from pstar_models.llama_config import LAYER_TYPES

# transformers' defaults (4.57 and 5.x alike) for keys a config.json may leave out (LlamaConfig, Qwen2Config,
# MistralConfig, Qwen3Config, Qwen3MoeConfig, MixtralConfig, Gemma3TextConfig). Left out or null, head_dim means hidden_size /
# num_attention_heads and num_key_value_heads num_attention_heads, unless a left-out key has a value here.
HF_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "num_key_value_heads": 32},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "num_key_value_heads": 8},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "num_key_value_heads": 4,
                  "num_experts": 128, "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False},  # (num_local_experts: 5.x's name for num_experts)
    "mixtral": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2},
    "gemma3_text": {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "num_key_value_heads": 4, "head_dim": 256,
                    "tie_word_embeddings": True},
}


# config.json's names of the counts models/limits.py bounds apart from the other sizes
LAYER_COUNTS = ("num_hidden_layers", "n_layer")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def require(config: Mapping[str, Any], key: str, bounded: bool = True) -> int:
    """A size the model needs: present, a positive whole number, and (``bounded``) not past the
    bounds of models/limits.py; unbounded where it is compared with the weights' shapes first,
    which name the size to set."""
    value = config.get(key)
    if value is None:
        raise ValueError(f"config.json has no {key!r}, which a {config.get('model_type')} model needs")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json's {key} is {value!r}; it must be a positive whole number")
    upper = MAX_LAYERS if key in LAYER_COUNTS else MAX_EXPERTS if key in EXPERT_COUNTS else MAX_SIZE
    if bounded and value > upper:
        raise ValueError(f"config.json's {key} is {value}; pstar_jax takes at most {upper}")
    return value


def refuse_unless(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"config.json asks for {what}, which pstar_jax's models do not implement")


def count(config: Mapping[str, Any], key: str, family: str, bounded: bool = True) -> int:
    """A count with transformers' default where config.json leaves it out; else as ``require``."""
    value = config.get(key, HF_DEFAULTS[family].get(key))
    return require({**config, key: value}, key, bounded)


def layer_types(config: Mapping[str, Any], family: str, n_layer: int) -> tuple[str, ...] | None:
    """config.json's layer_types (each layer's attention, as transformers 4.56+ saves it), checked:
    one per layer, each one we implement; None where the file has none."""
    types = config.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n_layer:
        raise ValueError(f"config.json layer_types must list one attention type for each of the "
                         f"{n_layer} layers (num_hidden_layers), got {str(types)[:80]}")
    unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"config.json layer_types holds {unknown[0]!r}, a kind of layer pstar_jax's {family} "
                         f"models do not implement (known: {', '.join(LAYER_TYPES)})")
    return tuple(types)
