"""From a model and a configuration to a planned engine.

The automatic choices (chunk size, device budget, host budget, machine rates), then layout,
warm-up trace and placement plan without allocating model data (what pstar-plan and the engine
share), the fit check, ``chunked_engine`` (plan first, then build the engine that carries the
finished plan out; ``EnginePlanner`` is the engine's one way back here, for a new batch shape or
an evaluation) and ``build_engine``: a ChunkedEngine or a PlainEngine behind one protocol. Data
flows one way: config -> plan -> executor.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh

from pstar_jax.engine.chunks import ChunkLayout, auto_chunk_numels, build_layout
from pstar_jax.config import ConfigError, EngineConfig, OptimConfig, format_bytes
from pstar_jax.engine.protocol import Engine
from pstar_jax.engine.executor import ChunkedEngine
from pstar_jax.model.freeze import Frozen, frozen_names, parse_patterns, trainable as make_trainable
from pstar_jax.model.quant_bytes import quant_rule
from pstar_jax.plan.machine import Machine
from pstar_jax.engine.memory import Placement, available_host_bytes, device_total_bytes, host_budget_bytes
from pstar_jax.model.staged import StagedModel, chunk_group, decays, validate_stages
from pstar_jax.engine.optim import ChunkOptimizer, TxFactory, default_tx
from pstar_jax.plan.forward import plan_forward
from pstar_jax.plan.placement import deepened, fewest_bytes, make_plan, plan_step
from pstar_jax.plan.planned import Plan
from pstar_jax.plan.schedule import Access, StepShape, kept_stages, step_accesses
from pstar_jax.engine.stages import BoundStage, StageFunctions, bind
from pstar_jax.planner.fit import MEMORY_FLAGS, fitting_seq_len, misfit_fixes
from pstar_jax.planner.trace import trace_forward, trace_step
from pstar_jax.engine.disk import ChunkReader

log = logging.getLogger(__name__)  # start-up phases (see pstar_jax.cli.flags.start_up_notes)
# Opens the reader of the frozen chunks a plan homes on disk: (layout, those chunks) -> reader.
FrozenSource = Callable[[ChunkLayout, Sequence[int]], ChunkReader]


@dataclasses.dataclass
class Planned:
    """A model's layout, stage functions, trace and plan for one batch shape: no model data."""
    layout: ChunkLayout
    bound: list[BoundStage]
    fns: StageFunctions
    shape: StepShape
    plan: Plan
    accesses: list[Access]
    device_budget_bytes: int
    batch_shape: tuple[int, int]  # global (micro-batch rows, seq_len)


