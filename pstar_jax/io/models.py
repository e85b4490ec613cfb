"""The model a configuration names: its model module (pstar_models, or the user's own), built from a
preset or from a Hugging Face config.json, and that module's Hugging Face tensor map and config."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

import dataclasses

from pstar_jax.config import CheckpointError, ConfigError, RunConfig
from pstar_jax.model.staged import StagedModel


def import_user_module(name: str) -> Any:
    """``name`` imported as ``python -m`` would find it: a console script's sys.path lacks the current
    directory, so ``--model-module examples.my_model`` run from a clone is retried with the current
    directory appended (after the installed packages, which it never shadows), only when the module
    itself (not something it imports) is missing."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        cwd = os.getcwd()
        missing = err.name or ""
        if not (name == missing or name.startswith(missing + ".")) or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        importlib.invalidate_caches()
        return importlib.import_module(name)


def _model_module(config: RunConfig) -> Any:
    name = config.model.module
    try:
        return import_user_module(name)
    except ImportError as err:
        raise ConfigError(f"ModelConfig.module {name!r} cannot be imported ({err}); name an importable "
                          "module with a build_model function") from None


def _module_function(module: Any, name: str, config: RunConfig) -> Any:
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"ModelConfig.module {config.model.module!r} has no {name} function; use a module that "
                          f"has one (the default, pstar_models, does)")
    return fn


TRUSTED_MODULE = "pstar_models"  # installed with pstar_jax: the one module a file may name on its own


def saved_run_config(config: RunConfig, named_module: str | None, where: str, prog: str) -> RunConfig:
    """A checkpoint's saved configuration, with the model module this command may import: the one
    the user named on its command line (``--model-module``, a decision to trust that code, like
    transformers' ``trust_remote_code``), else pstar_models. A checkpoint is a file from anywhere:
    the module its metadata records is never imported on its word, since importing a module runs
    its code (and a name not installed would be looked for in the current directory)."""
    if named_module:
        return dataclasses.replace(config, model=dataclasses.replace(config.model, module=named_module))
    if config.model.module != TRUSTED_MODULE:
        raise CheckpointError(f"the checkpoint in {where} was trained with the model module "
                              f"{config.model.module!r}, whose code {prog} runs only when you name it: pass "
                              f"--model-module {config.model.module} if you trust it")
    return config


def load_model(config: RunConfig) -> StagedModel:
    """The model a config names: ``build_model(name, **overrides)`` of its model module, or, with
    ``init_from_hf``, ``build_from_hf(config.json, **overrides)`` (an override that contradicts the
    checkpoint's config is refused)."""
    cfg = config.model
    module = _model_module(config)
    lora = {}
    if config.lora.enabled:  # the module's own spec class: pstar_jax never imports a model
        lora = dict(lora=_module_function(module, "LoraSpec", config)(**config.lora.spec_fields()))
    try:
        if cfg.init_from_hf:
            from pstar_jax.io.hf import has_weights, header_shapes, read_hf_config
            hf_json = read_hf_config(cfg.init_from_hf)
            check = getattr(module, "check_hf_shapes", None)  # optional: sizes against the headers, first
            # (a config alone, as pstar-plan may get for a checkpoint not yet downloaded, has no
            # tensors to check; loading the weights refuses their absence)
            if callable(check) and has_weights(cfg.init_from_hf):
                check(hf_json, header_shapes(cfg.init_from_hf))
            return _module_function(module, "build_from_hf", config)(hf_json, **lora, **cfg.overrides())
        return _module_function(module, "build_model", config)(cfg.name, **lora, **cfg.overrides())
    except (ValueError, TypeError, KeyError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from None


def hf_functions(config: RunConfig) -> tuple[Any, Any]:
    """The model module's (hf_tensors, hf_config)."""
    module = _model_module(config)
    return _module_function(module, "hf_tensors", config), _module_function(module, "hf_config", config)


def hf_export_source(config: RunConfig) -> str | None:
    """The run's --init-from-hf directory, if an HF export follows it (its config.json is there and
    the module's hf_config takes ``source``): the export keeps its config's fields and layout, and
    the rows of a tensor cut short on import (pstar_jax.io.hf_export)."""
    src = config.model.init_from_hf
    if src and os.path.isfile(os.path.join(src, "config.json")) and \
            "source" in inspect.signature(hf_functions(config)[1]).parameters:
        return src
    return None


def hf_export_config(config: RunConfig, model: StagedModel) -> tuple[Any, dict]:
    """The model's HF tensor map and config.json; the config keeps the fields and layout of the
    run's --init-from-hf config.json where the export follows it (``hf_export_source``)."""
    tensors, hf_config = hf_functions(config)
    source = None
    src = hf_export_source(config)
    if src:
        from pstar_jax.io.hf import read_hf_config
        source = read_hf_config(src)
    try:
        return tensors(model), hf_config(model) if source is None else hf_config(model, source=source)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"the model cannot be exported to Hugging Face: {err}") from None
