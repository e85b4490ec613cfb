"""Step shapes for planner tests (no model, no JAX): a GPT-like chain of stages over chunks."""

from pstar_jax.plan.schedule import StepShape


def gpt_like_shape(n_blocks, chunks_per_block, micro_batches=1, non_model=(100, 300), input_bytes=0):
    """embed in chunk 0, blocks in consecutive chunks (sharing an edge chunk), head reads 0 and the last.

    Items are 100 bytes, a chunk's optimizer state 600 bytes, a chunk 1000 elements; every stage
    but the first keeps an input of ``input_bytes`` for its backward (0: none)."""
    stage_chunks = [(0,)]
    c = 0
    for _ in range(n_blocks):
        stage_chunks.append(tuple(range(c, c + chunks_per_block + 1)))
        c += chunks_per_block
    stage_chunks.append((0, c))
    n = c + 1
    S = len(stage_chunks)
    lo, hi = non_model
    return StepShape(tuple(stage_chunks), tuple([lo] * (S - 1)), hi, tuple([hi] * (S - 1)),
                     tuple([1e9] * (S - 1)), 1e9, tuple([2e9] * (S - 1)), n, 1000, 100, 600, micro_batches,
                     input_bytes=(0,) + (input_bytes,) * (S - 1) if input_bytes else ())
