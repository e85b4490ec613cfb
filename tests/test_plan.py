"""The planner: plans never overflow the device, repeat step after step, and choose reproducibly."""

import dataclasses as dc
import json

import pytest

from hypothesis import example, given, settings, strategies as st

from pstar_jax.plan.machine import H200
from pstar_jax.plan.eviction import policy_for
from pstar_jax.plan.bounds import host_needed_bytes
from pstar_jax.plan.placement import choose, make_plan, plan_step
from pstar_jax.plan.replay import ReplayState, simulate
from pstar_jax.plan.schedule import step_accesses
from step_shapes import frozen_shape, gpt_like_shape

from pstar_jax.config import format_bytes
from tests import plan_goldens


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
    resident = {item for item, _ in plan.initial_device}
    for m, a in zip(plan.moments, accesses):
        assert m.chunk_bytes + a.non_model_bytes + sum(opt) * 600 <= device
        assert not set(m.evict) & set(m.fetch) and set(m.evict) <= resident and not set(m.fetch) & resident
        resident = (resident - set(m.evict)) | set(m.fetch)
        assert {it for it in a.needs if it[0] == "param"} <= resident, "a stage ran without its params"
        resident |= set(a.needs)  # grads are created at their first use
        assert sum(map(shape.item_size, resident)) == m.chunk_bytes
        resident -= set(a.to_host) | set(a.consumes) | set(a.drops)
        resident |= set(a.creates_device)
    assert resident == {item for item, _ in plan.initial_device}, "the step does not end where it started"
    assert plan.peak_device_bytes <= device


def test_plan_is_periodic_and_counts_traffic():
    """A step started from the plan's initial state ends there, moving the predicted bytes."""
    shape = gpt_like_shape(4, 2)
    plan = make_plan(shape, 300 + 900, 10**9, H200)
    assert plan.fits and plan.h2d_bytes > 0
    accesses = step_accesses(shape, plan.opt_on_device, plan.opt_streamed, plan.state_leads)
    start = ReplayState(dict(plan.initial_device),
                   {("slot", c) for c in range(shape.n_chunks)} - {i for i, d in plan.initial_device if d})
    moments, end = simulate(accesses, [m.capacity_bytes for m in plan.moments], shape.item_size, start,
                            policy_for("belady", accesses))
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
    shape = gpt_like_shape(4, 2)
    slow_host = dc.replace(H200, host_adam_params_per_s=1e3)
    plan = make_plan(shape, 300 + 900 + 600, 10**9, slow_host)
    assert plan.fits and any(plan.opt_streamed)
    assert not any(s and d for s, d in zip(plan.opt_streamed, plan.opt_on_device))
    host_only = plan_step(shape, 300 + 900 + 600, 10**9, slow_host, plan.opt_on_device)
    assert plan.predicted_step_s < host_only.predicted_step_s


def test_streamed_state_goes_down_ahead_far_enough_to_hide_its_copy():
    """When one moment's compute is shorter than a state copy, the state is sent several moments
    ahead: faster than one moment ahead, for more device memory."""
    shape = gpt_like_shape(6, 1)
    # a state copy takes 3 us, a stage 1-2 us
    machine = dc.replace(H200, h2d_bytes_per_s=600 / 3e-6, d2h_bytes_per_s=600 / 3e-6, flops_per_s=1e15)
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
        assert all(dirty for (kind, _), dirty in plan.initial_device if kind == "slot")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 2), st.integers(0, 4000), st.integers(0, 6000))
