"""The chunked engine: one training step run stage by stage over chunks, as the plan says.

Per micro-batch: forward through the stages, keeping only each stage's input (activation
checkpointing at stage boundaries) and the micro-batch's ``Batch`` (its side inputs, read by
every stage). A stage input is an item of the store beside the chunks (key ("act", stage,
micro-batch)): the plan keeps it on the device or sends it to pinned host memory after its
forward and fetches it back ahead of its backward, and the store counts its bytes. The last
stage computes its loss sum, scaled by 1 / the step's global count of trained tokens, and its
gradient in one call (with a mixture of experts' load-balancing loss the
stage inputs carry its per-expert sums beside h, and the head adds it: model/router_aux.py);
backward in reverse, recomputing each stage's forward under jax.vjp (or, in the last blocks
EngineConfig.keep_residuals names, running from the vjp residuals their forward added to their
input's item) and adding its tensor grads into gradient chunks. After a chunk's last backward
use in the last micro-batch its bf16 params are dropped and its grad takes their place (14 bytes
per parameter in all).

The optimizer update is deferred: step k's update of chunk c runs in step k+1, right before the
first forward stage that reads c, where its copies hide under the forward's compute (see
pstar_jax.plan.schedule). The math is unchanged: the update uses step k's gradient and clip scale. A chunk
updated on the host sends its grad up to the host right after its last backward use, and every
host update is begun (``ChunkOptimizer.begin_update``: on a worker thread) as soon as step k's
norm is known, at the end of ``step``: the host computes them while the caller goes on and the
device runs step k+1's forward, which waits for chunk c's update only at c's moment, to fetch
its new params. Between steps each chunk's bf16 slot (the store key ("slot", c)) holds its
pending gradient, or its current params when no update is pending (a host update under way owns
its chunk's slot, master and state until that moment); ``flush`` applies a pending update at
once, and everything that reads or saves state calls it.

Placement is the plan's: before each moment (or during the ``lead`` moments before it, when the plan
says prefetch; JAX dispatch is asynchronous, so those copies overlap the running stages) the executor
performs exactly the plan's evictions and fetches, and the store refuses anything that would
break the moment's device budget. The executor never decides placement itself.

A frozen chunk (``trainable`` false for its tensors, see pstar_jax.engine.chunks) is its compute-dtype params
alone, store key ("param", c), with one home (Plan.frozen_home): homed on the device it has no
other copy and is never evicted; homed on the host it has a pinned copy, and a device copy while
the plan keeps one there; homed on disk it has no copy but the device's while the plan keeps one
there, read at each fetch by the store's disk reader in the order the step's moments fetch (the
reads are scheduled as the step begins). No grad, master or optimizer state exists for it; evicting it drops
the device copy (nothing goes back up); stages differentiate only their trainable tensors.

Three parts of the engine have modules of their own: ``evaluate``, the forward-only held-out loss
by a plan of its own (pstar_jax.engine.evaluation), the state checkpoints save and restore
(pstar_jax.engine.chunk_state), and the optimizer updates of the chunks (pstar_jax.engine.updates).

The engine receives its plan finished (pstar_jax.planner.build plans, then builds it) and asks
the planner for more only through its ``Replanner``: the plan of a new batch shape, and the
forward-only plan of an evaluation. It never imports the planner.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from pstar_jax import compat
from pstar_jax.data.batch import Batch, as_batch, check_batches, row_counts, trained_count, with_dropout_seeds
from pstar_jax.engine.chunk_state import ChunkState
from pstar_jax.engine.chunks import pack_chunk
from pstar_jax.engine.disk import ChunkReader, DiskReader
from pstar_jax.engine.evaluation import Evaluation
from pstar_jax.engine.updates import ChunkUpdates
from pstar_jax.config import EngineConfig, format_bytes
from pstar_jax.engine.protocol import NonFiniteLoss, StepResult, step_metrics
from pstar_jax.plan.machine import Machine
from pstar_jax.engine.memory import ChunkStore, Placement, Space
from pstar_jax.model.staged import StagedModel
from pstar_jax.engine.optim import (ChunkOptimizer, PendingUpdate, TxFactory, clip_factor, clip_scale, sum_of_squares,
                             zeros_chunk)
from pstar_jax.plan.homes import DISK_SLOTS
from pstar_jax.plan.planned import Plan
from pstar_jax.plan.predict import issued_during, window_capacity
from pstar_jax.plan.replay import PlanMoment
from pstar_jax.plan.schedule import Access, staged_after
from pstar_jax.engine.pacing import Pacer
from pstar_jax.engine.zero import replicated_value, to_numpy

if TYPE_CHECKING:  # a type only: planning builds engines, the engine never calls into it
    from pstar_jax.planner.build import Planned


class Replanner(Protocol):
    """The narrow way back to planning for a built engine (pstar_jax.planner.build.EnginePlanner)."""
    machine: Machine
    host_bytes: int  # per device

    def for_batch(self, batch_shape: tuple[int, int]) -> "Planned":
        """The plan for another global micro-batch shape, with the engine's layout, stage functions
        and optimizer placement; ConfigError when it does not fit."""
        ...

    def for_evaluation(self, training: Plan, batch_shape: tuple[int, int], micro_batches: int) -> Plan:
        """The forward-only plan of an evaluation that starts and ends where ``training`` starts a
        step; ConfigError when it does not fit."""
        ...


class ChunkedEngine(ChunkState, Evaluation, ChunkUpdates):
    """Model data in chunks placed by the plan; one step runs stage by stage (the Engine protocol)."""
    kind = "chunked"

    def __init__(self, model: StagedModel, cfg: EngineConfig, planned: "Planned", replanner: Replanner,
                 make_tx: TxFactory, seed: int = 0, clip_norm: float | None = 1.0, init_params: Any = None,
                 skip_nonfinite: bool = False, frozen_source: ChunkReader | None = None):
        """Carry out ``planned`` (a fitting plan for ``model`` under ``cfg``: its layout, stage
        functions and placement); ``replanner`` answers for other batch shapes and evaluations.
        ``cfg.device_budget_bytes`` is all the device memory the engine may use per device, chunks
        and working memory together. ``frozen_source`` reads the frozen chunks the plan homes on
        disk (required when it homes any there). Build one with pstar_jax.planner.build.chunked_engine."""
        if not planned.plan.fits:
            raise ValueError(f"an engine needs a plan that fits: {planned.plan.problem}")
        self.cfg = cfg
        self.clip_norm = clip_norm
        self.replanner = replanner
        self.machine, self.host_bytes = replanner.machine, replanner.host_bytes
        self.placement = Placement(planned.fns.mesh)
        self.n_devices = self.placement.n_devices
        self.param_dtype = cfg.compute_dtype
        self.make_tx = make_tx
        self.model = model
        self.layout, self.bound, self.fns = planned.layout, planned.bound, planned.fns
        self.optimizer = ChunkOptimizer(make_tx, self.placement, self.param_dtype)
        self._plans: dict[tuple[int, int], Planned] = {tuple(planned.batch_shape): planned}
        self.plan = planned.plan
        self.device_budget_bytes = planned.device_budget_bytes
        self.opt_space = [Space.DEVICE if d else Space.HOST for d in self.plan.opt_on_device]
        self.store = ChunkStore(self.placement, self.device_budget_bytes)
        if "disk" in self.plan.frozen_home:
            if frozen_source is None:
                raise ValueError("the plan homes frozen chunks on disk: the engine needs a frozen_source to read them")
            self.store.disk = DiskReader(frozen_source, np.dtype(self.param_dtype), DISK_SLOTS,
                                         numel_of=self.layout.numel_of)
        # Device-resident optimizer state sits beside each moment's chunk capacity (same in every plan).
        self.store.reserve(self.plan.device_state_bytes)
        self.trained_chunks = self.layout.trainable_chunks
        self.skip_nonfinite = skip_nonfinite
        # The clip scale of the update pending in the slots; None: the slots hold params (no update).
        self._pending_clip: jax.Array | None = None
        self._staged: set[int] = set()  # chunks whose streamed state is on the device
        # Host updates under way (begun when the last step's norm was known): chunk -> its result.
        self._begun: dict[int, PendingUpdate] = {}
        self.seed = seed  # also the dropout masks' (with the step, micro-batch and row)
        self._init_chunks((lambda name: model.init_tensor(name, seed)) if init_params is None
                          else init_params.__getitem__)
        # Replicated exactly as in the trace, so the step reuses the trace's compilations.
        self._offsets = [self.placement.put(np.asarray(b.offset_data, np.int32), Space.DEVICE, replicated=True)
                         for b in self.bound]
        self.step_count = 0
        # (batch shape, micro-batches) -> (the training plan it starts from, the forward-only plan)
        self._eval_plans: dict[tuple, tuple[Plan, Plan]] = {}
        # Where the backend keeps allocator statistics (GPUs), the first step records each moment's
        # live non-model bytes beside the trace's prediction; None on a CPU.
        self.measured_non_model: list[int] | None = [] if self.device_memory_in_use() is not None else None

    # -- planning -----------------------------------------------------------------------------
    def chunk_bytes(self, c: int) -> int:
        """Chunk c's params (or grad), per device."""
        return self.layout.numel_of(c) * self.layout.dtype_of(c, self.param_dtype).itemsize // self.n_devices

    @property
    def model_data_bytes(self) -> int:
        """Per device: params (their grads take their place) + master and optimizer state of the
        trainable chunks; the params alone of the frozen ones."""
        return sum(map(self.chunk_bytes, range(self.layout.n_chunks))) + sum(self.plan.opt_state_bytes)

    def _params_key(self, c: int) -> tuple[str, int]:
        """The store key of chunk c's current params between steps: a trainable chunk's slot, a
        frozen chunk's params."""
        return ("param", c) if self.layout.is_frozen(c) else ("slot", c)

    def plan_for(self, batch_shape: tuple[int, int]) -> Planned:
        """The plan for a micro-batch shape (cached: a new shape makes a new plan)."""
        if batch_shape not in self._plans:
            self._plans[batch_shape] = self.replanner.for_batch(batch_shape)
        return self._plans[batch_shape]

    def summary(self) -> str:
        p, n = self.plan, len(self.trained_chunks)
        on_device, streamed = sum(p.opt_on_device), sum(p.opt_streamed)
        frozen = self.layout.n_chunks - n
        return "\n".join([
            f"chunked engine: {self.layout.numel:,} params in {self.layout.n_chunks} chunks of "
            f"{' or '.join(f'{size:,}' for size in sorted(set(self.layout.numels)))} elements "
            f"({100 * self.layout.numel / self.layout.padded_numel:.1f}% used"
            f"{f', {frozen} frozen' if frozen else ''}), {self.n_devices} device(s)",
            f"plan: device memory {format_bytes(self.device_budget_bytes)} (peak {format_bytes(p.peak_device_bytes)}), "
            f"host {format_bytes(p.peak_host_bytes)} of {format_bytes(self.host_bytes)}; model data "
            f"{format_bytes(self.model_data_bytes)}",
            f"plan: {100 * p.resident_fraction:.0f}% of param chunks stay on the device; Adam on the device for "
            f"{on_device} chunks, on the host for {n - on_device - streamed}, streamed through the device for "
            f"{streamed}; per step {format_bytes(p.h2d_bytes)} h2d, "
            f"{format_bytes(p.d2h_bytes)} d2h; predicted {p.predicted_step_s * 1e3:.1f} ms/step on {self.machine.name}",
            f"plan: {p.stage_inputs_line()}", *(f"plan: {line}" for line in filter(None, [p.frozen_line()]))])

    def _init_chunks(self, tensor: Callable[[str], Any]) -> None:
        """Master and optimizer state where the plan keeps them; params in the slots, placed as at
        the plan's step start (a frozen chunk homed on the device: there only; one homed on disk is
        read from there, none of its tensors asked for). One chunk at a time: a model far larger
        than one device or than host memory never exists whole."""
        initial = dict(self.plan.initial_device)
        for c in range(self.layout.n_chunks):
            if self.plan.home(c) == "disk":
                self.store.on_disk(("param", c), self.chunk_bytes(c))
                if ("param", c) in initial:
                    self.store.get(("param", c), Space.DEVICE)
                continue
            chunk = pack_chunk(self.layout, c, tensor)
            if jax.process_count() > 1:  # each process cuts its own shards from the same values
                chunk = to_numpy(chunk)
            key = self._params_key(c)
            dirty = initial.get(key)
            if not self.layout.is_frozen(c):
                master = self.placement.put(chunk, self.opt_space[c])
                self.store.put(("opt", c), self.optimizer.init(master))
                self.store.put(("master", c), master)
            home = self.plan.home(c)
            self.store.put(key, self.placement.put(chunk.astype(self.layout.dtype_of(c, self.param_dtype)),
                                                   Space.DEVICE if dirty or home == "device" else Space.HOST))
            if dirty is False and home != "device":  # on the device with a valid host copy
                self.store.get(key, Space.DEVICE)
        self.store.traffic.reset()

    # -- one step -----------------------------------------------------------------------------
    def step(self, micro_batches: Sequence[Batch | tuple[np.ndarray, np.ndarray]]) -> StepResult:
        """One optimizer step over micro-batches (``Batch``es, or (tokens, targets) pairs of plain
        data): this process's rows of each. The loss is the mean over the step's trained tokens.

        Runs the previous step's update and this step's forward and backward; this step's update
        is left pending (``flush`` applies it). Raises DataError for ids outside the vocabulary."""
        if len(micro_batches) != self.cfg.micro_batches:
            raise ValueError(f"expected {self.cfg.micro_batches} micro-batches, got {len(micro_batches)}")
        micro_batches = [as_batch(b) for b in micro_batches]
        check_batches(micro_batches, self.model)
        rows, seq_len = micro_batches[0].shape  # this process's rows of the global micro-batch
        if getattr(self.model, "dropout_seeded", False):  # seeds by global row: any device count
            micro_batches = [with_dropout_seeds(b, self.seed, self.step_count, m, jax.process_index() * rows)
                             for m, b in enumerate(micro_batches)]
        planned = self.plan_for((rows * jax.process_count(), seq_len))
        plan, accesses = planned.plan, planned.accesses
        start = time.perf_counter()
        self.store.traffic.reset()
        self.store.peak_device_bytes = self.store.bytes[Space.DEVICE]
        if plan is not self.plan:  # another batch shape: move to the new plan's starting state
            self._place_slots(plan)
            self.plan = plan
        self._begin_reads(plan)
        count, scale = self.fns.count(self._put_counts(micro_batches))
        run = _StepState(scale=scale, keeping=planned.shape.keeping)
        clip, self._pending_clip = self._pending_clip, None
        moments = plan.moments
        staging, issued = staged_after(accesses), issued_during(moments)
        pacer = Pacer()
        for t, (moment, access) in enumerate(zip(moments, accesses)):
            if not moment.prefetch:
                self._act(moment, moment.capacity_bytes)
            if t == 0:  # state sent down at the step's start: the plan counts it beside the first moment's chunks,
                self._stage(accesses[u].index for u in staging.get(-1, ()))  # so after that moment's evictions
            with jax.profiler.TraceAnnotation(f"pstar {access.phase} {access.index}"):  # named in --profile traces
                if access.phase == "adam":
                    pacer.mark(self._adam(access.index, clip))
                else:
                    pacer.mark(self._run(access, run, micro_batches), donated=access.phase != "fwd")
                    for key in access.to_host:  # a final grad bound for host Adam
                        self.store.evict(key)
            if self.measured_non_model is not None and len(self.measured_non_model) < len(moments):
                self._measure_moment(run)
            for u in issued.get(t, ()):  # prefetched moments' copies, issued as the plan says
                self._act(moments[u], window_capacity(moments, u))
            self._stage(accesses[u].index for u in staging.get(t, ()))
            for key in access.drops:
                self.store.drop(key)
        # sync: the step's time covers its work, and a bad step is caught before its update
        loss, sumsq = replicated_value(sum(run.losses)), replicated_value(sum(run.sumsq))
        counts = to_numpy(count)
        trained = trained_count(counts[-1])
        end = time.perf_counter()
        skip = not (np.isfinite(loss) and np.isfinite(sumsq))
        if skip and not self.skip_nonfinite:  # the slots' grads are dropped: params stay as they were
            raise NonFiniteLoss(self.step_count, loss, float(np.sqrt(sumsq)))
        self.step_count += 1
        self._pending_clip = None if skip else clip_scale(sum(run.sumsq), self.clip_norm)
        if self._pending_clip is not None:
            self._begin_host_updates(accesses, self._pending_clip)
        grad_norm = float(np.sqrt(sumsq))
        return StepResult(loss=loss, grad_norm=grad_norm, step_s=end - start,
                          clip_scale=clip_factor(grad_norm, self.clip_norm), h2d_bytes=self.store.traffic.h2d_bytes, d2h_bytes=self.store.traffic.d2h_bytes,
                          device_chunk_peak_bytes=self.store.peak_device_bytes,
                          predicted_h2d_bytes=plan.h2d_bytes, predicted_d2h_bytes=plan.d2h_bytes, skipped=skip,
                          trained_tokens=trained, disk_read_bytes=self.store.traffic.disk_read_bytes,
                          predicted_disk_read_bytes=plan.disk_read_bytes,
                          metrics=step_metrics(self.model, run.metrics, counts, len(micro_batches)))

    def _begin_reads(self, plan: Plan) -> None:
        """Schedule the reads of the chunks ``plan``'s moments fetch from disk, in that order (reads
        left by a step that ended early are dropped first); the files they come from must not have
        changed since the run opened them (CheckpointError otherwise)."""
        if self.store.disk is not None:
            self.store.disk.source.check_unchanged()
            self.store.disk.cancel()
            self.store.disk.schedule(plan.disk_reads())

    def close(self) -> None:
        """Stop the disk reader's thread and close the files it reads (a no-op without one)."""
        if self.store.disk is not None:
            self.store.disk.close()
            getattr(self.store.disk.source, "close", lambda: None)()

    def flush(self) -> None:
        """Apply the pending update now; afterwards the slots hold the current params, placed where
        the plan starts a step. Between steps no activations are live, so the whole device budget
        is room for it."""
        clip, self._pending_clip = self._pending_clip, None
        if clip is None:
            return
        self.store.limit(None)
        pacer = Pacer()
        for c in self.trained_chunks:
            space = self._update_space(c)
            if space is Space.DEVICE:  # the grad (and streamed state) come down
                self._make_room(c, self.chunk_bytes(c) + self.plan.opt_state_bytes[c] * self.plan.opt_streamed[c])
            pacer.mark(self._adam(c, clip))
            self.store.put(("slot", c), self.store.take(("param", c), space))
        self._place_slots(self.plan)

    def _make_room(self, c: int, nbytes: int) -> None:
        """Evict other slots (and host-homed frozen params) until ``nbytes`` more fit (flush only)."""
        for key in self.store.device_resident(("slot", "param")):
            if self.store.bytes[Space.DEVICE] + nbytes <= self.store.budget_bytes:
                return
            if key != ("slot", c) and self.plan.home(key[1]) != "device":
                self.store.evict(key)

    def _place_slots(self, plan: Plan) -> None:
        """Put the slots where ``plan`` starts a step (between steps: the whole budget is room; a
        frozen chunk homed on disk that belongs on the device is read at once)."""
        self.store.limit(None)
        if self.store.disk is not None:
            self.store.disk.cancel()  # nothing a step scheduled is read now
        initial = dict(plan.initial_device)
        for key in self.store.device_resident(("slot", "param")):  # between steps "param" keys are frozen chunks
            if key not in initial:
                self.store.evict(key)
        for key, dirty in initial.items():
            self.store.get(key, Space.DEVICE)
            if dirty or plan.home(key[1]) in ("device", "disk"):  # a frozen chunk homed there has no other copy
                self.store.drop_copy(key, Space.HOST)
            else:
                self.store.get(key, Space.HOST)

    def _act(self, moment: PlanMoment, capacity_bytes: int) -> None:
        """The plan's evictions, then its fetches, under the moment's device budget."""
        self.store.limit(capacity_bytes)
        for key in moment.evict:
            self.store.evict(key)
        for key in moment.fetch:
            self.store.get(key, Space.DEVICE)

    def _run(self, a: Access, run: "_StepState", micro_batches) -> Any:
        """The access's stage; returns what it produced (for the pacer), None where nothing ran."""
        i = a.index
        if not a.needs:  # a backward below the lowest trainable stage: no gradient is wanted
            return None
        params = tuple(self.store.get(("param", c), Space.DEVICE) for c in self.bound[i].chunks)
        key = ("act", i, a.micro)  # the stage's input, when it is not the batch's tokens
        if a.phase == "fwd":
            if i == 0:  # the micro-batch's side inputs stay live until its first stage's backward
                run.batch = self._put_batch(micro_batches[a.micro])
                run.x = run.batch.tokens
            else:  # the forward below made it: the store owns it from now on (run.x lets go of it)
                self.store.put(key, run.x)
                run.x = None
            x = run.batch.tokens if i == 0 else self.store.get(key, Space.DEVICE)
            if i in run.keeping:  # its vjp residuals join its input's item, as the plan counted them
                run.x, kept = self.fns.forward_keep(self.bound[i])(params, self._offsets[i], x, run.batch)
                self.store.put(key, (self.store.take(key, Space.DEVICE), kept))
            else:
                run.x = self.fns.forward(self.bound[i])(params, self._offsets[i], x, run.batch)
            return run.x
        grads = self._grads(i)
        if a.phase == "head":
            self.store.put(key, run.x)
            run.x = None
            loss, metrics, run.g, grads = self.fns.head(self.bound[i])(
                params, self._offsets[i], self.store.get(key, Space.DEVICE), run.batch, grads, run.scale)
            run.losses.append(loss)
            run.metrics.append(metrics)
        else:
            x = run.batch.tokens if i == 0 else self.store.get(key, Space.DEVICE)
            x, kept = x if i in run.keeping else (x, None)  # the plan drops the item after the backward
            args = (params, self._offsets[i], x, run.batch, run.g)
            run.g, grads = (self.fns.backward(self.bound[i], i == 0)(*args, grads) if kept is None
                            else self.fns.backward_kept(self.bound[i])(*args, kept, grads))
        last = a.micro == self.cfg.micro_batches - 1
        for c, grad in zip(self.bound[i].grad_chunks, grads):
            self.store.put(("slot", c), grad)
            if last and ("param", c) in a.drops:
                run.sumsq.append(sum_of_squares(grad))  # final: count it for the global norm
        return run.g, grads

    def _measure_moment(self, run: "_StepState") -> None:
        jax.block_until_ready((run.x, run.g))  # sync: first step only, to read the allocator
        in_use = self.device_memory_in_use() or 0
        self.measured_non_model.append(in_use - self.store.bytes[Space.DEVICE])

    def _put_batch(self, batch: Batch) -> Batch:
        """This process's rows of the global micro-batch, every field sharded over the data axis."""
        sharding = self.placement.sharding(Space.DEVICE)
        return Batch(*(None if field is None else jax.make_array_from_process_local_data(sharding, np.asarray(field))
                       for field in batch))

    def _put_counts(self, micro_batches: Sequence[Batch]) -> jax.Array:
        """[M, B, K] counts per row (trained targets, or the objective's), rows sharded: the device
        sums them to the global counts."""
        sharding = self.placement.sharding(Space.DEVICE, P(None, "data"))
        return jax.make_array_from_process_local_data(sharding, row_counts(micro_batches, self.model))

    def _grads(self, i: int) -> tuple[jax.Array, ...]:
        """Stage i's grad chunks on the device (zeros at first use), taken out to be donated."""
        out = []
        for c in self.bound[i].grad_chunks:
            key = ("slot", c)
            if key in self.store:
                out.append(self.store.take(key, Space.DEVICE))
            else:
                out.append(zeros_chunk(self.layout.numel_of(c), self.param_dtype,
                                       self.placement.sharding(Space.DEVICE)))
        return tuple(out)

    def device_memory_in_use(self) -> int | None:
        """What the backend's allocator holds now (None on a CPU): for checking the trace."""
        stats = compat.memory_stats(self.placement.mesh.devices.flat[0])
        return stats.get("bytes_in_use") if stats else None


@dataclasses.dataclass
class _StepState:
    """What flows between the moments of one step."""
    scale: jax.Array
    keeping: frozenset = frozenset()  # stages that keep their vjp residuals (StepShape.keeping)
    x: Any = None
    g: Any = None
    batch: Any = None
    losses: list = dataclasses.field(default_factory=list)
    metrics: list = dataclasses.field(default_factory=list)  # the head's metric sums, per micro-batch
    sumsq: list = dataclasses.field(default_factory=list)
