#!/usr/bin/env bash
# Where a speculative step's time goes on the GPU (random weights in the 1.5B's shapes, no staging):
# step traces of plain decoding, ngram and self (the target drafting for itself) at batch 1 and 16,
# and the verify/decode GPU-time ratio at batch 1 (bench profile --query-len Q).
# usage: PYTHONPATH=$PWD scripts/gpu_spec_diag.sh [BATCHES] [QUERY_LENS]
set -uo pipefail
m=qwen2.5-coder-1.5b-instruct
for b in ${1:-1 16}; do
  for spec in none ngram self; do
    echo "=== step_trace batch $b spec $spec"
    timeout 240 python3 scripts/step_trace.py --model $m --batch "$b" --spec $spec --k 4 --output-len 40 --top 14 2>&1 \
      | grep -v "^\s*$" | tail -n 24
  done
done
for q in ${2:-1 4 8 16}; do
  echo "=== profile query_len $q"
  timeout 240 python3 -m verispec.entrypoints.cli bench profile --random-weights --model $m --query-len "$q" 2>&1 \
    | grep -v "^\s*$" | tail -n 14
done
