"""The fused qkv projection + rotary + KV-cache write against the unfused torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.attention.reference import write_kv
from verispec.kernels.qkv_rope import qkv_rope_write_kv
from verispec.models.layers.rotary import RotaryEmbedding

CPU = pytest.param("cpu", torch.float32, id="cpu-fp32")
GPU = pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,heads,kv_heads,head_dim,k,bias", [
    (1, 6, 2, 16, 200, True), (3, 5, 1, 32, 77, False), (1, 12, 2, 128, 300, True),
])
def test_qkv_rope_write_kv_matches_unfused(device, dtype, m, heads, kv_heads, head_dim, k, bias):
    g = torch.Generator().manual_seed(m * 100 + heads)
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)  # made on the CPU (PDL contract)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    rot = RotaryEmbedding(head_dim, 300, 1e6).to(device)
    pos = torch.randint(0, 300, (m,), generator=g).to(device)
    slots = torch.randperm(23, generator=g)[:m].to(device)
    if m > 1:
        slots[1] = -1  # a padding row: nothing written
    cache = torch.randn(2, 23, kv_heads, head_dim, generator=g).to(device, dtype)

    qkv = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    q, kk, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    ref_q, ref_k = rot(pos, q.reshape(m, heads, head_dim), kk.reshape(m, kv_heads, head_dim))
    want = cache.clone()
    ok = slots >= 0
    write_kv(want, ref_k[ok], v.reshape(m, kv_heads, head_dim)[ok], slots[ok])

    got = cache.clone()
    out = qkv_rope_write_kv(x, w, b, pos, rot.cos, rot.sin, got, slots, heads, kv_heads, head_dim)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref_q, **tol)
    torch.testing.assert_close(got, want, **tol)
    untouched = torch.ones(23, dtype=torch.bool, device=device)
    untouched[slots[ok]] = False
    assert torch.equal(got[:, untouched], cache[:, untouched])


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,residual", [(1, True), (2, True), (1, False)])
def test_qkv_rope_norm_prologue(device, dtype, m, residual):
    """With norm=(w, eps) the kernel RMSNorms x (+ residual) first: same q and cache as the
    separate norm then the unfused kernel; the new residual is x + residual exactly."""
    from verispec.kernels.fused import rms_norm_ref

    g = torch.Generator().manual_seed(m + 7)
    heads, kv_heads, head_dim, k = 4, 2, 16, 150
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(m, k, generator=g).to(device, dtype)
    r = torch.randn(m, k, generator=g).to(device, dtype) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    rot = RotaryEmbedding(head_dim, 100, 1e6).to(device)
    pos = torch.randint(0, 100, (m,), generator=g).to(device)
    slots = torch.randperm(11, generator=g)[:m].to(device)
    cache = torch.randn(2, 11, kv_heads, head_dim, generator=g).to(device, dtype)
    args = (pos, rot.cos, rot.sin)
    want_cache, got_cache = cache.clone(), cache.clone()
    normed = rms_norm_ref(x, nw, 1e-6, r)
    normed, want_res = normed if residual else (normed, x)
    want_q = qkv_rope_write_kv(normed, w, b, *args, want_cache, slots, heads, kv_heads, head_dim)
    q, new_res = qkv_rope_write_kv(x, w, b, *args, got_cache, slots, heads, kv_heads, head_dim,
                                   norm=(nw, 1e-6), residual=r)
    assert torch.equal(new_res, want_res)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(got_cache, want_cache, **tol)
