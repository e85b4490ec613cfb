"""Upper bounds on a model's sizes, so that a hostile config (a downloaded config.json, a Flax
export's) is refused in one line before anything is built from it. A size is a tensor dimension
(XLA's are int64, but no published model has one near 2**31); counts of layers, experts and
convolution taps size tables and loops built in Python; head_dim sizes a RoPE table."""

from __future__ import annotations

MAX_SIZE = 2**31 - 1
MAX_LAYERS = 4096  # the largest published models have about 130
MAX_EXPERTS = 4096  # each expert's tensors are named one by one (the largest published MoEs have 384)
MAX_HEAD_DIM = 65536  # published models use 64 to 256
MAX_CONV_TAPS = 256  # a short convolution: Qwen3-Next's and Qwen3.5's have 4 taps


def check_sizes(owner: str, sizes: dict[str, object], uppers: dict[str, int] | None = None) -> None:
    """ValueError naming the first of ``sizes`` (field -> value; ints already checked positive)
    past its bound: ``uppers``' entry, else MAX_SIZE."""
    for field, value in sizes.items():
        upper = (uppers or {}).get(field, MAX_SIZE)
        if isinstance(value, int) and value > upper:
            raise ValueError(f"{owner}.{field} is {value}; pstar_jax takes at most {upper}")


__all__ = ["MAX_CONV_TAPS", "MAX_EXPERTS", "MAX_HEAD_DIM", "MAX_LAYERS", "MAX_SIZE", "check_sizes"]
