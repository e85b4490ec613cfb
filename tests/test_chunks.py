import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from pstar_jax.engine.chunks import ChunkLayout, auto_chunk_numels, build_layout, pack, unpack
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
    """(low, high, step) of auto_chunk_numels' search for one kind, as its docstring states it."""
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
    best = auto_chunk_numels(shapes, decays, multiple=multiple)["trainable"]
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
    best = auto_chunk_numels(shapes, lambda n: n in decayed)["trainable"]
    assert build_layout(shapes, lambda n: n in decayed, best).n_chunks >= 2


def test_auto_chunk_numel_is_least_padding_on_wide_range():
    """auto's padding is minimal over every aligned size of its range, also when that is wide."""
    rng = np.random.default_rng(0)
    shapes = {f"t{i}": (int(rng.integers(1, 3000)),) for i in range(int(rng.integers(20, 60)))}
    decays = lambda n: int(n[1:]) % 3 == 0
    best_padded = build_layout(shapes, decays, auto_chunk_numels(shapes, decays)["trainable"]).padded_numel
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
    assert layout.numels == (data["chunk_numel"],) * layout.n_chunks
    assert set(layout.chunk_numels.values()) == {data["chunk_numel"]} and layout.own_chunks == ()
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
    assert layout.chunk_numels == {"trainable": 64, "frozen": 200}  # a kind's size: the smallest of its chunks
    with pytest.raises(ValueError, match="past the end of chunk 2"):
        ChunkLayout.from_json({**data, "numels": [256, 200, 48]})


