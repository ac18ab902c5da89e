# s20: Tuning.narrow_rows (nr8) against R 8 / R 16 / R 32 per routing case, one process per case
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 MOSAIC_GPU_DUMP_PTXAS=1
source scripts/gpu_env.sh; mkdir -p $OUT/raw
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_grouped_matmul_kernel.py -k narrow 2>&1 | tail -3
G16=once+ismem+p2c4+s2+cat+kp+il+a2; D16=once+ismem+cat+kp+n128+s2+w4+a2
G65=once+ismem+s3+w16+cat+kp; D65=once+ismem+s2+w16+cat+kp+a2
T9="$G16+r8|$D16+r8,$G16+nr8|$D16+nr8,$G16|$D16"
T65="$G65+r8|$D65+r8,$G65+r16+nr8|$D65+r16+nr8,$G65+r32+nr8|$D65+r32+nr8,$G65+r32|$D65+r32"
run() { timeout $1 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases $2 --mlp_variants "$3" --out $OUT/raw/nr_$4.jsonl > $OUT/raw/nr_$4.log 2>&1; }
run 120 9:8 "$T9" t9e8
run 150 65:36 "$T65" t65e36
run 100 9:1 "$T9" t9e1
run 150 65:4 "$T65" t65e4
grep -h "Used [0-9]* registers\|spill" $OUT/raw/nr_t9e8.log | sort | uniq -c | head
grep -h "^mlp_t" $OUT/raw/nr_*.log | cut -c1-220
