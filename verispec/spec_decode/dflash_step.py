"""One DFlash drafting step in fixed shapes, so that it can replay a CUDA graph.

A step drafts for b rows (requests, padded up to a captured batch size). Row i holds:
  * W = 1 + k context rows: target features of positions the drafter has not consumed yet (those
    the last target step committed); their context K/V are written first. Unused rows write to a
    dump slot.
  * one block of B tokens [last token, MASK x (B-1)] at positions anchor .. anchor + B - 1, where
    anchor is the request's first uncomputed position. The block's own K/V are written to the
    cache at key indices anchor .. anchor + B - 1 and every block query attends to keys
    [kv_start, anchor + B) through the paged backend without causality (meta.causal False).

Where block K/V go: key index n maps through row i's block table. Entries up to anchor's block
are the request's own blocks (the slots at and past the anchor hold no consumed context, so
overwriting them is harmless: they are rewritten with context K/V once committed); later entries
point at scratch blocks private to row i, past the engine's blocks, so drafting never needs blocks
the engine did not reserve. Padding rows use their own scratch block. Nothing outlives a step but
the context K/V of committed positions.

All per-step integers travel in one host->device copy into a static buffer laid out per batch size;
captured features are gathered into static buffers; then the graph (or the same code eagerly)
writes context K/V, runs the drafter and the target's LM head: logits [b, k, V]. The graphs are
worker/graphs.py's GraphRunner (its pool, capture and replay, the attention backend's hooks) over
these static inputs (_StepGraphs); the drafter attends through the target's attention backend.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from verispec.core.attention_metadata import AttentionMetadata
from verispec.core.placeholder import PLACEHOLDER
from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.dflash_model import DFlashDrafter
from verispec.worker.graphs import GraphRunner, graph_batch_sizes
from verispec.worker.inputs import Staging
from verispec.worker.token_state import Owner, gather_plan


@dataclass
class DraftRow:
    """Host description of one request's row in a drafting step."""

    ctx_rows: list[int]  # indices into the step's captured features (at most W)
    ctx_pos: list[int]  # their positions
    ctx_slots: list[int]  # their cache slots
    first_token: int  # the block's first token (PLACEHOLDER: on the device, see owner)
    owner: Owner | None
    anchor: int  # position of the block's first token
    kv_start: int  # keys below are invisible
    block_ids: list[int]  # the request's block table


class _Layout:
    """Views of one batch size's sections in the static int64 buffer (laid out end to end)."""

    NAMES = ("ctx_pos", "ctx_slot", "blk_ids", "blk_pos", "blk_slot", "qsl", "seq_lens", "kv_start", "tables")

    def __init__(self, buf: torch.Tensor, b: int, w: int, big_b: int, width: int) -> None:
        sizes = (b * w, b * w, b * big_b, b * big_b, b * big_b, b + 1, b, b, b * width)
        self.size = sum(sizes)
        self.views: dict[str, torch.Tensor] = {}
        o = 0
        for name, n in zip(self.NAMES, sizes, strict=True):
            self.views[name] = buf[o : o + n]
            o += n


