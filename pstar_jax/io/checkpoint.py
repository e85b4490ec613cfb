"""Checkpoints with orbax: save all chunk state, resume bit for bit, restore under another layout.

A checkpoint holds every trainable chunk list (bf16 params, fp32 master, optimizer state)
wherever it lives, plus JSON metadata: the step, the data position, the run's config, the chunk
layout, the chunks saved and a checksum per array. Frozen chunks (a LoRA run's base) are not
saved: the metadata records where the base came from and its fingerprint (pstar_jax.io.base_record), and a
resume or a reader loads it from there. Saving is asynchronous (orbax writes in the background while training
goes on) and atomic (orbax commits a finished step by renaming it; a crash mid-save leaves the
previous step as the latest readable one). Loading checks the metadata against the model and
the checksums against the data before anything is replaced.

The same chunk size restores straight into the current mesh, whatever its number of devices
or processes (orbax reshards). Another chunk size is re-laid out on the host: tensors are
unpacked with the saved layout and packed with the new one.

A run owns its checkpoint directory (pstar_jax.io.run_lock: a second run into it is refused while
the first lives, and a reader is told which run holds it). Removal is only ever
suggested for a directory that holds a pstar step's items (``meta/``, ``state/``). A save that fails (full disk, read-only
file system) ends the run with one line naming the cause and the latest good step; its
temporary directory is removed and earlier steps are kept. The latest step is never deleted:
``--keep-checkpoints`` is at least 1.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from pstar_jax.engine.chunks import ChunkLayout
from pstar_jax.config.errors import CheckpointError, ConfigError
from pstar_jax.io.run_lock import DirectoryLock, live_holder
from pstar_jax.io.orbax_quiet import drop_closed_loop_errors, silence_orbax_errors
from pstar_jax.config.paths import check_output_dir, os_error_cause
from pstar_jax.engine.zero import to_numpy

FORMAT = 1
META_KEYS = ("format", "step", "checksums")
STEP_ITEMS = ("meta", "state")  # the folders orbax writes into each step of ours (a Composite save)


class CheckpointSaveError(Exception):
    """A save failed (disk full, read-only file system): one sentence naming the cause and the
    latest good step. orbax may leave worker threads waiting on the failed save, so a CLI ends the
    process with ``pstar_jax.run.exits.hard_exit`` rather than returning."""


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
    with numpy (a pass over host memory, not a host computation inside XLA or a copy down).

    An array of this process alone is summed shard by shard (one replica of each), each shard on
    its own device, and the sums added mod 2**32 here: a sum over the sharded array would be one
    program over every device with a collective, and a row of those dispatched back to back
    deadlocked the CPU client with 8 fake devices on 2 cores (tests/test_checkpoint.py hung
    there under load). An array spread over processes needs that collective."""
    sums: list[Any] = []
    for x in jax.tree.leaves(state):
        if isinstance(x, np.ndarray):
            sums.append(_host_checksum(x))
        elif x.sharding.memory_kind == "pinned_host" and x.is_fully_addressable:
            sums.append(_host_checksum(to_numpy(x)))
        elif x.is_fully_addressable:  # dispatched now, read below
            sums.append([_checksum(s.data) for s in x.addressable_shards if s.replica_id == 0])
        else:
            sums.append(_checksum(x))
    return [s if isinstance(s, int) else _read_sum(s) for s in sums]


def _read_sum(parts: Any) -> int:
    return sum(int(to_numpy(p)) for p in (parts if isinstance(parts, list) else [parts])) % 2**32


