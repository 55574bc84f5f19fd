"""Draft verification: greedy acceptance and rejection sampling (Leviathan et al., 2023).

Pure functions over one request's rows. For k drafts the target gives k+1 distributions p_0..p_k
(p_j for the token after draft j-1). Draft j is accepted with probability min(1, p_j(d)/q_j(d));
on the first rejection the replacement comes from normalize(max(p_j - q_j, 0)); if every draft is
accepted a bonus token is drawn from p_k. A draft without probabilities is a point mass
q_j = onehot(d_j). Output: the accepted drafts plus one final token, so 1..k+1 tokens.
"""

from __future__ import annotations

import torch


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """Accept drafts while they equal the target's argmax; then the target's own token."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        if target_argmax[j] != d:
            out.append(target_argmax[j])
            return out
        out.append(d)
    out.append(target_argmax[len(drafts)])
    return out


def rejection_sample(
    p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched core of rejection sampling (pure; randomness passed in).

    p: [R, k+1, V] target probabilities; drafts: [R, k] long; q: [R, k, V] draft probabilities or
    None (point-mass drafts); u: [R, k] uniforms. Returns (num_accepted [R], dist [R, V]): the
    distribution the final token is drawn from (the residual at the first rejection, or p_k).
    """
    rows, k1, _ = p.shape
    k = k1 - 1
    idx = torch.arange(rows, device=p.device)
    if k:
        valid = drafts >= 0  # a negative id (a placeholder that leaked) is never accepted
        drafts = drafts.clamp_min(0)
        p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0] * valid
        q_d = q.gather(-1, drafts[..., None])[..., 0] if q is not None else torch.ones_like(p_d)
        ratio = torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), torch.zeros_like(p_d))
        num_accepted = (u < ratio).long().cumprod(-1).sum(-1)
    else:
        num_accepted = torch.zeros(rows, dtype=torch.long, device=p.device)
    p_j = p[idx, num_accepted]
    if k:
        j = num_accepted.clamp(max=k - 1)
        if q is not None:
            q_j = q[idx, j]
        else:
            q_j = torch.zeros_like(p_j).scatter_(-1, drafts[idx, j][:, None], 1.0)
        resid = torch.where((num_accepted < k)[:, None], (p_j - q_j).clamp_min(0.0), p_j)
    else:
        resid = p_j
    total = resid.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass (the draft is then always accepted); fall back to p.
    dist = torch.where(total > 0, resid / total.clamp_min(1e-30), p_j)
    return num_accepted, dist


def verify_random(
    p: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """Rejection sampling for one request. p: [k+1, V] target probabilities (after temperature /
    top-k / top-p / min-p); q: [k, V] draft probabilities or None for point-mass drafts.
    Randomness comes from the request's generator in a fixed order: k uniforms, then one
    categorical draw, so a request's tokens do not depend on the rest of the batch."""
    k = len(drafts)
    dev = p.device
    u = torch.rand(1, k, generator=generator, device=dev)
    d = torch.tensor([drafts], dtype=torch.long, device=dev)
    num_accepted, dist = rejection_sample(p[None], d, None if q is None else q[None, :k], u)
    a = int(num_accepted[0])
    last = int(torch.multinomial(dist[0], 1, generator=generator)[0])
    return drafts[:a] + [last]
