"""Host AdamW: the update rate on one core and on every core, against the memory-bandwidth limit.

    python scripts/bench_host_adam.py                  # 32M-parameter chunk (about 1 GB moved a step)
    python scripts/bench_host_adam.py --numel 4194304 --repeats 3

One run prints: a STREAM-style triad (a = b + s*c, counted as 12 bytes per element as STREAM does,
though a CPU without streaming stores also reads a before writing it) and an in-place triad
(a = a + s*b, 12 bytes per element, all of them moved), on one thread and on every thread; the
host update of a bf16 chunk with fp32 master and Adam state through ChunkOptimizer (XLA's generic
path, the fused kernel on one thread, the fused kernel on every thread), in parameters per second
and as a share of the limit: the highest triad figure / 28 bytes per parameter (bf16 grad read and
params written, fp32 master, m, v read and written). Timings are wall-clock minima, so other
processes on the machine lower them: the CPU seconds per wall second beside each figure show how
many cores it really had, and the load average is printed first. Parameters per CPU-second fall
when threads share a saturated memory bus (or a cache with other processes). The in-place
triad's own speed-up from one thread to all is printed beside the update's: where one core
nearly saturates the memory, no update moving 28 bytes per parameter can scale further.

``--overlap`` also times device work (a chain of matmuls) alone, a host update alone, and both
issued together (the update through ``begin_update``, which returns at once): on an accelerator,
both together should take about the longer of the two. On a CPU the "device" is the same cores,
so there it only shows that issuing the update does not wait for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from pstar_jax.engine import host_adam  # noqa: E402
from pstar_jax.config import OptimConfig  # noqa: E402
from pstar_jax.engine.memory import Placement, Space  # noqa: E402
from pstar_jax.engine.optim import ChunkOptimizer, default_tx  # noqa: E402

ADAM_BYTES_PER_PARAM = 2 + 2 + 3 * 4 * 2  # bf16 grad in, bf16 params out, fp32 master, m, v in and out
TRIAD_BYTES_PER_ELEMENT = 3 * 4  # STREAM's count: b and c read, a written (no write-allocate)


def best_time(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(best wall seconds, CPU seconds per wall second of that run) after one warm-up call."""
    fn()
    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    wall_s, cpu_s = min(runs)
    return wall_s, cpu_s / wall_s


def triad_rate(numel: int, threads: int, repeats: int, in_place: bool) -> tuple[float, float]:
    """Bytes per second of a triad on ``threads`` threads, and the cores it used."""
    a, b, c = np.zeros(numel, np.float32), np.ones(numel, np.float32), np.full(numel, 2.0, np.float32)
    kernels = host_adam.kernels()
    pool = host_adam.SlicePool(threads, min_slice_numel=1)
    if in_place:
        tasks = [lambda lo=lo, hi=hi: kernels.triad_in_place(a[lo:hi], c[lo:hi], np.float32(0.5))
                 for lo, hi in pool.cuts(numel)]
    else:
        tasks = [lambda lo=lo, hi=hi: kernels.triad(a[lo:hi], b[lo:hi], c[lo:hi], np.float32(3.0))
                 for lo, hi in pool.cuts(numel)]
    wall_s, cores = best_time(lambda: pool.run(tasks), repeats)
    assert a[0] == a[-1] and a[0] > 0
    pool.close()
    return TRIAD_BYTES_PER_ELEMENT * numel / wall_s, cores


