"""Hugging Face peft LoRA adapters in and out: pure functions over name -> numpy array.

Our adapter of a projection (a block-relative module path of the model, ``attn.q``) in block i is
``blocks.{i}.attn.q.lora.lora_a`` [in, rank] and ``...lora.lora_b`` [rank, out], the branch
``y = x @ W + scale * (x @ lora_a) @ lora_b``. peft stores it under the HF module's name with the
prefix ``base_model.model.``: ``...self_attn.q_proj.lora_A.weight`` [rank, in] and
``...lora_B.weight`` [out, rank], both our tensors transposed. GPT-2's Conv1D keeps that layout
too (``fan_in_fan_out: true`` only tells peft how to merge). Base tensors trained in full (peft's
``modules_to_save``) are stored under their HF names with the same prefix: peft drops its
``modules_to_save.default`` wrapper when it saves.

Out: ``write_adapter`` writes ``adapter_model.safetensors`` and ``adapter_config.json`` (see
peft_config) into a hidden directory beside the target and renames it into place. In:
``read_adapter`` checks everything against the base model's shapes and returns our LoraSpec's
fields and tensors. ``merge_adapter``/``merged_tensors``/``merged_stream``: W + scale * lora_a @
lora_b in fp32, a tensor at a time.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from pstar_jax.config import ConfigError
from pstar_jax.io.hf import EXPORT_DTYPES, EXPORT_MARK, sort_metadata, written_by_us
from pstar_jax.model.lora import is_adapter
from pstar_jax.io.peft_config import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError, adapter_config, lora_settings,
                                   read_config, target_modules, targeted, write_config)
from pstar_jax.config.paths import check_output_dir, os_error_cause, staged_dir
from pstar_models.hf import SUPPORTED, hf_tensor

PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora.lora_a", ".lora.lora_b"
_PEFT_A, _PEFT_B = ".lora_A.weight", ".lora_B.weight"
_EMBEDDING = {"gpt2": "wte.embedding", **{family: "embed.embedding" for family in SUPPORTED if family != "gpt2"}}
_TIED_HEAD = PREFIX + "lm_head.weight"  # peft saves it beside a saved embedding the head is tied to
# The projections LoRA may wrap, by family (block-relative module paths, in the models' order).
_ATTENTION = ("attn.q", "attn.k", "attn.v", "attn.o")
_LLAMA = (*_ATTENTION, "mlp.gate", "mlp.up", "mlp.down")
# A mixture of experts' blocks offer attention's projections and every expert's three matrices, each
# matrix one projection here whatever the expert ("*": models/llama_config.projections lists them).
_EXPERTS = ("mlp.experts.*.gate", "mlp.experts.*.up", "mlp.experts.*.down")
PROJECTIONS = {"gpt2": ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"), "llama": _LLAMA, "qwen2": _LLAMA,
               "mistral": _LLAMA, "qwen3": _LLAMA, "qwen3_moe": (*_ATTENTION, *_EXPERTS),
               "mixtral": (*_ATTENTION, *_EXPERTS), "gemma3_text": _LLAMA,
               # Qwen3.5: its full-attention blocks' and its Gated DeltaNet blocks' projections
               "qwen3_5_text": (*_ATTENTION, *(f"linear_attn.{m}" for m in ("in_qkv", "in_z", "in_b", "in_a", "out")),
                                "mlp.gate", "mlp.up", "mlp.down")}
BLOCK_KINDS = ("qwen3_5_text",)  # families whose blocks hold different projections (by the path's first part)
_EXPERT_INDEX = re.compile(r"(?<=\.experts\.)\d+(?=\.)")


def projection_of(path: str) -> str:
    """The PROJECTIONS entry of a block-relative module path: an expert's index becomes '*'."""
    return _EXPERT_INDEX.sub("*", path)


def first_instance(projection: str) -> str:
    """A PROJECTIONS entry's first module path (expert 0's for an expert matrix), for matching
    targets and naming HF modules."""
    return projection.replace("*", "0")


