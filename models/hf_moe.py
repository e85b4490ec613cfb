"""Mixtures of experts in Hugging Face checkpoints (qwen3_moe, mixtral): the experts' config.json
fields read into a LlamaConfig and written back, their tensor names, and the check of their count
and width against the weights' shapes. The layers themselves are models/moe.py's."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from pstar_models.hf_fields import HF_DEFAULTS, count, refuse_unless
from pstar_models.llama_config import MOE_FAMILIES, LlamaConfig

EXPERT_KEYS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}  # the experts' count per layer


def expert_key(config: Mapping[str, Any], family: str) -> str:
    """The key config.json counts a layer's experts under: transformers 4.x writes qwen3_moe's as
    num_experts, 5.x as num_local_experts (Mixtral's name, which its Qwen3MoeConfig maps
    num_experts to); either is read, and both given must agree."""
    if family != "qwen3_moe" or "num_local_experts" not in config:
        return EXPERT_KEYS.get(family, "num_experts")
    if "num_experts" in config and config["num_experts"] != config["num_local_experts"]:
        raise ValueError(f"config.json's num_experts={config['num_experts']!r} and num_local_experts="
                         f"{config['num_local_experts']!r} disagree (transformers 4.x writes the first, 5.x the "
                         "second); keep the one the weights have")
    return "num_local_experts" if "num_experts" not in config else "num_experts"


def experts(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a LlamaConfig (none for a dense family), refusing in one
    line what transformers would compute differently from our blocks."""
    if family not in MOE_FAMILIES:
        return {}
    aux = router_aux(config)
    key = expert_key(config, family)
    n_experts = count(config, key, family)
    k = count(config, "num_experts_per_tok", family)
    if k > n_experts:
        raise ValueError(f"config.json's num_experts_per_tok={k} exceeds {key}={n_experts}; "
                         "a token cannot choose more experts than a layer has")
    if family == "mixtral":
        jitter = config.get("router_jitter_noise") or 0
        refuse_unless(jitter == 0, f"router_jitter_noise {jitter} (random noise on the router's input in "
                                    "training; only 0, the published checkpoints' value)")
        return dict(n_experts=n_experts, n_experts_per_tok=k, **aux)
    normalise = config.get("norm_topk_prob", HF_DEFAULTS[family]["norm_topk_prob"])
    if not isinstance(normalise, bool):
        raise ValueError(f"config.json's norm_topk_prob is {normalise!r}; it must be true or false")
    return dict(n_experts=n_experts, n_experts_per_tok=k, d_ff_expert=count(config, "moe_intermediate_size", family),
                norm_topk_prob=normalise, **layer_pattern(config), **aux)


def router_aux(config: Mapping[str, Any]) -> dict[str, Any]:
    """output_router_logits (whether transformers adds the routers' load-balancing loss when
    training) and its coefficient router_aux_loss_coef (transformers' default 0.001)."""
    on = config.get("output_router_logits", False)
    if not isinstance(on, bool):
        raise ValueError(f"config.json's output_router_logits is {on!r}; it must be true or false")
    coef = config.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
        raise ValueError(f"config.json's router_aux_loss_coef is {coef!r}; it must be a number >= 0")
    return dict(output_router_logits=on, router_aux_loss_coef=float(coef))


def layer_pattern(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's dense layers: mlp_only_layers (a list of layer indices) and decoder_sparse_step
    (experts in every step-th layer), checked against num_hidden_layers."""
    only, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)
    n_layer = config.get("num_hidden_layers")
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"config.json's mlp_only_layers is {str(only)[:80]}; it must be a list of layer indices")
    if isinstance(n_layer, int) and (outside := [i for i in only if not 0 <= i < n_layer]):
        raise ValueError(f"config.json's mlp_only_layers holds {outside[0]}, which is no layer of the {n_layer} "
                         f"(num_hidden_layers: 0 to {n_layer - 1}); remove it")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json's decoder_sparse_step is {step!r}; it must be a whole number >= 1 "
                         "(1: experts in every layer)")
    return dict(mlp_only_layers=tuple(sorted(set(only))), decoder_sparse_step=step)


# A mixture of experts' tensors (models/moe.py): ours -> (qwen3_moe's, mixtral's) name in the layer.
_EXPERT_MATRICES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
_EXPERT_NAME = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)\.kernel$")


def moe_tensor(family: str, rest: str) -> str | None:
    """The HF name, inside a layer, of a block tensor of a mixture of experts (None: not one)."""
    moe = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    if rest == "mlp.router.kernel":
        return f"{moe}.gate.weight"
    m = _EXPERT_NAME.match(rest)
    if m is None:
        return None
    return f"{moe}.experts.{int(m.group(1))}.{_EXPERT_MATRICES[m.group(2)][family == 'mixtral']}.weight"


def first_sparse_layer(config: Mapping[str, Any], family: str) -> int:
    """The first layer with experts (0 but where Qwen3-MoE's mlp_only_layers or decoder_sparse_step
    make the first layers dense)."""
    if family != "qwen3_moe":
        return 0
    pattern, n_layer = layer_pattern(config), config.get("num_hidden_layers")
    n_layer = n_layer if isinstance(n_layer, int) else 0
    return next((i for i in range(n_layer) if i not in pattern["mlp_only_layers"]
                 and (i + 1) % pattern["decoder_sparse_step"] == 0), 0)


def check_experts(config: Mapping[str, Any], family: str, shapes: Mapping[str, Sequence[int]], agree: Any) -> None:
    """The expert count and width of config.json against the first sparse layer's tensors."""
    moe, key = ("mlp" if family == "qwen3_moe" else "block_sparse_moe"), expert_key(config, family)
    n_experts, i = count(config, key, family, bounded=False), first_sparse_layer(config, family)
    expert = re.compile(rf"^(?:model\.)?layers\.{i}\.{moe}\.experts\.(\d+)\.")
    found = {int(m.group(1)) for n in shapes if (m := expert.match(n))}
    if found and (len(found) != n_experts or found != set(range(len(found)))):  # (no range of a hostile count)
        gaps = "" if found == set(range(len(found))) else f" (numbered {min(found)} to {max(found)}, with gaps)"
        raise ValueError(f"config.json's {key}={n_experts} disagrees with the weights, whose layer {i} holds "
                         f"{len(found)} experts{gaps}; set {key} to {len(found)} or use the weights this "
                         "config.json belongs to")
    agree(key, n_experts, f"model.layers.{i}.{moe}.gate.weight", 0, "router rows")
    width = "moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"
    first = f"model.layers.{i}.{moe}.experts.0.{'gate_proj' if family == 'qwen3_moe' else 'w1'}.weight"
    agree(width, count(config, width, family, bounded=False), first, 0, "rows")


def expert_fields(c: LlamaConfig) -> dict[str, Any]:
    """The experts' keys of an exported config.json (none for a dense family)."""
    if c.family == "qwen3_moe":
        return dict(num_experts=c.n_experts, num_experts_per_tok=c.n_experts_per_tok,
                    moe_intermediate_size=c.expert_width, norm_topk_prob=c.norm_topk_prob,
                    decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers),
                    output_router_logits=c.output_router_logits, router_aux_loss_coef=c.router_aux_loss_coef)
    if c.family == "mixtral":
        return dict(num_local_experts=c.n_experts, num_experts_per_tok=c.n_experts_per_tok, router_jitter_noise=0.0,
                    output_router_logits=c.output_router_logits, router_aux_loss_coef=c.router_aux_loss_coef)
    return {}
