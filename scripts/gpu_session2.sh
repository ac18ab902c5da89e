#!/usr/bin/env bash
# Second device call: MoE grouped-GEMM / INT4 bench, K2.6-width phase table + throughput vs
# context (new tree builder, Mosaic grouped GEMM), trained-pair speed per mode on the GPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
W=$OUT
timeout 60 python3 scripts/bench_moe.py 2>&1 | grep -v "^[IW]1" | tee $W/moe.txt
timeout 170 python3 scripts/bench_context_decode.py --config configs/bench_k26.py \
  --ctx 4096,16384,46000,131072 --mode ar,chain,ddtree --gen 8 --profile_ctx 46000 \
  --json_out $W/ctx.jsonl --plot_out $W/ctx.png 2>&1 | grep -v "^[IW]1" | tee $W/bench.txt
grep -q "ms/step" $W/bench.txt || KDTREE_GROUPED_MATMUL=xla timeout 110 python3 \
  scripts/bench_context_decode.py --config configs/bench_k26.py --ctx 4096,46000,131072 \
  --mode ar,chain,ddtree --gen 8 --profile_ctx 46000 --json_out $W/ctx_xla.jsonl 2>&1 \
  | grep -v "^[IW]1" | tee $W/bench_xla.txt
timeout 70 python3 scripts/eval_acceptance.py --config configs/k2tiny.py --config.dtype=bfloat16 \
  --prompts 4 --gen 128 --budgets 16,32,128 --json_out $W/accept_gpu.jsonl 2>&1 \
  | grep -v "^[IW]1" | tee $W/accept.txt
