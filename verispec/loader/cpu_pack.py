"""Pack GGUF tensors for the CPU quantized path (models/layers/quant.py): int4 planes for torch's CPU int4
matmul where the GGUF groups are 32 wide, bf16 matrices for the rest, quantized embedding rows.

A type whose quants q span at most 16 values (Q4_K, Q4_0, Q4_1) is one plane, u = q - lo; a wider one
(Q5_0, Q5_1, Q5_K, Q8_0) is two: q = 16 h + l with l = q mod 16 and h = floor(q / 16) in [-8, 7], so
w = scale * q + bias = [(l - 8) scale + (8 scale + bias)] + [(h + 8 - 8) * 16 scale], both in torch's
(u - 8) * scale + zero convention. The planes' integers are exact; the kernel rounds scales, zeros and
activations to bf16, hence "bf16-level" agreement with the float32 dequantized path.
"""

from __future__ import annotations

import functools
import logging

import torch
from gguf.constants import GGMLQuantizationType

from verispec.loader.dequant import QUANT_GROUPS, QUANT_RANGES, T, dequantize, quants, type_name
from verispec.models.layers.quant import INT4_GROUP, INT4_ROWS, DenseSegment, Int4Planes, QuantEmbedding

log = logging.getLogger("verispec")

COMPUTE_DTYPE = torch.bfloat16  # the CPU int4 kernel is fast in bf16 only (float32 runs ~15x slower)
Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # u uint8 [N, K] in [0, 15], scale, zero [N, K/32]


def packable(ggml_type: int) -> bool:
    """True for the quantized types int4 planes hold exactly (groups of 32, at most 8 bits)."""
    return QUANT_GROUPS.get(ggml_type) == INT4_GROUP


def num_planes(ggml_type: int) -> int:
    lo, hi = QUANT_RANGES[ggml_type]
    return 1 if hi - lo < 16 else 2


def planes_of(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, ggml_type: int,
              planes: int | None = None) -> list[Plane]:
    """The int4 planes (u, scale, zero) of one tensor's quants (dequant.quants: int8 / uint8 q); `planes`
    pads to that many with zero planes (u = 8, scale = zero = 0). Scales and zeros stay float32 here."""
    lo, _ = QUANT_RANGES[ggml_type]
    b = torch.zeros_like(scale) if bias is None else bias
    zero = torch.zeros_like(scale)
    if num_planes(ggml_type) == 1:
        out = [((q - lo).to(torch.uint8), scale, scale * (lo + 8) + b)]
    else:  # byte ops: & 15 is q mod 16, >> 4 (arithmetic on int8) is floor(q / 16)
        out = [((q & 15).to(torch.uint8), scale, scale * 8 + b), (((q >> 4) + 8).to(torch.uint8), scale * 16, zero)]
    while planes is not None and len(out) < planes:
        out.append((torch.full_like(q, 8, dtype=torch.uint8), zero, zero))
    return out


