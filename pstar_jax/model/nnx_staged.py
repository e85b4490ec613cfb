"""Flax NNX decoders as staged models (pstar_jax.model.staged's protocol): ``NNXStaged`` turns a
module of an embedding, a list of blocks and a head into a chain of stages, so a model module
only defines the network."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pstar_jax.data.batch import PER_POSITION, Batch
from pstar_jax.model.router_aux import add_stats, no_stats
from pstar_jax.model.staged import Stage, init_params, masked_loss_sum, n_params, token_cross_entropy


def _path(name: str) -> tuple:
    return tuple(int(k) if k.isdigit() else k for k in name.split("."))


def _flat(state: nnx.State) -> dict[str, Any]:
    return {".".join(map(str, path)): var.get_value() if hasattr(var, "get_value") else var
            for path, var in nnx.to_flat_state(state)}


def _variables(state: nnx.State) -> dict[str, Any]:
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}


def _merge(graph: Any, names: Sequence[str], values: Sequence[Any]) -> nnx.Module:
    return nnx.merge(graph, nnx.from_flat_state(list(zip(map(_path, names), values))))


def _first_use(fn: Callable, names: Sequence[str], values: Sequence[Any], *args: Any) -> list[str]:
    """The tensors ``fn(values, *args)`` reads, in the order its trace first reads them."""
    closed = jax.make_jaxpr(fn)(tuple(values), *args)
    invars = closed.jaxpr.invars[:len(names)]
    position = {v: i for i, v in enumerate(invars)}
    order: list[str] = []
    for eqn in closed.jaxpr.eqns:
        for var in eqn.invars:
            i = None if hasattr(var, "val") else position.get(var)  # literals have values
            if i is not None and names[i] not in order:
                order.append(names[i])
    for var in closed.jaxpr.outvars:
        i = None if hasattr(var, "val") else position.get(var)
        if i is not None and names[i] not in order:
            order.append(names[i])
    return order


class PerLayer(tuple):
    """A decoding cache held one pytree per layer, for blocks whose caches differ (see
    pstar_jax.engine.decode.Decoder)."""


jax.tree_util.register_pytree_node(PerLayer, lambda t: (tuple(t), None), lambda _, parts: PerLayer(parts))


class NNXStaged:
    """A Flax NNX decoder as a staged model: an embed stage, one stage per block, a head stage.

    ``make(rngs, n_blocks)`` builds the module with ``n_blocks`` blocks (its init scales still
    follow the real depth ``n_layer``). The module provides a method ``embed(tokens_BxL) ->
    h_BxLxD``, a list attribute ``blocks`` of blocks (``block(h) -> h``) and a method
    ``logits(h_BxLxD) -> logits_BxLxV`` (other method names: ``embed=``, ``logits=``). A module
    whose class sets ``supports_packing = True`` is called ``embed(tokens, positions=...)`` and
    ``block(h, segment_ids=..., positions=...)`` with the batch's [B, L] arrays (attention then
    stays within each example of a packed row); others are refused packed rows. The head stage
    is the module's method ``loss_sum(h_BxLxD, targets_BxL, weights_BxL) -> scalar`` (name
    ``loss_sum=``) where it has one: the sum of weighted token losses, computed however the
    module likes (the models here tile it, pstar_jax.model.loss, so N x V logits never exist). A
    module without it is read through ``logits``: ``loss(logits, targets)`` gives each token's
    loss ([B, L]) and the head returns their sum over the loss mask.
    ``block_kinds`` (one hashable per layer; None: all alike) says which blocks differ, in what
    they compute (Gemma's sliding and global layers) or in their tensors too (Qwen3-MoE's dense
    layers among its experts' ones): ``make(rngs, 1, first_block=i)`` must then build a module
    whose one block is layer i's. Each kind gets its tensors' names and order from its first
    layer's block, and a compiled block of its own (``block_graph(i)``).
    Tensor names are the module's state paths joined with '.'
    ('blocks.3.attn.q.kernel'), in the order the forward first reads them. Each tensor is
    initialised alone by the module's own initialisers (a jit that builds the module and keeps
    one tensor; XLA drops the rest), from a key folded from the seed and the tensor's index.
    A module with ``router_aux`` (coefficient, experts), not None, carries RouterStats: its blocks
    are called with ``router_stats=True`` and a block with experts returns (h, its stats)."""

    def __init__(self, make: Callable[[nnx.Rngs, int], nnx.Module], n_layer: int, *, seq_len: int,
                 vocab_size: int, loss: Callable[[jax.Array, jax.Array], jax.Array] = token_cross_entropy,
                 decays: Callable[[str], bool] | None = None, flops_per_token: float | None = None,
                 embed: str = "embed", logits: str = "logits", loss_sum: str = "loss_sum",
                 block_kinds: Sequence[Any] | None = None, target_logps: str = "target_logps"):
        self.make, self.n_layer, self.seq_len, self.vocab_size = make, n_layer, seq_len, vocab_size
        self.block_kinds = tuple(block_kinds) if block_kinds is not None else (None,) * n_layer
        if len(self.block_kinds) != n_layer:
            raise ValueError(f"block_kinds names {len(self.block_kinds)} layers, not n_layer={n_layer}")
        self._decays, self._flops = decays, flops_per_token
        outer = nnx.eval_shape(lambda: make(nnx.Rngs(0), 0))
        # One block graph per kind, from the kind's first layer.
        self._firsts = {kind: self.block_kinds.index(kind) for kind in dict.fromkeys(self.block_kinds)}
        block_states: dict[Any, nnx.State] = {}
        self._block_graphs: dict[Any, Any] = {}
        for kind, first in self._firsts.items():
            one = nnx.eval_shape(lambda f=first: make(nnx.Rngs(0), 1, first_block=f) if f else make(nnx.Rngs(0), 1))
            self._block_graphs[kind], block_states[kind] = nnx.split(one.blocks[0], nnx.Param)
        has_loss_sum = callable(getattr(outer, loss_sum, None))
        self.name = type(outer).__name__
        self.supports_packing = packing = bool(getattr(outer, "supports_packing", False))
        self._outer_graph, outer_state = nnx.split(outer, nnx.Param)
        outer_flat = _flat(outer_state)
        self._outer_names = tuple(outer_flat)
        self._outer_zeros = tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in outer_flat.values())
        # Only for tracing which tensors are read: a batch of one row of two positions.
        fake = Batch(*(jax.ShapeDtypeStruct((1, 2), jnp.float32 if f == "loss_mask" else jnp.int32)
                       for f in PER_POSITION))
        # A module that draws dropout masks (LoRA dropout) says so; the engines then give each
        # row a dropout seed (Batch.dropout_seed), which its blocks get as ``dropout_seed=``.
        self.dropout_seeded = bool(getattr(outer, "dropout_seeded", False))
        # A mixture of experts whose config asks for the routers' load-balancing loss says so
        # (``router_aux``: (coefficient, experts)); the stages then carry (h, RouterStats): the
        # first makes empty stats, each block's ``router_stats=True`` call adds its own (a dense
        # block returns h alone), the head returns (loss sum, the totals) and the engine adds the loss.
        router_aux = getattr(outer, "router_aux", None)
        self.router_aux_coef = None if router_aux is None else float(router_aux[0])

        def embed_call(module: nnx.Module, tokens_BxL: jax.Array, batch: Batch) -> Any:
            method = getattr(module, embed)
            h = method(tokens_BxL, positions=batch.positions) if packing else method(tokens_BxL)
            return h if router_aux is None else (h, no_stats(router_aux[1]))

        def block_call(block_module: nnx.Module, x: Any, batch: Batch) -> Any:
            seeded = {} if batch.dropout_seed is None else {"dropout_seed": batch.dropout_seed}
            if router_aux is not None:
                seeded["router_stats"] = True
                x, stats = x
            if packing:
                y = block_module(x, segment_ids=batch.segment_ids, positions=batch.positions, **seeded)
            else:
                y = block_module(x, **seeded)
            if router_aux is None:
                return y
            return (y[0], add_stats(stats, y[1])) if isinstance(y, tuple) else (y, stats)
        self._embed_call = embed_call

        def head_call(module: nnx.Module, x: Any, batch: Batch) -> Any:
            h_BxLxD = x if router_aux is None else x[0]
            if has_loss_sum:
                out = getattr(module, loss_sum)(h_BxLxD, batch.targets, batch.loss_mask)
            else:
                out = masked_loss_sum(loss(getattr(module, logits)(h_BxLxD), batch.targets), batch.loss_mask)
            return out if router_aux is None else (out, x[1])

        def outer_embed(v, x, batch):
            return embed_call(_merge(self._outer_graph, self._outer_names, v), x, batch)

        def outer_head(v, h, batch):
            return head_call(_merge(self._outer_graph, self._outer_names, v), h, batch)
        h = jax.eval_shape(outer_embed, self._outer_zeros, fake.tokens, fake)
        self._embed_names = tuple(_first_use(outer_embed, self._outer_names, self._outer_zeros, fake.tokens, fake))
        self._head_names = tuple(_first_use(outer_head, self._outer_names, self._outer_zeros, h, fake))
        # Each kind's tensors in the order its block first reads them (those read by nothing last:
        # validate_stages names them).
        self._block_names: dict[Any, tuple[str, ...]] = {}
        block_shapes: dict[Any, dict[str, tuple[int, ...]]] = {}
        for kind, state in block_states.items():
            block = _flat(state)
            def one_block(v, x, batch, graph=self._block_graphs[kind], names=tuple(block)):
                return block_call(_merge(graph, names, v), x, batch)
            read = tuple(_first_use(one_block, tuple(block), tuple(block.values()), h, fake))
            self._block_names[kind] = read + tuple(n for n in block if n not in read)
            block_shapes[kind] = {n: tuple(v.shape) for n, v in block.items()}
        shapes = {n: tuple(outer_flat[n].shape) for n in self._embed_names}
        shapes.update({f"blocks.{i}.{n}": block_shapes[kind][n] for i, kind in enumerate(self.block_kinds)
                       for n in self._block_names[kind]})
        shapes.update({n: tuple(outer_flat[n].shape) for n in (*self._head_names, *outer_flat) if n not in shapes})
        self._shapes = shapes
        # Initialisation keys: base tensors first, LoRA adapters (nnx.LoRAParam) after them, so a
        # base tensor's key (and value) is the same with or without adapters.
        adapters = {n for n, v in _variables(outer_state).items() if isinstance(v, nnx.LoRAParam)} | {
            f"blocks.{i}.{n}" for i, kind in enumerate(self.block_kinds)
            for n, v in _variables(block_states[kind]).items() if isinstance(v, nnx.LoRAParam)}
        self._index = {n: i for i, n in enumerate(sorted(shapes, key=lambda n: n in adapters))}

        def block_apply(kind: Any) -> Callable[..., jax.Array]:
            def apply(params: tuple[jax.Array, ...], h_BxLxD: jax.Array, batch: Batch) -> jax.Array:
                return block_call(_merge(self._block_graphs[kind], self._block_names[kind], params), h_BxLxD, batch)
            return apply
        # One object per kind: every block stage of a kind shares its compilation.
        self._block_applies = {kind: block_apply(kind) for kind in self._block_graphs}

        def head_apply(params: tuple[jax.Array, ...], h_BxLxD: jax.Array, batch: Batch) -> jax.Array:
            return head_call(self._outer(self._head_names, params), h_BxLxD, batch)
        self._head_apply = head_apply
        self._has_logps = callable(getattr(outer, target_logps, None))

        def logps_apply(params: tuple[jax.Array, ...], h_BxLxD: jax.Array, batch: Batch) -> jax.Array:
            module = self._outer(self._head_names, params)
            return getattr(module, target_logps)(h_BxLxD, batch.targets, batch.loss_mask)
        self._logps_apply = logps_apply
        self._embed_applies: dict[Any, Callable[..., jax.Array]] = {}
        self._init_fns: dict[tuple[int, str], Callable[[jax.Array], jax.Array]] = {}

    def _outer(self, names: Sequence[str], params: Sequence[jax.Array]) -> nnx.Module:
        """The module without blocks, holding ``params``; the tensors a stage does not read are
        zeros that XLA removes (nothing reads them)."""
        given = dict(zip(names, params))
        dtype = params[0].dtype if params else jnp.float32
        values = [given[n] if n in given else jnp.zeros(z.shape, dtype) for n, z in zip(self._outer_names,
                                                                                          self._outer_zeros)]
        return _merge(self._outer_graph, self._outer_names, values)

    # -- the protocol ---------------------------------------------------------------------------
    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return dict(self._shapes)

    def stages(self, compute_dtype: Any) -> list[Stage]:
        dtype = jnp.dtype(compute_dtype)
        if dtype not in self._embed_applies:
            def embed_apply(params: tuple[jax.Array, ...], tokens_BxL: jax.Array, batch: Batch) -> Any:
                out = self._embed_call(self._outer(self._embed_names, params), tokens_BxL, batch)
                return out.astype(dtype) if self.router_aux_coef is None else (out[0].astype(dtype), out[1])
            self._embed_applies[dtype] = embed_apply
        blocks = [Stage(f"block_{i}", tuple(f"blocks.{i}.{n}" for n in self._block_names[kind]),
                        self._block_applies[kind]) for i, kind in enumerate(self.block_kinds)]
        return [Stage("embed", self._embed_names, self._embed_applies[dtype]), *blocks,
                Stage("head", self._head_names, self._head_apply, self.router_aux_coef)]

    def block_graph(self, layer: int) -> Any:
        """The NNX graph of block ``layer`` (its kind's), whose state is the block's parameters."""
        return self._block_graphs[self.block_kinds[layer]]

    def logps_stage(self) -> Stage:
        """The head as each position's target log-prob, [B, L] float32, 0 off the loss mask (the
        module's ``target_logps``, tiled as its loss): what a preference loss reads
        (pstar_jax.model.preference). The head stage's tensors; ValueError if the module has none."""
        if not self._has_logps:
            raise ValueError(f"model {self.name} has no target_logps method, so it cannot give per-token log-probs")
        if self.router_aux_coef is not None:
            raise ValueError("a preference objective does not add a mixture of experts' router loss; train without "
                             "output_router_logits (--output-router-logits false, or set it false in config.json)")
        return Stage("head", self._head_names, self._logps_apply)

    def init_tensor(self, name: str, seed: int) -> jax.Array:
        parts = name.split(".")
        in_block = parts[0] == "blocks" and name not in self._outer_names
        # A block's tensor is made by its kind's first block, built alone.
        first = self._firsts[self.block_kinds[int(parts[1])]] if in_block else 0
        key = "blocks.0." + ".".join(parts[2:]) if in_block else name
        if (first, key) not in self._init_fns:
            n_blocks = 1 if in_block else 0
            kwargs = {"first_block": first} if first else {}
            self._init_fns[first, key] = jax.jit(lambda k: jnp.asarray(
                _flat(nnx.state(self.make(nnx.Rngs(k), n_blocks, **kwargs), nnx.Param))[key], jnp.float32))
        return self._init_fns[first, key](jax.random.fold_in(jax.random.key(seed), self._index[name]))

    def init_params(self, seed: int) -> dict[str, jax.Array]:
        return init_params(self, seed)

    def decays(self, name: str) -> bool:
        return self._decays(name) if self._decays else len(self._shapes[name]) >= 2

    def n_params(self) -> int:
        return n_params(self)

    def flops_per_token(self) -> float:
        if self._flops is not None:
            return float(self._flops)
        lookups = set(self._embed_names) - set(self._head_names)
        return 6.0 * sum(math.prod(s) for n, s in self._shapes.items() if n not in lookups)

    def module(self, params: Mapping[str, Any]) -> nnx.Module:
        """The whole NNX module holding ``params`` (names as ``param_shapes``), e.g. for inference."""
        if set(params) != set(self._shapes):
            missing, extra = sorted(set(self._shapes) - set(params)), sorted(set(params) - set(self._shapes))
            raise ValueError(f"params do not match the model: missing {missing}, unexpected {extra}")
        graph = nnx.split(nnx.eval_shape(lambda: self.make(nnx.Rngs(0), self.n_layer)), nnx.Param)[0]
        names = tuple(params)
        return _merge(graph, names, tuple(params[n] for n in names))
