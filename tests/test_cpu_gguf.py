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


INT8_TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
needs_int8 = pytest.mark.skipif(not cpu_gguf.int8_available(), reason="no C compiler or no AVX2: no integer-dot GEMV")


def _x_rounded_to_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as its int8 rounding gives it back, the rounding's scale per element): per 32 elements d = max |x| /
    127 and q = round-half-even(x * (1 / d)) in float32, as llama.cpp quantizes activations to Q8_0."""
    xb = x.reshape(-1, 32)
    d = xb.abs().amax(dim=1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv).clamp(-127, 127)
    return (q.double() * d.double()).reshape(x.shape), d.expand_as(xb).reshape(x.shape)


def _assert_int8_dot(x: torch.Tensor, w: cpu_gguf.CPUBlocks, ref: torch.Tensor) -> None:
    """linear(int8=True) is the float64 dot with x rounded to int8 up to float32 scale products and sums, within
    the rounding's own bound of the exact float32 GEMV, and not identical to it."""
    xr, d = _x_rounded_to_int8(x)
    want = xr @ ref.double().t()
    got = cpu_gguf.linear(x, w, int8=True)
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == torch.float32
    bound = 1e-5 * (xr.abs() @ ref.double().abs().t()) + 1e-30  # float32 scale products and sums only
    assert ((got.double() - want).abs() <= bound).all()
    # against the exact float32 path: |x - its rounding| <= d / 2 per element, and not identical to it
    exact = cpu_gguf.linear(x, w).double()
    assert ((got.double() - exact).abs() <= (d.double() / 2) @ ref.double().abs().t() + 2 * bound).all()
    assert not torch.equal(got, cpu_gguf.linear(x, w))


@needs_int8
@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("nblocks", [1, 2, 7, 28])  # the 2-block unrolled loop, its tail, the 0.5B's K = 896
@pytest.mark.parametrize("n", [1, 17, 45])
def test_int8_gemv_is_the_dot_with_x_rounded_to_8_bits(qtype, nblocks, n):
    k = GGML_QUANT_SIZES[qtype][0] * nblocks
    w, ref = _weight(qtype, n, k, seed=n * 31 + nblocks + int(qtype))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(nblocks)) * torch.rand(1, k) * 3
    _assert_int8_dot(x, w, ref)


@needs_int8
@pytest.mark.parametrize("flags", [(), ("-mno-avx512dq",), ("-mno-avx512vnni",), ("-mno-avx512f",)],
                         ids=["native", "no-avx512dq", "no-vnni", "no-avx512"])
def test_every_int8_route_is_the_dot_with_x_rounded_to_8_bits(flags):
    """The library built narrower than this CPU (the flags after -march=native) takes the narrower route of the
    integer dot (VNNI on 16 or 8 lanes, AVX2 maddubs: int8_route), and each is the same dot with x rounded to
    int8 on every type, both block loops and their tails. On a CPU without AVX-512 the flags change nothing: the
    AVX2 route is tested four times."""
    lib = cpu_gguf.variant(flags)
    assert lib is not None and lib.vs_int8() == 1
    route = cpu_gguf.int8_route(lib)
    if not flags:
        assert route == cpu_gguf.int8_route()
    if flags == ("-mno-avx512vnni",) or flags == ("-mno-avx512f",):
        assert route == 1
    for qtype in INT8_TYPES:
        for nblocks, m in ((7, 1), (28, 1), (3, 2 if qtype == T.Q4_K else 1)):
            k = GGML_QUANT_SIZES[qtype][0] * nblocks
            w, ref = _weight(qtype, 45, k, seed=nblocks + int(qtype))
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(nblocks)) * 2
            xr, _ = _x_rounded_to_int8(x)
            got = cpu_gguf.gemv_int8(lib, x, w).double()
            bound = 1e-5 * (xr.abs() @ ref.double().abs().t()) + 1e-30
            assert ((got - xr @ ref.double().t()).abs() <= bound).all(), (qtype.name, nblocks, m, route)


