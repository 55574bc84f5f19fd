"""Vectorized torch dequantization of ggml tensor types (runs on whatever device the bytes are on).

Each kernel takes a [n, type_size] uint8 block view and returns integer quants ``q`` (bytes, shaped
[n, groups, group_size]) with per-group float32 ``scale`` and optional ``bias``; the value is
``scale * q + bias``. Bit fields are unpacked four bytes at a time on int32 words (SWAR), and the
arithmetic follows ggml's reference so results are bit-exact with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
_F32 = torch.float32
_REP = 0x01010101  # a byte value repeated in every byte of an int32 word
_CHUNK_BLOCKS = 1 << 16  # blocks per step: bounds the temporaries
Quants = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 little-endian half floats -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).to(_F32)


def _words(b: torch.Tensor) -> torch.Tensor:
    """[n, 4k] bytes -> [n, k] int32 words (little-endian)."""
    b = b.contiguous()
    if b.storage_offset() % 4 or any(st % 4 for st in b.stride()[:-1]):  # a one-row slice is "contiguous"
        b = b.clone(memory_format=torch.contiguous_format)  # with its parent's offset and strides
    return b.view(torch.int32)


def _fields(w: torch.Tensor, nbits: int, count: int) -> torch.Tensor:
    """[..., W] words -> [..., count, W]: field k = bits [k*nbits, (k+1)*nbits) of every byte."""
    sh = torch.arange(0, nbits * count, nbits, dtype=torch.int32, device=w.device)
    return (w.unsqueeze(-2) >> sh.unsqueeze(-1)) & (((1 << nbits) - 1) * _REP)


def _signed(w: torch.Tensor, nbits: int) -> torch.Tensor:
    """Bytes holding v in [0, 2**nbits) -> int8 bytes v - 2**(nbits-1), computed on int32 words."""
    half = 1 << (nbits - 1)
    return (w & ((half - 1) * _REP)) | ((~w & (half * _REP)) * (256 // half - 1))


def _as_bytes(w: torch.Tensor, n: int, groups: int, signed: bool) -> torch.Tensor:
    return w.contiguous().view(torch.int8 if signed else torch.uint8).reshape(n, groups, -1)


def _q8_0(b: torch.Tensor) -> Quants:
    return b[:, 2:].contiguous().view(torch.int8).unsqueeze(1), _f16(b[:, :2]).unsqueeze(1), None


def _q4_0(b: torch.Tensor) -> Quants:
    q = _signed(_fields(_words(b[:, 2:]), 4, 2), 4)
    return _as_bytes(q, b.shape[0], 1, True), _f16(b[:, :2]).unsqueeze(1), None


def _q4_1(b: torch.Tensor) -> Quants:
    q = _fields(_words(b[:, 4:]), 4, 2)
    return _as_bytes(q, b.shape[0], 1, False), _f16(b[:, :2]).unsqueeze(1), _f16(b[:, 2:4]).unsqueeze(1)


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a 32-bit mask -> [n, 8] words whose byte j of word k is bit 4k+j, times 16."""
    x = _words(qh)
    nib = (x >> torch.arange(0, 32, 4, dtype=torch.int32, device=x.device)) & 0xF
    return ((nib * 0x00204081) & _REP) << 4  # spreads a nibble's 4 bits over 4 bytes


def _q5_0(b: torch.Tensor) -> Quants:
    lo = _fields(_words(b[:, 6:]), 4, 2).reshape(b.shape[0], 8)
    q = _signed(lo | _q5_high(b[:, 2:6]), 5)
    return _as_bytes(q, b.shape[0], 1, True), _f16(b[:, :2]).unsqueeze(1), None


