"""What the benchmark scripts share: random token batches and the median step time."""

from __future__ import annotations

import statistics

import numpy as np


def random_batches(vocab_size: int, batch: int, seq_len: int, steps: int, seed: int = 0) -> list:
    """``steps`` steps of one (tokens, targets) micro-batch each, the same for every method."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tok = rng.integers(0, vocab_size, (batch, seq_len + 1))
        out.append([(tok[:, :-1], tok[:, 1:])])
    return out


def median_step_s(engine, steps: list, warmup: int) -> tuple[float, object]:
    """Median step time after ``warmup`` steps (compilation excluded), and the last step's result."""
    times, last = [], None
    for i, step in enumerate(steps):
        last = engine.step(step)
        if i >= warmup:
            times.append(last.step_s)
    return statistics.median(times), last
