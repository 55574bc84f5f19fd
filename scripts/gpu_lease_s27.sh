#!/usr/bin/env bash
# Session 27's lease in one call, no model staging (as gpu_lease_s26.sh: the 1.5B's GGUF header plus zeros is a
# file of the real tensor types and shapes; a step's time does not depend on the weights' values). Issue 20's
# end-to-end figures with the one-row Q4_K GEMV on by default, beside bf16 random weights in the same call:
#   1. bench latency, batch 1 (128 prompt + 256 output tokens, CUDA graphs, async loop): gguf, bf16;
#   2. bench throughput --num-seqs 64,256: gguf, bf16 (weight memory and bytes per step in both reports);
#   3. gguf with ngram speculation at batch 1 (a functional run of speculation on the GGUF kernels with graphs:
#      zero weights make every token id 0, so every draft is accepted: its tok/s is an upper bound, not a claim).
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
args() {
  case $1 in
    gguf) echo "--model $G --quantization gguf" ;;
    bf16) echo "--model $M --random-weights --quantization none" ;;
  esac
}
for v in gguf bf16; do
  # shellcheck disable=SC2046
  timeout 150 $V bench latency $(args $v) --device cuda --batch-sizes 1 --input-len 128 --output-len 256 \
    --num-iters 3 --json "$R/latency_$v.json" > "$R/latency_$v.log" 2>&1
  echo "latency $v rc=$? at $(( $(date +%s) - t0 )) s"
done
for v in gguf bf16; do
  # shellcheck disable=SC2046
  timeout 200 $V bench throughput $(args $v) --device cuda --num-seqs 64,256 --repeats 2 \
    --json "$R/throughput_$v.json" > "$R/throughput_$v.log" 2>&1
  echo "throughput $v rc=$? at $(( $(date +%s) - t0 )) s"
done
# shellcheck disable=SC2046
timeout 120 $V bench latency $(args gguf) --device cuda --batch-sizes 1 --input-len 128 --output-len 256 \
  --num-iters 3 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}' \
  --json "$R/latency_gguf_ngram.json" > "$R/latency_gguf_ngram.log" 2>&1
echo "latency gguf ngram rc=$? at $(( $(date +%s) - t0 )) s"
for f in "$R"/latency_*.log "$R"/throughput_*.log; do echo "== $f"; tail -6 "$f"; done
