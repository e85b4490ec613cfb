"""The module paths pstar_jax had before its layers became folders, kept importing: ``import
pstar_jax.attention`` is ``pstar_jax.model.attention`` (the same module object, with a
DeprecationWarning naming the new path), and ``python -m pstar_jax.train`` runs pstar-train.

A module that was split (``pstar_jax.loop``: the loop and the model a config names) is a read-only
view whose names come from its new modules in turn. Old modules whose names are packages now
offer their old names from the package: ``pstar_jax.config`` and ``pstar_jax.model`` themselves,
``pstar_jax.data``, ``plan``, ``engine``, ``planner`` and ``cli`` through ``package_attr``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any, Sequence

# old module -> the modules its names live in now (the first is the main one)
MOVED = {
    "pstar_jax.config_types": ("pstar_jax.config.fields",),
    "pstar_jax.lora": ("pstar_jax.config.lora", "pstar_jax.model.lora"),
    "pstar_jax.paths": ("pstar_jax.config.paths",),
    "pstar_jax.batch": ("pstar_jax.data.batch",),
    "pstar_jax.rows": ("pstar_jax.data.rows",),
    "pstar_jax.packing": ("pstar_jax.data.packing",),
    "pstar_jax.chat": ("pstar_jax.data.chat", "pstar_jax.data.template"),
    "pstar_jax.tokens": ("pstar_jax.data.tokenizer", "pstar_jax.cli.tokens"),
    "pstar_jax.sft_file": ("pstar_jax.data.sft",),
    "pstar_jax.attention": ("pstar_jax.model.attention",),
    "pstar_jax.loss": ("pstar_jax.model.loss",),
    "pstar_jax.tiling": ("pstar_jax.model.tiling",),
    "pstar_jax.flops": ("pstar_jax.model.flops",),
    "pstar_jax.freeze": ("pstar_jax.model.freeze",),
    "pstar_jax.schedule": ("pstar_jax.plan.schedule",),
    "pstar_jax.eviction": ("pstar_jax.plan.eviction",),
    "pstar_jax.replay": ("pstar_jax.plan.replay",),
    "pstar_jax.predict": ("pstar_jax.plan.predict",),
    "pstar_jax.machine": ("pstar_jax.plan.machine", "pstar_jax.planner.measure"),
    "pstar_jax.chunks": ("pstar_jax.engine.chunks",),
    "pstar_jax.memory": ("pstar_jax.engine.memory",),
    "pstar_jax.stages": ("pstar_jax.engine.stages",),
    "pstar_jax.optim": ("pstar_jax.engine.optim",),
    "pstar_jax.host_adam": ("pstar_jax.engine.host_adam",),
    "pstar_jax.host_kernels": ("pstar_jax.engine.host_kernels",),
    "pstar_jax.zero": ("pstar_jax.engine.zero",),
    "pstar_jax.executor": ("pstar_jax.engine.executor", "pstar_jax.engine.chunk_state"),
    "pstar_jax.plain": ("pstar_jax.engine.plain",),
    "pstar_jax.decode": ("pstar_jax.engine.decode",),
    "pstar_jax.trace": ("pstar_jax.planner.trace",),
    "pstar_jax.planning": ("pstar_jax.planner.build",),
    "pstar_jax.plan_plot": ("pstar_jax.planner.plot",),
    "pstar_jax.checkpoint": ("pstar_jax.io.checkpoint", "pstar_jax.io.run_lock", "pstar_jax.run.signals"),
    "pstar_jax.orbax_quiet": ("pstar_jax.io.orbax_quiet",),
    "pstar_jax.flax_io": ("pstar_jax.io.flax_io",),
    "pstar_jax.hf": ("pstar_jax.io.hf",),
    "pstar_jax.peft_config": ("pstar_jax.io.peft_config",),
    "pstar_jax.peft_io": ("pstar_jax.io.peft_io",),
    "pstar_jax.lora_io": ("pstar_jax.io.lora_io",),
    "pstar_jax.base_record": ("pstar_jax.io.base_record",),
    "pstar_jax.loop": ("pstar_jax.run.loop", "pstar_jax.io.models"),
    "pstar_jax.metrics": ("pstar_jax.run.metrics",),
    "pstar_jax.distributed": ("pstar_jax.run.distributed",),
    "pstar_jax.exits": ("pstar_jax.run.exits",),
    "pstar_jax.train": ("pstar_jax.cli.train",),
    "pstar_jax.plan_cli": ("pstar_jax.cli.plan",),
    "pstar_jax.export_cli": ("pstar_jax.cli.export",),
    "pstar_jax.generate": ("pstar_jax.cli.generate",),
    "pstar_jax.machine_cli": ("pstar_jax.cli.machine",),
    "pstar_jax.launch": ("pstar_jax.cli.launch",),
}
# old module, a package now -> the modules its names live in now
PACKAGES = {
    "pstar_jax.data": ("pstar_jax.data.token_files", "pstar_jax.data.corpus", "pstar_jax.data.stream",
                       "pstar_jax.data.training", "pstar_jax.config.errors"),
    "pstar_jax.plan": ("pstar_jax.plan.placement",),
    "pstar_jax.engine": ("pstar_jax.engine.protocol",),
    "pstar_jax.planner": ("pstar_jax.planner.report", "pstar_jax.planner.search"),
    "pstar_jax.cli": ("pstar_jax.cli.flags",),
}
# old module -> the module ``python -m OLD`` runs now (a command's, for a split one)
MAIN = {"pstar_jax.tokens": "pstar_jax.cli.tokens"}


def lazy_attributes(package: str, table: dict[str, str]) -> tuple[Any, Any]:
    """A package's ``__getattr__`` and ``__dir__`` for names its modules define (``table``: name ->
    module, relative to the package), each imported on first use and kept in the package after it:
    so ``import pstar_jax`` loads the configuration alone, not JAX."""
    namespace = sys.modules[package].__dict__

    def getattr_(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later uses skip this function
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(table))
    return getattr_, dir_


def package_attr(package: str, attr: str) -> Any:
    """An old module's name asked of the package that took its name (its ``__getattr__``). A
    submodule's name is never answered here: the import system then imports the submodule."""
    if not attr.startswith("__") and importlib.util.find_spec(f"{package}.{attr}") is None:
        found = _first_with(PACKAGES[package], attr)
        if found is not None:
            warnings.warn(f"{package}.{attr} is now {found[0]}.{attr}; import it from there", DeprecationWarning,
                          stacklevel=3)
            return found[1]
    raise AttributeError(f"module {package!r} has no attribute {attr!r}")


