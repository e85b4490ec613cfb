import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from pstar_jax.engine.chunks import ChunkLayout, auto_chunk_numel, build_layout, pack, unpack
from pstar_jax.config import ConfigError

ALIGN = 64
ODD_SHAPES = [(3, 7), (1,), (5, 11, 2), (64,), (65,), (127,), (2, 32), (9, 9, 9), (1, 1), (200,)]

shape_st = st.one_of(st.sampled_from(ODD_SHAPES),
                     st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple))


@st.composite
def models(draw, min_tensors=1, max_tensors=12):
    """(shapes in model order, names that decay)."""
    n = draw(st.integers(min_tensors, max_tensors))
    shapes = {f"t{i}": draw(shape_st) for i in range(n)}
    decayed = {name for name in shapes if draw(st.booleans())}
    return shapes, decayed


def _largest(shapes) -> int:
    return max(math.prod(s) for s in shapes.values())


def check_layout(layout: ChunkLayout, shapes, decayed, align: int) -> None:
    assert [s.name for s in layout.slots] == list(shapes)
    assert layout.n_chunks == len(layout.n_decay) == 1 + max(s.chunk for s in layout.slots)
    assert layout.numel == sum(math.prod(s) for s in shapes.values())
    for s in layout.slots:
        assert s.shape == tuple(shapes[s.name]) and s.decays == (s.name in decayed)
        assert 0 <= s.offset and s.offset + s.numel <= layout.numel_of(s.chunk), f"{s} straddles its chunk"
        assert s.offset % align == 0
        if s.decays:
            assert s.offset + s.numel <= layout.n_decay[s.chunk]
        else:
            assert s.offset >= layout.n_decay[s.chunk]
    chunks = [s.chunk for s in layout.slots]
    assert chunks == sorted(chunks), "model order must map to non-decreasing chunks"
    assert set(chunks) == set(range(layout.n_chunks)), "no empty chunk"
    for c in range(layout.n_chunks):
        ranges = sorted((s.offset, s.offset + s.numel) for s in layout.slots if s.chunk == c)
        assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:])), "overlap"
        decayed_in_c = [s for s in layout.slots if s.chunk == c and s.decays]
        assert layout.n_decay[c] == max((s.offset + s.numel for s in decayed_in_c), default=0)


