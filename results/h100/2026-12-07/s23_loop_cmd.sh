# s23 call 2 (H100): queue row 12's loop half after the --ab_loop_bench whitelist fix: 32-layer ar and
# DDTree 15 loops, router_split_k=16 + qkv_split_k=8 vs default (ar: qkv_split_k alone)
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw; cp .probe2.sh $OUT/raw/_cmd.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 420 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/k26_rsk --config configs/bench_k26_loops.py \
  --ab_loop_modes=ar,ddtree --ab_loop_bench=target.router_split_k=16,target.qkv_split_k=8 \
  --time_budget_s 400 --config.target.layers=32 > $OUT/raw/s23_k26_rsk.log 2>&1; echo "loop rc=$?"
grep -v "allocation summary\|TF_GPU_ALLOCATOR" $OUT/raw/s23_k26_rsk.log | grep "ms/step\|compile\|ok\|Error" | cut -c1-160 | tail -16
