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
    # Under what a measured machine's rates were taken (None, "": a preset, or a file kept before
    # these were recorded): a reading on a busy CPU can be many times off (``load_note``).
    measured_at: str = ""  # local time, "YYYY-MM-DD HH:MM"
    measured_load: float | None = None  # the 1-minute load average (os.getloadavg) just before
    measured_cores: int | None = None  # os.cpu_count() then
    # Local disk, for frozen chunks kept there (0: not measured; pstar-machine --disk DIR): reads of
    # whole chunks from a cache file, and of tensors straight from safetensors files, transposed
    # and cast into a chunk's layout on the CPU.
    disk_read_bytes_per_s: float = 0.0
    disk_tensor_bytes_per_s: float = 0.0
    disk_measured_on: str = ""  # the directory the disk rates were read in


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


# The disk's rates: measured apart (pstar-machine --disk DIR) and kept through a remeasure; a preset
# given a disk rate (pstar-plan --disk-rate) is still the preset.
DISK_FIELDS = ("disk_read_bytes_per_s", "disk_tensor_bytes_per_s", "disk_measured_on")


def describe(machine: Machine) -> str:
    """'h200 rates (preset)' or 'NAME rates (measured)': where a plan's rates came from."""
    known = MACHINES.get(machine.name)
    preset = known is not None and dataclasses.replace(machine, **{f: getattr(known, f) for f in DISK_FIELDS}) == known
    return f"{machine.name} rates ({'preset' if preset else 'measured'})"


BUSY_LOAD_PER_CORE = 0.5  # a load above this many runnable processes per core counts as a busy machine


def provenance(machine: Machine) -> str:
    """'measured 2025-01-02 13:04 at load 5.2 on 2 cores', 'preset' or 'measured, load not recorded'."""
    if MACHINES.get(machine.name) == machine:
        return "preset"
    if machine.measured_load is None or not machine.measured_cores:
        return "measured, load not recorded"
    return f"measured {machine.measured_at} at load {machine.measured_load:.1f} on {machine.measured_cores} cores"


def load_note(machine: Machine, load_now: float | None) -> str | None:
    """A start-up note when ``machine``'s rates were measured on a busy machine (a load above
    ``BUSY_LOAD_PER_CORE`` per core) or under a load that far from ``load_now``: the plan's
    predictions may then be off by the same large factor as the rates. None when neither holds."""
    load, cores = machine.measured_load, machine.measured_cores
    if load is None or not cores:
        return None
    busy = load > BUSY_LOAD_PER_CORE * cores
    moved = load_now is not None and abs(load_now - load) > BUSY_LOAD_PER_CORE * cores
    if not (busy or moved):
        return None
    now = f", load now {load_now:.1f}" if moved else ""
    return (f"{machine.name} rates {provenance(machine)}{now}: predictions may be off; pstar-machine --remeasure "
            f"measures them again")


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
    if not (machine.measured_load is None or number(machine.measured_load, 0.0)) or not isinstance(
            machine.measured_at, str) or not (machine.measured_cores is None or number(machine.measured_cores, 1)):
        raise ConfigError(f"machine file {str(source)!r} holds a measured_load, measured_cores or measured_at "
                          f"that is not a load, a core count or a time; measure it again with pstar-machine --remeasure")
    if not (number(machine.disk_read_bytes_per_s, 0.0) and number(machine.disk_tensor_bytes_per_s, 0.0)
            and isinstance(machine.disk_measured_on, str)):
        raise ConfigError(f"machine file {str(source)!r} holds a disk rate that is not a number of bytes per second "
                          f"(0: not measured); measure it again with pstar-machine --disk DIR")
    return machine
