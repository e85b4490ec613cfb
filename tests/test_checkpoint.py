"""Checkpoints: exact resume, crash safety, other layouts, Flax interchange, faults, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models.gpt import load_gpt
from pstar_jax.io.checkpoint import Checkpointer
from pstar_jax.cli.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--quiet", "--precision", "fp32", "--batch-size", "8", "--lr", "3e-3"]


def records(path):
    return [json.loads(line) for line in open(path)]


def saved_arrays(directory):
    ckpt = Checkpointer(str(directory))
    step = ckpt.latest_step()
    meta = ckpt.meta(step)
    state = ckpt._manager.restore(step)["state"]
    ckpt.close()
    return meta, {"/".join(map(str, k)): np.asarray(v) for k, v in
                  jax.tree_util.tree_flatten_with_path(state)[0]}


def test_ten_straight_equal_five_stop_five_resumed(tmp_path):
    """Bit for bit: losses and every saved array (params, master, optimizer state)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*BASE, "--steps", "10", "--checkpoint-dir", str(a), "--metrics-out", str(tmp_path / "a.jsonl")]) == 0
    assert main([*BASE, "--steps", "10", "--stop-after", "5", "--checkpoint-dir", str(b),
                 "--metrics-out", str(tmp_path / "b.jsonl")]) == 0
    assert Checkpointer(str(b)).latest_step() == 5
    assert main([*BASE, "--steps", "10", "--resume", "--checkpoint-dir", str(b),
                 "--metrics-out", str(tmp_path / "b.jsonl")]) == 0
    la = [(r["loss"], r["grad_norm"]) for r in records(tmp_path / "a.jsonl")]
    lb = [(r["loss"], r["grad_norm"]) for r in records(tmp_path / "b.jsonl")]
    assert la == lb and len(la) == 10
    (meta_a, arrays_a), (meta_b, arrays_b) = saved_arrays(a), saved_arrays(b)
    assert meta_a["step"] == meta_b["step"] == 10 and meta_a["data_position"] == meta_b["data_position"]
    assert arrays_a.keys() == arrays_b.keys()
    for name in arrays_a:
        np.testing.assert_array_equal(arrays_a[name], arrays_b[name], err_msg=name)


