#!/usr/bin/env bash
# Issue 18 on the H200, one call of at most 4 minutes (BUDGET_S=240; expected ~3.5 min):
#   A. in parallel (PAR processes at a time, by ~A_END s): the acceptance gates on the GPU path, i.e. every
#      `-m gpu` cell of tests/test_faults.py, test_real_model_spec.py, test_spec_decode.py (the real 0.5B in
#      float32 with CUDA graphs, the overlapped loop and the Triton kernels) and test_batch_invariance.py
#      (bf16 kernels and engine with batch_invariant=True), each file cut into processes of <= SHARD cells
#      so that a device-side assert loses one process only, every cell's outcome and failure text logged
#      as it happens (scripts/pytest_live_log.py); beside them `bench invariance` on 32 held-out prompts x
#      INV_LEN (256) tokens, chat-rendered, none/ngram/self at batch 1 and 16 against plain decoding at
#      batch 1, in bf16 (the default) and bf16 + --batch-invariant (nothing timed there);
#   B. then alone (timed): the cost of --batch-invariant, `bench throughput` at 1, 64 and 256 sequences of
#      128 + 256 tokens without and with it (random weights in COST_MODEL's shapes, default the 1.5B's:
#      the README's speed figures; median of 3 runs).
# usage (repo root): PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache scripts/gpu_gates.sh [--device cpu]
#   The 0.5B is /tmp/models/qwen2.5-coder-0.5b-instruct.gguf (the lead stages it; registry lookups adopt it
#   through VERISPEC_STAGE_CACHE). --device cpu: a dry run on this machine (the same collection and process
#   plan with --collect-only, one real CPU process through the live log, the benches on 2-layer random
#   weights; --batch-invariant is refused on the CPU, as it must be).
# Output: compact tables here; logs, live logs and JSON under $OUT (default /tmp/gates_out, or the run tool's).
# env: GATES_PHASE (AB: both; A or B: one, e.g. A beside a training run and B alone later), BUDGET_S, A_END (seconds after start when phase A is cut, default BUDGET_S - 75), PAR (10), SHARD (5),
#      INV_LEN (256), COST_MODEL (qwen2.5-coder-1.5b-instruct), TEST_FILES (the four above),
#      GATE_DTYPE (float32; bfloat16: the gate cells in bf16 with batch_invariant=True, pytest --gate-dtype),
#      INV_BENCH (1; 0 skips the two bench invariance jobs of phase A), FAULTS_CPU (0; 1 also runs
#      tests/test_faults.py's CPU cells as one process, for the fault table: gpu_gates_summary.py faults).
set -uo pipefail
DEVICE=cuda
[[ "${1:-}" == "--device" ]] && DEVICE=${2:?--device needs cpu or cuda}
OUT=${OUT:-/tmp/gates_out}
mkdir -p "$OUT/tests"
rm -f "$OUT"/tests/*.ids "$OUT"/tests/*.live "$OUT"/tests/*.rc "$OUT"/tests/*.log
export VERISPEC_STAGE_CACHE=${VERISPEC_STAGE_CACHE:-/tmp/models} PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD/scripts  # scripts/: the live-log plugin
NAME=qwen2.5-coder-0.5b-instruct
PROMPTS=prompts/heldout_requests.jsonl
TEST_FILES=${TEST_FILES:-tests/test_faults.py tests/test_real_model_spec.py tests/test_spec_decode.py tests/test_batch_invariance.py}
SHARD=${SHARD:-5}
CLI=(python3 -m verispec.entrypoints.cli)
GATE_DTYPE=${GATE_DTYPE:-float32}
PYTEST=(python3 -m pytest -o addopts= -v -rfE --tb=short -p no:cacheprovider -p pytest_live_log --gate-dtype "$GATE_DTYPE")
PYTEST_GPU=("${PYTEST[@]}" -m gpu)  # -m gpu: also the cells marked slow (addopts deselects those)
T0=$(date +%s)
if [[ $DEVICE == cpu ]]; then
  BUDGET_S=${BUDGET_S:-1800}
  TINY='{"hidden_size":64,"intermediate_size":128,"num_layers":2,"num_heads":4,"num_kv_heads":2,"head_dim":16}'
  INV_MODEL=(--random-weights --model $NAME --model-overrides "$TINY" --device cpu)
  COST=(--random-weights --model $NAME --model-overrides "$TINY" --device cpu --num-seqs 1,4 --sweep-input-len 8
        --sweep-output-len 4 --repeats 1)
  INV_SIZE=(--num-prompts 3 --output-len 4 --batch-sizes 1,3)
  COLLECT_ONLY=(--collect-only)
  PAR=${PAR:-3}
else
  BUDGET_S=${BUDGET_S:-240}
  INV_MODEL=(--model "${MODEL:-$NAME}")  # the name, not the staged path: the warm step's dequantized cache
  COST=(--random-weights --model "${COST_MODEL:-qwen2.5-coder-1.5b-instruct}" --num-seqs 1,64,256
        --sweep-input-len 128 --sweep-output-len 256 --repeats 3)
  INV_SIZE=(--num-prompts 32 --output-len "${INV_LEN:-256}" --batch-sizes 1,16)
  COLLECT_ONLY=()
  PAR=${PAR:-10}
fi
A_END=${A_END:-$(( BUDGET_S - 75 ))}
elapsed() { echo $(( $(date +%s) - T0 )); }

job() {  # job NAME DIR END CMD...: run CMD with a timeout that ends END s after the start; DIR/NAME.{log,rc}
  local name=$1 dir=$2 end=$3 t=$(date +%s)
  shift 3
  local limit=$(( end - (t - T0) ))
  if (( limit < 5 )); then echo "124 0 skipped" > "$dir/$name.rc"; return; fi
  LIVE_LOG=$dir/$name.live timeout -k 5 "$limit" "$@" > "$dir/$name.log" 2>&1
  echo "$? $(( $(date +%s) - t ))" > "$dir/$name.rc"
}
pool() { while (( $(jobs -rp | wc -l) >= PAR )); do wait -n; done; }  # wait for a free slot
show() {  # show NAME DIR: the exit status, the time and the tail of a finished job's log
  echo "=== $1: rc $(cut -d' ' -f1 "$2/$1.rc") in $(cut -d' ' -f2 "$2/$1.rc")s"
  grep -v "^\s*$" "$2/$1.log" | grep -v "it/s\]$" | tail -n "${TAIL:-12}"
}

PHASE=${GATES_PHASE:-AB}
if [[ $PHASE == *A* ]]; then
# 0. The model into the cache (staged copy), the float32 and bf16 dequantized caches built once, not by
#    every process at the same time.
if [[ $DEVICE == cuda ]]; then
  job pull "$OUT" 60 "${CLI[@]}" pull $NAME; show pull "$OUT"
  job warm "$OUT" 90 python3 -c "
import torch
from verispec.loader.model_loader import load_model
for dt in (torch.float32, torch.bfloat16)[int('$GATE_DTYPE' == 'bfloat16'):]:
    load_model('$NAME', torch.device('cuda'), dt, progress=False)
print('dequantized caches ready')"
  show warm "$OUT"
fi

# A. The process plan: each file's -m gpu cells in chunks of SHARD, longest jobs (the benches) first.
# shellcheck disable=SC2086
python3 -m pytest -o addopts= --collect-only -q -m gpu -p no:cacheprovider --gate-dtype "$GATE_DTYPE" $TEST_FILES > "$OUT/collect.log" 2>&1
grep "::" "$OUT/collect.log" > "$OUT/cells.txt"
echo "=== plan: $(wc -l < "$OUT/cells.txt") cells of $(echo $TEST_FILES | wc -w) files; $(( $(elapsed) ))s so far"
for f in $TEST_FILES; do
  base=$(basename "$f" .py) n=$SHARD
  [[ $base == test_batch_invariance ]] && n=1000  # ~15 s of kernel tests: one process
  grep "^$f::" "$OUT/cells.txt" | split -l "$n" -d - "$OUT/tests/${base#test_}_"
done
for chunk in "$OUT"/tests/*_[0-9][0-9]; do mv "$chunk" "$chunk.ids"; done
INV=(bench invariance "${INV_MODEL[@]}" --prompts $PROMPTS --chat "${INV_SIZE[@]}" --methods none,ngram,self -k 3
     --dtype bfloat16)
if [[ ${INV_BENCH:-1} == 1 ]]; then
  pool; job inv_bf16_invariant "$OUT" "$A_END" "${CLI[@]}" "${INV[@]}" --batch-invariant --json "$OUT/inv_bf16_bi.json" &
  pool; job inv_bf16 "$OUT" "$A_END" "${CLI[@]}" "${INV[@]}" --json "$OUT/inv_bf16.json" &
fi
if [[ ${FAULTS_CPU:-0} == 1 ]]; then  # the fault gates' CPU cells (tiny models), the table's CPU column
  python3 -m pytest -o addopts= --collect-only -q -m "not gpu" -p no:cacheprovider tests/test_faults.py 2>/dev/null \
    | grep "::" > "$OUT/tests/faults_cpu.ids"
  [[ $DEVICE == cpu ]] && grep -E "::test_(row_by_position|placeholder_leak)_caught" "$OUT/tests/faults_cpu.ids" \
    > "$OUT/tests/faults_cpu.tmp" && mv "$OUT/tests/faults_cpu.tmp" "$OUT/tests/faults_cpu.ids"  # dry run: 2 cells
fi
for ids in "$OUT"/tests/*.ids; do
  pool
  mapfile -t cells < "$ids"
  if [[ $(basename "$ids") == faults_cpu.ids ]]; then
    job faults_cpu "$OUT/tests" "$A_END" "${PYTEST[@]}" -m "not gpu" "${cells[@]}" &
  else
    job "$(basename "$ids" .ids)" "$OUT/tests" "$A_END" "${PYTEST_GPU[@]}" "${COLLECT_ONLY[@]}" "${cells[@]}" &
  fi
done
if [[ $DEVICE == cpu ]]; then  # one real run through the live log and the summary (CPU cells, ~20 s)
  echo "tests/test_faults.py::test_early_prefix_publish_caught_whatever_the_block_count[16]" > "$OUT/tests/cpu_live.ids"
  pool; job cpu_live "$OUT/tests" "$A_END" "${PYTEST[@]}" "$(cat "$OUT/tests/cpu_live.ids")" &  # a CPU cell: no -m gpu
fi
wait
echo "=== A done at $(elapsed)s: the gates (one line per process; lost = aborted or never started)"
[[ $DEVICE == cpu ]] && echo "(dry run: the GPU cells' processes only collected them, rc 0 = every cell id found)"
python3 scripts/gpu_gates_summary.py tests "$OUT/tests"
[[ ${FAULTS_CPU:-0} == 1 ]] && python3 scripts/gpu_gates_summary.py faults "$OUT/tests"
if [[ ${INV_BENCH:-1} == 1 ]]; then
  TAIL=9 show inv_bf16 "$OUT"
  TAIL=9 show inv_bf16_invariant "$OUT"
fi

fi
# B. The cost of --batch-invariant, alone on the GPU.
[[ $PHASE == *B* ]] || { echo "=== total $(elapsed)s (phase A only)"; exit 0; }
for bi in no-batch-invariant batch-invariant; do
  end=$BUDGET_S
  [[ $bi == no-batch-invariant ]] && end=$(( ($(elapsed) + BUDGET_S) / 2 ))  # half of what is left each
  job "cost_$bi" "$OUT" "$end" "${CLI[@]}" bench throughput "${COST[@]}" "--$bi" --json "$OUT/tput_$bi.json"
  TAIL=6 show "cost_$bi" "$OUT"
done
python3 scripts/gpu_gates_summary.py cost "$OUT/tput_no-batch-invariant.json" "$OUT/tput_batch-invariant.json"
echo "=== total $(elapsed)s (budget ${BUDGET_S}s)"
