#!/usr/bin/env bash
# Speculation on real weights on the H200: every method against plain decoding in the same process,
# adaptive (the default) and with k pinned, on any prompts files (chat-rendered).
# usage: PYTHONPATH=/tmp/site:$PWD scripts/gpu_spec_real.sh TARGET.gguf DRAFT.gguf PROMPTS.jsonl [PROMPTS.jsonl ...]
# env: BATCHES (default 1,4,16,64), NUM_PROMPTS (32), OUTPUT_LEN (256), REPEATS (1), METHODS (none,ngram,draft_model),
#      MODES ("--adaptive --no-adaptive")
set -uo pipefail
m=$1; d=$2; shift 2
for prompts in "$@"; do
  for mode in ${MODES:---adaptive --no-adaptive}; do
    echo "=== $prompts $mode"
    python3 -m verispec.entrypoints.cli bench spec --model "$m" --draft-model "$d" \
      --methods "${METHODS:-none,ngram,draft_model}" --batch-sizes "${BATCHES:-1,4,16,64}" \
      --prompts "$prompts" --num-prompts "${NUM_PROMPTS:-32}" --output-len "${OUTPUT_LEN:-256}" \
      --repeats "${REPEATS:-1}" --chat $mode --json "${OUT:-/tmp}/spec_$(basename "$prompts" .jsonl)${mode}.json" 2>&1 \
      | grep -v "^\s*$" | tail -n 40
  done
done