def _instances(family: str, param_shapes: Mapping[str, Sequence[int]]) -> dict[str, list[str]]:
    """Each projection -> our module paths of it in the model (``blocks.{i}.<path>``, every expert)."""
    out: dict[str, list[str]] = {p: [] for p in PROJECTIONS[family]}
    for name in param_shapes:
        module = name.removesuffix(".kernel")
        if name.endswith(".kernel") and module.startswith("blocks.") and not is_adapter(name):
            path = projection_of(module.split(".", 2)[-1])
            if path in out:
                out[path].append(module)
    return out


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """peft's scaling of the adapter branch: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def merge_adapter(kernel_in_x_out: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray, scale: float) -> np.ndarray:
    """W + scale * lora_a @ lora_b, in fp32 (the merged kernel an HF export holds)."""
    kernel = np.asarray(kernel_in_x_out, np.float32)
    a, b = np.asarray(lora_a, np.float32), np.asarray(lora_b, np.float32)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or kernel.shape != (a.shape[0], b.shape[1]):
        raise ConfigError(f"an adapter of shapes {a.shape} and {b.shape} does not fit a kernel of shape "
                          f"{kernel.shape}; the adapter belongs to another model")
    return kernel + np.float32(scale) * (a @ b)


def merged_tensors(named_tensors: Iterable[tuple[str, np.ndarray]], adapters: Mapping[str, np.ndarray],
                   scale: float) -> Iterator[tuple[str, np.ndarray]]:
    """The base tensors as they stream by, each kernel with an adapter merged into it; the adapter
    tensors themselves (in ``adapters``, and in the stream if it holds them) are left out. An
    adapter whose kernel never came is an error at the end, not an export that silently lacks it."""
    pending = {n[: -len(LORA_A)] for n in adapters if n.endswith(LORA_A)}
    for name, value in named_tensors:
        if is_adapter(name):
            continue
        module = name[: -len(".kernel")] if name.endswith(".kernel") else None
        if module in pending:
            value = merge_adapter(value, adapters[module + LORA_A], adapters[module + LORA_B], scale)
            pending.discard(module)
        yield name, value
    if pending:
        raise ConfigError(f"the adapter of {sorted(pending)[0]} has no {sorted(pending)[0]}.kernel to merge into "
                          f"({len(pending)} such adapters); the adapters belong to another model")


def merged_stream(iter_tensors: Callable[[], Iterable[tuple[str, np.ndarray]]], scale: float,
                  iter_adapters: Callable[[], Iterable[tuple[str, np.ndarray]]] | None = None
                  ) -> Iterator[tuple[str, np.ndarray]]:
    """``merged_tensors`` over a stream that holds its own adapters (an engine's or a checkpoint's
    parameters): a first pass keeps the adapters (small), a second merges them as the base streams
    by, so the model never sits in host memory whole. ``iter_adapters``, a cheaper stream that holds
    the adapters too (the trained tensors alone, without a base read from disk), serves the first pass."""
    first = iter_adapters if iter_adapters is not None else iter_tensors
    adapters = {name: np.array(value, np.float32) for name, value in first() if is_adapter(name)}
    return merged_tensors(iter_tensors(), adapters, scale)


def model_family(model: object) -> str:
    """The peft family of one of our models: its HF model_type (gpt2, llama, qwen2, mistral, qwen3)."""
    config = getattr(model, "config", None)
    family = "gpt2" if type(config).__name__ == "GPTConfig" else getattr(config, "family", None)
    if family not in SUPPORTED:
        raise ConfigError(f"peft adapters are written for the gpt2 and llama families; this model is configured "
                          f"by {type(config).__name__}")
    return family


def _projection(family: str, module: str) -> tuple[int, str]:
    """(block index, block-relative path) of a module path ``blocks.{i}.<path>`` LoRA may wrap."""
    parts = module.split(".", 2)
    if len(parts) != 3 or parts[0] != "blocks" or not parts[1].isdigit() or \
            projection_of(parts[2]) not in PROJECTIONS[family]:
        raise ConfigError(f"{module} is not a projection LoRA can wrap in a {family} model; those are "
                          f"blocks.N.{{{','.join(PROJECTIONS[family])}}}")
    return int(parts[1]), projection_of(parts[2])


def _hf_module(family: str, module: str) -> str:
    """HF's module path for our projection ``blocks.3.attn.q``: ``model.layers.3.self_attn.q_proj``."""
    return hf_tensor(family, module + ".kernel").name.removesuffix(".weight")


def _family(family: str) -> str:
    if family not in SUPPORTED:
        raise ConfigError(f"no peft adapters for model family {family!r}; supported: {', '.join(SUPPORTED)}")
    return family


def to_peft(tensors: Mapping[str, np.ndarray], family: str) -> dict[str, np.ndarray]:
    """Our tensors (adapters and base tensors trained in full) under peft's names and layout."""
    out = {}
    for name, value in tensors.items():
        if is_adapter(name):
            module, suffix = name[: -len(LORA_A)], (_PEFT_A if name.endswith(LORA_A) else _PEFT_B)
            _projection(_family(family), module)
            out[PREFIX + _hf_module(family, module) + suffix] = np.asarray(value).T
        else:
            try:
                hf = hf_tensor(_family(family), name)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            out[PREFIX + hf.name] = np.asarray(value).T if hf.transpose else np.asarray(value)
    return out


