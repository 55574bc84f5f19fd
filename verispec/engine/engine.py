"""LLMEngine: requests in, RequestOutputs out; one step() at a time.

Flow of a step (synchronous loop):
  scheduler.schedule() -> runner.launch() + collect() -> scheduler.commit() -> detokenize / stop strings
  -> proposer.observe() + propose() -> drafts for the next step.
Offline (LLM.generate) and online (the HTTP server) both drive this same object.

Adaptive speculation (speculative_config.adaptive): before each proposal the policy
(spec_decode/policy.py) picks the next step's drafts (0..k) from its requests' acceptance counts, which
both loops report when they commit a step (counts only), and the step cost: see _plan_drafts. A step
planned at 0 is a plain decode step, and the overlapped loop stays overlapped for it (a host drafter's
wait for the step's tokens is skipped too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from verispec.config import EngineConfig
from verispec.core.counters import SpecCounters
from verispec.core.faults import Faults
from verispec.core.placeholder import PLACEHOLDER
from verispec.core.request import Request, Status
from verispec.core.sampling_params import RequestOutputKind, SamplingParams, any_params
from verispec.engine.builder import EngineParts, build_engine_parts, freeze_gc, resolve_config
from verispec.engine.detokenizer import IncrementalDetokenizer
from verispec.engine.scheduler import Scheduler
from verispec.outputs import CompletionOutput, RequestOutput
from verispec.spec_decode.policy import SpeculationPolicy
from verispec.spec_decode.proposer import Proposal
from verispec.worker.grammar import GrammarBackend, RequestGrammar, shared_backend
from verispec.worker.step import StepResult


@dataclass
class _Group:
    """A user request: its n sequences share a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    texts: list[str]  # streamed text so far (detokenizer deltas; partial stop strings held back)
    arrival_time: float
    first_token_time: float | None = None
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: one output, when it finishes
    # FINAL_ONLY without stop strings: nobody reads the text before the end, so each sequence is
    # detokenized once, when it finishes (texts stay "" until then).
    defer_text: bool = False

    def finished(self) -> bool:
        """True once every sequence of the request has finished."""
        for s in self.seqs:  # (no generator: this runs for every request in every step)
            if s.status is not Status.FINISHED:
                return False
        return True


def _prefill_fit(runner):
    """The scheduler's prefill_fit: the target graphs' padded_query_len where admission steps replay graphs
    (CUDA graphs, and no tensor parallelism: its steps never split into two replays, runner.py); else None."""
    graphs = runner.graphs
    return graphs.padded_query_len if graphs is not None and runner.tp is None else None


def _verified(s) -> int:
    """The drafts the policy sees a decode step of `s` verify: what it planned for the request (a
    shortfall of the proposer counts as rejected positions), at least the drafts scheduled. Resets the
    plan, which holds for one step."""
    req = s.request
    planned, req.planned_drafts = req.planned_drafts, 0
    if s.num_new_tokens != 1 + s.num_draft_tokens:  # not a decode step (a prefill chunk after a preemption)
        return s.num_draft_tokens
    return max(planned, s.num_draft_tokens)


