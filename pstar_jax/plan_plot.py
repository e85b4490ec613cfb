"""pstar-plan --plot: a plan's memory timeline, one bar of model and non-model data per moment.

The x axis is the step's moments in order, labelled by phase (forward, head, backward,
optimizer) and micro-batch; the y axis is bytes per device in the unit that suits the largest
value shown. A plan that does not fit has no placement: only the working memory is drawn, with
the capacity and the reason, never model data the plan did not place.
"""

from __future__ import annotations

from typing import Sequence

PHASES = {"fwd": "forward", "head": "head", "bwd": "backward", "adam": "optimizer"}
MAX_PHASE_LABELS = 12  # more runs than this (many micro-batches): label each phase once


def byte_unit(largest_bytes: float) -> tuple[str, int]:
    """('KiB', 1024) ... the binary unit in which ``largest_bytes`` reads between 1 and 1024."""
    unit, scale = "B", 1
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if largest_bytes < scale * 1024:
            break
        unit, scale = name, scale * 1024
    return unit, scale


def phase_runs(phases: Sequence[str], micros: Sequence[int]) -> list[tuple[int, int, str]]:
    """(first moment, last moment, label) of each run of equal (phase, micro-batch)."""
    runs: list[tuple[int, int, str]] = []
    for i, key in enumerate(zip(phases, micros)):
        if runs and i > 0 and key == (phases[i - 1], micros[i - 1]):
            runs[-1] = (runs[-1][0], i, runs[-1][2])
        else:
            label = PHASES.get(key[0], key[0]) + (f" {key[1]}" if len(set(micros)) > 1 and key[0] != "adam" else "")
            runs.append((i, i, label))
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
    opt = sum(plan.opt_on_device) * plan.opt_state_bytes
    model = [m.chunk_bytes + opt for m in plan.moments] if fits else [0] * len(accesses)
    capacity = plan.device_capacity_bytes
    unit, scale = byte_unit(max([capacity, *(m + n for m, n in zip(model, non_model))]))
    x = range(len(accesses))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    if fits:
        ax.stackplot(x, [m / scale for m in model], [n / scale for n in non_model], step="mid",
                     labels=["model data (param/grad chunks + Adam state on the device)", "non-model data"],
                     colors=["#4c72b0", "#dd8452"])
    else:
        ax.stackplot(x, [n / scale for n in non_model], step="mid", labels=["non-model data"], colors=["#dd8452"])
    ax.axhline(capacity / scale, color="black", linestyle="--", linewidth=1.2, label="device capacity")
    top = max([capacity, *(m + n for m, n in zip(model, non_model))]) / scale
    ax.set_ylim(0, top * 1.12)  # headroom: the capacity line stays clear of the frame
    ax.set_xlim(-0.5, len(accesses) - 0.5)
    runs = phase_runs([a.phase for a in accesses], [a.micro for a in accesses])
    if len(runs) > MAX_PHASE_LABELS:
        seen: set[str] = set()
        runs = [r for r in runs if not (r[2].split()[0] in seen or seen.add(r[2].split()[0]))]
    ax.set_xticks([(first + last) / 2 for first, last, _ in runs], [label for _, _, label in runs], fontsize=8)
    for first, _, _ in runs[1:]:
        ax.axvline(first - 0.5, color="grey", linewidth=0.5, alpha=0.5)
    ax.set_xlabel(f"the step's {len(accesses)} moments in order (phase" +
                  (", micro-batch)" if len({a.micro for a in accesses}) > 1 else ")"))
    ax.set_ylabel(f"{unit} per device")
    title = "pstar plan: fits" if fits else f"pstar plan: does not fit ({plan.problem})"
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["plot_timeline", "byte_unit", "phase_runs"]
