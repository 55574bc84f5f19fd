"""What a speculative step costs, as the speculation policy (policy.py) sees it.

A step of `batch` decoding requests that each verify k drafts costs

    host(k, batch)                 the engine's host work that the device waits for (k > 0 only)
  + target(batch * (1 + k), batch) the target's forward over the step's tokens
  + drafter(k, batch)              drafting k tokens for each of the batch's requests

Host work is priced as the overlapped loop (the default) pays it: a step without drafts is launched
before the host finishes the previous one, so its host work hides behind the device's, up to the point
where the host is the slower of the two (a plain step costs max(target, loop_host_per_seq * batch): at
batch 64 on the H200 the host's ~40 us per sequence is more than the forward); a step with drafts makes
the host wait for its accepted counts (and a host drafter for its tokens) before it can schedule the
next, so its host work adds to the step. The synchronous loop uses the same prices, so
that both loops make the same decisions (ARCHITECTURE.md, "Adaptive speculation").

`StepCost` is all the policy needs (seconds per step for a given k and batch); `ModeledStepCost` builds it
from forward-time models: `LinearForward` (analytic: fixed + per token + per sequence) or `ShapeTable`
(times measured per captured CUDA-graph shape, looked up the way the runner pads a step: to the next
captured batch size and query length). How an engine builds one: measure.py. Pure Python, no torch:
tests inject their own.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

# How a method drafts, for ModeledStepCost.drafter.
HOST = "host"  # on the host, from the request's tokens (ngram): a small cost per request
AUTOREGRESSIVE = "autoregressive"  # a draft model: one catch-up forward, then one forward per further draft
BLOCK = "block"  # one block-parallel drafter forward per step, whatever k (dflash)
DRAFTER_KINDS = (HOST, AUTOREGRESSIVE, BLOCK)


class StepCost(Protocol):
    """Seconds of one engine step in which each of `batch` decoding requests verifies k drafts."""

    def seconds(self, k: int, batch: int) -> float: ...


class ForwardCost(Protocol):
    """Seconds of one model forward over num_tokens tokens of num_seqs sequences."""

    def __call__(self, num_tokens: int, num_seqs: int) -> float: ...


@dataclass(frozen=True)
class LinearForward:
    """fixed + per_token * tokens + per_seq * sequences: the analytic model (launches and weight reads
    in `fixed`, matmul FLOPs in `per_token`, attention and row bookkeeping in `per_seq`)."""

    fixed: float
    per_token: float
    per_seq: float = 0.0

    def __call__(self, num_tokens: int, num_seqs: int) -> float:
        return self.fixed + self.per_token * num_tokens + self.per_seq * num_seqs


@dataclass(frozen=True)
class ShapeTable:
    """Forward times measured per (batch, query length) shape of the captured graphs.

    A step of n sequences and t tokens runs the graph of the smallest captured batch >= n and the
    smallest captured query length >= ceil(t / n) (the runner pads rows and queries to it); its time
    is interpolated linearly between the measured batch sizes around that batch, and a query length
    between two measured ones (start-up measures a few of the captured query lengths, measure.py)
    linearly between those. A step no graph fits runs eagerly: linear() prices it, a line through the
    smallest and the largest measured shapes."""

    times: dict[tuple[int, int], float]  # (batch, query length) -> seconds
    graph_batches: tuple[int, ...]  # every captured batch size (padding targets), ascending
    query_lens: tuple[int, ...]  # captured query lengths, ascending
    _measured: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _measured_q: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for q in sorted({qq for _, qq in self.times}):
            self._measured[q] = sorted(b for b, qq in self.times if qq == q)
        self._measured_q.extend(sorted(self._measured))
        for q in (self.query_lens[0], self.query_lens[-1]):
            if q not in self._measured:
                raise ValueError(f"ShapeTable has no measured shape of query length {q}")

    def __call__(self, num_tokens: int, num_seqs: int) -> float:
        n = max(1, num_seqs)
        q = -(-num_tokens // n)
        b = next((x for x in self.graph_batches if x >= n), None)
        qp = next((x for x in self.query_lens if x >= q), None)
        if b is None or qp is None:
            return self.linear()(num_tokens, num_seqs)
        if qp in self._measured:
            return self._at(b, qp)
        qs = self._measured_q
        i = bisect.bisect_left(qs, qp)
        lo, hi = qs[i - 1], qs[i]
        t_lo, t_hi = self._at(b, lo), self._at(b, hi)
        return t_lo + (t_hi - t_lo) * (qp - lo) / (hi - lo)

    def linear(self) -> LinearForward:
        """fixed + per_token * tokens through the smallest shape (1 token) and the largest measured one."""
        q0, q1 = self.query_lens[0], self.query_lens[-1]
        b0, b1 = self._measured[q0][0], self._measured[q1][-1]
        t0, t1 = self.times[(b0, q0)], self.times[(b1, q1)]
        n0, n1 = b0 * q0, b1 * q1
        per_token = max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0
        return LinearForward(max(0.0, t0 - per_token * n0), per_token)

    def _at(self, b: int, q: int) -> float:
        return _by_batch(self._measured[q], lambda x: self.times[(x, q)], b)


def _by_batch(measured: list[int], time_at, b: int) -> float:
    """The time at batch b from times measured at the ascending batch sizes `measured` (time_at(x)): exact
    where measured, the smallest's below it, proportional past the largest, linear between two."""
    i = bisect.bisect_left(measured, b)
    if i < len(measured) and measured[i] == b:
        return time_at(b)
    if i == 0:
        return time_at(measured[0])
    if i == len(measured):  # past the largest measured batch: proportional
        return time_at(measured[-1]) * b / measured[-1]
    lo, hi = measured[i - 1], measured[i]
    t_lo, t_hi = time_at(lo), time_at(hi)
    return t_lo + (t_hi - t_lo) * (b - lo) / (hi - lo)


