"""Per-step attention metadata: built by the runner, read by every attention backend and the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the runner, read-only for the model.

    Shapes: T = tokens in the step, B = sequences, Q = longest query, L = longest context.
    """

    slot_mapping: torch.Tensor  # [T] long: cache slot each new token's K/V is written to (< 0: not written)
    query_start_loc: torch.Tensor  # [B+1] int32: token offsets of each sequence in the step
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    block_size: int | None = None  # tokens per KV block (engine constant; Triton backend needs it)
    causal: bool = True  # False: every query sees all of its sequence's keys (DFlash drafter blocks)
    kv_start: torch.Tensor | None = None  # [B]: keys below kv_start[b] are invisible (None: from 0)
    # Reference backend only: padded gather indices and the mask (see build_reference_indices).
    kv_gather_idx: torch.Tensor | None = None  # [B, L] long slots (padding -> 0)
    q_pad_idx: torch.Tensor | None = None  # [B, Q] long token index (padding -> T, a zero row)
    q_unpad_idx: torch.Tensor | None = None  # [T] long index into the flattened [B*Q]
    attn_mask: torch.Tensor | None = None  # [B, 1, Q, L] bool, True = may attend
    q_positions: torch.Tensor | None = None  # [B, 1, Q, 1] long query positions (padding -> 0), for windows
    # Host facts of the same step (build_reference_indices), which let the reference skip identity gathers:
    ref_unpadded: bool = False  # every sequence has Q queries: q_pad_idx is arange(T).view(B, Q)
    ref_all_visible: bool = False  # and attn_mask is all True (one query each at the full length L)
