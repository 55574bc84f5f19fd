"""What the scheduler hands the runner each step: which requests, which token range, how many drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens), drafts last."""

    request: Request
    start: int
    num_new_tokens: int
    num_draft_tokens: int
    output_base: int = 0  # len(output_token_ids) when launched: index of the first sampled token

    @property
    def needs_sample(self) -> bool:
        """True when the chunk reaches the last known token, so the step samples for it."""
        return self.start + self.num_new_tokens - self.num_draft_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
