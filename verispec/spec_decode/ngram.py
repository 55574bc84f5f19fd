"""Prompt lookup (n-gram) drafting over the request's own tokens."""

from __future__ import annotations

from array import array

from verispec.core.placeholder import PLACEHOLDER
from verispec.core.request import Request
from verispec.spec_decode.proposer import Proposal, Proposer


class TokenWords:
    """A host mirror of a request's leading token values (prompt, then outputs) as 8-byte words, the
    form the lookup searches, kept by NgramProposer and extended by the tokens committed since: converting
    the whole list every step cost ~24 us per request at 1,000 tokens (array("q", list) is ~24 ns a token).

    Holds only values (never a PLACEHOLDER) of the first `length` tokens. Stale once the request's
    tokens before `length` change, which only a stop that cuts a step's tokens does (Scheduler.resolve:
    the request finishes, and the proposer drops its mirror in free_request, as on preemption);
    `current` checks it anyway (length and last value) before every read. Read only by the lookup
    (ngram_lookup), inside NgramProposer."""

    __slots__ = ("data", "last", "length")

    def __init__(self) -> None:
        self.data = bytearray()
        self.length = 0
        self.last = PLACEHOLDER  # the value of token length - 1 (PLACEHOLDER while empty)

    def current(self, req: Request) -> bool:
        """True while the mirror is a prefix of req's tokens as far as a length and last-value check
        can tell (False: rebuild it)."""
        n = self.length
        return n <= req.num_tokens and (n == 0 or req.token_at(n - 1) == self.last)

    def extend(self, new: list[int]) -> None:
        """Append token values (no PLACEHOLDER among them)."""
        if new:
            self.data += array("q", new).tobytes()
            self.length += len(new)
            self.last = new[-1]


def ngram_lookup(tokens: list[int] | TokenWords, k: int, n_min: int, n_max: int, length: int | None = None) -> list[int]:
    """Find the longest suffix n-gram (n_min <= n <= n_max) that occurred earlier; return up to k
    tokens that followed its most recent earlier occurrence.

    tokens: the token ids, or their TokenWords mirror (no conversion); length: look at the first
    `length` tokens only (default: all). The search runs in C: the tokens become 8-byte words and
    bytes.rfind looks for the suffix's bytes, skipping hits that are not word-aligned."""
    if isinstance(tokens, TokenWords):
        data, ids = tokens.data, None
        length = tokens.length if length is None else length
    else:
        ids = tokens
        length = len(tokens) if length is None else length
        data = array("q", tokens[:length]).tobytes()
    # The longest n with an earlier occurrence, searched from the shortest up: where the suffix n-gram
    # occurs (ending before the last token) its (n-1)-gram suffix occurs too, one token later, so the
    # first n without one ends the search. Each failed search scans the whole context and a found one
    # usually stops near its end, so this scans it once (longest first: once per n that fails).
    found = None
    for n in range(n_min, min(n_max, length - 1) + 1):
        start = _rfind_words(data, data[8 * (length - n) : 8 * length], 8 * (length - 1))
        if start is None:
            break
        found = start + n
    if found is None:
        return []
    b = min(found + k, length)  # never empty: the match ends before the last token
    return ids[found:b] if ids is not None else array("q", data[8 * found : 8 * b]).tolist()


def _rfind_words(data: bytes | bytearray, pattern: bytes | bytearray, end: int) -> int | None:
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
        self._words: dict[str, TokenWords] = {}  # request id -> its tokens' mirror (TokenWords says when stale)

    def free_request(self, request_id: str) -> None:
        self._words.pop(request_id, None)

    def _mirror(self, req: Request, store: bool) -> TokenWords:
        """req's TokenWords, current and extended by its new tokens up to the first PLACEHOLDER (kept for
        the next step when store; the probe hint never stores, as it also asks about finished requests)."""
        m = self._words.get(req.request_id)
        if m is None or not m.current(req):
            m = TokenWords()
            if store:
                self._words[req.request_id] = m
        new = req.token_slice(m.length, req.num_tokens)
        if PLACEHOLDER in new:
            new = new[: new.index(PLACEHOLDER)]
        m.extend(new)
        return m

    def would_draft(self, requests: list[Request]) -> int:
        """How many of the requests' tokens but the newest end in an n-gram that occurred earlier (the
        policy's probe hint: the newest token may still be a placeholder in the overlapped loop, the rest is
        known alike in both loops)."""
        count = 0
        for req in requests:
            m = self._mirror(req, store=False)
            n = req.num_tokens - 1  # (a placeholder among those tokens: not counted)
            if m.length >= n and ngram_lookup(m, 1, self.n_min, self.n_max, n):
                count += 1
        return count

    def propose(self, requests: list[Request], sources: dict | None = None) -> Proposal:
        out = Proposal()
        for req in requests:
            k = self.num_drafts_for(req)
            if k > 0:
                m = self._mirror(req, store=True)
                if m.length == req.num_tokens:
                    out.token_ids[req.request_id] = ngram_lookup(m, k, self.n_min, self.n_max)
                else:  # a placeholder among its tokens (a stale read: raises in debug mode), as before
                    tokens = self.faults.check_fresh(req.all_token_ids, "all_token_ids (ngram lookup)")
                    out.token_ids[req.request_id] = ngram_lookup(tokens, k, self.n_min, self.n_max)
        return out