class Checkpointer:
    """``in_run``: this process belongs to the run that owns the directory (its lock is ours), so
    a failed read is never blamed on a live run rotating the steps."""

    def __init__(self, directory: str, max_to_keep: int = 3, lock: DirectoryLock | None = None,
                 in_run: bool = False):
        if max_to_keep < 1:
            raise ConfigError(f"--keep-checkpoints must be at least 1 (the latest checkpoint is always kept), "
                              f"got {max_to_keep}")
        silence_orbax_errors()
        drop_closed_loop_errors()
        self.directory = os.path.abspath(directory)
        self._lock = lock
        self.in_run = in_run or lock is not None
        self._pending: int | None = None  # the step of the save in flight
        self.failed = False  # a save failed: orbax threads may never finish, do not wait for them
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def committed_steps(self) -> list[int]:
        """Steps whose directories orbax finished (renamed from their temporary names)."""
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        return sorted(int(n) for n in names if n.isdigit())

    def is_step(self, step: int) -> bool:
        """Whether ``directory``/``step`` holds a pstar step's items (not, say, a user's own folder '7')."""
        return any(os.path.isdir(os.path.join(self.directory, str(step), item)) for item in STEP_ITEMS)

    def _steps_there(self) -> str:
        steps = [s for s in self.committed_steps() if self.is_step(s)]
        return f"the steps there are {', '.join(map(str, steps))}" if steps else \
            f"{self.directory} holds no pstar checkpoint step"

    def _unreadable(self, step: int, problem: str) -> CheckpointError:
        """The error for a step that failed to read or verify: the step is gone or changing under a
        live run (retry), or it is not ours (say what is there), and only then removable."""
        where, path = f"checkpoint step {step} in {self.directory}", os.path.join(self.directory, str(step))
        gone = not os.path.isdir(path)
        holder = None if self.in_run else live_holder(self.directory)
        if holder:
            return CheckpointError(f"{where} {'was removed' if gone else 'changed'} while being read: the run "
                                   f"({holder}) training into this directory rotates its checkpoints; retry "
                                   f"({self._steps_there()}) or wait for that run to end")
        if gone:
            return CheckpointError(f"{where} was removed while being read; retry ({self._steps_there()})")
        if not self.is_step(step):
            return CheckpointError(f"{path} is not a pstar checkpoint step (it has no meta/ or state/ folder); "
                                   f"{self._steps_there()}")
        return CheckpointError(f"{where} {problem}; remove {path} to fall back to an earlier one")

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start an asynchronous save; the previous one is finished first."""
        self.wait()
        meta = {**meta, "format": FORMAT, "step": step, "checksums": checksums(state)}
        self._pending = step
        try:
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)))
        except Exception as err:
            self._fail(err)

    def wait(self) -> None:
        """Finish the save in flight; CheckpointSaveError if it failed."""
        if self.failed:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._fail(err)
        self._pending = None

    def _fail(self, err: BaseException) -> None:
        self.failed = True
        step = self._pending
        for name in os.listdir(self.directory) if os.path.isdir(self.directory) else []:
            if step is not None and name.startswith(f"{step}.orbax-checkpoint-tmp"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        good = [s for s in self.committed_steps() if s != step]
        latest = f"step {good[-1]}" if good else "none"
        raise CheckpointSaveError(f"saving checkpoint step {step} in {self.directory} failed: {os_error_cause(err)}; "
                                  f"the latest good checkpoint is {latest}") from None

    def meta(self, step: int | None = None, required: tuple[str, ...] = ()) -> dict:
        """The JSON metadata of ``step`` (default: the latest), checked to belong to that step."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}; train without --resume first")
        if step not in self.committed_steps():
            raise CheckpointError(f"no checkpoint step {step} in {self.directory}; {self._steps_there()}")
        where = f"checkpoint step {step} in {self.directory}"
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as err:  # orbax raises many kinds; all mean the files are unreadable
            raise self._unreadable(step, f"is unreadable ({type(err).__name__})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not a pstar_jax checkpoint")
        missing = [k for k in (*META_KEYS, *required) if k not in meta]
        if missing:
            raise CheckpointError(f"{where} has incomplete metadata (no {', '.join(missing)}); "
                                  f"remove {self.directory}/{step} to fall back to an earlier one")
        if meta["step"] != step:
            raise CheckpointError(f"{where} holds metadata of step {meta['step']}, so it was altered or copied; "
                                  f"remove {self.directory}/{step} to fall back to an earlier one")
        return meta

    def restore(self, step: int, abstract: Any, expected_checksums: list[int]) -> Any:
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
        except Exception as err:
            raise self._unreadable(step, f"is corrupt or incomplete ({type(err).__name__})") from None
        if checksums(state) != expected_checksums:
            raise self._unreadable(step, "fails its checksums")
        return state

    def restore_chunk(self, step: int, kind: str, chunk: int, numel: int, expected_checksum: int) -> np.ndarray:
        """One fp32 chunk of ``kind`` ("master") as numpy on the host, nothing else read."""
        item = {kind: {str(chunk): jax.ShapeDtypeStruct((numel,), np.float32)}}
        restore_args = {kind: {str(chunk): ocp.RestoreArgs(restore_type=np.ndarray)}}
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True))).state
        except Exception as err:
            raise self._unreadable(step, f"is corrupt or incomplete ({type(err).__name__})") from None
        value = np.asarray(state[kind][str(chunk)])
        if _host_checksum(value) != expected_checksum:
            raise self._unreadable(step, "fails its checksums")
        return value

    def close(self) -> None:
        """Finish the last save (CheckpointSaveError if it failed) and release the directory."""
        try:
            self.wait()
        finally:
            if not self.failed:
                self._manager.close()
            if self._lock:
                self._lock.release()


