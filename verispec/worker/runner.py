"""The model runner: owns the model, the KV cache and the generators; turns a scheduled step into
one forward pass plus verification, entirely on the device.

launch() returns a StepHandle without waiting for the device; its results reach the host through
non-blocking copies that collect() waits for. The synchronous loop collects at once; the
overlapped loop schedules the next step first. Input ids that the host only knows as PLACEHOLDER
are combined on the device from DeviceTokens (token_state.py); the verifier reads drafts from the
device input ids, never from the host mirror.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import torch

from verispec.engine import faults
from verispec.engine.scheduler import ScheduledRequest, SchedulerOutput
from verispec.models.layers.attention import reference_attention
from verispec.models.qwen2 import CausalLM
from verispec.spec.verify import rejection_sample, verify_greedy, verify_random
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch
from verispec.worker.sampler import RowParams, apply_penalties, probs_from_logits, row_params, top_logprobs
from verispec.worker.token_state import PLACEHOLDER, DeviceTokens, check_fresh, combine_inputs


@dataclass
class StepResult:
    """What one target step produced, by request id (host values, after collect())."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Hidden states of the captured layers at every scheduled position (for drafters), and
    # for each request the index of its first token in that flat batch.
    captured: list[torch.Tensor] = field(default_factory=list)
    token_offsets: dict[str, int] = field(default_factory=dict)
    audit_mismatches: int = 0
    audited: int = 0


@dataclass
class StepHandle:
    """A launched step. Device tensors are the truth; host_* are mirrors valid after collect()."""

    sched: SchedulerOutput
    sampling: list[tuple[ScheduledRequest, int]]
    sampled_dev: torch.Tensor | None  # [S, K+1] long, PLACEHOLDER past each row's count
    num_sampled_dev: torch.Tensor | None  # [S]
    host_sampled: torch.Tensor | None  # mirror of sampled_dev (stale until collect)
    host_num_sampled: torch.Tensor | None
    event: object | None
    logits: torch.Tensor | None
    captured: list[torch.Tensor]
    token_offsets: dict[str, int]
    audit: dict | None = None
    collected: StepResult | None = None

    def device_tokens(self) -> DeviceTokens | None:
        """This step's sampled tokens as a device buffer keyed by request id (output indices)."""
        if self.sampled_dev is None:
            return None
        rows = {s.request.request_id: i for i, (s, _) in enumerate(self.sampling)}
        base = {s.request.request_id: s.output_base for s, _ in self.sampling}
        return DeviceTokens(self.sampled_dev, rows, base)

    def counts(self) -> list[int]:
        """Tokens each sampling request emitted (1 + accepted drafts). Syncs on the counts only."""
        if self.num_sampled_dev is None:
            return []
        return self.num_sampled_dev.tolist()


