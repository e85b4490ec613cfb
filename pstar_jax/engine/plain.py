"""The plain engine: the whole model as one jit with optax, everything on the device.

It is the reference for equality tests and the baseline of every benchmark, so it is the best
plain JAX a user would write, not a strawman: the identical blocks run under ``lax.scan`` over
stacked parameters (one compiled block, XLA frees each layer's temporaries before the next),
remat wraps the scanned block, micro-batches are a ``lax.scan`` accumulating fp32 grads, the
bf16 compute copy of the params is cast once per step, and params and optimizer state are
donated (the update is in place). It runs the same stage functions as the chunked engine, the
same optimizer factory (one group with weight decay, one without) and the same clipping
formula, so the two engines differ only in where data lives and how the step is scheduled.
``remat`` picks the rematerialisation policy for the blocks.

Parameter layout: a run of consecutive middle stages that share one ``apply`` object, with
the same tensor shapes and decay flags and no tensor read elsewhere, is a scanned segment;
its tensors are stacked per position (``[n_stages, *shape]``). Every other tensor is kept by
name. ``params()`` returns names as ``model.param_shapes()`` whatever the layout.

Frozen tensors (``frozen``) are differentiated through but not with respect to: the gradient is
taken over the trainable arrays only, the global norm is theirs, and the optimizer gives the
frozen ones zero updates and keeps no state for them (``optax.set_to_zero`` in the
multi_transform). A scanned segment's rows are all frozen or all trainable.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from pstar_jax import compat
from pstar_jax.data.batch import (PER_POSITION, Batch, as_batch, check_batches, row_counts, stack, trained_count,
                                  with_dropout_seeds)
from pstar_jax.config import ConfigError
from pstar_jax.engine.protocol import NonFiniteLoss, StepResult, step_metrics
from pstar_jax.engine.optim import TxFactory, clip_factor, clip_scale
from pstar_jax.model.staged import Stage, StagedModel, decays, head_loss, head_sums, stage_seeds
from pstar_jax.engine.zero import replicated_value, to_numpy

REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    # XLA host offload (the MaxText recipe): matmul outputs go to pinned host memory in the
    # forward and come back for the backward. On a CPU this runs but moves nothing.
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


@dataclasses.dataclass(frozen=True)
class Segment:
    """One stage, or a run of identical stages scanned as one (``stages`` longer than one)."""
    stages: tuple[Stage, ...]

    @property
    def scanned(self) -> bool:
        return len(self.stages) > 1

    def names_at(self, position: int) -> tuple[str, ...]:
        """The tensor at ``position`` of each stage: the rows of one stacked array."""
        return tuple(stage.param_names[position] for stage in self.stages)


def segments(stages: Sequence[Stage], shapes: Mapping[str, tuple[int, ...]],
             decays: Callable[[str], bool], scan: bool = True, frozen: Collection[str] = ()) -> list[Segment]:
    """Group the chain into segments: runs of scannable identical middle stages, and singles.

    A middle stage joins the run before it when it shares the run's ``apply`` object and its
    tensors have the same shapes and decay flags, position by position. A stage reading a
    tensor that any other stage also reads (tied weights) stays single, since a stacked row
    cannot also be a named tensor."""
    readers = collections.Counter(n for stage in stages for n in stage.param_names)

    def signature(stage: Stage) -> tuple | None:
        if any(readers[n] > 1 for n in stage.param_names) or len(set(stage.param_names)) < len(stage.param_names):
            return None
        return stage.apply, tuple((tuple(shapes[n]), decays(n), n in frozen) for n in stage.param_names)

    out: list[list[Stage]] = [[stages[0]]]
    previous = None
    for stage in stages[1:-1]:
        sig = signature(stage) if scan else None
        if sig is not None and sig == previous:
            out[-1].append(stage)
        else:
            out.append([stage])
        previous = sig
    out.append([stages[-1]])
    return [Segment(tuple(run)) for run in out]


def _remat(fn: Callable, policy: Callable[..., bool] | None, in_scan: bool) -> Callable:
    # Inside scan the loop already keeps XLA from merging the recomputation with the forward,
    # and the barriers prevent_cse adds would only cost; unrolled, they are what keeps remat.
    return fn if policy is None else jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)


class PlainEngine:
    kind = "plain"

    def __init__(self, model: StagedModel, precision: str, make_tx: TxFactory, micro_batches: int = 1,
                 seed: int = 0, clip_norm: float | None = 1.0, remat: str = "none",
                 mesh: jax.sharding.Mesh | None = None, init_params: Any = None, opt_on_host: bool = False,
                 scan_layers: bool = True, skip_nonfinite: bool = False, frozen: Collection[str] = ()):
        """With ``mesh`` the batch is sharded over its ``data`` axis and everything else replicated.
        ``opt_on_host`` keeps the optimizer state in pinned host memory and updates it on the
        device: it comes down at the start of each step and goes back up at the end.
        ``scan_layers=False`` runs every stage unrolled (the reference the scan is tested against)."""
        if remat not in REMAT_POLICIES:
            raise ConfigError(f"--remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")
        compute_dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
        shapes = model.param_shapes()
        self._shapes = dict(shapes)
        self.clip_norm = clip_norm
        decays_of = functools.partial(decays, model)
        frozen = frozenset(frozen)
        self.frozen = frozen
        self._segments = segments(list(model.stages(compute_dtype)), shapes, decays_of, scan_layers, frozen)
        stacked = {n for seg in self._segments if seg.scanned for stage in seg.stages for n in stage.param_names}
        self._named = [n for n in shapes if n not in stacked]
        loss_fn = self._loss_fn(REMAT_POLICIES[remat])
        self._last = last = self._segments[-1].stages[0]

        self.mesh = mesh if mesh is not None else jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        replicated = NamedSharding(self.mesh, P())
        labels = self._tree(lambda names: "frozen" if names[0] in frozen else "decay" if decays_of(names[0])
                            else "no_decay")
        tx = optax.multi_transform({"decay": make_tx(1.0), "no_decay": make_tx(0.0), "frozen": optax.set_to_zero()},
                                   labels)
        trains = [label != "frozen" for label in jax.tree.leaves(labels)]  # per leaf of the params tree

        def split(tree):  # (trainable leaves, every leaf, treedef)
            leaves, treedef = jax.tree.flatten(tree)
            return [x for x, t in zip(leaves, trains) if t], leaves, treedef

        def merge(trained, leaves, treedef):  # the tree with its trainable leaves replaced
            it = iter(trained)
            return jax.tree.unflatten(treedef, [next(it) if t else x for x, t in zip(leaves, trains)])
        opt_sharding = replicated.with_memory_kind("pinned_host" if opt_on_host else "device")
        # Abstract first: memory_analysis() answers before anything is allocated.
        self._abstract_params = self._tree(lambda names: jax.ShapeDtypeStruct(
            (len(names), *shapes[names[0]]) if len(names) > 1 else tuple(shapes[names[0]]), jnp.float32,
            sharding=replicated))
        self._abstract_opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=opt_sharding),
                                          jax.eval_shape(tx.init, self._abstract_params))

        def allocate() -> None:
            tensor = (lambda n: model.init_tensor(n, seed)) if init_params is None else init_params.__getitem__

            def put(names: tuple[str, ...]) -> jax.Array:  # one stacked position at a time
                value = (jnp.stack([jnp.asarray(tensor(n), jnp.float32) for n in names]) if len(names) > 1
                         else jnp.asarray(tensor(names[0]), jnp.float32))
                return jax.device_put(value, replicated)
            self._params = self._tree(put)
            self._opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(self._params)
        self._allocate = allocate
        self._params = self._opt_state = None  # made at the first step (or by params())
        self.micro_batches = micro_batches
        self.model = model
        self.compute_dtype, self.precision = compute_dtype, precision
        self.skip_nonfinite = skip_nonfinite
        self.seed = seed

        def step(params, opt_state, batch_MxBxL, counts_MxBxK):
            if opt_on_host:
                opt_state = jax.device_put(opt_state, compat.DEVICE_SPACE)
            # One compute copy per step, shared by the micro-batches; grads w.r.t. it are
            # accumulated in fp32 (the chain rule through the cast is exactly that upcast).
            compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
            # The loss is the mean over the step's trained tokens (or the objective's counts): each
            # micro-batch's loss sums are scaled by 1 / the global counts before their gradient, as
            # the chunked engine does.
            count = jnp.sum(counts_MxBxK, axis=(0, 1))
            scale = 1.0 / jnp.maximum(count, 1.0)

            trained, leaves, treedef = split(compute)

            def scaled(t, batch):  # (loss, metric sums: the objective's, a router loss's value)
                return head_loss(last, loss_fn(merge(t, leaves, treedef), batch), scale)

            def micro(carry, batch):  # grads of the trainable leaves only; the metric sums per micro-batch
                (loss, metrics), grads = jax.value_and_grad(scaled, has_aux=True)(trained, batch)
                return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), carry, (loss, grads)), metrics
            zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), split(params)[0]))
            (loss_sum, grads), metrics = jax.lax.scan(micro, zeros, batch_MxBxL)
            sumsq = sum(jnp.sum(jnp.square(g)) for g in grads)
            scale = clip_scale(sumsq, clip_norm)
            # Frozen leaves get zero grads here only for the tree's shape: set_to_zero ignores them.
            grads = merge([g * scale for g in grads], jax.tree.map(jnp.zeros_like, jax.tree.leaves(params)), treedef)
            updates, new_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            # A non-finite step changes nothing (the caller skips it or stops, naming the step).
            finite = jnp.isfinite(loss_sum) & jnp.isfinite(sumsq)
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            return (jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state),
                    loss_sum, jnp.sqrt(sumsq), count, jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics))

        forward_loss = self._loss_fn(None)  # forward only: nothing is kept for a backward, so no remat

        def eval_loss(params, batch_MxBxL, counts_MxBxK):
            compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
            # (the language-model loss alone, without a router loss: what a held-out loss compares)
            sums = jax.lax.map(lambda batch: head_sums(last, forward_loss(compute, batch)), batch_MxBxL)
            return jnp.sum(jnp.sum(sums, axis=0) / jnp.maximum(jnp.sum(counts_MxBxK, axis=(0, 1)), 1.0))
        options = compat.compiler_options(self.mesh.devices.flat[0].platform)
        self._eval = jax.jit(eval_loss, out_shardings=replicated, compiler_options=options)

        # Donated: the new params and state are written over the old (XLA aliases them).
        self._step = jax.jit(step, donate_argnums=(0, 1), compiler_options=options,
                             out_shardings=(replicated, opt_sharding, replicated, replicated, replicated, replicated))
        self.step_count = 0
        self._logps: Callable | None = None  # the reference pass (reference_logps), built on first use

    def _tree(self, leaf: Callable[[tuple[str, ...]], Any]) -> dict[str, Any]:
        """The engine's parameter pytree, ``leaf(names)`` per array: a named tensor gets its one
        name, a stacked position the names of its rows."""
        return {"named": {n: leaf((n,)) for n in self._named},
                "stacked": tuple(tuple(leaf(seg.names_at(i)) for i in range(len(seg.stages[0].param_names)))
                                 for seg in self._segments if seg.scanned)}

    def _loss_fn(self, policy: Callable[..., bool] | None, head: Stage | None = None
                 ) -> Callable[[Any, Batch], jax.Array]:
        """The whole model as one function of the engine's pytree and a batch (the stages' own
        applies): the sum of the trained token losses (or what ``head``, in the last stage's place, gives)."""
        segs = self._segments

        def loss_fn(params, batch):
            named, stacks = params["named"], iter(params["stacked"])

            def take(stage: Stage) -> tuple[jax.Array, ...]:
                return tuple(named[n] for n in stage.param_names)
            h = segs[0].stages[0].apply(take(segs[0].stages[0]), batch.tokens, stage_seeds(batch, 0))
            index = 1  # each stage's place in the chain, mixed into its rows' dropout seeds
            for seg in segs[1:-1]:
                apply = _remat(seg.stages[0].apply, policy, seg.scanned)
                if seg.scanned:
                    def body(h, layer_and_index, apply=apply):
                        layer, i = layer_and_index
                        return apply(layer, h, stage_seeds(batch, i)), None
                    stages_at = jnp.arange(index, index + len(seg.stages), dtype=jnp.int32)
                    h, _ = jax.lax.scan(body, h, (next(stacks), stages_at))
                else:
                    h = apply(take(seg.stages[0]), h, stage_seeds(batch, index))
                index += len(seg.stages)
            last = head or segs[-1].stages[0]
            return last.apply(take(last), h, stage_seeds(batch, index))
        return loss_fn

    def step(self, micro_batches: Sequence[Batch | tuple[np.ndarray, np.ndarray]]) -> StepResult:
        """One optimizer step over micro-batches (``Batch``es, or (tokens, targets) pairs of plain
        data): the loss is the mean over the step's trained tokens. Raises DataError for ids
        outside the vocabulary."""
        micro_batches = [as_batch(b) for b in micro_batches]
        check_batches(micro_batches, self.model)
        if getattr(self.model, "dropout_seeded", False):  # as the chunked engine: by global row
            first = jax.process_index() * micro_batches[0].shape[0]
            micro_batches = [with_dropout_seeds(b, self.seed, self.step_count, m, first)
                             for m, b in enumerate(micro_batches)]
        if self._params is None:
            self._allocate()
        start = time.perf_counter()
        batch = self._put_rows(stack(micro_batches))
        self._params, self._opt_state, loss, norm, count, metrics = self._step(
            self._params, self._opt_state, batch, self._put_counts(micro_batches))
        loss, grad_norm = replicated_value(loss), replicated_value(norm)  # sync: the time covers the work
        skip = not (np.isfinite(loss) and np.isfinite(grad_norm))
        if skip and not self.skip_nonfinite:  # the step kept params and state as they were
            raise NonFiniteLoss(self.step_count, loss, grad_norm)
        self.step_count += 1
        model_bytes = sum(x.nbytes for x in jax.tree.leaves((self._params, self._opt_state)))
        return StepResult(loss=loss, grad_norm=grad_norm, step_s=time.perf_counter() - start,
                          clip_scale=clip_factor(grad_norm, self.clip_norm),
                          h2d_bytes=0, d2h_bytes=0, device_chunk_peak_bytes=model_bytes, skipped=skip,
                          trained_tokens=trained_count(to_numpy(count)[-1]),
                          metrics=step_metrics(self.model, [metrics] if metrics else [], to_numpy(count),
                                               len(micro_batches)))

    def evaluate(self, micro_batches: Sequence[Batch | tuple[np.ndarray, np.ndarray]]) -> float:
        """The mean loss over the trained tokens of all micro-batches (this process's rows of each),
        forward only with the current params: one jitted call, no gradients, nothing changed."""
        micro_batches = [as_batch(b) for b in micro_batches]
        check_batches(micro_batches, self.model)
        if self._params is None:
            self._allocate()
        return replicated_value(self._eval(self._params, self._put_rows(stack(micro_batches)),  # sync
                                           self._put_counts(micro_batches)))

    def reference_logps(self, micro_batches: Sequence[Batch]) -> list[np.ndarray]:
        """Each micro-batch's per-position target log-probs [B, L] (this process's rows) under the
        current params, the model's ``logps_stage`` as the head: full-fine-tuning DPO's stored
        reference (the chunked engine's ``reference_logps``, here one jitted forward)."""
        check_batches(micro_batches, self.model)
        if self._params is None:
            self._allocate()
        if self._logps is None:
            forward = self._loss_fn(None, getattr(self.model, "base", self.model).logps_stage())
            dtype = self.compute_dtype
            self._logps = jax.jit(lambda params, batch: forward(jax.tree.map(lambda p: p.astype(dtype), params), batch))
        rows = NamedSharding(self.mesh, P("data"))
        put = lambda b: Batch(*(None if x is None else  # noqa: E731
                                jax.make_array_from_process_local_data(rows, np.asarray(x)) for x in b))
        return [np.asarray(self._logps(self._params, put(b))) for b in micro_batches]  # sync

    def eval_plan_for(self, batch_shape: tuple[int, int], micro_batches: int) -> None:
        """Nothing to plan: everything is on the device."""

    def _put_rows(self, batch_MxBxL: Batch) -> Batch:
        """This process's rows of each micro-batch, every field sharded over the data axis."""
        rows = NamedSharding(self.mesh, P(None, "data"))
        return Batch(*(None if x is None else jax.make_array_from_process_local_data(rows, np.asarray(x))
                       for x in batch_MxBxL))

    def _put_counts(self, micro_batches: Sequence[Batch]) -> jax.Array:
        """[M, B, K] counts per row (pstar_jax.data.batch.row_counts), rows sharded as the batch."""
        rows = NamedSharding(self.mesh, P(None, "data"))
        return jax.make_array_from_process_local_data(rows, row_counts(micro_batches, self.model))

    def compiled(self, micro_batch: int, seq_len: int) -> Any:
        """The step compiled for this batch shape on abstract arguments (nothing is allocated)."""
        return self._step.lower(*self._abstract_step_args(micro_batch, seq_len)).compile()

    def counted_flops(self, micro_batch: int, seq_len: int) -> float:
        """One step's FLOPs per device as the chunked trace counts them (pstar_jax.model.flops: XLA's count
        with every iteration of the layer and micro-batch scans), the units of Machine.flops_per_s."""
        from pstar_jax.model.flops import call_flops
        return call_flops(self._step, *self._abstract_step_args(micro_batch, seq_len))[1]

    def _abstract_step_args(self, micro_batch: int, seq_len: int) -> tuple:
        rows = NamedSharding(self.mesh, P(None, "data"))
        shape = (self.micro_batches, micro_batch, seq_len)
        batch = Batch(*(jax.ShapeDtypeStruct(shape, jnp.float32 if f == "loss_mask" else jnp.int32, sharding=rows)
                        for f in PER_POSITION))
        if getattr(self.model, "reads_ref_logp", False):
            batch = batch._replace(ref_logp=jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows))
        counts = jax.ShapeDtypeStruct((*shape[:2], getattr(self.model, "n_counts", 1)), jnp.float32, sharding=rows)
        return self._abstract_params, self._abstract_opt, batch, counts

    def memory_analysis(self, micro_batch: int, seq_len: int) -> Any:
        """XLA's compile-time memory figures for one step at this batch shape (nothing runs)."""
        return self.compiled(micro_batch, seq_len).memory_analysis()

    def params(self, kind: str = "master") -> dict[str, np.ndarray]:
        """Every tensor by name, in ``param_shapes()`` order (stacked rows split back out): the fp32
        params, or with ``kind="param"`` cast to the compute dtype as a step uses them."""
        if self._params is None:
            self._allocate()
        out = {n: to_numpy(v) for n, v in self._params["named"].items()}
        scanned = (seg for seg in self._segments if seg.scanned)
        for seg, stack in zip(scanned, self._params["stacked"]):
            for i, array in enumerate(stack):
                out.update(zip(seg.names_at(i), to_numpy(array)))
        dtype = np.float32 if kind == "master" else jnp.dtype(self.compute_dtype)
        return {n: out[n].astype(dtype) for n in self._shapes}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def iter_params(self, kind: str = "master") -> Iterator[tuple[str, np.ndarray]]:
        return iter(self.params(kind).items())

    # -- state for checkpoints (the Engine protocol) ---------------------------------------------
    def state(self) -> dict:
        """The trained params and the optimizer state; frozen tensors (the base, which checkpoints
        record instead: pstar_jax.io.base_record) are left out, and there is no optimizer state for them."""
        if self._params is None:
            self._allocate()
        return {"params": self._trained(self._params), "opt": self._opt_state}

    def _trained(self, tree: dict[str, Any]) -> dict[str, Any]:
        """``tree`` (the params pytree) without its frozen entries (a stacked position is all frozen or none)."""
        scanned = [seg for seg in self._segments if seg.scanned]
        return {"named": {n: v for n, v in tree["named"].items() if n not in self.frozen},
                "stacked": tuple(tuple(v for i, v in enumerate(stack) if seg.names_at(i)[0] not in self.frozen)
                                 for seg, stack in zip(scanned, tree["stacked"]))}

    def abstract_state(self, layout: Any = None) -> dict:
        return {"params": self._trained(self._abstract_params), "opt": self._abstract_opt}

    def load_state(self, state: dict, step: int) -> None:
        """Replace the trained params and the optimizer state; frozen tensors keep the base."""
        if self._params is None:
            self._allocate()
        abstract = self.abstract_state()
        trained, opt = (jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), state[k], abstract[k])
                        for k in ("params", "opt"))
        scanned = [seg for seg in self._segments if seg.scanned]
        named = {n: trained["named"].get(n, v) for n, v in self._params["named"].items()}
        stacked = []
        for seg, stack, kept in zip(scanned, self._params["stacked"], trained["stacked"]):
            given = iter(kept)
            stacked.append(tuple(v if seg.names_at(i)[0] in self.frozen else next(given) for i, v in enumerate(stack)))
        self._params, self._opt_state = {"named": named, "stacked": tuple(stacked)}, opt
        self.step_count = step

    def summary(self) -> str:
        n_params = sum(math.prod(s) for s in self._shapes.values())
        runs = [len(seg.stages) for seg in self._segments if seg.scanned]
        scan = f", {'+'.join(map(str, runs))} identical stages scanned" if runs else ""
        return f"plain engine: {n_params:,} params, all on the device{scan}"
