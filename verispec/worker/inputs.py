"""Turn a batch of (tokens, first position, block table) into device tensors for one forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.models.layers.attention import AttentionMetadata, build_reference_indices


@dataclass
class SeqChunk:
    """New tokens of one sequence: token_ids at positions [start, start + len)."""

    token_ids: list[int]
    start: int
    block_ids: list[int]


def build_batch(
    chunks: list[SeqChunk],
    block_size: int,
    device: torch.device,
    with_reference: bool = True,
    token_ids: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, AttentionMetadata]:
    """Flat input ids and positions plus attention metadata (host work, one copy to device).
    token_ids=False skips the ids (the caller combines them on the device).

    with_reference=False skips the padded gather indices / mask that only reference_attention
    reads (the Triton backend reads query_start_loc, seq_lens and block_tables)."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    for c in chunks:
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        for p in range(c.start, c.start + n):
            pos.append(p)
            slots.append(c.block_ids[p // block_size] * block_size + p % block_size)
        query_lens.append(n)
        seq_lens.append(c.start + n)
        tables.append(c.block_ids)
    max_blocks = max(len(t) for t in tables)
    bt = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
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
        **(build_reference_indices(query_lens, seq_lens, tables, block_size, device) if with_reference else {}),
    )
    input_ids = torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True) if token_ids else None
    positions = torch.tensor(pos, dtype=torch.long).to(device, non_blocking=True)
    return input_ids, positions, meta


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device
) -> list[torch.Tensor]:
    """One [2, slots, kv_heads, head_dim] tensor per layer."""
    return [
        torch.zeros(2, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]
