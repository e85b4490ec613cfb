"""Which tensors are frozen: glob patterns over tensor names and names given in code.

A frozen tensor is read by the forward and the backward (gradients flow through it to the
activations) but never trained: it has no gradient, master copy or optimizer state, and the
chunked engine keeps it in chunks of its own (pstar_jax.engine.chunks). Both engines take the same set."""

from __future__ import annotations

import fnmatch
from typing import Callable, Collection, Iterable, Sequence

from pstar_jax.config import ConfigError

Frozen = Collection[str] | Callable[[str], bool] | None  # names, a predicate (True: frozen), or none


def parse_patterns(text: str | None) -> tuple[str, ...]:
    """``EngineConfig.freeze``: comma-separated glob patterns ("blocks.*.attn.*,embed")."""
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


def frozen_names(names: Sequence[str], patterns: Iterable[str] = (), frozen: Frozen = None) -> frozenset[str]:
    """The tensors among ``names`` that a pattern matches or ``frozen`` names (or says True for).

    A pattern that matches no tensor, or a name that is not the model's, is a ConfigError: a typo
    would otherwise silently train everything. Freezing every tensor leaves nothing to train and
    is refused too."""
    out: set[str] = set()
    for pattern in patterns:
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise ConfigError(f"EngineConfig.freeze pattern {pattern!r} matches no tensor of the model "
                              f"(names look like {', '.join(list(names)[:3])})")
        out.update(matched)
    if callable(frozen):
        out.update(n for n in names if frozen(n))
    elif frozen:
        unknown = sorted(set(frozen) - set(names))
        if unknown:
            raise ConfigError(f"frozen tensor {unknown[0]!r} is not a tensor of the model")
        out.update(frozen)
    if out and len(out) == len(set(names)):
        raise ConfigError("every tensor is frozen: nothing is left to train; freeze fewer (EngineConfig.freeze)")
    return frozenset(out)


def trainable(frozen: Collection[str]) -> Callable[[str], bool]:
    """The layout's predicate: a tensor is trainable unless it is in ``frozen``."""
    frozen = frozenset(frozen)
    return lambda name: name not in frozen
