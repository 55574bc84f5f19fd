"""The host-side fast paths equal their plain definitions: n-gram lookup, cache slots, staging,
shared-params checks, stop checks. (The decode-step input lists: test_batch_builder.py.)"""

from __future__ import annotations

import copy
import random

import torch

from verispec import SamplingParams
from verispec.core.request import Request
from verispec.core.scheduler_output import ScheduledRequest
from verispec.spec_decode.ngram import ngram_lookup
from verispec.worker.inputs import Staging, extend_slots, padded_tables
from verispec.worker.verifier import all_greedy, mask_and_penalize


def ngram_reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_lookup_matches_reference():
    rng = random.Random(0)
    for _ in range(3000):
        length = rng.randrange(0, 50)
        vocab = rng.choice([2, 3, 50, 70000])
        toks = [rng.randrange(vocab) for _ in range(length)]
        if rng.random() < 0.3:  # byte patterns that produce misaligned bytes.rfind hits
            toks = [rng.choice([0, 1, 255, 256, 65536, 2**32]) for _ in range(length)]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        assert ngram_lookup(toks, k, lo, hi) == ngram_reference(toks, k, lo, hi), (toks, k, lo, hi)


def test_extend_slots_and_tables():
    rng = random.Random(1)
    for _ in range(200):
        bs = rng.choice([1, 4, 16])
        blocks = rng.sample(range(100), 12)
        start = rng.randrange(0, 5 * bs)
        n = rng.randrange(0, len(blocks) * bs - start + 1)
        out: list[int] = []
        extend_slots(out, blocks, start, n, bs)
        assert out == [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        one: list[int] = [7]
        extend_slots(one, blocks, start, 1, bs)  # the decode-row fast path
        assert one == [7, blocks[start // bs] * bs + start % bs]
    assert padded_tables([[3, 4], [5]], 3) == [3, 4, 0, 5, 0, 0]


def test_staging_round_trip_and_ring():
    st = Staging(torch.device("cpu"), slots=2, capacity=4)
    first = st.stage([[1, 2, 3], [], [-2]], [[7], [8, 9]])
    assert [None if v is None else v.tolist() for v in first] == [[1, 2, 3], None, [-2], [7], [8, 9]]
    assert first[0].dtype == torch.long and first[3].dtype == torch.int32
    second = st.stage([list(range(20))], [[5] * 9])  # grows its slot; the first step's views stay intact
    assert second[0].tolist() == list(range(20)) and second[1].tolist() == [5] * 9
    assert first[0].tolist() == [1, 2, 3]


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.7]), min_tokens=rng.choice([0, 0, 2, 5]),
        max_tokens=rng.choice([None, 6, 40]), stop_token_ids=rng.choice([[], [3], [3, 7]]),
        ignore_eos=rng.random() < 0.3, presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
    )


def _sampling_rows(rng: random.Random) -> list[tuple[ScheduledRequest, int]]:
    """Sampling rows whose requests often share one SamplingParams object (as generate() does)."""
    shared = [_random_params(rng) for _ in range(rng.randrange(1, 4))]
    rows, r0 = [], 0
    for i in range(rng.randrange(1, 12)):
        p = rng.choice(shared) if rng.random() < 0.8 else _random_params(rng)
        req = Request(f"r{i}", [rng.randrange(64) for _ in range(rng.randrange(1, 6))], p, frozenset({2}))
        req.output_token_ids = [rng.randrange(64) for _ in range(rng.randrange(0, 8))]
        k = rng.choice([0, 0, 2])
        req.spec_token_ids = [rng.randrange(64) for _ in range(k)]
        rows.append((ScheduledRequest(req, req.num_tokens - 1, k + 1, k), r0))
        r0 += k + 1
    return rows


def test_shared_params_runs_match_per_request_checks():
    """all_greedy, mask_and_penalize and _needs_host_values check a run of one params object
    once; each must equal its per-request definition."""
    from verispec.engine.engine import LLMEngine

    rng = random.Random(5)
    for _ in range(400):
        rows = _sampling_rows(rng)
        assert all_greedy(rows) == all(s.request.params.greedy for s, _ in rows)
        eng = type("E", (), {"scheduler": type("S", (), {"running": [s.request for s, _ in rows]})()})()
        assert LLMEngine._needs_host_values(eng) == any(s.request.params.needs_penalties for s, _ in rows)
        logits = torch.randn(sum(s.num_draft_tokens + 1 for s, _ in rows), 64)
        fast = logits.clone()
        mask_and_penalize(fast, rows)
        for s, _ in rows:  # every request its own params object: no run to skip
            s.request.params = copy.copy(s.request.params)
        general = logits.clone()
        mask_and_penalize(general, rows)
        assert torch.equal(fast, general)
        # The rows left alone are exactly those with nothing to mask or penalize (the definition).
        for s, r0 in rows:
            p, rs = s.request.params, slice(r0, r0 + s.num_draft_tokens + 1)
            idle = len(s.request.output_token_ids) >= p.min_tokens and not p.needs_penalties
            masked = any(len(s.request.output_token_ids) + j < p.min_tokens for j in range(s.num_draft_tokens + 1))
            if idle:
                assert torch.equal(fast[rs], logits[rs])
            elif masked and (not p.ignore_eos or p.stop_token_ids):  # a banned id gets -inf
                assert not torch.equal(fast[rs], logits[rs])


