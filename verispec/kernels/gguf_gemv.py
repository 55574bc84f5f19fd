"""The one-row GEMVs for Q4_K and Q6_K weights as stored (decode at batch 1): y = x @ dequant(W)^T, few
instructions a weight.

Two forms. The loop (q4k_gemv1_kernel, session 21): SB super-blocks a step, the next step's bytes requested
before the current ones are used, so each step waits on memory once. The resident form (session 29;
q4k_gemv1_kernel with RES, and q6k_gemv1_kernel, which has only this form): the row as two power-of-two tiles
of super-blocks (resident_tiles), every byte of a program's rows (gate and up both with SILU_MUL) requested
before the PDL wait, then the arithmetic: one round trip to memory a program. Q6_K's 210-byte blocks are only
2-byte aligned, so its words are int16 pairs; its weight d sc (q - 32) is one FMA of exact float32 terms.
The Q4_K arithmetic, shared by both forms:

Why a kernel of its own: at one row the bytes read set the speed, and the H100 streams a Q4_K weight at ~25
elements per clock per SM, so the kernel has ~5 instructions per weight element to spend (128 lanes issue per
clock). gguf_matmul's _kquant_gemv_kernel spends ~43 (offline SASS for sm_90: a reduction across threads every
step, byte-to-float conversions at a quarter rate, unvectorized loads), so it ran at a quarter of the bandwidth.
This one keeps the work per element to a handful of full-rate instructions:
  * the quant bytes of BLOCK_N rows x SB super-blocks a step, as [BN, SB, 4, 32] (chunk c's byte l holds
    element 64 c + l in its low nibble and 64 c + 32 + l in its high one), x read at the same positions in the
    same layout (8 consecutive elements per thread: one 16-byte load of x, one 8-byte load of W);
  * a nibble becomes a float without a conversion instruction: (q | 0x4B000000) read as float32 is 2^23 + q,
    so one logic op and one add (exact);
  * the weight d sc q - dmin m by one FMA per element, then one FMA into an elementwise accumulator that is
    reduced once, after the loop (no shuffles inside it);
  * the next step's bytes requested before the current ones are used (the first ones before the PDL wait).
Products and sums are float32, the result rounded once to x's dtype. The weights are not bit-identical to
loader/dequant.py's: the folded constant -(2^p d sc + dmin m) rounds to float32, up to 2^-13 d sc off for the
low nibbles (about 2^-16 of a typical weight), the same for the 32 weights of a sub-block. Near an output of
zero that error is many bfloat16 ulps of the output (17.8 at the qkv shape, 75 at the LM head's worst of 151,936
outputs: session 24); tests/test_gguf_gemv.py bounds it from this arithmetic (dot_error_bound). Computing the
weights exactly would cost one more float op each.
"""

from __future__ import annotations

import triton
import triton.language as tl

from verispec.kernels.pdl import wait_prior

Q4_K_BYTES = 144  # one super-block of 256 elements: d, dmin (f16), 12 scale bytes, 128 quant bytes


@triton.jit
def _q4k_tile(w32_ptr, rowoff, okn, s0, NSB: tl.constexpr, SB: tl.constexpr, EVEN: tl.constexpr):
    """Super-blocks s0 .. s0 + SB of the rows at word offsets `rowoff` [1, 1, BN]: quant words q
    [4, SB, BN, 4, 2] (q[c, s, n, v, i] is word 2 v + i of chunk c: its bytes 8 v + 4 i .. + 3) and the header
    words h0 (d | dmin << 16), h1, h2, h3 (the 12 scale bytes) [1, SB, BN]. Two words a load (x's groups of 4
    elements are 8 bytes: the same layout); Triton spreads the threads over i, c, s, n and repeats v, so
    each thread holds a whole chunk (its scales computed once for 64 weights)."""
    s = s0 + tl.arange(0, SB)[None, :, None]
    blk = rowoff + s * 36
    ok = okn & (s < NSB)
    c = tl.arange(0, 4)[:, None, None]
    v = tl.arange(0, 4)[None, None, None, :, None]
    i = tl.arange(0, 2)[None, None, None, None, :]
    at = (blk + 4 + c * 8)[:, :, :, None, None] + 2 * v + i
    if EVEN:  # every row and super-block of the tiles exists
        return (tl.load(w32_ptr + at), tl.load(w32_ptr + blk), tl.load(w32_ptr + blk + 1),
                tl.load(w32_ptr + blk + 2), tl.load(w32_ptr + blk + 3))
    # out of range: quant words left unset (any bits make a finite f), header words 0 (weight 0)
    q = tl.load(w32_ptr + at, mask=ok[:, :, :, None, None])
    h0 = tl.load(w32_ptr + blk, mask=ok, other=0)
    h1 = tl.load(w32_ptr + blk + 1, mask=ok, other=0)
    h2 = tl.load(w32_ptr + blk + 2, mask=ok, other=0)
    h3 = tl.load(w32_ptr + blk + 3, mask=ok, other=0)
    return q, h0, h1, h2, h3


