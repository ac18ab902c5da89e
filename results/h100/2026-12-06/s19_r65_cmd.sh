export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
G65=once+ismem+s3+w16+cat+kp; D65=once+ismem+s2+w16+cat+kp+a2
run() { timeout $1 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases $2 --mlp_variants "$3" --out $OUT/raw/r_$4.jsonl > $OUT/raw/r_$4.log 2>&1; }
run 150 65:4 "$G65+r8|$D65+r8,$G65+r16|$D65+r16,$G65+r32|$D65+r32" t65e4
run 150 65:36 "$G65+r8|$D65+r8,$G65+r16|$D65+r16" t65e36
grep -h "^mlp_t" $OUT/raw/r_*.log | cut -c1-200
