export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh
mkdir -p $OUT/raw && cp "$0" $OUT/raw/_cmd.sh && cp results/h100/2026-12-07/s25_routing_probe.py $OUT/raw/
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 400 python3 results/h100/2026-12-07/s25_routing_probe.py 16 15 46000 2>&1 | grep -v "allocation summary\|TF_GPU_ALLOCATOR\|Warning\|warn(" | tee $OUT/raw/routing.log