@dataclass(frozen=True)
class BatchTable:
    """A drafting step's times measured per batch size (DFlash's block-parallel step, whose shape is set by
    the batch alone): a step of n sequences pads to the smallest of `pad_to` >= n (none: runs as n), and
    its time is interpolated linearly between the measured batch sizes around it (proportional past the
    largest). num_tokens is ignored: the block is part of the shape."""

    times: dict[int, float]  # batch -> seconds
    pad_to: tuple[int, ...] = ()  # captured batch sizes, ascending

    def __post_init__(self) -> None:
        if not self.times:
            raise ValueError("BatchTable needs at least one measured batch size")

    def __call__(self, num_tokens: int, num_seqs: int) -> float:
        n = max(1, num_seqs)
        b = next((x for x in self.pad_to if x >= n), n)
        return _by_batch(sorted(self.times), self.times.__getitem__, b)


@dataclass(frozen=True)
class ScaledForward:
    """Another forward model times a constant (a drafter priced as a fraction of the target)."""

    base: ForwardCost
    factor: float

    def __call__(self, num_tokens: int, num_seqs: int) -> float:
        return self.factor * self.base(num_tokens, num_seqs)


@dataclass(frozen=True)
class ModeledStepCost:
    """StepCost from a target forward model, a drafter model and the engine's host work.

    Host work of a step with drafts: overhead + overhead_per_seq * batch (+ host_per_request per request for
    HOST drafting), added to the device's; a step without drafts costs the larger of its forward and
    loop_host_per_seq * batch, the host work of any step (module docstring). Device work: the target's forward, plus for drafter_kind AUTOREGRESSIVE (draft_model,
    self) one catch-up forward over `catch_up` tokens per drafting request (the draft model's uniform
    shape, k_max + 1) and k - 1 one-token forwards, or for BLOCK (dflash) one forward over `catch_up`
    tokens per request (the block). At k = 0 nothing drafts: the step is a plain decode step."""

    target: ForwardCost
    drafter_kind: str = HOST
    drafter_forward: ForwardCost | None = None
    catch_up: int = 1
    host_per_request: float = 0.0
    overhead: float = 0.0
    overhead_per_seq: float = 0.0
    drafter_host: float = 0.0  # host work of one drafter forward (inputs, launch) the device waits for
    drafter_host_per_seq: float = 0.0  # ... and per drafting request
    loop_host_per_seq: float = 0.0  # host work per request of any step: a plain step's floor

    def __post_init__(self) -> None:
        if self.drafter_kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter_kind must be one of {DRAFTER_KINDS}, got {self.drafter_kind!r}")
        if self.drafter_kind != HOST and self.drafter_forward is None:
            raise ValueError(f"drafter_kind {self.drafter_kind!r} needs drafter_forward")

    def drafter(self, k: int, batch: int) -> float:
        """Seconds to draft k tokens for each of `batch` requests (0 for k = 0 or HOST): the drafter's
        forwards and the host work of each."""
        if k <= 0 or batch <= 0 or self.drafter_kind == HOST:
            return 0.0
        fwd = self.drafter_forward
        t = fwd(batch * self.catch_up, batch)
        forwards = 1
        if self.drafter_kind == AUTOREGRESSIVE and k > 1:
            t += (k - 1) * fwd(batch, batch)
            forwards = k
        return t + forwards * (self.drafter_host + self.drafter_host_per_seq * batch)

    def host(self, k: int, batch: int) -> float:
        """Seconds of host work the device waits for in the step (none without drafts)."""
        if k <= 0:
            return 0.0
        t = self.overhead + self.overhead_per_seq * batch
        if self.drafter_kind == HOST:
            t += self.host_per_request * batch
        return t

    def seconds(self, k: int, batch: int) -> float:
        if k <= 0:  # the host's work overlaps the device's: the slower of the two sets the pace
            return max(self.target(batch, batch), self.loop_host_per_seq * batch)
        return self.host(k, batch) + self.target(batch * (1 + k), batch) + self.drafter(k, batch)
