"""Fault injection: each known bug class, planted with VERISPEC_FAULT, is caught by a gate
(parity, oracle, prefix-cache equivalence or counter hand count), and nothing fires without it.
Several of these bugs leave the emitted text correct and only move acceptance.

The runtime audit (spec_audit_rate) catches every class that moves acceptance or the tokens of a
speculative step in the tiny setup: stale_host_draft, placeholder_leak, row_by_position and
miscount_rejected (the last only where drafts get rejected: the self oracle has none). It does not
catch early_prefix_publish, by design: that bug corrupts K/V, so both the device verifier and the
audit's host re-verification see the same wrong logits (the audit re-checks verification, not the
forward pass). Here it changes text only without speculation, where no row is audited, and the
prefix-cache equivalence gate (test_early_prefix_publish_caught) is what catches it.

Every gate runs on two targets (tests/gates.py): the tiny models on the CPU, and the real 0.5B on CUDA
in float32 with CUDA graphs and the Triton kernels (marked gpu). graph_stage_no_writeback plants a bug
in GPU-only code (the graph staging kernel), so its gate runs on CUDA only."""

from __future__ import annotations

import random

import pytest
from gates import CUDA_ONLY, TARGETS, gate_model, layer_skip_draft
from parity import STRESS, parity_problems, run_scenario, scenario_params, scenario_prompts
from tiny import CheapDrafts, run_all, tiny_config, tiny_engine, tiny_model

from verispec import SamplingParams


@pytest.fixture(scope="module", params=TARGETS)
def target(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(target, request):
    return gate_model(target, request, tiny_model)


def maker(model, adaptive: bool = False, **extra):
    """Engines for the parity scenario: k pinned, or the adaptive policy under a cost where accepted
    drafts pay (tiny.CheapDrafts), so that its plans vary with the batch and the acceptance."""

    def build(spec, async_scheduling):
        if spec:
            spec = {**spec, "adaptive": adaptive}
        return tiny_engine(model, spec=spec, async_scheduling=async_scheduling,
                           step_cost=CheapDrafts() if adaptive and spec else None, **{**STRESS, **extra})

    return build


POLICY = pytest.mark.parametrize("adaptive", [False, True], ids=["pinned", "adaptive"])


GREEDY = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 7, 16, 11, 18, 9)]


