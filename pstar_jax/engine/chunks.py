"""Chunks: every parameter tensor packed into fixed-size flat arrays.

A chunk is a flat 1-D array of one dtype; chunk ``c`` has ``numels[c]`` elements. Each kind of
chunk has a size of its own (``build_layout`` with sizes per kind), and a tensor larger than its
kind's size gets a chunk of its own, exactly its size (an embedding or head beside a LoRA run's
adapters). The layout maps each tensor to (chunk, offset, shape); it is the same for the four
chunk lists (bf16 params and their grads, fp32 master params, Adam m, Adam v), so chunk ``i`` of
every list covers the same tensors. Rules, as in PatrickStar:
  * no tensor straddles two chunks, so a chunk's size >= the largest tensor it holds;
  * tensors are placed greedily in model order, so a stage's tensors sit in consecutive chunks;
  * inside a chunk, tensors that take weight decay come first: elements ``[0, n_decay)`` decay
    and the rest do not, so the optimizer's decay mask is one comparison, not a stored array;
  * offsets are aligned to ``align`` elements (vector loads on the accelerator);
  * a chunk holds trainable tensors or frozen ones, never both (``trainable(name)``): a frozen
    chunk has only its compute-dtype params (2 bytes per parameter in bf16), no grad, master or
    optimizer state. Each kind fills its own open chunk in model order, so a stage's tensors of
    one kind still sit in consecutive chunks of that kind;
  * a model may keep a group of its tensors apart (``group(name)``, a mixture of experts' expert
    weights): within a kind, tensors of different groups never share a chunk, so the plan can
    place and report the experts' chunks apart from attention's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from pstar_jax.config import ConfigError
from pstar_jax.model.quant_bytes import dequantized, slot_bytes, to_bytes


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    chunk: int
    offset: int
    decays: bool
    quant: str = ""  # "nf4" or "int8": a frozen kernel kept quantized, as bytes (model/quant_bytes.py)

    @property
    def numel(self) -> int:
        """The elements the slot takes in its chunk: the tensor's, or its quantized form's bytes."""
        return slot_bytes(self.shape, self.quant, self.name) if self.quant else math.prod(self.shape)

    @property
    def n_params(self) -> int:
        return math.prod(self.shape)


# What a chunk holds: trained tensors; frozen ones (params only, in the compute dtype); or frozen
# kernels quantized (QUANT_KINDS: uint8 chunks of model/quant_bytes.py's slots).
KINDS = ("trainable", "frozen", "nf4", "int8")
QUANT_KINDS = ("nf4", "int8")


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    numels: tuple[int, ...]  # per chunk: its elements
    slots: tuple[TensorSlot, ...]  # model order
    n_decay: tuple[int, ...]  # per chunk: elements [0, n_decay) take weight decay
    kinds: tuple[str, ...]  # per chunk: one of KINDS

    def __post_init__(self):
        if not len(self.numels) == len(self.n_decay) == len(self.kinds):
            raise ValueError(f"a layout needs a size, a decay prefix and a kind per chunk, got {len(self.numels)}, "
                             f"{len(self.n_decay)} and {len(self.kinds)}")
        if set(self.kinds) - set(KINDS):
            raise ValueError(f"unknown chunk kinds {sorted(set(self.kinds) - set(KINDS))}; known: {KINDS}")

    @property
    def n_chunks(self) -> int:
        return len(self.numels)

    def numel_of(self, chunk: int) -> int:
        return self.numels[chunk]

    @property
    def chunk_numels(self) -> dict[str, int]:
        """Per kind present (in KINDS order): the size its chunks are filled to. A chunk larger than
        that holds one tensor of its own, so the kind's size is the smallest of its chunks (sizes
        under every tensor of a kind, which neither an int nor auto_chunk_numels gives, would read
        as the smallest of those chunks)."""
        return {kind: min(n for n, k in zip(self.numels, self.kinds) if k == kind)
                for kind in KINDS if kind in self.kinds}

    @property
    def own_chunks(self) -> tuple[int, ...]:
        """The chunks larger than their kind's size: each holds one tensor, alone."""
        sizes = self.chunk_numels
        return tuple(c for c, (n, k) in enumerate(zip(self.numels, self.kinds)) if n > sizes[k])

    def waste_numels(self) -> dict[str, int]:
        """Per kind present: its chunks' elements that hold no tensor (padding and alignment gaps)."""
        waste = {kind: 0 for kind in self.chunk_numels}
        for n, kind in zip(self.numels, self.kinds):
            waste[kind] += n
        for s in self.slots:
            waste[self.kinds[s.chunk]] -= s.numel
        return waste

    @property
    def frozen(self) -> tuple[bool, ...]:
        """Per chunk: holds frozen tensors (params only, quantized or not); () when none does."""
        frozen = tuple(kind != "trainable" for kind in self.kinds)
        return frozen if any(frozen) else ()

    def is_frozen(self, chunk: int) -> bool:
        return self.kinds[chunk] != "trainable"

    def dtype_of(self, chunk: int, compute_dtype: Any) -> np.dtype:
        """The dtype of chunk ``chunk``'s params: uint8 for quantized kernels, else ``compute_dtype``."""
        return np.dtype(np.uint8) if self.kinds[chunk] in QUANT_KINDS else np.dtype(compute_dtype)

    def dtypes(self, compute_dtype: Any) -> tuple[np.dtype, ...]:
        """Per chunk: ``dtype_of``."""
        return tuple(self.dtype_of(c, compute_dtype) for c in range(self.n_chunks))

    @property
    def n_params(self) -> int:
        """The model's parameters (a quantized kernel's counted as its elements, not its bytes)."""
        return sum(s.n_params for s in self.slots)

    @property
    def trainable_chunks(self) -> tuple[int, ...]:
        return tuple(c for c in range(self.n_chunks) if not self.is_frozen(c))

    @property
    def frozen_names(self) -> frozenset[str]:
        """The tensors in frozen chunks."""
        return frozenset(s.name for s in self.slots if self.is_frozen(s.chunk))

    @property
    def numel(self) -> int:
        """Elements of all tensors (without padding)."""
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return sum(self.numels)

    def slot(self, name: str) -> TensorSlot:
        return self._by_name[name]

    @property
    def _by_name(self) -> dict[str, TensorSlot]:
        cached = self.__dict__.get("_by_name_cache")
        if cached is None:
            cached = {s.name: s for s in self.slots}
            object.__setattr__(self, "_by_name_cache", cached)
        return cached

    def chunks_of(self, names: Iterable[str]) -> tuple[int, ...]:
        """Sorted chunk ids that hold any of ``names``."""
        return tuple(sorted({self.slot(n).chunk for n in names}))

    def to_json(self) -> dict:
        """The layout as checkpoints keep it: "chunk_numel" when every chunk has that size (else
        "numels", per chunk), and the frozen chunks' ids, as layouts were written before sizes were
        per chunk (their checkpoints read the same)."""
        out = {"chunk_numel": self.numels[0]} if len(set(self.numels)) == 1 else {"numels": list(self.numels)}
        out["tensors"] = [[s.name, list(s.shape), s.chunk, s.offset, s.decays, *([s.quant] if s.quant else [])]
                          for s in self.slots]
        if any(self.frozen):  # absent: every chunk trainable (layouts saved before frozen chunks)
            out["frozen_chunks"] = [c for c in range(self.n_chunks) if self.is_frozen(c)]
        return out

    @staticmethod
    def from_json(data: Mapping) -> "ChunkLayout":
        slots = tuple(TensorSlot(n, tuple(sh), c, o, d, *q) for n, sh, c, o, d, *q in data["tensors"])
        if "numels" in data:
            numels = tuple(int(n) for n in data["numels"])
        else:
            numels = (int(data["chunk_numel"]),) * (max(s.chunk for s in slots) + 1)
        frozen = set(data.get("frozen_chunks", ()))
        kinds = ["frozen" if c in frozen else "trainable" for c in range(len(numels))]
        for s in slots:  # a quantized kernel's chunk holds only quantized kernels of its kind
            if s.quant:
                kinds[s.chunk] = s.quant
        return _finish(numels, slots, tuple(kinds))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _decay_first(names: Sequence[str], decays: Callable[[str], bool]) -> list[str]:
    return [n for n in names if decays(n)] + [n for n in names if not decays(n)]


