"""What pip installs: metadata, console scripts, and every library the code imports declared
(optional ones only inside the code that needs them, as extras)."""

import ast
import glob
import importlib
import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# import name -> the distribution that provides it, where the two differ
DISTRIBUTION = {"orbax": "orbax-checkpoint", "llvmlite": "numba"}  # (llvmlite comes with numba)
NEVER_AT_RUN_TIME = {"torch", "transformers", "peft"}  # test-only references


def project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def imports(path: str) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level) for each absolute import in ``path``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    top_level = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append((node.module.split(".")[0], id(node) in top_level))
    return out


def test_metadata_names_the_license_authors_and_python():
    meta = project()
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert meta["authors"] == [{"name": "pstar_jax developers"}]
    assert "Programming Language :: Python :: 3.11" in meta["classifiers"]
    assert not any(c.startswith("License ::") for c in meta["classifiers"])  # (PEP 639: the expression says it)


def test_every_console_script_resolves_to_a_main():
    scripts = project()["scripts"]
    assert {"pstar-train", "pstar-plan", "pstar-launch"} <= set(scripts)
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name


def test_every_imported_library_is_declared_and_optional_ones_load_only_where_used():
    """A library the package imports is a dependency; one in an extra (matplotlib, tensorboardX) is
    imported only inside the function that needs it, so a plain install never misses it."""
    meta = project()
    required = names(meta["dependencies"])
    optional = set().union(*(names(r) for k, r in meta["optional-dependencies"].items() if k != "test"))
    assert "matplotlib" in optional and "matplotlib" not in required
    paths = glob.glob(os.path.join(ROOT, "pstar_jax", "*.py")) + glob.glob(os.path.join(ROOT, "models", "*.py"))
    for path in sorted(paths):
        for module, at_top in imports(path):
            if module in sys.stdlib_module_names or module in ("pstar_jax", "pstar_models", "models"):
                continue
            where = f"{os.path.relpath(path, ROOT)} imports {module}"
            dist = DISTRIBUTION.get(module, module).lower().replace("_", "-")
            assert module not in NEVER_AT_RUN_TIME, where
            assert dist in required or (dist in optional and not at_top), where
