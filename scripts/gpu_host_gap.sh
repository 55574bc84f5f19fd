#!/usr/bin/env bash
# Issue 17: the GPU's idle time per step with drafts (host work between a step's counts and the next
# launch), to re-fit CUDA_RATES' host terms (spec_decode/measure.py: host_per_step + host_per_seq * batch).
# Step traces (scripts/step_trace.py, random weights in the 1.5B's shapes, the overlapped loop, CUDA graphs)
# of ngram with k = 4 pinned at batch 1 / 16 / 64 after 128- and 1024-token prompts (prompt lookup reads
# the whole context, so the second shows what grows with it), and plain decoding at batch 64. Each line:
# wall and busy per step (medians, us) and gap = wall - busy; then a least-squares line through the
# ngram gaps of each prompt length: gap = a + b * batch. Budget: ~10 minutes on the H200.
# usage: PYTHONPATH=/tmp/site:$PWD scripts/gpu_host_gap.sh [--device cpu]
#   --device cpu: a dry run of the plumbing, small cells of gemma-3-270m's shapes (~3 min on the 2-core dev
#   machine; the CPU traces no GPU ops, so each line says "too few decode steps" and no fit is printed).
set -uo pipefail
model=qwen2.5-coder-1.5b-instruct
batches="1 16 64"
lens="128 1024"
outlen=40
if [ "${1:-}" = "--device" ] && [ "${2:-}" = "cpu" ]; then
  model=gemma-3-270m  # (random weights with its shapes; one small cell of each kind)
  batches="1 2"
  lens="16"
  outlen=8
fi
out=$(mktemp)
run() {  # spec batch input_len
  local line
  line=$(timeout 240 python3 scripts/step_trace.py --model $model --batch "$2" --spec "$1" --k 4 --input-len "$3" \
    --output-len $outlen --top 0 2>&1 | grep -E "step wall|too few|Error" | tail -n 1)
  local wall busy
  wall=$(sed -n 's/.*median \([0-9.]*\) us, GPU busy.*/\1/p' <<<"$line")
  busy=$(sed -n 's/.*GPU busy \([0-9.]*\) us.*/\1/p' <<<"$line")
  if [ -n "$wall" ] && [ -n "$busy" ]; then
    echo "$1 $2 $3 $wall $busy" >> "$out"
    printf "%-6s batch %3s prompt %5s: wall %8.1f us  busy %8.1f us  gap %8.1f us\n" "$1" "$2" "$3" "$wall" "$busy" \
      "$(echo "$wall - $busy" | bc -l)"
  else
    echo "$1 batch $2 prompt $3: $line"
  fi
}
for len in $lens; do
  for b in $batches; do run ngram "$b" "$len"; done
done
run none "${batches##* }" "${lens%% *}"
python3 - "$out" <<'PY'
import sys
rows = [line.split() for line in open(sys.argv[1])]
for length in sorted({r[2] for r in rows if r[0] == "ngram"}, key=int):
    pts = [(int(r[1]), float(r[3]) - float(r[4])) for r in rows if r[0] == "ngram" and r[2] == length]
    if len(pts) < 2:
        continue
    n, sx, sy = len(pts), sum(x for x, _ in pts), sum(y for _, y in pts)
    sxx, sxy = sum(x * x for x, _ in pts), sum(x * y for x, y in pts)
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    a = (sy - b * sx) / n
    print(f"ngram gap fit, prompt {length}: host_per_step {a / 1e6:.3g} s, host_per_seq {b / 1e6:.3g} s "
          f"(CUDA_RATES now: 0.55e-3, 25e-6)")
PY
rm -f "$out"
