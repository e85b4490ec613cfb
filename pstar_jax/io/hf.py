"""Hugging Face checkpoints in and out: safetensors weights, config.json and tokenizer files.

Model-agnostic: a model's side supplies a tensor map, pstar name -> (HF name, transpose,
truncate_rows), and the config.json to write. ``transpose``: HF stores torch Linear weights
[out, in] where our kernels are [in, out]. ``truncate_rows``: the HF tensor may have more rows
than ours (GPT-2's position table cut to our sequence length); we keep the first ones, and a
run's export puts the rest back from the source (``HFCheckpoint.rows_beyond``, pstar_jax.io.hf_export).

In: ``HFCheckpoint`` is a lazy mapping, pstar name -> fp32 numpy tensor, that reads and converts
one tensor per lookup, so an engine filling its chunks one at a time never holds the model
whole. Everything that can be checked from the files' headers (files, names, shapes, dtypes) is
checked when it is opened, before anything is allocated.

Out: ``export_hf`` takes tensors one at a time and writes a shard whenever the next tensor would
overflow it, so at most one shard is held. It writes into a hidden directory beside the target
and renames it into place at the end: a crash never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from pstar_jax.config.errors import ConfigError, HFCheckpointError
from pstar_jax.config.paths import check_output_dir, contained, staged_dir
from pstar_models.hf_gemma import MULTIMODAL, other_tower, tower_names
from pstar_models.hf_qwen35 import MULTIMODAL as QWEN35_MULTIMODAL

TensorMap = Mapping[str, tuple[str, bool, bool]]  # pstar name -> (HF name, transpose, truncate_rows)

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# What an export copies from the source checkpoint beside the weights: the tokenizer in any of its
# forms, its chat template (a file of its own since transformers 4.43) and the generation defaults.
_TOKENIZER_FILE = re.compile(r"^(tokenizer.*\.(json|model|txt)|special_tokens_map\.json|added_tokens\.json|"
                             r"chat_template\.(jinja|json)|generation_config\.json|vocab\.(json|txt)|merges\.txt|"
                             r"[\w.-]*\.(model|tiktoken))$")
_TEMPLATES_DIR = "additional_chat_templates"  # transformers 4.5x+: one .jinja per named template
# HF dtype name -> numpy dtype we read; everything is converted to fp32.
_SOURCE_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
EXPORT_DTYPES = {"bf16": (ml_dtypes.bfloat16, "bfloat16"), "fp16": (np.float16, "float16"),
                 "fp32": (np.float32, "float32")}
# Tensors in HF files that are not parameters: attention-mask and rotary buffers some versions
# saved, and lm_head.weight when the head is tied to the embedding (the map then leaves it out).
_BUFFER = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$|^lm_head\.weight$")
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
EXPORT_MARK = "pstar_jax"  # in the safetensors metadata of the files we write


def written_by_us(path: str) -> bool:
    """Whether a safetensors file carries our export mark (an unreadable file is not ours)."""
    try:
        with safe_open(path, framework="numpy") as f:
            return EXPORT_MARK in (f.metadata() or {})
    except Exception:  # SafetensorError, OSError
        return False


def read_hf_config(directory: str) -> dict:
    """``config.json`` of an HF checkpoint directory, as a dict."""
    if not os.path.isdir(directory):
        raise HFCheckpointError(f"{directory} is not a directory; pass a Hugging Face checkpoint directory")
    path = contained(directory, CONFIG, "the config", HFCheckpointError)
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{directory} holds no {CONFIG}; pass a Hugging Face checkpoint directory")
    try:
        with open(path) as f:
            config = json.load(f)
    except PermissionError:
        raise _unreadable(path) from None
    except (OSError, ValueError) as err:
        raise HFCheckpointError(f"{path} is not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{path} does not hold a JSON object")
    return config


def has_weights(directory: str) -> bool:
    """Whether ``directory`` holds safetensors weights (one file or an index), not only a config."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in (SINGLE, INDEX))


