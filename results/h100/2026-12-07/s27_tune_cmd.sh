export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw; cp "$0" $OUT/raw/_cmd.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
G16=once+ismem+p2c4+s2+cat+kp+il+a2; D16=once+ismem+cat+kp+n128+s2+w4+a2
G8=$G16+r8; D8=once+ismem+cat+kp+n128+s2+r8+w4+a2
G65=once+ismem+r8+s3+w16+cat+kp; D65=once+ismem+r8+s2+w16+cat+kp+a2
run() { timeout $1 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases $2 --mlp_variants "$3" --out $OUT/raw/t_$4.jsonl > $OUT/raw/t_$4.log 2>&1; echo "$4 rc=$?"; }
run 220 16:14 "$G16|$D16,$G8|$D8,$G65|$D65,$G16+nr8|$D16+nr8,$G16|$D16,$G8|$D8,$G65|$D65" t16e14
run 150 32:24 "$G16|$D16,$G8|$D8,$G65|$D65,$G16|$D16" t32e24
run 120 16:layer "$G16|$D16,$G8|$D8,$G65|$D65,$G16|$D16,$G8|$D8" t16lay
for f in $OUT/raw/t_*.jsonl; do python3 -c "
import json,sys
for l in open(sys.argv[1]):
  r=json.loads(l)
  if r.get('part')!='mlp_tune': continue
  print(r.get('case'), r.get('local_pairs'), r.get('experts_touched'), r['tuning'][:60], r.get('us'), r.get('gmm_int4_gated_us'), r.get('gmm_int4_us'), r.get('pct_copy'), r.get('bound_us'), r.get('ok'), r.get('error','')[:80])
" $f; done
