/* The hand-written decoding attention of handformer.nn.decode_attention: one query per head
 * attending over the keys and values a cache holds.
 *
 * Why by hand: a decoding step's attention reads every cached key and value once and does
 * little arithmetic on them (one query row), so it is bound by how fast the cache streams
 * in. A general attention kernel built for query blocks spends more than that stream here;
 * this loop reads each head's keys once (the scores), then its values once (the weighted sum).
 *
 * Per segment (one request: its query row and its keys) and query head h, over its keys j:
 *     s_j = (q_h · k_j) · scale,   p_j = exp(s_j − max s),   out_h = Σ p_j v_j / Σ p_j
 * where k_j and v_j are key/value head h / G (G = H / Hkv query heads share one, as in
 * grouped-query attention).
 *
 * Same bits on every path: the dot product runs in 16 lanes (lane l adds q[d]·k[d] for
 * d ≡ l mod 16, in order of d, a multiply then an add: no fused multiply-add anywhere), the
 * lanes fold in one fixed tree (l + 8, then + 4, + 2, + 1); the softmax's exponentials are
 * one plain-C polynomial and its sum adds in 16 lanes folded the same way; the weighted sum
 * adds p_j·v_j[d] per d in order of j. The AVX-512 path keeps the 16 lanes in one register,
 * AVX2 in two, the plain path in an array: every path does the same float operations in the
 * same order. Head dims that are not a multiple of 16 take the plain dot product and weighted
 * sum.
 *
 * Layout: out (n_seg, H, D) contiguous. Query head h of segment i lies at
 * q[q_base[i] + h · q_head_stride + d]; key d of head g at column c of segment i at
 * kv[base[i] + c · token_stride + g · head_stride + d];  values the same from kv + v_offset.
 * Each segment has keys[i] ≥ 1 columns.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "scratch.h"

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

int hf_decode_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return ISA_AVX512;
    return __builtin_cpu_supports("avx2") ? ISA_AVX2 : ISA_SCALAR;
}

/* Without trapping math the compiler may turn the clamps below into selects and so put the
 * exponentials into vector code; the arithmetic itself is unchanged (no contraction). The
 * loops that attend_* inline take it too (a function inlines only into one built alike). */
#define VECTOR_SELECTS __attribute__((optimize("no-trapping-math", "fp-contract=off")))

/* The lane fold every path shares: lane l + lane l+8, then +4, +2, +1. */
static float fold16(const float *lane) {
    float a[8], b[4], c[2];
    for (int l = 0; l < 8; l++) a[l] = lane[l] + lane[l + 8];
    for (int l = 0; l < 4; l++) b[l] = a[l] + a[l + 4];
    for (int l = 0; l < 2; l++) c[l] = b[l] + b[l + 2];
    return c[0] + c[1];
}

VECTOR_SELECTS static float dot_scalar(const float *q, const float *k, int64_t d_len) {
    float lane[16] = {0};
    for (int64_t d = 0; d < d_len; d++) {
        float product = q[d] * k[d];
        lane[d % 16] = d < 16 ? product : lane[d % 16] + product;
    }
    return fold16(lane);
}

__attribute__((target("avx2"))) VECTOR_SELECTS static float dot_avx2(const float *q,
                                                                     const float *k,
                                                                     int64_t d_len) {
    __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k + 8));
    for (int64_t d = 16; d < d_len; d += 16) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + d + 8),
                                             _mm256_loadu_ps(k + d + 8)));
    }
    __m256 a = _mm256_add_ps(lo, hi);                                            /* l + 8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* + 4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                               /* + 2 */
    return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));            /* + 1 */
}

__attribute__((target("avx512f"))) VECTOR_SELECTS static float dot_avx512(const float *q,
                                                                          const float *k,
                                                                          int64_t d_len) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int64_t d = 16; d < d_len; d += 16)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d)));
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(acc),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
}

/* out[d] = Σ_j w[j] · v_j[d], added in order of j from 0 for every d (the lanes are the d's,
 * so every width adds alike). The vector paths keep up to 4 vectors of sums in registers and
 * go over the keys once per such chunk of D. */
