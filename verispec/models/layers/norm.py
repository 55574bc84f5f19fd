"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from verispec.models.kernel_path import Kernels


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32. kernels (set by enable_triton): the fused
    kernel for CUDA tensors; cpu_ops (set by enable_cpu_ops: kernels/cpu_ops.py): the C op for float32
    CPU tensors."""

    kernels: Kernels | None = None
    cpu_ops: Any = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        k = self.kernels
        if k is not None and x.is_cuda:
            return k.rms_norm(x, self.weight, self.eps, residual, k.options)
        c = self.cpu_ops
        if c is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return c.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one op (the CPU decode step is op-bound): torch's rms_norm is x * rsqrt(mean(x^2) + eps) * weight
            # with the same float32 operations in the same order, bit for bit (tests/test_layers.py)
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return out if residual is None else (out, residual)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * self.weight.float()).to(x.dtype)
        return out if residual is None else (out, residual)
