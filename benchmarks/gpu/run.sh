#!/usr/bin/env bash
# The device benchmark, as one call of the `device` tool on a lent GPU (H100 / H200):
#
#     bash benchmarks/gpu/wheels.sh          # here, once: the wheels the GPU image lacks
#     device run: command="bash benchmarks/gpu/run.sh", carry=[".whl"], timeout_s=540
#
# It installs the carried wheels and this checkout (no network there) into /tmp/site, then
# runs benchmarks/gpu/bench.py within 450 s (the whole call about 8 minutes). Everything
# goes to $OUT: gpu_bench.json (see bench.py's docstring for its sections) and
# gpu_bench.png. A section that fails is recorded in the JSON with its error; a run cut
# short keeps the sections it finished.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=/tmp/site
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
fi
# This checkout, with its entry points (the model families), beside the image's packages.
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --no-cache-dir --upgrade --target "$SITE" .
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
set -o pipefail
timeout 470 "$PY" benchmarks/gpu/bench.py --out "$OUT" --budget 450 "$@" 2>&1 | tee "$OUT/log.txt"
