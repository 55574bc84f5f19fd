"""Fused Triton kernels for the elementwise parts of a decoder layer, with their torch references.

  * rms_norm(x, weight, eps, residual=None): RMSNorm, optionally fused with the residual add;
    same rounding as RMSNorm.forward (the sum is rounded to x.dtype before it is normalized).
  * rotary_write_kv_(...): NeoX rotate-half rotary on q in place, and k rotated + v written into the
    paged KV cache (the Triton attention backend's K/V write, attention/triton.py).
  * silu_and_mul(gate, up): SiLU(gate) * up in one pass (float32 math, one rounding).

verispec/models/kernel_path.py switches a model onto these kernels (CUDA tensors only). Each takes
options= (core/options.py) for its launch (PDL).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels.pdl import launch_kwargs, wait_prior


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, n_cols, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_cols
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    wait_prior(PDL)
    x = tl.load(x_ptr + row * n_cols + c, mask=ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * n_cols + c, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(rout_ptr + row * n_cols + c, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + c, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             options: KernelOptions = DEFAULT_OPTIONS):
    """Triton RMSNorm over the last dim; with residual returns (norm(x + residual), x + residual)."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    out = torch.empty_like(x2)
    if residual is not None:
        r2 = residual.reshape(-1, n).contiguous()
        rout = torch.empty_like(x2)
    else:
        r2 = rout = x2  # unused
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, rout, n, eps, HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8, **launch_kwargs(x.device, options.pdl),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), rout.view(shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Torch reference (identical to RMSNorm.forward)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


@triton.jit
def _rotate_heads(x_ptr, t, stride_t, stride_h, n_heads, cos, sin, H_PAD: tl.constexpr, HALF: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = h < n_heads
    p1 = x_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_write_kv_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_c, stride_cs, stride_ch, n_q,
                            NUM_KV: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, HALF: tl.constexpr,
                            PDL: tl.constexpr):
    """Rotate q in place; rotate k and store it with v into the token's cache slot (slot < 0: skip)."""
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + p * HALF + d)
    sin = tl.load(sin_ptr + p * HALF + d)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, n_q, cos, sin, QH_PAD, HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, KH_PAD)[:, None]
    ok = (h < NUM_KV) & (slot >= 0)
    k1p = k_ptr + t * stride_kt + h * stride_kh + d
    k1 = tl.load(k1p, mask=ok, other=0.0).to(tl.float32)
    k2 = tl.load(k1p + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = cache_ptr + slot * stride_cs + h * stride_ch + d
    tl.store(dst, (k1 * cos - k2 * sin).to(cache_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (k2 * cos + k1 * sin).to(cache_ptr.dtype.element_ty), mask=ok)
    vp = v_ptr + t * stride_vt + h * stride_vh + d
    tl.store(dst + stride_c, tl.load(vp, mask=ok, other=0.0), mask=ok)
    tl.store(dst + stride_c + HALF, tl.load(vp + HALF, mask=ok, other=0.0), mask=ok)


def rotary_write_kv_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     options: KernelOptions = DEFAULT_OPTIONS) -> None:
    """NeoX rotary on q [T, H, D] (in place) and on k [T, KH, D], written with v straight into
    kv_cache [2, slots, KH, D] at slot_mapping (negative: skipped); k itself is left unrotated
    (attention reads the cache). cos / sin: float32 [max_pos, D/2]."""
    num_tokens, num_q, head_dim = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert cos.dtype == torch.float32 and cos.shape[1] * 2 == head_dim and cos.is_contiguous()
    if num_tokens:
        _rotary_write_kv_kernel[(num_tokens,)](
            positions, q, k, v, cos, sin, kv_cache, slot_mapping, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            num_q, NUM_KV=k.shape[1], QH_PAD=triton.next_power_of_2(num_q),
            KH_PAD=triton.next_power_of_2(k.shape[1]), HALF=head_dim // 2, num_warps=4,
            **launch_kwargs(q.device, options.pdl),
        )


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n_cols
    g = tl.load(g_ptr + row * stride_g + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, options: KernelOptions = DEFAULT_OPTIONS,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(gate) * up for [..., N] inputs (last dim contiguous), in float32, rounded once to gate's dtype (to
    out's where given: a 2-D [rows, N] buffer with a unit last stride, e.g. a column slice)."""
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    res = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device) if out is None else out
    if tuple(res.shape) != tuple(g2.shape) or res.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: out must be {tuple(g2.shape)} with unit last stride, got {tuple(res.shape)}")
    block = min(1024, triton.next_power_of_2(n))
    if g2.shape[0]:
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
            g2, u2, res, n, g2.stride(0), u2.stride(0), res.stride(0), BLOCK=block, num_warps=4,
            **launch_kwargs(gate.device, options.pdl),
        )
    return res if out is not None else res.view(gate.shape)


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Torch reference (as in MLP.forward)."""
    return F.silu(gate) * up
