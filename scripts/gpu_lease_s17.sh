#!/usr/bin/env bash
# Session 17's lease as one background job (results under /tmp/burst, progress in /tmp/burst/progress), for the
# policy's new step cost (a plain step max(forward, 40 us per sequence), a drafting step's host 70 us per sequence):
#   0. once both models are staged (scripts/stage_small.sh's 48 MiB chunks; the driver stops after 5 minutes
#      without them): the graph-padding / decode GPU tests and the acceptance gates (gpu_gates.sh phase A);
#   1. `bench spec` (none, ngram, draft_model at 1, 4, 16, 64; 3 interleaved repeats,
#      traced) on the held-out requests, then on HumanEval-chat; an interleaved sweep that fails is rerun with
#      --no-interleave (one engine at a time); between the two, scripts/host_profile.py at batch 64 (the host
#      work per decode step of none, ngram and draft_model at k = 0);
#   2. the batch-1 verify / decode GPU-time ratio for k = 3, 7, 15 (scripts/step_ablation.py);
#   3. `bench spec --quantization gguf` on the held-out requests at 1 and 16 (speculation on the GGUF path).
#   setsid nohup scripts/gpu_lease_s17.sh > /tmp/burst/driver.log 2>&1 < /dev/null &
set -uo pipefail
R=/tmp/burst
mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=${VERISPEC_CACHE_DIR:-/tmp/vcache} VERISPEC_STAGE_CACHE=/tmp/models
M=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
V="python3 -m verispec.entrypoints.cli"
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
staged() {  # wait up to 5 minutes for a model's .ok (staging calls: scripts/stage_small.sh), else stop
  local t=0
  until [ -f "/tmp/models/$1.gguf.ok" ]; do
    sleep 2; t=$((t + 2))
    if [ $t -ge 300 ]; then mark "not staged: $1"; mark end; exit 1; fi
  done
}
mark start
staged $M
staged $D
mark staged
# The admission shaping (scheduler prefill_fit) and the trace fields are GPU-path changes: the graph-padding GPU
# tests and the acceptance gates (phase A of gpu_gates.sh, without its bench invariance jobs) first.
timeout 200 python3 -m pytest -o addopts= -q -rfE -m gpu -p no:cacheprovider tests/test_graph_padding.py tests/test_decode_gpu.py \
  > "$R/gpu_tests.log" 2>&1
mark "gpu tests rc=$? $(tail -1 "$R/gpu_tests.log")"
GATES_PHASE=A BUDGET_S=200 INV_BENCH=0 OUT=$R/gates timeout 240 scripts/gpu_gates.sh > "$R/gates.log" 2>&1
mark "gates rc=$?"
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
spec heldout prompts/heldout_requests.jsonl 1,4,16,64 3 || spec heldout_seq prompts/heldout_requests.jsonl 1,4,16,64 3 --no-interleave
timeout 240 python3 scripts/host_profile.py --model $M --draft-model $D --device cuda --batch 64 --steps 150 \
  > "$R/host_profile_b64.log" 2>&1
mark "host profile rc=$?"
spec humaneval humaneval.jsonl 1,4,16,64 3 || spec humaneval_seq humaneval.jsonl 1,4,16,64 3 --no-interleave
timeout 200 python3 scripts/step_ablation.py --model $M --batch-sizes 1 --context 1024 --query-len 1,4,8,16 \
  --variants base --rounds 3 --reps 30 > "$R/verify_ratio.log" 2>&1
mark "verify ratio rc=$?"
spec gguf prompts/heldout_requests.jsonl 1,16 3 --quantization gguf \
  || spec gguf_ngram prompts/heldout_requests.jsonl 1,16 3 --quantization gguf --methods none,ngram
mark end