def test_first_fit_answers_as_make_plan(n_blocks, per_block, micro, extra, host):
    """The searches' quick question (does anything fit?) gets make_plan's answer, and the host
    bound plan_step rejects with before replaying never exceeds what a replayed plan needs."""
    shape = gpt_like_shape(n_blocks, per_block, micro)
    device = 300 + 2 * (per_block + 1) * 100 + extra
    full = make_plan(shape, device, host, H200)
    assert make_plan(shape, device, host, H200, first_fit=True).fits == full.fits
    n = shape.n_chunks
    for k in (0, n // 2, n):
        for stream in (False, True):
            opt, streamed = [c < k for c in range(n)], [stream and c >= k for c in range(n)]
            plan = plan_step(shape, device, 10**9, H200, opt, streamed=streamed)
            if plan.fits:
                assert host_needed_bytes(shape, device, opt, streamed) <= plan.peak_host_bytes


def test_near_ties_go_to_the_plan_that_keeps_more_on_the_device():
    """Two fitting plans predicted within the margin: the one with more resident chunks wins
    whichever is a hair faster, and whichever comes first; beyond the margin the faster wins."""
    shape = gpt_like_shape(4, 2)
    resident = plan_step(shape, 10**6, 10**9, H200, [True] * shape.n_chunks)
    moving = plan_step(shape, 300 + 900, 10**9, H200, [False] * shape.n_chunks)
    assert resident.fits and moving.fits and resident.resident_fraction > moving.resident_fraction
    for factor in (0.97, 1.0, 1.03):
        near = dc.replace(moving, predicted_step_s=resident.predicted_step_s * factor)
        assert choose([near, resident]) is resident and choose([resident, near]) is resident
    far = dc.replace(moving, predicted_step_s=resident.predicted_step_s * 0.9)
    assert choose([far, resident]) is far and choose([resident, far]) is far
    assert choose([dc.replace(resident, fits=False, predicted_step_s=1e-9), far]) is far


def test_same_inputs_give_the_same_plan():
    shape = gpt_like_shape(5, 2, micro_batches=2)
    a = make_plan(shape, 300 + 1100, 10**9, H200)
    b = make_plan(shape, 300 + 1100, 10**9, H200)
    assert a.fits and a == b and a.to_json() == b.to_json()


def test_host_shortfall_is_never_that_of_a_placement_the_device_cannot_hold():
    """A placement whose device-resident optimizer state alone overflows the device is refused as a
    device problem, so the host shortfall reported is one a device-feasible placement has."""
    shape = gpt_like_shape(3, 2)
    too_much = plan_step(shape, 1200, 10**9, H200, [True] * shape.n_chunks)
    assert not too_much.fits and too_much.problem.startswith("device memory runs out by")
    plan = make_plan(shape, 1200, 1000, H200)
    assert not plan.fits and plan.problem.startswith("host memory runs out")
    assert plan.device_state_bytes < 1200


def test_mixed_optimizer_placement_when_it_is_faster():
    """Device state for the first chunks, streamed state next, host updates for the chunks the
    next forward needs last: where the host is too slow to update everything beside the forward
    and the link too slow to stream everything, the planner finds the mix, faster than any plan
    that puts all the rest one way."""
    import dataclasses as dc
    shape = gpt_like_shape(6, 1)
    n = shape.n_chunks
    stage_s = 1e9 / H200.flops_per_s
    machine = dc.replace(H200, host_adam_params_per_s=shape.shard_numels[0] / (3 * stage_s), call_s=0.0,
                         h2d_bytes_per_s=shape.opt_state_bytes[0] / (2 * stage_s),
                         d2h_bytes_per_s=shape.opt_state_bytes[0] / (2 * stage_s))
    device = 300 + 2 * n * 100 + 600
    plan = make_plan(shape, device, 10**9, machine)
    host = [not d and not s for d, s in zip(plan.opt_on_device, plan.opt_streamed)]
    assert plan.fits and any(plan.opt_streamed) and any(host)
    k, b = sum(plan.opt_on_device), n - sum(host)
    assert list(plan.opt_on_device) == [c < k for c in range(n)] and list(plan.opt_streamed) == [k <= c < b for c in range(n)]
    pure = [plan_step(shape, device, 10**9, machine, [c < j for c in range(n)], streamed=[stream] * n)
            for j in range(n + 1) for stream in (False, True)]
    assert plan.predicted_step_s * 1.05 < min(p.predicted_step_s for p in pure if p.fits)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.integers(0, 3000), st.integers(0, 2**12 - 1))
