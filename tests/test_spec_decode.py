"""Speculative decoding on a tiny random model: lossless greedy output for every method, the
self-drafting oracle, and per-position counters against a hand count. The gates run on the CPU and
on CUDA with the real 0.5B in float32, CUDA graphs and the Triton kernels (tests/gates.py)."""

from __future__ import annotations

import random

import pytest
from gates import TARGETS, gate_model, layer_skip_draft
from hand_count import check_counters
from tiny import run_all, tiny_config, tiny_engine, tiny_model

from verispec import SamplingParams
from verispec.spec_decode.ngram import ngram_lookup

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def mixed_prompts(n=6, seed=1) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(100, 3000) for _ in range(rng.randrange(4, 30))]
        out.append(base * (1 + i % 3))  # repetition gives the n-gram proposer something to find
    return out


@pytest.fixture(scope="module", params=TARGETS)
def target(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(target, request):
    return gate_model(target, request, tiny_model)


@pytest.fixture(scope="module")
def reference(model):
    """Prompts that repeat themselves with their own continuation (base + continuation + base),
    so prompt lookup finds drafts that are sometimes right and sometimes wrong."""
    bases = mixed_prompts()
    conts = [o.outputs[0].token_ids for o in run_all(tiny_engine(model), bases, GREEDY)]
    ps = [b + c[:12] + b for b, c in zip(bases, conts, strict=True)]
    return ps, [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, GREEDY)]


SPECS = [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False},
    {"method": "self", "num_speculative_tokens": 4, "adaptive": False},
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["method"])
@pytest.mark.parametrize("stress", ["plain", "chunked+preempt"])
def test_lossless_greedy(model, reference, spec, stress):
    ps, ref = reference
    kw = {} if stress == "plain" else dict(num_gpu_blocks=16, block_size=8, max_num_batched_tokens=11)
    eng = tiny_engine(model, spec=spec, **kw)
    outs = run_all(eng, ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    m = eng.get_metrics()
    assert m["spec_decode_num_drafts"] > 0
    assert 0 < m["spec_decode_num_accepted_tokens"]
    if spec["method"] == "ngram":
        assert m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]  # rejections too
    if stress != "plain":
        assert m["num_preemptions"] > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_draft_model_lossless(target, model, reference):
    ps, ref = reference
    draft = tiny_model(tiny_config(layers=1), seed=1) if target == "cpu" else layer_skip_draft(model)
    eng = tiny_engine(model, spec={"method": "draft_model", "num_speculative_tokens": 3, "model": "tiny-draft",
                                  "adaptive": False},
                      draft_override=draft)
    outs = run_all(eng, ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert eng.get_metrics()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_self_oracle_acceptance(model, k):
    eng = tiny_engine(model, spec={"method": "self", "num_speculative_tokens": k, "adaptive": False})
    run_all(eng, mixed_prompts(4, seed=k), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    m = eng.get_metrics()
    # float32 (CPU; CUDA as measured): the target drafting for itself is exact, so every draft is accepted.
    assert m["spec_decode_num_draft_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"], m
    # Mean acceptance length over full-k drafts; trimmed drafts at the end count as shorter ones.
    assert m["spec_decode_mean_acceptance_length"] == 1 + m["spec_decode_num_draft_tokens"] / m["spec_decode_num_drafts"]


def test_self_oracle_at_temperature(model):
    """q == p exactly: min(1, p/q) = 1, so every sampled draft is accepted."""
    eng = tiny_engine(model, spec={"method": "self", "num_speculative_tokens": 4, "adaptive": False})
    sp = SamplingParams(temperature=0.8, top_k=50, seed=5, max_tokens=30, ignore_eos=True)
    run_all(eng, mixed_prompts(3), sp)
    m = eng.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    # CPU float32: q == p bit for bit. On CUDA the draft's decode shape and the verify shape round apart
    # (q / p = 1 +- 1e-7: a rejection is that unlikely per draft), so the same exact count is expected.
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"], m


def test_per_position_counters_hand_count(model, reference):
    """The acceptance counters (global, per position, per request) equal a hand count (tests/hand_count.py)."""
    ps, ref = reference
    check = check_counters(model, ps, ref)
    assert check.problems == []
    assert check.want.rejected_drafts > 0 and check.want.accepted < check.want.draft_tokens  # rejections too


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 4, 1, 2], k=2, n_min=1, n_max=3) == [3, 4]
    assert ngram_lookup([5, 6, 7], k=2, n_min=1, n_max=3) == []
    # The longest matching n-gram wins over a more recent shorter one.
    assert ngram_lookup([1, 2, 9, 8, 2, 7, 1, 2], k=1, n_min=1, n_max=2) == [9]


