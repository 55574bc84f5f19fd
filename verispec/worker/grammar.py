"""Grammar masks for structured outputs: compiled grammars, per-request matchers, bitmask rows.

One `GrammarBackend` per tokenizer and logit width (`shared_backend`: built once per process, shared by
the engines on that tokenizer) compiles a request's checked xgrammar Grammar (core/structured.py)
against the engine's vocabulary (the tokenizer's byte-level spellings; ids the model has beyond the
tokenizer are never allowed) and gives each constrained sequence its own host `GrammarMatcher`.

The matcher's state is the grammar state after the request's *committed* output tokens; the engine
advances it after each step by the tokens the step emitted (`advance`). Before a step is verified,
`bitmask_rows` walks the matcher through the step's drafts: row j is the mask after drafts 0..j-1
(fill_next_token_bitmask, accept_token), then the matcher rolls back to where it was. A draft the
grammar forbids stops the walk: its own row forbids it, so greedy and rejection-sampled verification
both reject it there, and the rows after it are never used (they allow everything).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from verispec.core.structured import StructuredOutputsParams, import_xgrammar

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarBackend:
    """Compiles grammars for one vocabulary and makes matchers. vocab: the spellings of the
    tokenizer's ids ('' for special tokens); vocab_size: the model's logit width (>= len(vocab));
    stop_token_ids: the ids that end a completed grammar (EOS)."""

    def __init__(self, vocab: list[str], vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = import_xgrammar()
        self.vocab_size = vocab_size
        if len(vocab) > vocab_size:
            raise ValueError(f"the tokenizer has {len(vocab)} tokens but the model only {vocab_size} logits")
        stops = sorted(t for t in stop_token_ids if t < vocab_size)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._xgr = xgr

    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one sequence (the compiled grammar is cached by xgrammar). Raises
        ValueError when the grammar does not compile for this vocabulary."""
        try:
            compiled = self._compiler.compile_grammar(params.grammar_object())
        except RuntimeError as e:
            raise ValueError(f"StructuredOutputsParams.{params.kind()} does not compile: {e}") from None
        return RequestGrammar(self, self._xgr.GrammarMatcher(compiled))

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 host bitmask [rows, ceil(vocab / 32)], every token allowed."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab_size, stops): backend}
_SHARED_LOCK = threading.Lock()


def shared_backend(tokenizer: Any, vocab_size: int) -> GrammarBackend:
    """The GrammarBackend for a tokenizer object and a logit width, built once per process and shared
    by every engine on that tokenizer (building one costs ~1 s for a 150k vocabulary: xgrammar's
    TokenizerInfo; its compiled grammars are immutable and the compiler is thread-safe, and each
    request still gets a matcher of its own). Dropped with the tokenizer."""
    stops = tuple(sorted(tokenizer.eos_token_ids))
    with _SHARED_LOCK:
        per_tok = _SHARED.setdefault(tokenizer, {})
        backend = per_tok.get((vocab_size, stops))
        if backend is None:
            backend = per_tok[(vocab_size, stops)] = GrammarBackend(tokenizer.grammar_vocab(), vocab_size, list(stops))
        return backend


@dataclass
class RequestGrammar:
    """One sequence's grammar: its host matcher (the state after its committed output tokens; the
    engine advances it after each step) and the backend that sizes its bitmasks."""

    backend: GrammarBackend
    matcher: Any  # xgrammar.GrammarMatcher
    num_refused: int = 0  # emitted tokens the grammar refused (a bug if ever > 0)

    def advance(self, tokens: list[int]) -> bool:
        """Accept a step's emitted tokens; True once the grammar is terminated (its stop token accepted)."""
        self.num_refused += advance(self.matcher, tokens)
        return self.matcher.is_terminated()


def bitmask_rows(matcher: Any, drafts: list[int], bitmask: torch.Tensor) -> None:
    """Fill bitmask [len(drafts) + 1, words] (all ones on entry): row j is the matcher's mask after
    drafts[:j]. The matcher is left in the state it was in. A forbidden draft ends the walk."""
    accepted = 0
    for j in range(len(drafts) + 1):
        if matcher.is_terminated():
            break  # after the stop token nothing is sampled (the request finishes there)
        matcher.fill_next_token_bitmask(bitmask, j)
        if j == len(drafts) or not matcher.accept_token(drafts[j]):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)


def advance(matcher: Any, tokens: list[int]) -> int:
    """Accept a step's emitted tokens; returns how many the grammar refused (0 unless a bug let a
    forbidden token through: then the rest are skipped too)."""
    for i, t in enumerate(tokens):
        if matcher.is_terminated() or not matcher.accept_token(t):
            return len(tokens) - i
    return 0


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set logits[rows[i], t] to -inf where bit t of bitmask[i] is 0 (ids past the bitmask's
    vocabulary stay as they are: the backend sizes it to the logits)."""
    vocab = logits.shape[-1]
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).bool().view(len(rows), -1)[:, :vocab]
    idx = torch.tensor(rows, dtype=torch.long)
    if logits.device.type != "cpu":
        allowed, idx = allowed.to(logits.device, non_blocking=True), idx.to(logits.device, non_blocking=True)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
