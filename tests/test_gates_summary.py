"""scripts/gpu_gates_summary.py: the fault table (CPU vs CUDA cells of test_faults.py) and the bench
invariance verdicts, from hand-written live logs and result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gpu_gates_summary as summary  # noqa: E402

F = "tests/test_faults.py::"


def write_job(directory: Path, name: str, outcomes: dict[str, str], rc: str = "0 12") -> None:
    """A pytest process: its cells (.ids), the live log of their outcomes (.live) and its rc file."""
    (directory / f"{name}.ids").write_text("".join(f"{c}\n" for c in outcomes))
    live = "".join(f"START {c}\n{o} {c} call 0.1s\n" + ("    E   assert 1 == 0\n" if o == "FAILED" else "")
                   for c, o in outcomes.items() if o != "ABORTED")
    live += "".join(f"START {c}\n" for c, o in outcomes.items() if o == "ABORTED")
    (directory / f"{name}.live").write_text(live)
    (directory / f"{name}.rc").write_text(rc)


def test_cell_target():
    assert summary.cell_target(F + "test_row_by_position_caught[cpu]") == "cpu"
    assert summary.cell_target(F + "test_no_fault_all_gates_pass[cuda-bf16-pinned]") == "cuda-bf16"
    assert summary.cell_target(F + "test_runtime_audit_flags_row_by_position[cuda-f32-self]") == "cuda-f32"
    assert summary.cell_target(F + "test_early_prefix_publish_caught_whatever_the_block_count[16]") == "cpu"


def test_fault_table(tmp_path, capsys):
    write_job(tmp_path, "faults_cpu", {F + "test_row_by_position_caught[cpu]": "PASSED",
                                       F + "test_placeholder_leak_caught[cpu]": "PASSED"})
    write_job(tmp_path, "faults_00", {F + "test_row_by_position_caught[cuda-bf16]": "FAILED",
                                      F + "test_placeholder_leak_caught[cuda-bf16]": "PASSED",
                                      F + "test_graph_stage_no_writeback_caught[cuda-bf16]": "ABORTED"}, "134 3")
    assert summary.summarize_faults(tmp_path) == 1
    out = capsys.readouterr().out.splitlines()

    def line(fault: str, gate: str) -> list[str]:
        return next(x for x in out if x.startswith(fault + " ") and gate in x).split()

    assert line("row_by_position", "parity tokens")[-4:] == ["passed", "1/1", "FAILED", "0/1"]
    assert line("row_by_position", "runtime audit")[-2:] == ["-", "-"]
    assert line("placeholder_leak", "parity tokens")[-4:] == ["passed", "1/1", "passed", "1/1"]
    assert line("graph_stage_no_writeback", "GPU-only")[-3:] == ["-", "ABORTED", "0/1"]


def test_fault_table_all_caught(tmp_path, capsys):
    write_job(tmp_path, "faults_cpu", {F + "test_miscount_rejected_caught[cpu]": "PASSED"})
    assert summary.summarize_faults(tmp_path) == 0
    assert "cuda" in capsys.readouterr().out.splitlines()[0]  # the CUDA column, even with no CUDA cell


def _row(method: str, batch: int, loop: str, mismatches: int = 0, hashes=("a", "b"), **kw) -> dict:
    return {"method": method, "batch_size": batch, "loop": loop, "mismatches": mismatches, "num_prompts": 2,
            "first_mismatch": None if not mismatches else 3, "tok_s": 10.0, "output_hashes": list(hashes), **kw}


def test_same_requests_with_copies():
    assert summary.same_requests(list("ab"), list("abab")) and summary.same_requests(list("abab"), list("ab"))
    assert not summary.same_requests(list("ab"), list("abba"))
    assert not summary.same_requests(list("ab"), list("aba")) and not summary.same_requests([], [])


def test_invariance_verdicts(tmp_path, capsys):
    same = {"loop_mismatches": 0, "counters_match": True, "counters_diff": {}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": [_row("none", 1, "sync"), _row("none", 1, "async", **same),
                                      _row("none", 16, "sync"), _row("none", 16, "async", **same)]}))
    b.write_text(json.dumps({"rows": [_row("none", 1, "sync", hashes="abab"),  # --copies 2
                                      _row("ngram", 1, "sync", hashes="abab", acceptance_rate=0.5),
                                      _row("ngram", 1, "async", hashes="abab", acceptance_rate=0.5, **same)]}))
    assert summary.summarize_invariance([a, b]) == 0
    out = capsys.readouterr().out
    assert out.count("YES") == 4 and "NO " not in out

    bad = {"loop_mismatches": 1, "counters_match": False, "counters_diff": {"num_drafts": [4, 5]}}
    b.write_text(json.dumps({"rows": [_row("none", 1, "sync", hashes=("a", "c")),
                                      _row("ngram", 1, "sync", 1, ("a", "x"), acceptance_rate=0.5),
                                      _row("ngram", 1, "async", acceptance_rate=0.5, **bad)]}))
    assert summary.summarize_invariance([a, b]) == 1
    out = capsys.readouterr().out
    assert "num_drafts: first loop 4, this loop 5" in out
    verdicts = [line[:3] for line in out.splitlines() if line[:3] in ("YES", "NO ")]
    assert verdicts == ["YES", "NO ", "NO ", "NO "]
