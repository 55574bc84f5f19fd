#!/usr/bin/env bash
# Where the speculative bench's time goes, on random weights with the 1.5B's shapes (no model files needed;
# ~4 minutes on the H200): scripts/slow_steps.py at batch 1, 4 and 64 (what each slow step scheduled, GC in
# it, the host functions that grew over plain decoding), then `bench spec` over none / ngram / dflash (an
# untrained drafter: adaptive drafting should settle at k = 0, so its row is the cost of k = 0).
# env: R (results dir, default $OUT or /tmp/probe)
set -uo pipefail
R=${R:-${OUT:-/tmp/probe}}
mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD
M=qwen2.5-coder-1.5b-instruct
P="python3 scripts/slow_steps.py --random-weights --model $M --methods none,ngram,dflash --dflash-model random --top 30"
$P --batch-size 1 --num-prompts 16 --output-len 128 > "$R/slow_b1.txt" 2>&1
$P --batch-size 4 --num-prompts 24 --output-len 128 > "$R/slow_b4.txt" 2>&1
$P --batch-size 64 --num-prompts 96 --output-len 64 > "$R/slow_b64.txt" 2>&1
python3 -m verispec.entrypoints.cli bench spec --random-weights --model $M --methods none,ngram,dflash \
  --dflash-model random --batch-sizes 1,4,16,64 --num-prompts 32 --output-len 128 --repeats 1 \
  --json "$R/spec_random.json" > "$R/spec_random.log" 2>&1
echo done
