"""What a "does not fit" error names so that following it fits: a shorter sequence at which some
placement fits (``fitting_seq_len``) and the least device memory (search.smallest_device_bytes),
or where none fits, the least host memory (``misfit_fixes``), written as values that parse back
to at least what was found (``flag_bytes``).

Each probe asks only whether any placement fits (make_plan's ``first_fit``). The memory search
costs plans only; the sequence search traces the model at each length it tries
(``SEQ_LEN_FIT_TRACES`` at most), so an error that names a length costs a few traces.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from pstar_jax.config import ConfigError, EngineConfig, parse_bytes
from pstar_jax.plan.machine import Machine
from pstar_jax.plan.placement import make_plan
from pstar_jax.plan.planned import shortfall
from pstar_jax.plan.schedule import StepShape, scale_batch
from pstar_jax.planner.search import SEQ_LEN_GRANULE, resident_bytes, smallest_device_bytes, smallest_host_bytes

if TYPE_CHECKING:
    from pstar_jax.planner.build import Planned

SEQ_LEN_FIT_TOLERANCE = 0.1  # the error's sequence length is within 10% of one that does not fit
SEQ_LEN_FIT_TRACES = 3  # or the longest seen to fit in this many traces


def any_fits(shape: StepShape, device_bytes: int, host_bytes: int, machine: Machine, adam_placement: str,
             disk_bytes: int = 0) -> bool:
    """Whether some placement of ``shape`` fits: the pure placements first, then the mixes."""
    return any(make_plan(shape, device_bytes, host_bytes, machine, adam_placement, first_fit=True, mixes=mixes,
                         pure_fails=mixes, disk_bytes=disk_bytes).fits for mixes in (False, True))


def flag_bytes(n_bytes: int) -> str:
    """``n_bytes`` as a flag's value ("1.95GiB"), rounded up (placement.shortfall) so that the
    value parsed back is at least ``n_bytes``."""
    text = shortfall(n_bytes).replace(" ", "")
    while parse_bytes(text, "a size") < n_bytes:  # a float that parses a byte short
        n_bytes += max(1, n_bytes // 10_000)
        text = shortfall(n_bytes).replace(" ", "")
    return text


def fitting_seq_len(shape_at: Callable[[int], tuple[StepShape, int]], seq_len: int, host_bytes: int,
                    machine: Machine, adam_placement: str, failing: StepShape | None = None,
                    tolerance: float = SEQ_LEN_FIT_TOLERANCE, max_traces: int = SEQ_LEN_FIT_TRACES,
                    disk_bytes: int = 0) -> int:
    """A sequence length below ``seq_len`` (which does not fit; ``failing``: its step's shape) at
    which some placement fits, the longest the search saw fit; 0 when the shortest it tries does
    not. ``shape_at(n)`` is the step's shape and device budget with the model built for length n
    (a trace; ConfigError where the model cannot be built so).

    The shortest length comes first (SEQ_LEN_GRANULE tokens, or an eighth of a short ``seq_len``):
    when it does not fit, no shorter sequence is the fix. Then each probe is what memory allows
    between the longest length seen to fit and the shortest seen not to: the fitting one's trace
    with its working memory scaled as a power of the length, the power the two traces' working
    memories give (at least linear; plans only). It stops within ``tolerance`` of a length that
    does not fit, or after ``max_traces`` traces. Memory need not grow with the length everywhere
    (a model may tile its attention from some length on), so the answer is a length that fits,
    not always the longest."""
    granule = max(1, min(SEQ_LEN_GRANULE, seq_len // 8))

    def snap(n: float) -> int:
        return max(granule, int(n) // granule * granule)

    def probe(n: int) -> tuple[StepShape, int, bool] | None:
        try:
            shape, device_bytes = shape_at(n)
        except ConfigError:  # the model refuses this length
            return None
        return shape, device_bytes, any_fits(shape, device_bytes, host_bytes, machine, adam_placement, disk_bytes)

    def memory_allows(low: int, shape: StepShape, device_bytes: int, high: int, above: StepShape | None) -> int:
        # The longest length in (low, high) at which low's trace, its working memory scaled, fits.
        power = 1.0
        if above is not None and 0 < shape.busiest_working_bytes < above.busiest_working_bytes:
            power = max(1.0, math.log(above.busiest_working_bytes / shape.busiest_working_bytes) / math.log(high / low))
        lo, hi = low, high
        while hi - lo > max(granule, tolerance * lo / 2):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if any_fits(scale_batch(shape, (mid / low) ** power), device_bytes, host_bytes,
                                           machine, adam_placement, disk_bytes) else (lo, mid)
        return lo
    first = probe(granule) if seq_len > granule else None
    if first is None or not first[2]:
        return 0
    low, high, fitting, above = granule, seq_len, first[:2], failing
    for _ in range(max_traces - 1):
        if high - low <= max(granule, tolerance * low):
            break
        n = min(max(snap(memory_allows(low, *fitting, high, above)), snap(low * (1 + tolerance) + granule)),
                snap(high - 1))
        if n <= low:
            break
        traced = probe(n)
        if traced is not None and traced[2]:
            low, fitting = n, traced[:2]
        else:
            high, above = n, (traced[0] if traced is not None else None)
    return low


MEMORY_FLAGS = ("raise EngineConfig.device_memory or EngineConfig.host_memory, or lower EngineConfig.chunk_numel or "
                "the batch")
NO_MEMORY_FITS = ("it fits no device or host memory tried at this chunk size and batch; lower EngineConfig.chunk_numel "
                  "or TrainConfig.batch_size")


def misfit_fixes(planned: Planned, host_bytes: int, machine: Machine, config: EngineConfig,
                 seq_len: int = 0, devices_per_host: int | None = None) -> str:
    """What a "does not fit" error suggests: ``seq_len`` (a shorter sequence fitting_seq_len found
    to fit; 0: none), and the least device memory that fits with this host memory; where none does
    and the caller says how many devices share EngineConfig.host_memory (``devices_per_host``;
    ``host_bytes`` is one device's share), the least host memory that fits (``_host_memory_fix``);
    else which settings to change."""
    fixes = [f"ModelConfig.seq_len {seq_len} (at this batch)"] if seq_len else []
    least = smallest_device_bytes(planned, host_bytes, machine, config)
    if least is not None:
        fixes.append(f"EngineConfig.device_memory {flag_bytes(least)}" + (" (at this length)" if seq_len else ""))
    elif devices_per_host is not None and (host := _host_memory_fix(planned, host_bytes, machine, config,
                                                                    devices_per_host)):
        fixes.append(host)
    if fixes:
        return "it fits with " + " or with ".join(fixes)
    return MEMORY_FLAGS if devices_per_host is None else NO_MEMORY_FITS


def _host_memory_fix(planned: Planned, host_bytes: int, machine: Machine, config: EngineConfig,
                     devices_per_host: int) -> str | None:
    """The least EngineConfig.host_memory (the host's, shared by ``devices_per_host`` devices) that
    fits with this device memory; else the least with everything on the device, and the least
    device memory that fits with it; None when neither fits."""
    host = smallest_host_bytes(planned, host_bytes, planned.device_budget_bytes, machine, config)
    if host is not None:
        return f"EngineConfig.host_memory {flag_bytes(host * devices_per_host)}"
    host = smallest_host_bytes(planned, host_bytes, max(resident_bytes(planned.shape), planned.device_budget_bytes),
                               machine, config)
    device = None if host is None else smallest_device_bytes(planned, host, machine, config)
    if device is None:
        return None
    return (f"EngineConfig.host_memory {flag_bytes(host * devices_per_host)} and EngineConfig.device_memory "
            f"{flag_bytes(device)}")


__all__ = ["any_fits", "flag_bytes", "fitting_seq_len", "misfit_fixes", "MEMORY_FLAGS", "NO_MEMORY_FITS",
           "SEQ_LEN_FIT_TOLERANCE", "SEQ_LEN_FIT_TRACES"]
