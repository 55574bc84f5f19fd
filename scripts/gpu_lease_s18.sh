#!/usr/bin/env bash
# Session 18's lease as one background job (results under /tmp/burst, progress in /tmp/burst/progress): session
# 17's plan (scripts/gpu_lease_s17.sh, never run) reordered so that the work that needs no staged model runs while
# the chunks arrive (the 0.5B is staged first, then the 1.5B: scripts/stage_small.sh's 48 MiB chunks):
#   0. at once (random weights, no model file): the graph-padding / decode GPU tests, then the batch-1 verify /
#      decode GPU-time ratio for k = 3, 7, 15 (scripts/step_ablation.py);
#   1. once the 0.5B is staged: the acceptance gates (gpu_gates.sh phase A, without its bench invariance jobs),
#      stopped when the 1.5B is staged;
#   2. once the 1.5B is staged, where the cost-model change acts first (device time is short: 14 minutes left
#      after refused calls): `bench spec` (none, ngram, draft_model; 3 interleaved repeats, traced) at 16 and 64
#      on the held-out requests, then on HumanEval-chat; then the held-out requests at 1 and 4 (an interleaved
#      sweep that fails is rerun with --no-interleave); then scripts/host_profile.py at batch 64 (host work per
#      decode step at k = 0); then `bench spec --quantization gguf` on the held-out requests at 1 and 16.
# A model not staged within 6 minutes of the start of its wait stops the driver ("not staged" in progress).
#   setsid nohup scripts/gpu_lease_s18.sh > /tmp/burst/driver.log 2>&1 < /dev/null &
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
timeout 240 python3 scripts/host_profile.py --model $M --draft-model $D --device cuda --batch 64 --steps 150 \
  > "$R/host_profile_b64.log" 2>&1
mark "host profile rc=$?"
spec gguf prompts/heldout_requests.jsonl 1,16 3 --quantization gguf \
  || spec gguf_ngram prompts/heldout_requests.jsonl 1,16 3 --quantization gguf --methods none,ngram
mark end
