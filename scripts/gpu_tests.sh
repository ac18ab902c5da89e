#!/usr/bin/env bash
# Kernel test sets on a GPU (compiled Mosaic GPU kernels): tree-verify attention (full-shape class
# included) and the INT4 grouped matmul.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices(); print(jax.devices())'
exec "$PY" -m pytest tests/test_tree_verify_attention.py tests/test_int4_matmul.py -q -rs "$@"
