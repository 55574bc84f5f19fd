#!/usr/bin/env bash
# Session 22's lease (session 21's, with a shorter sweep: 900 s of device time were left): the one-row Q4_K GEMV (kernels/gguf_gemv.py) on the GPU. Kernel tests and the per-layer
# A/B against gguf_matmul's GEMV (random weights: no model) while the models are staged; then, on the 1.5B
# Q4_K_M, the batch-1 step profile and decode tok/s (gguf new, gguf old, bf16), the parity of the quantized path,
# and on the 0.5B the CUDA parity cells with session 20's capture fix (worker/graphs.py) and without it.
# Send with scripts/lease_chunk.sh scripts/gpu_lease_s22.sh MODEL NN [SHA] (the 1.5B's chunks, then the 0.5B's), then poll.
set -uo pipefail
R=/tmp/burst
mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache VERISPEC_STAGE_CACHE=/tmp/models PYTHONUNBUFFERED=1
M=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
V="python3 -m verispec.entrypoints.cli"
G=/tmp/models/$M.gguf
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
staged() {
  local t=0
  until [ -f "/tmp/models/$1.gguf.ok" ]; do
    sleep 2; t=$((t + 2))
    if [ $t -ge 400 ]; then mark "not staged: $1"; return 1; fi
  done
  mark "staged $1"
}
mark start
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
timeout 240 python3 -m pytest -o addopts= -q -rfE -m gpu -p no:cacheprovider tests/test_gguf_gemv.py tests/test_gguf_matmul.py \
  > "$R/gguf_tests.log" 2>&1
mark "gguf gpu tests rc=$? $(tail -1 "$R/gguf_tests.log")"
timeout 200 python3 scripts/gguf_bench.py --rows 1 --qtypes Q4_K --sweep-qtypes Q4_K --budget-s 40 \
  --json "$R/gguf_gemv1.json" > "$R/gguf_gemv1.log" 2>&1
mark "gguf bench gemv1 rc=$?"
timeout 120 python3 scripts/gguf_bench.py --rows 1 --qtypes Q4_K,Q6_K --sweep-qtypes '' --no-gemv1 \
  --json "$R/gguf_old.json" > "$R/gguf_old.log" 2>&1
mark "gguf bench old rc=$?"
if staged $M; then
  for v in new old bf16; do
    flag="--quantization gguf"; [ $v = old ] && flag="$flag --no-gguf-gemv1"; [ $v = bf16 ] && flag="--quantization none"
    timeout 150 $V bench profile --model $G $flag --batch-sizes 1 --context 1024 \
      --json "$R/profile_$v.json" > "$R/profile_$v.log" 2>&1
    mark "profile $v rc=$?"
  done
  for q in gguf none; do
    timeout 150 $V bench latency --model $G --device cuda --quantization $q --batch-sizes 1 --input-len 128 \
      --output-len 256 --num-iters 3 --json "$R/latency_$q.json" > "$R/latency_$q.log" 2>&1
    mark "latency $q rc=$?"
  done
  timeout 200 python3 scripts/quant_parity.py $G --device cuda --tokens 64 --prompts 8 > "$R/quant_parity.log" 2>&1
  mark "quant parity rc=$?"
fi
if staged $D; then
  sel=(tests/test_real_model_spec.py -k "parity")
  timeout 200 python3 -m pytest -o addopts= -v -rfE --tb=short -m gpu -p no:cacheprovider "${sel[@]}" > "$R/parity_fixed.log" 2>&1
  mark "parity fixed rc=$? $(tail -1 "$R/parity_fixed.log")"
fi
mark end
