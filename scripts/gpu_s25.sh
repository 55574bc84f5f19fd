#!/usr/bin/env bash
# Session 25's call (no model staged; carry .whl): the one-row Q4_K GEMV's GPU tests under the float32 bound,
# its new default tiles against the old GEMV (random weights, the 1.5B's shapes), then the host work of a step
# with drafts on the real path (CUDA graphs, Triton kernels; random weights in the 1.5B / 0.5B shapes, k pinned
# at 4) at batch 16 and 64, where issue 17's must-shows fail. Results in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
git log -1 --format=%h > "$R/commit.txt" 2>/dev/null
timeout 150 python3 -m pytest -o addopts= -q -rfE -m gpu -p no:cacheprovider tests/test_gguf_gemv.py tests/test_gguf_matmul.py \
  > "$R/gguf_tests.log" 2>&1
echo "gguf gpu tests rc=$? $(tail -1 "$R/gguf_tests.log")"
timeout 60 python3 scripts/gguf_bench.py --gemv1 --rows 1 --qtypes Q4_K --sweep-qtypes '' \
  --json "$R/gguf_gemv1.json" > "$R/gguf_gemv1.log" 2>&1
echo "gguf bench gemv1 rc=$?"
timeout 60 python3 scripts/gguf_bench.py --rows 1 --qtypes Q4_K --sweep-qtypes '' --no-gemv1 \
  --json "$R/gguf_old.json" > "$R/gguf_old.log" 2>&1
echo "gguf bench old rc=$?"
tail -8 "$R/gguf_gemv1.log"; tail -8 "$R/gguf_old.log"
for b in 16 64; do
  timeout 150 python3 scripts/host_profile.py --model qwen2.5-coder-1.5b-instruct --device cuda --random-weights \
    --draft-model qwen2.5-coder-0.5b-instruct --batch $b --steps 100 --rounds 3 --pin-k 4 --pattern 7 --top 40 \
    > "$R/host_b$b.log" 2>&1
  echo "host profile b$b rc=$?"; grep "a step" "$R/host_b$b.log"
done
