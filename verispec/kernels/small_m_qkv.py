"""The attention's input for 2..16 rows in one kernel, on the tensor cores (as qkv_rope.py at one row).

_small_m_qkv_rope_kernel: RMSNorm(x (+ residual)) in the K loop, the q/k/v projection (+ bias), NeoX
rotary on q and k, q stored, k / v written into each token's cache slot (slot < 0: not written). A
program's 16 weight rows are 8 rotary pairs (d, d + D/2) of one head: one [16, 16] dot per K tile
gives both halves of every pair (small_m._halves splits them). The rows are padded to small_m's BLOCK_M
tile, the first weight tile and the rows' positions, slots and cos / sin are loaded before the PDL wait
(the caller guarantees the kernel right before does not write them: qkv_rope.py's contract), and each
K step issues the next tiles' loads before it multiplies (kernels/small_m.py says why). Rounding: the
projection in float32 rounded once to the activation dtype, rotated in float32 and rounded again; the
norm as small_m's (x * nw into the dot, scaled by inv_rms after it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels import linear as lin
from verispec.kernels.pdl import launch_kwargs, wait_prior
from verispec.kernels.small_m import BLOCK_M, _check_rows, _halves, _load_x, _prep_x

ROPE_PAIRS = 8  # rotary pairs per program: 16 weight rows, tl.dot's smallest N


def qkv_block_k(k: int) -> int:
    """The K tile for a hidden size k (8 warps, no spills on sm_90: scripts/compile_check.py): 512 from
    k = 1024 (the 1.5B: three dependent steps for 1536 where 256 took six; one program per SM, so the
    221 registers do not bind), else 256 (the 0.5B's 896 spilled at 512)."""
    return 512 if k >= 1024 else min(256, max(16, triton.next_power_of_2(k)))


@triton.jit
def _small_m_qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, cache_ptr, nw_ptr, r_ptr, rout_ptr, eps, M,
    stride_xm, stride_wn, stride_qt, stride_qh, stride_c, stride_cs, stride_ch,
    K: tl.constexpr, HALF: tl.constexpr, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """Program p: rotary pairs j in [p * BLOCK_P, +BLOCK_P) modulo HALF of head p * BLOCK_P // HALF (q
    heads, then k, then v). Its 2 BLOCK_P weight rows: head * 2 HALF + j (the pairs' first rows), then
    those + HALF, so one dot gives both halves of every pair (split by _halves). The first weight tile,
    the rows' positions, slots and cos / sin are loaded before the PDL wait (qkv_rope.py's contract)."""
    first = tl.program_id(0) * BLOCK_P
    head = first // HALF
    j = first % HALF + tl.arange(0, BLOCK_P)
    i = tl.arange(0, 2 * BLOCK_P)
    row = head * 2 * HALF + first % HALF + i % BLOCK_P + (i // BLOCK_P) * HALF
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    kr = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + row.to(tl.int64)[:, None] * stride_wn
    w = tl.load(w_rows + kr[None, :], mask=(kr < K)[None, :], other=0.0)
    pos = tl.load(pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + m, mask=m_ok, other=-1).to(tl.int64)
    cos = tl.load(cos_ptr + pos[:, None] * HALF + j[None, :])
    sin = tl.load(sin_ptr + pos[:, None] * HALF + j[None, :])
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_P], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    wait_prior(PDL)
    x, r = _load_x(x_ptr, r_ptr, m, m_ok, kr, kr < K, stride_xm, K, NORM and HAS_RES)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kr
        kn = k + BLOCK_K  # the next tiles first
        w_next = tl.load(w_rows + kn[None, :], mask=(kn < K)[None, :], other=0.0)
        x_next, r_next = _load_x(x_ptr, r_ptr, m, m_ok, kn, kn < K, stride_xm, K, NORM and HAS_RES)
        xp, ss_t = _prep_x(x, r, rout_ptr, nw_ptr, m, m_ok, k, k < K, K, BLOCK_M, NORM, HAS_RES,
                           tl.program_id(0) == 0)
        ss += ss_t
        acc += tl.dot(xp, tl.trans(w), input_precision=DOT_PREC)
        w, x, r = w_next, x_next, r_next
    if NORM:
        acc *= (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + row).to(tl.float32)[None, :]
    dt = q_ptr.dtype.element_ty
    acc = acc.to(dt).to(tl.float32)  # the projection rounded once, as the unfused path's output
    a1, a2 = _halves(acc, BLOCK_M, 2 * BLOCK_P)
    is_q = head < NUM_Q
    is_k = (head >= NUM_Q) & (head < NUM_Q + NUM_KV)
    rotate = is_q | is_k
    o1 = tl.where(rotate, a1 * cos - a2 * sin, a1).to(dt)
    o2 = tl.where(rotate, a2 * cos + a1 * sin, a2).to(dt)
    rows_ok = m_ok[:, None] & (j < HALF)[None, :]
    q_dst = q_ptr + m.to(tl.int64)[:, None] * stride_qt + head * stride_qh + j[None, :]
    tl.store(q_dst, o1, mask=rows_ok & is_q)
    tl.store(q_dst + HALF, o2, mask=rows_ok & is_q)
    kv_head = tl.where(is_k, head - NUM_Q, head - NUM_Q - NUM_KV)
    c_dst = cache_ptr + tl.where(is_k, 0, stride_c) + slot[:, None] * stride_cs + kv_head * stride_ch + j[None, :]
    c_ok = rows_ok & (~is_q) & (slot >= 0)[:, None]
    tl.store(c_dst, o1, mask=c_ok)
    tl.store(c_dst + HALF, o2, mask=c_ok)


def small_m_qkv_rope_write_kv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None, block_k: int | None = None, options: KernelOptions = DEFAULT_OPTIONS,
):
    """qkv_rope.qkv_rope_write_kv's contract for M <= 16 rows on the tensor cores: q [M, H, D] rotated,
    k (rotated) and v written into kv_cache [2, slots, KH, D] at slot_mapping (< 0: not written);
    with norm=(weight, eps) returns (q, the new residual). head_dim must be a multiple of 2 * ROPE_PAIRS;
    block_k: the K tile (None: qkv_block_k)."""
    _check_rows(x, weight, residual)
    m, k = x.shape
    half = head_dim // 2
    if half % ROPE_PAIRS or weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"head_dim {head_dim} must be a multiple of {2 * ROPE_PAIRS} and weight "
                         f"[(H + 2 KH) * D, K], got {tuple(weight.shape)}")
    if kv_cache.stride(-1) != 1 or cos.dtype != torch.float32 or not cos.is_contiguous():
        raise ValueError("kv_cache needs a contiguous last dim and cos / sin contiguous float32 tables")
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    rout = torch.empty_like(x) if norm is not None and residual is not None else x
    if m:
        nw, eps = norm if norm is not None else (weight, 0.0)
        _small_m_qkv_rope_kernel[((num_heads + 2 * num_kv_heads) * half // ROPE_PAIRS,)](
            x, weight, bias if bias is not None else weight, positions, cos, sin, slot_mapping, q, kv_cache, nw,
            residual if residual is not None else x, rout, eps, m, x.stride(0), weight.stride(0), q.stride(0),
            q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), K=k, HALF=half,
            NUM_Q=num_heads, NUM_KV=num_kv_heads, BLOCK_M=BLOCK_M, BLOCK_P=ROPE_PAIRS,
            BLOCK_K=block_k or qkv_block_k(k), HAS_BIAS=bias is not None,
            NORM=norm is not None, HAS_RES=residual is not None, DOT_PREC=lin._dot_prec(x), num_warps=8,
            num_stages=2, **launch_kwargs(x.device, options.pdl),
        )
    return q if norm is None else (q, rout)