def test_frozen_chunks_are_read_only_and_free_to_evict(n_blocks, per_block, micro, extra, mask):
    """A frozen chunk is one clean item ("param", c): never a slot, never updated, never dirty, so
    no eviction of it writes anything back; the plan still keeps the device within capacity and
    ends the step where it started, and host memory above its lower bound."""
    base = gpt_like_shape(n_blocks, per_block, micro)
    frozen = tuple(bool(mask >> c & 1) for c in range(base.n_chunks))
    if all(frozen):
        frozen = (False,) + frozen[1:]
    shape = frozen_shape(base, frozen)
    device = 300 + 2 * (per_block + 1) * 100 + extra
    plan = plan_step(shape, device, 10**9, H200, [True] * shape.n_chunks)  # frozen chunks: no state to place
    assert not any(d for c, d in enumerate(plan.opt_on_device) if frozen[c])
    if not plan.fits:
        return
    accesses = step_accesses(shape, plan.opt_on_device)
    frozen_items = {("param", c) for c in range(shape.n_chunks) if frozen[c]}
    dirty = {item: d for item, d in plan.initial_device}
    assert not any(dirty.get(item) for item in frozen_items)
    for m, a in zip(plan.moments, accesses):
        assert not any(frozen[c] for kind, c in a.needs if kind == "slot")
        assert not (a.phase == "adam" and frozen[a.index])
        assert not frozen_items & set(a.drops + a.consumes + a.creates_device + a.creates_host)
        assert m.chunk_bytes + a.non_model_bytes + sum(plan.opt_on_device) * 600 <= device
        for item in m.evict:
            dirty.pop(item)
        dirty.update((item, False) for item in m.fetch)
        dirty.update((item, True) for item in a.needs if item[0] == "slot")
        for item in a.to_host + a.consumes + a.drops:
            dirty.pop(item, None)
        dirty.update((item, True) for item in a.creates_device)
    assert set(dirty) == {item for item, _ in plan.initial_device}
    bound = host_needed_bytes(shape, device, plan.opt_on_device, plan.opt_streamed)
    assert bound <= plan.peak_host_bytes
    # One home each: a device home is on the device at the start and no moment moves it; a host
    # home is what the host holds for it all step, on top of the replay's own peak.
    moved = {item for m in plan.moments for item in m.evict + m.fetch}
    at_start = {item for item, _ in plan.initial_device}
    for c, home in enumerate(plan.frozen_home):
        assert home == ("" if not frozen[c] else "device" if ("param", c) in at_start - moved else "host")
    host_homes = sum(100 for home in plan.frozen_home if home == "host")
    resident_plan = plan_step(shape, device, 10**9, H200, plan.opt_on_device, streamed=plan.opt_streamed,
                              leads=plan.state_leads)
    assert resident_plan.peak_host_bytes == plan.peak_host_bytes >= host_homes


def test_frozen_chunks_the_device_holds_all_step_need_no_host_copy():
    """A frozen base that the device can hold whole fits beside a host too small for it: only the
    chunks that move keep a pinned copy (it did not fit while every frozen chunk kept one)."""
    base = gpt_like_shape(4, 2, 1)
    shape = frozen_shape(base, [c > 0 for c in range(base.n_chunks)])  # the first chunk trains
    frozen = sum(shape.is_frozen(c) for c in range(shape.n_chunks))
    roomy = plan_step(shape, 10**6, 10**9, H200, [True] * shape.n_chunks)
    assert set(roomy.frozen_home) == {"", "device"} and roomy.frozen_home.count("device") == frozen
    host = 100 * frozen // 2  # half the base's bytes: enough once device homes hold no copy
    plan = make_plan(shape, 10**6, host, H200)
    assert plan.fits and plan.peak_host_bytes <= host and "host" not in plan.frozen_home, plan.problem
    assert plan.frozen_line().startswith(f"frozen base: {format_bytes(100 * frozen)} in {frozen} chunks on the device")
    tight = make_plan(shape, 900, 10**9, H200)  # now the base moves: its moving chunks need pinned copies
    assert tight.fits and "host" in tight.frozen_home
    assert tight.peak_host_bytes >= 100 * tight.frozen_home.count("host")
    assert not make_plan(shape, 900, host, H200).fits  # and those copies do not fit the small host


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 2), st.integers(0, 4000), st.integers(0, 40),
       st.sampled_from([30, 100, 250]))
