"""Every model preset behind one ``build_model``, and Hugging Face configs (``--model-module models``)."""

from __future__ import annotations

from typing import Any

from pstar_models import gpt, llama, qwen35
from pstar_models.hf import build_from_hf, check_hf_shapes, hf_config, hf_tensors
from pstar_models.lora import LoraSpec

__all__ = ["PRESET_NAMES", "LoraSpec", "build_from_hf", "build_model", "check_hf_shapes", "hf_config", "hf_tensors"]

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
