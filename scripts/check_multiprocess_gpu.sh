#!/usr/bin/env bash
# Two processes of one GPU each (jax.distributed over NCCL) decode the same tokens as one process
# with both GPUs (f32, the tiny random pair, ddtree, mesh tensor=2). Needs 2 GPUs.
#   bash scripts/check_multiprocess_gpu.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: check_multiprocess_gpu.sh OUT_DIR}
ARGS=(--config configs/tiny.py --config.mode=ddtree --config.budget=16 --config.max_new_tokens=32
      --config.mesh=tensor=2 --config.dtype=float32)
python3 scripts/decode.py "${ARGS[@]}" --json_out "$OUT/mp_one_process.json" || exit 1
for r in 0 1; do
  CUDA_VISIBLE_DEVICES=$r JAX_COORDINATOR_ADDRESS=localhost:12355 JAX_NUM_PROCESSES=2 \
    JAX_PROCESS_ID=$r python3 scripts/decode.py "${ARGS[@]}" --json_out "$OUT/mp_rank$r.json" &
done
wait
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
toks = [json.load(open(f"{out}/{n}.json"))["tokens"] for n in ("mp_one_process", "mp_rank0", "mp_rank1")]
print("multiprocess same tokens:", toks[0] == toks[1] == toks[2])
sys.exit(0 if toks[0] == toks[1] == toks[2] else 1)
PY
