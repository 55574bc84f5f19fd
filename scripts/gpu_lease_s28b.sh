#!/usr/bin/env bash
# Session 28's lease, call B: the GGUF super-block tensor-core kernel at 16, 64 and 256 rows (issue 20's
# throughput; 2..16 rows are a GGUF verify) against dense bf16 at the 1.5B's five layer shapes, default tiles
# then the sweep of both types (scripts/gguf_bench.py: mma_configs, the dense route at 16 and 64 rows) until
# the budget is spent. No default changes here: the figures pick them.
# carry: .whl
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VERISPEC_CACHE_DIR=/tmp/vcache
R=${OUT:-/tmp/out}
mkdir -p "$R"
timeout 520 python3 scripts/gguf_bench.py --device cuda --rows 16,64,256 --qtypes Q4_K,Q6_K \
  --sweep-qtypes Q4_K,Q6_K --budget-s ${BUDGET:-400} --iters 30 --json "$R/gguf_mma_bench.json" > "$R/gguf_mma_bench.log" 2>&1
echo "gguf_bench rc=$?"
grep -v "^  mma\|^  dense\|^  gemv" "$R/gguf_mma_bench.log" | tail -60