def from_peft(peft_tensors: Mapping[str, np.ndarray], family: str, param_shapes: Mapping[str, Sequence[int]],
              rank: int) -> dict[str, np.ndarray]:
    """peft's tensors under our names and layout, each name and shape checked against the base
    model's ``param_shapes`` (adapter entries in it are ignored) and the adapter's ``rank``."""
    ours = _peft_names(_family(family), param_shapes, rank)
    out = {}
    for key, value in peft_tensors.items():
        if key not in ours:
            raise AdapterError(f"the adapter holds {key}, which names no projection or parameter of this "
                               f"{family} model; it was trained for another model or is not a LoRA adapter")
        name, shape, transpose = ours[key]
        value = np.asarray(value)
        if tuple(value.shape[::-1] if transpose else value.shape) != shape:
            theirs = shape[::-1] if transpose else shape
            raise AdapterError(f"the adapter's {key} has shape {tuple(value.shape)}, this model and rank {rank} "
                               f"need {theirs}; the adapter belongs to another model")
        out[name] = np.ascontiguousarray(value.T) if transpose else value
    return out


def _peft_names(family: str, param_shapes: Mapping[str, Sequence[int]],
                rank: int) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """peft key -> (our name, shape in our layout, transposed in peft's) for every tensor an adapter
    of this model may hold: both halves of each projection's adapter and every base tensor."""
    out = {}
    for name, shape in param_shapes.items():
        if is_adapter(name):
            continue
        module = name.removesuffix(".kernel")
        if name.endswith(".kernel") and projection_of(module.split(".", 2)[-1]) in PROJECTIONS[family] and \
                module.startswith("blocks."):
            hf = PREFIX + _hf_module(family, module)
            out[hf + _PEFT_A] = (module + LORA_A, (shape[0], rank), True)
            out[hf + _PEFT_B] = (module + LORA_B, (rank, shape[1]), True)
        try:
            hf_name = hf_tensor(family, name)
        except ValueError:  # a parameter with no HF name cannot be in a peft file
            continue
        out[PREFIX + hf_name.name] = (name, tuple(shape), hf_name.transpose)
    return out


# -- out ----------------------------------------------------------------------------------------


def _is_earlier_adapter(directory: str) -> bool:
    names = set(os.listdir(directory))
    if names != {ADAPTER_CONFIG, ADAPTER_WEIGHTS} or not all(
            os.path.isfile(os.path.join(directory, n)) for n in names):
        return False
    return written_by_us(os.path.join(directory, ADAPTER_WEIGHTS))


def check_adapter_target(directory: str, what: str = "--export-lora") -> None:
    """Refuse, before any work, a target that cannot be written or a non-empty directory that is
    not an earlier adapter export (which is replaced). ``what`` names the setting in messages."""
    directory = os.path.abspath(directory)
    check_output_dir(directory, what)
    if os.path.isdir(directory) and os.listdir(directory) and not _is_earlier_adapter(directory):
        raise ConfigError(f"{what} {directory} is not empty and is not an earlier pstar_jax adapter export; "
                          "choose a new or empty directory")


