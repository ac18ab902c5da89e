#!/usr/bin/env bash
# The one GPU measurement entry point: runs the named parts, each under its own time box, on one
# device call; every part logs to $OUT/raw/<part>.log and writes its JSON lines beside it (a script
# taking --out_dir: into $OUT/raw/<part>/, so two parts of one script cannot overwrite); at the
# end raw/ is packed into $OUT/results.tgz (a device call returns at most 8 files; if the call is
# cut off before that, raw/ comes back as it is).
#   bash scripts/gpu_measure.sh OUT_DIR PART[:SECONDS] ...
# Parts (single-GPU parts see GPU 0 only):
#   moe_tests   grouped-matmul kernel GPU tests (bf16 + INT4, every code path once, the promoted
#               INT4 tunings at K2.6's T=1/16/65 shapes; ~14 Mosaic compiles: 186 s on a bare H100
#               (s12; 150 s timed out): moe_tests:240; the
#               old shape x path grid needs --gpu-full-grid, not run here)
#   moe_bench   pallas_kernels/grouped_matmul/bench.py: routed FFN per T, tuning sweep, whole MoE layer
#   moe_tune    pallas_kernels/grouped_matmul/bench.py --parts mlp_tune: the INT4 expert FFN's gated
#               and down calls at T=16 (14 experts), 1 (1), 9 (8), 65 (36): per case the rows of
#               bench.MLP_VARIANTS (the promoted tuning + kp first, the control; then the
#               case's open variants: kpi, pdl, ..., at T=9 the T=65 class's form at R 8,
#               at T=16 the R 16 form it had before s27); ptxas' register log of every
#               kernel (MOSAIC_GPU_DUMP_PTXAS, Mosaic's own dump switch, set for this part's
#               process; each row's first call is printed before its logs); per-call
#               Mosaic us, wrong rows marked FAIL; 18 programs: moe_tune:300 (one case
#               alone: the bench's --mlp_cases 9:8)
#   moe_layer   pallas_kernels/grouped_matmul/bench.py --parts layer at T = 65, 16, 9, 1: one
#               MoE layer of bench_k26_full per kernel with today's defaults (`auto`: the dense
#               glue at T=1, the lean glue and the routing kernel above) in the decode layout
#               (target.pack.pack_layer, as decode runs it; the rows before the twentieth session
#               were the loaded layout's) vs its weight-streaming floor (issue 12's whole-layer
#               row; 4 programs);
#               each variant's optimized HLO in raw/moe_layer_hlo/; first the routing kernel's
#               fast tests compiled for the GPU (<= 90 s): moe_layer:240
#   dense_dots  pallas_kernels/grouped_matmul/dense_bench.py: the few-row dense dots (q_a | kv_a,
#               o, router | shared gate | up, q_b, shared down) at M = 16, 1: XLA's pack.dot_t vs
#               our Mosaic grouped kernel as a dense dot (G = 1 expert of all M rows, [1, K, N]
#               bf16; default tuning, p1, r16, once, n64, p2, p4, pad8: x padded to 8 rows at
#               M=1, r16+once, n64+p1, k64), each called in turn on >= 120 MB of distinct weights:
#               us / gmm kernel us / % of copy / x XLA, wrong rows FAIL, best per shape last; 96
#               programs, XLA's and the default's rows first, no row started after secs - 20 (a
#               cut box loses the last variants only): dense_dots:150
#   gpu_tests   the whole default GPU test set (`pytest -m gpu tests`: every compiled-kernel path
#               once, 24 tests, tests/GPU_TESTS.md; the brief's "< 2 minutes" check), slowest 25
#               listed, 4 pytest-xdist workers when the wheels are carried (pip download -d .whl
#               pytest-xdist execnet): gpu_tests:240
#   verify      tree-verify kernel: GPU tests (-m gpu: the sharded file first, then 13 cases,
#               one kernel compile each, the f32 reference on the CPU: < 2 min), short bench
#               (default L=46000 grid); verify:240
#   verify_probes  tree-verify bench at L=46000, B=1, H=8 (N=1,8,16,64) then H=64 (N=64 first)
#               with the PROBES variants (swap_ab off at N*H = 8 where it is the default, on
#               at 1x8x8 and 1x1x64; 66 splits; packed mask, also the default's at 1x1x8; ~14
#               variants, one compile each):
#               verify_probes:200; ends with the best variant per shape and its % of copy
#   verify_full tree-verify kernel: every test + the full GPU grid, per-kernel profile, the issue's
#               whole bench table (with probes and XLA) until half the time box is spent
#   k26_full    scripts/bench_k26_full.py: 61-layer compile times, phase tables, throughput
#   k26_core    the same with the phase tables of ar and ddtree 15, loops at 46k only (a bare
#               machine: ~130 s of compile, ~80-110 s per table: k26_core:450)
#   k26_conc    k26_loops' graph loops (CONCURRENT scheduling: runtime.RuntimeConfig's default
#               since 2026-12-05, measured ar 5.186 -> 4.944 ms/step) beside the same with XLA's
#               default LHS chain, every kernel after the previous (`_opts` rows;
#               xla_gpu_command_buffer_scheduling_mode=LHS; notes/runtime.md) (k26_conc:300)
#   k26_tput    k26_full without phase tables: compile + throughput vs context (4k..128k) of ar,
#               chain, ddtree 15 (ar + ddtree took 383 s of a bare machine, chain cut: k26_tput:580)
#   k26_chain   k26_tput for chain only (configs/bench_k26_chain.py; the rows s9's k26_tput
#               lacked: k26_chain:300)
#   k26_loops   the ar and ddtree 15 loops at 46k only, each without and with command buffers
#               (configs/bench_k26_loops.py; no phase tables): the host-gap A/B (k26_loops:300)
#   k26_ddtree  k26_core without ar's phase table (k26_ddtree:360)
#   k26_cmdbuf  k26_core plus the ddtree loop compiled again with the other command-buffer
#               setting (one more loop compile; with today's default that is the host-driven
#               `ddtree_nograph` row) beside the default's ms/step (k26_cmdbuf:520)
#   k26_pdl     k26_loops' ar and ddtree 15 loops at 46k, the A/B loops with graphs as the run but
#               xla_gpu_enable_pdl=false (`_opts` rows): does PDL make the graph loop faster than
#               its no-graph kernels (notes/runtime.md "Loop vs kernels"; k26_pdl:300)
#   xla_options scripts/probe_xla_options.py: bench_k26_full's fused step (ar, ddtree 15), target
#               packed, compiled per XLA option set in XLA_VARIANTS below (the first is the
#               baseline), CUPTI kernel ms and launches each (4 sets: ~300 s on a bare machine)
#   target_layout  the same fused step (ar, ddtree 15), default options, target packed beside
#               TargetConfig A/Bs on it (probe_xla_options --layouts packed+field=value; one copy
#               of the experts; edit TARGET_LAYOUTS below for the A/B at hand (none open now:
#               packed alone; 3 layouts fit ~330 s):
#               CUPTI kernel ms and launches of each, side by side (2 layouts: ~200 s on a bare
#               machine; 5 layouts did not fit 330 s)
#   draft_share the same for k26_dflash_share only (bench_k26_full's draft, issue 17's must-show)
#   target_pdl  target_layout's step with TargetConfig.mosaic_pdl (the Mosaic kernels with
#               programmatic dependent launch, pallas_kernels/pdl.py) beside packed: wall_ms and
#               CUPTI kernel ms per step (CUPTI sums overlap under PDL: compare wall_ms;
#               notes/runtime.md "PDL: who waits")
#   draft_waves bench_draft.py on k26_dflash_share only: draft_block with the ctx kernel at 1, 2 and
#               3 programs per SM (memory parallelism of a latency-bound read), no tests (~70 s)
#   draft_io    the draft's packed-I/O GPU tests (ctx kernel reading the q|k|v dot's output, Triton
#               merge), then bench_draft.py on k26_dflash_share: draft_block with the older kernel
#               I/O (+splitio+xlaqk), packed I/O with XLA's q/k norm + rope (+xlaqk) and today's
#               default (the norm + rope in the kernel) (draft_ctx packed only; every kernel
#               listed with its HLO ops);
#               draft_io:130 (~100 s)
#   draft_gap   the packed-I/O GPU tests (every compiled form incl. the A/B options; 35 s), then
#               bench_draft.py on k26_dflash_share, draft_block only: today's default (q/k norm +
#               rope in the kernel) beside issue 17's ctx-kernel A/B options (+qkjoin, +hg2 at
#               131 and 65 programs, +expe (base e: the default until s5), +msplit2; s5's gemv.py
#               dot rows measured no faster and were removed: WORKSPACE.md);
#               each row printed when timed, with its logits' rel L2 vs the default and vs
#               the same draft in f32); draft_gap:130
#   draft_tokqkv  issue 17's layer-0 table (model.pack_token_qkv): its compiled GPU test, then
#               bench_draft.py on k26_dflash_share at 46k, draft_block only: today's default
#               beside +tokqkv (layer 0's q|k|v rows looked up, no layer-0 q|k|v dot; same
#               floor), rel L2 vs the default and vs f32, kernels per call; draft_tokqkv:150
#   k26_tree    the DDTree builder's A/B: its GPU tests (the one Triton program, the default on a GPU
#               since 2026-12-05: bench.tree_impl=auto), then the ddtree 15 loop at 46k twice in
#               one process, the default and bench.tree_impl=xla (`ddtree_spec` rows,
#               --ab_loop_bench; no phase tables: k26_core has the default's). One process,
#               because two calls' loops of the same program differed by 4.6% on an H100 (s17)
#               while the two builders' loops differed by 2% (k26_tree:300)
# Every k26_* part runs K2.6's 61-layer one-GPU share (77.7 GB of weights) on an H200; on a
# smaller GPU the first 32 layers (K26_LAYERS below): numbers of record need needs_h200=true.
#   k26_mpdl    TargetConfig.mosaic_pdl (our Mosaic kernels with PDL) in the ar and ddtree 15 graph
#               loops at 46k, default and mosaic_pdl=true in one process (`_spec` rows,
#               --ab_loop_bench=target.mosaic_pdl=true; target_pdl's one-step wall ms was
#               inconclusive on an H100, s17): k26_mpdl:330
#   k26_nosplitk  XLA's split-K Triton GEMMs off (xla_gpu_experimental_force_split_k=1) in the
#               ar and ddtree 15 graph loops at 46k, default and option in one process (`_opts`
#               rows, --ab_loop_options): the dense dots' split-K sums are ~4 glue kernels a
#               layer (notes/roadmap.md lever 1); without them the dots fill fewer SMs:
#               k26_nosplitk:330 (DONE s19, H100 32 layers: ar +2.0%, DDTree 15 +1.8%: lost)
#   k26_tokqkv  k26_ddtree with bench.draft_token_qkv=true (the ddtree 15 phase table and loop
#               at 46k with the table; compare with k26_ddtree in the same call): k26_tokqkv:360
#   k26_nokpi   k26_core with target.int4_k_interleaved=false (the experts K-packed, without the
#               INT4 kernels' PRMT-free dequantise kpi, the default since 2026-12-05); compare
#               with k26_core on the same warm machine: k26_core:450 then k26_nokpi:450
#   draft_tests the compiled draft_block GPU tests of the packed forms only (~45 s)
#   draft       the draft ctx kernel's GPU tests, then scripts/bench_draft.py: the two draft phases of
#               both drafts (k26_dflash_share first; each draft's rows written when it is done),
#               draft_ctx per K/V projection form (--ctx_kv), draft_block per ctx attention impl /
#               kernel tuning (--ctx_impls); 48 s with 4 impls + 1 ctx form, ~3-4 min now: draft:300
#   calibrate   scripts/calibrate_step_cost.py on configs/bench_k26_full.py
#   pair        the trained pair (k2tiny): the step cost of every candidate program calibrated
#               here (switch widths, fixed widths, chain, ar; <= min(220 s, half the part): a
#               cold cache needed more than 140 on an H100), then measured tok/s of ar / chain /
#               ddtree 1..63 / switch / auto (scripts/bench_pair.py; without a calibration it says so and uses the shipped
#               configs/k2tiny.step_cost.json, not the analytic floor); pair:480 cold
#   tree_builder  scripts/bench_tree_builder.py: DDTree's builder alone per budget (31, 47, 63,
#               15), XLA's sorts vs the Triton kernel at 4 and 8 warps (`bitonic w4 / w8`),
#               CUPTI us, trees checked node for node: decides
#               ddtree_build.AUTO_MAX_PADDED_CANDIDATES and BITONIC_WARPS; the kernel compiles
#               take ~8-70 s each: tree_builder:330
#   sharding    scripts/check_sharding_gpu.py over all visible GPUs (2 on nvidia-h200-x2)
#   multiprocess  two processes of one GPU each (jax.distributed, NCCL) vs one process, 2 GPUs
#   train_pair  train the k2tiny target, then its draft (configs/k2tiny.py, ~7 min with
#               start-up): HF checkpoints in k2tiny/{target,draft} (copy into checkpoints/ to
#               replace the shipped pair), both log.jsonl and losses.png
# A persistent compilation cache ($OUT/../xla_cache, or JAX_COMPILATION_CACHE_DIR) is shared by
# the parts of one call so each program compiles once.
set -uo pipefail
OUT=${1:?usage: gpu_measure.sh OUT_DIR PART[:SECONDS] ...}
shift
RAW="$OUT/raw"
mkdir -p "$RAW"
source "$(dirname "$0")/gpu_env.sh"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/kdtree_xla_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
quiet() { grep -v "^[IW][0-9]\{4\}" ; }
# K2.6's 61-layer one-GPU share is 77.7 GB of weights: it needs an H200 (an H100's XLA pool is
# 59.7 GB; bench_setup stops such a run before allocating). On a GPU under 120 GB every k26_* and
# probe_xla_options part runs the first 32 layers instead (~41 GB + caches), and says so: those
# ms/step are 32-layer numbers for A/Bs within one call, never the step of record.
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
K26_LAYERS=""
if [ -n "$GPU_MIB" ] && [ "$GPU_MIB" -lt 120000 ] 2>/dev/null; then
  K26_LAYERS="--config.target.layers=32"
  echo "== ${GPU_MIB} MiB GPU: k26_* / probe_xla_options parts run 32 of K2.6's 61 layers"
