#!/usr/bin/env bash
# Session 28's lease, call D: issue 20's throughput at 64 and 256 sequences, gguf (the header-plus-zeros 1.5B)
# against bf16 (random weights) in one call, after the dense route's copies went and the super-block tiles changed
# (as gpu_lease_s27.sh's throughput part). carry: .whl, .device-carry/hdr
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
for v in gguf bf16; do
  if [[ $v == gguf ]]; then a="--model $G --quantization gguf"; else a="--model $M --random-weights --quantization none"; fi
  # shellcheck disable=SC2086
  timeout 220 $V bench throughput $a --device cuda --num-seqs 64,256 --repeats 2 --json "$R/throughput_$v.json" \
    > "$R/throughput_$v.log" 2>&1
  echo "throughput $v rc=$? at $(( $(date +%s) - t0 )) s"
done
for f in "$R"/throughput_*.log; do echo "== $f"; tail -8 "$f"; done
