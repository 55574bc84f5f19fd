#!/usr/bin/env bash
# Session 20's second lease (the 0.5B only): the CUDA parity cells with real weights, with the capture fix
# (graphs.capture_graph: no cyclic GC during a capture) and then, for the record, with the file before it
# (old_graphs.py, carried untracked), where draft_model-adaptive failed in session 20's first lease.
# Send with scripts/lease_chunk.sh scripts/gpu_lease_s20b.sh qwen2.5-coder-0.5b-instruct NN [SHA], then poll.
set -uo pipefail
R=/tmp/burst
mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD VERISPEC_CACHE_DIR=/tmp/vcache VERISPEC_STAGE_CACHE=/tmp/models PYTHONUNBUFFERED=1
mark() { echo "$(date +%T) $*" >> "$R/progress"; }
mark start
t=0
until [ -f /tmp/models/qwen2.5-coder-0.5b-instruct.gguf.ok ]; do
  sleep 2; t=$((t + 2)); if [ $t -ge 300 ]; then mark "not staged"; mark end; exit 1; fi
done
mark staged
sel=(tests/test_real_model_spec.py -k "parity")
timeout 200 python3 -m pytest -o addopts= -v -rfE --tb=short -m gpu -p no:cacheprovider "${sel[@]}" > "$R/parity_fixed.log" 2>&1
mark "parity fixed rc=$? $(tail -1 "$R/parity_fixed.log")"
if [ -f old_graphs.py ]; then
  cp old_graphs.py verispec/worker/graphs.py
  timeout 200 python3 -m pytest -o addopts= -v -rfE --tb=short -m gpu -p no:cacheprovider "${sel[@]}" > "$R/parity_old.log" 2>&1
  mark "parity old rc=$? $(tail -1 "$R/parity_old.log")"
fi
mark end
