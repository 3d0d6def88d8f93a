#!/usr/bin/env bash
# The one command of the GPU check (issue #27) on the device machine, run from the repo root:
#   device run, carry [".whl"], command: bash benchmarks/gpu/run_on_device.sh [gpu_check args]
# Installs the wheels that benchmarks/gpu/fetch_wheels.sh put in .whl/ into /tmp/site (that
# machine has no network), runs ddpwatch from src/, and tees the check's output to
# $OUT/gpu_check.log. Its children write a few more logs beside it (at most 8 files return).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d)}"
export OUT PYTHONUNBUFFERED=1
if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "run_on_device: no wheels in .whl/: run benchmarks/gpu/fetch_wheels.sh here and carry .whl" >&2
  exit 2
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import zmq, msgspec, ddpwatch, torch; print("run_on_device: ddpwatch", ddpwatch.__version__, "pyzmq", zmq.__version__, "torch", torch.__version__)' || exit 2
"$PY" benchmarks/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
