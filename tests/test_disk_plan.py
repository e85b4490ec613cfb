"""The disk tier in the plan: frozen chunks the host cannot hold live on disk, read ahead of each
fetch through a ring of staging buffers (plan/homes.py); their reads are planned, counted and
timed (plan/predict.py); nothing goes there while the host holds the base."""

import dataclasses as dc

from hypothesis import given, settings, strategies as st

from pstar_jax.plan.bounds import could_fit, host_needed_bytes
from pstar_jax.plan.forward import plan_forward
from pstar_jax.plan.homes import DISK_SLOTS
from pstar_jax.plan.machine import H200, describe
from pstar_jax.plan.placement import make_plan, plan_step
from pstar_jax.plan.predict import predict_step_s
from pstar_jax.plan.schedule import step_accesses
from step_shapes import frozen_shape, gpt_like_shape, sized_shape

NVME = dc.replace(H200, disk_read_bytes_per_s=6e9, disk_tensor_bytes_per_s=6e9)


def lora_like(n_blocks: int, per_block: int, micro: int = 1, sizes=None):
    """A GPT-like shape whose chunks are all frozen but the first (the adapters' chunk)."""
    base = gpt_like_shape(n_blocks, per_block, micro)
    shape = frozen_shape(base, [c > 0 for c in range(base.n_chunks)])
    return sized_shape(shape, sizes) if sizes else shape


def fetched(plan, c: int) -> int:
    return sum(it == ("param", c) for m in plan.moments for it in m.fetch)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(1, 3), st.integers(1, 2), st.integers(0, 300), st.integers(0, 9),
       st.booleans())
def test_disk_homes_hold_what_the_host_cannot_and_move_the_same_bytes(n_blocks, per_block, micro, extra, tenths,
                                                                     mixed):
    """Under a host too small for every moving frozen chunk, the plan with a disk puts the rest
    there: the moments are those of the plan with host enough (homes change sources, not
    fetches); each fetch of a disk home is one read, in fetch order; the host peak is the roomy
    plan's less the disk homes' bytes plus the reader's ring (DISK_SLOTS of the largest disk
    chunk), within the budget; those fetched least go first (homes.with_disk_homes)."""
    sizes = [100 + (37 * c) % 60 if mixed else 100 for c in range(n_blocks * per_block + 1)]
    shape = lora_like(n_blocks, per_block, micro, sizes)
    device = 300 + (per_block + 2) * max(sizes) + extra
    roomy = plan_step(shape, device, 10**9, NVME, [False] * shape.n_chunks)
    if not roomy.fits or "host" not in roomy.frozen_home:
        return
    host_homes = [c for c, h in enumerate(roomy.frozen_home) if h == "host"]
    held = roomy.peak_host_bytes - sum(shape.chunk_bytes[c] for c in host_homes)
    host = held + (roomy.peak_host_bytes - held) * tenths // 10
    plan = plan_step(shape, device, host, NVME, roomy.opt_on_device, disk_bytes=10**9)
    if not plan.fits:  # the ring does not fit beside what stays
        assert plan.problem.startswith("host memory runs out by") and plan.staging_bytes + held > host
        return
    assert plan.moments == roomy.moments and plan.initial_device == roomy.initial_device
    disk = [c for c, h in enumerate(plan.frozen_home) if h == "disk"]
    assert disk, plan.problem
    assert {c for c, h in enumerate(plan.frozen_home) if h in ("host", "disk")} == set(host_homes)
    order = [it[1] for m in plan.moments for it in m.fetch if it[0] == "param" and it[1] in disk]
    assert plan.disk_reads() == tuple(order) and plan.disk_read_bytes == sum(shape.chunk_bytes[c] for c in order)
    assert plan.staging_bytes == DISK_SLOTS * max(shape.chunk_bytes[c] for c in disk)
    assert plan.peak_host_bytes == (roomy.peak_host_bytes - sum(shape.chunk_bytes[c] for c in disk)
                                    + plan.staging_bytes) <= host
    # Those fetched least go first, among chunks no larger than the largest on disk (the ring's size).
    kept = [c for c, h in enumerate(plan.frozen_home) if h == "host"]
    largest = max(shape.chunk_bytes[c] for c in disk)
    rank = {c: (fetched(plan, c), -shape.chunk_bytes[c], c) for c in disk + kept}
    assert all(rank[d] < rank[k] for d in disk for k in kept if shape.chunk_bytes[k] <= largest)
    assert "on disk" in plan.frozen_line() and plan.to_json()["disk_read_bytes"] == plan.disk_read_bytes
    # A disk read is never free: the same plan with every disk home on the host is never slower.
    accesses = step_accesses(shape, plan.opt_on_device, plan.opt_streamed, plan.state_leads)
    assert plan.predicted_step_s >= roomy.predicted_step_s - 1e-12 * roomy.predicted_step_s
    assert predict_step_s(plan.moments, accesses, shape, NVME, roomy.frozen_home, DISK_SLOTS) == pytest_approx(
        roomy.predicted_step_s)


def pytest_approx(x):
    import pytest
    return pytest.approx(x, rel=1e-12)


def test_nothing_goes_to_disk_while_the_host_holds_it():
    shape = lora_like(6, 2)
    roomy = plan_step(shape, 900, 10**9, NVME, [False] * shape.n_chunks)
    assert "host" in roomy.frozen_home
    for host in (10**9, roomy.peak_host_bytes):
        plan = plan_step(shape, 900, host, NVME, roomy.opt_on_device, disk_bytes=10**9)
        assert "disk" not in plan.frozen_home and plan.to_json() == roomy.to_json()
        assert "disk_read_bytes" not in plan.to_json() and "on disk" not in plan.frozen_line()