def _check_adapters(tensors: Mapping[str, np.ndarray], family: str, rank: int, targets: Sequence[str],
                    modules_to_save: Sequence[str]) -> list[str]:
    """The block-relative projections the adapters cover, after checking that they pair up, have
    ``rank``, cover the same blocks and are what ``targets`` (paths or glob patterns) name, and that
    every other tensor lies under ``modules_to_save``. A mixture of experts' matrix is one projection
    whose adapters must cover the same experts in every block they cover."""
    blocks: dict[str, set[int]] = {}
    experts: dict[tuple[str, int], set[str]] = {}
    for name, value in tensors.items():
        if not is_adapter(name):
            if not any(name == m or name.startswith(m + ".") for m in modules_to_save):
                raise ConfigError(f"tensor {name} is neither an adapter nor under modules_to_save "
                                  f"({', '.join(modules_to_save) or 'none'}); name its module there or leave it out")
            continue
        module, half = name[: -len(LORA_A)], name[-len(LORA_A):]
        other = module + (LORA_B if half == LORA_A else LORA_A)
        if other not in tensors:
            raise ConfigError(f"adapter tensor {name} has no {other}; an adapter needs both halves")
        shape = np.shape(value)
        if len(shape) != 2 or shape[1 if half == LORA_A else 0] != rank:
            raise ConfigError(f"adapter tensor {name} has shape {shape}, not rank {rank}")
        i, path = _projection(family, module)
        blocks.setdefault(path, set()).add(i)
        if path != module.split(".", 2)[-1]:
            experts.setdefault((path, i), set()).add(module.split(".", 2)[-1])
    if not blocks:
        raise ConfigError("the export got no adapter tensors (names ending in .lora.lora_a / .lora.lora_b)")
    # peft's format names one set of modules, wrapped in every block that has them: every projection
    # covers blocks 0..N-1, or with block kinds (Qwen3.5's attn / linear_attn) every projection of a
    # mixer the same blocks, the mixers together 0..N-1.
    groups = {p: p.split(".")[0] if family in BLOCK_KINDS else "" for p in blocks}
    covered = set().union(*blocks.values())
    first = next(iter(blocks.values()))
    if any(b != first for b in blocks.values()) and any("experts" in p for p in blocks):
        raise ConfigError("the experts' adapters cover the layers with experts only, and this model also has dense "
                          "layers (mlp_only_layers or decoder_sparse_step), which peft's target_modules cannot tell "
                          "apart yet; export adapters on attention only, or merge them with --export-hf")
    if covered != set(range(len(covered))) or any(
            b != next(blocks[q] for q in blocks if groups[q] == groups[p]) for p, b in blocks.items()) or (
            family not in BLOCK_KINDS and any(b != first for b in blocks.values())):
        raise ConfigError("the adapters do not cover the same blocks 0..N-1 in every projection "
                          f"({ {p: sorted(b) for p, b in blocks.items()} }); peft's format names one set of modules")
    if len({len(e) for e in experts.values()}) > 1:
        raise ConfigError("the experts' adapters do not cover the same experts in every block and matrix "
                          f"({ {f'blocks.{i}.{p}': len(e) for (p, i), e in experts.items()} }); adapt every expert")
    named = {p for p in PROJECTIONS[family] if any(fnmatch.fnmatchcase(first_instance(p), t) for t in targets)}
    if named != set(blocks):
        raise ConfigError(f"the targets ({', '.join(targets)}) name {sorted(named)} but the adapters cover "
                          f"{sorted(blocks)}; pass the targets the adapters were trained with")
    return [p for p in PROJECTIONS[family] if p in blocks]


def write_adapter(directory: str, tensors: Mapping[str, np.ndarray], *, rank: int, alpha: float,
                  dropout: float, rslora: bool, targets: Sequence[str], family: str,
                  base_model_name_or_path: str | None, modules_to_save: Sequence[str] = (),
                  dtype: str = "fp32", tie_embeddings: bool = False,
                  what: str = "--export-lora") -> list[str]:
    """Write a peft LoRA adapter: ``adapter_model.safetensors`` (``dtype``: fp32, bf16 or fp16)
    and ``adapter_config.json``. ``tensors``: our adapter tensors and the base tensors trained in
    full, which lie under ``modules_to_save`` (our module paths or tensor names: ``embed``,
    ``head.kernel``). ``tie_embeddings``: the head is the embedding, so peft must keep it tied to a
    saved embedding. A failed write is one ConfigError and leaves the target as it was. Returns the
    file names written."""
    directory = os.path.abspath(directory)
    _family(family)
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"adapter dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    projections = _check_adapters(tensors, family, rank, targets, modules_to_save)
    check_adapter_target(directory, what)
    peft_tensors = {}
    for key, value in to_peft(tensors, family).items():
        value = np.asarray(value, np.float32)
        if not np.isfinite(value).all():
            raise ConfigError(f"{key} holds NaN or infinite values; the run diverged: export an earlier checkpoint")
        with np.errstate(over="ignore"):
            converted = np.ascontiguousarray(value.astype(EXPORT_DTYPES[dtype][0]))
        if not np.isfinite(converted).all():
            raise ConfigError(f"{key} overflows {dtype}; export the adapter in bf16 or fp32")
        peft_tensors[key] = converted
    saved_modules = sorted({k[len(PREFIX):].rsplit(".", 1)[0] for k in peft_tensors
                            if not k.endswith((_PEFT_A, _PEFT_B))})
    embedding = PREFIX + hf_tensor(family, _EMBEDDING[family]).name
    if tie_embeddings and embedding in peft_tensors:  # as peft writes it (ensure_weight_tying)
        peft_tensors[_TIED_HEAD] = peft_tensors[embedding].copy()
    block_modules = {p: _hf_module(family, f"blocks.0.{first_instance(p)}").split(".", 3)[-1]
                     for p in PROJECTIONS[family]}
    config = adapter_config(rank=rank, alpha=alpha, dropout=dropout, rslora=rslora,
                            target_modules=target_modules(projections, block_modules), modules_to_save=saved_modules,
                            fan_in_fan_out=family == "gpt2", tie_embeddings=tie_embeddings,
                            base_model_name_or_path=base_model_name_or_path)
    with staged_dir(directory, what) as staging:
        path = os.path.join(staging, ADAPTER_WEIGHTS)
        save_file(peft_tensors, path, metadata={"format": "pt", EXPORT_MARK: "1"})
        sort_metadata(path)
        write_config(os.path.join(staging, ADAPTER_CONFIG), config)
        os.chmod(path, os.stat(os.path.join(staging, ADAPTER_CONFIG)).st_mode & 0o777)  # safetensors' is private
    return sorted(os.listdir(directory))


