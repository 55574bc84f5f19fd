"""The verifier: a step's logits and drafts in, its packed result out. The one object that decides
which tokens a step emits (the runner hands it the logits; nothing else samples for the target).

It owns, in the order a step runs them: min_tokens masking, logit_bias, repetition / presence /
frequency penalties and grammar masks (in place on the logits), greedy verification, rejection sampling with each request's own
generator (sampling_keys.RequestGenerators) for drafted rows, one batched draw for the undrafted sampled rows
(an exponential race with noise hashed from each row's own sampling key: no per-row kernels, the same
token whatever the batch), the runtime acceptance audit, and (after collect) the logprobs. Everything before collect runs
on the device without a host sync.

Rejection sampling (Leviathan et al., 2023): for k drafts the target gives k+1 distributions
p_0..p_k (p_j for the token after draft j-1). Draft j is accepted with probability
min(1, p_j(d)/q_j(d)); on the first rejection the replacement comes from normalize(max(p_j - q_j, 0));
if every draft is accepted a bonus token is drawn from p_k. A draft without probabilities is a
point mass q_j = onehot(d_j). Output: the accepted drafts plus one final token, so 1..k+1 tokens.

The audit (audit_rate > 0) re-checks a sampled fraction of speculative steps against sources that
are independent of the verifier's own draft read: the input ids the model actually consumed
(snapshot after the placeholders were filled), the proposer's drafts as it produced them (its
device tensor, else the host drafts of a host proposer) and the request's committed tokens as the
host knows them at collect. A row is a mismatch when the consumed inputs differ from those, when
the drafts the verifier read differ from the proposer's, or when re-verifying the proposer's drafts
on the synchronous host path (verify_greedy / verify_random) gives other tokens than the device
emitted. Rows that pass report their accepted count, which the engine compares with what its
counters recorded. The audit does not recompute the forward pass: wrong K/V (a prefix published
too early) gives wrong logits to both paths alike and is the prefix-cache equivalence gate's job.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

import torch

from verispec.core.faults import NO_FAULTS, Faults
from verispec.core.placeholder import PLACEHOLDER
from verispec.core.sampling_params import any_params
from verispec.core.scheduler_output import ScheduledRequest
from verispec.worker.grammar import apply_bitmask, bitmask_rows
from verispec.worker.inputs import to_device
from verispec.worker.sampler import (
    RowParams,
    argmax,
    argmax_with_counts,
    probs_from_logits,
    row_params,
    sample_by_key,
    triton_argmax_ok,
)
from verispec.worker.sampling_keys import RequestGenerators, key32, sample_key
from verispec.worker.token_state import DeviceTokens

#: The sampling requests of a step and the first logit row of each.
Sampling = list[tuple[ScheduledRequest, int]]


# ---- pure verification ------------------------------------------------------------------------
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


def verify_random(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """Rejection sampling for one request on the synchronous host path (the audit's). p: [k+1, V]
    target probabilities (after temperature / top-k / top-p / min-p); q: [k, V] draft
    probabilities or None for point-mass drafts. Randomness comes from the request's generator in
    the verifier's order: k uniforms, then one categorical draw."""
    k = len(drafts)
    dev = p.device
    u = torch.rand(1, k, generator=generator, device=dev)
    d = torch.tensor([drafts], dtype=torch.long, device=dev)
    num_accepted, dist = rejection_sample(p[None], d, None if q is None else q[None, :k], u)
    a = int(num_accepted[0])
    last = int(torch.multinomial(dist[0], 1, generator=generator)[0])
    return drafts[:a] + [last]


# ---- logit processing ---------------------------------------------------------------------------
def apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> None:
    """vLLM's penalties, in place, on the given rows. Repetition covers prompt + output tokens;
    presence and frequency cover output tokens only."""
    vocab = logits.shape[-1]
    dev = logits.device
    for r, p_ids, o_ids, pres, freq, rep in zip(rows, prompt_ids, output_ids, presence, frequency, repetition, strict=True):
        row = logits[r]
        out_counts = torch.bincount(to_device(o_ids, torch.long, dev), minlength=vocab)[:vocab]
        if rep != 1.0:
            seen = out_counts > 0
            if p_ids:
                seen |= torch.bincount(to_device(p_ids, torch.long, dev), minlength=vocab)[:vocab] > 0
            row.copy_(torch.where(seen, torch.where(row > 0, row / rep, row * rep), row))
        row -= freq * out_counts.to(row.dtype) + pres * (out_counts > 0).to(row.dtype)


def mask_and_penalize(logits: torch.Tensor, sampling: Sampling, faults: Faults = NO_FAULTS) -> None:
    """min_tokens (no EOS / stop ids before it), logit_bias, repetition/presence/frequency penalties
    and the grammar mask, in place. Row j of a request stands for output index len(output) + j;
    drafts before it count (for the grammar: row j is masked by the matcher state after drafts
    0..j-1, worker/grammar.py)."""
    pen_rows, pen_prompt, pen_out, pres, freq, rep = [], [], [], [], [], []
    plain = None  # the last params seen with nothing to do (often shared by all)
    for s, r0 in sampling:
        req = s.request
        p = req.params
        if p is plain:
            continue
        if p.min_tokens == 0 and not p.needs_logit_processing:
            plain = p
            continue
        if len(req.output_token_ids) >= p.min_tokens and not p.needs_logit_processing:
            continue  # the common case: nothing to mask or penalize in any of its rows
        k = s.num_draft_tokens
        if p.logit_bias:
            _add_logit_bias(logits, r0, k + 1, p.logit_bias)
        for j in range(k + 1):
            n_out = len(req.output_token_ids) + j
            if n_out < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
                banned = [t for t in banned if t < logits.shape[-1]]
                if banned:
                    logits[r0 + j].index_fill_(0, to_device(banned, torch.long, logits.device), float("-inf"))
            if p.needs_penalties:
                drafts = faults.check_fresh(req.spec_token_ids[:k], "spec_token_ids")
                pen_rows.append(r0 + j)
                pen_prompt.append(req.prompt_token_ids)
                pen_out.append(faults.check_fresh(req.output_token_ids, "output_token_ids") + drafts[:j])
                pres.append(p.presence_penalty)
                freq.append(p.frequency_penalty)
                rep.append(p.repetition_penalty)
    if pen_rows:
        apply_penalties(logits, pen_rows, pen_prompt, pen_out, pres, freq, rep)
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    _mask_grammar(logits, sampling, faults)


def _add_logit_bias(logits: torch.Tensor, r0: int, num_rows: int, bias: dict[int, float]) -> None:
    """logits[r0 : r0 + num_rows, t] += bias[t] (ids past the logits were refused at add_request)."""
    ids = to_device(list(bias), torch.long, logits.device)
    vals = to_device(list(bias.values()), logits.dtype, logits.device)
    logits[r0 : r0 + num_rows].index_add_(1, ids, vals[None, :].expand(num_rows, -1).contiguous())


def _mask_grammar(logits: torch.Tensor, sampling: Sampling, faults: Faults) -> None:
    """The grammar mask of every constrained request's rows, from its host matcher walked through
    its drafts (their host values: the engine collects them before such steps). With the
    unmasked_verify fault, the planted bug: rows of a step with drafts are left unmasked."""
    for s, r0 in sampling:
        req = s.request
        if req.grammar is None:
            continue
        k = s.num_draft_tokens
        if k and faults.active("unmasked_verify"):
            continue
        drafts = faults.check_fresh(req.spec_token_ids[:k], "spec_token_ids") if k else []
        bitmask = req.grammar.backend.new_bitmask(k + 1)
        bitmask_rows(req.grammar.matcher, drafts, bitmask)
        apply_bitmask(logits, list(range(r0, r0 + k + 1)), bitmask)


def all_greedy(sampling: Sampling) -> bool:
    """True when every sampling request is greedy (a run of one params object is checked once)."""
    return not any_params((s.request.params for s, _ in sampling), lambda p: not p.greedy)


def sampling_row_params(sampling: Sampling, vocab: int, device: torch.device) -> RowParams:
    """RowParams of the step's logit rows: each request's params for its 1 + k rows."""
    params = [s.request.params for s, _ in sampling]
    return row_params(params, [s.num_draft_tokens + 1 for s, _ in sampling], vocab, device)


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities (of the raw model distribution) of the chosen tokens and the top-n."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, token_ids[:, None])[:, 0]
    top_v, top_i = lp.topk(max(n, 1), dim=-1)
    return chosen, top_v, top_i


# ---- the audit's records ------------------------------------------------------------------------
@dataclass
class AuditSources:
    """What the audit checks a step against, none of it read through the verifier's drafts."""

    input_ids: torch.Tensor  # [T] the ids the model consumed (after the placeholders were filled)
    offsets: dict[str, int]  # each request's first input index in input_ids
    proposed: DeviceTokens | None  # the proposer's device drafts (None: host drafts)


@dataclass
class _AuditRow:
    """One audited request's copies, taken at launch before verification draws anything."""

    s: ScheduledRequest
    logits: torch.Tensor  # [k + 1, V] after penalties (a copy)
    used: torch.Tensor  # [k] the drafts the verifier read (a copy)
    proposed: torch.Tensor | list[int]  # [k] the proposer's drafts
    generator: torch.Generator | None = None  # None: greedy
    state: torch.Tensor | None = None
    q: torch.Tensor | None = None


@dataclass
class Audit:
    """A step's audited rows, kept from launch to collect."""

    rows: list[_AuditRow]
    input_ids: torch.Tensor  # a copy of AuditSources.input_ids
    offsets: dict[str, int]


class AuditResult(NamedTuple):
    """What the host re-check of a step's audited rows found."""

    audited: int  # rows re-checked
    mismatches: int
    accepted: dict[str, int]  # rows that passed: the accepted drafts the host re-verification found


class Verdict(NamedTuple):
    """The verifier's output for a step, on the device."""

    packed: torch.Tensor  # [S*W tokens (PLACEHOLDER past each count) | S counts]
    width: int  # W = 1 + the most drafts of any row
    audit: Audit | None


# ---- the verifier -------------------------------------------------------------------------------
class Verifier:
    """Penalties, greedy verification, rejection sampling, the audit and logprobs for one runner."""

    def __init__(self, device: torch.device, seed: int = 0, audit_rate: float = 0.0, faults: Faults = NO_FAULTS) -> None:
        self.device = device
        self.faults = faults
        self.seed = seed
        self.generators = RequestGenerators(device, seed)
        self.audit_rate = audit_rate
        self._audit_rng = random.Random(seed)
        self._ones_by_n: dict[int, torch.Tensor] = {}
        self._arange_buf = torch.arange(32, device=device)

    def free_request(self, request_id: str) -> None:
        """Forget a finished or preempted request's generator."""
        self.generators.free(request_id)

    def run(
        self,
        logits: torch.Tensor,
        sampling: Sampling,
        drafts: torch.Tensor | None,
        row_idx: torch.Tensor | None,
        draft_probs: dict[str, torch.Tensor],
        audit_sources: AuditSources | None = None,
    ) -> Verdict:
        """Verify / sample a step on the device (no host sync). logits: [rows, V], changed in place
        by the penalties; drafts: [S, kmax] as read for verification (None: no drafts); row_idx:
        [S * (kmax + 1)] logit row of each verified position; draft_probs: q [k, V] by request id
        for sampled drafts (point-mass drafts have none)."""
        mask_and_penalize(logits, sampling, self.faults)
        audit = None
        if drafts is not None and audit_sources is not None:
            audit = self._capture_audit(logits, sampling, drafts, draft_probs, audit_sources)
        packed, width = self._verify(logits, sampling, drafts, draft_probs, row_idx)
        return Verdict(packed, width, audit)

    def _verify(
        self, logits: torch.Tensor, sampling: Sampling, drafts: torch.Tensor | None, draft_probs, row_idx: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        """Greedy and rejection-sampled verification: the packed result and W = kmax + 1."""
        num = len(sampling)
        greedy = all_greedy(sampling)
        if drafts is None:
            if greedy:  # plain greedy decode: one logit row per request
                if triton_argmax_ok(logits):  # the kernel writes the counts too (one kernel less)
                    return argmax_with_counts(logits), 1
                return torch.cat([logits.argmax(-1), self._ones(num)]), 1
            drafts = logits.new_empty((num, 0), dtype=torch.long)
        kmax = drafts.shape[1]
        if kmax:  # padded drafts are -2, so they never match
            top = argmax(logits)[row_idx.view(num, kmax + 1)]
            num_acc = (top[:, :kmax] == drafts).long().cumprod(-1).sum(-1)
        else:
            top = argmax(logits)[:, None]
            num_acc = torch.zeros(num, dtype=torch.long, device=logits.device)
        tokens = top if greedy else self._sample_random(logits, sampling, drafts, draft_probs, top.clone(), num_acc)
        cols = self._arange(kmax + 1)
        tokens = torch.where(cols[None, :] <= num_acc[:, None], tokens, PLACEHOLDER)
        return torch.cat([tokens.reshape(-1), num_acc + 1]), kmax + 1

    def _sample_random(self, logits, sampling: Sampling, drafts, draft_probs, tokens, num_acc) -> torch.Tensor:
        """Rejection sampling for the non-greedy rows, each with its own generator (in place in
        tokens and num_acc)."""
        kmax = drafts.shape[1]
        dev = logits.device
        probs = probs_from_logits(logits, sampling_row_params(sampling, logits.shape[-1], self.device))
        plain = [(i, s, r) for i, (s, r) in enumerate(sampling) if not s.request.params.greedy and not s.num_draft_tokens]
        if plain:  # undrafted rows: drawn together, each from noise hashed from its own sampling key
            at = [r for _, _, r in plain]
            keys = [key32(sample_key(s.request, self.seed, len(s.request.output_token_ids))) for _, s, _ in plain]
            which = to_device([i for i, _, _ in plain], torch.long, dev)
            tok = sample_by_key(probs[to_device(at, torch.long, dev)], to_device(keys, torch.long, dev))
            tokens[which, 0] = tok  # (num_acc is 0 there already: padded drafts never match)
        for i, (s, r) in enumerate(sampling):
            req = s.request
            k = s.num_draft_tokens
            if req.params.greedy or not k:
                continue
            g = self.generators.at(req, len(req.output_token_ids))
            q = draft_probs.get(req.request_id) if k else None
            u = torch.rand(1, k, generator=g, device=dev)
            a, dist = rejection_sample(probs[r : r + k + 1][None], drafts[i : i + 1, :k], None if q is None else q[None, :k], u)
            last = torch.multinomial(dist[0], 1, generator=g)
            row = torch.cat([drafts[i, :k], drafts.new_zeros(kmax + 1 - k)])
            row.scatter_(0, a, last)
            tokens[i] = row
            num_acc[i] = a[0]
        return tokens

    def _ones(self, n: int) -> torch.Tensor:
        """A persistent device tensor of n ones (long); never written."""
        ones = self._ones_by_n.get(n)
        if ones is None:
            ones = self._ones_by_n[n] = torch.ones(n, dtype=torch.long, device=self.device)
        return ones

    def _arange(self, n: int) -> torch.Tensor:
        """A persistent device arange(n) (long); never written."""
        if self._arange_buf.numel() < n:
            self._arange_buf = torch.arange(max(n, 32), device=self.device)
        return self._arange_buf[:n]

    # ---- after collect -------------------------------------------------------------------------
    def logprobs(self, logits: torch.Tensor, sampling: Sampling, sampled: dict[str, list[int]]) -> dict[str, list[dict[int, float]]]:
        """Top logprobs of the sampled tokens, for the requests that ask for them."""
        out: dict[str, list[dict[int, float]]] = {}
        for s, r0 in [x for x in sampling if x[0].request.params.logprobs is not None]:
            req = s.request
            toks = sampled[req.request_id]
            n, want = len(toks), req.params.logprobs
            t = torch.tensor(toks, device=logits.device)
            chosen, top_v, top_i = top_logprobs(logits[r0 : r0 + n], t, want)
            entries = []
            for j in range(n):
                d = {int(i): float(v) for i, v in zip(top_i[j, :want].tolist(), top_v[j, :want].tolist(), strict=True)}
                d[toks[j]] = float(chosen[j])
                entries.append(d)
            out[req.request_id] = entries
        return out

    # ---- the audit -----------------------------------------------------------------------------
    def _capture_audit(self, logits, sampling: Sampling, drafts, draft_probs, src: AuditSources) -> Audit | None:
        """For a sampled fraction of speculative steps, keep what the host re-check needs."""
        if self.audit_rate <= 0 or not any(s.num_draft_tokens for s, _ in sampling):
            return None
        if self._audit_rng.random() >= self.audit_rate:
            return None
        rows = []
        for i, (s, r0) in enumerate(sampling):
            k = s.num_draft_tokens
            if k == 0:
                continue
            req = s.request
            row = _AuditRow(s, logits[r0 : r0 + k + 1].clone(), drafts[i, :k].clone(), self._proposed(req, k, src.proposed))
            if not req.params.greedy:
                row.generator = self.generators.at(req, len(req.output_token_ids))
                row.state = row.generator.get_state()
                row.q = draft_probs.get(req.request_id)
            rows.append(row)
        return Audit(rows, src.input_ids.clone(), src.offsets)

    @staticmethod
    def _proposed(req, k: int, proposed: DeviceTokens | None) -> torch.Tensor | list[int]:
        """The proposer's k drafts for req: a copy from its device tensor when it drafted there,
        else the host drafts (a host proposer's, exact on the host)."""
        first = proposed.flat_index(req.request_id, 0) if proposed is not None else None
        if first is None or proposed.flat_index(req.request_id, k - 1) is None:
            return list(req.spec_token_ids[:k])
        return proposed.values.reshape(-1)[first : first + k].clone()

    def check_audit(self, audit: Audit, sampled: dict[str, list[int]]) -> AuditResult:
        """Re-check the audited rows against the host's values (the step's results now known)."""
        consumed_all = audit.input_ids.tolist()
        mismatches = 0
        accepted: dict[str, int] = {}
        for e in audit.rows:
            s, req = e.s, e.s.request
            rid, k = req.request_id, s.num_draft_tokens
            proposed = e.proposed if isinstance(e.proposed, list) else e.proposed.tolist()
            o = audit.offsets[rid]
            truth = req.token_slice(s.start, s.start + s.num_new_tokens - k) + proposed
            if e.generator is None:
                want = verify_greedy(e.logits.argmax(-1).tolist(), proposed)
            else:
                p = probs_from_logits(e.logits, sampling_row_params([(s, 0)], e.logits.shape[-1], self.device))
                e.generator.set_state(e.state)
                want = verify_random(p, proposed, e.q, e.generator)
            ok = consumed_all[o : o + s.num_new_tokens] == truth and e.used.tolist() == proposed and want == sampled[rid]
            if ok:
                accepted[rid] = len(want) - 1
            else:
                mismatches += 1
        return AuditResult(len(audit.rows), mismatches, accepted)
