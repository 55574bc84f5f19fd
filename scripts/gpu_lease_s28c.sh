#!/usr/bin/env bash
# Session 28's lease, call C (after calls A and B): the A/B of the two changes they led to.
#   1. issue 17: verify / decode at batch 1 with KernelOptions.fused_qkv_max_rows (only the norm + qkv + rotary +
#      K/V write fused, in the one-row family's kernel) at 4, 8 and 16 rows against the defaults (bf16, random
#      weights, ctx 1024, queries 1, 2, 4, 5, 8, 16);
#   2. issue 20: the super-block kernel's new default tiles (mma_config after session 28's sweep) at 16 and 64 rows,
#      default pass only (compare with call B's default lines);
#   3. the GGUF verify / decode ratio at batch 1 (the header-plus-zeros 1.5B, `bench profile --query-len 1 | 4 | 16`);
#   4. the GGUF decode step at 64 and 256 sequences after the dense route's copies went (gguf_dense into out).
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
V="python3 -m verispec.entrypoints.cli"
timeout 200 python3 scripts/step_ablation.py --model $M --batch-sizes 1 --context 1024 --query-len 1,2,4,5,8,16 \
  --variants base,fused-qkv=4,fused-qkv=4+skinny-norm,fused-qkv=8,fused-qkv=16+skinny-norm --rounds 5 --reps 50 > "$R/verify_fused_qkv.log" 2>&1
echo "verify fused-qkv rc=$? at $(( $(date +%s) - t0 )) s"
timeout 150 python3 scripts/gguf_bench.py --device cuda --rows 16,64 --qtypes Q4_K,Q6_K --sweep-qtypes '' \
  --iters 30 --json "$R/gguf_defaults.json" > "$R/gguf_defaults.log" 2>&1
echo "gguf defaults rc=$? at $(( $(date +%s) - t0 )) s"
for q in 1 4 16; do
  timeout 60 $V bench profile --model "$G" --quantization gguf --device cuda --batch-sizes 1 --context 1024 \
    --query-len $q > "$R/profile_gguf_q$q.log" 2>&1
  echo "profile gguf q$q rc=$? at $(( $(date +%s) - t0 )) s"
done
timeout 90 $V bench profile --model "$G" --quantization gguf --device cuda --batch-sizes 64,256 --context 256 \
  > "$R/profile_b256_gguf.log" 2>&1
echo "profile b64/256 gguf rc=$? at $(( $(date +%s) - t0 )) s"
grep -v "Warn\|_warn" "$R/verify_fused_qkv.log" | tail -40
grep "M=\|per step" "$R/gguf_defaults.log" | cut -c1-150
grep -h "step:\|replay" "$R"/profile_gguf_q*.log
grep -v "Warn\|_warn" "$R/profile_b256_gguf.log" | head -60
