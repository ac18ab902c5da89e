# Queue row 19 (any GPU, one call, ~4 min): the INT4 expert call's forms at T=16 / 24 / 32 on
# independent routing (16:14, 24:18, 32:24), every row with kpi (the pair-interleaved stacks the
# model's decode pack stores: TargetConfig.int4_k_interleaved; s27's rows ran kp). Written in the
# twenty-eighth session (no GPU lent). Registers per thread, deviceless ptxas
# (`scripts/gmm_ptxas_rows.py --cases 16 --variants ...`): gate|up G8 175 (2 CTAs an SM),
# GU 170 (2), G65 72; down D8 190 (2 CTAs an SM), D8na 116 (4), D65 101 (4).
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw; cp "$0" $OUT/raw/_cmd.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
G8=once+ismem+p2c4+s2+cat+kpi+il+a2+r8; D8=once+ismem+cat+kpi+n128+s2+r8+w4+a2  # promoted
GU=once+ismem+s2+cat+kpi+il+a2+r8  # gate|up unsplit: SiLU in the kernel, no partials
D8w8=once+ismem+cat+kpi+n128+s2+r8+w8+a2; D8na=once+ismem+cat+kpi+n128+s2+r8+w4
G65=once+ismem+r8+s3+w16+cat+kpi; D65=once+ismem+r8+s2+w16+cat+kpi+a2  # the T=65 class's
V="$G8|$D8,$G8|$D65,$G8|$D8w8,$G8|$D8na,$GU+w2|$D8,$GU+w4|$D8,$G65|$D65,$G8|$D8,$G8|$D65"
run() { timeout $1 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune --mlp_cases $2 --mlp_variants "$3" --out $OUT/raw/t_$4.jsonl > $OUT/raw/t_$4.log 2>&1; echo "$4 rc=$?"; }
run 170 16:14 "$V" t16e14
run 150 32:24 "$V" t32e24
run 150 24:18 "$V" t24e18
for f in $OUT/raw/t_*.jsonl; do python3 -c "
import json,sys
for l in open(sys.argv[1]):
  r=json.loads(l)
  if r.get('part')!='mlp_tune': continue
  print(r.get('case'), r['tuning'][-50:], r.get('us'), r.get('gmm_int4_gated_us'), r.get('gmm_int4_us'), round(r.get('pct_copy',0),1), r.get('ok'), r.get('error','')[:80])
" $f; done
