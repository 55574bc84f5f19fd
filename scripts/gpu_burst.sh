#!/usr/bin/env bash
# Session 12's H200 burst as one background job: first the random-weights probe of the speculative bench
# (no model files needed, while the Qwen files are staged: none / ngram / dflash with an untrained
# drafter at batch 1, 4, 16, 64, the figures to set beside scripts/gpu_probe.sh's from before the
# prefill graphs and the batched DFlash frees), then scripts/gpu_session.sh with TRAIN_MINUTES of
# training, the GPU tests beside it, and `bench spec` on the held-out requests and HumanEval-chat.
# env: R (/tmp/burst), TRAIN_MINUTES (8), SKIP (gpu_session.sh's stages to skip)
set -uo pipefail
export R=${R:-/tmp/burst}
mkdir -p "$R/probe"
export PYTHONPATH=/tmp/site:$PWD
echo "$(date +%T) probe" >> "$R/progress"
python3 -m verispec.entrypoints.cli bench spec --random-weights --model qwen2.5-coder-1.5b-instruct \
  --methods none,ngram,dflash --dflash-model random --batch-sizes 1,4,16,64 --num-prompts 32 --output-len 128 \
  --repeats 1 --json "$R/probe/spec_random.json" > "$R/probe/spec_random.log" 2>&1
echo "$(date +%T) probe done rc=$?" >> "$R/progress"
TRAIN_MINUTES=${TRAIN_MINUTES:-8} SKIP=${SKIP:-gemma gates verify small_m cost structured} exec scripts/gpu_session.sh
