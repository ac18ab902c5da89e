export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
G9=once+ismem+p2c4+s2+cat+kp+il+a2+r8; D9=once+ismem+cat+s2+r8+w4+a2+kp; N9=once+ismem+cat+kp+n128+s2+r8+w4+a2
G1=once+ismem+cat+kp+il+a2+k128+p8; D1=once+ismem+cat+kp+a2+p4; N1=once+ismem+cat+kp+n128+a2+p4
G65=once+ismem+r8+s3+w16+cat+kp; D65=once+ismem+r8+s2+w16+cat+kp+a2; N65=once+ismem+n128+r8+s2+w16+cat+kp+a2
run() { timeout $1 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases $2 --mlp_variants "$3" --out $OUT/raw/p3_$4.jsonl > $OUT/raw/p3_$4.log 2>&1; }
run 120 9:8 "$G9|$D9,$G9|$N9,$G9|$D9,$G9|$N9" t9
run 120 1:1 "$G1|$D1,$G1|$N1,$G1|$D1,$G1|$N1" t1
run 150 65:36 "$G65|$D65,$G65|$N65,$G65|$D65,$G65|$N65" t65
grep -h "^mlp_t" $OUT/raw/p3_*.log | cut -c1-200
