"""The base of a run with frozen tensors (LoRA, --freeze): where it came from and a fingerprint.

A checkpoint of such a run holds its trainable chunks alone (the adapters, modules_to_save, their
master copies and optimizer state); the frozen base is not saved (a 70B bf16 base would be 140 GB
per checkpoint). The checkpoint's metadata records the base instead, under ``base``:

    {"source": "hf",   "path": DIR, "fingerprint": HEX}   the --init-from-hf directory
    {"source": "flax", "path": DIR, "fingerprint": HEX}   the --init-from-flax export
    {"source": "init", "module": M, "name": PRESET, "overrides": {...}, "seed": N, "fingerprint": HEX}

A resume rebuilds the engine from its own base, so it refuses one whose record differs (one line
naming what differs); pstar-generate and pstar-export read the base from the record, the rest
from the checkpoint (``checkpoint_tensors``).

The fingerprint is cheap, not a full checksum: a sha256 of a directory's weight files over each
file's name, size, its safetensors header (every tensor's name, dtype, shape and offsets; the
first 64 KiB of a file of another kind) and 1024 samples of 64 bytes at a fixed stride through the
file: about 64 KiB read per file whatever the base's size (a full sha256 of a 140 GB base takes
minutes). It tells apart checkpoints of the same shapes and other values, such as
Llama-3.1-8B and Llama-3.1-8B-Instruct (a fine-tune changes nearly every element, so every sample),
not a few changed bytes. An initialised base is fingerprinted by what determines its values: the
model module, preset, overrides, base tensor shapes and seed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Any, Iterator, Mapping

import numpy as np

from pstar_jax.io.checkpoint import Checkpointer, CheckpointError, iter_master_tensors, saved_chunks
from pstar_jax.engine.chunks import ChunkLayout
from pstar_jax.config import RunConfig

SAMPLES_PER_FILE = 1024
SAMPLE_BYTES = 64
HEAD_BYTES = 64 * 1024  # hashed whole at the start of a file that is not safetensors
LORA_SHAPE_FIELDS = ("rank", "targets", "modules_to_save")  # change the trained tensors


def _header_bytes(f: Any, size: int) -> int:
    """Bytes of a safetensors file's header (8-byte length, then JSON), or HEAD_BYTES for another file."""
    first = f.read(8)
    f.seek(0)
    if len(first) == 8:
        n = int.from_bytes(first, "little")
        if 0 < n <= size - 8 and f.read(9)[8:9] == b"{":
            f.seek(0)
            return 8 + n
        f.seek(0)
    return min(size, HEAD_BYTES)


def fingerprint_files(root: str, names: list[str]) -> str:
    """sha256 over the files ``names`` (relative to ``root``, in the given order): each name and
    size, its header, and fixed-stride samples of the rest."""
    digest = hashlib.sha256()
    for name in names:
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        digest.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            head = _header_bytes(f, size)
            digest.update(f.read(head))
            body = size - head
            if body <= SAMPLES_PER_FILE * SAMPLE_BYTES:
                digest.update(f.read())
                continue
            stride = body // SAMPLES_PER_FILE
            for i in range(SAMPLES_PER_FILE):
                f.seek(head + i * stride)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _weight_names(source: str, directory: str) -> list[str]:
    if source == "hf":
        from pstar_jax.io.hf import weight_files
        return sorted(set(weight_files(directory).values()))
    out = []
    for parent, _, files in os.walk(directory):
        out += [os.path.relpath(os.path.join(parent, f), directory) for f in files]
    return sorted(n for n in out if n != "config.json")


def base_record(config: RunConfig, model: Any) -> dict:
    """The record of the base ``config`` builds ``model`` from (see the module docstring)."""
    from pstar_jax.model.lora import base_shapes
    m = config.model
    for source, directory in (("hf", m.init_from_hf), ("flax", m.init_from_flax)):
        if directory:
            directory = os.path.abspath(directory)
            return {"source": source, "path": directory,
                    "fingerprint": fingerprint_files(directory, _weight_names(source, directory))}
    what = {"module": m.module, "name": m.name, "overrides": m.overrides(), "seed": config.train.seed}
    shapes = {n: list(s) for n, s in base_shapes(model).items()}
    text = json.dumps({**what, "shapes": shapes}, sort_keys=True)
    return {"source": "init", **what, "fingerprint": hashlib.sha256(text.encode()).hexdigest()}


