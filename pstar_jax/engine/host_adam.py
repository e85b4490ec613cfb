"""AdamW on host-resident chunks: one fused pass over the chunk, on every core.

XLA runs a host update (``compute_on('device_host')`` or a CPU-backend jit) on one thread, and
the CPU client runs its computations one after another, even on separate CPU devices or when
called from separate Python threads (measured: scripts/bench_host_adam.py). So for AdamW, the
default optimizer, the host path is a numba kernel instead (pstar_jax.engine.host_kernels): one loop that
reads the grad and the fp32 master, m and v and writes them back with the new params (28 bytes per
parameter with bf16 grads and params), cut into contiguous slices that a thread pool updates
concurrently. Its arithmetic is optax.adamw's, rounded where XLA's CPU compiler rounds it, so on
a CPU it gives the same bits as the generic path; the bias corrections and the learning rate come
from optax's own expressions. Other optax transformations keep the generic XLA path
(pstar_jax.engine.optim).

The update is in place. The inputs are first passed through a donating identity jit, so JAX
hands over buffers nobody else can see (a buffer still viewed elsewhere, say by numpy, is
copied instead, exactly as JAX donation does); the kernel then writes into them: the new params
go into the grad's buffer, which the fused loop reads first at each index.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import functools
import importlib.util
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pstar_jax import compat

Schedule = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class AdamW:
    """A ``make_tx`` factory for ``optax.adamw`` that the host path can run as one fused kernel.

    ``make_tx(decay_mask)`` is ``optax.adamw(..., weight_decay=weight_decay * decay_mask)``, the
    same transformation any other factory would give; only the host path looks inside."""
    learning_rate: float | Schedule
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: float = 1e-4

    def __call__(self, decay_mask: Any) -> optax.GradientTransformation:
        return optax.adamw(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps, eps_root=self.eps_root,
                           weight_decay=self.weight_decay * decay_mask)


def available() -> bool:
    """Whether numba is installed (a dependency; without it every transformation takes the generic path)."""
    return importlib.util.find_spec("numba") is not None


def default_threads() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_KERNELS = {jnp.dtype(jnp.bfloat16): ("adamw_bf16", np.uint16), jnp.dtype(jnp.float32): ("adamw_f32", np.float32)}


def kernels() -> Any:
    """The numba kernels (pstar_jax.engine.host_kernels), imported on first use: numba takes a second to load."""
    from pstar_jax.engine import host_kernels
    return host_kernels


def supports(param_dtype: Any) -> bool:
    return available() and jnp.dtype(param_dtype) in _KERNELS


def host_view(x: jax.Array, dtype: Any) -> np.ndarray:
    """A writable numpy view of a single-device host array's buffer (no copy)."""
    nbytes = x.size * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * nbytes).from_address(x.unsafe_buffer_pointer()), dtype=dtype)


