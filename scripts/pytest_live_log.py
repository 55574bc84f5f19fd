"""A pytest plugin for runs that may abort: a CUDA device-side assert kills the process before pytest
prints its summary, and with it every failure's text (H200 session 10, test_faults.py). This writes
each cell's start, its outcome and duration, and the full text of every failed phase to $LIVE_LOG as
it happens (flushed and synced), so an abort loses nothing but the cell it hit.

usage: LIVE_LOG=FILE PYTHONPATH=scripts:$PYTHONPATH python3 -m pytest -p pytest_live_log ...
Lines: "START <nodeid>", "<OUTCOME> <nodeid> <when> <seconds>s", then a failure's text, indented.
"""

from __future__ import annotations

import os

import pytest


def _write(text: str) -> None:
    path = os.environ.get("LIVE_LOG")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    """A cell starts (the last START without an outcome is the one an abort hit)."""
    _write(f"START {nodeid}\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A phase's outcome: every call phase, and setup / teardown phases that did not pass."""
    if report.when != "call" and report.passed:
        return
    outcome = report.outcome.upper()
    text = f"{outcome} {report.nodeid} {report.when} {report.duration:.1f}s\n"
    if report.failed:
        text += "".join(f"    {line}\n" for line in report.longreprtext.splitlines())
    _write(text)
