/* The small ops of a CPU decode step in float32 (verispec/kernels/cpu_ops.py calls them; cpu_gguf.py builds
   this file into the same library as cpu_gguf.c).

   A quantized CPU decode step is op-bound outside its matmuls: each torch op costs microseconds of dispatch
   for a few thousand floats. These do the same float32 arithmetic in one call each: RMSNorm with the residual
   add, SiLU-and-mul, rotary + the K/V write into the paged cache, and paged attention over the block table.
   Results match the plain-torch reference (attention/reference.py, models/layers/) up to the order of float32
   sums; the element-wise ones (rotary, the K/V write, SiLU-and-mul's products) round as torch's do. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* sum of a[i] * b[i], i < n, in 8 partial sums (a vectorizable order). */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Row r < rows of [rows, dim]: with res (may be NULL) h = x + res, written to res_out, else h = x;
   out = h * (1 / sqrt(mean(h^2) + eps)) * w. out may alias x. */
int vs_rms_norm(const float *x, const float *res, const float *w, int64_t rows, int64_t dim, float eps,
                float *out, float *res_out) {
    if (rows < 0 || dim < 1 || (res && !res_out)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        const float *h = xr;
        if (res) {
            float *ro = res_out + r * dim;
            const float *rr = res + r * dim;
            for (int64_t i = 0; i < dim; i++) ro[i] = xr[i] + rr[i];
            h = ro;
        }
        float inv = 1.0f / sqrtf(dot(h, h, dim) / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = h[i] * inv * w[i];
    }
    return 0;
}

/* out[r, i] = silu(x[r, i]) * x[r, n + i] for x [rows, 2n] (silu(g) = g / (1 + exp(-g)), as torch). */
int vs_silu_mul(const float *x, int64_t rows, int64_t n, float *out) {
    if (rows < 0 || n < 1) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return 0;
}

/* Rotary (rotate-half) of one head in float32: out[i] = x1 c - x2 s, out[i + d/2] = x2 c + x1 s. */
static inline void rope_head(const float *x, const float *c, const float *s, int64_t half, float *out) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * c[i] - x2 * s[i];
        out[i + half] = x2 * c[i] + x1 * s[i];
    }
}

/* Token t < T at position pos[t] (cos / sin tables [max_pos, D/2]): q_out[t] = rotated q [H, D]; the rotated k
   [KH, D] and v go to slot slots[t] of kv [2, num_slots, KH, D] (a negative slot is not written). q, k, v: rows
   of `ld*` floats per token, heads contiguous. Returns 0, or -1 for a position or slot out of range (nothing
   after that token is done). */
int vs_rope_write_kv(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                     int64_t T, int64_t H, int64_t KH, int64_t D, const int64_t *pos, const float *cos_t,
                     const float *sin_t, int64_t max_pos, float *kv, int64_t num_slots, const int64_t *slots,
                     float *q_out) {
    if (D % 2 || T < 0) return -1;
    int64_t half = D / 2, row = KH * D;
    float *vcache = kv + num_slots * row;
    for (int64_t t = 0; t < T; t++) {
        int64_t p = pos[t], slot = slots[t];
        if (p < 0 || p >= max_pos || slot >= num_slots) return -1;
        const float *c = cos_t + p * half, *s = sin_t + p * half;
        for (int64_t h = 0; h < H; h++) rope_head(q + t * ldq + h * D, c, s, half, q_out + (t * H + h) * D);
        if (slot < 0) continue;
        for (int64_t h = 0; h < KH; h++) rope_head(k + t * ldk + h * D, c, s, half, kv + slot * row + h * D);
        memcpy(vcache + slot * row, v + t * ldv, sizeof(float) * (size_t)row);
    }
    return 0;
}

/* Paged attention, q [T, H, D] -> out [T, H, D], as attention/reference.py's: sequence b's queries are tokens
   [qsl[b], qsl[b+1]); query i of ql sits at position p = seq_len - ql + i (causal; else seq_len - 1) and sees
   the keys at positions [lo, p], lo = kv_start[b] (kv_start NULL: 0) raised to p - window + 1 where window > 0;
   key j lives at slot tables[b][j / bs] * bs + j % bs of kv [2, num_slots, KH, D]. No visible key: zeros (a
   padding query placed before a chunk, p < 0, included).
   Query head h reads K/V head h / (H / KH). Returns 0, or -1 for bad arguments (a slot out of range included). */
