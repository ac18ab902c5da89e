#!/usr/bin/env bash
# Trains the k2tiny target, then its DFlash draft, on one H200 (~7 min wall: target capped at
# 250 s of training, draft at 140 s, plus start-up), and copies the results to $OUT:
#   $OUT/k2tiny.tar            k2tiny/{target,draft} (HF bf16 target, DFlash draft; from
#                              runs/k2tiny/hf: untar into checkpoints/ to replace the shipped pair)
#   $OUT/{target,draft}_log.jsonl, $OUT/{target,draft}_stdout.txt, $OUT/losses.png
# Usage: OUT=/some/dir PY=python3 scripts/train_pair_gpu.sh   (RESUME=1 keeps runs/k2tiny)
# Extra flags per script: TARGET_FLAGS="--config.max_seconds=200" DRAFT_FLAGS="...".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-runs/k2tiny/out}
mkdir -p "$OUT"
if [[ "${RESUME:-0}" != 1 ]]; then
  rm -rf runs/k2tiny/target runs/k2tiny/draft
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
# shellcheck disable=SC2086
"$PY" scripts/train_target.py --config configs/train_target.py ${TARGET_FLAGS:-} \
  2>&1 | tee "$OUT/target_stdout.txt"
# shellcheck disable=SC2086
"$PY" scripts/train_draft.py --config configs/train_draft.py ${DRAFT_FLAGS:-} \
  2>&1 | tee "$OUT/draft_stdout.txt"
tar -cf "$OUT/k2tiny.tar" -C runs/k2tiny/hf --transform 's,^,k2tiny/,' target draft
cp runs/k2tiny/target/log.jsonl "$OUT/target_log.jsonl"
cp runs/k2tiny/draft/log.jsonl "$OUT/draft_log.jsonl"
"$PY" scripts/plot_losses.py --logs "$OUT/target_log.jsonl,$OUT/draft_log.jsonl" \
  --out "$OUT/losses.png" || echo "plot failed (matplotlib?); logs are in $OUT"
ls -la "$OUT"
