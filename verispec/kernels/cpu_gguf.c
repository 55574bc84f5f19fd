/* GGUF-block matmul on the CPU (verispec/kernels/cpu_gguf.py builds and loads this file).

   y[i, r] = sum_k x[i, k] * W[r, k] for the rows i < m of float32 activations x, W held as its GGUF
   blocks (row r: k / BLOCK blocks of the type's bytes). Each block is dequantized exactly as
   loader/dequant.py does (float32: scale * q + bias), so the only difference from the float32
   reference matmul is the order of the float32 sums. Rows of W are split over OpenMP threads (the
   same libgomp torch runs on). vs_dequant writes the float32 weight itself (large m: torch's GEMM).

   Types: Q8_0, Q5_0, Q4_0 (32 per block), Q4_K, Q6_K (256 per block). AVX-512 where the compiler
   targets it, else AVX2 with FMA (8 lanes instead of 16), plain C otherwise (the same results up to
   summation order). vs_gemv_int8: rows of x through an integer dot (x rounded to int8; see there). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define VS_AVX2 1
#endif

enum { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };
#define MAX_M 16
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead in the weight stream (memory-level parallelism) */
#endif

static inline __attribute__((always_inline)) float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static int block_elems(int t) { return (t == T_Q4_K || t == T_Q6_K) ? 256 : 32; }

static int block_bytes(int t) {
    switch (t) {
    case T_Q4_0: return 18;
    case T_Q5_0: return 22;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* One block -> out[block_elems] float32, the values dequant.py gives. */
static void deq_q8_0(const uint8_t *b, float *out) {
    float d = f16(b);
    const int8_t *q = (const int8_t *)(b + 2);
#ifdef __AVX512F__
    __m512 vd = _mm512_set1_ps(d);
    for (int h = 0; h < 2; h++) {
        __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
        _mm512_store_ps(out + 16 * h, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(v)));
    }
#else
    for (int j = 0; j < 32; j++) out[j] = d * (float)q[j];
#endif
}

static void deq_q5_0(const uint8_t *b, float *out) {
    float d = f16(b);
    uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
    const uint8_t *qs = b + 6;
#ifdef __AVX512F__
    __m512 vd = _mm512_set1_ps(d);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
    __m512i sixteen = _mm512_set1_epi32(16);
    lo = _mm512_mask_add_epi32(lo, (__mmask16)(qh & 0xFFFF), lo, sixteen); /* bit j: element j's fifth bit */
    hi = _mm512_mask_add_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen);
    _mm512_store_ps(out, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, sixteen))));
    _mm512_store_ps(out + 16, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, sixteen))));
#else
    for (int j = 0; j < 16; j++) {
        int x0 = (qs[j] & 15) | (((qh >> j) & 1) << 4), x1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        out[j] = d * (float)(x0 - 16);
        out[j + 16] = d * (float)(x1 - 16);
    }
#endif
}

static void deq_q4_0(const uint8_t *b, float *out) {
    float d = f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)((qs[j] & 15) - 8);
        out[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

static void deq_q4_k(const uint8_t *b, float *out) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int j = 0; j < 8; j++) { /* sub-block j: 6-bit scale and min */
        int sc, mn;
        if (j < 4) {
            sc = s[j] & 63;
            mn = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        float scale = d * (float)sc, bias = -(dmin * (float)mn);
        const uint8_t *q = qs + 32 * (j / 2);
        int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) out[32 * j + l] = scale * (float)((q[l] >> shift) & 15) + bias;
    }
}

static void deq_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16(b + 208);
    for (int half = 0; half < 2; half++) { /* 128 values each: ql[64], qh[32], 8 scales */
        const uint8_t *l = ql + 64 * half, *h = qh + 32 * half;
        float *o = out + 128 * half;
        const int8_t *s = sc + 8 * half;
        for (int i = 0; i < 32; i++) {
            int is = i / 16;
            int q1 = ((l[i] & 15) | (((h[i] >> 0) & 3) << 4)) - 32;
            int q2 = ((l[i + 32] & 15) | (((h[i] >> 2) & 3) << 4)) - 32;
            int q3 = ((l[i] >> 4) | (((h[i] >> 4) & 3) << 4)) - 32;
            int q4 = ((l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4)) - 32;
            o[i] = (d * (float)s[is]) * (float)q1;
            o[i + 32] = (d * (float)s[is + 2]) * (float)q2;
            o[i + 64] = (d * (float)s[is + 4]) * (float)q3;
            o[i + 96] = (d * (float)s[is + 6]) * (float)q4;
        }
    }
}

typedef void (*deq_fn)(const uint8_t *, float *);

static deq_fn deq_of(int t) {
    switch (t) {
    case T_Q4_0: return deq_q4_0;
    case T_Q5_0: return deq_q5_0;
    case T_Q8_0: return deq_q8_0;
    case T_Q4_K: return deq_q4_k;
    case T_Q6_K: return deq_q6_k;
    default: return 0;
    }
}

int vs_block_elems(int t) { return deq_of(t) ? block_elems(t) : 0; }
int vs_block_bytes(int t) { return deq_of(t) ? block_bytes(t) : 0; }
int vs_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
/* The vector width of the GEMVs in bits: 512 (AVX-512), 256 (AVX2 + FMA), 0 (plain C). */
int vs_simd_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(VS_AVX2)
    return 256;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
/* The 32-element types in registers: q0, q1 the block's quants as float32 (elements 0-15, 16-31), d its
   scale; value = d * q exactly as dequant.py (a float32 product of two floats holding integers / halves). */
#define Q8_0_QUANTS(b, q0, q1, d)                                                                  \
    __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))); \
    __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))); \
    float d = f16(b)

#define Q5_0_QUANTS(b, q0, q1, d)                                                                  \
    __m512i v_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 6)));                    \
    uint32_t qh_;                                                                                  \
    memcpy(&qh_, b + 2, 4);                                                                        \
    const __m512i s16_ = _mm512_set1_epi32(16);                                                    \
    /* q = nibble + 16 * bit - 16: subtract 16 where the fifth bit is clear */                      \
    __m512 q0 = _mm512_cvtepi32_ps(_mm512_mask_sub_epi32(_mm512_and_si512(v_, _mm512_set1_epi32(15)), \
                                                         (__mmask16)~(qh_ & 0xFFFF),                 \
                                                         _mm512_and_si512(v_, _mm512_set1_epi32(15)), s16_)); \
    __m512 q1 = _mm512_cvtepi32_ps(_mm512_mask_sub_epi32(_mm512_srli_epi32(v_, 4), (__mmask16)~(qh_ >> 16), \
                                                         _mm512_srli_epi32(v_, 4), s16_));            \
    float d = f16(b)

#define Q4_0_QUANTS(b, q0, q1, d)                                                                  \
    __m512i v_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));                    \
    const __m512i s8_ = _mm512_set1_epi32(8);                                                      \
    __m512 q0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v_, _mm512_set1_epi32(15)), s8_)); \
    __m512 q1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v_, 4), s8_));                \
    float d = f16(b)

