"""Sliding-window attention (Gemma 3's local layers): the torch reference against a dense
per-query computation, and the Triton paged kernel against the reference on random odd sizes.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
the gpu-marked variants run it compiled in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels import make_batch, tol
from verispec.attention.reference import reference_attention
from verispec.kernels import paged_attention as pa

CPU = pytest.param("cpu", torch.float32, id="cpu-fp32")
GPU = pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)


def dense_window_attention(q, kv, meta, scale, window):
    """One query at a time, in float64, straight from the definition: query at position p sees
    the keys at positions max(0, p - window + 1) .. p of its sequence."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    bs, rep = meta.block_size, q.shape[1] // kv.shape[2]
    for b, sl in enumerate(lens):
        t0, t1 = qsl[b], qsl[b + 1]
        for i in range(t1 - t0):
            p = sl - (t1 - t0) + i
            pos = torch.arange(max(0, p - window + 1) if window else 0, p + 1)
            slots = meta.block_tables[b].long()[pos // bs] * bs + pos % bs
            k, v = (kv[j][slots].double().repeat_interleave(rep, dim=1) for j in (0, 1))  # [L, H, D]
            s = torch.einsum("hd,lhd->hl", q[t0 + i].double(), k) * scale
            out[t0 + i] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
    return out


SHAPES = [(1, 1), (1, 37), (1, 133), (5, 90), (3, 3), (29, 61), (70, 70)]


@pytest.mark.parametrize("window", [1, 7, 32, 1000])
def test_reference_window_matches_dense(window):
    meta, kv = make_batch(SHAPES, 16, 2, 32, torch.float32, "cpu", seed=window)
    q = torch.randn(meta.slot_mapping.shape[0], 6, 32, generator=torch.Generator().manual_seed(window))
    got = reference_attention(q, kv, meta, 0.3, window=window)
    torch.testing.assert_close(got.double(), dense_window_attention(q, kv, meta, 0.3, window), atol=1e-5, rtol=1e-5)


def test_window_wider_than_every_sequence_is_global():
    meta, kv = make_batch(SHAPES, 16, 2, 32, torch.float32, "cpu", seed=3)
    q = torch.randn(meta.slot_mapping.shape[0], 6, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(reference_attention(q, kv, meta, 0.3, window=200), reference_attention(q, kv, meta, 0.3))


def run_window(shapes, heads, kv_heads, head_dim, block_size, window, device, dtype, seed, splits=(1, 3)):
    meta, kv = make_batch(shapes, block_size, kv_heads, head_dim, dtype, device, seed)
    t = meta.slot_mapping.shape[0]
    q = torch.randn(t, heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    scale = head_dim**-0.5
    ref = reference_attention(q.float(), kv.float(), meta, scale, window=window)
    pa.POISON_SCRATCH = True
    try:
        for s in splits:
            out = torch.full_like(q, float("nan"))
            pa.triton_attention(q, kv, meta, scale, num_splits=s, out=out, window=window)
            assert not out.isnan().any(), f"unwritten output (splits={s})"
            torch.testing.assert_close(out.float(), ref, **tol(dtype), msg=lambda m, s=s: f"splits={s} window={window}: {m}")
    finally:
        pa.POISON_SCRATCH = False


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("window", [1, 5, 33, 100])
def test_kernel_decode_window(device, dtype, window):
    shapes = [(1, 1), (1, 37), (1, 80), (1, 133), (1, 17), (1, 301)]
    run_window(shapes, 6, 2, 64, 16, window, device, dtype, seed=window, splits=(1, 3, None))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("window", [2, 19, 64])
def test_kernel_verify_and_prefill_window(device, dtype, window):
    """Verify steps (several queries at the end of a context) and chunked / whole prefills with
    more queries than one tile, at an odd block size."""
    shapes = [(4, 50), (7, 7), (3, 140), (83, 83), (40, 171), (1, 9)]
    run_window(shapes, 4, 1, 32, 5, window, device, dtype, seed=100 + window)


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
def test_kernel_gemma_shape(device, dtype):
    """Gemma 3 270m's heads (4 query heads, 1 KV head, head_dim 256) with a window shorter than the context."""
    run_window([(1, 45), (6, 70), (30, 30)], 4, 1, 256, 16, 24, device, dtype, seed=7, splits=(1, 2))