# -- in -----------------------------------------------------------------------------------------


def read_adapter(directory: str, family: str,
                 param_shapes: Mapping[str, Sequence[int]]) -> tuple[dict, dict[str, np.ndarray]]:
    """A peft LoRA adapter read onto the base model ``param_shapes`` describes: (LoraSpec's fields:
    rank, alpha, dropout, targets, rslora; our tensors, fp32: the adapters and any base tensors it
    saved in full). Every refusal is one AdapterError naming the file and what to change."""
    directory = os.path.abspath(directory)
    _family(family)
    config = read_config(directory)
    path = os.path.join(directory, ADAPTER_CONFIG)
    rank, alpha, dropout, rslora = lora_settings(config, path)
    instances = _instances(family, param_shapes)
    hf = {p: [_hf_module(family, m) for m in modules] for p, modules in instances.items() if modules}
    wrapped = targeted(config, path, hf, family)
    weights = os.path.join(directory, ADAPTER_WEIGHTS)
    try:
        with open(weights, "rb"):  # safe_open calls every failure 'No such file': ask first
            pass
        handle = safe_open(weights, framework="numpy")
    except Exception as err:  # OSError, SafetensorError
        cause = os_error_cause(err) if isinstance(err, OSError) else err
        raise AdapterError(f"{weights} is not a readable safetensors file ({cause})") from None
    raw = {}
    for key in handle.keys():
        dtype = handle.get_slice(key).get_dtype()
        if dtype not in ("BF16", "F16", "F32"):
            raise AdapterError(f"tensor {key} in {weights} is {dtype}; only BF16, F16 and F32 adapters are read")
        raw[key] = handle.get_tensor(key).astype(np.float32)
        if not np.isfinite(raw[key]).all():
            raise AdapterError(f"tensor {key} in {weights} holds NaN or infinite values; the adapter is corrupt")
    embedding = PREFIX + hf_tensor(family, _EMBEDDING[family]).name
    if _TIED_HEAD in raw and "head.kernel" not in param_shapes and embedding in raw:
        if not np.array_equal(raw[_TIED_HEAD], raw[embedding]):
            raise AdapterError(f"{weights} holds a head that differs from its embedding, and this model ties them; "
                               "the adapter was trained for a model with an untied head")
        del raw[_TIED_HEAD]  # the tied head peft saves beside a saved embedding
    try:
        tensors = from_peft(raw, family, param_shapes, rank)
    except AdapterError as err:
        raise AdapterError(f"{weights}: {err}") from None
    covered = {m.rsplit(".lora.", 1)[0] for m in tensors if is_adapter(m)}
    for p, modules in instances.items():
        for module in modules:
            if p in wrapped and not {module + LORA_A, module + LORA_B} <= set(tensors):
                raise AdapterError(f"{weights} lacks the adapter of {PREFIX}{_hf_module(family, module)}, which "
                                   f"{ADAPTER_CONFIG} targets; the download is incomplete")
            if p not in wrapped and module in covered:
                raise AdapterError(f"{weights} holds an adapter of {PREFIX}{_hf_module(family, module)}, which "
                                   f"{ADAPTER_CONFIG}'s target_modules does not name; the files disagree")
    spec = dict(rank=rank, alpha=alpha, dropout=dropout, rslora=rslora,
                targets=tuple(p for p in PROJECTIONS[family] if p in wrapped))
    return spec, tensors
