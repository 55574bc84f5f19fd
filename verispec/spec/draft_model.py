"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens autoregressively.

Its KV cache mirrors the target's paging: the same block ids and block size, in a cache of its own,
so the target's block tables serve both. Per request it keeps `written`: how many leading positions
hold draft K/V for committed tokens. After verification `written` drops to at most the target's
num_computed_tokens (rollback = moving a length; positions past it are overwritten later).
"self" is this proposer with the target model itself (an oracle: greedy acceptance ~100%).
"""

from __future__ import annotations

import torch

from verispec.engine.request import Request
from verispec.engine.scheduler import SchedulerOutput
from verispec.models.qwen2 import CausalLM
from verispec.spec.proposer import Proposal, Proposer
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch
from verispec.worker.sampler import RowParams, probs_from_logits


class DraftModelProposer(Proposer):
    def __init__(self, model: CausalLM, num_speculative_tokens: int, device, dtype, seed: int = 0) -> None:
        super().__init__(num_speculative_tokens)
        self.model = model
        self.device, self.dtype, self.seed = device, dtype, seed
        self.kv_caches: list[torch.Tensor] = []
        self.written: dict[str, int] = {}
        self.generators: dict[str, torch.Generator] = {}

    def bind(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().bind(num_blocks, block_size, max_model_len)
        c = self.model.config
        self.kv_caches = allocate_kv_cache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def free_request(self, request_id: str) -> None:
        self.written.pop(request_id, None)
        self.generators.pop(request_id, None)

    def _written(self, req: Request) -> int:
        w = self.written.get(req.request_id)
        if w is None:
            w = req.num_cached_tokens  # published prefix blocks carry draft K/V too
        return min(w, req.num_computed_tokens)

    @torch.inference_mode()
    def observe(self, sched: SchedulerOutput, result) -> None:
        """Keep the draft cache level with the target for requests still in prefill."""
        todo = []
        for s in sched.scheduled:
            req = s.request
            if req.is_finished or req.num_computed_tokens >= req.num_tokens - 1 or not req.block_ids:
                continue
            w = self._written(req)
            if w < req.num_computed_tokens:
                todo.append((req, req.all_token_ids[w : req.num_computed_tokens], w))
        if todo:
            self._forward([SeqChunk(t, w, r.block_ids) for r, t, w in todo], last_only=True)
            for r, _, _ in todo:
                self.written[r.request_id] = r.num_computed_tokens

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> Proposal:
        out = Proposal()
        reqs = [r for r in requests if self.num_drafts_for(r) > 0]
        if not reqs:
            return out
        ks = {r.request_id: self.num_drafts_for(r) for r in reqs}
        starts = {r.request_id: self._written(r) for r in reqs}
        chunks = [SeqChunk(r.all_token_ids[starts[r.request_id] :], starts[r.request_id], r.block_ids) for r in reqs]
        drafts: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
        active = list(reqs)
        for step in range(max(ks.values())):
            logits = self._forward(chunks, last_only=True)
            toks = self._sample(active, logits, probs)
            nxt_reqs, nxt_chunks = [], []
            for r, t in zip(active, toks, strict=True):
                drafts[r.request_id].append(t)
                pos = r.num_tokens + step
                self.written[r.request_id] = pos  # K/V now written for positions < pos
                if len(drafts[r.request_id]) < ks[r.request_id]:
                    nxt_reqs.append(r)
                    nxt_chunks.append(SeqChunk([t], pos, r.block_ids))
            active, chunks = nxt_reqs, nxt_chunks
            if not active:
                break
        out.token_ids = drafts
        out.probs = {rid: torch.stack(p) for rid, p in probs.items() if p}
        return out

    def _forward(self, chunks: list[SeqChunk], last_only: bool) -> torch.Tensor:
        ids, pos, meta = build_batch(chunks, self.block_size, self.device)
        hidden, _ = self.model(ids, pos, meta, self.kv_caches)
        last = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last])

    def _sample(self, reqs: list[Request], logits: torch.Tensor, probs: dict) -> list[int]:
        if all(r.params.greedy for r in reqs):
            return logits.argmax(-1).tolist()
        vocab = logits.shape[-1]
        dev = logits.device
        rp = RowParams(
            temperature=torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev),
            top_k=torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs], device=dev),
            top_p=torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=dev),
            min_p=torch.tensor([r.params.min_p for r in reqs], dtype=torch.float32, device=dev),
            need_sort=any(r.params.top_k > 0 or r.params.top_p < 1 for r in reqs),
            need_min_p=any(r.params.min_p > 0 for r in reqs),
        )
        p = probs_from_logits(logits, rp)
        toks = []
        for i, r in enumerate(reqs):
            if r.params.greedy:
                toks.append(int(logits[i].argmax()))
                continue
            g = self.generators.get(r.request_id)
            if g is None:
                g = torch.Generator(device=self.device)
                base = r.params.seed if r.params.seed is not None else self.seed * 1_000_003 + r.arrival
                g.manual_seed((base * 7919 + 17) & (2**62 - 1))
                self.generators[r.request_id] = g
            toks.append(int(torch.multinomial(p[i], 1, generator=g)[0]))
            probs[r.request_id].append(p[i])
        return toks
