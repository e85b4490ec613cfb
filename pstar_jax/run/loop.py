"""The training loop: a run built from a RunConfig, stepping, metrics, checkpoints and signals.

``Run(config)`` makes everything a run needs, in the order that fails early: output paths are
checked, the backend configured, the model built, the data read and checked against the
vocabulary, the checkpoint directory opened (refusing another run's checkpoints, or a resume
whose math differs from the checkpoint's), and the engine planned, raising ConfigError before
any model data is allocated when it does not fit. ``Run.fit()`` then yields one record per step
(the fields of the JSON-lines metrics), saves checkpoints on schedule, at the end and when
SIGINT/SIGTERM arrives, and stops on a non-finite step unless told to skip such steps. With
``train.eval_every`` it reports a held-out loss (forward only) every so many steps and at the
end, on ``data.eval_path`` or else on the last 1% of the training tokens, which are not trained on.
Data is a token file or a packed SFT file (``NAME.sft.u16.bin``: rows of whole examples, the loss
over their trained tokens only); either may be the training or the evaluation data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from typing import Any, Iterator, Sequence

import numpy as np

from pstar_jax.config import ConfigError, RunConfig, from_dict, math_differences, to_dict
from pstar_jax.run.metrics import JsonlWriter, MetricsWriter, Progress, TensorBoardWriter, step_record
from pstar_jax.io.models import hf_functions, load_model
from pstar_jax.model.staged import StagedModel, flops_per_token

log = logging.getLogger(__name__)  # start-up phases (see pstar_jax.cli.flags.start_up_notes)


def _frozen_source(hf, init, cfg: RunConfig, model: StagedModel):
    """How the engine reads frozen chunks its plan homes on disk: straight from the Hugging Face
    base's safetensors files, or from EngineConfig.frozen_cache, written first from those files or
    the Flax export's tensors (None without a base in files: such a plan is refused in one line)."""
    cache = cfg.engine.frozen_cache
    if hf is None and not (cache and init is not None):
        return None

    def source(layout, chunks):
        from pstar_jax.io.frozen_disk import ChunkCache, SafetensorsChunks
        dtype, workers = np.dtype(cfg.engine.compute_dtype), min(4, os.cpu_count() or 1)
        straight = SafetensorsChunks(hf, layout, dtype, chunks=chunks, workers=workers) if hf is not None else None
        if not cache:
            return straight
        from pstar_jax.io.base_record import base_record
        try:
            return ChunkCache(cache, layout, straight if straight is not None else init,
                              base_record(cfg, model)["fingerprint"], dtype, chunks, workers)
        finally:
            if straight is not None:
                straight.close()
    return source


