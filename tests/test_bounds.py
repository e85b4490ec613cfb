"""Chunks of several sizes: the memory bounds stay bounds (never above a replayed plan), and plans
keep every moment within its capacity and move no more than LRU or FIFO would."""

import itertools

from hypothesis import given, settings, strategies as st

from pstar_jax.plan.bounds import could_fit, host_needed_bytes, most_bytes_within
from pstar_jax.plan.machine import H200
from pstar_jax.plan.placement import fewest_bytes, make_plan, plan_step
from pstar_jax.plan.schedule import step_accesses
from step_shapes import frozen_shape, gpt_like_shape, sized_shape


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([100, 250, 600, 601]), max_size=9), st.integers(-10, 4000))
def test_the_most_bytes_within_a_room_is_that_of_the_best_subset(sizes, room):
    best = max((sum(pick) for n in range(len(sizes) + 1) for pick in itertools.combinations(sizes, n)
                if sum(pick) <= room), default=0)
    assert most_bytes_within(sizes, room) == best


def test_past_its_combinations_it_bounds_instead(monkeypatch):
    import pstar_jax.plan.bounds as bounds
    monkeypatch.setattr(bounds, "MAX_COMBINATIONS", 3)
    sizes = [100] * 5 + [250] * 3 + [70]  # (3 + 1) * (1 + 1) combinations of the rare sizes
    assert most_bytes_within(sizes, 1000) == 1000 and most_bytes_within(sizes, 10**6) == sum(sizes)


def two_sizes(n_blocks, per_block, micro, big, mask, inputs=0):
    """gpt_like_shape with the chunks in ``mask`` of ``big`` bytes (items of 100 otherwise)."""
    base = gpt_like_shape(n_blocks, per_block, micro, input_bytes=inputs)
    return sized_shape(base, [big if mask >> c & 1 else 100 for c in range(base.n_chunks)])


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.sampled_from([40, 250, 430]),
       st.integers(0, 2**13 - 1), st.integers(0, 4000), st.integers(0, 20), st.integers(0, 2**13 - 1),
       st.sampled_from([0, 60]))
def test_plans_of_two_sizes_stay_within_capacity_and_above_the_host_bound(n_blocks, per_block, micro, big, mask,
                                                                          extra, k, frozen_mask, inputs):
    """Every moment holds its chunks (of their own sizes), the optimizer state kept on the device
    and its non-model data within the device; the plan ends the step where it started; the host
    bound is never above the replayed host peak, nor could_fit false where a plan fits."""
    shape = two_sizes(n_blocks, per_block, micro, big, mask, inputs)
    frozen = [bool(frozen_mask >> c & 1) for c in range(shape.n_chunks)]
    if not all(frozen):
        shape = frozen_shape(shape, frozen)
    device = 300 + 2 * (per_block + 1) * max(shape.chunk_bytes) + extra
    opt = [c < k for c in range(shape.n_chunks)]
    plan = plan_step(shape, device, 10**9, H200, opt)
    if not plan.fits:
        assert "runs out" in plan.problem
        return
    assert could_fit(shape, device, plan.peak_host_bytes)
    assert host_needed_bytes(shape, device, plan.opt_on_device, plan.opt_streamed) <= plan.peak_host_bytes
    accesses = step_accesses(shape, plan.opt_on_device)
    resident = {item for item, _ in plan.initial_device}
    for m, a in zip(plan.moments, accesses):
        resident = (resident - set(m.evict)) | set(m.fetch) | set(a.needs)
        assert sum(map(shape.item_size, resident)) == m.chunk_bytes + m.input_bytes
        assert m.chunk_bytes + m.input_bytes + a.non_model_bytes + plan.device_state_bytes <= device
        resident -= set(a.to_host) | set(a.consumes) | set(a.drops)
        resident |= set(a.creates_device)
    assert resident == {item for item, _ in plan.initial_device}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.sampled_from([40, 250]),
       st.integers(0, 2**13 - 1), st.integers(0, 1500), st.integers(0, 20))
def test_a_plan_of_two_sizes_moves_no_more_than_lru_or_fifo(n_blocks, per_block, micro, big, mask, extra, k):
    shape = two_sizes(n_blocks, per_block, micro, big, mask)
    device = 300 + 2 * (per_block + 1) * max(shape.chunk_bytes) + extra
    plan = fewest_bytes(plan_step(shape, device, 10**9, H200, [c < k for c in range(shape.n_chunks)]),
                        shape, 10**9, H200)
    if not plan.fits:
        return
    for rule in ("lru", "fifo"):
        other = plan_step(shape, device, 10**9, H200, plan.opt_on_device, victim_rule=rule,
                          streamed=plan.opt_streamed, leads=plan.state_leads)
        assert not other.fits or plan.h2d_bytes + plan.d2h_bytes <= other.h2d_bytes + other.d2h_bytes, rule


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 2), st.sampled_from([40, 250]), st.integers(0, 2**13 - 1),
       st.integers(300, 6000), st.integers(300, 6000))
def test_the_search_fits_exactly_when_its_first_fit_does(n_blocks, per_block, big, mask, device, host):
    """make_plan's bounds skip only candidates that cannot fit: asking for the first fit and for
    the best plan agree on whether anything fits, with chunks of two sizes."""
    shape = two_sizes(n_blocks, per_block, 1, big, mask)
    assert make_plan(shape, device, host, H200, first_fit=True).fits == make_plan(shape, device, host, H200).fits
