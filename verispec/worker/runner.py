"""The model runner: owns the model, the KV cache and the generators; turns a scheduled step into
one forward pass plus verification, entirely on the device.

launch() returns a StepHandle without waiting for the device; its results reach the host through
non-blocking copies that collect() waits for. The synchronous loop collects at once; the
overlapped loop schedules the next step first. Input ids that the host only knows as PLACEHOLDER
are combined on the device from DeviceTokens (token_state.py); the verifier reads drafts from the
device input ids, never from the host mirror.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from verispec.attention.reference import build_reference_indices, reference_attention
from verispec.core.attention_metadata import AttentionMetadata
from verispec.core.faults import NO_FAULTS, Faults
from verispec.core.placeholder import PLACEHOLDER
from verispec.core.sampling_params import any_params
from verispec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from verispec.kernels.argmax import argmax_rows
from verispec.models.qwen2 import CausalLM
from verispec.worker import graphs as graphs_mod
from verispec.worker.inputs import Staging, allocate_kv_cache, extend_slots, padded_tables, to_device
from verispec.worker.sampler import (
    RowParams,
    apply_penalties,
    argmax,
    probs_from_logits,
    row_params,
    top_logprobs,
    triton_argmax_ok,
)
from verispec.worker.sampling_keys import sample_key
from verispec.worker.token_state import DeviceTokens, Owner, Placeholders, fill_placeholders, gather_plan
from verispec.worker.verify import rejection_sample, verify_greedy, verify_random


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
    """A launched step. Device tensors are the truth; `host` is their mirror, valid after collect()
    (or after counts(), which waits for the same copy)."""

    sched: SchedulerOutput
    sampling: list[tuple[ScheduledRequest, int]]
    captured: list[torch.Tensor]
    token_offsets: dict[str, int]
    # The results on the device, packed: [S*W tokens (PLACEHOLDER past each count) | S counts].
    packed: torch.Tensor | None = None
    width: int = 0  # W: 1 + the most drafts of any row
    # Mirror of `packed` on the host (stale until the event completed).
    host: torch.Tensor | None = None
    event: object | None = None
    logits: torch.Tensor | None = None
    audit: dict | None = None
    collected: StepResult | None = None
    _mirror_slot: tuple | None = None

    @property
    def sampled_dev(self) -> torch.Tensor | None:
        """[S, W] long on the device: each row's tokens, PLACEHOLDER past its count."""
        if self.packed is None:
            return None
        return self.packed[: len(self.sampling) * self.width].view(len(self.sampling), self.width)

    @property
    def num_sampled_dev(self) -> torch.Tensor | None:
        """[S] on the device: tokens each row emitted."""
        return None if self.packed is None else self.packed[len(self.sampling) * self.width :]

    def device_tokens(self) -> DeviceTokens | None:
        """This step's sampled tokens as a device buffer keyed by request id (output indices)."""
        if self.packed is None:
            return None
        rows: dict[str, int] = {}
        base: dict[str, int] = {}
        for i, (s, _) in enumerate(self.sampling):
            rid = s.request.request_id
            rows[rid] = i
            base[rid] = s.output_base
        return DeviceTokens(self.sampled_dev, rows, base)

    def counts(self) -> list[int]:
        """Tokens each sampling request emitted (1 + accepted drafts). Waits for the step's copy
        to the host (no extra transfer) and reads only the counts."""
        if self.packed is None:
            return []
        if self.host is None:  # already collected: the mirror went back to the pool
            return self.num_sampled_dev.tolist()
        if self.event is not None:
            self.event.synchronize()
        return self.host[len(self.sampling) * self.width :].tolist()