def oracle_rate(model, async_scheduling: bool, adaptive: bool = False) -> float:
    eng = tiny_engine(model, spec={"method": "self", "num_speculative_tokens": 3, "adaptive": adaptive},
                      async_scheduling=async_scheduling, step_cost=CheapDrafts() if adaptive else None)
    run_all(eng, scenario_prompts(seed=3)[:3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    m = eng.get_metrics()
    return m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"]


@POLICY
def test_no_fault_all_gates_pass(model, monkeypatch, adaptive):
    monkeypatch.delenv("VERISPEC_FAULT", raising=False)
    assert parity_problems(maker(model, adaptive), "self", params=GREEDY) == []
    assert oracle_rate(model, True, adaptive) == 1.0  # CPU float32: the target drafting for itself accepts every draft


@POLICY
def test_stale_host_draft_caught_text_stays_correct(model, monkeypatch, adaptive):
    monkeypatch.setenv("VERISPEC_FAULT", "stale_host_draft")
    problems = parity_problems(maker(model, adaptive), "self", params=GREEDY)
    assert problems and all("tokens differ" not in p for p in problems), problems  # counters only
    assert oracle_rate(model, True, adaptive) < 0.5
    assert oracle_rate(model, False, adaptive) == 1.0  # the sync path holds real drafts on the host


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


def aborted_writer_problems(model, num_gpu_blocks: int = 256) -> list[int]:
    """Readers whose tokens with prefix caching differ from those without, after a writer that shares
    their first two blocks was aborted after its first chunk (slots 0..8 of its 48-token prompt
    written). Only block 0 is then full and written; early_prefix_publish has also published block 1,
    whose slots 9..15 were never written, and hands it to the readers. Unlike the stress scenario this
    does not hang on preemption timing: the number of KV blocks (one fewer on CUDA, where the last is
    the graphs' scratch block) does not move it."""
    rng = random.Random(7)
    writer = [rng.randrange(100, 3000) for _ in range(48)]
    readers = [writer[:16] + [rng.randrange(100, 3000) for _ in range(n)] for n in (5, 9, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(prefix_caching: bool) -> list[list[int]]:
        eng = tiny_engine(model, block_size=8, max_num_batched_tokens=9, enable_prefix_caching=prefix_caching,
                          async_scheduling=False, num_gpu_blocks=num_gpu_blocks)
        eng.add_request("w", None, params, writer)
        eng.step()  # the writer's first chunk: 9 of its 48 tokens
        eng.abort_request("w")
        outs = [o.outputs[0].token_ids for o in run_all(eng, readers, params)]
        if prefix_caching:  # every reader hits at least the writer's block 0
            assert eng.get_metrics()["prefix_cache_hits"] >= 8 * len(readers)
        return outs

    on, off = run(True), run(False)
    return [i for i, (a, b) in enumerate(zip(on, off, strict=True)) if a != b]


def test_early_prefix_publish_caught(model, monkeypatch):
    """The prefix-cache equivalence gate: with and without prefix caching, the same tokens (the stress
    scenario and the aborted writer's readers); early_prefix_publish breaks it for the readers."""
    monkeypatch.delenv("VERISPEC_FAULT", raising=False)
    assert prefix_cache_problems(model) == []
    assert aborted_writer_problems(model) == []
    monkeypatch.setenv("VERISPEC_FAULT", "early_prefix_publish")
    assert aborted_writer_problems(model)


@pytest.mark.parametrize("num_gpu_blocks", [15, 16, 17])
def test_early_prefix_publish_caught_whatever_the_block_count(monkeypatch, num_gpu_blocks):
    """The stress scenario alone missed the fault at 15 blocks here, and with the real 0.5B at 16
    (the CUDA count of STRESS's 17: the graphs take one): the aborted writer's readers see it at any."""
    monkeypatch.setenv("VERISPEC_FAULT", "early_prefix_publish")
    assert aborted_writer_problems(tiny_model(), num_gpu_blocks)


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


def test_stale_graph_metadata_caught(target, request, monkeypatch):
    """A replay that keeps the previous replay's seq_lens (the static metadata a CUDA graph reads):
    the graph-path run no longer matches the run without graphs; without the fault it does. On the CPU
    the graph path is the graph runner's eager capture=False mode over the same static buffers
    (test_graph_padding.py); on CUDA it is real captured graphs, staged by kernels/graph_inputs.py,
    against enforce_eager (greedy requests: float32 rounding differs between the two paths)."""
    if target == "cpu":
        from test_graph_padding import VOCAB, build

        prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
        with_graphs, without = build(True), build(False)
    else:
        model = request.getfixturevalue("model")
        prompts, params = scenario_prompts(), GREEDY
        with_graphs, without = maker(model), maker(model, enforce_eager=True)
    monkeypatch.delenv("VERISPEC_FAULT", raising=False)
    plain = run_scenario(without, "ngram", False, prompts, params)[0]
    toks, _, _, eng = run_scenario(with_graphs, "ngram", False, prompts, params)
    assert eng.runner.graph_steps > 0 and toks == plain
    monkeypatch.setenv("VERISPEC_FAULT", "stale_graph_metadata")
    assert run_scenario(with_graphs, "ngram", False, prompts, params)[0] != plain


@pytest.mark.parametrize("target", CUDA_ONLY, scope="module")
def test_graph_stage_no_writeback_caught(model, monkeypatch):
    """GPU-only code: the graph staging kernel (kernels/graph_inputs.py) fills the placeholders of the
    graph's static input ids but not those of the step's own ids, where the verifier reads the drafts.
    The model sees the right tokens, the verifier placeholders: the text stays right, and acceptance of
    the overlapped loop's device drafts collapses, which the parity gate (counters) and the self oracle
    see; the synchronous loop (drafts known on the host, no placeholders) is unaffected. The runtime
    audit flags the rows of the replayed steps (an eager step's torch gather fills the ids right)."""
    monkeypatch.setenv("VERISPEC_FAULT", "graph_stage_no_writeback")
    problems = parity_problems(maker(model), "self", params=GREEDY)
    assert problems and all("tokens differ" not in p for p in problems), problems  # counters only
    assert oracle_rate(model, True) < 0.5
    assert oracle_rate(model, False) == 1.0
    _, clean = audited_run(model, None, monkeypatch, "self", None)
    _, m = audited_run(model, None, monkeypatch, "self", "graph_stage_no_writeback")
    assert clean["spec_decode_audit_mismatches"] == 0
    assert m["spec_decode_num_accepted_tokens"] < clean["spec_decode_num_accepted_tokens"]
    assert 0 < m["spec_decode_audit_mismatches"] <= m["spec_decode_audited_steps"]


def test_debug_stale_read_raises(monkeypatch):
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


# Greedy requests that finish at different steps (rows reorder) and two seeded sampled ones.
AUDIT_PARAMS = GREEDY[:4] + [SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True),
                             SamplingParams(temperature=0.7, top_k=40, seed=4, max_tokens=12, ignore_eos=True)]


@pytest.fixture(scope="module")
def draft(target, model):
    """A draft model whose drafts are sometimes right: a 1-layer tiny one, or the real target's first half."""
    return tiny_model(tiny_config(layers=1), seed=1) if target == "cpu" else layer_skip_draft(model)


_AUDITED: dict[tuple, tuple] = {}  # runs are deterministic: the clean ones are shared by the tests


def audited_run(model, draft, monkeypatch, method: str, fault: str | None, async_scheduling: bool = True):
    """(tokens, metrics) of the parity scenario with spec_audit_rate=1.0 (every speculative row
    re-checked) and the fault planted."""
    key = (id(model), method, fault, async_scheduling)
    if key in _AUDITED:
        return _AUDITED[key]
    if fault:
        monkeypatch.setenv("VERISPEC_FAULT", fault)
    else:
        monkeypatch.delenv("VERISPEC_FAULT", raising=False)

    def build(spec, a):
        # k pinned: the adaptive policy would stop drafting once a fault ruins acceptance, and the gate
        # compares acceptance with and without the fault at the same draft schedule.
        spec = {**spec, "adaptive": False} if spec else spec
        return tiny_engine(model, spec=spec, draft_override=draft if method == "draft_model" else None,
                           async_scheduling=a, spec_audit_rate=1.0, **STRESS)

    toks, _, m, _ = run_scenario(build, method, async_scheduling, scenario_prompts(seed=3), AUDIT_PARAMS)
    rate = m["spec_decode_audit_mismatches"] / max(1, m["spec_decode_audited_steps"])
    print(f"{method} {'async' if async_scheduling else 'sync'} {fault}: {m['spec_decode_audit_mismatches']} of "
          f"{m['spec_decode_audited_steps']} audited rows flagged ({rate:.0%}); accepted "
          f"{m['spec_decode_num_accepted_tokens']} of {m['spec_decode_num_draft_tokens']} drafts")
    _AUDITED[key] = toks, m
    return toks, m


@pytest.mark.parametrize("method", ["self", "draft_model"])
def test_runtime_audit_flags_every_acceptance_fault(target, model, draft, monkeypatch, method):
    """spec_audit_rate=1.0 re-checks every speculative row against sources independent of the
    verifier's draft read (the ids the model consumed, the proposer's own drafts, the host's
    committed tokens) and the engine's counters against the host re-verification. Without a fault
    it counts exactly 0 mismatches; each fault that moves acceptance is flagged, in the row counts
    derived below. (The self oracle accepts everything, so miscount_rejected has no rejected
    position to miscount there: 0 flagged, and its counters do not move either.)

    The real target (CUDA) is flagged too, but its counts are not the tiny setup's: a placeholder read
    as token 0 by both the real target and its draft can raise acceptance (measured with the real 0.5B
    on the CPU: 46 of 79 drafts accepted against 31 of 119 without the fault, 19 of 28 rows flagged),
    and rows without placeholders (after a drain) are not flagged."""
    toks, clean = audited_run(model, draft, monkeypatch, method, None)
    rows = clean["spec_decode_num_drafts"]
    assert rows > 0 and clean["spec_decode_audited_steps"] == rows  # every speculative row audited
    assert clean["spec_decode_audit_mismatches"] == 0
    for fault in ("stale_host_draft", "placeholder_leak"):
        # Every draft of the overlapped loop lives on the device: the verifier reads placeholders
        # (stale_host_draft) or the model reads them as token 0 (placeholder_leak), in every row.
        _, m = audited_run(model, draft, monkeypatch, method, fault)
        assert m["spec_decode_audit_mismatches"] > 0, fault
        if target == "cpu":  # the tiny setup: every row, and acceptance drops
            assert m["spec_decode_num_accepted_tokens"] < clean["spec_decode_num_accepted_tokens"]
            assert m["spec_decode_audit_mismatches"] == m["spec_decode_audited_steps"] == m["spec_decode_num_drafts"], fault
    # The tokens stay right; the counters count one accepted draft too many in each row with a
    # rejection, and the audit flags exactly those rows.
    miscount_toks, m = audited_run(model, draft, monkeypatch, method, "miscount_rejected")
    assert miscount_toks == toks and m["spec_decode_audited_steps"] == rows
    overcount = m["spec_decode_num_accepted_tokens"] - clean["spec_decode_num_accepted_tokens"]
    assert m["spec_decode_audit_mismatches"] == overcount
    if method == "self":  # the oracle: nothing rejected, nothing to miscount
        assert clean["spec_decode_num_accepted_tokens"] == clean["spec_decode_num_draft_tokens"] and overcount == 0
    else:
        assert overcount > 0


@pytest.mark.parametrize("method", ["self", "draft_model"])
def test_runtime_audit_flags_row_by_position(model, draft, monkeypatch, method):
    """Rows of the previous step looked up by batch position: wrong input tokens once a request
    ahead has finished, which the audit sees in the ids the model consumed. The wrong row often
    lands on a column past its own count (a placeholder; with self-drafting in the tiny setup at
    once): the fault reads it as token 0, where an out-of-range id used to reach the embedding
    (an IndexError here, a device-side assert on CUDA that aborted the whole test process)."""
    toks, _ = audited_run(model, draft, monkeypatch, method, None)
    bad, m = audited_run(model, draft, monkeypatch, method, "row_by_position")
    assert bad != toks and m["spec_decode_audit_mismatches"] > 0


def test_runtime_audit_quiet_when_the_sync_loop_is_unaffected(model, draft, monkeypatch):
    """The synchronous loop holds every value on the host, so the overlapped loop's faults change
    nothing there, and the audit flags nothing."""
    _, clean = audited_run(model, draft, monkeypatch, "draft_model", None, async_scheduling=False)
    for fault in ("stale_host_draft", "placeholder_leak", "row_by_position"):
        _, m = audited_run(model, draft, monkeypatch, "draft_model", fault, async_scheduling=False)
        assert m["spec_decode_audit_mismatches"] == 0 and m["spec_decode_audited_steps"] == clean["spec_decode_audited_steps"]
