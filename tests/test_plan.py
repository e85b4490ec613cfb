"""The planner: Belady never moves more than LRU or FIFO, equals brute force, never overflows."""

import itertools

from hypothesis import given, settings, strategies as st

from pstar_jax.machine import H200
from pstar_jax.plan import (Access, StepShape, _State, make_plan, plan_step, simulate,
                            step_accesses, victim_for)


def read_trace(draw_needs, n_items):
    return [Access("fwd", t, 0, tuple(("param", c) for c in needs), 0) for t, needs in enumerate(draw_needs)]


@st.composite
def traces(draw, max_items=6, max_len=10):
    n_items = draw(st.integers(2, max_items))
    width = draw(st.integers(1, 2))
    needs = draw(st.lists(st.lists(st.integers(0, n_items - 1), min_size=1, max_size=width, unique=True),
                          min_size=1, max_size=max_len))
    capacity = draw(st.integers(width, n_items))
    return read_trace(needs, n_items), n_items, capacity


def fetched_bytes(accesses, n_items, capacity, rule):
    state = _State({}, {("param", c) for c in range(n_items)})
    moments, _ = simulate(accesses, [capacity] * len(accesses), 1, state, victim_for(rule, accesses),
                          prefetch=False)
    for m in moments:
        assert len(m.evict) + m.chunk_bytes >= 0
        assert m.chunk_bytes <= capacity, "the plan overflowed the device"
    return sum(m.h2d_bytes for m in moments)


def brute_force(accesses, n_items, capacity):
    """The fewest fetches over every eviction choice (read-only trace: evictions are free)."""
    best = [float("inf")]

    def go(t, resident, cost):
        if cost >= best[0]:
            return
        if t == len(accesses):
            best[0] = cost
            return
        needs = set(accesses[t].needs)
        missing = needs - resident
        keep = resident | missing
        over = len(keep) - capacity
        if over <= 0:
            go(t + 1, keep, cost + len(missing))
            return
        for out in itertools.combinations(sorted(resident - needs), over):
            go(t + 1, keep - set(out), cost + len(missing))
    go(0, frozenset(), 0)
    return best[0]


@settings(max_examples=150, deadline=None)
@given(traces())
def test_belady_moves_no_more_than_lru_or_fifo(trace):
    accesses, n, cap = trace
    opt = fetched_bytes(accesses, n, cap, "belady")
    assert opt <= fetched_bytes(accesses, n, cap, "lru")
    assert opt <= fetched_bytes(accesses, n, cap, "fifo")


@settings(max_examples=100, deadline=None)
@given(traces(max_items=5, max_len=8))
def test_belady_equals_brute_force_optimum(trace):
    accesses, n, cap = trace
    assert fetched_bytes(accesses, n, cap, "belady") == brute_force(accesses, n, cap)


def gpt_like_shape(n_blocks, chunks_per_block, micro_batches=1, non_model=(100, 300)):
    """embed in chunk 0, blocks in consecutive chunks (sharing an edge chunk), head reads 0 and the last."""
    stage_chunks = [(0,)]
    c = 0
    for _ in range(n_blocks):
        stage_chunks.append(tuple(range(c, c + chunks_per_block + 1)))
        c += chunks_per_block
    stage_chunks.append((0, c))
    n = c + 1
    S = len(stage_chunks)
    lo, hi = non_model
    return StepShape(tuple(stage_chunks), tuple([lo] * (S - 1)), hi, tuple([hi] * (S - 1)),
                     tuple([1e9] * (S - 1)), 1e9, tuple([2e9] * (S - 1)), n, 1000, 100, 600, micro_batches)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 2), st.integers(0, 4000), st.integers(0, 40))
def test_plan_never_exceeds_device_capacity(n_blocks, per_block, micro, extra, k):
    """At every moment: chunks + optimizer state + non-model data <= device capacity, or no plan."""
    shape = gpt_like_shape(n_blocks, per_block, micro)
    device = 300 + 2 * (per_block + 1) * 100 + extra
    opt = [c < k for c in range(shape.n_chunks)]
    plan = plan_step(shape, device, 10**9, H200, opt)
    if not plan.fits:
        assert "runs out" in plan.problem
        return
    accesses = step_accesses(shape, opt)
    assert len(plan.moments) == len(accesses)
    for m, a in zip(plan.moments, accesses):
        assert m.chunk_bytes + a.non_model_bytes + sum(opt) * 600 <= device
        assert set(a.needs) <= set(m.fetch) | set(m.evict) | set(a.needs)  # shape of the record
    assert plan.peak_device_bytes <= device


def test_plan_is_periodic_and_counts_traffic():
    """A step started from the plan's initial state ends there, moving the predicted bytes."""
    shape = gpt_like_shape(4, 2)
    plan = make_plan(shape, 300 + 900, 10**9, H200)
    assert plan.fits and plan.h2d_bytes > 0
    accesses = step_accesses(shape, plan.opt_on_device, plan.opt_streamed, plan.state_leads)
    start = _State(dict(plan.initial_device),
                   {("grad", c) for c in range(shape.n_chunks)} - {i for i, d in plan.initial_device if d})
    moments, end = simulate(accesses, [m.capacity_bytes for m in plan.moments], shape.item_bytes, start,
                            victim_for("belady", accesses))
    assert sum(m.h2d_bytes for m in moments) == plan.h2d_bytes
    assert tuple(sorted(end.device.items())) == plan.initial_device


