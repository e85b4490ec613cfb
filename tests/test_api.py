"""The public API: what README's Python section shows runs as written; a user's own module trains."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import pstar_jax as ps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Python API"):text.index("## Commands")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.slow
def test_readme_examples_run_as_written(tmp_path, monkeypatch, capsys):
    """Both README snippets, exactly: the Run example trains, reads params and exports; the
    build_engine one steps an engine inside a loop of the user's own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(ROOT)
    blocks = readme_python_blocks()
    assert len(blocks) == 2
    scope: dict = {}
    exec(compile(blocks[0], "README-run", "exec"), scope)
    out = capsys.readouterr().out
    assert "chunked engine" in out and "tensors, final loss" in out
    assert scope["record"]["step"] == 19 and np.isfinite(scope["record"]["loss"])
    assert set(scope["params"]) == set(scope["run"].model.param_shapes())
    # the export goes under runs/ (which .gitignore leaves out), not loose into the current directory
    assert os.path.exists(tmp_path / "runs" / "tiny_export" / "params")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    exec(compile(blocks[1], "README-loop", "exec"), {})
    assert capsys.readouterr().out.count("loss ") == 3


def test_public_surface_is_curated():
    """Everything in __all__ exists, and nothing else but submodules is exported."""
    import types
    exported = {n for n in dir(ps) if not n.startswith("_") and not isinstance(getattr(ps, n), types.ModuleType)}
    assert exported == set(ps.__all__)


@pytest.mark.slow
def test_run_refuses_a_model_that_does_not_fit_before_allocating():
    config = ps.RunConfig(train=ps.TrainConfig(steps=2, batch_size=4), distributed=ps.DistributedConfig(data_parallel=1),
                          engine=ps.EngineConfig(device_memory=60 * 1024), output=ps.OutputConfig(quiet=True))
    with pytest.raises(ps.ConfigError, match="does not fit"):
        ps.Run(config)


def test_writers_receive_every_step_and_both_engines_share_the_protocol():
    class Collect:
        def __init__(self):
            self.rows, self.closed = [], False

        def write_scalars(self, step, scalars):
            self.rows.append((step, scalars["loss"]))

        def close(self):
            self.closed = True
    for kind in ("chunked", "plain"):
        writer = Collect()
        config = ps.RunConfig(train=ps.TrainConfig(steps=3, batch_size=8), engine=ps.EngineConfig(kind=kind),
                              output=ps.OutputConfig(quiet=True))
        with ps.Run(config, writers=[writer]) as run:
            records = list(run.fit())
            assert run.engine.kind == kind and run.engine.step_count == 3
            assert isinstance(run.engine.summary(), str)
        assert [s for s, _ in writer.rows] == [0, 1, 2] == [r["step"] for r in records]


@pytest.mark.slow
def test_a_users_own_module_trains_through_the_cli(tmp_path):
    """examples/my_model.py: a module of its own, trained by pstar-train through --model-module.
    On this machine's one CPU device, as a user runs it (the other CLI tests drop the 8 fake
    devices too: with them, XLA's in-process all_gather deadlocked in about half of the runs on 2
    loaded cores, before the 2026-12-02 changes as after)."""
    metrics = tmp_path / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "pstar_jax.cli.train", "--model-module", "examples.my_model",
                           "--model", "mine", "--steps", "12", "--lr", "3e-3", "--quiet", "--metrics-out",
                           str(metrics)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    import json
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 12 and losses[-1] < losses[0]


def test_nnx_staged_module_names_order_and_init():
    """The adapter reads names and forward order from the module; each tensor initialises alone."""
    from examples.my_model import build_model
    model = build_model("mine", n_layer=2, d_model=32, n_head=2, vocab_size=64, seq_len=16)
    names = list(model.param_shapes())
    assert names[0] == "tok.embedding" and names[-1] in ("out.bias", "out.kernel")
    assert [s.name for s in model.stages(np.float32)] == ["embed", "block_0", "block_1", "head"]
    a = np.asarray(model.init_tensor("blocks.1.up.kernel", 0))
    assert a.shape == (32, 128) and a.std() > 0
    np.testing.assert_array_equal(a, model.init_tensor("blocks.1.up.kernel", 0))
    assert not np.array_equal(a, model.init_tensor("blocks.0.up.kernel", 0))
    with pytest.raises(ValueError, match="unknown model preset"):
        build_model("other")


def test_a_users_own_models_module_neither_hides_nor_replaces_ours(tmp_path):
    """A directory with a models.py of the user's own (every Django project): the default model module
    is pstar_models, so the user's file is not imported and the default preset still builds."""
    (tmp_path / "models.py").write_text("raise RuntimeError('the user models.py was imported')\n")
    code = ("import pstar_jax as ps\n"
            "from pstar_jax.io.models import load_model\n"
            "model = load_model(ps.RunConfig(model=ps.ModelConfig(name='tiny')))\n"
            "print(type(model).__name__)\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "StagedGPT"
    assert ps.ModelConfig().module == "pstar_models"


def test_import_loads_no_heavy_library():
    """``import pstar_jax`` brings in the configuration only: jax, flax, orbax, numba, tokenizers,
    safetensors and matplotlib load when a name that needs them is first used (a fresh interpreter,
    since this one has imported them all)."""
    heavy = ("jax", "flax", "optax", "orbax", "numba", "tokenizers", "safetensors", "matplotlib")
    code = ("import sys, pstar_jax as ps\n"
            "config = ps.RunConfig(train=ps.TrainConfig(steps=2))\n"
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
            "ps.Run, ps.DataError\n"  # the lazy names resolve
            "print('jax' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "True"]
