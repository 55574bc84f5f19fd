"""Sync and async scheduling give identical tokens AND identical acceptance counters (tiny model;
the real-model matrix is in test_real_model_spec.py)."""

from __future__ import annotations

import pytest
import torch
from parity import SPECS, STRESS, run_scenario, scenario_params, scenario_prompts
from tiny import (
    CheapDrafts,
    greedy_continuation,
    run_all,
    tiny_config,
    tiny_engine,
    tiny_model,
    trained_tiny_drafter,
)

from verispec.spec_decode.dflash import save_drafter

VOCAB = 512  # small, so the tiny model's outputs repeat and ngram finds drafts


@pytest.fixture(scope="module")
def models():
    return tiny_model(tiny_config(vocab=VOCAB)), tiny_model(tiny_config(vocab=VOCAB, layers=1), seed=1)


@pytest.fixture(scope="module")
def dflash_dir(models, tmp_path_factory):
    """A DFlash drafter fitted a little to the target's greedy answers to the scenario prompts, so
    that its drafts (greedy and sampled) are sometimes accepted."""
    ps = scenario_prompts(vocab_hi=VOCAB - 12)
    seqs = list(zip(ps, greedy_continuation(models[0], ps, 24), strict=True))
    drafter, _ = trained_tiny_drafter(models[0], seqs, block_size=4, mask_id=VOCAB - 1,
                                      steps=40, lr=2e-2, anchors=16)
    path = tmp_path_factory.mktemp("parity_dflash")
    save_drafter(drafter, path, torch.float32)
    return path


def make(models, drafter_dir=None, adaptive: bool = False):
    target, draft = models

    def build(spec, async_scheduling):
        if spec:
            spec = {**spec, "adaptive": adaptive}
        override = draft if spec and spec["method"] == "draft_model" else None
        if spec and spec["method"] == "dflash":
            spec = {**spec, "model": str(drafter_dir)}
        return tiny_engine(target, spec=spec, draft_override=override, async_scheduling=async_scheduling,
                           step_cost=CheapDrafts() if adaptive else None, **STRESS)

    return build


PARITY_CASES = [("none", False)] + [(m, a) for m in ("ngram", "self", "draft_model", "dflash") for a in (False, True)]


@pytest.mark.parametrize("method, adaptive", PARITY_CASES,
                         ids=[f"{m}-{'adaptive' if a else 'pinned'}" for m, a in PARITY_CASES])
def test_sync_async_parity(models, method, adaptive, request):
    """Greedy and seeded sampled requests (scenario_params): same tokens and acceptance counters,
    with k pinned and with the adaptive policy (its inputs are the same in both loops)."""
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
    build = make(models, request.getfixturevalue("dflash_dir") if method == "dflash" else None, adaptive)
    sync_toks, sync_c, sync_m, _ = run_scenario(build, method, False, prompts, params)
    async_toks, async_c, async_m, eng = run_scenario(build, method, True, prompts, params)
    assert async_toks == sync_toks
    assert async_c == sync_c
    assert sync_m["num_preemptions"] > 0 and sync_m["prefix_cache_hits"] > 0
    if method != "none":
        assert sync_c["spec_decode_num_drafts"] > 0
    if method == "dflash":  # drafts matter: a wrong draft in either loop would change the counters
        assert sync_c["spec_decode_num_accepted_tokens"] > 10
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_async_with_penalties_matches_sync(models):
    """Penalty requests read host token values, so the overlapped loop drains first; nothing is
    lost and the output equals the synchronous loop's."""
    from verispec import SamplingParams

    prompts = scenario_prompts(vocab_hi=VOCAB - 12)[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.3)] * 3
    out = {}
    for mode in (False, True):
        eng = tiny_engine(models[0], async_scheduling=mode)
        out[mode] = [o.outputs[0].token_ids for o in run_all(eng, prompts, params)]
    assert out[True] == out[False]


