"""A CUDA-graph replay's inputs in one kernel: the step's ids, positions, slots, query_start_loc,
seq_lens and block tables copied into the graph's static buffers, and the padding rows filled.

CudaGraphRunner.run did this with six copies and up to six fills (torch ops), each a separate
launch on the GPU's timeline before the replay; `scripts/step_trace.py` showed them between the
staging copy and the graph at every step. Row r < n takes sequence r's values; a padding row
r >= n gets what CudaGraphRunner._fill documents (query_len tokens at positions 0.., slots in the
scratch block, seq_len = query_len); block-table entries past the step's width hold the scratch
block. The result is the same as the torch path (run() keeps it for the CPU). It also fills the
step's placeholder inputs from their device sources (the runner's gather, two torch index kernels
before: `input_ids[pos] = flat[src]`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels.pdl import launch_kwargs, wait_prior

# (positions [P] sorted, source indices [P], flat [F]): input_ids[positions[i]] = flat[sources[i]]
Placeholders = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# Runs eagerly at every replay: no value or alignment specialization on what changes from step to
# step (a new specialization compiles mid-run; bench spec at batch 16 lost 5x to such compiles).
@triton.jit(do_not_specialize=["n", "width", "stride_bt", "scratch", "block_size", "n_ph"],
            do_not_specialize_on_alignment=["ids_ptr", "pos_ptr", "slot_ptr", "qsl_ptr", "sl_ptr", "bt_ptr",
                                            "ph_pos_ptr", "ph_src_ptr", "flat_ptr"])
def _graph_inputs_kernel(
    ids_ptr, pos_ptr, slot_ptr, qsl_ptr, sl_ptr, bt_ptr,  # the step's tensors (n rows)
    d_ids, d_pos, d_slot, d_qsl, d_sl, d_bt,  # the graph's static buffers (b rows)
    ph_pos_ptr, ph_src_ptr, flat_ptr, n_ph,  # placeholders: ids[ph_pos[i]] = flat[ph_src[i]]
    n, width, stride_bt, scratch, block_size,
    MAX_BLOCKS: tl.constexpr, Q: tl.constexpr, Q_PAD: tl.constexpr, COLS: tl.constexpr,
    PH_BLOCK: tl.constexpr, PDL: tl.constexpr, WRITEBACK: tl.constexpr,
):
    """Program r fills row r of every buffer (and program 0 query_start_loc[0]). Its placeholder
    inputs take their device values, in the static buffer and in the step's ids (ids_ptr: the
    verifier reads the drafts there; WRITEBACK=False skips that write: the graph_stage_no_writeback
    fault)."""
    wait_prior(PDL)
    r = tl.program_id(0)
    real = r < n
    j = tl.arange(0, Q_PAD)
    tok = r * Q + j
    t_ok = j < Q
    src_ok = t_ok & real
    ids = tl.load(ids_ptr + tok, mask=src_ok, other=0)
    # The placeholders (sorted by position) among this row's tokens: scan the list in blocks.
    c0 = 0
    while c0 < n_ph:
        c = c0 + tl.arange(0, PH_BLOCK)
        p = tl.load(ph_pos_ptr + c, mask=c < n_ph, other=-1)
        mine = (c < n_ph) & (p >= r * Q) & (p < r * Q + Q) & real
        v = tl.load(flat_ptr + tl.load(ph_src_ptr + c, mask=mine, other=0), mask=mine, other=0)
        hit = (p[None, :] == tok[:, None]) & mine[None, :]  # [Q_PAD, PH_BLOCK]
        found = tl.max(hit.to(tl.int32), 1) > 0
        ids = tl.where(found, tl.sum(tl.where(hit, v[None, :], 0), 1), ids)
        if WRITEBACK:
            tl.store(ids_ptr + tok, ids, mask=found & src_ok)
        c0 += PH_BLOCK
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
    n: int, b: int, q: int, scratch: int, block_size: int, placeholders: Placeholders | None = None,
    options: KernelOptions = DEFAULT_OPTIONS, writeback: bool = True,
) -> None:
    """src = (input_ids [n*q], positions [n*q], slot_mapping [n*q], query_start_loc [n+1], seq_lens [n],
    block_tables [n, width]) of a step of n sequences with q tokens each; dst = the same six static
    buffers (block tables [>= b, max_blocks], contiguous), whose first b rows are written.
    placeholders: input_ids[pos] = flat[src] is applied first (to input_ids as well), as the
    runner's torch gather would. writeback=False (the graph_stage_no_writeback fault only) leaves the
    step's input_ids as they were."""
    ids, pos, slots, qsl, sl, bt = src
    d_ids, d_pos, d_slot, d_qsl, d_sl, d_bt = dst
    assert bt.stride(1) == 1 and d_bt.is_contiguous() and bt.shape[1] <= d_bt.shape[1]
    ph_pos, ph_src, flat = placeholders if placeholders is not None else (ids, ids, ids)
    n_ph = ph_pos.shape[0] if placeholders is not None else 0
    _graph_inputs_kernel[(b,)](
        ids, pos, slots, qsl, sl, bt, d_ids, d_pos, d_slot, d_qsl, d_sl, d_bt, ph_pos, ph_src, flat, n_ph,
        n, bt.shape[1], bt.stride(0), scratch, block_size, MAX_BLOCKS=d_bt.shape[1], Q=q,
        Q_PAD=triton.next_power_of_2(q), COLS=min(1024, triton.next_power_of_2(d_bt.shape[1])), PH_BLOCK=64,
        WRITEBACK=writeback, num_warps=1, **launch_kwargs(d_ids.device, options.pdl),
    )
