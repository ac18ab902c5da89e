#!/usr/bin/env bash
# One device call: train the k2tiny pair, measure its acceptance / speed per mode, the K2.6-width
# bench (phase table at 46k + throughput vs context) and the verify kernel's per-kernel times.
# Each part is time-boxed; everything but the checkpoint tar and plots is tarred into logs.tar.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
W=/tmp/work; mkdir -p $W
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $W/gpu.txt
TARGET_FLAGS="--config.max_seconds=${TARGET_S:-150}" DRAFT_FLAGS="--config.max_seconds=${DRAFT_S:-85}" \
  OUT=$W timeout 330 bash scripts/train_pair_gpu.sh > $W/train.txt 2>&1
tail -4 $W/train.txt
timeout 80 python3 scripts/eval_acceptance.py --config configs/k2tiny.py --config.dtype=bfloat16 \
  --prompts 4 --gen 128 --budgets 32,128 --json_out $W/accept_gpu.jsonl 2>&1 \
  | grep -v "^[IW]1" | tee $W/accept.txt
timeout 110 python3 scripts/bench_context_decode.py --config configs/bench_k26.py \
  --ctx 4096,16384,46000,131072 --mode ar,chain,ddtree --gen 8 --profile_ctx 46000 \
  --json_out $W/ctx.jsonl --plot_out $W/ctx.png 2>&1 | grep -v "^[IW]1" | tee $W/bench.txt
timeout 30 python3 scripts/profile_verify_kernel.py 2>&1 | grep -v "^[IW]1" | tee $W/kernel.txt
cp $W/k2tiny.tar $W/losses.png $W/ctx.png "$OUT"/ 2>/dev/null
tar -cf "$OUT/logs.tar" -C $W --exclude k2tiny.tar --exclude '*.png' .
ls -la "$OUT"