@settings(max_examples=300, deadline=None)
@given(models(), st.integers(0, 600), st.sampled_from([1, 8, 64]))
def test_layout_invariants_aligned_chunks(model, extra_aligns, align):
    """No straddling or overlap, aligned offsets, model order -> chunk order, decayed prefix."""
    shapes, decayed = model
    chunk_numel = -(-_largest(shapes) // align) * align + extra_aligns * align
    layout = build_layout(shapes, lambda n: n in decayed, chunk_numel, align)
    check_layout(layout, shapes, decayed, align)


@settings(max_examples=300, deadline=None)
@given(models(), st.integers(0, 3000))
@example(({"a": (64,), "b": (1,)}, {"b"}), 1)  # once put 'a' past the end of a 65-element chunk
def test_layout_invariants_any_chunk_size(model, extra):
    """The same invariants for a chunk size that is not a multiple of align (--chunk-size 1000)."""
    shapes, decayed = model
    layout = build_layout(shapes, lambda n: n in decayed, _largest(shapes) + extra, ALIGN)
    check_layout(layout, shapes, decayed, ALIGN)


def test_stage_tensors_in_consecutive_chunks():
    """Any contiguous run of tensors (a stage) lies in a contiguous range of chunk ids."""
    shapes = {f"t{i}": (37 * (i % 5 + 1),) for i in range(30)}
    layout = build_layout(shapes, lambda n: int(n[1:]) % 2 == 0, 512)
    names = list(shapes)
    for start in range(len(names)):
        for stop in range(start + 1, len(names) + 1):
            chunks = layout.chunks_of(names[start:stop])
            assert chunks == tuple(range(chunks[0], chunks[-1] + 1))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@settings(max_examples=40, deadline=None)
@given(model=models(), extra_aligns=st.integers(0, 20), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(dtype, model, extra_aligns, seed):
    """unpack(pack(x)) == x exactly, and every element outside a tensor is zero padding."""
    shapes, decayed = model
    chunk_numel = -(-_largest(shapes) // ALIGN) * ALIGN + extra_aligns * ALIGN
    layout = build_layout(shapes, lambda n: n in decayed, chunk_numel)
    rng = np.random.default_rng(seed)
    # Non-zero values so that zero padding cannot be confused with a tensor element.
    params = {n: (rng.standard_normal(s) + 10.0).astype(dtype) for n, s in shapes.items()}
    chunks = pack(layout, params, dtype)
    assert len(chunks) == layout.n_chunks
    assert all(c.shape == (chunk_numel,) and c.dtype == np.dtype(dtype) for c in chunks)
    out = unpack(layout, chunks)
    assert list(out) == list(shapes)
    for name in shapes:
        assert out[name].dtype == np.dtype(dtype) and out[name].shape == tuple(shapes[name])
        assert np.array_equal(out[name], params[name])
    used = [np.zeros(chunk_numel, bool) for _ in chunks]
    for s in layout.slots:
        used[s.chunk][s.offset:s.offset + s.numel] = True
    for chunk, mask in zip(chunks, used):
        assert np.all(chunk[~mask] == 0) and np.all(chunk[mask] != 0)


def test_pack_rejects_wrong_shape():
    """A parameter whose shape differs from the layout's is a ConfigError naming it."""
    layout = build_layout({"w": (3, 7), "b": (7,)}, lambda n: n == "w", 64)
    with pytest.raises(ConfigError, match=r"parameter w has shape \(7, 3\)"):
        pack(layout, {"w": np.zeros((7, 3)), "b": np.zeros(7)}, np.float32)


def test_chunk_below_largest_tensor():
    """A chunk smaller than the largest tensor is a ConfigError naming the tensor and 'auto'."""
    shapes = {"embed": (10, 12), "ln": (12,), "head": (12, 11)}
    with pytest.raises(ConfigError, match=r"below the largest tensor \(head, 132 elements\).*auto"):
        build_layout(shapes, lambda n: True, 131)
    assert build_layout(shapes, lambda n: True, 132, align=1).n_chunks == 2


@settings(max_examples=100, deadline=None)
@given(models(), st.integers(0, 10))
def test_json_round_trip(model, extra_aligns):
    """ChunkLayout.from_json(to_json()) equals the original layout."""
    shapes, decayed = model
    chunk_numel = -(-_largest(shapes) // ALIGN) * ALIGN + extra_aligns * ALIGN
    layout = build_layout(shapes, lambda n: n in decayed, chunk_numel)
    again = ChunkLayout.from_json(layout.to_json())
    assert again == layout and again.n_decay == layout.n_decay
    assert again.slot("t0") == layout.slot("t0")


def _search_range(shapes, multiple: int, align: int) -> tuple[int, int, int]:
    """(low, high, step) of auto_chunk_numel's search, as its docstring states it."""
    step = multiple * align
    rounded = lambda n: -(-n // step) * step
    largest = _largest(shapes)
    total = sum(-(-math.prod(s) // align) * align for s in shapes.values())
    low = rounded(largest)
    return low, max(low, min(2 * low, rounded(total // 4))), step


@st.composite
def many_tensor_models(draw):
    """Many similar tensors, so auto's range spans several sizes (few tensors give one size)."""
    sizes = draw(st.lists(st.integers(1, 500), min_size=8, max_size=40))
    shapes = {f"t{i}": (n,) if i % 3 else (1, n) for i, n in enumerate(sizes)}
    return shapes, {name for name in shapes if draw(st.booleans())}


@settings(max_examples=60, deadline=None)
@given(st.one_of(models(min_tensors=2), many_tensor_models()), st.sampled_from([1, 2, 8]))
def test_auto_chunk_numel_is_least_padding(model, multiple):
    """auto picks a size >= the largest tensor that pads no more than any aligned size of its range."""
    shapes, decayed = model
    decays = lambda n: n in decayed
    best = auto_chunk_numel(shapes, decays, multiple=multiple)
    low, high, step = _search_range(shapes, multiple, ALIGN)
    assert best >= _largest(shapes) and best % multiple == 0 and best <= high
    best_padded = build_layout(shapes, decays, best).padded_numel
    for size in range(low, high + 1, step):
        assert best_padded <= build_layout(shapes, decays, size).padded_numel, size


@settings(max_examples=60, deadline=None)
@given(st.one_of(models(min_tensors=2), many_tensor_models()))
def test_auto_chunk_numel_gives_several_chunks(model):
    """For a model of several tensors auto never puts everything into one chunk."""
    shapes, decayed = model
    best = auto_chunk_numel(shapes, lambda n: n in decayed)
    assert build_layout(shapes, lambda n: n in decayed, best).n_chunks >= 2


def test_auto_chunk_numel_is_least_padding_on_wide_range():
    """auto's padding is minimal over every aligned size of its range, also when that is wide."""
    rng = np.random.default_rng(0)
    shapes = {f"t{i}": (int(rng.integers(1, 3000)),) for i in range(int(rng.integers(20, 60)))}
    decays = lambda n: int(n[1:]) % 3 == 0
    best_padded = build_layout(shapes, decays, auto_chunk_numel(shapes, decays)).padded_numel
    low, high, step = _search_range(shapes, 1, ALIGN)
    assert (high - low) // step > 40  # a wide range: many sizes to beat
    assert best_padded <= min(build_layout(shapes, decays, n).padded_numel
                              for n in range(low, high + 1, step))


def test_layout_work_is_linear_in_the_tensors():
    """A chunk of many small tensors (a deep narrow model in one large chunk) is laid out in one
    pass: the decay rule is asked a few times per tensor, not once per tensor per tensor added."""
    n = 2000
    shapes = {f"t{i}": (8,) if i % 3 else (4, 4) for i in range(n)}
    asked = []

    def decays(name):
        asked.append(name)
        return len(shapes[name]) == 2
    layout = build_layout(shapes, decays, 1 << 20)
    assert layout.n_chunks == 1 and len(asked) <= 4 * n


@settings(max_examples=100, deadline=None)
@given(models(), st.integers(0, 100), st.integers(0, 2**12 - 1))
def test_json_round_trips_and_keeps_the_format_of_one_size(model, extra_aligns, mask):
    """A layout reads back equal from its JSON; a layout of one size writes what layouts wrote
    before sizes and kinds were per chunk (a size, the tensors, the frozen chunks' ids)."""
    shapes, decayed = model
    frozen = {name for i, name in enumerate(shapes) if mask >> i & 1}
    layout = build_layout(shapes, lambda n: n in decayed, -(-_largest(shapes) // ALIGN) * ALIGN + extra_aligns * ALIGN,
                          trainable=lambda n: n not in frozen)
    data = layout.to_json()
    assert ChunkLayout.from_json(data) == layout
    assert sorted(data) == sorted(["chunk_numel", "tensors"] + (["frozen_chunks"] if frozen else []))
    assert layout.numels == (data["chunk_numel"],) * layout.n_chunks and layout.chunk_numel == data["chunk_numel"]
    assert layout.kinds == tuple("frozen" if c in data.get("frozen_chunks", ()) else "trainable"
                                 for c in range(layout.n_chunks))
    assert layout.frozen == (tuple(k == "frozen" for k in layout.kinds) if frozen else ())


OLD_JSON = {"chunk_numel": 256, "tensors": [["a", [10, 10], 0, 0, True], ["b", [3], 0, 128, False],
                                          ["c", [200], 1, 0, True], ["d", [7, 7], 2, 0, True]],
            "frozen_chunks": [1]}


def test_a_layout_written_before_sizes_were_per_chunk_reads():
    """The JSON of existing checkpoints: one "chunk_numel" and the frozen chunks' ids."""
    layout = ChunkLayout.from_json(OLD_JSON)
    assert layout.numels == (256, 256, 256) and layout.padded_numel == 768
    assert layout.kinds == ("trainable", "frozen", "trainable") and layout.frozen == (False, True, False)
    assert layout.trainable_chunks == (0, 2) and layout.frozen_names == {"c"} and layout.n_decay == (100, 200, 49)
    assert layout.to_json() == OLD_JSON


def test_sizes_per_chunk_are_written_only_where_they_differ():
    data = {**OLD_JSON, "numels": [256, 200, 64]}
    del data["chunk_numel"]
    layout = ChunkLayout.from_json(data)
    assert layout.numels == (256, 200, 64) and layout.padded_numel == 520 and layout.to_json() == data
    assert [c.shape for c in pack(layout, {"a": np.ones((10, 10)), "b": np.ones(3), "c": np.ones(200),
                                           "d": np.ones((7, 7))}, np.float32)] == [(256,), (200,), (64,)]
    with pytest.raises(ValueError, match="sizes, not one"):
        layout.chunk_numel
    with pytest.raises(ValueError, match="past the end of chunk 2"):
        ChunkLayout.from_json({**data, "numels": [256, 200, 48]})
