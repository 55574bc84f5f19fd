#!/usr/bin/env bash
# Session 30's GPU call (issue 17: admission steps at batch 16 / 64), after staging the 1.5B:
#   ../shared/device/stage qwen2.5-coder-1.5b-instruct, then one run call per chunk (its dd command) and
#   `echo ok > /tmp/models/qwen2.5-coder-1.5b-instruct.gguf.ok` after the sha256 check.
# The same bench spec in the tree before this session's change (.device-carry/base30: `git archive 88c2183 |
# tar -x -C .device-carry/base30`) and in this one, interleaved through scripts/ab_trees.sh, HumanEval-chat and
# the held-out requests, ngram against plain decoding at 16 and 64, with step traces (BENCHMARKS "Session 30:
# admission steps, predictions"). carry: .whl, .device-carry/base30
set -uo pipefail
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export EXTRA_PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VERISPEC_CACHE_DIR=/tmp/vcache VERISPEC_STAGE_CACHE=/tmp/models
R=${OUT:-/tmp/out}
mkdir -p "$R"
M=/tmp/models/qwen2.5-coder-1.5b-instruct.gguf
[ -f "$M.ok" ] || { echo "the 1.5B is not staged"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpu.txt" 2>&1
cp humaneval.jsonl .device-carry/base30/ 2>/dev/null
for set in humaneval:humaneval.jsonl heldout:prompts/heldout_requests.jsonl; do
  name=${set%%:*}; file=${set#*:}
  for tree in .device-carry/base30 .; do
    tag=$([[ $tree == . ]] && echo new || echo base)
    (cd "$tree" && PYTHONPATH="$PWD:/tmp/site" timeout 240 python3 -m verispec.entrypoints.cli bench spec --model "$M" \
      --methods none,ngram --batch-sizes 16,64 --prompts "$file" --num-prompts 32 --output-len 256 --repeats 1 --chat \
      --json "$R/spec_${name}_$tag.json" --trace-steps "$R/trace_${name}_$tag") > "$R/spec_${name}_$tag.log" 2>&1
    echo "spec $name $tag rc=$? at $(( $(date +%s) - t0 )) s"
    grep -E "^(none|ngram) " "$R/spec_${name}_$tag.log"
  done
done
