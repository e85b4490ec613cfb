"""Machine rates: measured once, kept in a file, read back exactly; bad files are one clear error."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from pstar_jax.planner import measure as mach
from pstar_jax.config import ConfigError
from pstar_jax.plan.machine import H200, MACHINES, load_machine, load_note, provenance, save_machine
from pstar_jax.planner.measure import machine_key, saved_machine, step_gap_note

ODD = dataclasses.replace(H200, name="odd", h2d_bytes_per_s=1.2345678901234567e10, call_s=3.3e-5, duplex=True,
                          disk_read_bytes_per_s=6.1e9, disk_tensor_bytes_per_s=2.5e9, disk_measured_on="/nvme/base")


def test_save_and_load_round_trip_exactly(tmp_path):
    path = tmp_path / "sub" / "m.json"
    save_machine(ODD, path)
    assert load_machine(path) == ODD and load_machine(str(path)) == ODD
    assert [p.name for p in path.parent.iterdir()] == ["m.json"]  # no temporary left behind


def test_a_file_kept_before_the_disk_rates_loads_without_them(tmp_path):
    path = tmp_path / "m.json"
    fields = dataclasses.asdict(ODD)
    for name in ("disk_read_bytes_per_s", "disk_tensor_bytes_per_s", "disk_measured_on"):
        del fields[name]
    path.write_text(json.dumps(fields))
    old = load_machine(path)
    assert old.disk_read_bytes_per_s == old.disk_tensor_bytes_per_s == 0.0 and old.disk_measured_on == ""


def test_names_are_the_built_in_machines():
    assert load_machine("h200") is MACHINES["h200"] and load_machine("h200-duplex").duplex


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"name": "x"}',
                                     json.dumps({**dataclasses.asdict(H200), "flops_per_s": -1}),
                                     json.dumps({**dataclasses.asdict(H200), "call_s": "slow"}),
                                     json.dumps({**dataclasses.asdict(H200), "disk_read_bytes_per_s": -1}),
                                     json.dumps({**dataclasses.asdict(H200), "disk_tensor_bytes_per_s": "fast"}),
                                     json.dumps({**dataclasses.asdict(H200), "disk_measured_on": 3}),
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


def _kept(tmp_path, monkeypatch, **fields):
    """A kept rates file with ``fields`` (the old ones: no measured_* fields at all)."""
    monkeypatch.setenv(mach.MACHINES_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(mach, "measure", lambda placement, optimizer: pytest.fail("measured again"))
    path = tmp_path / f"{machine_key(jnp.bfloat16)}.json"
    rates = {k: v for k, v in dataclasses.asdict(ODD).items() if not k.startswith("measured")}
    path.write_text(json.dumps({**rates, "name": path.stem, **fields}))
    return path


def test_a_file_kept_before_loads_were_recorded_still_loads(tmp_path, monkeypatch, caplog):
    path = _kept(tmp_path, monkeypatch)
    monkeypatch.setattr(mach.os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    with caplog.at_level("INFO", logger="pstar_jax"):
        machine = saved_machine(None, _Optimizer())
    assert machine == dataclasses.replace(ODD, name=path.stem) and machine.measured_load is None
    assert provenance(machine) == "measured, load not recorded" and load_note(machine, 7.0) is None
    assert caplog.messages == []


def test_rates_kept_from_a_busy_machine_say_so_at_start_up(tmp_path, monkeypatch, caplog):
    """Measured at load 5.2 on 2 cores (above half a process per core): one note, with the remedy."""
    _kept(tmp_path, monkeypatch, measured_at="2025-01-02 13:04", measured_load=5.2, measured_cores=2)
    monkeypatch.setattr(mach.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    with caplog.at_level("INFO", logger="pstar_jax"):
        saved_machine(None, _Optimizer())
    assert len(caplog.messages) == 1, caplog.messages
    note = caplog.messages[0]
    assert "rates measured 2025-01-02 13:04 at load 5.2 on 2 cores: predictions may be off" in note
    assert "pstar-machine --remeasure" in note and "load now" not in note


@pytest.mark.parametrize("measured, now, said", [(0.2, 0.3, False), (0.2, 4.0, True), (1.0, 0.1, False)])
def test_rates_from_a_quiet_machine_say_so_when_the_load_moved(tmp_path, monkeypatch, caplog, measured, now, said):
    _kept(tmp_path, monkeypatch, measured_at="2025-01-02 13:04", measured_load=measured, measured_cores=2)
    monkeypatch.setattr(mach.os, "getloadavg", lambda: (now, 0.0, 0.0))
    with caplog.at_level("INFO", logger="pstar_jax"):
        saved_machine(None, _Optimizer())
    assert [m for m in caplog.messages if f"load now {now:.1f}" in m] == caplog.messages
    assert bool(caplog.messages) == said


def test_a_reading_records_its_load_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(mach.os, "getloadavg", lambda: (5.2, 1.0, 1.0))
    conditions = mach.measuring_conditions()
    assert conditions["measured_load"] == 5.2 and conditions["measured_cores"] == mach.os.cpu_count()
    measured = dataclasses.replace(ODD, **conditions)
    save_machine(measured, tmp_path / "m.json")
    assert load_machine(tmp_path / "m.json") == measured
    (tmp_path / "m.json").write_text(json.dumps({**dataclasses.asdict(measured), "measured_load": "high"}))
    with pytest.raises(ConfigError, match="measured_load"):
        load_machine(tmp_path / "m.json")


def test_a_first_step_far_from_the_prediction_names_the_rates_and_the_remedy(monkeypatch):
    machine = dataclasses.replace(ODD, measured_at="2025-01-02 13:04", measured_load=5.2, measured_cores=2)
    monkeypatch.setattr(mach.os, "getloadavg", lambda: (0.4, 0.0, 0.0))
    note = step_gap_note(2, 2.10, 0.05, machine)
    assert note == ("step 3 took 2.1 s, the plan predicted 50 ms (42x slower): the odd rates (measured "
                    "2025-01-02 13:04 at load 5.2, load now 0.4) do not describe this machine now; pstar-machine "
                    "--remeasure measures them again")
    assert step_gap_note(2, 0.075, 0.05, machine) is None  # 1.5x: a fair prediction
    # The tiny default model on 2 cores: 12 moments of the executor's own time, which no rate covers
    assert step_gap_note(2, 0.031, 0.0019, machine, moments=12) is None
    assert "(16x slower)" in step_gap_note(2, 0.031, 0.0019, machine, moments=2)
    assert "(42x slower)" in step_gap_note(2, 2.10, 0.05, machine, moments=12)
    assert "took 10 ms, the plan predicted 50 ms (5x faster)" in step_gap_note(2, 0.01, 0.05, machine)
    assert "predicted 1.3 µs" in step_gap_note(2, 0.02, 1.3e-6, machine)
    assert "(preset" in step_gap_note(2, 2.1, 0.05, H200) and "without --machine" in step_gap_note(2, 2.1, 0.05, H200)
