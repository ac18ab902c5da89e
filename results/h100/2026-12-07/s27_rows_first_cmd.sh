export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh
mkdir -p $OUT/raw && cp "$0" $OUT/raw/_cmd.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 260 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/rf --config results/h100/2026-12-07/s27_ar_ab.py --ab_loop_bench=target.one_token_rows_first=true --time_budget_s 240 --config.target.layers=32 > $OUT/raw/rf.log 2>&1
echo "rf rc=$?"
grep -A30 "==== summary" $OUT/raw/rf.log | grep -v "while\|command-buffer comp"
