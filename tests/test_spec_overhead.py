"""Speculation that loses costs nothing (tiny models, CPU): a step planned at k = 0 runs no drafter
forward and no n-gram lookup, a draft model's catch-up after such steps is one forward of a captured
shape (padded, in rounds and in groups where it must be) whose logits equal a fresh forward's, and a
workload run again on an idle engine makes the same plans (the bench's warm-up covers its shapes)."""

from __future__ import annotations

import pytest
import torch
from parity import SPECS
from test_spec_decode import mixed_prompts
from tiny import MetadataBackend, run_all, tiny_config, tiny_engine, tiny_model

from verispec import SamplingParams
from verispec.spec_decode.draft_model import DraftModelProposer, catch_up_lens
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

K = 3
PROBE_EVERY = 9  # the scripted plan: k drafts at every 9th plan, none otherwise
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def plain(model):
    ps = mixed_prompts(4)
    return ps, [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, GREEDY)]


def draft_engine(model, async_scheduling: bool, graphs: bool, catch_up_max: int = 256, catch_up_batch: int = 16,
                 plan=None, **kw):
    """A draft_model engine (a 1-layer tiny drafter on MetadataBackend) whose policy is scripted: k at
    every PROBE_EVERY-th plan, 0 otherwise. graphs: the drafter's graph runners in their eager
    capture=False mode (the CUDA path's shapes and static buffers, on the CPU), over a cache with one
    spare block for their padding rows."""
    draft = tiny_model(tiny_config(layers=1), seed=1)
    draft.attn_backend = MetadataBackend()
    spec = {**SPECS["draft_model"], "model": "tiny-draft", "num_speculative_tokens": K, "adaptive": True}
    eng = tiny_engine(model, spec=spec, draft_override=draft, async_scheduling=async_scheduling, max_num_seqs=4, **kw)
    prop: DraftModelProposer = eng.proposer
    prop.catch_up_lens, prop.catch_up_batch = catch_up_lens(K, catch_up_max), catch_up_batch
    if graphs:
        c = draft.config
        prop.kv_caches = allocate_kv_cache(c.num_layers, eng.blocks.num_blocks + 1, prop.block_size, c.num_kv_heads,
                                           c.head_dim, torch.float32, "cpu")
        prop.graph_max_batch = 4
        prop.make_graphs(capture=False)
    plans = iter(range(10**6))
    eng.policy.plan = plan or (lambda ids, batch=None: K if next(plans) % PROBE_EVERY == PROBE_EVERY - 1 else 0)
    return eng


def logged_proposals(prop: DraftModelProposer) -> list[tuple[int, int, int]]:
    """(most drafts of a request, drafts in all, drafter forwards) of every propose() call from now on."""
    log: list[tuple[int, int, int]] = []
    propose = prop.propose

    def logged(requests, sources=None):
        before = prop.num_graph_forwards + prop.num_eager_forwards
        out = propose(requests, sources)
        drafts = [len(t) for t in out.token_ids.values()]
        log.append((max(drafts, default=0), sum(drafts), prop.num_graph_forwards + prop.num_eager_forwards - before))
        return out

    prop.propose = logged
    return log


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steps_planned_at_zero_run_no_drafter_forward(model, plain, async_scheduling):
    """With the plan at 0 for 8 steps in 9, the drafter runs exactly one catch-up forward plus one per
    further draft at each drafting step (the gap of 8 steps fits one catch-up shape) and nothing at the
    others; every one of those forwards is a graph shape (no eager forward: the prompts are prefilled
    in one step, so observe() forwards nothing); the tokens are plain decoding's."""
    ps, ref = plain
    eng = draft_engine(model, async_scheduling, graphs=True)
    log = logged_proposals(eng.proposer)
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)] == ref
    drafting = [(d, f) for d, _, f in log if d > 0]
    assert drafting and all(f == 0 for d, _, f in log if d == 0), log
    assert all(f == d for d, f in drafting), drafting  # 1 catch-up + (d - 1) draft forwards
    prop = eng.proposer
    assert prop.num_eager_forwards == 0
    assert prop.num_graph_forwards == sum(d for d, _ in drafting)
    m = eng.get_metrics()
    assert m["spec_decode_num_draft_tokens"] == sum(n for _, n, _ in log) > 0  # every draft was verified
    assert len(drafting) <= -(-m["num_steps"] // PROBE_EVERY)


def test_loops_agree_with_catch_ups_in_rounds_and_groups(model, plain):
    """Catch-ups longer than catch_up_max (8 here) run in rounds and batches beyond catch_up_batch (2) in
    groups: tokens are plain decoding's, and the synchronous and overlapped loops agree on them and on
    every acceptance counter."""
    ps, ref = plain
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_request_steps", "num_steps")

    def run(async_scheduling):
        eng = draft_engine(model, async_scheduling, graphs=True, catch_up_max=8, catch_up_batch=2)
        outs = [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)]
        m = eng.get_metrics()
        return outs, [m[k] for k in keys], eng.proposer.num_eager_forwards

    sync, overlapped = run(False), run(True)
    assert sync[0] == ref and overlapped == sync
    assert sync[2] == 0 and sync[1][1] > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_prompt_catch_up_in_graph_shapes(model, plain, async_scheduling):
    """Prompts chunked over several steps (a 16-token step budget): observe() keeps the draft cache level
    with each chunk in the graphs' catch-up shapes (groups, rounds of one catch_up_lens length), not in
    eager forwards: no eager forward at all, the tokens are plain decoding's, and the acceptance counters
    equal those of the engine whose drafter runs every forward eagerly."""
    ps, ref = plain
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens_per_pos")

    def run(graphs: bool):
        eng = draft_engine(model, async_scheduling, graphs=graphs, catch_up_max=8, catch_up_batch=2,
                           max_num_batched_tokens=16)
        outs = [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)]
        m = eng.get_metrics()
        return outs, [m[k] for k in keys], eng.proposer

    (g_out, g_counts, g_prop), (e_out, e_counts, e_prop) = run(True), run(False)
    assert g_out == ref and e_out == ref and g_counts == e_counts and g_counts[1] > 0
    assert g_prop.num_eager_forwards == 0 < g_prop.num_graph_forwards
    assert e_prop.num_eager_forwards > 0


