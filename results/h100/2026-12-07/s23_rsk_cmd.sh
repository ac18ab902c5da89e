# s22 call 1 (H100 ok): one MoE layer (T 65 / 16 / 9) with the router's split-K sum + shared SwiGLU
# in the routing kernel (router_split_k=16 / 8) and the aligned rows off / from T=1 (queue row 11's
# layer half), then the 32-layer ar and DDTree 15 loops with router_split_k=16 + qkv_split_k=8 vs
# default (ar's A/B is qkv_split_k's alone: one token keeps the router's path), one process each
export JAX_COMPILATION_CACHE_DIR=$PWD/.xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
source scripts/gpu_env.sh; mkdir -p $OUT/raw
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 -m pytest -q -x tests/target/test_route_shared.py tests/target/test_qkv_kernel.py -k "summed_partials or bf16_layer or numpy" > $OUT/raw/s22_route_shared_tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/raw/s22_route_shared_tests.log
timeout 170 python3 -m pallas_kernels.grouped_matmul.bench --parts layer --tokens 65,16,9 --layer_variants auto,auto+router_split_k=16,auto+router_split_k=16+router_warps=4,auto+router_split_k=8,auto+align_expert_rows_from=none,auto+align_expert_rows_from=1 --out $OUT/raw/s22_layer.jsonl > $OUT/raw/s22_layer.log 2>&1; echo "layer rc=$?"
grep -h "^part=layer" $OUT/raw/s22_layer.log | sed 's/part=layer fmt=int4 impl=moe //' | cut -c1-210
timeout 320 python3 scripts/bench_k26_full.py --out_dir $OUT/raw/k26_rsk --config configs/bench_k26_loops.py \
  --ab_loop_modes=ar,ddtree --ab_loop_bench=target.router_split_k=16,target.qkv_split_k=8 \
  --time_budget_s 300 --config.target.layers=32 > $OUT/raw/s22_k26_rsk.log 2>&1; echo "loop rc=$?"
grep -v "allocation summary\|TF_GPU_ALLOCATOR" $OUT/raw/s22_k26_rsk.log | grep "ms/step\|compile\|ok" | cut -c1-160 | tail -14
cp .probe1.sh $OUT/raw/_cmd.sh
