"""Adaptive speculation in the engine (tiny model, CPU): drafts that never match are driven to 0 (probes
only) at no cost in steps, drafts that always match keep k at its maximum, k follows acceptance that
changes mid-request, and the two loops agree when requests stop mid-batch."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from parity import SPECS
from test_spec_decode import mixed_prompts
from tiny import CheapDrafts, run_all, tiny_config, tiny_engine, tiny_model

from verispec import SamplingParams
from verispec.spec_decode.policy import PolicyParams, SpeculationPolicy
from verispec.spec_decode.proposer import Proposal, Proposer

K = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def plain(model):
    """Prompts, their greedy outputs and the engine steps of plain decoding."""
    ps = mixed_prompts(4)
    eng = tiny_engine(model)
    outs = [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)]
    return ps, outs, eng.get_metrics()["num_steps"]


class ScriptedProposer(Proposer):
    """Drafts from the known greedy continuation: right where right(output index) says so, else the
    right token + 1 (always rejected). Logs (request, output index, drafts) of every proposal."""

    def __init__(self, continuation: dict[str, list[int]], right, found=lambda n: True) -> None:
        super().__init__(K)
        self.cont, self.right, self.found = continuation, right, found
        self.log: list[tuple[str, int, int]] = []

    def propose(self, requests, sources=None):
        out = Proposal()
        for r in requests:
            k = self.num_drafts_for(r)
            n = len(r.output_token_ids)
            self.log.append((r.request_id, n, k))
            if k and self.found(n):  # found(n) False: no drafts this time (an ngram lookup without a match)
                c = self.cont[r.request_id]
                out.token_ids[r.request_id] = [c[n + j] if self.right(n + j) else c[n + j] + 1 for j in range(k)]
        return out


def scripted_engine(model, ref: list[list[int]], right, adaptive: bool = True, found=lambda n: True, **kw):
    """An engine whose proposer is a ScriptedProposer (with the analytic CPU cost of a host drafter)."""
    eng = tiny_engine(model, spec={**SPECS["ngram"], "num_speculative_tokens": K, "adaptive": adaptive}, **kw)
    eng.proposer = ScriptedProposer({f"r{i}": r for i, r in enumerate(ref)}, right, found)
    eng.proposer.bind(eng.blocks.num_blocks, eng.blocks.block_size, eng.max_model_len)
    eng.scheduler.drafts_for = eng.proposer.max_drafts_for
    return eng


def by_request(log):
    out: dict[str, list[tuple[int, int]]] = {}
    for rid, n, k in log:
        out.setdefault(rid, []).append((n, k))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_that_never_match_go_to_zero(model, plain, async_scheduling):
    """Every draft wrong: after a few verifications only probes remain (probe_k drafts, at least
    probe_min tokens apart), and the engine takes exactly plain decoding's steps for the same tokens
    (a rejected draft still emits one token per step); with k pinned it drafts k every step."""
    ps, ref, plain_steps = plain
    params = PolicyParams()
    eng = scripted_engine(model, ref, lambda i: False, async_scheduling=async_scheduling)
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)] == ref
    m = eng.get_metrics()
    assert m["num_steps"] == plain_steps and m["spec_decode_num_accepted_tokens"] == 0
    for rid, steps in by_request(eng.proposer.log).items():
        late = [(n, k) for n, k in steps if n >= 24]
        probes = [n for n, k in late if k > 0]
        assert all(k <= params.probe_k for _, k in late), (rid, steps)
        assert all(b - a >= params.probe_min for a, b in zip(probes, probes[1:], strict=False)), (rid, steps)
    assert m["spec_decode_mean_k"] < 0.5
    pinned = scripted_engine(model, ref, lambda i: False, adaptive=False, async_scheduling=async_scheduling)
    run_all(pinned, ps, GREEDY)
    mp = pinned.get_metrics()
    assert mp["num_steps"] == plain_steps and mp["spec_decode_mean_k"] > 3.5
    assert mp["spec_decode_num_draft_tokens"] > 8 * m["spec_decode_num_draft_tokens"]


def test_drafts_that_always_match_keep_k_at_max(model, plain):
    """Every draft right: after a warm-up of two plans (the prior, p = 0.5, starts lower) every plan is
    k, every request drafts the most it may carry (k, trimmed near max_tokens), and the engine takes
    fewer steps than plain decoding."""
    ps, ref, plain_steps = plain
    eng = scripted_engine(model, ref, lambda i: True)
    plans: list[int] = []
    plan = eng.policy.plan

    def logged(ids, batch=None):
        plans.append(plan(ids, batch))
        return plans[-1]

    eng.policy.plan = logged
    drafted: list[tuple[int, int]] = []  # (cap, drafts) of every proposal after the warm-up
    propose = eng.proposer.propose

    def logged_propose(requests, sources=None):
        if len(plans) > 2:
            drafted.extend((eng.proposer.max_drafts_for(r), eng.proposer.num_drafts_for(r)) for r in requests)
        return propose(requests, sources)

    eng.proposer.propose = logged_propose
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)] == ref
    m = eng.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"] > 0
    assert plans[0] > 0 and all(k == K for k in plans[2:]), plans
    assert drafted and all(k == cap for cap, k in drafted)
    assert m["spec_decode_mean_k"] > 3 and m["num_steps"] < plain_steps / 3


def test_k_follows_acceptance_that_changes_mid_request(model):
    """Right drafts for output indices < 48, wrong ones up to 160, right again after: k is at its
    maximum, falls to probes, and comes back once a probe is accepted."""
    ps = mixed_prompts(2)
    sp = SamplingParams(temperature=0.0, max_tokens=260, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, sp)]
    eng = scripted_engine(model, ref, lambda i: i < 48 or i >= 160)
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, sp)] == ref
    probe_max = PolicyParams().probe_max
    for rid, steps in by_request(eng.proposer.log).items():
        ks = dict(steps)
        first = [k for n, k in steps if 4 <= n < 44]
        assert first and all(k == K for k in first), (rid, steps)
        middle = [k for n, k in steps if 100 <= n < 160]
        assert middle and max(middle) <= 1 and sum(middle) <= 2, (rid, steps)
        back = next(n for n, k in steps if n >= 160 and k == K)
        assert back - 160 <= probe_max + 8, (rid, steps)
        assert all(k == K for n, k in steps if back <= n < 250), (rid, steps)
        assert ks  # (keeps the log readable in a failure)


def test_missing_drafts_count_as_rejections(model, plain):
    """A proposer that finds drafts only every other time (always right when it does): the policy's
    estimate of the first draft's acceptance is about one half, not 1, because a planned step without
    drafts counts as rejected positions, and the tokens are plain decoding's."""
    ps, ref, _ = plain
    found = lambda n: random.Random(n).random() < 0.5  # noqa: E731 - half the time, pseudo-randomly
    eng = scripted_engine(model, ref, lambda i: True, found=found, step_cost=CheapDrafts())
    estimates: list[float] = []
    plan = eng.policy.plan

    def logged(ids, batch=None):
        k = plan(ids, batch)
        if "r0" in eng.policy.stats and sum(eng.policy.stats["r0"].reach) > 4:
            estimates.append(eng.policy.stats["r0"].conditional(eng.policy.params.prior_mean)[0])
        return k

    eng.policy.plan = logged
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)] == ref
    assert estimates and 0.25 < sum(estimates) / len(estimates) < 0.75, estimates


