#!/usr/bin/env bash
# The default DFlash training run for the 1.5B on one H200 (15 minutes after the target loads: Magpie
# requests + stdlib stubs, responses, features, training; verispec/train/loop.py's docstring gives the
# expected sizes), split over two device calls because one call runs at most 10 minutes, then the
# held-out measurement. Each stage is one `run` call on the same lease (OUT stays on that machine):
#   PYTHONPATH=$PWD scripts/gpu_train_dflash.sh train1   # ~9.5 min: generation, features, training to 8.5 min
#   PYTHONPATH=$PWD scripts/gpu_train_dflash.sh train2   # ~7 min: resume (features again), the rest of 15 min
#   PYTHONPATH=$PWD scripts/gpu_train_dflash.sh bench [PROMPTS]  # held-out (default) or any prompts file
# OUT (default /tmp/dflash15) holds sequences.jsonl, requests.jsonl, model.safetensors, config.json,
# train_log.json and train_state/ (1.26 GB: fine within one lease; to carry it to another machine, copy
# its 15 MiB shards back 4 at a time, or rerun from sequences.jsonl.gz).
set -uo pipefail
m=qwen2.5-coder-1.5b-instruct
out=${OUT_DIR:-/tmp/dflash15}
v="python3 -m verispec.entrypoints.cli"
case "${1:-}" in
  train1)
    $v train-drafter --target $m --out "$out" --device cuda --save-state --stop-after-minutes 8.5 2>&1 \
      | grep -v "it/s\]$" | tail -n 40
    gzip -kf "$out/sequences.jsonl"; ls -la "$out" ;;
  train2)
    $v train-drafter --target $m --out "$out" --device cuda --save-state --resume 2>&1 | grep -v "it/s\]$" | tail -n 40
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('options'); print(json.dumps(d, indent=1))" \
      "$out/train_log.json" ;;
  bench)
    $v bench spec --model $m --methods none,dflash --dflash-model "$out" --prompts "${2:-prompts/heldout_requests.jsonl}" \
      --chat --num-prompts 32 --batch-sizes 1,4,16,64 --output-len 256 --repeats 3 --json "${3:-/tmp/bench_dflash.json}" ;;
  *) echo "usage: $0 train1 | train2 | bench [PROMPTS] [JSON]"; exit 2 ;;
esac
