#!/usr/bin/env bash
# One H200 session's work as one background job, so that the GPU never waits for the next call:
#   1. the default DFlash training run (`train-drafter`, 15 minutes after the target loads) with the
#      GPU correctness tests beside it (`pytest -m "gpu or gpu_gate"`, one process per file: they slow training a little; nothing is
#      timed while it runs);
#   2. then the timed measurements, one after another: `bench spec` on the held-out requests (every
#      method against plain decoding in the same process), the batch-1 verify/decode ratio
#      (scripts/step_ablation.py, random weights, context 1024), `bench spec` on HumanEval-chat, then
#      the helpers' GPU scripts (scripts/gpu_gguf.sh, scripts/gpu_gates.sh) where present.
# Start it from a copy of the tree (later calls re-sync the checkout under a running job):
#   mkdir -p /tmp/tree && git ls-files -z | xargs -0 cp --parents -t /tmp/tree && cd /tmp/tree &&
#   setsid nohup scripts/gpu_session.sh > /tmp/burst/driver.log 2>&1 < /dev/null &
# and poll $R/progress. Models: registry names, linked from /tmp/models into $VERISPEC_CACHE_DIR/models
# by the staging calls; the 0.5B may still be staging when the job starts: step 1's tests wait for
# /tmp/models/qwen2.5-coder-0.5b-instruct.gguf.ok (written after its sha256 check).
# env: R (results, /tmp/burst), SKIP (space-separated stages to skip: train tests heldout verify
#      humaneval gguf gates), PROMPTS (held-out file), TRAIN_MINUTES (15), REPEATS (1).
set -uo pipefail
R=${R:-/tmp/burst}
mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=${VERISPEC_CACHE_DIR:-/tmp/vcache}
M=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
V="python3 -m verispec.entrypoints.cli"
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
want() { [[ " ${SKIP:-} " != *" $1 "* ]]; }
spec() {  # spec NAME PROMPTS METHODS BATCHES [extra args]
  local name=$1 prompts=$2 methods=$3 batches=$4; shift 4
  local dflash=()
  [ -f "$R/dflash/model.safetensors" ] && dflash=(--dflash-model "$R/dflash")
  [ -f "$R/dflash/model.safetensors" ] || methods=${methods//,dflash/}
  $V bench spec --model $M --draft-model $D "${dflash[@]}" --methods "$methods" --batch-sizes "$batches" \
    --prompts "$prompts" --num-prompts 32 --output-len 256 --repeats "${REPEATS:-1}" --chat \
    --json "$R/spec_$name.json" "$@" > "$R/spec_$name.log" 2>&1
}

mark start
if want train; then
  mark train
  $V train-drafter --target $M --out "$R/dflash" --device cuda --minutes "${TRAIN_MINUTES:-15}" \
    > "$R/train.log" 2>&1 &
  train=$!
fi
if want tests; then
  until [ -f /tmp/models/$D.gguf.ok ]; do sleep 2; done
  mark tests
  # One process per test file, 4 at a time: a device-side assert aborts only its own file, and the
  # modules that import server packages the GPU machine lacks (openai, uvicorn, ...) are skipped.
  mkdir -p "$R/tests"
  grep -l "mark.gpu\|gpu_gate" tests/test_*.py | xargs -P 4 -I{} sh -c \
    'f={}; timeout 300 python3 -m pytest "$f" -q -rf -m "gpu or gpu_gate" -p no:cacheprovider \
       --continue-on-collection-errors > "$0/tests/$(basename "$f" .py).log" 2>&1; echo "rc=$?" >> "$0/tests/$(basename "$f" .py).log"' "$R"
  for f in "$R"/tests/*.log; do echo "$(basename "$f"): $(grep -E "passed|failed|error|skipped" "$f" | tail -1) $(tail -1 "$f")"; done \
    > "$R/pytest_gpu.txt"
  mark "tests done"
fi
if want train; then
  wait "$train"
  mark "train done rc=$?"
fi
want heldout && { mark heldout; spec heldout "${PROMPTS:-prompts/heldout_requests.jsonl}" none,ngram,draft_model,dflash 1,4,16,64; mark "heldout done rc=$?"; }
if want verify; then
  mark verify
  for q in 4 8 16; do
    python3 scripts/step_ablation.py --batch-sizes 1 --context 1024 --query-len $q \
      --variants "base,gemv=$q,small-splitk" --rounds 5 --reps 50 >> "$R/verify.log" 2>&1
  done
  python3 scripts/step_ablation.py --batch-sizes 1 --context 1024 --query-len 1 --variants base \
    --rounds 5 --reps 50 >> "$R/verify.log" 2>&1
  mark "verify done"
fi
want humaneval && { mark humaneval; spec humaneval humaneval.jsonl none,ngram,draft_model,dflash 1,16,64; mark "humaneval done rc=$?"; }
for s in gguf gates; do
  if want $s && [ -x scripts/gpu_$s.sh ]; then
    mark $s
    OUT=$R/$s scripts/gpu_$s.sh > "$R/$s.log" 2>&1
    mark "$s done rc=$?"
    [ -f /tmp/gguf_bench.json ] && cp /tmp/gguf_bench.json "$R/"
  fi
done
mark end
