"""The CPU GGUF-block kernel (verispec/kernels/cpu_gguf.py + .c) on random blocks of every type it runs and
odd shapes, against loader/dequant.py (bit-exact with gguf's reference) and a float64 matmul; and the CPU
loader's choice of segments (loader/quantized.py). Needs a C compiler, as the kernel does: without one the
kernel is off and the CPU path keeps the int4 planes (test_unavailable_kernel_keeps_the_int4_path)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from test_dequant import _SCALE_OFFSETS, random_rows

from verispec.kernels import cpu_gguf
from verispec.loader import quantized
from verispec.loader.dequant import dequantize
from verispec.models.layers.quant import GGUFSegment, Int4Planes, QuantLinear

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


def _raw(qtype: T, rows: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row bytes] of random blocks, scales in [2^-9, 2^-6] (matmul sums stay O(1))."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = random_rows(qtype, rows, k // block, seed)
    rng = np.random.default_rng(seed + 1)
    blocks = b.reshape(-1, size)
    for off in _SCALE_OFFSETS[qtype]:
        blocks[:, off : off + 2] = np.exp2(rng.uniform(-9, -6, blocks.shape[0])).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    return torch.from_numpy(b.copy())


def _weight(qtype: T, n: int, k: int, seed: int) -> tuple[cpu_gguf.CPUBlocks, torch.Tensor]:
    raw = _raw(qtype, n, k, seed)
    return cpu_gguf.CPUBlocks(raw, int(qtype), (n, k)), dequantize(raw.reshape(-1), qtype, (n, k))


@needs_cc
def test_kernel_builds_and_passes_its_check():
    assert cpu_gguf.library() is not None and cpu_gguf.available()


@needs_cc
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 17, 45])  # fewer rows than a thread's chunk, a partial chunk
def test_dequantize_is_bit_exact(qtype, n):
    w, ref = _weight(qtype, n, 3 * GGML_QUANT_SIZES[qtype][0], seed=n)
    got = cpu_gguf.dequantize(w)
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), ref.view(torch.int32))


@needs_cc
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 16, 17])  # the GEMV (one row, several, its maximum), then dequant + GEMM
def test_linear_matches_the_float64_reference(qtype, m):
    block = GGML_QUANT_SIZES[qtype][0]
    k = 7 * block if block == 32 else 2 * block  # 7 blocks: the 4-block unrolled loop and its tail
    w, ref = _weight(qtype, 37, k, seed=m + int(qtype))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = x.double() @ ref.double().t()
    got = cpu_gguf.linear(x, w)
    assert got.shape == (m, 37) and got.dtype == torch.float32
    bound = 1e-5 * (x.double().abs() @ ref.double().abs().t()) + 1e-30  # float32 sums: order only
    assert ((got.double() - want).abs() <= bound).all()
    # bf16 activations are taken as they are (cast to float32 exactly)
    xb = x.bfloat16()
    assert ((cpu_gguf.linear(xb, w).double() - xb.double() @ ref.double().t()).abs() <= bound).all()


@needs_cc
@needs_cc
def test_gemm_route_slices_the_weight_rows(monkeypatch):
    monkeypatch.setattr(cpu_gguf, "_GEMM_SLICE_ELEMS", 64 * 96)  # 64 rows a slice: 70 rows take two
    w, ref = _weight(T.Q8_0, 70, 96, seed=5)
    x = torch.randn(20, 96)
    want = x.double() @ ref.double().t()
    got = cpu_gguf.linear(x, w)
    assert got.shape == (20, 70) and ((got.double() - want).abs() <= 1e-5 * (x.abs() @ ref.abs().t()).double()).all()


@needs_cc
def test_linear_keeps_leading_dims_and_threads_agree():
    w, ref = _weight(T.Q5_0, 70, 96, seed=3)
    x = torch.randn(2, 3, 96)
    y = cpu_gguf.linear(x, w)
    assert y.shape == (2, 3, 70)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = cpu_gguf.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y, y1)  # rows are split over threads, each row's sum is one thread's: no change


def test_bad_weights_and_inputs_get_value_errors():
    raw = _raw(T.Q8_0, 4, 64, seed=0)
    with pytest.raises(ValueError, match="no CPU kernel"):
        cpu_gguf.CPUBlocks(raw, int(T.Q5_1), (4, 64))
    with pytest.raises(ValueError, match="not a multiple"):
        cpu_gguf.CPUBlocks(raw, int(T.Q8_0), (4, 48))
    with pytest.raises(ValueError, match="blocks must be"):
        cpu_gguf.CPUBlocks(raw[:3], int(T.Q8_0), (4, 64))
    w = cpu_gguf.CPUBlocks(raw, int(T.Q8_0), (4, 64))
    with pytest.raises(ValueError, match="features"):
        cpu_gguf.linear(torch.randn(2, 32), w)


def _parts(types: list[T], k: int, rows: int = 40) -> list[tuple[torch.Tensor, int, tuple[int, int]]]:
    return [(_raw(t, rows, k, seed=i).reshape(-1), int(t), (rows, k)) for i, t in enumerate(types)]


@needs_cc
def test_cpu_loader_runs_the_kernel_types_as_blocks_and_the_rest_as_before():
    from collections import Counter

    if not cpu_gguf.fast():
        pytest.skip("neither AVX-512 nor AVX2 here: the loader keeps the int4 path (test_unavailable_kernel_keeps_the_int4_path)")

    k = 256
    types = [T.Q5_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q4_0, T.Q2_K]
    parts = _parts(types, k)
    held: Counter = Counter()
    segs = quantized._cpu_segments(parts, held)
    # runs of one kernel type share one segment; Q4_K keeps its int4 plane (faster than the kernel's loop),
    # Q2_K (no kernel) its bf16 matrix
    assert [type(s).__name__ for s in segs] == ["GGUFSegment", "GGUFSegment", "Int4Planes", "GGUFSegment",
                                               "GGUFSegment", "DenseSegment"]
    assert [s.weight.qtype for s in segs if isinstance(s, GGUFSegment)] == [T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_0]
    assert held["Q5_0: GGUF blocks (CPU kernel)"] == 2 and sum(held.values()) == len(types)
    ref = torch.cat([dequantize(raw, t, shape) for raw, t, shape in parts])
    x = torch.randn(3, k)
    want = x.double() @ ref.double().t()
    pure = QuantLinear(quantized._cpu_segments(parts[:3], Counter()), None, torch.float32)
    got = pure(x[:, :])
    assert ((got.double() - want[:, :120]).abs() <= 1e-5 * (x.abs() @ ref[:120].abs().t()).double()).all()
    mixed = QuantLinear(segs, None, torch.bfloat16)  # as _linear builds a module with int4 / bf16 segments
    bound = 4 * 2.0**-8 * (x.abs() @ ref.abs().t()).double()
    assert mixed(x).dtype == torch.float32 and ((mixed(x).double() - want).abs() <= bound).all()


def test_unavailable_kernel_keeps_the_int4_path(monkeypatch):
    from collections import Counter

    monkeypatch.setattr(cpu_gguf, "fast", lambda: False)
    segs = quantized._cpu_segments(_parts([T.Q5_0, T.Q8_0], 64), Counter())
    assert [type(s) for s in segs] == [Int4Planes]  # one run of packable types, as cpu_pack packs it


@needs_cc
def test_the_kernels_use_the_widest_vectors_this_cpu_has():
    """-march=native: AVX-512 where /proc/cpuinfo lists avx512f, else AVX2 + FMA where it lists both."""
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    if not info.exists() or not cpu_gguf.available():
        pytest.skip("no /proc/cpuinfo (not Linux) or no kernel")
    flags = set(next(ln for ln in info.read_text().splitlines() if ln.startswith("flags")).split())
    want = 512 if "avx512f" in flags else 256 if {"avx2", "fma"} <= flags else 0
    assert cpu_gguf.simd_bits() == want
    assert cpu_gguf.fast() == (want > 0)