def _first_with(targets: Sequence[str], attr: str) -> tuple[str, Any] | None:
    """(module, value) of the first of ``targets`` that defines ``attr``, or None."""
    for target in targets:
        module = importlib.import_module(target)
        if hasattr(module, attr):
            return target, getattr(module, attr)
    return None


class _View(types.ModuleType):
    """A split module's old name: each attribute from the first new module that has it."""

    def __init__(self, name: str, targets: Sequence[str]):
        super().__init__(name)
        self.__targets = tuple(targets)

    def __getattr__(self, attr: str) -> Any:
        found = None if attr.startswith("__") else _first_with(self.__targets, attr)
        if found is not None:
            return found[1]
        raise AttributeError(f"module {self.__name__!r} (now {', '.join(self.__targets)}) has no attribute {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for t in self.__targets for n in dir(importlib.import_module(t))})


class _Loader(importlib.abc.Loader):
    def __init__(self, old: str):
        self.old, self.targets = old, MOVED[old]

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(f"{self.old} is now {' and '.join(self.targets)}; import it from there", DeprecationWarning,
                      stacklevel=2)
        if len(self.targets) == 1:
            return importlib.import_module(self.targets[0])  # one module object under both names
        return _View(self.old, self.targets)

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # the module is its new one, already executed

    def get_code(self, fullname: str) -> types.CodeType | None:
        """What ``python -m OLD`` runs (runpy asks the loader): the new module's own code, so its
        ``if __name__ == "__main__"`` block runs the command."""
        target = MAIN.get(self.old, self.targets[0])
        spec = importlib.util.find_spec(target)
        return spec.loader.get_code(target)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        # the new module's file as origin: ``python -m OLD`` puts it in sys.argv[0] (None there
        # broke jax's compilation cache, whose key reads every argument)
        origin = importlib.util.find_spec(MAIN.get(fullname, MOVED[fullname][0])).origin
        return importlib.machinery.ModuleSpec(fullname, _Loader(fullname), origin=origin)


def install() -> None:
    """Answer the old names, after every real module (appended: a real module always wins)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