def weight_files(directory: str) -> dict[str, str]:
    """HF tensor name -> the file (in ``directory``) that the index, or the single file, says holds it."""
    index_path = contained(directory, INDEX, "the weight index", HFCheckpointError)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise HFCheckpointError(f"{index_path} is not a safetensors index ({type(err).__name__}: {err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise HFCheckpointError(f"{index_path} is not a safetensors index (its weight_map names no files)")
        for name in set(weight_map.values()):
            contained(directory, name, f"{INDEX} names a weight file that", HFCheckpointError)
        missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(directory, f))})
        if missing:
            raise HFCheckpointError(f"{index_path} lists {missing[0]}, which is not in {directory}; "
                                    "download the complete checkpoint")
        return dict(weight_map)
    if not os.path.isfile(contained(directory, SINGLE, "the weight file", HFCheckpointError)):
        raise HFCheckpointError(f"{directory} holds neither {SINGLE} nor {INDEX}; only safetensors weights are "
                                "read (convert pytorch_model.bin with safetensors first)")
    return {name: SINGLE for name in _open(os.path.join(directory, SINGLE)).keys()}


def _unreadable(path: str) -> HFCheckpointError:
    return HFCheckpointError(f"{path} cannot be read (permission denied); make it readable (chmod a+r {path}) "
                             "or run as a user who may read it")


def _open(path: str):
    """A safetensors file's handle (header read, data mapped lazily)."""
    try:  # safe_open reports every failure to open as 'No such file or directory': ask first
        with open(path, "rb"):
            pass
        return safe_open(path, framework="numpy")
    except PermissionError:
        raise _unreadable(path) from None
    except Exception as err:  # SafetensorError, OSError: the file is not a readable safetensors file
        raise HFCheckpointError(f"{path} is not a readable safetensors file ({err}); download it again") from None


