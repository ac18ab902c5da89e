# Sourced by scripts/gpu_measure.sh on the GPU machine: unbuffered output, the repo root as the
# working directory and on PYTHONPATH (the GPU image runs the checkout without `pip install -e`),
# and the wheels the GPU image lacks (.whl/, e.g. ml_collections) installed into /tmp/site.
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
