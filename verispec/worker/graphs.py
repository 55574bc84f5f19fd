"""CUDA graphs: GraphRunner captures a forward once per shape and replays it; CudaGraphRunner is the
one for a CausalLM's decode / verify steps (the target's and the draft model's), and the DFlash
drafting step (spec_decode/dflash_step.py) is another GraphRunner over its own static inputs.

GraphRunner keeps one memory pool and the graphs captured into it, keyed by shape: captured at
start-up (capture_all, largest first) or with lazy=True each the first time it is needed (start-up
then captures nothing: the engine's default, as a full capture costs seconds before the first
token). Its user fills the static inputs with padding rows for a capture (_pad) and with the step
before a replay; the attention backend is asked before each (prepare_for_capture /
prepare_for_replay), and must read every per-step value from the metadata tensors
(backend.supports_graphs; the Triton backend's contract is in verispec/kernels/paged_attention.py).

CudaGraphRunner captures per (padded batch size, query length) for batch sizes 1, 2, 4, ...,
max_batch and each query length (1 for decode, 1 + k for verify), and optionally longer *prefill*
query lengths (prefill_lens) for the shapes of at most prefill_max_tokens tokens: a step that admits a
request (its prompt chunk next to the others' decode rows) then replays a graph with every chunk
padded to that length instead of running eagerly, which on the H200 costs ~15-30 ms of kernel launches
(1.5B) where the padded replay costs the GPU time of its tokens. Every replay copies the step's
metadata (input ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables) into the
static buffers the graph reads, so nothing from the capture (or a previous step) is stale.

Padding queries inside a row (a verify step whose requests carry fewer than k drafts) are the
runner's business (ModelRunner._assemble): it hands run() uniform rows already.

Padding rows (real batch n < captured batch b) are dummy sequences of query_len tokens with
seq_len = query_len, whose block table points only at a reserved scratch block and whose K/V are
written there. The caller must reserve that block: it is never handed to a request (default: the
last block of the cache; give the BlockManager num_blocks - 1).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from verispec.attention.backend import AttentionBackend
from verispec.core.attention_metadata import AttentionMetadata
from verispec.core.faults import NO_FAULTS, Faults
from verispec.core.options import KernelOptions
from verispec.models.kernel_path import options_of
from verispec.models.qwen2 import CausalLM
from verispec.worker.token_state import Placeholders, fill_placeholders

log = logging.getLogger("verispec")


def capture_graph(forward, pool, error_mode: str = "global"):
    """Warm forward() up on a side stream (Triton compiles, cuBLAS picks kernels), then capture it
    into a CUDA graph in `pool`. Returns (graph, forward's outputs: the graph's static outputs).

    Python's cyclic garbage collector is off during the capture: torch (2.9 on) no longer collects
    before a capture, so a dead engine's cycles (its graphs, events, streams) could be collected in
    the middle of one, and their destructors' CUDA calls invalidate it ("operation failed due to a
    previous error during capture": the CUDA gate of draft_model-adaptive parity, session 20, built
    right after other engines)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
            out = forward()
    finally:
        if was_enabled:
            gc.enable()
    return graph, out


class GraphOutput(NamedTuple):
    """A replay's results for the real tokens. captured are private copies; hidden and logits (only
    with with_logits) are views of static buffers, valid until the next run: use them at once (in
    stream order before the next replay, as every reader queued right after run() is)."""

    hidden: torch.Tensor  # [T, hidden]
    captured: list[torch.Tensor]
    logits: torch.Tensor | None  # [T, vocab] float32


