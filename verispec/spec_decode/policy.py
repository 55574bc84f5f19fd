"""Adaptive speculation: how many drafts (0..k) the requests of the next step verify.

Per request the policy keeps per-position reach / accept counts: position i (draft i + 1) is *reached*
by a verification that carried more than i drafts and accepted the first i; it is *accepted* when
draft i + 1 is accepted too. Before each verification is added, all counts decay by a factor
`2 ** (-1 / half_life)`, so the estimate follows acceptance that changes mid-request (steps without
drafts change nothing: a request at k = 0 keeps its evidence until a probe brings new). The conditional
acceptance of position i is a Beta posterior mean whose prior is the estimate of position i - 1
(`prior_mean` for position 0), with w pseudo-observations:

    p_i = (accept_i + w * p_{i-1}) / (reach_i + w)

w starts at `prior_strength` and decays like the counts (the prior is the request's first, imagined
evidence), so a request whose drafts are never accepted ends at p = 0, not at a floor the prior holds up.

The prior means m_i come from the *population*: every request's verifications so far, counted without
decay (exact integers, so their sum does not depend on the order of the requests), with the same chain
one level up, m_i = (A_i + c * m_{i-1}) / (R_i + c), m_{-1} = `prior_mean`, c = `population_strength`. A
request that does better or worse than the population at position i - 1 is assumed to do so at i
too: its prior at i is min(1, m_i * p_{i-1} / m_{i-1}). So a position the request has not reached
yet gets the drafter's typical acceptance there (DFlash's falls with the position: 0.63, 0.41, 0.54,
0.36 on the held-out requests, session 12), not the request's acceptance at the position before,
which over-promised deep drafts; with no population evidence the chain is the request's own, as
before (m_i = m_{i-1}).

The expected accepted length of k drafts is L(k) = sum_{j<=k} prod_{i<=j} p_i, so a verify of k
drafts emits 1 + L(k) tokens on average.

One k per step. The runner pads every row of a verify step to one query length so that the step
replays a CUDA graph, so a request verifying fewer drafts than another in its step saves nothing:
the step's cost is that of its largest k. plan() therefore picks the step's k in 0..max_k that
maximises the batch's expected tokens per second,

    sum_r (1 + L_r(k)) / cost.seconds(k, batch)

(cost.py: what a step costs), and every request drafts that many (fewer where its length caps it).
A larger k must beat the best smaller one by a factor 1 + min_gain: near-ties, where the cost
model's error decides, go to fewer drafts. k = 0 is a plain decode step: no drafting, no verify rows.

Re-probing: while the plan is k = 0 the policy counts the steps; after `probe_every` of them the
step gets `probe_k` drafts, so requests whose text became predictable draft again. probe_every starts
at probe_min and doubles after each probe that leaves the plan at 0 (up to probe_max), and falls back
to probe_min once a plan drafts: a batch whose drafts never pay spends about one step in probe_max on
them. A probe costs what a step of probe_k drafts costs more than a plain one (cost.py; for DFlash a
drafter forward and a verify of 1 + probe_k rows, which the device waits for), so the interval is at
least probe_floor(batch): as many plain steps as make that extra at most `probe_budget` of their time
(0.5%), within probe_min..probe_max (where probes are cheap the doubling schedule stands as it was). The clock starts afresh when a request arrives at an idle engine (reset_clock), so a workload run
again makes the same plans. At a batch size where no k would pay even if every draft were accepted (could_pay), the policy
does not probe at all. A proposer that can tell from the tokens how many requests it would draft for (ngram: a
suffix of the request's tokens but the newest one recurs earlier, which both loops know: the newest
may be a placeholder in the overlapped loop) gives the policy a probe hint: a probe due by the doubling
schedule then comes without the floor where drafts could pay if those requests' drafts were all accepted
(could_pay over just them: at batch 64, a step of 4 drafts that costs 3.3x a plain one needs 39 of them),
and not at all (the wait starts again) where they could not.

Everything here is a function of the counts the engine reports (observe) and the arguments of plan:
no clocks, no randomness, no token values; sums are exact (math.fsum), so the order of the requests
does not matter. The engine reports counts when it commits a step (both loops commit before they
propose, with the accepted counts known) and asks for one plan per step with drafts to plan, over the
same requests in both loops (engine.py, _plan_drafts), so the decisions are the same in the
synchronous and the overlapped loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from verispec.spec_decode.cost import StepCost


@dataclass(frozen=True)
class PolicyParams:
    """The policy's knobs (defaults: the engine's)."""

    half_life: float = 6.0  # verifications after which a count weighs half
    prior_mean: float = 0.5  # acceptance assumed for draft 1 of a request never verified
    prior_strength: float = 1.0  # pseudo-observations behind each position's prior
    probe_min: int = 8  # re-probe interval bounds (steps planned at k = 0), see the module docstring
    probe_max: int = 128
    probe_k: int = 1  # drafts of a probe
    probe_budget: float = 0.005  # most share of the time at k = 0 that probes may add (probe_floor)
    min_gain: float = 0.02  # relative gain in tokens per second a larger k needs
    population_strength: float = 4.0  # pseudo-observations behind each position's population mean
    population_prior: bool = True  # False: a position's prior is the request's estimate one position before

    def __post_init__(self) -> None:
        if not (self.half_life > 0 and 0 < self.prior_mean < 1 and self.prior_strength > 0):
            raise ValueError("PolicyParams needs half_life > 0, 0 < prior_mean < 1 and prior_strength > 0")
        if self.min_gain < 0 or self.population_strength <= 0:
            raise ValueError("PolicyParams needs min_gain >= 0 and population_strength > 0")
        if not (1 <= self.probe_min <= self.probe_max and self.probe_k >= 1):
            raise ValueError("PolicyParams needs 1 <= probe_min <= probe_max and probe_k >= 1")
        if not self.probe_budget > 0:
            raise ValueError("PolicyParams needs probe_budget > 0")


def count_verification(reach: list, accept: list, num_drafts: int, num_accepted: int) -> None:
    """Add one verification of num_drafts drafts, num_accepted accepted, to per-position counts (module
    docstring: reached, accepted)."""
    n = len(reach)
    for i in range(min(num_drafts, num_accepted + 1, n)):
        reach[i] += 1
    for i in range(min(num_accepted, n)):
        accept[i] += 1


class AcceptanceStats:
    """One request's decayed per-position counts."""

    __slots__ = ("reach", "accept", "prior_weight", "last_verified", "_tokens", "_version")

    def __init__(self, max_k: int, prior_strength: float = 1.0) -> None:
        self.reach = [0.0] * max_k
        self.accept = [0.0] * max_k
        self.prior_weight = prior_strength
        self._tokens: list[float] | None = None  # expected_tokens(), until the next observe
        self._version = -1  # the population version _tokens was computed against
        # Output index of the first token of the request's last verification that carried drafts.
        self.last_verified = 0

    def observe(self, num_drafts: int, num_accepted: int, output_index: int, decay: float) -> None:
        """A committed step: num_drafts verified, num_accepted of them accepted, its first token at
        output index output_index (a step without drafts changes nothing)."""
        if num_drafts <= 0:
            return
        self._tokens = None
        reach, accept = self.reach, self.accept
        n = len(reach)
        for i in range(n):
            reach[i] *= decay
            accept[i] *= decay
        self.prior_weight *= decay
        count_verification(reach, accept, num_drafts, num_accepted)
        self.last_verified = output_index

    def conditional(self, prior_mean: float, population: list[float] | None = None) -> list[float]:
        """p_i, the estimated acceptance of draft i + 1 given drafts 1..i were accepted. population: the
        population means m_i (module docstring); None: each position's prior is p_{i-1}."""
        out, p, w = [], prior_mean, self.prior_weight
        for i, (r, a) in enumerate(zip(self.reach, self.accept, strict=True)):
            m = p
            if population is not None:
                m = population[i]
                if i > 0 and population[i - 1] > 0:
                    m = min(1.0, m * out[i - 1] / population[i - 1])
            p = (a + w * m) / (r + w) if r + w > 0 else m
            out.append(p)
        return out

    def expected_accepted(self, k: int, prior_mean: float) -> float:
        """L(k): expected accepted drafts of a verification with k drafts."""
        return self.expected_tokens(prior_mean)[k] - 1.0

    def expected_tokens(self, prior_mean: float, population: PopulationStats | None = None) -> list[float]:
        """1 + L(k) for k = 0..max_k: tokens a verification of k drafts emits on average (cached until the
        next observe of this request or of the population; prior_mean is the policy's, which never changes)."""
        t = self._tokens
        version = population.version if population is not None else -1
        if t is None or self._version != version:
            means = population.means(prior_mean) if population is not None else None
            t, run, total = [1.0], 1.0, 1.0
            for p in self.conditional(prior_mean, means):
                run *= p
                total += run
                t.append(total)
            self._tokens, self._version = t, version
        return t