def test_no_disk_without_a_read_rate_or_room_on_it():
    """A disk tier is used only with a measured read rate, and holds no more than its bytes: the
    host then runs out as it would without one."""
    shape = lora_like(6, 2)
    roomy = plan_step(shape, 900, 10**9, NVME, [False] * shape.n_chunks)
    assert roomy.fits and roomy.frozen_home.count("host") >= 3
    host = roomy.peak_host_bytes - 300  # three chunks short
    for machine, disk in ((H200, 10**9), (NVME, 0), (NVME, 150)):
        plan = plan_step(shape, 900, host, machine, roomy.opt_on_device, disk_bytes=disk)
        assert not plan.fits and plan.problem.startswith("host memory runs out by"), (machine.name, disk)
        assert sum(plan.chunk_bytes[c] for c, h in enumerate(plan.frozen_home) if h == "disk") <= (
            disk if machine is NVME else 0)
    plan = plan_step(shape, 900, host, NVME, roomy.opt_on_device, disk_bytes=10**9)
    assert plan.fits and "disk" in plan.frozen_home


def test_bounds_count_the_disk_as_room_for_frozen_chunks_only():
    """The host bound and could_fit let frozen bytes go to disk, trained ones never: a bound stays
    at or below the plan's host peak."""
    shape = lora_like(6, 2)
    frozen = sum(b for c, b in enumerate(shape.chunk_bytes) if shape.is_frozen(c))
    opt = [True] * shape.n_chunks
    no_disk = host_needed_bytes(shape, 900, opt, [False] * shape.n_chunks)
    with_disk = host_needed_bytes(shape, 900, opt, [False] * shape.n_chunks, disk_bytes=10**9)
    assert no_disk - frozen <= with_disk < no_disk
    assert not could_fit(shape, 400, 600) and could_fit(shape, 400, 600, disk_bytes=frozen)
    assert not could_fit(shape, 400, 599, disk_bytes=10**9)  # the trained chunk's bytes stay off the disk
    plan = make_plan(shape, 900, 1200, NVME, disk_bytes=10**9)
    assert plan.fits and host_needed_bytes(shape, 900, plan.opt_on_device, plan.opt_streamed, 10**9) <= (
        plan.peak_host_bytes)


def test_a_disk_bound_step_takes_its_reads_one_after_another():
    """With compute and link all but free, a step takes the time of its disk reads in series; a
    ring of one buffer is never faster than DISK_SLOTS; a slower disk never faster."""
    shape = lora_like(6, 2)
    roomy = plan_step(shape, 900, 10**9, NVME, [False] * shape.n_chunks)
    host = roomy.peak_host_bytes - 300
    fast = dc.replace(NVME, flops_per_s=1e30, h2d_bytes_per_s=1e30, d2h_bytes_per_s=1e30,
                      device_adam_params_per_s=1e30, host_adam_params_per_s=1e30, disk_read_bytes_per_s=1e3)
    plan = plan_step(shape, 900, host, fast, roomy.opt_on_device, disk_bytes=10**9)
    assert plan.fits and plan.disk_read_bytes > 0
    assert abs(plan.predicted_step_s - plan.disk_read_bytes / 1e3) <= 1e-9 * plan.predicted_step_s
    accesses = step_accesses(shape, plan.opt_on_device, plan.opt_streamed, plan.state_leads)
    for machine in (NVME, dc.replace(NVME, disk_read_bytes_per_s=1e4)):
        ring = [predict_step_s(plan.moments, accesses, shape, machine, plan.frozen_home, s) for s in (1, DISK_SLOTS)]
        assert ring[0] >= ring[1] >= plan.disk_read_bytes / machine.disk_read_bytes_per_s
    slow = [predict_step_s(plan.moments, accesses, shape, dc.replace(NVME, disk_read_bytes_per_s=r),
                           plan.frozen_home, DISK_SLOTS) for r in (1e3, 1e4, 1e6)]
    assert slow[0] >= slow[1] >= slow[2]


def test_an_evaluation_reads_disk_homes_through_the_same_ring():
    """The forward-only plan keeps the training plan's homes: its fetches of disk homes are reads,
    and the ring counts in its host peak."""
    shape = lora_like(6, 2)
    roomy = plan_step(shape, 900, 10**9, NVME, [False] * shape.n_chunks)
    host = roomy.peak_host_bytes - 300
    training = plan_step(shape, 900, host, NVME, roomy.opt_on_device, disk_bytes=10**9)
    assert training.fits and "disk" in training.frozen_home
    forward = dc.replace(shape, fwd_non_model=(150,) * len(shape.fwd_non_model), head_non_model=200,
                         micro_batches=2)
    plan = plan_forward(forward, training, host, NVME)
    assert plan.fits and plan.frozen_home == training.frozen_home
    reads = [it[1] for m in plan.moments for it in m.fetch if training.frozen_home[it[1]] == "disk"]
    assert reads and plan.disk_read_bytes == sum(shape.chunk_bytes[c] for c in reads)
    assert plan.staging_bytes == training.staging_bytes and plan.peak_host_bytes >= training.staging_bytes


def test_a_preset_given_a_disk_rate_is_still_the_preset():
    assert describe(NVME) == "h200 rates (preset)"
    assert describe(dc.replace(H200, h2d_bytes_per_s=1.0)) == "h200 rates (measured)"