fi
one_gpu() { CUDA_VISIBLE_DEVICES=0 "$@"; }
# target_layout's layouts, the first the baseline: the next TargetConfig A/B goes here as
# packed,packed+FIELD=VALUE. None open. Measured and removed (H100 s13, 32 layers, DDTree 15
# CUPTI kernel ms): o_proj_k_splits=4 (6.772 -> 6.971) and work_list_kernel (6.772 -> 7.133):
# WORKSPACE.md. Before them: fold_norm_weights (H200 s11: ar 5.533 -> 5.456 ms of kernels,
# DDTree 15 10.921 -> 11.045: not promoted); the one-token add + RMSNorm as one launch measured
# no faster and was removed: WORKSPACE.md; the pair-layout launch lost: notes/moe.md
XLA_VARIANTS="default,block_level,heroless,all_triton"  # xla_options' option sets (probe_xla_options VARIANTS)
TARGET_LAYOUTS="packed"
GPU_TEST_WORKERS=4  # gpu_tests' pytest-xdist processes (16 host cores; the tests' GPU memory is small)

run_part() {
  local part=$1 secs=$2
  case $part in
    gpu_tests) # -v: a run cut by its time box still names each test it passed (s15's -q showed dots).
               # The set is compile-bound (Mosaic / Triton / ptxas on the host's CPUs): with
               # pytest-xdist carried in .whl, GPU_TEST_WORKERS processes share the one GPU
               # (memory on demand, not XLA's 75% preallocation each); without it, serial.
               if python3 -c "import xdist" 2>/dev/null; then
                 echo "== gpu_tests: $GPU_TEST_WORKERS pytest-xdist workers on one GPU"
                 one_gpu env XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$secs" python3 -m pytest \
                   -v -rs --durations=25 -n "$GPU_TEST_WORKERS" --dist load -m gpu tests
               else
                 echo "== gpu_tests: pytest-xdist not installed (carry its wheel in .whl): serial"
                 one_gpu timeout "$secs" python3 -m pytest -v -rs --durations=25 -m gpu tests
               fi ;;
    moe_tests) one_gpu timeout "$secs" python3 -m pytest -q -rs --durations=12 -m gpu \
                 tests/kernels/test_grouped_matmul_kernel.py \
                 tests/kernels/test_grouped_matmul_small_t.py ;;
    moe_bench) one_gpu timeout "$secs" python3 -m pallas_kernels.grouped_matmul.bench \
                 --out "$RAW/bench_moe.jsonl" ;;
    moe_tune) MOSAIC_GPU_DUMP_PTXAS=1 one_gpu timeout "$secs" \
                 python3 -m pallas_kernels.grouped_matmul.bench --parts mlp_tune \
                 --out "$RAW/bench_moe_tune.jsonl" ;;
    moe_layer) one_gpu timeout "$secs" bash -c "timeout 90 python3 -m pytest -q -rs -m 'not slow' \
                 tests/target/test_route_kernel.py; \
                 python3 -m pallas_kernels.grouped_matmul.bench --parts layer \
                 --tokens 65,16,9,1 --layer_variants auto \
                 --hlo_dir $RAW/moe_layer_hlo --out $RAW/bench_moe_layer.jsonl" ;;
    dense_dots) one_gpu timeout "$secs" python3 -m pallas_kernels.grouped_matmul.dense_bench \
                 --dots_budget_s $(( secs - 20 )) --dots_out "$RAW/bench_dense_dots.jsonl" ;;
    verify) one_gpu timeout "$secs" bash -c "timeout 170 python3 -m pytest -q -rs --durations=15 -m gpu \
                tests/sharding/test_verify_attention_sharded.py tests/kernels/test_tree_verify_attention.py; \
                python3 -m pallas_kernels.tree_verify.bench --probe_variants=false --skip_xla \
                --budget_s=$(( secs - 180 )) --json_out=$RAW/bench_verify_attention.jsonl" ;;
    verify_probes) one_gpu timeout "$secs" python3 -m pallas_kernels.tree_verify.bench --N=1,8,16,64 \
                --H=8,64 --skip_xla --budget_s=$(( secs - 60 )) --json_out=$RAW/bench_verify_probes.jsonl ;;
    verify_full) one_gpu timeout "$secs" bash -c "python3 -m pytest -q -rs --gpu-full-grid \
                tests/kernels/test_tree_verify_attention.py; python3 -m pallas_kernels.tree_verify.profile_kernels; \
                python3 -m pallas_kernels.tree_verify.bench --full_grid --budget_s=$(( secs / 2 )) \
                --json_out=$RAW/bench_verify_attention.jsonl" ;;
    k26_full) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_core) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_core.py --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_cmdbuf) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_core.py --ab_loop_modes=ddtree \
                --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_pdl) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_loops.py --ab_loop_options=xla_gpu_enable_pdl=false \
                --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_conc) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_loops.py \
                --ab_loop_options=xla_gpu_command_buffer_scheduling_mode=LHS \
                --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_tput) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_tput.py --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_chain) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_chain.py --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_loops) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_loops.py --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_ddtree) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_core.py --config.bench.phase_modes=ddtree \
                --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    xla_options) one_gpu timeout "$secs" python3 scripts/probe_xla_options.py --out_dir "$RAW/$part" \
                --layouts packed --variants "$XLA_VARIANTS" $K26_LAYERS ;;
    target_layout) one_gpu timeout "$secs" python3 scripts/probe_xla_options.py --out_dir "$RAW/$part" \
                --variants default --layouts "$TARGET_LAYOUTS" $K26_LAYERS ;;
    target_pdl) one_gpu timeout "$secs" python3 scripts/probe_xla_options.py --out_dir "$RAW/$part" \
                --variants default --layouts packed,packed+mosaic_pdl=true $K26_LAYERS ;;
    draft_waves) one_gpu timeout "$secs" python3 scripts/bench_draft.py --ctx 46000 \
                --drafts k26_dflash_share --out_dir "$RAW/$part" --ctx_impls \
                pallas:p131:64:8:3+block+packed,pallas:p263:64:8:3+block+packed,pallas:p263:64:4:3+block+packed,pallas:p395:64:4:2+block+packed,pallas:p263:128:8:2+block+packed ;;
    draft_io) one_gpu timeout "$secs" bash -c "timeout 60 python3 -m pytest -q -rs -m gpu \
                tests/draft/test_dflash_draft.py -k packed; python3 scripts/bench_draft.py \
                --ctx 46000 --drafts k26_dflash_share --out_dir $RAW/$part --ctx_kv packed --top 40 \
                --ctx_impls pallas+block+packed+splitio+xlaqk,pallas+block+packed+xlaqk,pallas+block+packed" ;;
    draft_gap) one_gpu timeout "$secs" bash -c "timeout 35 python3 -m pytest -q -rs -m gpu \
                tests/draft/test_dflash_draft.py -k packed; python3 scripts/bench_draft.py \
                --ctx 46000 --drafts k26_dflash_share --out_dir $RAW/$part --ctx_kv= --top 40 --f32_ref \
                --ctx_impls pallas+block+packed,pallas+block+packed+qkjoin,pallas+block+packed+hg2,pallas+block+packed+expe,pallas+block+packed+msplit2,pallas:p65+block+packed+hg2" ;;
    draft_tokqkv) one_gpu timeout "$secs" bash -c "timeout 60 python3 -m pytest -q -rs -m gpu \
                tests/draft/test_dflash_draft.py -k packed_io_draft_block_compiled; \
                python3 scripts/bench_draft.py \
                --ctx 46000 --drafts k26_dflash_share --out_dir $RAW/$part --ctx_kv= --top 40 --f32_ref \
                --ctx_impls pallas+block+packed,pallas+block+packed+tokqkv,pallas+block+packed" ;;
    k26_nokpi) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_core.py --config.target.int4_k_interleaved=false \
                --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_mpdl) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_core.py --config.bench.phase_modes=none \
                --ab_loop_modes=ar,ddtree --ab_loop_bench=target.mosaic_pdl=true \
                --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_nosplitk) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_core.py --config.bench.phase_modes=none \
                --ab_loop_modes=ar,ddtree --ab_loop_options=xla_gpu_experimental_force_split_k=1 \
                --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    k26_tree) one_gpu timeout "$secs" bash -c "timeout 60 python3 -m pytest -q -rs -m gpu \
                tests/decoding/test_tree_kernel.py; python3 scripts/bench_k26_full.py \
                --out_dir $RAW/$part --config configs/bench_k26_core.py \
                --config.bench.phase_modes=none --ab_loop_modes=ddtree \
                --ab_loop_bench=tree_impl=xla --time_budget_s $(( secs - 80 )) $K26_LAYERS" ;;
    k26_tokqkv) one_gpu timeout "$secs" python3 scripts/bench_k26_full.py --out_dir "$RAW/$part" \
                --config configs/bench_k26_core.py --config.bench.phase_modes=ddtree \
                --config.bench.draft_token_qkv=true --time_budget_s $(( secs - 20 )) $K26_LAYERS ;;
    draft_tests) one_gpu timeout "$secs" python3 -m pytest -q -rs -m gpu \
                tests/draft/test_dflash_draft.py -k packed ;;
    draft) one_gpu timeout "$secs" bash -c "timeout 60 python3 -m pytest -q -rs -m gpu \
                tests/draft/test_dflash_draft.py; python3 scripts/bench_draft.py --ctx 46000 --out_dir $RAW/$part" ;;
    draft_share) one_gpu timeout "$secs" bash -c "timeout 60 python3 -m pytest -q -rs -m gpu \
                tests/draft/test_dflash_draft.py; python3 scripts/bench_draft.py --ctx 46000 \
                --drafts k26_dflash_share --out_dir $RAW/$part" ;;
    calibrate) one_gpu timeout "$secs" python3 scripts/calibrate_step_cost.py \
                 --config configs/bench_k26_full.py --nofixed_programs --out_dir "$RAW/$part" ;;
    pair) local t0 left
          t0=$(date +%s)
          one_gpu timeout $(( secs / 2 < 220 ? secs / 2 : 220 )) python3 scripts/calibrate_step_cost.py --config configs/k2tiny.py \
            --ctx 16,128,256 --steps 4,32 --auto_programs switch --out_dir "$RAW/pair"
          left=$(( secs - $(date +%s) + t0 ))
          local cost="$RAW/pair/step_cost.json"
          [ -f "$cost" ] || { echo "== pair: no calibration came back; bench_pair uses the shipped table"; cost=""; }
          one_gpu timeout $(( left > 20 ? left : 20 )) python3 scripts/bench_pair.py \
            --step_cost "$cost" --out "$RAW/pair.jsonl" ;;
    tree_builder) one_gpu timeout "$secs" python3 scripts/bench_tree_builder.py \
                --budgets 31,47,63,15 --time_budget_s $(( secs - 30 )) \
                --out "$RAW/bench_tree_builder.jsonl" ;;
    sharding) timeout "$secs" python3 scripts/check_sharding_gpu.py --meshes ";tensor=2;expert=2" \
                --out "$RAW/sharding.jsonl" ;;
    multiprocess) timeout "$secs" bash scripts/check_multiprocess_gpu.sh "$RAW" ;;
    train_pair) one_gpu timeout "$secs" bash -c "rm -rf /tmp/train_state && python3 \
                  scripts/train_target.py --config configs/k2tiny.py \
                  --config.train.target.out_dir=$RAW/k2tiny/target \
                  --config.train.target.work_dir=/tmp/train_state/target \
                  && python3 scripts/train_draft.py --config configs/k2tiny.py \
                  --config.train.draft.target_checkpoint=$RAW/k2tiny/target \
                  --config.train.draft.out_dir=$RAW/k2tiny/draft \
                  --config.train.draft.work_dir=/tmp/train_state/draft && for m in target draft; do \
                  cp /tmp/train_state/\$m/log.jsonl $RAW/\${m}_log.jsonl; done && python3 \
                  scripts/plot_losses.py --logs $RAW/target_log.jsonl,$RAW/draft_log.jsonl \
                  --out $RAW/losses.png" ;;
    *) echo "unknown part $part"; return 2 ;;
  esac
}