def test_stage_inputs_are_placed_within_capacity_and_never_outlive_the_step(n_blocks, per_block, micro, extra, k,
                                                                          input_bytes):
    """With stage inputs as items of their own size: at every moment chunks + stage inputs +
    optimizer state + non-model data <= device, each moment's inputs are on the device when it runs,
    the moment's input_bytes are those resident, the step starts and ends with none, every input
    sent to the host comes back exactly once (before its backward), and what goes up is counted in
    the plan's d2h bytes and its input_offload_bytes."""
    shape = gpt_like_shape(n_blocks, per_block, micro, input_bytes=input_bytes)
    device = 300 + 2 * (per_block + 1) * 100 + input_bytes + extra
    opt = [c < k for c in range(shape.n_chunks)]
    plan = plan_step(shape, device, 10**9, H200, opt)
    if not plan.fits:
        assert "runs out" in plan.problem
        return
    accesses = step_accesses(shape, opt)
    size = shape.item_size
    resident = {item for item, _ in plan.initial_device}
    assert not any(item[0] == "act" for item in resident)
    went_up, came_down = [], []
    for m, a in zip(plan.moments, accesses):
        resident = (resident - set(m.evict)) | set(m.fetch)
        went_up += [it for it in m.evict if it[0] == "act"]
        came_down += [it for it in m.fetch if it[0] == "act"]
        resident |= set(a.needs)
        acts = sum(size(it) for it in resident if it[0] == "act")
        assert m.input_bytes == acts and m.chunk_bytes == sum(size(it) for it in resident) - acts
        assert m.chunk_bytes + m.input_bytes + a.non_model_bytes + sum(opt) * 600 <= device
        resident -= set(a.to_host) | set(a.consumes) | set(a.drops)
        resident |= set(a.creates_device)
    assert not any(item[0] == "act" for item in resident)
    assert sorted(went_up) == sorted(came_down) and len(set(went_up)) == len(went_up)
    assert plan.input_offload_bytes == sum(map(size, went_up)) <= plan.d2h_bytes
    assert plan.input_bytes == shape.input_bytes_per_step


def test_offloading_stage_inputs_fits_a_step_that_keeping_them_cannot_and_costs_their_copies():
    """Stage inputs far larger than the chunks: a device below the working memory of a step that
    keeps them all (``busiest_working_bytes``) fits by sending them to the host, with their bytes
    moved both ways and in the predicted time (a slower link predicts a slower step); a host too
    small for them is the limit, said as host memory running out."""
    shape = gpt_like_shape(6, 1, input_bytes=400)
    device = 2000
    assert device < shape.busiest_working_bytes
    plan = make_plan(shape, device, 10**9, H200)
    assert plan.fits and plan.input_offload_bytes >= 400 and plan.peak_device_bytes <= device
    assert plan.h2d_bytes >= plan.input_offload_bytes and plan.d2h_bytes >= plan.input_offload_bytes
    slow = dc.replace(H200, h2d_bytes_per_s=H200.h2d_bytes_per_s / 1e4, d2h_bytes_per_s=H200.d2h_bytes_per_s / 1e4)
    slowed = plan_step(shape, device, 10**9, slow, plan.opt_on_device, streamed=plan.opt_streamed)
    assert slowed.input_offload_bytes == plan.input_offload_bytes
    assert slowed.predicted_step_s >= slowed.h2d_bytes / slow.h2d_bytes_per_s  # one copy engine down, in series
    host_for_chunks = plan.peak_host_bytes - plan.input_offload_bytes // 2
    short = plan_step(shape, device, host_for_chunks, H200, plan.opt_on_device, streamed=plan.opt_streamed)
    assert not short.fits and short.problem.startswith("host memory runs out")
    roomy = make_plan(shape, 10**6, 10**9, H200)
    assert roomy.input_offload_bytes == 0 and roomy.h2d_bytes == roomy.d2h_bytes == 0


