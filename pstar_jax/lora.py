"""LoRA runs: the ``LoraConfig`` section (``--lora-*`` flags) and what it freezes.

A LoRA run adds adapters to the model's projections (the model module builds them: its
``build_model(name, lora=spec)`` / ``build_from_hf(config, lora=spec)`` take the module's own
``LoraSpec``, see models/lora.py) and trains only those: every base tensor is frozen (frozen
chunks, pstar_jax/freeze.py: 2 bytes per parameter in bf16, never written back) except the ones
``modules_to_save`` names, which train in full (peft's term). The embedding and head stay frozen
unless named there. Adapter tensors are named ``<projection>.lora.lora_a`` [in, rank] and
``<projection>.lora.lora_b`` [rank, out].

Conventions are peft's (scale alpha / rank, or alpha / sqrt(rank) with rslora; lora_a
Kaiming-uniform, lora_b zero, so step 0 equals the base model), except the default alpha: 16,
what most recipes pair with rank 8-16 (peft's own default is 8).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Iterator, Mapping, Sequence

from pstar_jax.config import ConfigError, option
from pstar_jax.config_types import section

DEFAULT_ALPHA = 16.0


def _names(text: str | None) -> tuple[str, ...]:
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
                                 "paths or glob patterns (llama/qwen2/mistral: attn.q attn.k attn.v attn.o "
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
        if not self.rank:
            given = [f for f in ("targets", "modules_to_save", "rslora", "dropout") if getattr(self, f)]
            if given or self.alpha != DEFAULT_ALPHA:
                raise ConfigError(f"LoraConfig.{(given or ['alpha'])[0]} is set but LoraConfig.rank is 0 (no LoRA); "
                                  "give LoraConfig.rank too")
        for field in ("targets", "modules_to_save"):
            if getattr(self, field) is not None and not _names(getattr(self, field)):
                raise ConfigError(f"LoraConfig.{field} names nothing; give comma-separated names or leave it out")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_list(self) -> tuple[str, ...]:
        """The targets as a tuple (() means every projection of the family)."""
        return _names(self.targets)

    def spec_fields(self) -> dict[str, Any]:
        """The keyword arguments of a model module's ``LoraSpec``."""
        return dict(rank=self.rank, alpha=float(self.alpha), dropout=float(self.dropout), targets=self.target_list,
                    rslora=self.rslora)


def is_adapter(name: str) -> bool:
    """Whether a tensor is a LoRA adapter's ('blocks.0.attn.q.lora.lora_a' or '.lora.lora_b')."""
    return name.endswith((".lora.lora_a", ".lora.lora_b"))


def adapter_names(model: Any) -> list[str]:
    """The model's adapter tensors, in model order."""
    return [n for n in model.param_shapes() if is_adapter(n)]


def saved_names(names: Sequence[str], modules_to_save: str | None) -> set[str]:
    """The base tensors ``modules_to_save`` names: each entry a glob over tensor names, or a
    module (every tensor under it: 'embed' names 'embed.embedding'). One matching nothing is a
    ConfigError, as a typo would otherwise leave the module frozen."""
    out: set[str] = set()
    for entry in _names(modules_to_save):
        matched = [n for n in names if not is_adapter(n) and (fnmatch.fnmatchcase(n, entry)
                                                               or fnmatch.fnmatchcase(n, entry + ".*"))]
        if not matched:
            raise ConfigError(f"LoraConfig.modules_to_save entry {entry!r} matches no base tensor of the model "
                              f"(names look like {', '.join(list(names)[:3])})")
        out.update(matched)
    return out


def frozen_for_lora(model: Any, config: LoraConfig) -> frozenset[str]:
    """What a LoRA run freezes: every tensor but the adapters and ``modules_to_save``'s (none
    without LoRA). A model that built no adapters (a model module ignoring ``lora=``) is refused."""
    if not config.enabled:
        return frozenset()
    names = list(model.param_shapes())
    adapters = set(adapter_names(model))
    if not adapters:
        raise ConfigError("LoraConfig.rank is set but the model has no LoRA adapters (no '.lora.lora_a' tensors): "
                          "its model module's build_model ignores lora=; use pstar_models or drop LoraConfig.rank")
    trained = adapters | saved_names(names, config.modules_to_save)
    return frozenset(n for n in names if n not in trained)


class WithAdapters(Mapping[str, Any]):
    """Initial tensors for a LoRA model from a base checkpoint: base names from ``base`` (which
    has no adapters), adapters from the model's own initialisation (peft's)."""

    def __init__(self, base: Mapping[str, Any], model: Any, seed: int):
        self.base, self.model, self.seed = base, model, seed
        self._names = list(model.param_shapes())

    def __getitem__(self, name: str) -> Any:
        return self.model.init_tensor(name, self.seed) if is_adapter(name) else self.base[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def base_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """The model's tensor shapes without the adapters: what a base checkpoint holds."""
    return {n: s for n, s in model.param_shapes().items() if not is_adapter(n)}


__all__ = ["LoraConfig", "DEFAULT_ALPHA", "is_adapter", "adapter_names", "saved_names",
           "WithAdapters", "base_shapes", "frozen_for_lora"]
