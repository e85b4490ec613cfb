"""Machine rates: measured once, kept in a file, read back exactly; bad files are one clear error."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from pstar_jax.planner import measure as mach
from pstar_jax.config import ConfigError
from pstar_jax.plan.machine import H200, MACHINES, load_machine, save_machine
from pstar_jax.planner.measure import machine_key, saved_machine

ODD = dataclasses.replace(H200, name="odd", h2d_bytes_per_s=1.2345678901234567e10, call_s=3.3e-5, duplex=True)


def test_save_and_load_round_trip_exactly(tmp_path):
    path = tmp_path / "sub" / "m.json"
    save_machine(ODD, path)
    assert load_machine(path) == ODD and load_machine(str(path)) == ODD
    assert [p.name for p in path.parent.iterdir()] == ["m.json"]  # no temporary left behind


def test_names_are_the_built_in_machines():
    assert load_machine("h200") is MACHINES["h200"] and load_machine("h200-duplex").duplex


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"name": "x"}',
                                     json.dumps({**dataclasses.asdict(H200), "flops_per_s": -1}),
                                     json.dumps({**dataclasses.asdict(H200), "call_s": "slow"}),
                                     json.dumps({**dataclasses.asdict(H200), "bogus": 1})])
def test_bad_files_are_config_errors(tmp_path, content):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="m.json"):
        load_machine(path)


def test_missing_machine_names_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="h200-duplex"):
        load_machine(tmp_path / "absent.json")


class _Optimizer:
    param_dtype = jnp.bfloat16


def test_saved_machine_measures_once(tmp_path, monkeypatch):
    """The first call measures and saves; later calls read the file; remeasure measures again."""
    monkeypatch.setenv(mach.MACHINES_DIR_ENV, str(tmp_path))
    readings = iter([ODD, dataclasses.replace(ODD, flops_per_s=1.0)])
    calls = []
    monkeypatch.setattr(mach, "measure", lambda placement, optimizer: calls.append(1) or next(readings))
    first = saved_machine(None, _Optimizer())
    assert first == dataclasses.replace(ODD, name=machine_key(jnp.bfloat16)) and len(calls) == 1
    assert (tmp_path / f"{machine_key(jnp.bfloat16)}.json").exists()
    assert saved_machine(None, _Optimizer()) == first and len(calls) == 1
    again = saved_machine(None, _Optimizer(), remeasure=True)
    assert again.flops_per_s == 1.0 and len(calls) == 2 and saved_machine(None, _Optimizer()) == again


def test_key_names_platform_versions_cores_and_dtype():
    import os

    import jax
    key = machine_key(jnp.float32)
    assert key.startswith("cpu-") and f"jax{jax.__version__}" in key and f"{os.cpu_count()}cores" in key
    assert key.endswith("float32") and "/" not in key and " " not in key


@pytest.mark.parametrize("kept", ["not json", '{"name": "x"}', "directory"])
def test_an_unreadable_kept_file_is_measured_again_with_a_warning(tmp_path, monkeypatch, kept):
    """The kept file is a cache: not JSON, a field missing or a directory in its place is
    measured again (and replaced where it can be), with one warning line, never an error."""
    monkeypatch.setenv(mach.MACHINES_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(mach, "measure", lambda placement, optimizer: ODD)
    path = tmp_path / f"{machine_key(jnp.bfloat16)}.json"
    if kept == "directory":
        path.mkdir()
    else:
        path.write_text(kept)
    warnings = []
    machine = saved_machine(None, _Optimizer(), warn=warnings.append)
    assert machine == dataclasses.replace(ODD, name=path.stem)
    assert warnings and all("\n" not in w for w in warnings) and "measuring this machine again" in warnings[0]
    if kept == "directory":
        assert "cannot keep" in warnings[-1] and path.is_dir()
    else:
        assert len(warnings) == 1 and load_machine(path) == machine  # replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left behind


def test_rates_that_cannot_be_kept_serve_the_run(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(mach.MACHINES_DIR_ENV, str(blocker / "machines"))  # under a file: cannot be made
    monkeypatch.setattr(mach, "measure", lambda placement, optimizer: ODD)
    warnings = []
    assert saved_machine(None, _Optimizer(), warn=warnings.append).flops_per_s == ODD.flops_per_s
    assert len(warnings) == 1 and "cannot keep" in warnings[0] and mach.MACHINES_DIR_ENV in warnings[0]
    with pytest.raises(OSError):
        saved_machine(None, _Optimizer(), must_keep=True)
