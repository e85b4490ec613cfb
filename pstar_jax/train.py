"""pstar-train: train a staged model (by default the Flax GPT of models/) with either engine.

This module only wires parts together: flags -> configs -> data, model, engine -> loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import signal
import sys
from typing import Sequence

from pstar_jax.config import ConfigError, OptimConfig, format_bytes, parse_bytes, parse_count, parse_memory
from pstar_jax.data import DataError, default_corpus, load_tokens

ENGINES = ("chunked", "plain")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pstar-train", description=__doc__.splitlines()[0])
    m = p.add_argument_group("model")
    m.add_argument("--model", default="tiny", help="preset name: tiny, small, GPT2_1B ... GPT3_175B")
    m.add_argument("--model-module", default="models.gpt",
                   help="module with build_model(name, **overrides) returning a staged model")
    for flag in ("--n-layer", "--d-model", "--n-head", "--vocab-size", "--seq-len"):
        m.add_argument(flag, type=int, default=None, help="override the preset")
    m.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all micro-batches")
    t.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip-norm", type=float, default=1.0, help="global-norm clip; 0 disables")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data", default=None, help="token file from pstar-tokens; default: the Python "
                   "standard library's sources as bytes")
    e = p.add_argument_group("engine")
    e.add_argument("--engine", choices=ENGINES, default="chunked")
    e.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    e.add_argument("--remat", default="none", help="plain engine: none, dots or full")
    e.add_argument("--device-memory", default="auto",
                   help="device memory for chunks and activations: bytes (2GiB), a fraction of the "
                        "device (0.8), or auto (0.9 on an accelerator; on a CPU half the model data, "
                        "so chunks move)")
    e.add_argument("--host-memory", default=None, help="pinned host memory pool (bytes); default: "
                   "what the machine has available")
    e.add_argument("--adam-placement", choices=("auto", "device", "host", "stream"), default="auto",
                   help="where fp32 master and Adam state live: device, host (updated there), stream "
                        "(kept on the host, updated on the device); auto: what the plan predicts fastest")
    e.add_argument("--chunk-size", default="auto", help="elements per chunk (4M, 65536) or auto")
    d = p.add_argument_group("data parallelism (ZeRO) and multi-host")
    d.add_argument("--data-parallel", type=int, default=None, help="devices W to shard chunks and the batch "
                   "over (default: all devices of all processes)")
    d.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (or PSTAR_COORDINATOR)")
    d.add_argument("--num-processes", type=int, default=None, help="or PSTAR_NUM_PROCESSES")
    d.add_argument("--process-id", type=int, default=None, help="or PSTAR_PROCESS_ID")
    d.add_argument("--heartbeat-timeout", type=int, default=60,
                   help="seconds before a silent process counts as dead and the others stop")
    d.add_argument("--coordinator-timeout", type=float, default=120,
                   help="seconds for every process to join through the coordinator before giving up")
    d.add_argument("--step-timeout", type=float, default=None,
                   help="end with an error if a step makes no progress for this many seconds")
    d.add_argument("--local-devices", type=int, default=None,
                   help="CPU only: fake this many devices per process (for trying data parallelism)")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-dir", default=None, help="orbax checkpoints of all chunk state")
    c.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps (and always at the end)")
    c.add_argument("--keep-checkpoints", type=int, default=3)
    c.add_argument("--resume", action="store_true", help="continue from the latest checkpoint; --steps counts "
                   "all steps, so a resumed run stops where a straight one would")
    c.add_argument("--stop-after", type=int, default=None, metavar="K", help="stop (and save) after K steps of "
                   "this run, e.g. to fit a job's time limit; --resume continues")
    c.add_argument("--export-flax", default=None, metavar="DIR", help="at the end, write the parameters as a "
                   "plain Flax pytree that models/ loads without pstar_jax")
    c.add_argument("--init-from-flax", default=None, metavar="DIR", help="start from such an export")
    c.add_argument("--skip-nonfinite", action="store_true", help="skip steps whose loss or grads are not finite "
                   "(default: stop with an error naming the step)")
    o = p.add_argument_group("output")
    o.add_argument("--metrics-out", default=None, help="JSON lines, one per step")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _model(args):
    module = importlib.import_module(args.model_module)
    try:
        return module.build_model(args.model, n_layer=args.n_layer, d_model=args.d_model,
                                  n_head=args.n_head, vocab_size=args.vocab_size, seq_len=args.seq_len,
                                  tie_embeddings=args.tie_embeddings)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def _tokens(args, vocab_size: int):
    from pstar_jax.data import check_vocab
    tokens = load_tokens(args.data) if args.data else default_corpus()
    check_vocab(tokens, vocab_size)
    return tokens


def _validate(args) -> None:
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    if args.batch_size < 1 or args.micro_batches < 1 or args.batch_size % args.micro_batches:
        raise ConfigError(f"--batch-size {args.batch_size} must be a positive multiple of "
                          f"--micro-batches {args.micro_batches}")
    if args.host_memory is not None:
        parse_bytes(args.host_memory, "--host-memory")
    if args.chunk_size != "auto":
        parse_count(args.chunk_size, "--chunk-size")


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    from pstar_jax.checkpoint import check_export_dir, check_init_and_resume, check_run_checkpoints
    check_init_and_resume(args.init_from_flax, args.resume)
    if args.checkpoint_dir:
        check_run_checkpoints(args.checkpoint_dir, args.resume, args.keep_checkpoints)
    if args.export_flax:
        check_export_dir(args.export_flax)
    from pstar_jax.memory import configure_backend, host_budget_bytes
    host_bytes = host_budget_bytes(args.host_memory)
    configure_backend("0.9" if args.device_memory == "auto" else args.device_memory, host_bytes)
    import jax
    if args.local_devices:  # CPU only: fake devices, to try data parallelism on one machine
        jax.config.update("jax_num_cpu_devices", args.local_devices)
    from pstar_jax import distributed, zero
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           timeout_s=args.coordinator_timeout, heartbeat_timeout_s=args.heartbeat_timeout)

    from pstar_jax.checkpoint import (StopSignal, export_flax, import_flax, open_run_checkpoints, restore_engine,
                                      save_engine)
    from pstar_jax.data import Batches
    from pstar_jax.metrics import MetricsWriter, Progress, step_record
    from pstar_jax.optim import default_tx

    model = _model(args)
    cfg = model.config
    tokens = _tokens(args, cfg.vocab_size)
    mesh = zero.data_mesh(args.data_parallel)
    W = mesh.devices.size
    micro = args.batch_size // args.micro_batches
    if micro % W:
        raise ConfigError(f"the micro-batch ({micro} sequences) must be a multiple of --data-parallel {W}")
    zero.check_process_rows(micro)
    optim = OptimConfig(lr=args.lr, total_steps=args.steps, weight_decay=args.weight_decay,
                        warmup_steps=args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20),
                        clip_norm=args.clip_norm or None)
    init = import_flax(args.init_from_flax, model.param_shapes()) if args.init_from_flax else None
    if args.resume and not args.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir")
    if args.checkpoint_dir and args.engine == "plain":
        raise ConfigError("--checkpoint-dir works with the chunked engine; drop it or --engine plain")
    ckpt = (open_run_checkpoints(args.checkpoint_dir, args.resume, args.steps, args.keep_checkpoints,
                                 lock=distributed.is_main_process())
            if args.checkpoint_dir else None)
    try:  # a refused restore or plan releases the directory (in-process callers run again)
        engine = _engine(args, model, mesh, default_tx(optim), optim.clip_norm, init, host_bytes)
        position = 0
        if ckpt and args.resume:
            meta = restore_engine(ckpt, engine)
            position = meta["data_position"]
    except BaseException:
        if ckpt:
            ckpt.close()
        raise
    batches = Batches(tokens, micro, cfg.seq_len, args.seed, process_index=jax.process_index(),
                      process_count=jax.process_count(), position=position)  # yields this process's rows
    main_process = distributed.is_main_process()
    if main_process:
        print(engine.summary(), flush=True)
        if engine.step_count:
            print(f"resumed from {ckpt.directory} at step {engine.step_count}", flush=True)

    def save(step: int) -> None:
        save_engine(ckpt, engine, step, {"data_position": batches.state()["position"], "args": vars(args),
                                          "seed": args.seed})

    writer = MetricsWriter(args.metrics_out if main_process else None)
    progress = Progress(args.steps, initial=engine.step_count, enabled=main_process and not args.quiet)
    watchdog = distributed.Watchdog(args.step_timeout, process_index=jax.process_index())
    stop = StopSignal()
    step_tokens = args.batch_size * cfg.seq_len
    result = record = None
    stopping = last = False
    first_step = engine.step_count
    try:
        with distributed.peer_failures_end_the_process():
            for step in range(engine.step_count, args.steps):
                result = engine.step([next(batches) for _ in range(args.micro_batches)])
                watchdog.progress(step + 1)
                record = step_record(step, result, step_tokens, model.flops_per_token(),
                                     predicted_h2d_bytes=result.predicted_h2d_bytes,
                                     predicted_d2h_bytes=result.predicted_d2h_bytes, skipped=result.skipped)
                writer.write(record)
                progress.update(record)
                last = step + 1 == args.steps or (args.stop_after and step + 1 - first_step >= args.stop_after)
                stopping = distributed.agree_to_stop(stop.signum != 0)  # every process stops after the same step
                if ckpt and (last or stopping or (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)):
                    save(step + 1)
                if stopping or last:
                    break
    finally:
        watchdog.stop()
        progress.close()
        writer.close()
        if ckpt:
            ckpt.close()  # waits for the last asynchronous save
        stop.restore()
    if stopping and not last:
        if main_process:
            where = f"; checkpoint saved in {ckpt.directory}" if ckpt else " (no --checkpoint-dir: nothing saved)"
            cause = signal.Signals(stop.signum).name if stop.signum else "a signal to another process"
            print(f"pstar-train: stopped by {cause} after step {engine.step_count}{where}", file=sys.stderr)
        return 0
    if args.export_flax:
        params = engine.params_numpy() if args.engine == "plain" else engine.params()
        export_flax(args.export_flax, params, dataclasses.asdict(cfg))
    if main_process and result is not None:
        print(f"done: {engine.step_count} of {args.steps} steps, loss {result.loss:.4f}, "
              f"{record['tokens_per_s']:,.0f} tokens/s, moved {format_bytes(result.h2d_bytes)} h2d / "
              f"{format_bytes(result.d2h_bytes)} d2h per device in the last step")
    return 0


def _engine(args, model, mesh, make_tx, clip_norm, init_params, host_bytes: int):
    """The chunked engine (planned for this machine), or the plain one."""
    import jax
    import jax.numpy as jnp

    from pstar_jax.chunks import auto_chunk_numel
    from pstar_jax.config import EngineConfig
    from pstar_jax.executor import ChunkedEngine
    from pstar_jax.machine import measure
    from pstar_jax.memory import Placement, device_total_bytes
    from pstar_jax.optim import ChunkOptimizer
    from pstar_jax.plain import PlainEngine

    cfg = model.config
    if args.engine == "plain":
        return PlainEngine(model, args.precision, make_tx, args.micro_batches, args.seed, clip_norm, args.remat,
                           mesh=mesh, init_params=init_params)
    chunk_numel = (auto_chunk_numel(model.param_shapes(), model.decays, multiple=mesh.devices.size)
                   if args.chunk_size == "auto" else parse_count(args.chunk_size, "--chunk-size"))
    device = jax.local_devices()[0]
    if args.device_memory == "auto":  # on a CPU: None, half the model data (the demo default)
        budget = None if device.platform == "cpu" else int(0.9 * device_total_bytes(device))
    else:
        budget = parse_memory(args.device_memory, device_total_bytes(device), "--device-memory")
    host = host_bytes // max(1, jax.local_device_count())  # per device, like the plan
    placement = Placement(mesh)
    compute_dtype = jnp.bfloat16 if args.precision == "bf16" else jnp.float32
    machine = measure(placement, ChunkOptimizer(make_tx, placement, compute_dtype))
    micro = args.batch_size // args.micro_batches
    return ChunkedEngine(model, EngineConfig(chunk_numel, budget, args.precision, args.micro_batches,
                                             args.adam_placement),
                         make_tx, mesh, (micro, cfg.seq_len), machine, args.seed, clip_norm, host_bytes=host,
                         init_params=init_params, skip_nonfinite=args.skip_nonfinite)


def main(argv: Sequence[str] | None = None) -> int:
    from pstar_jax.checkpoint import CheckpointSaveError
    try:
        return run(argv)
    except CheckpointSaveError as err:  # orbax threads may wait forever on the failed save: leave now
        from pstar_jax.distributed import hard_exit
        hard_exit(1, f"pstar-train: error: {err}")
    except (ConfigError, DataError) as err:
        print(f"pstar-train: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # NonFiniteLoss: the state before the bad step is intact
        print(f"pstar-train: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pstar-train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
