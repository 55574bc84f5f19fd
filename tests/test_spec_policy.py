"""The adaptive speculation policy and its cost model on their own (spec_decode/policy.py, cost.py):
synthetic acceptance sequences and deterministic costs, no engine."""

from __future__ import annotations

import pytest

from verispec.spec_decode.cost import (
    AUTOREGRESSIVE,
    BLOCK,
    HOST,
    LinearForward,
    ModeledStepCost,
    ScaledForward,
    ShapeTable,
)
from verispec.spec_decode.policy import AcceptanceStats, PolicyParams, SpeculationPolicy

K = 4
# A step of b requests at k drafts: a fixed 1.0 plus 0.02 per token (a memory-bound target at small b).
LINEAR = ModeledStepCost(target=LinearForward(1.0, 0.02))


class Request:
    """Drives one synthetic request through the policy: each step it verifies the chosen k drafts, of
    which `accepts(output_index)` says how many are right."""

    def __init__(self, policy: SpeculationPolicy, rid: str = "r") -> None:
        self.policy, self.rid, self.n = policy, rid, 0
        self.ks: list[tuple[int, int]] = []  # (output index, k) per step

    def step(self, accepted_prefix: int, batch: int = 1, k_cap: int = K) -> int:
        k = min(self.policy.plan([self.rid], batch), k_cap)
        self.ks.append((self.n, k))
        a = min(k, accepted_prefix)
        self.policy.observe(self.rid, k, a + 1, self.n)
        self.n += a + 1
        return k

    def run_until(self, n_out: int, accepted_prefix: int, batch: int = 1) -> list[int]:
        ks = []
        while self.n < n_out:
            ks.append(self.step(accepted_prefix, batch))
        return ks


def test_reach_and_accept_counts_per_position():
    st = AcceptanceStats(4)
    st.observe(3, 1, output_index=10, decay=1.0)  # 3 drafts, the first accepted: positions 0, 1 reached
    assert st.reach == [1, 1, 0, 0] and st.accept == [1, 0, 0, 0] and st.last_verified == 10
    st.observe(4, 4, output_index=12, decay=1.0)
    assert st.reach == [2, 2, 1, 1] and st.accept == [2, 1, 1, 1]
    st.observe(0, 0, output_index=17, decay=0.5)  # a step without drafts changes nothing
    assert st.reach == [2, 2, 1, 1] and st.last_verified == 12
    st.observe(1, 0, output_index=17, decay=0.5)  # old counts decay before a verification is added
    assert st.reach == [2, 1, 0.5, 0.5] and st.accept == [1, 0.5, 0.5, 0.5] and st.last_verified == 17
    assert st.prior_weight == 0.5  # the prior decays like the counts (from 1.0)
    # Position i's prior is position i - 1's estimate.
    p = AcceptanceStats(2, prior_strength=2.0).conditional(0.6)
    assert p == pytest.approx([0.6, 0.6])
    st = AcceptanceStats(2, prior_strength=2.0)
    st.observe(2, 0, 0, 1.0)
    p = st.conditional(0.6)
    assert p[0] == pytest.approx(1.2 / 3) and p[1] == pytest.approx(p[0])  # position 1 never reached
    assert st.expected_accepted(2, 0.6) == pytest.approx(p[0] + p[0] * p[1])
    st = AcceptanceStats(2, prior_strength=1.0)
    for _ in range(200):
        st.observe(2, 0, 0, 0.5)
    assert st.conditional(0.6)[0] < 1e-9  # never accepted: no floor from the prior


def test_always_accepted_keeps_k_at_max():
    pol = SpeculationPolicy(K, LINEAR)
    ks = Request(pol).run_until(400, accepted_prefix=K)
    assert ks[0] >= K - 1 and all(k == K for k in ks[1:])  # the prior alone (p = 0.5) is nearly enough


