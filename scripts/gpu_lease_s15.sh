#!/usr/bin/env bash
# Session 15's first lease as one background job: issue 20's GGUF run (scripts/gpu_gguf_lease.sh, with bench
# throughput at 64 and 256 sequences for both quantization paths as its EXTRA), then issue 17's traced
# `bench spec` on both prompt sets (scripts/gpu_session.sh stages heldout and humaneval; no drafter is trained
# in this lease, so DFlash is left out). Results under /tmp/burst; progress in /tmp/burst/progress and
# /tmp/burst/gguf/progress. Start from a copy of the tree:
#   setsid nohup scripts/gpu_lease_s15.sh > /tmp/burst/driver.log 2>&1 < /dev/null &
set -uo pipefail
mkdir -p /tmp/burst/gguf
M=/tmp/models/qwen2.5-coder-1.5b-instruct.gguf
export EXTRA="for q in none gguf; do timeout 240 python3 -m verispec.entrypoints.cli bench throughput --model $M \
--device cuda --quantization \$q --num-seqs 64,256 --repeats 1 > /tmp/burst/gguf/throughput_\$q.log 2>&1; done"
R=/tmp/burst/gguf scripts/gpu_gguf_lease.sh
SKIP="gemma train tests gates invariance verify small_m cost structured inv_spec inv_dflash hint k0 quant_lite \
host_gap gguf quant" R=/tmp/burst scripts/gpu_session.sh
