"""Compact results of scripts/gpu_gates.sh.

  tests DIR: every pytest process of DIR (<job>.ids: its cells, <job>.live: scripts/pytest_live_log.py's
    log, <job>.rc: "rc seconds") in one table, then each failure's assertion lines, the cell an abort
    hit and the cells it never ran;
  cost OFF.json ON.json: bench throughput without and with --batch-invariant, tok/s per sequence count
    and the cost of invariance (1 - on / off; the issue's rule: <= 5% at 1, <= 10% at 64 and 256).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    """One pytest process: its cells and what its live log says about them."""

    name: str
    cells: list[str]
    rc: str = "?"
    seconds: str = "?"
    outcome: dict[str, str] = field(default_factory=dict)  # nodeid -> PASSED / FAILED / SKIPPED / ERROR
    failures: list[tuple[str, str, list[str]]] = field(default_factory=list)  # (nodeid, when, text lines)
    started: list[str] = field(default_factory=list)

    @property
    def hit(self) -> list[str]:
        """Cells that started and never reported: where the process died (an abort, or its timeout)."""
        return [c for c in self.started if c not in self.outcome]

    @property
    def lost(self) -> list[str]:
        """Cells that never started."""
        return [c for c in self.cells if c not in self.outcome and c not in self.started]


def read_job(ids: Path) -> Job:
    """The job of one .ids file and its sibling .live and .rc files."""
    job = Job(ids.stem, [c for c in ids.read_text().splitlines() if c.strip()])
    rc = ids.with_suffix(".rc")
    if rc.exists():
        parts = rc.read_text().split()
        job.rc, job.seconds = (parts + ["?", "?"])[:2]
    live = ids.with_suffix(".live")
    lines = live.read_text(errors="replace").splitlines() if live.exists() else []
    for i, line in enumerate(lines):
        if line.startswith("START "):
            job.started.append(line.split(" ", 1)[1])
            continue
        if line.startswith("    "):
            continue
        word, _, rest = line.partition(" ")
        nodeid, when = (rest.split(" ") + ["", ""])[:2]
        if word == "FAILED" and when != "call":
            word = "ERROR"
        if word in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            if job.outcome.get(nodeid) not in ("FAILED", "ERROR"):
                job.outcome[nodeid] = word
            if word in ("FAILED", "ERROR"):
                text = []
                for follow in lines[i + 1:]:
                    if not follow.startswith("    "):
                        break
                    text.append(follow[4:])
                job.failures.append((nodeid, when, text))
    return job


def essence(text: list[str], limit: int = 8) -> list[str]:
    """A failure's assertion lines ("E   ...") and the line that raised it, at most limit of them."""
    errors = [t for t in text if t.startswith("E ") and t[1:].strip()]
    where = [t for t in text if t.startswith("tests/") or ".py:" in t][-1:]
    return (errors[:limit] or text[-limit:]) + where


def summarize_tests(directory: Path) -> int:
    """Print the table and the details; 0 when every cell passed or skipped, 1 otherwise."""
    jobs = [read_job(p) for p in sorted(directory.glob("*.ids"))]
    if not jobs:
        print(f"no pytest jobs under {directory}")
        return 1
    counts = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0, "ABORTED": 0, "NOT RUN": 0}
    bad = False
    print(f"{'process':<28} {'rc':>4} {'secs':>5}  cells  passed failed skipped  lost")
    for job in jobs:
        hit, lost = job.hit, job.lost
        for c in job.cells:
            counts[job.outcome.get(c, "ABORTED" if c in hit else "NOT RUN")] += 1
        n = {w: sum(1 for c in job.cells if job.outcome.get(c) == w) for w in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        print(f"{job.name:<28} {job.rc:>4} {job.seconds:>5}  {len(job.cells):>5}  {n['PASSED']:>6} "
              f"{n['FAILED'] + n['ERROR']:>6} {n['SKIPPED']:>7}  {len(hit) + len(lost):>4}")
        bad |= job.rc != "0" or bool(hit or lost)
    total = sum(counts.values())
    print("cells: " + ", ".join(f"{v} {k.lower()}" for k, v in counts.items() if v or k == "FAILED") + f" (of {total})")
    for job in jobs:
        for nodeid, when, text in job.failures:
            bad = True
            print(f"--- {'FAILED' if when == 'call' else 'ERROR in ' + when} {nodeid} [{job.name}]")
            for line in essence(text):
                print(f"    {line[:220]}")
        for nodeid in job.hit:
            what = "TIMED OUT" if job.rc in ("124", "137") else "ABORTED"
            print(f"--- {what} in {nodeid} [{job.name}, rc={job.rc}: see {job.name}.log]")
        if job.lost:
            more = f" ... (+{len(job.lost) - 3})" if len(job.lost) > 3 else ""
            print(f"--- not run [{job.name}, rc={job.rc}]: {' '.join(job.lost[:3])}{more}")
    return int(bad)


def throughput_rows(path: Path) -> dict[int, dict]:
    """num_seqs -> row of a bench throughput --json file ({} when it is missing or broken)."""
    try:
        return {int(r["num_seqs"]): r for r in json.loads(path.read_text())["rows"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def summarize_cost(off: Path, on: Path) -> int:
    """Print output tok/s without and with --batch-invariant and the cost per sequence count."""
    a, b = throughput_rows(off), throughput_rows(on)
    if not a or not b:
        print(f"cost: no result ({off.name}: {'ok' if a else 'missing'}, {on.name}: {'ok' if b else 'missing'})")
        return 1
    limits = {1: 0.05}
    print(f"{'seqs':>5} {'default tok/s':>14} {'invariant tok/s':>16} {'cost':>7} {'rule':>6}")
    for n in sorted(set(a) & set(b)):
        x, y = a[n]["output_tok_s"], b[n]["output_tok_s"]
        cost = 1 - y / x
        rule = limits.get(n, 0.10)
        print(f"{n:>5} {x:>14.1f} {y:>16.1f} {cost:>7.1%} {'ok' if cost <= rule else 'over':>6}"
              f"   runs {min(a[n]['runs']):.0f}-{max(a[n]['runs']):.0f} / {min(b[n]['runs']):.0f}-{max(b[n]['runs']):.0f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tests", help="the pytest processes of a directory")
    t.add_argument("dir", type=Path)
    c = sub.add_parser("cost", help="bench throughput JSON without and with --batch-invariant")
    c.add_argument("off", type=Path)
    c.add_argument("on", type=Path)
    args = ap.parse_args(argv)
    return summarize_tests(args.dir) if args.what == "tests" else summarize_cost(args.off, args.on)


if __name__ == "__main__":
    sys.exit(main())
