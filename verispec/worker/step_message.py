"""A step's model inputs as one int64 tensor, for the tensor-parallel step broadcast.

Rank 0's runner packs what every rank's forward needs, after the placeholders were filled on its
device: header [op, T, S, width, max_query_len, max_seq_len, logit rows (-1: every token, in order;
0: no logits this step), 0], then ids [T], positions [T], slots [T], logit rows, query_start_loc
[S + 1], seq_lens [S], block tables [S * width]. The other ranks unpack it into the same tensors
(views of the received buffer) and host lists for the reference attention's indices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from verispec.core.attention_metadata import AttentionMetadata

HEADER = 8  # int64 slots of every message's header
# A step; the buffer grows to header[1] slots; leave the step loop; a new engine's set-up follows.
OP_STEP, OP_GROW, OP_STOP, OP_SETUP = 1, 2, 3, 4


class StepInputs(NamedTuple):
    """One step's forward inputs as a non-zero rank receives them."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    num_seqs: int
    logit_rows: torch.Tensor | None  # None: every token is a logit row (or none: see has_logits)
    has_logits: bool
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]


def pack_step(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              logit_rows: torch.Tensor | None, has_logits: bool) -> torch.Tensor:
    """The message of one step (on ids' device; one small host->device copy for the header)."""
    num_seqs, width = meta.block_tables.shape
    rows = -1 if logit_rows is None else logit_rows.numel()
    header = torch.tensor([OP_STEP, ids.numel(), num_seqs, width, meta.max_query_len, meta.max_seq_len,
                           rows if has_logits else 0, 0], dtype=torch.long)
    if ids.is_cuda:
        header = header.pin_memory().to(ids.device, non_blocking=True)
    parts = [header, ids, positions, meta.slot_mapping]
    if has_logits and logit_rows is not None:
        parts.append(logit_rows)
    parts += [meta.query_start_loc.long(), meta.seq_lens.long(), meta.block_tables.reshape(-1).long()]
    return torch.cat(parts)


def unpack_step(buf: torch.Tensor, block_size: int, host_lists: bool) -> StepInputs:
    """The inputs packed by pack_step (buf: the received buffer, header first). host_lists: also read
    query_lens, seq_lens and tables back to the host (the reference backend's indices need them)."""
    _, t, s, width, max_q, max_s, rows, _ = buf[:HEADER].tolist()
    o = HEADER
    ids, positions, slots = buf[o : o + t], buf[o + t : o + 2 * t], buf[o + 2 * t : o + 3 * t]
    o += 3 * t
    logit_rows = None
    if rows > 0:
        logit_rows, o = buf[o : o + rows], o + rows
    qsl = buf[o : o + s + 1].to(torch.int32)
    seq_lens = buf[o + s + 1 : o + 2 * s + 1].to(torch.int32)
    tables = buf[o + 2 * s + 1 : o + 2 * s + 1 + s * width].to(torch.int32).view(s, width)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
                             max_query_len=max_q, max_seq_len=max_s, block_size=block_size)
    if not host_lists:
        return StepInputs(ids, positions, meta, s, logit_rows, rows != 0, [], [], [])
    q_host = qsl.tolist()
    query_lens = [b - a for a, b in zip(q_host, q_host[1:], strict=False)]
    return StepInputs(ids, positions, meta, s, logit_rows, rows != 0, query_lens, seq_lens.tolist(),
                      tables.tolist())
