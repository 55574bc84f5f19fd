"""The host-side fast paths equal their plain definitions: n-gram lookup, cache slots, staging,
the decode-step input lists."""

from __future__ import annotations

import random

import torch
from tiny import tiny_config, tiny_model

from verispec import SamplingParams
from verispec.engine.request import Request
from verispec.engine.scheduler import ScheduledRequest, SchedulerOutput
from verispec.spec.ngram import ngram_lookup
from verispec.worker.inputs import Staging, extend_slots, padded_tables
from verispec.worker.runner import ModelRunner, _decode_only
from verispec.worker.token_state import PLACEHOLDER


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


def _decode_batch(rng: random.Random) -> list[ScheduledRequest]:
    """One-token chunks: mostly decode rows (the last token, a PLACEHOLDER or a known value),
    some one-token prefill chunks that sample or not."""
    batch = []
    for r in range(rng.randrange(1, 9)):
        prompt = [rng.randrange(64) for _ in range(rng.randrange(1, 12))]
        out = [rng.randrange(64) for _ in range(rng.randrange(0, 6))]
        if out and rng.random() < 0.5:
            out[-1] = PLACEHOLDER  # the overlapped loop's last token: only the device knows it
        req = Request(f"r{r}", prompt, SamplingParams(), output_token_ids=out, block_ids=rng.sample(range(64), 5))
        total = len(prompt) + len(out)
        start = total - 1 if rng.random() < 0.7 else rng.randrange(total)
        batch.append(ScheduledRequest(req, start, 1, 0))
    return batch


def test_assemble_decode_fast_path_matches_general():
    runner = ModelRunner(tiny_model(tiny_config(vocab=64)), num_blocks=64, block_size=4,
                         device=torch.device("cpu"), dtype=torch.float32)
    rng = random.Random(3)
    for _ in range(300):
        scheduled = _decode_batch(rng)
        assert _decode_only(scheduled)
        for s in scheduled:
            s.output_base = -1  # set by both paths for the sampled rows only
        fast = runner._assemble_decode(scheduled)
        fast_bases = [s.output_base for s in scheduled]
        for s in scheduled:
            s.output_base = -1
        general = runner._assemble_chunks(SchedulerOutput(scheduled))
        assert fast_bases == [s.output_base for s in scheduled]
        for name in ("ids", "positions", "slots", "placeholders", "query_lens", "seq_lens", "tables",
                     "sampling", "logit_rows", "offsets"):
            assert getattr(fast, name) == getattr(general, name), name
        assert fast.draft_pos == [] and not any(general.draft_pos)  # no drafts either way
    two = _decode_batch(rng) + [ScheduledRequest(Request("x", [1, 2, 3], SamplingParams(), block_ids=[0]), 0, 3, 0)]
    assert not _decode_only(two)
    assert not _decode_only([ScheduledRequest(Request("d", [1], SamplingParams(), spec_token_ids=[PLACEHOLDER]), 1, 1, 1)])