# -- running them on every core ----------------------------------------------------------------
class SlicePool:
    """Runs a kernel over contiguous slices of arrays on ``n_threads`` threads."""

    def __init__(self, n_threads: int, min_slice_numel: int = 1 << 16):
        self.n_threads = max(1, n_threads)
        self.min_slice_numel = min_slice_numel
        self._pool = (cf.ThreadPoolExecutor(self.n_threads - 1, thread_name_prefix="pstar-host")
                      if self.n_threads > 1 else None)

    def cuts(self, numel: int) -> list[tuple[int, int]]:
        """[lo, hi) slices, cache-line aligned, at most one per thread and none tiny."""
        n = max(1, min(self.n_threads, numel // max(1, self.min_slice_numel)))
        bounds = [0] + [(numel * i // n) // 16 * 16 for i in range(1, n)] + [numel]
        return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]

    def run(self, tasks: list[Callable[[], None]]) -> None:
        """Run the tasks, this thread taking the last. An error is raised only once every task has
        finished, so no thread still writes into the buffers when the caller sees it."""
        if self._pool is None or len(tasks) == 1:
            for task in tasks:
                task()
            return
        futures = [self._pool.submit(task) for task in tasks[:-1]]
        error = None
        try:
            tasks[-1]()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others finish
            error = e
        for f in futures:
            error = error or f.exception()
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@functools.lru_cache(maxsize=None)
def _own_fn(n: int) -> Callable:
    # Passing buffers through a donating identity gives arrays that alias them without a copy,
    # while the donated inputs are marked deleted: so nothing else can observe the in-place writes.
    return jax.jit(lambda *xs: xs, donate_argnums=tuple(range(n)))


def host_views_work(sharding: jax.sharding.Sharding) -> bool:
    """Whether a host array in ``sharding`` can be written through ``host_view`` (checked on a
    small array: written through views, then read back through JAX)."""
    n = 16 * sharding.num_devices
    (x,) = _own_fn(1)(jax.device_put(np.arange(n, dtype=np.float32), sharding))
    try:
        jax.block_until_ready(x)
        for _, data in _shard_data(x):
            host_view(data, np.float32)[:] += 1
        return all(np.array_equal(np.asarray(s.data), np.arange(n, dtype=np.float32)[s.index] + 1)
                   for s in x.addressable_shards)
    except Exception:  # noqa: BLE001 - any failure means: use the generic path
        return False


def _shard_data(x: jax.Array) -> list[tuple[int, jax.Array]]:
    """(global offset, single-device array) of this process's shards of a 1-D array."""
    return [(s.index[0].start or 0, s.data) for s in x.addressable_shards] if x.ndim else [
        (0, s.data) for s in x.addressable_shards]


class HostAdamW:
    """The fused AdamW update of host-resident chunks, on a slice pool.

    ``hand_over`` (on the thread that dispatches JAX work) takes the buffers; ``run`` (which
    blocks, so it may run on another thread) updates them in place."""

    def __init__(self, spec: AdamW, param_dtype: Any, n_threads: int | None = None, min_slice_numel: int = 1 << 16):
        if not supports(param_dtype):
            raise ValueError(f"no fused host AdamW for {jnp.dtype(param_dtype)} params (or numba is missing)")
        self.spec = spec
        self.param_dtype = jnp.dtype(param_dtype)
        kernel_name, self._bits_dtype = _KERNELS[self.param_dtype]
        self._kernel = getattr(kernels(), kernel_name)
        self.pool = SlicePool(n_threads or default_threads(), min_slice_numel)
        self._scalars = _scalar_fn(spec)
        self._scalar_cache: dict[tuple, tuple[tuple, list[int]]] = {}

    def hand_over(self, grad: jax.Array, master: jax.Array, state: Any) -> tuple:
        """Donate the inputs: arrays over the same buffers that nothing else can see.

        On an accelerator the identity is probably an executable on its compute stream, whose
        outputs are ready only once the work queued before it is done (unverified: run
        scripts/bench_host_adam.py --overlap there). ``run`` waits for them, so issue it from a
        thread that may wait (``ChunkOptimizer.begin_update``) or when little work is queued."""
        leaves, treedef = jax.tree.flatten(state)
        owned = _own_fn(2 + len(leaves))(grad, master, *leaves)
        return owned[0], owned[1], jax.tree.unflatten(treedef, owned[2:])

    def run(self, grad: jax.Array, master: jax.Array, state: Any, scale: jax.Array,
            n_decay: int) -> tuple[jax.Array, Any, jax.Array]:
        """(grad, master, state) from ``hand_over`` -> (new master, new state, new params)."""
        counts, mu, nu = _adam_leaves(state)
        jax.block_until_ready((grad, master, state))  # sync: the kernel works outside JAX's tracking
        k, new_counts = self._constants(scale, counts)
        for count, value in zip(counts, new_counts):
            for _, data in _shard_data(count):
                host_view(data, np.int32)[0] = value
        tasks = []
        for (offset, g), (_, p), (_, m), (_, v) in zip(*(_shard_data(x) for x in (grad, master, mu, nu))):
            views = (host_view(g, self._bits_dtype), host_view(p, np.float32),
                     host_view(m, np.float32), host_view(v, np.float32))
            boundary = min(max(n_decay - offset, 0), p.size)  # decayed elements come first
            for lo, hi in self.pool.cuts(p.size):
                for a, b, wd in ((lo, min(hi, boundary), k[-2]), (max(lo, boundary), hi, np.float32(0))):
                    if b > a:
                        tasks.append(functools.partial(self._kernel, *(x[a:b] for x in views), *k[:-2], wd, k[-1]))
        with jax.profiler.TraceAnnotation(f"pstar host AdamW {master.size} params"):  # seen beside the device's work
            self.pool.run(tasks)
        return master, state, grad

    def _constants(self, scale: jax.Array, counts: list[jax.Array]) -> tuple[tuple, list[int]]:
        """The kernel's scalars (scale, b1, b2, 1-b1, 1-b2, 1/bc1, 1/bc2, eps, eps_root, wd, step) and
        the new counts, from the host count buffers."""
        values = tuple(int(host_view(c.addressable_shards[0].data, np.int32)[0]) for c in counts)
        key = (*values, float(np.asarray(scale)))
        if key not in self._scalar_cache:
            if len(self._scalar_cache) > 64:
                self._scalar_cache.clear()
            s, f = self.spec, np.float32
            rbc1, rbc2, step, new_counts = self._scalars(*values)
            k = (f(key[-1]), f(s.b1), f(s.b2), f(1 - s.b1), f(1 - s.b2), f(rbc1), f(rbc2), f(s.eps), f(s.eps_root),
                 f(s.weight_decay), f(step))
            self._scalar_cache[key] = (k, new_counts)
        return self._scalar_cache[key]

    def close(self) -> None:
        self.pool.close()


def _adam_leaves(state: Any) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """optax.adamw's state -> (the counts: Adam's, then the schedule's if any; mu; nu)."""
    adam = state[0]
    if not isinstance(adam, optax.ScaleByAdamState):
        raise ValueError("the state is not optax.adamw's")
    counts = [adam.count] + ([state[-1].count] if isinstance(state[-1], optax.ScaleByScheduleState) else [])
    return counts, adam.mu, adam.nu


def _scalar_fn(spec: AdamW) -> Callable[..., tuple]:
    """(adam count[, schedule count]) -> (1/bc1, 1/bc2, step, new counts), by optax's own
    expressions, evaluated on the CPU backend so the host path never waits on the accelerator."""
    def fn(count, sched_count=None):
        count_inc = optax.safe_increment(count)
        bc1 = 1 / (1 - spec.b1 ** count_inc)
        bc2 = 1 / (1 - spec.b2 ** count_inc)
        lr = spec.learning_rate(sched_count) if callable(spec.learning_rate) else spec.learning_rate
        step = jnp.array(-1 * lr, dtype=jnp.float32)
        new_counts = (count_inc,) if sched_count is None else (count_inc, optax.safe_increment(sched_count))
        return bc1.astype(jnp.float32), bc2.astype(jnp.float32), step, new_counts
    jitted = jax.jit(fn)
    device = compat.cpu_device()

    def scalars(*counts: int) -> tuple:
        args = [np.int32(c) for c in counts]
        if device is not None:
            args = [jax.device_put(a, device) for a in args]
        bc1, bc2, step, new_counts = jitted(*args)
        return float(bc1), float(bc2), float(step), [int(c) for c in new_counts]
    return scalars
