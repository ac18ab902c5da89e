# s20: the routing kernel at T=65 (route_kernel.MAX_TOKENS 64 -> 128) against XLA's routing, one process
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider -m 'not slow' tests/target/test_route_kernel.py 2>&1 | tail -3
timeout 200 python3 -m pallas_kernels.grouped_matmul.bench --parts layer --tokens 65 \
  --layer_variants auto,auto+router_impl=xla --out $OUT/raw/route65.jsonl > $OUT/raw/route65.log 2>&1
grep -v "^ptxas" $OUT/raw/route65.log | tail -50