def describe(record: Mapping) -> str:
    if record["source"] == "hf":
        return f"the Hugging Face checkpoint {record['path']} (--init-from-hf)"
    if record["source"] == "flax":
        return f"the Flax export {record['path']} (--init-from-flax)"
    overrides = "".join(f" --{k.replace('_', '-')} {v}" for k, v in record["overrides"].items())
    return f"--model {record['name']}{overrides} initialised with --seed {record['seed']}"


def _same_base(a: Mapping, b: Mapping) -> bool:
    """Whether two base records name one base: the same source and fingerprint."""
    return (a["source"], a["fingerprint"]) == (b["source"], b["fingerprint"])


def check_same_base(saved: Mapping | None, ours: Mapping, directory: str) -> None:
    """CheckpointError (one line) unless the checkpoint's base record names the base ``ours`` does
    (a base moved to another directory, same fingerprint, is the same base)."""
    if saved is None or _same_base(saved, ours):
        return
    where = f"the checkpoint in {directory}"
    if saved["source"] != ours["source"] or saved["source"] == "init":
        raise CheckpointError(f"{where} was trained on the base {describe(saved)}, this run's base is "
                              f"{describe(ours)}; "
                              "resume with the checkpoint's base")
    raise CheckpointError(f"{where} was trained on the base {describe(saved)} (fingerprint "
                          f"{saved['fingerprint'][:12]}), but the weights in {ours['path']} differ (fingerprint "
                          f"{ours['fingerprint'][:12]}); resume with the checkpoint's base")


def check_same_adapters(saved: RunConfig, ours: RunConfig, directory: str) -> None:
    """CheckpointError (one line) when the trained tensors differ: LoRA rank, targets or
    modules_to_save, or --freeze (changing them changes what the checkpoint holds)."""
    pairs = [(f"--lora-{f.replace('_', '-')}", getattr(saved.lora, f), getattr(ours.lora, f))
             for f in LORA_SHAPE_FIELDS] + [("--freeze", saved.engine.freeze, ours.engine.freeze)]
    def given(flag: str, value: Any) -> str:
        return f"{flag} {value}" if value else f"no {flag}"
    for flag, old, new in pairs:
        if old != new:
            fix = f"resume with {flag} {old}" if old else f"resume without {flag}"
            raise CheckpointError(f"the checkpoint in {directory} was trained with {given(flag, old)}, this run has "
                                  f"{given(flag, new)}; {fix} (other adapters are another run: choose another "
                                  "--checkpoint-dir)")


def base_tensors(record: Mapping, model: Any, config: RunConfig, directory: str) -> Mapping[str, Any]:
    """The base's tensors by name (fp32), read lazily where the source allows, after checking the
    source still holds the recorded base (CheckpointError naming what to restore otherwise);
    ``directory`` is the checkpoint's, for messages."""
    if record["source"] in ("hf", "flax"):
        if not os.path.isdir(record["path"]):
            raise CheckpointError(f"the checkpoint's base {describe(record)} is gone; put the base back there")
        now = {**record, "fingerprint": fingerprint_files(record["path"], _weight_names(record["source"],
                                                                                       record["path"]))}
    else:
        now = base_record(config, model)
    check_same_base(record, now, directory)
    return _source_tensors(record, model, config)


def run_base(config: RunConfig, model: Any, record: Mapping | None = None) -> Mapping[str, Any]:
    """The tensors of the base ``config`` builds ``model`` from, fp32 as its source stores them
    (the engine holds a compute-dtype copy of a frozen base), for an export at the end of the run;
    ``record``, the run's record of its base from the start, must still describe it (CheckpointError)."""
    now = base_record(config, model)
    if record is not None and not _same_base(record, now):
        raise CheckpointError(f"the run's base {describe(record)} changed while it trained (fingerprint "
                              f"{record['fingerprint'][:12]}, now {now['fingerprint'][:12]}); put back the base "
                              "it trained on, then export its checkpoint with pstar-export")
    return _source_tensors(now, model, config)


def _source_tensors(record: Mapping, model: Any, config: RunConfig) -> Mapping[str, Any]:
    tensors = _stored_tensors(record, model, config)
    return _Dequantized(tensors, model, config) if config.engine.base_quant else tensors


