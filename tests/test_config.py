import dataclasses

import pytest

from pstar_jax.config import (ConfigError, EngineConfig, OptimConfig, format_bytes, parse_bytes,
                              parse_count, parse_memory)


@pytest.mark.parametrize("text, size_bytes", [
    ("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000),
    ("1000000", 1_000_000), ("4k", 4096), ("4K", 4096), ("3kb", 3000), ("2 G", 2 * 1024**3),
    ("1TiB", 1024**4), ("7b", 7), ("1e3", 1000), (" 64MiB ", 64 * 1024**2), (12345, 12345)])
def test_parse_bytes(text, size_bytes):
    """Binary units (K, KiB, ...) are powers of 1024, decimal ones (KB, GB) powers of 1000."""
    assert parse_bytes(text, "--x") == size_bytes


@pytest.mark.parametrize("text", ["lots", "2XB", "GiB", "", "-1", "1.2.3GiB", "2 Gi B"])
def test_parse_bytes_rejects_non_sizes(text):
    """Anything that is not a number with a known unit is a ConfigError naming the flag."""
    with pytest.raises(ConfigError, match=r"^--host-memory: .* is not a size"):
        parse_bytes(text, "--host-memory")


@pytest.mark.parametrize("text, size_bytes", [
    ("0.5", 500), (".25", 250), ("1", 1000), ("1.0", 1000), ("2", 2), ("3GiB", 3 * 1024**3), (77, 77)])
def test_parse_memory_fraction_or_size(text, size_bytes):
    """A number in (0, 1] is a fraction of the total; anything else is a size in bytes."""
    assert parse_memory(text, 1000, "--device-memory") == size_bytes


@pytest.mark.parametrize("text, message", [
    ("0", "must be positive"), ("0B", "must be positive"), (0, "must be positive"),
    (-5, "must be positive"), ("0.0", "fraction must be above 0"), ("-0.5", "is not a size"),
    ("lots", "is not a size"), ("2XB", "is not a size")])
def test_parse_memory_rejects_non_positive(text, message):
    """Zero, negative and non-numeric memory sizes are ConfigErrors, not a zero budget."""
    with pytest.raises(ConfigError, match=message):
        parse_memory(text, 1000, "--device-memory")


@pytest.mark.parametrize("text, numel", [
    ("4M", 4 * 1024**2), ("4m", 4 * 1024**2), ("65536", 65536), ("64k", 65536), ("1G", 1024**3),
    ("1.5k", 1536), (4096, 4096)])
def test_parse_count(text, numel):
    """Element counts use binary multipliers: K=1024, M=1024**2, G=1024**3."""
    assert parse_count(text, "--chunk-size") == numel


@pytest.mark.parametrize("text", ["auto-ish", "lots", "4MB", "4MiB", "2XB", "", "-4"])
def test_parse_count_rejects_with_hint(text):
    """A bad count is a ConfigError that suggests 'auto'."""
    with pytest.raises(ConfigError, match=r"^--chunk-size: .* is not a count.*'auto'"):
        parse_count(text, "--chunk-size")


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (2 * 1024**3, "2.00 GiB"), (3.5 * 1024**4, "3.50 TiB"), (5 * 1024**5, "5120.00 TiB"),
    (-2048, "-2.00 KiB")])
def test_format_bytes(n, text):
    """Sizes print in the largest binary unit below 1024 of it, TiB at most."""
    assert format_bytes(n) == text


def test_format_bytes_parses_back():
    """What format_bytes prints for whole units, parse_bytes reads back to the same bytes."""
    for size in (512, 3 * 1024, 5 * 1024**2, 7 * 1024**3, 2 * 1024**4):
        assert parse_bytes(format_bytes(size).replace(".00", ""), "x") == size


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0), "--lr must be positive"), (dict(lr=-1e-3), "--lr must be positive"),
    (dict(lr=float("nan")), "--lr must be positive"), (dict(total_steps=0), "--steps"),
    (dict(warmup_steps=-1), "warmup"), (dict(clip_norm=0.0), "--clip-norm"),
    (dict(clip_norm=-1.0), "--clip-norm")])
def test_optim_config_rejects(kwargs, message):
    """Invalid optimizer settings fail at construction with the flag to change."""
    with pytest.raises(ConfigError, match=message):
        OptimConfig(**kwargs)


def test_optim_config_defaults_and_frozen():
    """The defaults validate, clip_norm None disables clipping, and configs are immutable."""
    cfg = OptimConfig()
    assert OptimConfig(clip_norm=None).clip_norm is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="--lr"):
        dataclasses.replace(cfg, lr=0.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="fp16"), "--precision must be one of bf16, fp32, got 'fp16'"),
    (dict(micro_batches=0), "--micro-batches must be at least 1, got 0"),
    (dict(chunk_numel=0), "--chunk-size must be positive, got 0"),
    (dict(device_budget_bytes=0), "--device-memory must be positive")])
def test_engine_config_rejects(kwargs, message):
    """Invalid engine settings fail at construction with the flag to change."""
    base = dict(chunk_numel=1024, device_budget_bytes=1 << 20)
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{**base, **kwargs})


def test_engine_config_compute_dtype():
    """precision maps to the compute dtype; a None budget (the CPU demo default) is valid."""
    import jax.numpy as jnp
    assert EngineConfig(1024, None).compute_dtype == jnp.bfloat16
    assert EngineConfig(1024, 1, precision="fp32").compute_dtype == jnp.float32