/* Rows [r0, r1) of W for one row of x: four blocks per iteration into four accumulators (FMA latency). */
#define BLOCK_DOT(b, xb, acc, QUANTS)                                                              \
    do {                                                                                           \
        QUANTS(b, q0, q1, d);                                                                      \
        __m512 s_ = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb))); \
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), s_, acc);                                         \
    } while (0)

#define GEMV32_ONE(NAME, BB, QUANTS)                                                               \
    static void NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const float *x, float *y) { \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const uint8_t *wr = w + r * nb * BB;                                                   \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                            \
            int64_t blk = 0;                                                                       \
            for (; blk + 4 <= nb; blk += 4) {                                                      \
                const uint8_t *b = wr + blk * BB;                                                  \
                const float *xb = x + blk * 32;                                                    \
                _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);                             \
                _mm_prefetch((const char *)b + PREFETCH + 64, _MM_HINT_T0);                        \
                BLOCK_DOT(b, xb, a0, QUANTS);                                                      \
                BLOCK_DOT(b + BB, xb + 32, a1, QUANTS);                                            \
                BLOCK_DOT(b + 2 * BB, xb + 64, a2, QUANTS);                                        \
                BLOCK_DOT(b + 3 * BB, xb + 96, a3, QUANTS);                                        \
            }                                                                                      \
            for (; blk < nb; blk++) BLOCK_DOT(wr + blk * BB, x + blk * 32, a0, QUANTS);            \
            y[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))); \
        }                                                                                          \
    }

/* Rows [r0, r1) of W for m rows of x (each block's quants converted once, used m times). */
#define GEMV32_MANY(NAME, BB, QUANTS)                                                              \
    static void NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const float *x, int64_t m, \
                     int64_t ldx, float *y, int64_t ldy) {                                          \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const uint8_t *wr = w + r * nb * BB;                                                   \
            __m512 acc[MAX_M];                                                                     \
            for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();                              \
            for (int64_t blk = 0; blk < nb; blk++) {                                               \
                const uint8_t *b = wr + blk * BB;                                                  \
                QUANTS(b, q0, q1, d);                                                              \
                __m512 vd = _mm512_set1_ps(d);                                                     \
                const float *xb = x + blk * 32;                                                    \
                for (int i = 0; i < m; i++) {                                                      \
                    __m512 s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + i * ldx + 16),             \
                                               _mm512_mul_ps(q0, _mm512_loadu_ps(xb + i * ldx)));   \
                    acc[i] = _mm512_fmadd_ps(vd, s, acc[i]);                                       \
                }                                                                                  \
            }                                                                                      \
            for (int i = 0; i < m; i++) y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]);             \
        }                                                                                          \
    }

/* Q6_K for one row of x: a 256-element block is 16 sub-blocks of 16 (element 32 g + o + i of a half takes
   ql[32 (g & 1) + o + i] (low nibble for g < 2, high for g >= 2), bits 2g of qh[o + i], and scale sc[2g + o/16]). */
static inline __attribute__((always_inline)) void q6k_block(const uint8_t *b, const float *xb, __m512 *a0,
                                                            __m512 *a1) {
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16(b + 208);
    const __m512i m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3), s32 = _mm512_set1_epi32(32);
    for (int half = 0; half < 2; half++) {
        const uint8_t *l = b + 64 * half, *h = b + 128 + 32 * half;
        __m512i hv[2], lv[2][2];
        for (int o = 0; o < 2; o++) {
            hv[o] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(h + 16 * o)));
            for (int c = 0; c < 2; c++)
                lv[c][o] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(l + 32 * c + 16 * o)));
        }
        for (int g = 0; g < 4; g++) {
            for (int o = 0; o < 2; o++) {
                __m512i lo = lv[g & 1][o];
                if (g >= 2) lo = _mm512_srli_epi32(lo, 4);
                lo = _mm512_and_si512(lo, m15);
                __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hv[o], 2 * g), m3), 4);
                __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(lo, hi), s32));
                __m512 t = _mm512_mul_ps(q, _mm512_loadu_ps(xb + 128 * half + 32 * g + 16 * o));
                float scale = d * (float)sc[8 * half + 2 * g + o];
                if (o == 0) *a0 = _mm512_fmadd_ps(_mm512_set1_ps(scale), t, *a0);
                else *a1 = _mm512_fmadd_ps(_mm512_set1_ps(scale), t, *a1);
            }
        }
    }
}

/* Q4_K for one row of x: sub-block j (32 elements) takes the low (j even) or high nibbles of qs[32 (j / 2) ..],
   value = (d sc_j) q + (-(dmin m_j)) as dequant.py (here one fused multiply-add per element). */
static void one_q4_k(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const float *x, float *y) {
    const __m512i m15 = _mm512_set1_epi32(15);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb * 144;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = wr + blk * 144, *s = b + 4, *qs = b + 16;
            _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)b + PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)b + PREFETCH + 128, _MM_HINT_T0);
            float d = f16(b), dmin = f16(b + 2);
            const float *xb = x + blk * 256;
            for (int c = 0; c < 4; c++) {
                __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c)));
                __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16)));
                for (int hi = 0; hi < 2; hi++) {
                    int j = 2 * c + hi, sc, mn;
                    if (j < 4) {
                        sc = s[j] & 63;
                        mn = s[j + 4] & 63;
                    } else {
                        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
                        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
                    }
                    __m512 vs = _mm512_set1_ps(d * (float)sc), vm = _mm512_set1_ps(-(dmin * (float)mn));
                    __m512i u0 = hi ? _mm512_srli_epi32(v0, 4) : v0, u1 = hi ? _mm512_srli_epi32(v1, 4) : v1;
                    __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(u0, m15)), vs, vm);
                    __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(u1, m15)), vs, vm);
                    a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + 32 * j), a0);
                    a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 32 * j + 16), a1);
                }
            }
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

static void one_q6_k(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const float *x, float *y) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb * 210;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = wr + blk * 210;
            for (int p = 0; p < 256; p += 64) _mm_prefetch((const char *)b + PREFETCH + p, _MM_HINT_T0);
            q6k_block(b, x + blk * 256, &a0, &a1);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

GEMV32_ONE(one_q8_0, 34, Q8_0_QUANTS)
GEMV32_ONE(one_q5_0, 22, Q5_0_QUANTS)
GEMV32_ONE(one_q4_0, 18, Q4_0_QUANTS)
GEMV32_MANY(many_q8_0, 34, Q8_0_QUANTS)
GEMV32_MANY(many_q5_0, 22, Q5_0_QUANTS)
GEMV32_MANY(many_q4_0, 18, Q4_0_QUANTS)
#endif

#ifdef __AVX2__
/* 8-lane helpers of the AVX2 kernels (the float ones under VS_AVX2, the integer dot under
   VS_INT8): a 32-element block's quants as 32 int8 bytes in element order (quants_*). */
