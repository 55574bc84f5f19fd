#!/usr/bin/env bash
# Session 29's lease, call A (no model staging: the 1.5B's GGUF header plus zeros, as gpu_lease_s26.sh).
# Issue 20, batch 1: kernels/gguf_gemv.py's new one-row kernels (the resident Q6_K GEMV, the resident form of the
# Q4_K one), no default changed yet:
#   1. their GPU tests (compiled, within the float32 bound at the 1.5B's shapes);
#   2. the batch-1 step (ctx 1024, bench profile): defaults, and with gguf_gemv1_q6k + gguf_gemv1_resident
#      (the per-kernel table separates the Q6_K and Q4_K kernels);
#   3. scripts/gguf_bench.py at one row, both resident forms' first-guess tiles (session 25 has the loop's).
# Call B is scripts/gpu_lease_s29b.sh (the tile sweep).
# carry: .whl, .device-carry/hdr
set -uo pipefail
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VERISPEC_CACHE_DIR=/tmp/vcache
R=${OUT:-/tmp/out}
mkdir -p "$R" /tmp/models
M=qwen2.5-coder-1.5b-instruct
G=/tmp/models/$M-zero.gguf
cp ".device-carry/hdr/$M.hdr" "$G" && truncate -s "$(cat ".device-carry/hdr/$M.size")" "$G"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
V="python3 -m verispec.entrypoints.cli"
timeout 110 python3 -m pytest -o addopts= -q -m gpu tests/test_gguf_gemv.py -k "not 12-False" > "$R/tests_gemv.log" 2>&1
echo "gemv tests rc=$? at $(( $(date +%s) - t0 )) s"; tail -5 "$R/tests_gemv.log"
for v in base q6k_res; do
  extra=""; [[ $v == q6k ]] && extra="--gguf-gemv1-q6k"; [[ $v == q6k_res ]] && extra="--gguf-gemv1-q6k --gguf-gemv1-resident"
  # shellcheck disable=SC2086
  timeout 55 $V bench profile --model "$G" --quantization gguf --device cuda --batch-sizes 1 --context 1024 \
    $extra > "$R/profile_b1_$v.log" 2>&1
  echo "profile b1 $v rc=$? at $(( $(date +%s) - t0 )) s"
done
left=$(( 290 - ($(date +%s) - t0) ))  # the per-layer bench only in the device time left to this call
if (( left > 30 )); then
  timeout $left python3 scripts/gguf_bench.py --rows 1 --qtypes Q4_K,Q6_K --sweep-qtypes '' --iters 50 --gemv1-q6k \
    --resident > "$R/bench_new.log" 2>&1
  echo "bench new rc=$? at $(( $(date +%s) - t0 )) s"
fi
for f in "$R"/bench_*.log; do echo "== $f"; grep -v "Warn\|_warn" "$f" | tail -16; done
for f in "$R"/profile_*.log; do echo "== $f"; grep -v "Warn\|_warn" "$f" | head -22; done
