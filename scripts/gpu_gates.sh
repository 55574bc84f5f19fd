#!/usr/bin/env bash
# Issue 18 on the H200, one call: the acceptance gates on the GPU path (-m gpu cells of the parity, oracle,
# counter and fault gates: the real 0.5B in float32 with CUDA graphs + Triton; the batch-invariance kernel
# and engine tests in bf16), the batch-invariance measurement (bench invariance: bf16, float32,
# bf16 + --batch-invariant; 32 held-out prompts x 128 tokens, chat-rendered, none/ngram/self at batch 1
# and 16 against plain decoding at batch 1), and the cost of --batch-invariant (bench latency at batch 1,
# bench throughput at 64 and 256 sequences of 128 + 128 tokens).
# Budget: <= 6 min in total on the H200: every step has its own timeout (below), cut further so that the
# whole call ends by BUDGET_S (default 360 s) after it starts; steps run most important first.
# usage (repo root): PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache scripts/gpu_gates.sh [--device cpu]
#   the 0.5B is taken from /tmp/models/qwen2.5-coder-0.5b-instruct.gguf (the lead stages it; the tests'
#   registry lookups adopt it through VERISPEC_STAGE_CACHE). --device cpu: a dry run of every command on
#   this machine's CPU with tiny sizes (test collection only; benches on 2-layer random weights).
# Results: compact tails here; full logs and JSON under $OUT (default /tmp/gates_out, or the run tool's $OUT).
set -uo pipefail
DEVICE=cuda
[[ "${1:-}" == "--device" ]] && DEVICE=${2:?--device needs cpu or cuda}
OUT=${OUT:-/tmp/gates_out}
mkdir -p "$OUT"
export VERISPEC_STAGE_CACHE=${VERISPEC_STAGE_CACHE:-/tmp/models}
NAME=qwen2.5-coder-0.5b-instruct
M=${MODEL:-/tmp/models/$NAME.gguf}
PROMPTS=prompts/heldout_requests.jsonl
T0=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD...: run, keep the log, print the exit status, the time and the tail
  local name=$1 limit=$2 t=$(date +%s)
  shift 2
  local left=$(( BUDGET_S - (t - T0) ))
  (( left < limit )) && limit=$left
  if (( limit < 5 )); then echo "=== $name: skipped (the ${BUDGET_S}s budget is spent)"; return; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t ))s (limit ${limit}s; total $(( $(date +%s) - T0 ))s)"
  grep -v "^\s*$" "$OUT/$name.log" | grep -v "it/s\]$" | tail -n "${TAIL:-14}"
}
CLI=(python3 -m verispec.entrypoints.cli)  # an array, not a function: timeout runs it

if [[ $DEVICE == cpu ]]; then
  BUDGET_S=${BUDGET_S:-3600}
  TINY='{"hidden_size":64,"intermediate_size":128,"num_layers":2,"num_heads":4,"num_kv_heads":2,"head_dim":16}'
  W=(--random-weights --model $NAME --model-overrides "$TINY" --device cpu)
  step collect 120 python3 -m pytest -q --co -m gpu tests/test_batch_invariance.py tests/test_faults.py \
    tests/test_spec_decode.py tests/test_real_model_spec.py
  for mode in "bfloat16" "float32"; do
    step "invariance_$mode" 300 "${CLI[@]}" bench invariance "${W[@]}" --dtype "$mode" --prompts $PROMPTS --chat \
      --num-prompts 3 --output-len 4 --batch-sizes 1,3 --methods none,ngram,self -k 3 --json "$OUT/inv_$mode.json"
  done
  step invariance_bf16_invariant 120 "${CLI[@]}" bench invariance "${W[@]}" --dtype bfloat16 --batch-invariant \
    --prompts $PROMPTS --num-prompts 2 --output-len 2  # on the CPU: refused (needs CUDA)
  step cost_latency 300 "${CLI[@]}" bench latency "${W[@]}" --batch-sizes 1 --input-len 8 --output-len 4 --num-iters 1
  step cost_throughput 300 "${CLI[@]}" bench throughput "${W[@]}" --num-seqs 4 --sweep-input-len 8 --sweep-output-len 4 \
    --repeats 1
  exit 0
fi

BUDGET_S=${BUDGET_S:-360}
step pull 30 "${CLI[@]}" pull $NAME
# 1. The gates. Kernel + engine invariance (bf16) and every planted fault's gate first, then the real-model
#    parity matrix, oracle and counters. -v: each cell's verdict is printed as it finishes, so a timeout
#    still shows what passed.
TAIL=40 step gates_faults_invariance 120 python3 -m pytest -m gpu -v -rfE -p no:cacheprovider \
  tests/test_batch_invariance.py tests/test_faults.py
TAIL=40 step gates_parity 75 python3 -m pytest -m gpu -v -rfE -p no:cacheprovider \
  tests/test_real_model_spec.py tests/test_spec_decode.py
# 2. Batch invariance on 32 held-out prompts x 128 tokens: bf16 (the default), float32, bf16 + --batch-invariant.
INV=(bench invariance --model "$M" --prompts $PROMPTS --chat --num-prompts 32 --output-len 128 --batch-sizes 1,16
     --methods none,ngram,self -k 3)
step invariance_bf16 45 "${CLI[@]}" "${INV[@]}" --dtype bfloat16 --json "$OUT/inv_bf16.json"
step invariance_fp32 55 "${CLI[@]}" "${INV[@]}" --dtype float32 --json "$OUT/inv_fp32.json"
step invariance_bf16_invariant 50 "${CLI[@]}" "${INV[@]}" --dtype bfloat16 --batch-invariant --json "$OUT/inv_bf16_bi.json"
# 3. The cost of --batch-invariant (bf16, real weights): batch-1 decode, and 64 / 256 sequences.
for bi in --no-batch-invariant --batch-invariant; do
  step "cost_latency$bi" 20 "${CLI[@]}" bench latency --model "$M" $bi --batch-sizes 1 --input-len 128 --output-len 128 \
    --num-iters 2 --json "$OUT/lat$bi.json"
  step "cost_throughput$bi" 30 "${CLI[@]}" bench throughput --model "$M" $bi --num-seqs 64,256 --sweep-input-len 128 \
    --sweep-output-len 128 --repeats 1 --json "$OUT/tput$bi.json"
done
echo "=== total $(( $(date +%s) - T0 ))s"
