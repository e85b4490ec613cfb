"""FLOPs of a compiled stage call, with every loop counted as often as it runs.

XLA's cost analysis counts a while loop's body once, whatever its trip count (checked on a CPU,
jax 0.10.2: ``lax.map`` of a matmul over 32 rows counts one matmul). The sequence tiles of
pstar_jax.model.tiling, the tiled loss and the tiled attention are such loops, so a stage cut into n
tiles counted about 1/n of its FLOPs, and pstar-plan predicted steps faster than the device's
matmul rate (llama-3.2-1b at 16k tokens: 893 model TFLOPS on an H200).

The count here is XLA's for the compiled call plus, for every ``scan`` in the call's jaxpr (what
``lax.map``, ``lax.scan`` and ``fori_loop`` with static bounds become), the iterations XLA did
not count, ``(length - 1) x`` one iteration's FLOPs as the jaxpr has them: ``dot_general``
exactly (2 per multiply-add, as XLA counts), elementwise arithmetic one per output element,
reductions one per input element, transcendentals none (XLA counts those apart). A call without
loops keeps XLA's count exactly, the units ``Machine.flops_per_s`` is calibrated in; only the
loops' missing iterations come from the jaxpr, whose counting of their matmuls (nearly all of a
tile's work) is exact. A ``while_loop`` of unknown trip count stays counted once, as XLA counts it.

Why not the alternatives: an untiled lowering of the stage needs the model rebuilt with another
tile budget (the trace sees only stage functions) and a second, larger compile per stage; the
model's analytic ``flops_per_token`` is one number for the whole step, without the per-moment
split the planner's timeline needs or the backward's recomputed forward that the device runs.
"""

from __future__ import annotations

import math
from typing import Any

from pstar_jax import compat

# Elementwise ops XLA counts one FLOP per output element (HloCostAnalysis' elementwise handlers);
# data movement (reshape, slice, broadcast, gather, convert, ...) counts none.
_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "floor", "ceil", "round",
    "eq", "ne", "lt", "le", "gt", "ge", "select_n", "and", "or", "not", "xor", "square", "integer_pow", "clamp",
    "nextafter", "copysign"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "argmax", "argmin", "cumsum", "cummax", "cummin", "cumprod", "cumlogsumexp"})


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _sub_jaxprs(params: dict) -> list:
    """The jaxprs an equation's params hold (a call's body, a custom rule's primal, ...)."""
    out = []
    for value in params.values():
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            inner = getattr(v, "jaxpr", v)  # a ClosedJaxpr holds its Jaxpr
            if hasattr(inner, "eqns"):
                out.append(inner)
    return out


def _eqn_flops(eqn: Any, loops: bool) -> float:
    """One equation's FLOPs; with ``loops`` a scan counts every iteration, else its body once."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * _size(eqn.outvars[0].aval) * math.prod(lhs[d] for d in contract)
    if name == "scan":
        body = jaxpr_flops(eqn.params["jaxpr"].jaxpr, loops)
        return body * (eqn.params["length"] if loops else 1)
    if name == "cond":
        return max(jaxpr_flops(b.jaxpr, loops) for b in eqn.params["branches"])
    if name in _ELEMENTWISE:
        return float(sum(_size(v.aval) for v in eqn.outvars))
    if name in _REDUCTIONS:
        return float(_size(eqn.invars[0].aval))
    return sum(jaxpr_flops(j, loops) for j in _sub_jaxprs(eqn.params))


def jaxpr_flops(jaxpr: Any, loops: bool = True) -> float:
    """FLOPs of a jaxpr's equations (see the module docstring); ``loops`` False counts each scan's
    body once, as XLA's cost analysis does."""
    return sum(_eqn_flops(eqn, loops) for eqn in jaxpr.eqns)


def loop_flops_missed(jaxpr: Any) -> float:
    """The FLOPs of the loop iterations XLA's cost analysis leaves out of ``jaxpr``'s count."""
    return jaxpr_flops(jaxpr, True) - jaxpr_flops(jaxpr, False)


def call_flops(fn: Any, *args: Any) -> tuple[Any, float]:
    """(compiled, FLOPs) of the jitted ``fn`` on abstract ``args``: XLA's count plus the loop
    iterations it missed, per device (a shard_map'ed body has per-device shapes)."""
    traced = fn.trace(*args)
    compiled = traced.lower().compile()
    return compiled, compat.cost_flops(compiled) + loop_flops_missed(traced.jaxpr.jaxpr)
