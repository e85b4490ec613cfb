"""pstar-launch: N local pstar-train processes joined by jax.distributed (the signal and dead-peer
cases are in test_faults)."""

import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def launch(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pstar_jax.launch", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_installed_as_a_console_script_and_bad_flags_are_one_line():
    """A pip user gets the launcher as pstar-launch (the repository's scripts/ are not installed)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["pstar-launch"] == "pstar_jax.launch:main"
    from pstar_jax.launch import main
    bad = launch("-n", "0")
    assert bad.returncode == 2 and bad.stderr == "pstar-launch: error: --num-processes must be at least 1, got 0\n"
    assert callable(main)


@pytest.mark.slow  # over 20 s on 2 cores
def test_runs_two_processes_and_reports_failures(tmp_path):
    r = launch("-n", "2", "--local-devices", "1", "--log-dir", str(tmp_path), "--timeout", "200",
               "--", "--steps", "2", "--quiet", "--batch-size", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 2 of 2 steps" in r.stdout
    bad = launch("-n", "2", "--log-dir", str(tmp_path), "--timeout", "200", "--", "--model", "nope")
    assert bad.returncode == 2 and "pstar-launch: process" in bad.stderr and "exited with code 2" in bad.stderr
