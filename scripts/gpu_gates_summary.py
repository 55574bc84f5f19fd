"""Compact results of scripts/gpu_gates.sh.

  tests DIR: every pytest process of DIR (<job>.ids: its cells, <job>.live: scripts/pytest_live_log.py's
    log, <job>.rc: "rc seconds") in one table, then each failure's assertion lines, the cell an abort
    hit and the cells it never ran;
  cost OFF.json ON.json: bench throughput without and with --batch-invariant, tok/s per sequence count
    and the cost of invariance (1 - on / off; the issue's rule: <= 5% at 1, <= 10% at 64 and 256);
  faults DIR: the fault table of tests/test_faults.py's cells in DIR's processes: for each planted fault
    and the gate that must catch it, the outcome of its CPU cells (tiny models) and of its CUDA cells
    (the real 0.5B, cuda-f32 or cuda-bf16);
  invariance JSON...: bench invariance --loops results (one file per process) in one table, and the
    verdicts: plain decoding the same at every batch size, every method the same as plain decoding,
    and the later loop (async) the same as the first (sync) in tokens and acceptance counters.
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


# (fault planted, the gate that catches it, its test in tests/test_faults.py); None: a control, no fault.
FAULT_GATES: list[tuple[str | None, str, str]] = [
    (None, "every gate passes, self oracle = 1.0", "test_no_fault_all_gates_pass"),
    (None, "audit quiet in the sync loop", "test_runtime_audit_quiet_when_the_sync_loop_is_unaffected"),
    ("stale_host_draft", "parity counters + self oracle", "test_stale_host_draft_caught_text_stays_correct"),
    ("stale_host_draft, placeholder_leak, miscount_rejected", "runtime audit",
     "test_runtime_audit_flags_every_acceptance_fault"),
    ("row_by_position", "parity tokens", "test_row_by_position_caught"),
    ("row_by_position", "runtime audit", "test_runtime_audit_flags_row_by_position"),
    ("placeholder_leak", "parity tokens", "test_placeholder_leak_caught"),
    ("early_prefix_publish", "prefix-cache equivalence", "test_early_prefix_publish_caught"),
    ("early_prefix_publish", "aborted writer, 15-17 blocks", "test_early_prefix_publish_caught_whatever_the_block_count"),
    ("miscount_rejected", "counter hand count", "test_miscount_rejected_caught"),
    ("stale_graph_metadata", "graph path vs eager", "test_stale_graph_metadata_caught"),
    ("graph_stage_no_writeback", "parity counters + oracle + audit (GPU-only code)",
     "test_graph_stage_no_writeback_caught"),
]


def cell_target(nodeid: str) -> str:
    """"cpu" or the CUDA cell's id ("cuda-f32", "cuda-bf16") of a test_faults.py cell; unparametrized
    cells run the tiny models on the CPU."""
    params = nodeid.partition("[")[2].rstrip("]").split("-")
    if params[0] == "cuda" and len(params) > 1:
        return f"cuda-{params[1]}"
    return "cpu"


def outcome_text(outcomes: list[str]) -> str:
    """"passed 2/2", "FAILED 1/2", or "-" for no cell."""
    if not outcomes:
        return "-"
    ok = sum(o in ("PASSED", "XFAIL") for o in outcomes)
    bad = [o for o in outcomes if o not in ("PASSED", "XFAIL", "SKIPPED")]
    word = "passed" if not bad else ("FAILED" if "FAILED" in bad or "ERROR" in bad else bad[0])
    skipped = sum(o == "SKIPPED" for o in outcomes)
    return f"{word} {ok}/{len(outcomes)}" + (f" ({skipped} skipped)" if skipped else "")


def summarize_faults(directory: Path) -> int:
    """Print the fault table; 0 when every cell that ran passed, 1 otherwise (or when no cell ran)."""
    outcome: dict[str, str] = {}
    for job in (read_job(p) for p in sorted(directory.glob("*.ids"))):
        hit = set(job.hit)
        for c in job.cells:
            outcome[c] = job.outcome.get(c, "ABORTED" if c in hit else "NOT RUN")
    cells = {c: o for c, o in outcome.items() if "test_faults.py::" in c}
    if not cells:
        print(f"faults: no tests/test_faults.py cells under {directory}")
        return 1
    cuda = sorted({cell_target(c) for c in cells} - {"cpu"}) or ["cuda"]
    print(f"{'fault':<54} {'gate':<48} {'cpu':<14} " + " ".join(f"{t:<14}" for t in cuda))
    bad = False
    for fault, gate, test in FAULT_GATES:
        mine = {c: o for c, o in cells.items() if c.split("::")[1].partition("[")[0] == test}
        cols = {t: [o for c, o in mine.items() if cell_target(c) == t] for t in ["cpu", *cuda]}
        bad |= any(o not in ("PASSED", "SKIPPED", "XFAIL") for o in mine.values())
        print(f"{fault or '(no fault: control)':<54} {gate:<48} {outcome_text(cols['cpu']):<14} "
              + " ".join(f"{outcome_text(cols[t]):<14}" for t in cuda))
    print("(passed = the gate caught the planted fault, or for a control: nothing fired; '-' = no such cell "
          "on that target: the fault's code path exists on one only, or the cells were not run)")
    return int(bad)


def same_requests(a: list[str], b: list[str]) -> bool:
    """Two rows' per-request hashes agree, where a row of a run with --copies N holds its prompts' N
    copies one after the other (request i + j * P is a copy of request i): the longer list must repeat
    the shorter one."""
    short, long = sorted((a or [], b or []), key=len)
    return bool(short) and len(long) % len(short) == 0 and all(h == short[i % len(short)] for i, h in enumerate(long))


def summarize_invariance(paths: list[Path]) -> int:
    """Print every bench invariance row of the files and the verdicts; 0 when all hold."""
    rows = []
    for path in paths:
        if not path.exists() and Path(f"{path}.partial").exists():  # a run cut short: the rows it finished
            print(f"invariance: {path.name}: cut short, the rows of {path.name}.partial")
            path = Path(f"{path}.partial")
        try:
            rows += [dict(r, file=path.name) for r in json.loads(path.read_text())["rows"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"invariance: {path.name}: no result ({type(e).__name__})")
    if not rows:
        return 1
    print(f"{'method':<12} {'batch':>5} {'loop':<6} {'differ':>7} {'first at':>8} {'accept':>7} {'tok/s':>8} "
          f"{'vs 1st loop':>11} {'counters':>9}  file")
    for r in rows:
        acc = f"{r['acceptance_rate']:.4f}" if r.get("acceptance_rate") is not None else "-"
        first = "-" if r.get("first_mismatch") is None else str(r["first_mismatch"])
        vs = "-" if "loop_mismatches" not in r else str(r["loop_mismatches"])
        same = "-" if "counters_match" not in r else ("same" if r["counters_match"] else "DIFFER")
        print(f"{r['method']:<12} {r['batch_size']:>5} {r.get('loop', '?'):<6} {r['mismatches']:>3}/{r['num_prompts']:<3} "
              f"{first:>8} {acc:>7} {r['tok_s']:>8.1f} {vs:>11} {same:>9}  {r['file']}")
        for name, (a, b) in r.get("counters_diff", {}).items():
            print(f"    {name}: first loop {a}, this loop {b}")
    plain = [r for r in rows if r["method"] == "none"]
    spec = [r for r in rows if r["method"] != "none"]
    later = [r for r in rows if "counters_match" in r]
    verdicts = [
        ("plain decoding identical at every batch size", plain),
        ("every method identical to plain decoding at batch 1", spec),
    ]
    ok = True
    for text, group in verdicts:
        held = bool(group) and all(r["mismatches"] == 0 for r in group)
        ok &= held
        sizes = sorted({r["batch_size"] for r in group})
        print(f"{'YES' if held else 'NO ':<3} {text} ({len(group)} rows, batches {sizes}; "
              f"{sum(r['mismatches'] > 0 for r in group)} with mismatches)")
    held = bool(later) and all(r["loop_mismatches"] == 0 and r["counters_match"] for r in later)
    ok &= held
    print(f"{'YES' if held else 'NO ':<3} later loop identical to the first in tokens and counters ({len(later)} rows; "
          f"{sum(r['loop_mismatches'] > 0 for r in later)} with token mismatches, "
          f"{sum(not r['counters_match'] for r in later)} with different counters)")
    # Across files (processes side by side): every row's tokens against the first file's reference.
    ref = rows[0].get("output_hashes")
    hashed = [r for r in rows if r.get("output_hashes")]
    if len(paths) > 1:
        off = [r for r in hashed if not same_requests(r["output_hashes"], ref)]
        held = bool(ref) and len(hashed) == len(rows) and not off
        ok &= held
        print(f"{'YES' if held else 'NO ':<3} every row of every file has the tokens of {rows[0]['file']}'s plain "
              f"batch 1 ({len(hashed)} rows with hashes; {len(off)} differ"
              + "".join(f"; {r['file']} {r['method']} b{r['batch_size']} {r.get('loop')}" for r in off[:4]) + ")")
    return int(not ok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tests", help="the pytest processes of a directory")
    t.add_argument("dir", type=Path)
    c = sub.add_parser("cost", help="bench throughput JSON without and with --batch-invariant")
    c.add_argument("off", type=Path)
    c.add_argument("on", type=Path)
    f = sub.add_parser("faults", help="the fault table of the test_faults.py cells of a directory's processes")
    f.add_argument("dir", type=Path)
    i = sub.add_parser("invariance", help="bench invariance JSON files (one per process) and the verdicts")
    i.add_argument("files", type=Path, nargs="+")
    args = ap.parse_args(argv)
    if args.what == "tests":
        return summarize_tests(args.dir)
    if args.what == "faults":
        return summarize_faults(args.dir)
    if args.what == "invariance":
        return summarize_invariance(args.files)
    return summarize_cost(args.off, args.on)


if __name__ == "__main__":
    sys.exit(main())
