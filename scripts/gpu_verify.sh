#!/usr/bin/env bash
# Issue 17, "verification at the price of a decode step", on the H200 in one call: the small-M tensor-core
# kernels (kernels/small_m.py, KernelOptions.small_m_max_rows) against their references, then the batch-1
# verify / decode GPU-time ratio for k = 3, 7, 15 with and without them (CUDA-graph replays, random
# weights in the 1.5B's shapes, context 1024: scripts/step_ablation.py), then the real 0.5B's verify rows
# against its torch path, then (if the budget is left) small batched decode, per-layer kernel times and
# the per-kernel profile of an 8-token verify.
# Budget: <= 3 min on the H200 (BUDGET_S, default 180 s; each step has its own limit, cut so that the call
# ends by then; steps run most important first). Expected on a fresh machine (empty Triton cache): the ratio
# 60-100 s (~25 kernel compiles), the kernel tests 30-50 s; the 0.5B check (~40 s) needs BUDGET_S=240,
# step 4 (~2.5 min more) BUDGET_S=400.
# usage (repo root): PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache scripts/gpu_verify.sh [--device cpu]
#   the 0.5B is taken from /tmp/models/qwen2.5-coder-0.5b-instruct.gguf (VERISPEC_STAGE_CACHE, as
#   gpu_gates.sh). --device cpu: a dry run on this machine (the kernels' CPU tests in the interpreter, the
#   kernels compiled for sm_90 with registers and spills, the GPU tests collected, the ablation's variants
#   parsed on a tiny model, the CLI flags checked).
# Results: compact tails here; full logs under $OUT (default /tmp/verify_out, or the run tool's $OUT).
set -uo pipefail
DEVICE=cuda
[[ "${1:-}" == "--device" ]] && DEVICE=${2:?--device needs cpu or cuda}
OUT=${OUT:-/tmp/verify_out}
mkdir -p "$OUT"
export VERISPEC_STAGE_CACHE=${VERISPEC_STAGE_CACHE:-/tmp/models}
M=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
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
CLI=(python3 -m verispec.entrypoints.cli)
ABL=(python3 scripts/step_ablation.py --model $M --context 1024 --rounds 5 --reps 50)

if [[ $DEVICE == cpu ]]; then
  BUDGET_S=${BUDGET_S:-900}
  step cpu_kernels 600 python3 -m pytest -o addopts= -q tests/test_small_m.py
  step compile_sm90 300 python3 scripts/compile_check.py  # the kernels compiled for the H200 (no GPU needed)
  step collect 120 python3 -m pytest -o addopts= -q --co -m gpu tests/test_small_m.py
  step collect_decode 120 python3 -m pytest -o addopts= -q --co -m gpu tests/test_decode_gpu.py -k "small-m or one_row"
  step variants 120 python3 -c "
import sys; sys.path.insert(0, 'scripts'); sys.path.insert(0, 'tests')
import step_ablation as s
from tiny import tiny_model
m = tiny_model()
for v in ('base', 'small-m=16', 'small-m=8+no-pdl'):
    s.variant(m, v); print(v, m.kernels.options.small_m_max_rows, m.kernels.linear.__module__)
"
  step flags 60 "${CLI[@]}" bench profile --random-weights --model $M --device cpu --small-m-max-rows 17
  step help 60 python3 scripts/step_ablation.py --help
  exit 0
fi

BUDGET_S=${BUDGET_S:-180}
# 1. The ratio: batch 1, query 1 (decode) then 4 / 8 / 16 (k = 3 / 7 / 15), base vs the small-M path;
#    every row prints its replay time over base at query 1, and its max logit difference from base.
TAIL=20 step ratio 110 "${ABL[@]}" --batch-sizes 1 --query-len 1,4,8,16 --variants base,small-m=16
# 2. The kernels against torch float32 references (odd sizes, bf16; the 1.5B's down_proj and LM head), and
#    CUDA-graph replays of small-M steps (2-layer random model) equal to eager, close to the default path.
step kernels 70 python3 -m pytest -o addopts= -q -m gpu tests/test_small_m.py
# 3. The real 0.5B: verify rows (2, 5, 16 queries) on the small-M path vs the torch path, and the one-row
#    decode path (refactored into DecoderLayer._forward_fused) unchanged.
step pull 30 "${CLI[@]}" pull $D  # adopts /tmp/models' file (VERISPEC_STAGE_CACHE), as gpu_gates.sh
step decode_gpu 45 python3 -m pytest -o addopts= -q -m gpu tests/test_decode_gpu.py -k "small-m or one_row"
# 4. Only with a larger BUDGET_S (400): small batched decode (2..16 sequences also take the path),
#    the per-layer kernels (small-M vs one-row GEMV vs cuBLAS), the per-kernel profile of an 8-token verify.
step batched 40 "${ABL[@]}" --batch-sizes 4,16 --query-len 1 --variants base,small-m=16
TAIL=30 step linear 60 "${CLI[@]}" bench linear --random-weights --model $M --rows 1,4,8,16
TAIL=30 step profile 45 "${CLI[@]}" bench profile --random-weights --model $M --batch-sizes 1 --query-len 8 \
  --context 1024 --small-m-max-rows 16
echo "total $(( $(date +%s) - T0 ))s"
