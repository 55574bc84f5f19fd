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
