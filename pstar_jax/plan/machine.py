"""Rates of the machine a plan is made for: transfers, compute, optimizer updates.

The planner predicts step time from these. ``H200`` holds figures measured on the project's
GPU machine; pstar_jax.planner.measure takes a quick reading of the machine at hand and keeps it
in a JSON file (``save_machine``, ``load_machine``), so the same machine always plans the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pstar_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Machine:
    """Per-device rates."""
    name: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    flops_per_s: float  # sustained FLOP/s of stage compute, as XLA's cost analysis counts FLOPs
    device_adam_params_per_s: float
    host_adam_params_per_s: float
    call_s: float = 0.0  # fixed cost of one stage or optimizer call (dispatch, launch, sync)
    duplex: bool = False  # host->device and device->host copies run at full rate at once


# One H200, jax 0.11.2 (shared/DESIGN.md): pinned-host copies, Adam on the device and with
# compute_on('device_host') over 16 cores. The compute rate is in FLOPs as the trace counts them
# (pstar_jax.model.flops: XLA's cost analysis with every loop iteration, recompute included): plain GPT
# 1.3B with full remat took 0.426 s/step there, and its compiled step counts 1.739e14 FLOPs
# (scripts/calibrate_flops.py; the chunked trace of the same step counts the same), so 408e12/s.
# Not measured there: the fixed cost per call (0) and whether the two copy directions overlap
# (assumed not).
H200 = Machine("h200", 48.6 * 2**30, 49.0 * 2**30, 408e12, 119e9, 0.88e9)


# The same if the two copy directions overlap fully (scripts/bandwidth.py says whether they do).
MACHINES = {"h200": H200, "h200-duplex": dataclasses.replace(H200, name="h200-duplex", duplex=True)}


def describe(machine: Machine) -> str:
    """'h200 rates (preset)' or 'NAME rates (measured)': where a plan's rates came from."""
    preset = MACHINES.get(machine.name) == machine
    return f"{machine.name} rates ({'preset' if preset else 'measured'})"


def copies_overlap(h2d_s: float, d2h_s: float, both_s: float) -> bool:
    """Whether one copy each way at once (``both_s``) ran well below the two one after the other:
    the two directions have their own copy engines (``Machine.duplex``)."""
    return both_s < 0.75 * (h2d_s + d2h_s)


def save_machine(machine: Machine, path: str | os.PathLike) -> None:
    """Write ``machine`` as JSON (whole or not at all: written beside, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(dataclasses.asdict(machine), indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # no half-written file beside the target
        raise


def load_machine(source: str | os.PathLike) -> Machine:
    """A machine by name (``MACHINES``) or from a JSON file that ``save_machine`` wrote."""
    if str(source) in MACHINES:
        return MACHINES[str(source)]
    try:
        fields = json.loads(Path(source).read_text())
        machine = Machine(**fields)
    except OSError as err:
        raise ConfigError(f"machine {str(source)!r} is neither one of {', '.join(MACHINES)} nor a readable "
                          f"file ({err.strerror}); measure one with pstar-machine") from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"machine file {str(source)!r} is not a saved machine ({err}); measure it again "
                          f"with pstar-machine --remeasure") from None
    def number(value, low: float) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value < float("inf")
    rates = (machine.h2d_bytes_per_s, machine.d2h_bytes_per_s, machine.flops_per_s,
             machine.device_adam_params_per_s, machine.host_adam_params_per_s)
    if not all(number(r, 1e-300) for r in rates) or not number(machine.call_s, 0.0):
        raise ConfigError(f"machine file {str(source)!r} holds a rate that is not a positive number")
    return machine