def test_stop_checks_match_their_definitions():
    """Scheduler._check_stop / _length_reached (properties inlined) equal the plain rules."""
    from verispec.engine.scheduler import Scheduler

    rng = random.Random(6)
    sched = Scheduler.__new__(Scheduler)
    for _ in range(3000):
        sched.max_model_len = rng.randrange(8, 40)
        req = Request("a", [1] * rng.randrange(1, 8), _random_params(rng), frozenset({2, 5}))
        req.output_token_ids = [9] * rng.randrange(0, 45)
        n, tok = rng.choice([None, rng.randrange(0, 45)]), rng.choice([2, 3, 5, 7, 9])
        m = len(req.output_token_ids) if n is None else n
        p = req.params
        stop = m >= p.min_tokens and ((not p.ignore_eos and tok in req.eos_token_ids) or tok in p.stop_token_ids)
        length = m >= req.max_tokens or req.num_prompt_tokens + m >= sched.max_model_len
        assert sched._length_reached(req) == (req.num_tokens >= sched.max_model_len or len(req.output_token_ids) >= req.max_tokens)
        assert sched._check_stop(req, tok, n) == (stop or length)
        if stop:
            eos = not p.ignore_eos and tok in req.eos_token_ids
            assert (req.finish_reason, req.stop_reason) == ("stop", None if eos else tok)
        elif length:
            assert req.finish_reason == "length"
        else:
            assert req.finish_reason is None


def test_build_batch_staged_equals_separate_copies():
    """build_batch through a Staging ring (one copy) gives the same tensors as its copy per tensor,
    with and without ids and reference indices, across more calls than the ring has slots."""
    from verispec.worker.inputs import SeqChunk, build_batch

    rng = random.Random(7)
    staging = Staging(torch.device("cpu"), slots=3, capacity=16)
    for trial in range(8):
        chunks = []
        for _ in range(rng.randint(1, 5)):
            n, start = rng.randint(1, 9), rng.randint(0, 40)
            blocks = rng.sample(range(100), (start + n + 3) // 4)
            chunks.append(SeqChunk([rng.randint(0, 999) for _ in range(n)], start, blocks))
        kw = dict(with_reference=trial % 2 == 0, token_ids=trial % 3 != 0)
        a = build_batch(chunks, 4, torch.device("cpu"), **kw)
        b = build_batch(chunks, 4, torch.device("cpu"), staging=staging, **kw)
        assert (a[0] is None) == (b[0] is None) and (a[0] is None or torch.equal(a[0], b[0]))
        assert torch.equal(a[1], b[1])
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            x, y = getattr(a[2], name), getattr(b[2], name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert (a[2].max_query_len, a[2].max_seq_len) == (b[2].max_query_len, b[2].max_seq_len)
        if kw["with_reference"]:
            assert torch.equal(a[2].kv_gather_idx, b[2].kv_gather_idx) and torch.equal(a[2].attn_mask, b[2].attn_mask)


def test_ngram_proposer_mirror_matches_reference_as_tokens_grow():
    """NgramProposer's per-request TokenWords mirror (extended step by step) drafts exactly what the
    plain lookup over all the request's tokens drafts, also after the tokens change under it (a cut
    after a stop, a placeholder) and for the probe hint (tokens but the newest, placeholders skipped)."""
    from verispec.core.placeholder import PLACEHOLDER
    from verispec.spec_decode.ngram import NgramProposer

    rng = random.Random(7)
    for trial in range(40):
        lo = rng.randrange(1, 3)
        hi = rng.randrange(lo, 5)
        prop = NgramProposer(4, lo, hi)
        vocab = rng.choice([3, 8, 300])
        req = Request("r", [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))], SamplingParams(max_tokens=10**6))
        for step in range(60):
            req.output_token_ids += [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            if rng.random() < 0.1 and len(req.output_token_ids) > 3:  # tokens change under the mirror
                del req.output_token_ids[-rng.randrange(1, 4):]
                req.output_token_ids[-1] = rng.randrange(vocab)
            want = ngram_reference(req.all_token_ids, 4, lo, hi)
            assert prop.propose([req]).token_ids["r"] == want, (trial, step)
            placeholder = rng.random() < 0.2
            if placeholder:
                req.output_token_ids.append(PLACEHOLDER)
            head = req.all_token_ids[:-1]
            hint = int(PLACEHOLDER not in head and bool(ngram_reference(head, 1, lo, hi)))
            assert prop.would_draft([req]) == hint, (trial, step)
            if placeholder:
                req.output_token_ids[-1] = rng.randrange(vocab)  # resolved
