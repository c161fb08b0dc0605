/* The hand-written int8 product of handformer.nn.int8_native: y = x · (Q · scale)ᵀ + bias.
 *
 * Why integers: a decoding step multiplies a few rows by every weight, and the float loop
 * spends a convert, a convert and a multiply-add on each int8 byte it reads, so it cannot keep
 * up with memory. Here each input row is first rounded to int16 on a grid of its own
 * (xq = round(x / sx), sx = max|x| / 32767), after which one instruction multiplies 32 int16
 * activations by 32 widened int8 weights and adds the pairs into 16 int32 sums (AVX-512 VNNI
 * vpdpwssd; vpmaddwd + vpaddd without VNNI; the same on 256 bits with AVX2).
 *
 * Exactness: every product is an integer |xq·q| ≤ 32767 · 127, and a lane adds two of them per
 * instruction, so a lane stays within int32 for 8256 terms (AVX-512) or 4128 (AVX2). The sums
 * restart every CHUNK (4096) inputs and each chunk's lanes are added in int64, so the integer
 * dot product is exact for any K: every instruction set and every blocking gives the same
 * integer, hence the same output bits. The one rounding that counts is x's to its grid, at most
 * sx / 2 per entry. The epilogue is y = (float)((double)dot · sx · scale) + bias, in that order.
 *
 * Non-finite input: a row holding NaN or ±inf has no grid; its outputs are NaN.
 * Layout: x (M, K) float32, q (N, K) int8, scale (N,) float32, bias (N,) float32 or NULL,
 * y (M, N) float32, all contiguous. The order of the work is the driver's (see DRIVER).
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "scratch.h"

#define CHUNK 4096
#define PREFETCH_ROWS 8
#define XQ_MAX 32767.0f

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_VNNI = 3 };

/* The best path this CPU runs (the caller may ask for a lower one). */
int hf_int8_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
        return __builtin_cpu_supports("avx512vnni") ? ISA_AVX512_VNNI : ISA_AVX512;
    }
    return __builtin_cpu_supports("avx2") ? ISA_AVX2 : ISA_SCALAR;
}

/* The grid step of a finite row whose largest |x| is amax. */
static float grid_step(float amax) {
    float sx = amax / XQ_MAX;
    if (sx == 0.0f) sx = amax > 0.0f ? 1.4e-45f : 1.0f; /* a subnormal row: the smallest step */
    return sx;
}

/* Row m of x onto its int16 grid, entries [k0, k_len): its largest |x| folded into *amax and
 * whether all are finite (first pass), then xq = clamp(round(x / sx)) (second pass). The
 * vector versions below do the same per lane: a max is exact in any order, the division is
 * IEEE-rounded and the rounding goes to nearest-even in each, so every path makes the same
 * grid; these loops finish their tails. */
static int scan_tail(const float *x, int64_t k0, int64_t k_len, float *amax) {
    int finite = 1;
    for (int64_t k = k0; k < k_len; k++) {
        float a = fabsf(x[k]);
        finite &= isfinite(a) != 0;
        *amax = a > *amax ? a : *amax;
    }
    return finite;
}

static void round_tail(const float *x, int64_t k0, int64_t k_len, float sx, int16_t *xq) {
    for (int64_t k = k0; k < k_len; k++) {
        float v = nearbyintf(x[k] / sx);
        v = v > XQ_MAX ? XQ_MAX : (v < -XQ_MAX ? -XQ_MAX : v);
        xq[k] = (int16_t)v;
    }
}

/* A row that is not finite has no grid: zeros, and NaN for its step. */
static float no_grid(int16_t *xq, int64_t k_len) {
    for (int64_t k = 0; k < k_len; k++) xq[k] = 0;
    return NAN;
}

/* The vector part of each pass, per path: scan_* folds |x| of entries [0, k) into *amax and
 * clears *finite on a NaN or ±inf; round_* writes the grid of entries [0, k); both return k,
 * where the tails above take over (the scalar path leaves every entry to them). */
static int64_t scan_none(const float *x, int64_t k_len, float *amax, int *finite) {
    (void)x, (void)k_len, (void)amax, (void)finite;
    return 0;
}

static int64_t round_none(const float *x, int64_t k_len, float sx, int16_t *xq) {
    (void)x, (void)k_len, (void)sx, (void)xq;
    return 0;
}

__attribute__((target("avx2")))
static int64_t scan_avx2(const float *x, int64_t k_len, float *amax, int *finite) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    __m256 vmax = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= k_len; k += 8) {
        __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k));
        *finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ)) == 0xFF;
        vmax = _mm256_max_ps(vmax, a);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    *amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    return k;
}

