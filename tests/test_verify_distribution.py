"""Statistical tests of the verifier the runner uses (worker/verifier.Verifier, driven through
Verifier.run exactly as ModelRunner does): rejection sampling emits tokens from the target
distribution whatever the draft distribution, a draft identical to the target is always accepted
with the bonus token drawn from the last row, and top-k / top-p / min-p sample from the right
truncated distributions.

Each test runs N requests through one Verifier.run call: N independent verifications of the same
target rows. The verifier's per-request generators are swapped for one stream (OneStream), so
the N requests draw one after another from a single generator instead of holding N generator
states; every other step (penalties pass, row parameters, filters, acceptance, residual, the
final draw, the packed result) is the engine's code.

Bound: with N samples over V categories the expected total-variation distance between the
empirical and true distributions is about 0.5 * sum_i sqrt(2 p_i / (pi N)) <= 0.4 * sqrt(V / N)
(0.0051 for V = 8, N = 50k), and its standard deviation is smaller still. We assert TV < 0.012,
over 2x the expectation; the bugs this guards against (sampling the residual wrongly, skipping
the bonus, ignoring top-k) move TV by 0.05 or more.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec import SamplingParams
from verispec.core.placeholder import PLACEHOLDER
from verispec.core.request import Request
from verispec.core.scheduler_output import ScheduledRequest
from verispec.worker.batch import SENTINEL_ID, row_index
from verispec.worker.sampler import RowParams, probs_from_logits, row_params, sample_by_key
from verispec.worker.sampling_keys import key32
from verispec.worker.verifier import AuditSources, Verifier, verify_greedy

N = 50_000  # (100k took ~77 s of the default suite for 0.0036 instead of 0.0051 expected TV)
V = 8
TV_BOUND = 0.012
CPU = torch.device("cpu")
PLAIN = SamplingParams(temperature=1.0, max_tokens=None)  # no filter: the target is softmax(logits)


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


class OneStream:
    """Stands in for Verifier.generators (sampling_keys.RequestGenerators): every sampling event
    draws from the same generator, in the order the verifier asks."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def at(self, req, index: int) -> torch.Generator:
        return self.g

    def free(self, request_id: str) -> None:
        pass


def rows_of(n: int, k: list[int] | int, params: SamplingParams) -> list[tuple[ScheduledRequest, int]]:
    """n requests (one known token, then k drafts each) and their first logit rows, as
    batch.build_host_batch lays out a verify step."""
    ks = [k] * n if isinstance(k, int) else k
    sampling, r0 = [], 0
    for i, ki in enumerate(ks):
        req = Request(f"r{i}", [0], params)
        sampling.append((ScheduledRequest(req, 0, ki + 1, ki), r0))
        r0 += ki + 1
    return sampling


def verify(verifier: Verifier, logits: torch.Tensor, sampling, drafts: torch.Tensor | None,
           q: torch.Tensor | None = None, audit: AuditSources | None = None):
    """Verifier.run as the runner calls it: (tokens [S, W] with PLACEHOLDER past each count,
    counts [S], the verdict)."""
    kmax = 0 if drafts is None else drafts.shape[1]
    row_idx = torch.tensor(row_index(sampling, kmax)) if kmax else None
    probs = {s.request.request_id: q for s, _ in sampling} if q is not None else {}
    verdict = verifier.run(logits, sampling, drafts, row_idx, probs, audit)
    s, w = len(sampling), verdict.width
    return verdict.packed[: s * w].view(s, w), verdict.packed[s * w :], verdict


def run(target_logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, params: SamplingParams = PLAIN,
        seed: int = 0):
    """N verifications of the same target rows [k+1, V] against drafts [N, k] (q: [k, V] or None
    for point-mass drafts). Returns the counts of the first and second emitted tokens and the
    number of tokens each verification emitted."""
    n, k = drafts.shape
    verifier = Verifier(CPU)
    verifier.generators = OneStream(seed)
    logits = target_logits[None].expand(n, -1, -1).reshape(n * (k + 1), V).clone()
    tokens, counts, _ = verify(verifier, logits, rows_of(n, k, params), drafts, q)
    assert bool((counts >= 1).all()) and bool((tokens[:, 0] >= 0).all())
    second_ok = counts >= 2  # a second token exists when the first draft was accepted
    firsts = np.bincount(tokens[:, 0].numpy(), minlength=V).astype(float)
    seconds = np.bincount(tokens[second_ok, 1].numpy(), minlength=V).astype(float)
    return firsts, seconds, counts.numpy()


def sample_drafts(q: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(q.shape[0])], 1)


def rand_dist(g: torch.Generator, zeros: list[int] = ()) -> torch.Tensor:
    x = torch.rand(V, generator=g) + 0.05
    x[list(zeros)] = 0.0
    return x / x.sum()


def target(logits: torch.Tensor, params: SamplingParams = PLAIN) -> torch.Tensor:
    """The distributions the verifier's rows stand for (the sampler's filters, tested below)."""
    return probs_from_logits(logits, row_params([params], [logits.shape[0]], V, CPU))


