# Twenty-ninth session: the T=1 class's down call unsplit (no p4: the combine then reads 1 split
# of partials, not 4) vs the promoted p4 form, in the 32-layer ar graph loop at 46k, paired
# rounds in one process (TargetConfig.expert_variants, the in-step A/B of an expert-call form).
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh
mkdir -p $OUT/raw && cp "$0" $OUT/raw/_cmd.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 280 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/t1down --config results/h100/2026-12-07/s27_ar_ab.py --ab_loop_bench='target.expert_variants=8=once+ismem+cat+il+a2+k128+p8|once+ismem+cat+a2' --time_budget_s 260 --config.target.layers=32 > $OUT/raw/t1down.log 2>&1
echo "t1down rc=$?"
grep -A30 "==== summary" $OUT/raw/t1down.log | grep -v "while\|command-buffer comp"