def _fresh_last_logits(draft, ids: list[int]) -> torch.Tensor:
    """The draft model's logits at the last of `ids`, from one forward over all of them in a cache of
    its own: the reference a catch-up must equal."""
    c, bs = draft.config, 16
    blocks = list(range(-(-len(ids) // bs)))
    kv = allocate_kv_cache(c.num_layers, len(blocks), bs, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    inp, pos, meta = build_batch([SeqChunk(ids, 0, blocks)], bs, torch.device("cpu"), with_reference=False)
    with torch.inference_mode():
        hidden, _ = draft(inp, pos, meta, kv)
        return draft.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-runner"])
def test_catch_up_logits_equal_a_fresh_forward(model, plain, graphs):
    """After stretches planned at 0, each catch-up (rounds of 8 tokens padded in front, groups of 2
    requests) leaves the drafter's logits at every request's last token equal to those of a fresh
    forward over the request's whole sequence (float32: within 1e-4)."""
    ps, _ = plain
    eng = draft_engine(model, False, graphs=graphs, catch_up_max=8, catch_up_batch=2)
    prop = eng.proposer
    checked: list[float] = []
    catch_up = prop._catch_up

    def checked_catch_up(reqs, sources):
        logits = catch_up(reqs, sources)
        for r, row in zip(reqs, logits, strict=True):
            ref = _fresh_last_logits(prop.model, r.all_token_ids)
            checked.append((row.float() - ref).abs().max().item())
        return logits

    prop._catch_up = checked_catch_up
    run_all(eng, ps, GREEDY)
    assert len(checked) >= 8 and max(checked) < 1e-4, checked


def test_catch_up_lens():
    """k + 1, then the powers of two above it up to the longest; a bad bound is a ValueError."""
    assert catch_up_lens(3) == (4, 8, 16, 32, 64, 128, 256)
    assert catch_up_lens(4, 64) == (5, 8, 16, 32, 64)
    assert catch_up_lens(15, 16) == (16,)
    with pytest.raises(ValueError, match="catch_up_max"):
        DraftModelProposer(tiny_model(tiny_config(layers=1)), 2, "cpu", torch.float32, catch_up_max=0)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_looks_up_nothing_at_zero_and_plans_repeat(model, async_scheduling, monkeypatch):
    """ngram under the real policy: the proposal lookups are exactly one per request of each drafting
    proposal (none in steps planned at 0; the probe hint's, when a probe is due, apart), and the same workload run again on the now idle engine makes the
    same plans in the same order (the probe clock restarts) once the population counts are reset (as
    the bench does before every run; an engine keeps them), so it takes the same steps."""
    from verispec.spec_decode import ngram

    calls: list[int] = []
    hinting: list[bool] = [False]
    lookup = ngram.ngram_lookup
    monkeypatch.setattr(ngram, "ngram_lookup", lambda *a: (hinting[0] or calls.append(1)) and False or lookup(*a))
    spec = {**SPECS["ngram"], "num_speculative_tokens": K, "adaptive": True}
    eng = tiny_engine(model, spec=spec, async_scheduling=async_scheduling, max_num_seqs=4)
    would_draft = eng.proposer.would_draft

    def hint(requests):  # the policy's probe hint looks up too, only when a probe is due: not counted
        hinting[0] = True
        try:
            return would_draft(requests)
        finally:
            hinting[0] = False

    eng.proposer.would_draft = hint
    plans: list[int] = []
    plan, propose = eng.policy.plan, eng.proposer.propose
    drafting: list[int] = []

    def logged_plan(ids, batch=None):
        plans.append(plan(ids, batch))
        return plans[-1]

    def logged_propose(requests, sources=None):
        drafting.append(sum(eng.proposer.num_drafts_for(r) > 0 for r in requests))
        return propose(requests, sources)

    eng.policy.plan, eng.proposer.propose = logged_plan, logged_propose
    ps = [p[:12] for p in mixed_prompts(4, seed=5)]  # short prompts with no repeats: drafts rarely match
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in run_all(eng, ps, sp)]
    n_plans, steps = len(plans), eng.get_metrics()["num_steps"]
    assert 0 in plans and len(calls) == sum(drafting) > 0
    eng.policy.reset_population()
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, sp)] == first
    assert plans[n_plans:] == plans[:n_plans]
    assert eng.get_metrics()["num_steps"] == 2 * steps
