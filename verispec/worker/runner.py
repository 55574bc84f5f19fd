"""The model runner: launches a scheduled step and collects it. It owns the model, the KV cache, the
staging ring and the graph runner; the host lists come from batch.py, the tokens from the verifier.

launch(): prepare the inputs (batch.build_host_batch, then one staged host->device copy, with the
placeholders filled on the device from DeviceTokens), run the forward (a CUDA graph replay or
eagerly), hand the logits and the drafts read from the device input ids to the Verifier, and
start one device->host copy of its packed result. It never waits for the device; collect() does.
The synchronous loop collects at once; the overlapped loop schedules the next step first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from verispec.core.attention_metadata import AttentionMetadata
from verispec.core.faults import NO_FAULTS, Faults
from verispec.core.placeholder import PLACEHOLDER
from verispec.core.scheduler_output import SchedulerOutput
from verispec.models.qwen2 import CausalLM
from verispec.worker.batch import SENTINEL_ID, HostBatch, build_host_batch, stage_plan
from verispec.worker.inputs import Staging, allocate_kv_cache
from verispec.worker.step import HostMirrors, StepHandle, StepResult
from verispec.worker.step_message import pack_step, unpack_step
from verispec.worker.token_state import DeviceTokens, Placeholders, fill_placeholders, gather_plan
from verispec.worker.verifier import AuditSources, Verifier

if TYPE_CHECKING:
    from verispec.core.parallel import TensorParallel

__all__ = ["ModelRunner", "StepHandle", "StepResult"]


class _DeviceInputs(NamedTuple):
    """A step's inputs on the device (views of the runner's staging buffers)."""

    ids: torch.Tensor  # [T] input ids (placeholders filled in by launch: graph staging or a torch gather)
    ids_ext: torch.Tensor  # [T + 1]: the ids and the SENTINEL_ID (the padding of draft_idx)
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor | None  # None: every token is a logit row, in order
    draft_idx: torch.Tensor | None  # [S, kmax] input positions of the drafts; None without drafts
    row_idx: torch.Tensor | None  # [S * (kmax + 1)] logit row of each verified position


class ModelRunner:
    """Runs the target model over the paged KV cache; its Verifier samples / verifies."""

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
        tp: TensorParallel | None = None,
    ) -> None:
        """tp: the tensor-parallel group of a model sharded by distributed/shard.py (None: one device).
        Rank 0 broadcasts every step's inputs to the other ranks, whose runners run follow()."""
        self.faults = faults
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.capture_layers = capture_layers
        self.tp = tp
        kv_heads = cfg.num_kv_heads // (tp.world_size if tp is not None else 1)  # this rank's KV heads
        self.kv_caches = allocate_kv_cache(cfg.num_layers, num_blocks, block_size, kv_heads, cfg.head_dim, dtype, device)
        self.verifier = Verifier(device, seed, audit_rate, faults)
        self.graphs = None
        # Steps that replayed a graph (padded_steps of them with padding queries) or ran eagerly.
        # split_steps: those replayed as two graphs (batch.split_for_graphs).
        self.graph_steps = self.padded_steps = self.eager_steps = self.split_steps = 0
        self.staging = Staging(device)
        self._mirrors = HostMirrors(device)
        if device.type == "cuda":
            from verispec.models.kernel_path import enable_triton, kernels_on

            if not kernels_on(model):  # a model switched on before (an A/B script) keeps its KernelOptions
                enable_triton(model)  # Triton attention backend, linears, norms, SiLU-mul; the CPU path stays torch
            if graph_options is not None:
                from verispec.worker.graphs import CudaGraphRunner

                # The last cache block is the graphs' scratch block (never given to a request).
                self.graphs = CudaGraphRunner(model, self.kv_caches, block_size=block_size,
                                              capture_layers=capture_layers, faults=faults, **graph_options)

    def free_request(self, req_id: str) -> None:
        """Forget a finished or preempted request (its generator)."""
        self.verifier.free_request(req_id)

    # ---- launch ----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        draft_probs: dict[str, torch.Tensor],
        sources: dict[str, DeviceTokens | None],
    ) -> StepHandle:
        """Build the step's inputs (one host->device copy), run the model, verify / sample on the
        device and start one device->host copy of the results. Never waits for the device.
        sources: device buffers holding the values of the step's placeholders ("out": the previous
        step's tokens, "draft": the proposer's drafts)."""
        # (No split replays with TP: every rank must run the same forwards, and its followers run one.)
        hb = build_host_batch(sched, self.block_size, self.graphs.padded_query_len if self.graphs else None,
                              split=self.tp is None)
        inp, ph = self._prepare(hb, self._fault_sources(sched, sources))
        hidden, captured = self._forward(inp, ph, hb, sched)
        handle = StepHandle(sched, hb.sampling, captured, hb.offsets)
        if hb.sampling:
            # The graph's hidden states are a view of its static buffer: read here, before the next replay.
            self._sample(handle, hb, inp, hidden if inp.logit_rows is None else hidden[inp.logit_rows], draft_probs,
                         sources.get("draft"))
        return handle

    def _fault_sources(self, sched: SchedulerOutput, sources: dict[str, DeviceTokens | None]) -> dict[str, DeviceTokens | None]:
        """The sources, or with the row_by_position fault the planted bug: the previous step's
        rows looked up by this step's batch position, which differs from the producing step's row
        once a request ahead has finished. The wrong row's columns past its own count hold
        PLACEHOLDER, which as an input id would index the embedding out of range (a device-side
        assert that aborts the process on CUDA, an IndexError on the CPU): the fault reads them as
        token 0, so that it moves tokens (what its gates check) and never crashes the engine."""
        prev = sources.get("out")
        if prev is None or not self.faults.active("row_by_position"):
            return sources
        order = [s.request.request_id for s in sched.scheduled]
        rows = {rid: min(i, prev.values.shape[0] - 1) for i, rid in enumerate(order)}
        return {**sources, "out": DeviceTokens(prev.values.clamp(min=0), rows, prev.base)}

    def _prepare(self, hb: HostBatch, sources: dict[str, DeviceTokens | None]) -> tuple[_DeviceInputs, Placeholders | None]:
        """The step's inputs on the device (one staged copy) and its placeholders, not yet filled:
        (positions, source indices, flat device sources) per token_state.gather_plan, for the
        forward to apply (input_ids[positions] = flat[sources]) before anything reads the ids."""
        ph_pos, ph_src, flat = gather_plan(hb.placeholders, sources)
        ids = hb.ids
        if hb.placeholders and self.faults.active("placeholder_leak"):
            ids = [0 if t == PLACEHOLDER else t for t in ids]  # the bug: placeholders reach the model
            ph_pos, ph_src = [], []
        plan = stage_plan(hb, ids, ph_pos, ph_src)
        ids_ext, positions, slots, pos_t, src_t, rows, draft_idx, row_idx, qsl, seq_lens, tables = self.staging.stage(
            plan.longs, plan.ints)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=tables.view(len(hb.query_lens), plan.width),
            max_query_len=max(hb.query_lens), max_seq_len=max(hb.seq_lens), block_size=self.block_size,
            **self._reference_indices(hb),
        )
        drafts_at = draft_idx.view(len(hb.sampling), plan.kmax) if plan.kmax else None
        ph = (pos_t, src_t, flat) if ph_pos else None
        return _DeviceInputs(ids_ext[: plan.num_tokens], ids_ext, positions, meta, rows, drafts_at, row_idx), ph

    def _reference_indices(self, hb: HostBatch) -> dict[str, torch.Tensor | bool]:
        backend = self.model.attn_backend
        if not backend.needs_reference_indices:
            return {}
        return backend.prepare_metadata(hb.query_lens, hb.seq_lens, hb.tables, self.block_size, self.device)

    def _forward(self, inp: _DeviceInputs, ph: Placeholders | None, hb: HostBatch, sched: SchedulerOutput
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Fill the placeholders and run the model: a graph replay (which fills them while staging
        its inputs, one kernel) when one fits, else eagerly (a torch gather fills them first)."""
        if ph is not None and (not self.graphs or self.tp is not None):
            fill_placeholders(inp.ids, ph)  # (with TP before the broadcast: every rank needs the values)
            ph = None
        if self.tp is not None:
            self.tp.send_step(pack_step(inp.ids, inp.positions, inp.meta, inp.logit_rows, bool(hb.sampling)))
        padded = len(hb.ids) > sched.num_tokens
        if hb.split is not None and self.graphs:
            out = self._run_split(inp.ids, inp.positions, inp.meta, hb.split, ph)
            if out is not None:
                self.graph_steps += 1
                self.split_steps += 1
                self.padded_steps += padded
                return out
            ph = None  # (filled by _run_split)
        return self._run_model(inp.ids, inp.positions, inp.meta, len(hb.query_lens), ph, padded)

    def _run_split(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   split: tuple[int, int, int], ph: Placeholders | None) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """A step as two graph replays (HostBatch.split: rows [0, n_a) of q_a queries, then the rest of
        q_b): the requests are independent, so each part's forward is the whole step's over its rows.
        The hidden states land in one tensor (the first part's copied out before the second replays: the
        graphs share their input buffers); the captured features are private copies already. Placeholders
        are filled first. None (with the placeholders filled) when a part fits no graph after all."""
        n_a, q_a, q_b = split
        t_a, n = n_a * q_a, meta.seq_lens.shape[0]
        if ph is not None:
            fill_placeholders(ids, ph)
        if not (self.graphs.fits(n_a, q_a) and self.graphs.fits(n - n_a, q_b)):
            return None
        hidden = captured = None
        for rows, toks, q, qsl in ((slice(0, n_a), slice(0, t_a), q_a, meta.query_start_loc[: n_a + 1]),
                                   (slice(n_a, n), slice(t_a, None), q_b, meta.query_start_loc[n_a:] - t_a)):
            part = AttentionMetadata(slot_mapping=meta.slot_mapping[toks], query_start_loc=qsl,
                                     seq_lens=meta.seq_lens[rows], block_tables=meta.block_tables[rows],
                                     max_query_len=q, max_seq_len=meta.max_seq_len, block_size=meta.block_size)
            out = self.graphs.run(ids[toks], positions[toks], part, rows.stop - rows.start, q)
            if out is None:
                return None
            if hidden is None:  # (captured: column views of one tensor, as graphs.private_rows returns them)
                hidden = out.hidden.new_empty((ids.shape[0], out.hidden.shape[1]))
                widths = [c.shape[1] for c in out.captured]
                captured = list(out.captured[0].new_empty((ids.shape[0], sum(widths))).split(widths, dim=-1)) \
                    if out.captured else []
            hidden[toks].copy_(out.hidden)
            for dst, c in zip(captured, out.captured, strict=True):
                dst[toks].copy_(c)
        return hidden, captured

    def _run_model(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, num_seqs: int,
                   ph: Placeholders | None, padded: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A graph replay when one fits, else the eager forward (placeholders filled first)."""
        out = self.graphs.run(ids, positions, meta, num_seqs, meta.max_query_len, ph) if self.graphs else None
        if out is None and ph is not None:
            fill_placeholders(ids, ph)
        if out is not None:
            self.graph_steps += 1
            self.padded_steps += padded
            return out.hidden, out.captured
        self.eager_steps += 1
        return self.model(ids, positions, meta, self.kv_caches, self.capture_layers)

    @torch.inference_mode()
    def follow(self, message: torch.Tensor) -> None:
        """A non-zero tensor-parallel rank's part of one step (message: rank 0's pack_step): the same
        forward over this rank's shards, and the LM head when the step samples (its all-gather). The
        tokens are picked on rank 0 only."""
        backend = self.model.attn_backend
        step = unpack_step(message, self.block_size, host_lists=backend.needs_reference_indices)
        meta = step.meta
        if backend.needs_reference_indices:
            for name, t in backend.prepare_metadata(step.query_lens, step.seq_lens, step.tables, self.block_size,
                                                    self.device).items():
                setattr(meta, name, t)
        hidden, _ = self._run_model(step.ids, step.positions, meta, step.num_seqs, None, False)
        if step.has_logits:
            self.model.compute_logits(hidden if step.logit_rows is None else hidden[step.logit_rows])

    def _drafts(self, inp: _DeviceInputs, host_ids: list[int]) -> torch.Tensor:
        """[S, kmax] drafts of each sampling request, read from the device input ids (padded with
        SENTINEL_ID). With the stale_host_draft fault, the planted bug: read from the host mirror
        of the ids (placeholders where the drafts were produced on the device)."""
        if self.faults.active("stale_host_draft"):
            return torch.tensor(host_ids + [SENTINEL_ID], dtype=torch.long).to(self.device)[inp.draft_idx]
        return inp.ids_ext[inp.draft_idx]

    def _sample(self, handle: StepHandle, hb: HostBatch, inp: _DeviceInputs, hidden: torch.Tensor, draft_probs,
                proposed: DeviceTokens | None) -> None:
        """Logits of the sampled rows, the verifier's verdict and the start of its copy to the host."""
        logits = self.model.compute_logits(hidden)
        drafts = self._drafts(inp, hb.ids) if inp.draft_idx is not None else None
        audit_sources = AuditSources(inp.ids, hb.offsets, proposed) if self.verifier.audit_rate > 0 else None
        verdict = self.verifier.run(logits, hb.sampling, drafts, inp.row_idx, draft_probs, audit_sources)
        handle.packed, handle.width, handle.audit = verdict
        handle.logits = logits
        handle.host, handle.event, handle._mirror_slot = self._mirrors.copy(handle.packed)

    # ---- collect ---------------------------------------------------------------------------
    def collect(self, h: StepHandle) -> StepResult:
        """Wait for the step's copy and return host values (fills the host mirrors)."""
        if h.collected is not None:
            return h.collected
        res = StepResult(captured=h.captured, token_offsets=h.token_offsets)
        if h.packed is not None:
            values = h.host_values()
            self._mirrors.release(h._mirror_slot)
            h.host = h._mirror_slot = None
            res.sampled = h.sampled_by_id(values)
            res.logprobs = self.verifier.logprobs(h.logits, h.sampling, res.sampled)
            if h.audit is not None:
                res.audited, res.audit_mismatches, res.audit_accepted = self.verifier.check_audit(h.audit, res.sampled)
        h.collected = res
        return res
