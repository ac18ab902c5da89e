export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh
mkdir -p $OUT/raw && cp "$0" $OUT/raw/_cmd.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 300 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/row17 --config configs/bench_k26_loops.py --ab_loop_modes=ddtree --ab_loop_bench=target.align_expert_rows_from=33 --config.bench.budget=64 --time_budget_s 280 --config.target.layers=32 > $OUT/raw/row17.log 2>&1
echo "row17 rc=$?"
grep -A30 "==== summary" $OUT/raw/row17.log | grep -v "while\|command-buffer comp"