def _q5_1(b: torch.Tensor) -> Quants:
    lo = _fields(_words(b[:, 8:]), 4, 2).reshape(b.shape[0], 8)
    q = lo | _q5_high(b[:, 4:8])
    return _as_bytes(q, b.shape[0], 1, False), _f16(b[:, :2]).unsqueeze(1), _f16(b[:, 2:4]).unsqueeze(1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins -> two [n, 8] float32."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.to(_F32), mn.to(_F32)


def _k_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, mn = _k_scales(b[:, 4:16])
    return (_f16(b[:, 0:2]) * sc).unsqueeze(2), (-(_f16(b[:, 2:4]) * mn)).unsqueeze(2)


def _q4_k(b: torch.Tensor) -> Quants:
    n = b.shape[0]
    q = _fields(_words(b[:, 16:]).reshape(n, 4, 8), 4, 2)  # [n, 4 chunks, lo/hi, 8 words]
    return (_as_bytes(q, n, 8, False), *_k_affine(b))


def _q5_k(b: torch.Tensor) -> Quants:
    n = b.shape[0]
    lo = _fields(_words(b[:, 48:]).reshape(n, 4, 8), 4, 2).reshape(n, 8, 8)
    hi = _fields(_words(b[:, 16:48]), 1, 8) << 4  # [n, 8 sub-blocks, 8 words]
    return (_as_bytes(lo | hi, n, 8, False), *_k_affine(b))


def _q6_k(b: torch.Tensor) -> Quants:
    n = b.shape[0]
    lo = _fields(_words(b[:, :128]).reshape(n, 2, 16), 4, 2).reshape(n, 8, 8)
    hi = _fields(_words(b[:, 128:192]).reshape(n, 2, 8), 2, 4).reshape(n, 8, 8) << 4
    q = _as_bytes(_signed(lo | hi, 6), n, 16, True)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(_F32)
    return q, (_f16(b[:, 208:210]) * scales).unsqueeze(2), None


def _q2_k(b: torch.Tensor) -> Quants:
    n = b.shape[0]
    s = b[:, :16]
    q = _fields(_words(b[:, 16:80]).reshape(n, 2, 8), 2, 4)
    scale = (_f16(b[:, 80:82]) * (s & 0x0F).to(_F32)).unsqueeze(2)
    bias = (-(_f16(b[:, 82:84]) * (s >> 4).to(_F32))).unsqueeze(2)
    return _as_bytes(q, n, 16, False), scale, bias


def _q3_k(b: torch.Tensor) -> Quants:
    n = b.shape[0]
    lo = _fields(_words(b[:, 32:96]).reshape(n, 2, 8), 2, 4).reshape(n, 8, 8)
    hi = _fields(_words(b[:, :32]), 1, 8) << 2  # hmask bit set means no -4 offset
    q = _as_bytes(_signed(lo | hi, 3), n, 16, True)
    s = b[:, 96:108]
    lo_s = torch.cat([s[:, :8] & 0x0F, s[:, :8] >> 4], dim=1)
    hi_s = torch.cat([(s[:, 8:12] >> k) & 3 for k in (0, 2, 4, 6)], dim=1)
    sc = (lo_s | (hi_s << 4)).to(_F32) - 32
    return q, (_f16(b[:, 108:110]) * sc).unsqueeze(2), None


_KERNELS: dict[int, Callable[[torch.Tensor], Quants]] = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
_FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
SUPPORTED_TYPES: frozenset[int] = frozenset(int(t) for t in (*_KERNELS, *_FLOATS))


def type_name(ggml_type: int) -> str:
    """Readable name of a ggml type id (``Q4_K``), or ``type <id>`` for unknown ids."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


# Integer range of each type's quants as its kernel returns them (value = scale * q + bias).
QUANT_RANGES: dict[int, tuple[int, int]] = {
    T.Q8_0: (-128, 127), T.Q4_0: (-8, 7), T.Q4_1: (0, 15), T.Q5_0: (-16, 15), T.Q5_1: (0, 31),
    T.Q2_K: (0, 3), T.Q3_K: (-4, 3), T.Q4_K: (0, 15), T.Q5_K: (0, 31), T.Q6_K: (-32, 31),
}
# Elements per (scale, bias) group of each type.
QUANT_GROUPS: dict[int, int] = {t: 16 if t in (T.Q2_K, T.Q3_K, T.Q6_K) else 32 for t in QUANT_RANGES}


def _check_bytes(raw: torch.Tensor, ggml_type: int, shape: Sequence[int]) -> tuple[tuple[int, ...], int, int, int]:
    """(shape, n_blocks, block, type_size), or ValueError for an unsupported type or a bad byte count."""
    if ggml_type not in SUPPORTED_TYPES:
        names = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
        raise ValueError(f"cannot dequantize ggml {type_name(ggml_type)}; supported: {names}")
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    if (shape and shape[-1] % block) or numel % block:
        raise ValueError(f"shape {shape} does not split into {type_name(ggml_type)} blocks of {block}")
    n_blocks = numel // block
    if raw.dtype != torch.uint8 or raw.numel() != n_blocks * type_size:
        raise ValueError(
            f"{type_name(ggml_type)} tensor of shape {shape} needs {n_blocks * type_size} uint8 bytes, "
            f"got {raw.numel()} of {raw.dtype}"
        )
    return shape, n_blocks, block, type_size


def quants(raw: torch.Tensor, ggml_type: int, shape: Sequence[int]) -> Quants:
    """A quantized 2-D tensor's integer quants and group affine terms, as stored (no rounding).

    Returns (q [N, K] int8 or uint8, scale [N, K // g] float32, bias [N, K // g] float32 or None),
    g the type's group size (32 or 16); dequantize's value is exactly ``scale * q + bias`` per group
    (float32, bias added after the product). ValueError for float types and bad byte counts."""
    if ggml_type not in _KERNELS:
        raise ValueError(f"ggml {type_name(ggml_type)} has no integer quants (supported: "
                         f"{', '.join(sorted(type_name(t) for t in _KERNELS))})")
    shape, n_blocks, _, type_size = _check_bytes(raw, ggml_type, shape)
    if len(shape) != 2:
        raise ValueError(f"quants needs a 2-D tensor, got shape {shape}")
    q, scale, bias = _KERNELS[ggml_type](raw.reshape(n_blocks, type_size))
    n = shape[0]
    return q.reshape(n, shape[1]), scale.reshape(n, -1), None if bias is None else bias.reshape(n, -1)


def dequantize(
    raw: torch.Tensor,
    ggml_type: int,
    shape: Sequence[int],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize ggml bytes into a ``shape`` tensor (torch order; blocks run along the last dim).

    The bytes are moved to ``device`` (default: where ``raw`` is) first and decoded there in
    float32, chunk by chunk, then cast to ``dtype``. Raises ValueError for unsupported types or a
    byte count that does not match ``shape``.
    """
    shape, n_blocks, block, type_size = _check_bytes(raw, ggml_type, shape)
    device = torch.device(device) if device is not None else raw.device
    raw = raw.to(device).reshape(-1)
    if ggml_type in _FLOATS:
        return raw.contiguous().view(_FLOATS[ggml_type]).to(_F32).to(dtype).reshape(shape)
    blocks = raw.reshape(n_blocks, type_size)
    out = torch.empty(n_blocks, block, dtype=dtype, device=device)
    kernel = _KERNELS[ggml_type]
    tmp = None if dtype == _F32 else torch.empty(min(n_blocks, _CHUNK_BLOCKS), block, dtype=_F32, device=device)
    for start in range(0, n_blocks, _CHUNK_BLOCKS):
        q, scale, bias = kernel(blocks[start : start + _CHUNK_BLOCKS])
        dst = out[start : start + q.shape[0]] if tmp is None else tmp[: q.shape[0]]
        dst = dst.view(q.shape)
        if bias is None:  # integer quants promote to float32 exactly
            torch.mul(q, scale, out=dst)
        else:  # scale * q is exact for these types, so this rounds once, like ggml's reference
            torch.addcmul(bias, scale, q, out=dst)
        if tmp is not None:
            out[start : start + q.shape[0]] = dst.reshape(q.shape[0], block)
    return out.reshape(shape)
