#!/usr/bin/env bash
# Issue 18's missing H200 must-shows in one call of at most 6 minutes (BUDGET_S=360; estimated ~5.5 min:
# pulls + bf16 dequantized caches ~45 s, then all of the below side by side ~4-4.5 min (the GPU time of
# the three benches alone ~200 s, the gate cells ~100 s; they share the GPU), summaries ~5 s). By value:
#   (a)+(b) INV: `bench invariance` on qwen2.5-coder-1.5b-instruct in bf16 + --batch-invariant, 32 held-out
#      requests (prompts/heldout_requests.jsonl, chat-rendered) x 256 tokens, k pinned (-k 3, --no-adaptive:
#      drafts every step; dflash: its block size - 1), in 3 processes side by side: plain decoding at
#      batch 1, 16, 64 (every prompt twice, --copies 2: 64 requests, so that batch 64 is full); ngram + self
#      at 1, 16; draft_model (0.5B draft) + dflash (DFLASH, else an untrained drafter) at 1, 16. Loops
#      (--loops sync,async): the cells at LOOP_BATCHES (16,64) run in both loops, tokens AND acceptance
#      counters compared; batch 1 in the sync loop only (LOOP_BATCHES=1,16,64 adds the async batch-1 cells:
#      ~+100 s of GPU time). Each process has its own plain batch-1 reference; the summary also checks every
#      row's tokens against the first process's reference through the per-request hashes. A process cut
#      by the budget keeps the rows it finished (JSON.partial).
#   (c) GATES: beside them, the gate suite in bf16 with batch_invariant=True (scripts/gpu_gates.sh phase A,
#      GATE_DTYPE=bfloat16: the -m gpu cells of test_faults.py, test_real_model_spec.py, test_spec_decode.py
#      on the real 0.5B), test_faults.py's CPU cells, and the fault table (CPU vs CUDA) from their live logs.
# usage (repo root): PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache scripts/gpu_invariance.sh [--device cpu]
#   Models at /tmp/models/<name>.gguf (staged by the lead; registry lookups adopt them via VERISPEC_STAGE_CACHE).
#   --device cpu: a dry run here: the 0.5B as target and draft on the CPU in bf16 without --batch-invariant
#   (refused on the CPU, as it must be), 2 prompts x 8 tokens, the gates collected only (gpu_gates.sh
#   --device cpu) and 2 real CPU fault cells for the table.
# env: SKIP_INV=1 / SKIP_GATES=1 (drop a part: INV is (a)+(b), the first must-show), SKIP_DFLASH=1,
#      DFLASH (a trained drafter dir; default: random), MODEL (qwen2.5-coder-1.5b-instruct), DRAFT
#      (qwen2.5-coder-0.5b-instruct), BUDGET_S (360), INV_LEN (256), INV_PROMPTS (32), PLAIN_COPIES (2),
#      LOOP_BATCHES (16,64), K (3), PAR (gate processes at a time, 8), SHARD (gate cells per process, 5).
# Output: compact tables here; logs and JSON under $OUT (default /tmp/invariance_out, or the run tool's).
set -uo pipefail
DEVICE=cuda
[[ "${1:-}" == "--device" ]] && DEVICE=${2:?--device needs cpu or cuda}
OUT=${OUT:-/tmp/invariance_out}
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.partial "$OUT"/*.log "$OUT"/*.rc
export VERISPEC_STAGE_CACHE=${VERISPEC_STAGE_CACHE:-/tmp/models} PYTHONUNBUFFERED=1
CLI=(python3 -m verispec.entrypoints.cli)
PROMPTS=prompts/heldout_requests.jsonl
DRAFT=${DRAFT:-qwen2.5-coder-0.5b-instruct}
T0=$(date +%s)
if [[ $DEVICE == cpu ]]; then
  BUDGET_S=${BUDGET_S:-1500}
  MODEL=${MODEL:-qwen2.5-coder-0.5b-instruct}
  MODE=(--device cpu --dtype bfloat16)
  SIZE=(--num-prompts "${INV_PROMPTS:-2}" --output-len "${INV_LEN:-8}")
else
  BUDGET_S=${BUDGET_S:-360}
  MODEL=${MODEL:-qwen2.5-coder-1.5b-instruct}
  MODE=(--dtype bfloat16 --batch-invariant)
  SIZE=(--num-prompts "${INV_PROMPTS:-32}" --output-len "${INV_LEN:-256}")
fi
elapsed() { echo $(( $(date +%s) - T0 )); }
job() {  # job NAME END CMD...: run CMD with a timeout that ends END s after the start; $OUT/NAME.{log,rc}
  local name=$1 end=$2 t=$(date +%s)
  shift 2
  local limit=$(( end - (t - T0) ))
  if (( limit < 5 )); then echo "124 0 skipped" > "$OUT/$name.rc"; return; fi
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$? $(( $(date +%s) - t ))" > "$OUT/$name.rc"
}
show() {  # show NAME: the exit status, the time and the tail of a finished job's log
  echo "=== $1: rc $(cut -d' ' -f1 "$OUT/$1.rc") in $(cut -d' ' -f2 "$OUT/$1.rc")s"
  grep -v "^\s*$" "$OUT/$1.log" | grep -v "it/s\]$" | tail -n "${TAIL:-12}"
}

# 0. The models into the cache (staged copies) and their bf16 dequantized caches, built once here rather
#    than by every process at the same time.
if [[ $DEVICE == cuda ]]; then
  job pull 90 bash -c "${CLI[*]} pull $MODEL && ${CLI[*]} pull $DRAFT"; show pull
  job warm 150 python3 -c "
import torch
from verispec.loader.model_loader import load_model
for name in ('$MODEL', '$DRAFT'):
    load_model(name, torch.device('cuda'), torch.bfloat16, progress=False)
print('bf16 dequantized caches ready')"
  show warm
fi
END=$(( BUDGET_S - 15 ))  # every job ends by then; the summaries follow

# (c) The gate suite in bf16 + batch_invariant beside the benches (its own processes and pool).
if [[ ${SKIP_GATES:-0} != 1 ]]; then
  GATE_ARGS=() PAR=${PAR:-8}
  [[ $DEVICE == cpu ]] && GATE_ARGS=(--device cpu) PAR=2
  OUT=$OUT/gates GATES_PHASE=A GATE_DTYPE=bfloat16 INV_BENCH=0 FAULTS_CPU=1 PAR=$PAR SHARD=${SHARD:-5} \
    BUDGET_S=$(( END - $(elapsed) + 75 )) A_END=$(( END - $(elapsed) )) \
    TEST_FILES="tests/test_faults.py tests/test_real_model_spec.py tests/test_spec_decode.py" \
    scripts/gpu_gates.sh "${GATE_ARGS[@]}" > "$OUT/gates.txt" 2>&1 &
fi

# (a)+(b) bench invariance, 3 processes side by side.
if [[ ${SKIP_INV:-0} != 1 ]]; then
  INV=(bench invariance --model "$MODEL" "${MODE[@]}" --prompts $PROMPTS --chat "${SIZE[@]}" -k "${K:-3}"
       --no-adaptive --loops sync,async --loop-batch-sizes "${LOOP_BATCHES:-16,64}")
  job inv_plain "$END" "${CLI[@]}" "${INV[@]}" --methods none --batch-sizes 1,16,64 --copies "${PLAIN_COPIES:-2}" \
    --json "$OUT/inv_plain.json" &
  job inv_ngram_self "$END" "${CLI[@]}" "${INV[@]}" --methods ngram,self --batch-sizes 1,16 \
    --json "$OUT/inv_ngram_self.json" &
  models=(draft_model --draft-model "$DRAFT")
  [[ ${SKIP_DFLASH:-0} != 1 ]] && models=(draft_model,dflash --draft-model "$DRAFT" --dflash-model "${DFLASH:-random}")
  job inv_draft_dflash "$END" "${CLI[@]}" "${INV[@]}" --methods "${models[@]}" --batch-sizes 1,16 \
    --json "$OUT/inv_draft_dflash.json" &
fi
wait
echo "=== all jobs done at $(elapsed)s"
if [[ ${SKIP_INV:-0} != 1 ]]; then
  for name in inv_plain inv_ngram_self inv_draft_dflash; do TAIL=4 show $name; done
  echo "=== (a) + (b): bench invariance, bf16$([[ $DEVICE == cuda ]] && echo ' + --batch-invariant'), $MODEL"
  python3 scripts/gpu_gates_summary.py invariance "$OUT"/inv_plain.json "$OUT"/inv_ngram_self.json \
    "$OUT"/inv_draft_dflash.json
fi
if [[ ${SKIP_GATES:-0} != 1 ]]; then
  echo "=== (c): the gate suite in bf16 + batch_invariant (scripts/gpu_gates.sh phase A; log $OUT/gates.txt)"
  grep -v "^\s*$" "$OUT/gates.txt" | tail -n "${GATES_TAIL:-60}"
fi
echo "=== total $(elapsed)s (budget ${BUDGET_S}s)"