@pytest.mark.parametrize("method", ["self", "draft_model", "ngram"])
def test_loops_agree_when_requests_stop_mid_batch(model, method):
    """Requests that stop on a token mid-batch: the overlapped loop learns of the stop one step later
    than the synchronous loop, and with a device drafter still counts the request as ready once more.
    The policy's batch input counts such requests in both loops, so with a cost that makes k depend
    on the batch, tokens (greedy and sampled) and acceptance counters are the same."""
    draft = tiny_model(tiny_config(layers=1), seed=1) if method == "draft_model" else None
    ps = mixed_prompts(6, seed=3)
    ref = [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, GREEDY)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, seed=i, max_tokens=40,
                             stop_token_ids=[r[5 + 3 * i]]) for i, r in enumerate(ref)]

    class BatchCost:  # the more requests, the dearer a draft
        def seconds(self, k: int, batch: int) -> float:
            return 1.0 + 0.05 * k * batch * batch

    def run(async_scheduling: bool):
        spec = {**SPECS[method], "model": "tiny-draft"} if method == "draft_model" else SPECS[method]
        spec = {**spec, "adaptive": True}
        eng = tiny_engine(model, spec=spec, draft_override=draft, async_scheduling=async_scheduling)
        eng.policy = SpeculationPolicy(eng.proposer.k, BatchCost())
        outs = run_all(eng, ps, params)
        m = eng.get_metrics()
        keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_request_steps")
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs], [m[k] for k in keys]

    sync, overlapped = run(False), run(True)
    assert "stop" in sync[1]
    assert overlapped == sync


