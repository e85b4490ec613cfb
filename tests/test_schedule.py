"""The step's moments: every update once, right before the first forward that reads its chunk."""

from hypothesis import given, settings, strategies as st

from pstar_jax.plan.schedule import scale_batch, staged_after, step_accesses
from step_shapes import frozen_shape, gpt_like_shape


def test_each_update_comes_right_before_the_first_forward_that_reads_its_chunk():
    shape = gpt_like_shape(3, 2, micro_batches=2)
    accesses = step_accesses(shape, [True] * shape.n_chunks)
    adam = [t for t, a in enumerate(accesses) if a.phase == "adam"]
    assert sorted(accesses[t].index for t in adam) == list(range(shape.n_chunks))
    for t in adam:
        c = accesses[t].index
        reader = next(u for u in range(t, len(accesses)) if accesses[u].phase != "adam")
        assert ("param", c) in accesses[reader].needs and accesses[reader].micro == 0
        assert all(("param", c) not in a.needs for a in accesses[:t])  # nothing reads it earlier


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3), st.integers(0, 40), st.booleans())
def test_moments_in_executor_order(n_blocks, per_block, micro, k, stream):
    """Per micro-batch: forwards, head, backwards in reverse; params dropped once, at their last
    backward use of the last micro-batch; each kind of update needs what its space implies."""
    shape = gpt_like_shape(n_blocks, per_block, micro)
    n, head = shape.n_chunks, len(shape.stage_chunks) - 1
    opt = [c < k for c in range(n)]
    accesses = step_accesses(shape, opt, [stream] * n)
    stages = [(a.phase, a.index, a.micro) for a in accesses if a.phase != "adam"]
    expected = [(p, i, m) for m in range(micro) for p, i in
                [*(("fwd", i) for i in range(head)), ("head", head), *(("bwd", i) for i in reversed(range(head)))]]
    assert stages == expected
    dropped = [it for a in accesses for it in a.drops]
    assert sorted(dropped) == [("param", c) for c in range(n)]
    for a in accesses:
        if a.phase == "adam":
            c = a.index
            if opt[c]:
                assert a.needs == (("slot", c),) and a.creates_device == (("param", c),) and not a.state_bytes_each_way
            elif stream:
                assert a.state_bytes_each_way == shape.opt_state_bytes[c] and a.creates_device == (("param", c),)
            else:
                assert a.needs == () and a.consumes == (("slot", c),) and a.creates_host == (("param", c),)
    host = [c for c in range(n) if not opt[c] and not stream]
    sent = [(it, a) for a in accesses for it in a.to_host]
    assert sorted(it for it, _ in sent) == [("slot", c) for c in host], "each host grad goes up once"
    for (_, c), a in sent:  # right after its last backward use: the grad is final
        assert a.micro == micro - 1 and ("param", c) in a.drops and ("slot", c) in a.needs
    assert sum(len(v) for v in staged_after(accesses).values()) == sum(1 for a in accesses if a.state_bytes_each_way)


def test_streamed_state_is_non_model_memory_of_the_moments_it_spans():
    """State sent down ``lead`` moments ahead and back up after its update sits beside each of them."""
    shape = gpt_like_shape(4, 1, non_model=(0, 0))
    n = shape.n_chunks
    leads = [3] * n
    accesses = step_accesses(shape, [False] * n, [True] * n, leads)
    plain = step_accesses(shape, [False] * n, [True] * n, [1] * n)
    extra = [a.non_model_bytes for a in accesses]
    for u, a in enumerate(accesses):
        if a.state_bytes_each_way:
            for t in range(max(0, u - 3), min(u + 2, len(accesses))):
                assert extra[t] >= a.state_bytes_each_way
    assert sum(extra) > sum(a.non_model_bytes for a in plain)


def test_scale_batch_scales_activations_and_flops_only():
    shape = gpt_like_shape(2, 1)
    double = scale_batch(shape, 2.0)
    assert double.fwd_non_model == tuple(2 * v for v in shape.fwd_non_model)
    assert double.head_flops == 2 * shape.head_flops and double.stage_chunks == shape.stage_chunks
    assert (double.chunk_bytes, double.opt_state_bytes, double.shard_numels) == (shape.chunk_bytes, shape.opt_state_bytes,
                                                                                 shape.shard_numels)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**8 - 1))
def test_stage_inputs_are_read_by_their_forward_and_their_backward_only(n_blocks, per_block, micro, mask):
    """Each stage input ("act", i, m), every stage but the first: needed by stage i's forward (the
    head's one moment, for the last stage) and by its backward in micro-batch m, nothing else, and
    dropped after the backward; below the lowest trainable stage no backward runs, so it is dropped
    after its forward. The step ends with none."""
    base = gpt_like_shape(n_blocks, per_block, micro, input_bytes=50)
    frozen = tuple(bool(mask >> c & 1) for c in range(base.n_chunks))
    shape = frozen_shape(base, frozen if not all(frozen) else (False,) + frozen[1:])
    accesses = step_accesses(shape, [True] * shape.n_chunks)
    head = len(shape.stage_chunks) - 1
    lowest = min(i for i, cs in enumerate(shape.stage_chunks) if any(not shape.is_frozen(c) for c in cs))
    for m in range(micro):
        for i in range(1, head + 1):
            item = ("act", i, m)
            readers = [(a.phase, a.index, a.micro) for a in accesses if item in a.needs]
            droppers = [(a.phase, a.index, a.micro) for a in accesses if item in a.drops]
            if i == head:
                assert readers == droppers == [("head", head, m)]
            elif i >= lowest:
                assert readers == [("fwd", i, m), ("bwd", i, m)] and droppers == [("bwd", i, m)]
            else:
                assert readers == droppers == [("fwd", i, m)]
    assert not any(it[0] == "act" for a in accesses for it in a.consumes + a.to_host + a.creates_device)
    assert shape.item_size(("act", 1, 0)) == 50 and shape.item_size(("slot", 0)) == shape.chunk_bytes[0]
