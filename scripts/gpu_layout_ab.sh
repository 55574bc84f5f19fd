#!/usr/bin/env bash
# The 0.2 layout's "no behaviour change" check on the H200, one call: the old tree (BASE, e.g. a
# `git archive ef0d21f` under .device-carry/base) against this one, alternating, random weights in
# the 1.5B's / 0.5B's exact shapes (speed does not depend on the weights' values).
# usage: EXTRA_PYTHONPATH=/tmp/site scripts/gpu_layout_ab.sh BASE
set -uo pipefail
base=$1
R="--random-weights --model qwen2.5-coder-1.5b-instruct"
ab() { scripts/ab_trees.sh "$@"; }
ab 2 "$base" . bench latency $R --batch-sizes 1 --input-len 128 --output-len 256 --num-iters 3
ab 1 "$base" . bench throughput $R --num-seqs 64,256 --repeats 3
spec="bench spec $R --draft-model qwen2.5-coder-0.5b-instruct --methods none,ngram,draft_model --batch-sizes 1,16 --num-prompts 16 --output-len 128 --prompts humaneval.jsonl"
for tree in "$base" .; do
  extra=""; [[ $tree == . ]] && extra="--no-adaptive --repeats 1"
  echo "=== tree $tree: verispec $spec $extra"
  (cd "$tree" && PYTHONPATH="$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" python3 -m verispec.entrypoints.cli $spec $extra) 2>&1 | grep -v "^\s*$" | tail -n 12
done
echo "=== tree . (adaptive): verispec $spec --repeats 1"
PYTHONPATH="$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" python3 -m verispec.entrypoints.cli $spec --repeats 1 2>&1 | grep -v "^\s*$" | tail -n 12
