export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 MOSAIC_GPU_DUMP_PTXAS=1
source scripts/gpu_env.sh; mkdir -p $OUT/raw
G=once+ismem+p2c4+s2+cat+kp+il+a2; D=once+ismem+cat+kp+s2+w4+a2
V16="$G|$D,once+ismem+k512+p2c4+s2+cat+kp+il+a2|$D,once+ismem+k512+p2c4+s2+cat+kp+il+a2+dq2|$D,$G|once+ismem+cat+kp+k512+s2+w4+a2,$G|once+ismem+cat+kp+n128+s2+w4+a2,$G+dq2|$D+dq2"
G1=once+ismem+cat+kp+il+a2+k128+p8; D1=once+ismem+cat+kp+a2+p4
V1="$G1|$D1,once+ismem+cat+kp+il+a2+p7|$D1,once+ismem+cat+kp+il+a2+p14|$D1,once+ismem+cat+kp+il+a2+k512+p7|$D1,$G1|once+ismem+cat+kp+a2+k512+p4"
timeout 230 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases 16:4 --mlp_variants "$V16" --out $OUT/raw/p16.jsonl > $OUT/raw/p16.log 2>&1
timeout 170 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases 1:1 --mlp_variants "$V1" --out $OUT/raw/p1.jsonl > $OUT/raw/p1.log 2>&1
grep -h "Used [0-9]* registers\|^mlp_t\|Error\|error" $OUT/raw/p*.log | cut -c1-230 | tail -50