def build_layout(shapes: Mapping[str, Sequence[int]], decays: Callable[[str], bool],
                 chunk_numel: int | Mapping[str, int], align: int = 64, trainable: Callable[[str], bool] | None = None,
                 multiple: int = 1, quant: Callable[[str], str] | None = None,
                 group: Callable[[str], str] | None = None) -> ChunkLayout:
    """Greedy placement in model order, trainable and frozen tensors (``trainable``, default: all
    trainable) in chunks of their own kind. ``chunk_numel`` is one size for every kind (an int, as
    ``--chunk-size`` gives: a tensor larger than it is a ConfigError) or a size per kind (a mapping
    from "trainable"/"frozen", as ``auto_chunk_numels`` gives): then a tensor larger than its kind's
    size gets a chunk of its own, its size rounded up to ``align * multiple`` (shardable over
    ``multiple`` devices), and the kind's next tensor opens a new chunk, so each kind's chunks
    still follow model order. ``quant(name)`` names the quantization ("nf4", "int8") of a frozen
    kernel stored quantized, in chunks of that kind, or "" (kept in the compute dtype).
    ``group(name)`` (default: one group) keeps tensors of different groups in different chunks."""
    kind_of, stored = tensor_kinds(shapes, trainable, quant)
    if isinstance(chunk_numel, Mapping):
        sizes = dict(chunk_numel)
    else:
        largest = max(shapes, key=lambda n: stored[n])
        if stored[largest] > chunk_numel:
            raise ConfigError(
                f"--chunk-size {chunk_numel} is below the largest tensor ({largest}, "
                f"{stored[largest]} elements); use --chunk-size auto or at least that many")
        sizes = dict.fromkeys(KINDS, chunk_numel)
    groups: list[list[str]] = []
    kinds: list[str] = []  # per chunk
    numels: list[int] = []  # per chunk
    # (kind, group) -> (the chunk it fills now, the running ends of its decayed and non-decayed parts)
    open_chunk: dict[tuple[str, str], tuple[int, int, int]] = {}
    # Fit is judged on the chunk as it will be laid out (decayed first), not in model order:
    # reordering changes the alignment gaps. The non-decayed part starts aligned, so its span does
    # not depend on the decayed part's: two running ends give the extent of the chunk plus one
    # tensor in constant time (recomputing it over the chunk made a chunk of many small tensors
    # quadratic: 12,000 tensors of a 1000-layer tiny took minutes).
    for name in shapes:
        kind, numel, decayed = kind_of[name], stored[name], decays(name)
        if kind not in sizes:
            raise ValueError(f"no chunk size for {kind} tensors (such as {name}); sizes given: {sorted(sizes)}")
        size, key = sizes[kind], (kind, group(name) if group else "")
        if numel > size:  # (sizes per kind only) alone, in a chunk of exactly its size
            groups.append([name])
            kinds.append(kind)
            numels.append(_round_up(numel, align * multiple))
            open_chunk.pop(key, None)
            continue
        c, decayed_end, plain_end = open_chunk.get(key, (-1, 0, 0))
        d_end = _round_up(decayed_end, align) + numel if decayed else decayed_end
        p_end = plain_end if decayed else _round_up(plain_end, align) + numel
        extent = _round_up(d_end, align) + p_end if p_end else d_end
        if c < 0 or extent > size:  # each kind fills chunks of its own
            c = len(groups)
            groups.append([])
            kinds.append(kind)
            numels.append(size)
            d_end, p_end = (numel, 0) if decayed else (0, numel)
        groups[c].append(name)
        open_chunk[key] = (c, d_end, p_end)
    slots = []
    for chunk, names in enumerate(groups):
        offset = 0  # decayed tensors first (stable), so a chunk's decay mask is a prefix
        for name in _decay_first(names, decays):
            q = kind_of[name] if kind_of[name] in QUANT_KINDS else ""
            slots.append(TensorSlot(name, tuple(shapes[name]), chunk, offset, decays(name), q))
            offset = _round_up(offset + stored[name], align)
    order = {name: i for i, name in enumerate(shapes)}
    slots.sort(key=lambda s: order[s.name])
    return _finish(tuple(numels), tuple(slots), tuple(kinds))


