"""Dequantization kernels against gguf's numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize

from verispec.loader.dequant import SUPPORTED_TYPES, dequantize
from verispec.loader.gguf import GGUFFile

T = GGMLQuantizationType
# byte offsets of the fp16 scale fields inside one block of each quantized type
_SCALE_OFFSETS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
TYPES = sorted(T(t) for t in SUPPORTED_TYPES)


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random finite halves over many magnitudes, subnormals included."""
    mag = np.exp2(rng.uniform(-24, 6, size=n)) * rng.choice([-1.0, 1.0], size=n)
    return mag.astype(np.float16)


def random_rows(qtype: T, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """[rows, bytes] uint8 of random blocks with sane scales (no NaN/Inf)."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = rows * blocks_per_row * block
    if qtype == T.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8).reshape(rows, -1)
    if qtype == T.F16:
        return _finite_f16(rng, n).view(np.uint8).reshape(rows, -1)
    if qtype == T.BF16:
        f = rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16
        return f.astype(np.uint16).view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        blocks[:, off : off + 2] = _finite_f16(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _check(raw: np.ndarray, qtype: T, shape: tuple[int, ...], device: str) -> None:
    want = ref_dequantize(raw, qtype).reshape(shape)
    assert np.isfinite(want).all()
    got = dequantize(torch.from_numpy(raw.copy()).reshape(-1), qtype, shape, device=device)
    assert got.shape == shape and got.dtype == torch.float32 and got.device.type == device
    got_np = got.cpu().numpy()
    bad = np.flatnonzero(got_np.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{qtype.name}: {bad.size} mismatches, first at {bad[0]}: {got_np.flat[bad[0]]} != {want.flat[bad[0]]}"


@pytest.mark.parametrize("rows", [7, 13])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_bit_exact(qtype: T, rows: int) -> None:
    blocks_per_row = 3 if rows == 7 else 2
    raw = random_rows(qtype, rows, blocks_per_row, seed=rows * 100 + int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    _check(raw, qtype, (rows, blocks_per_row * block), "cpu")


def test_chunked_path_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors larger than one chunk are decoded in several steps; the seams must not show."""
    import verispec.loader.dequant as dq

    monkeypatch.setattr(dq, "_CHUNK_BLOCKS", 5)
    raw = random_rows(T.Q4_K, 11, 2, seed=3)
    _check(raw, T.Q4_K, (11, 512), "cpu")
    got = dequantize(torch.from_numpy(raw.copy()).reshape(-1), T.Q4_K, (11, 512), dtype=torch.bfloat16)
    want = torch.from_numpy(ref_dequantize(raw, T.Q4_K)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_three_dim_shape() -> None:
    raw = random_rows(T.Q8_0, 6, 2, seed=5)
    got = dequantize(torch.from_numpy(raw.copy()).reshape(-1), T.Q8_0, (2, 3, 64))
    want = ref_dequantize(raw, T.Q8_0).reshape(2, 3, 64)
    assert torch.equal(got, torch.from_numpy(want))


def test_rejects_bad_input() -> None:
    raw = torch.zeros(34 * 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(raw, T.IQ2_XXS, (4, 256))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw[:-1], T.Q8_0, (4, 32))
    with pytest.raises(ValueError, match="blocks"):
        dequantize(raw, T.Q8_0, (8, 17))


def _one_tensor_per_type(f: GGUFFile) -> dict[int, str]:
    """The smallest tensor of every type present in the file."""
    best: dict[int, str] = {}
    for name, info in f.tensors.items():
        cur = best.get(info.ggml_type)
        if cur is None or info.nbytes < f.tensors[cur].nbytes:
            best[info.ggml_type] = name
    return best


def test_real_tensors_bit_exact(qwen05_path) -> None:
    f = GGUFFile(qwen05_path)
    picks = _one_tensor_per_type(f)
    assert {T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.F32} <= set(picks)  # what this Q4_K_M file mixes
    for qtype, name in picks.items():
        info = f.tensors[name]
        raw = f.raw(name)
        want = ref_dequantize(raw.numpy().reshape(info.shape[0] if len(info.shape) > 1 else 1, -1), T(qtype))
        got = dequantize(raw, qtype, info.shape)
        assert got.shape == info.shape
        assert torch.equal(got, torch.from_numpy(want).reshape(info.shape)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_bit_exact(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    import verispec.loader.dequant as dq

    raw = random_rows(qtype, 13, 3, seed=int(qtype))
    _check(raw, qtype, (13, 3 * GGML_QUANT_SIZES[qtype][0]), "cuda")
    monkeypatch.setattr(dq, "_CHUNK_BLOCKS", 64)  # several chunks on the device
    big = random_rows(qtype, 300, 8, seed=int(qtype) + 1)
    _check(big, qtype, (300, 8 * GGML_QUANT_SIZES[qtype][0]), "cuda")