static inline __attribute__((always_inline)) float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 16 bytes of nibble pairs -> 32 bytes: the low nibbles (elements 0-15), then the high ones (16-31). */
static inline __attribute__((always_inline)) __m256i nibbles32(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

static inline __attribute__((always_inline)) __m256i quants_q8_0(const uint8_t *b) {
    return _mm256_loadu_si256((const __m256i *)(b + 2));
}

static inline __attribute__((always_inline)) __m256i quants_q4_0(const uint8_t *b) {
    return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
}

/* q = nibble + 16 * bit - 16, the bit of element j being bit j of qh: byte j of `set` is 0xFF where it is 1
   (qh's byte j / 8 broadcast to byte j, tested against bit j % 8). */
static inline __attribute__((always_inline)) __m256i quants_q5_0(const uint8_t *b) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m256i pick = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick), bit), bit);
    return _mm256_sub_epi8(nibbles32(b + 6), _mm256_andnot_si256(set, _mm256_set1_epi8(16)));
}

#endif

#ifdef VS_AVX2
/* AVX2 + FMA: the same kernels as above on 8 lanes. A 32-element block's quants become 32 int8 bytes in
   element order (quants_*), then four 8-lane float32 vectors. */

/* int8 quants of elements 8 i .. 8 i + 7 of 32 bytes q, as float32. */
static inline __attribute__((always_inline)) __m256 q8_part(__m256i q, int i) {
    __m128i h = i < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    if (i & 1) h = _mm_srli_si128(h, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h));
}

/* sum_j q_j x_j over one 32-element block, in 8 lanes. */
static inline __attribute__((always_inline)) __m256 dot32(__m256i q, const float *xb) {
    __m256 s = _mm256_mul_ps(q8_part(q, 0), _mm256_loadu_ps(xb));
    s = _mm256_fmadd_ps(q8_part(q, 1), _mm256_loadu_ps(xb + 8), s);
    s = _mm256_fmadd_ps(q8_part(q, 2), _mm256_loadu_ps(xb + 16), s);
    return _mm256_fmadd_ps(q8_part(q, 3), _mm256_loadu_ps(xb + 24), s);
}

#define BLOCK_DOT8(b, xb, acc, QUANTS) acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b)), dot32(QUANTS(b), xb), acc)

#define GEMV32_ONE8(NAME, BB, QUANTS)                                                              \
    static void NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const float *x, float *y) { \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const uint8_t *wr = w + r * nb * BB;                                                   \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                            \
            int64_t blk = 0;                                                                       \
            for (; blk + 4 <= nb; blk += 4) {                                                      \
                const uint8_t *b = wr + blk * BB;                                                  \
                const float *xb = x + blk * 32;                                                    \
                _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);                             \
                _mm_prefetch((const char *)b + PREFETCH + 64, _MM_HINT_T0);                        \
                BLOCK_DOT8(b, xb, a0, QUANTS);                                                     \
                BLOCK_DOT8(b + BB, xb + 32, a1, QUANTS);                                           \
                BLOCK_DOT8(b + 2 * BB, xb + 64, a2, QUANTS);                                       \
                BLOCK_DOT8(b + 3 * BB, xb + 96, a3, QUANTS);                                       \
            }                                                                                      \
            for (; blk < nb; blk++) BLOCK_DOT8(wr + blk * BB, x + blk * 32, a0, QUANTS);           \
            y[r] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));             \
        }                                                                                          \
    }

#define GEMV32_MANY8(NAME, BB, QUANTS)                                                             \
    static void NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const float *x, int64_t m, \
                     int64_t ldx, float *y, int64_t ldy) {                                          \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const uint8_t *wr = w + r * nb * BB;                                                   \
            __m256 acc[MAX_M];                                                                     \
            for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();                              \
            for (int64_t blk = 0; blk < nb; blk++) {                                               \
                const uint8_t *b = wr + blk * BB;                                                  \
                __m256i q = QUANTS(b);                                                             \
                __m256 q0 = q8_part(q, 0), q1 = q8_part(q, 1), q2 = q8_part(q, 2), q3 = q8_part(q, 3); \
                __m256 vd = _mm256_set1_ps(f16(b));                                                \
                const float *xb = x + blk * 32;                                                    \
                for (int i = 0; i < m; i++) {                                                      \
                    const float *xi = xb + i * ldx;                                                \
                    __m256 s = _mm256_mul_ps(q0, _mm256_loadu_ps(xi));                             \
                    s = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xi + 8), s);                           \
                    s = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xi + 16), s);                          \
                    s = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xi + 24), s);                          \
                    acc[i] = _mm256_fmadd_ps(vd, s, acc[i]);                                       \
                }                                                                                  \
            }                                                                                      \
            for (int i = 0; i < m; i++) y[i * ldy + r] = hsum8(acc[i]);                            \
        }                                                                                          \
    }

/* Q4_K for one row of x, as the AVX-512 one: value = (d sc_j) q + (-(dmin m_j)), eight elements at a time. */
static void one_q4_k(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const float *x, float *y) {
    const __m256i m15 = _mm256_set1_epi32(15);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb * 144;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = wr + blk * 144, *s = b + 4, *qs = b + 16;
            _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)b + PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)b + PREFETCH + 128, _MM_HINT_T0);
            float d = f16(b), dmin = f16(b + 2);
            const float *xb = x + blk * 256;
            for (int j = 0; j < 8; j++) { /* sub-block j: the low (j even) or high nibbles of qs[32 (j / 2) ..] */
                int sc, mn;
                if (j < 4) {
                    sc = s[j] & 63;
                    mn = s[j + 4] & 63;
                } else {
                    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
                    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
                }
                __m256 vs = _mm256_set1_ps(d * (float)sc), vm = _mm256_set1_ps(-(dmin * (float)mn));
                const uint8_t *q = qs + 32 * (j / 2);
                for (int p = 0; p < 4; p++) {
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * p)));
                    if (j & 1) v = _mm256_srli_epi32(v, 4);
                    __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, m15)), vs, vm);
                    if (p & 1) a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xb + 32 * j + 8 * p), a1);
                    else a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xb + 32 * j + 8 * p), a0);
                }
            }
        }
        y[r] = hsum8(_mm256_add_ps(a0, a1));
    }
}

/* Q6_K for one row of x: element 32 g + i of a half (i < 32) takes ql[32 (g & 1) + i] (low nibble for g < 2,
   high for g >= 2), bits 2g of qh[i], and scale sc[2g + i / 16] of the half; eight i at a time. */
static void one_q6_k(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const float *x, float *y) {
    const __m256i m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), s32 = _mm256_set1_epi32(32);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb * 210;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = wr + blk * 210;
            for (int p = 0; p < 256; p += 64) _mm_prefetch((const char *)b + PREFETCH + p, _MM_HINT_T0);
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = f16(b + 208);
            const float *xb = x + blk * 256;
            for (int half = 0; half < 2; half++) {
                const uint8_t *l = b + 64 * half, *h = b + 128 + 32 * half;
                for (int p = 0; p < 4; p++) {
                    __m256i hv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(h + 8 * p)));
                    __m256i lv0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(l + 8 * p)));
                    __m256i lv1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(l + 32 + 8 * p)));
                    for (int g = 0; g < 4; g++) {
                        __m256i lo = (g & 1) ? lv1 : lv0;
                        if (g >= 2) lo = _mm256_srli_epi32(lo, 4);
                        lo = _mm256_and_si256(lo, m15);
                        __m256i hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hv, 2 * g), m3), 4);
                        __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo, hi), s32));
                        __m256 t = _mm256_mul_ps(q, _mm256_loadu_ps(xb + 128 * half + 32 * g + 8 * p));
                        __m256 vs = _mm256_set1_ps(d * (float)sc[8 * half + 2 * g + p / 2]);
                        if (g & 1) a1 = _mm256_fmadd_ps(vs, t, a1);
                        else a0 = _mm256_fmadd_ps(vs, t, a0);
                    }
                }
            }
        }
        y[r] = hsum8(_mm256_add_ps(a0, a1));
    }
}

