#!/usr/bin/env bash
# Session 15's second lease as one background job (results under /tmp/burst, progress in /tmp/burst/progress):
#   1. the GGUF kernels' GPU tests (tests/test_gguf_matmul.py -m gpu, 4 processes), no model needed;
#   2. scripts/gguf_bench.py at M = 16, 64, 256 (the dense route, gguf_dense, is the default from 65 rows and is
#      tried at 16 and 64 in the sweep);
#   3. once the 1.5B is staged: `bench throughput --num-seqs 64,256`, quantization none then gguf;
#   4. once the 0.5B is staged: `bench spec` on HumanEval-chat (none, ngram, draft_model at 1, 4, 16, 64; traced),
#      then the held-out requests at batch 64 with 3 repeats (the plain-decoding spread at 64).
#   setsid nohup scripts/gpu_lease_s15b.sh > /tmp/burst/driver.log 2>&1 < /dev/null &
set -uo pipefail
R=/tmp/burst
mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=${VERISPEC_CACHE_DIR:-/tmp/vcache}
M=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
V="python3 -m verispec.entrypoints.cli"
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
staged() { until [ -f "/tmp/models/$1.gguf.ok" ]; do sleep 2; done; }
mark start
i=0
for sel in "Q4_K" "Q6_K" "Q5_K or Q8_0 or graph or silu" "Q5_0 or Q4_0 or Q4_1 or Q5_1"; do
  timeout 150 python3 -m pytest tests/test_gguf_matmul.py -q -rf -m gpu -p no:cacheprovider -k "$sel" \
    > "$R/tests_$i.log" 2>&1 &
  i=$((i + 1))
done
wait
for j in 0 1 2 3; do echo "tests_$j: $(tail -1 "$R/tests_$j.log")"; done > "$R/tests.txt"
mark "tests done"
timeout 200 python3 scripts/gguf_bench.py --device cuda --rows 16,64,256 --qtypes Q4_K,Q6_K --sweep-qtypes Q4_K,Q6_K \
  --budget-s 25 --json "$R/gguf_bench.json" > "$R/gguf_bench.log" 2>&1
mark "bench done rc=$?"
staged $M
for q in none gguf; do
  timeout 240 $V bench throughput --model /tmp/models/$M.gguf --device cuda --quantization $q --num-seqs 64,256 \
    --repeats 1 > "$R/throughput_$q.log" 2>&1
  mark "throughput $q rc=$?"
done
staged $D
spec() {  # spec NAME PROMPTS BATCHES REPEATS
  $V bench spec --model $M --draft-model $D --methods none,ngram,draft_model --batch-sizes "$3" --prompts "$2" \
    --num-prompts 32 --output-len 256 --repeats "$4" --chat --json "$R/spec_$1.json" --trace-steps "$R/trace_$1" \
    > "$R/spec_$1.log" 2>&1
  mark "spec $1 rc=$?"
}
spec humaneval humaneval.jsonl 1,4,16,64 1
spec heldout64 prompts/heldout_requests.jsonl 64 3
mark end
