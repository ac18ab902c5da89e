export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
G16=once+ismem+p2c4+s2+cat+kp+il+a2; D16=once+ismem+cat+kp+n128+s2+w4+a2
G8=$G16+r8; D8=once+ismem+cat+kp+n128+s2+r8+w4+a2
run() { timeout $1 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases $2 --mlp_variants "$3" --out $OUT/raw/r8_$4.jsonl > $OUT/raw/r8_$4.log 2>&1; }
run 100 9:1 "$G16|$D16,$G8|$D8,$G16|$D16,$G8|$D8" t9e1
run 100 9:8 "$G16|$D16,$G8|$D8,$G16|$D16,$G8|$D8" t9e8
run 100 16:2 "$G16|$D16,$G8|$D8" t16e2
grep -h "^mlp_t" $OUT/raw/r8_*.log | cut -c1-200