# The device tool copies the working tree, not always its git HEAD (s25: a tree of 8df5100 ran
# under the session's first HEAD, fe9c14e): name the files that differ from the HEAD shown.
changed=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
[ "$changed" -gt 0 ] && echo "== the tree differs from this HEAD in $changed tracked files:" \
  "$(git status --porcelain --untracked-files=no | awk '{print $2}' | head -8 | tr '\n' ' ')"
echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l)"
for arg in "$@"; do
  part=${arg%%:*}
  secs=${arg#*:}
  [ "$secs" = "$arg" ] && secs=300
  t0=$(date +%s)
  echo "== part $part (time box ${secs} s)"
  mkdir -p "$RAW/$part"  # scripts with --out_dir write there: two parts of one script in one
                         # call overwrote each other's JSON lines (s17: k26_chain's by k26_pdl's)
  run_part "$part" "$secs" 2>&1 | quiet > "$RAW/$part.log"
  rc=${PIPESTATUS[0]}
  echo "== part $part exit $rc after $(( $(date +%s) - t0 )) s"
  tail -n 25 "$RAW/$part.log"
done
find "$RAW" -mindepth 1 -type d -empty -delete  # the folders of parts without --out_dir
tar czf "$OUT/results.tgz" -C "$RAW" . && rm -rf "$RAW"
