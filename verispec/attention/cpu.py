"""The CPU attention backend of a quantized model: kernels/cpu_ops.py's C ops for rotary + the K/V write and for
paged attention over the block table, in one call each per layer (the plain-torch reference takes ~25 ops, and a
CPU decode step is op-bound outside its matmuls).

Every step takes the C attention (cpu_ops.MAX_QUERY_LEN None: prompt chunks too, so a query's result does not
depend on the chunk it is in); with a MAX_QUERY_LEN, longer steps keep the reference's SDPA over gather indices,
which prepare_metadata builds for those steps only. Non-float32 tensors go to the reference too.
models/kernel_path.enable_cpu_ops installs it; the float32 reference model keeps attention/reference.py.
"""

from __future__ import annotations

import torch

from verispec.attention.reference import ReferenceBackend, build_reference_indices, reference_attention
from verispec.kernels import cpu_ops


class CPUBackend(ReferenceBackend):
    """ReferenceBackend's contract; steps of queries up to cpu_ops.MAX_QUERY_LEN tokens (None: every step) in C."""

    name = "cpu"
    needs_reference_indices = True  # prepare_metadata decides per step (none for a C step)

    def prepare_metadata(self, query_lens, seq_lens, block_tables, block_size, device, causal=True, kv_starts=None):
        limit = cpu_ops.MAX_QUERY_LEN
        if limit is None or max(query_lens, default=0) <= limit:
            return {}
        return build_reference_indices(query_lens, seq_lens, block_tables, block_size, device, causal, kv_starts)

    def rotary_write_kv(self, rotary, positions, q, k, v, kv_cache, slot_mapping):
        if q.dtype == k.dtype == v.dtype == kv_cache.dtype == torch.float32 and q.device.type == "cpu":
            return cpu_ops.rope_write_kv(rotary.cos, rotary.sin, positions, q, k, v, kv_cache, slot_mapping)
        return super().rotary_write_kv(rotary, positions, q, k, v, kv_cache, slot_mapping)

    def forward(self, q, kv_cache, meta, scale, prefetch=None, window=0):
        if meta.kv_gather_idx is None:  # a C step (prepare_metadata built no gather indices)
            return cpu_ops.paged_attention(q, kv_cache, meta, scale, window)
        return reference_attention(q, kv_cache, meta, scale, window)
