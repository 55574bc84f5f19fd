"""The CPU quantized path's packing (loader/cpu_pack.py) and layers (models/layers/quant.py), on random
GGUF blocks of every type, against loader/dequant.py (itself bit-exact with gguf's reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from test_dequant import _SCALE_OFFSETS, random_rows

from verispec.loader import cpu_pack
from verispec.loader.dequant import QUANT_RANGES, dequantize, quants
from verispec.models.layers.quant import DenseSegment, Int4Planes, QuantEmbedding, QuantLinear

T = GGMLQuantizationType
PACKED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K]
DENSE = [T.Q2_K, T.Q3_K, T.Q6_K]
BF16_EPS = 2.0**-8


def _raw(qtype: T, rows: int, k: int, seed: int, sane: bool = False) -> torch.Tensor:
    """Flat uint8 bytes of a random [rows, k] tensor; sane: scales in [2^-9, 2^-6] (for matmul checks)."""
    block = GGML_QUANT_SIZES[qtype][0]
    b = random_rows(qtype, rows, k // block, seed)
    if sane:
        rng = np.random.default_rng(seed + 1)
        size = GGML_QUANT_SIZES[qtype][1]
        blocks = b.reshape(-1, size)
        for off in _SCALE_OFFSETS[qtype]:
            blocks[:, off : off + 2] = np.exp2(rng.uniform(-9, -6, blocks.shape[0])).astype(np.float16).view(
                np.uint8).reshape(-1, 2)
    return torch.from_numpy(b.copy()).reshape(-1)


def _planes_value(planes) -> torch.Tensor:
    """sum_p (u_p - 8) * scale_p + zero_p in float64 (exact), per element."""
    out = 0
    for u, s, z in planes:
        g = u.shape[1] // s.shape[1]
        out = out + (u.double() - 8) * s.double().repeat_interleave(g, 1) + z.double().repeat_interleave(g, 1)
    return out


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_planes_are_exact(qtype: T):
    """The int4 planes hold the quants and scales exactly, and reproduce dequantize bit for bit for the
    symmetric types (within one float32 rounding of the zero for those with a bias); the byte-op fast
    path (Q5_0, Q8_0) gives the same planes as the generic one."""
    shape = (48, 512)
    raw = _raw(qtype, *shape, seed=int(qtype))
    want = dequantize(raw, qtype, shape)
    generic = cpu_pack.planes_of(*quants(raw, qtype, shape), qtype)
    fast = cpu_pack.raw_planes(raw, qtype, shape)
    assert len(generic) == cpu_pack.num_planes(qtype) == (1 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 2)
    q, scale, bias = quants(raw, qtype, shape)
    lo = QUANT_RANGES[qtype][0]
    for planes in (generic, fast):
        assert all(int(u.min()) >= 0 and int(u.max()) <= 15 and u.dtype == torch.uint8 for u, _, _ in planes)
        # the integers and scales exactly: q = u + lo (one plane) or l + 16 (h - 8) (two)
        u = [pl[0].to(torch.int32) for pl in planes]
        q_back = u[0] + lo if len(u) == 1 else u[0] + 16 * (u[1] - 8)
        assert torch.equal(q_back, q.to(torch.int32))
        assert torch.equal(planes[0][1], scale) and (len(planes) == 1 or torch.equal(planes[1][1], 16 * scale))
        got = _planes_value(planes).float()
        if bias is None:  # symmetric types: the value itself, bit for bit
            assert torch.equal(got, want), f"{qtype.name}: {(got != want).sum()} elements differ"
        else:  # zero = scale * (lo + 8) + bias holds one more float32 rounding
            mag = _planes_value([(v, sc.abs(), z.abs()) for v, sc, z in planes]).abs() + 8 * scale.abs().max()
            assert ((got.double() - want.double()).abs() <= 2.0**-23 * mag).all()
    for a, b in zip(fast, generic, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    padded = cpu_pack.planes_of(*quants(raw, qtype, shape), qtype, planes=2)
    assert len(padded) == 2 and torch.equal(_planes_value(padded), _planes_value(generic))


@pytest.mark.parametrize("n", [16, 48, 64, 80, 144, 208])
def test_pack_u4_matches_torch(n: int):
    g = torch.Generator().manual_seed(n)
    u = torch.randint(0, 16, (n, 96), generator=g, dtype=torch.uint8)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 1)
    assert torch.equal(cpu_pack.pack_u4(u), want)


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_packed_weight_through_the_kernel(qtype: T):
    """Packed with float32 scales, torch's int4 kernel reproduces the dequantized weight (x = identity): exactly
    for the symmetric types, within float32 rounding of the zero for the ones with a bias (Q4_1, Q5_1, K)."""
    shape = (80, 256)
    raw = _raw(qtype, *shape, seed=7 + int(qtype))
    want = dequantize(raw, qtype, shape)
    w = cpu_pack.pack_planes([cpu_pack.raw_planes(raw, qtype, shape)], dtype=torch.float32)
    got = cpu_pack.unpack_reference(w)
    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0):
        assert torch.equal(got, want)
    else:  # zero = 8 scale + bias is rounded to float32 once more: a few ulps of the terms' magnitude
        mag = _planes_value([(u, s.abs(), z.abs()) for u, s, z in cpu_pack.raw_planes(raw, qtype, shape)]).float()
        mag = mag + 8 * max(float(s.abs().max()) for _, s, _ in cpu_pack.raw_planes(raw, qtype, shape))
        assert ((got - want).abs() <= 4 * 2.0**-24 * mag.abs()).all()


def _bf16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A few bf16 roundings (activations, scales, zeros, output) relative to sum |x| |w|."""
    return 4 * BF16_EPS * (x.abs() @ w.abs().t()) + 1e-30


