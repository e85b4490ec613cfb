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


def _base_dir(tmp_path):
    """A directory like a base's: a safetensors file of 2-D bf16 and fp32 tensors (20 MiB) and a config."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file
    base = tmp_path / "base"
    base.mkdir()
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((2048, 4096)).astype(ml_dtypes.bfloat16),
               "v": rng.standard_normal((1024, 1024)).astype(np.float32)}, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    return base


def test_disk_reads_the_directory_and_keeps_its_rates_without_writing_there(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(mach.MACHINES_DIR_ENV, str(tmp_path / "machines"))
    base = _base_dir(tmp_path)
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in base.iterdir()}
    assert machine_cli.main(["--disk", str(base)]) == 0
    saved = load_machine(capsys.readouterr().out.splitlines()[0])
    assert saved.disk_read_bytes_per_s > 0 and saved.disk_tensor_bytes_per_s > 0
    assert saved.disk_measured_on == str(base)
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in base.iterdir()} == before  # nothing written
    assert machine_cli.main(["--remeasure"]) == 0  # the other rates again: the disk's are kept
    again = load_machine(capsys.readouterr().out.splitlines()[0])
    assert (again.disk_read_bytes_per_s, again.disk_measured_on) == (saved.disk_read_bytes_per_s, str(base))


def test_disk_refuses_in_one_line_what_it_cannot_read(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(mach.MACHINES_DIR_ENV, str(tmp_path / "machines"))
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text("{}")
    (tmp_path / "outside.bin").write_bytes(b"\0" * (32 << 20))
    (small / "link.bin").symlink_to(tmp_path / "outside.bin")  # not followed: the directory holds too little
    for target, says in [(tmp_path / "absent", "is not a directory"), (small / "config.json", "is not a directory"),
                         (small, "holds less than 16 MiB")]:
        assert machine_cli.main(["--disk", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and err.startswith("pstar-machine: error: --disk")
    assert not (tmp_path / "machines").exists()  # refused before measuring anything
