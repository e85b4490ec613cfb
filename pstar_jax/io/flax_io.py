"""Plain Flax interchange: the parameters as a nested pytree that orbax alone restores (and that
models/ loads without pstar_jax), written beside the target and renamed into place; read back with
names, shapes and finiteness checked."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

from pstar_jax.io.checkpoint import CheckpointError, CheckpointSaveError
from pstar_jax.config import ConfigError
from pstar_jax.config.paths import check_output_dir, os_error_cause


EXPORT_FILES = {"params", "config.json"}


def check_export_dir(directory: str) -> None:
    """An --export-flax target must be writable and absent, empty, or an earlier export (which
    is replaced); anything else in it (a user's files) is never overwritten."""
    check_output_dir(directory, "CheckpointConfig.export_flax")
    names = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    if names and not ("params" in names and names <= EXPORT_FILES):
        raise ConfigError(f"CheckpointConfig.export_flax {os.path.abspath(directory)} holds other files "
                          f"({', '.join(sorted(names - EXPORT_FILES)[:3]) or 'no params/'}); "
                          "choose an empty or new directory")


def export_flax(directory: str, params: dict[str, np.ndarray], model_config: dict) -> None:
    """Write parameters as a plain nested dict (names split at '.'), restorable with orbax alone.

    Written beside the target (DIR.pstar-tmp) and renamed into place: a failed export leaves no
    half export in DIR."""
    check_export_dir(directory)
    directory = os.path.abspath(directory)
    nested: dict = {}
    for name, value in params.items():
        node = nested
        *path, leaf = name.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = np.asarray(value, np.float32)
    # Every process takes part in the orbax save, as orbax expects; process 0 renames.
    main = jax.process_index() == 0
    staging = directory + ".pstar-tmp"
    try:
        if main:
            shutil.rmtree(staging, ignore_errors=True)  # left by an export that failed
            os.makedirs(staging)
        _barrier("pstar_jax export: staging ready")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(staging, "params"), nested)
        if main:
            with open(os.path.join(staging, "config.json"), "w") as f:
                json.dump(model_config, f, indent=1)
            if os.path.isdir(directory):  # empty, or an earlier export (checked above)
                shutil.rmtree(directory)
            os.rename(staging, directory)
    except Exception as err:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointSaveError(f"--export-flax {directory} failed: {os_error_cause(err)}") from None
    _barrier("pstar_jax export: done")


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def import_flax(directory: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Parameters by flat name from an export (or any orbax pytree of the same nested names),
    checked: every tensor present with the model's shape, every value finite."""
    path = os.path.join(os.path.abspath(directory), "params")
    if not os.path.isdir(path) or not os.listdir(path):
        raise CheckpointError(f"{directory} holds no Flax export (no params/ inside, or it is empty); "
                              "check --init-from-flax")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            nested = ckptr.restore(path)
        flat = {".".join(str(getattr(k, "key", k)) for k in key): np.asarray(v)
                for key, v in jax.tree_util.tree_flatten_with_path(nested)[0]}
    except Exception as err:
        raise CheckpointError(f"the Flax export in {directory} is unreadable ({type(err).__name__}); "
                              "export it again") from None
    got = {n: tuple(v.shape) for n, v in flat.items()}
    if got != dict(shapes):
        wrong = sorted(n for n in set(shapes) | set(got) if got.get(n) != shapes.get(n))[:3]
        raise CheckpointError(f"the Flax export in {directory} does not match the model (missing, extra or "
                              f"reshaped: {', '.join(wrong)}); use the model flags it was made with")
    bad = [n for n, v in flat.items() if not np.all(np.isfinite(v))]
    if bad:
        raise CheckpointError(f"the Flax export in {directory} holds non-finite values (in {', '.join(bad[:3])}); "
                              "export it again from a good checkpoint")
    return flat
