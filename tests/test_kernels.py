"""Triton kernels vs the plain torch references, on random odd-sized inputs.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported), in float32 with tight tolerances. The gpu-marked variants run the
compiled kernels in bfloat16 against a float32 reference on the same rounded inputs.
Outputs are poisoned with NaN before each kernel runs, so an element it fails to write fails.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from verispec.attention.reference import build_reference_indices, reference_attention, write_kv
from verispec.core.attention_metadata import AttentionMetadata
from verispec.kernels import fused
from verispec.kernels import paged_attention as pa
from verispec.worker.inputs import SeqChunk, build_batch

CPU = pytest.param("cpu", torch.float32, id="cpu-fp32")
GPU = pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)
DEVICES = [CPU, GPU]


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def make_batch(shapes, block_size, num_kv_heads, head_dim, dtype, device, seed, spare_blocks=3):
    """Random paged batch: shapes = [(q_len, seq_len)]; blocks shuffled across sequences."""
    rng = random.Random(seed)
    need = sum(-(-sl // block_size) for _, sl in shapes)
    perm = list(range(need + spare_blocks))
    rng.shuffle(perm)
    chunks = []
    for ql, sl in shapes:
        blocks = [perm.pop() for _ in range(-(-sl // block_size))]
        chunks.append(SeqChunk([0] * ql, sl - ql, blocks))
    _, _, meta = build_batch(chunks, block_size, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, (need + spare_blocks) * block_size, num_kv_heads, head_dim, generator=g)
    return meta, kv.to(device=device, dtype=dtype)


def run_attention(shapes, heads, kv_heads, head_dim, block_size, device, dtype, seed, splits=(1, 3)):
    meta, kv = make_batch(shapes, block_size, kv_heads, head_dim, dtype, device, seed)
    t = meta.slot_mapping.shape[0]
    q = torch.randn(t, heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    scale = head_dim**-0.5
    ref = reference_attention(q.float(), kv.float(), meta, scale)
    pa.POISON_SCRATCH = True
    try:
        for s in splits:
            out = torch.full_like(q, float("nan"))
            pa.triton_attention(q, kv, meta, scale, num_splits=s, out=out)
            assert not out.isnan().any(), f"unwritten output (splits={s})"
            torch.testing.assert_close(out.float(), ref, **tol(dtype), msg=lambda m, s=s: f"splits={s}: {m}")
    finally:
        pa.POISON_SCRATCH = False


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (12, 2, 128), (4, 4, 64)])
def test_decode(device, dtype, heads, kv_heads, head_dim):
    shapes = [(1, 1), (1, 37), (1, 80), (1, 133), (1, 17)]
    run_attention(shapes, heads, kv_heads, head_dim, 16, device, dtype, seed=head_dim + heads, splits=(1, 3, None))


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_decode_many_splits(device, dtype):
    """Many splits, most of them empty at these lengths; a long context spans several tiles per split
    (the block ids are loaded one tile ahead)."""
    shapes = [(1, 333), (1, 70), (1, 5), (1, 1100)]
    run_attention(shapes, 12, 2, 64, 16, device, dtype, seed=21, splits=(2, 8, 32))


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 7])
def test_verify(device, dtype, k):
    shapes = [(1 + k, 1 + k), (1 + k, 45), (1 + k, 97), (1 + k, 20)]
    run_attention(shapes, 14, 2, 64, 16, device, dtype, seed=k)
    run_attention(shapes[1:3], 12, 2, 128, 16, device, dtype, seed=10 + k, splits=(2,))


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (12, 2, 128)])
def test_bidirectional_with_kv_start(device, dtype, heads, kv_heads, head_dim):
    """The DFlash drafter's form: causal=False (every query sees its whole sequence) and a per-sequence
    first visible key (kv_start), block of 16 queries at odd context lengths."""
    shapes = [(16, 16), (16, 45), (16, 97), (16, 33), (5, 71)]
    starts = [0, 7, 0, 20, 66]
    meta, kv = make_batch(shapes, 16, kv_heads, head_dim, dtype, device, seed=heads)
    tables = meta.block_tables.tolist()
    ref_idx = build_reference_indices([q for q, _ in shapes], [s for _, s in shapes], tables, 16, torch.device(device),
                                      causal=False, kv_starts=starts)
    meta = dataclasses.replace(meta, causal=False, kv_start=torch.tensor(starts, device=device), **ref_idx)
    t = meta.slot_mapping.shape[0]
    q = torch.randn(t, heads, head_dim, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    scale = head_dim**-0.5
    ref = reference_attention(q.float(), kv.float(), meta, scale)
    causal_ref = reference_attention(q.float(), kv.float(), dataclasses.replace(
        meta, **build_reference_indices([q for q, _ in shapes], [s for _, s in shapes], tables, 16,
                                        torch.device(device))), scale)
    assert not torch.allclose(ref, causal_ref, atol=1e-2)  # the mask matters for these inputs
    for s in (1, 3, None):
        out = torch.full_like(q, float("nan"))
        pa.triton_attention(q, kv, meta, scale, num_splits=s, out=out)
        torch.testing.assert_close(out.float(), ref, **tol(dtype), msg=lambda m, s=s: f"splits={s}: {m}")


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_prefill_chunked_and_mixed(device, dtype):
    # Chunked prefill (q_len < seq_len, q_len > 16 -> prefill tiles), a whole prompt, decode and verify rows.
    shapes = [(21, 60), (17, 17), (1, 51), (5, 40), (19, 20)]
    run_attention(shapes, 6, 2, 64, 16, device, dtype, seed=3)
    run_attention(shapes[:2], 12, 2, 128, 16, device, dtype, seed=4, splits=(2,))


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_odd_block_size(device, dtype):
    run_attention([(3, 29), (1, 11), (9, 9)], 7, 1, 64, 5, device, dtype, seed=5)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_padding_rows_give_zeros(device, dtype):
    """A sequence with no visible key (graph padding: seq_len 0) yields zeros, not NaN."""
    meta, kv = make_batch([(2, 30)], 16, 2, 64, dtype, device, seed=6)
    dev = torch.device(device)
    pad = AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.long, device=dev),
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([30, 0], dtype=torch.int32, device=dev),
        block_tables=torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables)]),
        max_query_len=2, max_seq_len=30, block_size=16,
    )
    q = torch.randn(3, 4, 64).to(dev, dtype)
    ref = reference_attention(q[:2].float(), kv.float(), meta, 0.125)
    for s in (1, 4):
        out = torch.full_like(q, float("nan"))
        pa.triton_attention(q, kv, pad, 0.125, num_splits=s, out=out)
        torch.testing.assert_close(out[:2].float(), ref, **tol(dtype))
        assert (out[2] == 0).all()


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_padding_queries_before_chunk(device, dtype):
    """The runner's padded verify layout (ModelRunner._pad): each chunk of n real queries gets
    q - n padding queries in front and keeps its seq_len. The real queries see exactly what they
    see unpadded; a padding query sees only older keys, or none (zeros) when seq_len < q. Also
    checks tests/tiny.metadata_attention (the engine-level padding test's backend) on both."""
    from tiny import metadata_attention

    q_len, heads, kv_heads, head_dim, bs = 5, 6, 2, 64, 16
    shapes = [(1, 1), (2, 2), (5, 40), (1, 37), (3, 20), (4, 17)]
    meta, kv = make_batch(shapes, bs, kv_heads, head_dim, dtype, device, seed=12)
    dev = torch.device(device)
    real = torch.tensor([b * q_len + q_len - n + i for b, (n, _) in enumerate(shapes) for i in range(n)], device=dev)
    pad_rows = torch.ones(len(shapes) * q_len, dtype=torch.bool, device=dev)
    pad_rows[real] = False
    no_key = torch.tensor([i < q_len - sl for _, sl in shapes for i in range(q_len)], device=dev)  # qpos < 0
    padded = AttentionMetadata(
        slot_mapping=torch.full((len(shapes) * q_len,), -1, dtype=torch.long, device=dev),
        query_start_loc=torch.arange(len(shapes) + 1, dtype=torch.int32, device=dev) * q_len,
        seq_lens=meta.seq_lens, block_tables=meta.block_tables, max_query_len=q_len, max_seq_len=40, block_size=bs,
    )
    q = torch.randn(len(shapes) * q_len, heads, head_dim, generator=torch.Generator().manual_seed(13)).to(dev, dtype)
    ref = reference_attention(q[real].float(), kv.float(), meta, 0.125)
    torch.testing.assert_close(metadata_attention(q[real].float(), kv.float(), meta, 0.125), ref, **tol(torch.float32))
    for attn in ("metadata", 1, 3):
        if attn == "metadata":
            out = metadata_attention(q, kv, padded, 0.125)
        else:
            out = torch.full_like(q, float("nan"))
            pa.triton_attention(q, kv, padded, 0.125, num_splits=attn, out=out)
        torch.testing.assert_close(out[real].float(), ref, **tol(dtype), msg=lambda m, a=attn: f"{a}: {m}")
        assert not out.isnan().any() and (out[no_key] == 0).all() and (out[pad_rows & ~no_key] != 0).any()


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_write_kv(device, dtype):
    """The reference backend's K/V write: each token's K/V in its slot, a negative slot not written."""
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 53, 3, 64, generator=g).to(device, dtype)
    k = torch.randn(11, 3, 64, generator=g).to(device, dtype)
    v = torch.randn(11, 3, 64, generator=g).to(device, dtype)
    slots = torch.randperm(53, generator=g)[:11].to(device)
    skip = slots.clone()
    skip[4] = -1  # negative slot: not written
    got = cache.clone()
    write_kv(got, k, v, skip)
    want = cache.clone()
    for t in range(11):
        if t != 4:
            want[0, slots[t]], want[1, slots[t]] = k[t], v[t]
    assert torch.equal(got, want)


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("rows,hidden", [(7, 100), (3, 1536), (1, 64)])
def test_rms_norm(device, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    r = torch.randn(rows, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6), **tol(dtype))
    out, res = fused.rms_norm(x, w, 1e-6, r)
    ref_out, ref_res = fused.rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref_out, **tol(dtype))
    x3 = x.reshape(rows, 1, hidden)  # [T, heads, D] like q/k norm
    torch.testing.assert_close(fused.rms_norm(x3, w, 1e-6), fused.rms_norm_ref(x3, w, 1e-6), **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_backends_rotary_write_kv_agree(device, dtype):
    """The two backends' K/V writes (Triton: one kernel on CUDA, the torch path on the CPU; the
    reference: torch rotary + write_kv) leave the same q and cache, padding slots unwritten."""
    from verispec.attention.reference import ReferenceBackend
    from verispec.attention.triton import TritonBackend
    from verispec.models.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(64, 500, 1e6).to(device)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(9, 14, 64, generator=g).to(device, dtype)
    k = torch.randn(9, 2, 64, generator=g).to(device, dtype)
    v = torch.randn(9, 2, 64, generator=g).to(device, dtype)
    pos = torch.randint(0, 500, (9,), generator=g).to(device)
    slots = torch.randperm(40, generator=g)[:9].to(device)
    slots[2] = -1
    cache = torch.randn(2, 40, 2, 64, generator=g).to(device, dtype)
    outs = []
    for backend in (ReferenceBackend(), TritonBackend()):
        c = cache.clone()
        outs.append((backend.rotary_write_kv(rot, pos, q.clone(), k.clone(), v, c, slots), c))
    torch.testing.assert_close(outs[1][0], outs[0][0], **tol(dtype))
    torch.testing.assert_close(outs[1][1], outs[0][1], **tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (12, 2, 128), (5, 3, 32)])
