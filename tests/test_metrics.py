"""Metric writers: JSON lines that a resumed run rewrites from its checkpoint, TensorBoard events,
output paths checked before any work."""

import json
import os

import pytest

from pstar_jax.config import ConfigError
from pstar_jax.run.metrics import JsonlWriter, Progress, TensorBoardWriter
from pstar_jax.config.paths import check_output_file


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


def events(logdir):
    """Every Event of the one event file in ``logdir`` (TFRecord framing: length, its CRC, data, CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event
    (name,) = os.listdir(logdir)
    assert name.startswith("events.out.tfevents")
    data, out, at = (logdir / name).read_bytes(), [], 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        out.append(Event.FromString(data[at + 12:at + 12 + n]))
        at += 12 + n + 4
    return out


def scalars(logdir):
    return {(v.tag, e.step): v.simple_value for e in events(logdir) for v in e.summary.value
            if v.HasField("simple_value")}


def test_tensorboard_writes_every_finite_scalar_under_grouped_tags(tmp_path):
    w = TensorBoardWriter(str(tmp_path / "tb"))
    w.write_scalars(0, {"loss": 2.5, "lr": 1e-3, "grad_norm": float("nan"), "skipped": False, "tokens_per_s": 10,
                        "eval_loss": 2.75, "h2d_bytes": 4096, "device_chunk_peak_bytes": 8192, "mine/x": 1.0})
    w.close()
    assert scalars(tmp_path / "tb") == {
        ("train/loss", 0): 2.5, ("train/lr", 0): pytest.approx(1e-3), ("train/tokens_per_s", 0): 10,
        ("eval/loss", 0): 2.75, ("memory/h2d_bytes", 0): 4096, ("memory/device_chunk_peak_bytes", 0): 8192,
        ("mine/x", 0): 1.0}


def test_tensorboard_holds_the_config_once_as_text(tmp_path):
    config = {"train": {"steps": 3, "batch_size": 8}, "optim": {"lr": 0.001}}
    w = TensorBoardWriter(str(tmp_path / "tb"), config)
    w.write_scalars(0, {"loss": 2.5})
    w.write_scalars(1, {"loss": 2.0})
    w.close()
    texts = [v for e in events(tmp_path / "tb") for v in e.summary.value if v.tag.startswith("config")]
    assert len(texts) == 1
    text = texts[0].tensor.string_val[0].decode()
    assert json.loads("\n".join(line[4:] for line in text.splitlines())) == config


def test_progress_shows_lr_and_clipping():
    bar = Progress(3, enabled=False)
    record = {"loss": 2.5, "lr": 3e-4, "clip_scale": 0.5, "tokens_per_s": 1000.0, "h2d_bytes": 0, "d2h_bytes": 0}
    bar.update(record)
    assert "lr 3.00e-04" in bar._bar.postfix and "clip 0.50" in bar._bar.postfix
    bar.update({**record, "clip_scale": 1.0})
    assert "clip" not in bar._bar.postfix
    bar.close()


def test_train_cli_writes_tensorboard_and_refuses_bad_metrics_paths(tmp_path, capsys):
    from pstar_jax.cli.train import main
    assert main(["--steps", "2", "--batch-size", "8", "--quiet", "--eval-every", "2", "--eval-batches", "1",
                 "--tensorboard", str(tmp_path / "tb")]) == 0
    tags = {tag for tag, _ in scalars(tmp_path / "tb")}
    assert {"train/loss", "train/lr", "train/clip_scale", "eval/loss", "memory/h2d_bytes"} <= tags, tags
    assert all(tag.split("/")[0] in ("train", "eval", "memory") for tag in tags), tags
    assert main(["--steps", "2", "--quiet", "--metrics-out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pstar-train: error: --metrics-out") and err.count("\n") == 1, err
