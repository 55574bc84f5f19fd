#!/usr/bin/env bash
# The GGUF tensor-core kernels at prefill / batch sizes (issue 20, kernels/gguf_matmul.py's _mma_sb_kernel for
# Q4_K / Q6_K) on the H200. Budget: about 6 minutes.
#   1. the gpu tests of the super-block kernel: rows bit-identical alone and in batches of 37 / 256, x = the
#      identity giving the weight bit for bit, the 1.5B's shapes through gguf_linear (limit 200 s)
#   2. scripts/gguf_bench.py at M = 64 and 256 only: Q4_K and Q6_K vs dense bf16 at the 1.5B's qkv, o, gate_up,
#      down and lm_head shapes with the default tiles, then both types' tile sweeps (mma_configs: parts, L2
#      prefetch, operand order, tiles, warps, stages, split) until 200 s (limit 300 s). Numbers also in
#      /tmp/gguf_mma_bench.json.
# Run from the repo root:
#   PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache bash scripts/gpu_gguf_mma.sh
# Dry run on a CPU machine (Triton's interpreter, tiny shapes, ~1-2 min on 2 cores):
#   PYTHONPATH=$PWD bash scripts/gpu_gguf_mma.sh --device cpu
set -uo pipefail
device=cuda
[[ "${1:-}" == "--device" ]] && device=$2
if [[ $device == cpu ]]; then
  export TRITON_INTERPRET=1
  echo "=== dry run: the super-block kernel's interpreter tests and the bench at tiny shapes"
  python3 -m pytest -o addopts= tests/test_gguf_matmul.py -q -x -p no:cacheprovider -k "superblock and not gpu"
  python3 scripts/gguf_bench.py --device cpu --shapes tiny --rows 20,64 --qtypes Q4_K,Q6_K --sweep-qtypes Q4_K,Q6_K \
    --budget-s 20
  exit
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "=== 1. gpu tests (super-block kernel)"
timeout 200 python3 -m pytest -o addopts= tests/test_gguf_matmul.py -q -m gpu -p no:cacheprovider \
  -k "superblock or (real_shapes and (Q4_K or Q6_K)) or silu_mul" 2>&1 | grep -E "passed|failed|error|Error|assert" | tail -n 20
echo "=== 2. speed vs dense bf16 at M = 64, 256 (1.5B shapes), sweeps of both types"
timeout 300 python3 scripts/gguf_bench.py --device cuda --rows 64,256 --qtypes Q4_K,Q6_K --sweep-qtypes Q4_K,Q6_K \
  --budget-s 200 --json /tmp/gguf_mma_bench.json 2>&1 | tail -n 150
