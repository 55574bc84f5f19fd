"""Skinny linear layers: y = x @ W^T (+ bias) for few rows of x, streaming W once at full bandwidth.

At batch-1 decode a linear layer is a matrix-vector product bound by reading W. These kernels
split the output into narrow column blocks (many programs, each reading its rows of W exactly once)
and reduce over K in float32. Measured on the H200 inside CUDA graphs (`verispec bench linear`,
docs/BENCHMARKS.md), 1.5B shapes at one row: o_proj 4.0 us vs cuBLAS 6.3, qkv 4.1 vs 5.0 (both
still latency-bound at ~1.2-1.5 TB/s), gate_up + SiLU-mul 15.4 vs 17.8 (3.6 TB/s); cuBLAS keeps
down_proj and the LM head, where it is as fast or faster (skinny_config returns None there).
Epilogues fuse what follows:
  * bias add (Qwen2's q/k/v projection);
  * SiLU-and-mul for a fused [gate; up] weight (the MLP's first projection): the program reads
    the gate rows and the matching up rows and writes silu(gate) * up directly.

linear(x, w, b) and gate_up_silu(x, w) pick the kernel for CUDA tensors with at most
SKINNY_MAX_ROWS rows and fall back to torch otherwise; the *_ref functions are the torch
references the tests compare against. Rounding: one float32 accumulation per output, rounded once
to x.dtype (the fused SiLU-and-mul skips the intermediate rounding of gate and up).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SKINNY_MAX_ROWS = 16  # above this many rows, cuBLAS tiles well enough


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N_OUT, UP_OFFSET,
    stride_xm, stride_wn, stride_om, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k] (+ b[n]); SILU_MUL: silu(that) * (same with row n + UP_OFFSET)."""
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
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if SILU_MUL:
            wu = tl.load(w_rows + UP_OFFSET * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if USE_DOT:
                acc_up += tl.dot(x, tl.trans(wu))
            else:
                acc_up += tl.sum(x.to(tl.float32)[:, None, :] * wu.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_config(m: int, n_out: int, k: int, silu_mul: bool = False) -> dict | None:
    """Tile sizes for an [m, k] x [k, n_out] product, or None where cuBLAS is as fast (measured on
    an H200 with `verispec bench linear --sweep`, see docs/BENCHMARKS.md): a huge N (the LM head,
    where cuBLAS streams at ~96% of HBM bandwidth) and K >> N (down_proj: cuBLAS splits K, this
    kernel does not)."""
    if n_out >= 32768 or k >= 4 * n_out:
        return None
    if silu_mul:
        return dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3)
    if m == 1:
        return dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=4)
    return dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """The Triton path: x [M, K] (last dim contiguous) times weight [N, K]^T -> [M, N] (or [M, N/2]
    with silu_mul, where weight stacks [gate; up])."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    n_out = n // 2 if silu_mul else n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = dict(config or skinny_config(m, n_out, k, silu_mul) or _FALLBACK)
    grid = (triton.cdiv(n_out, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _skinny_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n_out, n_out if silu_mul else 0,
        x.stride(0), weight.stride(0), out.stride(0), K=k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, **cfg,
    )
    return out


# Tiles for shapes skinny_config leaves to cuBLAS, when skinny_linear is called on them anyway (tests).
_FALLBACK = dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3)


def _skinny(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    if not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS and x.stride(1) == 1):
        return False
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    return skinny_config(x.shape[0], n_out, x.shape[1], silu_mul) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the skinny kernel where it pays (CUDA, few rows, a shape it wins on)."""
    if _skinny(x, weight):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up] stacked along the output dim."""
    if _skinny(x, gate_up, silu_mul=True):
        return skinny_linear(x, gate_up, silu_mul=True)
    y = F.linear(x, gate_up)
    inter = gate_up.shape[0] // 2
    if x.is_cuda:
        from verispec.kernels.fused import silu_and_mul

        return silu_and_mul(y[..., :inter], y[..., inter:])
    return F.silu(y[..., :inter]) * y[..., inter:]


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      silu_mul: bool = False) -> torch.Tensor:
    """Torch reference in float32, rounded once to x.dtype."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if silu_mul:
        inter = weight.shape[0] // 2
        y = F.silu(y[:, :inter]) * y[:, inter:]
    return y.to(x.dtype)
