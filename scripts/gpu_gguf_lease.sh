#!/usr/bin/env bash
# Issue 20 in one short lease (~7 min), as one background job started by the lease's first call:
#   1. the GGUF kernels' GPU tests (tests/test_gguf_matmul.py -m gpu, 4 processes; no model needed), while
#      the 1.5B is being staged;
#   2. scripts/gguf_bench.py: every 1.5B layer shape, Q4_K and Q6_K, M = 1, 4, 16, 64, 256, against dense bf16,
#      then a tile sweep of both types until BUDGET_S (default 60);
#   3. once /tmp/models/$M.gguf.ok exists: `bench latency` at batch 1, quantization none then gguf (the
#      end-to-end decode with gguf_bench's default tiles), then scripts/quant_parity.py on the 1.5B
#      (greedy common prefix and logits error over 64 tokens, 8 prompts), then EXTRA (a command line, optional).
# Results under $R (default /tmp/burst14b), progress in $R/progress.
#   mkdir -p /tmp/tree && tar cf - --exclude=.device-carry . | (cd /tmp/tree && tar xf -) && cd /tmp/tree &&
#   setsid nohup scripts/gpu_gguf_lease.sh > /tmp/gguf_lease.log 2>&1 < /dev/null &
set -uo pipefail
R=${R:-/tmp/burst14b}
mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=${VERISPEC_CACHE_DIR:-/tmp/vcache}
M=qwen2.5-coder-1.5b-instruct
V="python3 -m verispec.entrypoints.cli"
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
mark start
i=0
for sel in "Q4_K" "Q6_K" "Q5_K or Q8_0 or graph or silu" "Q5_0 or Q4_0 or Q4_1 or Q5_1"; do
  timeout 150 python3 -m pytest -o addopts= tests/test_gguf_matmul.py -q -rf -m gpu -p no:cacheprovider -k "$sel" \
    > "$R/tests_$i.log" 2>&1 &
  i=$((i + 1))
done
wait
for j in 0 1 2 3; do echo "tests_$j: $(tail -1 "$R/tests_$j.log")"; done > "$R/tests.txt"
mark "tests done"
timeout 300 python3 scripts/gguf_bench.py --device cuda --rows 1,4,16,64,256 --qtypes Q4_K,Q6_K \
  --sweep-qtypes Q4_K,Q6_K --budget-s "${BUDGET_S:-60}" --json "$R/gguf_bench.json" > "$R/gguf_bench.log" 2>&1
mark "bench done rc=$?"
until [ -f /tmp/models/$M.gguf.ok ]; do sleep 2; done
for q in none gguf; do
  timeout 150 $V bench latency --model /tmp/models/$M.gguf --device cuda --quantization $q --batch-sizes 1 \
    --input-len 128 --output-len 256 --num-iters 3 > "$R/latency_$q.log" 2>&1
  mark "latency $q rc=$?"
done
timeout 150 python3 scripts/quant_parity.py /tmp/models/$M.gguf --device cuda --tokens 64 --prompts 8 \
  > "$R/parity.log" 2>&1
mark "parity rc=$?"
if [ -n "${EXTRA:-}" ]; then
  bash -c "$EXTRA" > "$R/extra.log" 2>&1
  mark "extra rc=$?"
fi
mark end
