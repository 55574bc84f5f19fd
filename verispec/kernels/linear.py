"""Linear layers for few rows of x: y = x @ W^T (+ bias), streaming W once at full bandwidth.

At batch-1 decode a linear layer is a matrix-vector product bound by reading W. Three Triton kernels:
  * _gemv_kernel (one row, every layer including the LM head): each program holds its 1-2 rows of W
    entirely in registers, loaded before it waits for the previous kernel (programmatic dependent
    launch, see kernels/pdl.py), so the weight stream overlaps the previous kernel's tail.
  * _skinny_kernel (2..SKINNY_MAX_ROWS rows): narrow column blocks, K looped in tiles; cuBLAS keeps
    down_proj and the LM head there (skinny_config returns None).
  * _splitk_kernel (batched decode, KernelOptions.splitk_min_rows..splitk_max_rows rows): tl.dot
    tiles with K split across programs, so that a narrow layer still has ~1 program per SM; the
    float32 partial sums go to a workspace that _splitk_reduce_kernel adds up (one kernel when
    SPLIT_K is 1).
Epilogues fuse what follows:
  * bias add (Qwen2's q/k/v projection);
  * SiLU-and-mul for a fused [gate; up] weight (the MLP's first projection): the program reads
    the gate rows and the matching up rows and writes silu(gate) * up directly.

linear(x, w, b) and gate_up_silu(x, w) pick the kernel for CUDA tensors and fall back to torch
otherwise; the *_ref functions are the torch references the tests compare against. Every entry
point takes options= (core/options.py: PDL, the split-K row range). Rounding: one float32
accumulation per output, rounded once to x.dtype (the fused SiLU-and-mul skips the intermediate
rounding of gate and up). The measurements behind each kernel's row range and tiles are in
docs/BENCHMARKS.md (sessions 2-5; "Moved from docstrings (0.2 layout)").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels.pdl import launch_kwargs, wait_prior

SKINNY_MAX_ROWS = 16  # above this many rows, cuBLAS tiles well enough
# Up to KernelOptions.gemv_max_rows rows (1: batch-1 decode): the weight-resident GEMV for every layer,
# the LM head included. The split-K row range is KernelOptions.splitk_*_rows.


@triton.jit
def input_row(x_ptr, r_ptr, rout_ptr, nw, m, stride_xm, k, k_ok, eps,
              K: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """Row m of a GEMV's input, in float32: x[m]; with NORM, RMSNorm(x[m] (+ residual[m])) * nw,
    rounded exactly as fused.rms_norm rounds (the sum, then the output, to x's dtype). With a
    residual, program 0 writes the sum to rout (rows of K contiguous elements, like the residual)."""
    x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
    if NORM:
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptr + m * K + k, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
            if tl.program_id(0) == 0:
                tl.store(rout_ptr + m * K + k, x, mask=k_ok)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / K + eps)
        x = (xf * inv * nw).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, nw_ptr, r_ptr, rout_ptr, eps, M, N_OUT, UP_OFFSET, stride_xm, stride_wn,
    stride_om, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for m < M (few rows); SILU_MUL as _skinny_kernel;
    NORM: x is first RMSNorm'ed (after the residual add, HAS_RES) as input_row does.

    Each program loads its whole weight slice [BLOCK_N, K] into registers first (every load in
    flight at once, and before the PDL wait, so the weights stream while the previous kernel
    finishes), then reads the rows of x and reduces over K in float32. (Splitting K into two
    power-of-two tiles, 8960 = 8192 + 1024 instead of a padded 16384, measured slower on the H200.)"""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, K_PAD)
    n_ok = n < N_OUT
    k_ok = k < K
    w_mask = n_ok[:, None] & k_ok[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    w = tl.load(w_rows, mask=w_mask, other=0.0)
    wu = w
    if SILU_MUL:
        wu = tl.load(w_rows + UP_OFFSET * stride_wn, mask=w_mask, other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    nw = tl.zeros([K_PAD], tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    wait_prior(PDL)
    m = 0
    while m < M:  # a while loop: the interpreter cannot take a tensor bound in range()
        x = input_row(x_ptr, r_ptr, rout_ptr, nw, m, stride_xm, k, k_ok, eps, K, NORM, HAS_RES)[None, :]
        acc = tl.sum(w.to(tl.float32) * x, axis=1) + bias
        if SILU_MUL:
            up = tl.sum(wu.to(tl.float32) * x, axis=1)
            acc = acc / (1.0 + tl.exp(-acc)) * up
        # Rounded to x's dtype first, also into a float32 out (logits): as F.linear(...).float().
        tl.store(out_ptr + m * stride_om + n, acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=n_ok)
        m += 1


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N_OUT, UP_OFFSET,
    stride_xm, stride_wn, stride_om, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k] (+ b[n]); SILU_MUL: silu(that) * (same with row n + UP_OFFSET)."""
    wait_prior(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N_OUT
    m_ok = m < M
    kr = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kr
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if SILU_MUL:
            wu = tl.load(w_rows + UP_OFFSET * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if USE_DOT:
                acc_up += tl.dot(x, tl.trans(wu), input_precision=DOT_PREC)
            else:
                acc_up += tl.sum(x.to(tl.float32)[:, None, :] * wu.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_config(m: int, n_out: int, k: int, silu_mul: bool = False) -> dict | None:
    """Tile sizes for an [m, k] x [k, n_out] product, or None where cuBLAS is as fast (`verispec
    bench linear --sweep`): a huge N (the LM head, which cuBLAS streams at ~96% of HBM bandwidth)
    and K >> N (down_proj: cuBLAS splits K, this kernel does not)."""
    if n_out >= 32768 or k >= 4 * n_out:
        return None
    if silu_mul:
        return dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3)
    if m == 1:
        return dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=4)
    return dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)


def _out_for(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> tuple[int, int, int, torch.Tensor]:
    """(M, K, N_out, an empty [M, N_out] output in x's dtype) for x [M, K] @ weight [N, K]^T, after
    checking the shapes and the unit strides the kernels assume."""
    m, k = x.shape
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    return m, k, n_out, torch.empty(m, n_out, dtype=x.dtype, device=x.device)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
    config: dict | None = None, options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """The Triton path: x [M, K] (last dim contiguous) times weight [N, K]^T -> [M, N] (or [M, N/2]
    with silu_mul, where weight stacks [gate; up])."""
    m, k, n_out, out = _out_for(x, weight, silu_mul)
    if m == 0:
        return out
    cfg = dict(config or skinny_config(m, n_out, k, silu_mul) or _FALLBACK)
    grid = (triton.cdiv(n_out, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _skinny_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n_out, n_out if silu_mul else 0,
        x.stride(0), weight.stride(0), out.stride(0), K=k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, DOT_PREC=_dot_prec(x), **cfg,
        **launch_kwargs(x.device, options.pdl),
    )
    return out


def _dot_prec(x: torch.Tensor) -> str:
    """tl.dot's precision: exact float32 products for float32 inputs (TF32 would round them and part
    from F.linear), the native one otherwise."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


@triton.jit
def _splitk_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, M, N_OUT, UP_OFFSET,
    stride_xm, stride_wn, stride_om, K: tl.constexpr, KS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """The part of out[m, n] = sum_k x[m, k] w[n, k] over program s's K range [s*KS, (s+1)*KS) (KS a
    multiple of BLOCK_K; the last range is cut at K); SILU_MUL as _skinny_kernel.

    Grid (M tiles, N tiles, SPLIT_K): the M tiles of one column block run next to each other, so a
    weight tile read from HBM is still in L2 for the other M tiles. SPLIT_K == 1: bias, SiLU-and-mul
    and the store here. Else the float32 partials go to ws [SPLIT_K, M, N_OUT] ([SPLIT_K, M, 2 N_OUT]
    with SILU_MUL: gate columns, then up columns) for _splitk_reduce_kernel."""
    wait_prior(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(2)
    m_ok = m < M
    n_ok = n < N_OUT
    kr = s * KS + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, KS, BLOCK_K):  # a constant trip count; the K tail (last split) is masked
        k = k0 + kr
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
        if SILU_MUL:
            wu = tl.load(w_rows + UP_OFFSET * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up += tl.dot(x, tl.trans(wu), input_precision=DOT_PREC)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws_n = 2 * N_OUT if SILU_MUL else N_OUT
        ws = ws_ptr + (s * M + m.to(tl.int64))[:, None] * ws_n + n[None, :]
        tl.store(ws, acc, mask=mask)
        if SILU_MUL:
            tl.store(ws + N_OUT, acc_up, mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, b_ptr, out_ptr, M, N_OUT, stride_om,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[m, n] = sum over the SPLIT_K partials in ws (+ b[n]), SiLU-and-mul'ed with the up partials
    under SILU_MUL, rounded once to out's dtype. Grid (N blocks, M)."""
    wait_prior(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    n_ok = n < N_OUT
    ws_n = 2 * N_OUT if SILU_MUL else N_OUT
    row = ws_ptr + m * ws_n + n
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(row + s * M * ws_n, mask=n_ok, other=0.0)
        if SILU_MUL:
            acc_up += tl.load(row + s * M * ws_n + N_OUT, mask=n_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


SPLITK_TARGET_PROGRAMS = 128  # about one program per SM of the H200 (132)
SPLITK_MAX_KS = 1536  # columns of K per split at most (down_proj's 8960 -> 8 splits)


def splitk_config(m: int, n_out: int, k: int, silu_mul: bool = False) -> dict | None:
    """Tiles for _splitk_kernel on an [m, k] x [k, n_out] product (m > SKINNY_MAX_ROWS), or None for the
    LM head (n_out >= 32768: cuBLAS streams it at ~90% of HBM bandwidth).

    BLOCK_N 32, BLOCK_M the smallest power of two >= m (16..64); SPLIT_K the smallest power of two
    giving >= SPLITK_TARGET_PROGRAMS programs with each split at most SPLITK_MAX_KS columns of K;
    BLOCK_K 128 (64 with SiLU-and-mul, whose gate and up tiles double the weight's share); 4 stages
    where a split has >= 4 iterations, else 3: the best tiles of `verispec bench linear --rows 64
    --sweep` (docs/BENCHMARKS.md, session 5)."""
    if n_out >= 32768:
        return None
    bm = min(64, max(16, triton.next_power_of_2(m)))
    bn, bk = 32, 64 if silu_mul else 128
    tiles = triton.cdiv(n_out, bn) * triton.cdiv(m, bm)
    split = 1
    while (tiles * split < SPLITK_TARGET_PROGRAMS or triton.cdiv(k, split) > SPLITK_MAX_KS) and k >= 2 * split * 2 * bk:
        split *= 2
    stages = 4 if triton.cdiv(k, split * bk) >= 4 else 3
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages)


def splitk_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(KS, splits): each split covers KS columns of K (a multiple of block_k), and `splits` =
    cdiv(k, KS) <= split_k of them are non-empty (the rounding up of KS can leave fewer)."""
    ks = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return ks, triton.cdiv(k, ks)


def splitk_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
    config: dict | None = None, options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """The split-K Triton path: x [M, K] (last dim contiguous) times weight [N, K]^T -> [M, N] (or
    [M, N/2] with silu_mul, where weight stacks [gate; up]). The float32 workspace of a split K is
    allocated per call (from the graph's pool under CUDA graph capture)."""
    m, k, n_out, out = _out_for(x, weight, silu_mul)
    if m == 0:
        return out
    cfg = dict(config or splitk_config(m, n_out, k, silu_mul) or _SPLITK_FALLBACK)
    ks, split = splitk_split(k, cfg["BLOCK_K"], cfg.pop("SPLIT_K"))
    ws = out if split == 1 else torch.empty(split, m, 2 * n_out if silu_mul else n_out, dtype=torch.float32,
                                            device=x.device)
    b = bias if bias is not None else weight
    pdl = launch_kwargs(x.device, options.pdl)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n_out, cfg["BLOCK_N"]), split)
    _splitk_kernel[grid](
        x, weight, b, out, ws, m, n_out, n_out if silu_mul else 0, x.stride(0), weight.stride(0), out.stride(0),
        K=k, KS=ks, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split, DOT_PREC=_dot_prec(x), **cfg, **pdl,
    )
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(n_out, _REDUCE_BLOCK), m)](
            ws, b, out, m, n_out, out.stride(0), HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split,
            BLOCK_N=_REDUCE_BLOCK, num_warps=4, **pdl,
        )
    return out


_REDUCE_BLOCK = 512


def gemv_config(n_out: int, k: int, silu_mul: bool = False, norm: bool = False) -> dict:
    """Tiles for _gemv_kernel: each thread holds ~64 weight elements (1 or 2 output rows of the
    padded K per program, 2-16 warps): the best of `bench linear --sweep` (or within 0.1 us of it)
    for every layer of the 1.5B at one row. With a norm prologue every program re-reads x and the
    residual; NORM_ROWS rows per program (wider programs were slower: docs/BENCHMARKS.md)."""
    k_pad = triton.next_power_of_2(k)
    per_row = k_pad * (2 if silu_mul else 1)
    block_n = NORM_ROWS if norm else (2 if per_row <= 2048 else 1)
    return dict(BLOCK_N=block_n, num_warps=max(2, min(16, block_n * per_row // (64 * 32))))


NORM_ROWS = 2


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         config: dict | None = None, norm: tuple[torch.Tensor, float] | None = None,
         residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         out: torch.Tensor | None = None, options: KernelOptions = DEFAULT_OPTIONS):
    """The weight-resident Triton GEMV: x [M, K] (few rows, last dim contiguous) times weight
    [N, K]^T -> [M, N] (or [M, N/2] with silu_mul, where weight stacks [gate; up]). out_dtype
    (e.g. float32 for logits): the result rounded to x's dtype, stored widened (no cast kernel);
    out: the buffer to store it in (rows contiguous; its dtype is the output dtype).

    norm=(weight, eps) applies RMSNorm to x first (after adding `residual`, as fused.rms_norm);
    then returns (out, the new residual x + residual, or x without one)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    assert residual is None or (residual.shape == x.shape and residual.is_contiguous())
    n_out = n // 2 if silu_mul else n
    if out is None:
        out = torch.empty(m, n_out, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (m, n_out) and out.stride(1) == 1
    rout = torch.empty_like(x) if norm is not None and residual is not None else x
    if m:
        cfg = dict(config or gemv_config(n_out, k, silu_mul, norm is not None))
        nw, eps = norm if norm is not None else (weight, 0.0)
        _gemv_kernel[(triton.cdiv(n_out, cfg["BLOCK_N"]),)](
            x, weight, bias if bias is not None else weight, out, nw, residual if residual is not None else x, rout,
            eps, m, n_out, n_out if silu_mul else 0, x.stride(0), weight.stride(0), out.stride(0), K=k,
            K_PAD=triton.next_power_of_2(k), HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None,
            HAS_RES=residual is not None, **cfg, **launch_kwargs(x.device, options.pdl),
        )
    return out if norm is None else (out, rout)


# Tiles for shapes skinny_config / splitk_config leave to cuBLAS, when called on them anyway (tests).
_FALLBACK = dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3)
_SPLITK_FALLBACK = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=4)


def _pick(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False, options: KernelOptions = DEFAULT_OPTIONS) -> str:
    """Which path an x [M, K] @ weight^T takes: "gemv", "skinny", "splitk" or "torch"."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if not (x.is_cuda and 0 < rows <= max(SKINNY_MAX_ROWS, options.splitk_max_rows, options.gemv_max_rows)
            and x.stride(1) == 1):
        return "torch"
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if rows <= options.gemv_max_rows:
        return "gemv"
    if rows > SKINNY_MAX_ROWS:
        ok = (options.splitk_min_rows <= rows <= options.splitk_max_rows
              and splitk_config(rows, n_out, x.shape[1], silu_mul))
        return "splitk" if ok else "torch"
    if skinny_config(rows, n_out, x.shape[1], silu_mul) is not None:
        return "skinny"
    return "splitk" if options.small_splitk and splitk_config(rows, n_out, x.shape[1], silu_mul) else "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
           options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """F.linear(x, weight, bias).to(out_dtype), through a Triton kernel where it pays (CUDA, few
    rows, a shape it wins on); the GEMV stores out_dtype itself (batch-1 logits: one kernel less).
    out: a buffer of that dtype to write the result into (returned)."""
    path = _pick(x, weight, False, options)
    if path == "gemv":
        return gemv(x, weight, bias, out_dtype=out_dtype, out=out, options=options)
    if path == "skinny":
        y = skinny_linear(x, weight, bias, options=options)
    elif path == "splitk":
        y = splitk_linear(x, weight, bias, options=options)
    else:
        y = F.linear(x, weight, bias)
    if out is not None:
        return out.copy_(y)
    return y if out_dtype is None else y.to(out_dtype)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up] stacked along the output dim."""
    path = _pick(x, gate_up, True, options)
    if path == "gemv":
        return gemv(x, gate_up, silu_mul=True, options=options)
    if path == "skinny":
        return skinny_linear(x, gate_up, silu_mul=True, options=options)
    if path == "splitk":
        return splitk_linear(x, gate_up, silu_mul=True, options=options)
    y = F.linear(x, gate_up)
    inter = gate_up.shape[0] // 2
    if x.is_cuda:
        from verispec.kernels.fused import silu_and_mul

        return silu_and_mul(y[..., :inter], y[..., inter:], options)
    return F.silu(y[..., :inter]) * y[..., inter:]


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      silu_mul: bool = False) -> torch.Tensor:
    """Torch reference in float32, rounded once to x.dtype."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if silu_mul:
        inter = weight.shape[0] // 2
        y = F.silu(y[:, :inter]) * y[:, inter:]
    return y.to(x.dtype)
