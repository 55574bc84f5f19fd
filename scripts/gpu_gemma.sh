#!/usr/bin/env bash
# Issue 21's H200 must-shows for gemma-3-270m:
#   1. the Gemma GPU tests: tests/test_sliding_window.py (the sliding-window kernel vs its reference on
#      random odd sizes, bf16) and tests/test_gemma3_gpu.py (the real model in float32 with CUDA graphs
#      and the Triton kernels vs transformers on the same device and weights: greedy tokens by teacher
#      forcing, last-step logits within 1e-3, pinned ngram lossless), one process each;
#   2. batch-1 decode (bench latency, 128 prompt + 128 output tokens, 3 timed runs) and 64-sequence
#      throughput (bench throughput, 128 + 256 tokens, median of 3), bf16, verispec and transformers
#      (--peer hf: Gemma3ForCausalLM on verispec's weights, same process, same token ids) in the same run;
#      latency also with transformers' static cache + torch.compile unless NO_COMPILE=1.
#
# GPU time budget: ~3 minutes (estimate, never measured): tests ~45 s; latency ~75 s (most of it
# transformers: eager at a few dozen tok/s, torch.compile's first compile); throughput ~35 s. Each
# command has its own timeout (tests 300 s each, benches 420 s each).
#
# Needs, on the GPU machine (run from the repository root): /tmp/models/gemma-3-270m.gguf
# (../shared/device/stage gemma-3-270m: 5 chunks, sha256 a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818),
# linked into $VERISPEC_CACHE_DIR/models here; no extra wheels (transformers builds the peer from
# verispec's weights: no gguf package needed).
# usage: scripts/gpu_gemma.sh            # on the H200
#        scripts/gpu_gemma.sh --dry-run  # on a CPU: the same commands in float32 with tiny sizes
# Results: $R (default /tmp/burst/gemma): latency.json, throughput.json, *.log, summary.txt (printed).
set -uo pipefail
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
R=${R:-/tmp/burst/gemma}
mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=${VERISPEC_CACHE_DIR:-/tmp/vcache}
G=gemma-3-270m
V="python3 -m verispec.entrypoints.cli"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$R/summary.txt"; }
: > "$R/summary.txt"

if [ $DRY = 0 ]; then
  [ -f /tmp/models/$G.gguf ] || { say "FAIL: /tmp/models/$G.gguf is missing (stage it first)"; exit 1; }
  mkdir -p "$VERISPEC_CACHE_DIR/models"
  [ -e "$VERISPEC_CACHE_DIR/models/$G.gguf" ] || ln -s /tmp/models/$G.gguf "$VERISPEC_CACHE_DIR/models/$G.gguf"
  GATE=()
  COMMON=(--model $G --quantization none --dtype bfloat16)
  LAT=(--batch-sizes 1 --input-len 128 --output-len 128 --num-iters 3)
  THR=(--num-seqs 64 --sweep-input-len 128 --sweep-output-len 256 --repeats 3)
  COMPILE=()
  [ "${NO_COMPILE:-0}" = 1 ] && COMPILE=(--no-compile)
else
  GATE=(--gate-device cpu)
  COMMON=(--model $G --quantization none --device cpu --dtype float32)
  LAT=(--batch-sizes 1 --input-len 16 --output-len 8 --num-iters 1)
  THR=(--num-seqs 4 --sweep-input-len 16 --sweep-output-len 8 --repeats 1)
  COMPILE=(--no-compile)
fi

for t in test_sliding_window test_gemma3_gpu; do
  [ "${SKIP_TESTS:-0}" = 1 ] && break  # SKIP_TESTS=1: the benches only
  say "$t"
  timeout 300 python3 -m pytest -o addopts= tests/$t.py -q -rf -m "gpu or gpu_gate" -p no:cacheprovider "${GATE[@]}" \
    > "$R/$t.log" 2>&1
  say "$t rc=$?: $(grep -E "passed|failed|error|skipped" "$R/$t.log" | tail -1)"
done

say "bench latency (batch 1) --peer hf ${COMPILE[*]}"
timeout 420 $V bench latency "${COMMON[@]}" "${LAT[@]}" --peer hf "${COMPILE[@]}" --json "$R/latency.json" \
  > "$R/latency.log" 2>&1
say "bench latency rc=$?"
say "bench throughput (64 sequences) --peer hf --no-compile"
timeout 420 $V bench throughput "${COMMON[@]}" "${THR[@]}" --peer hf --no-compile --json "$R/throughput.json" \
  > "$R/throughput.log" 2>&1
say "bench throughput rc=$?"

python3 - "$R/latency.json" "$R/throughput.json" <<'EOF' 2>&1 | tee -a "$R/summary.txt"
import json, sys
for path in sys.argv[1:]:
    try:
        res = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: no result ({e})")
        continue
    print(f"{res['kind']}: {res['model']} {res['dtype']} on {res.get('gpu_name', res['device'])}, load {res['load_s']:.1f} s")
    if res["kind"] == "latency":
        for r in res["rows"]:
            print(f"  verispec           batch {r['batch_size']}: decode {r['decode_tok_s']:9.1f} tok/s, "
                  f"TPOT p50 {r['tpot_ms_p50']:.3f} ms, TTFT p50 {r['ttft_ms_p50']:.2f} ms")
        for p in res["peers"]:
            print(f"  {p['peer']:18} batch {p['batch_size']}: " + (f"error {p['error'][:200]}" if "error" in p else
                  f"decode {p['decode_tok_s']:9.1f} tok/s, TPOT {p['tpot_ms']:.3f} ms, verispec/peer {p['ratio']:.2f}"))
    else:
        for r in res["rows"]:
            print(f"  verispec           {r['num_seqs']} seqs: {r['output_tok_s']:9.1f} output tok/s "
                  f"(runs {', '.join(f'{x:.0f}' for x in r['runs'])}), {r['output_tokens']} tokens")
        for p in res["peers"]:
            print(f"  {p['peer']:18} {p['num_seqs']} seqs: " + (f"error {p['error'][:200]}" if "error" in p else
                  f"{p['output_tok_s']:9.1f} output tok/s, verispec/peer {p['ratio']:.2f}"))
EOF
say "done"
