# s22 last call (H100 ok, ~450 s): one MoE layer (T 65 / 16) with router_split_k=16 and the
# aligned rows off, then the 32-layer ar and DDTree 15 loops with router_split_k=16 + qkv_split_k=8
# vs default (ar's A/B is qkv_split_k's alone), one process each; ordered so a cut loses the least
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 130 python3 -m pallas_kernels.grouped_matmul.bench --parts layer --tokens 65,16 --layer_variants auto,auto+router_split_k=16,auto+router_split_k=16+router_warps=4,auto+align_expert_rows_from=none --out $OUT/raw/s22_layer.jsonl > $OUT/raw/s22_layer.log 2>&1; echo "layer rc=$?"
grep -h "^part=layer\|^copy" $OUT/raw/s22_layer.log | sed 's/part=layer fmt=int4 impl=moe //' | cut -c1-230
timeout 320 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/k26_rsk --config configs/bench_k26_loops.py \
  --ab_loop_modes=ar,ddtree --ab_loop_bench=target.router_split_k=16,target.qkv_split_k=8 \
  --time_budget_s 300 --config.target.layers=32 > $OUT/raw/s22_k26_rsk.log 2>&1; echo "loop rc=$?"
grep -v "allocation summary\|TF_GPU_ALLOCATOR" $OUT/raw/s22_k26_rsk.log | grep "ms/step\|compile\|ok" | cut -c1-160 | tail -14
