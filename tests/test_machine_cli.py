"""pstar-machine: measures once, keeps the rates, says in one line where it cannot keep them."""

import jax.numpy as jnp

from pstar_jax.planner import measure as mach

from pstar_jax.cli import machine as machine_cli
from pstar_jax.plan.machine import load_machine
from pstar_jax.planner.measure import machine_key


def test_main_measures_this_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(mach.MACHINES_DIR_ENV, str(tmp_path))
    assert machine_cli.main([]) == 0
    path = capsys.readouterr().out.splitlines()[0]
    saved = load_machine(path)
    assert saved.name == machine_key(jnp.bfloat16) and saved.flops_per_s > 0 and saved.host_adam_params_per_s > 0
    assert machine_cli.main([]) == 0 and load_machine(capsys.readouterr().out.splitlines()[0]) == saved  # kept


def test_main_says_where_it_cannot_write(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(mach.MACHINES_DIR_ENV, str(blocker / "machines"))  # under a file: cannot be made
    assert machine_cli.main(["--remeasure"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "PSTAR_MACHINES_DIR" in err
