"""The placeholder value: a host mirror's stand-in for a token id that lives only on the device.

Every host list of token ids (a request's output, its drafts) may hold PLACEHOLDER entries between
a step's launch and its collect; verispec/worker/token_state.py says who may read which mirror when.
"""

from __future__ import annotations

PLACEHOLDER = -1


class StaleMirrorError(RuntimeError):
    """A host mirror of device token state was read before its values arrived."""
