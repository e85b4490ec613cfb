"""Full fine-tuning (or LoRA) of each Llama-family preset on one machine: pstar-plan's answers as one table.

    python scripts/plan_presets.py --device-memory 132GiB --host-memory 106GiB         # one H200
    python scripts/plan_presets.py --device-memory 22GiB --host-memory 54GiB           # a 24 GiB GPU
    python scripts/plan_presets.py --presets llama-3.2-1b,qwen2.5-0.5b --json
    python scripts/plan_presets.py --lora-rank 16 --host-memory 125GiB                # LoRA, base frozen

Each row is ``pstar_jax.plan_report`` for the preset at ``--seq-len`` (what ``pstar-plan --model
PRESET --seq-len ... --no-search --json`` answers, without a process per preset): whether it fits
or which memory runs out and by how much, the share of param chunks that never leave the device,
where Adam runs (chunks with state on the device / on the host / streamed through the device),
bytes moved per step, and the predicted step time and model TFLOPS. With ``--lora-rank`` only the
adapters train (14 B/param) and the base is frozen chunks (2 B/param). A row that does not fit also
gives a bound that holds for every placement: the model data beside what the device can hold at its
busiest moment plus the host. Predictions come from the
machine's rates (``--machine``, the H200's by default), not from a run; plans are traced on the
CPU backend, so no accelerator is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pstar_jax as ps  # noqa: E402

LLAMA_FAMILY = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-0.5b", "qwen2.5-7b",
                "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
                "qwen3-14b", "qwen3-32b", "mistral-7b")
COLUMNS = ("preset", "params", "model data", "fits (or what runs out)", "resident", "Adam chunks device/host/streamed",
           "moved/step (h2d+d2h)", "s/step", "model TFLOPS")


def use_cpu_backend() -> None:
    """Trace on the CPU (its memory analysis stands in for the accelerator's, as in pstar-plan),
    keeping compiled stages so that a rerun answers in seconds."""
    import jax
    jax.config.update("jax_platforms", "cpu")
    if jax.config.jax_compilation_cache_dir is None:
        from pstar_jax.planner.measure import cache_dir
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def plan_preset(name: str, args: argparse.Namespace) -> ps.PlanReport:
    from pstar_jax.plan.machine import load_machine
    from pstar_jax.planner.build import default_mesh
    engine = ps.EngineConfig(device_memory=ps.parse_bytes(args.device_memory, "--device-memory"),
                             host_memory=ps.parse_bytes(args.host_memory, "--host-memory"),
                             micro_batches=args.micro_batches, precision=args.precision, machine=args.machine)
    lora = ps.LoraConfig(rank=args.lora_rank)
    config = ps.RunConfig(model=ps.ModelConfig(name=name, module=args.model_module, seq_len=args.seq_len),
                          engine=engine, train=ps.TrainConfig(batch_size=args.batch_size), lora=lora)
    return ps.plan_report(ps.load_model(config), engine, args.batch_size, default_mesh(1), load_machine(args.machine),
                          engine.host_memory, label=name, search=False, lora=lora)


def row(report: ps.PlanReport) -> dict:
    """One table row as data (bytes in bytes, times in seconds; None where it does not fit)."""
    plan, shape, n = report.plan, report.planned.shape, report.planned.layout.n_chunks
    # per device: a param or grad, master and Adam; a frozen chunk its param alone
    model_data = sum(shape.chunk_bytes) + sum(shape.opt_state_bytes)
    busiest = shape.busiest_non_model_bytes
    out = {"preset": report.label, "n_params": report.n_params, "n_chunks": n,
           "chunk_numels": report.planned.layout.chunk_numels, "model_data_bytes": model_data, "fits": plan.fits,
           "problem": plan.problem,
           # Every chunk's item and state live somewhere at every moment, and at the busiest one the
           # device has room for at most its budget less that moment's working memory: a lower bound
           # on what is missing that holds for every placement.
           "short_bytes": max(0, model_data - (report.planned.device_budget_bytes - busiest) - report.host_bytes)}
    if plan.fits:
        on_device, streamed = sum(plan.opt_on_device), sum(plan.opt_streamed)
        out.update(resident_fraction=plan.resident_fraction, adam_chunks_device=on_device,
                   adam_chunks_host=shape.n_trainable - on_device - streamed, adam_chunks_streamed=streamed,
                   h2d_bytes=plan.h2d_bytes, d2h_bytes=plan.d2h_bytes, peak_device_bytes=plan.peak_device_bytes,
                   peak_host_bytes=plan.peak_host_bytes, predicted_step_s=plan.predicted_step_s,
                   model_tflops=report.model_tflops)
    return out


def markdown(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        head = f"| {r['preset']} | {r['n_params'] / 1e9:.2f}B | {ps.format_bytes(r['model_data_bytes'])} | "
        if not r["fits"]:
            short = (f"; whatever the placement, at least {ps.format_bytes(r['short_bytes'])} short"
                     if r["short_bytes"] else "")
            lines.append(head + f"no: {r['problem']}{short} |" + "  |" * (len(COLUMNS) - 4))
            continue
        lines.append(head + f"yes (peak device {ps.format_bytes(r['peak_device_bytes'])}, host "
                     f"{ps.format_bytes(r['peak_host_bytes'])}) | {100 * r['resident_fraction']:.0f}% | "
                     f"{r['adam_chunks_device']}/{r['adam_chunks_host']}/{r['adam_chunks_streamed']} | "
                     f"{ps.format_bytes(r['h2d_bytes'] + r['d2h_bytes'])} | {r['predicted_step_s']:.2f} | "
                     f"{r['model_tflops']:.0f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(LLAMA_FAMILY), help="comma list of presets")
    p.add_argument("--model-module", default="pstar_models")
    p.add_argument("--device-memory", default="132GiB", help="per device, bytes (default: 0.95 of an H200)")
    p.add_argument("--host-memory", default="106GiB", help="pinned host memory for chunks (default: 85%% of 125 GiB)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--machine", default="h200", help="rates to predict with: h200, h200-duplex or a JSON file")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on every projection, the "
                   "base frozen (0: full fine-tuning)")
    p.add_argument("--json", action="store_true", help="one JSON object per preset instead of the table")
    args = p.parse_args(argv)
    try:
        use_cpu_backend()
        rows = []
        for name in args.presets.split(","):
            rows.append(row(plan_preset(name, args)))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    except ps.ConfigError as err:  # LoraConfig's checks too
        print(f"plan_presets: {err}", file=sys.stderr)
        return 2
    if not args.json:
        what = f"LoRA rank {args.lora_rank} (base frozen)" if args.lora_rank else "full fine-tuning"
        print(f"{what}, batch {args.batch_size}x{args.seq_len} in {args.micro_batches} micro-batches, "
              f"{args.precision}; device {args.device_memory}, host {args.host_memory}; predicted with {args.machine} "
              "rates, not measured")
        print("\n".join(markdown(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
