"""Files a user downloads are untrusted: a checkpoint never names code that runs (the model module
its metadata records is imported only when the user names it on the command line)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "pre_layout" / "full"  # a tiny GPT checkpoint (pstar_models)
# A module beside the user's working directory, as any cloned repository may hold one: importing it
# leaves a mark, and it builds the same models as pstar_models.
HELPER = ("import pathlib\npathlib.Path(__file__).with_name('IMPORTED').write_text('ran')\n"
          "from pstar_models import *  # noqa\nfrom pstar_models import build_model, hf_tensors, hf_config  # noqa\n")


def _checkpoint_naming(tmp_path: Path, module: str) -> Path:
    """The fixture's checkpoint with its metadata edited to record another model module."""
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, directory)
    meta_file = directory / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"]["model"]["module"] = module
    meta_file.write_text(json.dumps(meta))
    return directory


def _tokenizer(path: Path) -> str:
    """A word-level tokenizer of the fixture's 64 tokens (one character each)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({chr(33 + i): i for i in range(64)}, unk_token="!"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return str(path)


def _run(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # one device
    code = (f"import sys; sys.path[:] = [p for p in sys.path if p not in ('', {str(cwd)!r})]; "  # a console script's
            f"from {module} import main; raise SystemExit(main(sys.argv[1:]))")                # sys.path
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow  # four processes, each importing JAX (~1 min on 2 cores)
@pytest.mark.parametrize("command, args", [
    ("pstar_jax.cli.generate", ["--max-new-tokens", "2", "--prompt", "A", "--tokenizer", "TOKENIZER", "--eos-token", "!"]),
    ("pstar_jax.cli.export", ["--hf", "OUT", "--export-dtype", "fp32"]),
])
def test_a_checkpoint_naming_another_model_module_runs_its_code_only_when_the_user_names_it(tmp_path, command,
                                                                                            args):
    work = tmp_path / "work"
    work.mkdir()
    (work / "pstar_helpers.py").write_text(HELPER)
    directory = _checkpoint_naming(tmp_path, "pstar_helpers")
    paths = {"OUT": str(tmp_path / "out"), "TOKENIZER": _tokenizer(tmp_path / "tokenizer.json")}
    args = ["--checkpoint-dir", str(directory)] + [paths.get(a, a) for a in args]
    refused = _run(command, args, work)
    assert refused.returncode == 2, refused.stderr
    assert not (work / "IMPORTED").exists()  # its code never ran
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "'pstar_helpers'" in lines[0] and "--model-module pstar_helpers" in lines[0], lines
    assert "Traceback" not in refused.stderr and not (tmp_path / "out").exists()
    trusted = _run(command, args + ["--model-module", "pstar_helpers"], work)  # the user's own decision
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    assert (work / "IMPORTED").read_text() == "ran"


def test_the_saved_configuration_keeps_pstar_models_and_takes_a_named_module(tmp_path):
    from pstar_jax.config import CheckpointError, ModelConfig, RunConfig
    from pstar_jax.io.models import saved_run_config
    config = RunConfig()
    assert saved_run_config(config, None, "D", "pstar-export") is config  # the installed families: no question
    other = RunConfig(model=ModelConfig(module="evil"))
    with pytest.raises(CheckpointError, match=r"model module 'evil', whose code pstar-export runs only when you "
                                              r"name it: pass --model-module evil if you trust it"):
        saved_run_config(other, None, "D", "pstar-export")
    assert saved_run_config(other, "mine", "D", "pstar-export").model.module == "mine"
