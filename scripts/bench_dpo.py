"""A preference-tuning step beside an SFT step on the same rows: LoRA over a frozen Llama, the
chunked engine, chunks moving. The DPO step adds the reference (the base with the adapters off:
one more forward of every block, its activations carried beside the policy's) and the pairs' head;
its backward does not recompute the reference. Per objective: the median step time, the
compiled FLOPs the plan counts per step, and the stage inputs kept for the backward.

    python scripts/bench_dpo.py --d-model 256 --layers 4 --seq-len 512 --batch 8 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from pstar_jax.config import EngineConfig, OptimConfig, format_bytes  # noqa: E402
from pstar_jax.config.lora import LoraConfig  # noqa: E402
from pstar_jax.config.preference import PreferenceConfig  # noqa: E402
from pstar_jax.data.batch import from_rows  # noqa: E402
from pstar_jax.engine.optim import default_tx  # noqa: E402
from pstar_jax.model.lora import frozen_for_lora  # noqa: E402
from pstar_jax.model.preference import PreferenceModel  # noqa: E402
from pstar_jax.plan.machine import H200  # noqa: E402
from pstar_jax.planner.build import chunked_engine  # noqa: E402
from pstar_models.llama import LlamaConfig, StagedLlama  # noqa: E402
from pstar_models.lora import LoraSpec  # noqa: E402


def preference_rows(rng, batch, seq_len, vocab):
    """[batch, seq_len + 1] rows filled with pairs (segment 2k-1 prompt + chosen, 2k prompt +
    rejected, labels on the completions): prompts of a quarter of a pair, completions the rest."""
    tokens = rng.integers(1, vocab, (batch, seq_len + 1)).astype(np.int32)
    segments, labels = np.zeros_like(tokens), np.zeros_like(tokens)
    pair = max(8, seq_len // 4)  # a pair's two sequences: up to 4 pairs a row
    for r in range(batch):
        at, seg = 0, 0
        while at + pair <= seq_len + 1:
            prompt = pair // 8
            for length in (pair // 2, pair - pair // 2):
                seg += 1
                segments[r, at:at + length] = seg
                labels[r, at + prompt:at + length] = 1
                at += length
    return from_rows(tokens, segments, labels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    args = p.parse_args(argv)
    model = StagedLlama(LlamaConfig(vocab_size=args.vocab, d_model=args.d_model, n_layer=args.layers,
                                    n_head=max(1, args.d_model // 64), n_kv_head=max(1, args.d_model // 128),
                                    d_ff=4 * args.d_model, seq_len=args.seq_len,
                                    max_position_embeddings=args.seq_len, lora=LoraSpec(rank=args.rank, alpha=16.0)))
    frozen = frozen_for_lora(model, LoraConfig(rank=args.rank))
    rows = preference_rows(np.random.default_rng(0), args.batch, args.seq_len, args.vocab)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    tx = default_tx(OptimConfig(lr=1e-4, warmup_steps=0, total_steps=args.steps + 1, clip_norm=None))
    print(f"Llama d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}, LoRA rank {args.rank}; "
          f"{args.batch} rows x {args.seq_len} tokens on {jax.devices()[0].platform}")
    print(f"{'objective':<34} {'s/step':>8} {'GFLOP/step':>11} {'stage inputs':>13}")
    times = {}
    for name, trained in (("SFT (the same rows)", model),
                          ("DPO sigmoid (reference in-step)", PreferenceModel(model, PreferenceConfig(),
                                                                             adapters_off=True))):
        engine = chunked_engine(trained, EngineConfig(chunk_numel=None, precision="fp32"), tx, mesh,
                                (args.batch, args.seq_len), H200, clip_norm=None,
                                trainable=lambda n: n not in frozen)
        shape = engine.plan_for((args.batch, args.seq_len)).shape
        flops = sum(shape.fwd_flops) + shape.head_flops + sum(shape.bwd_flops)
        engine.step([rows])  # compiles
        step_s = statistics.median(engine.step([rows]).step_s for _ in range(args.steps))
        times[name] = step_s
        print(f"{name:<34} {step_s:>8.3f} {flops / 1e9:>11.2f} {format_bytes(sum(shape.input_bytes)):>13}")
    sft, dpo = times.values()
    print(f"DPO / SFT step time: {dpo / sft:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
