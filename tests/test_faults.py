"""Fault injection: each known bug class, planted with VERISPEC_FAULT, is caught by a gate
(parity, oracle, prefix-cache equivalence or counter hand count), and nothing fires without it.
Several of these bugs leave the emitted text correct and only move acceptance."""

from __future__ import annotations

import pytest
from parity import STRESS, parity_problems, run_scenario, scenario_prompts
from tiny import run_all, tiny_engine, tiny_model

from verispec import SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def maker(model, **extra):
    def build(spec, async_scheduling):
        return tiny_engine(model, spec=spec, async_scheduling=async_scheduling, **{**STRESS, **extra})

    return build


GREEDY = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 7, 16, 11, 18, 9)]


def oracle_rate(model, async_scheduling: bool) -> float:
    eng = tiny_engine(model, spec={"method": "self", "num_speculative_tokens": 3}, async_scheduling=async_scheduling)
    run_all(eng, scenario_prompts(seed=3)[:3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    m = eng.get_metrics()
    return m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"]


def test_no_fault_all_gates_pass(model, monkeypatch):
    monkeypatch.delenv("VERISPEC_FAULT", raising=False)
    assert parity_problems(maker(model), "self", params=GREEDY) == []
    assert oracle_rate(model, True) >= 0.99


def test_stale_host_draft_caught_text_stays_correct(model, monkeypatch):
    monkeypatch.setenv("VERISPEC_FAULT", "stale_host_draft")
    problems = parity_problems(maker(model), "self", params=GREEDY)
    assert problems and all("tokens differ" not in p for p in problems), problems  # counters only
    assert oracle_rate(model, True) < 0.5
    assert oracle_rate(model, False) >= 0.99  # the sync path holds real drafts on the host


def test_row_by_position_caught(model, monkeypatch):
    monkeypatch.setenv("VERISPEC_FAULT", "row_by_position")
    assert any("tokens differ" in p for p in parity_problems(maker(model), "none", params=GREEDY))


def test_placeholder_leak_caught(model, monkeypatch):
    monkeypatch.setenv("VERISPEC_FAULT", "placeholder_leak")
    assert any("tokens differ" in p for p in parity_problems(maker(model), "none", params=GREEDY))


def prefix_cache_problems(model) -> list[int]:
    """Outputs with prefix caching (long shared prefix, small chunks) vs without."""
    prompts, params = scenario_prompts(seed=4), GREEDY
    build_on = maker(model, max_num_batched_tokens=9)
    build_off = maker(model, max_num_batched_tokens=9, enable_prefix_caching=False)
    on, _, m, _ = run_scenario(build_on, "none", False, prompts, params)
    off, _, _, _ = run_scenario(build_off, "none", False, prompts, params)
    assert m["prefix_cache_hits"] > 0
    return [i for i, (a, b) in enumerate(zip(on, off, strict=True)) if a != b]


def test_early_prefix_publish_caught(model, monkeypatch):
    monkeypatch.delenv("VERISPEC_FAULT", raising=False)
    assert prefix_cache_problems(model) == []
    monkeypatch.setenv("VERISPEC_FAULT", "early_prefix_publish")
    assert prefix_cache_problems(model)


def test_miscount_rejected_caught(model, monkeypatch):
    """The hand-count gate (tests/hand_count.py) fails on the acceptance counters only, each rejected
    draft counted as one more accepted token at its first rejected position; tokens and draft counts stay right."""
    from hand_count import GREEDY as HAND_GREEDY
    from hand_count import check_counters

    monkeypatch.setenv("VERISPEC_FAULT", "miscount_rejected")
    ps = scenario_prompts(seed=1)
    ref = [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, HAND_GREEDY)]
    check = check_counters(model, ps, ref)
    want, m = check.want, check.metrics
    assert want.rejected_drafts > 0
    assert [p.split(":")[0] for p in check.problems] == [
        "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
        "per_request_spec_num_accepted_tokens"], check.problems
    assert m["spec_decode_num_accepted_tokens"] == want.accepted + want.rejected_drafts
    assert m["spec_decode_num_accepted_tokens_per_pos"] == [*want.per_pos[:2], want.per_pos[2] + want.rejected_drafts]


def test_debug_stale_read_raises(model, monkeypatch):
    """VERISPEC_DEBUG_STALE=1: a host proposer reading placeholders fails loudly."""
    from verispec.core.placeholder import PLACEHOLDER, StaleMirrorError
    from verispec.core.request import Request
    from verispec.spec_decode.ngram import NgramProposer

    req = Request("x", [1, 2, 3, 1, 2], SamplingParams(max_tokens=9))
    req.output_token_ids = [3, PLACEHOLDER]
    from verispec.core.faults import Faults

    prop = NgramProposer(2, 1, 2)
    monkeypatch.setenv("VERISPEC_DEBUG_STALE", "1")
    prop.faults = Faults.from_env()  # what the engine builder does, once
    with pytest.raises(StaleMirrorError):
        prop.propose([req])
    monkeypatch.setenv("VERISPEC_DEBUG_STALE", "0")
    prop.faults = Faults.from_env()
    prop.propose([req])  # without debug mode it does not check


def test_runtime_audit_counts_disagreements(model, monkeypatch):
    """spec_audit_rate: re-verification on the host agrees with the device when all is well and
    flags the steps where the verifier read stale drafts."""
    def audited(fault: str | None) -> dict:
        if fault:
            monkeypatch.setenv("VERISPEC_FAULT", fault)
        else:
            monkeypatch.delenv("VERISPEC_FAULT", raising=False)
        eng = tiny_engine(model, spec={"method": "self", "num_speculative_tokens": 3}, async_scheduling=True, spec_audit_rate=1.0)
        params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True)]
        run_all(eng, scenario_prompts(seed=6)[:2], params)
        return eng.get_metrics()

    clean = audited(None)
    assert clean["spec_decode_audited_steps"] > 0 and clean["spec_decode_audit_mismatches"] == 0
    faulty = audited("stale_host_draft")
    assert faulty["spec_decode_audit_mismatches"] > 0