@dataclass
class _HostBatch:
    """One step's inputs as host lists, before anything touches the device."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    placeholders: list[tuple[int, Owner]] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    sampling: list[tuple[ScheduledRequest, int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    # Input positions of each sampling request's drafts (may be left empty when none has drafts).
    draft_pos: list[range] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)


def _all_greedy(sampling: list[tuple[ScheduledRequest, int]]) -> bool:
    """True when every sampling request is greedy (a run of one params object is checked once)."""
    return not any_params((s.request.params for s, _ in sampling), lambda p: not p.greedy)


def _decode_only(scheduled: list[ScheduledRequest]) -> bool:
    """True when every chunk of the step is one known token without drafts (a decode row)."""
    for s in scheduled:  # (no generator: this runs for every request in every step)
        if s.num_new_tokens != 1 or s.num_draft_tokens:
            return False
    return True


class _DeviceInputs(NamedTuple):
    """A step's inputs on the device (views of the runner's staging buffers)."""

    ids: torch.Tensor  # [T] input ids (placeholders filled in by launch: graph staging or a torch gather)
    ids_ext: torch.Tensor  # [T + 1]: the ids and a -2 sentinel (the padding of draft_idx)
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor | None  # None: every token is a logit row, in order
    draft_idx: torch.Tensor | None  # [S, kmax] input positions of the drafts; None without drafts
    row_idx: torch.Tensor | None  # [S * (kmax + 1)] logit row of each verified position


class _HostMirrors:
    """Reusable host buffers (pinned on CUDA) and events for the results' device->host copies."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.free: list[tuple[torch.Tensor, object | None]] = []

    def copy(self, src: torch.Tensor) -> tuple[torch.Tensor, object | None, tuple]:
        """Start a copy of the 1-D long src to the host: (host view, event, slot to release)."""
        buf, event = self.free.pop() if self.free else (None, torch.cuda.Event() if self.cuda else None)
        n = src.numel()
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1024), dtype=torch.long, pin_memory=self.cuda)
        view = buf[:n]
        view.copy_(src, non_blocking=True)
        if event is not None:
            event.record()
        return view, event, (buf, event)

    def release(self, slot: tuple) -> None:
        self.free.append(slot)


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
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.faults = faults
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
        # Steps that replayed a graph (padded_steps of them with padding queries) or ran eagerly.
        self.graph_steps = self.padded_steps = self.eager_steps = 0
        self.staging = Staging(device)
        self._mirrors = _HostMirrors(device)
        self._ones_by_n: dict[int, torch.Tensor] = {}
        self._arange_buf = torch.arange(32, device=device)
        if device.type == "cuda":
            from verispec.models.kernel_path import enable_triton

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
        """Build the step's inputs (one host->device copy), run the model, verify / sample on the
        device and start one device->host copy of the results. Never waits for the device."""
        hb = self._assemble(sched)
        inp, ph = self._stage(hb, self._fault_sources(sched, sources))
        if ph is not None and not (self.graphs and graphs_mod.FOLD_PLACEHOLDERS):
            fill_placeholders(inp.ids, ph)
            ph = None
        # A replay fills the placeholders while staging its inputs (one kernel); else the gather does.
        out = self.graphs.run(inp.ids, inp.positions, inp.meta, len(hb.query_lens), inp.meta.max_query_len,
                              ph) if self.graphs else None
        if out is None and ph is not None:
            fill_placeholders(inp.ids, ph)
        if out is not None:
            hidden, captured = out.hidden, out.captured
            self.graph_steps += 1
            self.padded_steps += len(hb.ids) > sched.num_tokens
        else:
            hidden, captured = self.model(inp.ids, inp.positions, inp.meta, self.kv_caches, self.capture_layers)
            self.eager_steps += 1
        handle = StepHandle(sched, hb.sampling, captured, hb.offsets)
        if hb.sampling:
            # The graph's hidden states are a view of its static buffer: read here, before the next replay.
            self._sample(handle, hb, inp, hidden if inp.logit_rows is None else hidden[inp.logit_rows], draft_probs)
        return handle

    def _fault_sources(self, sched: SchedulerOutput, sources: dict[str, DeviceTokens | None]) -> dict[str, DeviceTokens | None]:
        """The sources, or with VERISPEC_FAULT=row_by_position the planted bug: the previous step's
        rows looked up by this step's batch position, which differs from the producing step's row
        once a request ahead has finished."""
        prev = sources.get("out")
        if prev is None or not self.faults.active("row_by_position"):
            return sources
        order = [s.request.request_id for s in sched.scheduled]
        rows = {rid: min(i, prev.values.shape[0] - 1) for i, rid in enumerate(order)}
        return {**sources, "out": DeviceTokens(prev.values, rows, prev.base)}

    def _stage(
        self, hb: _HostBatch, sources: dict[str, DeviceTokens | None]
    ) -> tuple[_DeviceInputs, Placeholders | None]:
        """The step's inputs on the device (one staged copy) and its placeholders, not yet filled:
        (positions, source indices, flat device sources) per token_state.gather_plan, for launch to
        apply (input_ids[positions] = flat[sources]) before anything reads the ids."""
        ph_pos, ph_src, flat = gather_plan(hb.placeholders, sources)
        ids = hb.ids
        if hb.placeholders and self.faults.active("placeholder_leak"):
            ids = [0 if t == PLACEHOLDER else t for t in ids]  # the bug: placeholders reach the model
            ph_pos, ph_src = [], []
        num_tokens, num_seqs = len(ids), len(hb.query_lens)
        dense = len(hb.logit_rows) == num_tokens  # every token is a logit row, in order
        kmax = max(map(len, hb.draft_pos), default=0)
        width = max(map(len, hb.tables))
        ids_ext, positions, slots, pos_t, src_t, rows, draft_idx, row_idx, qsl, seq_lens, tables = self.staging.stage(
            [ids + [-2], hb.positions, hb.slots, ph_pos, ph_src, [] if dense else hb.logit_rows,
             self._draft_index(hb.draft_pos, kmax, num_tokens), self._row_index(hb.sampling, kmax)],
            [list(itertools.accumulate(hb.query_lens, initial=0)), hb.seq_lens, padded_tables(hb.tables, width)],
        )
        input_ids = ids_ext[:num_tokens]
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables.view(num_seqs, width),
            max_query_len=max(hb.query_lens), max_seq_len=max(hb.seq_lens), block_size=self.block_size,
            **self._reference_indices(hb),
        )
        drafts_at = draft_idx.view(len(hb.sampling), kmax) if kmax else None
        ph = (pos_t, src_t, flat) if ph_pos else None
        return _DeviceInputs(input_ids, ids_ext, positions, meta, rows, drafts_at, row_idx), ph

    def _sample(self, handle: StepHandle, hb: _HostBatch, inp: _DeviceInputs, hidden: torch.Tensor, draft_probs) -> None:
        """Logits of the sampled rows, verification / sampling, and the copy of the results."""
        logits = self.model.compute_logits(hidden)
        self._mask_and_penalize(logits, hb.sampling)
        drafts = None
        if inp.draft_idx is not None:
            drafts = self._draft_tensor(inp.ids_ext, hb.ids, inp.draft_idx)
            if self.audit_rate > 0:
                # The audit re-verifies against the drafts the device actually fed the model.
                true_drafts = self._draft_tensor(inp.ids_ext, hb.ids, inp.draft_idx, honest=True)
                handle.audit = self._maybe_audit(hb.sampling, logits, true_drafts, draft_probs)
        handle.packed, handle.width = self._verify(logits, hb.sampling, drafts, draft_probs, inp.row_idx)
        handle.logits = logits
        handle.host, handle.event, handle._mirror_slot = self._mirrors.copy(handle.packed)

    def _assemble(self, sched: SchedulerOutput) -> _HostBatch:
        """Host lists for a step: ids (PLACEHOLDER where only the device knows the value), their
        owners, positions, cache slots, attention lengths, logit rows and draft positions.
        Chunks of a step that a verify graph can replay are padded to its query length (_pad)."""
        if _decode_only(sched.scheduled):
            return self._assemble_decode(sched.scheduled)
        return self._assemble_chunks(sched)

    def _assemble_chunks(self, sched: SchedulerOutput) -> _HostBatch:
        """_assemble for any step (prefill chunks, drafts, padding), request by request."""
        hb = _HostBatch()
        bs = self.block_size
        q_pad = self._padded_query_len(sched)
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            k, n = s.num_draft_tokens, s.num_new_tokens
            n_known = n - k
            if q_pad > n:
                self._pad(hb, s.start, q_pad - n)
            offset = len(hb.ids)
            hb.offsets[rid] = offset
            known = req.token_slice(s.start, s.start + n_known)
            if PLACEHOLDER in known:
                first = s.start - req.num_prompt_tokens
                hb.placeholders += [(offset + j, (rid, "out", first + j)) for j, t in enumerate(known) if t == PLACEHOLDER]
            hb.ids += known
            if k:
                drafts = req.spec_token_ids[:k]
                if PLACEHOLDER in drafts:
                    hb.placeholders += [(offset + n_known + j, (rid, "draft", j)) for j, t in enumerate(drafts) if t == PLACEHOLDER]
                hb.ids += drafts
            hb.positions.extend(range(s.start, s.start + n))
            extend_slots(hb.slots, req.block_ids, s.start, n, bs)
            hb.query_lens.append(max(n, q_pad))
            hb.seq_lens.append(s.start + n)
            hb.tables.append(req.block_ids)
            if s.needs_sample:
                s.output_base = len(req.output_token_ids)
                hb.sampling.append((s, len(hb.logit_rows)))
                end = offset + n
                hb.logit_rows.extend(range(end - k - 1, end))
                hb.draft_pos.append(range(end - k, end))
        return hb

    def _assemble_decode(self, scheduled: list[ScheduledRequest]) -> _HostBatch:
        """_assemble for a step of decode rows only (one known token each, no drafts, so no
        padding either): the same lists, built a column at a time. This is every step of a
        steady decode batch, where the per-request loop of _assemble dominates the host time."""
        bs = self.block_size
        reqs = [s.request for s in scheduled]
        starts = [s.start for s in scheduled]
        tables = [r.block_ids for r in reqs]
        ids = [r.token_at(p) for r, p in zip(reqs, starts, strict=True)]
        hb = _HostBatch(
            ids=ids,
            positions=starts,
            slots=[t[p // bs] * bs + p % bs for t, p in zip(tables, starts, strict=True)],
            placeholders=[
                (i, (r.request_id, "out", p - len(r.prompt_token_ids)))
                for i, (t, r, p) in enumerate(zip(ids, reqs, starts, strict=True)) if t == PLACEHOLDER
            ],
            query_lens=[1] * len(scheduled),
            seq_lens=[p + 1 for p in starts],
            tables=tables,
            offsets={r.request_id: i for i, r in enumerate(reqs)},
        )
        sampling, logit_rows = hb.sampling, hb.logit_rows
        for i, s in enumerate(scheduled):
            out = s.request.output_token_ids
            n_out = len(out)
            # s.needs_sample (the chunk is the last known token), num_tokens inlined
            if s.start + 1 >= len(s.request.prompt_token_ids) + n_out:
                s.output_base = n_out
                sampling.append((s, len(logit_rows)))
                logit_rows.append(i)
        return hb

    def _padded_query_len(self, sched: SchedulerOutput) -> int:
        """The query length every chunk of this step is padded to so that it replays a verify
        graph; 0 for no padding (no graphs, a decode-only step, a chunk longer than any graph's
        query length or more sequences than the largest graph)."""
        if self.graphs is None or not sched.scheduled:
            return 0
        longest = max(s.num_new_tokens for s in sched.scheduled)
        if longest == 1:
            return 0  # uniform already: the decode graph
        return self.graphs.padded_query_len(len(sched.scheduled), longest) or 0

    @staticmethod
    def _pad(hb: _HostBatch, start: int, num: int) -> None:
        """num padding queries placed BEFORE a chunk of n tokens at positions [start, start + n).

        The chunk's seq_len stays start + n while its query length becomes q = n + num, so the
        attention kernel (query i sees keys [0, seq_len - q + i]) shows real token j, now query
        num + j, exactly keys [0, start + j] as unpadded; pad query i sees [0, start - num + i],
        only keys already in the cache before this step (none when negative: zeros). Pads write
        no K/V (slot -1) and are never a logit or draft row. Their positions only feed rotary."""
        hb.ids += [0] * num
        hb.positions += [max(0, start - num + i) for i in range(num)]
        hb.slots += [-1] * num

    @staticmethod
    def _draft_index(draft_pos: list[range], kmax: int, sentinel: int) -> list[int]:
        """[S, kmax] input positions of each sampling request's drafts, padded with the sentinel
        position (whose id is -2: never a token, so a padded draft never matches)."""
        if kmax == 0:
            return []  # no drafts in the step
        idx: list[int] = []
        for p in draft_pos:
            idx += p
            idx += [sentinel] * (kmax - len(p))
        return idx

    @staticmethod
    def _row_index(sampling: list[tuple[ScheduledRequest, int]], kmax: int) -> list[int]:
        """[S, kmax + 1] logit row of each verified position (clamped to the request's last row)."""
        if kmax == 0:
            return []  # one row per request, in order
        idx: list[int] = []
        for s, r0 in sampling:
            k = s.num_draft_tokens
            idx += range(r0, r0 + k + 1)
            idx += [r0 + k] * (kmax - k)
        return idx

    def _reference_indices(self, hb: _HostBatch) -> dict[str, torch.Tensor]:
        if self.model.attn_fn is not reference_attention:
            return {}
        return build_reference_indices(hb.query_lens, hb.seq_lens, hb.tables, self.block_size, self.device)

    def _draft_tensor(
        self, ids_ext: torch.Tensor, host_ids: list[int], draft_idx: torch.Tensor, honest: bool = False
    ) -> torch.Tensor:
        """[S, Kmax] drafts of each sampling request, read from the device input ids (padded with -2)."""
        if self.faults.active("stale_host_draft") and not honest:
            # The bug: drafts taken from the host mirror of the input ids (placeholders when the
            # drafts were produced on the device).
            src = torch.tensor(host_ids + [-2], dtype=torch.long).to(self.device)
            return src[draft_idx]
        return ids_ext[draft_idx]

    def _verify(
        self, logits: torch.Tensor, sampling, drafts: torch.Tensor | None, draft_probs, row_idx: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        """Greedy and rejection-sampled verification on the device; no host sync. drafts: [S, kmax]
        (None: no drafts). Returns the packed result [S*W tokens (PLACEHOLDER past each count) |
        S counts] and W = kmax + 1."""
        num = len(sampling)
        greedy = _all_greedy(sampling)
        if drafts is None:
            if greedy:  # plain greedy decode: one logit row per request
                if triton_argmax_ok(logits):  # the kernel writes the counts too (one kernel less)
                    return argmax_rows(logits, with_counts=True), 1
                return torch.cat([logits.argmax(-1), self._ones(num)]), 1
            drafts = logits.new_empty((num, 0), dtype=torch.long)
        kmax = drafts.shape[1]
        if kmax:  # padded drafts are -2, so they never match
            top = argmax(logits)[row_idx.view(num, kmax + 1)]
            num_acc = (top[:, :kmax] == drafts).long().cumprod(-1).sum(-1)
        else:
            top = argmax(logits)[:, None]
            num_acc = torch.zeros(num, dtype=torch.long, device=logits.device)
        tokens = top if greedy else self._sample_random(logits, sampling, drafts, draft_probs, top.clone(), num_acc)
        cols = self._arange(kmax + 1)
        tokens = torch.where(cols[None, :] <= num_acc[:, None], tokens, PLACEHOLDER)
        return torch.cat([tokens.reshape(-1), num_acc + 1]), kmax + 1

    def _sample_random(self, logits, sampling, drafts, draft_probs, tokens, num_acc) -> torch.Tensor:
        """Rejection sampling for the non-greedy rows, each with its own generator (in place in
        tokens and num_acc)."""
        kmax = drafts.shape[1]
        dev = logits.device
        probs = probs_from_logits(logits, self._row_params(sampling, logits.shape[-1]))
        for i, (s, r) in enumerate(sampling):
            req = s.request
            if req.params.greedy:
                continue
            k = s.num_draft_tokens
            g = self.generator(req, len(req.output_token_ids))
            q = draft_probs.get(req.request_id) if k else None
            u = torch.rand(1, k, generator=g, device=dev)
            a, dist = rejection_sample(probs[r : r + k + 1][None], drafts[i : i + 1, :k], None if q is None else q[None, :k], u)
            last = torch.multinomial(dist[0], 1, generator=g)
            row = torch.cat([drafts[i, :k], drafts.new_zeros(kmax + 1 - k)])
            row.scatter_(0, a, last)
            tokens[i] = row
            num_acc[i] = a[0]
        return tokens

    def _ones(self, n: int) -> torch.Tensor:
        """A persistent device tensor of n ones (long); never written."""
        ones = self._ones_by_n.get(n)
        if ones is None:
            ones = self._ones_by_n[n] = torch.ones(n, dtype=torch.long, device=self.device)
        return ones

    def _arange(self, n: int) -> torch.Tensor:
        """A persistent device arange(n) (long); never written."""
        if self._arange_buf.numel() < n:
            self._arange_buf = torch.arange(max(n, 32), device=self.device)
        return self._arange_buf[:n]

    def collect(self, h: StepHandle) -> StepResult:
        """Wait for the step's copy and return host values (fills the host mirrors)."""
        if h.collected is not None:
            return h.collected
        res = StepResult(captured=h.captured, token_offsets=h.token_offsets)
        if h.packed is not None:
            if h.event is not None:
                h.event.synchronize()
            values = h.host.tolist()
            self._mirrors.release(h._mirror_slot)
            h.host = h._mirror_slot = None
            w = h.width
            num = len(h.sampling)
            counts = values[num * w :]
            res.sampled = {
                s.request.request_id: values[o : o + c]
                for (s, _), o, c in zip(h.sampling, range(0, num * w, w), counts, strict=False)
            }
            self._logprobs(h, res)
            if h.audit is not None:
                res.audited, res.audit_mismatches = self._check_audit(h.audit, res)
        h.collected = res
        return res

    # ---- helpers ---------------------------------------------------------------------------
    def _logprobs(self, h: StepHandle, res: StepResult) -> None:
        """Top logprobs of the sampled tokens, for the requests that ask for them."""
        for s, r0 in [x for x in h.sampling if x[0].request.params.logprobs is not None]:
            req = s.request
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
        plain = None  # the last params seen with no min_tokens and no penalties (often shared by all)
        for s, r0 in sampling:
            req = s.request
            p = req.params
            if p is plain:
                continue
            if p.min_tokens == 0 and not p.needs_penalties:
                plain = p
                continue
            if len(req.output_token_ids) >= p.min_tokens and not p.needs_penalties:
                continue  # the common case: nothing to mask or penalize in any of its rows
            for j in range(s.num_draft_tokens + 1):
                n_out = len(req.output_token_ids) + j
                if n_out < p.min_tokens:
                    banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
                    banned = [t for t in banned if t < logits.shape[-1]]
                    if banned:
                        logits[r0 + j].index_fill_(0, to_device(banned, torch.long, logits.device), float("-inf"))
                if p.needs_penalties:
                    drafts = self.faults.check_fresh(req.spec_token_ids[: s.num_draft_tokens], "spec_token_ids")
                    pen_rows.append(r0 + j)
                    pen_prompt.append(req.prompt_token_ids)
                    pen_out.append(self.faults.check_fresh(req.output_token_ids, "output_token_ids") + drafts[:j])
                    pres.append(p.presence_penalty)
                    freq.append(p.frequency_penalty)
                    rep.append(p.repetition_penalty)
        if pen_rows:
            apply_penalties(logits, pen_rows, pen_prompt, pen_out, pres, freq, rep)
            torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)

    def _row_params(self, sampling, vocab: int) -> RowParams:
        params = [s.request.params for s, _ in sampling]
        return row_params(params, [s.num_draft_tokens + 1 for s, _ in sampling], vocab, self.device)