class DFlashStepRunner:
    """Owns the drafter's paged context cache and runs drafting steps (graphs on CUDA)."""

    def __init__(self, drafter: DFlashDrafter, target: CausalLM, k: int, num_blocks: int, block_size: int,
                 max_model_len: int, max_rows: int, graph_max_batch: int, device, dtype) -> None:
        cfg = drafter.config
        self.drafter, self.target, self.k = drafter, target, k
        self.bs, self.big_b, self.w = block_size, cfg.block_size, 1 + k
        self.device, self.dtype = torch.device(device), dtype
        self.max_rows = max(1, max_rows)
        self.mask_id, self.max_pos = cfg.mask_token_id, cfg.max_position_embeddings
        self.extra = math.ceil((block_size - 1 + self.big_b) / block_size) - 1  # scratch blocks per row
        self.pad_block = num_blocks  # padding rows' scratch (also the dump slot)
        pad_blocks = math.ceil(self.big_b / block_size)
        self.overflow0 = num_blocks + pad_blocks
        total = self.overflow0 + self.max_rows * self.extra
        self.kv = [torch.zeros(2, total * block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=self.device)
                   for _ in range(cfg.num_layers)]
        self.dump_slot = self.pad_block * block_size
        self.width = math.ceil((max_model_len + self.big_b) / block_size) + 1  # block-table width
        self.layouts: dict[int, _Layout] = {}
        sizes = 2 * self.w + 3 * self.big_b + 4 + self.width
        self.ints = torch.zeros(self.max_rows * sizes + 1, dtype=torch.long, device=self.device)
        hsz = target.config.hidden_size
        self.feats = [torch.zeros(self.max_rows * self.w, hsz, dtype=dtype, device=self.device)
                      for _ in cfg.target_layers]
        self.staging = Staging(self.device)
        self.backend = target.attn_backend
        self.graph_runner: _StepGraphs | None = None
        self.batch_sizes: list[int] = []
        if graph_max_batch > 0 and self.device.type == "cuda" and self.backend.supports_graphs:
            self.batch_sizes = graph_batch_sizes(min(graph_max_batch, self.max_rows))
            self.graph_runner = _StepGraphs(self)
            self.graph_runner.capture_all(sorted(self.batch_sizes, reverse=True))  # largest first, one pool

    @property
    def graphs(self) -> dict:
        """The captured drafting graphs by batch size (empty: every step runs eagerly)."""
        return self.graph_runner.graphs if self.graph_runner is not None else {}

    # ---- host layout -----------------------------------------------------------------------
    def _layout(self, b: int) -> _Layout:
        lay = self.layouts.get(b)
        if lay is None:
            lay = self.layouts[b] = _Layout(self.ints, b, self.w, self.big_b, self.width)
        return lay

    def _row_table(self, i: int, row: DraftRow) -> list[int]:
        """Block table of row i: the request's blocks through the anchor's, then row i's scratch."""
        first = row.anchor // self.bs
        last = (row.anchor + self.big_b - 1) // self.bs
        own = row.block_ids[: first + 1]
        scratch = [self.overflow0 + i * self.extra + j for j in range(last - first)]
        table = own + scratch
        return table + [self.pad_block] * (self.width - len(table))

    def _host_sections(self, rows: list[DraftRow], b: int) -> tuple[dict[str, list[int]], list[list[int]]]:
        """The step's sections for b rows (rows past len(rows) are padding), plus the block tables."""
        bs, big_b, w = self.bs, self.big_b, self.w
        sec: dict[str, list[int]] = {n: [] for n in _Layout.NAMES}
        tables: list[list[int]] = []
        pad_table = [self.pad_block + j // bs for j in range(0, big_b, bs)]
        pad_table += [self.pad_block] * (self.width - len(pad_table))
        for i in range(b):
            row = rows[i] if i < len(rows) else None
            if row is None:
                table, anchor, kv_start, first = pad_table, 0, 0, 0
                sec["ctx_pos"] += [0] * w
                sec["ctx_slot"] += [self.dump_slot] * w
            else:
                table, anchor, kv_start = self._row_table(i, row), row.anchor, row.kv_start
                first = row.first_token if row.first_token != PLACEHOLDER else 0
                n = len(row.ctx_rows)
                sec["ctx_pos"] += row.ctx_pos + [0] * (w - n)
                sec["ctx_slot"] += row.ctx_slots + [self.dump_slot] * (w - n)
            keys = range(anchor, anchor + big_b)
            sec["blk_ids"] += [first] + [self.mask_id] * (big_b - 1)
            sec["blk_pos"] += [min(p, self.max_pos - 1) for p in keys]
            sec["blk_slot"] += [table[p // bs] * bs + p % bs for p in keys]
            sec["seq_lens"].append(anchor + big_b)
            sec["kv_start"].append(kv_start)
            sec["tables"] += table
            tables.append(table)
        sec["qsl"] = [i * big_b for i in range(b + 1)]
        return sec, tables

    # ---- the step --------------------------------------------------------------------------
    def _meta(self, b: int, ref: dict | None = None) -> AttentionMetadata:
        v = self._layout(b).views
        return AttentionMetadata(
            slot_mapping=v["blk_slot"], query_start_loc=v["qsl"], seq_lens=v["seq_lens"],
            block_tables=v["tables"].view(b, self.width), max_query_len=self.big_b,
            max_seq_len=self.width * self.bs, block_size=self.bs, causal=False, kv_start=v["kv_start"],
            **(ref or {}),
        )

    def _forward(self, b: int, ref: dict | None = None) -> torch.Tensor:
        """Context write, drafter and LM head for b rows of the static buffers -> logits [b, k, V]."""
        v = self._layout(b).views
        feats = torch.cat([f[: b * self.w] for f in self.feats], dim=-1)
        self.drafter.write_context(feats, v["ctx_pos"], v["ctx_slot"], self.kv)
        emb = self.target.embed(v["blk_ids"]).to(self.dtype)
        hidden = self.drafter.forward_paged(emb, v["blk_pos"], self._meta(b, ref), self.kv, self.backend)
        hidden = hidden.view(b, self.big_b, -1)[:, 1 : 1 + self.k]
        return self.target.compute_logits(hidden.reshape(b * self.k, -1)).view(b, self.k, -1)

    @torch.inference_mode()
    def run(self, rows: list[DraftRow], captured: list[torch.Tensor], sources: dict) -> torch.Tensor:
        """Draft logits [len(rows), k, V] float32. The result may be a view of a graph's static
        output: read it before the next run."""
        n = len(rows)
        if n > self.max_rows:
            raise ValueError(f"{n} drafting rows exceed the {self.max_rows} this runner was sized for")
        b = next((s for s in self.batch_sizes if s >= n), n)
        lay = self._layout(b)
        sec, tables = self._host_sections(rows, b)
        placeholders = [(i * self.big_b, r.owner) for i, r in enumerate(rows) if r.first_token == PLACEHOLDER]
        ph_pos, ph_src, flat = gather_plan(placeholders, sources)
        feat_rows = [x for r in rows for x in r.ctx_rows + [0] * (self.w - len(r.ctx_rows))]
        have_feats = bool(captured) and any(r.ctx_rows for r in rows)
        flat_ints = [x for name in _Layout.NAMES for x in sec[name]]
        staged, rows_t, pos_t, src_t = self.staging.stage(
            [flat_ints, feat_rows if have_feats else [], ph_pos, ph_src], [[]])[:4]
        self.ints[: lay.size].copy_(staged, non_blocking=True)
        if have_feats:
            for dst, src in zip(self.feats, captured, strict=True):
                torch.index_select(src, 0, rows_t, out=dst[: len(feat_rows)])
        if ph_pos:
            lay.views["blk_ids"][pos_t] = flat[src_t]
        out = self.graph_runner.replay(b) if self.graph_runner is not None else None
        if out is not None:
            return out[0][:n]
        ref = None
        if self.backend.needs_reference_indices:
            ref = self.backend.prepare_metadata([self.big_b] * b, sec["seq_lens"], tables, self.bs, self.device,
                                                causal=False, kv_starts=sec["kv_start"])
        return self._forward(b, ref)[:n]

    @torch.inference_mode()
    def time_steps(self, batches: list[int], reps: int = 5) -> dict[int, float]:
        """Seconds of a drafting step of b rows for each b: run() from its host preparation through the
        device's end (synchronized), over rows that read no context and write only scratch (the padding
        block); the median of `reps` after one warm-up. The cost model prices drafting with it."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *_: None)
        out = {}
        for b in batches:
            rows = [DraftRow([], [], [], 0, None, 0, 0, [self.pad_block]) for _ in range(min(b, self.max_rows))]
            self.run(rows, [], {})
            sync(self.device)
            secs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                self.run(rows, [], {})
                sync(self.device)
                secs.append(time.perf_counter() - t0)
            out[len(rows)] = sorted(secs)[reps // 2]
        return out


class _StepGraphs(GraphRunner):
    """The drafting step's CUDA graphs, one per batch size: GraphRunner over DFlashStepRunner's
    static buffers (its packed int64 sections and gathered features), inputs padding rows at capture."""

    def __init__(self, step: DFlashStepRunner) -> None:
        super().__init__(step.backend, capture=True, lazy=False)
        self.step = step

    def _pad(self, b: int) -> AttentionMetadata:
        step = self.step
        sec, _ = step._host_sections([], b)
        lay = step._layout(b)
        step.ints[: lay.size].copy_(torch.tensor([x for n in _Layout.NAMES for x in sec[n]], dtype=torch.long))
        return step._meta(b)

    def _forward(self, b: int) -> torch.Tensor:
        return self.step._forward(b)
