"""The host batch builder (worker/batch.py) without a model: exact lists for small steps worked out
by hand (decode rows, a prefill chunk next to a verify chunk with a device draft, graph padding,
the draft / row indices and the staged-copy plan), and the decode fast path against the general
path on random decode steps."""

from __future__ import annotations

import random

from verispec import SamplingParams
from verispec.core.placeholder import PLACEHOLDER
from verispec.core.request import Request
from verispec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from verispec.worker.batch import (
    SENTINEL_ID,
    assemble_chunks,
    assemble_decode,
    build_host_batch,
    decode_only,
    draft_index,
    padded_query_len,
    row_index,
    split_is_cheaper,
    stage_plan,
)

BS = 4  # block size of every case here


def lists(hb) -> dict:
    return {name: getattr(hb, name) for name in ("ids", "positions", "slots", "placeholders", "query_lens",
                                                 "seq_lens", "tables", "logit_rows", "draft_pos", "offsets")}


def test_decode_step_by_hand():
    # a: prompt 10 11 12, output 20 21: the decode row is position 4 (block 1 of [7, 3] -> slot 12).
    a = Request("a", [10, 11, 12], SamplingParams(), output_token_ids=[20, 21], block_ids=[7, 3])
    # b: its last token only the device knows (the overlapped loop): position 2 -> slot 2*4+2.
    b = Request("b", [5, 6], SamplingParams(), output_token_ids=[PLACEHOLDER], block_ids=[2])
    sa, sb = ScheduledRequest(a, 4, 1, 0), ScheduledRequest(b, 2, 1, 0)
    hb = build_host_batch(SchedulerOutput([sa, sb]), BS, graph_fit=lambda n, q: 8)  # never pads a decode step
    assert lists(hb) == dict(
        ids=[21, PLACEHOLDER], positions=[4, 2], slots=[12, 10], placeholders=[(1, ("b", "out", 0))],
        query_lens=[1, 1], seq_lens=[5, 3], tables=[[7, 3], [2]], logit_rows=[0, 1], draft_pos=[],
        offsets={"a": 0, "b": 1},
    )
    assert hb.sampling == [(sa, 0), (sb, 1)]
    assert (sa.output_base, sb.output_base) == (2, 1)
    plan = stage_plan(hb, hb.ids, [1], [5])
    assert plan.longs == [[21, PLACEHOLDER, SENTINEL_ID], [4, 2], [12, 10], [1], [5], [], [], []]
    assert plan.ints == [[0, 1, 2], [5, 3], [7, 3, 2, 0]]
    assert (plan.num_tokens, plan.kmax, plan.width, plan.dense) == (2, 0, 2, True)


def _prefill_and_verify() -> tuple[ScheduledRequest, ScheduledRequest]:
    # p: the first 4 of its 6 prompt tokens (no sample yet), blocks [9, 8].
    p = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(), block_ids=[9, 8])
    # v: last known token at position 3, then drafts 50 and one the device holds; blocks [5, 6].
    v = Request("v", [30, 31], SamplingParams(), output_token_ids=[40, 41], block_ids=[5, 6],
                spec_token_ids=[50, PLACEHOLDER])
    return ScheduledRequest(p, 0, 4, 0), ScheduledRequest(v, 3, 3, 2)


def test_prefill_and_verify_chunks_by_hand():
    sp, sv = _prefill_and_verify()
    hb = build_host_batch(SchedulerOutput([sp, sv]), BS)
    assert lists(hb) == dict(
        ids=[1, 2, 3, 4, 41, 50, PLACEHOLDER], positions=[0, 1, 2, 3, 3, 4, 5],
        slots=[36, 37, 38, 39, 23, 24, 25], placeholders=[(6, ("v", "draft", 1))],
        query_lens=[4, 3], seq_lens=[4, 6], tables=[[9, 8], [5, 6]], logit_rows=[4, 5, 6],
        draft_pos=[range(5, 7)], offsets={"p": 0, "v": 4},
    )
    assert hb.sampling == [(sv, 0)] and sv.output_base == 2
    plan = stage_plan(hb, hb.ids, [6], [0])
    assert plan.longs == [[1, 2, 3, 4, 41, 50, PLACEHOLDER, SENTINEL_ID], [0, 1, 2, 3, 3, 4, 5],
                          [36, 37, 38, 39, 23, 24, 25], [6], [0], [4, 5, 6], [5, 6], [0, 1, 2]]
    assert plan.ints == [[0, 4, 7], [4, 6], [9, 8, 5, 6]]
    assert (plan.num_tokens, plan.kmax, plan.width, plan.dense) == (7, 2, 2, False)


def test_graph_padding_by_hand():
    """A verify graph of query length 4: the 3-token verify chunk gets one padding query in front
    (position 3 - 1 = 2, slot -1: no K/V written); its seq_len stays 6, its query length is 4."""
    sp, sv = _prefill_and_verify()
    asked = []
    hb = build_host_batch(SchedulerOutput([sp, sv]), BS, graph_fit=lambda n, q: asked.append((n, q)) or 4)
    assert asked == [(2, 4)]
    assert lists(hb) == dict(
        ids=[1, 2, 3, 4, 0, 41, 50, PLACEHOLDER], positions=[0, 1, 2, 3, 2, 3, 4, 5],
        slots=[36, 37, 38, 39, -1, 23, 24, 25], placeholders=[(7, ("v", "draft", 1))],
        query_lens=[4, 4], seq_lens=[4, 6], tables=[[9, 8], [5, 6]], logit_rows=[5, 6, 7],
        draft_pos=[range(6, 8)], offsets={"p": 0, "v": 5},
    )
    assert lists(assemble_chunks([sp, sv], BS, 4)) == lists(hb)


