"""The proposer interface. Every speculative method drafts through it.

Per engine step, after the target step is committed:
  1. observe(sched, result): see what the target just computed — its scheduled tokens and, for
     drafters that read target hidden states (DFlash, EAGLE), the captured layers' hidden states
     at every scheduled position (result.captured, result.token_offsets). Draft models use it to
     keep their own KV cache level with the target's.
  2. propose(requests): draft up to k tokens for each request that is about to decode.
Rollback after rejection is implicit: a proposer keeps per-request lengths, never copies cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.core.faults import NO_FAULTS
from verispec.core.request import Request
from verispec.core.scheduler_output import SchedulerOutput
from verispec.worker.token_state import DeviceTokens


@dataclass
class Proposal:
    """Drafts per request id, and (for sampled drafts) the draft distributions q [k, V].

    Device proposers (draft models) fill `device` (the truth) and leave `token_ids` as host
    mirrors holding PLACEHOLDERs until collect_host() copies the values back.
    """

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    probs: dict[str, torch.Tensor] = field(default_factory=dict)
    device: DeviceTokens | None = None

    def collect_host(self) -> None:
        """Fill the host mirror from the device drafts (a device->host sync)."""
        if self.device is None:
            return
        values = self.device.values.tolist()
        for rid, row in self.device.rows_by_id.items():
            k = len(self.token_ids[rid])
            self.token_ids[rid] = values[row][:k]


class Proposer:
    """Base class: subclasses override propose(); observe() and free_request() are optional."""

    #: Target layers whose hidden states the proposer reads (empty: none).
    capture_layers: tuple[int, ...] = ()
    #: True when drafting reads token values on the host (ngram): the overlapped loop must then
    #: collect the step before proposing. Device proposers read placeholders through `sources`.
    needs_host_tokens: bool = True

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.faults = NO_FAULTS  # the engine's planted bugs and strict checks (set by the builder)
        self.max_model_len = 1 << 30
        self.num_blocks = 0
        self.block_size = 16

    def bind(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """Called once the engine has sized the KV cache (draft models allocate theirs here)."""
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len

    def observe(self, sched: SchedulerOutput, result) -> None:  # noqa: B027 - optional hook
        """See the target's step (tokens computed, hidden states captured)."""

    def propose(self, requests: list[Request], sources: dict | None = None) -> Proposal:
        """Draft for each request. sources: device buffers (token_state.DeviceTokens) holding the
        values of any PLACEHOLDER in the requests' tokens."""
        raise NotImplementedError

    def free_request(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Forget a finished or preempted request."""

    def max_drafts_for(self, req: Request) -> int:
        """k, trimmed so drafts never run past max_tokens or the context."""
        left = min(req.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1
        return max(0, min(self.k, left))

    def num_drafts_for(self, req: Request) -> int:
        """The drafts to propose for req now: max_drafts_for, capped by the speculation policy's
        choice for its next step (req.draft_limit; None without adaptive speculation)."""
        k = self.max_drafts_for(req)
        limit = req.draft_limit
        return k if limit is None or limit >= k else max(0, limit)