def test_bad_speculative_configs():
    from verispec.config import SpeculativeConfig

    for bad, msg in [
        ({"method": "magic"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model"}, "model"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
        ({"method": "ngram", "bogus": 1}, "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.from_dict(bad)


def test_draft_model_with_other_vocab_is_refused(model):
    other = tiny_model(tiny_config(vocab=1000, layers=1))
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_engine(model, spec={"method": "draft_model", "num_speculative_tokens": 2, "model": "x"}, draft_override=other)


def _record_catch_ups(monkeypatch) -> list[list[tuple[int, int, int]]]:
    """Every catch-up forward of the draft model: [(query length, gap, first position)] per chunk."""
    from verispec.spec_decode.draft_model import DraftModelProposer

    calls: list[list[tuple[int, int, int]]] = []
    orig = DraftModelProposer._forward_chunks

    def record(self, items, sources, logits=True):
        calls.append([(n, end - self._written(r), end - n) for r, n, end in items])
        return orig(self, items, sources, logits)

    monkeypatch.setattr(DraftModelProposer, "_forward_chunks", record)
    return calls


def test_draft_catch_up_is_uniform(model, monkeypatch):
    """The draft model's catch-up forward gives every request the same query length (so it can replay a
    CUDA graph): exactly k + 1 tokens once a request drafts every step, including after rejections,
    and the oracle still accepts everything."""
    from verispec.spec_decode.draft_model import catch_up_lens

    k = 3
    calls = _record_catch_ups(monkeypatch)
    eng = tiny_engine(model, spec={"method": "self", "num_speculative_tokens": k, "adaptive": False})
    prompts = [[7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    run_all(eng, prompts, [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2)
    # The first propose() of a request catches up its whole prompt + first token (the draft's
    # prefill: 7 and 10 tokens, so a power of two, 8 or 16, padded in front); every later one is k + 1.
    assert all(len({n for n, _, _ in c}) == 1 for c in calls), calls
    lens = [c[0][0] for c in calls]
    assert lens[0] == 16 and set(lens[1:]) == {k + 1} and all(n in catch_up_lens(k) for n in lens), lens
    assert all(n >= gap for c in calls for n, gap, _ in c), calls
    assert eng.get_metrics()["spec_decode_num_accepted_tokens"] == eng.get_metrics()["spec_decode_num_draft_tokens"]


def test_draft_catch_up_after_steps_without_drafts_is_a_power_of_two(model, monkeypatch):
    """Adaptive, with a plan of 0 drafts except every 7th step: the catch-up after a stretch without
    drafts covers the gap in one forward of the smallest power of two that holds it (a few shapes, not
    one per gap length), the same length for every request of the forward, and the oracle still accepts
    every draft (the recomputed K/V are the same)."""
    k = 3
    calls = _record_catch_ups(monkeypatch)
    eng = tiny_engine(model, spec={"method": "self", "num_speculative_tokens": k, "adaptive": True})
    plans = iter(range(10**6))
    eng.policy.plan = lambda ids, batch=None: k if next(plans) % 7 == 6 else 0
    prompts = [[7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    run_all(eng, prompts, [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * 2)
    assert any(c[0][0] > k + 1 for c in calls)  # stretches without drafts happened
    for c in calls:
        (n,) = {n for n, _, _ in c}
        gap = max(g for _, g, _ in c)
        assert n >= gap and (n == k + 1 or (n & (n - 1) == 0 and n < 2 * gap)), calls
    m = eng.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]
