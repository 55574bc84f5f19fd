"""Prompt lookup (n-gram) drafting over the request's own tokens."""

from __future__ import annotations

from verispec.engine.request import Request
from verispec.spec.proposer import Proposal, Proposer
from verispec.worker.token_state import check_fresh


def ngram_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Find the longest suffix n-gram (n_max down to n_min) that occurred earlier; return up to k
    tokens that followed its most recent earlier occurrence."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        # Scan backwards for the latest earlier match.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, n_min: int, n_max: int) -> None:
        super().__init__(num_speculative_tokens)
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[Request], sources: dict | None = None) -> Proposal:
        out = Proposal()
        for req in requests:
            k = self.num_drafts_for(req)
            if k > 0:
                tokens = check_fresh(req.all_token_ids, "all_token_ids (ngram lookup)")
                out.token_ids[req.request_id] = ngram_lookup(tokens, k, self.n_min, self.n_max)
        return out
