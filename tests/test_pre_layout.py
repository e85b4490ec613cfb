"""Files written before the layers became folders (by the code of 35f3801; fixtures/pre_layout/
make.py says how) still load: a full and a LoRA checkpoint resume where they stopped and train the
steps the old code trained after them when it resumed them (resume.py: same losses, same bytes
moved), and pstar-export writes from them the Hugging Face checkpoint and the peft adapter the old
code wrote."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from pstar_jax.cli.export import main as export_main
from pstar_jax.cli.train import main as train_main

FIXTURES = Path(__file__).parent / "fixtures" / "pre_layout"
COMMON = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--vocab-size", "64", "--seq-len", "32",
          "--batch-size", "4", "--precision", "fp32", "--steps", "4", "--chunk-size", "2048",
          "--device-memory", "400KiB", "--quiet", "--seed", "3", "--data-parallel", "1",
          "--machine", "h200"]  # preset rates: the plan (and so the bytes moved) does not hang on a measurement
RUNS = {"full": [], "lora": ["--lora-rank", "4", "--model", "llama-tiny", "--device-memory", "1MiB", "--vocab-size", "64"]}
# fp32 losses of two steps on a CPU: a few units of rounding at the loss's scale, whatever the x86 CPU
RTOL = 32 * np.finfo(np.float32).eps


def _tokens(path: Path) -> str:
    """The token file the fixtures were trained on (make.py writes the same)."""
    ((np.arange(16384, dtype=np.int64) * 7919 + 13) % 61).astype(np.uint16).tofile(path)
    return str(path)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_checkpoint_of_before_the_layers_resumes_and_trains_as_it_did(tmp_path, name):
    directory = tmp_path / name
    shutil.copytree(FIXTURES / name, directory)
    metrics = tmp_path / "resumed.jsonl"
    argv = COMMON + RUNS[name] + ["--data", _tokens(tmp_path / "tokens.u16.bin"), "--checkpoint-dir",
                                  str(directory), "--keep-checkpoints", "1", "--resume", "--metrics-out", str(metrics),
                                  "--allow-config-change"]  # the fixture's data was written elsewhere
    assert train_main(argv) == 0
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    # the old code resuming these checkpoints (fixtures/pre_layout/resume.py) on each JAX the project
    # supports: a trace, and so a plan, is the compiler's, which differs between versions
    want = json.loads((FIXTURES / "resumed.json").read_text())[f"jax {'.'.join(jax.__version__.split('.')[:2])}"][name]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, 3]
    for g, w in zip(got, want):
        assert (g["h2d_bytes"], g["d2h_bytes"], g["trained_tokens"]) == (w["h2d_bytes"], w["d2h_bytes"],
                                                                          w["trained_tokens"])
        np.testing.assert_allclose([g["loss"], g["grad_norm"]], [w["loss"], w["grad_norm"]], rtol=RTOL)


@pytest.mark.parametrize("name, flags, written", [
    ("full", ["--hf", "OUT", "--export-dtype", "fp32"], "full_hf"),
    ("lora", ["--lora", "OUT"], "lora_adapter"),
])
def test_an_export_of_a_checkpoint_of_before_the_layers_is_the_one_written_then(tmp_path, name, flags, written):
    out = tmp_path / "out"
    assert export_main(["--checkpoint-dir", str(FIXTURES / name)] + [str(out) if f == "OUT" else f for f in flags]) == 0
    old = FIXTURES / written
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in old.iterdir())
    for path in old.iterdir():
        if path.suffix == ".safetensors":
            new_tensors, old_tensors = load_file(out / path.name), load_file(path)
            assert new_tensors.keys() == old_tensors.keys()
            for key, value in old_tensors.items():
                assert new_tensors[key].dtype == value.dtype and np.array_equal(new_tensors[key], value), key
        else:
            assert json.loads((out / path.name).read_text()) == json.loads(path.read_text()), path.name
