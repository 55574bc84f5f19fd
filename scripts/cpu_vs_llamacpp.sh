#!/usr/bin/env bash
# Issue 20's CPU comparison: README command 1's decode tok/s (quantization gguf, the CPU default, with the
# C GGUF-block kernel (kernels/cpu_gguf.py) and with it off (VERISPEC_CPU_GGUF=0: session 11's int4 planes),
# and none, the float32 dequantized path; int8=0: VERISPEC_CPU_GGUF_INT8=0, the one-row GEMVs of Q8_0 / Q5_0 /
# Q4_0 in float32 instead of the integer dot; ops=0: VERISPEC_CPU_OPS=0, torch's norms / rotary / attention and
# one call per weight segment instead of kernels/cpu_ops.py's C ops) beside llama.cpp on the same GGUF file, alternating, ROUNDS times.
# llama.cpp is node-llama-cpp's prebuilt x86-64 CPU binary (npm; no compiler needed):
#   mkdir -p /tmp/nlc && (cd /tmp/nlc && npm install --no-audit --no-fund node-llama-cpp@3.22.1)
# Usage: scripts/cpu_vs_llamacpp.sh [MODEL] [ROUNDS] [THREADS]; prints one line per run. Check `uptime`:
# on a loaded 2-core machine every figure collapses (docs/BENCHMARKS.md, session 10 CPU).
set -uo pipefail
M=${1:-qwen2.5-coder-0.5b-instruct}
ROUNDS=${2:-3}
T=${3:-2}
NLC=${NLC:-/tmp/nlc}
GGUF=$(python3 -c "from verispec.loader.registry import resolve_model; print(resolve_model('$M', progress=False))" 2>/dev/null \
       || echo "${VERISPEC_CACHE_DIR:-$HOME/.cache/verispec}/models/$M.gguf")
P="def fibonacci(n):"
echo "model $GGUF threads $T load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
  for qk in gguf:1:1:1 gguf:1:1:0 gguf:1:0:1 gguf:0:1:1 none:1:1:1; do
    IFS=: read -r q k i o <<< "$qk"
    line=$(OMP_NUM_THREADS=$T VERISPEC_CPU_GGUF=$k VERISPEC_CPU_GGUF_INT8=$i VERISPEC_CPU_OPS=$o python3 -m verispec.entrypoints.cli generate "$P" --model "$M" \
           --device cpu --quantization $q --max-tokens 128 2>&1 | grep -i "tok/s" | tail -1)
    echo "round $r verispec quantization=$q VERISPEC_CPU_GGUF=$k int8=$i ops=$o (load $(cut -d' ' -f1 /proc/loadavg)): $line"
  done
  # (an ES module resolves its imports beside itself, so it runs from a copy in $NLC)
  cp scripts/llamacpp_cpu.mjs "$NLC/" && node "$NLC/llamacpp_cpu.mjs" "$GGUF" "$P" 128 "$T" 2>/dev/null \
     | tail -1 | sed "s/^/round $r llama.cpp: /"
done
echo "load after $(cut -d' ' -f1-3 /proc/loadavg)"
