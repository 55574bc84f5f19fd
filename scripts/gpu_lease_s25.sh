#!/usr/bin/env bash
# Session 25's lease: the one-row Q4_K GEMV (KernelOptions.gguf_gemv1, new default tiles; its kernel tests passed
# on the H100 in this session's first call) end to end on the 1.5B Q4_K_M: the batch-1 step profile (gemv1, the
# old GEMV, bf16), decode tok/s, and greedy parity of the gguf path with it at one row (--batch1); then on the
# 0.5B the CUDA parity cells with session 20's capture fix (worker/graphs.py), never yet run on a GPU.
# Send with scripts/lease_chunk.sh scripts/gpu_lease_s25.sh MODEL NN [SHA] (the 1.5B's chunks, then the 0.5B's), then poll.
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
    if [ $t -ge 500 ]; then mark "not staged: $1"; return 1; fi
  done
  mark "staged $1"
}
mark start
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
git -C . log -1 --format=%h > "$R/commit.txt" 2>/dev/null
if staged $M; then
  for v in gemv1 old bf16; do
    flag="--quantization gguf"; [ $v = gemv1 ] && flag="$flag --gguf-gemv1"; [ $v = bf16 ] && flag="--quantization none"
    timeout 150 $V bench profile --model $G $flag --batch-sizes 1 --context 1024 \
      --json "$R/profile_$v.json" > "$R/profile_$v.log" 2>&1
    mark "profile $v rc=$? $(grep -m1 -i 'replay\|step' "$R/profile_$v.log" | head -c 150)"
  done
  timeout 200 python3 scripts/quant_parity.py $G --device cuda --tokens 64 --prompts 8 --batch1 --gguf-gemv1 \
    > "$R/quant_parity_gemv1.log" 2>&1
  mark "quant parity gemv1 rc=$?"
fi
if staged $D; then
  sel=(tests/test_real_model_spec.py -k "parity")
  timeout 300 python3 -m pytest -o addopts= -v -rfE --tb=short -m gpu -p no:cacheprovider "${sel[@]}" > "$R/parity_fixed.log" 2>&1
  mark "parity fixed rc=$? $(tail -1 "$R/parity_fixed.log")"
fi
mark end