def private_rows(captured: list[torch.Tensor], t: int) -> list[torch.Tensor]:
    """Private copies of the first t rows of each static captured buffer, in one copy kernel: views of one
    [t, sum of widths] tensor (a clone per layer would launch one copy each, every step)."""
    parts = [c[:t] for c in captured]
    if len(parts) < 2:
        return [p.clone() for p in parts]
    return list(torch.cat(parts, dim=-1).split([p.shape[-1] for p in parts], dim=-1))


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class GraphRunner:
    """CUDA graphs of one forward, one per shape key, captured into one memory pool and replayed.

    Subclasses provide _pad(key) (fill the static inputs with padding rows for shape key; return the
    static metadata the forward reads) and _forward(key) (the forward over the static inputs; its
    outputs become the graph's static outputs). capture=False keeps the bookkeeping but captures
    nothing (replay() then returns None, and the subclass runs the same forward eagerly)."""

    def __init__(self, backend: AttentionBackend, capture: bool = True, lazy: bool = False) -> None:
        if not backend.supports_graphs:
            raise ValueError(f"CUDA graphs need an attention backend that reads every per-step value from the "
                             f"metadata tensors (the {backend.name} backend bakes host indices)")
        self.backend = backend
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.lazy = capture and lazy
        self.graphs: dict[Hashable, tuple[Any, ...]] = {}  # key -> (graph, *the forward's outputs)
        self.static_meta: dict[Hashable, AttentionMetadata] = {}  # key -> the metadata it was captured over
        self.capture_seconds = 0.0

    def _pad(self, key) -> AttentionMetadata:
        raise NotImplementedError

    def _forward(self, key):
        raise NotImplementedError

    def _capture(self, key, error_mode: str) -> None:
        """Capture shape `key` over padding rows only."""
        meta = self._pad(key)
        self.backend.prepare_for_capture(meta)
        graph, out = capture_graph(lambda: self._forward(key), self.pool, error_mode)
        self.static_meta[key] = meta
        self.graphs[key] = (graph, *out) if isinstance(out, tuple) else (graph, out)

    @torch.inference_mode()
    def capture_all(self, keys, progress: bool = False, desc: str = "capturing CUDA graphs") -> float:
        """Capture every key in the given order (largest first: later ones reuse the pool); seconds."""
        from tqdm import tqdm

        gc.collect()  # dead engines' graphs and buffers go before the captures, not during one
        torch.cuda.synchronize()
        start = time.perf_counter()
        for key in tqdm(keys, desc=desc, disable=not progress):
            self._capture(key, "global")
        torch.cuda.synchronize()
        secs = time.perf_counter() - start
        self.capture_seconds += secs
        return secs

    def _capture_now(self, key) -> None:
        """A lazy capture in the middle of a run: waits for the device (torch.cuda.graph does);
        thread_local, so another thread's CUDA calls (a server) do not break the capture."""
        start = time.perf_counter()
        self._capture(key, "thread_local")
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - start
        log.debug("captured CUDA graph %s in %.2fs", key, time.perf_counter() - start)

    def ensure(self, key) -> None:
        """With lazy capture, capture `key` now if it is not yet (before its inputs are staged:
        capturing rewrites the static buffers)."""
        if self.lazy and key not in self.graphs:
            self._capture_now(key)

    def replay(self, key, meta: AttentionMetadata | None = None) -> tuple[Any, ...] | None:
        """Replay `key` (its step already staged into the static buffers; meta: the step's metadata,
        None: the graph's static one): the graph's static outputs, or None when it was not captured."""
        entry = self.graphs.get(key)
        if entry is None:
            return None
        self.backend.prepare_for_replay(meta if meta is not None else self.static_meta[key])
        entry[0].replay()
        return entry[1:]