def tensor_kinds(shapes: Mapping[str, Sequence[int]], trainable: Callable[[str], bool] | None = None,
                 quant: Callable[[str], str] | None = None) -> tuple[dict[str, str], dict[str, int]]:
    """(each tensor's chunk kind, the elements it takes in its chunk): "trainable" unless
    ``trainable(name)`` is false, then "frozen" or the quantization ``quant(name)`` names, whose
    slot holds its quantized bytes (a one-line ConfigError where the kind cannot hold it)."""
    kinds, stored = {}, {}
    for name, shape in shapes.items():
        kind = "trainable" if trainable is None or trainable(name) else (quant and quant(name)) or "frozen"
        if kind not in KINDS:
            raise ValueError(f"unknown chunk kind {kind!r} for {name}; known: {KINDS}")
        kinds[name] = kind
        stored[name] = slot_bytes(tuple(shape), kind, name) if kind in QUANT_KINDS else math.prod(shape)
    return kinds, stored


def _finish(numels: tuple[int, ...], slots: tuple[TensorSlot, ...], kinds: tuple[str, ...]) -> ChunkLayout:
    n_chunks = len(numels)
    n_decay = [0] * n_chunks
    for s in slots:
        if s.decays:
            n_decay[s.chunk] = max(n_decay[s.chunk], s.offset + s.numel)
    for s in slots:
        if not s.decays and s.offset < n_decay[s.chunk]:
            raise ValueError(f"layout puts non-decayed {s.name} inside the decayed prefix")
        if s.offset + s.numel > numels[s.chunk]:
            raise ValueError(f"layout puts {s.name} past the end of chunk {s.chunk} ({numels[s.chunk]} elements)")
    return ChunkLayout(tuple(numels), slots, tuple(n_decay), tuple(kinds))