def save_engine(ckpt: Checkpointer, engine, step: int, extra: dict) -> None:
    """Any engine's state; the metadata says which engine wrote it and how its arrays are laid
    out (the chunk layout and the chunks saved: the trainable ones, or the plain engine's tensor
    shapes). ``extra`` holds the caller's keys (the loop's: data position, config, base record)."""
    if engine.kind == "chunked":
        described = {"layout": engine.layout.to_json(), "precision": engine.cfg.precision,
                     "saved_chunks": list(engine.layout.trainable_chunks)}
    else:
        described = {"shapes": {n: list(s) for n, s in engine.param_shapes().items()}, "precision": engine.precision}
    ckpt.save(step, engine.state(), {"engine": engine.kind, **described, **extra})


def saved_chunks(meta: dict, layout: ChunkLayout) -> list[int]:
    """The chunks a chunked checkpoint holds: its trainable ones (every one before frozen chunks
    stopped being saved, which the metadata then does not list)."""
    return list(meta.get("saved_chunks", range(layout.n_chunks)))


def iter_master_tensors(ckpt: Checkpointer, step: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """A checkpoint's fp32 master tensors by name, read a chunk at a time: an export streams the
    model through host memory one chunk at a time, never whole. A checkpoint of a run with frozen
    tensors holds the trained ones only (base_record.checkpoint_tensors adds the base)."""
    meta = ckpt.meta(step)
    layout = ChunkLayout.from_json(meta["layout"])
    chunks = saved_chunks(meta, layout)
    # checksums follow jax.tree.leaves(state()): the "master" dict sorts first, its keys as strings.
    position = {key: i for i, key in enumerate(sorted(str(c) for c in chunks))}
    for c in chunks:
        chunk = ckpt.restore_chunk(meta["step"], "master", c, layout.numel_of(c), meta["checksums"][position[str(c)]])
        for s in sorted((s for s in layout.slots if s.chunk == c), key=lambda s: s.offset):
            yield s.name, chunk[s.offset:s.offset + s.numel].reshape(s.shape)


def check_compatible(meta: dict, layout: ChunkLayout, precision: str, directory: str) -> ChunkLayout:
    """The saved layout, if its tensors match the model's (names and shapes) and the same ones
    are frozen; else CheckpointError."""
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
    frozen_ours, frozen_theirs = frozen_tensors(layout), frozen_tensors(saved)
    if frozen_ours != frozen_theirs:
        name = sorted(frozen_ours ^ frozen_theirs)[0]
        raise CheckpointError(f"checkpoint in {directory} {'froze' if name in frozen_theirs else 'trained'} "
                              f"{name}, which this run {'trains' if name in frozen_theirs else 'freezes'}; resume "
                              "with the same --freeze and --lora-modules-to-save")
    return saved


def frozen_tensors(layout: ChunkLayout) -> set[str]:
    return {s.name for s in layout.slots if layout.is_frozen(s.chunk)}


def restore_engine(ckpt: Checkpointer, engine, step: int | None = None,
                   required: tuple[str, ...] = ("data_position",)) -> dict:
    """Load the latest (or given) checkpoint into ``engine``; returns its metadata, which holds
    at least the ``required`` keys (those the caller saved). Frozen chunks the checkpoint lacks
    keep the base the engine was built from (the caller checks it is the checkpoint's)."""
    meta = ckpt.meta(step, ("precision", *required))
    kind = meta.get("engine", "chunked")
    if kind != engine.kind:
        raise CheckpointError(f"checkpoint step {meta['step']} in {ckpt.directory} was written by the {kind} engine; "
                              f"resume it with --engine {kind}")
    if kind == "plain":
        return _restore_plain(ckpt, engine, meta)
    if "layout" not in meta:
        raise CheckpointError(f"checkpoint step {meta['step']} in {ckpt.directory} has no chunk layout in its "
                              "metadata; remove that step to fall back to an earlier one")
    saved = check_compatible(meta, engine.layout, engine.cfg.precision, ckpt.directory)
    ours, chunks = engine.layout, saved_chunks(meta, saved)
    if saved.numels == ours.numels and saved.slots == ours.slots:
        state = ckpt.restore(meta["step"], engine.abstract_state(saved, chunks), meta["checksums"])
    else:  # another chunk size: unpack with the saved layout, pack with ours, on the host
        replicated = NamedSharding(engine.placement.mesh, P())
        like = engine.abstract_state(saved, chunks)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), like)
        host = jax.tree.map(to_numpy, ckpt.restore(meta["step"], abstract, meta["checksums"]))
        state = relayout(host, saved, ours)
    engine.load_state(state, meta["step"])
    return meta


