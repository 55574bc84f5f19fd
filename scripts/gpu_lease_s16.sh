#!/usr/bin/env bash
# Session 16's lease as one background job (results under /tmp/burst, progress in /tmp/burst/progress):
#   1. the GGUF kernels' GPU tests (tests/test_gguf_matmul.py -m gpu, 4 processes), no model needed;
#   2. scripts/gguf_bench.py at M = 16, 64, 256 (the dense route, gguf_dense, is the default from 65 rows and is
#      tried at 16 and 64 in the sweep);
#   3. once the 1.5B is staged: `bench throughput --num-seqs 64,256`, quantization none then gguf;
#   4. once the 0.5B is staged: `bench spec` (none, ngram, draft_model at 1, 4, 16, 64; 3 interleaved repeats,
#      traced) on HumanEval-chat, then on the held-out requests; if an interleaved sweep fails, it is rerun with
#      --no-interleave (one engine at a time);
#   5. `bench spec --quantization gguf` on the held-out requests at 1 and 16 (speculation on the GGUF path);
#   6. the batch-1 verify / decode GPU-time ratio for k = 3, 7, 15 (scripts/step_ablation.py, random weights).
#   setsid nohup scripts/gpu_lease_s16.sh > /tmp/burst/driver.log 2>&1 < /dev/null &
set -uo pipefail
R=/tmp/burst
mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=${VERISPEC_CACHE_DIR:-/tmp/vcache} VERISPEC_STAGE_CACHE=/tmp/models
M=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
V="python3 -m verispec.entrypoints.cli"
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
staged() { until [ -f "/tmp/models/$1.gguf.ok" ]; do sleep 2; done; }
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
spec() {  # spec NAME PROMPTS BATCHES REPEATS [FLAGS...]
  local name=$1 prompts=$2 batches=$3 repeats=$4
  shift 4
  timeout 480 $V bench spec --model $M --draft-model $D --methods none,ngram,draft_model --batch-sizes "$batches" \
    --prompts "$prompts" --num-prompts 32 --output-len 256 --repeats "$repeats" --chat --json "$R/spec_$name.json" \
    --trace-steps "$R/trace_$name" "$@" > "$R/spec_$name.log" 2>&1
  local rc=$?
  mark "spec $name rc=$rc"
  return $rc
}
spec humaneval humaneval.jsonl 1,4,16,64 3 || spec humaneval_seq humaneval.jsonl 1,4,16,64 3 --no-interleave
spec heldout prompts/heldout_requests.jsonl 1,4,16,64 3 || spec heldout_seq prompts/heldout_requests.jsonl 1,4,16,64 3 --no-interleave
spec gguf prompts/heldout_requests.jsonl 1,16 3 --quantization gguf \
  || spec gguf_ngram prompts/heldout_requests.jsonl 1,16 3 --quantization gguf --methods none,ngram
timeout 200 python3 scripts/step_ablation.py --model $M --batch-sizes 1 --context 1024 --query-len 1,4,8,16 \
  --variants base --rounds 3 --reps 30 > "$R/verify_ratio.log" 2>&1
mark "verify ratio rc=$?"
mark end
