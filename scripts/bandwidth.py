"""Host<->device bandwidth: raw pinned-host copies, and pstar_jax's own streaming of chunks.

    python scripts/bandwidth.py            # on the accelerator (1 GiB copies, a 1.3B GPT streaming)
    python scripts/bandwidth.py --small    # a CPU dry run

Raw copies are timed one way at a time and both ways at once: the planner assumes the two
directions share the link (Machine.duplex False) until this says they do not.

Streaming is measured on a chunked training step whose device budget forces every param chunk
to be fetched at each use and whose batch is tiny, so the step is dominated by the copies:
(h2d + d2h bytes) / step time, beside the raw figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pstar_jax as ps  # noqa: E402
from pstar_models import build_model  # noqa: E402
from pstar_jax.plan.machine import copies_overlap  # noqa: E402
from pstar_jax.engine.memory import Placement, Space  # noqa: E402
from pstar_jax.planner.build import default_mesh, layout_for  # noqa: E402


def copy_rate(placement: Placement, nbytes: int) -> tuple[float, float, float]:
    """Pinned host->device and device->host rates, each alone, and each while the other runs
    (equal to alone when the two directions overlap fully: Machine.duplex)."""
    x = placement.put(np.zeros(nbytes // 2, np.uint16), Space.DEVICE)
    host = jax.device_put(x, x.sharding.with_memory_kind(Space.HOST.value))
    y = placement.put(np.ones(nbytes // 2, np.uint16), Space.DEVICE)

    def best(fn):
        jax.block_until_ready(fn())
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(fn())  # sync: timing the copy
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    h2d = nbytes / best(lambda: jax.device_put(host, x.sharding))
    d2h = nbytes / best(lambda: jax.device_put(x, host.sharding))
    both = nbytes / best(lambda: (jax.device_put(host, x.sharding), jax.device_put(y, host.sharding)))
    return h2d, d2h, both


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true",
                   help="a dry run with 16 MiB copies and a tiny model (what a CPU can answer)")
    p.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = p.parse_args()
    if not args.small and jax.default_backend() == "cpu":
        p.exit(2, "bandwidth.py: this machine has no accelerator (a CPU has no host link to measure, and a "
                  "1.3B-parameter model would take its memory); run with --small for a dry run\n")
    mesh = default_mesh(1)
    placement = Placement(mesh)
    gib = 2**30
    nbytes = (16 * 2**20) if args.small else gib
    h2d, d2h, both = copy_rate(placement, nbytes)
    model = build_model("tiny", n_layer=4) if args.small else build_model("GPT2_1B", n_layer=24)
    cfg = model.config
    # Adam on the host, and a device budget of a few stages' chunks beside the working memory:
    # every param chunk is fetched at each use (rates of the H200, the machine this is for).
    config = ps.EngineConfig(precision="bf16", adam_placement="host", machine="h200")
    chunk = max(layout_for(model, config, mesh).numels)
    stage_bytes = 2 * 2 * chunk * 3  # a block's params and grads in up to 3 chunks, bf16
    budget = (8 * 2**20 if args.small else gib // 2) + stage_bytes  # well below the 2.6 GB of bf16 params
    engine = ps.build_engine(model, dataclasses.replace(config, device_memory=budget), ps.OptimConfig(),
                             (1, cfg.seq_len), mesh=mesh)
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(4):
        tok = rng.integers(0, cfg.vocab_size, (1, cfg.seq_len + 1))
        r = engine.step([(tok[:, :-1], tok[:, 1:])])
        rates.append(((r.h2d_bytes + r.d2h_bytes) / r.step_s, r.h2d_bytes, r.d2h_bytes, r.step_s))
    stream, h2d_b, d2h_b, step_s = rates[-1]
    result = {"device": jax.devices()[0].device_kind, "pinned_h2d_GiB_s": h2d / gib, "pinned_d2h_GiB_s": d2h / gib,
              "pinned_each_way_at_once_GiB_s": both / gib,
              "duplex": copies_overlap(nbytes / h2d, nbytes / d2h, nbytes / both),
              "pstar_stream_GiB_s": stream / gib, "pstar_step_h2d_GiB": h2d_b / gib, "pstar_step_d2h_GiB": d2h_b / gib,
              "pstar_step_s": step_s, "stream_fraction_of_pinned": stream / ((h2d + d2h) / 2)}
    for k, v in result.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