def adam_rate(numel: int, repeats: int, fused: bool, threads: int | None) -> tuple[float, float]:
    """Parameters per second of one host chunk's update through ChunkOptimizer, and cores used."""
    placement = Placement(Mesh(np.array(jax.devices()[:1]), ("data",)))
    optimizer = ChunkOptimizer(default_tx(OptimConfig(warmup_steps=0)), placement, jnp.bfloat16,
                               host_threads=threads, fused_host=fused)
    assert optimizer.fused_host == fused
    master = placement.put(np.random.default_rng(0).standard_normal(numel).astype(np.float32), Space.HOST)
    live = {"master": master, "state": optimizer.init(master),
            "grad": placement.put(np.full(numel, 1e-3, jnp.bfloat16), Space.HOST)}
    clip = jnp.ones((), jnp.float32)

    def run():  # the new params (bf16, same shape) are the next call's donated grad
        live["master"], live["state"], live["grad"] = optimizer.update(
            Space.HOST, live["grad"], live["master"], live["state"], clip, numel // 2)
        jax.block_until_ready(live["master"])  # sync: timing the update
    wall_s, cores = best_time(run, repeats)
    assert np.isfinite(np.asarray(live["master"][:8])).all()
    return numel / wall_s, cores


def overlap(numel: int, repeats: int, threads: int) -> None:
    """Device matmuls and a host update, alone and together (see the module docstring)."""
    placement = Placement(Mesh(np.array(jax.devices()[:1]), ("data",)))
    optimizer = ChunkOptimizer(default_tx(OptimConfig(warmup_steps=0)), placement, jnp.bfloat16, host_threads=threads)
    master = placement.put(np.zeros(numel, np.float32), Space.HOST)
    live = {"master": master, "state": optimizer.init(master),
            "grad": placement.put(np.full(numel, 1e-3, jnp.bfloat16), Space.HOST)}
    clip = jnp.ones((), jnp.float32)
    a = placement.put(np.ones((1024, 1024), np.float32), Space.DEVICE)

    def chain(n: int) -> Callable:
        return jax.jit(lambda a: jax.lax.fori_loop(0, n, lambda i, x: (x @ a) * (1.0 / 1024), a))
    issue_s = []

    def begin():
        start = time.perf_counter()
        pending = optimizer.begin_update(Space.HOST, live["grad"], live["master"], live["state"], clip, numel // 2)
        issue_s.append(time.perf_counter() - start)
        return pending

    def finish(pending):
        live["master"], live["state"], live["grad"] = pending.result()

    t_host, _ = best_time(lambda: finish(begin()), repeats)
    t_8, _ = best_time(lambda: jax.block_until_ready(chain(8)(a)), repeats)
    matmuls = chain(max(1, round(8 * t_host / t_8)))  # about as long as the host update

    def both():
        out = matmuls(a)  # dispatched, not waited for
        finish(begin())
        jax.block_until_ready(out)  # sync: timing both
    t_device, _ = best_time(lambda: jax.block_until_ready(matmuls(a)), repeats)
    t_both, _ = best_time(both, repeats)
    hidden = (t_device + t_host - t_both) / min(t_device, t_host)
    print(f"overlap: device {t_device * 1e3:.1f} ms, host update {t_host * 1e3:.1f} ms, both {t_both * 1e3:.1f} ms: "
          f"{100 * hidden:.0f}% of the shorter one hidden; begin_update returned in {1e3 * min(issue_s):.2f} ms "
          f"(best), {1e3 * max(issue_s):.2f} ms (worst)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 25, help="parameters in the chunk (default 32M)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=host_adam.default_threads(),
                   help="threads for 'every core' (default: the cores this process may use)")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.add_argument("--overlap", action="store_true", help="also time device work and a host update together")
    args = p.parse_args()
    if not host_adam.available():
        sys.exit("numba is not installed: pip install numba (the fused host AdamW needs it)")
    n = args.threads
    load = os.getloadavg()
    print(f"{n} threads, chunk of {args.numel:,} params, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    figures = {"threads": n, "numel": args.numel, "load_1min": load[0]}
    for in_place, name in ((False, "triad         "), (True, "in-place triad")):
        for threads in (1, n):
            rate, cores = triad_rate(args.numel, threads, args.repeats, in_place)
            figures[f"{name.strip().replace(' ', '_').replace('-', '_')}_{'1' if threads == 1 else 'n'}_Bps"] = rate
            print(f"{name} {threads:2d} thread(s): {rate / 1e9:6.1f} GB/s  ({cores:.2f} cores)")
    bandwidth = max(v for k, v in figures.items() if k.endswith("_Bps"))  # the most this machine showed
    limit = figures["limit_params_per_s"] = bandwidth / ADAM_BYTES_PER_PARAM
    print(f"limit: {limit / 1e9:.2f} Gparams/s ({bandwidth / 1e9:.1f} GB/s / {ADAM_BYTES_PER_PARAM} bytes per param)")
    for label, key, fused, threads in (("XLA (compute_on)   ", "xla", False, None),
                                       ("fused,   1 thread  ", "fused_1", True, 1),
                                       (f"fused, {n:2d} threads ", "fused_n", True, n)):
        rate, cores = adam_rate(args.numel, args.repeats, fused, threads)
        figures[f"{key}_params_per_s"] = rate
        print(f"adam {label}: {rate / 1e9:5.2f} Gparams/s  {100 * rate / limit:5.1f}% of the limit  ({cores:.2f} cores, "
              f"{rate / cores / 1e9:.2f} Gparams per CPU-second)")
    memory_allows = figures["in_place_triad_n_Bps"] / figures["in_place_triad_1_Bps"]
    figures["triad_speedup"] = memory_allows
    print(f"speed-up from 1 to {n} threads: {figures['fused_n_params_per_s'] / figures['fused_1_params_per_s']:.2f}x "
          f"(the in-place triad's: {memory_allows:.2f}x, what the memory allows a kernel bound by it); "
          f"fused on {n} threads over XLA: {figures['fused_n_params_per_s'] / figures['xla_params_per_s']:.2f}x")
    if args.overlap:
        overlap(args.numel, args.repeats, n)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