def _stored_tensors(record: Mapping, model: Any, config: RunConfig) -> Mapping[str, Any]:
    if record["source"] == "hf":
        from pstar_jax.io.hf import HFCheckpoint
        from pstar_jax.io.models import hf_functions
        from pstar_jax.model.lora import base_shapes
        return HFCheckpoint(record["path"], hf_functions(config)[0](model), base_shapes(model))
    if record["source"] == "flax":
        from pstar_jax.io.flax_io import import_flax
        return import_flax(record["path"], model.param_shapes())
    return _Initialised(model, record["seed"])


class _Dequantized(Mapping[str, Any]):
    """A base trained quantized (EngineConfig.base_quant): its quantized kernels as the run's
    stages computed with them, quantized and dequantized in full (fp32), the rest as stored; what
    an export merges the adapters into, as peft merges into a bitsandbytes base's dequantized
    weights."""

    def __init__(self, tensors: Mapping[str, Any], model: Any, config: RunConfig):
        from pstar_jax.model.freeze import frozen_names, parse_patterns
        from pstar_jax.model.lora import frozen_for_lora
        from pstar_jax.model.quant_bytes import quant_rule
        shapes = model.param_shapes()
        frozen = frozen_names(list(shapes), parse_patterns(config.engine.freeze), frozen_for_lora(model, config.lora))
        self.tensors, self.kind = tensors, config.engine.base_quant
        self.rule = quant_rule(self.kind, shapes, lambda name: name not in frozen)

    def __getitem__(self, name: str) -> Any:
        from pstar_jax.model.quant_bytes import dequantized, to_bytes
        value = self.tensors[name]
        if not self.rule(name):
            return value
        value = np.asarray(value, np.float32)
        return dequantized(to_bytes(value, self.kind, name), value.shape, self.kind, np.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def close(self) -> None:
        close_tensors(self.tensors)


class _Initialised(Mapping[str, Any]):
    def __init__(self, model: Any, seed: int):
        self.model, self.seed, self._names = model, seed, list(model.param_shapes())

    def __getitem__(self, name: str) -> Any:
        return self.model.init_tensor(name, self.seed)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def checkpoint_tensors(ckpt: Checkpointer, meta: dict, model: Any, config: RunConfig
                       ) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of a chunked checkpoint's model (fp32, one at a time, in the order its engine's
    ``iter_params`` gives them, so an export of either writes the same shards): the saved ones from
    the checkpoint, a chunk at a time, and the frozen ones it does not hold from its recorded base
    as the base's source stores them, which is checked now (before anything is read)."""
    layout = ChunkLayout.from_json(meta["layout"])
    kept = set(saved_chunks(meta, layout))
    base = None
    if any(s.chunk not in kept for s in layout.slots):
        if not isinstance(meta.get("base"), dict):
            raise CheckpointError(f"checkpoint step {meta['step']} in {ckpt.directory} holds its trained tensors "
                                  "alone and no record of its base; read it where its engine was built")
        base = base_tensors(meta["base"], model, config, ckpt.directory)
    return _chain(layout, kept, iter_master_tensors(ckpt, meta["step"]), base)


def _chain(layout: ChunkLayout, kept: set[int], saved: Iterator[tuple[str, np.ndarray]], base: Any
           ) -> Iterator[tuple[str, np.ndarray]]:
    """Chunk by chunk: a saved chunk's tensors from ``saved`` (which reads the saved chunks in
    order), a frozen chunk's from ``base``."""
    by_chunk: dict[int, list] = {}
    for s in layout.slots:
        by_chunk.setdefault(s.chunk, []).append(s)
    try:
        for c in range(layout.n_chunks):
            slots = by_chunk.get(c, [])
            if c in kept:
                chunk = dict(itertools.islice(saved, len(slots)))  # views of the one chunk read
                yield from ((s.name, chunk[s.name]) for s in slots)
            else:
                yield from ((s.name, np.asarray(base[s.name], np.float32)) for s in slots)
    finally:
        close_tensors(base)


def close_tensors(tensors: Any) -> None:
    """Close a base's tensors where their source holds files open (an HFCheckpoint's)."""
    close = getattr(tensors, "close", None)
    if callable(close):
        close()


__all__ = ["base_record", "check_same_base", "check_same_adapters", "base_tensors", "run_base", "checkpoint_tensors",
           "close_tensors", "fingerprint_files", "describe"]
