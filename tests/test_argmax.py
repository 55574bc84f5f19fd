"""The two-stage Triton argmax against torch.argmax (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from verispec.kernels.argmax import CHUNK, argmax_rows

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,n", [(1, 5), (3, CHUNK), (2, 2 * CHUNK + 77), (3, 151936)])
def test_argmax_rows_matches_torch(device, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g)
    x[0, n // 2] = x[0, n - 1] = 9.0  # a tie across pieces: the first index wins
    if rows > 1:
        x[1] = float("-inf")  # no finite value: index 0, as torch
    if rows > 2:
        x[2, : n // 3] = x[2].max()  # a tie inside the first piece, many equal values
    x = x.to(device)
    got = argmax_rows(x)
    assert got.dtype == torch.long
    assert torch.equal(got.cpu(), x.cpu().argmax(-1))
    packed = argmax_rows(x, with_counts=True)
    assert torch.equal(packed.cpu(), torch.cat([x.cpu().argmax(-1), torch.ones(rows, dtype=torch.long)]))


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_rows_strided_and_empty(device):
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(3)).to(device)
    view = x[::2, :2999]  # row stride 6000, last dim contiguous
    assert torch.equal(argmax_rows(view).cpu(), view.cpu().argmax(-1))
    assert argmax_rows(x[:0]).shape == (0,)


def _variants(kernel) -> int:
    """Compiled variants of a Triton kernel on the current CUDA device."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_step_arguments_compile_once():
    """The eager per-step kernels compile once per constexpr set, whatever a step's row count,
    block-table width or staging offsets (Triton's value and alignment specialization compiled new
    variants mid-run, and bench spec at batch 16 lost 5x to it)."""
    from verispec.kernels import argmax as am
    from verispec.kernels import graph_inputs as gi

    dev = torch.device("cuda")
    logits = torch.randn(40, 3000, device=dev)
    am.argmax_rows(logits[:2])
    before = (_variants(am._argmax_chunk_kernel), _variants(am._argmax_rows_kernel))
    for lo, rows in ((1, 1), (3, 16), (5, 7), (0, 32)):  # row slices: odd row offsets and counts
        assert torch.equal(am.argmax_rows(logits[lo : lo + rows]), logits[lo : lo + rows].argmax(-1))
    assert (_variants(am._argmax_chunk_kernel), _variants(am._argmax_rows_kernel)) == before

    i64, i32 = dict(dtype=torch.long, device=dev), dict(dtype=torch.int32, device=dev)
    b, max_blocks = 16, 40
    dst = (torch.zeros(b, **i64), torch.zeros(b, **i64), torch.zeros(b, **i64), torch.zeros(b + 1, **i32),
           torch.zeros(b, **i32), torch.zeros(b, max_blocks, **i32))
    stage = torch.zeros(4096, **i64)  # staging-like: every section a view at some offset

    def step(n: int, width: int, off: int) -> None:
        src = (stage[off : off + n], stage[off + n : off + 2 * n], stage[off + 2 * n : off + 3 * n],
               stage.view(torch.int32)[2 * off : 2 * off + n + 1], stage.view(torch.int32)[2 * off + 7 : 2 * off + 7 + n],
               stage.view(torch.int32)[2 * off + 40 : 2 * off + 40 + n * width].view(n, width))
        gi.stage_graph_inputs(src, dst, n, b, 1, 0, 16)

    step(2, 3, 0)
    before = _variants(gi._graph_inputs_kernel)
    for n, width, off in ((1, 1, 1), (16, 16, 3), (3, 5, 8), (16, 32, 17)):
        step(n, width, off)
    torch.cuda.synchronize()
    assert _variants(gi._graph_inputs_kernel) == before
