"""Checkpoints with orbax: save all chunk state, resume bit for bit, restore under another layout.

A checkpoint holds every chunk list (bf16 params, fp32 master, optimizer state) wherever it
lives, plus JSON metadata: the step, the data position, the run's config, the chunk layout and
a checksum per array. Saving is asynchronous (orbax writes in the background while training
goes on) and atomic (orbax commits a finished step by renaming it; a crash mid-save leaves the
previous step as the latest readable one). Loading checks the metadata against the model and
the checksums against the data before anything is replaced.

The same chunk size restores straight into the current mesh, whatever its number of devices
or processes (orbax reshards). Another chunk size is re-laid out on the host: tensors are
unpacked with the saved layout and packed with the new one.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from pstar_jax.chunks import ChunkLayout, pack, unpack
from pstar_jax.config import ConfigError
from pstar_jax.zero import to_numpy

FORMAT = 1


class CheckpointError(ConfigError):
    """A missing, corrupt or incompatible checkpoint: one sentence, nothing overwritten."""


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
    """Sum of the raw bits (mod 2**32): exact, order-free, the same on any sharding."""
    bits = jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32, 1: jnp.uint8}[x.dtype.itemsize])
    return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)


def _host_checksum(x: np.ndarray) -> int:
    bits = x.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[x.dtype.itemsize])
    return int(np.sum(bits, dtype=np.uint32))


def checksums(state: Any) -> list[int]:
    """Per array: device-resident ones summed on the device; host-resident ones read in place
    with numpy (a pass over host memory, not a host computation inside XLA or a copy down)."""
    sums = []
    for x in jax.tree.leaves(state):
        if isinstance(x, np.ndarray):
            sums.append(_host_checksum(x))
        elif x.sharding.memory_kind == "pinned_host" and x.is_fully_addressable:
            sums.append(_host_checksum(to_numpy(x)))
        else:
            sums.append(_checksum(x))  # dispatched now, read below
    return [s if isinstance(s, int) else int(to_numpy(s)) for s in sums]


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start an asynchronous save; the previous one is finished first."""
        self._manager.wait_until_finished()
        meta = {**meta, "format": FORMAT, "step": step, "checksums": checksums(state)}
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}; train without --resume first")
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as err:  # orbax raises many kinds; all mean the files are unreadable
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is unreadable ({type(err).__name__}); "
                                  "remove it to fall back to an earlier one") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is not a pstar_jax checkpoint")
        return meta

    def restore(self, step: int, abstract: Any, expected_checksums: list[int]) -> Any:
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
        except Exception as err:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is corrupt or incomplete "
                                  f"({type(err).__name__}); remove it to fall back to an earlier one") from None
        if checksums(state) != expected_checksums:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} fails its checksums; "
                                  "remove it to fall back to an earlier one")
        return state

    def restore_chunk(self, step: int, kind: str, chunk: int, numel: int, expected_checksum: int) -> np.ndarray:
        """One fp32 chunk of ``kind`` ("master") as numpy on the host, nothing else read."""
        item = {kind: {str(chunk): jax.ShapeDtypeStruct((numel,), np.float32)}}
        restore_args = {kind: {str(chunk): ocp.RestoreArgs(restore_type=np.ndarray)}}
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True))).state
        except Exception as err:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is corrupt or incomplete "
                                  f"({type(err).__name__}); remove it to fall back to an earlier one") from None
        value = np.asarray(state[kind][str(chunk)])
        if _host_checksum(value) != expected_checksum:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} fails its checksums; "
                                  "remove it to fall back to an earlier one")
        return value

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def save_engine(ckpt: Checkpointer, engine, step: int, extra: dict) -> None:
    meta = {"layout": engine.layout.to_json(), "precision": engine.cfg.precision, **extra}
    ckpt.save(step, engine.state(), meta)


def iter_master_tensors(ckpt: Checkpointer, step: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """A checkpoint's fp32 master tensors by name, read a chunk at a time: an export streams the
    model through host memory one chunk at a time, never whole."""
    meta = ckpt.meta(step)
    layout = ChunkLayout.from_json(meta["layout"])
    # checksums follow jax.tree.leaves(state()): the "master" dict sorts first, its keys as strings.
    position = {key: i for i, key in enumerate(sorted(str(c) for c in range(layout.n_chunks)))}
    for c in range(layout.n_chunks):
        chunk = ckpt.restore_chunk(meta["step"], "master", c, layout.chunk_numel, meta["checksums"][position[str(c)]])
        for s in sorted((s for s in layout.slots if s.chunk == c), key=lambda s: s.offset):
            yield s.name, chunk[s.offset:s.offset + s.numel].reshape(s.shape)


def check_compatible(meta: dict, layout: ChunkLayout, precision: str, directory: str) -> ChunkLayout:
    """The saved layout, if its tensors match the model's (names and shapes); else CheckpointError."""
    saved = ChunkLayout.from_json(meta["layout"])
    ours = {s.name: s.shape for s in layout.slots}
    theirs = {s.name: s.shape for s in saved.slots}
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise CheckpointError(f"checkpoint in {directory} is for another model shape (first differences: "
                              f"{', '.join(f'{n} {tuple(s)}' for n, s in diff)}); use the same model flags")
    if meta.get("precision") != precision:
        raise CheckpointError(f"checkpoint in {directory} was trained with --precision {meta.get('precision')}; "
                              f"pass the same")
    return saved


def restore_engine(ckpt: Checkpointer, engine, step: int | None = None) -> dict:
    """Load the latest (or given) checkpoint into ``engine``; returns its metadata."""
    meta = ckpt.meta(step)
    saved = check_compatible(meta, engine.layout, engine.cfg.precision, ckpt.directory)
    ours = engine.layout
    if saved.chunk_numel == ours.chunk_numel and saved.slots == ours.slots:
        state = ckpt.restore(meta["step"], engine.abstract_state(), meta["checksums"])
    else:  # another chunk size: unpack with the saved layout, pack with ours, on the host
        replicated = NamedSharding(engine.placement.mesh, P())
        like = engine.abstract_state(saved)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), like)
        host = jax.tree.map(to_numpy, ckpt.restore(meta["step"], abstract, meta["checksums"]))
        state = relayout(host, saved, ours)
    engine.load_state(state, meta["step"])
    return meta


