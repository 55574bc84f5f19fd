"""Batch-invariant linear layers: a row's result never depends on how many rows the step has.

In batch-invariant mode (KernelOptions.batch_invariant) every linear layer (qkv, o, gate_up with
SiLU-and-mul, down, the LM head) runs linear.py's split-K kernel with one tile config and one K split
per weight, chosen from the weight's shape only (invariant_config), for every row count from 1 (decode)
to a prefill chunk. A row's output is then the same float32 sums in the same order whatever M is: more
rows only add M tiles to the grid, never change a tile, a split or the order in which the reduce kernel
adds the splits (0, 1, 2, ...). The one-row GEMV, the skinny kernel and cuBLAS, which pick other
kernels and split factors by shape, are not used. The kernels are linear.py's, jitted again without
specializing on the row count or the row strides (Triton compiles M == 1 and M % 16 == 0 separately
otherwise), so one compiled kernel serves every M.

linear / gate_up_silu have the signatures of linear.linear / linear.gate_up_silu (models/kernel_path.Kernels
hands the model these instead in batch-invariant mode) and always launch the kernel: CUDA tensors, or
CPU tensors under TRITON_INTERPRET (the tests).
"""

from __future__ import annotations

import torch
import triton

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels import linear as lin
from verispec.kernels.pdl import launch_kwargs

# What changes with the step is never a specialization: one compile for every row count.
_splitk = triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])(lin._splitk_kernel.fn)
_reduce = triton.jit(do_not_specialize=["M", "stride_om"])(lin._splitk_reduce_kernel.fn)

BLOCK_M, BLOCK_N = 32, 32
TARGET_PROGRAMS = lin.SPLITK_TARGET_PROGRAMS  # programs at one row: about one per SM of the H200
MAX_KS = lin.SPLITK_MAX_KS


def invariant_config(n_out: int, k: int, silu_mul: bool = False) -> dict:
    """The tiles and K split of an [M, k] x [k, n_out] product for every M: BLOCK_M 32 and BLOCK_N 32;
    BLOCK_K 128 (64 with SiLU-and-mul); SPLIT_K the smallest power of two that gives one row's grid at
    least TARGET_PROGRAMS programs with at most MAX_KS columns of K per split (and >= 2 BLOCK_K
    iterations each), as linear.splitk_config picks at 16 rows; 4 stages where a split has >= 4 iterations."""
    if n_out < 1 or k < 1:
        raise ValueError(f"invariant_config needs a non-empty weight, got n_out={n_out}, k={k}")
    bk = 64 if silu_mul else 128
    tiles = triton.cdiv(n_out, BLOCK_N)
    split = 1
    while (tiles * split < TARGET_PROGRAMS or triton.cdiv(k, split) > MAX_KS) and k >= 2 * split * 2 * bk:
        split *= 2
    stages = 4 if triton.cdiv(k, split * bk) >= 4 else 3
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     silu_mul: bool = False, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """x [M, K] (last dim contiguous) times weight [N, K]^T (+ bias) -> [M, N] in x's dtype (or [M, N/2]
    with silu_mul, weight stacking [gate; up]), with invariant_config's tiles and split for every M."""
    m, k, n_out, out = lin._out_for(x, weight, silu_mul)
    if m == 0:
        return out
    cfg = invariant_config(n_out, k, silu_mul)
    ks, split = lin.splitk_split(k, cfg["BLOCK_K"], cfg.pop("SPLIT_K"))
    ws = out if split == 1 else torch.empty(split, m, 2 * n_out if silu_mul else n_out, dtype=torch.float32,
                                            device=x.device)
    b = bias if bias is not None else weight
    pdl = launch_kwargs(x.device, options.pdl)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n_out, cfg["BLOCK_N"]), split)
    _splitk[grid](
        x, weight, b, out, ws, m, n_out, n_out if silu_mul else 0, x.stride(0), weight.stride(0), out.stride(0),
        K=k, KS=ks, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split, DOT_PREC=lin._dot_prec(x), **cfg,
        **pdl,
    )
    if split > 1:
        _reduce[(triton.cdiv(n_out, lin._REDUCE_BLOCK), m)](
            ws, b, out, m, n_out, out.stride(0), HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split,
            BLOCK_N=lin._REDUCE_BLOCK, num_warps=4, **pdl,
        )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
           options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """linear.linear's contract in batch-invariant mode: F.linear(x, weight, bias) rounded to x's dtype,
    then to out_dtype (the logits: float32), or copied into out."""
    y = invariant_linear(x, weight, bias, options=options)
    if out is not None:
        return out.copy_(y)
    return y if out_dtype is None else y.to(out_dtype)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up], batch-invariant (one rounding, in the epilogue)."""
    return invariant_linear(x, gate_up, silu_mul=True, options=options)
