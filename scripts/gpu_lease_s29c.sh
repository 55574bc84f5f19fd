#!/usr/bin/env bash
# Session 29's lease, call C (after the defaults follow call A / B): batch-1 decode end to end (bench latency,
# gguf against bf16 random weights, one process each, the same call) and the GGUF GPU tests on the new defaults.
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
timeout 120 $V bench latency --model "$G" --quantization gguf --device cuda --batch-sizes 1 --input-len 128 \
  --output-len 256 --num-iters 3 > "$R/latency_gguf.log" 2>&1
echo "latency gguf rc=$? at $(( $(date +%s) - t0 )) s"
timeout 120 $V bench latency --model $M --random-weights --quantization none --device cuda --batch-sizes 1 \
  --input-len 128 --output-len 256 --num-iters 3 > "$R/latency_bf16.log" 2>&1
echo "latency bf16 rc=$? at $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m pytest -o addopts= -q -m gpu tests/test_gguf_matmul.py tests/test_quant_wiring.py \
  tests/test_batch_invariance.py > "$R/tests_gguf.log" 2>&1
echo "gguf tests rc=$? at $(( $(date +%s) - t0 )) s"; tail -4 "$R/tests_gguf.log"
for f in "$R"/latency_*.log; do echo "== $f"; grep -v "Warn\|_warn" "$f" | tail -12; done
