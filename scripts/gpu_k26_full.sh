#!/usr/bin/env bash
# Issue 13's device call (one nvidia-h200, < 9 min): the memory plan of one GPU's share of K2.6 at
# full depth, then scripts/bench_k26_full.py (compile time per mode, phase tables at 46k for ar
# and ddtree budgets 15/7/31/63, throughput vs context 4k-128k for ar/chain/ddtree-15 with kernel
# time and host gap per step), everything time-boxed inside the run.
# Usage (device, carry .whl): OUT=$OUT bash scripts/gpu_k26_full.sh
# Results: $OUT/bench_k26_full.jsonl (every row as measured), $OUT/log.txt (the printed tables).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
W=${OUT:-/tmp/gpu_k26_full}; mkdir -p "$W"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # weights 77.6 GB + a 128k-row state + scratch
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  timeout 20 python3 scripts/plan_memory.py --config configs/bench_k26_full.py --mesh data=1 \
    --max_len 135168
  timeout 510 python3 scripts/bench_k26_full.py --config configs/bench_k26_full.py \
    --out_dir "$W" --time_budget_s 480
} 2>&1 | grep -v "^[IW]1" | tee "$W/log.txt"