def _restore_plain(ckpt: Checkpointer, engine, meta: dict) -> dict:
    ours = {n: list(s) for n, s in engine.param_shapes().items()}
    if meta.get("shapes") != ours:
        raise CheckpointError(f"checkpoint in {ckpt.directory} is for another model shape; use the same model flags")
    if meta["precision"] != engine.precision:
        raise CheckpointError(f"checkpoint in {ckpt.directory} was trained with --precision {meta['precision']}; "
                              "pass the same")
    engine.load_state(ckpt.restore(meta["step"], engine.abstract_state(), meta["checksums"]), meta["step"])
    return meta


def relayout(state: dict, saved: ChunkLayout, ours: ChunkLayout) -> dict:
    """The trainable chunk lists of ``state`` (numpy; frozen chunks, which earlier versions saved,
    are left out: the engine holds its base) from the saved layout to ours; per-chunk scalars come
    from the first chunk. Both layouts freeze the same tensors (check_compatible)."""
    theirs, mine = saved.trainable_chunks, ours.trainable_chunks

    def move(chunks: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        tensors = {s.name: chunks[s.chunk][s.offset:s.offset + s.numel] for s in saved.slots if s.chunk in chunks}
        dtype = next(iter(chunks.values())).dtype
        out = {c: np.zeros(ours.numel_of(c), dtype) for c in mine}
        for s in ours.slots:
            if s.chunk in out:
                out[s.chunk][s.offset:s.offset + s.numel] = tensors[s.name]
        return out

    out = {kind: move({c: state[kind][str(c)] for c in theirs}) for kind in ("param", "master")}
    per_chunk = {c: jax.tree.leaves(state["opt"][str(c)]) for c in theirs}
    treedef = jax.tree.structure(state["opt"][str(theirs[0])])
    columns = []
    for i, leaf in enumerate(per_chunk[theirs[0]]):
        if np.ndim(leaf) == 1 and leaf.shape[0] == saved.numel_of(theirs[0]):
            columns.append(move({c: leaves[i] for c, leaves in per_chunk.items()}))
        else:
            columns.append({c: leaf for c in mine})
    out["opt"] = {c: jax.tree.unflatten(treedef, [col[c] for col in columns]) for c in mine}
    return {kind: {str(c): v for c, v in chunks.items()} for kind, chunks in out.items()}


def open_run_checkpoints(directory: str, resume: bool, steps: int, keep: int,
                         lock: bool = True) -> Checkpointer:
    """A run's Checkpointer, owning ``directory`` (``lock``: process 0 only; the others share it).

    Refuses, creating nothing: a path that cannot be a writable directory, --resume from none,
    another run's checkpoints without --resume, a directory another live run is using."""
    check_run_checkpoints(directory, resume, keep)
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    owner = DirectoryLock(directory) if lock else None
    try:
        ckpt = Checkpointer(directory, keep, owner, in_run=True)
        latest = ckpt.latest_step()
        if resume and latest is None:
            raise CheckpointError(f"no checkpoint in {directory} to resume from; drop --resume to start afresh")
        if not resume and latest is not None:
            raise CheckpointError(f"{directory} already holds checkpoints up to step {latest}; pass --resume "
                                  "to continue them or choose another --checkpoint-dir")
        if resume and latest >= steps:
            raise CheckpointError(f"the checkpoint is at step {latest}, not before --steps {steps}; "
                                  "raise --steps to train further")
    except BaseException:
        if owner:
            owner.release()
        raise
    return ckpt


def check_run_checkpoints(directory: str, resume: bool, keep: int) -> None:
    """What can be refused about --checkpoint-dir before any work, creating nothing."""
    check_output_dir(directory, "--checkpoint-dir")
    if keep < 1:
        raise ConfigError(f"--keep-checkpoints must be at least 1 (the latest checkpoint is always kept), got {keep}")
    if resume and not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint in {os.path.abspath(directory)} to resume from; drop --resume to "
                              "start afresh")