GEMV32_ONE8(one_q8_0, 34, quants_q8_0)
GEMV32_ONE8(one_q5_0, 22, quants_q5_0)
GEMV32_ONE8(one_q4_0, 18, quants_q4_0)
GEMV32_MANY8(many_q8_0, 34, quants_q8_0)
GEMV32_MANY8(many_q5_0, 22, quants_q5_0)
GEMV32_MANY8(many_q4_0, 18, quants_q4_0)
#endif

/* Any type through its block dequantizer (the 256-element types; everything without AVX-512). */
static void gemv_generic(deq_fn deq, int be, int bb, const uint8_t *w, int64_t r0, int64_t r1, int64_t nb,
                         const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy) {
    float buf[256] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb * bb;
        float acc[MAX_M][16];
        memset(acc, 0, sizeof(acc));
        for (int64_t blk = 0; blk < nb; blk++) {
            deq(wr + blk * bb, buf);
            const float *xb = x + blk * be;
            for (int i = 0; i < m; i++)
                for (int j = 0; j < be; j += 16)
                    for (int l = 0; l < 16; l++) acc[i][l] += buf[j + l] * xb[i * ldx + j + l];
        }
        for (int i = 0; i < m; i++) {
            float s = 0;
            for (int l = 0; l < 16; l++) s += acc[i][l];
            y[i * ldy + r] = s;
        }
    }
}

/* y[i * ldy + r] = x[i * ldx + :k] . W[r], i < m <= MAX_M, r < n. Returns 0, or -1 for bad arguments. */
int vs_gemv(int t, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx,
            float *y, int64_t ldy, int threads) {
    deq_fn deq = deq_of(t);
    int be = block_elems(t), bb = block_bytes(t);
    if (!deq || k % be || m < 1 || m > MAX_M || threads < 1) return -1;
    int64_t nb = k / be;
    int64_t chunk = 16; /* rows per task: whole cache lines of y, and enough tasks to balance */
    int64_t tasks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t r0 = task * chunk, r1 = r0 + chunk < n ? r0 + chunk : n;
#if defined(__AVX512F__) || defined(VS_AVX2)
        if (m == 1 && t == T_Q8_0) { one_q8_0(w, r0, r1, nb, x, y); continue; }
        if (m == 1 && t == T_Q5_0) { one_q5_0(w, r0, r1, nb, x, y); continue; }
        if (m == 1 && t == T_Q4_0) { one_q4_0(w, r0, r1, nb, x, y); continue; }
        if (m == 1 && t == T_Q6_K) { one_q6_k(w, r0, r1, nb, x, y); continue; }
        if (m == 1 && t == T_Q4_K) { one_q4_k(w, r0, r1, nb, x, y); continue; }
        if (t == T_Q8_0) { many_q8_0(w, r0, r1, nb, x, m, ldx, y, ldy); continue; }
        if (t == T_Q5_0) { many_q5_0(w, r0, r1, nb, x, m, ldx, y, ldy); continue; }
        if (t == T_Q4_0) { many_q4_0(w, r0, r1, nb, x, m, ldx, y, ldy); continue; }
#endif
        gemv_generic(deq, be, bb, w, r0, r1, nb, x, m, ldx, y, ldy);
    }
    return 0;
}

/* The integer-dot GEMV: x is rounded to int8 per 32 elements as llama.cpp's Q8_0 (dx = max |x| / 127,
   q = x / dx rounded to nearest even), and each 32 elements' dot is an exact int32 sum of the weight's and x's
   int8 quants (maddubs on |w| and sign(w) x: at most 2 * 128 * 127 per 16-bit pair, no saturation), scaled by
   the float32 scales. Q4_K: per 32-element sub-block d sc_j (q . xq) dx_j - dmin m_j (sum xq) dx_j, q in 0..15;
   Q6_K: per 32 elements, two sub-blocks of 16 whose int8 scales weight the pairs' sums (madd), times d dx.
   Not the float32 reference's arithmetic: x's rounding is the difference (tests/test_cpu_gguf.py bounds it). */
#if defined(__AVX2__) && defined(__FMA__)
#define VS_INT8 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
/* AVX512-VNNI (on 8 lanes): one dpbusd is maddubs + madd, and a block's quants go in as unsigned bytes u with
   q = u - offset, the offset's share (offset * sum x) preloaded into the accumulator: the same exact int32 sums
   as the AVX2 route, fewer instructions a block (the 32-element GEMVs were compute-bound at 2 threads). */
#define VS_VNNI 1
#endif
#ifdef VS_VNNI
#define UDOT32(u, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x)
#else
#define UDOT32(u, x) _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
#endif
static void quantize_x8(const float *x, int64_t nb, int8_t *q, float *dx, int32_t *xs) {
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        dx[b] = d;
        for (int j = 0; j < 32; j++) {
            q[32 * b + j] = (int8_t)lrintf(xb[j] * id);
            sum += q[32 * b + j];
        }
        xs[b] = sum;
    }
}

/* sum over 32 elements of w_j x_j, w and x signed int8 (|w| <= 128, |x| <= 127), as 16 int16 pair sums. */
static inline __attribute__((always_inline)) __m256i ipairs32(__m256i w, const int8_t *xq) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static inline __attribute__((always_inline)) __m256 idot32(__m256i w, const int8_t *xq) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(ipairs32(w, xq), _mm256_set1_epi16(1)));
}

/* idot32 with |w| (the sign trick's first operand) computed once for every row of x. */
static inline __attribute__((always_inline)) __m256 idot32u(__m256i w, __m256i uw, const int8_t *xq) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(uw, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1)));
}

/* The rows of x a multi-row kernel takes at once (its accumulators in registers): left rows in groups of at most
   gmax, as even as can be (5 = 5 or 3 + 2, 8 = 4 + 4). */
static inline int64_t row_group(int64_t left, int64_t gmax) {
    int64_t parts = (left + gmax - 1) / gmax;
    return (left + parts - 1) / parts;
}

/* The 32-element types for m rows of x (row i: xq + i k, its scales dx8 + 8 i nb: dx of each block 8 times; y row
   i: y + i ldy). Each weight block's quants are read and unpacked once for every row, and each row's arithmetic is
   the same at every m (the block scale times dx, one FMA a block into one of two accumulators): a row's result has
   the same bits whatever rows run beside it. */
