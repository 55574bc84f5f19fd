"""Sum a bench spec trace directory (--trace-steps DIR: METHOD_bB.jsonl, or .jsonl.gz) by step kind: admission
(prefill) steps, decode steps without drafts, decode steps that committed drafts; each as (count, total ms,
median ms, new tokens per step), and (newer traces) the same by how the launched steps ran. usage: python3 scripts/trace_summary.py DIR"""

import gzip
import json
import statistics
import sys
from pathlib import Path


def part(xs: list[dict]) -> tuple:
    med = round(statistics.median([r["ms"] for r in xs]), 3) if xs else 0
    return len(xs), round(sum(r["ms"] for r in xs), 1), med, round(sum(r["new"] for r in xs) / max(1, len(xs)), 2)


for f in sorted(Path(sys.argv[1]).glob("*.jsonl*")):
    with gzip.open(f, "rt") if f.suffix == ".gz" else f.open() as fh:
        rows = [json.loads(line) for line in fh]
    pre = [r for r in rows if r["prefill"]]
    dec = [r for r in rows if not r["prefill"]]
    plain, drafting = [r for r in dec if r["drafts"] == 0], [r for r in dec if r["drafts"] > 0]
    total = sum(r["ms"] for r in rows)
    print(f"{f.name:28} steps {len(rows):5} total {total:8.1f} ms | prefill {part(pre)} | decode {part(plain)} "
          f"| drafting {part(drafting)}")
    if any("launch" in r for r in rows):  # traces from session 17 on: how each step ran
        kinds = sorted({r["launch"] for r in rows})
        print("    by launch: " + "; ".join(f"{k or '-'} {part([r for r in rows if r['launch'] == k])}" for k in kinds))
