/* The hand-written decoding attention of handformer.nn.decode_attention: one query per head
 * attending over the keys and values a cache holds.
 *
 * Why by hand: a decoding step's attention reads every cached key and value once and does
 * little arithmetic on them (one query row), so it is bound by how fast the cache streams
 * in. A general attention kernel built for query blocks spends more than that stream here;
 * this loop reads the keys once (every head's scores), then the values once (every head's
 * weighted sum).
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

/* acc[d] += p · v[d] for every d: one key's share of a head's weighted sum. Each head's sums
 * live in `out` (a few KB, in L1) while the keys stream past, so that every head is served
 * by one pass over the values; each d adds in order of the keys, a multiply then an add, on
 * every path. */
VECTOR_SELECTS static inline void wrow_scalar(float p, const float *v, int64_t d_len,
                                              float *acc) {
    for (int64_t d = 0; d < d_len; d++) acc[d] = acc[d] + p * v[d];
}

#define WROW(NAME, TARGET, VEC, W, SET1, LOAD, STORE, MUL, ADD)                                \
    __attribute__((target(TARGET))) VECTOR_SELECTS static inline void NAME(                    \
        float p, const float *v, int64_t d_len, float *acc) {                                  \
        VEC w = SET1(p);                                                                       \
        for (int64_t d = 0; d < d_len; d += (W))                                               \
            STORE(acc + d, ADD(LOAD(acc + d), MUL(w, LOAD(v + d))));                           \
    }

WROW(wrow_avx2, "avx2", __m256, 8, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps,
     _mm256_mul_ps, _mm256_add_ps)
WROW(wrow_avx512, "avx512f", __m512, 16, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps,
     _mm512_mul_ps, _mm512_add_ps)

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

/* One segment's query heads, all at once: every head's scores into `scratch` (H rows of
 * n_keys, then the H softmax sums), each head's softmax, then every head's weighted sum of the
 * values into `out` (H, D). The keys and values are read in order of columns, each column's
 * heads together, so that a cache laid out column by column (nn/kv_cache.py) streams in as
 * one run instead of one run per head: memory's prefetchers ramp up once per pass, not once
 * per head, and fetch nothing past a head's last column. The largest score is found in 16
 * lanes (exact in any order) and the softmax's sum added in 16 lanes (lane l takes the
 * weights j ≡ l mod 16, in order of j, folded as the dot products are), so that both
 * vectorise and every width adds alike. One copy per path, its own dot product and weighted
 * sum inlined (pick_attend); the file itself is built for any x86-64, whose copy takes 4
 * floats at a time. */
#define ATTEND_BODY(DOT, ROW_SUM)                                                             \
    {                                                                                         \
        float *totals = scratch + h_len * n_keys;                                             \
        for (int64_t j = 0; j < n_keys; j++) {                                                \
            const float *k = k0 + j * token_stride;                                           \
            for (int64_t h = 0; h < h_len; h++)                                               \
                scratch[h * n_keys + j] =                                                     \
                    DOT(q + h * q_head_stride, k + (h / group) * head_stride, d_len) * scale; \
        }                                                                                     \
        for (int64_t h = 0; h < h_len; h++) {                                                 \
            float *s = scratch + h * n_keys;                                                  \
            float top_lane[16], lane[16] = {0};                                               \
            for (int l = 0; l < 16; l++) top_lane[l] = -INFINITY;                             \
            int64_t j = 0;                                                                    \
            for (; j + 16 <= n_keys; j += 16)                                                 \
                for (int l = 0; l < 16; l++)                                                  \
                    top_lane[l] = s[j + l] > top_lane[l] ? s[j + l] : top_lane[l];            \
            for (int l = 0; j + l < n_keys; l++)                                              \
                top_lane[l] = s[j + l] > top_lane[l] ? s[j + l] : top_lane[l];                \
            float top = -INFINITY;                                                            \
            for (int l = 0; l < 16; l++) top = top_lane[l] > top ? top_lane[l] : top;         \
            for (j = 0; j + 16 <= n_keys; j += 16) {                                          \
                for (int l = 0; l < 16; l++) {                                                \
                    float p = exp_clamped(s[j + l] - top);                                    \
                    s[j + l] = p;                                                             \
                    lane[l] += p;                                                             \
                }                                                                             \
            }                                                                                 \
            for (int l = 0; j + l < n_keys; l++) {                                            \
                float p = exp_clamped(s[j + l] - top);                                        \
                s[j + l] = p;                                                                 \
                lane[l] += p;                                                                 \
            }                                                                                 \
            totals[h] = fold16(lane);                                                         \
        }                                                                                     \
        for (int64_t i = 0; i < h_len * d_len; i++) out[i] = 0.0f;                            \
        for (int64_t j = 0; j < n_keys; j++) {                                                \
            const float *v = v0 + j * token_stride;                                           \
            for (int64_t h = 0; h < h_len; h++)                                               \
                ROW_SUM(scratch[h * n_keys + j], v + (h / group) * head_stride, d_len,        \
                        out + h * d_len);                                                     \
        }                                                                                     \
        for (int64_t h = 0; h < h_len; h++)                                                   \
            for (int64_t d = 0; d < d_len; d++)                                               \
                out[h * d_len + d] = out[h * d_len + d] / totals[h];                          \
    }

/* q: query head h at q + h · q_head_stride; key d of head g at column j at
 * k0[j · token_stride + g · head_stride + d], values the same from v0; query head h reads
 * key/value head h / group. scratch: H · (n_keys + 1) floats. out: (H, D) contiguous. */
#define ATTEND_ARGS                                                                           \
    (const float *q, int64_t q_head_stride, const float *k0, const float *v0, int64_t n_keys, \
     int64_t token_stride, int64_t head_stride, int64_t h_len, int64_t group, int64_t d_len,  \
     float scale, float *scratch, float *out)

VECTOR_SELECTS static void attend_plain ATTEND_ARGS ATTEND_BODY(dot_scalar, wrow_scalar)
__attribute__((target("avx2"))) VECTOR_SELECTS static void attend_avx2 ATTEND_ARGS
ATTEND_BODY(dot_avx2, wrow_avx2)
__attribute__((target("avx512f"))) VECTOR_SELECTS static void attend_avx512 ATTEND_ARGS
ATTEND_BODY(dot_avx512, wrow_avx512)

typedef void (*attend_fn) ATTEND_ARGS;

/* One segment's attention on path `isa`; head dims that are not a multiple of 16 take the
 * plain copy. */
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
    float *scratch = hf_take((size_t)h_len * (size_t)(widest + 1) * sizeof(float));
    if (scratch == NULL) return -1;
    attend_fn attend = pick_attend(isa, d_len);
    for (int64_t i = 0; i < n_seg; i++)
        attend(q + q_base[i], q_head_stride, kv + base[i], kv + base[i] + v_offset, keys[i],
               token_stride, head_stride, h_len, h_len / hkv_len, d_len, scale, scratch,
               out + i * h_len * d_len);
    hf_give(scratch);
    return 0;
}
