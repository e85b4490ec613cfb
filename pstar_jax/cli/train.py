"""pstar-train: train a staged model (by default the Flax GPT of models/) with either engine.

This module only wires parts together: flags -> RunConfig -> pstar_jax.Run.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from pstar_jax.cli import flags as cli
from pstar_jax.config import SECTIONS, RunConfig, format_bytes
from pstar_jax.config.errors import DataError


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="pstar-train", description=__doc__.splitlines()[0])
    for section in SECTIONS:
        cli.add_section(p, section)
    return p


def parse_config(argv: Sequence[str] | None = None) -> RunConfig:
    args = build_parser().parse_args(argv)
    return RunConfig(**{name: cli.build(cls, args, name) for name, cls in SECTIONS.items()})


def run(argv: Sequence[str] | None = None) -> int:
    start = time.perf_counter()  # the done line's throughput covers everything from here
    config = parse_config(argv)
    from pstar_jax.run.preflight import check_inputs
    check_inputs(config)  # missing inputs, misplaced outputs: in well under a second, before JAX loads
    from pstar_jax.run.distributed import resolve  # imports JAX: after the signal handlers (cli.run_main)
    d = config.distributed
    resolved = resolve(d.coordinator, d.num_processes, d.process_id)  # only process 0 speaks
    with cli.start_up_notes(not config.output.quiet and (resolved is None or resolved[2] == 0), "pstar-train"):
        return _train(config, start)


def _train(config: RunConfig, start: float) -> int:
    from pstar_jax.run.loop import Run, log, signal_name
    log.info("building the model and reading the data")  # after JAX's import, the first seconds
    with Run(config) as r:
        first_step = r.engine.step_count
        if r.main_process:
            print(r.engine.summary(), flush=True)
            if r.engine.step_count:
                print(f"resumed from {r.checkpoint_directory} at step {r.engine.step_count}", flush=True)
        record, eval_loss = None, None
        for record in r.fit():
            eval_loss = record.get("eval_loss", eval_loss)
        wall_s = time.perf_counter() - start
        if r.main_process and config.output.profile:
            print(_profile_line(r.profile_written, config.output.profile), flush=True)
        if r.stopped_by or r.stopped_by_peer:
            if r.main_process:
                where = (f"; checkpoint saved in {r.checkpoint_directory}" if r.checkpoint_directory
                         else " (no --checkpoint-dir: nothing saved)")
                cause = signal_name(r.stopped_by) if r.stopped_by else "a signal to another process"
                print(f"pstar-train: stopped by {cause} after step {r.engine.step_count}{where}", file=sys.stderr)
            return 0
        if config.checkpoint.export_flax:
            r.export_flax(config.checkpoint.export_flax)
        if config.checkpoint.export_hf:
            files = r.export_hf(config.checkpoint.export_hf)
            if r.main_process:
                from pstar_jax.io.hf_export import quant_note
                print(f"exported to {config.checkpoint.export_hf}: {', '.join(files)}{quant_note(config)}", flush=True)
        if config.checkpoint.export_lora:
            files = r.export_lora(config.checkpoint.export_lora)
            if r.main_process:
                print(f"exported the LoRA adapter to {config.checkpoint.export_lora}: {', '.join(files)}", flush=True)
        if r.main_process and record is not None:
            held_out = f", eval loss {eval_loss:.4f}" if eval_loss is not None else ""
            tokens = (r.engine.step_count - first_step) * config.train.batch_size * r.model.seq_len
            print(f"done: {r.engine.step_count} of {config.train.steps} steps, loss {record['loss']:.4f}{held_out}, "
                  f"{tokens / wall_s:,.0f} tokens/s over the whole run ({wall_s:.1f} s, start-up and compilation "
                  f"included), moved {format_bytes(record['h2d_bytes'])} h2d / {format_bytes(record['d2h_bytes'])} "
                  "d2h per device in the last step")
    return 0


def _profile_line(written: tuple[str, int, int] | None, directory: str) -> str:
    if written is None:
        return f"profile: nothing traced into {directory}: the run stopped before the trace's first step"
    folder, first, last = written
    steps = f"step {first}" if first == last else f"steps {first} to {last}"
    return (f"profile: {steps} (numbered as in --metrics-out) traced into {folder}; open it with TensorBoard's "
            "profile plugin (tensorboard --logdir " + directory + "), or its .trace.json.gz in Perfetto")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return cli.run_main("pstar-train", run, argv, (DataError,))
    except FloatingPointError as err:  # NonFiniteLoss: the state before the bad step is intact
        print(f"pstar-train: error: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        # Not imported up front: importing JAX before run_main's signal handlers loses a Ctrl-C.
        checkpoint = sys.modules.get("pstar_jax.io.checkpoint")
        if checkpoint is None or not isinstance(err, checkpoint.CheckpointSaveError):
            raise
        from pstar_jax.run.exits import hard_exit  # orbax threads may wait forever on the failed save: leave now
        hard_exit(1, f"pstar-train: error: {err}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
