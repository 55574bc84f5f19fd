"""Logit processing shared by the verifier and the proposers: row-wise argmax and the per-row
temperature / top-k / top-p / min-p filters that turn logits into probabilities. Pure functions over
tensors; no host syncs.

Rows are independent: every row carries its own parameters, so a request's probabilities do not
depend on what else is in the batch. Penalties, verification and the random draws are the
verifier's (worker/verifier.py); the per-request seeds are in worker/sampling_keys.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from verispec.worker.inputs import to_device

GREEDY_TEMPERATURE = 1e-5  # rows at or below it are greedy


# Rows up to which argmax takes the Triton kernels. On the H200 they cost 1.9 + 1.9 us of GPU time
# for one 151,936-wide row against torch's 9.0 (step 1,148 vs 1,159 us at batch 1,
# `scripts/step_trace.py`), but 74 us of host time per call against 29 (`scripts/launch_cost.py`;
# both in docs/BENCHMARKS.md); at batch 64 the engine is host-bound, so there torch's launch wins.
ARGMAX_TRITON_MAX_ROWS = 16


def triton_argmax_ok(logits: torch.Tensor) -> bool:
    """Whether argmax takes kernels/argmax.py: float32 CUDA logits of at most ARGMAX_TRITON_MAX_ROWS rows."""
    return (logits.is_cuda and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and logits.shape[0] <= ARGMAX_TRITON_MAX_ROWS)


@functools.cache
def _argmax_rows():
    """kernels/argmax.py's argmax_rows, imported on the first call (triton loads on the CUDA path only)."""
    from verispec.kernels.argmax import argmax_rows

    return argmax_rows


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of logits [R, V] (first index on ties): the Triton kernels where
    triton_argmax_ok, torch otherwise."""
    if triton_argmax_ok(logits):
        return _argmax_rows()(logits)
    return logits.argmax(-1)


def argmax_with_counts(logits: torch.Tensor) -> torch.Tensor:
    """[2R]: the row-wise argmax of logits [R, V], then R ones (a greedy decode step's packed
    result), from the Triton kernels: call only where triton_argmax_ok(logits)."""
    return _argmax_rows()(logits, with_counts=True)


@dataclass
class RowParams:
    """Per-row sampling parameters as device tensors (R rows)."""

    temperature: torch.Tensor  # [R] float32; 0 = greedy
    top_k: torch.Tensor  # [R] int64; vocab size = off
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    need_sort: bool  # any row uses top-k or top-p
    need_min_p: bool
    any_greedy: bool | None = None  # known on the host (None: probs_from_logits asks the device)


def row_params(params: list, repeats: list[int], vocab: int, device) -> RowParams:
    """RowParams for requests' SamplingParams, each repeated for its number of rows."""
    temp, top_k, top_p, min_p = [], [], [], []
    for p, n in zip(params, repeats, strict=True):
        temp += [p.temperature] * n
        top_k += [p.top_k if p.top_k > 0 else vocab] * n
        top_p += [p.top_p] * n
        min_p += [p.min_p] * n
    return RowParams(
        temperature=to_device(temp, torch.float32, device),
        top_k=to_device(top_k, torch.long, device),
        top_p=to_device(top_p, torch.float32, device),
        min_p=to_device(min_p, torch.float32, device),
        need_sort=any(k < vocab for k in top_k) or any(x < 1.0 for x in top_p),
        need_min_p=any(m > 0 for m in min_p),
        # The device's test, in float32 on the host.
        any_greedy=bool((np.asarray(temp, dtype=np.float32) <= np.float32(GREEDY_TEMPERATURE)).any()),
    )


def probs_from_logits(logits: torch.Tensor, p: RowParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering; returns normalized probabilities [R, V].
    Greedy rows (temperature 0) get a one-hot at the argmax."""
    greedy = p.temperature <= GREEDY_TEMPERATURE
    temp = torch.where(greedy, torch.ones_like(p.temperature), p.temperature)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if p.need_sort:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        drop = ranks >= p.top_k[:, None]
        cum = sorted_p.cumsum(-1)
        drop |= (cum - sorted_p) > p.top_p[:, None]  # keep the smallest prefix reaching top_p
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    if p.need_min_p:
        thresh = probs.max(dim=-1, keepdim=True).values * p.min_p[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    if p.any_greedy if p.any_greedy is not None else bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs



_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 values in [0, 2^32); every product stays
    below 2^63, so the arithmetic is exact on every device."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & _M32
    return h ^ (h >> 16)


def sample_by_key(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [R, V]: argmax of p / E over the vocabulary with E_v ~ Exp(1) hashed from
    the row's 32-bit key [R] and v (the exponential race: token v wins with probability p_v; a token of
    probability 0 never wins). A row's noise depends on its key only, so its token does not depend on the
    batch, and a small change in p moves the winner only when two ratios nearly tie."""
    v = torch.arange(probs.shape[-1], device=probs.device)
    h = _mix32((keys[:, None] + v[None, :] * 0x61C88647) & _M32)
    e = -torch.log(((h >> 9).float() + 0.5) * (1.0 / 2**23))  # u in (0, 1), exact in float32: e > 0
    return (probs / e).argmax(-1)