def test_rejection_sampling_follows_target_with_mismatched_draft():
    g = torch.Generator().manual_seed(1)
    p = torch.stack([rand_dist(g, zeros=[0, 1]), rand_dist(g, zeros=[2]), rand_dist(g)])  # k = 2
    q = torch.stack([rand_dist(g, zeros=[5]), rand_dist(g)])  # q puts mass on 0, 1 where p_0 has none
    firsts, seconds, lengths = run(p.log(), sample_drafts(q, 0), q)
    assert tv(firsts, p[0].numpy()) < TV_BOUND
    assert firsts[0] == 0 and firsts[1] == 0  # never emits where the target has no mass
    assert tv(seconds, p[1].numpy()) < TV_BOUND
    assert lengths.min() >= 1 and lengths.max() == 3


def test_bonus_token_when_all_accepted():
    g = torch.Generator().manual_seed(2)
    logits = torch.stack([rand_dist(g), rand_dist(g), rand_dist(g)]).log()
    p = target(logits)
    q = p[:2].clone()  # the draft is the target itself (the self oracle): always accepted
    drafts = sample_drafts(q, 1)
    verifier = Verifier(CPU)
    verifier.generators = OneStream(5)
    tokens, counts, _ = verify(verifier, logits[None].expand(N, -1, -1).reshape(-1, V).clone(), rows_of(N, 2, PLAIN),
                               drafts, q)
    assert bool((counts == 3).all()) and torch.equal(tokens[:, :2], drafts)
    bonus = np.bincount(tokens[:, 2].numpy(), minlength=V).astype(float)
    assert tv(bonus, p[2].numpy()) < TV_BOUND


def test_point_mass_drafts_and_top_k_top_p_targets():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=g) * 2
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.95, max_tokens=None)
    p = target(logits, params)
    for j in range(2):
        np.testing.assert_allclose(p[j].double().numpy(), expected_truncated(logits[j].double().numpy(), 0.7, 5, 0.95, 0.0),
                                   atol=1e-6)
    assert 0 < int((p[0] > 0).sum()) <= 5
    # A fixed (point-mass) draft that the filters removed must never be emitted.
    banned = int(p[0].argmin())
    assert p[0, banned] == 0
    firsts, seconds, _ = run(logits, torch.full((N, 1), banned), None, params)
    assert firsts[banned] == 0
    assert tv(firsts, p[0].numpy()) < TV_BOUND
    likely = int(p[0].argmax())
    firsts, seconds, _ = run(logits, torch.full((N, 1), likely), None, params, seed=1)
    assert tv(firsts, p[0].numpy()) < TV_BOUND
    assert tv(seconds, p[1].numpy()) < TV_BOUND


