"""The Triton paged attention backend (CUDA): kernels/paged_attention.py's attention, rotary fused into
its K/V write, and (an option of this backend) the L2 prefetch of the next MLP weight.

It reads every per-step value from the metadata tensors (the contract in kernels/paged_attention.py),
so its steps can be captured in CUDA graphs and replayed with fresh metadata. Its KernelOptions
(core/options.py) fix the kernels' launches: PDL, the split-K target or a forced split factor, and
how much of the next gate_up weight the attention launch asks L2 for in which steps. This module
imports triton; models/kernel_path.py imports it only when a model is switched onto the kernels.
"""

from __future__ import annotations

import torch

from verispec.attention.backend import AttentionBackend
from verispec.attention.reference import write_kv
from verispec.core.attention_metadata import AttentionMetadata
from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels.fused import rotary_write_kv_
from verispec.kernels.l2_prefetch import Regions
from verispec.kernels.paged_attention import triton_attention


class TritonBackend(AttentionBackend):
    """triton_attention with this backend's options; no metadata beyond the common tensors."""

    name = "triton"
    supports_graphs = True

    def __init__(self, options: KernelOptions = DEFAULT_OPTIONS) -> None:
        self.options = options

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The torch write (for CPU tensors: the interpreter tests). On CUDA the model writes K/V
        through rotary_write_kv (one kernel) or, at one row, from the qkv projection kernel."""
        write_kv(kv_cache, k, v, slot_mapping)

    def rotary_write_kv(self, rotary, positions, q, k, v, kv_cache, slot_mapping) -> torch.Tensor:
        """On CUDA one kernel rotates q in place and writes the rotated k and v into their slots
        (negative: skipped; no host sync, so it is graph-safe); otherwise as the base class."""
        if not q.is_cuda:
            return super().rotary_write_kv(rotary, positions, q, k, v, kv_cache, slot_mapping)
        rotary_write_kv_(positions, q, k, v, rotary.cos, rotary.sin, kv_cache, slot_mapping, self.options)
        return q

    def l2_prefetch_bytes(self, num_tokens: int, meta: AttentionMetadata) -> int:
        """options.l2_prefetch_bytes in steps of at most l2_prefetch_max_rows tokens and
        l2_prefetch_max_seqs sequences, else 0 (larger steps lost with it: docs/BENCHMARKS.md)."""
        o = self.options
        if num_tokens <= o.l2_prefetch_max_rows and meta.query_start_loc.shape[0] <= o.l2_prefetch_max_seqs + 1:
            return o.l2_prefetch_bytes
        return 0

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                prefetch: Regions | None = None, window: int = 0) -> torch.Tensor:
        return triton_attention(q, kv_cache, meta, scale, num_splits=self.options.attn_num_splits, prefetch=prefetch,
                                options=self.options, window=window)

    def prepare_for_capture(self, meta: AttentionMetadata) -> None:
        """The launch depends only on shapes and meta's Python values (max_query_len, block_size,
        causal), fixed for the graph: nothing to stage; block_size must be set."""
        if meta.block_size is None:
            raise ValueError("a captured attention step needs meta.block_size (the engine's block size)")