#define IDOT_ROWS(NAME, BB, QUANTS)                                                                  \
    static inline __attribute__((always_inline)) void NAME##_m(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const int8_t *xq,       \
                     const float *dx8, int64_t ldy, float *y, const int64_t M) {                         \
        const int64_t k = 32 * nb;                                                                 \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const uint8_t *wr = w + r * nb * BB;                                                   \
            __m256 a0[4], a1[4];                                                           \
            for (int64_t i = 0; i < M; i++) a0[i] = a1[i] = _mm256_setzero_ps();                   \
            int64_t blk = 0;                                                                       \
            for (; blk + 2 <= nb; blk += 2) {                                                      \
                const uint8_t *b = wr + blk * BB;                                                  \
                _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);                             \
                __m256i q0 = QUANTS(b), q1 = QUANTS(b + BB);                                       \
                __m256i u0 = _mm256_sign_epi8(q0, q0), u1 = _mm256_sign_epi8(q1, q1);              \
                __m256 w0 = _mm256_set1_ps(f16(b)), w1 = _mm256_set1_ps(f16(b + BB));              \
                for (int64_t i = 0; i < M; i++) {                                                  \
                    const int8_t *xi = xq + i * k + 32 * blk;                                      \
                    const float *di = dx8 + 8 * (i * nb + blk);                                    \
                    a0[i] = _mm256_fmadd_ps(_mm256_mul_ps(w0, _mm256_loadu_ps(di)), idot32u(q0, u0, xi), a0[i]); \
                    a1[i] = _mm256_fmadd_ps(_mm256_mul_ps(w1, _mm256_loadu_ps(di + 8)), idot32u(q1, u1, xi + 32), \
                                            a1[i]);                                                \
                }                                                                                  \
            }                                                                                      \
            for (; blk < nb; blk++) {                                                              \
                const uint8_t *b = wr + blk * BB;                                                  \
                __m256i q0 = QUANTS(b), u0 = _mm256_sign_epi8(q0, q0);                             \
                __m256 w0 = _mm256_set1_ps(f16(b));                                                \
                for (int64_t i = 0; i < M; i++)                                                    \
                    a0[i] = _mm256_fmadd_ps(_mm256_mul_ps(w0, _mm256_loadu_ps(dx8 + 8 * (i * nb + blk))), \
                                            idot32u(q0, u0, xq + i * k + 32 * blk), a0[i]);        \
            }                                                                                      \
            for (int64_t i = 0; i < M; i++) y[i * ldy + r] = hsum8(_mm256_add_ps(a0[i], a1[i]));  \
        }                                                                                          \
    } \
    static void NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const int8_t *xq, const float *dx8, int64_t m, int64_t ldy, float *y) { \
        for (int64_t i0 = 0; i0 < m;) {                                                            \
            const int64_t g = row_group(m - i0, 4);                                              \
            switch (g) {                                                                           \
                case 1: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, ldy, y + i0 * ldy, 1); break; \
                case 2: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, ldy, y + i0 * ldy, 2); break; \
                case 3: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, ldy, y + i0 * ldy, 3); break; \
                case 4: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, ldy, y + i0 * ldy, 4); break; \
            }                                                                                      \
            i0 += g;                                                                               \
        }                                                                                          \
    }

#ifndef VS_VNNI /* (with VNNI the 32-element types take VDOT_ROWS / VDOT2_ROWS) */
IDOT_ROWS(idot_q8_0, 34, quants_q8_0)
IDOT_ROWS(idot_q5_0, 22, quants_q5_0)
IDOT_ROWS(idot_q4_0, 18, quants_q4_0)
#endif

#ifdef VS_VNNI
/* A block's quants as unsigned bytes u, q = u - OFFSET (Q8_0: the sign bit flipped, 128; Q4_0: the nibbles, 8;
   Q5_0: the nibbles plus 16 where qh's bit is set, 16). */
#define OFFSET_Q8_0 128
#define OFFSET_Q4_0 8
#define OFFSET_Q5_0 16
static inline __attribute__((always_inline)) __m256i uquants_q8_0(const uint8_t *b) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
}
static inline __attribute__((always_inline)) __m256i uquants_q4_0(const uint8_t *b) { return nibbles32(b + 2); }
static inline __attribute__((always_inline)) __m256i uquants_q5_0(const uint8_t *b) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    __m256i v = nibbles32(b + 6);
    return _mm256_mask_add_epi8(v, (__mmask32)qh, v, _mm256_set1_epi8(16));
}

/* xo: per x block 8 int32, lane 0 -OFFSET * sum xq, the rest 0 (the accumulator each block's dpbusd starts from);
   row i's at xo + 8 i nb. Rows, scales and the result as IDOT_ROWS. */
#define VDOT_ROWS(NAME, BB, UQUANTS)                                                                 \
    static inline __attribute__((always_inline)) void NAME##_m(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const int8_t *xq,       \
                     const float *dx8, const int32_t *xo, int64_t ldy, float *y, const int64_t M) {      \
        const int64_t k = 32 * nb;                                                                 \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const uint8_t *wr = w + r * nb * BB;                                                   \
            __m256 a0[4], a1[4];                                                           \
            for (int64_t i = 0; i < M; i++) a0[i] = a1[i] = _mm256_setzero_ps();                   \
            int64_t blk = 0;                                                                       \
            for (; blk + 2 <= nb; blk += 2) {                                                      \
                const uint8_t *b = wr + blk * BB;                                                  \
                _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);                             \
                __m256i q0 = UQUANTS(b), q1 = UQUANTS(b + BB);                                     \
                __m256 w0 = _mm256_set1_ps(f16(b)), w1 = _mm256_set1_ps(f16(b + BB));              \
                for (int64_t i = 0; i < M; i++) {                                                  \
                    const int64_t o = 8 * (i * nb + blk);                                          \
                    const int8_t *xi = xq + i * k + 32 * blk;                                      \
                    __m256i p0 = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(xo + o)), q0, \
                                                     _mm256_loadu_si256((const __m256i *)xi));     \
                    __m256i p1 = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(xo + o + 8)), q1, \
                                                     _mm256_loadu_si256((const __m256i *)(xi + 32))); \
                    a0[i] = _mm256_fmadd_ps(_mm256_mul_ps(w0, _mm256_loadu_ps(dx8 + o)), _mm256_cvtepi32_ps(p0), a0[i]); \
                    a1[i] = _mm256_fmadd_ps(_mm256_mul_ps(w1, _mm256_loadu_ps(dx8 + o + 8)), _mm256_cvtepi32_ps(p1), \
                                            a1[i]);                                                \
                }                                                                                  \
            }                                                                                      \
            for (; blk < nb; blk++) {                                                              \
                const uint8_t *b = wr + blk * BB;                                                  \
                __m256i q0 = UQUANTS(b);                                                           \
                __m256 w0 = _mm256_set1_ps(f16(b));                                                \
                for (int64_t i = 0; i < M; i++) {                                                  \
                    const int64_t o = 8 * (i * nb + blk);                                          \
                    __m256i p = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(xo + o)), q0, \
                                                    _mm256_loadu_si256((const __m256i *)(xq + i * k + 32 * blk))); \
                    a0[i] = _mm256_fmadd_ps(_mm256_mul_ps(w0, _mm256_loadu_ps(dx8 + o)), _mm256_cvtepi32_ps(p), a0[i]); \
                }                                                                                  \
            }                                                                                      \
            for (int64_t i = 0; i < M; i++) y[i * ldy + r] = hsum8(_mm256_add_ps(a0[i], a1[i]));  \
        }                                                                                          \
    } \
    static void NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const int8_t *xq, const float *dx8, const int32_t *xo, int64_t m, int64_t ldy, float *y) { \
        for (int64_t i0 = 0; i0 < m;) {                                                            \
            const int64_t g = row_group(m - i0, 4);                                              \
            switch (g) {                                                                           \
                case 1: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 1); break; \
                case 2: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 2); break; \
                case 3: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 3); break; \
                case 4: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 4); break; \
            }                                                                                      \
            i0 += g;                                                                               \
        }                                                                                          \
    }

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* Two consecutive blocks on 16 lanes (AVX-512): one dpbusd, one convert and one FMA for both, a scale vector
   whose low 8 lanes are block 0's, the high 8 block 1's. An odd last block takes the 8-lane step. */
