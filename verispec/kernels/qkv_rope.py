"""One kernel for the attention's input at batch-1 decode: the fused q/k/v projection (+ bias),
NeoX rotary on q and k, and the K/V-cache write.

Unfused, the step runs the qkv GEMV, then a rotary + KV-write kernel over its output. Here each
program computes a pair of output rows (d, d + D/2) of one head, which is exactly what rotary
mixes, then rotates them (q and k heads), writes q to its output and k / v into the token's cache
slot (slot < 0: not written). Like kernels/linear.py's GEMV, the program's weight rows sit in
registers, loaded before the PDL wait, and so do the rows' positions, cos / sin and slots: the
caller guarantees that the kernel launched right before this one does not write them (in the model
it is the embedding, the previous layer's down projection or the input RMSNorm; kernels/pdl.py has
the contract).

Rounding matches the unfused path: the projection is accumulated in float32 and rounded to the
activation dtype once, then rotated in float32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels.linear import input_row
from verispec.kernels.pdl import launch_kwargs, wait_prior

NORM_PAIRS = 1  # rotary pairs per program with a norm prologue (more were slower: docs/BENCHMARKS.md)


@triton.jit
def _qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, cache_ptr, nw_ptr, r_ptr, rout_ptr, eps, M,
    stride_xm, stride_wn, stride_qt, stride_qh, stride_c, stride_cs, stride_ch,
    K: tl.constexpr, K_PAD: tl.constexpr, HALF: tl.constexpr, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
    BLOCK_P: tl.constexpr, M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p: pairs j in [p * BLOCK_P, (p + 1) * BLOCK_P) of head p * BLOCK_P // HALF (q heads,
    then k heads, then v heads); rows head * 2 * HALF + j and that + HALF."""
    first = tl.program_id(0) * BLOCK_P
    head = first // HALF
    j = first % HALF + tl.arange(0, BLOCK_P)
    k = tl.arange(0, K_PAD)
    k_ok = k < K
    row1 = head * 2 * HALF + j
    w1_ptrs = w_ptr + row1.to(tl.int64)[:, None] * stride_wn + k[None, :]
    w1 = tl.load(w1_ptrs, mask=k_ok[None, :], other=0.0)  # row d of the pair
    w2 = tl.load(w1_ptrs + HALF * stride_wn, mask=k_ok[None, :], other=0.0)  # row d + HALF
    b1 = tl.zeros([BLOCK_P], tl.float32)
    b2 = tl.zeros([BLOCK_P], tl.float32)
    if HAS_BIAS:
        b1 = tl.load(b_ptr + row1).to(tl.float32)
        b2 = tl.load(b_ptr + row1 + HALF).to(tl.float32)
    is_q = head < NUM_Q
    is_k = (head >= NUM_Q) & (head < NUM_Q + NUM_KV)
    kv_head = tl.where(is_k, head - NUM_Q, head - NUM_Q - NUM_KV)
    # The step's positions and slots come from the host copy before the forward, never from the
    # kernel right before this one, so they too are read before the wait.
    rows = tl.arange(0, M_PAD)
    rows_ok = rows < M
    pos_all = tl.load(pos_ptr + rows, mask=rows_ok, other=0).to(tl.int64)
    slot_all = tl.load(slot_ptr + rows, mask=rows_ok, other=-1).to(tl.int64)
    cos_all = tl.load(cos_ptr + pos_all[:, None] * HALF + j[None, :])  # [M_PAD, BLOCK_P]
    sin_all = tl.load(sin_ptr + pos_all[:, None] * HALF + j[None, :])
    nw = tl.zeros([K_PAD], tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    wait_prior(PDL)
    m = 0
    while m < M:  # a while loop: the interpreter cannot take a tensor bound in range()
        x = input_row(x_ptr, r_ptr, rout_ptr, nw, m, stride_xm, k, k_ok, eps, K, NORM, HAS_RES)[None, :]
        dt = q_ptr.dtype.element_ty
        a1 = (tl.sum(w1.to(tl.float32) * x, axis=1) + b1).to(dt).to(tl.float32)
        a2 = (tl.sum(w2.to(tl.float32) * x, axis=1) + b2).to(dt).to(tl.float32)
        this = rows[:, None] == m
        cos = tl.sum(tl.where(this, cos_all, 0.0), axis=0)
        sin = tl.sum(tl.where(this, sin_all, 0.0), axis=0)
        slot = tl.sum(tl.where(rows == m, slot_all, 0), axis=0)
        rotate = is_q | is_k
        o1 = tl.where(rotate, a1 * cos - a2 * sin, a1).to(dt)
        o2 = tl.where(rotate, a2 * cos + a1 * sin, a2).to(dt)
        q_dst = q_ptr + m * stride_qt + head * stride_qh + j
        tl.store(q_dst, o1, mask=is_q & (j < HALF))
        tl.store(q_dst + HALF, o2, mask=is_q & (j < HALF))
        c_dst = cache_ptr + tl.where(is_k, 0, stride_c) + slot * stride_cs + kv_head * stride_ch + j
        c_ok = (~is_q) & (slot >= 0) & (j < HALF)
        tl.store(c_dst, o1, mask=c_ok)
        tl.store(c_dst + HALF, o2, mask=c_ok)
        m += 1


def qkv_rope_write_kv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None, options: KernelOptions = DEFAULT_OPTIONS,
):
    """q [M, H, D] rotated, with k (rotated) and v written into kv_cache [2, slots, KH, D] at
    slot_mapping. weight [(H + 2 KH) * D, K] stacks q, k and v; cos / sin: float32 [max_pos, D/2].

    norm=(weight, eps): x is RMSNorm'ed first (after adding `residual`), as linear.gemv does; then
    returns (q, the new residual)."""
    m, k = x.shape
    half = head_dim // 2
    assert weight.shape == ((num_heads + 2 * num_kv_heads) * head_dim, k) and weight.stride(1) == 1
    assert x.stride(1) == 1 and kv_cache.stride(-1) == 1 and cos.dtype == torch.float32 and cos.is_contiguous()
    assert residual is None or (residual.shape == x.shape and residual.is_contiguous())
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    rout = torch.empty_like(x) if norm is not None and residual is not None else x
    if m == 0:
        return q if norm is None else (q, rout)
    nw, eps = norm if norm is not None else (weight, 0.0)
    k_pad = triton.next_power_of_2(k)
    block_p = NORM_PAIRS if norm is not None else 1
    _qkv_rope_kernel[((num_heads + 2 * num_kv_heads) * half // block_p,)](
        x, weight, bias if bias is not None else weight, positions, cos, sin, slot_mapping, q, kv_cache, nw,
        residual if residual is not None else x, rout, eps, m,
        x.stride(0), weight.stride(0), q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), K=k, K_PAD=k_pad, HALF=half, NUM_Q=num_heads, NUM_KV=num_kv_heads,
        BLOCK_P=block_p, M_PAD=triton.next_power_of_2(m), HAS_BIAS=bias is not None, NORM=norm is not None,
        HAS_RES=residual is not None, num_warps=max(2, min(8, 2 * block_p * k_pad // 2048)),
        **launch_kwargs(x.device, options.pdl),
    )
    return q if norm is None else (q, rout)