@pytest.mark.parametrize("method", ["ngram", "self", "draft_model"])
def test_draft_schedule_independent_of_block_pressure(models, method):
    """A request's draft schedule is a function of the request alone: under block pressure
    (preemption, draft blocks reserved by preempting) both loops give the sampled requests the same
    tokens and the same acceptance counters as with blocks to spare, where nothing is preempted.
    (Before, a request that could not get its draft blocks went without drafts that step, so
    its rejection-sampled tokens depended on what else was running.)

    With adaptive speculation the schedule also depends on the batch the policy sees (preemption takes
    requests out of it), by design: this gate pins k, which is what the reserve machinery promises."""
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
    ample = {**STRESS, "num_gpu_blocks": 200}
    cells = {}
    for name, sizes in (("ample", ample), ("stress", STRESS)):
        for mode in (False, True):
            def build(spec, async_scheduling, sizes=sizes):
                spec = {**spec, "adaptive": False}
                override = models[1] if spec["method"] == "draft_model" else None
                return tiny_engine(models[0], spec=spec, draft_override=override, async_scheduling=async_scheduling, **sizes)

            toks, counters, m, _ = run_scenario(build, method, mode, prompts, params)
            cells[name, mode] = (toks, counters, m["num_preemptions"])
    assert cells["ample", False][2] == 0 and cells["stress", False][2] > 0
    for key, (toks, counters, _) in cells.items():
        assert toks == cells["ample", False][0], key
        assert counters == cells["ample", False][1], key


