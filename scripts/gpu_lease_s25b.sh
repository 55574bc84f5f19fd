#!/usr/bin/env bash
# Session 25's second lease, with ~950 s of device time left: the 0.5B only (10 chunks). First the CUDA parity
# cells with session 20's capture fix (worker/graphs.py), never run on a GPU yet; then the gguf path's greedy
# parity at one row with the one-row Q4_K GEMV (KernelOptions.gguf_gemv1; the 0.5B has 12 Q4_K layers) and
# without, and the batch-1 step profile both ways.
# Send with scripts/lease_chunk.sh scripts/gpu_lease_s25b.sh qwen2.5-coder-0.5b-instruct NN [SHA], then poll.
set -uo pipefail
R=/tmp/burst
mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache VERISPEC_STAGE_CACHE=/tmp/models PYTHONUNBUFFERED=1
D=qwen2.5-coder-0.5b-instruct
V="python3 -m verispec.entrypoints.cli"
G=/tmp/models/$D.gguf
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
mark start
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
t=0
until [ -f "$G.ok" ]; do sleep 2; t=$((t + 2)); [ $t -ge 400 ] && { mark "not staged"; exit 1; }; done
mark "staged $D"
timeout 300 python3 -m pytest -o addopts= -v -rfE --tb=short -m gpu -p no:cacheprovider tests/test_real_model_spec.py \
  -k parity > "$R/parity_fixed.log" 2>&1
mark "parity fixed rc=$? $(tail -1 "$R/parity_fixed.log")"
timeout 120 python3 scripts/quant_parity.py $G --device cuda --tokens 64 --prompts 8 --batch1 --gguf-gemv1 \
  > "$R/quant_parity_gemv1.log" 2>&1
mark "quant parity gemv1 rc=$?"
mark end