def moved(plan):
    return plan.h2d_bytes + plan.d2h_bytes


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.sampled_from([0, 50, 150, 250]),
       st.integers(0, 1500), st.integers(0, 20), st.lists(st.booleans(), min_size=14, max_size=14))
def test_a_plan_never_moves_more_than_lru_fifo_or_streaming_under_its_rules(n_blocks, per_block, micro, inputs,
                                                                           extra, k, stream):
    """Under one optimizer placement and its state leads, the plan an engine gets moves no more
    bytes than LRU or FIFO eviction at its capacity, nor than streaming every item at every use."""
    from pstar_jax.plan.placement import fewest_bytes
    shape = gpt_like_shape(n_blocks, per_block, micro, input_bytes=inputs)
    device = 300 + 2 * (per_block + 1) * 100 + extra
    opt = [c < k for c in range(shape.n_chunks)]
    streamed = [c >= k and s for c, s in enumerate(stream[:shape.n_chunks])]
    plan = fewest_bytes(plan_step(shape, device, 10**9, H200, opt, streamed=streamed), shape, 10**9, H200)
    if not plan.fits:
        return
    same = dict(streamed=plan.opt_streamed, leads=plan.state_leads)
    for rule in ("belady", "lru", "fifo"):
        other = plan_step(shape, device, 10**9, H200, plan.opt_on_device, victim_rule=rule, **same)
        assert not other.fits or moved(plan) <= moved(other), rule
    streaming = plan_step(shape, device, 10**9, H200, plan.opt_on_device, streaming=True, **same)
    assert streaming.fits and moved(plan) <= moved(streaming)


def test_where_belady_moves_more_than_lru_the_plan_is_lrus():
    """Furthest next use first loses to LRU here (stage inputs 2.5 chunks' size beside the chunks):
    the plan is the one that moves less."""
    from pstar_jax.plan.placement import fewest_bytes
    shape = gpt_like_shape(2, 1, 2, input_bytes=250)
    opt, streamed = [True, False, False], [False, True, False]
    belady = plan_step(shape, 1800, 10**9, H200, opt, streamed=streamed)
    lru = plan_step(shape, 1800, 10**9, H200, opt, victim_rule="lru", streamed=streamed)
    assert belady.fits and lru.fits and moved(lru) < moved(belady)
    plan = fewest_bytes(belady, shape, 10**9, H200)
    assert plan.victim_rule == "lru" and moved(plan) == moved(lru)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.sampled_from([0, 100, 250]),
       st.integers(0, 3000), st.integers(300, 4000), st.integers(0, 20))
def test_stopping_short_on_the_host_answers_as_replaying_in_full(n_blocks, per_block, micro, inputs, extra, host, k):
    """The searches' candidates stop replaying once the host overflows: they fit exactly when the
    full replay fits, and the host bound (stage inputs counted) is never above a replayed peak."""
    shape = gpt_like_shape(n_blocks, per_block, micro, input_bytes=inputs)
    device = 300 + 2 * (per_block + 1) * 100 + extra
    opt = [c < k for c in range(shape.n_chunks)]
    full = plan_step(shape, device, host, H200, opt)
    assert plan_step(shape, device, host, H200, opt, stop_short=True).fits == full.fits
    replayed = plan_step(shape, device, 10**9, H200, opt)
    if replayed.fits:
        assert host_needed_bytes(shape, device, replayed.opt_on_device, replayed.opt_streamed) <= \
            replayed.peak_host_bytes


