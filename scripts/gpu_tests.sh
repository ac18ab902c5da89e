#!/usr/bin/env bash
# Full tree-verify kernel test set on a GPU (compiled Mosaic GPU kernel, full-shape class included).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices(); print(jax.devices())'
exec "$PY" -m pytest tests/test_tree_verify_attention.py -q -rs "$@"
