#!/usr/bin/env bash
# The GPU check of pstar_jax: one command, under 9 minutes on one H200 (139 GiB, 16 cores,
# about 125 GiB host memory, jax 0.11.2, no network). Writes its results as files under OUT:
#   bandwidth.json   pinned host<->device copies, and pstar's own chunk streaming
#   host_adam.log    host AdamW on 1 and 16 cores beside the host's triad bandwidth, and a host
#                    update beside device matmuls (does begin_update let both run at once?)
#   machines/        this machine's rates as the planner measures them (pstar-machine)
#   gpt1b3/          plain (no remat, full remat) beside pstar at 1.3B: fits plain
#   gpt12b/          plain (predicted OOM) beside pstar at 12B, 32k tokens per step
#   plain_largest/   plain with full remat at 8.3B and 10B (compile-time check, then a run)
#   pstar_largest.txt  pstar-plan's largest depth at d 4096, then that model trained for real
#   lora/            the largest LoRA model (rank 16, d 8192, frozen bf16 base) the planner finds with
#                    the host budget, trained for a few steps: tokens/s, bytes moved by kind
#   long_seq.log     llama-3.2-1b at 64k tokens, batch 1 (pstar-plan: fits, 31.7 GiB peak predicted),
#                    a few steps: tokens/s and peak device memory
# Each phase has its own time limit and a failure does not stop the others.
#   usage: bash scripts/gpu_bench.sh [OUT]        (--cpu-check OUT: the same plumbing on a CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=0
if [ "${1:-}" = "--cpu-check" ]; then cpu=1; shift; fi
out=${1:-runs/gpu_$(date +%F)}
mkdir -p "$out"
# The whole card for JAX (default 0.75 leaves 34 GiB idle), and a pinned-host pool that fits the
# host's ~125 GiB beside Python and the page cache: both are read once, before the backend starts.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-110}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ $cpu = 1 ]; then
    small=(--small); s13=tiny; s12=small; plain_sizes=small-2x128,small-4x128; depth_model=small; host=2GiB; dev=(--device-memory 48MiB)
    # Limits with room for 2 cores shared by several processes (at load 8 gpt1b3 took over 120 s).
    b13=8; b12=8; t=(150 240 240 240 240 120 300 240); adam=(--numel 4194304 --repeats 2)
    lora=(--model small --device-memory 8MiB --host-memory 24MiB --lora-rank 2 --batch-size 2 --max-layers 24)
    long=(--model llama-tiny --seq-len 512 --device-memory 64MiB --host-memory 256MiB --steps 2)
else
    small=(); s13=GPT2_1B-24x2048; s12=GPT3_12B; plain_sizes=GPT3_8B,GPT3_10B; depth_model=GPT3_12B; host=100GiB; dev=()
    # Limits in seconds, 520 in all (under 9 minutes): bandwidth, gpt1b3, gpt12b, plain_largest,
    # pstar_largest, host_adam, lora, long_seq. Before the last two phases came in the first six
    # had 45 120 140 80 110 30.
    b13=16; b12=32; t=(30 75 90 45 75 30 120 55); adam=(--repeats 3)
    lora=(--model GPT_DS_20B --host-memory "$host" --lora-rank 16 --batch-size 4)
    long=(--model llama-3.2-1b --seq-len 65536 --host-memory "$host" --steps 3)
fi
phase() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$out/summary.txt"
}
phase bandwidth "${t[0]}" "$py" scripts/bandwidth.py "${small[@]}" --out "$out/bandwidth.json"
phase host_adam "${t[5]}" bash -c "$py scripts/bench_host_adam.py ${adam[*]} --overlap --json && \
    PSTAR_MACHINES_DIR=$out/machines $py -m pstar_jax.cli.machine --remeasure"
phase gpt1b3 "${t[1]}" "$py" scripts/bench_compare.py --sizes "$s13" --batch-sizes "$b13" \
    --methods plain-none,plain-full,pstar --host-memory "$host" "${dev[@]}" --steps 5 --out "$out/gpt1b3"
phase gpt12b "${t[2]}" "$py" scripts/bench_compare.py --sizes "$s12" --batch-sizes "$b12" \
    --methods plain-full,pstar --host-memory "$host" "${dev[@]}" --steps 4 --out "$out/gpt12b"
phase plain_largest "${t[3]}" "$py" scripts/bench_compare.py --sizes "$plain_sizes" --batch-sizes 8 \
    --methods plain-full "${dev[@]}" --steps 3 --warmup 1 --out "$out/plain_largest"
phase pstar_largest "${t[4]}" "$py" scripts/pstar_largest.py --model "$depth_model" --host-memory "$host" \
    "${dev[@]}" --out "$out/pstar_largest.txt"
phase lora "${t[6]}" "$py" scripts/bench_lora.py "${lora[@]}" --modes lora --steps 3 --out "$out/lora"
phase long_seq "${t[7]}" "$py" scripts/bench_long_seq_train.py "${long[@]}"
echo "results in $out"