def header_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, from the safetensors headers alone (nothing is read or allocated)."""
    shapes = {}
    for filename in sorted(set(weight_files(directory).values())):
        handle = _open(os.path.join(directory, filename))
        shapes.update((name, tuple(handle.get_slice(name).get_shape())) for name in handle.keys())
    return shapes


class HFCheckpoint(Mapping[str, np.ndarray]):
    """pstar name -> fp32 numpy tensor, read lazily from an HF directory's safetensors files.

    Opening validates every mapped tensor against ``shapes`` (after transpose and truncation) and
    refuses unsupported dtypes and HF tensors the map does not account for (buffers aside)."""

    def __init__(self, directory: str, tensor_map: TensorMap, shapes: Mapping[str, Sequence[int]]):
        self.directory = os.path.abspath(directory)
        # (the same one-line errors for a wrong directory); a multimodal Gemma 3's text tower is read
        # from under its prefixes, its vision tower left alone
        self._tower = read_hf_config(self.directory).get("model_type") in (MULTIMODAL, QWEN35_MULTIMODAL)
        if set(tensor_map) != set(shapes):
            odd = sorted(set(tensor_map) ^ set(shapes))[:3]
            raise HFCheckpointError(f"the tensor map and the model disagree on {odd}; the model's HF map is wrong")
        self._map = dict(tensor_map)
        self._shapes = {name: tuple(shape) for name, shape in shapes.items()}
        listed = weight_files(self.directory)
        self._files = {f: _open(os.path.join(self.directory, f)) for f in sorted(set(listed.values()))}
        self._where: dict[str, str] = {}  # HF name -> file, from the files' own headers
        for filename, handle in self._files.items():
            self._where.update((name, filename) for name in handle.keys())
        for name, filename in listed.items():
            if self._where.get(name) != filename:
                raise HFCheckpointError(f"{INDEX} in {self.directory} puts {name} in {filename}, which does not "
                                        "hold it; the checkpoint is incomplete or corrupt")
        self._hf_names = {pstar: self._resolve(hf) for pstar, (hf, _, _) in self._map.items()}
        # pstar name -> (rows in the file, rows kept), for the tensors cut short: callers say so.
        self.truncated: dict[str, tuple[int, int]] = {}
        for pstar in self._map:
            self._check(pstar)
        mapped = set(self._hf_names.values())
        unexpected = sorted(n for n in self._where if n not in mapped and not _BUFFER.search(n) and not (
            self._tower and (other_tower(n) or _BUFFER.search(n.removeprefix("language_model.")))))
        if unexpected:
            raise HFCheckpointError(f"{self._where[unexpected[0]]} in {self.directory} holds {unexpected[0]}, which "
                                    f"the model has no parameter for ({len(unexpected)} such tensors); the config "
                                    "and the weights describe different models")

    def _resolve(self, hf_name: str) -> str:
        """The name as stored: files saved from the base model lack the head's prefix ('transformer.h.0...'
        is stored as 'h.0...' in GPT-2's own files), so that spelling is accepted too, and a multimodal
        checkpoint's text tower nests the names (models/hf_gemma.tower_names)."""
        spellings = (hf_name, *hf_name.split(".", 1)[1:], *(tower_names(hf_name) if self._tower else ()))
        for name in spellings:
            if name in self._where:
                return name
        raise HFCheckpointError(f"{self.directory} lacks tensor {hf_name}; the config and the weights describe "
                                "different models, or the download is incomplete")

    def _check(self, pstar: str) -> None:
        hf = self._hf_names[pstar]
        _, transpose, truncate = self._map[pstar]
        where = f"{self._where[hf]} in {self.directory}"
        view = self._files[self._where[hf]].get_slice(hf)
        dtype, shape = view.get_dtype(), tuple(view.get_shape())
        if dtype not in _SOURCE_DTYPES:
            raise HFCheckpointError(f"tensor {hf} in {where} is {dtype}; only BF16, F16 and F32 weights are read")
        ours = self._shapes[pstar]
        if transpose:
            shape = shape[::-1]
        if len(shape) != len(ours) or shape[1:] != ours[1:] or (shape and not truncate and shape[0] != ours[0]):
            raise HFCheckpointError(f"tensor {hf} in {where} has shape {shape} (in our orientation), the model "
                                    f"expects {ours}; the config and the weights describe different models")
        if shape and shape[0] < ours[0]:
            raise HFCheckpointError(f"tensor {hf} in {where} has {shape[0]} rows, the model needs {ours[0]} "
                                    "(a longer sequence than the checkpoint has positions?); lower --seq-len")
        if shape and shape[0] > ours[0]:
            self.truncated[pstar] = (shape[0], ours[0])

    def _read(self, pstar: str, rows: slice) -> np.ndarray:
        """Rows ``rows`` (in our orientation) of a tensor, fp32."""
        hf = self._hf_names[pstar]
        handle = self._files[self._where[hf]]
        if self._map[pstar][1]:  # a view: the engine copies it into its chunk, so no contiguous copy here
            value = handle.get_tensor(hf).T[rows]
        elif rows == slice(None):
            value = handle.get_tensor(hf)
        else:
            value = handle.get_slice(hf)[rows]  # reads only those rows
        return value.astype(np.float32, copy=False)  # fp32 sources are not copied again

    def rows_beyond(self, pstar: str) -> np.ndarray:
        """The rows a tensor cut short (``truncated``) leaves out, fp32 as stored: an export puts them
        back after the model's own, so a model trained on fewer positions keeps the source's table."""
        return self._read(pstar, slice(self._shapes[pstar][0], None))

    def location(self, pstar: str) -> tuple[str, str, bool]:
        """(file in ``directory``, HF name as stored, transposed) of a tensor: where a reader of the
        files' raw bytes finds it (pstar_jax.io.frozen_disk)."""
        hf = self._hf_names[pstar]
        return self._where[hf], hf, self._map[pstar][1]

    def __getitem__(self, pstar: str) -> np.ndarray:
        hf = self._hf_names[pstar]
        value = self._read(pstar, slice(self._shapes[pstar][0] if self._map[pstar][2] else None))
        # Checked as each tensor streams in: a corrupt weight would otherwise surface as a NaN loss.
        if not np.isfinite(value).all():
            bad = int(value.size - np.isfinite(value).sum())
            raise HFCheckpointError(f"tensor {hf} in {self._where[hf]} in {self.directory} holds {bad} NaN or "
                                    "infinite values; the checkpoint is corrupt: download it again")
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def close(self) -> None:
        self._files.clear()  # safe_open handles close when dropped

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- out ----------------------------------------------------------------------------------------


