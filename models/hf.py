"""Hugging Face checkpoints: config.json <-> our model configs, and the tensor name map.

``check_hf_shapes(config, shapes)`` checks its sizes against the weights' headers first;
``build_from_hf(config)`` reads a config.json dict (model_type gpt2 or one of llama_config.FAMILIES) into
a staged model, refusing what our models do not implement; ``hf_config(model)`` writes one that
transformers' from_pretrained loads; ``hf_tensors(model)`` names, for each of our parameters,
the HF tensor holding it and how to convert it. No file I/O here: the checkpoint reader and
writer use these three.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, NamedTuple, Sequence

from pstar_models.gpt import LN_EPS, GPTConfig, StagedGPT
from pstar_models.lora import LoraSpec, is_adapter
from pstar_models.llama import DEFAULT_SEQ_LEN, FAMILIES, Llama3RopeScaling, LlamaConfig, StagedLlama
from pstar_models.llama_config import GEMMA, MOE_FAMILIES
from pstar_models.hf_gemma import (GEMMA_BLOCK, gemma_export, gemma_fields, other_tower, text_tower, tower_names,
                                    with_text_defaults)
from pstar_models.hf_fields import HF_DEFAULTS, layer_types, refuse_unless, require
from pstar_models.hf_moe import check_experts, expert_fields, expert_key, experts, moe_tensor
from pstar_models import hf_qwen35
from pstar_models.qwen35 import Qwen35Config, StagedQwen35

QWEN35 = hf_qwen35.TEXT  # Qwen3.5's text decoder (models/qwen35.py, its names in models/hf_qwen35.py)
SUPPORTED = ("gpt2", *FAMILIES, QWEN35)
_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM", GEMMA: "Gemma3ForCausalLM"}


class HFTensor(NamedTuple):
    """Where one of our parameters lives in an HF checkpoint."""
    name: str
    transpose: bool  # torch Linear weights are [out, in], our kernels [in, out]
    truncate_rows: bool  # GPT-2's wpe: the checkpoint may hold more positions than seq_len (an export puts them back)


def _with_overrides(cls: type, derived: dict[str, Any], overrides: Mapping[str, Any],
                    hf_keys: Mapping[str, str]) -> Any:
    """``cls(**derived)`` after checking that every non-None override agrees with the config
    (seq_len, which is a training choice, has been settled by the caller)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    for name, value in overrides.items():
        if value is None or name == "seq_len":
            continue
        if name not in fields:
            raise ValueError(f"unknown model setting {name!r} for a {cls.__name__}; known: {', '.join(sorted(fields))}")
        if value != derived[name]:
            source = f"config.json's {hf_keys[name]}" if name in hf_keys else "config.json"
            raise ValueError(f"{name}={value!r} contradicts {source} ({derived[name]!r}); drop the setting "
                             "or use a checkpoint with that shape")
    return cls(**derived)


