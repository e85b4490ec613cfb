"""A step's placement plan as plain data (``Plan``), and the lines that describe it.

placement.py makes plans (``plan_step``, ``make_plan``); this module is what they make, what the
executor carries out and what pstar-plan reports: every item's evictions and fetches per moment
(replay.PlanMoment, each issued ``lead`` moments ahead or right before its moment), the step's
starting state, the optimizer placement, the frozen chunks' homes, the bytes moved and the
predicted step time. It imports no planning, so the engine holds a plan without loading the
planner.
"""

from __future__ import annotations

import dataclasses
import json
import math

from pstar_jax.config import format_bytes
from pstar_jax.plan.homes import disk_reads
from pstar_jax.plan.replay import PlanMoment
from pstar_jax.plan.schedule import Item, StepShape


def shortfall(n_bytes: int) -> str:
    """``format_bytes`` rounded up, not to the nearest: a budget raised by the amount a message says
    is short is then no longer short by it."""
    text = format_bytes(n_bytes)
    unit = text.split()[1]
    if unit == "B":
        return text
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    return f"{math.ceil(n_bytes * 100 / scale) / 100:.2f} {unit}"


@dataclasses.dataclass(frozen=True)
class Plan:
    moments: tuple[PlanMoment, ...]
    initial_device: tuple[tuple[Item, bool], ...]  # (item, dirty) on the device at step start
    opt_on_device: tuple[bool, ...]
    opt_streamed: tuple[bool, ...]  # host-resident state updated on the device (streamed down and up)
    state_leads: tuple[int, ...]  # per chunk: moments ahead its streamed state is sent down
    chunk_bytes: tuple[int, ...]  # per chunk: its bf16 params (or grad), per device
    opt_state_bytes: tuple[int, ...]  # per chunk: its fp32 master + optimizer state, per device (0: frozen)
    device_capacity_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    peak_device_bytes: int  # chunks + non-model
    peak_host_bytes: int
    predicted_step_s: float
    fits: bool
    problem: str | None
    input_bytes: int = 0  # all stage inputs a step keeps for its backward, per device
    input_offload_bytes: int = 0  # those of them sent to pinned host memory (and back) per step
    victim_rule: str = "belady"  # the eviction rule that made the moments (eviction.py)
    # Per chunk where a frozen chunk's params live ("" for a trainable chunk; () when none is
    # frozen): "device" (never leaves it, no other copy), "host" (a pinned copy always held),
    # "disk" (read into a staging buffer before each fetch: homes.py).
    frozen_home: tuple[str, ...] = ()
    disk_read_bytes: int = 0  # read from disk-homed chunks per step, per device
    staging_bytes: int = 0  # the disk reader's ring in pinned host memory (in peak_host_bytes)
    prefetch_depth: int = 1  # the most moments ahead the replay issued a moment's copies (PlanMoment.lead)

    def to_json(self) -> dict:
        """The plan as plain data. Sizes all chunks share are one number, as they were before sizes
        were per chunk: "item_bytes" for the chunks' bytes (else "chunk_bytes", per chunk) and
        "opt_state_bytes" for the trainable chunks' state (else per chunk, 0 for a frozen one)."""
        data = json.loads(json.dumps(dataclasses.asdict(self)))
        states = {b for b in self.opt_state_bytes if b}  # a frozen chunk has none
        out = {}
        for key, value in data.items():
            if key in ("frozen_home", "disk_read_bytes", "staging_bytes") and not value:
                continue  # nothing frozen, or nothing on disk: the plan as before those homes
            if key == "prefetch_depth" and value == 1:
                continue  # one moment ahead at most: the plan as before deeper leads
            if key == "moments":
                for moment in value:
                    if moment["lead"] == 1:
                        del moment["lead"]
            if key == "chunk_bytes" and len(set(value)) == 1:
                key, value = "item_bytes", value[0]
            elif key == "opt_state_bytes" and len(states) == 1:
                value = states.pop()
            out[key] = value
        return out

    def home(self, c: int) -> str:
        """Where frozen chunk c's params live ("device", "host", "disk"; "" for a trainable chunk)."""
        return self.frozen_home[c] if self.frozen_home else ""

    def disk_reads(self) -> tuple[int, ...]:
        """The disk-homed chunks a step reads, in the order its moments fetch them."""
        return disk_reads(self.moments, self.frozen_home)

    def frozen_line(self) -> str | None:
        """Where the frozen base lives, in a sentence (None when nothing is frozen)."""
        if not self.frozen_home:
            return None
        parts = []
        for home, where in (("device", "on the device (no host copy)"), ("host", "in pinned host memory"),
                            ("disk", "on disk")):
            chunks = [c for c, h in enumerate(self.frozen_home) if h == home]
            if chunks or home != "disk":
                parts.append(f"{format_bytes(sum(self.chunk_bytes[c] for c in chunks))} in {len(chunks)} chunks "
                             f"{where}")
        line = "frozen base: " + ", ".join(parts)
        if "disk" in self.frozen_home:
            line += (f"; {format_bytes(self.disk_read_bytes)} read from disk per step "
                     f"({len(self.disk_reads())} reads) through {format_bytes(self.staging_bytes)} of staging buffers")
        return line

    @property
    def device_state_bytes(self) -> int:
        """The optimizer state the plan keeps on the device all step, per device."""
        return sum(b for b, d in zip(self.opt_state_bytes, self.opt_on_device) if d)

    def moved_line(self) -> str:
        """pstar-plan's line on the bytes a step moves, and how far ahead its copies are issued."""
        disk = f", {format_bytes(self.disk_read_bytes)} read from disk" if self.disk_read_bytes else ""
        ahead = f"; copies issued up to {self.prefetch_depth} moments ahead" if self.prefetch_depth > 1 else ""
        return (f"moved per step: {format_bytes(self.h2d_bytes)} host->device, {format_bytes(self.d2h_bytes)} "
                f"device->host{disk}{ahead}")

    def stage_inputs_line(self) -> str:
        """Where the stage inputs kept for the backward live, in a sentence (pstar-plan, summaries)."""
        if not self.input_bytes:
            return "stage inputs: none kept for the backward"
        where = ("all stay on the device" if not self.input_offload_bytes else
                 f"{format_bytes(self.input_offload_bytes)} of them go to pinned host memory after their forward "
                 "and come back before their backward")
        return f"stage inputs: {format_bytes(self.input_bytes)} per step kept for the backward; {where}"

    @property
    def resident_fraction(self) -> float:
        """Fraction of param chunks that never leave the device."""
        n = len(self.opt_on_device)
        moved = {item for m in self.moments for item in m.evict + m.fetch if item[0] == "param"}
        return sum(("param", c) not in moved for c in range(n)) / max(n, 1)


def residuals_line(shape: StepShape, plan: Plan) -> str:
    """The blocks that keep their vjp residuals and where, in a sentence ("" when none do)."""
    if not any(shape.residual_bytes):
        return ""
    where = ("with the stage inputs: on the device or in pinned host memory" if plan.input_offload_bytes else
             "on the device")
    return (f"blocks keeping their residuals: {sum(r > 0 for r in shape.residual_bytes)} of "
            f"{len(shape.stage_chunks) - 2}, {format_bytes(sum(shape.residual_bytes))} per micro-batch, {where}")
