"""adapter_config.json, the settings half of a peft LoRA adapter: what an export writes (peft
0.21.0's keys, with the values that say what was trained) and what an import accepts. A setting
that changes the adapter's math beyond plain LoRA (DoRA, per-module ranks, trained biases...) is
refused in one line rather than read as something else. Knows module names only as strings the
caller hands in (peft_io holds the name maps).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence

from pstar_jax.config.errors import AdapterError
from pstar_jax.config.paths import os_error_cause

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# adapter_config.json as peft 0.21.0 writes it for a LoRA of a causal LM; adapter_config sets the
# fields that say what was trained. Newer peft ignores keys it lacks; older peft fills its defaults.
_PEFT_CONFIG = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None,
    "base_model_name_or_path": None, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
    "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
    "init_lora_weights": True, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 8, "lora_bias": False, "lora_dropout": 0.0,
    "lora_ga_config": None, "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "monteclora_config": None, "peft_type": "LORA", "peft_version": "0.21.0", "qalora_group_size": 16, "r": 8,
    "rank_pattern": {}, "revision": None, "target_modules": [], "target_parameters": None,
    "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_bdlora": None, "use_dora": False,
    "use_qalora": False, "use_rslora": False, "velora_config": None}
# Settings of adapter_config.json that change the adapter's math or shape beyond what pstar_jax
# implements: key -> (what it means, whether the value is harmless).
_REFUSED = {
    "use_dora": ("DoRA (use_dora)", lambda v: not v),
    "bias": ("trained biases (bias != 'none')", lambda v: v in (None, "none")),
    "lora_bias": ("a bias on lora_B (lora_bias)", lambda v: not v),
    "rank_pattern": ("a rank per module (rank_pattern)", lambda v: not v),
    "alpha_pattern": ("an alpha per module (alpha_pattern)", lambda v: not v),
    "layers_to_transform": ("LoRA on some layers only (layers_to_transform)", lambda v: v in (None, [])),
    "layer_replication": ("layer_replication", lambda v: not v),
    "target_parameters": ("LoRA on parameters (target_parameters)", lambda v: not v),
    "trainable_token_indices": ("trainable_token_indices", lambda v: not v),
    "use_qalora": ("QALoRA (use_qalora)", lambda v: not v),
    "alora_invocation_tokens": ("activated LoRA (alora_invocation_tokens)", lambda v: not v),
    "use_bdlora": ("BD-LoRA (use_bdlora)", lambda v: not v),
    "velora_config": ("VeLoRA (velora_config)", lambda v: not v),
    "kasa_config": ("KaSA (kasa_config)", lambda v: not v),
    "arrow_config": ("Arrow routing (arrow_config)", lambda v: not v),
    "monteclora_config": ("MonteCLoRA (monteclora_config)", lambda v: not v),
}


def adapter_config(*, rank: int, alpha: float, dropout: float, rslora: bool, target_modules: Sequence[str],
                   modules_to_save: Sequence[str], fan_in_fan_out: bool, tie_embeddings: bool,
                   base_model_name_or_path: str | None) -> dict:
    """The adapter_config.json of a LoRA adapter; ``target_modules`` and ``modules_to_save`` are HF
    module names. ``tie_embeddings``: a saved embedding is the head too, which peft keeps tied only
    when asked (ensure_weight_tying)."""
    return {**_PEFT_CONFIG, "base_model_name_or_path": base_model_name_or_path, "r": rank, "lora_alpha": alpha,
            "lora_dropout": dropout, "use_rslora": rslora, "target_modules": sorted(target_modules),
            "fan_in_fan_out": fan_in_fan_out, "modules_to_save": sorted(modules_to_save) or None,
            "ensure_weight_tying": tie_embeddings and bool(modules_to_save)}


def write_config(path: str, config: Mapping) -> None:
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def target_modules(projections: Sequence[str], block_modules: Mapping[str, str]) -> list[str]:
    """peft's target_modules for the adapted ``projections``: HF's short module names (q_proj,
    c_attn), a dotted path only where the short name would also match a projection without an
    adapter (GPT-2's two c_proj). ``block_modules``: each projection -> its HF block-relative path."""
    out = []
    for p in projections:
        short = block_modules[p].rsplit(".", 1)[-1]
        clash = [q for q, path in block_modules.items() if q != p and path.rsplit(".", 1)[-1] == short]
        out.append(short if all(q in projections for q in clash) else block_modules[p])
    return sorted(set(out))


def read_config(directory: str) -> dict:
    """A peft adapter directory's adapter_config.json, once both its files are known to be there."""
    if not os.path.isdir(directory):
        raise AdapterError(f"{directory} is not a directory; pass a peft adapter directory (adapter_config.json "
                           "and adapter_model.safetensors)")
    path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise AdapterError(f"{directory} holds no {ADAPTER_CONFIG}; pass a peft adapter directory")
    if not os.path.isfile(os.path.join(directory, ADAPTER_WEIGHTS)):
        other = " (only adapter_model.bin: convert it with safetensors first)" if os.path.isfile(
            os.path.join(directory, "adapter_model.bin")) else ""
        raise AdapterError(f"{directory} holds no {ADAPTER_WEIGHTS}{other}; pass a peft adapter directory")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise AdapterError(f"{path} is not readable JSON ({os_error_cause(err) if isinstance(err, OSError) else err})"
                           ) from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} does not hold a JSON object")
    return config


def lora_settings(config: Mapping, path: str) -> tuple[int, float, float, bool]:
    """(rank, alpha, dropout, rslora) of an adapter_config.json, after refusing what we do not implement."""
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path} describes a {config.get('peft_type')} adapter; only peft LoRA adapters "
                           "(peft_type LORA) are read")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise AdapterError(f"{path} is for task {config['task_type']}; only CAUSAL_LM adapters are read")
    for key, (meaning, harmless) in _REFUSED.items():
        if not harmless(config.get(key)):
            raise AdapterError(f"{path} asks for {meaning}, which pstar_jax does not implement; "
                               "train the adapter without it")
    rank, alpha, dropout = config.get("r"), config.get("lora_alpha", 8), config.get("lora_dropout", 0.0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{path}'s r is {rank!r}; it must be a positive whole number")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{path}'s lora_alpha is {alpha!r}; it must be a positive number")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise AdapterError(f"{path}'s lora_dropout is {dropout!r}; it must be in [0, 1)")
    return rank, float(alpha), float(dropout), bool(config.get("use_rslora", False))


def targeted(config: Mapping, path: str, hf: Mapping[str, Sequence[str]], family: str) -> set[str]:
    """The projections target_modules names (peft's rules: a regex matched against the whole module
    path, or names matched exactly or as a dotted suffix). ``hf``: each projection -> the HF module
    paths of it in every block."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as err:
            raise AdapterError(f"{path}'s target_modules {targets!r} is not a regular expression ({err})") from None
        return {p for p, names in hf.items() if any(pattern.fullmatch(n) for n in names)}
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{path}'s target_modules is {targets!r}; it must name the modules the adapter wraps")
    found = set()
    for t in targets:
        hit = {p for p, names in hf.items() if any(n == t or n.endswith("." + t) for n in names)}
        if not hit:
            raise AdapterError(f"{path} targets {t!r}, which is not a projection of this {family} model "
                               f"(those are {', '.join(sorted({v[0].rsplit('.', 1)[-1] for v in hf.values()}))}); "
                               "the adapter was trained for another model")
        found |= hit
    return found
