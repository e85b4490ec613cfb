"""pstar-train: a short run writes the metrics it promises; bad input is one line and exit 2."""

import json
import os
import subprocess
import sys

import pytest

from pstar_jax.cli.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "clip_scale", "step_s", "tokens_per_s", "trained_tokens",
               "trained_tokens_per_s", "model_tflops", "h2d_bytes", "d2h_bytes", "device_chunk_peak_bytes",
               "predicted_h2d_bytes", "predicted_d2h_bytes", "skipped"}


def test_default_corpus_run_writes_metrics_and_moves_chunks(tmp_path, capsys):
    """A few chunked steps on the embedded corpus: one JSON line per step, chunks moved, loss falls."""
    out = tmp_path / "m.jsonl"
    assert main(["--steps", "12", "--lr", "3e-3", "--warmup-steps", "1", "--quiet",
                 "--metrics-out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(12))
    assert METRIC_KEYS <= records[0].keys()
    assert all(r["h2d_bytes"] > 0 for r in records[1:]), "the CPU default budget must move chunks"
    assert records[-1]["loss"] < records[0]["loss"]
    assert "chunked engine" in capsys.readouterr().out


def test_plain_engine_runs(tmp_path):
    out = tmp_path / "m.jsonl"
    assert main(["--engine", "plain", "--remat", "full", "--steps", "2", "--quiet",
                 "--metrics-out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("clip", ["1e-3", "0"])
def test_both_engines_report_each_steps_lr_and_clip_scale(tmp_path, capsys, clip):
    """The same fields from both engines; lr is the schedule's (warmup from 0 over 2 steps, then
    the peak, then the cosine); clip_scale is clip_norm / grad_norm when clipped (a clip norm far
    below the grad norm), 1.0 without clipping. The done line's tokens/s covers the whole run:
    between the tokens over the test's own clock and over the steps' time alone."""
    import time
    rows = {}
    for kind in ("chunked", "plain"):
        out = tmp_path / f"{kind}.jsonl"
        start = time.perf_counter()
        assert main(["--engine", kind, "--steps", "4", "--batch-size", "8", "--precision", "fp32", "--lr", "1e-2",
                     "--warmup-steps", "2", "--final-lr-fraction", "0.5", "--clip-norm", clip, "--quiet",
                     "--metrics-out", str(out)]) == 0
        wall_s = time.perf_counter() - start
        rows[kind] = [json.loads(line) for line in out.read_text().splitlines()]
        done = capsys.readouterr().out.strip().splitlines()[-1]
        assert "tokens/s over the whole run" in done and "start-up and compilation included" in done, done
        reported = float(done.split(" tokens/s")[0].rsplit(", ", 1)[1].replace(",", ""))
        tokens = 4 * 8 * 64  # steps x batch x the tiny default model's seq_len
        assert tokens / wall_s - 1 <= reported <= tokens / sum(r["step_s"] for r in rows[kind]) + 1
    for records in rows.values():
        assert METRIC_KEYS == records[0].keys()
        assert [r["lr"] for r in records] == pytest.approx([0.0, 5e-3, 1e-2, 0.75e-2], rel=1e-6)
        for r in records:
            want = 1.0 if clip == "0" else 1e-3 / r["grad_norm"]
            assert r["grad_norm"] > 1e-2 and r["clip_scale"] == pytest.approx(want, rel=1e-6)
    assert rows["chunked"][0].keys() == rows["plain"][0].keys()


@pytest.mark.parametrize("argv, words", [
    (["--chunk-size", "100"], "below the largest tensor"),
    (["--device-memory", "60KiB"], "does not fit: device memory runs out at the fwd of stage 0"),
    (["--model", "GPT_nope"], "unknown model preset"),
    (["--data", "/nonexistent/tokens.u16.bin"], "does not exist"),
    (["--device-memory", "lots"], "is not a size"),
    (["--chunk-size", "big"], "is not a count"),
    (["--batch-size", "6", "--micro-batches", "4"], "multiple of --micro-batches"),
    (["--precision", "fp8"], "invalid choice"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, argv, words):
    out = tmp_path / "m.jsonl"
    assert main([*argv, "--steps", "1", "--quiet", "--metrics-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pstar-train: error:") and "\n" not in err and words in err, err
    assert not out.exists()


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    """The console entry point: exit status 2, one stderr line, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "pstar_jax.cli.train", "--model", "nope", "--quiet"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "unknown model preset" in proc.stderr


@pytest.mark.parametrize("argv, words", [
    (["--data-parallel", "-1"], "--data-parallel must be a whole number of at least 1"),
    (["--data-parallel", "0"], "--data-parallel must be a whole number of at least 1"),
    (["--steps", "1000000000000"], "--steps must be a whole number of at least 1 and at most"),
    (["--seed", "100000000000000000000000"], "--seed"),
    (["--seed", "-3"], "--seed must be a whole number in [0,"),
    (["--step-timeout", "-1"], "--step-timeout must be a finite number in (0, inf)"),
    (["--step-timeout", "nan"], "--step-timeout must be a finite number"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be a whole number of at least 1"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be a whole number of at least 1"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be a whole number of at least 1"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be a whole number of at least 0"),
    (["--stop-after", "0"], "--stop-after must be a whole number of at least 1"),
    (["--stop-after", "-1"], "--stop-after must be a whole number of at least 1"),
    (["--local-devices", "0"], "--local-devices must be a whole number of at least 1"),
    (["--lr", "inf"], "--lr must be a finite number in (0, inf), got inf"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number in [0, inf)"),
    (["--adam-b2", "1"], "--adam-b2 must be a finite number in [0, 1)"),
    (["--model-module", "no_such_module_here"], "--model-module 'no_such_module_here' cannot be imported"),
    (["--model-module", "json"], "--model-module 'json' has no build_model function"),
    (["--num-processes", "0"], "--num-processes must be a whole number of at least 1"),
    (["--num-processes", "2", "--process-id", "2"], "--process-id must be below --num-processes (2)"),
    (["--coordinator", "nohost"], "--coordinator must be HOST:PORT"),
    (["--init-from-flax", "x", "--resume", "--checkpoint-dir", "y"], "--init-from-flax and --resume conflict"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--device-memory", "1.5"], "--device-memory: '1.5' is neither a fraction in (0, 1] nor a whole number"),
    (["--export-dtype", "int8"], "invalid choice"),
    (["--profile-steps", "0"], "--profile-steps must be a whole number of at least 1"),
])
def test_bad_flags_are_one_line_exit_2_before_any_work(tmp_path, capsys, argv, words):
    """Each of these was once a traceback or silently accepted: now one line naming the flag."""
    out = tmp_path / "m.jsonl"
    assert main([*argv, "--steps", "1", "--quiet", "--metrics-out", str(out)] if "--steps" not in argv
                else [*argv, "--quiet", "--metrics-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pstar-train: error:") and "\n" not in err and words in err, err
    assert not out.exists()


@pytest.mark.parametrize("value, budget", [("1000000", 1_000_000), ("1e9", 10**9), ("0.5", 0.5)])
def test_device_memory_bytes_are_not_read_as_fractions(value, budget):
    from pstar_jax.cli.train import parse_config
    assert parse_config(["--device-memory", value]).engine.device_memory == budget


def test_output_paths_are_checked_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "config.json").write_text("mine")
    cases = [(["--metrics-out", str(tmp_path)], "is a directory"),
             (["--export-flax", str(tmp_path / "file")], "--export-flax"),
             (["--export-flax", str(tmp_path / "user")], "holds other files"),
             (["--checkpoint-dir", str(tmp_path / "file" / "ck")], "--checkpoint-dir"),
             (["--profile", str(tmp_path / "file" / "trace")], "--profile")]
    for argv, words in cases:
        assert main([*argv, "--steps", "1", "--quiet"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("pstar-train: error:") and "\n" not in err and words in err, err
    assert (tmp_path / "user" / "config.json").read_text() == "mine"


def test_profile_traces_the_chosen_steps_with_named_stages_and_host_updates(tmp_path, capsys):
    """--profile writes a jax.profiler trace of --profile-steps steps after the two that compile, and
    says which steps and where: the executor's moments and the host optimizer's updates appear by
    name, the updates on the optimizer's own thread (on a GPU: beside the device's work)."""
    import collections
    import gzip
    import json
    assert main(["--steps", "5", "--quiet", "--adam-placement", "host", "--profile", str(tmp_path),
                 "--profile-steps", "2"]) == 0
    (trace,) = tmp_path.glob("plugins/profile/*/*.trace.json.gz")
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("profile:")]
    assert said == [f"profile: steps 2 to 3 (numbered as in --metrics-out) traced into {trace.parent}; open it with "
                    f"TensorBoard's profile plugin (tensorboard --logdir {tmp_path}), or its .trace.json.gz in "
                    "Perfetto"], said
    events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("name", "").startswith("pstar ")]
    threads = collections.defaultdict(set)
    for e in events:
        threads[e["name"].split(" ")[1]].add(e["tid"])
    n_chunks = sum(1 for e in events if e["name"].startswith("pstar adam ")) // 2  # two steps traced
    assert n_chunks >= 1 and {"fwd", "head", "bwd", "host"} <= set(threads)
    # the updates begun after the first traced step all end inside the second, which waits for them
    assert n_chunks <= sum(e["name"].startswith("pstar host AdamW") for e in events) <= 3 * n_chunks
    assert threads["host"].isdisjoint(threads["fwd"])


def test_plain_engine_stops_on_a_nonfinite_loss(capsys):
    """The plain engine no longer trains on with a NaN loss: it stops naming the step, exit 1."""
    assert main(["--engine", "plain", "--steps", "4", "--lr", "1e6", "--clip-norm", "0", "--warmup-steps", "0",
                 "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "not finite at step" in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_start_up_says_what_it_does_one_line_per_phase_and_quiet_silences_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PSTAR_MACHINES_DIR", str(tmp_path / "machines"))  # nothing measured yet
    assert main(["--steps", "1", "--batch-size", "8"]) == 0
    err = capsys.readouterr().err
    phases = ["building the model", "measuring this machine's rates (once, kept in " + str(tmp_path / "machines"),
              "tracing 4 stages", "planning", "compiling the first step"]
    at = [err.find(phase) for phase in phases]
    assert -1 not in at and at == sorted(at), err[-3000:]
    assert all(sum(line.startswith(phase) for line in err.splitlines()) == 1 for phase in phases), err[-3000:]
    assert main(["--steps", "1", "--batch-size", "8", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_third_step_far_from_the_prediction_is_noted_once(capsys):
    """The H200's rates predict this CPU's steps far too fast: after the first step that compiles
    nothing (the third) one note says so and what to do; --quiet keeps it out. (The model is wide
    enough that its steps take far longer than the executor's own time per moment: the tiny
    default's do not, and get no note.)"""
    assert main(["--steps", "4", "--batch-size", "8", "--d-model", "256", "--seq-len", "512", "--machine", "h200"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "the plan predicted" in line]
    assert len(notes) == 1 and notes[0].startswith("step 3 took ") and "x slower): the h200 rates (preset" in notes[0]
    assert main(["--steps", "3", "--batch-size", "8", "--machine", "h200", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


CONSOLE_SCRIPT = ("import sys, os; sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]; "
                  "from pstar_jax.cli.train import main; raise SystemExit(main(sys.argv[1:]))")


@pytest.mark.slow  # two processes, each compiling a model: ~100 s on the loaded 2-core VM
def test_model_module_from_the_current_directory_like_python_m(tmp_path):
    """A console script's sys.path lacks the current directory: ``--model-module pkg.mod`` of the
    README, run from the folder holding pkg/, still finds it (as ``python -m`` would)."""
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "my_model.py").write_text(open(os.path.join(ROOT, "examples", "my_model.py")).read())
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", CONSOLE_SCRIPT, "--model-module", "mymodels.my_model", "--model",
                           "mine", "--steps", "1", "--quiet"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "No module named" not in proc.stderr
    missing = subprocess.run([sys.executable, "-c", CONSOLE_SCRIPT, "--model-module", "mymodels.absent"],
                             capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert missing.returncode == 2 and "cannot be imported" in missing.stderr and "Traceback" not in missing.stderr


def test_rates_that_cannot_be_kept_are_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """A machines directory that cannot be made or written: pstar-train measures, warns in one
    line and trains (the kept rates are a cache, not an input)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PSTAR_MACHINES_DIR", str(blocker / "machines"))
    assert main(["--steps", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line for line in err.splitlines() if "warning" in line] == [
        line for line in err.splitlines() if "cannot keep this machine's rates" in line] != []
