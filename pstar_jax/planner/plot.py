"""pstar-plan --plot: a plan's memory timeline, one bar of model and non-model data per moment.

The x axis is the step's moments in order, labelled by the forward and backward of each
micro-batch, the optimizer's updates marked; the y axis is bytes per device in the unit that suits the largest
value shown. A plan that does not fit has no placement: only the working memory is drawn, with
the capacity and the reason, never model data the plan did not place.
"""

from __future__ import annotations

from typing import Sequence

from pstar_jax.config import format_bytes

# The optimizer update of a chunk runs just before the first forward stage that reads it, and the
# head (the loss) starts the backward: the axis labels the two halves of each micro-batch.
HALVES = {"adam": "forward", "fwd": "forward", "head": "backward", "bwd": "backward"}


def byte_unit(largest_bytes: float) -> tuple[str, int]:
    """('KiB', 1024) ... the binary unit in which ``largest_bytes`` reads between 1 and 1024."""
    unit, scale = "B", 1
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if largest_bytes < scale * 1024:
            break
        unit, scale = name, scale * 1024
    return unit, scale


def phase_runs(phases: Sequence[str], micros: Sequence[int]) -> list[tuple[int, int, str]]:
    """(first moment, last moment, label) of each forward or backward half of a micro-batch."""
    runs: list[tuple[int, int, str]] = []
    keys = [(HALVES.get(p, p), m) for p, m in zip(phases, micros)]
    several = len(set(micros)) > 1
    for i, key in enumerate(keys):
        if runs and key == keys[i - 1]:
            runs[-1] = (runs[-1][0], i, runs[-1][2])
        else:
            runs.append((i, i, key[0] + (f" {key[1]}" if several else "")))
    return runs


def plot_timeline(planned, path: str) -> None:
    """Model data (chunks and device optimizer state) and non-model data per moment, stacked,
    against the device capacity (shown above the data, never on the frame)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan, accesses = planned.plan, planned.accesses
    fits = plan.fits and len(plan.moments) == len(accesses)
    non_model = [a.non_model_bytes for a in accesses]
    if fits:  # the stage inputs the plan keeps on the device are activations too
        non_model = [n + m.input_bytes for n, m in zip(non_model, plan.moments)]
    opt = plan.device_state_bytes
    model = [m.chunk_bytes + opt for m in plan.moments] if fits else [0] * len(accesses)
    capacity = plan.device_capacity_bytes
    peak = max([1, *(m + n for m, n in zip(model, non_model))])
    capacity_shown = capacity <= 4 * peak  # else the data would be a sliver under a line far above it
    unit, scale = byte_unit(max(capacity, peak) if capacity_shown else peak)
    x = range(len(accesses))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    if fits:
        ax.stackplot(x, [m / scale for m in model], [n / scale for n in non_model], step="mid",
                     labels=["model data (param/grad chunks + Adam state on the device)", "non-model data"],
                     colors=["#4c72b0", "#dd8452"])
    else:
        ax.stackplot(x, [n / scale for n in non_model], step="mid", labels=["non-model data"], colors=["#dd8452"])
    if capacity_shown:
        ax.axhline(capacity / scale, color="black", linestyle="--", linewidth=1.2, label="device capacity")
    ax.set_ylim(0, (max(capacity, peak) if capacity_shown else peak) / scale * 1.12)  # the line clears the frame
    ax.set_xlim(-0.5, len(accesses) - 0.5)
    runs = phase_runs([a.phase for a in accesses], [a.micro for a in accesses])
    ax.set_xticks([(first + last) / 2 for first, last, _ in runs], [label for _, _, label in runs], fontsize=8)
    for first, _, _ in runs[1:]:
        ax.axvline(first - 0.5, color="grey", linewidth=0.5, alpha=0.5)
    updates = [i for i, a in enumerate(accesses) if a.phase == "adam"]
    ax.plot(updates, [0] * len(updates), linestyle="none", marker="^", color="black", markersize=5,
            clip_on=False, label="a chunk's optimizer update")
    ax.set_xlabel(f"the step's {len(accesses)} moments in order: each micro-batch's forward, then its loss and "
                  "backward")
    ax.set_ylabel(f"{unit} per device")
    title = "pstar plan: fits" if fits else f"pstar plan: does not fit ({plan.problem})"
    if not capacity_shown:
        title += f"; device capacity {format_bytes(capacity)}, far above"
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize=8, frameon=False)  # off the data
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["plot_timeline", "byte_unit", "phase_runs"]
