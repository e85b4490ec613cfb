"""Frozen, validated configuration and the parsing of sizes a user types.

Every user mistake that can be seen before allocating anything is raised here as a
``ConfigError``: one sentence that names the problem and what to change. The CLIs print it
as one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import re

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1000**4, "tib": 1024**4}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """A user error: one sentence naming what is wrong and what to change."""


def parse_bytes(text: str | int, what: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes. KiB/MiB/GiB (and K/M/G) are binary."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: {text!r} is not a size; write bytes like 2GiB, 512MiB or 1000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_memory(text: str | int, total_bytes: int, what: str) -> int:
    """A size, or a fraction of ``total_bytes`` written as a number in (0, 1]."""
    if isinstance(text, str) and re.fullmatch(r"\s*(0?\.[0-9]+|1(\.0*)?)\s*", text):
        fraction = float(text)
        if fraction <= 0:
            raise ConfigError(f"{what}: a fraction must be above 0, got {text!r}")
        return int(fraction * total_bytes)
    size = parse_bytes(text, what)
    if size <= 0:
        raise ConfigError(f"{what}: the size must be positive, got {text!r}")
    return size


def parse_count(text: str | int, what: str) -> int:
    """An element count like '64M' (binary multipliers: K=1024, M=1024**2)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else "?"
    if not match or unit not in ("", "k", "m", "g"):
        raise ConfigError(f"{what}: {text!r} is not a count; write elements like 4194304, 4M or 'auto'")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Bytes for people: '1023 B', '1.50 KiB', '2.00 GiB' (rounding never shows '1024')."""
    if abs(n) < 1023.5:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1023.995 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup + cosine decay to ``lr * final_lr_fraction`` and global-norm clipping."""
    lr: float = 3e-4
    warmup_steps: int = 10
    total_steps: int = 100
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ConfigError("--steps must be at least 1 and warmup steps non-negative")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"--clip-norm must be positive (or 0 to disable), got {self.clip_norm}")


PRECISIONS = ("bf16", "fp32")
ADAM_PLACEMENTS = ("auto", "device", "host", "stream")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the chunked engine runs: sizes are per device, in bytes or elements as named.

    ``device_budget_bytes`` None means half the model's chunk bytes plus the working memory:
    the CPU demo default, where 'device' memory is host RAM and the point is to see chunks move."""
    chunk_numel: int
    device_budget_bytes: int | None
    precision: str = "bf16"
    micro_batches: int = 1
    adam_placement: str = "auto"  # where fp32 master and optimizer state live and update: auto, device,
    #                               host, or stream (live on the host, update on the device)

    def __post_init__(self) -> None:
        if self.adam_placement not in ADAM_PLACEMENTS:
            raise ConfigError(f"--adam-placement must be one of {', '.join(ADAM_PLACEMENTS)}, "
                              f"got {self.adam_placement!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.chunk_numel < 1:
            raise ConfigError(f"--chunk-size must be positive, got {self.chunk_numel}")
        if self.micro_batches < 1:
            raise ConfigError(f"--micro-batches must be at least 1, got {self.micro_batches}")
        if self.device_budget_bytes is not None and self.device_budget_bytes < 1:
            raise ConfigError("--device-memory must be positive")

    @property
    def compute_dtype(self):
        import jax.numpy as jnp
        return jnp.bfloat16 if self.precision == "bf16" else jnp.float32
