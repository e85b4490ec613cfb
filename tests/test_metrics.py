"""Metric writers: JSON lines that a resumed run rewrites from its checkpoint, TensorBoard events,
output paths checked before any work."""

import json
import os

import pytest

from pstar_jax.config import ConfigError
from pstar_jax.metrics import JsonlWriter, TensorBoardWriter
from pstar_jax.paths import check_output_file


def lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_jsonl_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    """A run that crashed after step 5 with a checkpoint at step 3 resumes at 3: steps 3..5 of the
    crashed run are dropped, so a reader sees each step once; a torn last line is dropped too."""
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(str(path))
    for step in range(6):
        w.write_scalars(step, {"loss": float(step)})
    w.close()
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    w = JsonlWriter(str(path), first_step=3)
    for step in range(3, 5):
        w.write_scalars(step, {"loss": 10.0 + step})
    w.close()
    assert [(r["step"], r["loss"]) for r in lines(path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    JsonlWriter(str(path)).close()  # a fresh run starts the file afresh
    assert path.read_text() == ""


def test_a_resumed_metrics_file_keeps_the_umasks_permissions(tmp_path):
    """Dropping the steps after the checkpoint rewrites the file through a temporary one: it keeps
    the permissions a new file gets under the umask (0644), not tempfile's private 0600."""
    path = tmp_path / "m.jsonl"
    old = os.umask(0o022)
    try:
        w = JsonlWriter(str(path))
        w.write_scalars(0, {"loss": 1.0})
        w.close()
        JsonlWriter(str(path), first_step=1).close()
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o644 and len(lines(path)) == 1


def test_output_paths_are_checked_before_work(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a directory"):
        check_output_file(str(tmp_path), "OutputConfig.metrics_out")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_output_file(str(tmp_path / "file" / "m.jsonl"), "OutputConfig.metrics_out")
    check_output_file(str(tmp_path / "new" / "deeper" / "m.jsonl"), "OutputConfig.metrics_out")


def test_tensorboard_writes_event_files_with_every_finite_scalar(tmp_path):
    w = TensorBoardWriter(str(tmp_path / "tb"))
    w.write_scalars(0, {"loss": 2.5, "grad_norm": float("nan"), "skipped": False, "tokens_per_s": 10})
    w.close()
    (event,) = os.listdir(tmp_path / "tb")
    data = (tmp_path / "tb" / event).read_bytes()
    assert event.startswith("events.out.tfevents") and b"loss" in data and b"tokens_per_s" in data
    assert b"grad_norm" not in data and b"skipped" not in data


def test_train_cli_writes_tensorboard_and_refuses_bad_metrics_paths(tmp_path, capsys):
    from pstar_jax.train import main
    assert main(["--steps", "2", "--batch-size", "8", "--quiet", "--tensorboard", str(tmp_path / "tb")]) == 0
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "tb"))
    assert main(["--steps", "2", "--quiet", "--metrics-out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pstar-train: error: --metrics-out") and err.count("\n") == 1, err
