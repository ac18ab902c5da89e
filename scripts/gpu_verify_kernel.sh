#!/usr/bin/env bash
# Tree-verify kernel on a GPU, one device call (< 10 min): (1) the GPU test set (every code path,
# compiled kernel; KDTREE_GPU_FULL_GRID=1 adds the full grid), (2) per-kernel times of one call,
# (3) the benchmark table (must-show shapes first; ceilings measured in the same run).
# Writes $OUT/verify_kernel.log and $OUT/bench_verify_attention.jsonl. Wall time about
# 195 s + BENCH_S + 80 s at most (default BENCH_S = 290: ~565 s).
#   bash scripts/gpu_verify_kernel.sh "$OUT" [BENCH_S]
set -uo pipefail
OUT=${1:?usage: gpu_verify_kernel.sh OUT_DIR [BENCH_S]}
BENCH_S=${2:-290}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/verify_kernel.log"
quiet() { grep -v "^[IW][0-9]\{4\}" ; }
{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) $(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader)"
  echo "== 1. GPU tests (time box 150 s)"
  timeout 150 python3 -m pytest tests/test_tree_verify_attention.py tests/test_verify_attention_sharded.py \
    -q -rs --durations=8 2>&1 | quiet
  echo "== exit $?"
  echo "== 2. per-kernel CUPTI times of one call (time box 45 s)"
  timeout 45 python3 scripts/profile_verify_kernel.py 2>&1 | quiet
  echo "== exit $?"
  echo "== 3. bench (time box $((BENCH_S + 80)) s; stops starting shapes at $BENCH_S s)"
  timeout $((BENCH_S + 80)) python3 scripts/bench_verify_attention.py --budget_s="$BENCH_S" \
    --json_out="$OUT/bench_verify_attention.jsonl" 2>&1 | quiet
  echo "== exit $?"
} 2>&1 | tee "$LOG"
