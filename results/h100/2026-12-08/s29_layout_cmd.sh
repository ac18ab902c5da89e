# Twenty-ninth session: TargetConfig.pair_layout_impl=pallas (the pair layout + work list as one
# Pallas Triton launch instead of three XLA reductions) -- its tests on the GPU (the real Triton
# kernel), then the paired A/B of the 32-layer DDTree 15 graph loop at 46k, one process.
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh
mkdir -p $OUT/raw && cp "$0" $OUT/raw/_cmd.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/target/test_pair_layout_kernel.py -m "not slow" > $OUT/raw/tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/raw/tests.log
timeout 330 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/ab --config results/h100/2026-12-08/s29_ddtree_ab.py --ab_loop_bench=target.pair_layout_impl=pallas --time_budget_s 310 --config.target.layers=32 > $OUT/raw/ab.log 2>&1
echo "ab rc=$?"
grep -A30 "==== summary" $OUT/raw/ab.log | grep -v "while\|command-buffer comp"
