"""Plans of synthetic step shapes, kept as digests of their JSON (tests/data/plan_goldens.json): a
change that must not alter any plan (a new data structure, a refactor) is checked against them.

``python3 tests/plan_goldens.py`` rewrites the file (``--full FILE`` also writes the plans, to diff
two trees); only do so for a change meant to alter plans."""

from __future__ import annotations

import dataclasses as dc
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pstar_jax.plan.machine import H200  # noqa: E402
from pstar_jax.plan.forward import plan_forward  # noqa: E402
from pstar_jax.plan.placement import make_plan, plan_step  # noqa: E402
from tests.step_shapes import frozen_shape, gpt_like_shape  # noqa: E402

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "plan_goldens.json")
SLOW_HOST = dc.replace(H200, host_adam_params_per_s=1e3)
SLOW_LINK = dc.replace(H200, h2d_bytes_per_s=600 / 3e-6, d2h_bytes_per_s=600 / 3e-6, flops_per_s=1e15)


def _mixed_machine():
    stage_s = 1e9 / H200.flops_per_s
    return dc.replace(H200, host_adam_params_per_s=1000 / (3 * stage_s), call_s=0.0,
                      h2d_bytes_per_s=600 / (2 * stage_s), d2h_bytes_per_s=600 / (2 * stage_s))


def plans() -> dict[str, dict]:
    """Case name -> Plan.to_json(): make_plan over device and host budgets that keep everything,
    move chunks, stream state, mix placements, offload stage inputs or do not fit; forced
    placements; frozen chunks; a streaming baseline; a forward-only plan."""
    out = {}
    for n_blocks, per_block, micro, inputs in ((4, 2, 1, 0), (3, 1, 2, 0), (5, 2, 2, 60), (6, 1, 1, 400)):
        shape = gpt_like_shape(n_blocks, per_block, micro, input_bytes=inputs)
        for device in (500, 900, 1300, 2000, 4000, 10**6):
            for host in (1000, 4000, 10**9):
                out[f"make {n_blocks}x{per_block} m{micro} in{inputs} d{device} h{host}"] = \
                    make_plan(shape, device, host, H200).to_json()
        for placement in ("device", "host", "stream"):
            out[f"{placement} {n_blocks}x{per_block} m{micro} in{inputs}"] = \
                make_plan(shape, 1500, 10**9, H200, adam_placement=placement).to_json()
        out[f"first fit {n_blocks}x{per_block} m{micro} in{inputs}"] = \
            make_plan(shape, 1100, 10**9, H200, first_fit=True).to_json()
        out[f"streaming {n_blocks}x{per_block} m{micro} in{inputs}"] = \
            plan_step(shape, 0, 10**9, H200, [False] * shape.n_chunks, streaming=True).to_json()
        for rule in ("lru", "fifo"):
            out[f"{rule} {n_blocks}x{per_block} m{micro} in{inputs}"] = \
                plan_step(shape, 1000, 10**9, H200, [False] * shape.n_chunks, victim_rule=rule).to_json()
    shape = gpt_like_shape(4, 2)
    out["slow host adam"] = make_plan(shape, 2500, 10**9, SLOW_HOST).to_json()
    out["slow link"] = make_plan(gpt_like_shape(6, 1), 2500, 10**9, SLOW_LINK).to_json()
    six = gpt_like_shape(6, 1)
    out["mixed"] = make_plan(six, 300 + 2 * six.n_chunks * 100 + 600, 10**9, _mixed_machine()).to_json()
    for mask in (0b0000101, 0b1111110, 0b0110110):
        frozen = frozen_shape(gpt_like_shape(3, 2, 2), tuple(bool(mask >> c & 1) for c in range(7)))
        for device in (700, 1100, 10**6):
            out[f"frozen {mask:07b} d{device}"] = make_plan(frozen, device, 10**9, H200).to_json()
        out[f"frozen {mask:07b} all on device"] = plan_step(frozen, 1100, 10**9, H200, [True] * 7).to_json()
    training = plan_step(gpt_like_shape(6, 2), 900, 10**9, H200, [False] * 13)
    forward = dc.replace(gpt_like_shape(6, 2), fwd_non_model=(150,) * 7, head_non_model=200, micro_batches=2)
    out["forward"] = plan_forward(forward, training, 10**9, H200).to_json()
    return out


def digest(plan_json: dict) -> str:
    return hashlib.sha256(json.dumps(plan_json, sort_keys=True).encode()).hexdigest()


if __name__ == "__main__":
    made = plans()
    with open(PATH, "w") as f:
        json.dump({name: digest(p) for name, p in made.items()}, f, indent=0, sort_keys=True)
        f.write("\n")
    if sys.argv[1:2] == ["--full"]:
        with open(sys.argv[2], "w") as f:
            json.dump(made, f, indent=0, sort_keys=True)
    print(f"wrote {PATH}")
