"""Per-step metrics: writers (JSON lines, TensorBoard, any object with ``write_scalars``) and a
live progress bar.

A step's record (``step_record``): ``step`` (0-based), ``loss``, ``aux_loss`` (the routers'
load-balancing loss, where the model adds it: ``loss`` holds its coefficient times it), ``lr``
(the learning rate of the step's update; left out for an optimizer factory whose schedule is not
known), ``grad_norm``,
``clip_scale`` (the factor global-norm clipping applied, 1.0 when not clipped), ``step_s``,
``tokens_per_s``, ``model_tflops``, the copies and memory of the step (``h2d_bytes``,
``d2h_bytes``, ``device_chunk_peak_bytes``, ``predicted_h2d_bytes``, ``predicted_d2h_bytes``;
with frozen chunks on disk ``disk_read_bytes`` and ``predicted_disk_read_bytes``), ``skipped``, and after an evaluation ``eval_loss`` and ``eval_s``.
Under a preference objective also TRL's ``rewards/chosen``, ``rewards/rejected``,
``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` and ``nll_loss``
(TensorBoard keeps those names as its tags)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import IO, Any, Protocol

from tqdm import tqdm

from pstar_jax.config import ConfigError, format_bytes
from pstar_jax.engine.protocol import StepResult
from pstar_jax.config.paths import check_output_file, create_temp_beside


class MetricsWriter(Protocol):
    def write_scalars(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def step_record(step: int, result: StepResult, tokens: int, flops_per_token: float,
                lr: float | None = None) -> dict:
    """The metrics of one step (``step`` counts from 0): the StepResult's fields plus throughput:
    ``tokens_per_s`` of every position, ``trained_tokens_per_s`` of those in the loss (fewer on
    SFT data, where prompts and padding are not trained)."""
    return {"step": step, "loss": result.loss,
            **({"lr": lr} if lr is not None else {}),
            "grad_norm": result.grad_norm, "clip_scale": result.clip_scale, "step_s": result.step_s,
            "tokens_per_s": tokens / result.step_s,
            "trained_tokens": result.trained_tokens, "trained_tokens_per_s": result.trained_tokens / result.step_s,
            "model_tflops": flops_per_token * tokens / result.step_s / 1e12,
            "h2d_bytes": result.h2d_bytes, "d2h_bytes": result.d2h_bytes,
            "device_chunk_peak_bytes": result.device_chunk_peak_bytes,
            "predicted_h2d_bytes": result.predicted_h2d_bytes, "predicted_d2h_bytes": result.predicted_d2h_bytes,
            **({"disk_read_bytes": result.disk_read_bytes,
                "predicted_disk_read_bytes": result.predicted_disk_read_bytes}
               if result.disk_read_bytes or result.predicted_disk_read_bytes else {}),
            "skipped": result.skipped, **result.metrics}


class JsonlWriter:
    """One JSON object per line. Opened with ``first_step``, it drops lines of steps at or past it
    (a resumed run rewrites what the crashed one wrote after its checkpoint), so a reader sees
    each step once."""

    def __init__(self, path: str, first_step: int = 0):
        check_output_file(path, "OutputConfig.metrics_out")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if first_step and os.path.exists(path):
            _truncate_steps(path, first_step)
        self._file: IO[str] = open(path, "a" if first_step else "w", encoding="utf-8")

    def write_scalars(self, step: int, scalars: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **scalars}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _truncate_steps(path: str, first_step: int) -> None:
    """Keep the lines of steps before ``first_step`` (atomically: a temp file renamed over)."""
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if json.loads(line)["step"] < first_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut off by a crash
    fd, tmp = create_temp_beside(path)  # (the umask's permissions, not mkstemp's 0600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


# TensorBoard groups tags by their prefix: training, held-out, and copies and memory.
_TB_TAGS = {"eval_loss": "eval/loss", "eval_s": "eval/seconds", "h2d_bytes": "memory/h2d_bytes",
            "d2h_bytes": "memory/d2h_bytes", "device_chunk_peak_bytes": "memory/device_chunk_peak_bytes",
            "predicted_h2d_bytes": "memory/predicted_h2d_bytes",
            "predicted_d2h_bytes": "memory/predicted_d2h_bytes", "disk_read_bytes": "memory/disk_read_bytes",
            "predicted_disk_read_bytes": "memory/predicted_disk_read_bytes"}


def tensorboard_tag(name: str) -> str:
    """A record field's TensorBoard tag: ``train/loss``, ``eval/loss``, ``memory/h2d_bytes``; a
    name that has a group already keeps it."""
    return name if "/" in name else _TB_TAGS.get(name, f"train/{name}")


class TensorBoardWriter:
    """TensorBoard event files through tensorboardX (an optional dependency): the scalars under
    grouped tags (``tensorboard_tag``), and ``config`` (the run's, as a dict) once as text."""

    def __init__(self, logdir: str, config: dict | None = None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("OutputConfig.tensorboard needs tensorboardX: pip install 'pstar_jax[tensorboard]'"
                              ) from None
        check_output_file(os.path.join(logdir, "events"), "OutputConfig.tensorboard")
        self._writer = SummaryWriter(logdir)
        if config is not None:  # indented four spaces: TensorBoard's markdown shows it verbatim
            text = json.dumps(config, indent=2, sort_keys=True)
            self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def write_scalars(self, step: int, scalars: dict[str, Any]) -> None:
        for name, value in scalars.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(tensorboard_tag(name), value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Progress:
    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self._bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                         dynamic_ncols=True, mininterval=0.5)

    def update(self, record: dict) -> None:
        extra = f" | aux {record['aux_loss']:.4f}" if "aux_loss" in record else ""
        extra += f" | eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""
        if "rewards/accuracies" in record:  # preference tuning: TRL's headline metrics
            extra += f" | acc {record['rewards/accuracies']:.2f} margin {record['rewards/margins']:.3f}"
        lr = f" | lr {record['lr']:.2e}" if "lr" in record else ""
        clip = f" | clip {record['clip_scale']:.2f}" if record.get("clip_scale", 1.0) < 1.0 else ""
        self._bar.set_postfix_str(
            f"loss {record['loss']:.4f}{extra}{lr}{clip} | {record['tokens_per_s']:,.0f} tok/s | "
            f"h2d {format_bytes(record['h2d_bytes'])} d2h {format_bytes(record['d2h_bytes'])}",
            refresh=False)
        self._bar.update(1)

    def aside(self) -> contextlib.AbstractContextManager:
        """Inside, the bar is off the terminal: a line written to stderr then does not cut it."""
        return tqdm.external_write_mode(file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