def test_never_accepted_goes_to_zero_and_probes():
    """Every draft rejected: the plan falls to 0 within a few verifications, then probes with probe_k
    drafts after probe_min plans at 0, the interval doubling up to probe_max."""
    params = PolicyParams()
    pol = SpeculationPolicy(K, LINEAR, params)
    req = Request(pol)
    req.run_until(1200, accepted_prefix=0)
    ks = [k for _, k in req.ks]
    assert ks[0] >= K - 1 and 0 in ks[:16]  # optimistic start, then it learns
    first_zero = ks.index(0)
    late = ks[first_zero:]
    probes = [i for i, k in enumerate(late) if k > 0]
    assert all(late[i] == params.probe_k for i in probes)
    gaps = [b - a for a, b in zip([-1, *probes], probes, strict=False)]
    want = [params.probe_min]
    while len(want) < len(gaps):
        want.append(min(2 * want[-1], params.probe_max))
    assert gaps == want and gaps[-1] == params.probe_max


def test_probe_hint_replaces_the_floor():
    """With a probe hint (the proposer says whether it would draft: ngram's suffix match), a dear probe
    comes on the doubling schedule where the hint says yes (no floor: 8, 16, 32 ... plans apart), and
    never where it says no (the wait starts again, no doubling); the hint is asked only when a probe is
    due by the doubling schedule."""

    class Dear:
        def seconds(self, k: int, batch: int) -> float:
            return 1.0 + 0.5 * k

    for answer in (True, False):
        pol = SpeculationPolicy(K, Dear())
        asked = []
        pol.probe_hint = lambda a=answer, log=asked, p=pol: log.append(p.idle_steps) or a
        req = Request(pol)
        req.run_until(700, accepted_prefix=0)
        ks = [k for _, k in req.ks]
        late = ks[ks.index(0):]
        probes = [i for i, k in enumerate(late) if k > 0]
        if answer:
            gaps = [b - a for a, b in zip([-1, *probes], probes, strict=False)]
            assert gaps[:6] == [8, 16, 32, 64, 128, 128], gaps
        else:
            assert probes == [] and asked and set(asked) == {pol.params.probe_min}


def test_probe_hint_counts_the_requests_that_would_draft():
    """The hint is a count: at batch 64 under a cost where a step of k drafts costs 1 + 0.5 k plain steps,
    drafts for 10 requests could not pay even if all were accepted ((64 + 10 k) / (1 + 0.5 k) < 64 for every
    k), so no probe comes; for 48 requests they could (k = 4: 256 / 3 > 64 x 1.02), and probes come on the
    doubling schedule without the floor. At batch 1 one request is enough."""

    class Dear:
        def seconds(self, k: int, batch: int) -> float:
            return 1.0 + 0.5 * k

    def probes(count: int, batch: int) -> list[int]:
        pol = SpeculationPolicy(K, Dear())
        pol.probe_hint = lambda: count
        ids = [f"r{i}" for i in range(batch)]
        for rid in ids:  # every request's drafts rejected: the plan is 0 from here on
            for _ in range(30):
                pol.observe(rid, K, 1, 0)
        assert pol.plan(ids) == 0
        return [i for i in range(400) if pol.plan(ids) > 0]

    assert probes(10, 64) == [] and probes(0, 1) == []
    for count, batch in ((48, 64), (1, 1)):
        got = probes(count, batch)
        gaps = [b - a for a, b in zip(got, got[1:], strict=False)]  # plans from a probe to the next
        assert got[0] < 8 and gaps[:3] == [16, 32, 64], (count, batch, got)  # no floor (it would be 100)