def test_rotary_write_kv(device, dtype, heads, kv_heads, head_dim):
    """q rotated in place, rotated k and v in their cache slots; q/k/v are views of one qkv row."""
    from verispec.models.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(head_dim, 500, 1e6).to(device)
    g = torch.Generator().manual_seed(heads + 1)
    t = 9
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)
    pos = torch.randint(0, 500, (t,), generator=g).to(device)
    slots = torch.randperm(40, generator=g)[:t].to(device)
    slots[3] = -1  # not written
    cache = torch.randn(2, 40, kv_heads, head_dim, generator=g).to(device, dtype)
    ref_q, ref_k = rot(pos, q, k)
    want = cache.clone()
    ok = slots >= 0
    write_kv(want, ref_k[ok], v[ok], slots[ok])
    got = cache.clone()
    fused.rotary_write_kv_(pos, q, k, v, rot.cos, rot.sin, got, slots)
    torch.testing.assert_close(q, ref_q, **tol(dtype))
    torch.testing.assert_close(got, want, **tol(dtype))
    keep = torch.ones(40, dtype=torch.bool, device=device)
    keep[slots[slots >= 0]] = False
    assert torch.equal(got[:, keep], cache[:, keep])


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_silu_and_mul(device, dtype):
    g = torch.Generator().manual_seed(8)
    gu = torch.randn(5, 2 * 1500, generator=g).to(device, dtype)
    gate, up = gu[:, :1500], gu[:, 1500:]  # strided views, as from a merged projection
    torch.testing.assert_close(fused.silu_and_mul(gate, up), fused.silu_and_mul_ref(gate, up), **tol(dtype))
    wide = torch.full((5, 1600), 3.0, device=device, dtype=dtype)  # out=: a column slice, the rest untouched
    assert fused.silu_and_mul(gate, up, out=wide[:, 50:1550]).data_ptr() == wide[:, 50:].data_ptr()
    torch.testing.assert_close(wide[:, 50:1550], fused.silu_and_mul_ref(gate, up), **tol(dtype))
    assert (wide[:, :50] == 3.0).all() and (wide[:, 1550:] == 3.0).all()
    with pytest.raises(ValueError, match="out must be"):
        fused.silu_and_mul(gate, up, out=wide[:, :1499])


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_tiny_model_triton_matches_reference(device, dtype):
    """A whole (tiny, random) model: Triton attention + fused kernels vs the torch path (prefill,
    verify and decode shapes)."""
    from tiny import tiny_config, tiny_model

    from verispec.models.kernel_path import enable_triton
    from verispec.models.qwen2 import build_model
    from verispec.worker.inputs import allocate_kv_cache

    cpu_model = tiny_model(tiny_config(vocab=512))
    cfg = cpu_model.config
    model = build_model(cfg, dict(cpu_model.named_parameters()), torch.device(device), dtype)
    chunks = [SeqChunk(list(range(5, 5 + 13)), 0, [3, 0]), SeqChunk([7, 8, 9], 0, [1])]
    outs = []
    for on in (False, True):
        enable_triton(model, on)
        kv = allocate_kv_cache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        ids, pos, meta = build_batch(chunks, 16, torch.device(device))
        h1, _ = model(ids, pos, meta, kv)
        # then one verify step of 3 tokens for the first sequence, reading the cache just written
        ids, pos, meta = build_batch([SeqChunk([11, 12, 13], 13, [3, 0])], 16, torch.device(device))
        h2, _ = model(ids, pos, meta, kv)
        # and one decode token (on CUDA: the one-row GEMV and the fused qkv + rotary + KV write)
        ids, pos, meta = build_batch([SeqChunk([14], 16, [3, 0])], 16, torch.device(device))
        h3, _ = model(ids, pos, meta, kv)
        outs.append(torch.cat([h1, h2, h3]).float())
    enable_triton(model, False)
    if dtype == torch.float32:
        torch.testing.assert_close(outs[1], outs[0], **tol(dtype))
    else:
        assert ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 2e-2


