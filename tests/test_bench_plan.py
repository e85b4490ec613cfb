"""scripts/bench_plan.py's rows: one optimizer placement and state leads for all, the plan moving least."""

import dataclasses

from hypothesis import given, settings, strategies as st

from pstar_jax.plan.machine import H200
from pstar_jax.plan.placement import make_plan
from scripts.bench_plan import placement_rows, table
from step_shapes import gpt_like_shape


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.sampled_from([0, 50, 250]), st.integers(0, 1500),
       st.sampled_from([1e3, 1e9]))
def test_rows_share_the_plans_placement_and_none_moves_less(n_blocks, per_block, inputs, extra, host_adam):
    shape = gpt_like_shape(n_blocks, per_block, 1, input_bytes=inputs)
    machine = dataclasses.replace(H200, host_adam_params_per_s=host_adam)
    plan = make_plan(shape, 300 + 2 * (per_block + 1) * 100 + extra, 10**9, machine)
    if not plan.fits:
        return
    rows = placement_rows(shape, 10**9, machine, plan)
    names = [name for name, _ in rows]
    assert names[0].startswith("plan (") and names[-1] == "streaming every chunk at every use" and len(rows) == 4
    for name, other in rows:
        assert (other.opt_on_device, other.opt_streamed, other.state_leads) == (
            plan.opt_on_device, plan.opt_streamed, plan.state_leads), name
        if other.fits:
            assert plan.h2d_bytes + plan.d2h_bytes <= other.h2d_bytes + other.d2h_bytes, name
    assert rows[-1][1].fits, "streaming needs only each moment's own items"


def test_the_table_shows_the_predicted_time_in_a_fitting_unit():
    lines = table([("plan (Belady), predicted", 3 * 2**20, 2**20, 0.0123), ("measured", 3 * 2**20, 2**20, None)])
    assert lines[0].split() == ["placement", "h2d/step", "d2h/step", "total", "predicted"]
    assert lines[1].split()[-2:] == ["12.3", "ms"] and lines[1].split()[-4:-2] == ["4.00", "MiB"]
    assert lines[2].split()[-2:] == ["4.00", "MiB"]
