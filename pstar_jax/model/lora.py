"""The model side of a LoRA run: which tensors are adapters, what the run freezes, and a base
checkpoint's tensors with the adapters' own initialisation beside them (the settings are
pstar_jax.config.lora's ``LoraConfig``)."""

from __future__ import annotations

import fnmatch
from typing import Any, Iterator, Mapping, Sequence

from pstar_jax.config.errors import ConfigError
from pstar_jax.config.lora import LoraConfig, names_of


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
    for entry in names_of(modules_to_save):
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
