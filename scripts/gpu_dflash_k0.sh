#!/usr/bin/env bash
# Issue 17, what DFlash costs while the policy plans k = 0: an untrained (random) drafter, so the policy
# settles at k = 0 and the dflash row is what k = 0 (plus its probes) costs against plain decoding, measured
# in the same process. Session 13 change: the owed context of undrafted steps is kept as spans over the
# steps' captured tensors (no device op per k = 0 step, one gather per context forward), and a finished
# request's owed rows wait (complete blocks, which a prefix hit may read) or are dropped (its last block).
# CPU, tiny model, scripts/dflash_k0.py (200 steps, proposer host ms per step, context forwards):
#   before (563aeba): b1 0.05 ms, b64 0.61 ms, 110 context forwards
#   after: b1 0.03 ms, b64 0.30 ms, 6 context forwards
# GPU budget: ~2 minutes (random 1.5B weights, no model file; 3 methods x 2 batch sizes x warm-up + 1 timed
# run, 24 x 128 tokens), at most 6 minutes (timeout 360 s). Then the CPU host-time probe (~1 min).
#
# usage (repo root): PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache scripts/gpu_dflash_k0.sh
# CPU dry run (tiny sizes; checks the command line):
#   DEVICE=cpu CONFIG='{"num_layers": 2}' NUM_PROMPTS=2 OUTPUT_LEN=6 BATCHES=1,2 scripts/gpu_dflash_k0.sh
#
# Before (session 12 code, H200): b1 none 894.7 tok/s, dflash 848.5 = 0.95x (p50 1.12 vs 1.10 ms); b64 none
# 21,940, dflash 19,757 = 0.90x (p50 1.99 vs 1.92 ms). What went: (1) a finished request's owed rows were
# taken out of every owed chunk with one index upload + gather each (~32 chunks per finished request at b64,
# ~0.5 finishes per step: ~0.3 ms of host per step, the b64 loss), then written in one context forward per
# step with finishes; now host bookkeeping only and no forward (rows wait for the next flush); (2) every step at
# k = 0 ran a clone per captured layer (5) plus a cat, now one copy (graphs.private_rows) and nothing in
# the proposer; (3) probes no closer than probe_floor(batch) (~100 plain steps on the H200's costs) instead
# of 8, 16, 32, 64; (4) the policy's best_k sums per column. Prediction: b1 >= 0.98x (p50 within 0.01 ms
# of none), b64 >= 0.97x; ngram unchanged (1.00x / 1.05x).
set -uo pipefail
extra=()
if [ -n "${CONFIG:-}" ]; then extra+=(--model-overrides "$CONFIG"); fi
echo "=== bench spec, random weights, dflash k = 0, device ${DEVICE:-cuda}"
timeout "${TIMEOUT:-360}" python3 -m verispec.entrypoints.cli bench spec --random-weights \
  --model "${TARGET:-qwen2.5-coder-1.5b-instruct}" --device "${DEVICE:-cuda}" --methods none,ngram,dflash \
  --dflash-model random --batch-sizes "${BATCHES:-1,64}" --num-prompts "${NUM_PROMPTS:-24}" \
  --output-len "${OUTPUT_LEN:-128}" --repeats 1 --waves 2 "${extra[@]}" 2>&1 | tail -n 30
echo "=== host time per k = 0 step (CPU, tiny model): proposer ms/step, context forwards"
timeout 300 python3 scripts/dflash_k0.py --steps 200 --repeats 2 2>&1 | tail -n 4