class Run:
    """One training run. ``model`` and ``tokens`` replace what the config names; ``writers``
    receive every step's metrics beside those the config asks for; ``make_tx`` replaces AdamW by
    another elementwise optax transformation factory (see pstar_jax.engine.optim); ``eval_tokens``
    replaces ``data.eval_path`` (the held-out tokens of ``train.eval_every``). ``tokens`` and
    ``eval_tokens`` may also be packed SFT rows (pstar_jax.data.rows.Rows or packing.PackedRows)."""

    def __init__(self, config: RunConfig, model: StagedModel | None = None, tokens: np.ndarray | None = None,
                 writers: Sequence[MetricsWriter] = (), make_tx: Any = None, verbose: bool = True,
                 eval_tokens: np.ndarray | None = None):
        from pstar_jax.io.checkpoint import check_run_checkpoints
        from pstar_jax.io.flax_io import check_export_dir
        self.config = cfg = config
        self._writers: list[MetricsWriter] = list(writers)
        self._ckpt = None
        self.base: dict | None = None  # the record of a frozen base (checkpoints hold the rest)
        self.stopped_by, self.stopped_by_peer = 0, False
        self.profile_written: tuple[str, int, int] | None = None  # fit()'s profile: (folder, first, last step)
        from pstar_jax.run.preflight import check_inputs, positions_warning
        check_inputs(cfg)  # (pstar-train asks this before importing JAX)
        if cfg.checkpoint.directory:
            check_run_checkpoints(cfg.checkpoint.directory, cfg.checkpoint.resume, cfg.checkpoint.keep)
        from pstar_jax.config.paths import check_output_dir, check_output_file
        if cfg.output.metrics_out:
            check_output_file(cfg.output.metrics_out, "OutputConfig.metrics_out")
        if cfg.output.tensorboard:
            check_output_dir(cfg.output.tensorboard, "OutputConfig.tensorboard")
        if cfg.output.profile:
            check_output_dir(cfg.output.profile, "OutputConfig.profile")
        if cfg.checkpoint.export_flax:
            check_export_dir(cfg.checkpoint.export_flax)
        if cfg.checkpoint.export_hf:
            from pstar_jax.io.hf import check_export_target, tokenizer_files
            check_export_target(cfg.checkpoint.export_hf)
            hf_functions(cfg)
            if cfg.model.init_from_hf and os.path.isdir(cfg.model.init_from_hf):
                tokenizer_files(cfg.model.init_from_hf)  # what the export will copy: refused now, not after training
        if cfg.checkpoint.export_lora:
            from pstar_jax.io.peft_io import check_adapter_target
            check_adapter_target(cfg.checkpoint.export_lora, "CheckpointConfig.export_lora")

        from pstar_jax.engine.memory import configure_backend, host_budget_bytes
        configure_backend(cfg.engine.device_memory, host_budget_bytes(cfg.engine.host_memory))
        import jax
        if cfg.distributed.local_devices:  # CPU only: fake devices, to try data parallelism on one machine
            jax.config.update("jax_num_cpu_devices", cfg.distributed.local_devices)
        from pstar_jax.run import distributed
        from pstar_jax.engine import zero
        d = cfg.distributed
        distributed.initialize(d.coordinator, d.num_processes, d.process_id, timeout_s=d.coordinator_timeout,
                               heartbeat_timeout_s=d.heartbeat_timeout)
        self.main_process = distributed.is_main_process()
        self.verbose = verbose and self.main_process
        if cfg.checkpoint.resume:
            from pstar_jax.run.resume import check_resume
            check_resume(cfg)  # its base and data, before a model is built from flags that lack them

        self._adapter: dict[str, np.ndarray] = {}  # --init-from-lora's tensors
        if cfg.model.init_from_lora:  # the adapter's LoRA settings become the run's
            from pstar_jax.config.lora import LoraConfig
            from pstar_jax.io.lora_io import adopt_adapter
            base = model if model is not None else load_model(dataclasses.replace(cfg, lora=LoraConfig()))
            self.config = cfg = (adopted := adopt_adapter(cfg, base))[0]
            self._adapter = adopted[1]
        self.model = model if model is not None else load_model(cfg)
        if self.main_process and (warning := positions_warning(self.model)):
            log.warning(warning)
        from pstar_jax.data.training import is_packed, open_training_data
        self.tokens = tokens if tokens is not None else open_training_data(cfg.data.path, self.model.vocab_size)
        _check_packing(self.model, self.tokens, "DataConfig.path")
        from pstar_jax.run.objective import check_data, trained_model
        check_data(cfg, self.tokens, "DataConfig.path")
        self.eval_tokens = None  # the held-out tokens (train.eval_every)
        if eval_tokens is not None and not cfg.train.eval_every:
            raise ConfigError("eval_tokens given but TrainConfig.eval_every is 0; set how often to evaluate")
        if cfg.train.eval_every:
            self.tokens, self.eval_tokens = _eval_split(cfg, self.tokens, eval_tokens, self.model.vocab_size)
            _check_packing(self.model, self.eval_tokens, "DataConfig.eval_path")
            if cfg.data.eval_path:
                check_data(cfg, self.eval_tokens, "DataConfig.eval_path")
        self.mesh = zero.data_mesh(d.data_parallel)
        from pstar_jax.planner.build import build_engine, micro_batch_shape
        shape = micro_batch_shape(cfg.train.batch_size, cfg.engine.micro_batches, self.model.seq_len, self.mesh)
        zero.check_process_rows(shape[0])
        init = hf = None
        if cfg.model.init_from_flax:
            from pstar_jax.io.flax_io import import_flax
            init = import_flax(cfg.model.init_from_flax, self.model.param_shapes())
        if cfg.model.init_from_hf:  # validated whole here; tensors are read one chunk at a time later
            from pstar_jax.io.hf import HFCheckpoint
            from pstar_jax.model.lora import WithAdapters, base_shapes
            init = hf = HFCheckpoint(cfg.model.init_from_hf, hf_functions(cfg)[0](self.model), base_shapes(self.model))
            for name, (rows, kept) in init.truncated.items():
                if self.verbose:
                    print(f"note: {name} has {rows} rows in {cfg.model.init_from_hf}; the first {kept} are used "
                          f"(seq_len {self.model.seq_len})", flush=True)
            if cfg.lora.enabled:  # the checkpoint holds the base; the adapters start as peft's
                init = WithAdapters(init, self.model, cfg.train.seed)
            if self._adapter:  # continuing: the adapter's tensors replace the fresh ones and the base's
                from pstar_jax.io.lora_io import Overlay
                init = Overlay(init, self._adapter)
        if cfg.checkpoint.directory:
            self._ckpt = self._open_checkpoints()
        try:
            from pstar_jax.model.lora import frozen_for_lora
            frozen = frozen_for_lora(self.model, cfg.lora)  # LoRA: all but the adapters and modules_to_save
            from pstar_jax.engine.optim import default_tx
            self._make_tx = make_tx if make_tx is not None else default_tx(cfg.optim)  # its schedule: each lr
            # A model built from the config is rebuilt at another length for a misfit's error to name one.
            seq_len_at = None if model is not None else (lambda n: trained_model(cfg, load_model(
                dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_len=n)))))
            self.engine = build_engine(trained_model(cfg, self.model), cfg.engine, cfg.optim, shape, mesh=self.mesh,
                                       seed=cfg.train.seed,
                                       init_params=init, skip_nonfinite=cfg.train.skip_nonfinite,
                                       make_tx=self._make_tx, frozen=frozen, seq_len_at=seq_len_at,
                                       frozen_source=_frozen_source(hf, init, cfg, self.model))
            from pstar_jax.model.freeze import frozen_names, parse_patterns
            # What the engine freezes (its patterns and LoRA's): no weight gradient, fewer model FLOPs.
            self.frozen = frozen_names(list(self.model.param_shapes()), parse_patterns(cfg.engine.freeze), frozen)
            position = 0
            self.eval_set: list = []  # the fixed held-out micro-batches, this process's rows
            if self.eval_tokens is not None:
                from pstar_jax.data.training import evaluation_set
                what = ("DataConfig.eval_path" if cfg.data.eval_path or eval_tokens is not None else
                        "the held-out last 1% of the training tokens (TrainConfig.eval_every without "
                        "DataConfig.eval_path)")
                self.eval_set = evaluation_set(self.eval_tokens, shape[0], self.model.seq_len, cfg.train.eval_batches,
                                               process_index=jax.process_index(), process_count=jax.process_count(),
                                               what=what)
                self.engine.eval_plan_for(shape, cfg.train.eval_batches)  # a misfit is refused before training
            # The stored reference is the initial weights' (pstar_jax.run.reference): made before a restore.
            from pstar_jax.run.reference import held_out_reference, stored_reference
            self._ref = stored_reference(cfg, self.model, self.engine, shape[0], self.verbose)
            self.eval_set = held_out_reference(cfg, self.model, self.engine, self._ref, self.eval_set,
                                               self.eval_tokens, shape[0], self.verbose)
            if self._ckpt is not None and cfg.checkpoint.resume:
                from pstar_jax.io.checkpoint import restore_engine
                log.info("restoring the latest checkpoint in %s", self._ckpt.directory)
                from pstar_jax.run.resume import data_position
                position = data_position(restore_engine(self._ckpt, self.engine), self._ckpt.directory)
        except BaseException:
            self.close()
            raise
        from pstar_jax.data.training import training_batches
        self.packed = is_packed(self.tokens)
        self.batches = training_batches(self.tokens, shape[0], self.model.seq_len, cfg.train.seed,
                                        process_index=jax.process_index(), process_count=jax.process_count(),
                                        position=position, ref=self._ref)  # yields this process's rows

    def _open_checkpoints(self):
        from pstar_jax.io.base_record import base_record, check_same_adapters, check_same_base
        from pstar_jax.io.checkpoint import open_run_checkpoints
        c = self.config.checkpoint
        ckpt = open_run_checkpoints(c.directory, c.resume, self.config.train.steps, c.keep,
                                    lock=self.main_process)  # a run owns its directory
        try:
            # A run with frozen tensors saves its trained chunks alone and records the base (pstar_jax.io.base_record).
            self.base = base_record(self.config, self.model) if self.config.lora.enabled or \
                self.config.engine.freeze else None
            if c.resume:
                meta = ckpt.meta()
                saved = meta.get("config")
                if saved:  # what the checkpoint holds and is trained on cannot change, allowed or not
                    check_same_adapters(from_dict(RunConfig, saved), self.config, ckpt.directory)
                if self.base is not None:
                    check_same_base(meta.get("base"), self.base, ckpt.directory)
                differences = math_differences(from_dict(RunConfig, saved), self.config) if saved else []
                if differences and not c.allow_changes:
                    raise ConfigError(f"resuming with settings that change the training math: "
                                      f"{'; '.join(differences)}; use the checkpoint's values, or pass "
                                      "CheckpointConfig.allow_changes to resume with the new ones")
        except BaseException:
            ckpt.close()
            raise
        return ckpt

    @property
    def checkpoint_directory(self) -> str | None:
        return self._ckpt.directory if self._ckpt is not None else None

    def save(self) -> None:
        """Save a checkpoint of the current step now (asynchronous; ``close`` waits for it)."""
        from pstar_jax.io.checkpoint import save_engine
        if self._ckpt is None:
            raise ConfigError("no CheckpointConfig.directory: nothing to save into")
        save_engine(self._ckpt, self.engine, self.engine.step_count,
                    {"data_position": self.batches.state()["position"], "seed": self.config.train.seed,
                     "config": to_dict(self.config), "engine": self.engine.kind,
                     **({"base": self.base} if self.base is not None else {})})

    def evaluate(self) -> float:
        """The held-out loss now (forward only; nothing changes): needs ``train.eval_every``."""
        if not self.eval_set:
            raise ConfigError("no held-out data: set TrainConfig.eval_every (and DataConfig.eval_path, or the last "
                              "1% of the training tokens is held out)")
        return self.engine.evaluate(self.eval_set)

    def fit(self) -> Iterator[dict]:
        """Train to ``train.steps`` (or ``checkpoint.stop_after`` more steps, or a stop signal),
        yielding each step's record. Checkpoints are saved as configured and at the end. Every
        ``train.eval_every`` steps and at the end the record also holds ``eval_loss`` (and the
        seconds it took, ``eval_s``).

        SIGINT/SIGTERM to any process stops every process after the same step (they agree on it
        each step), with a checkpoint; ``stopped_by`` then names the signal (0: none reached this
        process, ``stopped_by_peer``: another process got it)."""
        import jax

        from pstar_jax.run import distributed
        from pstar_jax.run.signals import StopSignal
        from pstar_jax.engine.optim import learning_rate
        from pstar_jax.planner.measure import step_gap_note
        cfg, engine = self.config, self.engine
        writers = list(self._writers)
        if self.main_process and cfg.output.metrics_out:
            writers.append(JsonlWriter(cfg.output.metrics_out, first_step=engine.step_count))
        if self.main_process and cfg.output.tensorboard:
            writers.append(TensorBoardWriter(cfg.output.tensorboard, to_dict(cfg)))
        watchdog = distributed.Watchdog(cfg.distributed.step_timeout, process_index=jax.process_index())
        stop = StopSignal()  # from here a signal stops after a step, with a checkpoint
        if engine.step_count < cfg.train.steps:
            log.info("compiling the first step")  # before the bar, which would cut the line
        progress = Progress(cfg.train.steps, initial=engine.step_count,
                            enabled=self.verbose and not cfg.output.quiet)
        step_tokens = cfg.train.batch_size * self.model.seq_len
        flops = flops_per_token(self.model, self.frozen)
        first_step, every = engine.step_count, cfg.checkpoint.every
        evaluated = False
        profile = Profile(cfg.output.profile if self.main_process else None, first_step + 2, cfg.output.profile_steps)
        try:
            with distributed.peer_failures_end_the_process():
                for step in range(engine.step_count, cfg.train.steps):
                    profile.before(step)
                    result = engine.step([next(self.batches) for _ in range(cfg.engine.micro_batches)])
                    stop.nothing_to_save = False
                    profile.after(step)
                    timed = step > first_step  # the first two steps compile: not timed (see Watchdog)
                    if timed:
                        watchdog.progress(step + 1)
                    record = step_record(step, result, step_tokens, flops, learning_rate(self._make_tx, step))
                    last = step + 1 == cfg.train.steps or bool(
                        cfg.checkpoint.stop_after and step + 1 - first_step >= cfg.checkpoint.stop_after)
                    if cfg.train.eval_every and (last or (step + 1) % cfg.train.eval_every == 0):
                        start = time.perf_counter()
                        with watchdog.untimed() if not evaluated else contextlib.nullcontext():
                            record["eval_loss"] = self.evaluate()  # the first one compiles
                        evaluated = True
                        record["eval_s"] = time.perf_counter() - start
                        if timed:  # an evaluation is timed on its own, not as part of the next step
                            watchdog.progress(step + 1)
                    for writer in writers:
                        writer.write_scalars(step, {k: v for k, v in record.items() if k != "step"})
                    progress.update(record)
                    if step == first_step + 2 and self.main_process and hasattr(engine, "machine"):  # compiles nothing
                        if note := step_gap_note(step, result.step_s, engine.plan.predicted_step_s, engine.machine,
                                                len(engine.plan.moments)):
                            with progress.aside():
                                log.info(note)
                    stopping = distributed.agree_to_stop(stop.signum != 0)  # all processes stop after one step
                    if stopping and not last:
                        self.stopped_by, self.stopped_by_peer = stop.signum, not stop.signum
                    if self._ckpt is not None and (last or stopping or (every and (step + 1) % every == 0)):
                        self.save()
                    yield record
                    if stopping or last:
                        break
        finally:
            profile.close()
            self.profile_written = profile.written
            watchdog.stop()
            progress.close()
            for writer in writers[len(self._writers):]:
                writer.close()
            stop.restore()
            if self._ckpt is not None:
                self._ckpt.wait()

    def export_flax(self, directory: str) -> None:
        """The current parameters as a plain Flax pytree (see pstar_jax.io.checkpoint.export_flax)."""
        from pstar_jax.io.flax_io import export_flax
        config = getattr(self.model, "config", None)
        export_flax(directory, self.engine.params(), dataclasses.asdict(config) if config is not None else {})

    def export_hf(self, directory: str, dtype: str | None = None) -> list[str]:
        """The current parameters as a Hugging Face checkpoint, streamed a chunk at a time (a LoRA
        run's adapters merged into their kernels, frozen tensors read from the base's source), with
        the tokenizer files of the checkpoint the run started from: what pstar-export writes from
        the run's checkpoint (pstar_jax.io.hf_export)."""
        from pstar_jax.io.hf_export import export_run_hf
        return export_run_hf(directory, self.config, self.model, self.engine.iter_params,
                             dtype or self.config.checkpoint.export_dtype, self.config.model.init_from_hf,
                             frozen=self.frozen, base=self.base)

    def export_lora(self, directory: str) -> list[str]:
        """A LoRA run's adapters (and modules_to_save) as a Hugging Face peft adapter."""
        from pstar_jax.io.lora_io import export_lora
        return export_lora(directory, self.config, self.model, self.engine.iter_params,
                           what="CheckpointConfig.export_lora")

    def close(self) -> None:
        """Wait for the last checkpoint save and release the checkpoint directory; stop the disk
        reader of a base read from disk."""
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_packing(model: StagedModel, data: Any, what: str) -> None:
    """Packed SFT rows need a model whose attention stays within each example of a row, and rows of
    its seq_len (refused here, before the seconds of planning, not when the first batch is drawn)."""
    from pstar_jax.data.batch import model_name, supports_packing
    from pstar_jax.data.rows import check_rows
    from pstar_jax.data.training import is_packed
    from pstar_jax.config.errors import DataError
    if is_packed(data):
        check_rows(data, model.seq_len, what)
    if is_packed(data) and not supports_packing(model):
        raise DataError(f"{what} is packed SFT data, but model {model_name(model)} does not follow segment ids "
                        "(it has no supports_packing), so it would mix the examples of a row; use a model that "
                        "supports packing (the gpt and llama families do) or plain token data")


