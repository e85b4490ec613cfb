"""The warm-up trace: non-model memory per moment from compile-time analysis, nothing allocated."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pstar_models.gpt import build_model
from pstar_jax.engine.chunks import build_layout
from pstar_jax.engine.memory import Placement
from pstar_jax.engine.stages import StageFunctions, bind
from pstar_jax.planner.trace import trace_step


def traced(n_layer, batch=4, cache=None):
    model = build_model("tiny", n_layer=n_layer)
    layout = build_layout(model.param_shapes(), model.decays, 8192)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    bound = [bind(s, layout, i) for i, s in enumerate(model.stages(jnp.bfloat16))]
    return trace_step(bound, StageFunctions(mesh), Placement(mesh), layout.numels, jnp.bfloat16,
                      batch, 64, (100,) * layout.n_chunks, cache=cache), layout


def test_trace_shapes_and_memory():
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    shape, layout = traced(3)
    assert {id(x) for x in jax.live_arrays()} <= before, "tracing must not allocate"
    assert shape.n_chunks == layout.n_chunks and len(shape.stage_chunks) == 5
    assert len(shape.fwd_non_model) == len(shape.bwd_non_model) == 4
    assert all(b > 0 for b in shape.fwd_non_model + shape.bwd_non_model) and shape.head_non_model > 0
    # The stage inputs kept for the backward are items, not non-model bytes: micro-batch x
    # sequence x d_model in the compute dtype (bf16) for every stage after the embedding, so equal
    # blocks have equal working memory wherever they sit.
    assert shape.input_bytes == (0,) + (4 * 64 * 32 * 2,) * 4
    assert shape.fwd_non_model[3] == shape.fwd_non_model[1]
    assert shape.busiest_working_bytes >= shape.head_non_model + sum(shape.input_bytes)  # the head holds them all
    assert shape.bwd_flops[1] > shape.fwd_flops[1] > 0
    assert shape.chunk_bytes == (8192 * 2,) * layout.n_chunks and shape.shard_numels == layout.numels


def test_activation_memory_grows_with_batch():
    small, _ = traced(2, batch=2)
    big, _ = traced(2, batch=8)
    assert big.head_non_model > small.head_non_model and big.bwd_non_model[1] > small.bwd_non_model[1]


def test_shared_cache_analyses_equal_stages_once():
    """A deeper model of the same width reuses every analysis: the cache does not grow."""
    cache = {}
    traced(2, cache=cache)
    analyses = {k for k in cache if k[0] != "out"}
    traced(6, cache=cache)
    assert len({k for k in cache if k[0] != "out"}) <= len(analyses) + 2  # a new chunk count at most
