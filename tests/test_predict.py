"""Step-time prediction: between full overlap and none; a duplex link is never slower; host
updates run beside the device's work."""

import dataclasses as dc

import pytest
from hypothesis import given, settings, strategies as st

from pstar_jax.plan.machine import H200
from pstar_jax.plan.placement import plan_step
from pstar_jax.plan.predict import compute_s, host_update_s, predict_step_s, state_leads
from pstar_jax.plan.schedule import step_accesses
from step_shapes import gpt_like_shape


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 3000), st.integers(0, 30), st.booleans())
def test_predicted_time_lies_between_full_overlap_and_none(n_blocks, per_block, extra, k, stream):
    """Never faster than the compute alone or the link alone, never slower than both in series;
    a link that copies both ways at once is never slower."""
    shape = gpt_like_shape(n_blocks, per_block)
    slow_link = dc.replace(H200, h2d_bytes_per_s=1e3, d2h_bytes_per_s=1e3, flops_per_s=1e12)
    opt = [c < k for c in range(shape.n_chunks)]
    plan = plan_step(shape, 300 + 2 * (per_block + 1) * 100 + extra, 10**9, slow_link, opt,
                     streamed=[stream] * shape.n_chunks)
    if not plan.fits:
        return
    accesses = step_accesses(shape, opt, plan.opt_streamed, plan.state_leads)
    compute = sum(compute_s(a, shape, slow_link) for a in accesses)
    host = sum(host_update_s(a, shape, slow_link) for a in accesses)
    link = plan.h2d_bytes / 1e3 + plan.d2h_bytes / 1e3
    eps = 1e-9 * (compute + link + host)
    assert max(compute, link, host) - eps <= plan.predicted_step_s <= compute + link + host + eps
    duplex = predict_step_s(plan.moments, accesses, shape, dc.replace(slow_link, duplex=True))
    assert max(compute, plan.h2d_bytes / 1e3, plan.d2h_bytes / 1e3) - eps <= duplex <= plan.predicted_step_s + eps


def test_host_updates_run_beside_the_forward():
    """Host updates start when the step does and the device waits only for the one it needs next:
    with an update as long as a stage, the step takes far less than the two in series, and the
    device never waits for the compute of an update it does not need yet."""
    shape = gpt_like_shape(6, 1)
    n = shape.n_chunks
    stage_s = 1e9 / H200.flops_per_s
    machine = dc.replace(H200, host_adam_params_per_s=shape.shard_numels[0] / stage_s)  # an update: one forward stage
    plan = plan_step(shape, 10**6, 10**9, machine, [False] * n)  # every param resident, every update on the host
    assert plan.fits and plan.h2d_bytes == plan.d2h_bytes == sum(shape.chunk_bytes)  # grads up, new params down
    accesses = step_accesses(shape, [False] * n)
    compute = sum(compute_s(a, shape, machine) for a in accesses)
    host = sum(host_update_s(a, shape, machine) for a in accesses)
    # each update is shard_numel / (shard_numel / stage_s): stage_s to float64 rounding, summed n times
    assert host == pytest.approx(n * stage_s, rel=8 * n * 2.0**-52) and compute_s(accesses[0], shape, machine) == 0.0
    assert plan.predicted_step_s < compute + host / 2
    # the forward of stage i needs updates 0..i, so it waits at most for one update beyond the last stage
    assert plan.predicted_step_s <= compute + 2 * stage_s + shape.n_chunks * machine.call_s + 1e-12



def test_state_leads_cover_the_copy_with_compute():
    """Each streamed update's state goes down just far enough ahead for the moments between to
    cover its copy (or from the step's start)."""
    shape = gpt_like_shape(6, 1)
    machine = dc.replace(H200, h2d_bytes_per_s=600 / 3e-6, flops_per_s=1e15)  # copy 3 us, stage 1-2 us
    n = shape.n_chunks
    accesses = step_accesses(shape, [False] * n, [True] * n)
    leads = state_leads(accesses, shape, machine)
    for u, a in enumerate(accesses):
        if a.state_bytes_each_way:
            copy_s = a.state_bytes_each_way / machine.h2d_bytes_per_s
            lead = leads[a.index]
            covered = sum(compute_s(accesses[t], shape, machine) for t in range(max(u - lead, 0), u))
            assert lead >= u or covered >= copy_s
            assert lead == 1 or covered - compute_s(accesses[u - lead], shape, machine) < copy_s
