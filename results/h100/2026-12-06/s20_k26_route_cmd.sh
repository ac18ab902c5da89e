# s20: the 32-layer DDTree budget-64 loop (verify T=65) with the routing kernel (default, cap 128) vs XLA's routing, one process
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache
source scripts/gpu_env.sh; mkdir -p $OUT/raw
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/k26_route --config configs/bench_k26_loops.py \
  --config.bench.budget=64 --ab_loop_modes=ddtree --ab_loop_bench=target.router_impl=xla \
  --time_budget_s 280 --config.target.layers=32 > $OUT/raw/k26_route.log 2>&1
grep -v "allocation summary\|TF_GPU_ALLOCATOR" $OUT/raw/k26_route.log | tail -25