def plan_model(model: StagedModel, cfg: EngineConfig, mesh: Mesh, batch_shape: tuple[int, int],
               machine: Machine, host_bytes: int, make_tx: TxFactory, layout: ChunkLayout | None = None,
               fns: StageFunctions | None = None, trace_cache: dict | None = None,
               adam: tuple[Sequence[bool], Sequence[bool]] | None = None,
               trainable: Callable[[str], bool] | None = None) -> Planned:
    """Lay out, trace and plan without allocating model data.

    ``cfg`` must be resolved (a device budget in bytes or None for the CPU demo default).
    ``adam`` fixes the optimizer placement (per chunk: state on the device, state streamed)
    instead of choosing it: an engine places its optimizer state once, for every batch shape.
    ``trainable(name)`` false freezes a tensor (chunks.build_layout); ignored with a
    given ``layout``, which records its frozen chunks. ``cfg.keep_residuals`` None (auto): the plan
    of the fastest kept count that fits, of none, a quarter, half, three quarters and all blocks."""
    if cfg.keep_residuals is None:
        trace_cache = {} if trace_cache is None else trace_cache
        none = plan_model(model, dataclasses.replace(cfg, keep_residuals=0), mesh, batch_shape, machine, host_bytes,
                          make_tx, layout, fns, trace_cache, adam, trainable)
        blocks = len(none.bound) - 2
        tried = [none] + [plan_model(model, dataclasses.replace(cfg, keep_residuals=k), mesh, batch_shape, machine,
                                     host_bytes, make_tx, none.layout, none.fns, trace_cache, adam)
                          for k in sorted({blocks // 4, blocks // 2, 3 * blocks // 4, blocks} - {0})]
        log.info("kept residuals: %s", ", ".join(f"{len(p.shape.keeping)} blocks "
                                                  f"{p.plan.predicted_step_s if p.plan.fits else 'no fit'}"
                                                  for p in tried))
        return min(tried, key=lambda p: (not p.plan.fits, p.plan.predicted_step_s))
    layout, bound, fns, shape, budget = trace_model(model, cfg, mesh, batch_shape, make_tx, layout, fns, trace_cache,
                                                    trainable)
    log.info("planning where each chunk lives at each moment of the step")
    disk = cfg.disk_memory or 0
    if adam is None:
        plan = make_plan(shape, budget, host_bytes, machine, cfg.adam_placement, disk_bytes=disk)
    else:
        plan = plan_step(shape, budget, host_bytes, machine, adam[0], streamed=adam[1], disk_bytes=disk)
        if not plan.fits and any(adam[1]):  # streamed state one moment ahead needs less memory
            plan = plan_step(shape, budget, host_bytes, machine, adam[0], streamed=adam[1], hide_state=False,
                             disk_bytes=disk)
        plan = deepened(fewest_bytes(plan, shape, host_bytes, machine, disk), shape, host_bytes, machine, disk)
    return Planned(layout, bound, fns, shape, plan,
                   step_accesses(shape, plan.opt_on_device, plan.opt_streamed, plan.state_leads), budget,
                   tuple(batch_shape))


def trace_model(model: StagedModel, cfg: EngineConfig, mesh: Mesh, batch_shape: tuple[int, int], make_tx: TxFactory,
                layout: ChunkLayout | None = None, fns: StageFunctions | None = None, trace_cache: dict | None = None,
                trainable: Callable[[str], bool] | None = None
                ) -> tuple[ChunkLayout, list[BoundStage], StageFunctions, StepShape, int]:
    """plan_model's layout, bound stages, stage functions, trace and device budget in bytes, before
    any placement is planned."""
    placement = Placement(mesh)
    param_dtype = cfg.compute_dtype
    stages = list(model.stages(param_dtype))
    try:
        validate_stages(stages, model.param_shapes())
    except ValueError as err:
        raise ConfigError(f"the model's stages are inconsistent: {err}") from None
    if trainable is None and cfg.freeze:
        trainable = make_trainable(frozen_names(list(model.param_shapes()), parse_patterns(cfg.freeze)))
    layout = layout or layout_for(model, cfg, mesh, trainable)
    bound = [bind(s, layout, i) for i, s in enumerate(stages)]
    if (cfg.keep_residuals or 0) > len(bound) - 2:
        raise ConfigError(f"EngineConfig.keep_residuals {cfg.keep_residuals} is more than the model's "
                          f"{len(bound) - 2} blocks; keep at most that many")
    fns = fns or StageFunctions(mesh)
    opt_state_bytes = ChunkOptimizer(make_tx, placement, param_dtype).chunk_state_bytes(layout)
    log.info("tracing %d stages (each compiled once to measure its memory)", len(bound))
    shape = trace_step(bound, fns, placement, layout.numels, param_dtype, *batch_shape, opt_state_bytes,
                       cfg.micro_batches, cache=trace_cache,
                       dropout_seeded=bool(getattr(model, "dropout_seeded", False)),  # the batch the step runs
                       dtypes=layout.dtypes(param_dtype), objective=model,
                       keep=kept_stages(len(bound), cfg.keep_residuals or 0))
    budget = cfg.device_budget_bytes
    if budget is None:  # the CPU demo default: half the model data beside the working memory
        stage_bytes = max(sum(shape.chunk_bytes[c] for c in cs) for cs in shape.stage_chunks) * 2
        working = shape.busiest_working_bytes  # stage inputs kept on the device
        model_data = sum(shape.chunk_bytes) + sum(shape.opt_state_bytes)
        budget = working + max(model_data // 2, 2 * stage_bytes)
    return layout, bound, fns, shape, budget


def require_fit(planned: Planned, host_bytes: int, fixes: Callable[[Planned], str] | None = None) -> None:
    """ConfigError when ``planned`` does not fit, saying what would: ``fixes(planned)`` (e.g.
    fit.misfit_fixes: values found to fit), else which settings to change."""
    if not planned.plan.fits:
        raise ConfigError(
            f"the model does not fit: {planned.plan.problem} (device memory "
            f"{format_bytes(planned.device_budget_bytes)}, host memory {format_bytes(host_bytes)}); "
            f"{fixes(planned) if fixes is not None else MEMORY_FLAGS}")


class EnginePlanner:
    """What a built chunked engine may ask planning for (executor.Replanner): the plan of another
    batch shape, with the layout, stage functions and optimizer placement of the engine's first
    plan (an engine places its optimizer state once), and the forward-only plan of an
    evaluation. Both raise ConfigError when they do not fit."""

    def __init__(self, model: StagedModel, cfg: EngineConfig, machine: Machine, host_bytes: int,
                 make_tx: TxFactory, first: Planned):
        self.model, self.cfg, self.machine, self.host_bytes, self.make_tx = model, cfg, machine, host_bytes, make_tx
        self.first = first

    def for_batch(self, batch_shape: tuple[int, int]) -> Planned:
        first = self.first
        planned = plan_model(self.model, self.cfg, first.fns.mesh, batch_shape, self.machine, self.host_bytes,
                             self.make_tx, first.layout, first.fns,
                             adam=(first.plan.opt_on_device, first.plan.opt_streamed))
        require_fit(planned, self.host_bytes)
        return planned

    def for_evaluation(self, training: Plan, batch_shape: tuple[int, int], micro_batches: int) -> Plan:
        first = self.first
        shape = trace_forward(first.bound, first.fns, Placement(first.fns.mesh), first.layout.numels,
                              self.cfg.compute_dtype, *batch_shape, micro_batches,
                              dtypes=first.layout.dtypes(self.cfg.compute_dtype), objective=self.model)
        plan = plan_forward(shape, training, self.host_bytes, self.machine)
        if not plan.fits:
            raise ConfigError(f"evaluation does not fit: {plan.problem} (device memory "
                              f"{format_bytes(first.device_budget_bytes)}); lower TrainConfig.batch_size or raise "
                              f"EngineConfig.device_memory")
        return plan


def chunked_engine(model: StagedModel, cfg: EngineConfig, make_tx: TxFactory, mesh: Mesh,
                   batch_shape: tuple[int, int], machine: Machine, seed: int = 0, clip_norm: float | None = 1.0,
                   host_bytes: int | None = None, layout: ChunkLayout | None = None, init_params: Any = None,
                   skip_nonfinite: bool = False, trainable: Callable[[str], bool] | None = None,
                   traced_at: Callable[[int], tuple[StepShape, int]] | None = None,
                   frozen_source: FrozenSource | None = None):
    """Plan ``model`` for ``batch_shape`` (global micro-batch rows, seq_len) and build the chunked
    engine that carries the plan out. ``cfg`` resolved (resolve_engine_config); ``host_bytes`` per
    device (default: what the machine has available); ``trainable(name)`` false freezes a tensor.
    Raises ConfigError, before allocating model data, when the plan does not fit, naming the
    least device memory that fits and, given ``traced_at(n)`` (the step's shape and device budget
    with the model built for sequences of n tokens), a shorter sequence that fits.
    ``frozen_source(layout, chunks)`` opens the reader of the frozen ``chunks`` the plan homes on
    disk (EngineConfig.disk_memory; io.frozen_disk: straight from a Hugging Face base's files)."""
    host_bytes = host_bytes if host_bytes is not None else available_host_bytes()
    if cfg.disk_memory and not machine.disk_read_bytes_per_s:
        raise ConfigError("EngineConfig.disk_memory needs the disk's read rate: measure it with pstar-machine --disk "
                          "DIR (DIR on the disk the base is read from)")
    planned = plan_model(model, cfg, mesh, batch_shape, machine, host_bytes, make_tx, layout, trainable=trainable)

    def fixes(planned: Planned) -> str:
        shorter = 0
        if traced_at is not None:
            log.info("looking for a sequence length that fits (a trace for each length tried)")
            shorter = fitting_seq_len(traced_at, batch_shape[1], host_bytes, machine, cfg.adam_placement,
                                      planned.shape, disk_bytes=cfg.disk_memory or 0)
        return misfit_fixes(planned, host_bytes, machine, cfg, shorter)
    require_fit(planned, host_bytes, fixes)
    on_disk = [c for c, home in enumerate(planned.plan.frozen_home) if home == "disk"]
    source = None
    if on_disk:
        if frozen_source is None:
            raise ConfigError(f"the plan keeps {len(on_disk)} frozen chunks on disk (EngineConfig.disk_memory), read "
                              "from the base's own safetensors files: start from a Hugging Face checkpoint "
                              "(ModelConfig.init_from_hf), or raise EngineConfig.host_memory")
        source = frozen_source(planned.layout, on_disk)
    try:
        return ChunkedEngine(model, cfg, planned, EnginePlanner(model, cfg, machine, host_bytes, make_tx, planned),
                             make_tx, seed, clip_norm, init_params, skip_nonfinite, frozen_source=source)
    except BaseException:
        getattr(source, "close", lambda: None)()
        raise


def default_mesh(data_parallel: int | None = None) -> Mesh:
    """A 1-D ``data`` mesh over the first W devices (all of them by default)."""
    from pstar_jax.engine.zero import data_mesh
    return data_mesh(data_parallel)


# Automatic chunk sizes keep a model to about this many chunks: planning time grows with the count
# (pstar-plan refuses past planner/report.MAX_PLAN_CHUNKS, twice this), and the least-waste sizes of
# a mixture of experts' small expert kernels gave Qwen3-30B-A3B's frozen base 2,732 chunks.
AUTO_MAX_CHUNKS = 1024


def chunk_sizes(cfg: EngineConfig, model: StagedModel, mesh: Mesh,
                trainable: Callable[[str], bool] | None = None) -> int | dict[str, int]:
    """The chunk sizes a layout of ``model`` gets: ``EngineConfig.chunk_numel`` for every kind
    (rounded up to shard over the mesh) when set, else per kind the size that wastes least
    (chunks.auto_chunk_numels; ``trainable`` as build_layout's)."""
    W = mesh.devices.size
    quant = quant_rule(cfg.base_quant, model.param_shapes(), trainable)
    if cfg.chunk_numel is not None:
        return -(-cfg.chunk_numel // W) * W
    return auto_chunk_numels(model.param_shapes(), functools.partial(decays, model), multiple=W, trainable=trainable,
                             quant=quant, group=functools.partial(chunk_group, model), max_chunks=AUTO_MAX_CHUNKS)


def layout_for(model: StagedModel, cfg: EngineConfig, mesh: Mesh, trainable: Callable[[str], bool] | None = None,
               sizes: int | Mapping[str, int] | None = None) -> ChunkLayout:
    """``model``'s chunk layout with ``sizes`` (default: ``chunk_sizes``'), shardable over the mesh."""
    sizes = chunk_sizes(cfg, model, mesh, trainable) if sizes is None else sizes
    return build_layout(model.param_shapes(), functools.partial(decays, model), sizes, trainable=trainable,
                        multiple=mesh.devices.size, quant=quant_rule(cfg.base_quant, model.param_shapes(), trainable),
                        group=functools.partial(chunk_group, model))


def resolve_engine_config(cfg: EngineConfig, model: StagedModel, mesh: Mesh,
                          trainable: Callable[[str], bool] | None = None) -> EngineConfig:
    """The automatic choices made concrete: the device budget in bytes (a fraction of the device,
    0.9 of an accelerator by default, or None on a CPU: the demo default of half the model data, so
    chunks move). The chunk sizes are chosen where the layout is built (``layout_for``), per kind,
    so ``model`` and ``trainable`` no longer matter here."""
    device = mesh.devices.flat[0]
    memory = cfg.device_memory
    if memory is None:
        budget = None if device.platform == "cpu" else int(0.9 * device_total_bytes(device))
    elif isinstance(memory, float):
        budget = int(memory * device_total_bytes(device))
    else:
        budget = memory
    return dataclasses.replace(cfg, device_memory=budget)


def resolve_machine(config: EngineConfig, mesh: Mesh, make_tx: TxFactory | None = None) -> Machine:
    """The rates an engine with ``config`` plans with: ``config.machine`` (a name or a JSON file),
    else this machine's rates kept in a file (measured once, with ``make_tx``'s update; AdamW by
    default), so the same command plans the same way every time."""
    from pstar_jax.plan.machine import load_machine
    from pstar_jax.planner.measure import saved_machine
    if config.machine:
        return load_machine(config.machine)
    placement = Placement(mesh)
    make_tx = make_tx or default_tx(OptimConfig())
    return saved_machine(placement, ChunkOptimizer(make_tx, placement, config.compute_dtype))


def build_engine(model: StagedModel, config: EngineConfig, optim: OptimConfig, batch_shape: tuple[int, int], *,
                 mesh: Mesh | None = None, seed: int = 0, init_params: Any = None, skip_nonfinite: bool = False,
                 machine: Machine | None = None, make_tx: TxFactory | None = None, scan_layers: bool = True,
                 opt_on_host: bool = False, frozen: Frozen = None,
                 seq_len_at: Callable[[int], StagedModel] | None = None,
                 frozen_source: FrozenSource | None = None) -> Engine:
    """An engine for ``model``, planned for this machine; raises ConfigError before allocating model
    data when the plan does not fit.

    ``batch_shape`` is the global (micro-batch rows, seq_len); the rows are sharded over ``mesh``
    (default: every device, see DistributedConfig.data_parallel). ``init_params`` maps tensor names
    to initial values (read one chunk at a time); by default the model's own initialisation.
    ``make_tx`` replaces the AdamW of ``optim`` by any elementwise optax transformation factory
    (see pstar_jax.engine.optim); ``optim.clip_norm`` still clips. ``machine`` replaces the rates of
    ``resolve_machine``. The plain engine only (baselines): ``scan_layers=False`` unrolls the
    blocks, ``opt_on_host`` keeps its optimizer state in pinned host memory. ``frozen`` (tensor
    names, or a predicate true for a frozen name) is frozen beside ``config.freeze``'s patterns.
    ``seq_len_at(n)``: the model built for sequences of n tokens, for a "does not fit" error to
    name a length that fits (as the same config would plan it). ``frozen_source``: how to read
    frozen chunks the plan homes on disk (chunked_engine's); reads straight from safetensors plan
    at the machine's ``disk_tensor_bytes_per_s``."""
    from pstar_jax.engine.plain import PlainEngine

    mesh = mesh if mesh is not None else default_mesh()
    micro_batch_shape(batch_shape[0], 1, batch_shape[1], mesh)  # the rows must shard over the mesh
    make_tx = make_tx or default_tx(optim)
    frozen = frozen_names(list(model.param_shapes()), parse_patterns(config.freeze), frozen)
    if config.kind == "plain":
        return PlainEngine(model, config.precision, make_tx, config.micro_batches, seed, optim.clip_norm,
                           config.remat, mesh=mesh, init_params=init_params, opt_on_host=opt_on_host,
                           scan_layers=scan_layers, skip_nonfinite=skip_nonfinite, frozen=frozen)
    if opt_on_host or not scan_layers:
        raise ConfigError("scan_layers and opt_on_host are plain-engine settings (EngineConfig.kind plain); the "
                          "chunked engine places its optimizer state by its plan (EngineConfig.adam_placement)")
    resolved = resolve_engine_config(config, model, mesh, make_trainable(frozen))
    host_bytes = host_budget_bytes(config.host_memory) // max(1, jax.local_device_count())  # per device
    machine = machine or resolve_machine(resolved, mesh, make_tx)
    if config.disk_memory and machine.disk_tensor_bytes_per_s and not config.frozen_cache:  # the base's files
        machine = dataclasses.replace(machine, disk_read_bytes_per_s=machine.disk_tensor_bytes_per_s)
    traced_at = None
    if seq_len_at is not None:
        def traced_at(seq_len: int) -> tuple[StepShape, int]:
            shorter = seq_len_at(seq_len)  # planned as the same flags would plan it (its own chunk size)
            cfg = resolve_engine_config(config, shorter, mesh, make_trainable(frozen))
            return trace_model(shorter, cfg, mesh, (batch_shape[0], seq_len), make_tx,
                               trainable=make_trainable(frozen))[3:]
    return chunked_engine(model, resolved, make_tx, mesh, batch_shape, machine, seed, optim.clip_norm,
                          host_bytes=host_bytes, init_params=init_params, skip_nonfinite=skip_nonfinite,
                          trainable=make_trainable(frozen), traced_at=traced_at, frozen_source=frozen_source)


def micro_batch_shape(batch_size: int, micro_batches: int, seq_len: int, mesh: Mesh) -> tuple[int, int]:
    """The global micro-batch shape, checked against the mesh."""
    micro = batch_size // micro_batches
    W = mesh.devices.size
    if micro % W:
        raise ConfigError(f"the micro-batch ({micro} sequences) must be a multiple of the data-parallel degree "
                          f"{W} (DistributedConfig.data_parallel)")
    return micro, seq_len


__all__ = ["Planned", "plan_model", "trace_model", "require_fit", "EnginePlanner", "chunked_engine",
           "resolve_engine_config", "chunk_sizes", "layout_for", "resolve_machine", "build_engine", "default_mesh",
           "micro_batch_shape"]
