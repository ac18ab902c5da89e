# s21 call 1: the 8-aligned expert rows (TargetConfig.align_expert_rows) in one MoE layer, then
# queue row 10 + ':a8' cases on the layer's own T=65 routing; one process each
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pallas_kernels.grouped_matmul.bench --parts layer --tokens 65,16,9 --layer_variants auto,auto+align_expert_rows=true --out $OUT/raw/s21_align_layer.jsonl > $OUT/raw/s21_align_layer.log 2>&1; echo "layer rc=$?"
G65=once+ismem+s3+w16+cat+kp; D65=once+ismem+s2+w16+cat+kp+a2
V65="$G65+r8|$D65+r8,$G65+r16+nr8|$D65+r16+nr8,$G65+r16|$D65+r16"
timeout 250 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases 65:layer,65:layer:a8,65:36 --mlp_variants "$V65" --out $OUT/raw/s21_t65.jsonl > $OUT/raw/s21_t65.log 2>&1; echo "t65 rc=$?"
grep -h "^layer\|^mlp_t\|^  fastest" $OUT/raw/s21_*.log | cut -c1-200 | tail -40