def test_a_host_too_small_for_the_stage_inputs_is_known_without_replaying(monkeypatch):
    """Every stage input is alive at the head's moment: what the device cannot hold of them is on
    the host, so a host short of them is refused before any replay (the depth search's deepest
    probes were spent replaying such steps)."""
    import pstar_jax.plan.placement as placement
    shape = gpt_like_shape(6, 1, input_bytes=400)
    device = 300 + 2 * 2 * 100 + 1200
    replayed = plan_step(shape, device, 10**9, H200, [False] * shape.n_chunks)
    assert replayed.fits
    need = host_needed_bytes(shape, device, replayed.opt_on_device, replayed.opt_streamed)
    assert need > sum(shape.chunk_bytes) + sum(shape.opt_state_bytes)  # more than the model data alone

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed")
    monkeypatch.setattr(placement, "settle", no_replay)
    plan = plan_step(shape, device, need - 1, H200, [False] * shape.n_chunks)
    assert not plan.fits and plan.problem.startswith("host memory runs out by at least")


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 2), st.sampled_from([0, 100]), st.integers(0, 4000),
       st.integers(0, 6000), st.sampled_from([1e3, 1e9]))
@example(3, 1, 2, 0, 1655 - 700, 2200, 1e3)  # only a mix fits
def test_skipping_the_pure_placements_where_they_fail_answers_as_make_plan(n_blocks, per_block, micro, inputs, extra,
                                                                        host, host_adam):
    """Past the answer without mixes (none of those placements fits), asking with mixes but
    without planning those placements again gets make_plan's own answer."""
    shape = gpt_like_shape(n_blocks, per_block, micro, input_bytes=inputs)
    machine = dc.replace(H200, host_adam_params_per_s=host_adam)
    device = 300 + 2 * (per_block + 1) * 100 + extra
    if make_plan(shape, device, host, machine, first_fit=True, mixes=False).fits:
        return
    full = make_plan(shape, device, host, machine)
    assert make_plan(shape, device, host, machine, first_fit=True, pure_fails=True).fits == \
        make_plan(shape, device, host, machine, first_fit=True).fits <= full.fits


def test_plans_are_those_recorded():
    """The plans of tests/plan_goldens.py's shapes are byte for byte those recorded (its JSON's
    digests): a change of data structures moves no chunk and predicts no other time."""
    want = json.loads(open(plan_goldens.PATH).read())
    got = {name: plan_goldens.digest(plan) for name, plan in plan_goldens.plans().items()}
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []


def _carry_out(plan, shape):
    """Walk ``plan``'s moments in the executor's order (engine/executor.py: a moment's own copies
    before it, its stage, its final grads sent up, the copies of the moments issued as it starts
    (predict.issued_during), then what it drops), holding the device's items as the store does.
    Returns the worst overshoot of a budget: each moment's capacity while it runs, and while a
    later moment's copies are issued the least capacity of the moments they overlap (0: none)."""
    from pstar_jax.plan.predict import issued_during, window_capacity
    accesses = step_accesses(shape, plan.opt_on_device, plan.opt_streamed, plan.state_leads)
    device = {item for item, _ in plan.initial_device}
    held = lambda: sum(map(shape.item_size, device))  # noqa: E731
    worst = 0

    def act(u):
        for item in plan.moments[u].evict:
            assert item in device, (u, item)
            device.remove(item)
        for item in plan.moments[u].fetch:
            assert item not in device, (u, item)
            device.add(item)
    issued = issued_during(plan.moments)
    for t, (moment, a) in enumerate(zip(plan.moments, accesses)):
        if not moment.prefetch:
            act(t)
        device.update(a.needs)  # what is not there is created by the moment (a grad, a stage input)
        worst = max(worst, held() - moment.capacity_bytes)
        device.difference_update(a.to_host)
        for u in issued.get(t, ()):
            unborn = {it for w in accesses[t + 1:u] for it in (*w.creates_host, *w.creates_device, *w.to_host)}
            assert not unborn & set(plan.moments[u].fetch), (t, u)  # nothing is fetched before it exists
            act(u)
            worst = max(worst, held() - window_capacity(plan.moments, u))
        device.difference_update(a.drops + a.consumes)
        device.update(a.creates_device)
    return worst


