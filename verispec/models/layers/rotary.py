"""Rotary position embedding (NeoX / Hugging Face rotate-half layout)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k given absolute positions; cos/sin cached in float32.
    (On CUDA the Triton attention backend rotates inside its K/V write, reading cos / sin.)"""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        """Tables on the default device, but on the CPU inside `with torch.device("meta")`
        (build_model moves them; meta factory ops would import torch._dynamo: 2.5 s of start-up)."""
        super().__init__()
        dev = torch.get_default_device()
        f64 = dict(dtype=torch.float64, device="cpu" if dev.type == "meta" else dev)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, **f64) / head_dim))
        t = torch.arange(max_positions, **f64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KH, D], positions: [T] -> rotated (q, k)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
