"""LoRA runs: the ``LoraConfig`` section (``--lora-*`` flags); what it freezes is pstar_jax.model.lora.

A LoRA run adds adapters to the model's projections (the model module builds them: its
``build_model(name, lora=spec)`` / ``build_from_hf(config, lora=spec)`` take the module's own
``LoraSpec``, see models/lora.py) and trains only those: every base tensor is frozen (frozen
chunks, pstar_jax/model/freeze.py: 2 bytes per parameter in bf16, never written back) except the ones
``modules_to_save`` names, which train in full (peft's term). The embedding and head stay frozen
unless named there. Adapter tensors are named ``<projection>.lora.lora_a`` [in, rank] and
``<projection>.lora.lora_b`` [rank, out].

Conventions are peft's (scale alpha / rank, or alpha / sqrt(rank) with rslora; lora_a
Kaiming-uniform, lora_b zero, so step 0 equals the base model), except the default alpha: 16,
what most recipes pair with rank 8-16 (peft's own default is 8).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pstar_jax.config.errors import ConfigError
from pstar_jax.config.fields import option, section

DEFAULT_ALPHA = 16.0


def names_of(text: str | None) -> tuple[str, ...]:
    """The names of a comma-separated list, blanks dropped."""
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


@section
class LoraConfig:
    """LoRA adapters on the attention and MLP projections; rank 0 trains the whole model."""
    rank: int = option(0, "rank of LoRA adapters on the projections, training only them (the base is frozen: "
                       "2 bytes/param, never written back); 0: no LoRA, train everything", flag="--lora-rank",
                       math_changing=True)
    alpha: float = option(DEFAULT_ALPHA, "LoRA alpha: the adapter's output is scaled by alpha / rank (peft's "
                          "convention; peft's own default alpha is 8)", flag="--lora-alpha",
                          math_changing=True)
    dropout: float = option(0.0, "dropout on the adapters' input, in [0, 1)", flag="--lora-dropout",
                            math_changing=True)
    targets: str | None = option(None, "projections that get adapters: comma-separated block-relative module "
                                 "paths or glob patterns (llama/qwen2/mistral/qwen3: attn.q attn.k attn.v attn.o "
                                 "mlp.gate mlp.up mlp.down; GPT-2: attn.qkv attn.proj mlp.fc mlp.proj); "
                                 "default: all of them", metavar="PATHS", flag="--lora-targets",
                                 math_changing=True)
    rslora: bool = option(False, "rank-stabilised LoRA: scale by alpha / sqrt(rank)", flag="--lora-rslora",
                          math_changing=True)
    modules_to_save: str | None = option(None, "base modules trained in full beside the adapters (peft's term): "
                                         "comma-separated module names or glob patterns over tensor names, "
                                         "e.g. 'embed,head'", metavar="MODULES",
                                         flag="--lora-modules-to-save", math_changing=True)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank <= 2**31 - 1:
            raise ConfigError(f"LoraConfig.rank must be a whole number of at least 0 (0: no LoRA), got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"LoraConfig.alpha must be a positive number, got {self.alpha!r}")
        if not (math.isfinite(self.dropout) and 0 <= self.dropout < 1):
            raise ConfigError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for field in ("targets", "modules_to_save"):
            if getattr(self, field) is not None and not names_of(getattr(self, field)):
                raise ConfigError(f"LoraConfig.{field} names nothing; give comma-separated names or leave it out")

    def given(self) -> list[str]:
        """The settings given other than their defaults (rank apart)."""
        return [f.name for f in dataclasses.fields(self) if f.name != "rank" and getattr(self, f.name) != f.default]

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_list(self) -> tuple[str, ...]:
        """The targets as a tuple (() means every projection of the family)."""
        return names_of(self.targets)

    def spec_fields(self) -> dict[str, Any]:
        """The keyword arguments of a model module's ``LoraSpec``."""
        return dict(rank=self.rank, alpha=float(self.alpha), dropout=float(self.dropout), targets=self.target_list,
                    rslora=self.rslora)