VECTOR_SELECTS static void wsum_scalar(const float *w, const float *v0, int64_t n_keys,
                                       int64_t token_stride, int64_t d_len, float *out) {
    for (int64_t d = 0; d < d_len; d++) out[d] = 0.0f;
    for (int64_t j = 0; j < n_keys; j++) {
        const float *v = v0 + j * token_stride;
        for (int64_t d = 0; d < d_len; d++) out[d] += w[j] * v[d];
    }
}

#define WSUM_CHUNK(VEC, W, NV, ZERO, SET1, LOAD, STORE, MUL, ADD)                             \
    do {                                                                                      \
        VEC acc[NV];                                                                          \
        for (int u = 0; u < (NV); u++) acc[u] = ZERO;                                         \
        for (int64_t j = 0; j < n_keys; j++) {                                                \
            const float *v = v0 + j * token_stride + d0;                                      \
            VEC p = SET1(w[j]);                                                               \
            for (int u = 0; u < (NV); u++) acc[u] = ADD(acc[u], MUL(p, LOAD(v + u * (W))));   \
        }                                                                                     \
        for (int u = 0; u < (NV); u++) STORE(out + d0 + u * (W), acc[u]);                     \
    } while (0)

#define WSUM(NAME, TARGET, VEC, W, ZERO, SET1, LOAD, STORE, MUL, ADD)                         \
    __attribute__((target(TARGET))) VECTOR_SELECTS static void NAME(                         \
        const float *w, const float *v0, int64_t n_keys, int64_t token_stride, int64_t d_len, \
        float *out) {                                                                         \
        for (int64_t d0 = 0; d0 < d_len; d0 += 4 * (W)) {                                     \
            switch ((d_len - d0) / (W)) {                                                     \
            case 1: WSUM_CHUNK(VEC, W, 1, ZERO, SET1, LOAD, STORE, MUL, ADD); break;          \
            case 2: WSUM_CHUNK(VEC, W, 2, ZERO, SET1, LOAD, STORE, MUL, ADD); break;          \
            case 3: WSUM_CHUNK(VEC, W, 3, ZERO, SET1, LOAD, STORE, MUL, ADD); break;          \
            default: WSUM_CHUNK(VEC, W, 4, ZERO, SET1, LOAD, STORE, MUL, ADD); break;         \
            }                                                                                 \
        }                                                                                     \
    }

WSUM(wsum_avx2, "avx2", __m256, 8, _mm256_setzero_ps(), _mm256_set1_ps, _mm256_loadu_ps,
     _mm256_storeu_ps, _mm256_mul_ps, _mm256_add_ps)
WSUM(wsum_avx512, "avx512f", __m512, 16, _mm512_setzero_ps(), _mm512_set1_ps, _mm512_loadu_ps,
     _mm512_storeu_ps, _mm512_mul_ps, _mm512_add_ps)

/* e^x in plain float arithmetic that the compiler turns into vector code (libm's expf is a
 * call per value): x = n·ln 2 + r with n = round(x / ln 2) (adding and subtracting 1.5·2^23
 * rounds to nearest), ln 2 in two parts so that r is nearly exact, then e^r by a polynomial
 * (Horner, a multiply then an add) and 2^n put into the exponent bits. Relative error within
 * 2e-7. x is clamped to [−87, 88], where 2^n stays a normal float (e^−87 ≈ 1.6e−38 is 0 to a
 * softmax, whose largest term is 1); NaN stays NaN. The softmax (x = s_j − max s ≤ 0) and
 * the block kernel's activations use it; the same code serves every path, so bits agree. */
VECTOR_SELECTS static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    int32_t whole = n == n ? (int32_t)n : 0; /* NaN: p is NaN already */
    uint32_t bits = (uint32_t)(whole + 127) << 23;
    float two_n;
    __builtin_memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* One segment's query head: scores into `scratch`, softmax, weighted sum of the values. The
 * largest score is found in 16 lanes (exact in any order) and the softmax's sum added in 16
 * lanes (lane l takes the weights j ≡ l mod 16, in order of j, folded as the dot products
 * are), so that both vectorise and every width adds alike. One copy per path, its own dot
 * product and weighted sum inlined (pick_attend); the file itself is built for any x86-64,
 * whose copy takes 4 floats at a time. */
