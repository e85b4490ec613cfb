"""Warm-up trace: non-model memory and chunk accesses at every moment of a step.

A *moment* is one stage call: each stage's forward, the head (forward and backward in one), each
stage's backward, then the optimizer. The trace is taken before any model data exists: every
distinct stage function is lowered and compiled on abstract arguments, and
``memory_analysis()`` gives its temporaries and outputs, ``cost_analysis()`` its FLOPs. The
non-model memory of a moment is what the stage call needs beside the chunks: the stage inputs
stashed for the backward so far, the call's activation inputs and outputs, and its temporaries
(which on a CPU include the copies XLA makes of static slices of chunks).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pstar_jax import compat
from pstar_jax.memory import Placement, Space
from pstar_jax.stages import BoundStage, StageFunctions


@dataclasses.dataclass(frozen=True)
class Moment:
    phase: str  # "fwd", "head", "bwd", "adam"
    stage: int  # stage index; -1 for the optimizer
    chunks: tuple[int, ...]
    non_model_bytes: int  # per device
    flops: float  # per device


@dataclasses.dataclass(frozen=True)
class Trace:
    moments: tuple[Moment, ...]
    batch_shape: tuple[int, int]  # global (batch, seq_len) of one micro-batch

    @property
    def peak_non_model_bytes(self) -> int:
        return max(m.non_model_bytes for m in self.moments)

    def to_json(self) -> dict:
        return {"batch_shape": list(self.batch_shape),
                "moments": [dataclasses.asdict(m) for m in self.moments]}


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
               chunk_numel: int, param_dtype: Any, batch: int, seq_len: int) -> Trace:
    """Trace one micro-batch of the chunked step for a global ``batch`` x ``seq_len``."""
    dev = placement.sharding(Space.DEVICE)
    rep = placement.sharding(Space.DEVICE, P())
    W = placement.n_devices
    chunk = _abstract((chunk_numel,), param_dtype, dev)
    tokens = _abstract((batch, seq_len), jnp.int32, dev)

    def offsets(b: BoundStage):
        return _abstract((len(b.offsets),), jnp.int32, rep)

    def chunks(b: BoundStage):
        return tuple(chunk for _ in b.chunks)

    # Activation shapes along the chain (abstract evaluation, nothing allocated).
    xs = [tokens]
    for b in bound[:-1]:
        y = jax.eval_shape(fns.forward(b), chunks(b), offsets(b), xs[-1])
        xs.append(_abstract(y.shape, y.dtype, dev))
    act_bytes = [x.size * x.dtype.itemsize // W for x in xs]

    cache: dict[tuple, tuple[int, int, float]] = {}

    def analysed(role: str, b: BoundStage, fn, *args) -> tuple[int, int, float]:
        key = (role, b.stage.apply, b.pattern, tuple(a.shape for a in args[2:] if hasattr(a, "shape")))
        if key not in cache:
            cache[key] = _analyse(fn, *args)
        return cache[key]

    moments = []
    head = len(bound) - 1
    for i, b in enumerate(bound[:-1]):
        temp, out, flops = analysed("fwd", b, fns.forward(b), chunks(b), offsets(b), xs[i])
        stashed = sum(act_bytes[:i + 1])
        moments.append(Moment("fwd", i, b.chunks, stashed + temp + out, flops))
    b = bound[head]
    scale = _abstract((), jnp.float32, rep)
    temp, out, flops = analysed("head", b, fns.head(b), chunks(b), offsets(b), xs[head], tokens, chunks(b), scale)
    chunk_out = len(b.chunks) * chunk.size * chunk.dtype.itemsize // W  # grad chunks are model data
    moments.append(Moment("head", head, b.chunks, sum(act_bytes) + temp + max(out - chunk_out, 0), flops))
    for i in reversed(range(head)):
        b = bound[i]
        fn = fns.backward(b, first=(i == 0))
        temp, out, flops = analysed("bwd", b, fn, chunks(b), offsets(b), xs[i], xs[i + 1], chunks(b))
        chunk_out = len(b.chunks) * chunk.size * chunk.dtype.itemsize // W
        moments.append(Moment("bwd", i, b.chunks, sum(act_bytes[:i + 2]) + temp + max(out - chunk_out, 0), flops))
    moments.append(Moment("adam", -1, tuple(sorted({c for b in bound for c in b.chunks})), 0, 0.0))
    return Trace(tuple(moments), (batch, seq_len))