static inline __attribute__((always_inline)) __m512i pair512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
/* The nibbles of two blocks' 16 bytes each, in element order: [low 0, high 0, low 1, high 1] (16 bytes each). */
static inline __attribute__((always_inline)) __m512i nibbles64(const uint8_t *p0, const uint8_t *p1) {
    __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)p1), _mm_loadu_si128((const __m128i *)p0));
    __m256i m = _mm256_set1_epi8(15);
    __m512i z = pair512(_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}
static inline __attribute__((always_inline)) __m512i uquants2_q8_0(const uint8_t *b, const uint8_t *c) {
    return _mm512_xor_si512(pair512(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_loadu_si256((const __m256i *)(c + 2))),
                            _mm512_set1_epi8((char)0x80));
}
static inline __attribute__((always_inline)) __m512i uquants2_q4_0(const uint8_t *b, const uint8_t *c) {
    return nibbles64(b + 2, c + 2);
}
static inline __attribute__((always_inline)) __m512i uquants2_q5_0(const uint8_t *b, const uint8_t *c) {
    uint32_t h0, h1;
    memcpy(&h0, b + 2, 4);
    memcpy(&h1, c + 2, 4);
    __m512i v = nibbles64(b + 6, c + 6);
    return _mm512_mask_add_epi8(v, (__mmask64)(((uint64_t)h1 << 32) | h0), v, _mm512_set1_epi8(16));
}

/* VDOT_ROWS with two blocks on 16 lanes: block pairs into two accumulators (blocks 4j, 4j + 1 and 4j + 2, 4j + 3),
   the blocks past the last multiple of 4 on 8 lanes. */
#define VDOT2_ROWS(NAME, BB, UQUANTS2, UQUANTS)                                                      \
    static inline __attribute__((always_inline)) void NAME##_m(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const int8_t *xq,       \
                     const float *dx8, const int32_t *xo, int64_t ldy, float *y, const int64_t M) {      \
        const int64_t k = 32 * nb;                                                                 \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const uint8_t *wr = w + r * nb * BB;                                                   \
            __m512 a0[5], a1[5];                                                           \
            __m256 t[5];                                                                       \
            for (int64_t i = 0; i < M; i++) {                                                      \
                a0[i] = a1[i] = _mm512_setzero_ps();                                               \
                t[i] = _mm256_setzero_ps();                                                        \
            }                                                                                      \
            int64_t blk = 0;                                                                       \
            for (; blk + 4 <= nb; blk += 4) {                                                      \
                const uint8_t *b = wr + blk * BB;                                                  \
                _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);                             \
                _mm_prefetch((const char *)b + PREFETCH + 64, _MM_HINT_T0);                        \
                __m512i q0 = UQUANTS2(b, b + BB), q1 = UQUANTS2(b + 2 * BB, b + 3 * BB);          \
                __m512 w0 = _mm512_insertf32x8(_mm512_set1_ps(f16(b)), _mm256_set1_ps(f16(b + BB)), 1); \
                __m512 w1 = _mm512_insertf32x8(_mm512_set1_ps(f16(b + 2 * BB)), _mm256_set1_ps(f16(b + 3 * BB)), 1); \
                for (int64_t i = 0; i < M; i++) {                                                  \
                    const int64_t o = 8 * (i * nb + blk);                                          \
                    const int8_t *xi = xq + i * k + 32 * blk;                                      \
                    __m512i p0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(xo + o), q0, _mm512_loadu_si512(xi)); \
                    __m512i p1 = _mm512_dpbusd_epi32(_mm512_loadu_si512(xo + o + 16), q1, _mm512_loadu_si512(xi + 64)); \
                    a0[i] = _mm512_fmadd_ps(_mm512_mul_ps(w0, _mm512_loadu_ps(dx8 + o)), _mm512_cvtepi32_ps(p0), a0[i]); \
                    a1[i] = _mm512_fmadd_ps(_mm512_mul_ps(w1, _mm512_loadu_ps(dx8 + o + 16)), _mm512_cvtepi32_ps(p1), \
                                            a1[i]);                                                \
                }                                                                                  \
            }                                                                                      \
            for (; blk < nb; blk++) {                                                              \
                const uint8_t *b = wr + blk * BB;                                                  \
                __m256i q = UQUANTS(b);                                                            \
                __m256 w8 = _mm256_set1_ps(f16(b));                                                \
                for (int64_t i = 0; i < M; i++) {                                                  \
                    const int64_t o = 8 * (i * nb + blk);                                          \
                    __m256i p = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(xo + o)), q, \
                                                    _mm256_loadu_si256((const __m256i *)(xq + i * k + 32 * blk))); \
                    t[i] = _mm256_fmadd_ps(_mm256_mul_ps(w8, _mm256_loadu_ps(dx8 + o)), _mm256_cvtepi32_ps(p), t[i]); \
                }                                                                                  \
            }                                                                                      \
            for (int64_t i = 0; i < M; i++)                                                        \
                y[i * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i])) + hsum8(t[i]);  \
        }                                                                                          \
    } \
    static void NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const int8_t *xq, const float *dx8, const int32_t *xo, int64_t m, int64_t ldy, float *y) { \
        for (int64_t i0 = 0; i0 < m;) {                                                            \
            const int64_t g = row_group(m - i0, 5);                                              \
            switch (g) {                                                                           \
                case 1: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 1); break; \
                case 2: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 2); break; \
                case 3: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 3); break; \
                case 4: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 4); break; \
                case 5: NAME##_m(w, r0, r1, nb, xq + 32 * i0 * nb, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, ldy, y + i0 * ldy, 5); break; \
            }                                                                                      \
            i0 += g;                                                                               \
        }                                                                                          \
    }

