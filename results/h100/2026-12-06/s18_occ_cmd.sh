export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 MOSAIC_GPU_DUMP_PTXAS=1
source scripts/gpu_env.sh; mkdir -p $OUT/raw
D16=once+ismem+cat+kp+s2+w4+a2
G=once+ismem+p2c4+s2+cat+kp+il
V16="$G+a2|$D16,$G|$D16,once+ismem+p4c4+s2+cat+kp+il|$D16,once+ismem+p4c4+s2+cat+kp+il+a2|$D16,once+ismem+p4c3+s2+cat+kp+il|$D16,$G+a2|once+ismem+cat+kp+s2+p2c4+a2,$G+a2|once+ismem+cat+kp+s2+w6"
D9=once+ismem+cat+s2+r8+w4+a2+kp
V9="once+ismem+x4c4+s2+r8+cat+kp|$D9,once+ismem+p2c4+s2+cat+kp+il+a2+r8|$D9,once+ismem+p4c4+s2+cat+kp+il+r8|$D9,once+ismem+p2c4+s2+cat+kp+il+r8|$D9"
timeout 250 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases 16:4 --mlp_variants "$V16" --out $OUT/raw/occ16.jsonl > $OUT/raw/occ16.log 2>&1
timeout 170 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases 9:8 --mlp_variants "$V9" --out $OUT/raw/occ9.jsonl > $OUT/raw/occ9.log 2>&1
grep -h "Used [0-9]* registers\|^mlp_t" $OUT/raw/occ*.log | cut -c1-230 | tail -50
