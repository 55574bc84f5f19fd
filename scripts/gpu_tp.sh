#!/usr/bin/env bash
# Tensor and data parallelism on two H200s (nvidia-h200-x2): TP=2 vs TP=1 for the 1.5B (batch-1 latency,
# throughput at 64 and 256 sequences, bf16 greedy agreement, NCCL time per decode step), DP=2 vs DP=1
# served throughput. Budget: about 25 min in all (expected ~15; if every TP=2 graph run fails and is re-run
# eagerly, ~20); every command is capped at 7.5 min (timeout 450).
#
# usage (repo root):
#   PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache scripts/gpu_tp.sh [/tmp/models/qwen2.5-coder-1.5b-instruct.gguf]
#   scripts/gpu_tp.sh --device cpu     # dry run on the CPU: the 0.5B, tiny sizes, every command once
#                                      # (7 min on a loaded 2-core machine; every rc=0 there on 2026-12-01)
# env: OUT (default /tmp/tp), PORT (default 8123)
# NCCL_NVLS_ENABLE is inherited as set on the machine (0); this script never sets it.
set -uo pipefail
OUT=${OUT:-/tmp/tp}; mkdir -p "$OUT"
PORT=${PORT:-8123}
CLI="python3 -m verispec.entrypoints.cli"
DT="--distributed-timeout 90"  # a hung collective fails the command in 90 s instead of the 7.5 min cap
if [[ "${1:-}" == "--device" && "${2:-}" == "cpu" ]]; then
  M=${M:-qwen2.5-coder-0.5b-instruct}; DEV="--device cpu --dtype float32"
  LAT="--batch-sizes 1 --input-len 16 --output-len 8 --num-iters 1"
  THR="--num-seqs 4 --sweep-input-len 16 --sweep-output-len 8 --repeats 1"
  PROBE="--num-prompts 4 --max-tokens 8 --device cpu --dtype float32"
  SERVE_N=16; SERVE_TOK=8; CONC=8
else
  M=${1:-/tmp/models/qwen2.5-coder-1.5b-instruct.gguf}; DEV=""
  LAT="--batch-sizes 1 --input-len 128 --output-len 256 --num-iters 3"
  THR="--num-seqs 64,256 --repeats 3"
  PROBE="--num-prompts 64 --max-tokens 128 --profile"
  SERVE_N=1024; SERVE_TOK=256; CONC=256
  nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
  echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-<unset>}"
fi
run() {  # print the command, the tail of its output and its exit status; return that status
  echo "=== $*"; timeout 450 "$@" 2>&1 | grep -v "^\s*$" | tail -n 25
  local rc=${PIPESTATUS[0]}; echo "rc=$rc"; return "$rc"
}

# 1. batch-1 latency and 2. throughput, TP=1 then TP=2 (CUDA graphs on: NCCL collectives inside captured
#    graphs were never run before; a TP=2 command that fails runs again with --enforce-eager). The TP=2
#    latency also runs eagerly once, for the graphs' share.
for tp in 1 2; do
  run $CLI bench latency --model "$M" $DEV $LAT --tensor-parallel-size $tp $DT --json "$OUT/latency_tp$tp.json" ||
    run $CLI bench latency --model "$M" $DEV $LAT --tensor-parallel-size $tp $DT --enforce-eager --json "$OUT/latency_tp${tp}_eager.json"
  run $CLI bench throughput --model "$M" $DEV $THR --tensor-parallel-size $tp $DT --json "$OUT/throughput_tp$tp.json" ||
    run $CLI bench throughput --model "$M" $DEV $THR --tensor-parallel-size $tp $DT --enforce-eager --json "$OUT/throughput_tp${tp}_eager.json"
done
[[ -f "$OUT/latency_tp2_eager.json" ]] ||
  run $CLI bench latency --model "$M" $DEV $LAT --tensor-parallel-size 2 $DT --enforce-eager --json "$OUT/latency_tp2_eager.json"

# 3. greedy agreement TP=2 vs TP=1 (bf16 on CUDA) and the NCCL kernel time per decode step (64 seqs).
run python3 scripts/tp_probe.py --model "$M" --tp 2 $PROBE

# 4. served throughput, DP=1 then DP=2 (replica i on cuda:i), the same 256 concurrent streaming clients.
for dp in 1 2; do
  echo "=== serve --data-parallel-size $dp"
  $CLI serve "$M" $DEV --port "$PORT" --data-parallel-size $dp --max-model-len 2048 > "$OUT/serve_dp$dp.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  run $CLI bench serve --url "http://127.0.0.1:$PORT" --concurrency $CONC --num-requests $SERVE_N \
    --max-tokens $SERVE_TOK --json "$OUT/serve_dp$dp.json"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^verispec:(generation_tokens|request_success)_total" | head -5
  kill "$spid"; wait "$spid" 2>/dev/null
  tail -n 3 "$OUT/serve_dp$dp.log"
done
echo "results in $OUT"
