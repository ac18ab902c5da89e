# s21 call 2: align_expert_rows with its tight item bound in one MoE layer (T=65, 9), then the
# 32-layer DDTree budget-64 loop (verify T=65) with and without it, one process each
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pallas_kernels.grouped_matmul.bench --parts layer --tokens 65,9 --layer_variants auto+align_expert_rows_from=none,auto,auto+align_expert_rows_from=1 --out $OUT/raw/s21_align2_layer.jsonl > $OUT/raw/s21_align2_layer.log 2>&1; echo "layer rc=$?"
grep -h "^layer" $OUT/raw/s21_align2_layer.log | cut -c1-200
timeout 260 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/k26_align --config configs/bench_k26_loops.py \
  --config.bench.budget=64 --ab_loop_modes=ddtree --ab_loop_bench=target.align_expert_rows_from=none \
  --time_budget_s 240 --config.target.layers=32 > $OUT/raw/s21_k26_align.log 2>&1; echo "loop rc=$?"
grep -v "allocation summary\|TF_GPU_ALLOCATOR" $OUT/raw/s21_k26_align.log | grep "ms/step\|compile\|ok" | cut -c1-160 | tail -14
