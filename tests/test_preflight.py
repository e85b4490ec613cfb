"""What pstar-train refuses before it imports JAX (one line, in well under a second), and the
warning of a model trained past its positions."""

import os
import subprocess
import sys

import numpy as np
import pytest

from pstar_jax.config import ConfigError, ModelConfig, RunConfig
from pstar_jax.run.preflight import check_inputs, positions_warning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each case's one line and exit status, then whether JAX was imported to find them.
CASES = ("import sys; from pstar_jax.cli.train import main\n"
         "for argv in sys.argv[1].split('|'):\n"
         "    print('exit', main(argv.split()), flush=True)\n"
         "print('jax imported', 'jax' in sys.modules)")


def _packed(path, seq_len):
    from pstar_jax.data.packing import pack, write_packed
    pairs = [(np.arange(1, 6, dtype=np.uint32), np.ones(5, np.uint8))] * 4
    write_packed(path, pack(pairs, seq_len=seq_len), {"vocab_size": 256})


def test_inputs_and_outputs_are_refused_before_jax_loads(tmp_path):
    """A missing base or data file, an --export-hf that is a file, a packed SFT file for another
    --seq-len and a --profile of a run too short to trace: each one line naming the flag and what to
    pass, all found without importing JAX (which takes seconds before a run can say anything)."""
    (tmp_path / "file").write_text("x")
    sft = tmp_path / "chat.sft.u16.bin"
    _packed(sft, 32)
    cases = [(f"--init-from-hf {tmp_path}/nonexistent", f"--init-from-hf {tmp_path}/nonexistent does not exist; "
              "pass a Hugging Face checkpoint directory"),
             (f"--init-from-hf {tmp_path}", f"--init-from-hf {tmp_path} holds no config.json"),
             (f"--export-hf {tmp_path}/file", f"--export-hf {tmp_path}/file is a file, not a directory"),
             (f"--data {sft} --seq-len 64", f"--data {sft} was packed for seq_len 32, but the model trains at "
              "seq_len 64; repack it with `pstar-tokens --chat --seq-len 64` or train at --seq-len 32"),
             (f"--data {tmp_path}/none.u16.bin", "does not exist; make it with `pstar-tokens`"),
             (f"--profile {tmp_path}/trace --steps 2", "--profile traces from a run's third step (the first two "
              "compile), but this run has 2 steps; run at least 3 steps"),
             (f"--profile {tmp_path}/trace --steps 9 --stop-after 1", "but this run has 1 step;")]
    proc = subprocess.run([sys.executable, "-c", CASES, "|".join(argv for argv, _ in cases)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    errors = proc.stderr.splitlines()
    assert proc.stdout.splitlines() == ["exit 2"] * len(cases) + ["jax imported False"], proc.stdout + proc.stderr
    assert len(errors) == len(cases), proc.stderr
    for (argv, words), line in zip(cases, errors):
        assert line.startswith("pstar-train: error: ") and words in line, (argv, line)


def test_the_python_api_gets_the_same_refusals(tmp_path):
    with pytest.raises(ConfigError, match="ModelConfig.init_from_hf .* does not exist"):
        check_inputs(RunConfig(model=ModelConfig(init_from_hf=str(tmp_path / "none"))))
    check_inputs(RunConfig())  # the defaults need nothing on disk


class _Model:
    def __init__(self, seq_len, limit):
        self.seq_len, self.config = seq_len, type("C", (), {"max_position_embeddings": limit})()


def test_a_model_past_its_positions_gets_a_warning_naming_the_limit():
    assert positions_warning(_Model(64, 64)) is None and positions_warning(_Model(32, None)) is None
    text = positions_warning(_Model(128, 64))
    assert text.startswith("ModelConfig.seq_len 128 is past the model's max_position_embeddings 64") and \
        "choose ModelConfig.seq_len 64 or less" in text


def test_pstar_train_warns_in_one_line_when_training_past_max_position_embeddings(tmp_path, capsys):
    """A Llama-family checkpoint made for 32 positions trained at --seq-len 64: one warning line
    naming --seq-len and the limit (also under --quiet), and the run goes on."""
    from pstar_models.llama import LlamaConfig, StagedLlama
    from pstar_jax.cli.train import main
    from test_hf import write_family_checkpoint
    src = str(tmp_path / "src")
    write_family_checkpoint(src, StagedLlama(LlamaConfig(vocab_size=300, d_model=48, n_layer=2, n_head=6, n_kv_head=2,
                                                         d_ff=80, seq_len=32, max_position_embeddings=32)))
    assert main(["--init-from-hf", src, "--seq-len", "64", "--steps", "1", "--batch-size", "8", "--quiet"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["pstar-train: warning: --seq-len 64 is past the model's max_position_embeddings 32: its "
                        "rotary positions beyond 32 were never trained (no RoPE scaling is added for them), so the "
                        "model may train and generate worse there; choose --seq-len 32 or less to stay within them"]


def test_a_packed_file_for_the_presets_other_seq_len_is_refused_before_planning(tmp_path, capsys):
    """Without --seq-len the preset's is known once the model is built: refused then, before the
    stages are traced and planned (it was refused when the first batch was drawn)."""
    from pstar_jax.cli.train import main
    sft = tmp_path / "chat.sft.u16.bin"
    _packed(sft, 32)
    assert main(["--data", str(sft), "--steps", "1"]) == 2  # the tiny preset trains at seq_len 64
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == ("pstar-train: error: --data was packed for seq_len 32, but the model trains at seq_len 64; "
                         "repack it with `pstar-tokens --chat --seq-len 64` or train at --seq-len 32"), lines
    assert not any(line.startswith(("tracing", "planning")) for line in lines), lines
