# Sourced by the scripts/gpu_session*.sh device calls: unbuffered output, the repo root as the
# working directory, and the wheels the GPU image lacks (.whl/, e.g. ml_collections) on PYTHONPATH.
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