__attribute__((target("avx2")))
static int64_t round_avx2(const float *x, int64_t k_len, float sx, int16_t *xq) {
    const __m256 step = _mm256_set1_ps(sx), hi = _mm256_set1_ps(XQ_MAX), lo = _mm256_set1_ps(-XQ_MAX);
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        __m256 a = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), step),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 b = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k + 8), step),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        a = _mm256_min_ps(_mm256_max_ps(a, lo), hi);
        b = _mm256_min_ps(_mm256_max_ps(b, lo), hi);
        /* packs works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7, put back in order */
        __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
        _mm256_storeu_si256((__m256i *)(xq + k), _mm256_permute4x64_epi64(p, 0xD8));
    }
    return k;
}

__attribute__((target("avx512f,avx512bw")))
static int64_t scan_avx512(const float *x, int64_t k_len, float *amax, int *finite) {
    const __m512 big = _mm512_set1_ps(FLT_MAX);
    __m512 vmax = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + k));
        *finite &= _mm512_cmp_ps_mask(a, big, _CMP_LE_OQ) == 0xFFFF;
        vmax = _mm512_max_ps(vmax, a);
    }
    *amax = _mm512_reduce_max_ps(vmax);
    return k;
}

__attribute__((target("avx512f,avx512bw")))
static int64_t round_avx512(const float *x, int64_t k_len, float sx, int16_t *xq) {
    const __m512 step = _mm512_set1_ps(sx), hi = _mm512_set1_ps(XQ_MAX), lo = _mm512_set1_ps(-XQ_MAX);
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        __m512 a = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), step),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        a = _mm512_min_ps(_mm512_max_ps(a, lo), hi);
        _mm256_storeu_si256((__m256i *)(xq + k), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(a)));
    }
    return k;
}

typedef int64_t (*scan_fn)(const float *, int64_t, float *, int *);
typedef int64_t (*round_fn)(const float *, int64_t, float, int16_t *);

/* Row m of x onto its int16 grid with one path's vector parts; returns sx, or NaN (and a
 * zero grid) where the row is not finite. */
static float quantize_row(const float *x, int64_t k_len, int16_t *xq, scan_fn scan,
                          round_fn round_row) {
    float amax = 0.0f;
    int finite = 1;
    int64_t k = scan(x, k_len, &amax, &finite);
    if (!(scan_tail(x, k, k_len, &amax) & finite)) return no_grid(xq, k_len);
    float sx = grid_step(amax);
    round_tail(x, round_row(x, k_len, sx, xq), k_len, sx, xq);
    return sx;
}

/* block_*: the dot products of input rows [m0, m0 + MB) with weight rows [n, n + NB) over
 * inputs [k0, k1): out[i][j] += Σ_k xq[m0+i][k] · q[n+j][k], exact. MB, NB ≤ 4 are constants
 * at every call (the bodies inline), so the sums live in registers. Each weight vector is
 * widened once and feeds the MB input rows; each input vector feeds the NB weight rows. With
 * fewer than 4 sums, each is split in two (even and odd vectors) so that its adds do not wait
 * on each other. Over one CHUNK a lane adds CHUNK / (lanes per vector) products at most
 * (two per instruction), 512 on AVX2, within int32's 516, so even + odd is still exact.
 * NB > 1 reads rows side by side and prefetches them PREFETCH_ROWS ahead, which a
 * sequential stream does not need. */

static inline __attribute__((always_inline)) void block_scalar(
    const int16_t *xq, const int8_t *q, int64_t k_len, int64_t n, int nb, int64_t m0, int mb,
    int64_t k0, int64_t k1, int64_t out[4][4]) {
    for (int i = 0; i < mb; i++) {
        for (int j = 0; j < nb; j++) {
            const int16_t *xr = xq + (m0 + i) * k_len;
            const int8_t *qr = q + (n + j) * k_len;
            int64_t s = 0;
            for (int64_t k = k0; k < k1; k++) s += (int32_t)xr[k] * (int32_t)qr[k];
            out[i][j] += s;
        }
    }
}

__attribute__((target("avx2")))
static int64_t sum8_epi32(__m256i v) {
    __m256i lo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v));
    __m256i hi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1));
    __m256i s = _mm256_add_epi64(lo, hi);
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
}

__attribute__((target("avx512f,avx512bw")))
static int64_t sum16_epi32(__m512i v) {
    __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v));
    __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1));
    return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}