def test_measured_cost_from_graph_replays():
    """The CUDA start-up measurement, run on the CPU: a CudaGraphRunner with capture=False times its
    eager padded forward per shape (the measured batch sizes and every query length); the engine's step
    cost is then built on that table ("self" drafts with the target's own)."""
    import torch
    from tiny import MetadataBackend

    from verispec.spec_decode.cost import AUTOREGRESSIVE, HOST, ShapeTable
    from verispec.spec_decode.draft_model import DraftModelProposer
    from verispec.spec_decode.measure import build_step_cost, measure_graphs
    from verispec.spec_decode.ngram import NgramProposer
    from verispec.worker.graphs import CudaGraphRunner
    from verispec.worker.inputs import allocate_kv_cache

    m = tiny_model(tiny_config(vocab=512))
    m.attn_backend = MetadataBackend()
    c = m.config
    kv = allocate_kv_cache(c.num_layers, 9, 8, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    graphs = CudaGraphRunner(m, kv, max_batch=8, query_lens=(1, 1 + K), block_size=8, max_blocks_per_seq=4,
                             capture=False)
    table = measure_graphs(graphs, reps=3)
    assert set(table.times) == {(b, q) for b in (1, 4, 8) for q in (1, 1 + K)}
    assert all(t > 0 for t in table.times.values())

    class Runner:
        pass

    runner = Runner()
    runner.graphs = graphs
    ngram = build_step_cost(m, NgramProposer(K, 1, 3), runner, torch.device("cpu"), measure=True)
    assert ngram.drafter_kind == HOST and isinstance(ngram.target, ShapeTable)
    own = build_step_cost(m, DraftModelProposer(m, K, "cpu", torch.float32), runner, torch.device("cpu"), measure=True)
    assert own.drafter_kind == AUTOREGRESSIVE and own.drafter_forward is own.target and own.catch_up == K + 1
    assert 0 < own.seconds(0, 4) < own.seconds(K, 4)


def test_batch_table_pads_and_interpolates():
    """BatchTable (a DFlash drafting step's measured times): a batch pads to the next captured size, then
    interpolates between the measured sizes around it, proportional past the largest."""
    from verispec.spec_decode.cost import BatchTable

    t = BatchTable({1: 1.0, 4: 2.0, 16: 8.0}, pad_to=(1, 2, 4, 8, 16))
    assert t(16, 1) == 1.0  # num_tokens plays no part
    assert t(0, 3) == 2.0  # pads to 4, measured
    assert t(0, 2) == pytest.approx(1.0 + 1.0 * (2 - 1) / 3)  # pads to 2, between 1 and 4
    assert t(0, 5) == pytest.approx(2.0 + 6.0 * (8 - 4) / 12)  # pads to 8, between 4 and 16
    assert t(0, 32) == pytest.approx(8.0 * 32 / 16)  # past every captured size: unpadded, proportional
    assert BatchTable({1: 1.0, 4: 2.0})(0, 3) == pytest.approx(1.0 + 1.0 * 2 / 3)  # no padding
    with pytest.raises(ValueError, match="at least one"):
        BatchTable({})


def test_dflash_drafting_step_measured_and_harmless(tmp_path, monkeypatch):
    """With measure=True the DFlash step cost prices drafting by timing the drafting step itself at
    batch sizes 1, 4 and the runner's rows (DFlashStepRunner.time_steps, host preparation included, so no
    separate drafter host term), not the target's forward scaled by the layer share (the analytic
    default). The timed steps write only scratch: an engine timed first decodes the same tokens with the
    same counters as one that was not."""
    import torch

    from verispec.spec_decode import measure
    from verispec.spec_decode.cost import BLOCK, BatchTable, ScaledForward, ShapeTable
    from verispec.spec_decode.dflash import save_drafter
    from verispec.spec_decode.dflash_model import DFlashDrafter, new_config

    model = tiny_model()
    cfg = new_config(model, "tiny", tiny_config().vocab_size - 1, block_size=5, num_layers=1)
    d = DFlashDrafter(cfg)
    d.init_weights(seed=3, std=0.2)
    save_drafter(d, tmp_path, torch.float32)
    spec = {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 4, "adaptive": False}
    ps = [[random.Random(i).randrange(100, 3000) for _ in range(12 + i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    target = ShapeTable({(1, 1): 1e-3, (1, 5): 2e-3}, (1,), (1, 5))
    monkeypatch.setattr(measure, "measure_graphs", lambda graphs, reps=5: target)

    def run(timed: bool):
        eng = tiny_engine(model, spec=spec, max_num_seqs=6)
        if timed:
            analytic = measure.build_step_cost(model, eng.proposer, eng.runner, torch.device("cpu"), measure=False)
            assert analytic.drafter_kind == BLOCK and isinstance(analytic.drafter_forward, ScaledForward)
            cost = measure.build_step_cost(model, eng.proposer, SimpleNamespace(graphs=object()),
                                           torch.device("cpu"), measure=True)
            table = cost.drafter_forward
            assert cost.target is target and isinstance(table, BatchTable)
            assert set(table.times) == {1, 4, 6} and table.pad_to == () and all(t > 0 for t in table.times.values())
            assert cost.drafter_host == 0 and cost.drafter_host_per_seq == 0
            assert cost.drafter(4, 4) == table.times[4] and cost.drafter(0, 4) == 0
        outs = run_all(eng, ps, params)
        m = eng.get_metrics()
        return [o.outputs[0].token_ids for o in outs], m["spec_decode_num_accepted_tokens_per_pos"], m["spec_decode_num_drafts"]

    plain, timed = run(False), run(True)
    assert plain == timed and plain[2] > 0
