"""Linear layers on GGUF weights as stored: y = x @ dequant(W)^T (+ bias), dequantized inside the kernels.

GGUFWeight holds a weight's raw ggml blocks row by row ([N, K // block_elems * block_bytes] uint8, exactly
the file's bytes). Every kernel dequantizes a tile [BLOCK_N, BLOCK_K // G, G] of it in registers through
dequant_tile: G elements of a row share one scale (and bias), so the scale fields are loaded once per
group and broadcast, and the quants of a group are G consecutive bytes (nibbles, bit planes) of the block.
The arithmetic is loader/dequant.py's (ggml's reference): every product of a scale and a quant is exact in
float32, so the dequantized values are bit-identical (gguf_dequantize checks it; tests compare).
  * _gemv_kernel (1..GEMV_MAX_ROWS rows: decode, verify): each program streams BLOCK_N rows of W once,
    K in BLOCK_K tiles (the next tile's bytes requested before the current one is reduced), and every row
    of x reuses each dequantized tile; float32 FMA reductions, no tensor cores.
  * _mma_kernel (more rows: prefill, big batches): tiles dequantized in the load, cast to x's dtype, and
    tl.dot; K optionally split across programs (float32 partials summed by linear.py's reduce kernel).
  * _mma_sb_kernel (the same for Q4_K / Q6_K, the 1.5B's types): one 256-element super-block per K step,
    its quant bytes as contiguous tiles, its scales once per block, each nibble / bit plane dotted with the
    x columns it holds (x is read in the tile's element order: no shuffle of W); W is the MMA's left operand.
    The K split depends on the shape only, so a row's result never depends on the rows that came with it.
Epilogues: bias; silu_mul for a [gate; up] stacked weight (silu(gate) * up from the float32 sums); out= to
write into a column slice (a fused projection whose parts differ in type: the 1.5B's v is Q6_K in half its
layers, q and k Q4_K). gguf_linear picks the kernel on CUDA and falls back to gguf_linear_ref (dequantize,
then F.linear in float32) elsewhere. Shapes alone pick configs and buffers: no host syncs, CUDA-graph capturable. PDL as
kernels/pdl.py: the GEMV requests its first weight tile before it waits for the previous kernel.
Rounding: one float32 accumulation per output, rounded once to x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.core import envs
from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels.gguf_gemv import (
    i16_pair,
    q4k_gemv1_config,
    q4k_gemv1_kernel,
    q6k_gemv1_config,
    q6k_gemv1_kernel,
    resident_tiles,
)
from verispec.kernels.l2_prefetch import prefetch_supported
from verispec.kernels.linear import _splitk_reduce_kernel, splitk_split
from verispec.kernels.pdl import launch_kwargs, wait_prior
from verispec.loader.dequant import dequantize

T = GGMLQuantizationType
# ggml type id -> G, the elements that share one scale (and bias) in dequant_tile's tiles.
GROUP: dict[int, int] = {T.Q4_0: 16, T.Q4_1: 16, T.Q5_0: 16, T.Q5_1: 16, T.Q8_0: 32,
                         T.Q4_K: 32, T.Q5_K: 32, T.Q6_K: 16}
KERNEL_TYPES: frozenset[int] = frozenset(int(t) for t in GROUP)
GEMV_MAX_ROWS = 16  # above this many rows gguf_linear takes the tensor-core kernel (KQUANT_GEMV_ROWS for Q4_K / Q6_K)
# Measured on the H200 (docs/BENCHMARKS.md, session 14): the Q4_K / Q6_K GEMV is bound by its per-element
# unpacking, so its time grows with every row (M = 4: 2.3-3x M = 1) while the super-block tensor-core kernel
# at BLOCK_M 16 costs about one row's GEMV; that kernel loses to the generic one at 256 rows (the whole step's
# linears 9.3 ms against 6.7).
KQUANT_GEMV_ROWS = 1  # Q4_K / Q6_K: the GEMV for this many rows, the tensor-core kernels above
SB_MAX_ROWS = 64  # Q4_K / Q6_K: the super-block tensor-core kernel up to this many rows, the generic one above
# From this many rows gguf_linear dequantizes the weight into a scratch in x's dtype, a chunk of rows at a time,
# and runs torch's GEMM on it (gguf_dense): at 256 rows the step's linears took 9,271 us in the super-block kernel
# and 6,681 in the generic one against 1,595 dense (session 14), and a dequant pass costs about the bytes it writes.
DENSE_MIN_ROWS = SB_MAX_ROWS + 1
DENSE_CHUNK_ELEMS = 1 << 25  # most weight elements one scratch holds (64 MiB in bf16; the LM head takes 7 chunks)
KQUANT_GEMV_TYPES: frozenset[int] = frozenset({int(T.Q4_K), int(T.Q6_K)})  # _kquant_gemv_kernel's types
# Byte offsets of each type's float16 fields (d, and dmin / m where it has one) within a block.
F16_FIELDS: dict[int, tuple[int, ...]] = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
                                          T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}

_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = tl.constexpr(2), tl.constexpr(3), tl.constexpr(6), tl.constexpr(7), tl.constexpr(8)
_Q4_K, _Q5_K, _Q6_K = tl.constexpr(12), tl.constexpr(13), tl.constexpr(14)


class _TensorSource(Protocol):
    """What GGUFWeight.from_gguf reads: loader/gguf.py's GGUFFile (kernels may not import the loader)."""

    def tensor(self, name: str): ...  # -> GGUFTensorInfo (.ggml_type, .shape)

    def raw(self, name: str) -> torch.Tensor: ...


def type_name(qtype: int) -> str:
    """``Q4_K`` for a ggml type id (``type <id>`` if unknown)."""
    try:
        return T(qtype).name
    except ValueError:
        return f"type {qtype}"