#define ATTEND_BODY(DOT, WSUM)                                                                \
    {                                                                                         \
        for (int64_t j = 0; j < n_keys; j++)                                                  \
            scratch[j] = DOT(q, k0 + j * token_stride, d_len) * scale;                        \
        float top_lane[16], lane[16] = {0};                                                   \
        for (int l = 0; l < 16; l++) top_lane[l] = -INFINITY;                                 \
        int64_t j = 0;                                                                        \
        for (; j + 16 <= n_keys; j += 16)                                                     \
            for (int l = 0; l < 16; l++)                                                      \
                top_lane[l] = scratch[j + l] > top_lane[l] ? scratch[j + l] : top_lane[l];    \
        for (int l = 0; j + l < n_keys; l++)                                                  \
            top_lane[l] = scratch[j + l] > top_lane[l] ? scratch[j + l] : top_lane[l];        \
        float top = -INFINITY;                                                                \
        for (int l = 0; l < 16; l++) top = top_lane[l] > top ? top_lane[l] : top;             \
        for (j = 0; j + 16 <= n_keys; j += 16) {                                              \
            for (int l = 0; l < 16; l++) {                                                    \
                float p = exp_clamped(scratch[j + l] - top);                                  \
                scratch[j + l] = p;                                                           \
                lane[l] += p;                                                                 \
            }                                                                                 \
        }                                                                                     \
        for (int l = 0; j + l < n_keys; l++) {                                                \
            float p = exp_clamped(scratch[j + l] - top);                                      \
            scratch[j + l] = p;                                                               \
            lane[l] += p;                                                                     \
        }                                                                                     \
        float total = fold16(lane);                                                           \
        WSUM(scratch, v0, n_keys, token_stride, d_len, out);                                  \
        for (int64_t d = 0; d < d_len; d++) out[d] = out[d] / total;                          \
    }

#define ATTEND_ARGS                                                                           \
    (const float *q, const float *k0, const float *v0, int64_t n_keys, int64_t token_stride,  \
     int64_t d_len, float scale, float *scratch, float *out)

VECTOR_SELECTS static void attend_plain ATTEND_ARGS ATTEND_BODY(dot_scalar, wsum_scalar)
__attribute__((target("avx2"))) VECTOR_SELECTS static void attend_avx2 ATTEND_ARGS
ATTEND_BODY(dot_avx2, wsum_avx2)
__attribute__((target("avx512f"))) VECTOR_SELECTS static void attend_avx512 ATTEND_ARGS
ATTEND_BODY(dot_avx512, wsum_avx512)

typedef void (*attend_fn) ATTEND_ARGS;

/* One head's attention on path `isa`; head dims that are not a multiple of 16 take the plain
 * copy. */
static attend_fn pick_attend(int isa, int64_t d_len) {
    if (d_len % 16 != 0) return attend_plain;
    return isa >= ISA_AVX512 ? attend_avx512 : isa == ISA_AVX2 ? attend_avx2 : attend_plain;
}

/* out (n_seg, H, D) contiguous = attention of each segment's query over its cached columns
 * (see the header for the layout), on path `isa` (at most hf_decode_best_isa()). Returns 0,
 * or -1 where the scores' scratch cannot be allocated (out is then untouched). */
int hf_decode_attention(int isa, const float *q, const int64_t *q_base, int64_t q_head_stride,
                        const float *kv, int64_t v_offset, int64_t token_stride,
                        int64_t head_stride, const int64_t *base, const int64_t *keys,
                        int64_t n_seg, int64_t h_len, int64_t hkv_len, int64_t d_len,
                        float scale, float *out) {
    int64_t widest = 1;
    for (int64_t i = 0; i < n_seg; i++) widest = keys[i] > widest ? keys[i] : widest;
    float *scratch = hf_take((size_t)widest * sizeof(float));
    if (scratch == NULL) return -1;
    attend_fn attend = pick_attend(isa, d_len);
    int64_t group = h_len / hkv_len;
    for (int64_t i = 0; i < n_seg; i++) {
        for (int64_t h = 0; h < h_len; h++) {
            const float *k0 = kv + base[i] + (h / group) * head_stride;
            attend(q + q_base[i] + h * q_head_stride, k0, k0 + v_offset, keys[i], token_stride,
                   d_len, scale, scratch, out + (i * h_len + h) * d_len);
        }
    }
    hf_give(scratch);
    return 0;
}
