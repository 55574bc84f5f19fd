"""A CPU decode step's small float32 ops in C (cpu_ops.c, built into kernels/cpu_gguf.py's library): RMSNorm
with the residual add, rotary + the K/V write, and paged attention over the block table.

What models/kernel_path.enable_cpu_ops switches a quantized CPU model onto (the float32 reference path keeps
plain torch). Each is one C call where torch takes five to twenty ops of a few microseconds each; the results
are torch's up to the order of float32 sums (tests/test_cpu_ops.py checks each against the reference).
"""

from __future__ import annotations

import torch

from verispec.core.attention_metadata import AttentionMetadata
from verispec.kernels import cpu_gguf

# Steps whose longest query is longer keep torch's attention (SDPA). None: every step takes the C kernel, prompt
# chunks included, so that a query's result never depends on the chunk it is computed in (prefill chunking, a
# drafter's catch-up, a preempted request's recompute and a prefix hit all give the same bits; the quantized CPU
# path's self-drafting then accepts every draft by construction), at 0-25% more prefill time than SDPA on 64-1,500
# token prompts (scripts/cpu_prefill_attention.py, BENCHMARKS "Session 30, CPU").
MAX_QUERY_LEN: int | None = None


def available() -> bool:
    """Whether the library built and passed its check (cpu_gguf.available())."""
    return cpu_gguf.available()


def _f32(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"cpu_ops: {name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """models/layers/norm.RMSNorm's forward on float32 CPU tensors: norm(x), or with residual
    (norm(x + residual), x + residual)."""
    _f32(x, "x")
    _f32(weight, "weight")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"cpu_ops.rms_norm: weight {tuple(weight.shape)} for rows of {dim}")
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = None
    if residual is not None:
        _f32(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"cpu_ops.rms_norm: residual {tuple(residual.shape)} for x {tuple(x.shape)}")
        residual = residual.contiguous()
        res_out = torch.empty_like(x)
    rows = x.numel() // dim
    rc = cpu_gguf._lib().vs_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                                     weight.contiguous().data_ptr(), rows, dim, eps, out.data_ptr(),
                                     None if res_out is None else res_out.data_ptr())
    if rc != 0:
        raise ValueError(f"cpu_ops.rms_norm: the kernel refused x {tuple(x.shape)}")
    return out if res_out is None else (out, res_out)


def _rows(t: torch.Tensor, name: str) -> int:
    """Floats per token of a [T, heads, D] view whose heads are contiguous (a column slice of qkv's output)."""
    _f32(t, name)
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"cpu_ops: {name} must be [T, heads, D] with contiguous heads, got strides {t.stride()}")
    return t.stride(0)


def rope_write_kv(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, KH, D] to `positions` (cos / sin: [max_positions, D / 2] tables), write k and
    v into kv_cache [2, slots, KH, D] at slot_mapping (negative: not written); returns the rotated q."""
    t, h, d = q.shape
    kh = k.shape[1]
    if k.shape != (t, kh, d) or v.shape != (t, kh, d) or kv_cache.shape[1:] != (kv_cache.shape[1], kh, d) \
            or not kv_cache.is_contiguous() or cos.shape != (cos.shape[0], d // 2) or sin.shape != cos.shape:
        raise ValueError(f"cpu_ops.rope_write_kv: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"cache {tuple(kv_cache.shape)} cos {tuple(cos.shape)} do not match")
    _f32(kv_cache, "kv_cache")
    _f32(cos, "cos")
    _f32(sin, "sin")
    pos = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    out = torch.empty(t, h, d, dtype=torch.float32)
    rc = cpu_gguf._lib().vs_rope_write_kv(
        q.data_ptr(), _rows(q, "q"), k.data_ptr(), _rows(k, "k"), v.data_ptr(), _rows(v, "v"), t, h, kh, d,
        pos.data_ptr(), cos.contiguous().data_ptr(), sin.contiguous().data_ptr(), cos.shape[0], kv_cache.data_ptr(),
        kv_cache.shape[1], slots.data_ptr(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"cpu_ops.rope_write_kv: a position (max {int(pos.max())}) or slot (max {int(slots.max())}) "
                         f"is outside the tables ({cos.shape[0]}) or the cache ({kv_cache.shape[1]})")
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int = 0) -> torch.Tensor:
    """attention/backend.AttentionBackend.forward's contract on float32 CPU tensors, read straight from the
    block table (no gather indices): q [T, H, D] -> [T, H, D]."""
    _f32(q, "q")
    _f32(kv_cache, "kv_cache")
    t, h, d = q.shape
    kh = kv_cache.shape[2]
    if kv_cache.shape[3] != d or not kv_cache.is_contiguous() or meta.block_size is None:
        raise ValueError(f"cpu_ops.paged_attention: cache {tuple(kv_cache.shape)} for q {tuple(q.shape)} "
                         f"(block size {meta.block_size})")
    q = q.contiguous()
    i32 = torch.int32
    qsl = meta.query_start_loc.to(i32).contiguous()
    lens = meta.seq_lens.to(i32).contiguous()
    tables = meta.block_tables.to(i32).contiguous()
    start = None if meta.kv_start is None else meta.kv_start.to(i32).contiguous()
    b = lens.shape[0]
    out = torch.empty_like(q)
    rc = cpu_gguf._lib().vs_paged_attention(
        q.data_ptr(), t, h, kh, d, kv_cache.data_ptr(), kv_cache.shape[1], qsl.data_ptr(), lens.data_ptr(), b,
        tables.data_ptr(), tables.shape[1] if tables.dim() == 2 else 0, meta.block_size,
        None if start is None else start.data_ptr(), int(meta.causal), window, scale, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"cpu_ops.paged_attention: the kernel refused the step ({t} tokens, {b} sequences, "
                         f"cache {tuple(kv_cache.shape)}): query offsets, lengths or block table out of range")
    return out
