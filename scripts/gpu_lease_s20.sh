#!/usr/bin/env bash
# The next lease as one background job (results under /tmp/burst, progress in /tmp/burst/progress): session 18's
# plan (scripts/gpu_lease_s18.sh, never run: every start was refused) with session 19's integer-dot GGUF GEMV first,
# since it needs no model file and is the one change to issue 20's kernels since session 16:
#   0. at once (random blocks): the int8 GEMV's GPU tests, then scripts/gguf_bench.py at one row with --int8
#      (tiles swept) and without it (the float GEMV), then session 18's step 0 (graph-padding / decode tests, the
#      verify / decode ratio);
#   1-2. session 18's steps (gates while the 1.5B stages; bench spec on both prompt sets; host profile);
#   3. with the 1.5B staged, after bench spec: `bench profile --quantization gguf` with and without
#      --gguf-int8-gemv (one decode step's GPU time), and scripts/quant_parity.py --gguf-int8-gemv (greedy
#      agreement of int8 decode with the bf16 path on 8 prompts); then spec on GGUF as in session 18.
# Send with scripts/lease_chunk.sh scripts/gpu_lease_s20.sh MODEL NN [SHA] (every call self-starting, in one
# message), then a polling call.
set -uo pipefail
R=/tmp/burst
mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=${VERISPEC_CACHE_DIR:-/tmp/vcache} VERISPEC_STAGE_CACHE=/tmp/models
export PYTHONUNBUFFERED=1
M=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
V="python3 -m verispec.entrypoints.cli"
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
staged() {
  local t=0
  until [ -f "/tmp/models/$1.gguf.ok" ]; do
    sleep 2; t=$((t + 2))
    if [ $t -ge 360 ]; then mark "not staged: $1"; mark end; exit 1; fi
  done
  mark "staged $1"
}
mark start
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
timeout 150 python3 -m pytest -o addopts= -q -rfE -m gpu -p no:cacheprovider tests/test_gguf_matmul.py -k "int8 or kquant_gemv" \
  > "$R/gguf_int8_tests.log" 2>&1
mark "gguf int8 tests rc=$? $(tail -1 "$R/gguf_int8_tests.log")"
timeout 150 python3 scripts/gguf_bench.py --rows 1 --qtypes Q4_K,Q6_K --int8 --sweep-qtypes Q4_K,Q6_K --budget-s 60 \
  --json "$R/gguf_int8.json" > "$R/gguf_int8.log" 2>&1
mark "gguf bench int8 rc=$?"
timeout 90 python3 scripts/gguf_bench.py --rows 1 --qtypes Q4_K,Q6_K --sweep-qtypes '' --json "$R/gguf_float.json" \
  > "$R/gguf_float.log" 2>&1
mark "gguf bench float rc=$?"
timeout 200 python3 -m pytest -o addopts= -q -rfE -m gpu -p no:cacheprovider tests/test_graph_padding.py tests/test_decode_gpu.py \
  > "$R/gpu_tests.log" 2>&1
mark "gpu tests rc=$? $(tail -1 "$R/gpu_tests.log")"
timeout 200 python3 scripts/step_ablation.py --model $M --batch-sizes 1 --context 1024 --query-len 1,4,8,16 \
  --variants base --rounds 3 --reps 30 > "$R/verify_ratio.log" 2>&1
mark "verify ratio rc=$?"
staged $D
# The gates use the staging's time only: stopped once the 1.5B is staged (the live logs keep each cell's outcome).
(GATES_PHASE=A BUDGET_S=200 INV_BENCH=0 OUT=$R/gates timeout 240 scripts/gpu_gates.sh > "$R/gates.log" 2>&1
 mark "gates rc=$?") &
gates=$!
staged $M
if kill -0 $gates 2>/dev/null; then
  mark "gates stopped (1.5B staged)"; pkill -TERM -f gpu_gates.sh; pkill -TERM -f "pytest.*gpu"; sleep 3
  pkill -KILL -f "pytest.*gpu"
fi
wait $gates 2>/dev/null
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
spec heldout prompts/heldout_requests.jsonl 16,64 3 || spec heldout_seq prompts/heldout_requests.jsonl 16,64 3 --no-interleave
spec humaneval humaneval.jsonl 16,64 3 || spec humaneval_seq humaneval.jsonl 16,64 3 --no-interleave
spec heldout_small prompts/heldout_requests.jsonl 1,4 3
G=/tmp/models/$M.gguf
for v in float int8; do
  flag=""; [ $v = int8 ] && flag=--gguf-int8-gemv
  timeout 150 $V bench profile --model $G --quantization gguf --batch-sizes 1 --context 1024 $flag \
    --json "$R/profile_gguf_$v.json" > "$R/profile_gguf_$v.log" 2>&1
  mark "profile gguf $v rc=$?"
done
timeout 200 python3 scripts/quant_parity.py $G --device cuda --tokens 64 --prompts 8 --gguf-int8-gemv \
  > "$R/quant_parity_int8.log" 2>&1
mark "quant parity int8 rc=$?"
timeout 240 python3 scripts/host_profile.py --model $M --draft-model $D --device cuda --batch 64 --steps 150 \
  > "$R/host_profile_b64.log" 2>&1
mark "host profile rc=$?"
spec gguf prompts/heldout_requests.jsonl 1,16 3 --quantization gguf \
  || spec gguf_ngram prompts/heldout_requests.jsonl 1,16 3 --quantization gguf --methods none,ngram
mark end