def test_everything_fits_moves_nothing():
    shape = gpt_like_shape(3, 2)
    plan = make_plan(shape, 10**6, 10**9, H200)
    assert plan.fits and plan.h2d_bytes == 0 and plan.d2h_bytes == 0 and all(plan.opt_on_device)
    assert plan.resident_fraction == 1.0


def test_too_small_device_names_the_moment():
    plan = make_plan(gpt_like_shape(3, 2), 500, 10**9, H200)
    assert not plan.fits and "device memory runs out at" in plan.problem


def test_host_memory_shortfall_is_reported():
    plan = make_plan(gpt_like_shape(3, 2), 1200, 1000, H200)
    assert not plan.fits and "host memory runs out" in plan.problem


def test_slow_host_adam_makes_the_plan_stream_state_through_the_device():
    """When host Adam is slow and the copies are fast, auto picks streamed updates for host state."""
    import dataclasses as dc
    shape = gpt_like_shape(4, 2)
    slow_host = dc.replace(H200, host_adam_params_per_s=1e3)
    plan = make_plan(shape, 300 + 900 + 600, 10**9, slow_host)
    assert plan.fits and any(plan.opt_streamed)
    assert not any(s and d for s, d in zip(plan.opt_streamed, plan.opt_on_device))
    host_only = plan_step(shape, 300 + 900 + 600, 10**9, slow_host, plan.opt_on_device)
    assert plan.predicted_step_s < host_only.predicted_step_s


def test_each_update_comes_right_before_the_first_forward_that_reads_its_chunk():
    shape = gpt_like_shape(3, 2, micro_batches=2)
    accesses = step_accesses(shape, [True] * shape.n_chunks)
    adam = [t for t, a in enumerate(accesses) if a.phase == "adam"]
    assert sorted(accesses[t].index for t in adam) == list(range(shape.n_chunks))
    for t in adam:
        c = accesses[t].index
        reader = next(u for u in range(t, len(accesses)) if accesses[u].phase != "adam")
        assert ("param", c) in accesses[reader].needs and accesses[reader].micro == 0
        assert all(("param", c) not in a.needs for a in accesses[:t])  # nothing reads it earlier


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 3000), st.integers(0, 30), st.booleans())
def test_predicted_time_lies_between_full_overlap_and_none(n_blocks, per_block, extra, k, stream):
    """Never faster than the compute alone or the link alone, never slower than both in series;
    a link that copies both ways at once is never slower."""
    import dataclasses as dc

    from pstar_jax.plan import compute_s, predict_step_s
    shape = gpt_like_shape(n_blocks, per_block)
    slow_link = dc.replace(H200, h2d_bytes_per_s=1e3, d2h_bytes_per_s=1e3, flops_per_s=1e12)
    opt = [c < k for c in range(shape.n_chunks)]
    plan = plan_step(shape, 300 + 2 * (per_block + 1) * 100 + extra, 10**9, slow_link, opt,
                     streamed=[stream] * shape.n_chunks)
    if not plan.fits:
        return
    accesses = step_accesses(shape, opt, plan.opt_streamed, plan.state_leads)
    compute = sum(compute_s(a, shape, slow_link) for a in accesses)
    link = plan.h2d_bytes / 1e3 + plan.d2h_bytes / 1e3
    eps = 1e-9 * (compute + link)
    assert max(compute, link) - eps <= plan.predicted_step_s <= compute + link + eps
    duplex = predict_step_s(plan.moments, accesses, shape, dc.replace(slow_link, duplex=True))
    assert max(compute, plan.h2d_bytes / 1e3, plan.d2h_bytes / 1e3) - eps <= duplex <= plan.predicted_step_s + eps


def test_streamed_state_goes_down_ahead_far_enough_to_hide_its_copy():
    """When one moment's compute is shorter than a state copy, the state is sent several moments
    ahead: faster than one moment ahead, for more device memory."""
    import dataclasses as dc
    shape = gpt_like_shape(6, 1)
    machine = dc.replace(H200, h2d_bytes_per_s=600 / 3e-6, d2h_bytes_per_s=600 / 3e-6, flops_per_s=1e15)  # copy 3 us, stage 1-2 us
    n = shape.n_chunks
    hidden = plan_step(shape, 10**5, 10**9, machine, [False] * n, streamed=[True] * n)
    near = plan_step(shape, 10**5, 10**9, machine, [False] * n, streamed=[True] * n, hide_state=False)
    assert hidden.fits and near.fits and max(hidden.state_leads) > 1 and set(near.state_leads) == {1}
    assert hidden.predicted_step_s < near.predicted_step_s
    assert hidden.peak_device_bytes > near.peak_device_bytes
    assert (hidden.h2d_bytes, hidden.d2h_bytes) == (near.h2d_bytes, near.d2h_bytes)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 2), st.integers(0, 3000), st.integers(0, 40))
def test_a_grad_written_after_a_fetch_is_dirty_again(n_blocks, per_block, micro, extra, k):
    """A grad evicted, fetched back and accumulated into has no valid host copy: evicting it or
    sending it to host Adam must cost a copy (the executor pays one). So no grad is ever clean on
    the device where a step starts, and moving it is counted."""
    shape = gpt_like_shape(n_blocks, per_block, micro)
    opt = [c < k for c in range(shape.n_chunks)]
    plan = plan_step(shape, 300 + 2 * (per_block + 1) * 100 + extra, 10**9, H200, opt)
    if plan.fits:
        assert all(dirty for (kind, _), dirty in plan.initial_device if kind == "grad")
