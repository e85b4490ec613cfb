"""pstar-train: a short run writes the metrics it promises; bad input is one line and exit 2."""

import json
import os
import subprocess
import sys

import pytest

from pstar_jax.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC_KEYS = {"step", "loss", "step_s", "tokens_per_s", "model_tflops", "h2d_bytes", "d2h_bytes",
               "device_chunk_peak_bytes"}


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


@pytest.mark.parametrize("argv, words", [
    (["--chunk-size", "100"], "below the largest tensor"),
    (["--device-memory", "60KiB"], "does not fit: device memory runs out at the optimizer update of chunk 0"),
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
    proc = subprocess.run([sys.executable, "-m", "pstar_jax.train", "--model", "nope", "--quiet"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "unknown model preset" in proc.stderr
