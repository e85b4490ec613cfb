"""The plain engine: the whole model as one jit with optax, everything on the device.

It is the reference for equality tests and the baseline of every benchmark. It runs the same
stage functions as the chunked engine (composed into one loss), the same optimizer factory
(one group with weight decay, one without) and the same clipping formula, so the two engines
differ only in where data lives and how the step is scheduled. ``remat`` picks XLA's
rematerialisation policy for the blocks.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from pstar_jax import compat
from pstar_jax.config import ConfigError
from pstar_jax.engine import StepResult
from pstar_jax.optim import TxFactory, clip_scale
from pstar_jax.model import StagedModel, cast_params, compose_loss
from pstar_jax.zero import replicated_value, to_numpy

REMAT_POLICIES: dict[str, Callable[[Callable], Callable] | None] = {
    "none": None,
    "dots": lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    "full": lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable),
    # XLA host offload (the MaxText recipe): matmul outputs go to pinned host memory in the
    # forward and come back for the backward. On a CPU this runs but moves nothing.
    "offload": lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host")),
}


class PlainEngine:
    kind = "plain"

    def __init__(self, model: StagedModel, precision: str, make_tx: TxFactory, micro_batches: int = 1,
                 seed: int = 0, clip_norm: float | None = 1.0, remat: str = "none",
                 mesh: jax.sharding.Mesh | None = None, init_params: Any = None, opt_on_host: bool = False,
                 skip_nonfinite: bool = False):
        """With ``mesh`` the batch is sharded over its ``data`` axis and everything else replicated.
        ``opt_on_host`` keeps the optimizer state in pinned host memory and updates it on the
        device: it comes down at the start of each step and goes back up at the end."""
        if remat not in REMAT_POLICIES:
            raise ConfigError(f"--remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")
        compute_dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
        loss_fn = compose_loss(list(model.stages(compute_dtype)), REMAT_POLICIES[remat])
        self.mesh = mesh if mesh is not None else jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        replicated = NamedSharding(self.mesh, P())
        shapes = model.param_shapes()
        labels = {n: "decay" if model.decays(n) else "no_decay" for n in shapes}
        tx = optax.multi_transform({"decay": make_tx(1.0), "no_decay": make_tx(0.0)}, labels)
        opt_sharding = replicated.with_memory_kind("pinned_host" if opt_on_host else "device")
        # Abstract first: memory_analysis() answers before anything is allocated.
        self._abstract_params = {n: jax.ShapeDtypeStruct(tuple(s), jnp.float32, sharding=replicated)
                                 for n, s in shapes.items()}
        self._abstract_opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=opt_sharding),
                                          jax.eval_shape(tx.init, self._abstract_params))

        def allocate() -> None:
            tensor = (lambda n: model.init_tensor(n, seed)) if init_params is None else init_params.__getitem__
            self.params = {n: jax.device_put(jnp.asarray(tensor(n), jnp.float32), replicated) for n in shapes}
            self.opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(self.params)
        self._allocate = allocate
        self.params = self.opt_state = None  # made at the first step (or by params_numpy)
        self.micro_batches = micro_batches

        def mean_loss(params, tokens_MxBxL, targets_MxBxL):
            compute = cast_params(params, compute_dtype)
            losses = [loss_fn(compute, tokens_MxBxL[m], targets_MxBxL[m]) for m in range(micro_batches)]
            return sum(losses) / micro_batches

        def step(params, opt_state, tokens, targets):
            if opt_on_host:
                opt_state = jax.device_put(opt_state, compat.DEVICE_SPACE)
            loss, grads = jax.value_and_grad(mean_loss)(params, tokens, targets)
            sumsq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
            scale = clip_scale(sumsq, clip_norm)
            grads = jax.tree.map(lambda g: g * scale, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, jnp.sqrt(sumsq)

        self._step = jax.jit(step, donate_argnums=(0, 1), out_shardings=(replicated, opt_sharding, replicated, replicated))
        self.step_count = 0

    def step(self, micro_batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> StepResult:
        if self.params is None:
            self._allocate()
        start = time.perf_counter()
        tokens = np.stack([t for t, _ in micro_batches]).astype(np.int32)
        targets = np.stack([t for _, t in micro_batches]).astype(np.int32)
        rows = NamedSharding(self.mesh, P(None, "data"))  # this process's rows of each micro-batch
        tokens, targets = (jax.make_array_from_process_local_data(rows, x) for x in (tokens, targets))
        self.params, self.opt_state, loss, norm = self._step(self.params, self.opt_state, tokens, targets)
        loss = replicated_value(loss)  # sync: the step's time includes all its work
        self.step_count += 1
        model_bytes = sum(x.nbytes for x in jax.tree.leaves((self.params, self.opt_state)))
        return StepResult(loss=loss, grad_norm=replicated_value(norm), step_s=time.perf_counter() - start,
                          h2d_bytes=0, d2h_bytes=0, device_chunk_peak_bytes=model_bytes)

    def compiled(self, micro_batch: int, seq_len: int) -> Any:
        """The step compiled for this batch shape on abstract arguments (nothing is allocated)."""
        rows = NamedSharding(self.mesh, P(None, "data"))
        batch = jax.ShapeDtypeStruct((self.micro_batches, micro_batch, seq_len), jnp.int32, sharding=rows)
        return self._step.lower(self._abstract_params, self._abstract_opt, batch, batch).compile()

    def memory_analysis(self, micro_batch: int, seq_len: int) -> Any:
        """XLA's compile-time memory figures for one step at this batch shape (nothing runs)."""
        return self.compiled(micro_batch, seq_len).memory_analysis()

    def params_numpy(self) -> dict[str, np.ndarray]:
        if self.params is None:
            self._allocate()
        return {n: to_numpy(v) for n, v in self.params.items()}

    def summary(self) -> str:
        return f"plain engine: {sum(v.size for v in self._abstract_params.values()):,} params, all on the device"
