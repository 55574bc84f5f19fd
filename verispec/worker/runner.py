"""The model runner: owns the model, the KV cache and the generators; turns a scheduled step
into one forward pass and the tokens each request emits (sampled, or verified drafts + one)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.engine.scheduler import ScheduledRequest, SchedulerOutput
from verispec.models.qwen2 import CausalLM
from verispec.spec.verify import verify_greedy, verify_random
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch
from verispec.worker.sampler import RowParams, apply_penalties, probs_from_logits, top_logprobs


@dataclass
class StepResult:
    """What one target step produced, by request id."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Hidden states of the captured layers at every scheduled position (for drafters), and
    # for each request the index of its first token in that flat batch.
    captured: list[torch.Tensor] = field(default_factory=list)
    token_offsets: dict[str, int] = field(default_factory=dict)


class ModelRunner:
    """Runs the target model over the paged KV cache and samples / verifies."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.seed = seed
        self.capture_layers = capture_layers
        self.kv_caches = allocate_kv_cache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device
        )
        self.generators: dict[str, torch.Generator] = {}

    # ---- per-request state -----------------------------------------------------------------
    def generator(self, req_id: str, seed: int | None, arrival: int) -> torch.Generator:
        g = self.generators.get(req_id)
        if g is None:
            g = torch.Generator(device=self.device)
            # Unseeded requests still get a deterministic stream, derived from the engine seed.
            g.manual_seed(seed if seed is not None else (self.seed * 1_000_003 + arrival) & (2**62 - 1))
            self.generators[req_id] = g
        return g

    def free_request(self, req_id: str) -> None:
        self.generators.pop(req_id, None)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, draft_probs: dict[str, torch.Tensor] | None = None
    ) -> StepResult:
        chunks: list[SeqChunk] = []
        logit_rows: list[int] = []
        sampling: list[tuple[ScheduledRequest, int]] = []  # (request, first logits row)
        result = StepResult()
        offset = 0
        for s in sched.scheduled:
            req = s.request
            k = s.num_draft_tokens
            known = req.all_token_ids[s.start : s.start + s.num_new_tokens - k]
            chunks.append(SeqChunk(known + req.spec_token_ids[:k], s.start, req.block_ids))
            result.token_offsets[req.request_id] = offset
            offset += s.num_new_tokens
            if s.needs_sample:
                sampling.append((s, len(logit_rows)))
                logit_rows.extend(range(offset - k - 1, offset))
        input_ids, positions, meta = build_batch(chunks, self.block_size, self.device)
        hidden, captured = self.model(input_ids, positions, meta, self.kv_caches, self.capture_layers)
        result.captured = captured
        if not sampling:
            return result
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        self._mask_and_penalize(logits, sampling)
        self._sample(logits, sampling, draft_probs or {}, result)
        return result

    def _mask_and_penalize(self, logits: torch.Tensor, sampling) -> None:
        """min_tokens (no EOS / stop ids before it) and repetition/presence/frequency penalties.
        Row j of a request stands for output index len(output) + j; drafts before it count."""
        pen_rows, pen_prompt, pen_out, pres, freq, rep = [], [], [], [], [], []
        for s, r0 in sampling:
            req, p = s.request, s.request.params
            drafts = req.spec_token_ids[: s.num_draft_tokens]
            for j in range(s.num_draft_tokens + 1):
                n_out = len(req.output_token_ids) + j
                if n_out < p.min_tokens:
                    banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
                    if banned:
                        logits[r0 + j, banned] = float("-inf")
                if p.needs_penalties:
                    pen_rows.append(r0 + j)
                    pen_prompt.append(req.prompt_token_ids)
                    pen_out.append(req.output_token_ids + drafts[:j])
                    pres.append(p.presence_penalty)
                    freq.append(p.frequency_penalty)
                    rep.append(p.repetition_penalty)
        if pen_rows:
            apply_penalties(logits, pen_rows, pen_prompt, pen_out, pres, freq, rep)

    def _sample(self, logits: torch.Tensor, sampling, draft_probs, result: StepResult) -> None:
        all_greedy = all(s.request.params.greedy for s, _ in sampling)
        if all_greedy:
            argmax = logits.argmax(-1).tolist()  # the step's one host sync
        else:
            probs = probs_from_logits(logits, self._row_params(sampling, logits.shape[-1]))
            argmax = None
        for s, r0 in sampling:
            req = s.request
            k = s.num_draft_tokens
            drafts = req.spec_token_ids[:k]
            if req.params.greedy:
                am = argmax[r0 : r0 + k + 1] if argmax is not None else logits[r0 : r0 + k + 1].argmax(-1).tolist()
                toks = verify_greedy(am, drafts)
            else:
                g = self.generator(req.request_id, req.params.seed, req.arrival)
                q = draft_probs.get(req.request_id) if k else None
                toks = verify_random(probs[r0 : r0 + k + 1], drafts, q, g)
            result.sampled[req.request_id] = toks
            if req.params.logprobs is not None:
                n = len(toks)
                t = torch.tensor(toks, device=logits.device)
                chosen, top_v, top_i = top_logprobs(logits[r0 : r0 + n], t, req.params.logprobs)
                entries = []
                for j in range(n):
                    d = {int(i): float(v) for i, v in zip(top_i[j, : req.params.logprobs].tolist(), top_v[j].tolist(), strict=False)}
                    d[toks[j]] = float(chosen[j])
                    entries.append(d)
                result.logprobs[req.request_id] = entries

    def _row_params(self, sampling, vocab: int) -> RowParams:
        temp, top_k, top_p, min_p = [], [], [], []
        for s, _ in sampling:
            p = s.request.params
            n = s.num_draft_tokens + 1
            temp += [p.temperature] * n
            top_k += [p.top_k if p.top_k > 0 else vocab] * n
            top_p += [p.top_p] * n
            min_p += [p.min_p] * n
        dev = self.device
        return RowParams(
            temperature=torch.tensor(temp, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_k, dtype=torch.long, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=dev),
            need_sort=any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p),
            need_min_p=any(m > 0 for m in min_p),
        )
