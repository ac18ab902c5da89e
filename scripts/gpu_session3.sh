#!/usr/bin/env bash
# The device call that the second 2026-11-30 session could not make (its device time was spent):
# everything written since the last GPU run, in priority order, each part time-boxed so that the
# whole call stays under 10 minutes and partial results still come back.
#   1. kernel tests on the GPU: tree-verify full-shape set (19 of 25 grid cases never ran) + INT4
#   2. the GPU compiler's copies of cache buffers in the decode loop (audit_cache_copies.py)
#   3. the fused INT4 grouped matmul vs dequant + Mosaic (bench_moe.py)
#   4. per-kernel times of the verify call after the merge rewrite (profile_verify_kernel.py)
#   5. throughput vs context 1k-128k on the K2.6-width bench config, one process per mode
#   6. the phase table at 46k (per-layer caches: the commit phase should drop)
#   7. host gap with the while loop in CUDA-graph command buffers (XLA_FLAGS), ar and ddtree
# Usage (device): OUT=$OUT bash scripts/gpu_session3.sh ; results in $OUT/*.txt, *.jsonl.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
W=${OUT:-/tmp/gpu_session3}; mkdir -p "$W"
quiet() { grep -v "^[IW]1"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$W/gpu.txt"
timeout 120 bash scripts/gpu_tests.sh 2>&1 | tail -n 30 | tee "$W/gpu_tests.txt"
timeout 30 python3 scripts/audit_cache_copies.py --modes ar,ddtree 2>&1 | quiet | head -n 20 \
  | tee "$W/audit.txt"
timeout 60 python3 scripts/bench_moe.py 2>&1 | quiet | tee "$W/moe.txt"
timeout 30 python3 scripts/profile_verify_kernel.py 2>&1 | quiet | tee "$W/kernel.txt"
for m in ar chain ddtree; do
  timeout 70 python3 scripts/bench_context_decode.py --config configs/bench_k26.py \
    --ctx 1024,4096,16384,46000,131072 --mode $m --gen 8 --json_out "$W/ctx_$m.jsonl" 2>&1 \
    | quiet | tee "$W/ctx_$m.txt"
done
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
XLA_FLAGS="$CB" timeout 60 python3 scripts/bench_context_decode.py --config configs/bench_k26.py \
  --ctx 4096 --mode ar,ddtree --gen 8 --json_out "$W/ctx_cmdbuf.jsonl" 2>&1 | quiet \
  | tee "$W/ctx_cmdbuf.txt"
timeout 50 python3 scripts/bench_context_decode.py --config configs/bench_k26.py --ctx 46000 \
  --mode ddtree --gen 8 --profile_ctx 46000 --json_out "$W/phases.jsonl" 2>&1 | quiet \
  | tee "$W/phases.txt"
ls -la "$W"
