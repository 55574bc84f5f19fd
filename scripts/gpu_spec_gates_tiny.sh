#!/usr/bin/env bash
# The speculative path's GPU gates that need no staged model (tiny random models: spec decode parity and
# counters, planted faults, decode, graph padding), one call, carry .whl. Results in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpu.txt" 2>&1
timeout ${BUDGET:-330} python3 -m pytest -o addopts= -q -rfEs -m gpu -p no:cacheprovider tests/test_spec_decode.py \
  tests/test_faults.py tests/test_decode_gpu.py tests/test_graph_padding.py > "$R/spec_gates.log" 2>&1
echo "rc=$?"; tail -25 "$R/spec_gates.log"
