"""A CUDA-graph replay's inputs in one kernel: the step's ids, positions, slots, query_start_loc,
seq_lens and block tables copied into the graph's static buffers, and the padding rows filled.

CudaGraphRunner.run did this with six copies and up to six fills (torch ops), each a separate
launch on the GPU's timeline before the replay; `scripts/step_trace.py` showed them between the
staging copy and the graph at every step. Row r < n takes sequence r's values; a padding row
r >= n gets what CudaGraphRunner._fill documents (query_len tokens at positions 0.., slots in the
scratch block, seq_len = query_len); block-table entries past the step's width hold the scratch
block. The result is the same as the torch path (run() keeps it for the CPU).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from verispec.kernels.pdl import launch_kwargs, wait_prior  # noqa: E402


# Runs eagerly at every replay: no value or alignment specialization on what changes from step to
# step (a new specialization compiles mid-run; bench spec at batch 16 lost 5x to such compiles).
@triton.jit(do_not_specialize=["n", "width", "stride_bt", "scratch", "block_size"],
            do_not_specialize_on_alignment=["ids_ptr", "pos_ptr", "slot_ptr", "qsl_ptr", "sl_ptr", "bt_ptr"])
def _graph_inputs_kernel(
    ids_ptr, pos_ptr, slot_ptr, qsl_ptr, sl_ptr, bt_ptr,  # the step's tensors (n rows)
    d_ids, d_pos, d_slot, d_qsl, d_sl, d_bt,  # the graph's static buffers (b rows)
    n, width, stride_bt, scratch, block_size,
    MAX_BLOCKS: tl.constexpr, Q: tl.constexpr, Q_PAD: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr,
):
    """Program r fills row r of every buffer (and program 0 query_start_loc[0])."""
    wait_prior(PDL)
    r = tl.program_id(0)
    real = r < n
    j = tl.arange(0, Q_PAD)
    tok = r * Q + j
    t_ok = j < Q
    src_ok = t_ok & real
    ids = tl.load(ids_ptr + tok, mask=src_ok, other=0)
    pos = tl.load(pos_ptr + tok, mask=src_ok, other=0)
    slot = tl.load(slot_ptr + tok, mask=src_ok, other=0)
    pad_slot = scratch.to(tl.int64) * block_size + j % block_size
    tl.store(d_ids + tok, ids, mask=t_ok)
    tl.store(d_pos + tok, tl.where(real, pos, j.to(tl.int64)), mask=t_ok)
    tl.store(d_slot + tok, tl.where(real, slot, pad_slot), mask=t_ok)
    qsl = tl.load(qsl_ptr + r + 1, mask=real, other=0)
    tl.store(d_qsl + r + 1, tl.where(real, qsl, (r + 1) * Q))
    if r == 0:
        tl.store(d_qsl, tl.load(qsl_ptr))
    tl.store(d_sl + r, tl.where(real, tl.load(sl_ptr + r, mask=real, other=0), Q))
    for c0 in tl.static_range(0, MAX_BLOCKS, COLS):
        c = c0 + tl.arange(0, COLS)
        blk = tl.load(bt_ptr + r.to(tl.int64) * stride_bt + c, mask=real & (c < width), other=scratch)
        tl.store(d_bt + r.to(tl.int64) * MAX_BLOCKS + c, blk, mask=c < MAX_BLOCKS)


def stage_graph_inputs(
    src: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    n: int, b: int, q: int, scratch: int, block_size: int,
) -> None:
    """src = (input_ids [n*q], positions [n*q], slot_mapping [n*q], query_start_loc [n+1], seq_lens [n],
    block_tables [n, width]) of a step of n sequences with q tokens each; dst = the same six static
    buffers (block tables [>= b, max_blocks], contiguous), whose first b rows are written."""
    ids, pos, slots, qsl, sl, bt = src
    d_ids, d_pos, d_slot, d_qsl, d_sl, d_bt = dst
    assert bt.stride(1) == 1 and d_bt.is_contiguous() and bt.shape[1] <= d_bt.shape[1]
    _graph_inputs_kernel[(b,)](
        ids, pos, slots, qsl, sl, bt, d_ids, d_pos, d_slot, d_qsl, d_sl, d_bt,
        n, bt.shape[1], bt.stride(0), scratch, block_size, MAX_BLOCKS=d_bt.shape[1], Q=q, Q_PAD=triton.next_power_of_2(q), COLS=min(1024, triton.next_power_of_2(d_bt.shape[1])),
        num_warps=1, **launch_kwargs(d_ids.device),
    )
