# s23 last call (H100, ~150 s): queue row 11's layer half at T=9 (aligned rows from T=1 / default /
# off; router_warps=4), then the default GPU test set
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw; cp .probe6.sh $OUT/raw/_cmd.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 75 python3 -m pallas_kernels.grouped_matmul.bench --parts layer --tokens 9 --layer_variants auto,auto+align_expert_rows_from=1,auto+align_expert_rows_from=none,auto+router_warps=4 --out $OUT/raw/s23_align_layer.jsonl > $OUT/raw/s23_align_layer.log 2>&1; echo "layer rc=$?"
grep -h "^part=layer" $OUT/raw/s23_align_layer.log | sed 's/part=layer fmt=int4 impl=moe //' | cut -c1-200
bash scripts/gpu_measure.sh $OUT/gt gpu_tests:80 > $OUT/raw/s23_gpu_tests.log 2>&1; echo "gpu_tests rc=$?"; grep -h "passed\|failed" $OUT/raw/s23_gpu_tests.log | tail -2
