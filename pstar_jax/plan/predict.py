"""Step time from the device's compute stream and its copy engines, given a machine's rates.

The planner compares candidate plans by this prediction, and sends streamed optimizer state
down far enough ahead (``state_leads``) that its copy hides under the compute of earlier moments.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from pstar_jax.plan.machine import Machine
from pstar_jax.plan.schedule import Access, StepShape, staged_after


class MomentCopies(Protocol):
    """What the prediction reads of a planned moment (replay.PlanMoment): when its copies are issued
    and how many bytes they move. placement.py imports this module, never the other way round."""
    prefetch: bool
    issued_at: int  # moments ahead its copies are issued (0: right before it)
    fetch: tuple
    h2d_bytes: int
    d2h_bytes: int


def issued_during(moments: Sequence[MomentCopies]) -> dict[int, list[int]]:
    """Moment t -> the later moments whose evictions and fetches are issued as t starts (right
    after its call is dispatched), in order: each prefetched moment u at t = u - lead. The
    executor, the evaluation and the prediction all issue them so."""
    out: dict[int, list[int]] = {}
    for u, m in enumerate(moments):
        if m.issued_at:
            out.setdefault(u - m.issued_at, []).append(u)
    return out


def window_capacity(moments: Sequence, u: int) -> int:
    """The device memory moment u's copies may use: the least capacity of the moments they are
    issued during (moments[u - lead] .. moments[u - 1]) and of u itself."""
    return min(m.capacity_bytes for m in moments[u - moments[u].issued_at:u + 1])


def compute_s(a: Access, shape: StepShape, machine: Machine) -> float:
    """A moment's predicted time on the device's compute stream: a host update computes elsewhere
    (``host_update_s``), so its moment takes none."""
    if a.phase == "adam":
        return shape.shard_numels[a.index] / machine.device_adam_params_per_s if a.needs else 0.0
    return a.flops / machine.flops_per_s


def host_update_s(a: Access, shape: StepShape, machine: Machine) -> float:
    """A moment's predicted time on the host's cores: a host update's (its grad is not on the device)."""
    if a.phase == "adam" and not a.needs:
        return shape.shard_numels[a.index] / machine.host_adam_params_per_s
    return 0.0


def state_leads(accesses: Sequence[Access], shape: StepShape, machine: Machine) -> list[int]:
    """Per chunk: how many moments ahead its streamed state must be sent down for the copy to hide
    under their compute (at least 1; the step's start at most)."""
    leads = [1] * shape.n_chunks
    for u, a in enumerate(accesses):
        if a.state_bytes_each_way:
            copy_s = a.state_bytes_each_way / machine.h2d_bytes_per_s
            covered, lead = 0.0, 0
            while lead < u and (lead == 0 or covered < copy_s):
                lead += 1
                covered += compute_s(accesses[u - lead], shape, machine)
            leads[a.index] = max(lead, 1)
    return leads


def predict_step_s(moments: Sequence[MomentCopies], accesses: Sequence[Access], shape: StepShape,
                   machine: Machine, homes: Sequence[str] = (), slots: int = 1) -> float:
    """Replay the step on the device's compute stream and its copy engines, in the executor's order.

    Each moment computes after the previous one and after its own inputs have arrived. Copies
    are issued when the executor issues them: a moment's evictions and fetches as the moment
    ``lead`` moments earlier starts when the plan prefetches it, else after the previous one
    (evictions and grads bound for host Adam go up first, then fetches come down into the room
    they freed); streamed state
    ``state_lead`` moments ahead, and back up after its update; final grads bound for host Adam
    go up after the moment that finished them. A copy waits for the copy engine of its direction;
    with ``machine.duplex`` False both directions share one, so a step never looks faster than
    one serial PCIe link allows.

    Host updates run one after another on the host's cores from the step's start (the previous
    step's backward sent their grads up and gave the norm); a host update's moment starts
    when the device is free and that update is done.

    A fetch of a chunk whose ``homes`` entry is "disk" waits for its read: the disk reads one
    chunk after another at ``machine.disk_read_bytes_per_s``, in fetch order, from the step's
    start, into a ring of ``slots`` buffers; a read waits for a free buffer, freed once the
    fetch ``slots`` reads earlier is on the device (engine/disk.DiskReader does the same)."""
    free = {"up": 0.0, "down": 0.0, "disk": 0.0}  # when each copy engine (and the disk) is next free
    released: list[float] = []  # per disk read, in order: when its fetch freed its buffer
    on_disk = "disk" in homes

    def copy(direction: str, after: float, seconds: float) -> float:
        start = max(after, free[direction] if machine.duplex else max(free["up"], free["down"]))
        for d in ((direction,) if machine.duplex else ("up", "down")):
            free[d] = start + seconds
        return start + seconds

    def read(item_bytes: int) -> float:  # the next disk read: when it is done
        k = len(released)
        start = max(free["disk"], released[k - slots] if k >= slots else 0.0)
        free["disk"] = start + item_bytes / machine.disk_read_bytes_per_s
        return free["disk"]

    def own_copies(t: int, at: float) -> float:
        m, a = moments[t], accesses[t]
        up = m.d2h_bytes - a.state_bytes_each_way - sent_up[t]
        if up:
            at = copy("up", at, up / machine.d2h_bytes_per_s)
        fetch = m.h2d_bytes - a.state_bytes_each_way
        from_disk = [it for it in m.fetch if it[0] == "param" and homes[it[1]] == "disk"] if on_disk else []
        fetch -= sum(map(shape.item_size, from_disk))
        done = copy("down", at, fetch / machine.h2d_bytes_per_s) if fetch else at
        for it in from_disk:  # each after its read
            done = copy("down", max(at, read(shape.item_size(it))), shape.item_size(it) / machine.h2d_bytes_per_s)
            released.append(done)
        return done

    staging = staged_after(accesses)
    state_ready: dict[int, float] = {}

    def stage(t: int, at: float) -> None:
        for u in staging.get(t, ()):
            state_ready[u] = copy("down", at, accesses[u].state_bytes_each_way / machine.h2d_bytes_per_s)

    sent_up = [sum(map(shape.item_size, a.to_host)) for a in accesses]  # always dirty: written by the moment
    host_done, host_free = {}, 0.0
    for t, a in enumerate(accesses):
        update_s = host_update_s(a, shape, machine)
        if update_s:
            host_free = host_done[t] = host_free + update_s

    issued = issued_during(moments)
    ready_at: dict[int, float] = {}
    stage(-1, 0.0)
    compute_start = compute_end = 0.0
    ready = 0.0  # when the current moment's own copies are done
    for t, (m, a) in enumerate(zip(moments, accesses)):
        compute = compute_s(a, shape, machine)
        if not m.prefetch:
            ready = own_copies(t, compute_end)
        compute_start = max(compute_end, ready, state_ready.get(t, 0.0), host_done.get(t, 0.0))
        compute_end = compute_start + compute + machine.call_s
        if a.state_bytes_each_way:
            copy("up", compute_end, a.state_bytes_each_way / machine.d2h_bytes_per_s)
        if sent_up[t]:
            copy("up", compute_end, sent_up[t] / machine.d2h_bytes_per_s)
        for u in issued.get(t, ()):  # the moments whose copies are issued as this one starts
            ready_at[u] = own_copies(u, compute_start)
        if t + 1 < len(moments) and moments[t + 1].prefetch:
            ready = ready_at.pop(t + 1)
        stage(t, compute_start)
    return max(compute_end, host_free, *free.values())
