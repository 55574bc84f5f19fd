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


def verify_random(
    p: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """Rejection sampling. p: [k+1, V] target probabilities (after temperature/top-k/top-p/min-p);
    q: [k, V] draft probabilities or None for point-mass drafts. Randomness comes from the
    request's generator in a fixed order: k uniforms, then one categorical draw."""
    k = len(drafts)
    dev = p.device
    u = torch.rand(k, generator=generator, device=dev) if k else None
    d = torch.tensor(drafts, dtype=torch.long, device=dev)
    if k:
        p_d = p[:k].gather(-1, d[:, None])[:, 0]
        q_d = q[:k].gather(-1, d[:, None])[:, 0] if q is not None else torch.ones_like(p_d)
        ratio = torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), torch.zeros_like(p_d))
        ok = (u < ratio).tolist()
    else:
        ok = []
    num_accepted = 0
    while num_accepted < k and ok[num_accepted]:
        num_accepted += 1
    if num_accepted < k:
        j = num_accepted
        if q is not None:
            resid = (p[j] - q[j]).clamp_min(0.0)
        else:
            resid = p[j].clone()
            resid[drafts[j]] = 0.0
        total = resid.sum()
        # p == q exactly (or p concentrated on the draft) leaves no residual mass; fall back to p.
        dist = resid / total if float(total) > 0 else p[j]
    else:
        dist = p[k]
    last = int(torch.multinomial(dist, 1, generator=generator)[0])
    return drafts[:num_accepted] + [last]
