"""Linear layers for 2..SMALL_M_MAX_ROWS rows (a batch-1 verify, a small batch): tensor cores, W read once.

A verify forward of 1 + k tokens reads the same weights as a one-row decode. The one-row GEMV reduces
row by row on the CUDA cores, so its cost grows with the rows; cuBLAS and the skinny kernel tile for
compute. Here the rows are padded to one BLOCK_M = 16 tile (masked loads: padding rows fetch nothing),
so every program streams its [BLOCK_N, K] slice of W exactly once, tile by tile, and `tl.dot` does the
math on the tensor cores: the cost stays the weight stream's, whatever the row count up to 16.

  * _small_m_kernel: y = x @ W^T (+ bias), optionally SiLU-and-mul over a stacked [gate; up] weight,
    optionally RMSNorm(x (+ residual)) * nw in the prologue, and split over K (SPLIT_K > 1: float32
    partials, added in split order by linear.py's reduce kernel; never with the norm).
  * _small_m_qkv_rope_kernel: the attention's input in one kernel (as qkv_rope.py at one row): the norm
    prologue, the q/k/v projection (+ bias), NeoX rotary on q and k, q stored, k / v written into the
    token's cache slot. A program computes 16 rotary pairs (d, d + D/2) of one head: two [16, 16] dots.

The norm rides in the K loop instead of a pass of its own: RMSNorm(x)[m, k] W[n, k] summed over k is
inv_rms[m] * sum_k (x[m, k] nw[k]) W[n, k], so each tile feeds x * nw to the dot and adds x^2 to the
row's sum of squares, and the accumulator is scaled by inv_rms once after the loop (a separate walk over
K first, the reverted session-9 prologue, cost a dependent L2 round trip per tile). Rounding therefore
differs from the unfused path in bf16 (x * nw is rounded to the dot's input dtype instead of the normed
x); it is one rounding of the input either way, and float32 inputs take exact (ieee) dots. The
residual sum is rounded to x's dtype before it is squared, as fused.rms_norm does; the programs of the
first column block store it.

Not batch invariant (issue 18): the tile, split and the fused norm differ from the one-row GEMV and
from kernels/invariant.py, so KernelOptions.batch_invariant never routes here (models/kernel_path.py).
PDL: every load of an activation follows wait_prior (kernels/pdl.py); the K loop streams W after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels import linear as lin  # linear imports this module too: its names are read at call time
from verispec.kernels.pdl import launch_kwargs, wait_prior

SMALL_M_MAX_ROWS = 16  # one BLOCK_M tile: the rows a verify of k <= 15 drafts (or a batch of 16) has
BLOCK_M = 16
ROPE_PAIRS = 16  # rotary pairs per qkv program (tl.dot's smallest N)


@triton.jit
def _input_tile(x_ptr, r_ptr, rout_ptr, nw_ptr, m, m_ok, k, k_ok, stride_xm, K: tl.constexpr,
                BLOCK_M: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES):
    """x[m, k] for one K tile, and its rows' sum of squares; with NORM the tile is x * nw (after the
    residual add with HAS_RES, whose sum the caller's STORE_RES programs write to rout)."""
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + m.to(tl.int64)[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    ss = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        if HAS_RES:
            res = m.to(tl.int64)[:, None] * K + k[None, :]
            x = (x.to(tl.float32) + tl.load(r_ptr + res, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            if STORE_RES:
                tl.store(rout_ptr + res, x, mask=mask)
        xf = x.to(tl.float32)
        ss = tl.sum(xf * xf, 1)
        x = (xf * tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
    return x, ss


@triton.jit
def _small_m_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, nw_ptr, r_ptr, rout_ptr, eps, M, N_OUT, UP_OFFSET,
    stride_xm, stride_wn, stride_om, K: tl.constexpr, KS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (N blocks, SPLIT_K): columns [pid0 * BLOCK_N, +BLOCK_N) of every row over K range
    [s * KS, (s + 1) * KS). SPLIT_K == 1: bias, SiLU-and-mul and the store (rounded to x's dtype,
    then stored in out's dtype: float32 logits as F.linear(...).float()). Else the float32 partials
    go to ws [SPLIT_K, M, N_OUT] ([SPLIT_K, M, 2 N_OUT] with SILU_MUL), linear._splitk_reduce_kernel's layout."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N_OUT
    m_ok = m < M
    kr = s * KS + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    wait_prior(PDL)
    for k0 in range(0, KS, BLOCK_K):  # a constant trip count; the K tail is masked
        k = k0 + kr
        k_ok = k < K
        x, ss_t = _input_tile(x_ptr, r_ptr, rout_ptr, nw_ptr, m, m_ok, k, k_ok, stride_xm, K, BLOCK_M, NORM, HAS_RES,
                              pid_n == 0)
        ss += ss_t
        w_mask = n_ok[:, None] & k_ok[None, :]
        acc += tl.dot(x, tl.trans(tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)), input_precision=DOT_PREC)
        if SILU_MUL:
            wu = tl.load(w_rows + UP_OFFSET * stride_wn + k[None, :], mask=w_mask, other=0.0)
            acc_up += tl.dot(x, tl.trans(wu), input_precision=DOT_PREC)
    if NORM:
        inv = (1.0 / tl.sqrt(ss / K + eps))[:, None]
        acc *= inv
        acc_up *= inv
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        y = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], y, mask=mask)
    else:
        ws_n = 2 * N_OUT if SILU_MUL else N_OUT
        ws = ws_ptr + (s * M + m.to(tl.int64))[:, None] * ws_n + n[None, :]
        tl.store(ws, acc, mask=mask)
        if SILU_MUL:
            tl.store(ws + N_OUT, acc_up, mask=mask)


def small_m_config(n_out: int, k: int, silu_mul: bool = False, norm: bool = False) -> dict:
    """Tiles and K split for _small_m_kernel on an [M <= 16, k] x [k, n_out] product (not measured on
    the GPU yet: scripts/gpu_verify.sh times them). BLOCK_N 64 for the LM head (n_out >= 32768: ~2,400
    programs), 32 for gate_up (280 programs at the 1.5B), else 16 (o, down: 96 programs); BLOCK_K 128
    for the fused SiLU-and-mul (two weight tiles a step), 512 where K >= 4096 (down_proj: 35 tiles of
    16 KB keep ~64 KB of W in flight per program without a split), else 256. SPLIT_K 1: one kernel per
    layer, no reduce launch."""
    if n_out < 1 or k < 1:
        raise ValueError(f"small_m_config needs a non-empty weight, got n_out={n_out}, k={k}")
    bn = 64 if n_out >= 32768 else (32 if silu_mul else 16)
    bk = 128 if silu_mul else (512 if k >= 4096 else 256)
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=4, num_stages=4 if triton.cdiv(k, bk) >= 4 else 3)


def _check_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """The shapes and unit strides the kernels assume, as ValueErrors before any launch."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not make x @ weight^T")
    if x.shape[0] > SMALL_M_MAX_ROWS:
        raise ValueError(f"the small-M kernels take at most {SMALL_M_MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dimension")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"residual must be contiguous with x's shape {tuple(x.shape)}")


def small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
    norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None, config: dict | None = None,
    options: KernelOptions = DEFAULT_OPTIONS,
):
    """x [M <= 16, K] (last dim contiguous) times weight [N, K]^T (+ bias) -> [M, N] (or [M, N/2] with
    silu_mul, weight stacking [gate; up]), in out_dtype (default x's; rounded to x's dtype first) or
    into `out`. norm=(weight, eps): RMSNorm(x (+ residual)) first, as linear.gemv; then returns
    (out, the new residual x + residual, or x itself without one). config: small_m_config's keys."""
    _check_rows(x, weight, residual)
    m, k = x.shape
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    cfg = dict(config or small_m_config(n_out, k, silu_mul, norm is not None))
    if norm is not None and cfg["SPLIT_K"] != 1:
        raise ValueError("the norm prologue needs every column of K in one program (SPLIT_K 1)")
    if out is None:
        out = torch.empty(m, n_out, dtype=out_dtype or x.dtype, device=x.device)
    if out.shape != (m, n_out) or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n_out}] with a contiguous last dimension")
    rout = torch.empty_like(x) if norm is not None and residual is not None else x
    if m:
        ks, split = lin.splitk_split(k, cfg["BLOCK_K"], cfg.pop("SPLIT_K"))
        ws = out if split == 1 else torch.empty(split, m, 2 * n_out if silu_mul else n_out, dtype=torch.float32,
                                                device=x.device)
        b = bias if bias is not None else weight
        nw, eps = norm if norm is not None else (weight, 0.0)
        pdl = launch_kwargs(x.device, options.pdl)
        _small_m_kernel[(triton.cdiv(n_out, cfg["BLOCK_N"]), split)](
            x, weight, b, out, ws, nw, residual if residual is not None else x, rout, eps, m, n_out,
            n_out if silu_mul else 0, x.stride(0), weight.stride(0), out.stride(0), K=k, KS=ks,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None, HAS_RES=residual is not None,
            SPLIT_K=split, BLOCK_M=BLOCK_M, DOT_PREC=lin._dot_prec(x), **cfg, **pdl,
        )
        if split > 1:
            y = out if out.dtype == x.dtype else torch.empty(m, n_out, dtype=x.dtype, device=x.device)
            lin._splitk_reduce_kernel[(triton.cdiv(n_out, lin._REDUCE_BLOCK), m)](
                ws, b, y, m, n_out, y.stride(0), HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split,
                BLOCK_N=lin._REDUCE_BLOCK, num_warps=4, **pdl,
            )
            if y is not out:
                out.copy_(y)
    return out if norm is None else (out, rout)


