"""pstar-tokens --chat throughput and packing efficiency on synthetic conversations.

    python scripts/bench_sft_data.py --conversations 20000 --seq-len 2048

Writes a messages JSONL of multi-turn conversations whose lengths follow a log-normal mix (median
about 200 tokens), renders them with the Qwen2.5 chat template of the test fixtures and a byte-level
BPE trained here (or --tokenizer DIR, a real checkpoint's), packs them and prints the summary line
of pstar-tokens --chat with the machine's load average (other processes share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import numpy as np  # noqa: E402

from pstar_jax.cli import tokens as tokens_cli  # noqa: E402

WORDS = ("the of and to in is that for it as with was on be by this are or from at an which have not but all can "
         "model data train token answer question python function value result system user helpful paris france "
         "memory chunk device host step loss gradient batch sequence").split()


def conversations(n: int, seed: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        turns = int(rng.integers(1, 4))
        words = np.maximum(1, rng.lognormal(np.log(60 / turns), 0.9, 2 * turns)).astype(int)
        conv = []
        for t in range(turns):
            for role, k in (("user", words[2 * t]), ("assistant", words[2 * t + 1])):
                conv.append({"role": role, "content": " ".join(rng.choice(WORDS, k)) + "."})
        out.append(conv)
    return out


def fixture_tokenizer(root: Path) -> Path:
    from chat_fixtures import CORPUS, tokenizer_dir
    CORPUS.extend([" ".join(WORDS)] * 4)  # so the BPE learns the words, as a real vocabulary would
    return tokenizer_dir(root, "qwen25")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=20_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--tokenizer", default=None, help="an HF tokenizer directory with a chat template")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "chat.jsonl"
        with open(data, "w") as f:
            for conv in conversations(args.conversations, args.seed):
                f.write(json.dumps({"messages": conv}) + "\n")
        tokenizer = args.tokenizer or fixture_tokenizer(tmp)
        print(f"{args.conversations:,} conversations, {data.stat().st_size / 2**20:.1f} MiB of JSONL; "
              f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        start = time.perf_counter()
        code = tokens_cli.main(["--chat", "--tokenizer", str(tokenizer), "--seq-len", str(args.seq_len), str(data),
                            "-o", str(tmp / "train.sft.u16.bin")])
        print(f"wall {time.perf_counter() - start:.2f} s; load average after {os.getloadavg()[0]:.2f}")
        raise SystemExit(code)


if __name__ == "__main__":
    main()