@needs_int8
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [2, 5, 16])
def test_int8_gemv_takes_every_row_count_and_a_row_does_not_depend_on_it(qtype, m):
    """Every type's integer dot runs up to MAX_ROWS rows: each row the dot with that row rounded to int8, and the
    same bits as the row alone (a verify row and a decode row of the same x agree exactly: spec == plain)."""
    k = 19 * 256  # the 0.5B's ffn_down K = 4864: 19 super-blocks, 152 blocks of 32
    w, ref = _weight(qtype, 37, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2
    _assert_int8_dot(x, w, ref)
    got = cpu_gguf.linear(x, w, int8=True)
    for i in (0, m - 1):
        assert torch.equal(got[i], cpu_gguf.linear(x[i : i + 1], w, int8=True)[0]), (qtype.name, i)
    with pytest.raises(ValueError, match="features"):
        cpu_gguf.linear(x[:, :256], w, int8=True)


@needs_int8
def test_int8_gemv_is_exact_for_zero_blocks_and_takes_prompt_chunks():
    w, ref = _weight(T.Q8_0, 33, 96, seed=9)
    # 17 rows and more (a prompt chunk) take the integer dot too, MAX_ROWS at a time, each row its own bits
    for m in (cpu_gguf.MAX_ROWS + 1, 3 * cpu_gguf.MAX_ROWS + 5):
        xm = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
        got = cpu_gguf.linear(xm, w, int8=True)
        _assert_int8_dot(xm, w, ref)
        assert all(torch.equal(got[i], cpu_gguf.linear(xm[i : i + 1], w, int8=True)[0]) for i in range(m))
    x1 = torch.zeros(1, 96)
    x1[0, 40] = 2.0  # block 0 and 2 all zero (d = 0), block 1 one value: rounding is exact
    assert torch.allclose(cpu_gguf.linear(x1, w, int8=True)[0], 2.0 * ref[:, 40], rtol=1e-6, atol=0)
    for qtype in (T.Q4_K, T.Q6_K):  # one value in sub-block 3 of a 256-element block: the min and scale terms
        wk, rk = _weight(qtype, 21, 512, seed=4)
        xk = torch.zeros(1, 512)
        xk[0, 300] = -1.5
        assert torch.allclose(cpu_gguf.linear(xk, wk, int8=True)[0], -1.5 * rk[:, 300], rtol=1e-6, atol=1e-9), qtype


@needs_int8
def test_loader_takes_the_int8_gemv_unless_turned_off(monkeypatch):
    from collections import Counter

    parts = _parts([T.Q5_0, T.Q6_K, T.Q4_K], 256)
    x = torch.randn(1, 256)
    held_on: Counter = Counter()
    on_segs = quantized._cpu_segments(parts, held_on)
    on = QuantLinear(on_segs, None, torch.float32)
    monkeypatch.setenv("VERISPEC_CPU_GGUF_INT8", "0")
    held: Counter = Counter()
    off_segs = quantized._cpu_segments(parts, held)
    off = QuantLinear(off_segs[:2], None, torch.float32)  # the block segments (the loader's float32 module)
    # on: Q4_K runs as blocks through the integer dot; off: it keeps its int4 plane
    assert [type(s).__name__ for s in on_segs] == ["GGUFSegment"] * 3
    assert [type(s).__name__ for s in off_segs] == ["GGUFSegment", "GGUFSegment", "Int4Planes"]
    assert held_on["Q4_K: GGUF blocks (CPU kernel, int8 x)"] == 1
    assert held_on["Q6_K: GGUF blocks (CPU kernel, int8 x)"] == 1
    assert held["Q5_0: GGUF blocks (CPU kernel)"] == 1 and held["Q6_K: GGUF blocks (CPU kernel)"] == 1
    for i, t in enumerate((T.Q5_0, T.Q6_K)):
        w = cpu_gguf.CPUBlocks(parts[i][0].reshape(40, -1), int(t), (40, 256))
        cols = slice(40 * i, 40 * (i + 1))
        assert torch.equal(on(x)[0, cols], cpu_gguf.linear(x, w, int8=True)[0]), t
        assert torch.equal(off(x)[0, cols], cpu_gguf.linear(x, w)[0]), t
    w4 = cpu_gguf.CPUBlocks(parts[2][0].reshape(40, -1), int(T.Q4_K), (40, 256))
    x4 = torch.randn(5, 256)
    assert torch.equal(on(x4)[:, 80:], cpu_gguf.linear(x4, w4, int8=True))


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
def test_cpu_loader_runs_the_kernel_types_as_blocks_and_the_rest_as_before(monkeypatch):
    from collections import Counter

    if not cpu_gguf.fast():
        pytest.skip("neither AVX-512 nor AVX2 here: the loader keeps the int4 path (test_unavailable_kernel_keeps_the_int4_path)")

    monkeypatch.setenv("VERISPEC_CPU_GGUF_INT8", "0")  # the float GEMVs (the int8 ones: the test above)
    k = 256
    types = [T.Q5_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q4_0, T.Q2_K]
    parts = _parts(types, k)
    held: Counter = Counter()
    segs = quantized._cpu_segments(parts, held)
    # runs of one kernel type share one segment; Q4_K keeps its int4 plane (faster than the float GEMV),
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


@needs_int8
def test_int8_gemv_on_the_real_05b_tensors(qwen05_path):
    """The real 0.5B's layers on the integer dot (layer 0's Q5_0 and Q8_0 weights, the Q8_0 LM head's first rows,
    a Q6_K and a Q4_K ffn_down) with activations the model makes (an embedding row through the first RMSNorm's
    weight; for ffn_down, layer 0's MLP product of it): the dot with x rounded to int8 up to float32 order, and
    within 1% of the exact float32 GEMV (relative norm)."""
    from verispec.loader.gguf import GGUFFile

    f = GGUFFile(qwen05_path)

    def rows_of(name: str, rows: int) -> tuple[torch.Tensor, int, tuple[int, int]]:
        info = f.tensor(name)
        raw = f.raw(name).reshape(info.shape[0], -1)[:rows].contiguous()
        return raw, info.ggml_type, (rows, info.shape[1])

    raw, t, shape = rows_of("token_embd.weight", 1001)
    e = dequantize(raw[1000:].reshape(-1), t, (1, shape[1]))
    norm = f.raw("blk.0.attn_norm.weight").view(torch.float32)
    x = e * torch.rsqrt(e.pow(2).mean() + 1e-6) * norm
    seen = set()
    for name, rows in (("blk.0.attn_q.weight", 896), ("blk.0.attn_v.weight", 128), ("blk.0.ffn_gate.weight", 4864),
                       ("output.weight", 4096)):
        raw, t, (n, k) = rows_of(name, rows)
        w = cpu_gguf.CPUBlocks(raw, t, (n, k))
        seen.add(T(t).name)
        ref = dequantize(raw.reshape(-1), t, (n, k)).double()
        xr, _ = _x_rounded_to_int8(x)
        got = cpu_gguf.linear(x, w, int8=True).double()
        assert ((got - xr @ ref.t()).abs() <= 1e-5 * (xr.abs() @ ref.abs().t()) + 1e-30).all(), name
        exact = cpu_gguf.linear(x, w).double()
        rel = float((got - exact).norm() / exact.norm())
        print(f"{name}: int8 vs float32 GEMV {rel:.4f}")
        assert 0 < rel < 0.01, (name, rel)
    assert seen == {"Q5_0", "Q8_0"}
    # ffn_down (K = 4864) on its input the model makes there, silu(gate x) * (up x): layer 0's Q6_K, and the
    # first layer whose ffn_down is Q4_K (its rows through the integer dot up to 16 rows: two rows here)
    gate = dequantize(f.raw("blk.0.ffn_gate.weight"), f.tensor("blk.0.ffn_gate.weight").ggml_type, (4864, 896))
    up = dequantize(f.raw("blk.0.ffn_up.weight"), f.tensor("blk.0.ffn_up.weight").ggml_type, (4864, 896))
    h = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
    h2 = torch.cat([h, h.flip(-1)])
    q4 = next(i for i in range(24) if f.tensor(f"blk.{i}.ffn_down.weight").ggml_type == T.Q4_K)
    for name, xs in (("blk.0.ffn_down.weight", h), (f"blk.{q4}.ffn_down.weight", h2)):
        raw, t, (n, k) = rows_of(name, 896)
        w = cpu_gguf.CPUBlocks(raw, t, (n, k))
        seen.add(T(t).name)
        ref = dequantize(raw.reshape(-1), t, (n, k)).double()
        xr, _ = _x_rounded_to_int8(xs)
        got = cpu_gguf.linear(xs, w, int8=True).double()
        assert ((got - xr @ ref.t()).abs() <= 1e-5 * (xr.abs() @ ref.abs().t()) + 1e-30).all(), name
        exact = (xs.double() @ ref.t())
        rel = float((got - exact).norm() / exact.norm())
        print(f"{name} ({T(t).name}): int8 vs float64 {rel:.4f}")
        assert 0 < rel < 0.01, (name, rel)
    assert seen == {"Q5_0", "Q8_0", "Q6_K", "Q4_K"}