VDOT2_ROWS(vdot_q8_0, 34, uquants2_q8_0, uquants_q8_0)
VDOT2_ROWS(vdot_q5_0, 22, uquants2_q5_0, uquants_q5_0)
VDOT2_ROWS(vdot_q4_0, 18, uquants2_q4_0, uquants_q4_0)
#else
VDOT_ROWS(vdot_q8_0, 34, uquants_q8_0)
VDOT_ROWS(vdot_q5_0, 22, uquants_q5_0)
VDOT_ROWS(vdot_q4_0, 18, uquants_q4_0)
#endif
#endif

/* Q4_K's eight 6-bit scales (sc[0..7]) and mins (mn[0..7]) of a block's 12 packed bytes s, as deq_q4_k reads
   them: j < 4 takes the low 6 bits of s[j] and s[j + 4]; j >= 4 the nibbles of s[j + 4] with the top 2 bits of
   s[j - 4] and s[j] above them. Four bytes at a time in 32-bit words. */
static inline __attribute__((always_inline)) void q4k_scales_mins(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3], o[4];
    memcpy(u, s, 12);
    const uint32_t low6 = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, top2 = 0x03030303u;
    o[0] = u[0] & low6;                                       /* sc 0..3 */
    o[1] = (u[2] & nib) | (((u[0] >> 6) & top2) << 4);        /* sc 4..7 */
    o[2] = u[1] & low6;                                       /* mn 0..3 */
    o[3] = ((u[2] >> 4) & nib) | (((u[1] >> 6) & top2) << 4); /* mn 4..7 */
    memcpy(sc, o, 8);
    memcpy(mn, o + 2, 8);
}

/* Rows of x the K-quant kernels take at once: 5 where AVX-512VL gives 32 vector registers (5 rows' accumulators
   beside a block's eight unpacked quant vectors), else 4. */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define KQ_GMAX 5
#else
#define KQ_GMAX 4
#endif
/* Rows [r0, r1) of a Q4_K weight for m rows of x (x row i: xq + i * k, dx / xs + i * k / 32; y row i: y + i * n).
   Sub-block 2t takes the low nibbles of qs[32 t ..], 2t + 1 the high ones; each block's nibbles are unpacked
   once for all m rows. The eight sub-blocks' min terms are one 8-lane product per block. */
static inline __attribute__((always_inline)) void idot_q4_k_m(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb,
                                                             const int8_t *xq, const float *dx, const int32_t *xs,
                                                             int64_t n, float *y, const int64_t M) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const int64_t k = 256 * nb;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb * 144;
        __m256 acc[KQ_GMAX], mins[KQ_GMAX];
        for (int64_t i = 0; i < M; i++) acc[i] = mins[i] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = wr + blk * 144, *qs = b + 16;
            _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)b + PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)b + PREFETCH + 128, _MM_HINT_T0);
            uint8_t sc[8], mn[8];
            q4k_scales_mins(b + 4, sc, mn);
            int64_t sv, mv;
            memcpy(&sv, sc, 8);
            memcpy(&mv, mn, 8);
            __m256 ds = _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sv))));
            __m256 dm = _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mv))));
            __m256i q[8];
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * t));
                q[2 * t] = _mm256_and_si256(v, m4);
                q[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            for (int64_t i = 0; i < M; i++) {
                const int8_t *xb = xq + i * k + 256 * blk;
                __m256 db = _mm256_loadu_ps(dx + i * (k / 32) + 8 * blk);
                __m256 sd = _mm256_mul_ps(ds, db);
                mins[i] = _mm256_fmadd_ps(_mm256_mul_ps(dm, db),
                                          _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(xs + i * (k / 32) + 8 * blk))),
                                          mins[i]);
                __m256 a = acc[i];
                for (int j = 0; j < 8; j++) { /* q in 0..15: maddubs on (q, x) directly */
                    __m256i x = _mm256_loadu_si256((const __m256i *)(xb + 32 * j));
                    __m256i p = UDOT32(q[j], x);
                    a = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sd, _mm256_set1_epi32(j)), _mm256_cvtepi32_ps(p), a);
                }
                acc[i] = a;
            }
        }
        for (int64_t i = 0; i < M; i++) y[i * n + r] = hsum8(_mm256_sub_ps(acc[i], mins[i]));
    }
}

static void idot_q4_k(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const int8_t *xq, const float *dx,
                      const int32_t *xs, int64_t m, int64_t n, float *y) {
    const int64_t k = 256 * nb;
    for (int64_t i0 = 0; i0 < m;) {
        const int64_t g = row_group(m - i0, KQ_GMAX);
        const int8_t *x0 = xq + i0 * k;
        const float *d0 = dx + i0 * (k / 32);
        const int32_t *s0 = xs + i0 * (k / 32);
        switch (g) {
        case 1: idot_q4_k_m(w, r0, r1, nb, x0, d0, s0, n, y + i0 * n, 1); break;
        case 2: idot_q4_k_m(w, r0, r1, nb, x0, d0, s0, n, y + i0 * n, 2); break;
        case 3: idot_q4_k_m(w, r0, r1, nb, x0, d0, s0, n, y + i0 * n, 3); break;
        case 4: idot_q4_k_m(w, r0, r1, nb, x0, d0, s0, n, y + i0 * n, 4); break;
        default: idot_q4_k_m(w, r0, r1, nb, x0, d0, s0, n, y + i0 * n, KQ_GMAX); break;
        }
        i0 += g;
    }
}

/* Rows [r0, r1) of a Q6_K weight for m rows of x (layout as idot_q4_k). Element 32 g + e of a half takes
   ql[32 (g & 1) + e] (low nibble for g < 2, high for g >= 2) and bits 2g of qh[e]; q = that 6-bit value - 32;
   elements e < 16 take scale sc[2g] of the half, the rest sc[2g + 1]. */
static inline __attribute__((always_inline)) void idot_q6_k_m(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb,
                                                             const int8_t *xq, const float *dx, int64_t n, float *y,
                                                             const int64_t M) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), s32 = _mm256_set1_epi8(32);
    const int64_t k = 256 * nb;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb * 210;
        __m256 acc[KQ_GMAX];
        for (int64_t i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = wr + blk * 210;
            for (int p = 0; p < 256; p += 64) _mm_prefetch((const char *)b + PREFETCH + p, _MM_HINT_T0);
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = f16(b + 208);
            __m256i q[8], scl[8];
            for (int half = 0; half < 2; half++) {
                const uint8_t *l = b + 64 * half, *h = b + 128 + 32 * half;
                __m256i hv = _mm256_loadu_si256((const __m256i *)h);
                __m256i l0 = _mm256_loadu_si256((const __m256i *)l), l1 = _mm256_loadu_si256((const __m256i *)(l + 32));
                for (int g = 0; g < 4; g++) {
                    __m256i lo = (g & 1) ? l1 : l0;
                    if (g >= 2) lo = _mm256_srli_epi16(lo, 4);
                    lo = _mm256_and_si256(lo, m4);
                    __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * g), m2), 4);
                    q[4 * half + g] = _mm256_sub_epi8(_mm256_or_si256(lo, hi), s32);
                    int s = 8 * half + 2 * g;
                    scl[4 * half + g] = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
                }
            }
            for (int64_t i = 0; i < M; i++) {
                const int8_t *xb = xq + i * k + 256 * blk;
                const float *db = dx + i * (k / 32) + 8 * blk;
                __m256 a = acc[i];
                for (int j = 0; j < 8; j++) {
                    __m256i p = _mm256_madd_epi16(ipairs32(q[j], xb + 32 * j), scl[j]);
                    a = _mm256_fmadd_ps(_mm256_set1_ps(d * db[j]), _mm256_cvtepi32_ps(p), a);
                }
                acc[i] = a;
            }
        }
        for (int64_t i = 0; i < M; i++) y[i * n + r] = hsum8(acc[i]);
    }
}