def test_dear_probes_come_at_most_every_probe_floor():
    """A probe that costs half a plain step more (1 + 0.5 k): probes come no closer than 100 plans at 0
    (0.5 / (0.005 * 1.0)), so they add at most probe_budget (0.5%) to the time at k = 0; the doubling
    schedule takes over once it exceeds that (128 = probe_max). Where a probe is cheap (LINEAR: 0.02 more
    per draft, floor 4 < probe_min) the schedule is the doubling one (test above)."""

    class Dear:
        def seconds(self, k: int, batch: int) -> float:
            return 1.0 + 0.5 * k

    params = PolicyParams()
    pol = SpeculationPolicy(K, Dear(), params)
    assert pol.probe_floor(1) == 100 and SpeculationPolicy(K, LINEAR).probe_floor(1) == params.probe_min
    req = Request(pol)
    req.run_until(1200, accepted_prefix=0)
    ks = [k for _, k in req.ks]
    late = ks[ks.index(0):]
    probes = [i for i, k in enumerate(late) if k > 0]
    gaps = [b - a for a, b in zip([-1, *probes], probes, strict=False)]
    assert gaps[:5] == [100, 100, 100, 100, 128] and set(gaps[5:]) == {128}, gaps
    extra = sum(Dear().seconds(late[i], 1) - Dear().seconds(0, 1) for i in probes)
    assert extra <= params.probe_budget * Dear().seconds(0, 1) * (len(late) - len(probes))
    with pytest.raises(ValueError):
        PolicyParams(probe_budget=0.0)


def test_k_follows_acceptance_changes_mid_request():
    """Predictable text, then unpredictable, then predictable again: k goes K -> 0 (probes) -> K."""
    pol = SpeculationPolicy(K, LINEAR)
    req = Request(pol)
    req.run_until(200, accepted_prefix=K)
    assert req.ks[-1][1] == K
    req.run_until(400, accepted_prefix=0)
    first_zero = next(n for n, k in req.ks if n >= 200 and k == 0)
    assert first_zero - 200 <= 48  # within a few half-lives of the counts
    assert all(k <= 1 for n, k in req.ks if n >= 260 and n < 400)
    assert sum(k for n, k in req.ks if n >= 260 and n < 400) <= 5  # probes only, ever rarer
    req.run_until(600, accepted_prefix=K)
    back = next(n for n, k in req.ks if n >= 400 and k == K)
    assert back - 400 <= 2 * PolicyParams().probe_max  # a probe finds it, then drafts come back
    assert all(k == K for n, k in req.ks if n >= back)