@pytest.mark.parametrize("case", ["frozen 16x1 m2 in50", "6x2 m2 in60", "5x2 m2 in60 stream"])
def test_copies_issued_moments_ahead_keep_every_budget(case):
    """At every prefetch depth, carried out in the executor's order, no moment and no window of
    moments a later moment's copies overlap holds more than its budget, nothing is fetched
    before the moment that makes it has run, copies are issued in the moments' order, and
    depth 1 is the plan as it was before deeper prefetch."""
    if case.startswith("frozen"):
        base = gpt_like_shape(16, 1, 2, input_bytes=50)
        shape = frozen_shape(base, [c != 0 for c in range(base.n_chunks)])
    else:
        shape = gpt_like_shape(6 if case.startswith("6") else 5, 2, 2, input_bytes=60)
    machine = dc.replace(H200, h2d_bytes_per_s=400 / 3e-6, d2h_bytes_per_s=400 / 3e-6, flops_per_s=1e15)
    n = shape.n_chunks
    streamed = [case.endswith("stream") and c % 2 == 1 for c in range(n)]
    for device in (3500, 4000, 5000) if case.endswith("stream") else (1000, 1300, 2000):
        plans = {depth: plan_step(shape, device, 10**9, machine, [False] * n, streamed=streamed, prefetch_depth=depth)
                 for depth in (1, 2, 3, 8)}
        assert plans[1] == plan_step(shape, device, 10**9, machine, [False] * n, streamed=streamed)
        for depth, plan in plans.items():
            assert plan.fits, (case, device, depth, plan.problem)
            starts = [t - m.issued_at for t, m in enumerate(plan.moments)]
            assert starts == sorted(starts)
            assert max(1, *(m.issued_at for m in plan.moments)) == plan.prefetch_depth <= depth
            assert _carry_out(plan, shape) <= 0, (case, device, depth)
        assert max(m.issued_at for m in plans[8].moments) > 1  # the budgets leave room to go deeper


def test_the_chosen_plan_goes_deeper_only_where_that_is_predicted_faster():
    """make_plan deepens its choice while the copies show (one frozen-base shape on a slow link:
    depth 2, at least 1% faster); where the copies hide under the compute, a plan stays one
    moment ahead; either way the placement is the one chosen at depth 1."""
    from pstar_jax.plan.placement import DEPTH_MARGIN, deepened
    base = gpt_like_shape(16, 1, 2, input_bytes=50)
    shape = frozen_shape(base, [c != 0 for c in range(base.n_chunks)])
    slow = dc.replace(H200, h2d_bytes_per_s=400 / 3e-6, d2h_bytes_per_s=400 / 3e-6, flops_per_s=1e15)
    chosen = make_plan(shape, 1000, 10**9, slow)
    at_one = plan_step(shape, 1000, 10**9, slow, chosen.opt_on_device, chosen.victim_rule, chosen.opt_streamed,
                       leads=chosen.state_leads)
    assert chosen.prefetch_depth == 2 and chosen.opt_on_device == at_one.opt_on_device
    assert chosen.predicted_step_s < at_one.predicted_step_s * (1 - DEPTH_MARGIN)
    assert deepened(at_one, shape, 10**9, slow) == chosen
    fast = make_plan(shape, 1000, 10**9, H200)
    assert fast.fits and fast.prefetch_depth == 1 and "prefetch_depth" not in fast.to_json()
    assert chosen.to_json()["prefetch_depth"] == 2
