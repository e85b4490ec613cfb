"""Stage FLOPs with loops counted as often as they run: a stage tiled over the sequence counts
what the same stage untiled counts (XLA's cost analysis alone counts each loop body once)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from pstar_models.llama import LlamaConfig, StagedLlama
from pstar_jax.engine.chunks import build_layout
from pstar_jax.model.flops import call_flops
from pstar_jax.plan.machine import H200
from pstar_jax.engine.memory import Placement
from pstar_jax.engine.stages import StageFunctions, bind
from pstar_jax.model.tiling import TileBudget
from pstar_jax.planner.trace import trace_forward, trace_step

B, L = 2, 40
LLAMA = LlamaConfig(vocab_size=101, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, seq_len=L)
# 8 positions per tile of each kind (loss: 8 of the B*L tokens; attention and MLP: 8 of L)
SMALL = TileBudget(logits_bytes=4 * LLAMA.vocab_size * 8, scores_bytes=4 * B * LLAMA.n_head * L * 8,
                   mlp_bytes=4 * B * LLAMA.d_ff * 8)


def test_a_loop_counts_every_iteration():
    """lax.map over n row tiles of a matmul counts what one matmul over all rows counts."""
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    for n in (1, 2, 8):
        x = jax.ShapeDtypeStruct((n, 16, 128), jnp.float32)
        tiled = jax.jit(lambda w, x: jax.lax.map(lambda xi: xi @ w, x))
        whole = jax.jit(lambda w, x: (x.reshape(-1, 128) @ w).reshape(x.shape))
        matmul = 2.0 * n * 16 * 128 * 128
        for fn in (tiled, whole, jax.jit(jax.grad(lambda w, x: jnp.sum(tiled(w, x) ** 2)))):
            _, flops = call_flops(fn, w, x)
            units = 2 if fn not in (tiled, whole) else 1  # the grad: the forward (its output is read) and dW
            assert abs(flops - units * matmul) <= 0.02 * units * matmul, (n, flops, units * matmul)


def traced(tiling: TileBudget, trace=trace_step, *extra):
    model = StagedLlama(LLAMA, tiling)
    layout = build_layout(model.param_shapes(), model.decays, 4096)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    bound = [bind(s, layout, i) for i, s in enumerate(model.stages(jnp.float32))]
    per_chunk = ((x,) * layout.n_chunks for x in extra)  # trace_step's optimizer state: the same for each chunk
    return trace(bound, StageFunctions(mesh), Placement(mesh), layout.numels, jnp.float32, B, L, *per_chunk)


def trace_forward_flops(tiling: TileBudget) -> float:
    """The head's loss alone (the held-out forward)."""
    return traced(tiling, trace_forward).head_flops


@pytest.mark.slow
def test_tiled_stages_count_the_untiled_flops():
    """Forwards: equal to a few percent (padding, the tiles' index arithmetic). The head and the
    backwards run more than the untiled call: a tile's forward is recomputed in the backward loop
    (tiling.map_tiles' backward, the loss's custom vjp) where the untiled call keeps or shares it
    (XLA merges the head's two equal logits matmuls when no loop separates them), so they count at
    least the untiled call and at most one more forward. XLA's count alone gave the tiled head
    and backwards a fifth of that (5 and 10 tiles)."""
    tiled, whole = traced(SMALL, trace_step, 100), traced(TileBudget(), trace_step, 100)
    for t, w in zip(tiled.fwd_flops[1:], whole.fwd_flops[1:]):
        assert abs(t - w) <= 0.05 * w, (t, w)
    whole_loss = trace_forward_flops(TileBudget())
    assert abs(trace_forward_flops(SMALL) - whole_loss) <= 0.05 * whole_loss
    assert 0.95 * whole.head_flops <= tiled.head_flops <= whole.head_flops + 1.05 * whole_loss
    for t, w, f in zip(tiled.bwd_flops[1:], whole.bwd_flops[1:], whole.fwd_flops[1:]):
        assert 0.95 * w <= t <= w + 1.05 * f, (t, w, f)


def test_a_plan_never_beats_the_machine_matmul_rate():
    """Model TFLOPS (6 per parameter per token) over the predicted step stays below the rate the
    prediction divides counted FLOPs by: the step counts at least those FLOPs (plus recompute).
    A model wide enough and a step long enough for matmuls to dominate (not the optimizer), in
    tiles of 64 positions: XLA's count alone predicted 666 model TFLOPS on an H200 (397 then)."""
    import pstar_jax as ps
    long = dataclasses.replace(LLAMA, d_model=256, n_head=4, n_kv_head=4, d_ff=1024, seq_len=1024)
    tiles = TileBudget(logits_bytes=4 * long.vocab_size * 64, scores_bytes=4 * B * long.n_head * long.seq_len * 64,
                       mlp_bytes=4 * B * long.d_ff * 64)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    report = ps.plan_report(StagedLlama(long, tiles), ps.EngineConfig(device_memory=2**30), B, mesh, H200, 2**30,
                            search=False)
    assert report.fits and 0 < report.model_tflops * 1e12 <= H200.flops_per_s, report.model_tflops
