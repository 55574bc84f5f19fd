"""Statistical tests: rejection sampling emits tokens from the target distribution whatever the
draft distribution, and top-k / top-p / min-p sample from the right truncated distributions.

Bound: with N samples over V categories the expected total-variation distance between the
empirical and true distributions is about 0.5 * sum_i sqrt(2 p_i / (pi N)) <= 0.4 * sqrt(V / N)
(0.0036 for V = 8, N = 100k), and its standard deviation is smaller still. We assert TV < 0.012,
over 3x the expectation; the bugs this guards against (sampling the residual wrongly, skipping
the bonus, ignoring top-k) move TV by 0.05 or more.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.worker.sampler import RowParams, probs_from_logits
from verispec.worker.verifier import rejection_sample, verify_greedy, verify_random

N = 100_000
V = 8
TV_BOUND = 0.012


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def run(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, seed: int = 0):
    """Emitted tokens for N independent verifications of the same target rows (batched core of
    verify_random, with the same arithmetic). drafts: [N, k]."""
    g = torch.Generator().manual_seed(seed)
    n, k = drafts.shape
    u = torch.rand(n, k, generator=g)
    qb = None if q is None else q[None].expand(n, -1, -1)
    num_acc, dist = rejection_sample(p[None].expand(n, -1, -1), drafts, qb, u)
    last = torch.multinomial(dist, 1, generator=g)[:, 0]
    first = torch.where(num_acc > 0, drafts[:, 0], last)
    second_ok = num_acc >= 1
    second = torch.where(num_acc > 1, drafts[:, min(1, k - 1)], last)
    firsts = np.bincount(first.numpy(), minlength=V).astype(float)
    seconds = np.bincount(second[second_ok].numpy(), minlength=V).astype(float)
    return firsts, seconds, (num_acc + 1).numpy()


def sample_drafts(q: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(q.shape[0])], 1)


def rand_dist(g: torch.Generator, zeros: list[int] = ()) -> torch.Tensor:
    x = torch.rand(V, generator=g) + 0.05
    x[list(zeros)] = 0.0
    return x / x.sum()


def test_rejection_sampling_follows_target_with_mismatched_draft():
    g = torch.Generator().manual_seed(1)
    p = torch.stack([rand_dist(g, zeros=[0, 1]), rand_dist(g, zeros=[2]), rand_dist(g)])  # k = 2
    q = torch.stack([rand_dist(g, zeros=[5]), rand_dist(g)])  # q puts mass on 0, 1 where p_0 has none
    firsts, seconds, lengths = run(p, sample_drafts(q, 0), q)
    assert tv(firsts, p[0].numpy()) < TV_BOUND
    assert firsts[0] == 0 and firsts[1] == 0  # never emits where the target has no mass
    assert tv(seconds, p[1].numpy()) < TV_BOUND
    assert lengths.min() >= 1 and lengths.max() == 3


def test_bonus_token_when_all_accepted():
    g = torch.Generator().manual_seed(2)
    p = torch.stack([rand_dist(g), rand_dist(g), rand_dist(g)])
    q = p[:2].clone()  # identical draft: always accepted, so the bonus comes from p_2
    drafts = sample_drafts(q, 1)
    g2 = torch.Generator().manual_seed(5)
    num_acc, dist = rejection_sample(p[None].expand(N, -1, -1), drafts, q[None].expand(N, -1, -1), torch.rand(N, 2, generator=g2))
    assert bool((num_acc == 2).all())
    bonus = np.bincount(torch.multinomial(dist, 1, generator=g2)[:, 0].numpy(), minlength=V).astype(float)
    assert tv(bonus, p[2].numpy()) < TV_BOUND
    # The per-request wrapper agrees with the batched core.
    gen = torch.Generator().manual_seed(0)
    for i in range(200):
        out = verify_random(p, drafts[i].tolist(), q, gen)
        assert out[:2] == drafts[i].tolist() and len(out) == 3


def test_point_mass_drafts_and_top_k_top_p_targets():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=g) * 2
    params = RowParams(
        temperature=torch.tensor([0.7, 1.3]), top_k=torch.tensor([5, V]), top_p=torch.tensor([1.0, 0.8]),
        min_p=torch.tensor([0.0, 0.0]), need_sort=True, need_min_p=False,
    )
    p = probs_from_logits(logits, params)
    assert int((p[0] > 0).sum()) == 5
    # A fixed (point-mass) draft that the top-k filter removed must never be emitted.
    banned = int(p[0].argmin())
    firsts, seconds, _ = run(p, torch.full((N, 1), banned), None)
    assert firsts[banned] == 0
    assert tv(firsts, p[0].numpy()) < TV_BOUND
    likely = int(p[0].argmax())
    firsts, seconds, _ = run(p, torch.full((N, 1), likely), None, seed=1)
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
    g = torch.Generator().manual_seed(4)
    cases = [(0.8, 3, 1.0, 0.0), (1.0, V, 0.6, 0.0), (1.2, V, 1.0, 0.3), (0.9, 6, 0.9, 0.1)]
    for temp, k, tp, mp in cases:
        logits = torch.randn(1, V, generator=g) * 1.5
        rp = RowParams(
            temperature=torch.tensor([temp]), top_k=torch.tensor([k]), top_p=torch.tensor([tp]),
            min_p=torch.tensor([mp]), need_sort=True, need_min_p=mp > 0,
        )
        probs = probs_from_logits(logits, rp)[0]
        want = expected_truncated(logits[0].double().numpy(), temp, k, tp, mp)
        np.testing.assert_allclose(probs.double().numpy(), want, atol=1e-6)
        draws = torch.multinomial(probs, N, replacement=True, generator=torch.Generator().manual_seed(0))
        counts = np.bincount(draws.numpy(), minlength=V).astype(float)
        assert counts[want == 0].sum() == 0
        assert tv(counts, want) < TV_BOUND


def test_verify_greedy_cases():
    assert verify_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert verify_greedy([5, 9, 7], [5, 6]) == [5, 9]
    assert verify_greedy([4, 9, 7], [5, 6]) == [4]
    assert verify_greedy([3], []) == [3]