def _eval_split(config: RunConfig, data: Any, eval_data: Any, vocab_size: int) -> tuple[Any, Any]:
    """(training data, held-out data): ``eval_data`` or DataConfig.eval_path's file (tokens or
    packed SFT rows), else the last 1% of the training tokens or rows, which training then never reads."""
    from pstar_jax.data.token_files import check_vocab
    from pstar_jax.data.training import held_out, is_packed, open_training_data
    from pstar_jax.config.errors import DataError
    if eval_data is None and not config.data.eval_path:
        return held_out(data)
    try:
        if eval_data is None:
            eval_data = open_training_data(config.data.eval_path, vocab_size)
        elif not is_packed(eval_data):
            check_vocab(eval_data, vocab_size)
    except DataError as err:
        raise DataError(f"DataConfig.eval_path: {err}") from None
    return data, eval_data


class Profile:
    """A jax.profiler trace of steps ``first`` .. ``first + count - 1`` into ``directory`` (None:
    none). Each step ends synchronised (it reads its loss), so the trace holds whole steps."""

    def __init__(self, directory: str | None, first: int, count: int):
        self.directory, self.first, self.last = directory, first, first + count - 1
        self.tracing, self.traced = False, -1
        self.written: tuple[str, int, int] | None = None  # (the trace's folder, its first and last step)

    def before(self, step: int) -> None:
        if self.directory and step == self.first:
            import jax
            jax.profiler.start_trace(self.directory)
            self.tracing = True

    def after(self, step: int) -> None:
        self.traced = step
        if step == self.last:
            self.close()

    def close(self) -> None:
        if self.tracing:
            import jax
            self.tracing = False
            jax.profiler.stop_trace()
            runs = os.path.join(self.directory, "plugins", "profile")  # one folder per trace, named by its time
            folders = [os.path.join(runs, n) for n in os.listdir(runs)] if os.path.isdir(runs) else []
            folder = max(folders, key=os.path.getmtime) if folders else self.directory
            self.written = (folder, self.first, self.traced) if self.traced >= self.first else None


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


__all__ = ["Run", "signal_name"]