/* One body for every vector path: VEC the register type, W inputs per vector, WIDEN loads W
 * int8 weights as int16, LOADX W int16 inputs, MADD multiplies pairs and adds them to a sum,
 * ADD and SUM fold the sums. */
#define BLOCK_BODY(VEC, W, ZERO, WIDEN, LOADX, MADD, ADD, SUM)                                \
    {                                                                                         \
        const int U = MB * NB < 4 ? 2 : 1;                                                    \
        VEC acc[4][4][2];                                                                     \
        for (int i = 0; i < MB; i++)                                                          \
            for (int j = 0; j < NB; j++) acc[i][j][0] = acc[i][j][1] = ZERO;                  \
        const int8_t *qr[4];                                                                  \
        for (int j = 0; j < NB; j++) qr[j] = q + (n + j) * k_len;                            \
        int64_t k = k0;                                                                       \
        for (; k + U * W <= k1; k += U * W) {                                                 \
            if (NB > 1 && (k & 63) < U * W) {                                                 \
                for (int j = 0; j < NB; j++)                                                  \
                    _mm_prefetch((const char *)(qr[j] + PREFETCH_ROWS * k_len + k),          \
                                 _MM_HINT_T0);                                                \
            }                                                                                 \
            VEC w[2][4];                                                                      \
            for (int u = 0; u < U; u++)                                                       \
                for (int j = 0; j < NB; j++) w[u][j] = WIDEN(qr[j] + k + u * W);              \
            for (int u = 0; u < U; u++)                                                       \
                for (int i = 0; i < MB; i++) {                                                \
                    VEC xv = LOADX(xq + (m0 + i) * k_len + k + u * W);                        \
                    for (int j = 0; j < NB; j++) acc[i][j][u] = MADD(acc[i][j][u], xv, w[u][j]); \
                }                                                                             \
        }                                                                                     \
        for (; U == 2 && k + W <= k1; k += W) {                                               \
            VEC w[4];                                                                         \
            for (int j = 0; j < NB; j++) w[j] = WIDEN(qr[j] + k);                             \
            for (int i = 0; i < MB; i++) {                                                    \
                VEC xv = LOADX(xq + (m0 + i) * k_len + k);                                    \
                for (int j = 0; j < NB; j++) acc[i][j][0] = MADD(acc[i][j][0], xv, w[j]);    \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < MB; i++)                                                          \
            for (int j = 0; j < NB; j++)                                                      \
                out[i][j] += SUM(U == 2 ? ADD(acc[i][j][0], acc[i][j][1]) : acc[i][j][0]);   \
        if (k < k1) block_scalar(xq, q, k_len, n, NB, m0, MB, k, k1, out);                    \
    }

#define BLOCK_ARGS                                                                            \
    (const int16_t *xq, const int8_t *q, int64_t k_len, int64_t n, const int NB, int64_t m0, \
     const int MB, int64_t k0, int64_t k1, int64_t out[4][4])

#define WIDEN_256(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define LOADX_256(p) _mm256_loadu_si256((const __m256i *)(p))
#define MADD_AVX2(acc, x, w) _mm256_add_epi32((acc), _mm256_madd_epi16((x), (w)))
#define WIDEN_512(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define LOADX_512(p) _mm512_loadu_si512((const void *)(p))
#define MADD_VNNI(acc, x, w) _mm512_dpwssd_epi32((acc), (x), (w))
#define MADD_BW(acc, x, w) _mm512_add_epi32((acc), _mm512_madd_epi16((x), (w)))

__attribute__((target("avx2"))) static inline __attribute__((always_inline))
void block_avx2 BLOCK_ARGS
BLOCK_BODY(__m256i, 16, _mm256_setzero_si256(), WIDEN_256, LOADX_256, MADD_AVX2,
           _mm256_add_epi32, sum8_epi32)

__attribute__((target("avx512f,avx512bw"))) static inline __attribute__((always_inline))
void block_avx512 BLOCK_ARGS
BLOCK_BODY(__m512i, 32, _mm512_setzero_si512(), WIDEN_512, LOADX_512, MADD_BW,
           _mm512_add_epi32, sum16_epi32)

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline __attribute__((always_inline))
void block_avx512_vnni BLOCK_ARGS
BLOCK_BODY(__m512i, 32, _mm512_setzero_si512(), WIDEN_512, LOADX_512, MADD_VNNI,
           _mm512_add_epi32, sum16_epi32)

/* One input row (decoding) on a vector path: weight row after weight row, start to end, so
 * that memory sees one sequential stream — the pattern every hardware prefetcher follows —
 * and nothing else in the loop: two sums per row (even and odd vectors, so that consecutive
 * multiply-adds do not wait on each other), added in int32 per CHUNK as the tiles' one-row
 * order adds them, so the integer is the same. The tiles below carry bookkeeping for up to
 * 4 × 4 sums that a single row pays for on every weight row. */
#define ROW1_BODY(VEC, W, ZERO, WIDEN, LOADX, MADD, ADD, SUM)                                  \
    {                                                                                         \
        for (int64_t n = 0; n < n_len; n++) {                                                 \
            const int8_t *qr = q + n * k_len;                                                 \
            int64_t dot = 0;                                                                  \
            for (int64_t k0 = 0; k0 < k_len; k0 += CHUNK) {                                   \
                int64_t k1 = k_len - k0 < CHUNK ? k_len : k0 + CHUNK;                         \
                VEC a0 = ZERO, a1 = ZERO;                                                     \
                int64_t k = k0;                                                               \
                for (; k + 2 * W <= k1; k += 2 * W) {                                         \
                    a0 = MADD(a0, LOADX(xq + k), WIDEN(qr + k));                              \
                    a1 = MADD(a1, LOADX(xq + k + W), WIDEN(qr + k + W));                      \
                }                                                                             \
                if (k + W <= k1) {                                                            \
                    a0 = MADD(a0, LOADX(xq + k), WIDEN(qr + k));                              \
                    k += W;                                                                   \
                }                                                                             \
                dot += SUM(ADD(a0, a1));                                                      \
                for (; k < k1; k++) dot += (int32_t)xq[k] * (int32_t)qr[k];                   \
            }                                                                                 \
            double v = (double)dot * (double)sx[0] * (double)scale[n];                        \
            float out = (float)v;                                                             \
            y[n] = bias != NULL ? out + bias[n] : out;                                        \
        }                                                                                     \
    }

#define ROW1_ARGS                                                                             \
    (const int16_t *xq, const float *sx, const int8_t *q, const float *scale,                 \
     const float *bias, int64_t n_len, int64_t k_len, float *y)

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void row1_avx512_vnni ROW1_ARGS
ROW1_BODY(__m512i, 32, _mm512_setzero_si512(), WIDEN_512, LOADX_512, MADD_VNNI,
          _mm512_add_epi32, sum16_epi32)

__attribute__((target("avx512f,avx512bw")))
static void row1_avx512 ROW1_ARGS
ROW1_BODY(__m512i, 32, _mm512_setzero_si512(), WIDEN_512, LOADX_512, MADD_BW,
          _mm512_add_epi32, sum16_epi32)

__attribute__((target("avx2")))
static void row1_avx2 ROW1_ARGS
ROW1_BODY(__m256i, 16, _mm256_setzero_si256(), WIDEN_256, LOADX_256, MADD_AVX2,
          _mm256_add_epi32, sum8_epi32)

/* MB input rows (a constant) × NB weight rows from m0, n, summed over every CHUNK, and the
 * epilogue. */
#define TILE(BLOCK, NB, MB)                                                                   \
    do {                                                                                      \
        int64_t dot[4][4] = {{0}};                                                            \
        for (int64_t k0 = 0; k0 < k_len; k0 += CHUNK) {                                       \
            int64_t k1 = k_len - k0 < CHUNK ? k_len : k0 + CHUNK;                             \
            BLOCK(xq, q, k_len, n, NB, m0, MB, k0, k1, dot);                                  \
        }                                                                                     \
        for (int i = 0; i < (MB); i++) {                                                      \
            for (int j = 0; j < (NB); j++) {                                                  \
                double v = (double)dot[i][j] * (double)sx[m0 + i] * (double)scale[n + j];     \
                float out = (float)v;                                                         \
                y[(m0 + i) * n_len + n + j] = bias != NULL ? out + bias[n + j] : out;         \
            }                                                                                 \
        }                                                                                     \
    } while (0)

/* The tile of NB weight rows for the input rows from m0, with MB (a constant) picked by
 * the rows left, so that the sums stay in registers. */
#define TILE_ROWS(BLOCK, NB)                                                                  \
    switch (m_len - m0) {                                                                     \
    case 1: TILE(BLOCK, NB, 1); break;                                                        \
    case 2: TILE(BLOCK, NB, 2); break;                                                        \
    case 3: TILE(BLOCK, NB, 3); break;                                                        \
    default: TILE(BLOCK, NB, 4); break;                                                       \
    }

/* Several input rows go in tiles of 4 weight rows × up to 4 input rows, where each loaded
 * vector serves 4 products and the work, not the stream, sets the pace; a last partial tile
 * of weight rows goes one row at a time. One input row goes one weight row at a time too
 * (row1_* on the vector paths). One copy per path so that each block body inlines into it. */
#define DRIVER(NAME, TARGET, BLOCK)                                                           \
    __attribute__((target(TARGET))) static void NAME(                                         \
        const int16_t *xq, const float *sx, const int8_t *q, const float *scale,              \
        const float *bias, int64_t m_len, int64_t n_len, int64_t k_len, float *y) {           \
        int64_t n = 0;                                                                        \
        if (m_len > 1) {                                                                      \
            for (; n + 4 <= n_len; n += 4) {                                                  \
                for (int64_t m0 = 0; m0 < m_len; m0 += 4) {                                   \
                    TILE_ROWS(BLOCK, 4);                                                      \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (; n < n_len; n++) {                                                              \
            for (int64_t m0 = 0; m0 < m_len; m0 += 4) {                                       \
                TILE_ROWS(BLOCK, 1);                                                          \
            }                                                                                 \
        }                                                                                     \
    }

DRIVER(linear_scalar, "arch=x86-64", block_scalar)
DRIVER(linear_avx2, "avx2", block_avx2)
DRIVER(linear_avx512, "avx512f,avx512bw", block_avx512)
DRIVER(linear_avx512_vnni, "avx512f,avx512bw,avx512vnni", block_avx512_vnni)

typedef void (*row1_fn) ROW1_ARGS;
typedef void (*linear_fn)(const int16_t *, const float *, const int8_t *, const float *,
                          const float *, int64_t, int64_t, int64_t, float *);

/* y (M, N) = x (M, K) · (q (N, K) · scale)ᵀ + bias on path `isa`, in memory the caller gives:
 * sx (M floats) and xq (M · K int16) for x's grids. One input row goes row1_* (the plain
 * path has none), several go the tiles. hf_int8_linear and the block kernel
 * (decode_block.c) both call it. */
static void int8_product(int isa, const float *x, const int8_t *q, const float *scale,
                         const float *bias, int64_t m_len, int64_t n_len, int64_t k_len,
                         float *sx, int16_t *xq, float *y) {
    scan_fn scan = isa >= ISA_AVX512 ? scan_avx512 : isa == ISA_AVX2 ? scan_avx2 : scan_none;
    round_fn round_row = isa >= ISA_AVX512 ? round_avx512
                         : isa == ISA_AVX2 ? round_avx2
                                           : round_none;
    for (int64_t m = 0; m < m_len; m++)
        sx[m] = quantize_row(x + m * k_len, k_len, xq + m * k_len, scan, round_row);
    row1_fn row1 = isa >= ISA_AVX512_VNNI ? row1_avx512_vnni
                   : isa == ISA_AVX512    ? row1_avx512
                   : isa == ISA_AVX2      ? row1_avx2
                                          : NULL;
    linear_fn linear = isa >= ISA_AVX512_VNNI ? linear_avx512_vnni
                       : isa == ISA_AVX512    ? linear_avx512
                       : isa == ISA_AVX2      ? linear_avx2
                                              : linear_scalar;
    if (m_len == 1 && row1 != NULL)
        row1(xq, sx, q, scale, bias, n_len, k_len, y);
    else
        linear(xq, sx, q, scale, bias, m_len, n_len, k_len, y);
}

/* y (M, N) = x (M, K) · (q (N, K) · scale)ᵀ + bias on path `isa` (at most hf_int8_best_isa()).
 * Returns 0, or -1 where the scratch for x's grid cannot be allocated (y is then untouched). */
int hf_int8_linear(int isa, const float *x, const int8_t *q, const float *scale,
                   const float *bias, int64_t m_len, int64_t n_len, int64_t k_len, float *y) {
    /* sx (M floats), then the grid (M · K int16), 64-byte aligned */
    size_t sx_bytes = ((size_t)(m_len + 1) * sizeof(float) + 63) & ~(size_t)63;
    char *mem = hf_take(sx_bytes + (size_t)(m_len * k_len + 1) * sizeof(int16_t));
    if (mem == NULL) return -1;
    int8_product(isa, x, q, scale, bias, m_len, n_len, k_len, (float *)mem,
                 (int16_t *)(mem + sx_bytes), y);
    hf_give(mem);
    return 0;
}
