"""The plain-torch attention backend: the reference every kernel is tested against, and the CPU path.

The KV cache of one layer is a tensor [2, num_slots, num_kv_heads, head_dim] where a slot is
block_id * block_size + offset. Each step first writes the new tokens' K/V into their slots, then
every query attends to its sequence's context (cached tokens + this step's tokens), causally. The
reference gathers each sequence's keys with padded host-built indices (build_reference_indices),
which a CUDA graph would bake in: it runs eagerly only (supports_graphs False).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.attention.backend import AttentionBackend
from verispec.core.attention_metadata import AttentionMetadata


def build_reference_indices(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int, device,
    causal: bool = True, kv_starts: list[int] | None = None,
) -> dict[str, torch.Tensor | bool]:
    """Host-side construction of the padded gather indices used by the reference backend
    (causal and kv_starts as AttentionMetadata.causal / kv_start), and two host flags of the step's
    shape (ref_unpadded, ref_all_visible: see AttentionMetadata)."""
    num_seqs = len(query_lens)
    max_q = max(query_lens)
    max_l = max(seq_lens)
    total = sum(query_lens)
    kv_idx = torch.zeros(num_seqs, max_l, dtype=torch.long)
    q_pad = torch.full((num_seqs, max_q), total, dtype=torch.long)
    q_unpad = torch.empty(total, dtype=torch.long)
    mask = torch.zeros(num_seqs, 1, max_q, max_l, dtype=torch.bool)
    q_pos = torch.zeros(num_seqs, 1, max_q, 1, dtype=torch.long)  # padding rows: position 0 (sees key 0)
    offset = 0
    for b, (ql, sl, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        pos = torch.arange(sl)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        kv_idx[b, :sl] = blocks * block_size + pos % block_size
        q_pad[b, :ql] = torch.arange(offset, offset + ql)
        q_unpad[offset : offset + ql] = b * max_q + torch.arange(ql)
        qpos = torch.arange(sl - ql, sl) if causal else torch.full((ql,), sl - 1)
        lo = kv_starts[b] if kv_starts is not None else 0
        mask[b, 0, :ql, :sl] = (pos[None, :] <= qpos[:, None]) & (pos[None, :] >= lo)
        q_pos[b, 0, :ql, 0] = qpos
        mask[b, 0, ql:, 0] = True  # padded query rows attend to one key so softmax stays finite
        offset += ql
    out = dict(kv_gather_idx=kv_idx, q_pad_idx=q_pad, q_unpad_idx=q_unpad, attn_mask=mask, q_positions=q_pos)
    moved: dict = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    # Host facts that let reference_attention skip work (the tensors above stay the definition):
    # no sequence has fewer queries than the longest (q is already the [B, Q] grid), and every query
    # sees every one of its row's L keys (one query per sequence at the full length, none hidden).
    moved["ref_unpadded"] = all(ql == max_q for ql in query_lens)
    moved["ref_all_visible"] = moved["ref_unpadded"] and all(sl == max_l for sl in seq_lens) \
        and (max_q == 1 or not causal) and not any(kv_starts or ())
    return moved


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V ([T, KH, D]) into their cache slots; a negative slot (a padding
    token) is not written. (The mask is a host sync on CUDA; the Triton path has none.)"""
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    if keep.numel() != slot_mapping.numel():
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    kv_cache[0].index_copy_(0, slot_mapping, k)
    kv_cache[1].index_copy_(0, slot_mapping, v)


def reference_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0
) -> torch.Tensor:
    """Paged causal attention in plain torch. q: [T, H, D] -> [T, H, D]. window > 0: a query at
    position p sees no key at a position <= p - window (a sliding-window layer)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    batch, max_q = meta.q_pad_idx.shape
    if meta.ref_unpadded:  # the gather through q_pad_idx would be the identity
        qp = q.view(batch, max_q, num_heads, head_dim).transpose(1, 2)  # [B, H, Q, D]
    else:
        q_ext = torch.cat([q, q.new_zeros(1, num_heads, head_dim)])
        qp = q_ext[meta.q_pad_idx].transpose(1, 2)
    k = kv_cache[0][meta.kv_gather_idx].transpose(1, 2)  # [B, KH, L, D]
    v = kv_cache[1][meta.kv_gather_idx].transpose(1, 2)
    mask = meta.attn_mask
    if window > 0:
        kpos = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (kpos > meta.q_positions - window)
    elif meta.ref_all_visible:  # an all-True mask: the same result, without reading it
        mask = None
    # enable_gqa: each group of query heads reads its K/V head in place (the same sums as repeating K/V).
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=num_kv_heads != num_heads)
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B*Q, H, D]
    return out if meta.ref_unpadded else out[meta.q_unpad_idx]


class ReferenceBackend(AttentionBackend):
    """reference_attention over metadata carrying build_reference_indices' gather indices; K/V
    written by write_kv; rotary by the model's torch module."""

    name = "reference"
    needs_reference_indices = True

    def prepare_metadata(self, query_lens, seq_lens, block_tables, block_size, device, causal=True, kv_starts=None):
        return build_reference_indices(query_lens, seq_lens, block_tables, block_size, device, causal, kv_starts)

    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        write_kv(kv_cache, k, v, slot_mapping)

    def forward(self, q, kv_cache, meta, scale, prefetch=None, window=0):
        return reference_attention(q, kv_cache, meta, scale, window)