def test_restore_under_other_chunk_size_budget_and_data_parallel(tmp_path):
    """Saved with W=1 and 8192-element chunks; resumed with W=2, 16384-element chunks, all resident."""
    straight, split = tmp_path / "s.jsonl", tmp_path / "p.jsonl"
    assert main([*BASE, "--steps", "6", "--chunk-size", "8192", "--metrics-out", str(straight)]) == 0
    d = tmp_path / "ck"
    assert main([*BASE, "--steps", "6", "--stop-after", "3", "--chunk-size", "8192", "--data-parallel", "1",
                 "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0
    assert main([*BASE, "--steps", "6", "--resume", "--chunk-size", "16384", "--data-parallel", "2",
                 "--device-memory", "1GiB", "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0
    np.testing.assert_allclose([r["loss"] for r in records(split)], [r["loss"] for r in records(straight)], rtol=2e-5)


def test_a_lora_run_resumes_under_another_size_per_kind(tmp_path):
    """Saved with the adapters and the base in chunks of their own sizes (auto); resumed with one
    size forced on both (--chunk-size): the trainable chunks are laid out again on the host."""
    lora = [*BASE, "--model", "llama-tiny", "--lora-rank", "4", "--steps", "4"]
    straight, split, d = tmp_path / "s.jsonl", tmp_path / "p.jsonl", tmp_path / "ck"
    assert main([*lora, "--metrics-out", str(straight)]) == 0
    assert main([*lora, "--stop-after", "2", "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0
    meta = Checkpointer(str(d)).meta(2)
    assert "numels" in meta["layout"] and meta["layout"]["frozen_chunks"]  # two sizes, and frozen chunks
    assert main([*lora, "--resume", "--chunk-size", "12288", "--checkpoint-dir", str(d),
                 "--metrics-out", str(split)]) == 0
    np.testing.assert_allclose([r["loss"] for r in records(split)], [r["loss"] for r in records(straight)], rtol=2e-5)


@pytest.mark.slow
def test_bf16_resume_is_bit_for_bit_under_the_same_degree_and_equal_to_rounding_under_another(tmp_path):
    """What README's "Checkpoints and faults" promises in bf16: a stop and resume at W=2 equals the
    straight W=2 run exactly; the same checkpoint resumed at W=1 reduces gradients across devices
    in another order, so it agrees to rounding (and is not claimed to be bit for bit)."""
    bf16 = [*BASE[:1], "--precision", "bf16", *BASE[3:], "--steps", "6"]
    straight, split, other = tmp_path / "s.jsonl", tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    d, copy = tmp_path / "ck", tmp_path / "ck_copy"
    assert main([*bf16, "--data-parallel", "2", "--metrics-out", str(straight)]) == 0
    assert main([*bf16, "--data-parallel", "2", "--stop-after", "3", "--checkpoint-dir", str(d),
                 "--metrics-out", str(split)]) == 0
    shutil.copytree(d, copy)
    shutil.copyfile(split, other)
    assert main([*bf16, "--data-parallel", "2", "--resume", "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0
    assert main([*bf16, "--data-parallel", "1", "--resume", "--checkpoint-dir", str(copy),
                 "--metrics-out", str(other)]) == 0
    ref = [(r["loss"], r["grad_norm"]) for r in records(straight)]
    assert [(r["loss"], r["grad_norm"]) for r in records(split)] == ref and len(ref) == 6
    rows = records(other)
    assert [(r["loss"], r["grad_norm"]) for r in rows[:3]] == ref[:3]
    np.testing.assert_allclose([r["loss"] for r in rows[3:]], [x[0] for x in ref[3:]], rtol=1e-4)
    np.testing.assert_allclose([r["grad_norm"] for r in rows[3:]], [x[1] for x in ref[3:]], rtol=1e-2)


@pytest.mark.slow
def test_export_flax_gives_the_same_loss_from_models_alone(tmp_path):
    """Export, load with models.gpt.load_gpt (no pstar_jax), same loss as training would report."""
    out = tmp_path / "export"
    assert main([*BASE, "--steps", "3", "--export-flax", str(out), "--metrics-out", str(tmp_path / "m.jsonl")]) == 0
    model = load_gpt(str(out))
    rng = np.random.default_rng(1)
    tok = jnp.asarray(rng.integers(0, 256, (4, 65)), jnp.int32)
    loss = float(model.loss(tok[:, :-1], tok[:, 1:]))
    # The same parameters started again through pstar_jax: its first step's loss is that loss.
    metrics = tmp_path / "again.jsonl"
    assert main([*BASE, "--steps", "1", "--init-from-flax", str(out), "--metrics-out", str(metrics)]) == 0
    from pstar_jax.io.flax_io import import_flax
    from pstar_jax.model.staged import compose_loss
    from pstar_models.gpt import build_model
    staged = build_model("tiny")
    params = import_flax(str(out), staged.param_shapes())
    again = float(compose_loss(staged.stages(jnp.float32))(params, tok[:, :-1], tok[:, 1:]))
    np.testing.assert_allclose(loss, again, rtol=1e-6)
    assert abs(records(metrics)[0]["loss"] - records(tmp_path / "m.jsonl")[-1]["loss"]) < 0.2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's aborted reads
def test_refuses_to_overwrite_and_reports_bad_checkpoints(tmp_path, capsys):
    d = tmp_path / "ck"
    assert main([*BASE, "--steps", "2", "--checkpoint-dir", str(d)]) == 0
    before = sorted(os.listdir(d))
    assert main([*BASE, "--steps", "4", "--checkpoint-dir", str(d)]) == 2
    assert "already holds checkpoints up to step 2; pass --resume" in capsys.readouterr().err
    assert main([*BASE, "--steps", "4", "--resume", "--checkpoint-dir", str(tmp_path / "none")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert main([*BASE, "--steps", "4", "--resume", "--n-layer", "3", "--checkpoint-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "change the training math: --n-layer was None, now 3; --steps was 2, now 4" in err
    assert "--allow-config-change" in err and err.count("\n") == 1
    assert main([*BASE, "--steps", "4", "--resume", "--n-layer", "3", "--allow-config-change",
                 "--checkpoint-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "another model shape" in err and err.count("\n") == 1
    # Corrupt one array file: a clear error, and nothing overwritten.
    victim = max((os.path.join(r, f) for r, _, fs in os.walk(d / "2") for f in fs if "state" in r),
                 key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(0)
        f.write(b"\0" * 64)
    assert main([*BASE, "--steps", "4", "--resume", "--allow-config-change", "--checkpoint-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "step 2" in err and ("corrupt" in err or "checksums" in err or "unreadable" in err), err
    assert sorted(os.listdir(d)) == before


@pytest.mark.slow
def test_nonfinite_loss_stops_naming_the_step_or_is_skipped(tmp_path, capsys):
    """A huge learning rate blows up: stop with the step named (exit 1), or skip with --skip-nonfinite."""
    argv = [*BASE, "--steps", "8", "--lr", "1e6", "--clip-norm", "0", "--warmup-steps", "0"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "the loss or gradient is not finite at step" in err and err.count("\n") == 1, err
    metrics = tmp_path / "m.jsonl"
    assert main([*argv, "--skip-nonfinite", "--metrics-out", str(metrics)]) == 0
    rows = records(metrics)
    assert len(rows) == 8 and any(r["skipped"] for r in rows)


def run_cli(args, **kw):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, "-m", "pstar_jax.cli.train", *BASE, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    d, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = run_cli(["--steps", "100000", "--checkpoint-dir", str(d), "--metrics-out", str(metrics)])
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by SIGTERM after step" in err
    step = Checkpointer(str(d)).latest_step()
    assert step is not None and step >= 3 and f"after step {step};" in err


@pytest.mark.slow
def test_kill_during_save_leaves_last_good_checkpoint(tmp_path):
    """kill -9 while orbax writes a step: resume comes from the last committed one and goes on."""
    d, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = run_cli(["--model", "small", "--steps", "100000", "--checkpoint-every", "1", "--checkpoint-dir", str(d),
                    "--keep-checkpoints", "100", "--metrics-out", str(metrics)])
    deadline = time.monotonic() + 180
    try:
        while True:  # wait for a save in flight after at least one committed step
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-2000:] if proc.poll() else ""
            names = os.listdir(d) if d.exists() else []
            committed = [n for n in names if n.isdigit()]
            if committed and any("tmp" in n for n in names):
                break
            time.sleep(0.005)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    names = os.listdir(d)
    assert any("tmp" in n for n in names), names  # killed mid-save
    last_good = Checkpointer(str(d)).latest_step()
    assert last_good is not None
    resumed = run_cli(["--model", "small", "--steps", str(last_good + 2), "--resume", "--allow-config-change", "--checkpoint-dir", str(d),
                       "--metrics-out", str(tmp_path / "r.jsonl")])
    out, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err[-2000:]
    assert f"resumed from {d} at step {last_good}" in out
    assert [r["step"] for r in records(tmp_path / "r.jsonl")] == [last_good, last_good + 1]


@pytest.mark.slow
def test_plain_engine_checkpoints_resume_bit_for_bit(tmp_path, capsys):
    """The Engine protocol: the plain engine saves and resumes too (10 straight steps equal 5, a
    stop and 5 resumed); a chunked run cannot resume a plain checkpoint."""
    straight, split, d = tmp_path / "s.jsonl", tmp_path / "p.jsonl", tmp_path / "ck"
    plain = [*BASE, "--engine", "plain", "--steps", "6"]
    assert main([*plain, "--metrics-out", str(straight)]) == 0
    assert main([*plain, "--stop-after", "3", "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0
    assert main([*plain, "--resume", "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0
    assert [r["loss"] for r in records(split)] == [r["loss"] for r in records(straight)]
    capsys.readouterr()
    assert main([*BASE, "--steps", "8", "--resume", "--allow-config-change", "--checkpoint-dir", str(d)]) == 2
    assert "written by the plain engine; resume it with --engine plain" in capsys.readouterr().err


def small_steps(directory, steps):
    """A Checkpointer's steps of one 8-element master chunk (no model needed); its checksum."""
    ckpt = Checkpointer(str(directory), max_to_keep=10)
    for step in steps:
        ckpt.save(step, {"master": {"0": jnp.arange(8, dtype=jnp.float32) + step}}, {})
    ckpt.close()
    return lambda step: ckpt_meta(directory, step)["checksums"][0]


def ckpt_meta(directory, step):
    ckpt = Checkpointer(str(directory))
    try:
        return ckpt.meta(step)
    finally:
        ckpt.close()


def read_error(directory, step=None):
    from pstar_jax.io.checkpoint import CheckpointError
    ckpt = Checkpointer(str(directory))
    try:
        with pytest.raises(CheckpointError) as err:
            ckpt.meta(step)
    finally:
        ckpt.close()
    return str(err.value)


def test_removal_is_suggested_only_for_pstar_steps_and_a_missing_step_names_those_present(tmp_path):
    """A user's own folders 1, 2, 7 are never called a checkpoint to remove; --step 999 names the
    steps there instead of calling a step that never existed unreadable; a damaged step of ours is
    still named for removal."""
    own = tmp_path / "own"
    for name in ("1", "2", "7"):
        (own / name).mkdir(parents=True)
        (own / name / "notes.txt").write_text("mine")
    err = read_error(own)
    assert err == f"{own}/7 is not a pstar checkpoint step (it has no meta/ or state/ folder); {own} holds no " \
                  "pstar checkpoint step" and "remove" not in err
    mixed = tmp_path / "mixed"
    small_steps(mixed, [3, 6])
    (mixed / "7").mkdir()
    assert read_error(mixed) == f"{mixed}/7 is not a pstar checkpoint step (it has no meta/ or state/ folder); " \
                                "the steps there are 3, 6"
    assert read_error(mixed, 999) == f"no checkpoint step 999 in {mixed}; the steps there are 3, 6"
    os.remove(mixed / "6" / "meta" / "metadata")
    err = read_error(mixed, 6)
    assert err.startswith(f"checkpoint step 6 in {mixed} is unreadable (") and \
        err.endswith(f"; remove {mixed}/6 to fall back to an earlier one"), err


def test_a_step_rotated_away_mid_read_names_the_live_run_and_says_retry(tmp_path):
    """pstar-export reading a step that the live run owning the directory rotates away (keeps its
    latest --keep-checkpoints): the run (pid, host) is named and the reader told to retry, never to
    remove a step; without a live run the step is still only said to have gone."""
    import socket

    from pstar_jax.io.checkpoint import CheckpointError
    from pstar_jax.io.run_lock import DirectoryLock
    d = tmp_path / "ck"
    checksum = small_steps(d, [3, 6])(3)
    reader = Checkpointer(str(d))
    try:
        np.testing.assert_array_equal(reader.restore_chunk(3, "master", 0, 8, checksum), np.arange(8) + 3)
        run = DirectoryLock(str(d))  # the live run, which now saves step 9 and drops step 3
        try:
            shutil.rmtree(d / "3")
            with pytest.raises(CheckpointError) as err:
                reader.restore_chunk(3, "master", 0, 8, checksum)
            assert str(err.value) == (
                f"checkpoint step 3 in {d} was removed while being read: the run (pid {os.getpid()} on host "
                f"{socket.gethostname()}) training into this directory rotates its checkpoints; retry (the steps "
                "there are 6) or wait for that run to end")
        finally:
            run.release()
        with pytest.raises(CheckpointError, match=r"^checkpoint step 3 in .* was removed while being read; retry "
                                                  r"\(the steps there are 6\)$"):
            reader.restore_chunk(3, "master", 0, 8, checksum)
    finally:
        reader.close()


@pytest.mark.parametrize("name", ["full", "lora"])
def test_the_layout_of_an_existing_checkpoint_reads_and_is_written_back_as_it_was(name):
    """A checkpoint's layout (one chunk size, frozen chunks by id, as every checkpoint so far) reads
    with a size and a kind per chunk and is written back byte for byte, so a run resumed from it
    saves the layout it read."""
    from pstar_jax.engine.chunks import ChunkLayout
    path = os.path.join(ROOT, "tests", "fixtures", "pre_layout", name, "2", "meta", "metadata")
    saved = json.load(open(path))["layout"]
    layout = ChunkLayout.from_json(saved)
    assert layout.numels == (saved["chunk_numel"],) * layout.n_chunks
    assert [c for c in range(layout.n_chunks) if layout.is_frozen(c)] == saved.get("frozen_chunks", [])
    assert json.dumps(layout.to_json()) == json.dumps(saved)