class LLMEngine:
    """The engine core shared by the offline LLM class and the server."""

    def __init__(self, config: EngineConfig, parts: EngineParts | None = None, faults: Faults | None = None) -> None:
        """faults: planted bugs (tests only); None reads VERISPEC_FAULT / VERISPEC_DEBUG_STALE now, once.
        Pre-built parts carry their own (assemble_parts(..., faults=)). self.config is `config` resolved
        (builder.resolve_config: no 'auto' device or dtype, async_scheduling True or False)."""
        self.config = config = resolve_config(config)
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size} is a server option (verispec serve "
                             "--data-parallel-size N runs N engines); one LLMEngine is one replica")
        p = parts or build_engine_parts(config, faults or Faults.from_env())
        self.faults = p.faults
        self.parts = p
        self.tokenizer = p.tokenizer
        self.model_config = p.model_config
        self.max_model_len = p.max_model_len
        self.blocks = p.blocks
        self.runner = p.runner
        self.proposer = p.proposer
        # The scheduler sizes a resumed request's draft blocks for the most drafts it may get (the policy
        # decides later, in _propose), so admission never depends on the policy.
        self.scheduler = Scheduler(p.blocks, config.max_num_seqs, config.max_num_batched_tokens, p.max_model_len,
                                   drafts_for=p.proposer.max_drafts_for if p.proposer is not None else None,
                                   faults=p.faults, prefill_fit=_prefill_fit(p.runner))
        sc = config.speculative_config
        self.policy: SpeculationPolicy | None = None
        if p.proposer is not None and sc is not None and sc.adaptive and p.step_cost is not None:
            self.policy = SpeculationPolicy(p.proposer.k, p.step_cost)
        # Request-steps that sampled after a request's first token (each could carry drafts), and
        # engine steps that verified drafts: the policy's mean k is num_draft_tokens / request steps.
        self.num_request_steps = 0
        self.num_verify_steps = 0
        # The latest launched step, and its requests that a stop (not the length) finished once its
        # values were committed: part of the batch the policy sees (_plan_drafts).
        self._latest_sched = None
        self._stopped_latest: list[Request] = []
        self._plan_ready: list[Request] = []
        self.planned_k = 0  # the latest plan's k (host int, set by _plan_drafts; the bench's step traces read it)
        self.launched_tokens = 0  # tokens of every step launched so far (the bench's step traces)
        if self.policy is not None and hasattr(p.proposer, "would_draft"):  # (the same requests in both loops)
            self.policy.probe_hint = lambda: p.proposer.would_draft(self._plan_ready + self._stopped_latest)
        # The overlapped loop collects its in-flight step before the next schedule (_step_async).
        self._drain_first = False
        self.spec = SpecCounters()
        self.groups: dict[str, _Group] = {}
        self.seq_to_group: dict[str, _Group] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_finished = 0
        self.num_steps = 0
        # Draft distributions q for the next step's sampled drafts (empty for point-mass drafts).
        self.pending_draft_probs: dict = {}
        # Drafts for the next step: `device` is the truth, Request.spec_token_ids their mirror.
        self.pending_proposal: Proposal | None = None
        # The overlapped loop's launched-but-not-collected step.
        self.inflight = None
        self.audit_mismatches = 0
        self.num_audited_steps = 0
        # Structured outputs: built on the first constrained request (xgrammar is imported then).
        self._grammars: GrammarBackend | None = None
        self.num_grammar_refused_tokens = 0  # emitted tokens a grammar refused: a bug if ever > 0
        if config.gc_freeze:  # last: everything the engine keeps is built by now
            freeze_gc()

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for an empty or too long prompt, bad token ids or
        a duplicate id; nothing is queued then."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already running")
        if self.policy is not None and not self.has_unfinished_requests():
            # A batch on an idle engine starts the probe clock afresh, in either loop (both are idle
            # here alike), so a workload run again makes the same plans: the shapes of its steps are
            # those of the first run (bench spec times a second run, after a warm-up).
            self.policy.reset_clock()
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string (or pass prompt_token_ids)")
            prompt_token_ids = self.tokenizer.encode_prompt(prompt)
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, but the context (max_model_len) is {self.max_model_len}: "
                f"at most {self.max_model_len - 1} prompt tokens leave room to generate"
            )
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"SamplingParams.logit_bias has token id {max(params.logit_bias)}, outside [0, {vocab})")
        eos = frozenset(self.tokenizer.eos_token_ids)
        seqs = []
        for i in range(params.n):
            sp = params
            if params.n > 1 and params.seed is not None:
                sp = SamplingParams(**{**params.__dict__, "seed": params.seed + i, "n": 1})
            sid = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Request(sid, list(ids), sp, eos, parent_id=request_id, index=i,
                                grammar=self._request_grammar(params)))
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            for _ in seqs
        ]
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        g = _Group(request_id, prompt, ids, seqs, detoks, [""] * len(seqs), time.monotonic(),
                   final_only=final_only, defer_text=final_only and not params.stop)
        self.groups[request_id] = g
        for s in seqs:
            self.seq_to_group[s.request_id] = g
            self.scheduler.add(s)
        self.num_prompt_tokens += len(ids)

    def _request_grammar(self, params: SamplingParams) -> RequestGrammar | None:
        """A fresh grammar matcher for one sequence of a constrained request (None for free text)."""
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            self._grammars = shared_backend(self.tokenizer, self.model_config.vocab_size)
        return self._grammars.request_grammar(params.structured_outputs)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (no-op if unknown or already finished)."""
        g = self.groups.pop(request_id, None)
        if g is None:
            return
        for s in g.seqs:
            if not s.is_finished:
                self._finish(s, "abort")
            self.seq_to_group.pop(s.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.inflight is not None

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the current state of every request that changed."""
        return self._step_async() if self.config.async_scheduling else self._step_sync()

    def _step_sync(self) -> list[RequestOutput]:
        sched = self._schedule()
        if not sched.scheduled:
            return []
        handle = self.runner.launch(sched, self.pending_draft_probs, {})
        previous = self._launched(sched)
        result = self.runner.collect(handle)
        touched = self._commit(sched, result, optimistic=False)
        self.scheduler.publish_rest(previous, sched.scheduled)
        if self.proposer is not None:
            self._propose(sched, handle)
        return self._outputs(touched)

    def _step_async(self) -> list[RequestOutput]:
        """Overlapped loop: launch step N, then finish step N-1 on the host while N runs.

        The books of step N are committed optimistically (placeholders, counts only) right after
        launch; the values arrive when the step is collected one iteration later."""
        early = []
        if self._needs_host_values():
            early = self._drain()
            self._collect_drafts()
        elif self._drain_first:
            # A request preempted with this step's placeholders (reserve, in _propose) gets its values
            # before the next schedule, which may admit it again, as the synchronous loop's would.
            early = self._drain()
        self._drain_first = False
        sched = self._schedule()
        if not sched.scheduled:
            return early + self._drain()
        prev = self.inflight
        drafts = self.pending_proposal.device if self.pending_proposal is not None else None
        sources = {"out": prev.device_tokens() if prev is not None else None, "draft": drafts}
        handle = self.runner.launch(sched, self.pending_draft_probs, sources)
        previous = self._launched(sched)
        # Step N-1 is finished on the host while step N runs: before waiting for N's accepted counts,
        # so that this host work hides behind N's verify instead of delaying the drafter's launch.
        outputs = early + (self._drain_handle(prev) if prev is not None else [])
        counts = handle.counts() if any(s.num_draft_tokens for s in sched.scheduled) else None
        self._commit_optimistic(handle, counts)
        self.scheduler.publish_rest(previous, sched.scheduled)  # (step N-1's values are on the host now)
        self.inflight = handle
        if self.proposer is not None:
            host = self.proposer.needs_host_tokens  # (drains first, then reads host values: no device sources)
            outputs += self._propose(sched, handle, device_sources=not host, drain=host)
        return outputs

    def _needs_host_values(self) -> bool:
        """Penalties and grammar masks read token values on the host (outputs and the drafts before
        each verified position): such steps wait for the values first."""
        return any_params((r.params for r in self.scheduler.running),
                          lambda p: p.needs_penalties or p.structured_outputs is not None)

    def _collect_drafts(self) -> None:
        """Fill the PLACEHOLDER mirrors of device drafts (Request.spec_token_ids) with their
        values: one device->host copy, only before steps with penalty requests."""
        p = self.pending_proposal
        if p is None or p.device is None:
            return
        if not any(PLACEHOLDER in r.spec_token_ids for r in self.scheduler.running):
            return
        p.collect_host()
        for r in self.scheduler.running:
            if PLACEHOLDER in r.spec_token_ids:
                ids = p.token_ids[r.request_id]
                assert len(ids) == len(r.spec_token_ids), "drafts of another proposal"
                r.spec_token_ids = list(ids)

    def _drain(self) -> list[RequestOutput]:
        handle, self.inflight = self.inflight, None
        return self._drain_handle(handle) if handle is not None else []

    def _drain_handle(self, handle) -> list[RequestOutput]:
        result = self.runner.collect(handle)
        return self._outputs(self._commit(handle.sched, result, optimistic=True))

    def _schedule(self):
        sched = self.scheduler.schedule()
        for r in sched.preempted:
            if self.proposer is not None:
                self.proposer.free_request(r.request_id)
        if sched.scheduled:
            self.num_steps += 1
        return sched

    def _launched(self, sched) -> list:
        """Record the step just launched; returns the previous launched step's scheduled requests."""
        previous = self._latest_sched.scheduled if self._latest_sched is not None else []
        self._latest_sched, self._stopped_latest = sched, []
        self.launched_tokens += sched.num_tokens
        return previous

    def _commit_optimistic(self, handle, counts: list[int] | None) -> None:
        """Advance the books of a launched step: lengths now, values later (PLACEHOLDER). The policy
        learns the accepted counts here, as the synchronous loop's _commit does."""
        commit = self.scheduler.commit
        observe = self.policy.observe if self.policy is not None else None
        sampling = handle.sampling  # the sampled rows, in the order of sched.scheduled
        i, num = 0, len(sampling)
        for s in handle.sched.scheduled:
            row = i < num and sampling[i][0] is s
            n = (counts[i] if counts is not None else 1) if row else 0
            i += 1 if row else 0
            if s.request.status is Status.FINISHED:
                continue  # step N-1's values (drained first) finished it: this step's rows are discarded
            if row:
                # (a row that verified nothing and had nothing planned tells the policy nothing: skipped)
                if observe is not None and (s.num_draft_tokens or s.request.planned_drafts):
                    observe(s.request.request_id, _verified(s), n, len(s.request.output_token_ids))
                commit(s, [PLACEHOLDER] * n)
            else:
                commit(s, None)

    def _commit(self, sched, result, optimistic: bool) -> dict:
        """Apply host values to the books: finalize tokens, count acceptance, detokenize, stop."""
        touched: dict[str, _Group] = {}
        groups, values, logprobs = self.seq_to_group, result.sampled, result.logprobs
        resolve, finished = self.scheduler.resolve, Status.FINISHED  # (hoisted: a loop over the batch)
        observe = self.policy.observe if self.policy is not None and not optimistic else None
        latest, verified = sched is self._latest_sched, False
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            g = groups.get(rid)
            if g is None or req.status is finished:
                continue  # finished (or aborted) while this step was in flight: discard
            sampled = values.get(rid)
            if optimistic:
                new = resolve(s, sampled)
            else:
                n_before = len(req.output_token_ids)
                if observe is not None and sampled is not None and (s.num_draft_tokens or req.planned_drafts):
                    observe(rid, _verified(s), len(sampled), n_before)
                self.scheduler.commit(s, sampled)
                new = req.output_token_ids[n_before:]
            if sampled is not None:
                if s.output_base:
                    self.num_request_steps += 1
                if s.num_draft_tokens:
                    verified = True
                    counted = self._count_acceptance(req, s.num_draft_tokens, len(sampled) - 1)
                    audited = result.audit_accepted.get(rid) if result.audit_accepted else None
                    if audited is not None and audited != counted:
                        self.audit_mismatches += 1  # the counters disagree with the audit's re-verification
                if logprobs and rid in logprobs:
                    req.logprobs.extend(logprobs[rid][: len(new)])
            if new:
                if req.grammar is not None:
                    self._advance_grammar(req, new)
                self._add_text(g, req, new)
            if req.finish_reason is not None and req.status is not finished:
                if latest and req.finish_reason == "stop" and sampled is not None and not self.scheduler.length_reached(
                        req, s.output_base + len(sampled)):
                    self._stopped_latest.append(req)
                self._finish(req, req.finish_reason)
            touched[g.request_id] = g
        self.num_verify_steps += verified
        self.num_audited_steps += result.audited
        self.audit_mismatches += result.audit_mismatches
        return touched

    def _advance_grammar(self, req: Request, new: list[int]) -> None:
        """Move a constrained sequence's matcher over its emitted tokens; a terminated grammar (its
        stop token accepted) finishes the sequence with "stop"."""
        before = req.grammar.num_refused
        terminated = req.grammar.advance(new)
        self.num_grammar_refused_tokens += req.grammar.num_refused - before
        if terminated and req.finish_reason is None:
            req.finish_reason = "stop"

    def _add_text(self, g: _Group, req: Request, new: list[int]) -> None:
        """Count and detokenize a sequence's new tokens; a stop string finishes it."""
        self.num_generation_tokens += len(new)
        if g.first_token_time is None:
            g.first_token_time = time.monotonic()
        if g.defer_text:
            return  # detokenized in _finish
        detok = g.detoks[req.index]
        g.texts[req.index] += detok.add_tokens(new)
        if detok.stop_hit is not None and req.finish_reason is None:
            req.finish_reason, req.stop_reason = "stop", detok.stop_hit

    def _propose(self, sched, handle, device_sources: bool = False, drain: bool = False) -> list[RequestOutput]:
        """Drafts for the next step. device_sources: the overlapped loop, where the step's tokens are
        device values (handle.device_tokens(), built only when something drafts). drain: a host
        proposer in the overlapped loop, which needs the in-flight step's tokens: drain it first, unless
        the policy plans no drafts (returns the drained step's outputs)."""
        self.proposer.observe(sched, StepResult(captured=handle.captured, token_offsets=handle.token_offsets))
        ready = self._ready()
        outputs: list[RequestOutput] = []
        if self.policy is not None:
            k = self._plan_drafts(ready)
            if k == 0:  # the next step is a plain decode step: nothing to reserve or draft
                for r in ready:
                    if r.spec_token_ids:
                        r.spec_token_ids = []
                ready = []  # (a drafter still sees the step: DFlash writes its context K/V in propose)
            elif drain:
                outputs = self._drain()
                ready = [r for r in ready if r.status is Status.RUNNING and not r.pending_stop]
        else:  # k pinned
            self.planned_k = self.proposer.k if ready else 0
            if drain:
                outputs = self._drain()
                ready = self._ready()
        # Drafters write K/V at the draft positions, so their blocks are reserved now. A request
        # never goes without drafts for lack of blocks (that would make its draft schedule, and so
        # its sampled tokens, depend on block pressure): requests are preempted as in schedule(),
        # and a preempted request resumes in the decode state and drafts then (scheduler.py).
        for r in ready:
            if r.status is Status.RUNNING:
                for victim in self.scheduler.reserve(r, r.num_tokens + self.proposer.num_drafts_for(r)):
                    self.proposer.free_request(victim.request_id)
                    if PLACEHOLDER in victim.output_token_ids:  # (the overlapped loop's step in flight)
                        self._drain_first = True
        ready = [r for r in ready if r.status is Status.RUNNING]
        sources = {"out": handle.device_tokens()} if device_sources and ready else {}
        proposal = self.proposer.propose(ready, sources)
        if not self.config.async_scheduling:
            proposal.collect_host()
        for r in ready:
            r.spec_token_ids = proposal.token_ids.get(r.request_id, [])
        self.pending_draft_probs = proposal.probs
        self.pending_proposal = proposal
        return outputs

    def _ready(self) -> list[Request]:
        """Running requests in the decode state (all but their last token computed), not stopping."""
        return [
            r for r in self.scheduler.running
            if r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1 and not r.pending_stop
        ]

    def _plan_drafts(self, ready: list[Request]) -> int:
        """The policy's drafts for the next step (Request.draft_limit of each ready request); returns them.

        The policy plans over the ready requests plus those of the latest launched step that a stop
        (EOS, stop token or string; not the length) finished once its values were committed: the
        synchronous loop knows of those finishes already, the overlapped loop does not yet and still
        counts them as ready (their counts are known to both: committed optimistically, and the policy
        keeps a finished request's state until the next plan). So both loops plan over the same requests
        whenever their steps held the same requests. A step without ready requests plans nothing."""
        if not ready:
            return 0
        ids = [r.request_id for r in ready] + [r.request_id for r in self._stopped_latest]
        self._plan_ready = ready
        k = self.planned_k = self.policy.plan(ids)
        if k == 0:
            for r in ready:
                r.draft_limit = r.planned_drafts = 0
            return 0
        cap = self.proposer.max_drafts_for
        for r in ready:
            r.draft_limit = r.planned_drafts = min(k, cap(r))
        return k

    def _count_acceptance(self, req: Request, num_drafts: int, num_accepted: int) -> int:
        """Record a verified row in the engine's and the request's counters; returns the accepted
        count recorded (the runtime audit checks it)."""
        if num_drafts == 0:
            return 0
        if self.faults.active("miscount_rejected") and num_accepted < num_drafts:
            num_accepted += 1  # the bug: the first rejected position counted as accepted
        self.spec.record(num_drafts, num_accepted)
        req.spec.record(num_drafts, num_accepted)
        return num_accepted

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.runner.free_request(req.request_id)
        if self.proposer is not None:
            self.proposer.free_request(req.request_id)
        if self.policy is not None:
            self.policy.forget(req.request_id)
        g = self.seq_to_group.get(req.request_id)
        if g is not None:
            detok = g.detoks[req.index]
            if g.defer_text and reason != "abort":  # an aborted request's text is never read
                g.texts[req.index] += detok.add_tokens(self.faults.check_fresh(req.output_token_ids, "output_token_ids"))
            g.texts[req.index] += detok.flush()
            if g.finished() and reason != "abort":
                self.num_requests_finished += 1

    def _outputs(self, touched: dict[str, _Group]) -> list[RequestOutput]:
        """RequestOutputs of the groups a step changed; a FINAL_ONLY group only once it finishes
        (LLM.generate reads nothing else, so nothing is built for it in the steps before)."""
        return [self._output(g) for g in touched.values() if not g.final_only or g.finished()]

    def _output(self, g: _Group) -> RequestOutput:
        """The group's state now: a snapshot (fresh lists) that later steps never change."""
        outs = [self._completion(s, text) for s, text in zip(g.seqs, g.texts, strict=True)]
        finished = g.finished()
        if finished:
            self.groups.pop(g.request_id, None)
            for s in g.seqs:
                self.seq_to_group.pop(s.request_id, None)
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, finished, g.seqs[0].num_cached_tokens)

    @staticmethod
    def _completion(s: Request, text: str) -> CompletionOutput:
        """One sequence's CompletionOutput (positional arguments: this runs for every request
        in every step of a streaming consumer). token_ids are the values known on the host: the
        overlapped loop's trailing PLACEHOLDERs (its launched step) are left out."""
        ids = s.output_token_ids
        n = len(ids)
        while n and ids[n - 1] == PLACEHOLDER:  # placeholders only ever trail (steps resolve in order)
            n -= 1
        done = s.status is Status.FINISHED
        return CompletionOutput(
            s.index, text, ids[:n], s.finish_reason if done else None, s.stop_reason,
            list(s.logprobs) if s.params.logprobs is not None else None, None,
            s.spec.num_draft_tokens, s.spec.num_accepted_tokens, list(s.spec.accepted_per_pos),
        )

    # ---- metrics ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the tensor-parallel rank processes, if any (idempotent; the engine cannot step after)."""
        if self.parts.tp is not None:
            self.parts.tp.shutdown()

    def get_metrics(self) -> dict:
        """Counters summed since the engine started (CONTRACT.md names, plus a few more)."""
        sp = self.spec
        return {
            "spec_decode_num_drafts": sp.num_drafts,
            "spec_decode_num_draft_tokens": sp.num_draft_tokens,
            "spec_decode_num_accepted_tokens": sp.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(sp.accepted_per_pos),
            "spec_decode_mean_acceptance_length": (1 + sp.num_accepted_tokens / sp.num_drafts) if sp.num_drafts else 0.0,
            # The policy's mean k: drafts per request-step that could carry them (zeros included).
            "spec_decode_num_request_steps": self.num_request_steps,
            "spec_decode_num_verify_steps": self.num_verify_steps,
            "spec_decode_mean_k": sp.num_draft_tokens / self.num_request_steps if self.num_request_steps else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "num_requests_finished": self.num_requests_finished,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.blocks.num_free_blocks,
            "num_total_blocks": self.blocks.num_blocks,
            "prefix_cache_queries": self.blocks.num_query_tokens,
            "prefix_cache_hits": self.blocks.num_hit_tokens,
            "num_steps": self.num_steps,
            "spec_decode_audit_mismatches": self.audit_mismatches,
            "spec_decode_audited_steps": self.num_audited_steps,
            "structured_output_refused_tokens": self.num_grammar_refused_tokens,
        }
