"""The L2 prefetch hint (kernels/l2_prefetch.py): which bytes it asks for, and that asking changes
nothing. The regions are plain arithmetic (CPU); the kernel path needs a Hopper GPU (gpu marker):
attention with the prefetch row equals attention without it bit for bit, eagerly and in a CUDA
graph, and one-row decode steps with the 1.5B's shapes give the same logits with and without it."""

from __future__ import annotations

import pytest
import torch
from test_kernels import make_batch

from verispec.core.options import KernelOptions
from verispec.kernels import l2_prefetch
from verispec.kernels import paged_attention as pa
from verispec.kernels.l2_prefetch import stacked_head


class _FakeCuda:
    """Stands in for a contiguous CUDA weight: stacked_head reads only these attributes."""

    is_cuda = True

    def __init__(self, rows: int, cols: int, ptr: int) -> None:
        self.rows, self.cols, self.ptr = rows, cols, ptr

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return self.rows * self.cols

    def element_size(self) -> int:
        return 2

    def data_ptr(self) -> int:
        return self.ptr


def test_stacked_head_asks_for_the_leading_rows_of_both_halves():
    w = _FakeCuda(2 * 8960, 1536, ptr=1 << 40)
    half = 8960 * 1536 * 2
    a0, n0, a1, n1 = stacked_head(w, 16 << 20)
    assert (a0, a1) == (1 << 40, (1 << 40) + half)
    assert n0 == n1 == (8 << 20) and n0 % 256 == 0


def test_stacked_head_clips_to_the_weight_and_rounds_to_256_bytes():
    w = _FakeCuda(2 * 10, 64, ptr=4096)  # halves of 1,280 bytes
    assert stacked_head(w, 1 << 30) == (4096, 1280, 4096 + 1280, 1280)
    assert stacked_head(w, 1000) == (4096, 256, 4096 + 1280, 256)  # 500 per half -> 256
    assert stacked_head(w, 300) is None  # 150 per half rounds to nothing
    assert stacked_head(w, 0) is None


def test_stacked_head_refuses_cpu_weights():
    assert stacked_head(torch.zeros(4, 256, dtype=torch.bfloat16), 1 << 20) is None


def test_backend_asks_only_in_small_steps():
    """The Triton backend's option: options.l2_prefetch_bytes in steps of at most l2_prefetch_max_rows
    tokens and l2_prefetch_max_seqs sequences, 0 otherwise; the reference backend never asks."""
    from verispec.attention.reference import ReferenceBackend
    from verispec.attention.triton import TritonBackend

    def meta(seqs):
        return make_batch([(1, 5)] * seqs, 16, 2, 64, torch.float32, "cpu", seed=seqs)[0]

    default = TritonBackend()
    assert default.l2_prefetch_bytes(1, meta(1)) == 4 << 20
    assert default.l2_prefetch_bytes(8, meta(2)) == 4 << 20
    assert default.l2_prefetch_bytes(9, meta(1)) == 0 and default.l2_prefetch_bytes(3, meta(3)) == 0
    wide = TritonBackend(KernelOptions(l2_prefetch_bytes=1 << 20, l2_prefetch_max_seqs=4, l2_prefetch_max_rows=16))
    assert wide.l2_prefetch_bytes(16, meta(4)) == 1 << 20 and wide.l2_prefetch_bytes(17, meta(4)) == 0
    assert ReferenceBackend().l2_prefetch_bytes(1, meta(1)) == 0


def test_prefetch_is_ignored_where_unsupported():
    """On the CPU (the interpreter has no inline PTX) the argument changes nothing."""
    meta, kv = make_batch([(1, 37), (1, 80)], 16, 2, 64, torch.float32, "cpu", seed=3)
    q = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(4))
    assert not l2_prefetch.prefetch_supported(q.device)
    a = pa.triton_attention(q, kv, meta, 0.125, num_splits=2)
    b = pa.triton_attention(q, kv, meta, 0.125, num_splits=2, prefetch=(1 << 40, 4096, 1 << 41, 4096))
    assert torch.equal(a, b)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA device of compute capability >= 9.0")
@pytest.mark.parametrize("shapes,splits", [([(1, 1)], None), ([(1, 333)], None), ([(1, 77), (1, 5), (4, 90)], 3),
                                           ([(1, 1100)], 1)])
def test_attention_with_prefetch_equals_without(shapes, splits):
    """Odd lengths, one and several sequences, split and unsplit: the prefetch row of programs
    changes no output bit, eagerly and replayed in a CUDA graph."""
    meta, kv = make_batch(shapes, 16, 2, 128, torch.bfloat16, "cuda", seed=len(shapes) + (splits or 0))
    t = meta.slot_mapping.shape[0]
    q = torch.randn(t, 12, 128, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    weight = torch.randn(2 * 8960, 1536, dtype=torch.bfloat16).cuda()
    regions = stacked_head(weight, 24 << 20)
    assert regions is not None
    ref = pa.triton_attention(q, kv, meta, 0.088, num_splits=splits)
    out = pa.triton_attention(q, kv, meta, 0.088, num_splits=splits, prefetch=regions)
    assert torch.equal(out, ref)
    static = torch.zeros_like(q)
    graph = torch.cuda.CUDAGraph()
    pa.triton_attention(q, kv, meta, 0.088, num_splits=splits, out=static, prefetch=regions)  # compile first
    with torch.cuda.graph(graph):
        pa.triton_attention(q, kv, meta, 0.088, num_splits=splits, out=static, prefetch=regions)
    static.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA device of compute capability >= 9.0")
def test_decode_step_logits_unchanged_by_prefetch():
    """Two layers with the 1.5B's shapes and random weights, one-row decode steps (the path that
    passes the prefetch): the logits with the prefetch on equal those with it off, bit for bit."""
    import dataclasses

    from verispec.bench.models import random_model, shapes_for
    from verispec.models.kernel_path import enable_triton
    from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

    cfg = dataclasses.replace(shapes_for("qwen2.5-coder-1.5b-instruct"), num_layers=2)
    dev = torch.device("cuda")
    model = random_model(cfg, dev, torch.bfloat16)
    logits = {}
    for mb in (0, 24):
        enable_triton(model, True, options=KernelOptions(l2_prefetch_bytes=mb << 20))
        kv = allocate_kv_cache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, dev)
        ids, pos, meta = build_batch([SeqChunk(list(range(100, 141)), 0, list(range(8)))], 16, dev)
        model(ids, pos, meta, kv)
        steps = []
        for i in range(5):
            ids, pos, meta = build_batch([SeqChunk([7 + i], 41 + i, list(range(8)))], 16, dev)
            steps.append(model.compute_logits(model(ids, pos, meta, kv)[0]))
        logits[mb] = torch.cat(steps)
    assert torch.equal(logits[0], logits[24])

