#!/usr/bin/env bash
# A lease's smallest useful call (no model staged): the GGUF kernels' GPU tests, then the one-row Q4_K GEMV
# against gguf_matmul's old GEMV on random weights of the 1.5B's shapes. Results in $OUT (one call, carry .whl).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
git log -1 --format=%h > "$R/commit.txt" 2>/dev/null
timeout 150 python3 -m pytest -o addopts= -q -rfE -m gpu -p no:cacheprovider tests/test_gguf_gemv.py tests/test_gguf_matmul.py \
  > "$R/gguf_tests.log" 2>&1
echo "gguf gpu tests rc=$? $(tail -1 "$R/gguf_tests.log")"
timeout 100 python3 scripts/gguf_bench.py --gemv1 --rows 1 --qtypes Q4_K --sweep-qtypes Q4_K --budget-s 30 \
  --json "$R/gguf_gemv1.json" > "$R/gguf_gemv1.log" 2>&1
echo "gguf bench gemv1 rc=$?"
timeout 60 python3 scripts/gguf_bench.py --rows 1 --qtypes Q4_K,Q6_K --sweep-qtypes '' --no-gemv1 \
  --json "$R/gguf_old.json" > "$R/gguf_old.log" 2>&1
echo "gguf bench old rc=$?"
tail -15 "$R/gguf_gemv1.log"; tail -8 "$R/gguf_old.log"