static void idot_q6_k(const uint8_t *w, int64_t r0, int64_t r1, int64_t nb, const int8_t *xq, const float *dx,
                      int64_t m, int64_t n, float *y) {
    const int64_t k = 256 * nb;
    for (int64_t i0 = 0; i0 < m;) {
        const int64_t g = row_group(m - i0, KQ_GMAX);
        const int8_t *x0 = xq + i0 * k;
        const float *d0 = dx + i0 * (k / 32);
        switch (g) {
        case 1: idot_q6_k_m(w, r0, r1, nb, x0, d0, n, y + i0 * n, 1); break;
        case 2: idot_q6_k_m(w, r0, r1, nb, x0, d0, n, y + i0 * n, 2); break;
        case 3: idot_q6_k_m(w, r0, r1, nb, x0, d0, n, y + i0 * n, 3); break;
        case 4: idot_q6_k_m(w, r0, r1, nb, x0, d0, n, y + i0 * n, 4); break;
        default: idot_q6_k_m(w, r0, r1, nb, x0, d0, n, y + i0 * n, KQ_GMAX); break;
        }
        i0 += g;
    }
}
#endif

/* 1 where vs_gemv_int8 runs (AVX2 + FMA), else 0. */
int vs_int8(void) {
#ifdef VS_INT8
    return 1;
#else
    return 0;
#endif
}

/* The integer dot's route for the 32-element types: 512 (VNNI, two blocks per 512-bit step), 256 (VNNI on 8
   lanes), 1 (AVX2 maddubs), 0 (none). */
int vs_int8_route(void) {
#if defined(VS_VNNI) && defined(__AVX512F__) && defined(__AVX512DQ__)
    return 512;
#elif defined(VS_VNNI)
    return 256;
#elif defined(VS_INT8)
    return 1;
#else
    return 0;
#endif
}

/* y[i * ldy + :n] = x[i * k + :k] . W[r] through the integer dot, i < m, any m >= 1 (Q8_0, Q5_0, Q4_0, Q4_K, Q6_K):
   each task of 16 weight rows goes through x's rows MAX_M at a time, so a prompt chunk of many rows streams the
   weights from memory once (its 16 rows stay in cache across the slices) and each row's arithmetic is the same at
   every m.
   Returns 0, or -1 for bad arguments or without AVX2 + FMA. */
int vs_gemv_int8(int t, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int64_t ldy,
                 int threads) {
#ifdef VS_INT8
    int kq = t == T_Q4_K || t == T_Q6_K;
    if ((t != T_Q8_0 && t != T_Q5_0 && t != T_Q4_0 && !kq) || k % (kq ? 256 : 32) || m < 1 ||
        threads < 1 || ldy < n)
        return -1;
    int64_t nb = k / 32;
    int8_t *xq = (int8_t *)malloc((size_t)(m * k) + 32);
    float *dx = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * nb));
    if (!xq || !dx || !xs) {
        free(xq);
        free(dx);
        free(xs);
        return -1;
    }
    quantize_x8(x, m * nb, xq, dx, xs);
    float *dx8 = NULL; /* the 32-element types: each block's dx 8 times (one vector load a block and row) */
    int32_t *xo = NULL;
    if (!kq) {
        dx8 = (float *)malloc(sizeof(float) * (size_t)(8 * m * nb));
        if (!dx8) {
            free(xq);
            free(dx);
            free(xs);
            return -1;
        }
        for (int64_t b = 0; b < m * nb; b++)
            for (int j = 0; j < 8; j++) dx8[8 * b + j] = dx[b];
#ifdef VS_VNNI
        int off = t == T_Q8_0 ? OFFSET_Q8_0 : t == T_Q5_0 ? OFFSET_Q5_0 : OFFSET_Q4_0;
        xo = (int32_t *)calloc((size_t)(8 * m * nb), sizeof(int32_t));
        if (!xo) {
            free(xq);
            free(dx);
            free(xs);
            free(dx8);
            return -1;
        }
        for (int64_t b = 0; b < m * nb; b++) xo[8 * b] = -off * xs[b];
#endif
    }
    int64_t chunk = 16, tasks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t r0 = task * chunk, r1 = r0 + chunk < n ? r0 + chunk : n;
        for (int64_t i0 = 0; i0 < m; i0 += MAX_M) {
            const int64_t mm = m - i0 < MAX_M ? m - i0 : MAX_M;
            const int8_t *xqi = xq + i0 * k;
            float *yi = y + i0 * ldy;
            if (t == T_Q4_K) idot_q4_k(w, r0, r1, k / 256, xqi, dx + i0 * nb, xs + i0 * nb, mm, ldy, yi);
            else if (t == T_Q6_K) idot_q6_k(w, r0, r1, k / 256, xqi, dx + i0 * nb, mm, ldy, yi);
#ifdef VS_VNNI
            else if (t == T_Q8_0) vdot_q8_0(w, r0, r1, nb, xqi, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, mm, ldy, yi);
            else if (t == T_Q5_0) vdot_q5_0(w, r0, r1, nb, xqi, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, mm, ldy, yi);
            else vdot_q4_0(w, r0, r1, nb, xqi, dx8 + 8 * i0 * nb, xo + 8 * i0 * nb, mm, ldy, yi);
#else
            else if (t == T_Q8_0) idot_q8_0(w, r0, r1, nb, xqi, dx8 + 8 * i0 * nb, mm, ldy, yi);
            else if (t == T_Q5_0) idot_q5_0(w, r0, r1, nb, xqi, dx8 + 8 * i0 * nb, mm, ldy, yi);
            else idot_q4_0(w, r0, r1, nb, xqi, dx8 + 8 * i0 * nb, mm, ldy, yi);
#endif
        }
    }
    free(xq);
    free(dx);
    free(xs);
    free(dx8);
    free(xo);
    return 0;
#else
    (void)t; (void)w; (void)n; (void)k; (void)x; (void)m; (void)y; (void)ldy; (void)threads;
    return -1;
#endif
}

/* out[r * k + :k] = W[r] as float32, r < n. Returns 0, or -1 for bad arguments. */
int vs_dequant(int t, const uint8_t *w, int64_t n, int64_t k, float *out, int threads) {
    deq_fn deq = deq_of(t);
    int be = block_elems(t), bb = block_bytes(t);
    if (!deq || k % be || threads < 1) return -1;
    int64_t nb = k / be;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n * nb; i++) {
        float buf[256] __attribute__((aligned(64)));
        deq(w + i * bb, buf);
        memcpy(out + i * be, buf, sizeof(float) * be);
    }
    return 0;
}
