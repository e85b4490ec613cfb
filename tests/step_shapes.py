"""Step shapes for planner tests (no model, no JAX): a GPT-like chain of stages over chunks."""

import dataclasses

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
                     tuple([1e9] * (S - 1)), 1e9, tuple([2e9] * (S - 1)), shard_numels=(1000,) * n,
                     chunk_bytes=(100,) * n, opt_state_bytes=(600,) * n, micro_batches=micro_batches,
                     input_bytes=(0,) + (input_bytes,) * (S - 1) if input_bytes else ())


def frozen_shape(shape, frozen):
    """``shape`` with the chunks ``frozen`` (per chunk) frozen: they have no optimizer state."""
    frozen = tuple(bool(f) for f in frozen)
    return dataclasses.replace(shape, frozen=frozen,
                               opt_state_bytes=tuple(0 if f else b for f, b in zip(frozen, shape.opt_state_bytes)))


def sized_shape(shape, sizes):
    """``shape`` with chunk c of ``sizes[c]`` bytes, its optimizer state 6 times that (none when
    frozen) and its elements 10 times, as gpt_like_shape's chunks of 100 bytes."""
    return dataclasses.replace(shape, chunk_bytes=tuple(sizes), shard_numels=tuple(10 * b for b in sizes),
                               opt_state_bytes=tuple(0 if shape.is_frozen(c) else 6 * b for c, b in enumerate(sizes)))
