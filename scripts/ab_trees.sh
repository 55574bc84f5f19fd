#!/usr/bin/env bash
# Same-call A/B of two source trees: run one `verispec` command line in tree A, then B, for R rounds.
# usage: scripts/ab_trees.sh ROUNDS TREE_A TREE_B VERISPEC-ARGS...
#   e.g. scripts/ab_trees.sh 2 .device-carry/base . bench latency --random-weights --batch-sizes 1
# Each run is its own process (python3 -m verispec.entrypoints.cli) with PYTHONPATH=TREE plus
# $EXTRA_PYTHONPATH (the carried wheels), so the trees never mix; output goes to stdout, labelled.
set -uo pipefail
rounds=$1; a=$2; b=$3; shift 3
for r in $(seq 1 "$rounds"); do
  for tree in "$a" "$b"; do
    echo "=== round $r tree $tree: verispec $*"
    (cd "$tree" && PYTHONPATH="$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" python3 -m verispec.entrypoints.cli "$@") 2>&1 \
      | grep -v "^\s*$" | tail -n 25
  done
done