@pytest.mark.parametrize("qtype", PACKED + DENSE, ids=lambda t: t.name)
def test_quant_linear_bf16_level(qtype: T):
    shape = (48, 512)
    raw = _raw(qtype, *shape, seed=11 + int(qtype), sane=True)
    w = dequantize(raw, qtype, shape)
    segs = cpu_pack.pack_tensors([(raw, qtype, shape)])
    assert isinstance(segs[0], Int4Planes if qtype in PACKED else DenseSegment) and len(segs) == 1
    bias = torch.randn(shape[0])
    lin = QuantLinear(segs, bias, cpu_pack.COMPUTE_DTYPE)
    x = torch.randn(5, shape[1])
    got, want = lin(x), F.linear(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (5, shape[0])
    assert ((got - want).abs() <= _bf16_bound(x, w)).all()
    if qtype in DENSE:  # the bf16 matrix is dequantize's own, rounded once
        assert torch.equal(segs[0].weight, dequantize(raw, qtype, shape, dtype=torch.bfloat16))


def test_fused_projection_of_mixed_types():
    """q/k/v-like stacking: Q5_0 + Q4_K (one plane, padded to two) -> one Int4Planes, Q6_K -> bf16, then
    Q8_0 -> a second Int4Planes; rows stay in order, N = 16 + 32 + 16 + 8 is padded internally."""
    parts = [(T.Q5_0, 16), (T.Q4_K, 32), (T.Q6_K, 16), (T.Q8_0, 8)]
    k = 256
    tensors = [(_raw(t, n, k, seed=i, sane=True), t, (n, k)) for i, (t, n) in enumerate(parts)]
    segs = cpu_pack.pack_tensors(tensors)
    assert [type(s).__name__ for s in segs] == ["Int4Planes", "DenseSegment", "Int4Planes"]
    assert segs[0].planes == 2 and segs[0].shape == (48, k) and segs[2].shape == (8, k)
    lin = QuantLinear(segs, None, cpu_pack.COMPUTE_DTYPE)
    w = torch.cat([dequantize(raw, t, shape) for raw, t, shape in tensors])
    x = torch.randn(3, k)
    got, want = lin(x), x @ w.t()
    assert got.shape == (3, 72) and ((got - want).abs() <= _bf16_bound(x, w)).all()


@pytest.mark.parametrize("qtype", PACKED + DENSE, ids=lambda t: t.name)
def test_quant_embedding_rows_bit_exact(qtype: T):
    shape = (40, 512)
    raw = _raw(qtype, *shape, seed=3 + int(qtype))
    emb = cpu_pack.quant_embedding(raw, qtype, shape, torch.float32)
    ids = torch.tensor([[0, 39, 5], [5, 17, 2]])
    assert torch.equal(emb(ids), dequantize(raw, qtype, shape)[ids])
    assert cpu_pack.quant_embedding(torch.zeros(4 * 32 * 4, dtype=torch.uint8), int(T.F32), (4, 32), torch.float32) is None


def test_quant_ranges_match_the_kernels():
    """QUANT_RANGES (what the planes assume) holds for every type's quants on random blocks."""
    for qtype, (lo, hi) in QUANT_RANGES.items():
        q, _, _ = quants(_raw(T(qtype), 64, 256, seed=qtype), qtype, (64, 256))
        assert lo <= int(q.min()) and int(q.max()) <= hi and int(q.max()) - int(q.min()) == hi - lo, T(qtype).name


def test_bad_inputs_are_value_errors():
    seg = cpu_pack.pack_tensors([(_raw(T.Q8_0, 16, 64, seed=1), T.Q8_0, (16, 64))])[0]
    other = DenseSegment(torch.zeros(16, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="in_features"):
        QuantLinear([seg, other], None, torch.bfloat16)
    with pytest.raises(ValueError, match="bias"):
        QuantLinear([seg], torch.zeros(3), torch.bfloat16)
    with pytest.raises(ValueError, match="at least one"):
        QuantLinear([], None, torch.bfloat16)
    with pytest.raises(ValueError, match="do not match"):
        QuantEmbedding(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(5, 1), None, torch.float32)
    with pytest.raises(ValueError, match="integer quants"):
        quants(torch.zeros(64, dtype=torch.uint8), int(T.F32), (4, 4))


def test_int4_check_runs_here():
    """The start-up check passes on a torch that has the ops (this one), so GGUF files default to the path."""
    has = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    assert cpu_pack.cpu_int4_available() is has
