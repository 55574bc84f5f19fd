#!/usr/bin/env bash
# Session 26's lease in one call, no model staging: the 1.5B's GGUF header (carried, 5.9 MB) with zero bytes
# for its tensor data makes a file of the real tensor types and shapes (the step's time does not depend on the
# weights' values). On it, the batch-1 step profile with the one-row Q4_K GEMV (KernelOptions.gguf_gemv1) and
# with the old GEMV, beside bf16 random weights; then the speculative path's GPU gates on tiny models
# (scripts/gpu_spec_gates_tiny.sh's selection) with the time left, and the GGUF kernel tests.
# carry: .whl, .device-carry/hdr   (make the headers: see docs/BENCHMARKS.md "Session 26")
set -uo pipefail
t0=$(date +%s)
left() { echo $(( ${BUDGET:-520} - ($(date +%s) - t0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VERISPEC_CACHE_DIR=/tmp/vcache
R=${OUT:-/tmp/out}
mkdir -p "$R" /tmp/models
M=qwen2.5-coder-1.5b-instruct
G=/tmp/models/$M-zero.gguf
cp ".device-carry/hdr/$M.hdr" "$G" && truncate -s "$(cat ".device-carry/hdr/$M.size")" "$G"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
V="python3 -m verispec.entrypoints.cli"
for v in gemv1 old bf16; do
  case $v in
    gemv1) a=(--model "$G" --quantization gguf --gguf-gemv1) ;;
    old) a=(--model "$G" --quantization gguf --no-gguf-gemv1) ;;
    bf16) a=(--model $M --random-weights --quantization none) ;;
  esac
  timeout 120 $V bench profile "${a[@]}" --batch-sizes 1 --context 1024 --json "$R/profile_$v.json" \
    > "$R/profile_$v.log" 2>&1
  echo "profile $v rc=$? at $(( $(date +%s) - t0 )) s"
done
b=$(( $(left) - 60 ))
if [ $b -gt 60 ]; then
  timeout $b python3 -m pytest -o addopts= -q -rfEs -m gpu -p no:cacheprovider tests/test_spec_decode.py \
    tests/test_faults.py tests/test_decode_gpu.py tests/test_graph_padding.py > "$R/spec_gates.log" 2>&1
  echo "spec gates rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$R/spec_gates.log")"
fi
b=$(( $(left) - 5 ))
if [ $b -gt 30 ]; then
  timeout $b python3 -m pytest -o addopts= -q -rfEs -m gpu -p no:cacheprovider tests/test_gguf_gemv.py \
    > "$R/gemv_tests.log" 2>&1
  echo "gemv tests rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$R/gemv_tests.log")"
fi
for v in gemv1 old bf16; do grep -iE "replay|total|step" "$R/profile_$v.log" | head -4; done
