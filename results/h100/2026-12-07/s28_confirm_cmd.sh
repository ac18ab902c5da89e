# Twenty-eighth session, second call (same warm H100): the unsplit gate|up (GU, SiLU in the
# kernel) against the promoted T=2..32 form across the class's T, each row twice.
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw; cp "$0" $OUT/raw/_cmd.sh
G8=once+ismem+p2c4+s2+cat+kpi+il+a2+r8; D8=once+ismem+cat+kpi+n128+s2+r8+w4+a2  # promoted
GU=once+ismem+s2+cat+kpi+il+a2+r8
V="$G8|$D8,$GU+w4|$D8,$GU+w2|$D8,$G8|$D8,$GU+w4|$D8,$GU+w2|$D8"
run() { timeout $1 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases $2 --mlp_variants "$3" --out $OUT/raw/c_$4.jsonl > $OUT/raw/c_$4.log 2>&1; echo "$4 rc=$?"; }
run 80 16:layer "$V" t16lay
run 80 9:8 "$V" t9e8
run 80 4:4 "$V" t4e4
run 80 12:11 "$V" t12e11
run 80 20:16 "$V" t20e16
for f in $OUT/raw/c_*.jsonl; do python3 -c "
import json,sys
for l in open(sys.argv[1]):
  r=json.loads(l)
  if r.get('part')!='mlp_tune': continue
  print(r.get('case'), r['tuning'][-50:], r.get('us'), r.get('gmm_int4_gated_us'), r.get('gmm_int4_us'), round(r.get('pct_copy',0),1), r.get('ok'), r.get('error','')[:80])
" $f; done
