"""Incremental detokenization for streaming, with stop strings.

Each call decodes only a short window of recent tokens: a few tokens of already-emitted context
(so decoders that depend on neighbours stay consistent), then the tokens not yet settled, from
``_read`` on. The window's text minus the text of the context is new. A window whose text ends in
U+FFFD may end in the middle of a UTF-8 character, so its last character is held back until a later
token completes it (or ``flush``).

On top of that, stop strings: the trailing characters that could still grow into a stop string are
held back, so a partial stop string is never streamed; when one appears the text is cut there.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4  # prompt tokens decoded as context for the first output token
_MAX_CACHED_CONTEXTS = 1 << 17  # per tokenizer; the cache starts over when it is full


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class _ContextLengths:
    """Memo of len(decode(ids)) for context windows, shared by the detokenizers of one tokenizer.

    A window's context is usually the one token settled in the previous step, so the same few
    thousand contexts come back over and over; decode is a pure function of (ids, skip), so a hit
    is exactly what decoding would return, one decode per step fewer."""

    _by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.lengths: dict[tuple[bool, tuple[int, ...]], int] = {}

    @classmethod
    def of(cls, tokenizer: object) -> _ContextLengths:
        """The memo shared by every detokenizer of tokenizer (a private one if it cannot be
        weakly referenced)."""
        try:
            memo = cls._by_tokenizer.get(tokenizer)
            if memo is None:
                memo = cls._by_tokenizer[tokenizer] = cls()
        except TypeError:
            return cls()
        return memo

    def length(self, tokenizer: _Decoder, ids: list[int], skip: bool) -> int:
        """len(tokenizer.decode(ids, skip_special_tokens=skip)), from the memo when known."""
        key = (skip, tuple(ids))
        n = self.lengths.get(key)
        if n is None:
            n = len(tokenizer.decode(ids, skip_special_tokens=skip))
            if len(self.lengths) >= _MAX_CACHED_CONTEXTS:
                self.lengths.clear()
            self.lengths[key] = n
        return n


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, honouring stop strings."""

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a list of non-empty strings")
        self._tok = tokenizer
        self._context_lengths = _ContextLengths.of(tokenizer)
        self._skip = skip_special_tokens
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._include_stop = include_stop_str_in_output
        # The window: already-emitted context tokens _ids[:_read], then the unsettled ones.
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read = len(self._ids)
        if self._decode(0, self._read).endswith(_REPLACEMENT):  # prompt ends mid-character: no context
            self._ids, self._read = [], 0
        self._partial = 0  # chars emitted beyond the text of the context tokens
        self._chunks: list[str] = []  # settled output text
        self._len = 0  # total length of the settled output text
        self._streamed = 0  # chars of it already returned as deltas
        self._tail = ""  # its last max_stop-1 chars, where a stop string may have begun
        self.stop_hit: str | None = None
        self._finished = False

    # ------------------------------------------------------------------ public
    @property
    def text(self) -> str:
        """Output text so far, cut at a stop string; includes text still held back from the stream."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def finished(self) -> bool:
        """True once a stop string was hit or ``flush`` was called."""
        return self._finished

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append output tokens; return the text that may now be streamed (possibly empty)."""
        if self._finished or not new_ids:
            return ""
        self._ids.extend(new_ids)
        return self._append(self._settle(final=False))

    def flush(self) -> str:
        """End of generation: return all held-back text, including an unfinished trailing character."""
        if self._finished:
            return ""
        delta = self._append(self._settle(final=True))
        if self._finished:  # a stop string appeared in the last text
            return delta
        self._finished = True
        rest = self.text[self._streamed :]
        self._streamed = self._len
        return delta + rest

    # ----------------------------------------------------------------- decoding
    def _decode(self, start: int, end: int) -> str:
        ids = self._ids if start == 0 and end == len(self._ids) else self._ids[start:end]
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _settle(self, final: bool) -> str:
        """New settled text of the window; slide the window when its text is complete."""
        done = self._context_lengths.length(self._tok, self._ids[: self._read], self._skip) + self._partial
        window = self._decode(0, len(self._ids))
        if window.endswith(_REPLACEMENT) and not final:
            # Maybe a character cut in two: everything before the last char is settled already.
            new = window[done : len(window) - 1]
            self._partial += len(new)
            return new
        new = window[done:]
        # Slide: the old unsettled start becomes the context start; drop tokens before it.
        del self._ids[: self._read]
        self._read, self._partial = len(self._ids), 0
        return new

    # ------------------------------------------------------------ stop strings
    def _append(self, new: str) -> str:
        """Add settled text, look for stop strings, return what may be streamed now."""
        if not new:
            return ""
        self._chunks.append(new)
        self._len += len(new)
        if not self._stop:
            self._streamed = self._len
            return new
        # Only the last max_stop-1 old chars (which cover the held-back ones) can take part.
        region = self._tail + new
        base = self._len - len(region)  # offset of region[0] in the output text
        hit: tuple[int, int, str] | None = None  # (end, start, stop): the first to complete wins
        for s in self._stop:
            i = region.find(s)
            if i >= 0 and (hit is None or (i + len(s), i) < hit[:2]):
                hit = (i + len(s), i, s)
        if hit is not None:
            stop_end, start, self.stop_hit = hit
            end = base + (stop_end if self._include_stop else start)
            self._finished = True
            whole = self.text
            self._chunks, self._len = [whole[:end]], end
            delta = region[self._streamed - base : end - base]
            self._streamed = end
            return delta
        self._tail = region[-(self._max_stop - 1) :] if self._max_stop > 1 else ""
        keep = self._len - self._held_back(region)
        delta = region[self._streamed - base : keep - base] if keep > self._streamed else ""
        self._streamed = max(self._streamed, keep)
        return delta

    def _held_back(self, text: str) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
