"""The package's layers (pyproject.toml's import-linter contracts): imports run only downward, no
module is in an import circle (imports inside functions counted), the tree holds its layers, and
no module grows past what one concept needs. The old module paths still import."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450
TOP_LEVEL = {"__init__.py", "compat.py", "_moved.py"}  # every other module lives in its layer's folder


def test_the_import_linter_contracts_hold():
    proc = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(no_cache=True))"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") >= 3, proc.stdout[-2000:]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_no_module_is_in_an_import_circle():
    sys.path.insert(0, str(ROOT))  # the checkout's packages, as the tests import them
    try:
        graph = grimp.build_graph("pstar_jax", "pstar_models", exclude_type_checking_imports=True, cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))
    assert "pstar_jax.engine.executor" in graph.modules and "pstar_models.llama" in graph.modules
    assert _cycles(graph) == []


def test_the_tree_shows_the_layers_and_no_module_is_two_concepts():
    top = {p.name for p in (ROOT / "pstar_jax").glob("*.py")}
    assert top == TOP_LEVEL, f"modules directly in pstar_jax/ beside {sorted(TOP_LEVEL)}: {sorted(top - TOP_LEVEL)}"
    layers = {p.name for p in (ROOT / "pstar_jax").iterdir() if (p / "__init__.py").exists()}
    assert layers == {"config", "data", "model", "plan", "engine", "planner", "io", "run", "cli"}
    long = {str(p.relative_to(ROOT)): n for p in [*(ROOT / "pstar_jax").rglob("*.py"), *(ROOT / "models").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines (split them where a concept boundary is): {long}"


@pytest.mark.parametrize("old, new, name", [
    ("pstar_jax.attention", "pstar_jax.model.attention", "causal_attention"),
    ("pstar_jax.tiling", "pstar_jax.model.tiling", "map_tiles"),
    ("pstar_jax.batch", "pstar_jax.data.batch", "from_rows"),
    ("pstar_jax.loop", "pstar_jax.io.models", "load_model"),  # a split module: a view of its new ones
    ("pstar_jax.checkpoint", "pstar_jax.run.signals", "StopSignal"),
])
def test_a_module_path_of_before_the_layers_still_imports_with_a_warning(old, new, name):
    import importlib
    with pytest.warns(DeprecationWarning, match=f"{old} is now"):
        module = importlib.import_module(old) if old not in sys.modules else importlib.reload(sys.modules[old])
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_the_old_names_of_a_package_that_took_a_module_s_name():
    from pstar_jax import planner
    from pstar_jax.planner.report import plan_report
    with pytest.warns(DeprecationWarning, match="pstar_jax.planner.plan_report is now pstar_jax.planner.report"):
        assert planner.plan_report is plan_report
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a submodule is the submodule, with no warning
        from pstar_jax.data import stream
    assert stream.__name__ == "pstar_jax.data.stream"
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        planner.nothing  # noqa: B018


@pytest.mark.parametrize("module", ["pstar_jax.train", "pstar_jax.tokens", "pstar_jax.cli.train"])
def test_python_dash_m_runs_the_command_under_its_old_and_new_names(module):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: pstar-")


def test_an_old_module_name_runs_as_its_new_module_s_file():
    """``python -m OLD`` puts the spec's origin in sys.argv[0]: the new module's file, never None
    (jax's compilation cache key reads every argument; pstar_jax.machine_cli --remeasure failed)."""
    import importlib.util
    from pstar_jax._moved import MAIN, MOVED
    for old, targets in MOVED.items():
        origin = importlib.util.find_spec(old).origin
        assert origin == importlib.util.find_spec(MAIN.get(old, targets[0])).origin and origin.endswith(".py"), old


def test_every_layer_is_a_package_that_pip_installs():
    import tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pstar_jax").rglob("__init__.py")}
    assert listed == folders | {"pstar_models"}, "pyproject.toml's [tool.setuptools] packages must list every folder"
