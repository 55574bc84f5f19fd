"""Engine mechanics on a tiny random model: batching, chunked prefill, preemption, prefix cache."""

from __future__ import annotations

import random

import pytest
from tiny import run_all, tiny_engine, tiny_model

from verispec import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 4000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's greedy output generated on its own."""
    ps = prompts(8)
    return ps, [run_all(tiny_engine(model), [p], GREEDY)[0].outputs[0].token_ids for p in ps]


def test_batch_equals_alone(model, alone):
    ps, ref = alone
    outs = run_all(tiny_engine(model), ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_small_chunked_prefill(model, alone):
    ps, ref = alone
    eng = tiny_engine(model, max_num_batched_tokens=7)
    outs = run_all(eng, ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert eng.num_steps > sum(len(p) for p in ps) // 7


def test_preemption_keeps_outputs(model, alone):
    ps, ref = alone
    eng = tiny_engine(model, num_gpu_blocks=15, block_size=8)  # 120 slots: the longest request fits alone
    outs = run_all(eng, ps, GREEDY)
    assert eng.get_metrics()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_prefix_cache_hit(model):
    eng = tiny_engine(model, block_size=8)
    shared = prompts(1, seed=5, lo=40, hi=41)[0]
    a = shared + [11, 12, 13]
    b = shared + [21, 22]
    first = run_all(eng, [a], GREEDY)[0]
    assert first.num_cached_tokens == 0
    out_b = run_all(eng, [b], GREEDY)[0]
    assert len(shared) == 40  # five full blocks of 8, all of them a's: b hits exactly those 40 tokens
    assert out_b.num_cached_tokens == 40
    assert eng.get_metrics()["prefix_cache_hits"] == 40
    ref = run_all(tiny_engine(model, enable_prefix_caching=False), [b], GREEDY)[0]
    assert out_b.outputs[0].token_ids == ref.outputs[0].token_ids


def test_all_features_together(model, alone):
    ps, ref = alone
    eng = tiny_engine(model, num_gpu_blocks=20, block_size=8, max_num_batched_tokens=13)
    run_all(eng, [ps[0][:30]], GREEDY)  # seed the prefix cache
    outs = run_all(eng, ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert eng.get_metrics()["num_preemptions"] > 0


def test_seeded_sampling_reproducible_and_batch_independent(model):
    ps = prompts(4, seed=3)
    sp = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(4)]
    a = run_all(tiny_engine(model), ps, sp)
    b = run_all(tiny_engine(model), ps[:1], sp[:1])
    c = run_all(tiny_engine(model, max_num_batched_tokens=9), ps, sp)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in c]
    d = run_all(tiny_engine(model), ps[:1], [SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)])
    assert d[0].outputs[0].token_ids != a[0].outputs[0].token_ids