def sample_key(req, engine_seed: int, index: int, salt: int = 0) -> int:
    """Seed for the sampling event at a request's output index (salt separates drafters)."""
    base = req.params.seed if req.params.seed is not None else engine_seed * 1_000_003 + zlib.crc32(req.request_id.encode())
    return (base * 6_364_136_223 + index * 1_442_695_041 + salt * 97_531) & (2**62 - 1)


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
        audit_rate: float = 0.0,
        graph_options: dict | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.seed = seed
        self.capture_layers = capture_layers
        self.kv_caches = allocate_kv_cache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.generators: dict[str, torch.Generator] = {}
        self.audit_rate = audit_rate
        self._audit_rng = random.Random(seed)
        self.graphs = None
        if device.type == "cuda":
            from verispec.kernels.fused import enable_triton

            enable_triton(model)  # Triton attention, norms, rotary, SiLU-mul; the CPU path stays torch
            if graph_options is not None:
                from verispec.worker.graphs import CudaGraphRunner

                # The last cache block is the graphs' scratch block (never given to a request).
                self.graphs = CudaGraphRunner(model, self.kv_caches, block_size=block_size,
                                              capture_layers=capture_layers, **graph_options)

    # ---- per-request state -----------------------------------------------------------------
    def generator(self, req, index: int, salt: int = 0) -> torch.Generator:
        """The generator for one sampling event of a request, keyed by its output index (not by
        how many times it was sampled), so preemption or a different batch never shifts the
        random stream. Unseeded requests derive their key from the engine seed and request id."""
        g = self.generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            self.generators[req.request_id] = g
        g.manual_seed(sample_key(req, self.seed, index, salt))
        return g

    def free_request(self, req_id: str) -> None:
        self.generators.pop(req_id, None)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        draft_probs: dict[str, torch.Tensor],
        sources: dict[str, DeviceTokens | None],
    ) -> StepHandle:
        chunks: list[SeqChunk] = []
        host_ids: list[int] = []
        owners: list[tuple[str, str, int] | None] = []
        logit_rows: list[int] = []
        draft_pos: list[list[int]] = []
        sampling: list[tuple[ScheduledRequest, int]] = []
        offsets: dict[str, int] = {}
        for s in sched.scheduled:
            req = s.request
            k = s.num_draft_tokens
            n_known = s.num_new_tokens - k
            known = req.all_token_ids[s.start : s.start + n_known]
            drafts = req.spec_token_ids[:k]
            chunk_ids = known + drafts
            offset = len(host_ids)
            offsets[req.request_id] = offset
            host_ids.extend(chunk_ids)
            p = req.num_prompt_tokens
            owners.extend((req.request_id, "out", pos - p) for pos in range(s.start, s.start + n_known))
            owners.extend((req.request_id, "draft", j) for j in range(k))
            chunks.append(SeqChunk(chunk_ids, s.start, req.block_ids))
            if s.needs_sample:
                s.output_base = len(req.output_token_ids)
                sampling.append((s, len(logit_rows)))
                end = offset + s.num_new_tokens
                logit_rows.extend(range(end - k - 1, end))
                draft_pos.append(list(range(end - k, end)))
        with_ref = self.model.attn_fn is reference_attention
        _, positions, meta = build_batch(chunks, self.block_size, self.device, token_ids=False, with_reference=with_ref)
        if faults.active("row_by_position") and sources.get("out") is not None:
            # The bug: the previous step's rows looked up by this step's batch position, which
            # differs from the producing step's row once a request ahead has finished.
            prev = sources["out"]
            order = [s.request.request_id for s in sched.scheduled]
            rows = {rid: min(i, prev.values.shape[0] - 1) for i, rid in enumerate(order)}
            sources = {**sources, "out": DeviceTokens(prev.values, rows, prev.base)}
        input_ids = combine_inputs(host_ids, owners, sources, self.device)
        out = self.graphs.run(input_ids, positions, meta, len(chunks), meta.max_query_len) if self.graphs else None
        if out is not None:
            hidden, captured = out.hidden, out.captured
        else:
            hidden, captured = self.model(input_ids, positions, meta, self.kv_caches, self.capture_layers)
        handle = StepHandle(sched, sampling, None, None, None, None, None, None, captured, offsets)
        if not sampling:
            return handle
        rows = torch.tensor(logit_rows, dtype=torch.long).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden[rows])
        self._mask_and_penalize(logits, sampling)
        drafts = self._draft_tensor(input_ids, host_ids, draft_pos)
        if self.audit_rate > 0:
            # The audit re-verifies against the drafts the device actually fed the model.
            true_drafts = self._draft_tensor(input_ids, host_ids, draft_pos, honest=True)
            handle.audit = self._maybe_audit(sampling, logits, true_drafts, draft_probs)
        tokens, counts = self._verify(logits, sampling, drafts, draft_probs)
        handle.sampled_dev, handle.num_sampled_dev, handle.logits = tokens, counts, logits
        if self.device.type == "cuda":
            handle.host_sampled = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            handle.host_num_sampled = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            handle.host_sampled.copy_(tokens, non_blocking=True)
            handle.host_num_sampled.copy_(counts, non_blocking=True)
            handle.event = torch.cuda.Event()
            handle.event.record()
        else:
            handle.host_sampled, handle.host_num_sampled = tokens.clone(), counts.clone()
        return handle

    def _draft_tensor(
        self, input_ids: torch.Tensor, host_ids: list[int], draft_pos: list[list[int]], honest: bool = False
    ) -> torch.Tensor:
        """[S, Kmax] drafts of each sampling request, read from the device input ids (padded with -2)."""
        kmax = max((len(p) for p in draft_pos), default=0)
        idx = [p + [-1] * (kmax - len(p)) for p in draft_pos]
        if faults.active("stale_host_draft") and not honest:
            # The bug: drafts taken from the host mirror of the input ids (placeholders when the
            # drafts were produced on the device).
            src = torch.tensor(host_ids + [-2], dtype=torch.long).to(self.device)
        else:
            src = torch.cat([input_ids, input_ids.new_full((1,), -2)])
        return src[torch.tensor(idx, dtype=torch.long).reshape(len(draft_pos), kmax).to(self.device)]

    def _verify(self, logits, sampling, drafts: torch.Tensor, draft_probs) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy and rejection-sampled verification on the device; no host sync."""
        num = len(sampling)
        kmax = drafts.shape[1]
        dev = logits.device
        ks = torch.tensor([s.num_draft_tokens for s, _ in sampling], device=dev)
        r0 = torch.tensor([r for _, r in sampling], device=dev)
        cols = torch.arange(kmax + 1, device=dev)
        row_idx = r0[:, None] + torch.minimum(cols[None, :], ks[:, None])  # [S, K+1]
        argmax = logits.argmax(-1)[row_idx]
        match = (argmax[:, :kmax] == drafts) & (cols[None, :kmax] < ks[:, None])
        num_acc = match.long().cumprod(-1).sum(-1) if kmax else torch.zeros(num, dtype=torch.long, device=dev)
        tokens = argmax.clone()
        random_rows = [i for i, (s, _) in enumerate(sampling) if not s.request.params.greedy]
        if random_rows:
            probs = probs_from_logits(logits, self._row_params(sampling, logits.shape[-1]))
            for i in random_rows:
                s, r = sampling[i]
                k = s.num_draft_tokens
                req = s.request
                g = self.generator(req, len(req.output_token_ids))
                q = draft_probs.get(req.request_id) if k else None
                u = torch.rand(1, k, generator=g, device=dev)
                a, dist = rejection_sample(probs[r : r + k + 1][None], drafts[i : i + 1, :k], None if q is None else q[None, :k], u)
                last = torch.multinomial(dist[0], 1, generator=g)
                row = torch.cat([drafts[i, :k], drafts.new_zeros(kmax + 1 - k)])
                row.scatter_(0, a, last)
                tokens[i] = row
                num_acc[i] = a[0]
        tokens = torch.where(cols[None, :] <= num_acc[:, None], tokens, torch.full_like(tokens, PLACEHOLDER))
        return tokens, num_acc + 1

    def collect(self, h: StepHandle) -> StepResult:
        """Wait for the step's copies and return host values (fills the host mirrors)."""
        if h.collected is not None:
            return h.collected
        res = StepResult(captured=h.captured, token_offsets=h.token_offsets)
        if h.sampled_dev is not None:
            if h.event is not None:
                h.event.synchronize()
            toks = h.host_sampled.tolist()
            counts = h.host_num_sampled.tolist()
            for i, (s, _) in enumerate(h.sampling):
                res.sampled[s.request.request_id] = toks[i][: counts[i]]
            self._logprobs(h, res)
            if h.audit is not None:
                res.audited, res.audit_mismatches = self._check_audit(h.audit, res)
        h.collected = res
        return res

    # ---- helpers ---------------------------------------------------------------------------
    def _logprobs(self, h: StepHandle, res: StepResult) -> None:
        for s, r0 in h.sampling:
            req = s.request
            if req.params.logprobs is None:
                continue
            toks = res.sampled[req.request_id]
            n, want = len(toks), req.params.logprobs
            t = torch.tensor(toks, device=h.logits.device)
            chosen, top_v, top_i = top_logprobs(h.logits[r0 : r0 + n], t, want)
            entries = []
            for j in range(n):
                d = {int(i): float(v) for i, v in zip(top_i[j, :want].tolist(), top_v[j, :want].tolist(), strict=True)}
                d[toks[j]] = float(chosen[j])
                entries.append(d)
            res.logprobs[req.request_id] = entries

    def _maybe_audit(self, sampling, logits, drafts, draft_probs) -> dict | None:
        """Runtime acceptance audit: for a sampled fraction of speculative steps, keep what the
        synchronous host path needs to re-verify this step after collect()."""
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
            entry = {"id": req.request_id, "k": k, "drafts": drafts[i, :k].clone(), "logits": logits[r0 : r0 + k + 1].clone()}
            if not req.params.greedy:
                entry["gen"] = self.generator(req, len(req.output_token_ids))
                entry["gen_state"] = entry["gen"].get_state()
                entry["q"] = draft_probs.get(req.request_id)
                entry["s"] = s
            rows.append(entry)
        return {"rows": rows, "sampling": sampling}

    def _check_audit(self, audit: dict, res: StepResult) -> tuple[int, int]:
        mismatches = 0
        for e in audit["rows"]:
            drafts = e["drafts"].tolist()
            if "gen" not in e:
                want = verify_greedy(e["logits"].argmax(-1).tolist(), drafts)
            else:
                p = probs_from_logits(e["logits"], self._row_params([(e["s"], 0)], e["logits"].shape[-1]))
                e["gen"].set_state(e["gen_state"])
                want = verify_random(p, drafts, e["q"], e["gen"])
            mismatches += int(want != res.sampled[e["id"]])
        return len(audit["rows"]), mismatches

    def _mask_and_penalize(self, logits: torch.Tensor, sampling) -> None:
        """min_tokens (no EOS / stop ids before it) and repetition/presence/frequency penalties.
        Row j of a request stands for output index len(output) + j; drafts before it count."""
        pen_rows, pen_prompt, pen_out, pres, freq, rep = [], [], [], [], [], []
        for s, r0 in sampling:
            req, p = s.request, s.request.params
            for j in range(s.num_draft_tokens + 1):
                n_out = len(req.output_token_ids) + j
                if n_out < p.min_tokens:
                    banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
                    banned = [t for t in banned if t < logits.shape[-1]]
                    if banned:
                        logits[r0 + j, banned] = float("-inf")
                if p.needs_penalties:
                    drafts = check_fresh(req.spec_token_ids[: s.num_draft_tokens], "spec_token_ids")
                    pen_rows.append(r0 + j)
                    pen_prompt.append(req.prompt_token_ids)
                    pen_out.append(check_fresh(req.output_token_ids, "output_token_ids") + drafts[:j])
                    pres.append(p.presence_penalty)
                    freq.append(p.frequency_penalty)
                    rep.append(p.repetition_penalty)
        if pen_rows:
            apply_penalties(logits, pen_rows, pen_prompt, pen_out, pres, freq, rep)
            torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)

    def _row_params(self, sampling, vocab: int) -> RowParams:
        params = [s.request.params for s, _ in sampling]
        return row_params(params, [s.num_draft_tokens + 1 for s, _ in sampling], vocab, self.device)