def test_padded_query_len_rules():
    sp, sv = _prefill_and_verify()
    assert padded_query_len([sp, sv], None) == 0  # no graphs
    assert padded_query_len([], lambda n, q: 4) == 0
    assert padded_query_len([sp, sv], lambda n, q: None) == 0  # no graph fits
    assert padded_query_len([sp, sv], lambda n, q: q + 1) == 5
    one = ScheduledRequest(Request("d", [1, 2], SamplingParams(), block_ids=[0]), 1, 1, 0)
    assert padded_query_len([one], lambda n, q: 4) == 0  # a decode step is uniform already


def _decode_rows_and_chunk(num_decode: int, chunk: int) -> list[ScheduledRequest]:
    """num_decode decode rows, then one prompt chunk of `chunk` tokens (a request admitted beside them)."""
    rows = [ScheduledRequest(Request(f"d{i}", [1, 2], SamplingParams(), output_token_ids=[3], block_ids=[i]), 2, 1, 0)
            for i in range(num_decode)]
    p = Request("p", list(range(chunk)), SamplingParams(), block_ids=list(range(20, 20 + -(-chunk // BS))))
    return rows + [ScheduledRequest(p, 0, chunk, 0)]


def test_padding_every_row_or_splitting_by_padded_tokens():
    """One graph that pads 15 decode rows to a 100-token chunk's 128 queries (2,048 tokens) against two
    replays (15 x 1, then 1 x 128: 143 tokens plus a pass over the weights, SPLIT_COST_TOKENS = 256):
    the split. 3 decode rows beside a 20-token chunk padded to 32 (128 tokens against 3 + 32 + 256): one
    graph. A chunk no graph fits whole still splits; a step no split fits still pads."""
    def fit(num_seqs, longest):  # query 1 at any batch; 32 and 128 up to 2,048 tokens
        return next((q for q in (1, 32, 128) if q >= longest and (q == 1 or num_seqs * q <= 2048)), None)

    assert split_is_cheaper(16, 128, (15, 1, 128))
    assert not split_is_cheaper(4, 32, (3, 1, 32))
    assert split_is_cheaper(16, 128, (15, 1, 128 - 1))  # (the threshold: 2,048 > 15 + 127 + 256)
    big = build_host_batch(SchedulerOutput(_decode_rows_and_chunk(15, 100)), BS, fit, split=True)
    assert big.split == (15, 1, 128) and big.query_lens == [1] * 15 + [128]
    small = build_host_batch(SchedulerOutput(_decode_rows_and_chunk(3, 20)), BS, fit, split=True)
    assert small.split is None and small.query_lens == [32] * 4
    # Without split (tensor parallelism): the one padded graph.
    assert build_host_batch(SchedulerOutput(_decode_rows_and_chunk(15, 100)), BS, fit).query_lens == [128] * 16
    # A chunk past every graph but its own (17 rows x 128 > 2,048): split, as before.
    assert build_host_batch(SchedulerOutput(_decode_rows_and_chunk(16, 100)), BS, fit, split=True).split == (
        16, 1, 128)


def test_draft_and_row_index_by_hand():
    """Mixed draft counts (2 and 0, kmax 2): padded drafts point at the sentinel input, padded
    verified rows repeat the request's last logit row."""
    r2 = ScheduledRequest(Request("x", [1], SamplingParams()), 0, 3, 2)
    r0 = ScheduledRequest(Request("y", [1], SamplingParams()), 0, 1, 0)
    assert draft_index([range(5, 7), range(9, 9)], 2, sentinel=10) == [5, 6, 10, 10]
    assert row_index([(r2, 0), (r0, 3)], 2) == [0, 1, 2, 3, 3, 3]
    assert draft_index([range(1, 1)], 0, sentinel=4) == [] and row_index([(r0, 0)], 0) == []


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


def test_decode_fast_path_matches_general():
    rng = random.Random(3)
    for _ in range(300):
        scheduled = _decode_batch(rng)
        assert decode_only(scheduled)
        for s in scheduled:
            s.output_base = -1  # set by both paths for the sampled rows only
        fast = assemble_decode(scheduled, BS)
        fast_bases = [s.output_base for s in scheduled]
        for s in scheduled:
            s.output_base = -1
        general = assemble_chunks(scheduled, BS)
        assert fast_bases == [s.output_base for s in scheduled]
        for name in ("ids", "positions", "slots", "placeholders", "query_lens", "seq_lens", "tables",
                     "sampling", "logit_rows", "offsets"):
            assert getattr(fast, name) == getattr(general, name), name
        assert fast.draft_pos == [] and not any(general.draft_pos)  # no drafts either way
        assert stage_plan(fast, fast.ids, [], []) == stage_plan(general, general.ids, [], [])
    two = _decode_batch(rng) + [ScheduledRequest(Request("x", [1, 2, 3], SamplingParams(), block_ids=[0]), 0, 3, 0)]
    assert not decode_only(two)
    assert not decode_only([ScheduledRequest(Request("d", [1], SamplingParams(), spec_token_ids=[PLACEHOLDER]), 1, 1, 1)])
