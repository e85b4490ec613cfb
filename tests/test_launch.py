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
    return subprocess.run([sys.executable, "-m", "pstar_jax.cli.launch", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_installed_as_a_console_script_and_bad_flags_are_one_line():
    """A pip user gets the launcher as pstar-launch (the repository's scripts/ are not installed)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["pstar-launch"] == "pstar_jax.cli.launch:main"
    from pstar_jax.cli.launch import main
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


@pytest.mark.slow  # two launches of pstar-train on 2 cores
def test_lora_over_two_processes_equals_one_process_of_two_devices(tmp_path):
    """ZeRO of a LoRA run across processes (frozen base chunks and adapter chunks sharded over the
    data axis of two jax.distributed processes) gives the losses of the same mesh in one process."""
    import json
    import numpy as np
    flags = ["--steps", "3", "--quiet", "--batch-size", "4", "--precision", "fp32", "--model", "tiny",
             "--lora-rank", "4", "--lr", "1e-2", "--chunk-size", "8192"]
    losses = {}
    for n, local in ((2, 1), (1, 2)):
        metrics = tmp_path / f"m{n}.jsonl"
        r = launch("-n", str(n), "--local-devices", str(local), "--log-dir", str(tmp_path / f"logs{n}"),
                   "--timeout", "250", "--", *flags, "--metrics-out", str(metrics), "--checkpoint-dir",
                   str(tmp_path / f"ck{n}"))
        assert r.returncode == 0, r.stderr[-3000:]
        losses[n] = np.array([json.loads(line)["loss"] for line in open(metrics)])
    assert len(losses[2]) == 3
    # fp32 sums of the same terms in another order across processes: a few ulps at the loss's scale
    np.testing.assert_allclose(losses[2], losses[1], rtol=0, atol=64 * np.finfo(np.float32).eps * losses[1].max())


def test_logs_go_to_runs_launch_not_the_current_directory_and_the_help_shows_the_defaults(tmp_path):
    """Processes 1.. log into runs/launch/ (which .gitignore leaves out), never loose files in the
    directory the launcher runs in."""
    r = subprocess.run([sys.executable, "-m", "pstar_jax.cli.launch", "-n", "2", "--", "--data",
                        str(tmp_path / "none.u16.bin")], cwd=tmp_path, env={**ENV, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=120)
    # whichever process fails first, its own line reaches the terminal: process 0 writes there, and
    # the launcher repeats process 1's last logged line where it stops the others
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
    # process 1 either reaches the same error or is ended by the launcher once process 0 failed:
    # which comes first is a race, but both are pstar-train's own line in its log
    log = (tmp_path / "runs" / "launch" / "pstar_process_1.log").read_text()
    assert "does not exist" in log or "pstar-train: terminated (SIGTERM)" in log, log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    text = " ".join(launch("--help").stdout.split())
    assert "-n NUM_PROCESSES, --num-processes NUM_PROCESSES pstar-train processes to start (default: 2)" in text
    assert "(default: runs/launch)" in text
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/runs/" in f.read().split()


def test_a_log_dir_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    bad = launch("-n", "2", "--log-dir", str(tmp_path / "file" / "logs"), "--", "--steps", "1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--log-dir" in bad.stderr, bad.stderr


def test_a_failed_process_s_last_logged_line_is_repeated_where_the_launcher_stops(tmp_path):
    """Process 1.. write to their logs: when one fails first, the launcher's own line carries its
    reason (process 0 then may be stopped before it prints its own); none for process 0 or no log."""
    from pstar_jax.cli.launch import _last_line
    (tmp_path / "pstar_process_1.log").write_text("loading\npstar-train: error: --data x does not exist\n\n")
    assert _last_line(str(tmp_path), 1) == ", saying: pstar-train: error: --data x does not exist"
    assert _last_line(str(tmp_path), 0) == "" and _last_line(str(tmp_path), 2) == ""
