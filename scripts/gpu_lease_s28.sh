#!/usr/bin/env bash
# (Historical: session 28's run. The fused-only variant and --small-m-fused-only were removed in session 29.)
# Session 28's lease, call A (no model staging: the 1.5B's GGUF header plus zeros, as gpu_lease_s26.sh; bf16 on
# random weights). Measurements that pick the next defaults, no default changed yet:
#   1. issue 17, verify / decode GPU time at batch 1 (ctx 1024, queries 1, 4, 8, 16): the defaults against the
#      small-M kernels everywhere and on the fused kernels only (small_m_plain_linears=False), with and
#      without split-K down_proj (scripts/step_ablation.py, interleaved rounds in one process);
#   2. issue 17, the kernel breakdown of a 4-query verify step on the defaults and on the fused-only variant;
#   3. issue 20, the kernel breakdown of a decode step at 64 and 256 sequences (ctx 256): gguf against bf16.
# Call B is scripts/gpu_lease_s28b.sh (the GGUF tensor-core kernel's tile sweep).
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
timeout 200 python3 scripts/step_ablation.py --model $M --batch-sizes 1 --context 1024 --query-len 1,4,8,16 \
  --variants base,small-m=16,small-m=16+fused-only,small-m=16+fused-only+small-splitk --rounds 5 --reps 50 \
  > "$R/verify_ratio.log" 2>&1
echo "verify ratio rc=$? at $(( $(date +%s) - t0 )) s"
for v in base fused; do
  extra=""; [[ $v == fused ]] && extra="--small-m-max-rows 16 --small-m-fused-only"
  # shellcheck disable=SC2086
  timeout 60 $V bench profile --model $M --random-weights --quantization none --device cuda --batch-sizes 1 \
    --context 1024 --query-len 4 $extra > "$R/profile_q4_$v.log" 2>&1
  echo "profile q4 $v rc=$? at $(( $(date +%s) - t0 )) s"
done
timeout 90 $V bench profile --model "$G" --quantization gguf --device cuda --batch-sizes 64,256 --context 256 \
  > "$R/profile_b64_gguf.log" 2>&1
echo "profile b64/256 gguf rc=$? at $(( $(date +%s) - t0 )) s"
timeout 60 $V bench profile --model $M --random-weights --quantization none --device cuda --batch-sizes 64,256 \
  --context 256 > "$R/profile_b64_bf16.log" 2>&1
echo "profile b64/256 bf16 rc=$? at $(( $(date +%s) - t0 )) s"
grep -v Warning "$R/verify_ratio.log" | grep -v _warn_once | tail -30
for f in "$R"/profile_*.log; do echo "== $f"; grep -v "Warn\|_warn" "$f" | head -30; done
