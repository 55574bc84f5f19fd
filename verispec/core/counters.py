"""Acceptance counters: one implementation for the engine's totals and each request's own."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    """Acceptance counters, summed since start (CONTRACT.md names)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