class CudaGraphRunner(GraphRunner):
    """Captured forwards of `model` over `kv_caches` for uniform-query-length batches."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        query_lens: tuple[int, ...] = (1,),
        block_size: int = 16,
        max_blocks_per_seq: int = 256,
        scratch_block: int | None = None,
        capture_layers: tuple[int, ...] = (),
        with_logits: bool = False,
        progress: bool = True,
        capture: bool = True,
        lazy: bool = False,
        options: KernelOptions | None = None,
        faults: Faults = NO_FAULTS,
        prefill_lens: tuple[int, ...] = (),
        prefill_max_tokens: int = 0,
    ) -> None:
        """capture=False skips the graphs: run() then executes the same padded forward eagerly
        (for CPU tests, and to tell padding problems from capture problems). lazy=True captures
        a shape on its first use (one device sync then) instead of all of them here. options:
        the staging kernel's (None: the model's, models/kernel_path.options_of). prefill_lens: query
        lengths longer than query_lens', captured only for batch sizes b with b * q <= prefill_max_tokens."""
        super().__init__(model.attn_backend, capture, lazy)
        self.options = options or options_of(model)
        self.faults = faults
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.query_lens = tuple(sorted(set(query_lens)))
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.prefill_max_tokens = prefill_max_tokens
        # (a padding row of q queries attends to q positions: its block table must reach them)
        self.prefill_lens = tuple(sorted(q for q in set(prefill_lens) if self.query_lens[-1] < q <= min(
            prefill_max_tokens, max_blocks_per_seq * block_size)))
        self._all_query_lens = self.query_lens + self.prefill_lens
        self.capture_layers, self.with_logits = capture_layers, with_logits
        num_blocks = kv_caches[0].shape[1] // block_size
        self.scratch_block = num_blocks - 1 if scratch_block is None else scratch_block
        dev = kv_caches[0].device
        max_tokens = max([max_batch * self.query_lens[-1]] + [b * q for b, q in self.shapes()])
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.long, device=dev)
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.slot_mapping = torch.zeros(max_tokens, **i64)
        self.query_start_loc = torch.zeros(max_batch + 1, **i32)
        self.seq_lens = torch.zeros(max_batch, **i32)
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), self.scratch_block, **i32)
        # Per query length: what padding rows hold (token t of a padding row is query t % q).
        ar = torch.arange(max_tokens, **i64)
        self._pad_pos = {q: ar % q for q in self._all_query_lens}
        self._pad_slot = {q: self.scratch_block * block_size + (ar % q) % block_size for q in self._all_query_lens}
        self._qsl = {q: torch.arange(max_batch + 1, **i32) * q for q in self._all_query_lens}
        self.logits = (
            torch.zeros(max_tokens, model.config.vocab_size, dtype=torch.float32, device=dev) if with_logits else None
        )
        self._stage_kernel = None  # kernels/graph_inputs.py's stage_graph_inputs, on CUDA (options.stage_kernel)
        if self.options.stage_kernel and dev.type == "cuda":
            from verispec.kernels.graph_inputs import stage_graph_inputs

            self._stage_kernel = stage_graph_inputs
        if capture and not lazy:
            self._capture_all(progress)

    def allowed(self, b: int, q: int) -> bool:
        """Whether shape (b, q) has a graph: every batch size at the decode / verify query lengths, at a
        prefill length only within prefill_max_tokens."""
        return q in self.query_lens or (q in self.prefill_lens and b * q <= self.prefill_max_tokens)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch, query length) this runner captures."""
        return [(b, q) for q in self._all_query_lens for b in self.batch_sizes if self.allowed(b, q)]

    # ---- capture ---------------------------------------------------------------------------
    def _meta(self, b: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: b * q], query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_query_len=q,
            max_seq_len=self.max_blocks * self.block_size, block_size=self.block_size,
        )

    def _fill(self, n: int, b: int, q: int) -> None:
        """Rows n..b-1 (tokens n*q..b*q-1) become padding rows."""
        t, tp = n * q, b * q
        self.input_ids[t:tp].zero_()
        self.positions[t:tp].copy_(self._pad_pos[q][t:tp])
        self.slot_mapping[t:tp].copy_(self._pad_slot[q][t:tp])
        self.query_start_loc[n + 1 : b + 1].copy_(self._qsl[q][n + 1 : b + 1])
        self.seq_lens[n:b].fill_(q)
        self.block_tables[:b].fill_(self.scratch_block)

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, n: int, b: int,
               q: int, placeholders: Placeholders | None = None) -> None:
        """The step's inputs into the static buffers, rows n..b-1 as padding: one kernel on CUDA
        (kernels/graph_inputs.py), torch copies and fills otherwise. placeholders (pos, src, flat):
        input_ids[pos] = flat[src] first (input_ids itself is updated too)."""
        src = (input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)
        dst = (self.input_ids, self.positions, self.slot_mapping, self.query_start_loc, self.seq_lens,
               self.block_tables)
        if self._stage_kernel is not None and all(x.is_cuda for x in src):
            self._stage_kernel(src, dst, n, b, q, self.scratch_block, self.block_size, placeholders, self.options,
                               writeback=not self.faults.active("graph_stage_no_writeback"))
            return
        if placeholders is not None:
            fill_placeholders(input_ids, placeholders)
        self._fill(n, b, q)
        t = n * q
        for x, buf in zip(src[:3], dst[:3], strict=True):
            buf[:t].copy_(x, non_blocking=True)
        self.query_start_loc[: n + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)

    def _forward(self, key: tuple[int, int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        b, q = key
        tp = b * q
        hidden, captured = self.model(
            self.input_ids[:tp], self.positions[:tp], self._meta(b, q), self.kv_caches, self.capture_layers
        )
        if self.logits is not None:
            self.model.compute_logits(hidden, out=self.logits[:tp])
        return hidden, captured

    def _capture_all(self, progress: bool) -> None:
        shapes = sorted(self.shapes(), key=lambda s: -s[0] * s[1])
        secs = self.capture_all(shapes, progress)
        if progress:
            extra = (f", prefill query {self.prefill_lens} up to {self.prefill_max_tokens} tokens"
                     if self.prefill_lens else "")
            print(f"captured {len(shapes)} CUDA graphs (batch {self.batch_sizes} x query {self.query_lens}{extra}) "
                  f"in {secs:.1f}s")

    def _pad(self, key: tuple[int, int]) -> AttentionMetadata:
        """Shape (b, q) as padding rows only (their K/V go to the scratch block). With the staging
        kernel, it writes them (a step of 0 real rows), so that its specialization for query length
        q compiles here, at capture, not in the middle of a run."""
        b, q = key
        self.query_start_loc[0] = 0
        if self._stage_kernel is not None:
            bufs = (self.input_ids, self.positions, self.slot_mapping, self.query_start_loc, self.seq_lens,
                    self.block_tables)
            self._stage_kernel(bufs, bufs, 0, b, q, self.scratch_block, self.block_size, None, self.options)
        else:
            self._fill(0, b, q)
        return self._meta(b, q)

    @torch.inference_mode()
    def replay_padding(self, b: int, q: int) -> None:
        """Replay shape (b, q) over padding rows only (their K/V go to the scratch block, nothing of a
        request is touched), capturing it first when lazy: what start-up timing runs (no host sync)."""
        key = (b, q)
        self.ensure(key)
        meta = self._pad(key)
        if self.replay(key, meta) is None:  # capture=False: the same forward, eagerly
            self._forward(key)

    # ---- replay ----------------------------------------------------------------------------
    def padded_batch(self, num_seqs: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    def padded_query_len(self, num_seqs: int, longest: int) -> int | None:
        """The shortest captured query length >= longest, if a graph for num_seqs rows exists:
        what the runner pads each chunk of a mixed-length step to (None: the step runs eagerly)."""
        b = self.padded_batch(num_seqs)
        if b is None:
            return None
        return next((q for q in self._all_query_lens if q >= longest and self.allowed(b, q)), None)

    def fits(self, num_seqs: int, query_len: int) -> bool:
        """Whether a graph replays num_seqs sequences of query_len tokens each."""
        b = self.padded_batch(num_seqs)
        return b is not None and self.allowed(b, query_len)

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, num_seqs: int, query_len: int,
        placeholders: Placeholders | None = None,
    ) -> GraphOutput | None:
        """Replay the graph for a batch of num_seqs sequences of exactly query_len new tokens each;
        None when no graph fits (the caller runs the model eagerly, and placeholders are left to
        it). With a graph, placeholders (pos, src, flat) are filled while staging:
        input_ids[pos] = flat[src], in the graph's buffer and in input_ids. No host sync (but a
        lazy capture, once per shape)."""
        b = self.padded_batch(num_seqs)
        t = num_seqs * query_len
        if (
            b is None or not self.allowed(b, query_len) or input_ids is None
            or input_ids.shape[0] != t or meta.max_query_len != query_len  # uniform query lengths
            or meta.block_tables.shape[1] > self.max_blocks or meta.block_size != self.block_size
        ):
            return None
        key = (b, query_len)
        self.ensure(key)  # before staging the inputs: capturing rewrites the buffers
        stale = self.seq_lens.clone() if self.faults.active("stale_graph_metadata") else None
        self._stage(input_ids, positions, meta, num_seqs, b, query_len, placeholders)
        if stale is not None:  # the planted bug: the replay reads the previous replay's seq_lens
            self.seq_lens.copy_(stale)
        out = self.replay(key, meta)
        hidden, captured = out if out is not None else self._forward(key)  # None: capture=False
        return GraphOutput(hidden[:t], private_rows(captured, t), self.logits[:t] if self.logits is not None else None)
