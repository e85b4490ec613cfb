"""Per-step metrics: one JSON object per line, and a live progress bar."""

from __future__ import annotations

import json
import os
from typing import IO, Any

from tqdm import tqdm

from pstar_jax.config import format_bytes


def step_record(step: int, result: Any, tokens: int, flops_per_token: float, **extra: Any) -> dict:
    """The metrics of one step: the StepResult's fields plus throughput figures."""
    record = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm,
              "step_s": result.step_s, "tokens_per_s": tokens / result.step_s,
              "model_tflops": flops_per_token * tokens / result.step_s / 1e12,
              "h2d_bytes": result.h2d_bytes, "d2h_bytes": result.d2h_bytes,
              "device_chunk_peak_bytes": result.device_chunk_peak_bytes}
    record.update(extra)
    return record


class MetricsWriter:
    """Appends JSON lines; opened only once training really starts, so bad input writes nothing."""

    def __init__(self, path: str | None):
        self._file: IO[str] | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


class Progress:
    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self._bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                         dynamic_ncols=True, mininterval=0.5)

    def update(self, record: dict) -> None:
        self._bar.set_postfix_str(
            f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s | "
            f"h2d {format_bytes(record['h2d_bytes'])} d2h {format_bytes(record['d2h_bytes'])}",
            refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