def test_max_tokens_min_tokens_stop_ids(model):
    p = prompts(1, seed=9)[0]
    free = run_all(tiny_engine(model), [p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    toks = free.outputs[0].token_ids
    assert len(toks) == 12 and free.outputs[0].finish_reason == "length"
    stop_tok = toks[5]
    first = toks.index(stop_tok)
    out = run_all(tiny_engine(model), [p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0]
    assert out.outputs[0].token_ids == toks[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    # min_tokens bans the stop id until enough tokens exist.
    out = run_all(
        tiny_engine(model), [p], SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_tok])
    )[0]
    assert len(out.outputs[0].token_ids) == 12 and stop_tok not in out.outputs[0].token_ids[: 12]


def test_stop_string_truncates_text(model):
    eng = tiny_engine(model)
    p = prompts(1, seed=4)[0]
    full = run_all(eng, [p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = full.index(stop)
    out = run_all(tiny_engine(model), [p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].text == full[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_n_and_logprobs(model):
    eng = tiny_engine(model)
    p = prompts(1, seed=2)[0]
    out = run_all(eng, [p], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, logprobs=2, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert tok in lp and all(v <= 0 for v in lp.values()) and len(lp) >= 2


def test_abort_frees_blocks(model):
    eng = tiny_engine(model)
    eng.add_request("x", None, SamplingParams(max_tokens=100, ignore_eos=True), prompts(1)[0])
    eng.step()
    eng.step()
    assert eng.blocks.num_free_blocks < eng.blocks.num_blocks
    eng.abort_request("x")
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert not eng.has_unfinished_requests()


def test_bad_requests_rejected_cleanly(model):
    eng = tiny_engine(model, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("a", None, SamplingParams(), [])
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("b", None, SamplingParams(), [5] * 64)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("c", None, SamplingParams(), [-1, 3])
    with pytest.raises(ValueError, match="prompt must be a string"):
        eng.add_request("d", None, SamplingParams(), None)
    eng.add_request("ok", None, SamplingParams(max_tokens=2), [5, 6])
    with pytest.raises(ValueError, match="already running"):
        eng.add_request("ok", None, SamplingParams(), [5])
    assert len(eng.scheduler.waiting) == 1  # only the good one queued


def test_gc_frozen_once_after_start_up(model, monkeypatch):
    """The engine's default (gc_freeze on): one gc.freeze at the end of construction, so the
    engine itself is in the permanent generation; steps freeze nothing more. gc_freeze False: none."""
    import gc

    from verispec.config import EngineConfig
    from verispec.engine import builder as setup

    assert EngineConfig(model="m").gc_freeze
    calls = []
    real = gc.freeze
    monkeypatch.setattr(setup.gc, "freeze", lambda: (calls.append(1), real())[1])
    try:
        gc.unfreeze()
        eng = tiny_engine(model, gc_freeze=True)
        assert calls == [1] and gc.get_freeze_count() > 0
        assert not any(o is eng for o in gc.get_objects())  # frozen objects are not listed
        run_all(eng, prompts(2), GREEDY)
        assert calls == [1]
        gc.unfreeze()
        eng = tiny_engine(model, gc_freeze=False)
        assert calls == [1] and gc.get_freeze_count() == 0 and any(o is eng for o in gc.get_objects())
        with pytest.raises(ValueError, match="gc_freeze"):
            tiny_engine(model, gc_freeze="yes")
    finally:
        gc.unfreeze()  # later tests run with the collector as they found it


def test_preemption_picks_the_most_recently_admitted_request():
    """Out of blocks, the tail of the running list goes (vLLM's rule): a request that arrived first
    but was admitted last (after its own preemption) is the victim, not the last to arrive."""
    from verispec.core.request import Request
    from verispec.engine.kv_blocks import BlockManager
    from verispec.engine.scheduler import Scheduler

    sched = Scheduler(BlockManager(4, 4, False), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = (Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=40)) for rid in "ab")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # both prefill one block each
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"] and not out.preempted
    for s in out.scheduled:
        sched.commit(s, [5])
    sched.running.reverse()  # a is now the most recently admitted, though it arrived first
    for r in (a, b):
        r.output_token_ids += [6] * 6  # both need a third block: only one fits
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["a"]
    assert [s.request.request_id for s in out.scheduled] == ["b"]


def _fit64(rows: int, longest: int) -> int | None:
    """A stand-in for CudaGraphRunner.padded_query_len: prompt chunks pad to 16 / 32 / 64 queries, and a
    graph exists for rows * query length <= 64."""
    q = next((x for x in (16, 32, 64) if x >= longest), None)
    return q if q is not None and rows * q <= 64 else None


def test_admission_stops_where_the_prompt_chunks_would_leave_every_graph():
    """With prefill_fit, a step takes prompt chunks only while a graph still fits them all: 20-token prompts
    pad to 32 queries, and 64 padded tokens hold 2 of them, so 6 waiting requests are admitted 2 a step
    (each step's decode rows beside them replay their own graph); without prefill_fit the token budget takes
    all 6 at once. A first chunk that fits no graph still goes in alone (admission never stalls), and beside it
    the others follow as before (that step is eager anyway)."""
    from verispec.core.request import Request
    from verispec.engine.kv_blocks import BlockManager
    from verispec.engine.scheduler import Scheduler

    def admitted_per_step(fit, prompt_lens):
        sched = Scheduler(BlockManager(64, 16, False), max_num_seqs=8, max_num_batched_tokens=2048,
                          max_model_len=256, prefill_fit=fit)
        for i, n in enumerate(prompt_lens):
            sched.add(Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4)))
        counts = []
        while sched.waiting:
            out = sched.schedule()
            counts.append(sum(1 for s in out.scheduled if s.start == 0))
            for s in out.scheduled:
                sched.commit(s, [7] if s.needs_sample else None)
        return counts

    assert admitted_per_step(_fit64, [20] * 6) == [2, 2, 2]
    assert admitted_per_step(None, [20] * 6) == [6]
    assert admitted_per_step(_fit64, [100, 20, 20]) == [3]  # 100 tokens: no graph at all, so no limit
    assert admitted_per_step(_fit64, [40, 20, 20]) == [1, 2]  # 40 pads to 64 and fills a graph; then 2 x 32
    # A 1-token prompt after a chunk is a row of the chunks' part (padded to 64 beside the 40: no graph), so it
    # waits; in the next step it comes before any chunk, with the decode rows, and the 20 joins it.
    assert admitted_per_step(_fit64, [40, 1, 20]) == [1, 2]


def test_prefill_fit_only_where_admission_steps_split_into_graphs():
    """The scheduler shapes admissions to the graphs only where there are graphs and no tensor parallelism
    (a TP step never splits into two replays, so the shaping would only delay admissions)."""
    from types import SimpleNamespace

    from verispec.engine.engine import _prefill_fit

    graphs = SimpleNamespace(padded_query_len=_fit64)
    assert _prefill_fit(SimpleNamespace(graphs=graphs, tp=None)) is _fit64
    assert _prefill_fit(SimpleNamespace(graphs=graphs, tp=object())) is None
    assert _prefill_fit(SimpleNamespace(graphs=None, tp=None)) is None