def relayout(state: dict, saved: ChunkLayout, ours: ChunkLayout) -> dict:
    """Chunk lists from the saved layout to ours (numpy); per-chunk scalars come from chunk 0."""
    def move(chunks: list[np.ndarray]) -> list[np.ndarray]:
        return pack(ours, unpack(saved, chunks), chunks[0].dtype)

    out = {kind: dict(enumerate(move([state[kind][str(c)] for c in range(saved.n_chunks)])))
           for kind in ("param", "master")}
    per_chunk = [jax.tree.leaves(state["opt"][str(c)]) for c in range(saved.n_chunks)]
    treedef = jax.tree.structure(state["opt"]["0"])
    columns = []
    for i, leaf in enumerate(per_chunk[0]):
        if np.ndim(leaf) == 1 and leaf.shape[0] == saved.chunk_numel:
            columns.append(move([leaves[i] for leaves in per_chunk]))
        else:
            columns.append([leaf] * ours.n_chunks)
    out["opt"] = {c: jax.tree.unflatten(treedef, [col[c] for col in columns]) for c in range(ours.n_chunks)}
    return {kind: {str(c): v for c, v in chunks.items()} for kind, chunks in out.items()}


def open_run_checkpoints(directory: str, resume: bool, steps: int, keep: int) -> Checkpointer:
    """A run's Checkpointer; refuses to overwrite another run's checkpoints or resume from none."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"--checkpoint-dir {directory} is a file, not a directory")
    ckpt = Checkpointer(directory, keep)
    latest = ckpt.latest_step()
    if resume and latest is None:
        raise CheckpointError(f"no checkpoint in {ckpt.directory} to resume from; drop --resume to start afresh")
    if not resume and latest is not None:
        raise CheckpointError(f"{ckpt.directory} already holds checkpoints up to step {latest}; pass --resume "
                              "to continue them or choose another --checkpoint-dir")
    if resume and latest >= steps:
        raise CheckpointError(f"the checkpoint is at step {latest}, not before --steps {steps}; "
                              "raise --steps to train further")
    return ckpt


class StopSignal:
    """SIGINT/SIGTERM ask the training loop to save and stop after the current step; a second
    signal stops at once."""

    def __init__(self) -> None:
        self.signum = 0
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside some test runners)
                pass

    def _handle(self, signum, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


# -- plain Flax interchange ---------------------------------------------------------------------


def check_export_dir(directory: str) -> None:
    """Refuse, before training, an export directory that is a file, unwritable, or holds anything
    but an earlier export (whose files a new export would overwrite)."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"export directory {directory} is a file; choose a directory")
    if os.path.isdir(directory):
        if os.path.exists(os.path.join(directory, "params")):
            raise CheckpointError(f"{directory} already holds an export; choose another export directory")
        if os.listdir(directory):
            raise CheckpointError(f"export directory {directory} is not empty; choose an empty or new directory")
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise CheckpointError(f"export directory {directory} cannot be created under {existing}; choose another")


def export_flax(directory: str, params: dict[str, np.ndarray], model_config: dict) -> None:
    """Write parameters as a plain nested dict (names split at '.'), restorable with orbax alone."""
    directory = os.path.abspath(directory)
    check_export_dir(directory)
    nested: dict = {}
    for name, value in params.items():
        node = nested
        *path, leaf = name.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = np.asarray(value, np.float32)
    os.makedirs(directory, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(directory, "params"), nested)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model_config, f, indent=1)


def import_flax(directory: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Parameters by flat name from an export (or any orbax pytree of the same nested names)."""
    path = os.path.join(os.path.abspath(directory), "params")
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} holds no Flax export (no params/ inside); check --init-from-flax")
    with ocp.StandardCheckpointer() as ckptr:
        nested = ckptr.restore(path)
    flat = {".".join(str(getattr(k, "key", k)) for k in key): np.asarray(v)
            for key, v in jax.tree_util.tree_flatten_with_path(nested)[0]}
    if {n: tuple(v.shape) for n, v in flat.items()} != dict(shapes):
        missing = sorted(set(shapes) - set(flat))[:3]
        raise CheckpointError(f"the Flax export in {directory} does not match the model (missing or "
                              f"reshaped: {missing or 'shapes differ'}); use the model flags it was made with")
    return flat
