"""The run's objective: SFT (the loss over trained tokens) or preference tuning
(pstar_jax.model.preference), and which data files each one takes.

A preference file is a packed SFT file whose sidecar says ``"preference": true`` (pairs of
consecutive segments, chosen first; pstar-tokens --preference writes it). An SFT run refuses one,
and preference tuning refuses anything else, or one whose rows are not whole pairs
(pstar_jax.data.pairs), at load time and in one line naming the file's flag.
"""

from __future__ import annotations

from typing import Any

from pstar_jax.config import RunConfig
from pstar_jax.config.errors import ConfigError, DataError
from pstar_jax.data.pairs import check_pairs


def is_preference(data: Any) -> bool:
    """Whether ``data`` is a preference file's rows (its sidecar says so)."""
    return bool(getattr(data, "info", {}).get("preference") is True)


def check_data(config: RunConfig, data: Any, what: str) -> None:
    """DataError (one line) when ``data`` (the file ``what`` names) does not suit the objective."""
    dpo = config.preference.objective == "dpo"
    if dpo and not is_preference(data) and what == "DataConfig.path" and config.data.path is None:
        raise DataError("PreferenceConfig.objective dpo trains on pairs of chosen and rejected answers, but without "
                        "DataConfig.path the data is the built-in corpus, which holds none; give DataConfig.path, "
                        "a preference file made with pstar-tokens --preference")
    if dpo and not is_preference(data):
        raise DataError(f"{what} is not a preference file (its sidecar does not say \"preference\": true), but "
                        "PreferenceConfig.objective dpo trains on pairs of chosen and rejected answers; make one "
                        "with pstar-tokens --preference")
    if dpo:
        check_pairs(data, what)
    if not dpo and is_preference(data):
        raise DataError(f"{what} is a preference file (pairs of chosen and rejected answers); tune on it with "
                        "PreferenceConfig.objective dpo, or pack SFT data with pstar-tokens --chat")


def trained_model(config: RunConfig, model: Any) -> Any:
    """The model the engine trains: ``model`` itself for SFT; under preference tuning the model with
    the preference head, its reference the base with the adapters off in a LoRA run."""
    if config.preference.objective != "dpo":
        return model
    if getattr(model, "router_aux_coef", None) is not None:
        raise ConfigError("PreferenceConfig.objective dpo does not add a mixture of experts' router loss (TRL's "
                          "DPOTrainer would); train without it: --no-output-router-logits, or "
                          "output_router_logits false in config.json")
    from pstar_jax.model.preference import PreferenceModel
    return PreferenceModel(model, config.preference, adapters_off=config.lora.enabled)