def pack(layout: ChunkLayout, params: Mapping[str, np.ndarray], dtype) -> list[np.ndarray]:
    """Tensors -> flat chunks (host numpy); padding is zero."""
    chunks = [np.zeros(layout.numel_of(c), dtype) for c in range(layout.n_chunks)]
    for s in layout.slots:
        value = np.asarray(params[s.name])
        if value.shape != s.shape:
            raise ConfigError(f"parameter {s.name} has shape {value.shape}, the layout expects {s.shape}")
        chunks[s.chunk][s.offset:s.offset + s.numel] = value.reshape(-1)
    return chunks


def pack_chunk(layout: ChunkLayout, chunk: int, tensor: Callable[[str], Any]) -> Any:
    """One fp32 chunk as a jax array, asking ``tensor(name)`` only for the tensors it holds; a
    chunk of quantized kernels is their bytes, uint8 (quantized here, on the host)."""
    import jax.numpy as jnp  # chunks is otherwise numpy-only
    if layout.kinds[chunk] in QUANT_KINDS:
        out = np.zeros(layout.numel_of(chunk), np.uint8)
        for s in (s for s in layout.slots if s.chunk == chunk):
            value = np.asarray(tensor(s.name))
            if value.shape != s.shape:
                raise ConfigError(f"parameter {s.name} has shape {value.shape}, the layout expects {s.shape}")
            out[s.offset:s.offset + s.numel] = to_bytes(value, s.quant, s.name)
        return jnp.asarray(out)
    pieces, end = [], 0
    for s in sorted((s for s in layout.slots if s.chunk == chunk), key=lambda s: s.offset):
        if s.offset > end:
            pieces.append(jnp.zeros((s.offset - end,), jnp.float32))
        value = jnp.asarray(tensor(s.name), jnp.float32)
        if value.shape != s.shape:
            raise ConfigError(f"parameter {s.name} has shape {value.shape}, the layout expects {s.shape}")
        pieces.append(value.reshape(-1))
        end = s.offset + s.numel
    pieces.append(jnp.zeros((layout.numel_of(chunk) - end,), jnp.float32))
    return jnp.concatenate(pieces)


