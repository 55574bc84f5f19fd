"""A request's books: tokens, progress, blocks and status. No tensors live here."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from verispec.core.counters import SpecCounters
from verispec.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclass
class Request:
    """One sequence being generated (a request with n > 1 becomes n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # Committed output tokens: sampled and (for speculative steps) accepted.
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Moves back on preemption and after rejected drafts.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Leading blocks of block_ids whose hashes this request has published (reset when freed).
    num_published_blocks: int = 0
    # Host copy of the drafts to verify in the next step. In the synchronous loop it is exact; the
    # overlapped loop keeps the authoritative drafts on the device (see worker/token_state.py).
    spec_token_ids: list[int] = field(default_factory=list)
    # Drafts the speculation policy allows in the request's next step (None: no policy, k). Set by the
    # engine right before each proposal.
    draft_limit: int | None = None
    # What the policy planned for the request's next step (0: nothing planned). A proposer that finds
    # fewer drafts (ngram without a match) falls short of it; the policy counts the shortfall as
    # rejected positions, so its estimates include the steps where drafts were missing.
    planned_drafts: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival))
    # Per-request acceptance counters (the same type as the engine's totals).
    spec: SpecCounters = field(default_factory=SpecCounters)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Overlapped loop: the length limit was reached with placeholders; finish once they resolve.
    pending_stop: bool = False
    parent_id: str | None = None
    index: int = 0
    # Structured outputs: the sequence's grammar matcher (worker/grammar.RequestGrammar), on the host;
    # its state follows the committed output tokens (the engine advances it in commit). None: free text.
    grammar: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus committed output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def token_at(self, i: int) -> int:
        """all_token_ids[i] (0 <= i < num_tokens) without building the whole list."""
        p = len(self.prompt_token_ids)
        return self.output_token_ids[i - p] if i >= p else self.prompt_token_ids[i]

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens if self.params.max_tokens is not None else 1 << 30