class PopulationStats:
    """Every request's verifications, counted per position without decay (integers: exact in any order)."""

    def __init__(self, max_k: int, strength: float) -> None:
        self.reach = [0] * max_k
        self.accept = [0] * max_k
        self.strength = strength
        self.version = 0  # bumped by every observe: the requests' cached expectations are stale then
        self._means: tuple[int, list[float]] | None = None

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        count_verification(self.reach, self.accept, num_drafts, num_accepted)
        self.version += 1

    def means(self, prior_mean: float) -> list[float]:
        """m_i = (A_i + c * m_{i-1}) / (R_i + c), m_{-1} = prior_mean."""
        if self._means is None or self._means[0] != self.version:
            out, m, c = [], prior_mean, self.strength
            for r, a in zip(self.reach, self.accept, strict=True):
                m = (a + c * m) / (r + c)
                out.append(m)
            self._means = (self.version, out)
        return self._means[1]


class SpeculationPolicy:
    """Chooses each step's drafts from its requests' own acceptance and the step cost."""

    def __init__(self, max_k: int, cost: StepCost, params: PolicyParams | None = None) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.cost = cost
        self.params = params or PolicyParams()
        self.decay = 2.0 ** (-1.0 / self.params.half_life)
        self.stats: dict[str, AcceptanceStats] = {}
        self._fresh = AcceptanceStats(max_k, self.params.prior_strength)  # a request never verified
        self.population = PopulationStats(max_k, self.params.population_strength) if self.params.population_prior \
            else None
        self._costs: dict[int, list[float]] = {}  # batch -> seconds of a step at k = 0..max_k
        self._could_pay: dict[tuple[int, int], bool] = {}  # (batch, drafting) -> could_pay
        self._probe_floor: dict[int, int] = {}  # batch -> probe_floor(batch)
        self._retired: list[str] = []  # finished requests, dropped after the next plan
        self.idle_steps = 0  # consecutive plans at k = 0 since the last drafting step
        # The engine's probe hint (None: none): for how many of the requests being planned the proposer
        # would find drafts, from tokens both loops know (ngram: a suffix match; module docstring). Asked
        # only when a probe is due by the doubling schedule.
        self.probe_hint: Callable[[], int] | None = None
        self.probe_every = self.params.probe_min

    def reset_clock(self) -> None:
        """A request arrives at an idle engine (engine.add_request): start the probe clock afresh (the
        next probe comes after probe_min plans at k = 0) and drop the finished requests' counts now (no
        step is in flight that a plan could still count them for, and a request id used again must
        start from the prior)."""
        self.idle_steps, self.probe_every = 0, self.params.probe_min
        for rid in self._retired:
            self.stats.pop(rid, None)
        self._retired.clear()

    def reset_population(self) -> None:
        """Forget the population counts (the bench starts every run from none, so that a run repeats its
        warm-up's plans; an engine keeps them across idle periods)."""
        if self.population is not None:
            self.population = PopulationStats(self.max_k, self.params.population_strength)

    def _stats(self, request_id: str) -> AcceptanceStats:
        st = self.stats.get(request_id)
        if st is None:
            st = self.stats[request_id] = AcceptanceStats(self.max_k, self.params.prior_strength)
        return st

    def observe(self, request_id: str, num_drafts: int, num_emitted: int, output_index: int) -> None:
        """A committed step of the request: num_drafts verified, num_emitted tokens emitted (so
        num_emitted - 1 drafts accepted), the first at output index output_index."""
        if num_drafts > 0:
            self._stats(request_id).observe(num_drafts, max(0, num_emitted - 1), output_index, self.decay)
            if self.population is not None:
                self.population.observe(num_drafts, max(0, num_emitted - 1))

    def forget(self, request_id: str) -> None:
        """The request finished: its state goes after the next plan (which may still count it: the
        overlapped loop learns of a stop one step later than the synchronous loop, engine.py)."""
        self._retired.append(request_id)

    def step_costs(self, batch: int) -> list[float]:
        """Seconds of a step of `batch` requests at k = 0..max_k (cached per batch)."""
        c = self._costs.get(batch)
        if c is None:
            c = self._costs[batch] = [self.cost.seconds(k, batch) for k in range(self.max_k + 1)]
        return c

    def expected_tokens(self, request_id: str) -> list[float]:
        """1 + L(k) for k = 0..max_k: the request's expected tokens from a verification of k drafts."""
        st = self.stats.get(request_id)
        return (st if st is not None else self._fresh).expected_tokens(self.params.prior_mean, self.population)

    def best_k(self, request_ids: list[str], batch: int | None = None) -> int:
        """The step k with the most expected tokens per second for these requests (no probing, no
        state change); batch: the step's size for its cost (default: len(request_ids))."""
        if not request_ids:
            return 0
        costs = self.step_costs(max(1, batch or len(request_ids)))
        cols = list(zip(*[self.expected_tokens(r) for r in request_ids], strict=True))  # cols[k]: each 1 + L(k)
        gain = 1.0 + self.params.min_gain
        best_k, best = 0, len(request_ids) / costs[0]
        for k in range(1, self.max_k + 1):
            rate = math.fsum(cols[k]) / costs[k]
            if rate > best * gain:
                best_k, best = k, rate
        return best_k

    def could_pay(self, batch: int, drafting: int | None = None) -> bool:
        """Whether drafts could pay at this batch size at all: some k beats a plain step even if every
        draft were accepted (1 + k tokens). Where none does, plan() does not probe. drafting: only that
        many of the batch's requests would get drafts (the probe hint), the others emit 1 token a step."""
        d = batch if drafting is None else min(drafting, batch)
        c = self._could_pay.get((batch, d))
        if c is None:
            costs = self.step_costs(max(1, batch))
            gain = 1.0 + self.params.min_gain
            c = self._could_pay[(batch, d)] = d > 0 and any(
                (batch + d * k) / costs[k] > gain * batch / costs[0] for k in range(1, self.max_k + 1))
        return c

    def probe_floor(self, batch: int) -> int:
        """The fewest plans at k = 0 between probes at this batch size, so that probing adds at most
        probe_budget to the time of the steps at k = 0: ceil((cost(probe_k) - cost(0)) / (probe_budget *
        cost(0))), within probe_min..probe_max (a probe still comes every probe_max plans at 0)."""
        f = self._probe_floor.get(batch)
        if f is None:
            costs, p = self.step_costs(max(1, batch)), self.params
            extra = max(0.0, costs[min(p.probe_k, self.max_k)] - costs[0])
            f = math.ceil(extra / (p.probe_budget * costs[0])) if costs[0] > 0 else p.probe_max
            f = self._probe_floor[batch] = max(p.probe_min, min(p.probe_max, f))
        return f

    def plan(self, request_ids: list[str], batch: int | None = None) -> int:
        """The drafts of the next step for every one of these requests: best_k, or a probe when that
        has been 0 for probe_every plans (module docstring). Advances the probe clock, then drops the
        requests forgotten before it."""
        b = batch or len(request_ids)
        # Where no k could pay even if every draft were accepted, best_k is 0 (its rates are bounded by
        # could_pay's): skipped, a batch's expectations cost ~1 us a request of host time every step.
        k = self.best_k(request_ids, batch) if request_ids and self.could_pay(b) else 0
        if k > 0:
            self.idle_steps, self.probe_every = 0, self.params.probe_min
        elif request_ids and self.could_pay(b):
            self.idle_steps += 1
            hint = self.probe_hint() if self.probe_hint is not None and self.idle_steps >= self.probe_every else None
            if hint is not None and not self.could_pay(b, hint):
                self.idle_steps = 0  # too few requests would get drafts for them to pay: wait probe_every more
            elif self.idle_steps >= (self.probe_every if hint is not None else
                                     max(self.probe_every, self.probe_floor(b))):
                self.idle_steps = 0
                self.probe_every = min(2 * self.probe_every, self.params.probe_max)
                k = self.params.probe_k
        for rid in self._retired:
            self.stats.pop(rid, None)
        self._retired.clear()
        return min(k, self.max_k)
