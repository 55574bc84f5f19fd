"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

The scheduler keeps books only (which request runs, how many tokens, which blocks); it never
touches a tensor. Each step every running request asks for its remaining tokens plus its drafts;
waiting requests are admitted with what is left of the token budget. When blocks run out, the
most recently admitted running request (the tail of the running list, as in vLLM) is preempted: its blocks are freed and it is recomputed
later (its published prefix blocks usually survive in the prefix cache).

With a proposer (`drafts_for`: how many drafts it will propose for a request), a request resumed after preemption recomputes all but its
last token: it comes back in the decode state and gets drafts for its next output index, exactly
as if it had never been preempted. Together with `reserve()` (draft blocks are taken with the same
preemption rule, never silently skipped) this makes a request's draft schedule (how many drafts
each verification of each output index carries) a function of the request alone, not of block
pressure, prefix hits or the loop that drives the engine.

Both loops (engine.py) get the same schedules, so that the adaptive policy, which plans over the batch,
makes the same plans: prefix hashes are published by one rule at the same points (commit: the blocks whose
token values were known at the step's launch, so not the step's own sampled tokens, which the overlapped
loop does not have yet; publish_rest: the previous step's requests this step skipped), a schedule() that
preempted admits nobody (in the overlapped loop its victims still wait for the in-flight step's values),
and requests waiting only for their last values (pending_stop) hold no seat.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from verispec.core.faults import NO_FAULTS, Faults
from verispec.core.placeholder import PLACEHOLDER
from verispec.core.request import Request, Status
from verispec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from verispec.engine.kv_blocks import BlockManager


class Scheduler:
    """Decides each step's batch and commits its results into the requests' books."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        drafts_for: Callable[[Request], int] | None = None,
        faults: Faults = NO_FAULTS,
        prefill_fit: Callable[[int, int], int | None] | None = None,
    ) -> None:
        """prefill_fit(rows, longest chunk): the query length a captured graph replays that many prompt
        chunks at (None: none does; the runner's CudaGraphRunner.padded_query_len). With it, admission
        stops before a prompt chunk that would push the step's prompt chunks past every graph (see
        schedule); None (CPU, no graphs): admission fills the token budget."""
        self.faults = faults
        self.prefill_fit = prefill_fit
        self.blocks = blocks
        self.drafts_for = drafts_for
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bs = self.blocks.block_size
        drafting = self.drafts_for is not None
        running = self.running
        i = num_pending = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.pending_stop:
                i += 1  # waiting for its last values; nothing more to compute
                num_pending += 1
                continue
            # _resumes_short, _target and _blocks_for inlined (every request, every step): without a
            # proposer no request resumes short; a request that does not computes all its tokens, and
            # its blocks cover the chunk's end.
            computed = req.num_computed_tokens
            outs = req.output_token_ids
            n_tok = len(req.prompt_token_ids) + len(outs)  # (req.num_tokens)
            short = drafting and bool(outs) and computed < n_tok - 1
            num_new = n_tok - 1 - computed if short else n_tok - computed
            k = len(req.spec_token_ids)
            if k:
                k = max(0, min(k, self.max_num_batched_tokens - num_new, self.max_model_len - req.num_tokens))
                if k and num_new + k > budget:
                    # Drafts are never cut to fit the budget: the request waits a step with all of
                    # them, so its draft schedule does not depend on what else is in the batch.
                    i += 1
                    continue
            num_new += k
            if num_new > budget:
                num_new = budget
            need = self._blocks_for(req, num_new, True) if short else computed + num_new
            if need > len(req.block_ids) * bs and not self._allocate_or_preempt(req, need, out):
                continue  # req itself was preempted; the list shrank
            out.scheduled.append(ScheduledRequest(req, computed, num_new, k))  # (not cached: _preempt replaces it)
            budget -= num_new
            i += 1

        # Requests that wait only for their last values (pending_stop, the overlapped loop) hold no seat:
        # the synchronous loop has finished them already. A step that preempted admits nobody (its
        # victims, at the head of the queue, come back in a later step): in the overlapped loop a
        # victim of this call has the in-flight step's placeholders, so the two loops admit alike.
        seats = self.max_num_seqs + num_pending
        # The step's prompt chunks as the runner splits it (the rows from the first prompt chunk on: runner.py,
        # batch.split_for_graphs): their count and longest chunk, for prefill_fit.
        fit = self.prefill_fit if self.waiting else None  # (no admission: nothing to shape)
        if fit is not None:
            first = next((j for j, x in enumerate(out.scheduled) if x.num_new_tokens - x.num_draft_tokens > 1), None)
            part = out.scheduled[first:] if first is not None else []
            part_rows, part_longest = len(part), max((x.num_new_tokens for x in part), default=0)
        while self.waiting and budget > 0 and len(self.running) < seats and not out.preempted:
            req = self.waiting[0]
            if PLACEHOLDER in req.output_token_ids:
                break  # preempted while a step was in flight: wait for its values
            if not req.block_ids:
                # A request resuming for drafts leaves its last token (and >= 1 more) to compute.
                ids = req.all_token_ids
                hit = self.blocks.lookup_prefix(ids[:-1] if self._resumes_short(req) else ids)
                self.blocks.take_cached(hit)
                req.block_ids = list(hit)
                req.num_computed_tokens = len(hit) * self.blocks.block_size
                req.num_cached_tokens = req.num_computed_tokens
            num_new = min(self._target(req) - req.num_computed_tokens, budget)
            if fit is not None and (num_new > 1 or part_rows):  # (a 1-token prompt after a chunk joins its part)
                # An admission step whose prompt chunks fit a graph replays it (~2-8 ms for the 1.5B on the
                # H200) where one more chunk would make it run eagerly (~15-30 ms of launches): that chunk
                # waits for the next step. The first chunk, and any beside chunks no graph fits anyway, go in.
                longest = max(part_longest, num_new)
                if part_rows and fit(part_rows, part_longest) and not fit(part_rows + 1, longest):
                    self._release(req)
                    break
                part_rows, part_longest = part_rows + 1, longest
            if not self.blocks.allocate(req.block_ids, self._blocks_for(req, num_new)):
                if not self.running:
                    # Nothing else holds blocks: admit a smaller chunk rather than stall forever.
                    room = len(self.blocks.free) * self.blocks.block_size
                    room += len(req.block_ids) * self.blocks.block_size - req.num_computed_tokens
                    num_new = min(num_new, room)
                    if num_new <= 0 or not self.blocks.allocate(req.block_ids, self._blocks_for(req, num_new)):
                        break
                else:
                    self._release(req)
                    break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.spec_token_ids = []
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new, 0))
            budget -= num_new
        if self.faults.active("early_prefix_publish"):
            # The planted bug: hashes published before the K/V of later chunks is written.
            for s in out.scheduled:
                self.blocks.publish(s.request.block_ids, s.request.all_token_ids, s.request.num_tokens)
        return out

    def _resumes_short(self, req: Request) -> bool:
        """True for a request with output tokens that must (re)compute its context before
        drafting: its prefill stops one token short of the end."""
        return self.drafts_for is not None and bool(req.output_token_ids) and req.num_computed_tokens < req.num_tokens - 1

    def _blocks_for(self, req: Request, num_new: int, short: bool | None = None) -> int:
        """Tokens whose blocks a chunk of num_new tokens needs: its own, and when it completes a
        resume, also the drafts that propose() reserves right after the step (admitting it
        without them would only preempt it again once the prefill is done). short: the value
        of _resumes_short(req) when the caller has it."""
        end = req.num_computed_tokens + num_new
        if (self._resumes_short(req) if short is None else short) and end == req.num_tokens - 1:
            return req.num_tokens + self.drafts_for(req)
        return end

    def _target(self, req: Request, short: bool | None = None) -> int:
        """How far the request's known tokens are computed this step (before drafts): all of
        them, or all but the last for a request resuming for drafts (see the module docstring).
        short: the value of _resumes_short(req) when the caller has it."""
        n = req.num_tokens
        return n - 1 if (self._resumes_short(req) if short is None else short) else n

    def _allocate_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow req's blocks to num_tokens, preempting the most recently admitted running
        requests (possibly req itself) until they fit. False if req itself was preempted."""
        while not self.blocks.allocate(req.block_ids, num_tokens):
            # Requests waiting only for their last values (pending_stop) hold no blocks: skip them
            # (the synchronous loop has already finished them).
            victim = next(r for r in reversed(self.running) if not r.pending_stop)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        # A victim scheduled earlier in this step loses its slot in the batch.
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def _release(self, req: Request) -> None:
        self._free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []

    def _free(self, req: Request) -> None:
        self.blocks.free_blocks(req.block_ids)
        req.num_published_blocks = 0

    def _publish(self, req: Request, num_written: int) -> None:
        """Publish the hashes of req's full blocks among its first num_written tokens; the blocks
        it published before are skipped (their hashes cannot change while it holds them)."""
        bs = self.blocks.block_size
        first, n = req.num_published_blocks, min(num_written // bs, len(req.block_ids))
        if n > first:
            self.blocks.publish(req.block_ids, req.token_slice(first * bs, n * bs), n * bs, first)
            req.num_published_blocks = n

    def reserve(self, req: Request, num_tokens: int) -> list[Request]:
        """Blocks for num_tokens (the draft positions a drafter writes before the step that
        verifies them), preempting as schedule() does when they run out, possibly req itself:
        a request never goes without its drafts for lack of blocks. Returns the preempted."""
        if num_tokens <= len(req.block_ids) * self.blocks.block_size:
            return []  # its blocks hold them already (most steps: allocate would take nothing)
        out = SchedulerOutput()
        self._allocate_or_preempt(req, num_tokens, out)
        return out.preempted

    # ---- commit ----------------------------------------------------------------------------
    def commit(self, s: ScheduledRequest, sampled: list[int] | None) -> int:
        """Apply a step's result to one request: advance num_computed_tokens (minus rejected
        drafts), append the emitted tokens, publish written blocks (publish_rule). Returns drafts
        accepted. The overlapped loop commits PLACEHOLDER tokens (counts known, values not) and fills
        the values in later with resolve()."""
        req = s.request
        known = req.num_tokens  # token values known before this step's sampled ones (publish_rule)
        end = s.start + s.num_new_tokens
        if sampled is None:
            req.num_computed_tokens = end
        else:
            num_accepted = len(sampled) - 1
            assert 0 <= num_accepted <= s.num_draft_tokens
            req.num_computed_tokens = end - (s.num_draft_tokens - num_accepted)
        if req.spec_token_ids:
            req.spec_token_ids = []
        self._publish(req, min(req.num_computed_tokens, known))
        if sampled is not None:
            out = req.output_token_ids
            for tok in sampled:
                out.append(tok)
                if tok == PLACEHOLDER:
                    if self._length_reached(req):
                        # Finish once the values arrive; the blocks go back now, as they would
                        # in the synchronous loop.
                        req.pending_stop = True
                        self._free(req)
                        break
                elif self._check_stop(req, tok):
                    break
        return 0 if sampled is None else len(sampled) - 1

    def resolve(self, s: ScheduledRequest, sampled: list[int] | None) -> list[int]:
        """Replace a launched step's placeholders with the collected values, check stops in
        order (dropping anything optimistically appended after a stop), publish written blocks.
        Returns the tokens that became real."""
        req = s.request
        if sampled is None:
            return []
        new: list[int] = []
        out = req.output_token_ids
        n_out, i = len(out), s.output_base  # (out only shrinks right before the loop ends)
        for tok in sampled:
            if i >= n_out:
                break
            assert out[i] == PLACEHOLDER, "resolving a token that is not a placeholder"
            out[i] = tok
            new.append(tok)
            i += 1
            if self._check_stop(req, tok, i):  # as if it were the last one committed
                del out[i:]
                break
        if req.finish_reason is None and req.pending_stop and PLACEHOLDER not in out:
            req.finish_reason = "length"
        return new

    def publish_rest(self, previous: list[ScheduledRequest], current: list[ScheduledRequest]) -> None:
        """After step N's commit, in both loops: publish the blocks of step N-1's requests that step N did
        not schedule (N-1's sampled tokens are known by now); step N's requests published at commit."""
        bs = self.blocks.block_size
        now = None  # the ids of this step's requests, built on the first candidate (rare in steady decode)
        for s in previous:
            req = s.request
            if (req.num_computed_tokens // bs > req.num_published_blocks and req.status is Status.RUNNING
                    and not req.pending_stop and req.finish_reason is None):
                if now is None:
                    now = {id(c.request) for c in current}
                if id(req) not in now:
                    self._publish(req, min(req.num_computed_tokens, self._known(req)))

    def _known(self, req: Request, start: int = 0) -> int:
        """Leading tokens of the request whose values are on the host. start: an output index
        before which the caller knows there is no placeholder (the search begins there)."""
        try:
            return req.num_prompt_tokens + req.output_token_ids.index(PLACEHOLDER, start)
        except ValueError:
            return req.num_tokens

    def length_reached(self, req: Request, n: int) -> bool:
        """True when n output tokens reach the request's max_tokens or the model length."""
        return self._length_reached(req, n)

    def _length_reached(self, req: Request, n: int | None = None) -> bool:
        """True when n output tokens (default: the current count) reach max_tokens or the model
        length. (Request.max_tokens and num_tokens inlined: this runs for every committed token.)"""
        p = req.params
        n = len(req.output_token_ids) if n is None else n
        return n >= (p.max_tokens if p.max_tokens is not None else 1 << 30) or len(req.prompt_token_ids) + n >= self.max_model_len

    def _check_stop(self, req: Request, tok: int, n: int | None = None) -> bool:
        """Stop check for tok as output token n - 1 (default: the last one)."""
        p = req.params
        n = len(req.output_token_ids) if n is None else n
        if n >= p.min_tokens:
            # Under a grammar EOS is its stop token (worker/grammar.py), allowed only where the grammar ends:
            # it ends the request even with ignore_eos, and a speculative step's tokens after it are dropped.
            if tok in req.eos_token_ids and (not p.ignore_eos or req.grammar is not None):
                req.finish_reason, req.stop_reason = "stop", None
                return True
            if tok in p.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", tok
                return True
        if self._length_reached(req, n):
            req.finish_reason = "length"
            return True
        return False

    def finish(self, req: Request, reason: str | None = None) -> None:
        """Remove a request (finished or aborted) and free its blocks."""
        if reason is not None:
            req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
