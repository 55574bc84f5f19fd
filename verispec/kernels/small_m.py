"""Linear layers for 2..SMALL_M_MAX_ROWS rows (a batch-1 verify, a small batch): tensor cores, W read once.

A verify forward of 1 + k tokens reads the same weights as a one-row decode. The one-row GEMV reduces
row by row on the CUDA cores, so its cost grows with the rows; cuBLAS and the skinny kernel tile for
compute (and leave down_proj and the LM head to cuBLAS). Here the rows are padded to one BLOCK_M = 16
tile (masked loads: padding rows fetch nothing), every program streams its [BLOCK_N, K] slice of W
exactly once, and `tl.dot` does the math on the tensor cores: the cost should stay the weight
stream's whatever the row count up to 16. As in the GEMV, a program's first weight tile is loaded
before the PDL wait (kernels/pdl.py), so it streams during the previous kernel's tail; each iteration
of the K loop issues the next tiles' loads before it multiplies the current ones (Triton does not
software-pipeline these loops on sm_90: scripts/compile_check.py shows the registers it costs).

  * _small_m_kernel: y = x @ W^T (+ bias), optionally SiLU-and-mul over a stacked [gate; up] weight
    (a program's BLOCK_N weight rows: BLOCK_N / 2 gate rows and the matching up rows, so one dot
    yields both),
    optionally RMSNorm(x (+ residual)) * nw in the prologue, and split over K (SPLIT_K > 1: float32
    partials, added in split order by linear.py's reduce kernel; never with the norm).
  * kernels/small_m_qkv.py builds the attention's input (norm + qkv + rotary + K/V write) from the same
    pieces (_load_x, _prep_x, _halves).

The norm rides in the K loop instead of a pass of its own: RMSNorm(x)[m, k] W[n, k] summed over k is
inv_rms[m] * sum_k (x[m, k] nw[k]) W[n, k], so each tile feeds x * nw to the dot and adds x^2 to the
row's sum of squares, and the accumulator is scaled by inv_rms once after the loop (a separate walk over
K first, the reverted session-9 prologue, cost a dependent L2 round trip per tile). Rounding therefore
differs from the unfused path in bf16 (x * nw is rounded to the dot's input dtype instead of the normed
x); it is one rounding of the input either way, and float32 inputs take exact (ieee) dots. The
residual sum is rounded to x's dtype before it is squared, as fused.rms_norm does; the programs of the
first column block store it.

linear / gate_up_silu have linear.py's signatures and route x here when takes_small_m says so, to
linear.py otherwise: models/kernel_path.Kernels hands them to the model when KernelOptions.small_m_max_rows
is on (the default path then never calls this module).

Not batch invariant (issue 18): tiles, splits and the fused norm differ from the one-row GEMV and from
kernels/invariant.py, so KernelOptions.batch_invariant never routes here (models/kernel_path.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels import linear as lin
from verispec.kernels.pdl import launch_kwargs, wait_prior

SMALL_M_MAX_ROWS = 16  # one BLOCK_M tile: the rows a verify of k <= 15 drafts (or a batch of 16) has
BLOCK_M = 16


@triton.jit
def _load_x(x_ptr, r_ptr, m, m_ok, k, k_ok, stride_xm, K: tl.constexpr, HAS_RES: tl.constexpr):
    """The raw tiles x[m, k] and (HAS_RES) residual[m, k] (else x again, not loaded twice)."""
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + m.to(tl.int64)[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    r = x
    if HAS_RES:
        r = tl.load(r_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=mask, other=0.0)
    return x, r


@triton.jit
def _prep_x(x, r, rout_ptr, nw_ptr, m, m_ok, k, k_ok, K: tl.constexpr, BLOCK_M: tl.constexpr, NORM: tl.constexpr,
            HAS_RES: tl.constexpr, STORE_RES):
    """One K tile of the dot's input and its rows' sum of squares: x as is, or with NORM x * nw after
    the residual add (HAS_RES; its sum rounded to x's dtype, stored to rout by the STORE_RES programs)."""
    ss = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        if HAS_RES:
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            if STORE_RES:
                tl.store(rout_ptr + m.to(tl.int64)[:, None] * K + k[None, :], x, mask=m_ok[:, None] & k_ok[None, :])
        xf = x.to(tl.float32)
        ss = tl.sum(xf * xf, 1)
        x = (xf * tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
    return x, ss


@triton.jit
def _weight_rows(pid_n, N_OUT, UP_OFFSET, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr):
    """(the weight row of each of the program's BLOCK_N tile rows, its output column, column in range).
    SILU_MUL: rows alternate halves, BLOCK_N / 2 gate rows then the matching up rows (UP_OFFSET on),
    so one [16, BLOCK_N] dot yields both and _halves separates them."""
    i = tl.arange(0, BLOCK_N)
    if SILU_MUL:
        col = pid_n * (BLOCK_N // 2) + i % (BLOCK_N // 2)
        row = col + (i // (BLOCK_N // 2)) * UP_OFFSET
    else:
        col = pid_n * BLOCK_N + i
        row = col
    return row, col, col < N_OUT


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N) of acc [BLOCK_M, BLOCK_N] (exact: sums with zeros)."""
    r = tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2])
    h = tl.arange(0, 2)[None, :, None]
    return tl.sum(tl.where(h == 0, r, 0.0), 1), tl.sum(tl.where(h == 1, r, 0.0), 1)


@triton.jit
def _small_m_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, nw_ptr, r_ptr, rout_ptr, eps, M, N_OUT, UP_OFFSET,
    stride_xm, stride_wn, stride_om, K: tl.constexpr, KS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (column blocks, SPLIT_K): the program's BLOCK_N weight rows (_weight_rows) against every
    row of x over K range [s * KS, (s + 1) * KS). Its first [BLOCK_N, BLOCK_K] weight tile is loaded
    before the PDL wait (with BLOCK_K >= KS: all of its weights, as the one-row GEMV); each iteration
    issues the next tiles' loads (W, x, the residual) before it multiplies the current ones, since
    Triton does not software-pipeline these loops (no cp.async in the sm_90 PTX). SPLIT_K == 1: bias,
    SiLU-and-mul and the store (rounded to x's dtype, then stored in out's dtype: float32 logits as
    F.linear(...).float()). Else the float32 partials go to ws [SPLIT_K, M, N_OUT] ([SPLIT_K, M, 2 N_OUT]
    with SILU_MUL: gate columns, then up), linear._splitk_reduce_kernel's layout."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    row, n, n_ok = _weight_rows(pid_n, N_OUT, UP_OFFSET, BLOCK_N, SILU_MUL)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    k_end = tl.minimum(K, (s + 1) * KS)
    kr = s * KS + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + row.to(tl.int64)[:, None] * stride_wn
    w = tl.load(w_rows + kr[None, :], mask=n_ok[:, None] & (kr < k_end)[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    wait_prior(PDL)
    x, r = _load_x(x_ptr, r_ptr, m, m_ok, kr, kr < k_end, stride_xm, K, NORM and HAS_RES)
    for k0 in range(0, KS, BLOCK_K):  # a constant trip count; the K tail is masked
        k = k0 + kr
        kn = k + BLOCK_K  # the next tiles first (past the split's end fully masked: no traffic)
        w_next = tl.load(w_rows + kn[None, :], mask=n_ok[:, None] & (kn < k_end)[None, :], other=0.0)
        x_next, r_next = _load_x(x_ptr, r_ptr, m, m_ok, kn, kn < k_end, stride_xm, K, NORM and HAS_RES)
        xp, ss_t = _prep_x(x, r, rout_ptr, nw_ptr, m, m_ok, k, k < k_end, K, BLOCK_M, NORM, HAS_RES, pid_n == 0)
        ss += ss_t
        acc += tl.dot(xp, tl.trans(w), input_precision=DOT_PREC)
        w, x, r = w_next, x_next, r_next
    if NORM:
        acc *= (1.0 / tl.sqrt(ss / K + eps))[:, None]
    m_rows = m.to(tl.int64)[:, None]
    if SILU_MUL:
        gate, up = _halves(acc, BLOCK_M, BLOCK_N)
        n2 = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        mask = m_ok[:, None] & (n2 < N_OUT)[None, :]
        if SPLIT_K == 1:
            y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + m_rows * stride_om + n2[None, :], y, mask=mask)
        else:
            ws = ws_ptr + (s * M + m_rows) * (2 * N_OUT) + n2[None, :]
            tl.store(ws, gate, mask=mask)
            tl.store(ws + N_OUT, up, mask=mask)
    else:
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + m_rows * stride_om + n[None, :], y, mask=mask)
        else:
            tl.store(ws_ptr + (s * M + m_rows) * N_OUT + n[None, :], acc, mask=mask)


DOWN_KS = 1024  # columns of K per split where K >= 4096 (down_proj's 8960: 9 splits, 864 programs)


@functools.lru_cache(maxsize=256)
def small_m_config(n_out: int, k: int, silu_mul: bool = False, norm: bool = False) -> dict:
    """Tiles and K split for _small_m_kernel on an [M <= 16, k] x [k, n_out] product. Not timed on the GPU
    yet (scripts/gpu_verify.sh times them, `bench linear --sweep` sweeps them); chosen from the sm_90
    compile (no register spills, at most ~200 registers a thread) and the bytes of W each SM keeps in
    flight (a program has two tiles in flight: the one multiplied and the next):
      * the LM head (n_out >= 32768): 32 rows x 256 columns, 8 warps (~4,700 programs, 2 per SM);
      * SiLU-and-mul (gate_up): 16 gate + 16 up rows x 128 columns, 4 warps (560 programs, 3 per SM);
      * K >= 4096 (down_proj): split into DOWN_KS columns, 2 tiles of 16 x 512, 8 warps (864 programs),
        the partials added by the reduce kernel;
      * else (o): 16 rows x 512 columns, 8 warps (96 programs at the 1.5B).
    Cached per shape: callers copy the dict before they change it."""
    if n_out < 1 or k < 1:
        raise ValueError(f"small_m_config needs a non-empty weight, got n_out={n_out}, k={k}")
    kp = max(16, triton.next_power_of_2(k))
    if n_out >= 32768:
        return dict(BLOCK_N=32, BLOCK_K=min(256, kp), SPLIT_K=1, num_warps=8, num_stages=2)
    if silu_mul:
        return dict(BLOCK_N=32, BLOCK_K=min(128, kp), SPLIT_K=1, num_warps=4, num_stages=2)
    if k >= 4096 and not norm:
        return dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=triton.cdiv(k, DOWN_KS), num_warps=8, num_stages=2)
    return dict(BLOCK_N=16, BLOCK_K=min(512, kp), SPLIT_K=1, num_warps=8, num_stages=2)


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
    if silu_mul and bias is not None:
        raise ValueError("small_m_linear takes no bias with silu_mul (the MLP's gate_up has none)")
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
        cols = cfg["BLOCK_N"] // 2 if silu_mul else cfg["BLOCK_N"]
        _small_m_kernel[(triton.cdiv(n_out, cols), split)](
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


def takes_small_m(x: torch.Tensor, options: KernelOptions) -> bool:
    """True where linear / gate_up_silu route x to the small-M kernel: a CUDA x of 2..small_m_max_rows
    rows (more than gemv_max_rows: the one-row GEMV keeps its rows), last dim contiguous."""
    rows = x.shape[0] if x.dim() == 2 else 0
    return x.is_cuda and max(2, options.gemv_max_rows + 1) <= rows <= options.small_m_max_rows and x.stride(1) == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
           options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """linear.linear's contract, with the rows takes_small_m picks on the small-M kernel."""
    if takes_small_m(x, options):
        return small_m_linear(x, weight, bias, out_dtype=out_dtype, out=out, options=options)
    return lin.linear(x, weight, bias, out_dtype=out_dtype, out=out, options=options)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """linear.gate_up_silu's contract, with the rows takes_small_m picks on the small-M kernel."""
    if takes_small_m(x, options):
        return small_m_linear(x, gate_up, silu_mul=True, options=options)
    return lin.gate_up_silu(x, gate_up, options)
