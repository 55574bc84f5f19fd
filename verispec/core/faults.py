"""Test-only fault injection: VERISPEC_FAULT=<name> plants one known bug so tests can prove the
gates catch it. Ignored unless set. Names:

- stale_host_draft: the verifier reads draft tokens from the stale host mirror.
- row_by_position: previous-step rows are mapped by position instead of request id.
- placeholder_leak: a placeholder id reaches the model's input ids.
- early_prefix_publish: a prefix-cache hash is published before its K/V is written.
- miscount_rejected: the acceptance counters count a rejected position as accepted.
"""

from __future__ import annotations

import os

KNOWN = ("stale_host_draft", "row_by_position", "placeholder_leak", "early_prefix_publish", "miscount_rejected")


def active(name: str) -> bool:
    """True when VERISPEC_FAULT names this fault (read at call time so tests can set it)."""
    assert name in KNOWN, name
    return os.environ.get("VERISPEC_FAULT") == name
