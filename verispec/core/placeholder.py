"""The placeholder value: a host mirror's stand-in for a token id that lives only on the device.

Every host list of token ids (a request's output, its drafts) may hold PLACEHOLDER entries between
a step's launch and its collect; verispec/worker/token_state.py says who may read which mirror when.
"""

from __future__ import annotations

import os

PLACEHOLDER = -1


class StaleMirrorError(RuntimeError):
    """A host mirror of device token state was read before its values arrived."""


def debug_stale() -> bool:
    """True when VERISPEC_DEBUG_STALE=1: a read of a stale mirror raises."""
    return os.environ.get("VERISPEC_DEBUG_STALE") == "1"


def check_fresh(ids: list[int], what: str) -> list[int]:
    """Return ids; with VERISPEC_DEBUG_STALE=1 raise if any entry is still a placeholder."""
    if debug_stale() and PLACEHOLDER in ids:
        raise StaleMirrorError(f"read of a stale host mirror: {what} holds placeholders {ids[-8:]}")
    return ids
