#!/usr/bin/env bash
# Sharded decoding on a 2-GPU machine: same tokens on 1 GPU vs tensor=2 vs expert=2 (f32), and
# bf16 step time of a 3-layer, 384-expert K2.6-width model (~75 GB) on 1 vs 2 GPUs.
# Prints a table; writes $OUT/check_sharding.json (OUT defaults to /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import jax; assert jax.default_backend() == "gpu" and jax.device_count() == 2, jax.devices()'
exec "$PY" scripts/check_sharding_gpu.py --out "${OUT:-/tmp}" "$@"