@triton.jit
def _small_m_qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, cache_ptr, nw_ptr, r_ptr, rout_ptr, eps, M,
    stride_xm, stride_wn, stride_qt, stride_qh, stride_c, stride_cs, stride_ch,
    K: tl.constexpr, HALF: tl.constexpr, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """Program p: pairs j in [p * BLOCK_P, +BLOCK_P) modulo HALF of head p * BLOCK_P // HALF (q heads,
    then k, then v); weight rows head * 2 HALF + j and that + HALF, for every row m < M."""
    first = tl.program_id(0) * BLOCK_P
    head = first // HALF
    j = first % HALF + tl.arange(0, BLOCK_P)
    row1 = head * 2 * HALF + j
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    kr = tl.arange(0, BLOCK_K)
    w1_rows = w_ptr + row1.to(tl.int64)[:, None] * stride_wn
    acc1 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    # Positions and slots come from the host copy before the forward (qkv_rope.py's contract).
    pos = tl.load(pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + m, mask=m_ok, other=-1).to(tl.int64)
    cos = tl.load(cos_ptr + pos[:, None] * HALF + j[None, :])
    sin = tl.load(sin_ptr + pos[:, None] * HALF + j[None, :])
    wait_prior(PDL)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kr
        k_ok = k < K
        x, ss_t = _input_tile(x_ptr, r_ptr, rout_ptr, nw_ptr, m, m_ok, k, k_ok, stride_xm, K, BLOCK_M, NORM, HAS_RES,
                              tl.program_id(0) == 0)
        ss += ss_t
        w1 = tl.load(w1_rows + k[None, :], mask=k_ok[None, :], other=0.0)
        w2 = tl.load(w1_rows + HALF * stride_wn + k[None, :], mask=k_ok[None, :], other=0.0)
        acc1 += tl.dot(x, tl.trans(w1), input_precision=DOT_PREC)
        acc2 += tl.dot(x, tl.trans(w2), input_precision=DOT_PREC)
    if NORM:
        inv = (1.0 / tl.sqrt(ss / K + eps))[:, None]
        acc1 *= inv
        acc2 *= inv
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + row1).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + row1 + HALF).to(tl.float32)[None, :]
    dt = q_ptr.dtype.element_ty
    a1 = acc1.to(dt).to(tl.float32)  # the projection rounded once, as the unfused path's output
    a2 = acc2.to(dt).to(tl.float32)
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
    residual: torch.Tensor | None = None, block_k: int = 128, options: KernelOptions = DEFAULT_OPTIONS,
):
    """qkv_rope.qkv_rope_write_kv's contract for M <= 16 rows on the tensor cores: q [M, H, D] rotated,
    k (rotated) and v written into kv_cache [2, slots, KH, D] at slot_mapping (< 0: not written);
    with norm=(weight, eps) returns (q, the new residual). head_dim must be a multiple of 2 * ROPE_PAIRS."""
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
            BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))), HAS_BIAS=bias is not None,
            NORM=norm is not None, HAS_RES=residual is not None, DOT_PREC=lin._dot_prec(x), num_warps=4,
            num_stages=4, **launch_kwargs(x.device, options.pdl),
        )
    return q if norm is None else (q, rout)
