"""Command-line flags derived from the configuration dataclasses, and one-line errors.

Every field of a config section becomes one flag (``--field-name`` unless the field names
another) with the field's help, choices and parser, so defaults and help texts are written
once, in pstar_jax.config. Only flags given on the command line are passed on; the
dataclasses' own defaults fill the rest. Library errors name fields (``OptimConfig.lr``);
``error_line`` turns them into flags (``--lr``) for the user.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import re
import signal
import sys
from typing import Any, Callable, Iterator, Sequence

from pstar_jax.run import exits
from pstar_jax.config import SECTIONS, ConfigError, format_bytes, parse_device_memory, parse_optional_bytes

_TITLES = {"model": "model", "train": "training", "optim": "optimizer", "engine": "engine", "data": "data",
           "checkpoint": "checkpoints", "distributed": "data parallelism (ZeRO) and multi-host",
           "output": "output", "lora": "LoRA adapters (only they train; the base is frozen)",
           "preference": "preference tuning (DPO, IPO, SimPO as TRL defines them)"}


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        raise ConfigError(message)


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(with_flags(str(err))) from None
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid value") from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _number(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if kind is int and abs(value) > 2**63:
            raise ValueError(text)
        return value
    parse.__name__ = kind.__name__
    return parse


def add_section(parser: argparse.ArgumentParser, section: str, skip: Sequence[str] = (),
                defaults: dict[str, Any] | None = None, helps: dict[str, str] | None = None) -> None:
    """One argument group with a flag per field of a config section (``skip``: fields to leave out;
    ``defaults``: other defaults for this command, shown in the help and passed on; ``helps``: help
    texts for this command, where its defaults mean something else than the field's)."""
    group = parser.add_argument_group(_TITLES[section])
    for field in dataclasses.fields(SECTIONS[section]):
        if not field.metadata.get("cli", True) or field.name in skip:
            continue
        flag, meta = flag_of(field), field.metadata
        default = (defaults or {}).get(field.name, field.default)
        kwargs: dict[str, Any] = dict(dest=f"{section}.{field.name}", help=(helps or {}).get(field.name, meta["help"]),
                                      default=argparse.SUPPRESS)
        if defaults and field.name in defaults:
            kwargs["default"] = default
        shown = "auto" if default is None and meta.get("parse") else default
        if meta.get("parse") in (parse_device_memory, parse_optional_bytes) and isinstance(default, int):
            shown = format_bytes(default).replace(".00 ", "").replace(" ", "")
        if field.type in ("bool", "bool | None"):
            kwargs["action"] = "store_true" if field.default is False else argparse.BooleanOptionalAction
        else:
            parse = meta.get("parse") or _number({"int": int, "int | None": int, "float": float,
                                                  "float | None": float}.get(field.type, str))
            kwargs.update(type=_typed(parse), choices=meta.get("choices"),
                          metavar=None if meta.get("choices") else meta.get("metavar") or field.name.upper())
            if shown is not None and "default:" not in kwargs["help"]:  # (a help that says its default)
                kwargs["help"] += f" (default: {shown})"
        group.add_argument(flag, **kwargs)


def section_values(args: argparse.Namespace, section: str) -> dict[str, Any]:
    """The fields of one section given on the command line (or with a command default)."""
    prefix = section + "."
    return {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}


def build(cls: type, args: argparse.Namespace, section: str, **extra: Any) -> Any:
    return cls(**{**section_values(args, section), **extra})


def _flags() -> dict[str, str]:
    return {f"{cls.__name__}.{f.name}": flag_of(f) for cls in SECTIONS.values() for f in dataclasses.fields(cls)
            if f.metadata.get("cli", True)}


def with_flags(text: str) -> str:
    """Every ``Section.field`` in ``text`` replaced by its flag."""
    flags = _flags()
    return re.sub(r"\b[A-Z][A-Za-z]+Config\.[a-z_][a-z0-9_]*\b", lambda m: flags.get(m.group(0), m.group(0)), text)


def error_line(prog: str, err: BaseException) -> str:
    """'prog: error: ...' with every ``Section.field`` replaced by its flag."""
    return f"{prog}: error: {' '.join(with_flags(str(err)).split())}"


class _NoteFormatter(logging.Formatter):
    """A note as it is; a warning as 'prog: warning: ...' with its fields named by their flags."""

    def __init__(self, prog: str):
        super().__init__("%(message)s")
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{self.prog}: warning: {with_flags(text)}" if record.levelno >= logging.WARNING else text


@contextlib.contextmanager
def start_up_notes(enabled: bool = True, prog: str = "pstar_jax") -> Iterator[None]:
    """Inside, pstar_jax's notes on what it is doing (the INFO lines of its loggers: measuring the
    machine, tracing, planning, compiling) go to stderr, one line each, so that the seconds
    before the first step are not silent; ``enabled`` False keeps only its warnings (one line
    each, 'prog: warning: ...')."""
    logger, handler = logging.getLogger("pstar_jax"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(_NoteFormatter(prog))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if enabled else logging.WARNING)
    logger.propagate = False  # once: a library may have given the root logger a handler too
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def run_main(prog: str, run: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None,
             user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a CLI: user errors are one line and exit 2, never a traceback. SIGINT and SIGTERM end
    the process at once with one line (exit 130, 143; see pstar_jax.run.exits), except where the
    training loop's own handler stops after a step; a KeyboardInterrupt that still comes out
    (a second Ctrl-C in the loop) ends it the same way, without the interpreter's teardown."""
    with exits.signals_end_the_process(prog):
        try:
            return run(argv)
        except (ConfigError, *user_errors) as err:
            print(error_line(prog, err), file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            exits.hard_exit(exits.EXIT_INTERRUPTED, exits.signal_line(prog, signal.SIGINT))
            return exits.EXIT_INTERRUPTED
