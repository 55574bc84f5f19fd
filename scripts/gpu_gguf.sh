#!/usr/bin/env bash
# GGUF blocks as stored (issue 20 part B, kernels/gguf_matmul.py) on the H200. Budget: about 4 minutes.
#   1. the gpu tests of tests/test_gguf_matmul.py: 8 ggml types at the 1.5B's qkv / down shapes, both kernels,
#      and CUDA-graph capture: ~70 Triton compiles, in 4 pytest processes side by side (~1 min; limit 200 s)
#   2. scripts/gguf_bench.py: Q4_K and Q6_K vs dense bf16 (linear() / F.linear) at the 1.5B's qkv, o, gate_up,
#      down and lm_head shapes for M = 1, 2, 4, 8, 16, 64, 256: us, GB/s and % of 4.8 TB/s, each default
#      checked against the reference; then Q4_K tile sweeps until 110 s (limit 240 s). Numbers also in
#      /tmp/gguf_bench.json.
# Run from the repo root:
#   PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache bash scripts/gpu_gguf.sh
# Dry run on a CPU machine (Triton's interpreter, tiny shapes, ~2-3 min on 2 cores):
#   PYTHONPATH=$PWD bash scripts/gpu_gguf.sh --device cpu
set -uo pipefail
device=cuda
[[ "${1:-}" == "--device" ]] && device=$2
if [[ $device == cpu ]]; then
  export TRITON_INTERPRET=1
  echo "=== dry run: interpreter tests (a sample) and the bench at tiny shapes"
  python3 -m pytest -o addopts= tests/test_gguf_matmul.py -q -x -p no:cacheprovider -k "Q4_K and (gemv or mma) and not tiles"
  python3 scripts/gguf_bench.py --device cpu --shapes tiny --rows 1,3,20 --qtypes Q4_K,Q6_K --budget-s 20
  exit
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "=== 1. gpu tests"
i=0
for sel in "Q4_K or Q5_K" "Q6_K or Q8_0" "Q5_0 or Q4_0" "Q4_1 or Q5_1 or graph"; do
  timeout 200 python3 -m pytest -o addopts= tests/test_gguf_matmul.py -q -m gpu -p no:cacheprovider -k "$sel" \
    > /tmp/gguf_tests_$i.log 2>&1 &
  i=$((i + 1))
done
wait
for j in 0 1 2 3; do echo "--- tests part $j"; grep -E "passed|failed|error|Error|assert" /tmp/gguf_tests_$j.log | tail -n 12; done
echo "=== 2. speed vs dense bf16 (1.5B shapes)"
timeout 240 python3 scripts/gguf_bench.py --device cuda --budget-s 110 --json /tmp/gguf_bench.json 2>&1 | tail -n 120
