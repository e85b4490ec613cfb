"""Split optimizer: each chunk's update runs where its fp32 state lives.

Any elementwise optax transformation works, because applying it to a flat chunk equals
applying it to each tensor in the chunk. The user gives a factory ``make_tx(decay_mask)``:
``decay_mask`` is 1.0 where weight decay applies and 0.0 where not, a per-element array for a
chunk (the layout puts decayed tensors first, so it is ``iota < n_decay``) or a scalar for the
plain engine's per-tensor groups. The same factory drives both engines, so they do the same
math. Global-norm clipping needs the norm of all grads before any update, so the executor
sums the squares of each chunk's grad as soon as it is final and passes one scale factor in.

Device-resident state is updated by a plain jit on the device; host-resident state on the host,
so fp32 master, m and v never cross PCIe (only the bf16 grad goes down and the bf16 params come
back up). On the host, AdamW (``default_tx``, or any ``host_adam.AdamW`` factory) runs as one
fused kernel on every core (pstar_jax.engine.host_adam); any other transformation runs as the same jit
under ``compute_on('device_host')``, which XLA runs on one core.

A host update blocks the thread that waits for it, so ``begin_update`` runs it on a worker
thread and returns at once: the caller keeps dispatching device work and takes the result
(``PendingUpdate.result()``) only when it needs the new params.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from pstar_jax import compat

from pstar_jax.engine import host_adam
from pstar_jax.config import OptimConfig
from pstar_jax.engine.chunks import ChunkLayout
from pstar_jax.engine.memory import Placement, Space

TxFactory = Callable[[Any], optax.GradientTransformation]


def default_tx(cfg: OptimConfig) -> TxFactory:
    """AdamW with linear warmup and cosine decay, decay applied where the mask says."""
    warmup, total = cfg.schedule_steps()
    if total is None:  # no known end: warm up, then stay at the peak
        schedule = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, max(warmup, 1)),
                                         optax.constant_schedule(cfg.lr)], [warmup])
    else:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
            decay_steps=max(total, warmup + 1), end_value=cfg.lr * cfg.final_lr_fraction)
    return host_adam.AdamW(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)


def clip_scale(sumsq: jax.Array, clip_norm: float | None) -> jax.Array:
    """The factor grads are multiplied by: 1 below the norm, clip_norm/norm above (as optax)."""
    if clip_norm is None:
        return jnp.ones((), jnp.float32)
    norm = jnp.sqrt(sumsq)
    return jnp.where(norm < clip_norm, 1.0, clip_norm / norm).astype(jnp.float32)


def clip_factor(grad_norm: float, clip_norm: float | None) -> float:
    """``clip_scale`` on the host, from the norm a step read back: what a step reports."""
    if clip_norm is None:
        return 1.0
    return 1.0 if grad_norm < clip_norm else clip_norm / grad_norm


def learning_rate(make_tx: Any, step: int) -> float | None:
    """The learning rate of step ``step``'s update (0-based) under a ``make_tx`` with a
    ``learning_rate`` (a number or an optax schedule: ``default_tx`` and host_adam.AdamW have
    one); None for another factory, whose schedule is not known from outside."""
    lr = getattr(make_tx, "learning_rate", None)
    if lr is None:
        return None
    return float(lr(step)) if callable(lr) else float(lr)


@jax.jit
def sum_of_squares(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


class PendingUpdate:
    """An update under way: ``result()`` waits for (new master, new state, new params) and
    raises what the update raised."""

    def __init__(self, value: tuple | None = None, future: cf.Future | None = None):
        self._value, self._future = value, future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self) -> tuple[jax.Array, Any, jax.Array]:
        return self._value if self._future is None else self._future.result()


class ChunkOptimizer:
    """Per-chunk optax updates, one compiled function per memory space (or the fused host AdamW).

    ``host_threads``: the threads of the fused host AdamW (default: every core this process may
    use); ``fused_host`` False keeps every transformation on the generic path."""

    def __init__(self, make_tx: TxFactory, placement: Placement, param_dtype: Any,
                 host_threads: int | None = None, fused_host: bool = True):
        self.make_tx = make_tx
        self.placement = placement
        self.param_dtype = param_dtype
        self.host_threads = host_threads
        self.fused_host = fused_host and isinstance(make_tx, host_adam.AdamW) and host_adam.supports(param_dtype)
        self._update = {space: self._build(space) for space in Space}
        self._keep = {space: self._build_keep(space) for space in Space}

    @functools.cached_property
    def _host_adam(self) -> host_adam.HostAdamW:
        return host_adam.HostAdamW(self.make_tx, self.param_dtype, self.host_threads)

    @functools.cached_property
    def _driver(self) -> cf.ThreadPoolExecutor:
        # One thread, so begun updates run in order; it is joined at exit after its last update.
        return cf.ThreadPoolExecutor(1, thread_name_prefix="pstar-host-update")

    def init(self, master: jax.Array) -> Any:
        """Optimizer state for one master chunk, made directly in the master's space and sharding."""
        space = Space(master.sharding.memory_kind)
        tx_init = self.make_tx(jnp.ones((), jnp.float32)).init
        on_device = jax.device_put(master, master.sharding.with_memory_kind(Space.DEVICE.value))
        shardings = jax.tree.map(lambda x: self.placement.sharding(space, P("data") if x.ndim else P()),
                                 jax.eval_shape(tx_init, on_device))
        return jax.jit(tx_init, out_shardings=shardings)(on_device)

    def state_bytes(self, numel: int) -> int:
        """Per-device bytes of the fp32 master plus the optimizer state of a chunk of ``numel``
        elements (nothing allocated)."""
        master = jax.ShapeDtypeStruct((numel,), jnp.float32)
        state = jax.eval_shape(self.make_tx(jnp.ones((), jnp.float32)).init, master)
        W = self.placement.n_devices
        return sum(x.size * x.dtype.itemsize // (W if x.ndim else 1) for x in jax.tree.leaves((master, state)))

    def chunk_state_bytes(self, layout: ChunkLayout) -> tuple[int, ...]:
        """Per chunk of ``layout``: ``state_bytes`` of its size, 0 for a frozen chunk (no master,
        no optimizer state); what the planner's StepShape.opt_state_bytes holds."""
        of_size = {n: self.state_bytes(n) for n in set(layout.numels)}
        return tuple(0 if layout.is_frozen(c) else of_size[layout.numel_of(c)] for c in range(layout.n_chunks))

    def update(self, space: Space, grad: jax.Array, master: jax.Array, state: Any,
               scale: jax.Array, n_decay: int) -> tuple[jax.Array, Any, jax.Array]:
        """(grad, master, state) in ``space`` -> (new master, new state, new params), in ``space``.

        grad, master and state are donated: the update is in place. A host update blocks until
        done; ``begin_update`` does not."""
        if self._fused(space, grad):
            return self._host_adam.run(*self._host_adam.hand_over(grad, master, state), scale, n_decay)
        scalars = self.placement.put((scale, np.int32(n_decay)), space)
        return self._update[space](grad, master, state, *scalars)

    def begin_update(self, space: Space, grad: jax.Array, master: jax.Array, state: Any, scale: jax.Array,
                     n_decay: int) -> PendingUpdate:
        """Start ``update`` and return at once; the inputs are donated now. Device updates are
        dispatched asynchronously by JAX as usual; a fused host update runs on a worker thread
        (updates run in the order they were begun)."""
        if self._fused(space, grad):
            owned = self._host_adam.hand_over(grad, master, state)
            return PendingUpdate(future=self._driver.submit(self._host_adam.run, *owned, scale, n_decay))
        return PendingUpdate(self.update(space, grad, master, state, scale, n_decay))

    def _fused(self, space: Space, grad: jax.Array) -> bool:
        return space is Space.HOST and self.fused_host and grad.dtype == self.param_dtype and self._views_work

    @functools.cached_property
    def _views_work(self) -> bool:
        """Checked once: the fused kernel writes host buffers through raw pointers, which only a
        CPU run of the tests proves; where that fails, host updates take the generic path."""
        ok = host_adam.host_views_work(self.placement.sharding(Space.HOST))
        if not ok:
            warnings.warn("host arrays cannot be written in place here: the host optimizer update runs "
                          "on one core (compute_on)", RuntimeWarning, stacklevel=3)
        return ok

    def keep(self, space: Space, grad: jax.Array, master: jax.Array, state: Any) -> tuple[jax.Array, Any, jax.Array]:
        """A skipped step: the grad is dropped, master and state stay, params are cast again."""
        return self._keep[space](grad, master, state)

    def _build_keep(self, space: Space) -> Callable:
        def keep(grad, master, state):
            return master, state, master.astype(self.param_dtype)
        fn = compat.on_host(keep) if space is Space.HOST else keep
        shard = self.placement.sharding(space)
        return jax.jit(fn, donate_argnums=(0,), out_shardings=(shard, None, shard))

    def _build(self, space: Space) -> Callable:
        host = space is Space.HOST

        def update(grad, master, state, scale, n_decay):
            index = jax.lax.iota(jnp.int32, master.shape[0])
            if host:  # created arrays start in device space; move before mixing with host ones
                index = compat.to_host(index)
            decay_mask = (index < n_decay).astype(jnp.float32)
            tx = self.make_tx(decay_mask)
            g = grad.astype(jnp.float32) * scale
            updates, state = tx.update(g, state, master)
            master = optax.apply_updates(master, updates)
            return master, state, master.astype(self.param_dtype)

        fn = compat.on_host(update) if host else update
        shard = self.placement.sharding(space)
        return jax.jit(fn, donate_argnums=(0, 1, 2), out_shardings=(shard, None, shard))


@functools.lru_cache(maxsize=None)
def _zeros_fn(numel: int, dtype: Any, sharding: jax.sharding.Sharding) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros((numel,), dtype), out_shardings=sharding)


def zeros_chunk(numel: int, dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A zero chunk created directly in its sharding (no host staging)."""
    return _zeros_fn(numel, jnp.dtype(dtype), sharding)()
