/* A whole pre-norm Transformer block's decoding step in one call: handformer.nn.decode_block.
 *
 * Why one call: at batch 1 a decoding step is bound by reading the block's int8 weights and
 * its cached keys and values once. The two loops that read them (int8_kernel.c's product,
 * decode_attention.c's attention) run near memory's rate, but called one module at a time
 * from Python a step also pays the interpreter, the calls and a dozen small torch ops per
 * block, each of which runs with cold caches after the weights streamed through. Here the
 * small work (norms, the activation, the residual adds, the cache write) is a few loops over
 * a few thousand floats between the products, in registers and L1.
 *
 * What it computes, for one token x (C) of one request, the block's own modules in order:
 *     h = norm1(x);  [q | k | v] = in_proj(h)        (H, Hkv and Hkv heads of D)
 *     cache column t ← k, v;   a_h = softmax(q_h · K_gᵀ / √D) · V_g  over columns [0, t]
 *     x1 = x + out_proj(a);    y = x1 + fc_out(act(fc_in(norm2(x1))))
 * with g = h / (H / Hkv). The products are int8_kernel.c's, called exactly as a one-row
 * hf_int8_linear (same grid, same integer, same bits); each head's attention is
 * decode_attention.c's (its attend_* copy for the path, same bits). The norms and the
 * activation are one C body copied per path (the same float operations in the same order),
 * so the output's bits do not depend on the path either. norm: LayerNorm (mean and variance
 * in double, bias optional) or RMSNorm (x̂ rounded to float, then times the gain, as
 * nn/norm.py). act: GELU (erf or tanh form; erf, tanh and the exponential are polynomials
 * here and in decode_attention.c, within 2e-7), ReLU, ReLU², SwiGLU (fc_in's first F
 * outputs are the gate, the next F the up projection).
 *
 * Layout: x and y (C) float32; the cache kv (2, L, Hkv, D) contiguous: the keys, then the
 * values, each column by column (nn/kv_cache.py), L = capacity ≥ t + 1.
 *
 * hf_decode_stack runs a stack of blocks in one call; hf_decode_token a whole token of a
 * model: its embedding rows, the stack, the final norm and the head.
 */
/* The two loops' files share ISA_* names with different numbers: the attention's are renamed. */
#define ISA_SCALAR ATTN_ISA_SCALAR
#define ISA_AVX2 ATTN_ISA_AVX2
#define ISA_AVX512 ATTN_ISA_AVX512
#include "decode_attention.c"
#undef ISA_SCALAR
#undef ISA_AVX2
#undef ISA_AVX512
#include "int8_kernel.c"

enum { NORM_LAYER = 0, NORM_RMS = 1 };
/* In the order of nn/feedforward.py's ACTIVATIONS: decode_block.py passes the index. */
enum { ACT_GELU = 0, ACT_GELU_TANH = 1, ACT_RELU = 2, ACT_RELU2 = 3, ACT_SWIGLU = 4 };

struct hf_linear {
    const int8_t *q;
    const float *scale;
    const float *bias; /* NULL: none */
    int64_t n, k;
};

struct hf_block {
    int64_t d_model, n_heads, n_kv_heads, head_dim;
    int32_t norm_type, activation;
    float eps, attn_scale;
    const float *norm1_w, *norm1_b, *norm2_w, *norm2_b; /* a LayerNorm's bias may be NULL */
    struct hf_linear in_proj, out_proj, fc_in, fc_out;
};

/* The block takes the product's paths (the attention's AVX-512 serves both 512-bit ones). */
int hf_block_best_isa(void) { return hf_int8_best_isa(); }

