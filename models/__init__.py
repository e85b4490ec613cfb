"""Every model preset behind one ``build_model``, and Hugging Face configs (``--model-module models``)."""

from __future__ import annotations

from typing import Any, Mapping

from pstar_models import gpt, llama, qwen35
from pstar_models.hf import build_from_hf, check_hf_shapes, hf_config, hf_tensors
from pstar_models.lora import LoraSpec

__all__ = ["PRESET_NAMES", "LoraSpec", "build_from_hf", "build_model", "check_hf_shapes", "hf_config", "hf_tensors",
           "model_from_fields"]

PRESET_NAMES: tuple[str, ...] = (*gpt.PRESETS, *llama.PRESETS, *qwen35.PRESETS)


def build_model(name: str, **overrides: Any) -> gpt.StagedGPT | llama.StagedLlama | qwen35.StagedQwen35:
    """A GPT, Llama-family or Qwen3.5 preset with some fields replaced (None values are ignored)."""
    if name in gpt.PRESETS:
        return gpt.build_model(name, **overrides)
    if name in llama.PRESETS:
        return llama.build_model(name, **overrides)
    if name in qwen35.PRESETS:
        return qwen35.build_model(name, **overrides)
    raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESET_NAMES)}")


def model_from_fields(fields: Mapping[str, Any]) -> gpt.StagedGPT | llama.StagedLlama | qwen35.StagedQwen35:
    """The model whose config's fields ``fields`` holds, as JSON holds them (dataclasses.asdict's,
    what a Flax export's config.json has): a Qwen3.5 by its linear-attention sizes, a Llama-family
    model by its key/value heads, otherwise a GPT. Raises ValueError or TypeError for fields that
    describe none of them."""
    from pstar_models.gated_deltanet import DeltaNetShape
    from pstar_models.llama_config import config_from_fields
    fields = dict(fields)
    if isinstance(fields.get("lora"), dict):
        lora = dict(fields["lora"])
        lora["targets"] = tuple(lora.get("targets", ()))
        fields["lora"] = LoraSpec(**lora)
    if "linear" in fields:
        if not isinstance(fields["linear"], dict) or not isinstance(fields.get("layer_types"), list):
            raise ValueError("a Qwen3.5 config needs its 'linear' sizes and its 'layer_types' list")
        config = qwen35.Qwen35Config(**{**fields, "linear": DeltaNetShape(**fields["linear"]),
                                        "layer_types": tuple(fields["layer_types"])})
        return qwen35.StagedQwen35(config)
    if "n_kv_head" in fields:
        return llama.StagedLlama(config_from_fields(fields))
    return gpt.StagedGPT(gpt.GPTConfig(**fields))
