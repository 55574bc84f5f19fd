#!/usr/bin/env bash
# quantization="gguf" (h3's kernels/gguf_matmul.py) against the bf16 dequantized path on the H200, side by side:
# parity on real weights, batch-1 decode, throughput at 64 / 256 sequences, weight memory (in each bench header).
# Budget: ~12 min in all, every command < 8 min (parity ~1 min per model, latency ~1 min per path, throughput
# ~2-3 min per path).
# usage: PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache scripts/gpu_quant.sh
#        dry run on a CPU (tiny sizes, the 0.5B for both models): scripts/gpu_quant.sh --device cpu
set -uo pipefail
dev=cuda; M=/tmp/models/qwen2.5-coder-1.5b-instruct.gguf; D=/tmp/models/qwen2.5-coder-0.5b-instruct.gguf
lat="--batch-sizes 1 --input-len 128 --output-len 256 --num-iters 3"; thr="--num-seqs 64,256 --repeats 3"; par="--tokens 64"
if [ "${1:-}" = "--device" ] && [ "${2:-}" = "cpu" ]; then
  dev=cpu; M=qwen2.5-coder-0.5b-instruct; D=$M
  lat="--batch-sizes 1 --input-len 8 --output-len 8 --num-iters 1"; thr="--num-seqs 2 --sweep-input-len 8 --sweep-output-len 8 --repeats 1"
  par="--tokens 4 --prompts 2"
fi
run() { echo "=== $*"; timeout 480 "$@" 2>&1 | grep -v "^\s*$" | grep -v Warning | tail -n "${TAIL:-12}"; }
for m in "$D" "$M"; do
  run python3 scripts/quant_parity.py "$m" --device $dev $par
done
for q in none gguf; do
  run python3 -m verispec.entrypoints.cli bench latency --model "$M" --device $dev --quantization $q $lat
done
for q in none gguf; do
  run python3 -m verispec.entrypoints.cli bench throughput --model "$M" --device $dev --quantization $q $thr
done
