"""How a config field is declared (``option``: its default, help, parser and flag) and checked: the
type check every config section runs at construction (``section``), derived from its field
annotations, and the range checks the sections' ``__post_init__`` use.

Python does not enforce dataclass annotations, so without this ``CheckpointConfig(resume="false")``
would resume (a non-empty string is true), ``RunConfig(train={...})`` would end in an
AttributeError far from the call, and ``DataConfig(path=3)`` in a bare TypeError at open time.
Each field's value is checked against its annotation (``int``, ``float``, ``bool``, ``str``, a
section class, or a union of those with ``None``) and refused with one ConfigError naming the
field. Values are also normalised so a config stays JSON-able for checkpoints: an ``os.PathLike``
in a path field (a field whose metavar is FILE or DIR) becomes its ``str``, a numpy integer an
``int``, an int in a field that takes only floats a ``float``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import types
import math
import typing
from typing import Any, Callable

from pstar_jax.config.errors import ConfigError

_NAMES = {bool: "True or False", int: "a whole number (int)", float: "a number", str: "a str"}


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """field name -> the types its annotation allows (NoneType included for ``X | None``)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is \
            typing.Union else (hint,)
        for t in allowed:
            if not (t in _NAMES or t is type(None) or dataclasses.is_dataclass(t)):
                raise TypeError(f"{cls.__name__}.{f.name}: annotation {hint!r} has no type check")
        out[f.name] = allowed
    return out


def _is_path(f: dataclasses.Field) -> bool:
    return str(f.metadata.get("metavar") or "").endswith(("FILE", "DIR"))


def _convert(value: Any, allowed: tuple[type, ...], path: bool) -> tuple[bool, Any]:
    """(whether ``value`` is one of ``allowed``, the value to keep)."""
    if value is None:
        return type(None) in allowed, None
    if bool in allowed and isinstance(value, bool):
        return True, value
    if isinstance(value, bool):  # a bool is an int to Python, never a count or a rate here
        return False, value
    if int in allowed and isinstance(value, numbers.Integral):
        return True, int(value)
    if float in allowed and isinstance(value, numbers.Real):
        return True, float(value)
    if str in allowed and isinstance(value, str):
        return True, value
    if str in allowed and path and isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        return True, os.fspath(value)
    return any(dataclasses.is_dataclass(t) and isinstance(value, t) for t in allowed), value


def _article(name: str) -> str:
    return ("an " if name[0] in "AEIOUaeiou" else "a ") + name


def _describe(allowed: tuple[type, ...], path: bool) -> str:
    if int in allowed and float in allowed:  # (a number; its value check says which ints and floats)
        allowed = tuple(t for t in allowed if t is not int)
    names = [("a path (str or os.PathLike)" if path and t is str else _NAMES.get(t) or _article(t.__name__))
             for t in allowed if t is not type(None)]
    if type(None) in allowed:
        names.append("None")
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def check_types(obj: Any) -> None:
    """Refuse (ConfigError naming the field) a value its annotation does not allow; normalise the rest."""
    cls = type(obj)
    allowed_by_field = _field_types(cls)
    for f in dataclasses.fields(cls):
        value, allowed, path = getattr(obj, f.name), allowed_by_field[f.name], _is_path(f)
        ok, kept = _convert(value, allowed, path)
        if not ok:
            got = repr(value)
            section = next((t for t in allowed if dataclasses.is_dataclass(t)), None)
            if section is not None:  # a dict or another section: name its type, not its whole repr
                got = _article(type(value).__name__)
                if isinstance(value, dict):
                    got += f"; write {section.__name__}(**...) instead"
            raise ConfigError(f"{cls.__name__}.{f.name} must be {_describe(allowed, path)}, got {got}")
        if kept is not value:
            object.__setattr__(obj, f.name, kept)  # (the sections are frozen)


def section(cls: type) -> type:
    """A frozen dataclass whose fields are type-checked (``check_types``) before its own
    ``__post_init__`` validates their values."""
    own = cls.__dict__.get("__post_init__")

    def __post_init__(self) -> None:
        check_types(self)
        if own is not None:
            own(self)
    cls.__post_init__ = __post_init__
    return dataclasses.dataclass(frozen=True)(cls)


MAX_STEPS = 2**31 - 1  # step counters live in int32 arrays (optax schedules, checkpoints)
MAX_SEED = 2**32 - 1  # jax.random.key takes a uint32 seed


def option(default: Any, help: str, *, flag: str | None = None, parse: Callable[[str], Any] | None = None,
           choices: tuple[str, ...] | None = None, metavar: str | None = None, math_changing: bool = False,
           cli: bool = True) -> Any:
    """A config field with what its flag needs: help text, parser, choices. ``math_changing``:
    resuming with another value changes the training math (refused unless overridden)."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, flag=flag, parse=parse, choices=choices, metavar=metavar, math_changing=math_changing, cli=cli))


def positive_int(obj: Any, *names: str, allow_none: bool = False, upper: int | None = None) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper and value > upper):
            bound = f" and at most {upper}" if upper else ""
            raise ConfigError(f"{type(obj).__name__}.{name} must be a whole number of at least 1{bound}, got {value!r}")


def finite(obj: Any, name: str, low: float, high: float = math.inf, low_open: bool = True,
            high_open: bool = True) -> None:
    value = getattr(obj, name)
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > low if low_open else value >= low) \
        and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise ConfigError(f"{type(obj).__name__}.{name} must be a finite number in {lo}{low:g}, {high:g}{hi}, "
                          f"got {value!r}")
