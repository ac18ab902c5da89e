# Twenty-ninth session: on an H200, queue row 1 (61-layer k26_core with today's defaults); on an
# H100, the T=1 down A/B (s29_t1down_cmd.sh).
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash scripts/gpu_measure.sh $OUT k26_core:450
else
  bash results/h100/2026-12-08/s29_t1down_cmd.sh
fi