def raw_planes(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int], planes: int | None = None) -> list[Plane]:
    """planes_of(*quants(raw, ...)), read straight from the blocks with byte ops for Q5_0 and Q8_0 (most
    of the registry files' bytes; the same planes, ~3x faster to load); other types go through quants."""
    n, k = shape
    if ggml_type not in (T.Q5_0, T.Q8_0) or (planes or 2) != 2:
        q, sc, b = quants(raw, ggml_type, shape)
        return planes_of(q, sc, b, ggml_type, planes)
    blocks = raw.reshape(n * k // 32, -1)
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32).view(n, k // 32)
    nib = 0x0F0F0F0F  # on int32 words: four bytes per op
    if ggml_type == T.Q8_0:  # int8 bytes b: b & 15 is q mod 16, (b >> 4) ^ 8 is floor(q / 16) + 8
        w = blocks[:, 2:].contiguous().view(torch.int32)
        lo, hi = w & nib, ((w >> 4) & nib) ^ 0x08080808
    else:  # Q5_0: q = (nibble | high bit << 4) - 16, so q mod 16 = nibble, floor(q / 16) + 8 = high bit + 7
        w = blocks[:, 6:].contiguous().view(torch.int32)
        lo = torch.cat([w & nib, (w >> 4) & nib], dim=1)
        qh = blocks[:, 2:6].contiguous().view(torch.int32)
        nibs = (qh >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF  # [n, 8]: 4 high bits each
        hi = ((nibs * 0x00204081) & 0x01010101) + 0x07070707  # spreads a nibble's bits over 4 bytes
    as_u8 = lambda t: t.contiguous().view(torch.uint8).reshape(n, k)  # noqa: E731
    return [(as_u8(lo), d, d * 8), (as_u8(hi), d * 16, torch.zeros_like(d))]


def pack_planes(parts: list[list[Plane]], dtype: torch.dtype = COMPUTE_DTYPE) -> Int4Planes:
    """One Int4Planes from the planes of tensors stacked along N (all with the same plane count and K).
    dtype: of the scales and zeros, and so of the activations the kernel takes (float32: exact, slow)."""
    counts = {len(p) for p in parts}
    ks = {pl[0].shape[1] for p in parts for pl in p}
    if len(counts) != 1 or len(ks) != 1:
        raise ValueError(f"pack_planes: parts differ in plane count {sorted(counts)} or K {sorted(ks)}")
    planes, k = counts.pop(), ks.pop()
    n = sum(p[0][0].shape[0] for p in parts)
    n_pad = n + (-n % INT4_ROWS)
    g = k // INT4_GROUP
    u = torch.empty(n_pad, planes * k, dtype=torch.uint8)
    u[n:] = 8  # padding rows: u = 8, scale = zero = 0
    s = torch.zeros(n_pad, planes * g)
    z = torch.zeros(n_pad, planes * g)
    row = 0
    for part in parts:
        rows = part[0][0].shape[0]
        for i, (pu, ps, pz) in enumerate(part):
            u[row : row + rows, i * k : (i + 1) * k] = pu
            s[row : row + rows, i * g : (i + 1) * g] = ps
            z[row : row + rows, i * g : (i + 1) * g] = pz
        row += rows
    packed = pack_u4(u)
    sz = torch.stack([s.t(), z.t()], dim=-1).to(dtype).contiguous()
    return Int4Planes(packed, sz, planes, (n, k))


def _block_rows() -> int:
    """Rows a block of torch's CPU int4 layout holds on this CPU (its kernels are built per instruction set):
    64 under AVX-512 (byte j of a block's column pairs rows j and j + 32), 32 under AVX2 (rows j and j + 16);
    0 where the layout is another one (non-x86 builds), which pack_u4 leaves to torch's op."""
    return {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability(), 0)


def pack_u4(u: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 15] (N a multiple of 16) -> torch's CPU int4 layout [N, K / 2].

    Full blocks of B rows (_block_rows) are laid out here with byte ops: block b, column k, byte d holds
    row B b + d in its low nibble and row B b + B / 2 + d in its high one (what
    _convert_weight_to_int4pack_for_cpu writes, ~10x faster; tests/test_cpu_pack.py compares the two and
    cpu_int4_available() checks the result against the float reference at start-up). The last N % B rows,
    and every row where the layout is not one of those, go through torch's op."""
    n, k = u.shape
    rows = _block_rows()
    full = n - n % rows if rows else 0
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    if full:
        blocks = u[:full].view(full // rows, 2, rows // 2, k)
        both = blocks[:, 1] << 4
        torch.bitwise_or(both, blocks[:, 0], out=both)  # contiguous first: a transposed copy is 2x faster than
        packed[:full].view(full // rows, k, rows // 2).copy_(both.transpose(1, 2))  # a transposed OR
    if full < n:
        packed[full:] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u[full:].to(torch.int32), 1)
    return packed


def unpack_reference(w: Int4Planes) -> torch.Tensor:
    """The float32 weight an Int4Planes stands for, through the kernel itself in float32 (exact there):
    x = identity. For tests and checks, not for the hot path."""
    n, k = w.shape
    eye = torch.eye(k, dtype=torch.float32)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(eye.repeat(1, w.planes), w.packed, INT4_GROUP,
                                                   w.scales_zeros.float())
    return y[:, :n].t().contiguous()


def pack_tensors(tensors: list[tuple[torch.Tensor, int, tuple[int, int]]]) -> list[Int4Planes | DenseSegment]:
    """Segments for tensors stacked along N: runs of packable ones -> one Int4Planes each (plane count:
    the run's largest), others -> a bf16 DenseSegment. tensors: (raw bytes, ggml type, (N, K))."""
    segs: list[Int4Planes | DenseSegment] = []
    run: list[tuple[torch.Tensor, int, tuple[int, int]]] = []

    def flush() -> None:
        if run:
            planes = max(num_planes(t) for _, t, _ in run)
            segs.append(pack_planes([raw_planes(raw, t, shape, planes) for raw, t, shape in run]))
            run.clear()

    for raw, t, shape in tensors:
        if packable(t):
            run.append((raw, t, shape))
        else:
            flush()
            segs.append(DenseSegment(dequantize(raw, t, shape, dtype=COMPUTE_DTYPE).contiguous()))
    flush()
    return segs


def quant_embedding(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int], dtype: torch.dtype) -> QuantEmbedding | None:
    """Embedding rows as integer quants (None for float types: those stay a dense nn.Embedding)."""
    if ggml_type not in QUANT_RANGES:
        return None
    q, s, b = quants(raw, ggml_type, shape)
    return QuantEmbedding(q.contiguous(), s.contiguous(), None if b is None else b.contiguous(), dtype)


@functools.cache
def cpu_int4_available() -> bool:
    """Whether this torch runs the CPU int4 matmul correctly (checked once on a small random weight
    against the float32 reference)."""
    op = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    if op is None or not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        log.info("this torch has no CPU int4 matmul: the quantized CPU path is off")
        return False
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(-16, 16, (80, 64), generator=g, dtype=torch.int8)  # 64 rows: pack_u4's layout
        scale = torch.rand(80, 2, generator=g) / 16
        w = pack_planes([planes_of(q, scale, None, GGMLQuantizationType.Q5_0)])  # two planes
        x = torch.randn(3, 64, generator=g)
        ref = x @ (q.float() * scale.repeat_interleave(32, dim=1)).t()
        y = w(x.to(COMPUTE_DTYPE)).float()
        ok = bool(torch.allclose(y, ref, rtol=0.03, atol=0.03 * ref.abs().max().item()))
    except (RuntimeError, NotImplementedError) as e:
        log.info("the CPU int4 matmul failed its check (%s): the quantized CPU path is off", e)
        return False
    if not ok:
        log.info("the CPU int4 matmul gave wrong results on its check: the quantized CPU path is off")
    return ok


def describe(ggml_type: int) -> str:
    """How the CPU path holds a tensor of this type (for log lines)."""
    if packable(ggml_type):
        return f"{type_name(ggml_type)}: {num_planes(ggml_type)} int4 plane(s)"
    return f"{type_name(ggml_type)}: bf16"
