"""RMSNorm on the CPU (models/layers/norm.py): float32 takes torch's one-op rms_norm, which must be the written
formula bit for bit (the float32 reference path is compared token for token with transformers), and so must
transformers' Qwen2RMSNorm; other dtypes keep the formula in float32."""

from __future__ import annotations

import pytest
import torch

from verispec.models.layers.norm import RMSNorm


def _formula(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("rows,size", [(1, 896), (3, 1536), (17, 131), (5, 7)])
def test_float32_norm_is_the_formula_bit_for_bit(rows, size):
    g = torch.Generator().manual_seed(rows * size)
    norm = RMSNorm(size, 1e-6)
    norm.weight.data = torch.randn(size, generator=g)
    x = torch.randn(rows, size, generator=g) * 5
    r = torch.randn(rows, size, generator=g)
    assert torch.equal(norm(x), _formula(x, norm.weight, 1e-6))
    out, res = norm(x, r)
    assert torch.equal(res, x + r) and torch.equal(out, _formula(x + r, norm.weight, 1e-6))


def test_float32_norm_is_transformers_qwen2_norm():
    qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    g = torch.Generator().manual_seed(0)
    theirs = qwen2.Qwen2RMSNorm(896, eps=1e-6)
    theirs.weight.data = torch.randn(896, generator=g)
    ours = RMSNorm(896, 1e-6)
    ours.weight.data = theirs.weight.data.clone()
    x = torch.randn(4, 896, generator=g) * 3
    assert torch.equal(ours(x), theirs(x))


def test_bf16_norm_keeps_the_float32_formula():
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64, generator=g)
    x = torch.randn(2, 64, generator=g).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _formula(x, norm.weight, 1e-5))