def _round(n: int, step: int) -> int:
    return -(-n // step) * step


@st.composite
def two_kind_models(draw):
    """(shapes, names that decay, names frozen)."""
    shapes, decayed = draw(models(min_tensors=2, max_tensors=16))
    return shapes, decayed, {name for name in shapes if draw(st.booleans())}


def check_kinds(layout: ChunkLayout, shapes, frozen, sizes, align: int, multiple: int) -> None:
    """Each chunk holds one kind; a kind's chunks have its size and follow model order, but for a
    tensor over that size, alone in a chunk of exactly its size (aligned, shardable)."""
    kind_of = {n: "frozen" if n in frozen else "trainable" for n in shapes}
    by_chunk: dict[int, list] = {}
    for s in layout.slots:
        by_chunk.setdefault(s.chunk, []).append(s)
        assert layout.kinds[s.chunk] == kind_of[s.name], s.name
    for c, slots in by_chunk.items():
        size = sizes[layout.kinds[c]]
        if max(s.numel for s in slots) > size:
            assert len(slots) == 1 and layout.numel_of(c) == _round(slots[0].numel, align * multiple)
            assert c in layout.own_chunks
        else:
            assert layout.numel_of(c) == size and c not in layout.own_chunks
    for kind in set(kind_of.values()):
        chunks = [s.chunk for s in layout.slots if kind_of[s.name] == kind]
        assert chunks == sorted(chunks), f"the {kind} chunks must follow model order"
    padded = {k: sum(n for n, kind in zip(layout.numels, layout.kinds) if kind == k) for k in set(layout.kinds)}
    used = {k: sum(math.prod(shapes[n]) for n in shapes if kind_of[n] == k) for k in padded}
    assert layout.waste_numels() == {k: padded[k] - used[k] for k in padded}


@settings(max_examples=200, deadline=None)
@given(two_kind_models(), st.integers(1, 700), st.integers(1, 700), st.sampled_from([1, 2, 8]),
       st.sampled_from([1, 8, 64]))
def test_each_kind_fills_chunks_of_its_own_size(model, trainable_numel, frozen_numel, multiple, align):
    shapes, decayed, frozen = model
    # (each kind has a tensor within its size, as with an int or auto's sizes: else the kind's
    # size would read as the smallest of its chunks, all of their own)
    smallest = {k: min((math.prod(s) for n, s in shapes.items() if (n in frozen) == (k == "frozen")), default=1)
                for k in ("trainable", "frozen")}
    sizes = {"trainable": max(trainable_numel, smallest["trainable"]), "frozen": max(frozen_numel, smallest["frozen"])}
    layout = build_layout(shapes, lambda n: n in decayed, sizes, align, trainable=lambda n: n not in frozen,
                          multiple=multiple)
    for s in layout.slots:  # no straddling, aligned, the decayed prefix
        assert 0 <= s.offset and s.offset + s.numel <= layout.numel_of(s.chunk) and s.offset % align == 0
        assert (s.offset + s.numel <= layout.n_decay[s.chunk]) if s.decays else (s.offset >= layout.n_decay[s.chunk])
    check_kinds(layout, shapes, frozen, sizes, align, multiple)
    assert ChunkLayout.from_json(layout.to_json()) == layout


@settings(max_examples=60, deadline=None)
@given(two_kind_models(), st.sampled_from([1, 2, 8]))
def test_auto_sizes_per_kind_are_least_padding_over_each_kinds_range(model, multiple):
    """With both kinds, each kind's size pads its tensors no more than any aligned size from its
    largest repeated tensor (else its largest) up to twice that, capped at a quarter of the kind."""
    shapes, decayed, frozen = model
    decays, trainable = (lambda n: n in decayed), (lambda n: n not in frozen)
    sizes = auto_chunk_numels(shapes, decays, multiple=multiple, trainable=trainable)
    assert set(sizes) == {"frozen" if n in frozen else "trainable" for n in shapes}
    for kind, best in sizes.items():
        mine = {n: s for n, s in shapes.items() if (n in frozen) == (kind == "frozen")}
        seen = [tuple(s) for s in mine.values()]
        repeated = [math.prod(s) for s in set(seen) if seen.count(s) > 1]
        step = multiple * ALIGN
        low = _round(max(repeated) if len(sizes) > 1 and repeated else _largest(mine), step)
        high = max(low, min(2 * low, _round(sum(_round(math.prod(s), ALIGN) for s in mine.values()) // 4, step)))
        assert low <= best <= high and best % multiple == 0

        def padded(n):
            return build_layout(mine, decays, {kind: n}, trainable=trainable, multiple=multiple).padded_numel
        assert all(padded(best) <= padded(n) for n in range(low, high + 1, step))


def test_a_tiny_llama_lora_run_gets_small_adapter_chunks_and_the_embedding_and_head_alone():
    """LoRA on a tiny Llama: the adapters' chunks are smaller than the largest frozen tensor, each
    chunk holds one kind, the embedding and head each sit alone in a chunk of their size, and
    EngineConfig.chunk_numel (--chunk-size) still forces one size on both kinds."""
    import functools

    from pstar_models import build_model
    from pstar_models.lora import LoraSpec
    from pstar_jax.config import EngineConfig
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.model.freeze import trainable
    from pstar_jax.model.lora import frozen_for_lora
    from pstar_jax.model.staged import decays
    from pstar_jax.planner.build import default_mesh, layout_for
    m = build_model("llama-tiny", lora=LoraSpec(rank=4, alpha=16.0))
    shapes, frozen = m.param_shapes(), frozen_for_lora(m, LoraConfig(rank=4))
    sizes = auto_chunk_numels(shapes, functools.partial(decays, m), trainable=trainable(frozen))
    assert sizes["trainable"] < max(math.prod(shapes[n]) for n in frozen)
    layout = layout_for(m, EngineConfig(), default_mesh(1), trainable(frozen))
    assert layout.chunk_numels == sizes and {"trainable", "frozen"} == set(layout.kinds)
    check_kinds(layout, shapes, frozen, sizes, ALIGN, 1)
    assert sorted(s.name for s in layout.slots if s.chunk in layout.own_chunks) == ["embed.embedding", "head.kernel"]
    assert all(layout.waste_numels()[k] < 0.2 * layout.padded_numel for k in sizes)
    forced = layout_for(m, EngineConfig(chunk_numel=12_345), default_mesh(1), trainable(frozen))
    assert set(forced.numels) == {12_345} and forced.own_chunks == () and set(forced.kinds) == set(sizes)
    check_kinds(forced, shapes, frozen, dict.fromkeys(sizes, 12_345), ALIGN, 1)
    with pytest.raises(ConfigError, match="below the largest tensor"):
        layout_for(m, EngineConfig(chunk_numel=4096), default_mesh(1), trainable(frozen))