def test_partial_acceptance_picks_a_middle_k_and_batch_lowers_it():
    """Position-dependent acceptance (0.9, then 0.3): a few drafts pay, all of them not; a bigger batch
    (each extra token costs more relative to the fixed part) never asks for more drafts."""
    pol = SpeculationPolicy(K, ModeledStepCost(target=LinearForward(1.0, 0.05)))
    st = pol.stats["r"] = AcceptanceStats(K, 0.0)
    st.reach, st.accept = [100.0, 90.0, 27.0, 8.0], [90.0, 27.0, 8.0, 2.4]
    ks = [pol.best_k(["r"], b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert ks[0] == 2 and ks[-1] == 0
    assert ks == sorted(ks, reverse=True)


def test_step_plan_weighs_every_request():
    """One k per step: the sum of the requests' expected tokens over the step cost. A request whose
    drafts always match and one whose drafts never do: alone, K and 0; together, the k that is best for
    the pair (worked out here by hand from the cost: 1 + 0.05 tokens per row)."""
    cost = ModeledStepCost(target=LinearForward(1.0, 0.05))
    pol = SpeculationPolicy(K, cost)
    good = pol.stats["good"] = AcceptanceStats(K, 0.0)
    bad = pol.stats["bad"] = AcceptanceStats(K, 0.0)
    good.reach, good.accept = [50.0] * K, [50.0] * K  # p = 1 at every position
    bad.reach, bad.accept = [50.0, 0.0, 0.0, 0.0], [0.0] * K  # p = 0
    assert pol.best_k(["good"], 2) == K and pol.best_k(["bad"], 2) == 0
    # Together at batch 2: tokens 1 + (1 + k) per step, cost 1 + 0.05 * 2 * (1 + k).
    rates = [(2 + k) / (1 + 0.1 * (1 + k)) for k in range(K + 1)]
    assert pol.best_k(["good", "bad"]) == max(range(K + 1), key=rates.__getitem__) == K
    assert pol.best_k(["bad", "good"]) == pol.best_k(["good", "bad"])  # order-free (exact sums)
    # Ten requests that never match outweigh one that always does.
    assert pol.best_k(["good"] + ["bad"] * 10) == 0


def test_plan_is_the_only_state_change_and_forget_waits_for_it():
    pol = SpeculationPolicy(K, LINEAR)
    Request(pol).run_until(100, accepted_prefix=0)
    a = [pol.best_k(["r"], b) for b in range(1, 50)]
    assert a == [pol.best_k(["r"], b) for b in range(1, 50)]  # best_k changes nothing
    idle, every = pol.idle_steps, pol.probe_every
    k = pol.plan(["r"])  # best_k is 0 (never accepted): the probe clock ticks, or a probe resets it
    if idle + 1 >= every:
        assert (k, pol.idle_steps, pol.probe_every) == (pol.params.probe_k, 0, min(2 * every, pol.params.probe_max))
    else:
        assert (k, pol.idle_steps, pol.probe_every) == (0, idle + 1, every)
    assert pol.plan([]) == 0  # nothing to plan: the probe clock stands still
    pol.forget("r")
    assert "r" in pol.stats  # kept for the next plan (the overlapped loop may still count it)
    pol.plan(["r"])
    assert "r" not in pol.stats


def test_expected_throughput_is_smooth_in_batch():
    """No cliffs: as the batch grows one request at a time, the policy's expected tokens per second per
    request moves by small steps (it switches k only where two k give nearly the same rate) and stays
    within min_gain of the best fixed k's (a continuous envelope)."""
    cost = ModeledStepCost(target=LinearForward(1.0, 0.01), overhead_per_seq=0.001)
    pol = SpeculationPolicy(K, cost)
    st = pol.stats["r"] = AcceptanceStats(K, 0.0)
    st.reach, st.accept = [50.0, 35.0, 21.0, 10.0], [35.0, 21.0, 10.0, 4.0]

    def rate(k: int, b: int) -> float:
        return (1 + st.expected_accepted(k, 0.5)) / cost.seconds(k, b)

    bs = range(1, 257)
    chosen = [rate(pol.best_k(["r"], b), b) for b in bs]
    best = [max(rate(k, b) for k in range(K + 1)) for b in bs]
    # Each fixed k's own curve moves by at most this from one batch size to the next:
    fixed = max(abs(rate(k, b + 1) - rate(k, b)) / rate(k, b) for k in range(K + 1) for b in bs)
    assert len({pol.best_k(["r"], b) for b in bs}) >= 3  # k really changes along the way
    assert all(abs(y - x) / x <= fixed + 2 * pol.params.min_gain for x, y in zip(chosen, chosen[1:], strict=False))
    assert all(c >= b / (1 + pol.params.min_gain) for c, b in zip(chosen, best, strict=True))
    assert pol.best_k(["r"], 1) > pol.best_k(["r"], 256)


def test_shape_table_pads_like_the_runner():
    times = {(1, 1): 1.0, (8, 1): 1.4, (32, 1): 2.0, (1, 5): 1.1, (8, 5): 2.0, (32, 5): 5.0}
    t = ShapeTable(times, graph_batches=(1, 2, 4, 8, 16, 32), query_lens=(1, 5))
    assert t(1, 1) == 1.0 and t(8, 8) == 1.4
    assert t(3, 3) == pytest.approx(1.0 + 0.4 * 3 / 7)  # batch 3 runs the batch-4 graph: between 1 and 8
    assert t(10, 5) == pytest.approx(t(20, 5))  # 2 queries per row pad to 5
    assert t(9 * 5, 9) == pytest.approx(2.0 + 3.0 * 8 / 24)  # batch 9 -> 16, between 8 and 32
    lin = t.linear()  # eager beyond the graphs: a line through 1 token and the largest shape
    assert lin(1, 1) == pytest.approx(1.0) and lin(160, 32) == pytest.approx(5.0)
    assert t(64, 64) == pytest.approx(lin(64, 64)) and t(7 * 3, 3) == pytest.approx(lin(21, 3))
    with pytest.raises(ValueError):
        ShapeTable({(1, 1): 1.0}, (1,), (1, 5))
    # Query lengths 1..5 captured, 1, 2 and 5 measured: 3 and 4 lie on the line between 2 and 5.
    times = {(1, 1): 1.0, (1, 2): 1.2, (1, 5): 1.8, (4, 1): 2.0, (4, 2): 2.4, (4, 5): 3.0}
    t = ShapeTable(times, graph_batches=(1, 2, 4), query_lens=(1, 2, 3, 4, 5))
    assert t(3, 1) == pytest.approx(1.2 + 0.6 / 3) and t(4, 1) == pytest.approx(1.2 + 1.2 / 3)
    # Batch 2 lies a third of the way from 1 to 4: q 2 -> 1.6, q 5 -> 2.2; q 4 is two thirds from 2 to 5.
    assert t(2 * 4, 2) == pytest.approx(1.6 + (2.2 - 1.6) * 2 / 3)


def test_modeled_step_cost_by_drafter_kind():
    fwd = LinearForward(1.0, 0.1)
    host = ModeledStepCost(target=fwd, drafter_kind=HOST, host_per_request=0.01, overhead=0.5, overhead_per_seq=0.1)
    assert host.seconds(0, 2) == pytest.approx(1.2)  # no drafts: the host work hides behind the device's
    assert host.seconds(3, 2) == pytest.approx(0.5 + 0.2 + 0.02 + 1.8)
    ar = ModeledStepCost(target=fwd, drafter_kind=AUTOREGRESSIVE, drafter_forward=ScaledForward(fwd, 0.5), catch_up=5)
    assert ar.drafter(0, 2) == 0.0
    assert ar.drafter(1, 2) == pytest.approx(0.5 * 2.0)  # catch-up over 5 tokens per request
    assert ar.drafter(3, 2) == pytest.approx(0.5 * (2.0 + 2 * 1.2))
    ar_host = ModeledStepCost(target=fwd, drafter_kind=AUTOREGRESSIVE, drafter_forward=ScaledForward(fwd, 0.5),
                              catch_up=5, drafter_host=0.03, drafter_host_per_seq=0.01)
    assert ar_host.drafter(3, 2) == pytest.approx(0.5 * (2.0 + 2 * 1.2) + 3 * (0.03 + 0.02))  # 3 forwards
    blk = ModeledStepCost(target=fwd, drafter_kind=BLOCK, drafter_forward=fwd, catch_up=16, drafter_host=0.1)
    assert blk.drafter(1, 1) == blk.drafter(15, 1) == pytest.approx(2.6 + 0.1)
    with pytest.raises(ValueError):
        ModeledStepCost(target=fwd, drafter_kind=BLOCK)
    with pytest.raises(ValueError):
        PolicyParams(probe_min=0)


def test_plain_step_costs_the_slower_of_host_and_device():
    """The overlapped loop hides a plain step's host work behind the forward until the host is the slower:
    seconds(0, b) = max(target, loop_host_per_seq * b). A step with drafts pays its host work on top, and
    loop_host_per_seq plays no part in it (overhead_per_seq is all the host work of such a step)."""
    fwd = LinearForward(1.0, 0.01)  # batch 10: 1.1; batch 40: 1.4
    cost = ModeledStepCost(target=fwd, overhead=0.2, overhead_per_seq=0.05, loop_host_per_seq=0.04)
    assert cost.seconds(0, 10) == pytest.approx(1.1)  # device-bound: 0.4 of host work hidden
    assert cost.seconds(0, 40) == pytest.approx(1.6)  # host-bound: 40 * 0.04 > 1.4
    assert cost.seconds(2, 40) == pytest.approx(0.2 + 40 * 0.05 + 1.0 + 0.01 * 120)
    assert cost.seconds(2, 40) == ModeledStepCost(target=fwd, overhead=0.2, overhead_per_seq=0.05).seconds(2, 40)


def test_dearer_drafting_host_work_turns_the_batch_plan_to_plain():
    """The policy follows the cost: a request accepting ~half of its drafts drafts at batch 16 while a step
    with drafts costs 0.55 ms + 25 us per sequence of host work on top of a forward (the old H200 figure),
    and not once the host work is the measured 70 us per sequence (session 16's traces); at batch 1 it
    drafts under both (a sequence's host work is small beside the step's fixed part)."""
    fwd = LinearForward(1.0e-3, 4e-6)  # ~1 ms a forward, ~4 us per token
    old = ModeledStepCost(target=fwd, overhead=0.55e-3, overhead_per_seq=25e-6)
    new = ModeledStepCost(target=fwd, overhead=0.55e-3, overhead_per_seq=70e-6, loop_host_per_seq=40e-6)
    plans = {}
    for name, cost in (("old", old), ("new", new)):
        pol = SpeculationPolicy(K, cost)
        ids = [f"r{i}" for i in range(16)]
        for rid in ids:
            st = pol.stats[rid] = AcceptanceStats(K, 0.0)
            st.reach, st.accept = [50.0, 35.0, 24.0, 16.0], [35.0, 24.0, 16.0, 10.0]  # p ~ 0.7, 0.69, 0.67, 0.63
        plans[name] = (pol.best_k(ids, 16), pol.best_k(ids[:1], 1))
    assert plans["old"][0] > 0 and plans["new"][0] == 0
    assert plans["old"][1] > 0 and plans["new"][1] > 0


def test_no_probes_where_no_draft_could_pay():
    """A cost under which even always-accepted drafts lose (each draft costs more than a plain step):
    the plan stays at 0 and never probes; where they could pay, it probes."""

    class Dear:
        def seconds(self, k: int, batch: int) -> float:
            return 1.0 + (1.5 * k if batch > 8 else 0.1 * k)

    pol = SpeculationPolicy(K, Dear())
    assert not pol.could_pay(16) and pol.could_pay(4)
    st = pol.stats["r"] = AcceptanceStats(K, 0.0)
    st.reach, st.accept = [50.0, 0.0, 0.0, 0.0], [0.0] * K  # never accepted: best_k is 0 at any batch
    assert all(pol.plan(["r"], 16) == 0 for _ in range(1000))
    assert any(pol.plan(["r"], 4) > 0 for _ in range(1000))


def test_plan_skips_the_expectations_where_no_draft_could_pay():
    """Where no k could pay even if every draft were accepted, plan() decides k = 0 without reading a
    request's expectations (host time every step of a large batch); where one could, it reads them. And
    the shortcut changes no decision: over random acceptance states and batch sizes, plan's k with the
    probes off equals best_k's."""
    import random

    class Dear:
        def seconds(self, k: int, batch: int) -> float:
            return 1.0 + (1.5 * k if batch > 8 else 0.1 * k)

    reads: list[str] = []
    pol = SpeculationPolicy(K, Dear(), PolicyParams(probe_min=10**9, probe_max=10**9))
    real = pol.expected_tokens
    pol.expected_tokens = lambda rid: reads.append(rid) or real(rid)  # type: ignore[method-assign]
    assert pol.plan(["a", "b"], 16) == 0 and reads == []
    pol.plan(["a", "b"], 4)
    assert reads == ["a", "b"]

    rng = random.Random(3)
    pol = SpeculationPolicy(K, Dear(), PolicyParams(probe_min=10**9, probe_max=10**9))
    for trial in range(300):
        ids = [f"t{trial}-{i}" for i in range(rng.randint(1, 12))]
        for rid in ids:
            st = pol.stats[rid] = AcceptanceStats(K, 0.0)
            st.reach = [float(rng.randint(1, 40)) for _ in range(K)]
            st.accept = [rng.random() * r for r in st.reach]
        batch = rng.choice([1, 2, 4, 8, 9, 16, 64])
        assert pol.plan(ids, batch) == pol.best_k(ids, batch)


# Accepted prefixes of a DFlash-like drafter, one per verification, cycled: conditional acceptance
# 12/20 = 0.6 at position 0, then 5/12, 3/5, 1/3 (it falls with the position).
FALLING = [0] * 8 + [1] * 7 + [2] * 2 + [3] * 2 + [4]


def _serve(pol: SpeculationPolicy, cost, num_requests: int, n_out: int) -> float:
    """Requests one after another (batch 1), each verifying the planned k against FALLING: tokens per
    unit of modeled step time over the whole run."""
    tokens = seconds = 0.0
    j = 0
    for r in range(num_requests):
        req = Request(pol, f"r{r}")
        while req.n < n_out:
            n0 = req.n
            k = req.step(FALLING[j % len(FALLING)])
            j += 1
            tokens += req.n - n0
            seconds += cost.seconds(k, 1)
        pol.forget(req.rid)
    return tokens / seconds


def test_population_prior_learns_the_drafters_curve():
    """A fresh request's estimate of an unreached position is the population's acceptance there (with
    many verifications: the measured conditional rates within 0.02), not the estimate one position
    before; without the population prior it is the fixed prior mean."""
    pol = SpeculationPolicy(K, LINEAR)
    for i in range(2000):
        pol.observe("old", K, FALLING[i % len(FALLING)] + 1, i)
    fresh = pol.stats.get("new") or pol._fresh
    got = fresh.conditional(pol.params.prior_mean, pol.population.means(pol.params.prior_mean))
    assert got == pytest.approx([12 / 20, 5 / 12, 3 / 5, 1 / 3], abs=0.02)
    t = pol.expected_tokens("new")
    assert t[K] == pytest.approx(1 + (12 + 5 + 3 + 1) / 20, abs=0.03)
    off = SpeculationPolicy(K, LINEAR, PolicyParams(population_prior=False))
    for i in range(2000):
        off.observe("old", K, FALLING[i % len(FALLING)] + 1, i)
    assert off.population is None and off._fresh.conditional(0.5) == [0.5] * K


def test_population_prior_drafts_less_deep_where_acceptance_falls():
    """Drafts that cost 0.3 of a step each (a step of k drafts: 1 + 0.3 * (1 + k)): with FALLING the best
    fixed k is 1 (1.6 tokens per 1.6 against 1.85 per 1.9 at k = 2). The request-only chain assumes
    position 0's 0.6 all the way down and drafts deeper; the population prior knows the curve, and the
    run's tokens per second is higher."""
    cost = ModeledStepCost(target=LinearForward(1.0, 0.3))
    with_pop = _serve(SpeculationPolicy(K, cost), cost, 40, 120)
    chain = _serve(SpeculationPolicy(K, cost, PolicyParams(population_prior=False)), cost, 40, 120)
    assert with_pop >= 1.05 * chain  # 0.95 against 0.88 (the best fixed k: 1.0; the bursty pattern
    assert with_pop >= 0.93  # of FALLING sends both to k = 0 for stretches)


def test_population_survives_an_idle_engine_until_reset():
    """reset_clock (a request at an idle engine) keeps the population counts, so a server learns the
    drafter's curve across requests; reset_population (the bench, before each run) forgets them."""
    pol = SpeculationPolicy(K, LINEAR)
    pol.observe("a", K, 2, 0)  # 4 drafts, the first accepted
    pol.reset_clock()
    assert pol.population.reach == [1, 1, 0, 0] and pol.population.accept == [1, 0, 0, 0]
    pol.reset_population()
    assert pol.population.reach == [0] * K and pol.population.accept == [0] * K
