"""Turn a batch of (tokens, first position, block table) into device tensors for one forward."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from verispec.attention.backend import AttentionBackend
from verispec.attention.reference import build_reference_indices
from verispec.core.attention_metadata import AttentionMetadata


@dataclass
class SeqChunk:
    """New tokens of one sequence: token_ids at positions [start, start + len), after `pad` padding
    queries (worker/batch.pad_before's convention: id 0, slot -1 so no K/V is written, positions only
    for rotary; the chunk's seq_len stays start + len, so its real tokens see exactly what they would
    unpadded). Padding gives chunks of different lengths one query length (a CUDA graph's shape)."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    pad: int = 0


def extend_padding(ids: list[int], positions: list[int], slots: list[int], start: int, num: int) -> None:
    """Append num padding queries placed before a chunk starting at `start` (batch.pad_before explains
    what they see): id 0, positions start - num .. start - 1 (clamped at 0; rotary only), slot -1 (no K/V)."""
    ids.extend([0] * num)
    positions.extend(max(0, start - num + i) for i in range(num))
    slots.extend([-1] * num)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small host list as a device tensor without a stream sync: pinned, then a non-blocking
    copy on CUDA (torch.tensor(values, device=cuda) waits for all queued work)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def build_batch(
    chunks: list[SeqChunk],
    block_size: int,
    device: torch.device,
    with_reference: bool = True,
    token_ids: bool = True,
    staging: Staging | None = None,
    backend: AttentionBackend | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, AttentionMetadata]:
    """Flat input ids and positions plus attention metadata (host work, one copy to device).
    token_ids=False skips the ids (the caller combines them on the device).

    with_reference=False skips the padded gather indices / mask that only reference_attention
    reads (the Triton backend reads query_start_loc, seq_lens and block_tables). staging: move
    everything in that Staging's one pinned copy (the tensors are then views valid until its
    ring comes round again), instead of a copy per tensor. backend: the attention backend that will run the
    step, in place of with_reference: its prepare_metadata builds what its forward reads where it needs reference
    indices (CPUBackend: none for the steps its C kernel takes), nothing otherwise, as ModelRunner asks it."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    for c in chunks:
        n = len(c.token_ids)
        if c.pad:
            extend_padding(ids, pos, slots, c.start, c.pad)
        ids.extend(c.token_ids)
        pos.extend(range(c.start, c.start + n))
        extend_slots(slots, c.block_ids, c.start, n, block_size)
        query_lens.append(n + c.pad)
        seq_lens.append(c.start + n)
        tables.append(c.block_ids)
    max_blocks = max(len(t) for t in tables)
    if backend is not None:
        extra = backend.prepare_metadata(query_lens, seq_lens, tables, block_size, device) \
            if backend.needs_reference_indices else {}
    else:
        extra = build_reference_indices(query_lens, seq_lens, tables, block_size, device) if with_reference else {}
    if staging is not None:
        return _staged_batch(staging, ids if token_ids else [], pos, slots, query_lens, seq_lens,
                             padded_tables(tables, max_blocks), max_blocks, block_size, extra)
    bt = torch.tensor(padded_tables(tables, max_blocks), dtype=torch.int32).view(len(chunks), max_blocks)
    qsl = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
        query_start_loc=qsl.to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        block_tables=bt.to(device, non_blocking=True),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        **extra,
    )
    input_ids = torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True) if token_ids else None
    positions = torch.tensor(pos, dtype=torch.long).to(device, non_blocking=True)
    return input_ids, positions, meta


def _staged_batch(staging: Staging, ids: list[int], pos: list[int], slots: list[int], query_lens: list[int],
                  seq_lens: list[int], flat_tables: list[int], width: int, block_size: int,
                  reference: dict) -> tuple[torch.Tensor | None, torch.Tensor, AttentionMetadata]:
    """build_batch's tensors as views of one staged copy."""
    qsl = list(itertools.accumulate(query_lens, initial=0))
    ids_t, pos_t, slots_t, qsl_t, sl_t, bt_t = staging.stage([ids, pos, slots], [qsl, seq_lens, flat_tables])
    meta = AttentionMetadata(
        slot_mapping=slots_t, query_start_loc=qsl_t, seq_lens=sl_t, block_tables=bt_t.view(len(query_lens), width),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size, **reference,
    )
    return ids_t, pos_t, meta


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device
) -> list[torch.Tensor]:
    """One [2, slots, kv_heads, head_dim] tensor per layer."""
    return [
        torch.zeros(2, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]


def extend_slots(out: list[int], block_ids: list[int], start: int, n: int, block_size: int) -> None:
    """Append the cache slots of positions [start, start + n): one range per block touched."""
    if n == 1:  # a decode row: most rows of a large batch
        blk, off = divmod(start, block_size)
        out.append(block_ids[blk] * block_size + off)
        return
    p, end = start, start + n
    while p < end:
        blk, off = divmod(p, block_size)
        m = min(block_size - off, end - p)
        base = block_ids[blk] * block_size + off
        out.extend(range(base, base + m))
        p += m


def padded_tables(tables: list[list[int]], width: int) -> list[int]:
    """Block tables flattened row by row, each padded with zeros to width."""
    flat: list[int] = []
    zeros = [0] * width
    for t in tables:
        flat += t
        flat += zeros[: width - len(t)]
    return flat


class _Layout(NamedTuple):
    """Where a step's sections live in a staging slot, with their device views made once."""

    host: torch.Tensor  # host[:size]
    dev: torch.Tensor  # dev[:size]
    offsets64: list[int]
    offsets32: list[int]
    views: list[torch.Tensor | None]


class _StagingSlot:
    """One host buffer (pinned on CUDA) and its device twin, both int64, and the views of the
    section layouts seen so far (a steady decode batch reuses one layout every step)."""

    MAX_LAYOUTS = 64

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.recorded = False
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.zeros(capacity, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.dev = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.h64, self.h32 = self.host.numpy(), self.host.view(torch.int32).numpy()
        self.layouts: dict[tuple, _Layout] = {}

    def acquire(self, size: int) -> None:
        """Wait until the last copy out of this slot is done; grow it to hold size int64s."""
        if self.recorded:
            self.event.synchronize()  # in practice long done: the slot is two steps old
            self.recorded = False
        if size > self.host.numel():
            self._allocate(max(size, 2 * self.host.numel()))

    def layout(self, lens64: tuple[int, ...], lens32: tuple[int, ...], size: int) -> _Layout:
        key = (lens64, lens32)
        found = self.layouts.get(key)
        if found is None:
            if len(self.layouts) >= self.MAX_LAYOUTS:
                self.layouts.clear()
            found = self.layouts[key] = self._make_layout(lens64, lens32, size)
        return found

    def _make_layout(self, lens64: tuple[int, ...], lens32: tuple[int, ...], size: int) -> _Layout:
        offsets64 = list(itertools.accumulate(lens64[:-1], initial=0))
        offsets32 = list(itertools.accumulate(lens32[:-1], initial=2 * sum(lens64)))
        dev32 = self.dev.view(torch.int32)
        views = [self.dev[o : o + n] if n else None for o, n in zip(offsets64, lens64, strict=True)]
        views += [dev32[o : o + n] if n else None for o, n in zip(offsets32, lens32, strict=True)]
        return _Layout(self.host[:size], self.dev[:size], offsets64, offsets32, views)

    def send(self, layout: _Layout) -> None:
        layout.dev.copy_(layout.host, non_blocking=True)
        if self.event is not None:
            self.event.record()
            self.recorded = True


class Staging:
    """Small per-step integer tensors go host->device in one copy.

    A ring of persistent host buffers (pinned on CUDA) with device twins: the host writes a step's
    sections with numpy, one non-blocking copy moves them, and the device tensors are views. A slot
    is rewritten only after the event behind its previous copy completed, so the host never
    overwrites memory that an in-flight copy still reads; the device twin is rewritten by a copy
    queued on the same stream after every kernel that read it.
    """

    def __init__(self, device: torch.device, slots: int = 2, capacity: int = 4096) -> None:
        self._slots = [_StagingSlot(device, capacity) for _ in range(slots)]
        self._next = 0

    def stage(self, longs: Sequence[Sequence[int]], ints: Sequence[Sequence[int]]) -> list[torch.Tensor | None]:
        """Device views of the sections, in order: int64 ones, then int32 ones (None for an empty
        section). The views are valid until the slot comes round again (two calls later)."""
        lens64, lens32 = tuple(map(len, longs)), tuple(map(len, ints))
        size = sum(lens64) + (sum(lens32) + 1) // 2
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        slot.acquire(size)
        lay = slot.layout(lens64, lens32, size)
        for dst, sections, offsets in ((slot.h64, longs, lay.offsets64), (slot.h32, ints, lay.offsets32)):
            for x, o in zip(sections, offsets, strict=True):
                if x:
                    dst[o : o + len(x)] = x
        slot.send(lay)
        return lay.views