@pytest.mark.parametrize("method", ["self", "draft_model"])
def test_async_device_drafts_with_penalties_match_sync(models, method):
    """Penalties count the drafts before each verified position, on the host. Device drafters leave
    PLACEHOLDER mirrors in the overlapped loop, so the engine collects the drafts' values before a
    step with penalty requests; the output and the counters equal the synchronous loop's. Greedy and
    seeded sampled penalty requests, next to a request without penalties."""
    from verispec import SamplingParams

    prompts = scenario_prompts(vocab_hi=VOCAB - 12)[:3]
    pen = dict(max_tokens=16, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    params = [SamplingParams(temperature=0.0, **pen), SamplingParams(temperature=0.9, seed=5, **pen),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    spec = SPECS[method]
    out = {}
    for mode in (False, True):
        eng = tiny_engine(models[0], spec=spec, draft_override=models[1] if method == "draft_model" else None,
                          async_scheduling=mode)
        res = run_all(eng, prompts, params)
        m = eng.get_metrics()
        out[mode] = ([o.outputs[0].token_ids for o in res], m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"])
    assert out[False][1] > 0
    assert out[True] == out[False]


class DraftsPayOnlyWhenAccepted:
    """A step cost under which only well-accepted drafts pay: with the tiny drafter the policy plans
    k = 0 for stretches and probes now and then, so drafting steps follow steps that drafted nothing."""

    def seconds(self, k: int, batch: int) -> float:
        return 1.0 + 0.35 * k * batch


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_dflash_defers_context_of_undrafted_steps(models, dflash_dir, monkeypatch, async_scheduling):
    """A step planned at k = 0 writes no drafter context: its features wait for the next drafting step.
    The tokens and the acceptance counters equal those of writing the context at once every step
    (OWED_MAX_ROWS = -1, the behaviour before), with fewer drafter context forwards."""
    from verispec.spec_decode import dflash, dflash_model

    calls = []
    real_write = dflash_model.DFlashDrafter.write_context

    def counting(self, *a, **kw):
        calls.append(1)
        return real_write(self, *a, **kw)

    monkeypatch.setattr(dflash_model.DFlashDrafter, "write_context", counting)
    logits = []  # every drafting step's drafter logits: they read the context K/V, so a missing or wrong
    real_draft = dflash.DFlashProposer._draft_logits  # deferred write shows here even where drafts agree

    def recording(self, *a, **kw):
        out = real_draft(self, *a, **kw)
        logits.append(out.detach().clone())
        return out

    monkeypatch.setattr(dflash.DFlashProposer, "_draft_logits", recording)
    uploads, per_defer = [], []  # an undrafted step runs no device op: no upload, no gather, no write
    real_upload, real_defer = dflash.to_device, dflash.DFlashProposer._defer_context

    def counting_upload(*a, **kw):
        uploads.append(1)
        return real_upload(*a, **kw)

    def counting_defer(self):
        n, w, reqs = len(uploads), len(calls), len(self._pending)
        real_defer(self)
        per_defer.append((reqs, len(uploads) - n + len(calls) - w))

    monkeypatch.setattr(dflash, "to_device", counting_upload)
    monkeypatch.setattr(dflash.DFlashProposer, "_defer_context", counting_defer)
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)

    def build(spec, a):
        spec = {**spec, "model": str(dflash_dir), "adaptive": True}
        return tiny_engine(models[0], spec=spec, async_scheduling=a, step_cost=DraftsPayOnlyWhenAccepted(), **STRESS)

    cells, default = {}, dflash.OWED_MAX_ROWS
    for cap in (default, -1):
        monkeypatch.setattr(dflash, "OWED_MAX_ROWS", cap)
        calls.clear()
        logits.clear()
        per_defer.clear()
        toks, counters, m, eng = run_scenario(build, "dflash", async_scheduling, prompts, params)
        cells[cap] = (toks, counters, len(calls), list(logits))
        if cap == default:
            several = [g for reqs, g in per_defer if reqs > 1]
            assert several and all(g == 0 for g in several)  # the features stay in the step's captured tensors
    (d_toks, d_c, d_calls, d_logits), (i_toks, i_c, i_calls, i_logits) = cells[default], cells[-1]
    assert d_toks == i_toks
    assert d_c == i_c
    assert len(d_logits) == len(i_logits) > 0
    for a, b in zip(d_logits, i_logits, strict=True):  # batched context writes may round differently
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert d_c["spec_decode_num_drafts"] > 0  # drafting steps happened, after k = 0 stretches:
    assert d_c["spec_decode_num_drafts"] < sum(p.max_tokens for p in params)  # not every step drafted
    assert d_calls < i_calls


class DraftsNeverPay:
    """A step cost under which no draft pays (the policy plans k = 0 and never probes)."""

    def seconds(self, k: int, batch: int) -> float:
        return 1.0 + 100.0 * k


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_dflash_finished_requests_write_no_context_at_k0(models, dflash_dir, monkeypatch, async_scheduling):
    """Four requests that never draft finish in the same step, a fifth later: no drafter context forward
    runs at all (their complete blocks' rows wait for a drafting step, the rest are dropped). Tokens equal
    plain decoding's."""
    from verispec import SamplingParams
    from verispec.spec_decode import dflash_model

    calls = []
    real_write = dflash_model.DFlashDrafter.write_context

    def counting(self, feats, positions, slots, kv):
        calls.append(int(positions.numel()))
        return real_write(self, feats, positions, slots, kv)

    monkeypatch.setattr(dflash_model.DFlashDrafter, "write_context", counting)
    prompts = scenario_prompts(vocab_hi=VOCAB - 12)[:5]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]  # a fifth runs on: the next observe
    spec = {"method": "dflash", "num_speculative_tokens": 3, "model": str(dflash_dir), "adaptive": True}
    eng = tiny_engine(models[0], spec=spec, async_scheduling=async_scheduling, step_cost=DraftsNeverPay(),
                      max_num_seqs=8)
    out = [o.outputs[0].token_ids for o in run_all(eng, prompts, params)]
    plain = [o.outputs[0].token_ids for o in run_all(tiny_engine(models[0], async_scheduling=async_scheduling),
                                                     prompts, params)]
    assert out == plain
    assert eng.get_metrics()["spec_decode_num_drafts"] == 0
    # No context forward at all: a step at k = 0 defers, and a finished request's rows either wait (those
    # of its complete blocks, which a prefix hit may read: written before the next drafting step, unless
    # the block gets another owner first, whose observe drops them) or are dropped (its last, incomplete
    # block). A request's context is every position but its last two: the step that computes its last
    # input token finishes it, so that step's features are never observed.
    assert calls == []
    bs = eng.config.block_size
    context = [len(p) + n - 2 for p, n in zip(prompts, [12] * 4 + [20], strict=True)]
    prop = eng.proposer
    waiting = sum(sp[3] - sp[2] for spans in prop._freed.values() for sp in spans)
    assert prop.dropped_rows + waiting == sum(context)
    assert prop.dropped_rows >= sum(n % bs for n in context) > 0 and waiting > 0
    assert prop._owed_rows == waiting and not prop._owed


# Cells where the adaptive policy's plans used to part between the loops (found by a sweep of blocks x
# token budget x prompt seed on the tiny models, block size 8): a request preempted while its step was in
# flight came back differently in the overlapped loop (its in-flight step's blocks were never published,
# or it waited a step for its values), so a later step's prefill chunks, then the set of requests a plan
# drafts for, and then the sampled requests' tokens differed (the real-model dflash cell, session 10).
PREEMPTED_IN_FLIGHT = [("self", 17, 17, 2), ("self", 14, 17, 3), ("draft_model", 14, 17, 2)]


@pytest.mark.parametrize("method, blocks, budget, seed", PREEMPTED_IN_FLIGHT,
                         ids=[f"{m}-{b}blocks-{t}tokens-seed{s}" for m, b, t, s in PREEMPTED_IN_FLIGHT])
def test_adaptive_plans_equal_with_preemption_in_flight(models, monkeypatch, method, blocks, budget, seed):
    """Under the adaptive policy, with requests preempted while the overlapped loop has their step in
    flight, both loops launch the same steps (requests, token ranges, drafts) and make the same plans, so
    the tokens and the acceptance counters are the same: the overlapped loop's preemption and
    readmission timing never reaches the policy's inputs (scheduler.py: one publish rule and one
    admission rule for both loops)."""
    from verispec.engine.engine import LLMEngine
    from verispec.engine.scheduler import Scheduler
    from verispec.spec_decode.policy import SpeculationPolicy

    steps, plans, in_flight, engines = [], [], [], []
    real_schedule, real_plan, real_preempt = LLMEngine._schedule, SpeculationPolicy.plan, Scheduler._preempt

    def schedule(self):
        out = real_schedule(self)
        if out.scheduled:  # (the overlapped loop also schedules nothing while it waits for values)
            steps.append([(s.request.request_id, s.start, s.num_new_tokens, s.num_draft_tokens) for s in out.scheduled])
        return out

    def plan(self, ids, batch=None):
        k = real_plan(self, ids, batch)
        plans.append((sorted(ids), k))
        return k

    def preempt(self, req, out):
        step = engines[-1].inflight  # the overlapped loop's launched, not yet collected step
        in_flight.append(step is not None and any(s.request is req for s in step.sched.scheduled))
        return real_preempt(self, req, out)

    monkeypatch.setattr(LLMEngine, "_schedule", schedule)
    monkeypatch.setattr(SpeculationPolicy, "plan", plan)
    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    sizes = dict(num_gpu_blocks=blocks, block_size=8, max_num_batched_tokens=budget)

    def build(spec, async_scheduling):
        override = models[1] if spec["method"] == "draft_model" else None
        engines.append(tiny_engine(models[0], spec={**spec, "adaptive": True}, draft_override=override,
                                   async_scheduling=async_scheduling, step_cost=CheapDrafts(), **sizes))
        return engines[-1]

    prompts, params = scenario_prompts(seed=seed, vocab_hi=VOCAB - 12), scenario_params(32)
    cells = {}
    for mode in (False, True):
        steps.clear(), plans.clear(), in_flight.clear()
        toks, counters, m, eng = run_scenario(build, method, mode, prompts, params)
        cells[mode] = (toks, counters, list(steps), list(plans), list(in_flight))
    (s_toks, s_c, s_steps, s_plans, _), (a_toks, a_c, a_steps, a_plans, a_in_flight) = cells[False], cells[True]
    assert any(a_in_flight)  # the mechanism: a victim was in the overlapped loop's step in flight
    assert sum(k for _, k in s_plans) > 0 and s_c["spec_decode_num_drafts"] > 0
    assert a_steps == s_steps
    assert a_plans == s_plans
    assert a_toks == s_toks
    assert a_c == s_c
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_ngram_probe_hint_same_in_both_loops(models):
    """ngram under a cost where only well-accepted drafts pay (k = 0 stretches, probes): the policy's probe
    hint (a suffix match on each request's tokens but the newest, which the overlapped loop may not know
    yet) is asked in both loops, and the loops agree on tokens and every acceptance counter, under
    preemption, chunked prefill, prefix hits, stops and seeded sampling."""
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
    asked: dict[bool, list[int]] = {}

    def build(spec, a):
        eng = tiny_engine(models[0], spec={**spec, "adaptive": True}, async_scheduling=a,
                          step_cost=DraftsPayOnlyWhenAccepted(), **STRESS)
        would_draft = eng.proposer.would_draft
        log = asked.setdefault(a, [])
        eng.proposer.would_draft = lambda reqs: log.append(would_draft(reqs)) or log[-1]
        return eng

    sync = run_scenario(build, "ngram", False, prompts, params)
    overlapped = run_scenario(build, "ngram", True, prompts, params)
    assert overlapped[0] == sync[0] and overlapped[1] == sync[1]
    assert asked[True] == asked[False] and any(asked[False]) and 0 in asked[False], asked
