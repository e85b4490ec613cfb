"""Files a user downloads are untrusted: a checkpoint never names code that runs (the model module
its metadata records is imported only when the user names it on the command line)."""

import json
import os
import re
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
    ("pstar_jax.cli.generate", ["--max-new-tokens", "2", "--prompt", "A", "--tokenizer", "TOKENIZER", "--eos-token", "!",
                                "--quiet"]),
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


# -- a downloaded directory never leads outside itself -------------------------------------------


def _escaping_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    """A tokenizer directory whose chat_template.jinja links to a private file beside it."""
    from chat_fixtures import tokenizer_dir
    directory = tokenizer_dir(tmp_path / "download", "qwen25")
    secret = tmp_path / "secret.txt"
    secret.write_text("{{ 'my private notes' }}")
    (directory / "chat_template.jinja").symlink_to(secret)
    return directory, secret


def test_a_tokenizer_file_linking_outside_its_directory_is_neither_read_nor_copied(tmp_path):
    from pstar_jax.config import DataError, HFCheckpointError
    from pstar_jax.data.template import ChatTemplate
    from pstar_jax.io.hf import export_hf
    directory, secret = _escaping_tokenizer(tmp_path)
    with pytest.raises(DataError, match=f"the chat template {directory}/chat_template.jinja leads to {secret}, "
                                        f"outside {directory}; put the file itself in {directory}"):
        ChatTemplate.from_tokenizer_dir(directory)
    out = tmp_path / "export"
    with pytest.raises(HFCheckpointError, match="the tokenizer file .*chat_template.jinja leads to .*secret.txt"):
        export_hf(str(out), iter([]), {}, {}, "fp32", tokenizer_from=str(directory))
    assert not out.exists()  # nothing written, so nothing to upload
    (directory / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    (directory / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="the tokenizer .*tokenizer.json leads to"):
        ChatTemplate.from_tokenizer_dir(directory)


def test_links_within_the_directory_and_the_hub_cache_layout_are_followed(tmp_path):
    from chat_fixtures import tokenizer_dir
    from pstar_jax.data.template import ChatTemplate
    from pstar_jax.io.hf import tokenizer_files
    source = tokenizer_dir(tmp_path / "src", "qwen25")
    # huggingface_hub's cache: <cache>/models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "hub" / "models--org--name"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (blobs / f"hash-{name}").write_bytes((source / name).read_bytes())
        (snapshot / name).symlink_to(Path("..", "..", "blobs", f"hash-{name}"))
    (snapshot / "inner").mkdir()
    (snapshot / "inner" / "t.jinja").write_text("{{ messages[0].content }}")
    (snapshot / "chat_template.jinja").symlink_to(Path("inner", "t.jinja"))  # a link inside the directory
    template = ChatTemplate.from_tokenizer_dir(snapshot)
    assert template.render([{"role": "user", "content": "hi"}]) == "hi"
    assert tokenizer_files(str(snapshot)) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]


def test_a_weight_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    from pstar_jax.config import HFCheckpointError
    from pstar_jax.io.hf import weight_files
    (tmp_path / "outside.safetensors").write_bytes(b"")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "../outside.safetensors"}}))
    with pytest.raises(HFCheckpointError, match="names a weight file that .*outside.safetensors leads to"):
        weight_files(str(checkpoint))


# -- a chat template cannot run for ever ---------------------------------------------------------


@pytest.mark.parametrize("source, words", [
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ range(10**12) | list }}", "OverflowError: Range too big"),
    ("{{ 'a' * 10**12 }}", "repeating 1 items 1,000,000,000,000 times makes more than 16,777,216"),
    ("{{ [0] * 10**9 }}", "repeating 1 items"),
    ("{{ 7 ** 1000000 }}", "7 ** 1000000 has more than 65,536 bits"),
    ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
])
def test_a_template_that_fails_or_asks_too_much_refuses_the_example_in_one_line(source, words):
    from tokenizers import Tokenizer, models
    from pstar_jax.data.chat import BadExample
    from pstar_jax.data.template import ChatTemplate
    template = ChatTemplate(source, "T.jinja", Tokenizer(models.WordLevel({"!": 0}, unk_token="!")), {})
    with pytest.raises(BadExample, match=f"is refused by the chat template T.jinja: .*{re.escape(words)}"):
        template.render([{"role": "user", "content": "hi"}])


def test_a_template_that_runs_past_the_limit_is_refused_and_the_timer_is_put_back(monkeypatch):
    import signal
    import time
    from tokenizers import Tokenizer, models
    from pstar_jax.config import DataError
    from pstar_jax.data import template as chat
    monkeypatch.setattr(chat, "RENDER_LIMIT_S", 0.5)  # (10 s in use: real templates take milliseconds)
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    template = chat.ChatTemplate(nested, "T.jinja", Tokenizer(models.WordLevel({"!": 0}, unk_token="!")), {})
    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    with pytest.raises(DataError, match=r"the chat template T.jinja took over 0.5 s to render one conversation"):
        template.render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 5
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_run_that_would_export_a_tokenizer_linking_outside_is_refused_before_training(tmp_path):
    import pstar_jax as ps
    from pstar_models import build_model
    from test_hf import write_family_checkpoint
    source = tmp_path / "download"
    write_family_checkpoint(str(source), build_model("tiny", n_layer=1, d_model=16, n_head=2, vocab_size=64,
                                                     seq_len=16))
    (tmp_path / "secret.txt").write_text("private")
    (source / "chat_template.jinja").symlink_to(tmp_path / "secret.txt")
    config = ps.RunConfig(model=ps.ModelConfig(init_from_hf=str(source)), train=ps.TrainConfig(steps=1, batch_size=2),
                          checkpoint=ps.CheckpointConfig(export_hf=str(tmp_path / "export")))
    with pytest.raises(ps.ConfigError, match="chat_template.jinja leads to .*secret.txt, outside"):
        ps.Run(config)
    assert not (tmp_path / "export").exists()


def test_a_template_that_is_not_utf8_is_one_line(tmp_path):
    from chat_fixtures import tokenizer_dir
    from pstar_jax.config import DataError
    from pstar_jax.data.template import ChatTemplate
    directory = tokenizer_dir(tmp_path, "qwen25")
    latin1 = tmp_path / "t.jinja"
    latin1.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with pytest.raises(DataError, match=r"the chat template .*t.jinja is not UTF-8 text \(bad byte 0xe9"):
        ChatTemplate.from_tokenizer_dir(directory, latin1)


def test_a_file_of_a_directory_at_the_file_system_root_is_inside_it():
    """``contained`` of the root directory: '/x' lies in '/' (its check once compared with '//', so a
    tokenizer named at the root was refused as leading outside '/' instead of "does not exist")."""
    from pstar_jax.config.paths import contained
    assert contained("/", "tokenizer_config.json", "the tokenizer's config") == "/tokenizer_config.json"
