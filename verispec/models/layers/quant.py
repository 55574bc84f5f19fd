"""Linear layers and embeddings over weights kept quantized (quantization="gguf").

A QuantLinear replaces an nn.Linear: its weight is a list of segments along the output dim, each one of
  * Int4Planes: torch's CPU int4 matmul (`_weight_int4pack_mm_for_cpu`, groups of 32, bf16 activations).
    A GGUF type of b <= 8 bits is held as 1 or 2 int4 planes laid side by side along K (the input is
    repeated), so one call sums them: w = sum_p (u_p - 8) * scale_p + zero_p (torch's convention);
  * DenseSegment: a bf16 (or other dtype) matrix, for the types int4 planes cannot hold exactly (groups
    of 16: Q6_K, Q3_K, Q2_K) and for float tensors;
  * GGUFSegment: raw GGUF blocks (h3's GGUFWeight) run by a CUDA kernel handed in by the loader, so this
    file imports no kernel module.
QuantEmbedding looks rows up in a GGUF tensor's integer quants and dequantizes just those rows, exactly
as loader/dequant.py does. The packing itself is loader/cpu_pack.py's job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32  # torch's CPU int4 matmul takes groups of 32..256; GGUF's 32-element groups map 1:1
INT4_ROWS = 16  # its packing needs N divisible by 16 (padded with zero rows)


@dataclass(frozen=True)
class Int4Planes:
    """N x K weight as `planes` int4 planes side by side along K, packed for `_weight_int4pack_mm_for_cpu`.

    packed: uint8 [n_pad, planes * K / 2]; scales_zeros: [planes * K / 32, n_pad, 2] (bf16), n_pad = N
    rounded up to 16 (the padding rows are zero)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    planes: int
    shape: tuple[int, int]

    def __call__(self, x: torch.Tensor, repeated: bool = False) -> torch.Tensor:
        """x [T, K] in the scales' dtype -> [T, N] in that dtype (accumulated in float32 inside);
        repeated: x is already [T, planes * K] (its planes' copies side by side)."""
        if self.planes > 1 and not repeated:
            x = torch.cat([x] * self.planes, dim=1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)
        n = self.shape[0]
        return y if y.shape[-1] == n else y[:, :n]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * self.scales_zeros.element_size()