def expected_truncated(logits: np.ndarray, temp: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Independent numpy version of the filters (float64)."""
    z = logits / temp
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    cum = 0.0
    for rank, i in enumerate(order):
        if rank >= top_k or cum >= top_p:
            break
        keep[i] = True
        cum += p[i]
    keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def test_sampler_filters_statistically():
    """Plain sampling (no drafts) through the verifier: each filter combination, N requests."""
    g = torch.Generator().manual_seed(4)
    cases = [(0.8, 3, 1.0, 0.0), (1.0, V, 0.6, 0.0), (1.2, V, 1.0, 0.3), (0.9, 6, 0.9, 0.1)]
    for seed, (temp, k, tp, mp) in enumerate(cases):
        logits = torch.randn(1, V, generator=g) * 1.5
        rp = RowParams(
            temperature=torch.tensor([temp]), top_k=torch.tensor([k]), top_p=torch.tensor([tp]),
            min_p=torch.tensor([mp]), need_sort=True, need_min_p=mp > 0,
        )
        want = expected_truncated(logits[0].double().numpy(), temp, k, tp, mp)
        np.testing.assert_allclose(probs_from_logits(logits, rp)[0].double().numpy(), want, atol=1e-6)
        params = SamplingParams(temperature=temp, top_k=k if k < V else -1, top_p=tp, min_p=mp, max_tokens=None)
        np.testing.assert_allclose(target(logits, params)[0].double().numpy(), want, atol=1e-6)
        verifier = Verifier(CPU)
        verifier.generators = OneStream(seed)
        tokens, counts, _ = verify(verifier, logits.expand(N, -1).clone(), rows_of(N, 0, params), None)
        assert tokens.shape == (N, 1) and bool((counts == 1).all())
        drawn = np.bincount(tokens[:, 0].numpy(), minlength=V).astype(float)
        assert drawn[want == 0].sum() == 0
        assert tv(drawn, want) < TV_BOUND


def test_verify_greedy_cases():
    assert verify_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert verify_greedy([5, 9, 7], [5, 6]) == [5, 9]
    assert verify_greedy([4, 9, 7], [5, 6]) == [4]
    assert verify_greedy([3], []) == [3]


def test_greedy_verification_through_the_verifier():
    """The same cases as greedy requests of one step (mixed draft counts: the last has none, its
    draft row padded with the sentinel id), read from the packed result."""
    argmaxes = [[5, 6, 7], [5, 9, 7], [4, 9, 7], [3]]
    drafts = torch.tensor([[5, 6], [5, 6], [5, 6], [SENTINEL_ID, SENTINEL_ID]])
    logits = torch.nn.functional.one_hot(torch.tensor([t for row in argmaxes for t in row]), 10).float()
    sampling = rows_of(4, [2, 2, 2, 0], SamplingParams(temperature=0.0))
    tokens, counts, _ = verify(Verifier(CPU), logits, sampling, drafts)
    P = PLACEHOLDER
    assert tokens.tolist() == [[5, 6, 7], [5, 9, P], [4, P, P], [3, P, P]]
    assert counts.tolist() == [3, 2, 1, 1]


def test_audit_agrees_with_the_device_path():
    """The audit's host re-verification (verify_greedy / verify_random with each request's real
    generator, re-seeded) gives the tokens the device path emitted: 0 mismatches over greedy and
    sampled requests with mismatched sampled drafts."""
    g = torch.Generator().manual_seed(6)
    n, k = 200, 2
    q = torch.stack([rand_dist(g), rand_dist(g)])
    drafts = sample_drafts(q, 2)[:n]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1), PLAIN]
    sampling = []
    for i in range(n):
        req = Request(f"r{i}", [i % V], params[i % 3], spec_token_ids=drafts[i].tolist())
        sampling.append((ScheduledRequest(req, 0, k + 1, k), i * (k + 1)))
    logits = torch.randn(n * (k + 1), V, generator=g)
    input_ids = torch.tensor([t for s, _ in sampling for t in [s.request.prompt_token_ids[0], *s.request.spec_token_ids]])
    verifier = Verifier(CPU, seed=3, audit_rate=1.0)
    tokens, counts, verdict = verify(verifier, logits, sampling, drafts, q,
                                     AuditSources(input_ids, {s.request.request_id: r for s, r in sampling}, None))
    sampled = {s.request.request_id: tokens[i, : counts[i]].tolist() for i, (s, _) in enumerate(sampling)}
    result = verifier.check_audit(verdict.audit, sampled)
    assert (result.audited, result.mismatches) == (n, 0)
    assert result.accepted == {rid: len(t) - 1 for rid, t in sampled.items()}
    assert 0 < sum(result.accepted.values()) < n * k  # some drafts accepted, some rejected


def test_exponential_race_follows_the_distribution():
    """sample_by_key over 100,000 keys (one row each): the draws follow p, and a zero-probability token is
    never drawn; one key always gives the same token."""
    p = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0, 0.0])
    keys = torch.tensor([key32(k) for k in range(N)])
    drawn = sample_by_key(p.expand(N, -1), keys)
    counts = np.bincount(drawn.numpy(), minlength=V).astype(float)
    assert counts[p.numpy() == 0].sum() == 0
    assert tv(counts, p.numpy()) < TV_BOUND
    assert torch.equal(sample_by_key(p.expand(N, -1), keys), drawn)


def test_key32_is_uniform():
    """key32 over consecutive keys: 32-bit values whose top bits fill 16 bins evenly."""
    k = np.array([key32(i) for i in range(100_000)])
    assert k.min() >= 0 and k.max() < 2**32
    hist = np.bincount(k >> 28, minlength=16)
    assert np.abs(hist - 6250).max() < 400  # ~5 sigma of a binomial(100k, 1/16)


def test_undrafted_sampled_rows_do_not_depend_on_the_batch():
    """A seeded request's sampled token is the same alone, among other requests in any order, and beside
    drafted rows (the undrafted rows are drawn together, each from its own key)."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, V, generator=g)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=None) for i in range(6)]

    def draw(order: list[int], k_of: dict[int, int]) -> dict[int, int]:
        sampling, rows, r0 = [], [], 0
        for i in order:
            k = k_of.get(i, 0)
            sampling.append((ScheduledRequest(Request(f"q{i}", [0], params[i]), 0, k + 1, k), r0))
            rows += [logits[i]] * (k + 1)
            r0 += k + 1
        kmax = max(k_of.values(), default=0)
        drafts = torch.full((len(order), kmax), 1, dtype=torch.long) if kmax else None
        tokens, _, _ = verify(Verifier(CPU, seed=3), torch.stack(rows).clone(), sampling, drafts)
        return {i: int(tokens[j, 0]) for j, i in enumerate(order) if not k_of.get(i)}

    alone = {i: draw([i], {})[i] for i in range(6)}
    assert draw([5, 3, 1, 0, 2, 4], {}) == alone
    mixed = draw([0, 1, 2, 3, 4, 5], {1: 2, 4: 3})
    assert mixed == {i: alone[i] for i in (0, 2, 3, 5)}
    assert len(set(alone.values())) > 1  # the seeds give different draws, not one constant
