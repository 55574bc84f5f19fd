#!/usr/bin/env bash
# Issue 19's H200 must-show: the cost of structured outputs. tok/s with and without a JSON schema at
# batch 1 and 16, without speculation and with ngram / draft_model (the 0.5B drafting for the 1.5B,
# k = 4 pinned so that speculation really runs; ADAPTIVE=1 runs the engine's default adaptive policy
# instead), bf16, the held-out requests through the chat template (verispec bench structured).
# Before it: the structured-output GPU test (tests/test_structured_gpu.py: the 0.5B in float32 with
# CUDA graphs, schema-valid outputs, speculation token-identical under the grammar).
#
# GPU time budget: ~3 minutes (estimate, never measured): test ~40 s, bench ~130 s (6 engines; batch 1
# runs 6 requests, batch 16 runs 16, up to 384 tokens each, warm-up + 2 runs per mode). Each command
# has its own timeout (test 300 s, bench 420 s).
#
# Needs, on the GPU machine (run from the repository root):
#   .whl/ carried in the tree: xgrammar 0.2.9 and its runtime deps (apache-tvm-ffi, pydantic,
#     pydantic-core, annotated-types, typing-inspection, typing-extensions) + jsonschema and its deps
#     (attrs, referencing, rpds-py, jsonschema-specifications); installed here into /tmp/site unless
#     xgrammar and jsonschema already import;
#   /tmp/models/qwen2.5-coder-{1.5b,0.5b}-instruct.gguf (../shared/device/stage), linked into
#     $VERISPEC_CACHE_DIR/models here when they are not there yet.
# usage: scripts/gpu_structured.sh            # on the H200
#        scripts/gpu_structured.sh --dry-run  # on a CPU: the same commands, tiny random model, tiny sizes
# Results: $R (default /tmp/burst/structured): structured.json, *.log, summary.txt (printed at the end).
set -uo pipefail
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
R=${R:-/tmp/burst/structured}
mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=${VERISPEC_CACHE_DIR:-/tmp/vcache}
M=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
V="python3 -m verispec.entrypoints.cli"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$R/summary.txt"; }
: > "$R/summary.txt"

if ! python3 -c "import xgrammar, jsonschema" 2>/dev/null; then
  ls .whl/*.whl > /dev/null 2>&1 || { say "FAIL: no .whl/ here and xgrammar/jsonschema do not import"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$R/pip.log" 2>&1 || { say "FAIL: wheel install (see $R/pip.log)"; exit 1; }
fi
python3 -c "import xgrammar, jsonschema, pydantic; print('xgrammar', xgrammar.__file__)" > "$R/imports.log" 2>&1 \
  || { say "FAIL: imports after install"; cat "$R/imports.log"; exit 1; }
say "imports ok: $(head -1 "$R/imports.log")"

if [ $DRY = 0 ]; then
  mkdir -p "$VERISPEC_CACHE_DIR/models"
  for m in $M $D; do
    [ -f /tmp/models/$m.gguf ] || { say "FAIL: /tmp/models/$m.gguf is missing (stage it first)"; exit 1; }
    [ -e "$VERISPEC_CACHE_DIR/models/$m.gguf" ] || ln -s /tmp/models/$m.gguf "$VERISPEC_CACHE_DIR/models/$m.gguf"
  done
  GATE=()
  BENCH=(--model $M --draft-model $D --dtype bfloat16 --batch-sizes 1,16 --num-prompts 6 --max-tokens 384 --repeats 2)
else
  GATE=(--gate-device cpu)
  TINY='{"hidden_size":64,"intermediate_size":128,"num_layers":2,"num_heads":4,"num_kv_heads":2,"head_dim":16}'
  BENCH=(--model $D --draft-model $D --random-weights --model-overrides "$TINY" --device cpu --dtype float32
         --batch-sizes 1,2 --num-prompts 2 --max-tokens 16 --repeats 1)
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then  # SKIP_TESTS=1: the bench only (the CPU dry run of the test takes ~12 min)
  say "test_structured_gpu"
  timeout 300 python3 -m pytest -o addopts= tests/test_structured_gpu.py -q -rf -m "gpu or gpu_gate" -p no:cacheprovider \
    "${GATE[@]}" > "$R/test_structured_gpu.log" 2>&1
  say "test_structured_gpu rc=$?: $(grep -E "passed|failed|error" "$R/test_structured_gpu.log" | tail -1)"
fi

ADAPT=--no-adaptive
[ "${ADAPTIVE:-0}" = 1 ] && ADAPT=--adaptive
say "bench structured ($ADAPT)"
timeout 420 $V bench structured "${BENCH[@]}" --methods none,ngram,draft_model $ADAPT -k 4 \
  --prompts prompts/heldout_requests.jsonl --chat --json "$R/structured.json" > "$R/structured.log" 2>&1
say "bench structured rc=$?"
python3 - "$R/structured.json" <<'EOF' 2>&1 | tee -a "$R/summary.txt"
import json, sys
try:
    res = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no result: {e}")
print(f"{res['model']} {res['dtype']} on {res.get('gpu_name', res['device'])}, prompts: {res['prompts']}")
print("method       mode batch    tok/s  json/free  speedup  mean_k  accept  out_tok  mism  fin/valid/trunc  refused")
for r in res["rows"]:
    js = r["mode"] == "json"
    print(f"{r['method']:12} {r['mode']:4} {r['batch_size']:5} {r['tok_s']:8.1f} "
          + (f"{r['vs_free']:10.3f}" if js else f"{'-':>10}") + f" {r['speedup']:8.2f} {r['mean_k']:7.2f} "
          f"{r.get('acceptance_rate') or 0:7.3f} {r['output_tokens']:8d} {r['mismatches']:5d} "
          + (f"{r['finished']:5d}/{r['valid']}/{r['truncated']}  {r['refused']:7d}" if js else ""))
EOF
say "done"