@dataclass(frozen=True)
class DenseSegment:
    """A plain N x K matrix (bf16 on the CPU path) for weights int4 planes cannot hold exactly."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


@dataclass(frozen=True)
class GGUFSegment:
    """Raw GGUF blocks (a kernels.gguf_matmul.GGUFWeight) and the kernel that multiplies by them."""

    weight: Any  # GGUFWeight: blocks uint8 [N, row bytes], qtype, shape (N, K)
    matmul: Callable[..., torch.Tensor]  # gguf_linear(x, w, bias=None)
    epilogues: bool = False  # matmul also takes out= and silu_mul= (kernels/gguf_matmul.py's gguf_linear)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight)

    @property
    def nbytes(self) -> int:
        b = self.weight.blocks
        return b.numel() * b.element_size()


Segment = Int4Planes | DenseSegment | GGUFSegment


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as segments along the output dim (see the module docstring).

    compute_dtype: the dtype the segments take (bf16 on the CPU path); the output comes back in x's
    dtype, plus the bias (kept in the model's dtype). kernels: set by enable_triton (models/kernel_path.py):
    its options go to the GGUF kernels (batch_invariant: one kernel for every row count). cpu_linear: set by
    the loader where every segment is CPU GGUF blocks (a kernels/cpu_gguf.StackedLinear): float32 x of 1 to
    cpu_linear.max_rows rows goes through it, one kernel call per segment into one output."""

    kernels: Any = None
    cpu_linear: Any = None

    def __init__(self, segments: list[Segment], bias: torch.Tensor | None, compute_dtype: torch.dtype) -> None:
        super().__init__()
        if not segments:
            raise ValueError("QuantLinear needs at least one segment")
        ks = {s.shape[1] for s in segments}
        if len(ks) != 1:
            raise ValueError(f"QuantLinear segments disagree on in_features: {sorted(ks)}")
        self.segments = segments
        self.in_features = ks.pop()
        self.out_features = sum(s.shape[0] for s in segments)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({self.out_features},)")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.compute_dtype = compute_dtype
        self._kernel_segments = all(isinstance(s, GGUFSegment) and s.epilogues for s in segments)

    @property
    def kernel_segments(self) -> bool:
        """True when every segment is GGUF blocks run by a kernel with epilogues (the CUDA path: forward
        writes each segment's columns of one output, bias in the kernel's epilogue; silu_mul is one kernel).
        Fixed at construction (forward runs per layer and step)."""
        return self._kernel_segments

    def _kernel_forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """The segments' kernels on 2-D x, each writing its column slice of one [T, N] buffer (no
        concatenation, no separate bias add); silu_mul: one [gate; up] segment -> silu(gate) * up."""
        n = self.out_features // 2 if silu_mul else self.out_features
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        opts = {} if self.kernels is None else {"options": self.kernels.options}
        if silu_mul:
            seg = self.segments[0]
            return seg.matmul(x, seg.weight, out=y, silu_mul=True, **opts)
        off = 0
        for seg in self.segments:
            rows = seg.shape[0]
            bias = None if self.bias is None else self.bias[off: off + rows]
            seg.matmul(x, seg.weight, bias, out=y if len(self.segments) == 1 else y[:, off: off + rows], **opts)
            off += rows
        return y

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T) for a stacked [gate; up] weight: fused in the GGUF kernel's
        epilogue where the weight is one CUDA GGUF segment without bias, else forward, then the two halves."""
        if x.dim() == 2 and self.bias is None and len(self.segments) == 1 and self._kernel_segments \
                and x.dtype == self.compute_dtype:
            return self._kernel_forward(x, silu_mul=True)
        c = self.cpu_linear
        if c is not None and self.bias is None and self._takes_cpu_linear(x):
            return c(x, silu_mul=True)
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self._kernel_segments and x.dtype == self.compute_dtype \
                and (self.bias is None or self.bias.dtype == x.dtype):
            return self._kernel_forward(x)
        c = self.cpu_linear
        if c is not None and self._takes_cpu_linear(x):
            y = c(x)
            return y if self.bias is None else y.add_(self.bias)
        one = self.segments[0] if len(self.segments) == 1 else None
        if isinstance(one, Int4Planes) and x.dim() == 2:  # the common case, with fewer ops (decode is op-bound)
            xc = (torch.cat([x] * one.planes, dim=1) if one.planes > 1 else x).to(self.compute_dtype)
            y = one(xc, repeated=True).to(x.dtype)
            return y if self.bias is None else y + self.bias
        lead = x.shape[:-1]
        xc = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)
        ys = [s(xc) for s in self.segments]
        y = (ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _takes_cpu_linear(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == torch.float32 and 1 <= x.shape[0] <= self.cpu_linear.max_rows \
            and x.device.type == "cpu" and (self.bias is None or self.bias.dtype == torch.float32)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the weight as held (what a step reads)."""
        return sum(s.nbytes for s in self.segments)

    def extra_repr(self) -> str:
        kinds = "+".join(type(s).__name__ for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, segments={kinds}"


class QuantEmbedding(nn.Module):
    """Embedding rows dequantized on lookup from GGUF integer quants: row = scale * q + bias per group
    (float32, the same arithmetic as loader/dequant.py, so rows are bit-identical), cast to `dtype`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        if q.dim() != 2 or scale.dim() != 2 or q.shape[0] != scale.shape[0] or q.shape[1] % scale.shape[1]:
            raise ValueError(f"QuantEmbedding: quants {tuple(q.shape)} and scales {tuple(scale.shape)} do not match")
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("bias_", bias, persistent=False)
        self.group = q.shape[1] // scale.shape[1]
        self.num_embeddings, self.embedding_dim = q.shape
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        n, g = flat.shape[0], self.scale.shape[1]
        q = self.q[flat].view(n, g, self.group)
        s = self.scale[flat].unsqueeze(-1)
        row = q * s if self.bias_ is None else torch.addcmul(self.bias_[flat].unsqueeze(-1), s, q)
        return row.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    @property
    def weight_nbytes(self) -> int:
        ts = [self.q, self.scale] + ([] if self.bias_ is None else [self.bias_])
        return sum(t.numel() * t.element_size() for t in ts)


def is_quantized(module: nn.Module) -> bool:
    """True for the modules of this file (they have no dense .weight)."""
    return isinstance(module, QuantLinear | QuantEmbedding)


def weight_nbytes(model: nn.Module) -> int:
    """Bytes the model's weights take as held: its parameters plus the quantized modules' weights."""
    seen: set[int] = set()
    total = 0
    for t in model.parameters():
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total + sum(m.weight_nbytes for m in model.modules() if is_quantized(m))


def step_weight_nbytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: all of them as held, less the input embedding (a row
    gather), unless the embedding is the LM head too (a dense tied model)."""
    total = weight_nbytes(model)
    emb = model.get_submodule("model.embed_tokens")
    if "lm_head" in model._modules:
        total -= emb.weight_nbytes if is_quantized(emb) else emb.weight.numel() * emb.weight.element_size()
    return total
