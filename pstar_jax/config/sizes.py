"""Sizes as people write them ('2GiB', '4M', '0.8') and as they read them ('1.50 KiB')."""

from __future__ import annotations

import re

from pstar_jax.config.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1000**4, "tib": 1024**4}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int, what: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes. KiB/MiB/GiB (and K/M/G) are binary."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: {text!r} is not a size; write bytes like 2GiB, 512MiB or 1000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_rate(text: str, what: str) -> float:
    """'6GB/s', '5.5GiB/s', '2e9' -> bytes per second (positive)."""
    body = str(text).strip()
    body = body[:-2] if body.lower().endswith("/s") else body
    try:
        rate = parse_bytes(body, what) if body else 0
    except ConfigError:
        rate = 0
    if rate <= 0:
        raise ConfigError(f"{what}: {text!r} is not a read rate; write bytes per second like 6GB/s or 3.5GiB/s")
    return float(rate)


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


def format_seconds(seconds: float) -> str:
    """A time in the unit that shows it: '1.25 s', '12.5 ms', '830 µs', '45 ns'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= 0.9995 * scale:
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def parse_device_memory(text: str | int | float | None) -> int | float | None:
    """'auto' -> None; a plain number in (0, 1] -> a fraction of the device; anything else a size
    in bytes ('2GiB', '1e9', '1000000'). A plain number above 1 is bytes."""
    if text is None or isinstance(text, (int, float)):
        return text
    text = text.strip()
    if text.lower() == "auto":
        return None
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and 0 < number <= 1:
        return number
    if number is not None and number != int(number):
        raise ConfigError(f"EngineConfig.device_memory: {text!r} is neither a fraction in (0, 1] nor a whole number "
                          "of bytes; write 0.8, 2GiB or 1000000")
    return parse_bytes(text, "EngineConfig.device_memory")


def parse_optional_bytes(text: str | int | None) -> int | None:
    return None if text is None or str(text).strip().lower() in ("", "auto") else parse_bytes(text, "EngineConfig.host_memory")


def parse_chunk_numel(text: str | int | None) -> int | None:
    return None if text is None or str(text).strip().lower() == "auto" else parse_count(text, "EngineConfig.chunk_numel")


def parse_keep_residuals(text: str | int | None) -> int | None:
    """A count of blocks, or auto (None: the planner picks it)."""
    if text is None or isinstance(text, int):
        return text
    text = str(text).strip().lower()
    if text == "auto":
        return None
    if not text.isdigit():
        raise ConfigError(f"EngineConfig.keep_residuals: {text!r} is not a count of blocks; write a whole number "
                          "like 40, or auto")
    return int(text)


def parse_clip_norm(text: str | float | None) -> float | None:
    value = None if text is None else float(text)
    return None if value == 0 else value
