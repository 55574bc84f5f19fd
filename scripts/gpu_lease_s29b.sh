#!/usr/bin/env bash
# Session 29's lease, call B: the resident one-row GEMVs' tiles (Q4_K resident form, Q6_K), one row, the 1.5B's
# shapes (scripts/gguf_bench.py's second pass: each case's closest alternatives first, until the budget).
# carry: .whl
set -uo pipefail
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VERISPEC_CACHE_DIR=/tmp/vcache
R=${OUT:-/tmp/out}
mkdir -p "$R"
timeout 500 python3 scripts/gguf_bench.py --rows 1 --qtypes Q4_K,Q6_K --sweep-qtypes Q4_K,Q6_K --gemv1-q6k \
  --resident --budget-s 380 --iters 30 --json "$R/sweep.json" > "$R/sweep.log" 2>&1
echo "sweep rc=$? at $(( $(date +%s) - t0 )) s"
grep -v "Warn\|_warn" "$R/sweep.log" | grep -v "^  gemv {" | tail -40
