"""Micro-batches for the engines' tests: random plain windows, and packed SFT rows with uneven
trained tokens per row."""

import numpy as np

from pstar_jax.data.batch import Batch, from_rows


def batches(n_steps, micro_batches=1, batch=4, seq=64, seed=0):
    """Steps of (tokens, targets) micro-batches of random byte-level windows."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        step = []
        for _ in range(micro_batches):
            tok = rng.integers(0, 256, (batch, seq + 1))
            step.append((tok[:, :-1], tok[:, 1:]))
        out.append(step)
    return out


def sft_steps(n_steps, micro_batches=1, batch=4, seq=64, seed=0):
    """Packed rows of random examples with uneven trained tokens per row (each row its own label
    density), so micro-batches and devices hold different counts of trained tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        step = []
        for _ in range(micro_batches):
            tokens = rng.integers(0, 256, (batch, seq + 1))
            segments = np.zeros((batch, seq + 1), np.int64)
            for r in range(batch):
                at, k = 0, 1
                end = seq + 1 - rng.integers(0, 12)  # padding after the last example
                while at < end:
                    n = min(int(rng.integers(4, 30)), end - at)
                    segments[r, at:at + n] = k
                    at, k = at + n, k + 1
            labels = rng.random((batch, seq + 1)) < rng.uniform(0.05, 0.95, (batch, 1))
            step.append(from_rows(tokens, segments, labels))
        out.append(step)
    return out


def merge(step):
    """One micro-batch holding every row of a step's micro-batches."""
    return [Batch(*(None if f[0] is None else np.concatenate(f) for f in zip(*step)))]

