"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens autoregressively.

Its KV cache mirrors the target's paging: the same block ids and block size, in a cache of its own,
so the target's block tables serve both. Per request it keeps `written`: how many leading positions
hold draft K/V for committed tokens. After verification `written` drops to at most the target's
num_computed_tokens (rollback = moving a length; positions past it are overwritten later).
Drafts stay on the device (Proposal.device); the host gets PLACEHOLDER mirrors, so the overlapped
loop never waits for draft values. "self" is this proposer with the target model itself (an
oracle: greedy acceptance ~100%).

Shapes are kept uniform so the drafter's steps replay CUDA graphs: the catch-up forward that
brings the draft cache level with the target covers the last k + 1 tokens (recomputing K/V of
positions it already holds, which gives the same values), or the last 2^j after steps without
drafts (_catch_up_start), and each further draft step is one token per request. On CUDA (without enforce_eager) bind() captures graphs for both shapes.
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


class DraftModelProposer(Proposer):
    needs_host_tokens = False

    def __init__(self, model: CausalLM, num_speculative_tokens: int, device, dtype, seed: int = 0,
                 graph_max_batch: int = 0) -> None:
        """graph_max_batch > 0: capture CUDA graphs for batches up to that size (CUDA only)."""
        super().__init__(num_speculative_tokens)
        self.model = model
        self.device, self.dtype, self.seed = device, dtype, seed
        self.graph_max_batch = graph_max_batch
        self.graphs = None
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
            from verispec.worker.graphs import CudaGraphRunner

            # Scratch block: the cache's last block, which the engine never hands to a request.
            self.graphs = CudaGraphRunner(self.model, self.kv_caches, self.graph_max_batch, query_lens=(1, 1 + self.k),
                                          block_size=block_size, max_blocks_per_seq=-(-max_model_len // block_size))

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
        tokens are prompt tokens, always known on the host)."""
        todo = []
        for s in sched.scheduled:
            req = s.request
            if req.is_finished or req.num_computed_tokens >= req.num_tokens - 1 or not req.block_ids:
                continue
            w = self._written(req)
            if w < req.num_computed_tokens:
                todo.append((req, w))
        if todo:
            self._forward_chunks([(r, w, r.num_computed_tokens) for r, w in todo], {})
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
        logits = self._forward_chunks([(r, self._catch_up_start(r), r.num_tokens) for r in reqs], sources or {})
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

    def _catch_up_start(self, req: Request) -> int:
        """First position of the catch-up forward: the last k + 1 tokens (uniform shape), or, when the
        draft cache lacks an earlier position (after steps planned without drafts), the last 2^j
        tokens that cover it: catch-up lengths come from a few powers of two, so the eager forwards
        that run them compile a few kernel specializations once instead of one per gap length (each
        a ~1 s stall on the H200, docs/BENCHMARKS.md session 9). Recomputing K/V the cache already
        holds writes the same values."""
        n = req.num_tokens - min(self._written(req), req.num_tokens - (self.k + 1))
        if n > self.k + 1:
            n = 1 << (n - 1).bit_length()
        return max(0, req.num_tokens - n)

    def _forward_chunks(self, items: list[tuple[Request, int, int]], sources: dict) -> torch.Tensor:
        """Forward tokens [start, end) of each request (placeholders combined on the device)."""
        host_ids, owners, chunks = [], [], []
        for r, start, end in items:
            ids = r.all_token_ids[start:end]
            host_ids.extend(ids)
            owners.extend((r.request_id, "out", pos - r.num_prompt_tokens) for pos in range(start, end))
            chunks.append(SeqChunk(ids, start, r.block_ids))
        return self._forward(chunks, combine_inputs(host_ids, owners, sources, self.device, self.faults))

    def _forward(self, chunks: list[SeqChunk], input_ids: torch.Tensor) -> torch.Tensor:
        with_ref = self.model.attn_backend.needs_reference_indices
        _, pos, meta = build_batch(chunks, self.block_size, self.device, token_ids=False, with_reference=with_ref,
                                   staging=self.staging)
        out = self.graphs.run(input_ids, pos, meta, len(chunks), meta.max_query_len) if self.graphs else None
        hidden = out.hidden if out is not None else self.model(input_ids, pos, meta, self.kv_caches)[0]
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
