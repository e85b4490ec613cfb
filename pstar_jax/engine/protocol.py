"""The engine protocol: what every engine (chunked or plain) offers its callers.

A training loop, a checkpoint or an export never asks which engine it holds: both step over
micro-batches, evaluate a held-out loss, read the current parameters by name, hand over and take
back their state for checkpoints, and describe themselves in a summary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping, Protocol, Sequence

import numpy as np

from pstar_jax.engine.zero import replicated_value
from pstar_jax.data.batch import Batch  # this process's rows of a micro-batch; a (tokens, targets) pair is plain data


@dataclasses.dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_s: float
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    device_chunk_peak_bytes: int = 0  # the chunk store's device peak: chunks, device optimizer state, stage inputs
    predicted_h2d_bytes: int = 0
    predicted_d2h_bytes: int = 0
    skipped: bool = False  # a non-finite loss or gradient: no update was applied
    clip_scale: float = 1.0  # the factor global-norm clipping multiplied the grads by (1: not clipped)
    trained_tokens: int = 0  # targets in the loss (the loss mask summed over the global batch)
    disk_read_bytes: int = 0  # frozen chunks read from disk (in h2d_bytes too: they go on to the device)
    predicted_disk_read_bytes: int = 0
    metrics: dict = dataclasses.field(default_factory=dict)  # the objective's own (preference: TRL's rewards/...)


def step_metrics(model: Any, metric_sums: Sequence[Mapping[str, Any]], counts: Any, micro_batches: int
                 ) -> dict[str, float]:
    """A step's metrics from its heads' metric sums (per micro-batch, each added over the
    devices, or already added over the micro-batches) and the step's global counts: the routers'
    load-balancing loss ``aux_loss`` as the mean of the ``micro_batches`` values (transformers
    computes it per forward), the objective's through the model's ``step_metrics`` where it has
    one; a plain head has none."""
    if not metric_sums:
        return {}
    totals = {name: float(sum(np.asarray(replicated_value(m[name])) for m in metric_sums)) for name in metric_sums[0]}
    out = {"aux_loss": totals.pop("aux_loss") / micro_batches} if "aux_loss" in totals else {}
    finish = getattr(model, "step_metrics", None)
    if finish is not None and totals:
        out.update(finish(totals, np.asarray(counts)))
    return out


class NonFiniteLoss(FloatingPointError):
    def __init__(self, step: int, loss: float, grad_norm: float):
        super().__init__(f"the loss or gradient is not finite at step {step} (loss {loss:.4g}, gradient norm "
                         f"{grad_norm:.4g}); lower --lr, or pass --skip-nonfinite to skip such steps")
        self.step = step


class Engine(Protocol):
    """What the training loop, checkpoints and exports use."""
    kind: str  # "chunked" or "plain": recorded in checkpoints, whose state formats differ
    step_count: int

    def step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step over this process's rows of each micro-batch."""

    def evaluate(self, micro_batches: Sequence[Batch]) -> float:
        """The mean loss over the trained tokens of every micro-batch: forward only, no gradients,
        no optimizer work, the current params; the state is unchanged."""

    def eval_plan_for(self, batch_shape: tuple[int, int], micro_batches: int) -> Any:
        """Plan an evaluation of ``micro_batches`` micro-batches of the global ``batch_shape`` ahead
        (ConfigError if it does not fit), so a run fails before training, not at its first eval."""

    def params(self, kind: str = "master") -> dict[str, np.ndarray]:
        """Current tensors by name as numpy: the fp32 master, or the compute-dtype ``param``."""

    def iter_params(self, kind: str = "master") -> Iterator[tuple[str, np.ndarray]]:
        """The same tensors one at a time, in model order (the chunked engine reads one chunk at a time)."""

    def state(self) -> dict:
        """All state as arrays (for a checkpoint), any pending update applied first."""

    def abstract_state(self, layout: Any = None) -> dict:
        """Shapes and shardings of ``state()`` (for restoring into this engine)."""

    def load_state(self, state: dict, step: int) -> None:
        """Replace all state and set the step count."""

    def summary(self) -> str:
        """A few lines for people: sizes, placement, predictions."""
