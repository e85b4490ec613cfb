"""The Llama family's configuration (Llama 3.x, Qwen2/2.5, Mistral, Qwen3 dense, the mixtures of
experts Qwen3-MoE and Mixtral, and Gemma 3's text decoder) and its presets, as plain frozen dataclasses: what a model of the
family is, before any array exists."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from pstar_models.limits import MAX_EXPERTS, MAX_HEAD_DIM, MAX_LAYERS, check_sizes
from pstar_models.lora import LoraSpec, check_spec

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "gemma3_text")  # the HF model_type
MOE_FAMILIES = ("qwen3_moe", "mixtral")  # blocks whose MLP is a mixture of experts (qwen3_moe: not every one)
GEMMA = "gemma3_text"
LAYER_TYPES = ("full_attention", "sliding_attention")  # config.json layer_types entries we implement


def gemma_layer_types(n_layer: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's default: every ``pattern``-th layer global, the others sliding (transformers'
    sliding_window_pattern, 6 in the published configs: 5 sliding layers, then 1 global)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layer))


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Linear position interpolation (HF ``rope_scaling`` with ``rope_type: linear``): inv_freq / factor.
    Gemma 3 4B and larger scale their global layers by 8."""
    factor: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor!r}")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency scaling (HF ``rope_scaling`` with ``rope_type: llama3``)."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for field in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not getattr(self, field) > 0:
                raise ValueError(f"rope scaling {field} must be positive, got {getattr(self, field)!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope scaling high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    d_ff: int
    seq_len: int
    head_dim: int | None = None  # None: d_model // n_head
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | LinearRopeScaling | None = None  # Gemma: its global layers' only
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2's q/k/v biases
    qk_norm: bool = False  # Qwen3's RMSNorm over each head's q and k (width head_dim), before RoPE
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None  # the context written to config.json; None: seq_len
    family: str = "llama"  # one of FAMILIES: the HF model_type it exports as
    # Mixture of experts (MOE_FAMILIES): every block's MLP is n_experts SwiGLU experts of width
    # d_ff_expert (None: d_ff), each token routed to n_experts_per_tok of them by a softmax over
    # a bias-free router, the top weights renormalised to sum 1 when norm_topk_prob (Mixtral always).
    n_experts: int = 0
    n_experts_per_tok: int = 0
    d_ff_expert: int | None = None
    norm_topk_prob: bool = True
    # Gemma 3 (family gemma3_text): RMSNorm by 1 + weight, embeddings times sqrt(d_model), GeGLU (tanh
    # GELU), norms before and after attention and the MLP, q/k norms, scores scaled by
    # query_pre_attn_scalar ** -0.5, and per layer (layer_types) full or sliding-window attention,
    # the sliding layers with RoPE base rope_local_theta and no scaling.
    layer_types: tuple[str, ...] | None = None  # one of LAYER_TYPES per layer; None: every layer full
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # None: head_dim
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (final_logit_softcapping)
    # Qwen3-MoE's dense layers: layer i has experts iff i is not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0; the others a dense SwiGLU MLP of width d_ff.
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    # The routers' load-balancing loss (transformers' output_router_logits): router_aux_loss_coef
    # times it is added to the training loss when output_router_logits (models/moe.py).
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    lora: LoraSpec | None = None  # adapters on the projections (models/lora.py); not part of HF's config

    def __post_init__(self) -> None:
        for field in ("rope_theta", "norm_eps", "rope_local_theta", "query_pre_attn_scalar", "final_softcap",
                      "router_aux_loss_coef"):  # JSON writes 500000.0 as 500000: as a float, whatever its size
            value = getattr(self, field)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, field, float(value))
        for field in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{field} must be a positive integer, got {value!r}")
        for field in ("head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"LlamaConfig.{field} must be a positive integer or None, got {value!r}")
        check_sizes("LlamaConfig", {f: getattr(self, f) for f in (
            "vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "seq_len", "head_dim",
            "max_position_embeddings", "sliding_window", "n_experts", "n_experts_per_tok", "d_ff_expert")},
            {"n_layer": MAX_LAYERS, "head_dim": MAX_HEAD_DIM, "n_experts": MAX_EXPERTS,
             "n_experts_per_tok": MAX_EXPERTS})
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"LlamaConfig.d_model={self.d_model} must be divisible by n_head={self.n_head} "
                             "unless head_dim is given")
        if self.d_head % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.d_head} must be even (RoPE rotates pairs)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig.rope_theta must be positive, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"LlamaConfig.norm_eps must be positive, got {self.norm_eps!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, (Llama3RopeScaling, LinearRopeScaling)):
            raise ValueError(f"LlamaConfig.rope_scaling must be a Llama3RopeScaling, a LinearRopeScaling or None, "
                             f"got {self.rope_scaling!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"LlamaConfig.family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        # HF's Qwen2 always has q/k/v biases; its Llama puts attention_bias on o as well, Mistral has none.
        if self.qkv_bias != (self.family == "qwen2"):
            raise ValueError(f"LlamaConfig.qkv_bias={self.qkv_bias} does not fit family {self.family!r}: "
                             "q/k/v biases exist exactly in qwen2")
        if self.qk_norm != (self.family in ("qwen3", "qwen3_moe", GEMMA)):
            raise ValueError(f"LlamaConfig.qk_norm={self.qk_norm} does not fit family {self.family!r}: "
                             "q/k norms exist exactly in qwen3, qwen3_moe and gemma3_text")
        self._check_gemma()
        for field in ("n_experts", "n_experts_per_tok"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LlamaConfig.{field} must be a whole number >= 0, got {value!r}")
        if (self.n_experts > 0) != (self.family in MOE_FAMILIES):
            raise ValueError(f"LlamaConfig.n_experts={self.n_experts} does not fit family {self.family!r}: "
                             f"experts exist exactly in {' and '.join(MOE_FAMILIES)}")
        if self.n_experts and not 0 < self.n_experts_per_tok <= self.n_experts:
            raise ValueError(f"LlamaConfig.n_experts_per_tok={self.n_experts_per_tok} must be between 1 and "
                             f"n_experts={self.n_experts}")
        if self.d_ff_expert is not None and (not isinstance(self.d_ff_expert, int) or self.d_ff_expert <= 0):
            raise ValueError(f"LlamaConfig.d_ff_expert must be a positive integer or None, got {self.d_ff_expert!r}")
        if self.family == "mixtral" and not self.norm_topk_prob:
            raise ValueError("LlamaConfig.norm_topk_prob=False does not fit family 'mixtral', which always "
                             "renormalises its top-k routing weights")
        self._check_layer_pattern()
        if not isinstance(self.output_router_logits, bool):
            raise ValueError(f"LlamaConfig.output_router_logits must be True or False, got {self.output_router_logits!r}")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
            raise ValueError(f"LlamaConfig.router_aux_loss_coef must be a number >= 0, got {coef!r}")
        if self.output_router_logits and not self.sparse_layers:
            raise ValueError("LlamaConfig.output_router_logits needs a layer with experts (a router to balance); "
                             f"{'this model has none' if self.n_experts else 'family ' + repr(self.family) + ' has no experts'}")
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise ValueError(f"LlamaConfig.lora must be a LoraSpec or None, got {self.lora!r}")
        check_spec(self.lora, projections(self), self.family)
        for m in ("gate", "up", "down") if self.lora is not None and self.n_experts else ():
            adapted = sum(self.lora.targets_path(f"mlp.experts.{e}.{m}") for e in range(self.n_experts))
            if 0 < adapted < self.n_experts:
                raise ValueError(f"LoRA targets adapt {adapted} of the {self.n_experts} experts' {m} matrices; "
                                 f"adapt all of them (mlp.experts.*.{m}) or none")

    def _check_gemma(self) -> None:
        gemma_only = ("layer_types", "sliding_window", "rope_local_theta", "query_pre_attn_scalar", "final_softcap")
        if not self.gemma:
            given = [f for f in gemma_only if getattr(self, f) is not None]
            if given:
                raise ValueError(f"LlamaConfig.{given[0]} is Gemma 3's; family {self.family!r} has no such setting")
            if isinstance(self.rope_scaling, LinearRopeScaling):
                raise ValueError(f"LlamaConfig.rope_scaling: linear scaling is Gemma 3's; family {self.family!r} "
                                 "takes a Llama3RopeScaling")
            return
        for field in ("rope_local_theta", "query_pre_attn_scalar", "final_softcap"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"LlamaConfig.{field} must be a positive number or None, got {value!r}")
        if self.layer_types is not None:
            if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.n_layer:
                raise ValueError(f"LlamaConfig.layer_types must be a tuple of one entry per layer "
                                 f"({self.n_layer}), got {self.layer_types!r}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"LlamaConfig.layer_types holds {unknown[0]!r}; known: {', '.join(LAYER_TYPES)}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"LlamaConfig.sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if "sliding_attention" in (self.layer_types or ()) and self.sliding_window is None:
            raise ValueError("LlamaConfig.layer_types has sliding layers but sliding_window is None; give the window")
        if isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError("LlamaConfig.rope_scaling: Gemma 3 scales its global layers linearly (LinearRopeScaling)")

    @property
    def gemma(self) -> bool:
        return self.family == GEMMA

    def sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within the sliding window (Gemma 3's local layers)."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.d_head) ** -0.5

    def _check_layer_pattern(self) -> None:
        only, step = self.mlp_only_layers, self.decoder_sparse_step
        if not isinstance(only, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ValueError(f"LlamaConfig.mlp_only_layers must be a tuple of layer indices, got {only!r}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"LlamaConfig.decoder_sparse_step must be a whole number >= 1, got {step!r}")
        if (only or step != 1) and self.family != "qwen3_moe":
            raise ValueError(f"LlamaConfig.mlp_only_layers and decoder_sparse_step are qwen3_moe's; family "
                             f"{self.family!r} has experts in every layer or in none")
        outside = [i for i in only if not 0 <= i < self.n_layer]
        if outside:
            raise ValueError(f"LlamaConfig.mlp_only_layers holds {outside[0]}, which is no layer of the "
                             f"{self.n_layer} (0 to {self.n_layer - 1})")

    def sparse_layer(self, i: int) -> bool:
        """Whether block i's MLP is a mixture of experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return self.n_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def block_kind(self, i: int) -> tuple[bool, bool]:
        """What sets block i apart from others (pstar_jax.model.staged's block kinds): whether it
        slides (Gemma 3's local layers) and whether its MLP has experts (Qwen3-MoE's dense layers)."""
        return self.sliding(i), self.sparse_layer(i)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if self.sparse_layer(i))

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head

    @property
    def expert_width(self) -> int:
        """An expert's hidden width (moe_intermediate_size; Mixtral's intermediate_size)."""
        return self.d_ff_expert if self.d_ff_expert is not None else self.d_ff


def config_from_fields(fields: Mapping[str, object]) -> LlamaConfig:
    """A LlamaConfig from its fields as JSON holds them (dataclasses.asdict's, as a Flax export writes
    them): the RoPE scaling rebuilt as its class, layer_types as a tuple."""
    fields = dict(fields)
    scaling = fields.get("rope_scaling")
    if isinstance(scaling, dict):
        kind = Llama3RopeScaling if "low_freq_factor" in scaling else LinearRopeScaling
        fields["rope_scaling"] = kind(**scaling)
    for field in ("layer_types", "mlp_only_layers"):
        if isinstance(fields.get(field), list):
            fields[field] = tuple(fields[field])  # type: ignore[arg-type]
    return LlamaConfig(**fields)  # type: ignore[arg-type]


def projections(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Every projection of a block that LoRA may target: path -> (in, out) features. A mixture of
    experts offers every expert's three matrices (``mlp.experts.{e}.gate``), and its dense layers'
    MLP where it has some; its router is no target (an adapter there would move the routing, and peft users leave it out)."""
    D, F, HK, NK = config.d_model, config.d_ff, config.n_head * config.d_head, config.n_kv_head * config.d_head
    attention = {"attn.q": (D, HK), "attn.k": (D, NK), "attn.v": (D, NK), "attn.o": (HK, D)}
    dense = {"mlp.gate": (D, F), "mlp.up": (D, F), "mlp.down": (F, D)}
    if config.n_experts:  # (Qwen3-MoE's mlp_only_layers and decoder_sparse_step leave dense layers among them)
        I = config.expert_width
        experts = {f"mlp.experts.{e}.{m}": shape for e in range(config.n_experts)
                   for m, shape in (("gate", (D, I)), ("up", (D, I)), ("down", (I, D)))}
        return {**attention, **experts, **(dense if len(config.sparse_layers) < config.n_layer else {})}
    return {**attention, **dense}


def _llama3(factor: float) -> Llama3RopeScaling:
    return Llama3RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)


DEFAULT_SEQ_LEN = 4096  # presets train at this length unless told otherwise
_LLAMA3 = LlamaConfig(vocab_size=128256, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, d_ff=14336,
                      seq_len=DEFAULT_SEQ_LEN, rope_theta=500000.0, rope_scaling=_llama3(8.0),
                      norm_eps=1e-5, max_position_embeddings=131072)
_QWEN25 = LlamaConfig(vocab_size=152064, d_model=3584, n_layer=28, n_head=28, n_kv_head=4, d_ff=18944,
                      seq_len=DEFAULT_SEQ_LEN, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True,
                      max_position_embeddings=131072, family="qwen2")
# Every Qwen3 size has head_dim 128; None where d_model / n_head gives it (as models/hf.py reads it).
_QWEN3 = LlamaConfig(vocab_size=151936, d_model=4096, n_layer=36, n_head=32, n_kv_head=8, d_ff=12288,
                     seq_len=DEFAULT_SEQ_LEN, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                     max_position_embeddings=40960, family="qwen3")
_r = dataclasses.replace
# Shapes of the published config.json files, checked against stored copies of them:
# Llama 3.1 8B, 3.2 3B and Qwen2.5 7B/14B/32B in citsjtu2020/LLM-Prof sglang/Model_Config.md;
# Llama 3.2 1B in kevinstephano/thunder_model_blocks hf_llama/llama_config.py; Llama 3.1 70B in
# vulkomilev/oumi configs/recipes/llama3_1/README.md; Qwen2.5 0.5B/72B in a MaxText test file
# quoting huggingface.co/Qwen/Qwen2.5-*/blob/main/config.json (72B base: rms_norm_eps 1e-5, the
# Instruct model has 1e-6); Mistral 7B v0.3 (vocab 32768, theta 1e6, sliding_window null) in
# litgpt's config.py quoting huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json.
# Qwen3 4B/8B/14B/32B: their config.json files in citsjtu2020/LLM-Prof sglang/Model_Config.md; 0.6B
# and 1.7B (and the others again) in pytorch/torchtune torchtune/models/qwen3/_model_builders.py,
# "the default parameter values from huggingface.co/Qwen/Qwen3-*" (the instruct checkpoints, 40960
# positions; the -Base ones have 32768). Sizes checked by keras-team/keras-hub's qwen3_presets.py.
# Qwen3-30B-A3B, Qwen3-235B-A22B (every layer sparse, norm_topk_prob true, the published 40960
# positions) and Mixtral-8x7B-v0.1: their config.json fields as quoted by several projects' tests
# (vLLM, Megatron-Bridge, NVIDIA's conversion tests) and agreeing; their parameter counts (30.5B,
# 235B, 46.7B) are tests/test_moe.py's.


def _gemma3(n_layer: int, **fields: object) -> LlamaConfig:
    """A Gemma 3 text decoder of the published layout: 5 sliding layers (window 1024, RoPE base
    10k) to each global one (base 1e6, linear scaling 8), tied 262k embeddings; ``fields`` the size."""
    base = dict(vocab_size=262208, seq_len=DEFAULT_SEQ_LEN, rope_theta=1000000.0, rope_scaling=LinearRopeScaling(8.0),
                norm_eps=1e-6, qk_norm=True, tie_embeddings=True, max_position_embeddings=131072, family=GEMMA,
                sliding_window=1024, rope_local_theta=10000.0, head_dim=256, query_pre_attn_scalar=256)
    return LlamaConfig(n_layer=n_layer, layer_types=gemma_layer_types(n_layer), **{**base, **fields})  # type: ignore[arg-type]


# Gemma 3 1B (gemma3_text), 4B, 12B, 27B (the text_config of the multimodal gemma3 checkpoints): the
# google/gemma-3-{1b,4b,12b,27b}-pt config.json fields as a stored config module mirroring them
# quotes them (hidden 1152/2560/3840/5376, layers 26/34/48/62, heads 4/8/16/32, kv heads 1/4/8/16,
# head_dim 256 but 128 for 27B, query_pre_attn_scalar 256 but 168 for 27B, intermediate
# 6912/10240/15360/21504, vocab 262144 for 1B and 262208 above, sliding_window 512 for 1B and 1024
# above, linear rope_scaling 8 from 4B up, 32768 positions for 1B and 131072 above); a Flax NNX
# Gemma 3 and keras-hub-style presets in other stored repositories agree on 12B and 27B.
PRESETS: Mapping[str, LlamaConfig] = MappingProxyType({
    "llama-tiny": LlamaConfig(vocab_size=256, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=96,
                              seq_len=64, rope_scaling=_llama3(8.0)),
    "llama-3.2-1b": _r(_LLAMA3, d_model=2048, n_layer=16, n_head=32, d_ff=8192, rope_scaling=_llama3(32.0),
                       tie_embeddings=True),
    "llama-3.2-3b": _r(_LLAMA3, d_model=3072, n_layer=28, n_head=24, d_ff=8192, rope_scaling=_llama3(32.0),
                       tie_embeddings=True),
    "llama-3.1-8b": _LLAMA3,
    "llama-3.1-70b": _r(_LLAMA3, d_model=8192, n_layer=80, n_head=64, d_ff=28672),
    "qwen2.5-0.5b": _r(_QWEN25, vocab_size=151936, d_model=896, n_layer=24, n_head=14, n_kv_head=2, d_ff=4864,
                       tie_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-7b": _QWEN25,
    "qwen2.5-14b": _r(_QWEN25, d_model=5120, n_layer=48, n_head=40, n_kv_head=8, d_ff=13824, norm_eps=1e-5),
    "qwen2.5-32b": _r(_QWEN25, d_model=5120, n_layer=64, n_head=40, n_kv_head=8, d_ff=27648, norm_eps=1e-5),
    "qwen2.5-72b": _r(_QWEN25, d_model=8192, n_layer=80, n_head=64, n_kv_head=8, d_ff=29568, norm_eps=1e-5),
    "qwen3-0.6b": _r(_QWEN3, d_model=1024, n_layer=28, n_head=16, d_ff=3072, head_dim=128, tie_embeddings=True),
    "qwen3-1.7b": _r(_QWEN3, d_model=2048, n_layer=28, n_head=16, d_ff=6144, tie_embeddings=True),
    "qwen3-4b": _r(_QWEN3, d_model=2560, n_head=32, d_ff=9728, head_dim=128, tie_embeddings=True),
    "qwen3-8b": _QWEN3,
    "qwen3-14b": _r(_QWEN3, d_model=5120, n_layer=40, n_head=40, d_ff=17408),
    "qwen3-32b": _r(_QWEN3, d_model=5120, n_layer=64, n_head=64, d_ff=25600, head_dim=128),
    "qwen3-30b-a3b": _r(_QWEN3, d_model=2048, n_layer=48, n_head=32, n_kv_head=4, d_ff=6144, head_dim=128,
                        family="qwen3_moe", n_experts=128, n_experts_per_tok=8, d_ff_expert=768),
    "qwen3-235b-a22b": _r(_QWEN3, d_model=4096, n_layer=94, n_head=64, n_kv_head=4, d_ff=12288, head_dim=128,
                          family="qwen3_moe", n_experts=128, n_experts_per_tok=8, d_ff_expert=1536),
    "mixtral-8x7b": LlamaConfig(vocab_size=32000, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, d_ff=14336,
                                seq_len=DEFAULT_SEQ_LEN, rope_theta=1000000.0, norm_eps=1e-5,
                                max_position_embeddings=32768, family="mixtral", n_experts=8, n_experts_per_tok=2),
    "mistral-7b": LlamaConfig(vocab_size=32768, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, d_ff=14336,
                              seq_len=DEFAULT_SEQ_LEN, rope_theta=1000000.0, norm_eps=1e-5,
                              max_position_embeddings=32768, family="mistral"),
    "gemma-tiny": _gemma3(6, vocab_size=256, d_model=32, n_head=4, n_kv_head=2, d_ff=64, head_dim=16,
                          query_pre_attn_scalar=16, seq_len=64, sliding_window=16, max_position_embeddings=None),
    "gemma-3-1b": _gemma3(26, vocab_size=262144, d_model=1152, n_head=4, n_kv_head=1, d_ff=6912, rope_scaling=None,
                          sliding_window=512, max_position_embeddings=32768),
    "gemma-3-4b": _gemma3(34, d_model=2560, n_head=8, n_kv_head=4, d_ff=10240),
    "gemma-3-12b": _gemma3(48, d_model=3840, n_head=16, n_kv_head=8, d_ff=15360),
    "gemma-3-27b": _gemma3(62, d_model=5376, n_head=32, n_kv_head=16, d_ff=21504, head_dim=128,
                           query_pre_attn_scalar=168),
})


def preset(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
