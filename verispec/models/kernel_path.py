"""Switch a model between its plain-torch path and the Triton kernels (CUDA tensors only)."""

from __future__ import annotations

import torch


def enable_triton(model: torch.nn.Module, on: bool = True, attention: bool = True) -> None:
    """Switch a CausalLM's norms, rotary, MLPs, KV write (and attention) to the Triton kernels.

    The switched modules still use torch for CPU tensors. on=False restores the torch path."""
    from verispec.attention.reference import reference_attention  # local: triton loads only with CUDA
    from verispec.kernels.paged_attention import triton_attention

    for m in model.modules():
        if hasattr(m, "use_triton"):
            m.use_triton = on
    if attention:
        model.attn_fn = triton_attention if on else reference_attention
