"""Prompt lookup (n-gram) drafting over the request's own tokens."""

from __future__ import annotations

from array import array

from verispec.core.placeholder import PLACEHOLDER
from verispec.core.request import Request
from verispec.spec_decode.proposer import Proposal, Proposer


def ngram_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Find the longest suffix n-gram (n_max down to n_min) that occurred earlier; return up to k
    tokens that followed its most recent earlier occurrence.

    The search runs in C: the tokens become 8-byte words and bytes.rfind looks for the suffix's
    bytes, skipping hits that are not word-aligned."""
    length = len(tokens)
    data = array("q", tokens).tobytes()
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        start = _rfind_words(data, data[8 * (length - n) :], 8 * (length - 1))
        if start is not None:
            return tokens[start + n : start + n + k]  # never empty: the match ends before the last token
    return []


def _rfind_words(data: bytes, pattern: bytes, end: int) -> int | None:
    """Word index of the last occurrence of pattern inside data[:end] that starts on a word."""
    while True:
        i = data.rfind(pattern, 0, end)
        if i < 0:
            return None
        if i % 8 == 0:
            return i // 8
        end = i + len(pattern) - 1  # a misaligned hit: look further left


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, n_min: int, n_max: int) -> None:
        super().__init__(num_speculative_tokens)
        self.n_min, self.n_max = n_min, n_max

    def would_draft(self, requests: list[Request]) -> int:
        """How many of the requests' tokens but the newest end in an n-gram that occurred earlier (the
        policy's probe hint: the newest token may still be a placeholder in the overlapped loop, the rest is
        known alike in both loops)."""
        count = 0
        for req in requests:
            tokens = req.all_token_ids[:-1]
            if PLACEHOLDER not in tokens and ngram_lookup(tokens, 1, self.n_min, self.n_max):
                count += 1
        return count

    def propose(self, requests: list[Request], sources: dict | None = None) -> Proposal:
        out = Proposal()
        for req in requests:
            k = self.num_drafts_for(req)
            if k > 0:
                tokens = self.faults.check_fresh(req.all_token_ids, "all_token_ids (ngram lookup)")
                out.token_ids[req.request_id] = ngram_lookup(tokens, k, self.n_min, self.n_max)
        return out
