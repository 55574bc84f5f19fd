"""Planted bugs and strict checks for one engine: an object the engine is given, never a global.

A production engine gets `Faults()` (nothing planted). Tests and outside checks plant one known
bug so a gate can prove it catches it; `Faults.from_env()` reads VERISPEC_FAULT and
VERISPEC_DEBUG_STALE once, when an engine is built. The bug classes:

- stale_host_draft: the verifier reads draft tokens from the stale host mirror.
- row_by_position: previous-step rows are mapped by position instead of request id.
- placeholder_leak: a placeholder id reaches the model's input ids.
- early_prefix_publish: a prefix-cache hash is published before its K/V is written.
- miscount_rejected: the acceptance counters count a rejected position as accepted.
- stale_graph_metadata: a CUDA-graph replay skips refreshing the attention metadata (the static
  seq_lens keep the previous replay's values; vLLM #38311's class).
- unmasked_verify: a constrained request's drafts are verified without its grammar mask.
- graph_stage_no_writeback (GPU-only code): the CUDA-graph staging kernel (kernels/graph_inputs.py)
  fills the placeholders of the graph's static input ids but not of the step's own ids, where the
  verifier reads the drafts (the model sees the right tokens, the verifier placeholders).
"""

from __future__ import annotations

from dataclasses import dataclass

from verispec.core import envs
from verispec.core.placeholder import PLACEHOLDER, StaleMirrorError

KNOWN = ("stale_host_draft", "row_by_position", "placeholder_leak", "early_prefix_publish", "miscount_rejected",
         "stale_graph_metadata", "unmasked_verify", "graph_stage_no_writeback")


@dataclass(frozen=True)
class Faults:
    """planted: the bugs to plant (names from KNOWN); debug_stale: stale mirror reads raise."""

    planted: frozenset[str] = frozenset()
    debug_stale: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.planted) - set(KNOWN)
        if unknown:
            raise ValueError(f"unknown fault {sorted(unknown)}; known: {list(KNOWN)}")

    @classmethod
    def from_env(cls) -> Faults:
        """VERISPEC_FAULT and VERISPEC_DEBUG_STALE, read now (once per engine)."""
        name = envs.fault()
        return cls(frozenset([name]) if name else frozenset(), envs.debug_stale())

    def active(self, name: str) -> bool:
        """True when this engine plants the named bug."""
        assert name in KNOWN, name
        return name in self.planted

    def check_fresh(self, ids: list[int], what: str) -> list[int]:
        """Return ids; with debug_stale, raise if any entry is still a placeholder."""
        if self.debug_stale and PLACEHOLDER in ids:
            raise StaleMirrorError(f"read of a stale host mirror: {what} holds placeholders {ids[-8:]}")
        return ids


NO_FAULTS = Faults()
