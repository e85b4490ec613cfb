"""Warm-up trace: non-model memory and chunk accesses at every moment of a step.

A *moment* is one stage call: each stage's forward, the head (forward and backward in one), each
stage's backward, then the optimizer per chunk. The trace is taken before any model data exists: every
distinct stage function is lowered and compiled on abstract arguments, and
``memory_analysis()`` gives its temporaries and outputs, ``cost_analysis()`` its FLOPs. The
non-model memory of a moment is what the stage call needs beside the chunks: the stage inputs
stashed for the backward so far, the call's activation inputs and outputs, and its temporaries
(which on a CPU include the copies XLA makes of static slices of chunks).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pstar_jax import compat
from pstar_jax.memory import Placement, Space
from pstar_jax.schedule import StepShape
from pstar_jax.stages import BoundStage, StageFunctions


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def _analyse(fn, *args) -> tuple[int, int, float]:
    """(temp bytes, output bytes, flops) of one compiled call, per device."""
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
    out = int(getattr(mem, "output_size_in_bytes", 0)) if mem is not None else 0
    return temp, out, compat.cost_flops(compiled)


def trace_step(bound: Sequence[BoundStage], fns: StageFunctions, placement: Placement,
               chunk_numel: int, param_dtype: Any, batch: int, seq_len: int, opt_state_bytes: int,
               micro_batches: int = 1, cache: dict | None = None) -> StepShape:
    """Trace one micro-batch of the chunked step for a global ``batch`` x ``seq_len``.

    ``cache`` may be shared between traces of models that differ only in depth or chunk layout
    (pstar-plan's searches): a stage is known by its apply function's name and position, its
    number of chunks and its activation shapes, so equal stages are analysed once."""
    cache = {} if cache is None else cache
    dev = placement.sharding(Space.DEVICE)
    rep = placement.sharding(Space.DEVICE, P())
    W = placement.n_devices
    chunk = _abstract((chunk_numel,), param_dtype, dev)
    chunk_bytes = chunk_numel * jnp.dtype(param_dtype).itemsize // W
    tokens = _abstract((batch, seq_len), jnp.int32, dev)

    def offsets(b: BoundStage):
        return _abstract((len(b.offsets),), jnp.int32, rep)

    def chunks(b: BoundStage):
        return tuple(chunk for _ in b.chunks)

    def kind(b: BoundStage) -> tuple:
        return (getattr(b.stage.apply, "__qualname__", id(b.stage.apply)), b is bound[0], b is bound[-1],
                jnp.dtype(param_dtype).name, W)

    # Activation shapes along the chain (abstract evaluation, nothing allocated).
    xs = [tokens]
    for b in bound[:-1]:
        key = ("out", kind(b), xs[-1].shape, len(b.chunks))
        if key not in cache:
            cache[key] = jax.eval_shape(fns.forward(b), chunks(b), offsets(b), xs[-1])
        y = cache[key]
        xs.append(_abstract(y.shape, y.dtype, dev))
    act = [x.size * x.dtype.itemsize // W for x in xs]

    def analysed(role: str, b: BoundStage, fn, *args) -> tuple[int, int, float]:
        # Memory barely depends on where tensors sit in chunks, so one compile per
        # (role, stage kind, number of chunks, activation shapes) stands for all such stages.
        key = (role, kind(b), len(b.chunks), chunk_numel, tuple(getattr(a, "shape", ()) for a in args[2:]))
        if key not in cache:
            cache[key] = _analyse(fn, *args)
        return cache[key]

    head = len(bound) - 1
    fwd_nm, fwd_fl, bwd_nm, bwd_fl = [], [], [0] * head, [0.0] * head
    for i, b in enumerate(bound[:-1]):
        temp, out, flops = analysed("fwd", b, fns.forward(b), chunks(b), offsets(b), xs[i])
        fwd_nm.append(sum(act[:i + 1]) + temp + out)  # stashed inputs so far, the call's temps and output
        fwd_fl.append(flops)
    b = bound[head]
    scale = _abstract((), jnp.float32, rep)
    temp, out, head_fl = analysed("head", b, fns.head(b), chunks(b), offsets(b), xs[head], tokens, chunks(b), scale)
    head_nm = sum(act) + temp + max(out - len(b.chunks) * chunk_bytes, 0)  # grad chunks are model data
    for i in reversed(range(head)):
        b = bound[i]
        temp, out, flops = analysed("bwd", b, fns.backward(b, first=(i == 0)), chunks(b), offsets(b), xs[i],
                                    xs[i + 1], chunks(b))
        bwd_nm[i] = sum(act[:i + 2]) + temp + max(out - len(b.chunks) * chunk_bytes, 0)
        bwd_fl[i] = flops
    return StepShape(tuple(b.chunks for b in bound), tuple(fwd_nm), head_nm, tuple(bwd_nm), tuple(fwd_fl),
                     head_fl, tuple(bwd_fl), n_chunks=max(c for b in bound for c in b.chunks) + 1,
                     chunk_numel=chunk_numel // W, item_bytes=chunk_bytes, opt_state_bytes=opt_state_bytes,
                     micro_batches=micro_batches)