int vs_paged_attention(const float *q, int64_t T, int64_t H, int64_t KH, int64_t D, const float *kv,
                       int64_t num_slots, const int32_t *qsl, const int32_t *seq_lens, int64_t B,
                       const int32_t *tables, int64_t max_blocks, int64_t bs, const int32_t *kv_start, int causal,
                       int64_t window, float scale, float *out, int threads) {
    if (H < 1 || KH < 1 || H % KH || D < 1 || bs < 1 || B < 0 || threads < 1 || qsl[0] != 0 || qsl[B] != T)
        return -1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        if (qsl[b + 1] < qsl[b] || seq_lens[b] < 0 || seq_lens[b] > max_blocks * bs) return -1;
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    int64_t group = H / KH, row = KH * D, tasks = T * KH;
    const float *vcache = kv + num_slots * row;
    int bad = 0;
    /* A task is one query token and one K/V head: the `group` query heads that read that head go through its
       keys together (each key and value row is read once for all of them). Each query head's arithmetic is the
       same as alone (its dots, max, exponentials and sums in key order), so its result does not depend on the
       other heads or tokens of the step. One thread below ~64k multiply-adds: a fork costs more than the work. */
#pragma omp parallel num_threads(threads) if (T * H * max_len * D > 65536) reduction(| : bad)
    {
        int64_t n = max_len > 0 ? max_len : 1;
        float *sc = (float *)malloc(sizeof(float) * (size_t)(n * group + 2 * group));
        int64_t *sl = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
        if (!sc || !sl) bad = 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!sc || !sl) continue;
            int64_t t = task / KH, kh = task % KH, b = 0;
            while (qsl[b + 1] <= t) b++;
            int64_t ql = qsl[b + 1] - qsl[b], len = seq_lens[b];
            int64_t p = causal ? len - ql + (t - qsl[b]) : len - 1;
            int64_t lo = kv_start ? kv_start[b] : 0;
            if (window > 0 && p - window + 1 > lo) lo = p - window + 1;
            if (lo < 0) lo = 0;
            const float *q0 = q + (t * H + kh * group) * D;
            float *o0 = out + (t * H + kh * group) * D, *mx = sc + n * group, *sum = mx + group;
            memset(o0, 0, sizeof(float) * (size_t)(group * D));
            if (lo > p) continue;
            const int32_t *tab = tables + b * max_blocks;
            for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY;
            int64_t blk = lo / bs, off = lo % bs, base = (int64_t)tab[blk] * bs; /* (no division per key) */
            for (int64_t j = lo; j <= p; j++) {
                if (off == bs) {
                    off = 0;
                    base = (int64_t)tab[++blk] * bs;
                }
                int64_t slot = base + off++;
                if (slot < 0 || slot >= num_slots) { bad = 1; slot = 0; }
                sl[j - lo] = slot;
                const float *kj = kv + slot * row + kh * D;
                for (int64_t g = 0; g < group; g++) {
                    float s = dot(q0 + g * D, kj, D) * scale;
                    sc[g * n + j - lo] = s;
                    mx[g] = s > mx[g] ? s : mx[g];
                }
            }
            for (int64_t g = 0; g < group; g++) sum[g] = 0.0f;
            for (int64_t j = 0; j <= p - lo; j++) {
                const float *vj = vcache + sl[j] * row + kh * D;
                for (int64_t g = 0; g < group; g++) {
                    float e = expf(sc[g * n + j] - mx[g]);
                    sum[g] += e;
                    float *o = o0 + g * D;
                    for (int64_t d = 0; d < D; d++) o[d] += e * vj[d];
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float inv = 1.0f / sum[g], *o = o0 + g * D;
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        }
        free(sc);
        free(sl);
    }
    return bad ? -1 : 0;
}
