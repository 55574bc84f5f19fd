"""Row-wise argmax of float32 logits: two short Triton kernels instead of torch's reduction, which on
the H200 took 8.8 us for one 151,936-wide row (one program per row; `scripts/step_trace.py`).

Stage 1 splits each row into CHUNK-wide pieces, one program each, and keeps every piece's maximum and
its first index; stage 2 picks, per row, the first piece holding the row's maximum. So ties resolve
to the first index, as torch.argmax does. NaN counts as +inf (torch returns a NaN's index; here a
+inf before it would win). argmax_rows(..., with_counts=True) also writes the R ones that follow
the tokens in a greedy decode step's packed result (ModelRunner._verify), saving a cat kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels.pdl import launch_kwargs, wait_prior

CHUNK = 2048


@triton.jit  # its arguments are the same every step (fresh, aligned logits of one vocabulary)
def _argmax_chunk_kernel(x_ptr, pv_ptr, pi_ptr, N, stride_x, NUM_CHUNKS, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """(max, first index of it) of logits row r's piece c -> pv / pi [R, NUM_CHUNKS]."""
    wait_prior(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + r * stride_x + offs, mask=offs < N, other=float("-inf"))
    x = tl.where(x != x, float("inf"), x)
    v, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(pv_ptr + r * NUM_CHUNKS + c, v)
    tl.store(pi_ptr + r * NUM_CHUNKS + c, c * CHUNK + i)


@triton.jit(do_not_specialize=["R"])  # the row count changes per step: one compile for all
def _argmax_rows_kernel(pv_ptr, pi_ptr, out_ptr, R, NUM_CHUNKS, C_PAD: tl.constexpr, COUNTS: tl.constexpr,
                        PDL: tl.constexpr):
    """out[r] = the index in the first piece holding row r's maximum; COUNTS: out[R + r] = 1."""
    wait_prior(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    ok = c < NUM_CHUNKS
    v = tl.load(pv_ptr + r * NUM_CHUNKS + c, mask=ok, other=float("-inf"))
    idx = tl.load(pi_ptr + r * NUM_CHUNKS + c, mask=ok, other=0)
    _, j = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + r, tl.sum(tl.where(c == j, idx, 0), 0).to(tl.int64))
    if COUNTS:
        tl.store(out_ptr + R + r, 1)


def argmax_rows(logits: torch.Tensor, with_counts: bool = False, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """logits [R, N] float32 (rows contiguous) -> [R] int64 argmax per row; with_counts: [2R], the
    argmax then R ones."""
    rows, n = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(2 * rows if with_counts else rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(n, CHUNK)
    pv = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    pi = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    pdl = launch_kwargs(logits.device, options.pdl)
    _argmax_chunk_kernel[(rows, chunks)](logits, pv, pi, n, logits.stride(0), chunks, CHUNK=CHUNK, num_warps=4, **pdl)
    _argmax_rows_kernel[(rows,)](pv, pi, out, rows, chunks, C_PAD=max(16, triton.next_power_of_2(chunks)),
                                 COUNTS=with_counts, num_warps=1, **pdl)
    return out
