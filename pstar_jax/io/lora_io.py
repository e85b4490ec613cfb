"""A LoRA run and Hugging Face peft adapters: continuing from one (``--init-from-lora``), writing
one (``--export-lora``), and the merged model an ``--export-hf`` of a LoRA run writes.

Wiring between a run's config, its model and pstar_jax/io/peft_io.py's pure functions. An adapter
read to continue from gives the run its LoRA settings (rank, alpha, targets, rsLoRA, the tensors
it trained in full); LoRA flags given as well must agree with it, so a run never trains an
adapter other than the one the user named.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from pstar_jax.config import ConfigError, RunConfig
from pstar_jax.config.lora import LoraConfig
from pstar_jax.model.lora import is_adapter, saved_names
from pstar_models.lora import targeted
from pstar_jax.io.peft_io import (PROJECTIONS, first_instance, lora_scale, merged_stream, model_family, read_adapter,
                                  write_adapter)


def _projections(family: str, targets: Iterable[str]) -> tuple[str, ...]:
    """The family's projections that ``targets`` (paths or globs; none: all but the experts) name, in
    model order."""
    targets = tuple(targets)
    return tuple(p for p in PROJECTIONS[family] if targeted(targets, first_instance(p)))


def adopt_adapter(config: RunConfig, base_model: Any) -> tuple[RunConfig, dict[str, np.ndarray]]:
    """``config`` with the LoRA settings of its ``init_from_lora`` adapter, and the adapter's
    tensors (fp32, our names), read onto ``base_model`` (the run's model without adapters). The
    adapter's settings are the run's defaults: a setting of its shape (rank, alpha, rsLoRA, targets,
    modules trained in full) that the user gave as well must agree with it, while its dropout, a
    training choice, is the user's where given and else the adapter's ``lora_dropout``."""
    directory = config.model.init_from_lora
    family = model_family(base_model)
    spec, tensors = read_adapter(directory, family, base_model.param_shapes())
    saved = sorted(n for n in tensors if not is_adapter(n))
    what = f"ModelConfig.init_from_lora {directory}"
    given = config.lora
    named = set(given.given()) | ({"rank"} if given.enabled else set())
    theirs = {"rank": spec["rank"], "alpha": spec["alpha"], "rslora": spec["rslora"],
              "targets": ",".join(spec["targets"])}
    ours = {"rank": given.rank, "alpha": float(given.alpha), "rslora": given.rslora,
            "targets": ",".join(_projections(family, given.target_list))}
    for field in ("rank", "alpha", "rslora", "targets"):
        if field in named and theirs[field] != ours[field]:
            raise ConfigError(f"{what} was trained with LoRA {field} {theirs[field]}, LoraConfig.{field} is "
                              f"{ours[field]}; drop LoraConfig.{field} to take the adapter's, or pass "
                              f"{theirs[field]}")
    if "modules_to_save" in named:
        missing = sorted(set(saved) - saved_names(list(base_model.param_shapes()), given.modules_to_save))
        if missing:
            raise ConfigError(f"{what} trained {missing[0]} in full, which LoraConfig.modules_to_save does not "
                              f"name; add it, or drop LoraConfig.modules_to_save to take the adapter's")
    lora = LoraConfig(rank=spec["rank"], alpha=spec["alpha"], targets=",".join(spec["targets"]), rslora=spec["rslora"],
                      modules_to_save=given.modules_to_save if "modules_to_save" in named else ",".join(saved) or None,
                      dropout=given.dropout if "dropout" in named else spec["dropout"])
    return dataclasses.replace(config, lora=lora), tensors


class Overlay(Mapping[str, Any]):
    """Initial tensors: ``given`` (an adapter's) where it has them, else ``base``'s."""

    def __init__(self, base: Mapping[str, Any], given: Mapping[str, np.ndarray]):
        self.base, self.given = base, given

    def __getitem__(self, name: str) -> Any:
        return self.given[name] if name in self.given else self.base[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def export_lora(directory: str, config: RunConfig, model: Any,
                iter_params: Callable[[], Iterable[tuple[str, np.ndarray]]], what: str = "--export-lora",
                whole: str = "--export-hf") -> list[str]:
    """Write the run's adapters and the tensors it trains in full (modules_to_save) as a peft
    adapter, fp32, for ``init_from_hf``'s base. Only those tensors are kept from the stream.
    ``what`` and ``whole`` name the command's flags for this export and the whole model's."""
    if not config.lora.enabled:
        raise ConfigError(f"{what} needs a LoRA run (LoraConfig.rank above 0); export the whole model with "
                          f"{whole}")
    family = model_family(model)
    saved = saved_names(list(model.param_shapes()), config.lora.modules_to_save)
    if "wpe" in saved and config.model.init_from_hf:  # GPT-2's position table, cut to seq_len on import
        from pstar_jax.io.hf import read_hf_config
        rows = read_hf_config(config.model.init_from_hf).get("n_positions", 1024)
        if rows != model.param_shapes()["wpe"][0]:
            raise ConfigError(f"{what}: the run trained wpe in full with {model.param_shapes()['wpe'][0]} positions, "
                              f"the base has {rows}, so peft could not load it; export the merged model with "
                              f"{whole} instead")
    tensors = {name: np.array(value, np.float32) for name, value in iter_params() if is_adapter(name) or name in saved}
    lora = config.lora
    return write_adapter(directory, tensors, rank=lora.rank, alpha=float(lora.alpha), dropout=float(lora.dropout),
                         rslora=lora.rslora, targets=_projections(family, lora.target_list), family=family,
                         base_model_name_or_path=config.model.init_from_hf, modules_to_save=sorted(saved),
                         tie_embeddings=bool(getattr(model.config, "tie_embeddings", False)), what=what)


def hf_stream(config: RunConfig, iter_params: Callable[[], Iterable[tuple[str, np.ndarray]]],
              iter_adapters: Callable[[], Iterable[tuple[str, np.ndarray]]] | None = None
              ) -> Iterable[tuple[str, np.ndarray]]:
    """The tensors an HF export writes: the parameters, with a LoRA run's adapters merged into
    their kernels (W + scale * lora_a @ lora_b, fp32) as the base streams by; ``iter_adapters``
    (peft_io.merged_stream) gives the adapters more cheaply than ``iter_params``."""
    lora = config.lora
    if not lora.enabled:
        return iter_params()
    return merged_stream(iter_params, lora_scale(float(lora.alpha), lora.rank, lora.rslora), iter_adapters)
