"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens autoregressively.

Its KV cache mirrors the target's paging: the same block ids and block size, in a cache of its own,
so the target's block tables serve both. Per request it keeps `written`: how many leading positions
hold draft K/V for committed tokens. After verification `written` drops to at most the target's
num_computed_tokens (rollback = moving a length; positions past it are overwritten later).
Drafts stay on the device (Proposal.device); the host gets PLACEHOLDER mirrors, so the overlapped
loop never waits for draft values. "self" is this proposer with the target model itself (an
oracle: greedy acceptance ~100%).

Shapes are kept uniform so the drafter's steps replay CUDA graphs (bind(), on CUDA without
enforce_eager; the longer catch-up shapes on first use where the engine captures lazily): each further draft step is one token per request, and the catch-up
forward that brings the draft cache level with the target gives every request of the step the same
query length (recomputing K/V of positions the cache already holds, which writes the same values, or
padding in front where a request has fewer tokens): k + 1 in the steady state (the last verify's
tokens), else the smallest power of two up to `catch_up_max` that covers the largest gap, which steps
planned at k = 0 leave (the draft cache is not kept up while nothing drafts: a k = 0 step costs the
drafter nothing, and the first drafting step after it pays one forward for the gap). Gaps beyond
catch_up_max take several such forwards, and batches beyond catch_up_batch run in groups of it, so
that a catch-up never meets a shape first at run time (an eager forward of a new shape compiles
kernels mid-run: ~1 s stalls on the H200, docs/BENCHMARKS.md sessions 9-10). observe()'s catch-up of a
prompt chunked over several steps takes the same shapes where there are graphs. `num_graph_forwards`
and `num_eager_forwards` count the drafter's forwards.
"""

from __future__ import annotations

import torch

from verispec.core.placeholder import PLACEHOLDER
from verispec.core.request import Request
from verispec.core.scheduler_output import SchedulerOutput
from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.proposer import Proposal, Proposer
from verispec.worker.inputs import SeqChunk, Staging, allocate_kv_cache, build_batch, to_device
from verispec.worker.sampler import argmax, probs_from_logits, row_params
from verispec.worker.sampling_keys import RequestGenerators
from verispec.worker.token_state import DeviceTokens, combine_inputs

CATCH_UP_MAX = 256  # the longest catch-up forward, tokens per request (probe gaps reach ~130: policy.py)
CATCH_UP_BATCH = 16  # catch-up graphs longer than k + 1 are captured up to this batch size


def catch_up_lens(k: int, longest: int = CATCH_UP_MAX) -> tuple[int, ...]:
    """The query lengths of catch-up forwards: k + 1, then each power of two above it up to `longest`."""
    lens, n = [k + 1], 1 << (k + 1).bit_length()
    while n <= longest:
        lens.append(n)
        n *= 2
    return tuple(lens)


class DraftModelProposer(Proposer):
    needs_host_tokens = False

    def __init__(self, model: CausalLM, num_speculative_tokens: int, device, dtype, seed: int = 0,
                 graph_max_batch: int = 0, catch_up_max: int = CATCH_UP_MAX, catch_up_batch: int = CATCH_UP_BATCH,
                 lazy_catch_up: bool = False) -> None:
        """graph_max_batch > 0: capture CUDA graphs for batches up to that size (CUDA only). catch_up_max,
        catch_up_batch: the longest catch-up forward and the batch size catch-ups longer than k + 1 run in
        (module docstring). lazy_catch_up: capture those longer catch-up shapes on first use (the engine's
        graph_capture="lazy"), not all at bind."""
        super().__init__(num_speculative_tokens)
        if catch_up_max < 1 or catch_up_batch < 1:
            raise ValueError(f"catch_up_max and catch_up_batch must be >= 1, got {catch_up_max}, {catch_up_batch}")
        self.model = model
        self.device, self.dtype, self.seed = device, dtype, seed
        self.graph_max_batch = graph_max_batch
        self.catch_up_lens = catch_up_lens(num_speculative_tokens, catch_up_max)
        self.catch_up_batch, self.lazy_catch_up = catch_up_batch, lazy_catch_up
        self.graphs = None  # decode (1) and steady catch-up (1 + k) shapes, up to graph_max_batch
        self.catch_up_graphs = None  # the longer catch-up shapes, up to catch_up_batch
        self.num_graph_forwards = self.num_eager_forwards = 0
        self.kv_caches: list[torch.Tensor] = []
        self.written: dict[str, int] = {}
        # Draft draws are keyed by the drafted output index (salt 1: apart from the verifier's).
        self.generators = RequestGenerators(device, seed, salt=1)

    def bind(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().bind(num_blocks, block_size, max_model_len)
        c = self.model.config
        self.kv_caches = allocate_kv_cache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)
        # One pinned copy per forward; a ring of 2k + 2 slots, so the host fills one while the
        # device still reads the inputs of a whole propose() and the next one's catch-up.
        self.staging = Staging(torch.device(self.device), slots=2 * self.k + 2)
        if self.graph_max_batch > 0 and torch.device(self.device).type == "cuda":
            self.make_graphs()

    def make_graphs(self, capture: bool = True) -> None:
        """The drafter's graph runners over its cache (after bind): every shape a draft step or a
        catch-up can take, captured now (the longer catch-ups on first use with lazy_catch_up).
        capture=False: the runners' eager mode over the same static buffers (CPU tests of the graph path)."""
        from verispec.worker.graphs import CudaGraphRunner

        # Scratch block: the cache's last block, which the engine never hands to a request.
        common = dict(block_size=self.block_size, max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                      capture=capture)
        batch = max(1, self.graph_max_batch)
        self.graphs = CudaGraphRunner(self.model, self.kv_caches, batch, query_lens=(1, 1 + self.k), **common)
        if len(self.catch_up_lens) > 1:
            self.catch_up_graphs = CudaGraphRunner(self.model, self.kv_caches, min(batch, self.catch_up_batch),
                                                   query_lens=self.catch_up_lens[1:], lazy=self.lazy_catch_up,
                                                   **common)

    def free_request(self, request_id: str) -> None:
        self.written.pop(request_id, None)
        self.generators.free(request_id)

    def _written(self, req: Request) -> int:
        w = self.written.get(req.request_id)
        if w is None:
            w = req.num_cached_tokens  # published prefix blocks carry draft K/V too
        return min(w, req.num_computed_tokens)

    @torch.inference_mode()
    def observe(self, sched: SchedulerOutput, result) -> None:
        """Keep the draft cache level with the target for requests still in prefill (their
        tokens are prompt tokens, always known on the host), and roll back the draft K/V of a verified
        step's rejected drafts now: the next drafting step may come many steps later (steps planned at
        k = 0), when num_computed_tokens no longer marks where this step's accepted drafts ended."""
        todo = []
        written = self.written
        for s in sched.scheduled:
            req = s.request
            if s.num_draft_tokens:
                w = written.get(req.request_id)
                if w is not None and w > req.num_computed_tokens:
                    written[req.request_id] = req.num_computed_tokens
            if req.is_finished or req.num_computed_tokens >= req.num_tokens - 1 or not req.block_ids:
                continue
            w = self._written(req)
            if w < req.num_computed_tokens:
                todo.append((req, w))
        if todo:
            if self.graphs is None or not self._graph_prefill(todo):
                self._prefill_chunks([(r, w, r.num_computed_tokens) for r, w in todo])
            for r, _ in todo:
                self.written[r.request_id] = r.num_computed_tokens

    @torch.inference_mode()
    def propose(self, requests: list[Request], sources: dict | None = None) -> Proposal:
        out = Proposal()
        reqs = [r for r in requests if self.num_drafts_for(r) > 0]
        if not reqs:
            return out
        ks = [self.num_drafts_for(r) for r in reqs]
        kmax = max(ks)
        logits = self._catch_up(reqs, sources or {})
        drafts = torch.full((len(reqs), kmax), PLACEHOLDER, dtype=torch.long, device=self.device)
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
        active = list(range(len(reqs)))
        for step in range(kmax):
            toks = self._sample([reqs[i] for i in active], logits, probs, step)  # device [len(active)]
            if len(active) == len(reqs):
                drafts[:, step] = toks
            else:
                drafts[to_device(active, torch.long, self.device), step] = toks
            nxt = []
            for j, i in enumerate(active):
                self.written[reqs[i].request_id] = reqs[i].num_tokens + step
                if step + 1 < ks[i]:
                    nxt.append((i, j))
            if not nxt:
                break
            if len(nxt) < len(active):
                toks = toks[to_device([j for _, j in nxt], torch.long, self.device)]
            active = [i for i, _ in nxt]
            chunks = [SeqChunk([0], reqs[i].num_tokens + step, reqs[i].block_ids) for i in active]
            logits = self._forward(chunks, toks)
        out.device = DeviceTokens(drafts, {r.request_id: i for i, r in enumerate(reqs)}, {r.request_id: 0 for r in reqs})
        out.token_ids = {r.request_id: [PLACEHOLDER] * k for r, k in zip(reqs, ks, strict=True)}
        out.probs = {rid: torch.stack(p) for rid, p in probs.items() if p}
        return out

    def _catch_up(self, reqs: list[Request], sources: dict) -> torch.Tensor:
        """Bring the draft cache level with each request's tokens; the logits [len(reqs), V] at each one's
        last token. One forward of k + 1 tokens per request in the steady state; after a gap (steps
        planned without drafts) groups of catch_up_batch requests, each in forwards of one length from
        catch_up_lens, the last of which ends at every request's last token (module docstring)."""
        needs = [r.num_tokens - self._written(r) for r in reqs]
        steady = self.catch_up_lens[0]
        if max(needs) <= steady:
            return self._forward_chunks([(r, steady, r.num_tokens) for r in reqs], sources)
        out = self._grouped_forwards(reqs, [r.num_tokens for r in reqs], needs, sources, logits=True)
        return out[0] if len(out) == 1 else torch.cat(out)

    def _catch_up_len(self, need: int) -> int:
        """The length of the catch-up forwards that cover a gap of `need` tokens (the longest, in rounds,
        past catch_up_max)."""
        return next((x for x in self.catch_up_lens if x >= need), self.catch_up_lens[-1])

    def _grouped_forwards(self, reqs: list[Request], ends: list[int], needs: list[int], sources: dict,
                          logits: bool) -> list[torch.Tensor | None]:
        """Catch-up forwards in the graphs' shapes: groups of catch_up_batch requests, each group in rounds
        of one catch_up_lens length, the last round ending at each request's ends[i] and earlier rounds
        only for requests whose gap (needs[i]) reaches that far back. Per group, the logits of its last
        round at each request's last token (logits=True) or None."""
        out = []
        for g in range(0, len(reqs), self.catch_up_batch):
            group, g_ends, g_needs = (x[g : g + self.catch_up_batch] for x in (reqs, ends, needs))
            need = max(g_needs)
            n = self._catch_up_len(need)
            rounds = -(-need // n)
            res = None
            for j in range(rounds):
                back = (rounds - 1 - j) * n  # tokens after this forward's chunk
                items = [(r, n, e - back) for r, e, d in zip(group, g_ends, g_needs, strict=True) if d > back]
                res = self._forward_chunks(items, sources, logits=logits and j == rounds - 1)
            out.append(res)
        return out

    def _graph_prefill(self, todo: list[tuple[Request, int]]) -> bool:
        """observe()'s prompt catch-up in the graphs' shapes (with graphs): _grouped_forwards ending at every
        request's num_computed_tokens (recomputing positions the cache holds writes the same values).
        An admission wave chunked over several steps ran one eager drafter forward per step (~10-20 ms
        of launches for the 0.5B on the H200, at batch 64 where nothing drafts: docs/BENCHMARKS.md,
        session 13). Returns False, forwarding nothing, where the padded shapes would compute more than
        twice the chunks' tokens (chunks of very different lengths): the caller runs them eagerly then."""
        needs = [r.num_computed_tokens - w for r, w in todo]
        cb = self.catch_up_batch
        padded = 0
        for g in range(0, len(todo), cb):
            need = max(needs[g : g + cb])
            n = self._catch_up_len(need)
            padded += -(-need // n) * n * len(needs[g : g + cb])
        if padded > 2 * sum(needs):
            return False
        reqs = [r for r, _ in todo]
        self._grouped_forwards(reqs, [r.num_computed_tokens for r in reqs], needs, {}, logits=False)
        return True

    def _forward_chunks(self, items: list[tuple[Request, int, int]], sources: dict,
                        logits: bool = True) -> torch.Tensor | None:
        """Forward tokens [end - n, end) of each (request, n, end) (padded in front where end < n;
        placeholders combined on the device); the logits at each chunk's last token (logits=True)."""
        host_ids, owners, chunks = [], [], []
        for r, n, end in items:
            start = max(0, end - n)
            pad = n - (end - start)
            ids = r.all_token_ids[start:end]
            host_ids.extend([0] * pad)
            owners.extend([None] * pad)
            host_ids.extend(ids)
            owners.extend((r.request_id, "out", pos - r.num_prompt_tokens) for pos in range(start, end))
            chunks.append(SeqChunk(ids, start, r.block_ids, pad))
        return self._forward(chunks, combine_inputs(host_ids, owners, sources, self.device, self.faults), logits)

    def _prefill_chunks(self, items: list[tuple[Request, int, int]]) -> None:
        """Forward prompt tokens [start, end) of each (request, start, end): observe()'s catch-up."""
        host_ids, owners, chunks = [], [], []
        for r, start, end in items:
            ids = r.all_token_ids[start:end]
            host_ids.extend(ids)
            owners.extend((r.request_id, "out", pos - r.num_prompt_tokens) for pos in range(start, end))
            chunks.append(SeqChunk(ids, start, r.block_ids))
        self._forward(chunks, combine_inputs(host_ids, owners, {}, self.device, self.faults), logits=False)

    def _forward(self, chunks: list[SeqChunk], input_ids: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        """One drafter forward over the chunks: a graph replay where a captured shape fits, else eager;
        the logits at each chunk's last token, or None (logits=False)."""
        # (the backend picks the step's attention path, as for the target's steps: CPUBackend's C kernel)
        _, pos, meta = build_batch(chunks, self.block_size, self.device, token_ids=False, staging=self.staging,
                                   backend=self.model.attn_backend)
        out = None
        for graphs in (self.graphs, self.catch_up_graphs):
            if graphs is not None and out is None:
                out = graphs.run(input_ids, pos, meta, len(chunks), meta.max_query_len)
        if out is not None:
            self.num_graph_forwards += 1
            hidden = out.hidden
        else:
            self.num_eager_forwards += 1
            hidden = self.model(input_ids, pos, meta, self.kv_caches)[0]
        if not logits:
            return None
        if meta.max_query_len > 1:  # one token per chunk: every row is the chunk's last
            hidden = hidden[meta.query_start_loc[1:].long() - 1]
        return self.model.compute_logits(hidden)

    def _sample(self, reqs: list[Request], logits: torch.Tensor, probs: dict, step: int) -> torch.Tensor:
        toks = argmax(logits)
        if all(r.params.greedy for r in reqs):
            return toks
        rp = row_params([r.params for r in reqs], [1] * len(reqs), logits.shape[-1], logits.device)
        p = probs_from_logits(logits, rp)
        for i, r in enumerate(reqs):
            if r.params.greedy:
                continue
            # Keyed by the drafted output index, so re-drafting a position draws the same token.
            g = self.generators.at(r, len(r.output_token_ids) + step)
            toks[i] = torch.multinomial(p[i], 1, generator=g)[0]
            probs[r.request_id].append(p[i])
        return toks