def _gpt2_config(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> GPTConfig:
    d = require(config, "n_embd")
    n_inner = config.get("n_inner") or 4 * d
    act = config.get("activation_function", "gelu_new")
    refuse_unless(act in ("gelu_new", "gelu_pytorch_tanh"), f"activation_function {act!r} (only gelu_new)")
    eps = config.get("layer_norm_epsilon", 1e-5)
    refuse_unless(eps == LN_EPS, f"layer_norm_epsilon {eps} (only {LN_EPS})")
    refuse_unless(config.get("scale_attn_weights", True), "scale_attn_weights false")
    refuse_unless(not config.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx")
    refuse_unless(not config.get("add_cross_attention", False), "add_cross_attention")
    refuse_unless(n_inner % d == 0, f"n_inner {n_inner}, not a multiple of n_embd {d}")
    n_positions = config.get("n_positions", 1024)
    seq_len = overrides.get("seq_len") or n_positions
    if seq_len > n_positions:
        raise ValueError(f"seq_len={seq_len} exceeds the checkpoint's learned positions "
                         f"(n_positions={n_positions}); choose seq_len <= {n_positions}")
    derived = dict(vocab_size=require(config, "vocab_size"), d_model=d, n_layer=require(config, "n_layer"),
                   n_head=require(config, "n_head"), seq_len=seq_len,
                   tie_embeddings=config.get("tie_word_embeddings", True), mlp_ratio=n_inner // d)
    return _with_overrides(GPTConfig, derived, overrides, {
        "vocab_size": "vocab_size", "d_model": "n_embd", "n_layer": "n_layer", "n_head": "n_head",
        "tie_embeddings": "tie_word_embeddings", "mlp_ratio": "n_inner / n_embd"})


def _rope(config: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """RoPE's theta and scaling from either layout: transformers 4.x writes top-level ``rope_theta``
    and ``rope_scaling``, 5.x only ``rope_parameters`` (theta, rope_type and factors in one dict).
    Precedence as in 5.x: a non-null rope_scaling, else rope_parameters; theta from that dict,
    else the top-level rope_theta, else 10000."""
    key = "rope_scaling" if config.get("rope_scaling") is not None else "rope_parameters"
    params = config.get(key)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json's {key} is {params!r}, not an object of RoPE settings")
    if params and all(isinstance(v, dict) for v in params.values()):  # one dict per layer type
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        refuse_unless(len(distinct) == 1, f"a different {key} per layer type ({', '.join(params)})")
        params = next(iter(params.values()))
    theta = params.get("rope_theta")
    theta = config.get("rope_theta", 10000.0) if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"config.json's rope_theta is {theta!r}; it must be a positive number")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    refuse_unless(partial in (None, 1, 1.0), f"partial_rotary_factor {partial} (only 1.0, RoPE on the whole head)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    refuse_unless(kind == "llama3", f"{key} rope_type {kind!r} (only 'default' and 'llama3')")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if params.get(k) is None]
    if missing:
        raise ValueError(f"config.json's {key} (rope_type 'llama3') has no {missing[0]!r}")
    # 5.x fills a missing original context with max_position_embeddings, as here.
    original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    return float(theta), Llama3RopeScaling(
        factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]), original_max_position_embeddings=int(original))


def _sliding_window(config: Mapping[str, Any], family: str, n_layer: int) -> int | None:
    """The window of the layers that slide, or None: what transformers would apply."""
    layer_types(config, family, n_layer)  # refuses a kind of layer we do not implement
    if family == "mistral":
        return config.get("sliding_window", 4096)
    if family == "mixtral":
        return config.get("sliding_window")
    if family == "qwen3_moe":  # its sliding_window applies to every layer once use_sliding_window is set
        return config.get("sliding_window", 4096) if config.get("use_sliding_window", False) else None
    if family in ("qwen2", "qwen3") and config.get("use_sliding_window", False):
        types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(n_layer)]
        return config.get("sliding_window", 4096) if "sliding_attention" in types else None
    return None


def _head_sizes(config: Mapping[str, Any], family: str) -> tuple[Any, Any]:
    """(head_dim as given, None where it is left to hidden_size / num_attention_heads; the key/value
    heads) as transformers reads them from ``config``."""
    defaults = HF_DEFAULTS[family]
    n_kv_head = config.get("num_key_value_heads", defaults.get("num_key_value_heads"))
    return config.get("head_dim", defaults.get("head_dim")), n_kv_head or config.get("num_attention_heads")


def _llama_config(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> LlamaConfig:
    family = config["model_type"]
    defaults = HF_DEFAULTS[family]
    gemma = family == GEMMA
    if gemma:
        config = with_text_defaults(config)
    act = config.get("hidden_act", "silu")
    refuse_unless(gemma or act == "silu", f"hidden_act {act!r} (only silu)")
    if family in ("llama", "qwen3", "qwen3_moe"):
        refuse_unless(not config.get("attention_bias", False), "attention_bias (biases on q/k/v/o)")
        refuse_unless(not config.get("mlp_bias", False), "mlp_bias")
    refuse_unless(config.get("partial_rotary_factor", 1.0) == 1.0, "partial_rotary_factor below 1")
    n_head, n_layer = require(config, "num_attention_heads"), require(config, "num_hidden_layers")
    d_model = require(config, "hidden_size")
    head_dim, n_kv_head = _head_sizes(config, family)
    if head_dim is not None and isinstance(d_model, int) and isinstance(n_head, int) and head_dim * n_head == d_model:
        head_dim = None  # transformers writes the derived value; ours means the same by None
    rope_theta, rope_scaling = (None, None) if gemma else _rope(config)
    max_positions = config.get("max_position_embeddings") or defaults["max_position_embeddings"]
    seq_len = overrides.get("seq_len") or min(max_positions, DEFAULT_SEQ_LEN)
    window = None if gemma else _sliding_window(config, family, n_layer)
    if window is not None and window < seq_len:
        raise ValueError(f"config.json's sliding_window={window} would take effect at seq_len={seq_len}, and "
                         f"pstar_jax does not implement sliding-window attention; choose seq_len <= {window}")
    derived = dict(
        vocab_size=require(config, "vocab_size"), d_model=d_model, n_layer=n_layer,
        n_head=n_head, n_kv_head=n_kv_head,
        d_ff=require(config, "intermediate_size"), seq_len=seq_len, head_dim=head_dim,
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        norm_eps=float(config.get("rms_norm_eps", defaults["rms_norm_eps"])), qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe", GEMMA),
        tie_embeddings=bool(config.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
        max_position_embeddings=None if max_positions == seq_len else max_positions, family=family,
        **experts(config, family))
    if gemma:
        derived.update(gemma_fields(config, n_layer))
    if overrides.get("output_router_logits") is not None:  # a training choice (pstar-train's flag), not a shape
        derived["output_router_logits"] = overrides["output_router_logits"]
    return _with_overrides(LlamaConfig, derived, overrides, {
        "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads", "d_ff": "intermediate_size",
        "head_dim": "head_dim", "rope_theta": "rope_theta (or rope_parameters)",
        "rope_scaling": "rope_scaling (or rope_parameters)",
        "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings", "family": "model_type",
        "qkv_bias": "model_type", "qk_norm": "model_type", "n_experts": expert_key(config, family),
        "n_experts_per_tok": "num_experts_per_tok", "d_ff_expert": "moe_intermediate_size",
        "norm_topk_prob": "norm_topk_prob", "layer_types": "layer_types (or sliding_window_pattern)",
        "sliding_window": "sliding_window", "rope_local_theta": "rope_local_base_freq (or rope_parameters)",
        "query_pre_attn_scalar": "query_pre_attn_scalar", "final_softcap": "final_logit_softcapping"})


def build_from_hf(config: Mapping[str, Any], lora: LoraSpec | None = None, **overrides: Any) -> StagedGPT | StagedLlama:
    """The staged model a config.json describes. ``overrides`` are our config fields (None values
    ignored): ``seq_len`` may be chosen (for GPT-2 at most n_positions; default n_positions for
    GPT-2, min(max_position_embeddings, 4096) for the Llama family), any other must agree.
    ``lora`` adds adapters (models/lora.py) that the checkpoint does not hold."""
    model_type = config.get("model_type")
    refuse_unless(config.get("quantization_config") is None, "quantization_config (quantized weights)")
    if model_type == "gpt2":
        return StagedGPT(dataclasses.replace(_gpt2_config(config, overrides), lora=lora))
    if model_type in (QWEN35, hf_qwen35.MULTIMODAL):
        return StagedQwen35(dataclasses.replace(hf_qwen35.qwen35_config(config, overrides), lora=lora))
    tower = text_tower(config)  # a multimodal Gemma 3: its text decoder alone
    if tower is not None:
        return build_from_hf(tower, lora, **overrides)
    if model_type in FAMILIES:
        return StagedLlama(dataclasses.replace(_llama_config(config, overrides), lora=lora))
    raise ValueError(f"config.json model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")


# Keys whose place depends on the transformers version that wrote the file.
_LAYOUT_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype")
# Training settings, not the model: an export keeps the source's (we train without dropout).
_SOURCE_WINS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "initializer_range", "use_cache",
                "router_aux_loss_coef")


def hf_config(model: Any, torch_dtype: str = "bfloat16", source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json for ``model`` (a StagedGPT/StagedLlama or anything with such a ``.config``),
    its weights stored in ``torch_dtype``. With ``source``, the config.json the model was read from:
    its other fields (bos/eos ids, ...) are kept and its layout followed (5.x rope_parameters or
    4.x rope_theta/rope_scaling; dtype or torch_dtype), and a GPT-2 keeps its n_positions: the
    writer of an export that follows the source puts back the position rows our seq_len left out."""
    if isinstance(getattr(model, "config", None), Qwen35Config):
        return hf_qwen35.qwen35_hf_config(model.config, torch_dtype, source)
    ours = _hf_config(model, torch_dtype)
    if source is None or source.get("model_type") != ours["model_type"]:
        return ours
    out = {k: v for k, v in source.items() if k not in _LAYOUT_KEYS}
    out.update((k, v) for k, v in ours.items() if k not in _LAYOUT_KEYS and not (k in _SOURCE_WINS and k in source))
    out["dtype" if "dtype" in source and "torch_dtype" not in source else "torch_dtype"] = torch_dtype
    if ours["model_type"] == "gpt2" and source.get("n_positions", 1024) >= ours["n_positions"]:
        del out["n_positions"]  # the source's count (or its default): the writer puts back the rows seq_len cut
        if "n_positions" in source:
            out["n_positions"] = source["n_positions"]
    if ours["model_type"] == GEMMA:  # its RoPE keys in the source's layout
        out.pop("rope_local_base_freq", None)
        out.update(gemma_export(model.config, five="rope_parameters" in source and "rope_theta" not in source))
    elif "rope_theta" in ours:
        if "rope_parameters" in source and "rope_theta" not in source:  # 5.x
            out["rope_parameters"] = {"rope_theta": ours["rope_theta"],
                                      **(ours["rope_scaling"] or {"rope_type": "default"})}
        else:
            out.update(rope_theta=ours["rope_theta"], rope_scaling=ours["rope_scaling"])
    if ours["model_type"] in ("qwen2", "qwen3") and "layer_types" in source:  # what we trained: no layer slides
        out["layer_types"] = ["full_attention"] * ours["num_hidden_layers"]
    return out


def _hf_config(model: Any, torch_dtype: str) -> dict[str, Any]:
    c = model.config
    if isinstance(c, GPTConfig):
        return {"architectures": [_ARCHITECTURES["gpt2"]], "model_type": "gpt2", "vocab_size": c.vocab_size,
                "n_positions": c.seq_len, "n_embd": c.d_model, "n_layer": c.n_layer, "n_head": c.n_head,
                "n_inner": c.mlp_ratio * c.d_model, "activation_function": "gelu_new",
                "layer_norm_epsilon": LN_EPS, "scale_attn_weights": True, "tie_word_embeddings": c.tie_embeddings,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
                "use_cache": True, "torch_dtype": torch_dtype}
    if not isinstance(c, LlamaConfig):
        raise ValueError(f"no Hugging Face export for a model configured by {type(c).__name__}")
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[c.family]], "model_type": c.family, "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings or c.seq_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": None, "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "torch_dtype": torch_dtype}
    if c.head_dim is not None:
        out["head_dim"] = c.head_dim
    if c.rope_scaling is not None:
        out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)}
    if c.family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif c.family == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer)
    elif c.gemma:
        for key in ("hidden_act", "rope_scaling", "rope_theta"):
            del out[key]
        out.update(gemma_export(c, five=False))
    elif c.family in ("qwen3", "qwen3_moe"):  # head_dim always: qwen3 without one means 128, not d_model / n_head
        out.update(head_dim=c.d_head, attention_bias=False, use_sliding_window=False, sliding_window=None,
                   max_window_layers=c.n_layer)
    else:
        out.update(sliding_window=None)
    out.update(expert_fields(c))
    return out


_GPT2_TOP = {"wte.embedding": HFTensor("transformer.wte.weight", False, False),
             "wpe": HFTensor("transformer.wpe.weight", False, True),
             "ln_f.scale": HFTensor("transformer.ln_f.weight", False, False),
             "ln_f.bias": HFTensor("transformer.ln_f.bias", False, False),
             "head.kernel": HFTensor("lm_head.weight", True, False)}
# HF's Conv1D weights are already [in, out]; c_attn is the fused q|k|v, split in that order
# into heads exactly as models.gpt.Attention reshapes qkv to (3, n_head, head_dim).
_GPT2_BLOCK = {"ln1.scale": "ln_1.weight", "ln1.bias": "ln_1.bias", "attn.qkv.kernel": "attn.c_attn.weight",
               "attn.qkv.bias": "attn.c_attn.bias", "attn.proj.kernel": "attn.c_proj.weight",
               "attn.proj.bias": "attn.c_proj.bias", "ln2.scale": "ln_2.weight", "ln2.bias": "ln_2.bias",
               "mlp.fc.kernel": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
               "mlp.proj.kernel": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias"}
_LLAMA_TOP = {"embed.embedding": HFTensor("model.embed_tokens.weight", False, False),
              "norm.scale": HFTensor("model.norm.weight", False, False),
              "head.kernel": HFTensor("lm_head.weight", True, False)}
_LLAMA_BLOCK = {"attn_norm.scale": "input_layernorm.weight", "mlp_norm.scale": "post_attention_layernorm.weight",
                **{f"attn.{x}.kernel": f"self_attn.{x}_proj.weight" for x in "qkvo"},
                **{f"attn.{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"},
                **{f"attn.{x}_norm.scale": f"self_attn.{x}_norm.weight" for x in "qk"},  # Qwen3
                **{f"mlp.{x}.kernel": f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}}


def hf_tensors(model: Any) -> dict[str, HFTensor]:
    """For every parameter of ``model`` (by its pstar name): the HF tensor name, whether to
    transpose, whether the HF tensor may have extra rows to drop. Tied heads have no entry of
    their own (HF's lm_head.weight is the embedding then), nor LoRA adapters (a base checkpoint
    has none; the peft format is pstar_jax/io/peft_io.py's)."""
    if isinstance(model.config, GPTConfig):
        family = "gpt2"
    elif isinstance(model.config, (LlamaConfig, Qwen35Config)):
        family = model.config.family
    else:
        raise ValueError(f"no Hugging Face names for a model configured by {type(model.config).__name__}")
    return {name: hf_tensor(family, name) for name in model.param_shapes() if not is_adapter(name)}


def check_hf_shapes(config: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]) -> None:
    """Refuse, naming the field, a config.json size that the weights' shapes (from the safetensors
    headers, before anything is allocated) contradict. Tensors absent here are left to the loader."""
    tower = text_tower(config)
    if tower is not None:  # the text tower's tensors under the names a gemma3_text checkpoint gives them
        renamed = {n[len(p):]: s for n, s in shapes.items() for p in ("language_model.", "model.language_model.")
                   if n.startswith(p)}
        renamed = {(n if n.startswith(("model.", "lm_head.")) else "model." + n): s for n, s in renamed.items()}
        return check_hf_shapes(tower, renamed)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED or model_type == QWEN35:  # (Qwen3.5: the reader checks each shape)
        return
    if model_type == GEMMA:
        config = with_text_defaults(config)

    def shape(name: str) -> tuple[int, ...] | None:  # GPT-2's own files lack the 'transformer.' prefix
        found = shapes.get(name, shapes.get(name.split(".", 1)[1]))
        return None if found is None else tuple(found)

    def agree(key: str, value: Any, tensor: str, axis: int, what: str) -> None:
        found = shape(tensor)
        if found is None or len(found) <= axis or found[axis] == value:
            return
        raise ValueError(f"config.json's {key}={value} disagrees with the weights: {tensor} has {found[axis]} "
                         f"{what}; set {key} to {found[axis]} or use the weights this config.json belongs to")

    gpt = model_type == "gpt2"
    block = "transformer.h" if gpt else "model.layers"
    n_layer_key = "n_layer" if gpt else "num_hidden_layers"
    layer_name = re.compile(rf"^(?:{block}|{block.split('.', 1)[1]})\.(\d+)\.")  # with the prefix or without
    layers = {int(m.group(1)) for n in shapes if (m := layer_name.match(n))}
    n_layer = require(config, n_layer_key, bounded=False)
    if layers and n_layer != len(layers):
        raise ValueError(f"config.json's {n_layer_key}={n_layer} disagrees with the weights, which hold "
                         f"{len(layers)} layers; set {n_layer_key} to {len(layers)} or use the weights this "
                         "config.json belongs to")
    if gpt:
        d = require(config, "n_embd", bounded=False)
        agree("vocab_size", require(config, "vocab_size", bounded=False), "transformer.wte.weight", 0, "rows")
        agree("n_embd", d, "transformer.wte.weight", 1, "columns")
        agree("n_positions", config.get("n_positions", 1024), "transformer.wpe.weight", 0, "rows")
        if config.get("n_inner") is not None:
            agree("n_inner", config["n_inner"], "transformer.h.0.mlp.c_fc.weight", 1, "columns")
        return
    d, n_head = require(config, "hidden_size", bounded=False), require(config, "num_attention_heads", bounded=False)
    agree("vocab_size", require(config, "vocab_size", bounded=False), "model.embed_tokens.weight", 0, "rows")
    agree("hidden_size", d, "model.embed_tokens.weight", 1, "columns")
    agree("intermediate_size", require(config, "intermediate_size", bounded=False),
          "model.layers.0.mlp.gate_proj.weight", 0, "rows")
    if model_type in MOE_FAMILIES:
        check_experts(config, model_type, shapes, agree)
    given, n_kv_head = _head_sizes(config, model_type)
    explicit = given is not None  # else it follows hidden_size / num_attention_heads
    head_dim = given or d // n_head
    agree("head_dim", head_dim, "model.layers.0.self_attn.q_norm.weight", 0, "entries")  # Qwen3's q norm
    for key, heads, proj in (("num_attention_heads", n_head, "q"), ("num_key_value_heads", n_kv_head, "k")):
        tensor = f"model.layers.0.self_attn.{proj}_proj.weight"
        rows = (shape(tensor) or (heads * head_dim,))[0]
        if rows != heads * head_dim:
            fix = (f"set {key} to {rows // head_dim}" if (explicit or proj == "k") and rows % head_dim == 0
                   else "fix config.json")
            raise ValueError(f"config.json's {key}={heads} disagrees with the weights: {tensor} has {rows} rows, "
                             f"not {heads} heads of {head_dim}; {fix} or use the weights this "
                             "config.json belongs to")


def hf_tensor(family: str, name: str) -> HFTensor:
    """Where our parameter ``name`` lives in a ``family`` checkpoint (a model_type of SUPPORTED), from
    the name alone: what the peft adapter files need, which name base tensors and projections
    without a model at hand."""
    if family not in SUPPORTED:
        raise ValueError(f"no Hugging Face names for family {family!r}; supported: {', '.join(SUPPORTED)}")
    if family == QWEN35:
        return HFTensor(hf_qwen35.hf_name(name), hf_qwen35.transposed(name), False)
    gpt = family == "gpt2"
    top, block, prefix = ((_GPT2_TOP, _GPT2_BLOCK, "transformer.h") if gpt
                          else (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"))
    if name.startswith("blocks.") and name.count(".") >= 2:
        _, i, rest = name.split(".", 2)
        moe = moe_tensor(family, rest) if family in MOE_FAMILIES else None
        if i.isdigit() and moe is not None:
            return HFTensor(f"{prefix}.{i}.{moe}", True, False)
        block = GEMMA_BLOCK if family == GEMMA else block
        if i.isdigit() and rest in block and not (family == "mixtral" and rest.startswith("mlp.")):
            return HFTensor(f"{prefix}.{i}.{block[rest]}", rest.endswith("kernel") and not gpt, False)
    elif name in top:
        return top[name]
    raise ValueError(f"parameter {name!r} has no Hugging Face counterpart in a {family} checkpoint")
