"""The plan of a forward-only pass between two training steps (a held-out loss).

It places chunks by the same replay and eviction rule as a training step (placement.py), starting
where the training plan starts a step and ending there, with frozen chunks in the homes the
training plan gave them.
"""

from __future__ import annotations

from pstar_jax.plan.eviction import policy_for
from pstar_jax.plan.homes import DISK_SLOTS, disk_reads
from pstar_jax.plan.machine import Machine
from pstar_jax.plan.planned import Plan, shortfall
from pstar_jax.plan.predict import predict_step_s
from pstar_jax.plan.replay import Infeasible, PlanMoment, ReplayState, moment_name, simulate
from pstar_jax.plan.schedule import StepShape, forward_accesses


def plan_forward(shape: StepShape, training: Plan, host_bytes: int, machine: Machine,
                 victim_rule: str = "belady") -> Plan:
    """The plan of a forward-only pass (held-out loss) run between two steps of ``training``.

    ``shape`` is a forward-only shape (trace.trace_forward). The pass starts where ``training``
    starts a step (its slots holding current params, as after a flush), under the same device
    budget beside the optimizer state that plan keeps on the device, and places chunks by the
    same replay and eviction rule, with no gradients and no optimizer moments. Its last moment
    ("restore") evicts what the pass brought in and fetches back what it evicted, so the next
    step finds the placement its plan starts from. Moments are those of
    ``schedule.forward_accesses(shape, resident)``; their items are ("param", c), the params that
    sit in slot ("slot", c) between steps (``initial_device`` keeps the slots' names). Frozen
    chunks keep the homes ``training`` gave them: a device home is never evicted, a disk home is
    read before each fetch through the same staging buffers."""
    start = {("param", c): dirty for (_, c), dirty in training.initial_device}
    opt_device = training.device_state_bytes
    host_opt = sum(training.opt_state_bytes) - opt_device
    accesses = forward_accesses(shape, tuple(start))
    capacity = [training.device_capacity_bytes - a.non_model_bytes - opt_device for a in accesses]
    homes = training.frozen_home or ("",) * shape.n_chunks
    clean = {("param", c) for c in range(shape.n_chunks) if not start.get(("param", c), False)}
    state = ReplayState(start, {it for it in clean if not homes[it[1]]}, frozenset(it for it in clean if homes[it[1]]),
                        pinned=frozenset(("param", c) for c, h in enumerate(homes) if h == "device"))

    def plan(moments=(), problem=None, peak_device=0, peak_host=0, predicted_s=float("inf"), read=0) -> Plan:
        return Plan(tuple(moments), training.initial_device, training.opt_on_device, training.opt_streamed,
                    training.state_leads, shape.chunk_bytes, training.opt_state_bytes,
                    training.device_capacity_bytes, sum(m.h2d_bytes for m in moments),
                    sum(m.d2h_bytes for m in moments), peak_device, peak_host, predicted_s, problem is None, problem,
                    frozen_home=training.frozen_home, disk_read_bytes=read, staging_bytes=training.staging_bytes)
    try:
        for a, room in zip(accesses, capacity):
            own = sum(map(shape.item_size, a.needs))
            if own > room:
                raise Infeasible(moment_name(a), own - room)
        # Belady sees the restore's needs, so it keeps what the next step starts with where it can.
        moments, state = simulate(accesses[:-1], capacity[:-1], shape.item_size, state,
                                  policy_for(victim_rule, accesses))
    except Infeasible as err:
        return plan(problem=f"device memory runs out during evaluation at {err} by {shortfall(err.shortfall)}")
    evict = tuple(sorted(it for it in state.device if it not in start))
    fetch = tuple(sorted(it for it in start if it not in state.device))
    written_back = [it for it in evict if state.device[it]]  # never any: only start items are dirty
    moments.append(PlanMoment("restore", -1, 0, evict, fetch, False, capacity[-1], sum(map(shape.item_size, start)),
                              0, sum(map(shape.item_size, fetch)), sum(map(shape.item_size, written_back))))
    peak_device = max(m.chunk_bytes + a.non_model_bytes + opt_device for m, a in zip(moments, accesses))
    peak_host = (state.peak_host_bytes + host_opt + training.staging_bytes
                 + sum(b for b, h in zip(shape.chunk_bytes, homes) if h == "host"))
    problem = (f"host memory runs out during evaluation by {shortfall(peak_host - host_bytes)}"
               if peak_host > host_bytes else None)
    return plan(moments, problem, peak_device, peak_host,
                predict_step_s(moments, accesses, shape, machine, homes, DISK_SLOTS),
                sum(shape.chunk_bytes[c] for c in disk_reads(moments, homes)))


__all__ = ["plan_forward"]