@triton.jit
def _sc_min(h1, h2, h3, c, b):
    """The 6-bit scale and min of sub-block 2 c + (b % 2) (b: its byte in each scale word, 2 (c % 2) + 0 or 1)."""
    u1 = (h1 >> (8 * b)) & 255
    u2 = (h2 >> (8 * b)) & 255
    u3 = (h3 >> (8 * b)) & 255
    first = c < 2
    sc = tl.where(first, u1 & 63, (u3 & 15) | ((u1 >> 2) & 48))
    mn = tl.where(first, u2 & 63, (u3 >> 4) | ((u2 >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _bf16_at(xw, i: tl.constexpr):
    """Element i (0..3) of the 4 bfloat16 packed in int64 xw, as float32."""
    return (((xw >> (16 * i)) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _f_at(q, sh: tl.constexpr, hi: tl.constexpr):
    """1 + nibble / 2^11 (lo) or 1 + nibble / 2^7 (hi) of the byte at bit 8 sh of word q, as float32."""
    nib = (q >> (8 * sh + 4 * hi)) & 15
    return ((nib << (12 + 4 * hi)) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _q4k_fma(acc, q, xl, xh, a0, c0, a1, c1, ASM: tl.constexpr):
    """acc + the dot of the 8 weights in quant word q with x (xl: the 4 bfloat16 of its low nibbles' elements,
    xh: the high ones'), weight = f a - c per nibble (f from the nibble as _f_at; a, c per sub-block)."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{ .reg .b32 t0, t1, t2, t3, xa, xb, xc, xd, f, w, e;
            mov.b64 {xa, xb}, $2; mov.b64 {xc, xd}, $3; mov.b32 $0, $8;
            shl.b32 t0, $1, 12; shl.b32 t1, $1, 4; shr.b32 t2, $1, 4; shr.b32 t3, $1, 12;
            lop3.b32 f, t0, 0xF000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $4, $5; shl.b32 e, xa, 16;
            fma.rn.f32 $0, w, e, $0;
            lop3.b32 f, t1, 0xF000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $4, $5; and.b32 e, xa, 0xFFFF0000;
            fma.rn.f32 $0, w, e, $0;
            lop3.b32 f, t2, 0xF000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $4, $5; shl.b32 e, xb, 16;
            fma.rn.f32 $0, w, e, $0;
            lop3.b32 f, t3, 0xF000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $4, $5; and.b32 e, xb, 0xFFFF0000;
            fma.rn.f32 $0, w, e, $0;
            lop3.b32 f, t0, 0xF0000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $6, $7; shl.b32 e, xc, 16;
            fma.rn.f32 $0, w, e, $0;
            lop3.b32 f, t1, 0xF0000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $6, $7; and.b32 e, xc, 0xFFFF0000;
            fma.rn.f32 $0, w, e, $0;
            lop3.b32 f, t2, 0xF0000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $6, $7; shl.b32 e, xd, 16;
            fma.rn.f32 $0, w, e, $0;
            lop3.b32 f, t3, 0xF0000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $6, $7; and.b32 e, xd, 0xFFFF0000;
            fma.rn.f32 $0, w, e, $0; }""",
            "=f,r,l,l,f,f,f,f,f", [q, xl, xh, a0, c0, a1, c1, acc], dtype=tl.float32, is_pure=True, pack=1)
    for i in tl.static_range(4):
        acc += (_f_at(q, i, 0) * a0 + c0) * _bf16_at(xl, i)
    for i in tl.static_range(4):
        acc += (_f_at(q, i, 1) * a1 + c1) * _bf16_at(xh, i)
    return acc


@triton.jit
def _q4k_step(acc, x64_ptr, s0, q, h0, h1, h2, h3, NSB: tl.constexpr, SB: tl.constexpr, EVEN: tl.constexpr,
              ASM: tl.constexpr):
    """acc [4, SB, BN, 4, 2] plus x times the weights of one step (q and header words from _q4k_tile)."""
    c = tl.arange(0, 4)[:, None, None]
    b = 2 * (c % 2)
    d = (h0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    sc0, mn0 = _sc_min(h1, h2, h3, c, b)
    sc1, mn1 = _sc_min(h1, h2, h3, c, b + 1)
    # d sc q - dmin m from f = 1 + q / 2^p (p = 11 lo, 7 hi): (2^p d sc) f - (2^p d sc + dmin m), one FMA; the
    # constant's rounding is ~2^(p - 24) d sc, below 2^-12 of a quantization step
    a0 = 2048.0 * (d * sc0)
    a1 = 128.0 * (d * sc1)
    c0 = -(a0 + dmin * mn0)
    c1 = -(a1 + dmin * mn1)
    a0, _ = tl.broadcast(a0[:, :, :, None, None], q)
    c0, _ = tl.broadcast(c0[:, :, :, None, None], q)
    a1, _ = tl.broadcast(a1[:, :, :, None, None], q)
    c1, _ = tl.broadcast(c1[:, :, :, None, None], q)
    s = s0 + tl.arange(0, SB)[None, :, None, None, None]
    v = tl.arange(0, 4)[None, None, None, :, None]
    i = tl.arange(0, 2)[None, None, None, None, :]
    k = s * 64 + c[:, :, :, None, None] * 16 + 2 * v + i  # x as int64: 4 elements each
    k, _ = tl.broadcast(k, q)  # x read in q's shape (and so its layout) for every row of W
    if EVEN:
        xl = tl.load(x64_ptr + k)
        xh = tl.load(x64_ptr + k + 8)
    else:  # x of a missing super-block: 0 (its weights are 0: the product must not be NaN)
        xl = tl.load(x64_ptr + k, mask=s < NSB, other=0)
        xh = tl.load(x64_ptr + k + 8, mask=s < NSB, other=0)
    return _q4k_fma(acc, q, xl, xh, a0, c0, a1, c1, ASM)


@triton.jit
def _q4k_rows_sum(x64_ptr, w32_ptr, n, N, NSB: tl.constexpr, SB: tl.constexpr, BLOCK_N: tl.constexpr,
                  EVEN: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    """x @ W[n]^T in float32 [BLOCK_N] over the Q4_K rows n (< N)."""
    rowoff = n.to(tl.int64)[None, None, :] * (NSB * 36)
    okn = (n < N)[None, None, :]
    acc = tl.zeros([4, SB, BLOCK_N, 4, 2], tl.float32)
    q, h0, h1, h2, h3 = _q4k_tile(w32_ptr, rowoff, okn, 0, NSB, SB, EVEN)
    wait_prior(PDL)
    for s0 in range(0, NSB, SB):
        cq, c0, c1, c2, c3 = q, h0, h1, h2, h3
        # EVEN: the last step re-reads its own tile instead of one past the row (no masks)
        nxt = tl.minimum(s0 + SB, NSB - SB) if EVEN else s0 + SB
        q, h0, h1, h2, h3 = _q4k_tile(w32_ptr, rowoff, okn, nxt, NSB, SB, EVEN)
        acc = _q4k_step(acc, x64_ptr, s0, cq, c0, c1, c2, c3, NSB, SB, EVEN, ASM)
    return _sum5(acc)


@triton.jit
def _sum5(acc):
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=0), axis=0)


@triton.jit
def _q4k_piece(x64_ptr, s0, q, h0, h1, h2, h3, NSB: tl.constexpr, SB: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN: tl.constexpr, ASM: tl.constexpr):
    """x . W over the super-blocks s0 .. s0 + SB of one resident tile (from _q4k_tile), float32 [BLOCK_N]."""
    acc = tl.zeros([4, SB, BLOCK_N, 4, 2], tl.float32)
    return _sum5(_q4k_step(acc, x64_ptr, s0, q, h0, h1, h2, h3, NSB, SB, EVEN, ASM))


@triton.jit
def _q4k_rows_resident(x64_ptr, w32_ptr, n, N, NSB: tl.constexpr, SB: tl.constexpr, SB1: tl.constexpr,
                       BLOCK_N: tl.constexpr, EVEN: tl.constexpr, EVEN1: tl.constexpr, SILU_MUL: tl.constexpr,
                       ASM: tl.constexpr, PDL: tl.constexpr):
    """(x . W[n], x . W[n + N] with SILU_MUL, else the first again) in float32 [BLOCK_N], every byte of the rows
    requested before the PDL wait: the row as two tiles of SB and SB1 super-blocks (SB the largest power of two
    <= the row's, SB1 the power of two >= the rest, masked; 0: none). One round trip to memory a program, where
    the loop of _q4k_rows_sum makes one a step (each step's bytes wait for the last step's)."""
    rowoff = n.to(tl.int64)[None, None, :] * (NSB * 36)
    okn = (n < N)[None, None, :]
    q, h0, h1, h2, h3 = _q4k_tile(w32_ptr, rowoff, okn, 0, NSB, SB, EVEN)
    if SB1 > 0:
        r, g0, g1, g2, g3 = _q4k_tile(w32_ptr, rowoff, okn, SB, NSB, SB1, EVEN1)
    if SILU_MUL:
        upoff = rowoff + N * (NSB * 36)
        uq, u0, u1, u2, u3 = _q4k_tile(w32_ptr, upoff, okn, 0, NSB, SB, EVEN)
        if SB1 > 0:
            ur, v0, v1, v2, v3 = _q4k_tile(w32_ptr, upoff, okn, SB, NSB, SB1, EVEN1)
    wait_prior(PDL)
    acc = _q4k_piece(x64_ptr, 0, q, h0, h1, h2, h3, NSB, SB, BLOCK_N, EVEN, ASM)
    if SB1 > 0:
        acc += _q4k_piece(x64_ptr, SB, r, g0, g1, g2, g3, NSB, SB1, BLOCK_N, EVEN1, ASM)
    up = acc
    if SILU_MUL:
        up = _q4k_piece(x64_ptr, 0, uq, u0, u1, u2, u3, NSB, SB, BLOCK_N, EVEN, ASM)
        if SB1 > 0:
            up += _q4k_piece(x64_ptr, SB, ur, v0, v1, v2, v3, NSB, SB1, BLOCK_N, EVEN1, ASM)
    return acc, up


@triton.jit
def q4k_gemv1_kernel(x64_ptr, w32_ptr, b_ptr, out_ptr, N, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, EVEN: tl.constexpr,
                     ASM: tl.constexpr, PDL: tl.constexpr, RES: tl.constexpr = False, SB1: tl.constexpr = 0,
                     EVEN1: tl.constexpr = False):
    """out[0, n] = x[0] . W[n] (+ bias) for BLOCK_N rows n a program; SILU_MUL: W stacks [gate; up] (up row
    n + N), out = silu(gate) * up. RES: the rows resident (_q4k_rows_resident; SB, SB1 its two tiles), else
    the loop over SB super-blocks a step."""
    NSB: tl.constexpr = K // 256
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if RES:
        acc, up = _q4k_rows_resident(x64_ptr, w32_ptr, n, N, NSB, SB, SB1, BLOCK_N, EVEN, EVEN1, SILU_MUL,
                                     ASM, PDL)
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * up
    else:
        acc = _q4k_rows_sum(x64_ptr, w32_ptr, n, N, NSB, SB, BLOCK_N, EVEN, ASM, PDL)
        if SILU_MUL:
            up = _q4k_rows_sum(x64_ptr, w32_ptr, n + N, 2 * N, NSB, SB, BLOCK_N, EVEN, ASM, False)
            acc = acc / (1.0 + tl.exp(-acc)) * up
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


Q6_K_BYTES = 210  # d (f16) last; ql 128, qh 64, 16 int8 scales: 105 int16, blocks only 2-byte aligned


@triton.jit
def i16_pair(i16_ptr, at, ok, EVEN: tl.constexpr):
    """The int32 word of the int16 pair at element offsets at, at + 1 (0 where not ok; EVEN: no mask). Q6_K's
    210-byte blocks are only 2-byte aligned, so every Q6_K kernel reads its words this way."""
    if EVEN:
        lo = tl.load(i16_ptr + at)
        hi = tl.load(i16_ptr + at + 1)
    else:
        lo = tl.load(i16_ptr + at, mask=ok, other=0)
        hi = tl.load(i16_ptr + at + 1, mask=ok, other=0)
    return (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)


@triton.jit
def _q6k_tile(i16_ptr, u8_ptr, rowoff, okn, s0, NSB: tl.constexpr, SB: tl.constexpr, EVEN: tl.constexpr):
    """Super-blocks s0 .. s0 + SB of the Q6_K rows at int16 offsets `rowoff` [1, 1, 1, BN], as int32 words
    [8, 2, SB, BN] per word w (4 byte positions l = 4 w .. 4 w + 3) and half h (128 elements): ql bytes l (a)
    and l + 32 (b) of the half, its qh bytes l (c); the int8 scales 8 h + 2 j + w // 4 of its elements
    (sc0..sc3, by j) and d, in float32; all [8, 2, SB, BN]. (u8_ptr: the same blocks as bytes.)
    (w first: no load here is provably contiguous or aligned, and Triton then lays the threads out in dimension
    order, so a warp's loads are w's neighbouring bytes.)"""
    s = s0 + tl.arange(0, SB)[None, None, :, None]
    h = tl.arange(0, 2)[None, :, None, None]
    w = tl.arange(0, 8)[:, None, None, None]
    blk = rowoff + s * 105
    ok = okn & (s < NSB)
    at = blk + h * 32 + w * 2  # ql byte 64 h + 4 w
    a = i16_pair(i16_ptr, at, ok, EVEN)
    b = i16_pair(i16_ptr, at + 16, ok, EVEN)
    c = i16_pair(i16_ptr, blk + 64 + h * 16 + w * 2, ok, EVEN)  # qh byte 128 + 32 h + 4 w
    # the scales and d read in the quant words' shape (so their layout: no conversion where they meet)
    sat = 2 * blk + 192 + h * 8 + w // 4  # scale byte 8 h + w // 4 (+ 2 j)
    dat = blk + 104 + h * 0 + w * 0
    if EVEN:
        d = tl.load(i16_ptr + dat)
        sc0, sc1 = tl.load(u8_ptr + sat), tl.load(u8_ptr + sat + 2)
        sc2, sc3 = tl.load(u8_ptr + sat + 4), tl.load(u8_ptr + sat + 6)
    else:
        d = tl.load(i16_ptr + dat, mask=ok, other=0)
        sc0, sc1 = tl.load(u8_ptr + sat, mask=ok, other=0), tl.load(u8_ptr + sat + 2, mask=ok, other=0)
        sc2, sc3 = tl.load(u8_ptr + sat + 4, mask=ok, other=0), tl.load(u8_ptr + sat + 6, mask=ok, other=0)
    return (a, b, c, _i8f(sc0), _i8f(sc1), _i8f(sc2), _i8f(sc3),
            d.to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _i8f(byte):
    """A uint8 read as int8, in float32."""
    return byte.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _bits(word, pos: tl.constexpr, dst: tl.constexpr, mask: tl.constexpr):
    """word shifted so that bit pos lands on bit dst, then masked (mask: the destination bits kept)."""
    if pos >= dst:
        return (word >> (pos - dst)) & mask
    return (word << (dst - pos)) & mask


@triton.jit
def _q6k_piece(x64_ptr, s0, a, b, c, sc0, sc1, sc2, sc3, d, NSB: tl.constexpr, SB: tl.constexpr,
               BLOCK_N: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """x . W over one resident Q6_K tile (from _q6k_tile), float32 [BLOCK_N]. Element 128 h + 32 j + l of a
    super-block (l = 4 w + i) has quant q = ql nibble | qh bit pair << 4 (ql byte l's low nibble for j = 0,
    byte l + 32's for j = 1, their high nibbles for j = 2, 3; qh byte l's bits 2 j) and weight d sc (q - 32),
    sc the int8 scale 8 h + 2 j + w // 4 (sc0..sc3 by j). From f = 1 + q / 64 (q's bits in 1.0's mantissa: no conversion) the
    weight is one FMA, a f + c with a = 64 d sc and c = -96 d sc (both exact in float32); one FMA into an
    elementwise accumulator, reduced once."""
    s = s0 + tl.arange(0, SB)[None, None, :, None]
    h = tl.arange(0, 2)[None, :, None, None]
    w = tl.arange(0, 8)[:, None, None, None]
    acc = tl.zeros([8, 2, SB, BLOCK_N], tl.float32)
    d64 = 64.0 * d
    d96 = -96.0 * d
    for j in tl.static_range(4):
        sc = sc0 if j == 0 else (sc1 if j == 1 else (sc2 if j == 2 else sc3))
        aj = d64 * sc
        cj = d96 * sc
        src = a if j % 2 == 0 else b
        # x's 4 elements 128 h + 32 j + 4 w .. as one int64, read in the words' shape for every row, its
        # offset along w written as (2 w) // 2 so that the compiler sees it no more contiguous than the
        # words' (2 w: int16 pairs): the same layout (else the accumulator is converted at every update)
        xat = s * 64 + h * 32 + 8 * j + (2 * w) // 2
        xat, _ = tl.broadcast(xat, a)
        if EVEN:
            xw = tl.load(x64_ptr + xat)
        else:  # a missing super-block's x is 0 (its weights are 0: no NaN)
            xw = tl.load(x64_ptr + xat, mask=s < NSB, other=0)
        # the 4 quants of the word, a byte each: the nibbles j // 2 and the qh pairs j (bits 4, 5 of each byte)
        q4 = ((src >> (4 * (j // 2))) & 0x0F0F0F0F) | _bits(c, 2 * j, 4, 0x30303030)
        acc = _q6k_fma(acc, q4, xw.to(tl.int32), (xw >> 32).to(tl.int32), aj, cj, ASM)
    return tl.sum(tl.sum(tl.sum(acc, axis=0), axis=0), axis=0)


@triton.jit
def _q6k_fma(acc, q4, xlo, xhi, a, c, ASM: tl.constexpr):
    """acc + the dot of the 4 weights a f + c of word q4 (6-bit quants, one a byte; f = 1 + q / 64) with the 4
    bfloat16 of x in xlo, xhi: per element a shift, one lop3 into 1.0's mantissa, an FMA, one op for x, an FMA."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{ .reg .b32 t, f, w, e;
            mov.b32 $0, $6;
            shl.b32 t, $1, 17; lop3.b32 f, t, 0x7E0000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $4, $5;
            shl.b32 e, $2, 16; fma.rn.f32 $0, w, e, $0;
            shl.b32 t, $1, 9; lop3.b32 f, t, 0x7E0000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $4, $5;
            and.b32 e, $2, 0xFFFF0000; fma.rn.f32 $0, w, e, $0;
            shl.b32 t, $1, 1; lop3.b32 f, t, 0x7E0000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $4, $5;
            shl.b32 e, $3, 16; fma.rn.f32 $0, w, e, $0;
            shr.b32 t, $1, 7; lop3.b32 f, t, 0x7E0000, 0x3F800000, 0xEA; fma.rn.f32 w, f, $4, $5;
            and.b32 e, $3, 0xFFFF0000; fma.rn.f32 $0, w, e, $0; }""",
            "=f,r,r,r,f,f,f", [q4, xlo, xhi, a, c, acc], dtype=tl.float32, is_pure=True, pack=1)
    for i in tl.static_range(4):
        f = (_bits(q4, 8 * i, 17, 0x7E0000) | 0x3F800000).to(tl.float32, bitcast=True)
        xi = xlo if i < 2 else xhi
        xf = ((xi << 16) if i % 2 == 0 else (xi & -65536)).to(tl.float32, bitcast=True)
        acc += (f * a + c) * xf
    return acc


@triton.jit
def _q6k_rows_resident(x64_ptr, i16_ptr, u8_ptr, n, N, NSB: tl.constexpr, SB: tl.constexpr, SB1: tl.constexpr,
                       BLOCK_N: tl.constexpr, EVEN: tl.constexpr, EVEN1: tl.constexpr, SILU_MUL: tl.constexpr,
                       ASM: tl.constexpr, PDL: tl.constexpr):
    """_q4k_rows_resident for Q6_K rows."""
    rowoff = n.to(tl.int64)[None, None, None, :] * (NSB * 105)
    okn = (n < N)[None, None, None, :]
    a, b, c, s0, s1, s2, s3, d = _q6k_tile(i16_ptr, u8_ptr, rowoff, okn, 0, NSB, SB, EVEN)
    if SB1 > 0:
        a1, b1, c1, t0, t1, t2, t3, d1 = _q6k_tile(i16_ptr, u8_ptr, rowoff, okn, SB, NSB, SB1, EVEN1)
    if SILU_MUL:
        upoff = rowoff + N * (NSB * 105)
        ua, ub, uc, u0, u1, u2, u3, ud = _q6k_tile(i16_ptr, u8_ptr, upoff, okn, 0, NSB, SB, EVEN)
        if SB1 > 0:
            va, vb, vc, v0, v1, v2, v3, vd = _q6k_tile(i16_ptr, u8_ptr, upoff, okn, SB, NSB, SB1, EVEN1)
    wait_prior(PDL)
    acc = _q6k_piece(x64_ptr, 0, a, b, c, s0, s1, s2, s3, d, NSB, SB, BLOCK_N, EVEN, ASM)
    if SB1 > 0:
        acc += _q6k_piece(x64_ptr, SB, a1, b1, c1, t0, t1, t2, t3, d1, NSB, SB1, BLOCK_N, EVEN1, ASM)
    up = acc
    if SILU_MUL:
        up = _q6k_piece(x64_ptr, 0, ua, ub, uc, u0, u1, u2, u3, ud, NSB, SB, BLOCK_N, EVEN, ASM)
        if SB1 > 0:
            up += _q6k_piece(x64_ptr, SB, va, vb, vc, v0, v1, v2, v3, vd, NSB, SB1, BLOCK_N, EVEN1, ASM)
    return acc, up


@triton.jit
def q6k_gemv1_kernel(x64_ptr, i16_ptr, u8_ptr, b_ptr, out_ptr, N, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, SB1: tl.constexpr,
                     EVEN: tl.constexpr, EVEN1: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    """q4k_gemv1_kernel's resident form for Q6_K weights (i16_ptr, u8_ptr: the blocks as int16, as bytes)."""
    NSB: tl.constexpr = K // 256
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc, up = _q6k_rows_resident(x64_ptr, i16_ptr, u8_ptr, n, N, NSB, SB, SB1, BLOCK_N, EVEN, EVEN1, SILU_MUL, ASM, PDL)
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


def resident_tiles(k: int) -> tuple[int, int]:
    """(SB, SB1) of a resident row of k // 256 super-blocks: the largest power of two <= it, and the power of
    two >= the rest (0 if none): 6 -> (4, 2), 35 -> (32, 4)."""
    nsb = k // 256
    sb = 1 << (nsb.bit_length() - 1)
    rest = nsb - sb
    return sb, (1 << (rest - 1).bit_length()) if rest else 0


def q4k_gemv1_config(n: int, k: int, resident: bool = False) -> dict:
    """Tiles of q4k_gemv1_kernel for an [n, k] Q4_K weight: SB super-blocks a step (4 chunk threads each, so
    4 SB threads a row), BLOCK_N rows a program. From session 24's sweep on an H100 (docs/BENCHMARKS.md): below
    16,384 rows, SB 8 and 4 rows a program of 4 warps (o 2.9 us, down 10.6, each within 3% of the best tile);
    from there on, where there are programs enough, SB 1 and 16 rows a program of 2 warps (gate_up 12.5 us,
    the best; LM head 88.7, 7% over the best). resident: the resident form (RES=1), 4 warps, 8 rows a program
    for rows of up to 2048 elements, 4 for longer ones (offline sm_90a SASS, scripts/gemv1_sm90_compile.py:
    5.1-7.3 instructions a weight, at most 168 registers; not yet swept on a GPU)."""
    if resident:
        return dict(RES=1, BLOCK_N=8 if k <= 2048 else 4, num_warps=4)
    if n >= 16384:
        return dict(BLOCK_N=16, SB=1, num_warps=2)
    return dict(BLOCK_N=4, SB=8, num_warps=4)


def q6k_gemv1_config(n: int, k: int) -> dict:
    """Tiles of q6k_gemv1_kernel for an [n, k] Q6_K weight (always resident: every byte of a program's rows
    requested at once): 4 warps, 4 rows a program for rows of up to 2048 elements, 2 for longer ones (offline
    sm_90a SASS: 10.5-12 instructions a weight, 48 / 104 registers; not yet swept on a GPU)."""
    return dict(BLOCK_N=4 if k <= 2048 else 2, num_warps=4)