def tokenizer_files(directory: str) -> list[str]:
    """The tokenizer, chat-template and generation files of an HF directory, as an export copies them
    (refused, HFCheckpointError, if one leads outside the directory: the export is what a user uploads)."""
    names = sorted(n for n in os.listdir(directory) if _TOKENIZER_FILE.match(n) and n != CONFIG
                   and os.path.isfile(contained(directory, n, "the tokenizer file", HFCheckpointError)))
    templates = os.path.join(directory, _TEMPLATES_DIR)
    if not os.path.isdir(contained(directory, _TEMPLATES_DIR, "the chat templates", HFCheckpointError)):
        return names
    for parent, dirs, files in os.walk(templates):
        for name in dirs + files:
            contained(directory, os.path.relpath(os.path.join(parent, name), directory), "the chat template",
                      HFCheckpointError)
    return names + [_TEMPLATES_DIR]


def _is_earlier_export(directory: str) -> bool:
    names = os.listdir(directory)

    def ours(name: str) -> bool:  # a name an export writes, of the kind it writes
        if name == _TEMPLATES_DIR:
            return os.path.isdir(os.path.join(directory, name))
        return (name in (CONFIG, SINGLE, INDEX) or bool(_SHARD.match(name) or _TOKENIZER_FILE.match(name))) \
            and os.path.isfile(os.path.join(directory, name))

    if not all(ours(n) for n in names):
        return False
    weights = SINGLE if SINGLE in names else next((n for n in sorted(names) if _SHARD.match(n)), None)
    if CONFIG not in names or weights is None:
        return False
    return written_by_us(os.path.join(directory, weights))


def check_export_target(directory: str, what: str = "CheckpointConfig.export_hf") -> None:
    """Refuse, before any work, a target that cannot be written (a file, a path under a file, a
    read-only or unwritable place) or a non-empty directory that is not an earlier export (which
    is replaced). ``what`` names the setting in messages."""
    directory = os.path.abspath(directory)
    check_output_dir(directory, what)
    if os.path.isdir(directory) and os.listdir(directory) and not _is_earlier_export(directory):
        raise ConfigError(f"{what} {directory} is not empty and is not an earlier pstar_jax Hugging Face export; "
                          "choose a new or empty directory")


class _ShardWriter:
    """Tensors into safetensors files of at most ``max_shard_bytes`` (a larger tensor gets its own)."""

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self._shard: dict[str, np.ndarray] = {}
        self._shard_bytes = 0

    def add(self, name: str, value: np.ndarray) -> None:
        if self._shard and self._shard_bytes + value.nbytes > self.max_shard_bytes:
            self._flush()
        self._shard[name] = value
        self._shard_bytes += value.nbytes
        self.total_bytes += value.nbytes

    def _flush(self) -> None:
        filename = f"shard-{len(self.files)}.safetensors"
        path = os.path.join(self.directory, filename)
        save_file(self._shard, path, metadata={"format": "pt", EXPORT_MARK: "1"})
        sort_metadata(path)
        self.files.append(filename)
        self.weight_map.update((name, filename) for name in self._shard)
        self._shard, self._shard_bytes = {}, 0

    def finish(self) -> None:
        """The last shard, then HF's names: one ``model.safetensors``, or numbered shards and an index."""
        if self._shard:
            self._flush()
        n = len(self.files)
        final = {f: SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(self.files)}
        for old, new in final.items():
            os.rename(os.path.join(self.directory, old), os.path.join(self.directory, new))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: final[f] for name, f in sorted(self.weight_map.items())}}
            with open(os.path.join(self.directory, INDEX), "w") as f:
                json.dump(index, f, indent=2)


