# s20: one MoE layer in the decode layout (pack_layer) vs the loaded one, T = 65, 16, 9, 1, one process
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pallas_kernels.grouped_matmul.bench --parts layer --tokens 65,16,9,1 \
  --layer_variants auto --layer_layouts decode,loaded --out $OUT/raw/layout.jsonl > $OUT/raw/layout.log 2>&1
grep -v "^ptxas" $OUT/raw/layout.log | grep -v "^ *[0-9.]* us  x" | tail -30
