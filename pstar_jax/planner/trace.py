"""Warm-up trace: non-model memory and chunk accesses at every moment of a step.

A *moment* is one stage call: each stage's forward, the head (forward and backward in one), each
stage's backward, then the optimizer per chunk; a forward-only pass (held-out loss) has only the
forwards and a head that computes the loss (``trace_forward``). The trace is taken before any
model data exists: every distinct stage function is lowered and compiled on abstract arguments,
and ``memory_analysis()`` gives its temporaries and outputs, ``pstar_jax.model.flops`` its FLOPs (every
loop iteration counted: XLA's cost analysis counts a loop body once). The
non-model memory of a moment is what the stage call needs beside the chunks and the stage inputs:
the micro-batch (its ``Batch``: tokens and side inputs, live from the first forward to the first
stage's backward; with LoRA dropout, ``dropout_seeded``, its rows' seeds too, so the masks are
in the temporaries and the step calls the very functions the trace compiled), the gradient
flowing down (in a backward), the call's outputs and its temporaries (which on a CPU include
the copies XLA makes of static slices of chunks). The stage inputs kept for the backward
(``StepShape.input_bytes``: micro-batch x sequence x d_model in the compute dtype for a decoder,
per device) are items the plan places, so a moment's non-model bytes do not count them; a
stage's own input is one of them (schedule.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pstar_jax.data.batch import PER_POSITION, Batch
from pstar_jax.model.flops import call_flops
from pstar_jax.engine.memory import Placement, Space
from pstar_jax.plan.schedule import StepShape
from pstar_jax.engine.stages import BoundStage, StageFunctions


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def _bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _analyse(fn, *args) -> tuple[int, int, float]:
    """(temp bytes, new output bytes, flops) of one compiled call, per device. Outputs written
    into donated inputs (grad chunks, a backward's gradient over the one from above) take no
    new memory and are not counted. The FLOPs count every iteration of the call's loops
    (pstar_jax.model.flops: XLA's own count has each loop body once)."""
    compiled, flops = call_flops(fn, *args)
    mem = compiled.memory_analysis()
    if mem is None:
        return 0, 0, flops
    out = int(getattr(mem, "output_size_in_bytes", 0)) - int(getattr(mem, "alias_size_in_bytes", 0))
    return int(getattr(mem, "temp_size_in_bytes", 0)), max(out, 0), flops


class _Tracer:
    """Abstract arguments of a chain's stage calls and their compiled figures, shared by the
    training and the forward-only trace (equal calls are analysed once per ``cache``)."""

    def __init__(self, bound: Sequence[BoundStage], fns: StageFunctions, placement: Placement,
                 numels: Sequence[int], param_dtype: Any, batch: int, seq_len: int, cache: dict | None,
                 dropout_seeded: bool = False, dtypes: Sequence[Any] | None = None, objective: Any = None):
        self.bound, self.fns, self.numels, self.param_dtype = bound, fns, tuple(numels), param_dtype
        # Per chunk: its dtype (uint8 for quantized kernels, ChunkLayout.dtypes), else the compute dtype.
        self.dtypes = tuple(jnp.dtype(d) for d in dtypes) if dtypes else (jnp.dtype(param_dtype),) * len(self.numels)
        self.cache = {} if cache is None else cache
        self.dev = placement.sharding(Space.DEVICE)
        self.rep = placement.sharding(Space.DEVICE, P())
        self.W = placement.n_devices
        self.abstract_chunks = [_abstract((n,), d, self.dev) for n, d in zip(self.numels, self.dtypes)]
        # Per chunk, per device: its elements and its bytes in its dtype.
        self.shard_numels = tuple(n // self.W for n in self.numels)
        self.chunk_bytes = tuple(n * d.itemsize // self.W for n, d in zip(self.numels, self.dtypes))
        # The batch the engine runs (executor._put_batch): every field sharded over the data axis,
        # the seeds ([B] uint32, batch.with_dropout_seeds) only where the model draws dropout masks.
        seeds = _abstract((batch,), jnp.uint32, self.dev) if dropout_seeded else None
        # The objective's side (pstar_jax.model.preference): a reference's log-probs per position,
        # and its K loss sums, each scaled by its own count.
        ref_logp = _abstract((batch, seq_len), jnp.float32, self.dev) if getattr(objective, "reads_ref_logp", False) \
            else None
        self.n_counts = int(getattr(objective, "n_counts", 1))
        self.batch = Batch(*(_abstract((batch, seq_len), jnp.float32 if f == "loss_mask" else jnp.int32, self.dev)
                             for f in PER_POSITION), dropout_seed=seeds, ref_logp=ref_logp)
        # Activation shapes along the chain (abstract evaluation, nothing allocated).
        self.xs = [self.batch.tokens]
        for b in bound[:-1]:
            key = ("out", self.kind(b), _shapes(self.xs[-1]), len(b.chunks))
            if key not in self.cache:
                self.cache[key] = jax.eval_shape(fns.forward(b), self.chunks(b), self.offsets(b), self.xs[-1],
                                                 self.batch)
            # (a pytree where the stages carry more than h: a preference objective's (h, h_ref), a
            # mixture of experts' RouterStats)
            self.xs.append(jax.tree.map(lambda y: _abstract(y.shape, y.dtype, self.dev), self.cache[key]))
        # Per device. The first stage's input is the batch itself (its tokens among it); a stage
        # input counts every array the stages carry (RouterStats too: the plan places them with h).
        self.batch_bytes = _bytes(self.batch) // self.W
        self.act = [self.batch_bytes] + [_bytes(x) // self.W for x in self.xs[1:]]

    def offsets(self, b: BoundStage):
        return _abstract((len(b.offset_data),), jnp.int32, self.rep)

    def chunks(self, b: BoundStage):
        return tuple(self.abstract_chunks[c] for c in b.chunks)

    def grads(self, b: BoundStage):
        return tuple(self.abstract_chunks[c] for c in b.grad_chunks)

    def kind(self, b: BoundStage) -> tuple:
        return (getattr(b.stage.apply, "__qualname__", id(b.stage.apply)), b is self.bound[0], b is self.bound[-1],
                jnp.dtype(self.param_dtype).name, self.W, b.frozen, self.batch.dropout_seed is not None, b.quant)

    def analysed(self, role: str, b: BoundStage, fn, *args) -> tuple[int, int, float]:
        # Memory barely depends on where tensors sit in chunks, so one compile per
        # (role, stage kind, sizes of its chunks, activation shapes) stands for all such stages.
        key = (role, self.kind(b), tuple(self.numels[c] for c in b.chunks),
               tuple(_shapes(a) for a in args[2:]))
        if key not in self.cache:
            self.cache[key] = _analyse(fn, *args)
        return self.cache[key]


def _shapes(tree: Any) -> tuple:
    """The shapes of a pytree's leaves (an activation may be a pair, a batch is several arrays)."""
    return tuple(getattr(leaf, "shape", ()) for leaf in jax.tree.leaves(tree))


def trace_step(bound: Sequence[BoundStage], fns: StageFunctions, placement: Placement,
               numels: Sequence[int], param_dtype: Any, batch: int, seq_len: int, opt_state_bytes: Sequence[int],
               micro_batches: int = 1, cache: dict | None = None, dropout_seeded: bool = False,
               dtypes: Sequence[Any] | None = None, objective: Any = None,
               keep: frozenset[int] = frozenset()) -> StepShape:
    """Trace one micro-batch of the chunked step for a global ``batch`` x ``seq_len``, over chunks
    of ``numels`` elements (the layout's, per chunk) whose master and optimizer state take
    ``opt_state_bytes`` per device (per chunk, 0 for a frozen one: ChunkOptimizer.chunk_state_bytes);
    ``dropout_seeded`` (the model's attribute: it draws LoRA dropout masks) adds the rows' seeds.

    ``cache`` may be shared between traces of models that differ only in depth or chunk layout
    (pstar-plan's searches): a stage is known by its apply function's name and position, its
    chunks' sizes and its activation shapes, so equal stages are analysed once. ``dtypes``: per
    chunk (ChunkLayout.dtypes) where quantized kernels' chunks are uint8, else ``param_dtype``.
    ``objective``: the model, where its attributes ``reads_ref_logp`` and ``n_counts`` change the
    batch and the head's scale (preference tuning). ``keep``: the stages that keep their vjp
    residuals (schedule.kept_stages): their backward runs from them (fewer FLOPs) and they join the
    stage's input item (``input_bytes``, and ``residual_bytes`` alone)."""
    tr = _Tracer(bound, fns, placement, numels, param_dtype, batch, seq_len, cache, dropout_seeded, dtypes,
                 objective)
    xs, act, chunks, offsets, analysed = tr.xs, tr.act, tr.chunks, tr.offsets, tr.analysed
    head = len(bound) - 1
    fwd_nm, fwd_fl, bwd_nm, bwd_fl = [], [], [0] * head, [0.0] * head
    residuals, res_bytes = {}, [0] * (head + 1)
    for i, b in enumerate(bound[:-1]):
        if i in keep:
            residuals[i] = tuple(_abstract(r.shape, r.dtype, tr.dev) for r in jax.eval_shape(
                fns.forward_keep(b), chunks(b), offsets(b), xs[i], tr.batch)[1])
            res_bytes[i] = _bytes(residuals[i]) // tr.W
            temp, out, flops = analysed("fwd_keep", b, fns.forward_keep(b), chunks(b), offsets(b), xs[i],
                                        tr.batch)
        else:
            temp, out, flops = analysed("fwd", b, fns.forward(b), chunks(b), offsets(b), xs[i], tr.batch)
        # the batch, the call's temps and output (its input, and the residuals it keeps, are an item)
        fwd_nm.append(act[0] + temp + out - res_bytes[i])
        fwd_fl.append(flops)
    b = bound[head]
    scale = _abstract((tr.n_counts,), jnp.float32, tr.rep)
    temp, out, head_fl = analysed("head", b, fns.head(b), chunks(b), offsets(b), xs[head], tr.batch, tr.grads(b),
                                  scale)
    head_nm = act[0] + temp + out  # (the grad chunks, model data, are written in place)
    for i in reversed(range(head)):
        b = bound[i]
        if i in keep:
            temp, out, flops = analysed("bwd_kept", b, fns.backward_kept(b), chunks(b), offsets(b), xs[i],
                                        tr.batch, xs[i + 1], residuals[i], tr.grads(b))
        else:
            temp, out, flops = analysed("bwd", b, fns.backward(b, first=(i == 0)), chunks(b), offsets(b), xs[i],
                                        tr.batch, xs[i + 1], tr.grads(b))
        # the batch, the gradient from above (shaped as stage i + 1's input, and overwritten by the
        # gradient of stage i's input, but in the first stage), temps, new outputs
        bwd_nm[i] = act[0] + act[i + 1] + temp + out
        bwd_fl[i] = flops
    return StepShape(tuple(b.chunks for b in bound), tuple(fwd_nm), head_nm, tuple(bwd_nm), tuple(fwd_fl),
                     head_fl, tuple(bwd_fl), shard_numels=tr.shard_numels, chunk_bytes=tr.chunk_bytes,
                     opt_state_bytes=tuple(opt_state_bytes), micro_batches=micro_batches, frozen=_frozen(bound, numels),
                     input_bytes=(0, *(a + r for a, r in zip(act[1:], res_bytes[1:]))),
                     residual_bytes=tuple(res_bytes) if keep else ())


def trace_forward(bound: Sequence[BoundStage], fns: StageFunctions, placement: Placement,
                  numels: Sequence[int], param_dtype: Any, batch: int, seq_len: int, micro_batches: int = 1,
                  cache: dict | None = None, dtypes: Sequence[Any] | None = None, objective: Any = None
                  ) -> StepShape:
    """Trace a forward-only pass (held-out loss) for a global ``batch`` x ``seq_len``.

    The shape of schedule.forward_accesses: a forward moment holds the micro-batch (live until
    its loss), its input, its temporaries and output (nothing is stashed: there is no backward);
    the head computes only the loss. The backward fields are zeros and there is no optimizer
    state."""
    tr = _Tracer(bound, fns, placement, numels, param_dtype, batch, seq_len, cache, dtypes=dtypes, objective=objective)
    head = len(bound) - 1

    def live(i: int) -> int:  # the batch, and the stage's input when it is not the batch's tokens
        return tr.batch_bytes + (tr.act[i] if i else 0)
    fwd_nm, fwd_fl = [], []
    for i, b in enumerate(bound[:-1]):
        temp, out, flops = tr.analysed("fwd", b, fns.forward(b), tr.chunks(b), tr.offsets(b), tr.xs[i], tr.batch)
        fwd_nm.append(live(i) + temp + out)
        fwd_fl.append(flops)
    b = bound[head]
    temp, out, loss_fl = tr.analysed("loss", b, fns.loss(b), tr.chunks(b), tr.offsets(b), tr.xs[head], tr.batch)
    loss_nm = live(head) + temp + out
    return StepShape(tuple(b.chunks for b in bound), tuple(fwd_nm), loss_nm, (0,) * head, tuple(fwd_fl),
                     loss_fl, (0.0,) * head, shard_numels=tr.shard_numels, chunk_bytes=tr.chunk_bytes,
                     opt_state_bytes=(0,) * len(tr.numels), micro_batches=micro_batches, frozen=_frozen(bound, numels))


def _frozen(bound: Sequence[BoundStage], numels: Sequence[int]) -> tuple[bool, ...]:
    """Per chunk id: frozen, from the stages bound to the layout (() when none is)."""
    frozen = {c: f for b in bound for c, f in zip(b.chunks, b.frozen)}
    if not any(frozen.values()):
        return ()
    return tuple(frozen.get(c, False) for c in range(len(numels)))