def sort_metadata(path: str) -> None:
    """Rewrite a safetensors header with its metadata keys sorted, in place: safetensors keeps them
    in a Rust HashMap, whose order changes from run to run, so two exports would differ in bytes.
    The same keys and values sorted take the same bytes, so the tensors' data does not move."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size), object_pairs_hook=dict)
        header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:  # padded with spaces, as safetensors pads its headers
            f.seek(8)
            f.write(text.ljust(size))


def export_hf(directory: str, named_tensors: Iterable[tuple[str, np.ndarray]], tensor_map: TensorMap,
              config: dict, dtype: str = "bf16", tokenizer_from: str | None = None,
              max_shard_bytes: int = 5 * 10**9, what: str = "CheckpointConfig.export_hf") -> list[str]:
    """Write an HF checkpoint: config.json (``dtype`` or ``torch_dtype``, whichever ``config``
    uses, set), safetensors weights in ``dtype`` (bf16, fp16 or fp32) and the tokenizer,
    chat-template and generation files found in ``tokenizer_from``. Tensors arrive one at a time as
    (pstar name, fp32 array); every name of ``tensor_map`` must come exactly once. A failed write
    (disk full, permissions) is one ConfigError naming the path, and leaves the target as it was.
    Returns the file names written. The same tensors and config give the same bytes."""
    directory = os.path.abspath(directory)
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"export dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    if max_shard_bytes <= 0:
        raise ConfigError(f"the shard size must be positive, got {max_shard_bytes} bytes")
    if tokenizer_from is not None and not os.path.isdir(tokenizer_from):
        raise ConfigError(f"{tokenizer_from} is not a directory; pass the HF directory holding the tokenizer")
    check_export_target(directory, what)
    copied = tokenizer_files(tokenizer_from) if tokenizer_from else []  # refused before any work, as a whole
    np_dtype, torch_name = EXPORT_DTYPES[dtype]
    with staged_dir(directory, what) as staging:
        writer = _ShardWriter(staging, max_shard_bytes)
        seen: set[str] = set()
        for name, value in named_tensors:
            if name not in tensor_map:
                raise ConfigError(f"tensor {name} has no Hugging Face name in the model's map; the map is incomplete")
            if name in seen:
                raise ConfigError(f"tensor {name} was given twice to the export")
            seen.add(name)
            hf_name, transpose, _ = tensor_map[name]
            value = np.asarray(value, np.float32)
            with np.errstate(over="ignore"):  # an fp16 overflow is reported below, by name
                converted = np.ascontiguousarray((value.T if transpose else value).astype(np_dtype))
            if dtype == "fp16" and not np.isfinite(converted).all() and np.isfinite(value).all():
                raise ConfigError(f"tensor {name} overflows fp16; export in bf16 or fp32")
            writer.add(hf_name, converted)
            del value, converted
        missing = [n for n in tensor_map if n not in seen]
        if missing:
            raise ConfigError(f"the export got no tensor {missing[0]} ({len(missing)} missing); nothing was written")
        writer.finish()
        dtype_key = "dtype" if "dtype" in config and "torch_dtype" not in config else "torch_dtype"
        with open(os.path.join(staging, CONFIG), "w") as f:
            json.dump({**config, dtype_key: torch_name}, f, indent=2)
        mode = os.stat(os.path.join(staging, CONFIG)).st_mode & 0o777  # what the umask gives a new file
        for name in os.listdir(staging):  # safetensors creates its files private
            os.chmod(os.path.join(staging, name), mode)
        for name in copied:
            source = os.path.join(tokenizer_from, name)
            if os.path.isdir(source):
                shutil.copytree(source, os.path.join(staging, name))
            else:
                shutil.copyfile(source, os.path.join(staging, name))
    return sorted(os.listdir(directory))
