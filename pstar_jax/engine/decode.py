"""Autoregressive decoding of a staged NNX model: on the device with a KV cache, or streamed.

The model owns attention, so it owns the cache: its NNX module implements ``Decoder``
(models/gpt.py and models/llama.py do). Two ways to run it, giving the same tokens:

* ``CachedDecoder``: every parameter on the device, and one jitted function for the whole
  generation: a prefill of the prompt, then a ``while_loop`` of one-token steps, each reading
  and extending a cache [layers, B, max_len, kv_heads, head_dim] in the compute dtype.
* ``StreamedDecoder``: for a model larger than the device. Parameters stay in pinned host
  memory; every new token runs the chain stage by stage (embed, each block, head), bringing
  each stage's parameters to the device just for it (the next stage's copy is issued before
  the current stage runs, so it overlaps), and each layer's cache goes back to the host with
  them. Every token moves the whole model across the bus: slow, but it runs.

Sampling is greedy at temperature 0, else softmax(logits / temperature) restricted to the
smallest set of tokens whose probability reaches ``top_p`` (nucleus); the key of new token i is
``fold_in(key(seed), i)`` in both decoders, so a seed reproduces a sample.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pstar_jax.config import ConfigError
from pstar_jax.model.nnx_staged import NNXStaged
from pstar_jax.model.nnx_staged import PerLayer


@runtime_checkable
class Decoder(Protocol):
    """What an NNX module provides to be decoded. The cache is a pytree whose leaves have the
    layer as their first axis, or a ``PerLayer`` (a tuple with one pytree per layer, for blocks
    whose caches differ: Qwen3.5's linear and full-attention layers);
    ``blocks[i].decode(h, layer_cache, pos) -> (h, layer_cache)`` works on layer i's part. ``pos``
    is the position of the first of the T new tokens."""
    blocks: Sequence[Any]

    def max_decode_len(self) -> int: ...

    def init_cache(self, batch: int, max_len: int, dtype: Any) -> Any: ...

    def decode_embed(self, tokens_BxT: jax.Array, pos: jax.Array) -> jax.Array: ...

    def decode_logits(self, h_BxTxD: jax.Array) -> jax.Array: ...

    def decode(self, tokens_BxT: jax.Array, cache: Any, pos: jax.Array) -> tuple[jax.Array, Any]: ...


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0
    eos_id: int | None = None  # a row that samples it is finished (and repeats it); all finished: stop

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"the temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p!r}")


def sample(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """One token per row (int32): argmax at temperature 0, else a draw from the nucleus."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV / temperature
    if top_p < 1:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # mass of the more likely tokens
        kept = jnp.sum(before_BxV < top_p, axis=-1, keepdims=True)  # >= 1: the top token always stays
        threshold_Bx1 = jnp.take_along_axis(sorted_BxV, kept - 1, axis=-1)
        logits_BxV = jnp.where(logits_BxV >= threshold_Bx1, logits_BxV, -jnp.inf)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def _step(logits_BxV: jax.Array, key: jax.Array, i: jax.Array, done_B: jax.Array, s: Sampling
          ) -> tuple[jax.Array, jax.Array]:
    """New token i of every row, and which rows are finished after it."""
    token_B = sample(logits_BxV, jax.random.fold_in(key, i), s.temperature, s.top_p)
    if s.eos_id is None:
        return token_B, done_B
    token_B = jnp.where(done_B, s.eos_id, token_B)
    return token_B, done_B | (token_B == s.eos_id)


# -- the NNX module from flat parameters ------------------------------------------------------


def _path(name: str) -> tuple:
    return tuple(int(k) if k.isdigit() else k for k in name.split("."))


def _merge(graph: Any, params: Mapping[str, jax.Array]) -> nnx.Module:
    return nnx.merge(graph, nnx.from_flat_state([(_path(n), v) for n, v in params.items()]))


def decoder_shell(model: NNXStaged, n_blocks: int) -> tuple[Any, Decoder]:
    """(graph, abstract module) of the model with ``n_blocks`` blocks; ConfigError if the module
    cannot decode."""
    make = getattr(model, "make", None)
    if make is None:
        raise ConfigError(f"{type(model).__name__} is not an NNX staged model; pstar-generate decodes those only")
    module = nnx.eval_shape(lambda: make(nnx.Rngs(0), n_blocks))
    missing = [m for m in ("max_decode_len", "init_cache", "decode_embed", "decode_logits", "decode")
               if not callable(getattr(module, m, None))]
    if missing:
        raise ConfigError(f"the model {type(module).__name__} has no {', '.join(missing)}: it cannot be decoded "
                          "(see pstar_jax.engine.decode.Decoder)")
    return nnx.split(module, nnx.Param)[0], module


def cache_bytes(model: NNXStaged, batch: int, max_len: int, dtype: Any) -> int:
    _, shell = decoder_shell(model, 0)
    cache = jax.eval_shape(lambda: shell.init_cache(batch, max_len, dtype))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def params_bytes(model: NNXStaged, dtype: Any) -> int:
    return sum(math.prod(s) for s in model.param_shapes().values()) * jnp.dtype(dtype).itemsize


# -- on the device, one jitted loop -----------------------------------------------------------


class CachedDecoder:
    """The whole generation as one compiled function of (params, prompt_BxP, key)."""

    def __init__(self, model: NNXStaged, dtype: Any, batch: int, prompt_len: int, n_new: int, s: Sampling):
        self.graph, shell = decoder_shell(model, model.n_layer)
        self.dtype, self.n_new, self.sampling = jnp.dtype(dtype), n_new, s
        abstract = {n: jax.ShapeDtypeStruct(shape, self.dtype) for n, shape in model.param_shapes().items()}
        self.compiled = jax.jit(self._generate).lower(
            abstract, jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32), jax.random.key(0)).compile()

    def device_bytes(self) -> int:
        """What the compiled generation holds on the device at its peak: arguments, outputs and
        temporaries (the cache, activations), as XLA accounts them."""
        m = self.compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)

    def _generate(self, params: Mapping[str, jax.Array], prompt_BxP: jax.Array, key: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
        module: Any = _merge(self.graph, params)
        B, P = prompt_BxP.shape
        n_new, s = self.n_new, self.sampling
        cache = module.init_cache(B, P + n_new, self.dtype)
        logits_BxPxV, cache = module.decode(prompt_BxP, cache, jnp.int32(0))
        token_B, done_B = _step(logits_BxPxV[:, -1], key, jnp.int32(0), jnp.zeros((B,), bool), s)
        out_BxN = jnp.zeros((B, n_new), jnp.int32).at[:, 0].set(token_B)

        def more(carry):
            i, _, _, _, done_B = carry
            return (i < n_new) & ~jnp.all(done_B)

        def step(carry):
            i, out_BxN, cache, token_B, done_B = carry
            logits_Bx1xV, cache = module.decode(token_B[:, None], cache, P + i - 1)
            token_B, done_B = _step(logits_Bx1xV[:, 0], key, i, done_B, s)
            return i + 1, out_BxN.at[:, i].set(token_B), cache, token_B, done_B

        n, out_BxN, *_ = jax.lax.while_loop(more, step, (jnp.int32(1), out_BxN, cache, token_B, done_B))
        return out_BxN, n

    def __call__(self, params: Mapping[str, jax.Array], prompt_BxP: np.ndarray) -> np.ndarray:
        """The new tokens [B, n], n <= n_new (fewer when every row reached eos)."""
        out_BxN, n = self.compiled(dict(params), jnp.asarray(prompt_BxP, jnp.int32),
                                   jax.random.key(self.sampling.seed))
        return np.asarray(out_BxN)[:, :int(n)]


# -- streamed from the host, stage by stage ---------------------------------------------------


class StreamedDecoder:
    """Parameters in pinned host memory, brought to the device one stage at a time per token."""

    def __init__(self, model: NNXStaged, dtype: Any, device: jax.Device | None = None):
        self.model, self.dtype = model, jnp.dtype(dtype)
        device = device or jax.devices()[0]
        self.on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        self.on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        stages = model.stages(self.dtype)
        self.stage_names = [s.param_names for s in stages]
        self.outer_graph, _ = decoder_shell(model, 0)
        decoder_shell(model, 1)  # refuses a module that cannot decode
        # Per block stage its compiled decode, one per kind of block (stages sharing an apply:
        # Gemma's sliding and global layers, Qwen3-MoE's dense and sparse ones), with its kind's
        # graph and tensor paths.
        kinds: dict[Any, Callable] = {}
        self._blocks = []
        for i, stage in enumerate(stages[1:-1]):
            if stage.apply not in kinds:
                paths = [n.split(".", 2)[2] for n in stage.param_names]  # 'blocks.<i>.<path>'
                kinds[stage.apply] = jax.jit(functools.partial(self._block_fn, model.block_graph(i), paths),
                                             donate_argnums=(2,))
            self._blocks.append(kinds[stage.apply])
        self.outer_zeros = {n: jax.ShapeDtypeStruct(s, self.dtype) for n, s in model.param_shapes().items()
                            if not n.startswith("blocks.")}
        self.host: list[tuple[jax.Array, ...]] = []  # per stage, filled by load()
        self._embed = jax.jit(self._embed_fn)
        self._head = jax.jit(self._head_fn)
        self._sample = jax.jit(_step, static_argnums=(4,))

    def stage_bytes(self) -> list[int]:
        shapes = self.model.param_shapes()
        return [sum(math.prod(shapes[n]) for n in names) * self.dtype.itemsize for names in self.stage_names]

    def load(self, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
        """Take the tensors (any order, one at a time) into pinned host memory in the compute dtype."""
        where: dict[str, list[tuple[int, int]]] = {}  # a tied embedding is read by two stages
        for s, names in enumerate(self.stage_names):
            for k, n in enumerate(names):
                where.setdefault(n, []).append((s, k))
        slots: list[list[Any]] = [[None] * len(names) for names in self.stage_names]
        for name, value in tensors:
            if name not in where:
                raise ConfigError(f"the weights hold {name}, which the model does not have")
            on_host = jax.device_put(np.asarray(value).astype(self.dtype), self.on_host)
            for s, k in where[name]:
                slots[s][k] = on_host
        missing = [n for names, got in zip(self.stage_names, slots) for n, v in zip(names, got) if v is None]
        if missing:
            raise ConfigError(f"the weights lack {missing[0]} ({len(missing)} tensors missing)")
        self.host = [tuple(s) for s in slots]

    def _outer(self, names: Sequence[str], params: Sequence[jax.Array]) -> Any:
        given = dict(zip(names, params))  # tensors the stage does not read are zeros XLA removes
        return _merge(self.outer_graph, {n: given.get(n, jnp.zeros(z.shape, z.dtype))
                                         for n, z in self.outer_zeros.items()})

    def _embed_fn(self, params, tokens_BxT, pos):
        return self._outer(self.stage_names[0], params).decode_embed(tokens_BxT, pos)

    @staticmethod
    def _block_fn(graph, paths, params, h_BxTxD, layer_cache, pos):
        block = _merge(graph, dict(zip(paths, params)))
        return block.decode(h_BxTxD, layer_cache, pos)

    def _head_fn(self, params, h_BxTxD):
        return self._outer(self.stage_names[-1], params).decode_logits(h_BxTxD[:, -1:])[:, 0]

    def _fetch(self, stage: int) -> tuple[jax.Array, ...]:
        return tuple(jax.device_put(x, self.on_device) for x in self.host[stage])

    def logits(self, tokens_BxT: jax.Array, cache: list[Any], pos: int) -> jax.Array:
        """The last position's logits; ``cache`` (one host pytree per layer) is updated in place."""
        last = len(self.host) - 1
        pos_ = jnp.int32(pos)
        upcoming = self._fetch(0)
        for s in range(last + 1):
            params = upcoming
            if s < last:
                upcoming = self._fetch(s + 1)  # dispatched now: copied while stage s computes
            if s == 0:
                h = self._embed(params, tokens_BxT, pos_)
            elif s == last:
                return self._head(params, h)
            else:
                layer = jax.device_put(cache[s - 1], self.on_device)
                h, layer = self._blocks[s - 1](params, h, layer, pos_)
                cache[s - 1] = jax.device_put(layer, self.on_host)
        raise AssertionError("unreachable")

    def __call__(self, prompt_BxP: np.ndarray, n_new: int, s: Sampling) -> np.ndarray:
        """The new tokens [B, n], n <= n_new (fewer when every row reached eos)."""
        B, P = prompt_BxP.shape
        _, shell = decoder_shell(self.model, 0)
        full = jax.eval_shape(lambda: shell.init_cache(B, P + n_new, self.dtype))
        layers = list(full) if isinstance(full, PerLayer) else [
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), full)] * self.model.n_layer
        cache = [jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), self.on_host), layer)
                 for layer in layers]
        key, done_B = jax.random.key(s.seed), jnp.zeros((B,), bool)
        tokens_BxT, out = jnp.asarray(prompt_BxP, jnp.int32), []
        for i in range(n_new):
            logits_BxV = self.logits(tokens_BxT, cache, 0 if i == 0 else P + i - 1)
            token_B, done_B = self._sample(logits_BxV, key, jnp.int32(i), done_B, s)
            out.append(np.asarray(token_B))
            if s.eos_id is not None and bool(jnp.all(done_B)):
                break
            tokens_BxT = token_B[:, None]
        return np.stack(out, axis=1)


def stream_peak_bytes(stage_bytes: Sequence[int], layer_cache_bytes: int) -> int:
    """Parameters of two consecutive stages (one computing, the next arriving) and a layer's cache."""
    pairs = [a + b for a, b in zip(stage_bytes, stage_bytes[1:])] or list(stage_bytes)
    return max(pairs) + layer_cache_bytes