def random_weight(qtype: int, n: int, k: int, seed: int = 0, device: torch.device | str = "cpu") -> GGUFWeight:
    """Random but valid blocks (tests, benches): random bytes with the float16 fields overwritten by values
    of either sign in 2^-10..2^-6 (random bytes there would be NaN, inf or huge). Made on the CPU, then
    copied (kernels/pdl.py: a weight must not come from the kernel right before a PDL launch)."""
    _check_type(qtype)
    g = torch.Generator().manual_seed(seed)
    qk, size = GGML_QUANT_SIZES[T(qtype)]
    if k % qk:
        raise ValueError(f"random_weight: K={k} is not a multiple of the {type_name(qtype)} block of {qk}")
    b = torch.randint(0, 256, (n * (k // qk), size), generator=g, dtype=torch.uint8)
    for off in F16_FIELDS[qtype]:
        mag = torch.exp2(-10 + 4 * torch.rand(b.shape[0], generator=g))
        sign = torch.randint(0, 2, (b.shape[0],), generator=g) * 2 - 1
        b[:, off : off + 2] = (mag * sign).to(torch.float16).view(torch.uint8).reshape(-1, 2)
    return GGUFWeight.from_raw(b, qtype, (n, k), device=device)


def _check_type(qtype: int) -> None:
    if qtype not in KERNEL_TYPES:
        names = ", ".join(sorted(type_name(t) for t in KERNEL_TYPES))
        raise ValueError(f"GGUFWeight: no kernel for ggml {type_name(qtype)}; supported: {names}")


@dataclass(frozen=True, eq=False)
class GGUFWeight:
    """A linear layer's weight [N, K] kept in its GGUF blocks: `blocks` uint8 [N, K // block_elems *
    block_bytes] (row n = the blocks of output row n, as stored), `qtype` the ggml type id, `shape` (N, K).
    Rows move as byte rows: a row permutation of the weight (loader/weights.py's unpermute_rope for Llama's
    q / k) is the same permutation of `blocks`. Compared by identity (it holds a tensor)."""

    blocks: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        _check_type(self.qtype)
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise ValueError(f"GGUFWeight: shape must be (N, K) with N, K > 0, got {self.shape}")
        n, k = self.shape
        qk, size = GGML_QUANT_SIZES[T(self.qtype)]
        if k % qk:
            raise ValueError(f"GGUFWeight: K={k} is not a multiple of the {type_name(self.qtype)} block of {qk}")
        want = (n, k // qk * size)
        b = self.blocks
        if b.dtype != torch.uint8 or tuple(b.shape) != want or b.stride(1) != 1 or b.stride(0) != want[1]:
            raise ValueError(f"GGUFWeight: {type_name(self.qtype)} {self.shape} needs contiguous uint8 blocks of "
                             f"shape {want}, got {b.dtype} {tuple(b.shape)} with strides {b.stride()}")

    @classmethod
    def from_raw(cls, raw: torch.Tensor, qtype: int, shape: tuple[int, ...],
                 device: torch.device | str | None = None) -> GGUFWeight:
        """From a tensor's raw bytes (any shape, e.g. GGUFFile.raw's flat view) and its torch-order shape."""
        if len(shape) != 2:
            raise ValueError(f"GGUFWeight: a linear weight is 2-D (N, K), got shape {tuple(shape)}")
        _check_type(qtype)
        n, k = (int(s) for s in shape)
        qk, size = GGML_QUANT_SIZES[T(qtype)]
        if raw.dtype != torch.uint8 or k % qk or raw.numel() != n * (k // qk) * size:
            raise ValueError(f"GGUFWeight: {type_name(qtype)} {(n, k)} needs {n * (k // qk) * size} uint8 bytes "
                             f"(K a multiple of {qk}), got {raw.numel()} of {raw.dtype}")
        blocks = raw.reshape(n, k // qk * size).to(device if device is not None else raw.device).contiguous()
        return cls(blocks, int(qtype), (n, k))

    @classmethod
    def from_gguf(cls, file: _TensorSource, name: str, device: torch.device | str | None = None) -> GGUFWeight:
        """Tensor `name` of an opened GGUF file (loader/gguf.py's GGUFFile), copied to `device`."""
        info = file.tensor(name)
        return cls.from_raw(file.raw(name), info.ggml_type, info.shape, device)

    @classmethod
    def cat(cls, weights: list[GGUFWeight]) -> GGUFWeight:
        """The weights stacked along N (a fused q/k/v or gate/up projection): one type and K for all."""
        if not weights or len({(w.qtype, w.shape[1], w.blocks.device) for w in weights}) != 1:
            desc = [(type_name(w.qtype), w.shape, str(w.blocks.device)) for w in weights]
            raise ValueError(f"GGUFWeight.cat needs weights of one type, K and device, got {desc}")
        return cls(torch.cat([w.blocks for w in weights]), weights[0].qtype,
                   (sum(w.shape[0] for w in weights), weights[0].shape[1]))

    def to(self, device: torch.device | str) -> GGUFWeight:
        """The same weight with its blocks on `device`."""
        return GGUFWeight(self.blocks.to(device), self.qtype, self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (what a pass over the weight reads)."""
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight through loader/dequant.py (the reference)."""
        return dequantize(self.blocks, self.qtype, self.shape, dtype=dtype)


@triton.jit
def _u8(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(h_ptr, off, mask):
    """The float16 at byte offset `off` (even: every block size and field offset is) as float32."""
    return tl.load(h_ptr + off // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _k_scale_min(w_ptr, base, s, mask):
    """Q4_K / Q5_K sub-block s's 6-bit scale and min from the 12 packed bytes at base + 4."""
    a = _u8(w_ptr, base + 8 + s, mask)  # byte s + 4 of the 12
    b = _u8(w_ptr, base + 4 + s, mask)  # byte s
    c = _u8(w_ptr, base + 4 + s % 4, mask)  # byte s - 4 (s >= 4)
    lo = s < 4
    sc = tl.where(lo, b & 63, (a & 15) | ((c >> 6) << 4))
    mn = tl.where(lo, a & 63, (a >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def dequant_tile(w_ptr, h_ptr, row, gg, e, mask, QTYPE: tl.constexpr):
    """float32 [BN, NG, G] weights: element e (of [1, 1, G]) of group gg (global index along the row,
    [1, NG, 1]) of the rows starting at byte `row` ([BN, 1, 1] int64); masked elements are 0.
    h_ptr is the blocks viewed as float16 (the d / dmin fields)."""
    if QTYPE == _Q8_0:
        base = row + gg * 34
        q = _u8(w_ptr, base + 2 + e, mask)
        val = _f16(h_ptr, base, mask) * (q - ((q & 128) << 1)).to(tl.float32)
    elif QTYPE == _Q4_K or QTYPE == _Q5_K:
        s = gg % 8
        base = row + (gg // 8) * (144 if QTYPE == _Q4_K else 176)
        sc, mn = _k_scale_min(w_ptr, base, s, mask)
        qs: tl.constexpr = 16 if QTYPE == _Q4_K else 48
        q = (_u8(w_ptr, base + qs + (s // 2) * 32 + e, mask) >> ((s % 2) * 4)) & 15
        if QTYPE == _Q5_K:
            q = q | (((_u8(w_ptr, base + 16 + e, mask) >> s) & 1) << 4)
        val = (_f16(h_ptr, base, mask) * sc) * q.to(tl.float32) - _f16(h_ptr, base + 2, mask) * mn
    elif QTYPE == _Q6_K:
        s = gg % 16  # scale index: element j = 16 s + e of the 256
        base = row + (gg // 16) * 210
        half, quarter, lane = s // 8, (s % 8) // 2, (s % 2) * 16 + e
        ql = (_u8(w_ptr, base + half * 64 + (quarter % 2) * 32 + lane, mask) >> ((quarter // 2) * 4)) & 15
        qh = (_u8(w_ptr, base + 128 + half * 32 + lane, mask) >> (2 * quarter)) & 3
        sc = _u8(w_ptr, base + 192 + s, mask)
        d = _f16(h_ptr, base + 208, mask) * (sc - ((sc & 128) << 1)).to(tl.float32)
        val = d * ((ql | (qh << 4)) - 32).to(tl.float32)
    else:  # Q4_0, Q4_1, Q5_0, Q5_1: 32-element blocks as two groups of 16 (low nibbles, then high)
        half = gg % 2
        size: tl.constexpr = 18 if QTYPE == _Q4_0 else (20 if QTYPE == _Q4_1 else (22 if QTYPE == _Q5_0 else 24))
        qs: tl.constexpr = 2 if QTYPE == _Q4_0 else (4 if QTYPE == _Q4_1 else (6 if QTYPE == _Q5_0 else 8))
        base = row + (gg // 2) * size
        q = (_u8(w_ptr, base + qs + e, mask) >> (half * 4)) & 15
        if QTYPE == _Q5_0 or QTYPE == _Q5_1:
            j = half * 16 + e  # bit j of the 32-bit high-bit mask
            q = q | (((_u8(w_ptr, base + qs - 4 + j // 8, mask) >> (j % 8)) & 1) << 4)
        d = _f16(h_ptr, base, mask)
        if QTYPE == _Q4_0:
            val = d * (q - 8).to(tl.float32)
        elif QTYPE == _Q5_0:
            val = d * (q - 16).to(tl.float32)
        else:
            val = d * q.to(tl.float32) + _f16(h_ptr, base + 2, mask)
    return val


@triton.jit
def _tile(w_ptr, h_ptr, n, k0, N, K: tl.constexpr, QK: tl.constexpr, SIZE: tl.constexpr, G: tl.constexpr,
          BLOCK_K: tl.constexpr, QTYPE: tl.constexpr):
    """(weights [BN, BLOCK_K // G, G] of rows n and columns k0.., their columns [1, BLOCK_K // G, G])."""
    gg = k0 // G + tl.arange(0, BLOCK_K // G)[None, :, None]
    e = tl.arange(0, G)[None, None, :]
    row = (n.to(tl.int64) * (K // QK * SIZE))[:, None, None]
    mask = (n < N)[:, None, None] & (gg < K // G)
    return dequant_tile(w_ptr, h_ptr, row, gg, e, mask, QTYPE), gg * G + e


@triton.jit
def _dequant_kernel(w_ptr, h_ptr, out_ptr, N, K: tl.constexpr, QK: tl.constexpr, SIZE: tl.constexpr,
                    G: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n, k] = dequant_tile's value of W[n, k] (float32): the tile code checked element by element."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w, k = _tile(w_ptr, h_ptr, n, tl.program_id(1) * BLOCK_K, N, K, QK, SIZE, G, BLOCK_K, QTYPE)
    n3 = n.to(tl.int64)[:, None, None]
    tl.store(out_ptr + n3 * K + k, w, mask=(n3 < N) & (k < K))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, h_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_om,
    K: tl.constexpr, QK: tl.constexpr, SIZE: tl.constexpr, G: tl.constexpr, QTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] W[n, k] (+ b[n]) for m < M <= BLOCK_M, n < N. Grid: N blocks. Every row of
    x reuses each dequantized tile (BLOCK_M 1: a single row, without the row loop). SILU_MUL: W stacks
    [gate; up] (2 N rows) and out = silu(x @ gate^T) * (x @ up^T), from the float32 sums."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_next, k_next = _tile(w_ptr, h_ptr, n, 0, N, K, QK, SIZE, G, BLOCK_K, QTYPE)  # weights: before the wait
    u_next = w_next
    if SILU_MUL:
        u_next, _ = _tile(w_ptr, h_ptr, n + N, 0, 2 * N, K, QK, SIZE, G, BLOCK_K, QTYPE)
    wait_prior(PDL)
    for k0 in range(0, K, BLOCK_K):
        w, u, k = w_next, u_next, k_next
        w_next, k_next = _tile(w_ptr, h_ptr, n, k0 + BLOCK_K, N, K, QK, SIZE, G, BLOCK_K, QTYPE)
        if SILU_MUL:
            u_next, _ = _tile(w_ptr, h_ptr, n + N, k0 + BLOCK_K, 2 * N, K, QK, SIZE, G, BLOCK_K, QTYPE)
        if BLOCK_M == 1:  # one row: no row loop
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum(w * x, axis=2), axis=1)[None, :]
            if SILU_MUL:
                acc_up += tl.sum(tl.sum(u * x, axis=2), axis=1)[None, :]
        else:
            m = 0
            while m < M:  # a while loop: the interpreter cannot take a tensor bound in range()
                x = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
                part = tl.sum(tl.sum(w * x, axis=2), axis=1)
                acc = tl.where(rows == m, acc + part[None, :], acc)
                if SILU_MUL:
                    part = tl.sum(tl.sum(u * x, axis=2), axis=1)
                    acc_up = tl.where(rows == m, acc_up + part[None, :], acc_up)
                m += 1
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = out_ptr + rows.to(tl.int64) * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M) & (n < N)[None, :])


@triton.jit
def _q4k_bytes(w_ptr, n, N, s0, NSB: tl.constexpr, SB: tl.constexpr):
    """Q4_K quant bytes [BN, SB, 4, 32] of super-blocks s0.. of rows n (chunk c's byte l holds element
    64 c + l in its low nibble and 64 c + 32 + l in its high one), the blocks' byte offsets [BN, SB, 1] and
    their mask. One contiguous 128-byte run per row and block: loaded before the tile before it is reduced."""
    s = s0 + tl.arange(0, SB)[None, :, None]
    blk = n.to(tl.int64)[:, None, None] * (NSB * 144) + s * 144
    ok = (n < N)[:, None, None] & (s < NSB)
    c = tl.arange(0, 4)[None, None, :]
    q = tl.load(w_ptr + (blk + 16 + c * 32)[:, :, :, None] + tl.arange(0, 32)[None, None, None, :],
                mask=ok[:, :, :, None], other=0)
    return q, blk, ok


@triton.jit
def _q4k_scales(w_ptr, h_ptr, blk, ok):
    """(d sc, dmin m) of sub-blocks 2 c and 2 c + 1 ([BN, SB, 4] each, c = 0..3) of the blocks at `blk`."""
    c = tl.arange(0, 4)[None, None, :]
    d, dmin = _f16(h_ptr, blk, ok), _f16(h_ptr, blk + 2, ok)
    sc0, mn0 = _k_scale_min(w_ptr, blk, 2 * c, ok)
    sc1, mn1 = _k_scale_min(w_ptr, blk, 2 * c + 1, ok)
    return d * sc0, d * sc1, dmin * mn0, dmin * mn1


@triton.jit
def _q4k_dot(x_ptr, s0, lo, hi, a0, a1, b0, b1, NSB: tl.constexpr, SB: tl.constexpr):
    """One row's sum over super-blocks s0.. of x[k] W[n, k] -> [BN]: per sub-block the integer quants'
    products with x, then its scale and (times the sub-block's sum of x) its min."""
    s = s0 + tl.arange(0, SB)[:, None, None]
    k = s * 256 + tl.arange(0, 4)[None, :, None] * 64 + tl.arange(0, 32)[None, None, :]
    xl = tl.load(x_ptr + k, mask=s < NSB, other=0.0).to(tl.float32)
    xh = tl.load(x_ptr + k + 32, mask=s < NSB, other=0.0).to(tl.float32)
    part = (a0 * tl.sum(lo * xl[None], axis=3) + a1 * tl.sum(hi * xh[None], axis=3)
            - (b0 * tl.sum(xl, axis=2)[None] + b1 * tl.sum(xh, axis=2)[None]))
    return tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def _q6k_bytes(w_ptr, n, N, s0, NSB: tl.constexpr, SB: tl.constexpr):
    """Q6_K bytes of the half-blocks (128 elements) 2 s0.. of rows n: ql [BN, HB, 4, 16] (group j's byte e
    holds element 16 j + e of the half in its low nibble and 64 + 16 j + e in its high one), qh [BN, HB, 4, 16]
    (their 2 high bits, at bits 2 (j // 2) and 4 + 2 (j // 2)), the half-blocks' byte offsets and mask."""
    hb = 2 * s0 + tl.arange(0, 2 * SB)[None, :, None]
    blk = n.to(tl.int64)[:, None, None] * (NSB * 210) + (hb // 2) * 210
    half = (hb % 2)
    ok = (n < N)[:, None, None] & (hb < 2 * NSB)
    j = tl.arange(0, 4)[None, None, :]
    e = tl.arange(0, 16)[None, None, None, :]
    ql = tl.load(w_ptr + (blk + half * 64 + j * 16)[:, :, :, None] + e, mask=ok[:, :, :, None], other=0)
    qh = tl.load(w_ptr + (blk + 128 + half * 32 + (j % 2) * 16)[:, :, :, None] + e, mask=ok[:, :, :, None], other=0)
    return ql, qh, blk + half * 8, blk, ok


@triton.jit
def _q6k_dot(x_ptr, s0, lo, hi, a0, a1, NSB: tl.constexpr, SB: tl.constexpr):
    """One row's sum over the half-blocks 2 s0.. -> [BN] (lo / hi: the 6-bit quants 0..63, whose offset of 32
    is taken off through each group's sum of x)."""
    hb = 2 * s0 + tl.arange(0, 2 * SB)[:, None, None]
    k = hb * 128 + tl.arange(0, 4)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    xl = tl.load(x_ptr + k, mask=hb < 2 * NSB, other=0.0).to(tl.float32)
    xh = tl.load(x_ptr + k + 64, mask=hb < 2 * NSB, other=0.0).to(tl.float32)
    part = (a0 * (tl.sum(lo * xl[None], axis=3) - 32.0 * tl.sum(xl, axis=2)[None])
            + a1 * (tl.sum(hi * xh[None], axis=3) - 32.0 * tl.sum(xh, axis=2)[None]))
    return tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def _q4k_rows(x_ptr, w_ptr, h_ptr, M, stride_xm, acc, s0, q, blk, ok,
              NSB: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc [BLOCK_M, BN] plus every row's sum over the super-blocks s0.. whose bytes q / blk / ok are
    (_q4k_bytes): the nibbles unpacked once and reused by each row."""
    lo, hi = (q & 15).to(tl.float32), (q >> 4).to(tl.float32)
    a0, a1, b0, b1 = _q4k_scales(w_ptr, h_ptr, blk, ok)
    if BLOCK_M == 1:
        acc += _q4k_dot(x_ptr, s0, lo, hi, a0, a1, b0, b1, NSB, SB)[None, :]
    else:
        rows = tl.arange(0, BLOCK_M)[:, None]
        m = 0
        while m < M:
            part = _q4k_dot(x_ptr + m * stride_xm, s0, lo, hi, a0, a1, b0, b1, NSB, SB)
            acc = tl.where(rows == m, acc + part[None, :], acc)
            m += 1
    return acc


@triton.jit
def _q6k_rows(x_ptr, w_ptr, h_ptr, M, stride_xm, acc, s0, ql, qh, sc_at, blk, ok,
              NSB: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr):
    """_q4k_rows for Q6_K (bytes from _q6k_bytes): 6-bit quants from ql's nibbles and qh's bit pairs,
    int8 scales of 16 elements times d."""
    sh = 2 * (tl.arange(0, 4) // 2)[None, None, :, None]
    lo = ((ql & 15) | (((qh >> sh) & 3) << 4)).to(tl.float32)
    hi = ((ql >> 4) | (((qh >> (sh + 4)) & 3) << 4)).to(tl.float32)
    j = tl.arange(0, 4)[None, None, :]
    d = _f16(h_ptr, blk + 208, ok)
    c0 = _u8(w_ptr, sc_at + 192 + j, ok)
    c1 = _u8(w_ptr, sc_at + 196 + j, ok)
    a0 = d * (c0 - ((c0 & 128) << 1)).to(tl.float32)
    a1 = d * (c1 - ((c1 & 128) << 1)).to(tl.float32)
    if BLOCK_M == 1:
        acc += _q6k_dot(x_ptr, s0, lo, hi, a0, a1, NSB, SB)[None, :]
    else:
        rows = tl.arange(0, BLOCK_M)[:, None]
        m = 0
        while m < M:
            part = _q6k_dot(x_ptr + m * stride_xm, s0, lo, hi, a0, a1, NSB, SB)
            acc = tl.where(rows == m, acc + part[None, :], acc)
            m += 1
    return acc


@triton.jit
def _q4k_sum(x_ptr, w_ptr, h_ptr, n, N, M, stride_xm, NSB: tl.constexpr, SB: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """x @ W[n]^T in float32 [BLOCK_M, BLOCK_N] over Q4_K rows n (< N): SB super-blocks a step, the next
    step's bytes requested before the current ones are unpacked (the first ones before the PDL wait)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    q, blk, ok = _q4k_bytes(w_ptr, n, N, 0, NSB, SB)
    wait_prior(PDL)
    for s0 in range(0, NSB, SB):
        cq, cblk, cok = q, blk, ok
        q, blk, ok = _q4k_bytes(w_ptr, n, N, s0 + SB, NSB, SB)
        acc = _q4k_rows(x_ptr, w_ptr, h_ptr, M, stride_xm, acc, s0, cq, cblk, cok, NSB, SB, BLOCK_M)
    return acc


@triton.jit
def _q6k_sum(x_ptr, w_ptr, h_ptr, n, N, M, stride_xm, NSB: tl.constexpr, SB: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """_q4k_sum for Q6_K rows."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ql, qh, sc_at, blk, ok = _q6k_bytes(w_ptr, n, N, 0, NSB, SB)
    wait_prior(PDL)
    for s0 in range(0, NSB, SB):
        cl, ch, csc, cblk, cok = ql, qh, sc_at, blk, ok
        ql, qh, sc_at, blk, ok = _q6k_bytes(w_ptr, n, N, s0 + SB, NSB, SB)
        acc = _q6k_rows(x_ptr, w_ptr, h_ptr, M, stride_xm, acc, s0, cl, ch, csc, cblk, cok, NSB, SB, BLOCK_M)
    return acc


@triton.jit
def _kquant_gemv_kernel(
    x_ptr, w_ptr, h_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_om,
    K: tl.constexpr, QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr,
):
    """_gemv_kernel for Q4_K and Q6_K, a super-block at a time: each program streams BLOCK_N rows of W,
    SB super-blocks (256 elements) per step as contiguous byte runs (_q4k_sum / _q6k_sum); a row's
    arithmetic does not depend on M (rows after the first repeat it). SILU_MUL: the up rows (n + N)
    follow the gate rows' pass."""
    NSB: tl.constexpr = K // 256
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)[:, None]
    if QTYPE == _Q4_K:
        acc = _q4k_sum(x_ptr, w_ptr, h_ptr, n, N, M, stride_xm, NSB, SB, BLOCK_M, BLOCK_N, PDL)
        if SILU_MUL:
            up = _q4k_sum(x_ptr, w_ptr, h_ptr, n + N, 2 * N, M, stride_xm, NSB, SB, BLOCK_M, BLOCK_N, False)
            acc = acc / (1.0 + tl.exp(-acc)) * up
    else:
        acc = _q6k_sum(x_ptr, w_ptr, h_ptr, n, N, M, stride_xm, NSB, SB, BLOCK_M, BLOCK_N, PDL)
        if SILU_MUL:
            up = _q6k_sum(x_ptr, w_ptr, h_ptr, n + N, 2 * N, M, stride_xm, NSB, SB, BLOCK_M, BLOCK_N, False)
            acc = acc / (1.0 + tl.exp(-acc)) * up
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64) * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M) & (n < N)[None, :])


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """Per element: the 4 bytes of int32 a (unsigned) dotted with the 4 bytes of b (signed), as int32: PTX
    dp4a.u32.s32 compiled (ASM), the same sum in plain integer arithmetic in the interpreter (no inline asm)."""
    b = tl.broadcast_to(b, a.shape)
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = tl.zeros_like(a)
        for j in tl.static_range(4):
            sb = (b >> (8 * j)) & 255
            s += ((a >> (8 * j)) & 255) * (sb - ((sb & 128) << 1))
        return s


@triton.jit
def _quant_x32(x_ptr, k, mask):
    """x[k] for k [A, B, 8, 4] (A B groups of 32 elements, 4 consecutive ones per word) as int8 quants
    round(x / dx), dx = max |x| / 127 per group, packed 4 to an int32 word [A, B, 8] (element 4 i + j in byte j
    of word i), each word's sum of quants [A, B, 8] and dx [A, B]. A group of zeros gives zeros."""
    x = tl.load(x_ptr + k, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=3), axis=2)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.floor(x * inv[:, :, None, None] + 0.5).to(tl.int32)
    words = tl.sum((q & 255) << (8 * tl.arange(0, 4))[None, None, None, :], axis=3)
    return words, tl.sum(q, axis=3), amax / 127.0


@triton.jit
def _q4k_i8_words(i_ptr, n, N, s0, NSB: tl.constexpr, SB: tl.constexpr):
    """The quant bytes of Q4_K super-blocks s0 .. s0 + SB - 1 of rows n as int32 words [BN, SB, 4, 8] (chunk
    c's word i holds elements 64 c + 4 i .. + 3 of the block in its low nibbles, 64 c + 32 + 4 i .. in its high
    ones); 0 past the row's end (so the step after the last one loads nothing)."""
    s = s0 + tl.arange(0, SB)[None, :, None, None]
    ok = (n < N)[:, None, None, None] & (s < NSB)
    word = n.to(tl.int64)[:, None, None, None] * (NSB * 36) + s * 36 + 4 + tl.arange(0, 4)[None, None, :, None] * 8 \
        + tl.arange(0, 8)[None, None, None, :]
    return tl.load(i_ptr + word, mask=ok, other=0)


@triton.jit
def _q4k_i8_dot(x_ptr, w_ptr, h_ptr, n, N, s0, wq, NSB: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """One row of x against the Q4_K rows n over super-blocks s0 .. (their words wq, _q4k_i8_words) ->
    float32 [BN]: x's 32-element sub-blocks as int8 words (_quant_x32); per sub-block the integer dot (dp4a)
    times d sc dx, minus dmin m dx sum(xq). The scale bytes share the lines the words came from."""
    s = s0 + tl.arange(0, SB)[None, :, None]  # [1, SB, 1]
    ok = (n < N)[:, None, None] & (s < NSB)  # [BN, SB, 1]
    blk = n.to(tl.int64)[:, None, None] * (NSB * 144) + s * 144  # byte offsets [BN, SB, 1]
    a0, a1, b0, b1 = _q4k_scales(w_ptr, h_ptr, blk, ok)  # [BN, SB, 4]: sub-blocks 2 c and 2 c + 1
    xs = s0 + tl.arange(0, SB)[:, None, None, None]  # [SB, 1, 1, 1]
    k = (xs * 256 + tl.arange(0, 4)[None, :, None, None] * 64 + tl.arange(0, 8)[None, None, :, None] * 4
         + tl.arange(0, 4)[None, None, None, :])  # [SB, 4, 8, 4]
    xe, se, de = _quant_x32(x_ptr, k, xs < NSB)
    xo, so, do = _quant_x32(x_ptr, k + 32, xs < NSB)
    pe = tl.sum(_dp4a(wq & 0x0F0F0F0F, xe[None], ASM), axis=3).to(tl.float32)  # [BN, SB, 4]
    po = tl.sum(_dp4a((wq >> 4) & 0x0F0F0F0F, xo[None], ASM), axis=3).to(tl.float32)
    se = tl.sum(se, axis=2).to(tl.float32)[None]
    so = tl.sum(so, axis=2).to(tl.float32)[None]
    part = de[None] * (a0 * pe - b0 * se) + do[None] * (a1 * po - b1 * so)
    return tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def _q6k_i8_words(i_ptr, n, N, s0, NSB: tl.constexpr, SB: tl.constexpr):
    """Q6_K super-blocks s0 .. s0 + SB - 1 of rows n (i_ptr: the blocks as int16) as int32 words [BN, SB, 2, 8]
    per half-block h: ql bytes 64 h + 4 i .. (ql0), 64 h + 32 + 4 i .. (ql1) and qh bytes 32 h + 4 i ..; 0 past
    the row's end."""
    s = s0 + tl.arange(0, SB)[None, :, None, None]
    hb = tl.arange(0, 2)[None, None, :, None]
    ok = (n < N)[:, None, None, None] & (s < NSB)
    blk = n.to(tl.int64)[:, None, None, None] * (NSB * 210) + s * 210 + hb * 64 + 4 * tl.arange(0, 8)[None, None, None, :]
    ql0 = i16_pair(i_ptr, blk // 2, ok, False)
    ql1 = i16_pair(i_ptr, (blk + 32) // 2, ok, False)
    qh = i16_pair(i_ptr, (blk - hb * 32 + 128) // 2, ok, False)  # qh of half h: byte 128 + 32 h + 4 i
    return ql0, ql1, qh


@triton.jit
def _q6k_i8_dot(x_ptr, w_ptr, h_ptr, n, N, s0, ql0, ql1, qh, NSB: tl.constexpr, SB: tl.constexpr,
                ASM: tl.constexpr):
    """_q4k_i8_dot for Q6_K (words from _q6k_i8_words): per half-block h (128 elements) and quarter r (32), the
    6-bit quants 0..63 of elements 128 h + 32 r + 4 i .. + 3 as words (ql's nibbles r // 2 of ql0 / ql1 by r % 2,
    qh's bit pairs r) dotted with x's int8 words; the offset 32 through the quants' sums; the int8 scale of each
    16 elements times d dx."""
    s = s0 + tl.arange(0, SB)[None, :, None, None]  # [1, SB, 1, 1]
    hb = tl.arange(0, 2)[None, None, :, None]  # [1, 1, 2, 1]
    ok = (n < N)[:, None, None, None] & (s < NSB)  # [BN, SB, 1, 1]
    blk = n.to(tl.int64)[:, None, None, None] * (NSB * 210) + s * 210  # byte offsets [BN, SB, 1, 1]
    d = tl.load(h_ptr + (blk + 208) // 2, mask=ok, other=0.0).to(tl.float32)  # [BN, SB, 1, 1]
    xs = s0 + tl.arange(0, SB)[:, None, None, None]  # [SB, 1, 1, 1]
    kb = xs * 256 + tl.arange(0, 2)[None, :, None, None] * 128 + tl.arange(0, 8)[None, None, :, None] * 4 \
        + tl.arange(0, 4)[None, None, None, :]  # [SB, 2, 8, 4]
    j = tl.arange(0, 2)[None, None, None, :]  # the 16-element scale group within a quarter
    sc_at = blk + 192 + hb * 8  # [BN, SB, 2, 1]
    acc = tl.zeros([ql0.shape[0]], tl.float32)
    for r in tl.static_range(4):
        src = ql0 if r % 2 == 0 else ql1
        q = ((src >> (4 * (r // 2))) & 0x0F0F0F0F) | (((qh >> (2 * r)) & 0x03030303) << 4)
        xw, xsum, dx = _quant_x32(x_ptr, kb + 32 * r, xs < NSB)  # [SB, 2, 8], [SB, 2, 8], [SB, 2]
        dp = tl.sum(tl.reshape(_dp4a(q, xw[None], ASM), (q.shape[0], SB, 2, 2, 4)), axis=4)  # [BN, SB, 2, 2]
        qs = tl.sum(tl.reshape(xsum, (SB, 2, 2, 4)), axis=3)[None]  # [1, SB, 2, 2]
        sc = _u8(w_ptr, sc_at + 2 * r + j, ok)  # [BN, SB, 2, 2]
        sc = (sc - ((sc & 128) << 1)).to(tl.float32)
        part = (d * sc) * (dx[None, :, :, None] * (dp - 32 * qs).to(tl.float32))
        acc += tl.sum(tl.sum(tl.sum(part, axis=3), axis=2), axis=1)
    return acc


@triton.jit
def _kq_i8_sum(x_ptr, w_ptr, h_ptr, i_ptr, n, N, M, stride_xm, QTYPE: tl.constexpr, NSB: tl.constexpr,
               SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
               PDL: tl.constexpr):
    """x @ W[n]^T in float32 [BLOCK_M, BLOCK_N] over the Q4_K / Q6_K rows n (< N), SB super-blocks a step:
    the next step's words requested before the current ones are dotted (the first ones before the PDL wait:
    x comes from the kernel before), every row of x dotting each step's words."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    rows = tl.arange(0, BLOCK_M)[:, None]
    if QTYPE == _Q4_K:
        wq = _q4k_i8_words(i_ptr, n, N, 0, NSB, SB)
        wait_prior(PDL)
        for s0 in range(0, NSB, SB):
            cq = wq
            wq = _q4k_i8_words(i_ptr, n, N, s0 + SB, NSB, SB)
            if BLOCK_M == 1:
                acc += _q4k_i8_dot(x_ptr, w_ptr, h_ptr, n, N, s0, cq, NSB, SB, ASM)[None, :]
            else:
                m = 0
                while m < M:  # a while loop: the interpreter cannot take a tensor bound in range()
                    part = _q4k_i8_dot(x_ptr + m * stride_xm, w_ptr, h_ptr, n, N, s0, cq, NSB, SB, ASM)
                    acc = tl.where(rows == m, acc + part[None, :], acc)
                    m += 1
    else:
        l0, l1, qh = _q6k_i8_words(i_ptr, n, N, 0, NSB, SB)
        wait_prior(PDL)
        for s0 in range(0, NSB, SB):
            c0, c1, ch = l0, l1, qh
            l0, l1, qh = _q6k_i8_words(i_ptr, n, N, s0 + SB, NSB, SB)
            if BLOCK_M == 1:
                acc += _q6k_i8_dot(x_ptr, w_ptr, h_ptr, n, N, s0, c0, c1, ch, NSB, SB, ASM)[None, :]
            else:
                m = 0
                while m < M:
                    part = _q6k_i8_dot(x_ptr + m * stride_xm, w_ptr, h_ptr, n, N, s0, c0, c1, ch, NSB, SB, ASM)
                    acc = tl.where(rows == m, acc + part[None, :], acc)
                    m += 1
    return acc


@triton.jit
def _kquant_i8_kernel(
    x_ptr, w_ptr, h_ptr, i_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_om,
    K: tl.constexpr, QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):
    # i_ptr: the blocks as int32 (Q4_K: 144-byte blocks) or int16 (Q6_K: 210-byte blocks); h_ptr as float16.
    """_kquant_gemv_kernel with integer dot products (llama.cpp's scheme for few rows): each row of x is
    quantized to int8 per 32 elements (scale max |x| / 127) as the program reads it, and each 4 weight quants
    are dotted with 4 of x's by one dp4a, so the weights' nibbles are never converted to float (the float
    GEMV is bound by that per-element work). Not the float kernels' arithmetic: x's rounding to 8 bits adds
    an error of about that size relative to each sum (tests bound it); a row's result does not depend on M.
    SILU_MUL as there."""
    NSB: tl.constexpr = K // 256
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)[:, None]
    acc = _kq_i8_sum(x_ptr, w_ptr, h_ptr, i_ptr, n, N, M, stride_xm, QTYPE, NSB, SB, BLOCK_M, BLOCK_N, ASM, PDL)
    if SILU_MUL:
        up = _kq_i8_sum(x_ptr, w_ptr, h_ptr, i_ptr, n + N, 2 * N, M, stride_xm, QTYPE, NSB, SB, BLOCK_M, BLOCK_N,
                        ASM, False)
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64) * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M) & (n < N)[None, :])


@triton.jit
def _mma_kernel(
    x_ptr, w_ptr, h_ptr, b_ptr, out_ptr, ws_ptr, M, N, stride_xm, stride_om,
    K: tl.constexpr, KS: tl.constexpr, QK: tl.constexpr, SIZE: tl.constexpr, G: tl.constexpr,
    QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """Program (i, j, s)'s part of out = x @ W^T over K range [s KS, (s + 1) KS): tl.dot on weight tiles
    dequantized in the load and cast to x's dtype. Grid (M tiles, N tiles, splits): the M tiles of a
    column block run side by side, so the weight bytes come from HBM once. SPLIT_K == 1: bias and the
    store here; else float32 partials to ws [splits, M, N] for linear.py's _splitk_reduce_kernel.
    SILU_MUL as _gemv_kernel (ws rows then hold the gate columns, then the up columns)."""
    wait_prior(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(2)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, KS, BLOCK_K):  # a constant trip count; the K tail is masked
        k = s * KS + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        w, _ = _tile(w_ptr, h_ptr, n, s * KS + k0, N, K, QK, SIZE, G, BLOCK_K, QTYPE)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
        if SILU_MUL:
            u, _ = _tile(w_ptr, h_ptr, n + N, s * KS + k0, 2 * N, K, QK, SIZE, G, BLOCK_K, QTYPE)
            u = tl.reshape(u, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
            acc_up += tl.dot(x, tl.trans(u), input_precision=DOT_PREC)
    mask = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        ws_n = 2 * N if SILU_MUL else N
        ws = ws_ptr + (s * M + m.to(tl.int64))[:, None] * ws_n + n[None, :]
        tl.store(ws, acc, mask=mask)
        if SILU_MUL:
            tl.store(ws + N, acc_up, mask=mask)


# Types with a super-block kernel (_mma_sb_kernel): the 1.5B's file is Q4_K and Q6_K.
SB_TYPES: frozenset[int] = frozenset({int(T.Q4_K), int(T.Q6_K)})


@triton.jit
def _i2f(q, OFFSET: tl.constexpr):
    """float32(q - OFFSET) for int32 0 <= q < 2^22, exactly, without an int-to-float conversion (a quarter-rate
    instruction): the bits of 2^23 + q, minus 2^23 + OFFSET."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _q4k_part(w_ptr, i_ptr, row, b, ok, p: tl.constexpr, P: tl.constexpr, DT: tl.constexpr):
    """Part p of P of super-block b of the Q4_K rows at byte `row` ([BN, 1] int64; `ok` [BN, 1] masks rows):
    its chunks c = p C .. (p + 1) C - 1 (C = 4 / P; chunk c is quant bytes 32 c + l, l < 32) as two
    [BN, 32 C] tiles in DT, the low nibbles (elements 64 c + l) and the high ones (64 c + 32 + l): the
    bytes load as one contiguous [BN, 32 C] tile (16-byte aligned), the d / dmin and 12 scale bytes as four
    int32 words per row (i_ptr: the blocks as int32), decoded on [BN, 2 C, 1]. Masked rows give 0."""
    C: tl.constexpr = 4 // P
    base = row + b * 144  # [BN, 1]
    bn: tl.constexpr = row.shape[0]
    # viewed as [BN, 2 C, 16]: byte 32 (p C) + 16 g + e is chunk p C + g // 2's l = 16 (g % 2) + e
    q = tl.load(w_ptr + base + 16 + 32 * p * C + tl.arange(0, 32 * C)[None, :], mask=ok, other=0)
    q = tl.reshape(q, (bn, 2 * C, 16)).to(tl.int32)
    base = base[:, :, None]
    ok = ok[:, :, None]
    word = base // 4  # int32 loads (4-byte aligned): pipelined as asynchronous copies, one per row
    dd = tl.load(i_ptr + word, mask=ok, other=0)  # d | dmin << 16
    w0 = tl.load(i_ptr + word + 1, mask=ok, other=0)  # scale bytes 0..3
    w1 = tl.load(i_ptr + word + 2, mask=ok, other=0)  # 4..7
    w2 = tl.load(i_ptr + word + 3, mask=ok, other=0)  # 8..11
    d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    s = (p * C + tl.arange(0, 2 * C)[None, :, None] // 2) * 2  # the low nibbles' sub-block; the high: s + 1
    sc, mn = _q4k_scale_min(w0, w1, w2, s)
    lo = (d * sc) * _i2f(q & 15, 0.0) - dmin * mn
    sc, mn = _q4k_scale_min(w0, w1, w2, s + 1)
    hi = (d * sc) * _i2f(q >> 4, 0.0) - dmin * mn
    return tl.reshape(lo, (bn, 32 * C)).to(DT), tl.reshape(hi, (bn, 32 * C)).to(DT)


@triton.jit
def _q4k_scale_min(w0, w1, w2, s):
    """Q4_K sub-block s's 6-bit scale and min (float32) from the 12 scale bytes as int32 words w0, w1, w2:
    byte s % 4 of each word is scale byte s % 4, 4 + s % 4 and 8 + s % 4."""
    sh = (s % 4) * 8
    b0 = (w0 >> sh) & 255
    b1 = (w1 >> sh) & 255
    b2 = (w2 >> sh) & 255
    lo = s < 4
    sc = tl.where(lo, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(lo, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q6k_quarter(ql, qh, scb, d, Q: tl.constexpr, DT: tl.constexpr):
    """Quarter Q (< 4) of a Q6_K part, [BN, W] in DT: 4-bit ql and qh ([BN, W / 16, 16]), qh's 2-bit field Q,
    int8 scale bytes scb ([BN, W / 16, 1]), f16 d."""
    sc = scb - ((scb & 128) << 1)
    q = ql | (((qh >> (2 * Q)) & 3) << 4)
    val = (d * sc.to(tl.float32)) * _i2f(q, 32.0)
    bn: tl.constexpr = ql.shape[0]
    return tl.reshape(val, (bn, ql.shape[1] * 16)).to(DT)


@triton.jit
def _q6k_index(i, p: tl.constexpr, P: tl.constexpr):
    """(h, l // 16) of element i = 16 j + e of part p's tiles (halves h = p H .., H = 2 / P): l // 16 =
    1 - j // H (descending, so the scale loads see no adjacent pair and do not pick the layout of the
    whole dequantization), h = p H + j % H."""
    H: tl.constexpr = 2 // P
    j = i // 16
    return p * H + j % H, 1 - j // H


@triton.jit
def _q6k_part(w_ptr, h_ptr, row, b, ok, p: tl.constexpr, P: tl.constexpr, DT: tl.constexpr):
    """Part p of P of super-block b of the Q6_K rows at byte `row` ([BN, 1]; `ok` masks): its halves
    h = p H .. (H = 2 / P) as four [BN, 32 H] tiles in DT, tile Q holding the elements 128 h + 32 Q + l
    (l < 32) in _q6k_index's order. Quarters 0 / 2 are the low / high nibbles of ql bytes 64 h + l, 1 / 3 of
    64 h + 32 + l, each loaded once, the qh bytes 32 h + l once (four 2-bit fields each), the int8 scales
    as [BN, 2 H, 1] bytes, d per row."""
    H: tl.constexpr = 2 // P
    base = row + b * 210  # [BN, 1]
    bn: tl.constexpr = row.shape[0]
    i = tl.arange(0, 32 * H)[None, :]
    h, l16 = _q6k_index(i, p, P)
    lane = h * 64 + l16 * 16 + i % 16  # ql byte 64 h + l
    qa = tl.reshape(tl.load(w_ptr + base + lane, mask=ok, other=0), (bn, 2 * H, 16)).to(tl.int32)
    qb = tl.reshape(tl.load(w_ptr + base + 32 + lane, mask=ok, other=0), (bn, 2 * H, 16)).to(tl.int32)
    qh = tl.load(w_ptr + base + 128 + h * 32 + l16 * 16 + i % 16, mask=ok, other=0)  # qh byte 32 h + l
    qh = tl.reshape(qh, (bn, 2 * H, 16)).to(tl.int32)
    base = base[:, :, None]
    ok = ok[:, :, None]
    d = tl.load(h_ptr + base // 2 + 104, mask=ok, other=0.0).to(tl.float32)
    h, l16 = _q6k_index(tl.arange(0, 2 * H)[None, :, None] * 16, p, P)
    sc = base + 192 + h * 8 + l16  # + 2 Q: the scale of elements 16 (8 h + 2 Q + l // 16) ..
    s0 = tl.load(w_ptr + sc, mask=ok, other=0).to(tl.int32)
    s1 = tl.load(w_ptr + sc + 2, mask=ok, other=0).to(tl.int32)
    s2 = tl.load(w_ptr + sc + 4, mask=ok, other=0).to(tl.int32)
    s3 = tl.load(w_ptr + sc + 6, mask=ok, other=0).to(tl.int32)
    return (_q6k_quarter(qa & 15, qh, s0, d, 0, DT), _q6k_quarter(qb & 15, qh, s1, d, 1, DT),
            _q6k_quarter(qa >> 4, qh, s2, d, 2, DT), _q6k_quarter(qb >> 4, qh, s3, d, 3, DT))


@triton.jit
def _dot_acc(acc, x, w, SWAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + x @ w^T ([BM, BN]), or with SWAP acc + w @ x^T ([BN, BM]: the weight is the MMA's left
    operand, so the instruction's 64-row side is N and a few rows of x are its narrow side)."""
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _sb_step(acc, x_rows, xm, w_ptr, h_ptr, i_ptr, row, b, ok, QTYPE: tl.constexpr, PARTS: tl.constexpr,
             SWAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc plus super-block b's products, in PARTS parts (fewer live registers per part): each dequantized
    tile against the x columns it holds, in the tile's own element order (the dot's K order is free as long
    as x and W agree, so W needs no shuffle)."""
    DT: tl.constexpr = x_rows.dtype.element_ty
    C: tl.constexpr = 4 // PARTS  # Q4_K: chunks of 64 elements per part
    H: tl.constexpr = 2 // PARTS  # Q6_K: halves of 128 per part
    xb = x_rows + b * 256
    for p in tl.static_range(PARTS):
        if QTYPE == _Q4_K:
            i = tl.arange(0, 32 * C)
            xk = xb + (p * C * 64 + (i // 32) * 64 + i % 32)[None, :]  # element 64 c + l of byte 32 c + l
            lo, hi = _q4k_part(w_ptr, i_ptr, row, b, ok, p, PARTS, DT)
            acc = _dot_acc(acc, tl.load(xk, mask=xm, other=0.0), lo, SWAP, DOT_PREC)
            acc = _dot_acc(acc, tl.load(xk + 32, mask=xm, other=0.0), hi, SWAP, DOT_PREC)
        else:
            i = tl.arange(0, 32 * H)
            h, l16 = _q6k_index(i, p, PARTS)
            xk = xb + (h * 128 + l16 * 16 + i % 16)[None, :]  # + 32 Q
            t0, t1, t2, t3 = _q6k_part(w_ptr, h_ptr, row, b, ok, p, PARTS, DT)
            acc = _dot_acc(acc, tl.load(xk, mask=xm, other=0.0), t0, SWAP, DOT_PREC)
            acc = _dot_acc(acc, tl.load(xk + 32, mask=xm, other=0.0), t1, SWAP, DOT_PREC)
            acc = _dot_acc(acc, tl.load(xk + 64, mask=xm, other=0.0), t2, SWAP, DOT_PREC)
            acc = _dot_acc(acc, tl.load(xk + 96, mask=xm, other=0.0), t3, SWAP, DOT_PREC)
    return acc


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (PTX prefetch.global.L2, a hint: no result, no fault). Compiled only
    (the interpreter has no inline asm): callers guard it with a constexpr."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_block(w_ptr, n, N, b, NB: tl.constexpr, SIZE: tl.constexpr):
    """L2 prefetch of super-block b (clamped to the row) of rows n (clamped to N): 8 addresses 30 bytes
    apart cover every 32-byte sector of a 144- or 210-byte block. For Q6_K, whose bytes cannot be copied
    asynchronously (2-byte aligned), so its loads would otherwise wait on HBM every step."""
    rows = tl.minimum(n, N - 1).to(tl.int64) * (NB * SIZE)
    off = tl.minimum(b, NB - 1) * SIZE + tl.minimum(tl.arange(0, 8) * 30, SIZE - 1)
    _prefetch_l2(w_ptr + rows[:, None] + off[None, :])


@triton.jit
def _mma_sb_kernel(
    x_ptr, w_ptr, h_ptr, i_ptr, b_ptr, out_ptr, ws_ptr, M, N, stride_xm, stride_om,
    NB: tl.constexpr, SBS: tl.constexpr, QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr, PARTS: tl.constexpr,
    PREFETCH: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """_mma_kernel for Q4_K / Q6_K, one 256-element super-block per K step (NB per row; split s covers
    super-blocks [s SBS, (s + 1) SBS)): the block's quant bytes load as contiguous tiles, the scales once per
    block, and each nibble plane is dotted with the x columns it holds. Grid, epilogues and workspace as
    _mma_kernel. A row's arithmetic depends on K's split (a function of the shape) but not on M or BLOCK_M."""
    wait_prior(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(2)
    SIZE: tl.constexpr = 144 if QTYPE == _Q4_K else 210
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    row = (n.to(tl.int64) * (NB * SIZE))[:, None]
    row_up = ((n + N).to(tl.int64) * (NB * SIZE))[:, None]
    if SWAP:
        mm, nn = m[None, :], n[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        mm, nn = m[:, None], n[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = acc
    for t in range(0, SBS):  # a constant trip count; super-blocks past the row (last split) are masked
        b = s * SBS + t
        if PREFETCH > 0:  # the block PREFETCH steps ahead, into L2
            _prefetch_block(w_ptr, n, 2 * N if SILU_MUL else N, b + PREFETCH, NB, SIZE)
            if SILU_MUL:
                _prefetch_block(w_ptr, n + N, 2 * N, b + PREFETCH, NB, SIZE)
        ok = (n < N)[:, None] & (b < NB)
        xm = (m < M)[:, None] & (b < NB)
        acc = _sb_step(acc, x_rows, xm, w_ptr, h_ptr, i_ptr, row, b, ok, QTYPE, PARTS, SWAP, DOT_PREC)
        if SILU_MUL:
            acc_up = _sb_step(acc_up, x_rows, xm, w_ptr, h_ptr, i_ptr, row_up, b, ok, QTYPE, PARTS, SWAP, DOT_PREC)
    mask = (mm < M) & (nn < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + nn, mask=nn < N, other=0.0).to(tl.float32)
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(out_ptr + mm.to(tl.int64) * stride_om + nn, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws_n = 2 * N if SILU_MUL else N
        ws = ws_ptr + (s * M + mm.to(tl.int64)) * ws_n + nn
        tl.store(ws, acc, mask=mask)
        if SILU_MUL:
            tl.store(ws + N, acc_up, mask=mask)


def _type_args(w: GGUFWeight, block_k: int) -> dict:
    """The kernels' per-type constexprs, after checking that BLOCK_K tiles whole scale groups."""
    qk, size = GGML_QUANT_SIZES[T(w.qtype)]
    g = GROUP[w.qtype]
    if block_k < g or block_k & (block_k - 1):
        raise ValueError(f"gguf_linear: BLOCK_K={block_k} must be a power of two >= {g} for {type_name(w.qtype)}")
    return dict(K=w.shape[1], QK=qk, SIZE=size, G=g, QTYPE=w.qtype)


def _check(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None, silu_mul: bool = False) -> torch.Tensor:
    """x with a unit last stride, after checking x and bias against w (a ValueError naming what is wrong)."""
    if not isinstance(w, GGUFWeight):
        raise ValueError(f"gguf_linear: w must be a GGUFWeight, got {type(w).__name__}")
    n, k = w.shape
    if silu_mul and (n % 2 or bias is not None):
        raise ValueError(f"gguf_linear: silu_mul needs [gate; up] stacked (an even N, got {n}) and no bias")
    if x.dim() != 2 or x.shape[1] != k or not x.dtype.is_floating_point:
        raise ValueError(f"gguf_linear: x must be a floating [M, {k}] tensor, got {x.dtype} {tuple(x.shape)}")
    if x.device != w.blocks.device:
        raise ValueError(f"gguf_linear: x is on {x.device} but the weight on {w.blocks.device}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.device != x.device):
        raise ValueError(f"gguf_linear: bias must be [{n}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    return x if x.stride(1) == 1 else x.contiguous()


def gemv_config(m: int, n: int, k: int, qtype: int, int8: bool = False, one_row: bool = False,
                one_row_q6k: bool = False, resident: bool = False) -> dict:
    """Tiles for the GEMV. Q4_K / Q6_K (_kquant_gemv_kernel): BLOCK_K = 256 x the super-blocks per step (2 where
    they divide a row of up to 8, else 4), BLOCK_N 8 rows for wide layers (the LM head, gate_up), else 4;
    BLOCK_M 1 for one row (the single-row variant: fewer registers, the same arithmetic per row).
    Other types (_gemv_kernel): BLOCK_K 512 (256 for K < 1024), BLOCK_N so that even narrow layers have >= ~2
    programs per SM of the H200, BLOCK_M GEMV_MAX_ROWS whatever m (one compile for every row count). Either way a
    row's result does not depend on how many rows came with it. (First guesses: scripts/gpu_gguf.sh sweeps.)
    int8 (Q4_K / Q6_K: _kquant_i8_kernel, I8=1): 2 super-blocks a step where they divide the row, else 1,
    BLOCK_N 16 rows for wide layers, else 8 (unmeasured guesses: `scripts/gguf_bench.py --int8` sweeps).
    one_row (one row of Q4_K, KernelOptions.gguf_gemv1) and one_row_q6k (of Q6_K, KernelOptions.gguf_gemv1_q6k):
    kernels/gguf_gemv.py's kernels (ONE_ROW=1; gguf_gemv takes the tiles above instead for an x that is not
    bfloat16); resident (KernelOptions.gguf_gemv1_resident): Q4_K's in the resident form."""
    if one_row and m == 1 and qtype == T.Q4_K and not int8:
        return dict(ONE_ROW=1, BLOCK_M=1, **q4k_gemv1_config(n, k, resident))
    if one_row_q6k and m == 1 and qtype == T.Q6_K and not int8:
        return dict(ONE_ROW=1, BLOCK_M=1, **q6k_gemv1_config(n, k))
    if int8 and qtype in KQUANT_GEMV_TYPES:
        nsb = max(1, k // 256)
        return dict(I8=1, BLOCK_M=1 if m == 1 else GEMV_MAX_ROWS, BLOCK_N=16 if n >= 16384 else 8,
                    BLOCK_K=512 if nsb % 2 == 0 else 256, num_warps=4)
    if qtype in KQUANT_GEMV_TYPES:
        nsb = max(1, k // 256)
        sb = 2 if nsb % 2 == 0 and nsb <= 8 else 4
        return dict(BLOCK_M=1 if m == 1 else GEMV_MAX_ROWS, BLOCK_N=8 if n >= 16384 else 4, BLOCK_K=256 * sb,
                    num_warps=4)
    block_n = 8 if n >= 8 * 528 else (4 if n >= 4 * 264 else 2)
    return dict(BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=512 if k >= 1024 else 256, num_warps=4)


def mma_split(n: int, k: int, block_n: int = 64) -> int:
    """SPLIT_K of the tensor-core kernels: a function of the layer's shape only (a row's float32 sums must
    not depend on how many rows came with it): layers narrower than 100 column tiles of 64 split K in
    powers of two while that keeps <= 200 programs per row tile and >= 2 super-blocks of 256 per split.
    Wide layers (gate_up, the LM head) have the programs already, and their workspace would cost more
    than it gives."""
    tiles, split = triton.cdiv(n, block_n), 1
    if tiles >= 100:
        return 1
    while tiles * 2 * split <= 200 and triton.cdiv(triton.cdiv(k, 256), 2 * split) >= 2:
        split *= 2
    return split


def mma_config(m: int, n: int, k: int, qtype: int, superblock: bool = True) -> dict:
    """Tiles for the tensor-core kernels. Q4_K / Q6_K (SB: _mma_sb_kernel): one super-block per K step in
    PARTS 2 halves (ptxas for sm_90: ~160-220 registers instead of 255 and spills with silu_mul), BLOCK_N 64
    rows of W as the MMA's left operand (SWAP: the 64-row side of Hopper's instruction is N, x's rows its
    narrow side, so every M takes the same instruction), BLOCK_M the power of two >= m in 16..128, 8 warps
    from 128 rows, an L2 prefetch one block ahead for Q6_K (its loads are synchronous). SWAP and PARTS fix
    the order of a row's sums; they do not vary with m. Other types and superblock=False (_mma_kernel): BLOCK_M as above,
    BLOCK_N 64, BLOCK_K 64. Both: K split by mma_split (the shape only; the super-block kernel doubles it
    for narrow layers of K <= 2048). The super-block tiles from session 28's sweep
    (`scripts/gguf_bench.py --rows 16,64,256`): see the comment below."""
    bm = min(128, max(16, triton.next_power_of_2(m)))
    split = mma_split(n, k)
    if qtype in SB_TYPES and superblock:
        # Session 28's sweep on an H100 (docs/BENCHMARKS.md; the shape decides split and parts, so a row's sums
        # still do not depend on m): narrow layers of K <= 2048 (qkv, o) split twice as far, down to one
        # super-block a split (o at 16 / 64 rows: Q4_K 6.5 -> 5.4 / 8.1 -> 7.0 us, Q6_K 10.7 -> 8.4 / 15.8 -> 9.5);
        # Q6_K's narrow layers in one part (qkv, o, down: 5-30% faster); Q4_K three stages up to 16 rows and
        # on qkv / o up to 64 rows (qkv 16 rows 6.9 -> 5.9 us, gate_up 27.0 -> 21.9, down 16.1 -> 15.4; 64 rows: qkv
        # 8.6 -> 7.9, o 8.1 -> 7.4).
        narrow = triton.cdiv(n, 64) < 100
        if narrow and k <= 2048:
            split = min(2 * split, max(1, k // 256))
        # (three stages of BLOCK_M 128 need more than the H100's 227 KB of shared memory: two from 65 rows)
        # (call C of session 28: down_proj at 64 rows lost with three, 23.1 -> 27.4 us: only K <= 2048 there)
        stages = 3 if qtype == T.Q4_K and (m <= 16 or (narrow and k <= 2048)) and bm <= 64 else 2
        return dict(SB=1, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=256, SPLIT_K=split, SWAP=1,
                    PARTS=1 if qtype == T.Q6_K and narrow else 2, PREFETCH=1 if qtype == T.Q6_K else 0,
                    num_warps=8 if bm >= 128 else 4, num_stages=stages)
    return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, SPLIT_K=split, num_warps=4, num_stages=3)


def _out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked ([M, n] in x's dtype on x's device, unit last stride: e.g. a column slice of a fused
    projection's output whose parts have different types), or a new one."""
    if out is None:
        return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (x.shape[0], n) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1:
        raise ValueError(f"gguf_linear: out must be [{x.shape[0]}, {n}] {x.dtype} on {x.device} with unit "
                         f"last stride, got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    return out


def gguf_gemv(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None, config: dict | None = None,
              options: KernelOptions = DEFAULT_OPTIONS, out: torch.Tensor | None = None,
              silu_mul: bool = False) -> torch.Tensor:
    """The weight-streaming kernel: x [M, K] (M <= the config's BLOCK_M, default up to 16) -> [M, N] in x's
    dtype (written into `out` if given, and returned); silu_mul: w stacks [gate; up] -> [M, N / 2]."""
    x = _check(x, w, bias, silu_mul)
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    out = _out(x, n, out)
    if x.shape[0] == 0:
        return out
    cfg = dict(config or gemv_config(x.shape[0], n, w.shape[1], w.qtype))
    if x.shape[0] > cfg["BLOCK_M"]:
        raise ValueError(f"gguf_gemv: {x.shape[0]} rows exceed BLOCK_M={cfg['BLOCK_M']}")
    b, pdl = bias if bias is not None else x, launch_kwargs(x.device, options.pdl)
    if cfg.pop("ONE_ROW", 0):
        if _one_row_ok(x, w):
            _one_row(x, w, b, out, bias is not None, silu_mul, cfg, pdl)
            return out
        cfg = gemv_config(x.shape[0], n, w.shape[1], w.qtype)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    if w.qtype in KQUANT_GEMV_TYPES and cfg.pop("I8", 0):
        sb = cfg.pop("BLOCK_K") // 256
        words = w.blocks.view(torch.int32 if w.qtype == T.Q4_K else torch.int16)
        _kquant_i8_kernel[grid](
            x, w.blocks, w.blocks.view(torch.float16), words, b, out, x.shape[0], n, x.stride(0), out.stride(0),
            K=w.shape[1], QTYPE=w.qtype, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SB=sb,
            ASM=not envs.triton_interpret(), **cfg, **pdl,
        )
        return out
    if w.qtype in KQUANT_GEMV_TYPES and cfg["BLOCK_K"] % 256 == 0:
        sb = cfg.pop("BLOCK_K") // 256
        _kquant_gemv_kernel[grid](
            x, w.blocks, w.blocks.view(torch.float16), b, out, x.shape[0], n, x.stride(0), out.stride(0),
            K=w.shape[1], QTYPE=w.qtype, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SB=sb, **cfg, **pdl,
        )
        return out
    _gemv_kernel[grid](
        x, w.blocks, w.blocks.view(torch.float16), b, out, x.shape[0], n,
        x.stride(0), out.stride(0), **_type_args(w, cfg["BLOCK_K"]), HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        **cfg, **pdl,
    )
    return out


def _one_row_ok(x: torch.Tensor, w: GGUFWeight) -> bool:
    """True where kernels/gguf_gemv.py's kernels take this call: one bfloat16 row (read as int64 words: its
    start 16-byte aligned) and a Q4_K or Q6_K weight."""
    return (w.qtype in (T.Q4_K, T.Q6_K) and x.shape[0] == 1 and x.dtype == torch.bfloat16
            and x.data_ptr() % 16 == 0 and x.stride(0) % 4 == 0 and w.blocks.data_ptr() % 16 == 0)


def _one_row(x: torch.Tensor, w: GGUFWeight, b: torch.Tensor, out: torch.Tensor, has_bias: bool, silu_mul: bool,
             cfg: dict, pdl: dict) -> None:
    """Launch q4k_gemv1_kernel or q6k_gemv1_kernel on one row (cfg: their *_config tiles, BLOCK_M dropped;
    RES=1: the resident form, its two tiles from resident_tiles)."""
    n, k = out.shape[1], w.shape[1]
    cfg.pop("BLOCK_M", None)
    nsb, grid = k // 256, (triton.cdiv(n, cfg["BLOCK_N"]),)
    even_n = n % cfg["BLOCK_N"] == 0
    if cfg.pop("RES", 0) or w.qtype == T.Q6_K:
        sb, sb1 = resident_tiles(k)
        tiles = dict(SB=sb, SB1=sb1, EVEN=even_n, EVEN1=even_n and sb + sb1 == nsb)
        if w.qtype == T.Q6_K:
            q6k_gemv1_kernel[grid](x.view(torch.int64), w.blocks.view(torch.int16), w.blocks, b, out, n, K=k,
                                   HAS_BIAS=has_bias, SILU_MUL=silu_mul, ASM=not envs.triton_interpret(), **tiles,
                                   **cfg, **pdl)
            return
        cfg.update(tiles, RES=True)
    else:
        cfg["EVEN"] = nsb % cfg["SB"] == 0 and even_n  # no masks
    q4k_gemv1_kernel[grid](
        x.view(torch.int64), w.blocks.view(torch.int32), b, out, n, K=k, HAS_BIAS=has_bias, SILU_MUL=silu_mul,
        ASM=not envs.triton_interpret(), **cfg, **pdl,
    )


def gguf_mma(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None, config: dict | None = None,
             options: KernelOptions = DEFAULT_OPTIONS, out: torch.Tensor | None = None,
             silu_mul: bool = False) -> torch.Tensor:
    """The tensor-core kernel: x [M, K] -> [M, N] in x's dtype (into `out` if given; silu_mul as gguf_gemv).
    config["SB"] (mma_config's pick for Q4_K / Q6_K) takes the super-block kernel, else the generic one.
    A split K's float32 workspace is allocated per call (from the graph's pool under CUDA-graph capture)."""
    x = _check(x, w, bias, silu_mul)
    m, k = x.shape
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    out = _out(x, n, out)
    if m == 0:
        return out
    cfg = dict(config or mma_config(m, n, k, w.qtype))
    sb = cfg.pop("SB", 0)
    b = bias if bias is not None else x
    pdl = launch_kwargs(x.device, options.pdl)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    h = w.blocks.view(torch.float16)
    if sb:
        if w.qtype not in SB_TYPES:
            raise ValueError(f"gguf_mma: SB needs Q4_K or Q6_K, got {type_name(w.qtype)}")
        cfg.pop("BLOCK_K", None)  # always one super-block (256)
        cfg.setdefault("SWAP", 1)
        cfg.setdefault("PARTS", 1)
        cfg["PREFETCH"] = cfg.get("PREFETCH", 0) if prefetch_supported(x.device) else 0  # inline PTX
        nb = k // 256
        sbs, split = splitk_split(nb, 1, cfg.pop("SPLIT_K", 1))
        ws = _workspace(x, m, n, split, silu_mul, out)
        i32 = w.blocks.view(torch.int32) if w.qtype == T.Q4_K else w.blocks  # Q4_K rows: multiples of 144 B
        _mma_sb_kernel[(triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)](
            x, w.blocks, h, i32, b, out, ws, m, n, x.stride(0), out.stride(0), NB=nb, SBS=sbs, QTYPE=w.qtype,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split, DOT_PREC=prec, **cfg, **pdl,
        )
    else:
        targs = _type_args(w, cfg["BLOCK_K"])
        ks, split = splitk_split(k, cfg["BLOCK_K"], cfg.pop("SPLIT_K", 1))
        ws = _workspace(x, m, n, split, silu_mul, out)
        _mma_kernel[(triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)](
            x, w.blocks, h, b, out, ws, m, n, x.stride(0), out.stride(0), KS=ks, **targs,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split, DOT_PREC=prec, **cfg, **pdl,
        )
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(n, 512), m)](
            ws, b, out, m, n, out.stride(0), HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split,
            BLOCK_N=512, num_warps=4, **pdl,
        )
    return out


def _workspace(x: torch.Tensor, m: int, n: int, split: int, silu_mul: bool, out: torch.Tensor) -> torch.Tensor:
    """The float32 partials [split, M, N (2 N with silu_mul)] of a split K (`out` itself when unsplit)."""
    if split == 1:
        return out
    return torch.empty(split, m, 2 * n if silu_mul else n, dtype=torch.float32, device=x.device)


def gguf_dense(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None, config: dict | None = None,
               options: KernelOptions = DEFAULT_OPTIONS, out: torch.Tensor | None = None,
               silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, N] through a dense GEMM (many rows: prefill, big batches): each chunk of W's rows
    (config["CHUNK"] elements at most, default DENSE_CHUNK_ELEMS) is dequantized by dequant_tile into a scratch
    in x's dtype, then multiplied by torch (cuBLAS on CUDA) with float32 accumulation straight into its columns
    of `out`, the bias added in the GEMM (addmm) and rounded once; silu_mul (as gguf_gemv): the GEMM's [gate, up]
    output, then fused.silu_and_mul into `out` (float32 inside, rounded once). The scratch is freed after each chunk (under CUDA-graph capture it comes from the graph's
    pool and is reused by the next layer). (Session 28, 256 rows: the former float32 buffer, its per-chunk
    copies and torch's SiLU / bias ops were 1.7 ms of a 6.8 ms step.)"""
    from verispec.kernels.fused import silu_and_mul

    x = _check(x, w, bias, silu_mul)
    m, k = x.shape
    n_all = w.shape[0]
    n = n_all // 2 if silu_mul else n_all
    out = _out(x, n, out)
    if m == 0:
        return out
    chunk = max(16, (config or {}).get("CHUNK", DENSE_CHUNK_ELEMS) // k // 16 * 16)
    targs = _type_args(w, 256)
    y = torch.empty(m, n_all, dtype=x.dtype, device=x.device) if silu_mul else out
    for n0 in range(0, n_all, chunk):
        rows = min(chunk, n_all - n0)
        blocks = w.blocks[n0:n0 + rows]
        scratch = torch.empty(rows, k, dtype=x.dtype, device=x.device)
        _dequant_kernel[(triton.cdiv(rows, 16), triton.cdiv(k, 256))](
            blocks, blocks.view(torch.float16), scratch, rows, **targs, BLOCK_N=16, BLOCK_K=256,
        )
        dst = y[:, n0:n0 + rows]  # rows of stride n_all: cuBLAS takes the leading dimension, no copy
        if bias is not None:
            torch.addmm(bias[n0:n0 + rows].to(x.dtype), x, scratch.t(), out=dst)
        else:
            torch.mm(x, scratch.t(), out=dst)
        del scratch
    if silu_mul:
        silu_and_mul(y[:, :n], y[:, n:], options, out=out)
    return out


def gguf_linear(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None,
                options: KernelOptions = DEFAULT_OPTIONS, out: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ dequant(w)^T (+ bias) -> [M, N] in x's dtype: on CUDA the kernel linear_plan picks (the GEMV
    for few rows, tensor-core kernels above; one kernel for every M with options.batch_invariant); elsewhere
    gguf_linear_ref. `out`: the buffer to write it into (returned). silu_mul: w stacks [gate; up]; the result
    is silu(x @ gate^T) * (x @ up^T)."""
    x = _check(x, w, bias, silu_mul)
    if not x.is_cuda:
        y = gguf_linear_ref(x, w, bias, silu_mul)
        return y if out is None else _out(x, y.shape[1], out).copy_(y)
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    kernel, cfg = linear_plan(x.shape[0], n, w.shape[1], w.qtype, options)
    run = {"gemv": gguf_gemv, "mma": gguf_mma, "dense": gguf_dense}[kernel]
    return run(x, w, bias, config=cfg, options=options, out=out, silu_mul=silu_mul)


def linear_plan(m: int, n: int, k: int, qtype: int, options: KernelOptions = DEFAULT_OPTIONS) -> tuple[str, dict]:
    """gguf_linear's kernel ("gemv", "mma" or "dense") and tiles for m rows of an [n, k] weight of this type: the
    GEMV up to KQUANT_GEMV_ROWS (Q4_K / Q6_K) or GEMV_MAX_ROWS rows, the tensor-core kernel (super-block for
    Q4_K / Q6_K) below DENSE_MIN_ROWS, gguf_dense from there; with options.batch_invariant the tensor-core kernel
    of the type at every m (the kernels' sums differ from each other; each one's row results do not depend on
    m, which a library GEMM does not promise)."""
    if options.batch_invariant:
        return "mma", mma_config(m, n, k, qtype)
    if m <= (KQUANT_GEMV_ROWS if qtype in KQUANT_GEMV_TYPES else GEMV_MAX_ROWS):
        return "gemv", gemv_config(m, n, k, qtype, options.gguf_int8_gemv, options.gguf_gemv1,
                                   options.gguf_gemv1_q6k, options.gguf_gemv1_resident)
    if m >= DENSE_MIN_ROWS:
        return "dense", {}
    return "mma", mma_config(m, n, k, qtype)


def gguf_linear_ref(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None,
                    silu_mul: bool = False) -> torch.Tensor:
    """The reference: loader/dequant.py's float32 weight, F.linear in float32 (then SiLU-and-mul of its two
    halves with silu_mul), rounded once to x's dtype."""
    x = _check(x, w, bias, silu_mul)
    y = F.linear(x.float(), w.dequantize(torch.float32), None if bias is None else bias.float())
    if silu_mul:
        y = F.silu(y[:, : w.shape[0] // 2]) * y[:, w.shape[0] // 2 :]
    return y.to(x.dtype)


def gguf_dequantize(w: GGUFWeight, block_n: int = 16, block_k: int = 256) -> torch.Tensor:
    """The float32 [N, K] weight through the kernels' own dequant_tile (tests compare it with loader/dequant.py)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32, device=w.blocks.device)
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.blocks, w.blocks.view(torch.float16), out, n, **_type_args(w, block_k), BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