def test_graph_padding_eager_matches_unpadded():
    """CudaGraphRunner's padded static-buffer forward (capture=False: no CUDA needed) equals the
    plain forward on the real rows, follows new metadata every call, and only writes the
    real slots plus the scratch block."""
    from tiny import tiny_config, tiny_model

    from verispec.attention.triton import TritonBackend
    from verispec.worker.graphs import CudaGraphRunner
    from verispec.worker.inputs import allocate_kv_cache

    model = tiny_model(tiny_config(vocab=512))
    model.attn_backend = TritonBackend()
    cfg = model.config
    kv = allocate_kv_cache(cfg.num_layers, 12, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    for c in kv:
        c.normal_()
    runner = CudaGraphRunner(model, kv, max_batch=4, query_lens=(1, 3), block_size=4, max_blocks_per_seq=6,
                             capture_layers=(0,), with_logits=True, capture=False)
    assert runner.scratch_block == 11
    rng = random.Random(9)
    for n, q in ((3, 3), (1, 1), (2, 3)):
        perm = list(range(11))
        rng.shuffle(perm)
        chunks = []
        for _ in range(n):
            sl = rng.randint(q, 9)
            chunks.append(SeqChunk([rng.randrange(512) for _ in range(q)], sl - q, [perm.pop() for _ in range(-(-sl // 4))]))
        ids, pos, meta = build_batch(chunks, 4, torch.device("cpu"))
        before = [c.clone() for c in kv]
        out = runner.run(ids, pos, meta, n, q)
        after = [c.clone() for c in kv]
        for c, b in zip(kv, before, strict=True):
            c.copy_(b)
        want, cap = model(ids, pos, meta, kv, (0,))
        torch.testing.assert_close(out.hidden, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.captured[0], cap[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.logits, model.compute_logits(want), atol=1e-3, rtol=1e-4)
        for c, a in zip(kv, after, strict=True):  # same cache except the scratch block
            torch.testing.assert_close(a[:, : 11 * 4], c[:, : 11 * 4], atol=1e-5, rtol=1e-5)
    assert runner.run(ids, pos, meta, n, 2) is None  # no graph for this query length
    assert runner.run(ids, pos, meta, 5, q) is None  # batch too large