/* The fold of 8 double lanes every norm copy shares: lane l + lane l+4, then +2, +1. */
static double fold8(const double *lane) {
    double a[4];
    for (int l = 0; l < 4; l++) a[l] = lane[l] + lane[l + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* x (c) → out (c): LayerNorm (type NORM_LAYER; bias may be NULL) or RMSNorm, as the header
 * says; a block's two norms and the model's final one. Each sum over x runs in 8 double
 * lanes (lane l takes the entries i ≡ l mod 8, in order of i) folded by fold8, so that it
 * vectorises and every copy adds alike: one copy per path (norm_row), as the activation. */
#define NORM_BODY                                                                             \
    {                                                                                         \
        double lane[8] = {0};                                                                 \
        int64_t i = 0;                                                                        \
        if (type == NORM_RMS) {                                                               \
            for (; i + 8 <= c; i += 8)                                                        \
                for (int l = 0; l < 8; l++) lane[l] += (double)x[i + l] * (double)x[i + l];   \
            for (int l = 0; i + l < c; l++) lane[l] += (double)x[i + l] * (double)x[i + l];   \
            float inv = (float)(1.0 / sqrt(fold8(lane) / (double)c + (double)eps));           \
            for (i = 0; i < c; i++) out[i] = (x[i] * inv) * w[i];                             \
            return;                                                                           \
        }                                                                                     \
        for (; i + 8 <= c; i += 8)                                                            \
            for (int l = 0; l < 8; l++) lane[l] += (double)x[i + l];                          \
        for (int l = 0; i + l < c; l++) lane[l] += (double)x[i + l];                          \
        double mean = fold8(lane) / (double)c;                                                \
        for (int l = 0; l < 8; l++) lane[l] = 0.0;                                            \
        for (i = 0; i + 8 <= c; i += 8)                                                       \
            for (int l = 0; l < 8; l++)                                                       \
                lane[l] += ((double)x[i + l] - mean) * ((double)x[i + l] - mean);             \
        for (int l = 0; i + l < c; l++)                                                       \
            lane[l] += ((double)x[i + l] - mean) * ((double)x[i + l] - mean);                 \
        double rstd = 1.0 / sqrt(fold8(lane) / (double)c + (double)eps);                      \
        for (i = 0; i < c; i++) {                                                             \
            float v = (float)(((double)x[i] - mean) * rstd) * w[i];                           \
            out[i] = bias != NULL ? v + bias[i] : v;                                          \
        }                                                                                     \
    }

#define NORM_ARGS                                                                             \
    (int32_t type, int64_t c, float eps, const float *x, const float *w, const float *bias,  \
     float *out)

static void norm_plain NORM_ARGS NORM_BODY
__attribute__((target("avx2"))) static void norm_avx2 NORM_ARGS NORM_BODY
__attribute__((target("avx512f,avx512bw,avx512dq"))) static void norm_avx512 NORM_ARGS
NORM_BODY

/* The norm's copy for product path `isa` (int8_kernel.c's ISA_* values). */
static void norm_row(int isa, int32_t type, int64_t c, float eps, const float *x,
                     const float *w, const float *bias, float *out) {
    if (isa >= ISA_AVX512)
        norm_avx512(type, c, eps, x, w, bias, out);
    else if (isa == ISA_AVX2)
        norm_avx2(type, c, eps, x, w, bias, out);
    else
        norm_plain(type, c, eps, x, w, bias, out);
}

static void norm(int isa, const struct hf_block *b, const float *x, const float *w,
                 const float *bias, float *out) {
    norm_row(isa, b->norm_type, b->d_model, b->eps, x, w, bias, out);
}

/* y (N) = x (K) · (q · scale)ᵀ + bias: hf_int8_linear's one row, in the step's scratch. */
static void product(int isa, const struct hf_linear *l, const float *x, int16_t *xq, float *y) {
    float sx;
    int8_product(isa, x, l->q, l->scale, l->bias, 1, l->n, l->k, &sx, xq, y);
}

/* erf(x) by Abramowitz and Stegun's 7.1.26 (error within 1.5e-7 before float rounding), in
 * plain arithmetic that vectorises, unlike libm's erff. */
VECTOR_SELECTS static inline float erf_approx(float x) {
    float a = fabsf(x);
    float t = 1.0f / (1.0f + 0.3275911f * a);
    float poly = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t
                  + 0.254829592f) * t;
    return copysignf(1.0f - poly * exp_clamped(-(a * a)), x);
}

/* tanh(u) = 1 − 2 / (e^{2|u|} + 1), with u's sign: vectorises, unlike libm's tanhf. */
VECTOR_SELECTS static inline float tanh_approx(float u) {
    return copysignf(1.0f - 2.0f / (exp_clamped(2.0f * fabsf(u)) + 1.0f), u);
}

/* f (fc_in's N) → g (fc_out's K): the block's activation, one loop per kind so that each
 * vectorises. One copy per path (the file itself is built for any x86-64, so its own copy
 * takes 4 floats at a time): each element goes through the same float operations in the
 * same order at any vector width (no fused multiply-add), so every copy gives the same bits. */
#define ACTIVATE_BODY                                                                         \
    {                                                                                         \
        switch (act) {                                                                        \
        case ACT_GELU:                                                                        \
            for (int64_t i = 0; i < width; i++)                                               \
                g[i] = 0.5f * f[i] * (1.0f + erf_approx(f[i] * 0.70710678118654752f));        \
            break;                                                                            \
        case ACT_GELU_TANH:                                                                   \
            for (int64_t i = 0; i < width; i++) {                                             \
                float v = f[i];                                                               \
                float u = 0.79788456080286536f * (v + 0.044715f * v * v * v);                 \
                g[i] = 0.5f * v * (1.0f + tanh_approx(u));                                    \
            }                                                                                 \
            break;                                                                            \
        case ACT_RELU:                                                                        \
            for (int64_t i = 0; i < width; i++) g[i] = f[i] > 0.0f ? f[i] : 0.0f;             \
            break;                                                                            \
        case ACT_RELU2:                                                                       \
            for (int64_t i = 0; i < width; i++) g[i] = f[i] > 0.0f ? f[i] * f[i] : 0.0f;      \
            break;                                                                            \
        default: /* SwiGLU: the first `width` outputs are the gate, the next the up projection */ \
            for (int64_t i = 0; i < width; i++)                                               \
                g[i] = (f[i] / (1.0f + exp_clamped(-f[i]))) * f[width + i];                   \
            break;                                                                            \
        }                                                                                     \
    }

#define ACTIVATE_ARGS (int act, const float *f, int64_t width, float *g)

VECTOR_SELECTS static void activate_plain ACTIVATE_ARGS ACTIVATE_BODY
__attribute__((target("avx2"))) VECTOR_SELECTS static void activate_avx2 ACTIVATE_ARGS
ACTIVATE_BODY
__attribute__((target("avx512f,avx512bw,avx512dq"))) VECTOR_SELECTS
static void activate_avx512 ACTIVATE_ARGS ACTIVATE_BODY

/* The activation's copy for product path `isa` (int8_kernel.c's ISA_* values). */
static void activate(int isa, int act, const float *f, int64_t width, float *g) {
    if (isa >= ISA_AVX512)
        activate_avx512(act, f, width, g);
    else if (isa == ISA_AVX2)
        activate_avx2(act, f, width, g);
    else
        activate_plain(act, f, width, g);
}

/* One decoding step of block b on path `isa` (int8_kernel.c's ISA_* values; the attention
 * takes the same level, capped at its AVX-512): x (C) → y (C), the token's keys and values
 * written into column t of kv (capacity L). Returns 0, or -1 where the scratch cannot be
 * allocated (then nothing is written). */
int hf_decode_block(int isa, const struct hf_block *b, const float *x, float *kv, int64_t cap,
                    int64_t t, float *y) {
    int64_t c = b->d_model, h_len = b->n_heads, hkv = b->n_kv_heads, d = b->head_dim;
    int64_t widest_k = b->fc_out.k > c ? b->fc_out.k : c;
    if (b->out_proj.k > widest_k) widest_k = b->out_proj.k;
    int64_t floats = 2 * c + b->in_proj.n + b->out_proj.k + b->fc_in.n + b->fc_out.k
                     + h_len * (t + 2);
    size_t xq_bytes = ((size_t)(widest_k + 1) * sizeof(int16_t) + 63) & ~(size_t)63;
    char *mem = hf_take(xq_bytes + (size_t)floats * sizeof(float));
    if (mem == NULL) return -1;
    int16_t *xq = (int16_t *)mem; /* each product's input grid, 64-byte aligned */
    float *h = (float *)(mem + xq_bytes), *x1 = h + c, *qkv = x1 + c, *att = qkv + b->in_proj.n;
    float *f = att + b->out_proj.k, *g = f + b->fc_in.n, *scores = g + b->fc_out.k;
    attend_fn attend = pick_attend(isa, d); /* both 512-bit product paths take its AVX-512 */

    norm(isa, b, x, b->norm1_w, b->norm1_b, h);
    product(isa, &b->in_proj, h, xq, qkv); /* H query heads, Hkv key heads, Hkv value heads */
    int64_t row = hkv * d; /* one column's heads */
    float *k0 = kv, *v0 = kv + cap * row;
    for (int64_t i = 0; i < row; i++) k0[t * row + i] = qkv[h_len * d + i];
    for (int64_t i = 0; i < row; i++) v0[t * row + i] = qkv[h_len * d + row + i];
    attend(qkv, d, k0, v0, t + 1, row, d, h_len, h_len / hkv, d, b->attn_scale, scores, att);
    product(isa, &b->out_proj, att, xq, x1);
    for (int64_t i = 0; i < c; i++) x1[i] = x[i] + x1[i];
    norm(isa, b, x1, b->norm2_w, b->norm2_b, h);
    product(isa, &b->fc_in, h, xq, f);
    activate(isa, b->activation, f, b->fc_out.k, g);
    product(isa, &b->fc_out, g, xq, y);
    for (int64_t i = 0; i < c; i++) y[i] = x1[i] + y[i];
    hf_give(mem);
    return 0;
}

/* A stack of blocks' decoding step in one call: block i reads what block i - 1 wrote, x → y
 * through n blocks (all of width C), block i's cache kvs[i] of capacity caps[i]. `work`
 * holds 2·C floats for the hidden states between blocks. One call instead of n spares the
 * caller a return to Python between blocks, whose work there runs with caches the weights
 * just streamed through. Returns 0, or -1 where a block's scratch cannot be allocated. */
int hf_decode_stack(int isa, int64_t n, const struct hf_block *const *blocks,
                    float *const *kvs, const int64_t *caps, int64_t t, const float *x,
                    float *work, float *y) {
    const float *in = x;
    for (int64_t i = 0; i < n; i++) {
        float *out = i == n - 1 ? y : work + (i % 2) * blocks[i]->d_model;
        if (hf_decode_block(isa, blocks[i], in, kvs[i], caps[i], t, out) != 0) return -1;
        in = out;
    }
    return 0;
}

/* The model's two ends around the stack, for hf_decode_token: the token table (V_in, C), the
 * learned positions (P, C) or NULL, the final norm (a block's norm kinds) and the head, an
 * int8 product (V, C). */
struct hf_ends {
    const float *token;
    int64_t n_tokens;
    const float *positions;
    int64_t n_positions;
    int32_t norm_type;
    float eps;
    const float *norm_w, *norm_b; /* a LayerNorm's bias may be NULL */
    struct hf_linear head;
};

/* Greedy decoding's choice from logits (V): the first index of the largest value, the one
 * torch's argmax picks. Returns 0, or 1 where the logits cannot be sampled from — a NaN or
 * +inf anywhere, or no finite value (-inf everywhere) — leaving *id untouched: the caller's
 * sampling then names the fault. */
static int greedy_id(const float *logits, int64_t v, int64_t *id) {
    float best = -INFINITY;
    int64_t at = -1; /* stays -1 while every value is -inf */
    int bad = 0;
    for (int64_t i = 0; i < v; i++) {
        float a = logits[i];
        bad |= isnan(a) || a == INFINITY;
        if (a > best) {
            best = a;
            at = i;
        }
    }
    if (bad || at < 0) return 1;
    *id = at;
    return 0;
}

/* A whole decoding token in one call: the token's row of the table (plus its position's
 * row, one float add, as the embedding module does), the stack, the final norm and the head
 * → logits (V). After the stack, the Python that ran the embedding, the norm and the head
 * ran with caches the weights had just streamed through; here they are a few loops over C
 * floats. `work` holds 5·C floats: the stack's 2·C, the token's input and output (C each)
 * and the head's input grid (C int16). With `next_id` (else NULL), greedy decoding's next
 * token is written there too (greedy_id), so that no tensor op runs between tokens.
 * Returns 0; -2 where the id or the position lies outside its table (nothing is read or
 * written: the modules' path raises the error); -1 where a block's scratch cannot be
 * allocated; 1 where `next_id` was asked for and the logits cannot be sampled from (they
 * and the cache column are written, `next_id` is not). */
int hf_decode_token(int isa, int64_t n, const struct hf_block *const *blocks,
                    float *const *kvs, const int64_t *caps, int64_t t, const int64_t *id,
                    int64_t position, const struct hf_ends *e, float *work, float *logits,
                    int64_t *next_id) {
    int64_t c = blocks[0]->d_model, row = *id;
    if (row < 0 || row >= e->n_tokens
        || (e->positions != NULL && (position < 0 || position >= e->n_positions)))
        return -2;
    float *x = work + 2 * c, *y = work + 3 * c;
    int16_t *xq = (int16_t *)(work + 4 * c);
    const float *tok = e->token + row * c;
    if (e->positions != NULL) {
        const float *pos = e->positions + position * c;
        for (int64_t i = 0; i < c; i++) x[i] = tok[i] + pos[i];
    } else {
        for (int64_t i = 0; i < c; i++) x[i] = tok[i];
    }
    if (hf_decode_stack(isa, n, blocks, kvs, caps, t, x, work, y) != 0) return -1;
    norm_row(isa, e->norm_type, c, e->eps, y, e->norm_w, e->norm_b, x);
    product(isa, &e->head, x, xq, logits);
    return next_id == NULL ? 0 : greedy_id(logits, e->head.n, next_id);
}