def unpack(layout: ChunkLayout, chunks: Sequence[np.ndarray], dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Flat chunks -> tensors by name, in model order (``slot_value``)."""
    host = [np.asarray(c) for c in chunks]
    return {s.name: slot_value(s, host[s.chunk], dtype) for s in layout.slots}


def slot_value(slot: TensorSlot, chunk: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """A tensor's values in its (host) chunk; a quantized kernel dequantized in full into ``dtype``."""
    piece = chunk[slot.offset:slot.offset + slot.numel]
    if slot.quant:
        return dequantized(piece, slot.shape, slot.quant, dtype)
    return piece.reshape(slot.shape)


def auto_chunk_numels(shapes: Mapping[str, Sequence[int]], decays: Callable[[str], bool],
                      multiple: int = 1, align: int = 64, max_candidates: int = 512,
                      trainable: Callable[[str], bool] | None = None,
                      quant: Callable[[str], str] | None = None,
                      group: Callable[[str], str] | None = None, max_chunks: int | None = None) -> dict[str, int]:
    """Per kind present ("trainable", "frozen", a quantization), the chunk size whose layout of that kind's tensors
    wastes the fewest elements (build_layout with these sizes).

    Waste is padding at chunk ends plus alignment gaps. A least-waste size is always the extent
    of some run of consecutive tensors of the kind (a smaller size would not change the layout of
    a full chunk), so those extents are the candidates; repeated blocks make most of them equal.
    Sizes run from ``low`` up to 2x it (coarser chunks place memory too coarsely), but no further
    than a quarter of the kind, so there are always several chunks to place. Ties go to the
    smaller size. ``low`` is the largest tensor when one kind holds every tensor (nothing frozen:
    the sizes of layouts before kinds had sizes of their own). With both kinds it is the kind's
    largest tensor whose shape occurs at least twice (a block's), else its largest: a larger
    singleton, such as an embedding or a head, gets a chunk of its own instead of setting the
    size of all the others.

    ``max_chunks``: where the kinds' least-waste sizes give more chunks in all, the kind with the
    most chunks searches again from the size that brings the total within it (a mixture of
    experts' thousands of small expert kernels, say), and so on while the total is over."""
    kind_of, stored = tensor_kinds(shapes, trainable, quant)
    by_kind: dict[str, dict[str, Sequence[int]]] = {}
    for name, shape in shapes.items():
        by_kind.setdefault(kind_of[name], {})[name] = shape
    out = {}
    for kind in (k for k in KINDS if k in by_kind):
        mine = by_kind[kind]
        seen: dict[tuple, int] = {}
        for shape in mine.values():
            seen[tuple(shape)] = seen.get(tuple(shape), 0) + 1
        repeated = [stored[n] for n, s in mine.items() if seen[tuple(s)] > 1]
        low = max(repeated) if len(by_kind) > 1 and repeated else max(stored[n] for n in mine)
        out[kind] = _least_waste(mine, decays, low, kind, multiple, align, max_candidates, group)
    if max_chunks is None:
        return out

    def count(kind: str) -> int:
        return build_layout(by_kind[kind], decays, {kind: out[kind]}, align, trainable, multiple, quant, group).n_chunks
    counts = {kind: count(kind) for kind in out}
    for kind in sorted(out, key=counts.get, reverse=True):
        if sum(counts.values()) <= max_chunks:
            break
        room = max(1, max_chunks - (sum(counts.values()) - counts[kind]))
        low = -(-sum(stored[n] for n in by_kind[kind]) // room)
        out[kind] = _least_waste(by_kind[kind], decays, max(low, out[kind]), kind, multiple, align, max_candidates,
                                 group)
        counts[kind] = count(kind)
    return out


def _least_waste(shapes: Mapping[str, Sequence[int]], decays: Callable[[str], bool], low_numel: int, kind: str,
                 multiple: int, align: int, max_candidates: int, group: Callable[[str], str] | None) -> int:
    """auto_chunk_numels' search over the tensors of one kind."""
    names = list(shapes)
    trainable, quant = (lambda name: kind == "trainable"), (lambda name: kind if kind in QUANT_KINDS else "")
    stored = tensor_kinds(shapes, trainable, quant)[1]
    sizes = [_round_up(stored[n], align) for n in names]
    low = _round_up(low_numel, multiple * align)
    high = max(low, min(2 * low, _round_up(sum(sizes) // 4, multiple * align)))
    candidates = {low}
    for i in range(len(names)):
        run = 0
        for size in sizes[i:]:
            run += size
            if run > high:
                break
            if run >= low:
                candidates.add(_round_up(run, multiple))
    ordered = sorted(candidates)
    if len(ordered) > max_candidates:  # keep the search quick for huge, irregular models
        step = len(ordered) / max_candidates
        ordered = sorted({ordered[int(i * step)] for i in range(max_candidates)} | {low})
    return min(ordered, key=lambda n: (build_layout(shapes, decays, {kind: n}, align, trainable,
                                                    multiple, quant, group).padded_numel, n))


def outgrown(shapes: Mapping[str, Sequence[int]], chunk_numel: int | Mapping[str, int],
             trainable: Callable[[str], bool] | None = None, quant: Callable[[str], str] | None = None) -> set[str]:
    """The tensors larger than their kind's size (with sizes per kind: those in chunks of their own)."""
    kind_of, stored = tensor_kinds(shapes, trainable, quant)
    sizes = chunk_numel if isinstance(chunk_numel, Mapping) else dict.fromkeys(KINDS, chunk_numel)
    return {n for n in shapes if stored[n] > sizes.get(kind_of[n], 0)}
