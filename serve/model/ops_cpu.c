/* The CPU reference model ops: single-threaded, on the calling thread. Dot products follow the
 * accumulation orders fixed in ops.h; on x86-64 they run as SSE2 (baseline, no -march) whose
 * lanes are exactly those accumulators, elsewhere as the same scalar code. No FMA is used: a
 * fused multiply-add would round differently from the scalar path. */
#include <math.h>
#include <string.h>

#include "model/gguf.h"
#include "model/ops.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define OPS_SSE2 1
#else
#define OPS_SSE2 0
#endif

/* Tokens per tile of a projection: a tile's inputs stay in cache while the weight rows stream
 * past once per tile. */
#define TOKEN_TILE 64u

/* The 8 float accumulators of a dot product combined in the order ops.h fixes. */
static inline float combine8(const float a[8])
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* dot(x, w) over n inputs, input j in accumulator j % 8. */
static float dot1(const float *x, const float *w, uint32_t n)
{
    float acc[8] = {0};
    uint32_t j = 0;
#if OPS_SSE2
    __m128 lo = _mm_setzero_ps(), hi = _mm_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        lo = _mm_add_ps(lo, _mm_mul_ps(_mm_loadu_ps(x + j), _mm_loadu_ps(w + j)));
        hi = _mm_add_ps(hi, _mm_mul_ps(_mm_loadu_ps(x + j + 4), _mm_loadu_ps(w + j + 4)));
    }
    _mm_storeu_ps(acc, lo);
    _mm_storeu_ps(acc + 4, hi);
#else
    for (; j + 8 <= n; j += 8)
        for (uint32_t k = 0; k < 8; k++) acc[k] += x[j + k] * w[j + k];
#endif
    for (; j < n; j++) acc[j & 7] += x[j] * w[j];
    return combine8(acc);
}

/* dot1 for four weight rows at once: x is loaded once for all four. */
static void dot4(const float *x, const float *w0, const float *w1, const float *w2, const float *w3,
                 uint32_t n, float y[4])
{
    float acc[4][8];
    const float *w[4] = {w0, w1, w2, w3};
    uint32_t j = 0;
#if OPS_SSE2
    __m128 l0 = _mm_setzero_ps(), h0 = _mm_setzero_ps(), l1 = _mm_setzero_ps(),
           h1 = _mm_setzero_ps(), l2 = _mm_setzero_ps(), h2 = _mm_setzero_ps(),
           l3 = _mm_setzero_ps(), h3 = _mm_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m128 xl = _mm_loadu_ps(x + j), xh = _mm_loadu_ps(x + j + 4);
        l0 = _mm_add_ps(l0, _mm_mul_ps(xl, _mm_loadu_ps(w0 + j)));
        h0 = _mm_add_ps(h0, _mm_mul_ps(xh, _mm_loadu_ps(w0 + j + 4)));
        l1 = _mm_add_ps(l1, _mm_mul_ps(xl, _mm_loadu_ps(w1 + j)));
        h1 = _mm_add_ps(h1, _mm_mul_ps(xh, _mm_loadu_ps(w1 + j + 4)));
        l2 = _mm_add_ps(l2, _mm_mul_ps(xl, _mm_loadu_ps(w2 + j)));
        h2 = _mm_add_ps(h2, _mm_mul_ps(xh, _mm_loadu_ps(w2 + j + 4)));
        l3 = _mm_add_ps(l3, _mm_mul_ps(xl, _mm_loadu_ps(w3 + j)));
        h3 = _mm_add_ps(h3, _mm_mul_ps(xh, _mm_loadu_ps(w3 + j + 4)));
    }
    _mm_storeu_ps(acc[0], l0);
    _mm_storeu_ps(acc[0] + 4, h0);
    _mm_storeu_ps(acc[1], l1);
    _mm_storeu_ps(acc[1] + 4, h1);
    _mm_storeu_ps(acc[2], l2);
    _mm_storeu_ps(acc[2] + 4, h2);
    _mm_storeu_ps(acc[3], l3);
    _mm_storeu_ps(acc[3] + 4, h3);
#else
    memset(acc, 0, sizeof(acc));
    for (; j + 8 <= n; j += 8)
        for (uint32_t r = 0; r < 4; r++)
            for (uint32_t k = 0; k < 8; k++) acc[r][k] += x[j + k] * w[r][j + k];
#endif
    for (; j < n; j++)
        for (uint32_t r = 0; r < 4; r++) acc[r][j & 7] += x[j] * w[r][j];
    for (uint32_t r = 0; r < 4; r++) y[r] = combine8(acc[r]);
}

static void cpu_matmul(void *ctx, const float *x, const float *w, uint32_t n, uint32_t in,
                       uint32_t out, float *y)
{
    (void) ctx;
    for (uint32_t t0 = 0; t0 < n; t0 += TOKEN_TILE) {
        const uint32_t t1 = n - t0 < TOKEN_TILE ? n : t0 + TOKEN_TILE;
        uint32_t i = 0;
        for (; i + 4 <= out; i += 4) {
            const float *w0 = w + (size_t) i * in;
            for (uint32_t t = t0; t < t1; t++) {
                float r[4];
                dot4(x + (size_t) t * in, w0, w0 + in, w0 + 2 * (size_t) in, w0 + 3 * (size_t) in,
                     in, r);
                memcpy(y + (size_t) t * out + i, r, sizeof(r));
            }
        }
        for (; i < out; i++)
            for (uint32_t t = t0; t < t1; t++)
                y[(size_t) t * out + i] = dot1(x + (size_t) t * in, w + (size_t) i * in, in);
    }
}

/* v rounded to the nearest integer (ties to even) while it is below 2^51, where adding and
 * removing 1.5 * 2^52 does exactly that; larger values are left as they are (see ops.h). */
static inline double round_fix(double v)
{
    const double magic = 0x1.8p52;
    if (fabs(v) < 0x1p51) return (v + magic) - magic;
    return v;
}

#define FIX_SCALE   ((double) (UINT64_C(1) << KVS_MODEL_FIX_SHIFT))
#define FIX_UNSCALE (1.0 / FIX_SCALE)

/* The row-split partial of `rows` (1..4) weight rows for one token, plainly: blocks of
 * `block` inputs, each a double dot with 4 accumulators, quantised to 2^-S and summed in
 * order. partial4_sse2 computes exactly this, faster. */
static void partial_rows(const float *x, const float *const *w, uint32_t rows, uint32_t in,
                         uint32_t block, double *y)
{
    double tot[4] = {0, 0, 0, 0};
    for (uint32_t b0 = 0; b0 < in; b0 += block) {
        double acc[4][4];
        memset(acc, 0, sizeof(acc));
        for (uint32_t j = b0; j < b0 + block; j++)
            for (uint32_t r = 0; r < rows; r++)
                acc[r][(j - b0) & 3] += (double) x[j] * (double) w[r][j];
        for (uint32_t r = 0; r < rows; r++)
            tot[r] += round_fix(((acc[r][0] + acc[r][2]) + (acc[r][1] + acc[r][3])) * FIX_SCALE);
    }
    for (uint32_t r = 0; r < rows; r++) y[r] = tot[r];
}

#if OPS_SSE2
/* One row's 4 inputs at j: lanes (j, j+1) into lo and (j+2, j+3) into hi. */
#define PARTIAL_ROW(lo, hi, wr)                                                                    \
    do {                                                                                           \
        __m128 wv = _mm_loadu_ps((wr) + j);                                                        \
        lo = _mm_add_pd(lo, _mm_mul_pd(xl, _mm_cvtps_pd(wv)));                                     \
        hi = _mm_add_pd(hi, _mm_mul_pd(xh, _mm_cvtps_pd(_mm_movehl_ps(wv, wv))));                  \
    } while (0)

/* Block sums of two rows, (a0+a2)+(a1+a3) each, scaled and rounded as round_fix does. */
static inline __m128d quantise2(__m128d lo_a, __m128d hi_a, __m128d lo_b, __m128d hi_b)
{
    const __m128d ta = _mm_add_pd(lo_a, hi_a), tb = _mm_add_pd(lo_b, hi_b);
    const __m128d v = _mm_mul_pd(_mm_add_pd(_mm_unpacklo_pd(ta, tb), _mm_unpackhi_pd(ta, tb)),
                                 _mm_set1_pd(FIX_SCALE));
    const __m128d magic = _mm_set1_pd(0x1.8p52);
    const __m128d rounded = _mm_sub_pd(_mm_add_pd(v, magic), magic);
    const __m128d absv = _mm_andnot_pd(_mm_set1_pd(-0.0), v);
    const __m128d small = _mm_cmplt_pd(absv, _mm_set1_pd(0x1p51));
    return _mm_or_pd(_mm_and_pd(small, rounded), _mm_andnot_pd(small, v));
}

/* partial_rows for 4 rows and block % 4 == 0, in SSE2 registers. */
static void partial4_sse2(const float *x, const float *const *w, uint32_t in, uint32_t block,
                          double *y)
{
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    __m128d tot01 = _mm_setzero_pd(), tot23 = _mm_setzero_pd();
    for (uint32_t b0 = 0; b0 < in; b0 += block) {
        __m128d l0 = _mm_setzero_pd(), h0 = _mm_setzero_pd(), l1 = _mm_setzero_pd(),
                h1 = _mm_setzero_pd(), l2 = _mm_setzero_pd(), h2 = _mm_setzero_pd(),
                l3 = _mm_setzero_pd(), h3 = _mm_setzero_pd();
        for (uint32_t j = b0; j < b0 + block; j += 4) {
            const __m128 xv = _mm_loadu_ps(x + j);
            const __m128d xl = _mm_cvtps_pd(xv), xh = _mm_cvtps_pd(_mm_movehl_ps(xv, xv));
            PARTIAL_ROW(l0, h0, w0);
            PARTIAL_ROW(l1, h1, w1);
            PARTIAL_ROW(l2, h2, w2);
            PARTIAL_ROW(l3, h3, w3);
        }
        tot01 = _mm_add_pd(tot01, quantise2(l0, h0, l1, h1));
        tot23 = _mm_add_pd(tot23, quantise2(l2, h2, l3, h3));
    }
    _mm_storeu_pd(y, tot01);
    _mm_storeu_pd(y + 2, tot23);
}
#undef PARTIAL_ROW
#endif

static void cpu_matmul_partial(void *ctx, const float *x, const float *w, uint32_t n, uint32_t in,
                               uint32_t out, uint32_t block, double *y)
{
    (void) ctx;
    for (uint32_t t0 = 0; t0 < n; t0 += TOKEN_TILE) {
        const uint32_t t1 = n - t0 < TOKEN_TILE ? n : t0 + TOKEN_TILE;
        for (uint32_t i = 0; i < out; i += 4) {
            const uint32_t rows = out - i < 4 ? out - i : 4;
            const float *w4[4];
            for (uint32_t r = 0; r < rows; r++) w4[r] = w + (size_t) (i + r) * in;
            for (uint32_t t = t0; t < t1; t++) {
                double r4[4];
#if OPS_SSE2
                if (rows == 4 && block % 4 == 0)
                    partial4_sse2(x + (size_t) t * in, w4, in, block, r4);
                else
#endif
                    partial_rows(x + (size_t) t * in, w4, rows, in, block, r4);
                memcpy(y + (size_t) t * out + i, r4, rows * sizeof(double));
            }
        }
    }
}

static void cpu_add_partial(void *ctx, float *x, const double *d, size_t count)
{
    (void) ctx;
    for (size_t i = 0; i < count; i++) x[i] = (float) ((double) x[i] + d[i] * FIX_UNSCALE);
}

static void cpu_embed(void *ctx, const float *table, uint32_t dim, const uint32_t *tokens,
                      uint32_t n, float *x)
{
    (void) ctx;
    for (uint32_t t = 0; t < n; t++)
        memcpy(x + (size_t) t * dim, table + (size_t) tokens[t] * dim, dim * sizeof(float));
}

static void cpu_rmsnorm(void *ctx, const float *x, const float *w, uint32_t n, uint32_t dim,
                        float eps, float *y)
{
    (void) ctx;
    for (uint32_t t = 0; t < n; t++) {
        const float *xt = x + (size_t) t * dim;
        float *yt = y + (size_t) t * dim;
        double ss = 0;
        for (uint32_t j = 0; j < dim; j++) ss += (double) xt[j] * xt[j];
        const double inv = 1.0 / sqrt(ss / dim + (double) eps);
        for (uint32_t j = 0; j < dim; j++) yt[j] = (float) (xt[j] * inv) * w[j];
    }
}

static void cpu_rope(void *ctx, float *x, const uint32_t *pos, uint32_t n, uint32_t heads,
                     uint32_t head_dim, float theta)
{
    (void) ctx;
    for (uint32_t t = 0; t < n; t++) {
        float *xt = x + (size_t) t * heads * head_dim; /* [heads][head_dim] */
        for (uint32_t i = 0; i < head_dim / 2; i++) {
            const double angle = pos[t] * pow((double) theta, -2.0 * i / head_dim);
            const double c = cos(angle), s = sin(angle);
            for (uint32_t h = 0; h < heads; h++) {
                float *p = xt + (size_t) h * head_dim + 2 * i;
                const double x0 = p[0], x1 = p[1];
                p[0] = (float) (x0 * c - x1 * s);
                p[1] = (float) (x0 * s + x1 * c);
            }
        }
    }
}

/* Address of (position, local head) of a region through the token's page table. */
static inline uint8_t *kv_at(const kvs_region_t *r, const uint32_t *pages, uint32_t page_size,
                             uint32_t pos, uint32_t head)
{
    return kvs_region_addr(r, pages[pos / page_size], pos % page_size, head);
}

/* bf16 K/V (elem_bytes 2, the CUDA backend's dtype, so that a CPU instance pairs with a GPU
 * one): stored rounded to nearest even from the f32 values (kvs_f32_to_bf16, NaN kept a NaN),
 * read back exactly (kvs_bf16_to_f32). */
static void store_head(uint8_t *dst, const float *src, uint32_t n, uint32_t elem_bytes)
{
    if (elem_bytes == sizeof(float)) {
        memcpy(dst, src, (size_t) n * sizeof(float));
        return;
    }
    for (uint32_t i = 0; i < n; i++) {
        const uint16_t h = kvs_f32_to_bf16(src[i]);
        memcpy(dst + 2 * (size_t) i, &h, 2);
    }
}

/* The head at src as floats: src itself for f32, else widened into tmp[n]. */
static inline const float *load_head(const uint8_t *src, uint32_t n, uint32_t elem_bytes,
                                     float *tmp)
{
    if (elem_bytes == sizeof(float)) return (const float *) src;
    for (uint32_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * (size_t) i, 2);
        tmp[i] = kvs_bf16_to_f32(h);
    }
    return tmp;
}

static void cpu_kv_write(void *ctx, const kvs_model_kv_desc_t *d)
{
    (void) ctx;
    for (uint32_t t = 0; t < d->n; t++) {
        for (uint32_t h = 0; h < d->kv_heads; h++) {
            const size_t off = ((size_t) t * d->kv_heads + h) * d->head_dim;
            store_head(kv_at(d->k, d->pages[t], d->page_size, d->pos[t], h), d->k_new + off,
                       d->head_dim, d->k->elem_bytes);
            store_head(kv_at(d->v, d->pages[t], d->page_size, d->pos[t], h), d->v_new + off,
                       d->head_dim, d->v->elem_bytes);
        }
    }
}

/* out[k] += p * v[k]: elementwise, so the SSE2 lanes round exactly as the scalar loop. */
static inline void axpy(float *out, float p, const float *v, uint32_t n)
{
    uint32_t k = 0;
#if OPS_SSE2
    const __m128 pv = _mm_set1_ps(p);
    for (; k + 4 <= n; k += 4)
        _mm_storeu_ps(out + k,
                      _mm_add_ps(_mm_loadu_ps(out + k), _mm_mul_ps(pv, _mm_loadu_ps(v + k))));
#endif
    for (; k < n; k++) out[k] += p * v[k];
}

static void cpu_attention(void *ctx, const kvs_model_kv_desc_t *d)
{
    (void) ctx;
    const uint32_t D = d->head_dim, P = d->page_size;
    float *s = d->scores;              /* [pos + 1] */
    float tmp[KVS_MODEL_MAX_HEAD_DIM]; /* a bf16 head widened */
    for (uint32_t t = 0; t < d->n; t++) {
        const uint32_t *pages = d->pages[t];
        const uint32_t len = d->pos[t] + 1;
        for (uint32_t qh = 0; qh < d->q_heads; qh++) {
            const size_t off = ((size_t) t * d->q_heads + qh) * D;
            const float *q = d->q + off;
            float *out = d->out + off;
            const uint32_t kvh = d->q_kv[qh];

            float max = -INFINITY;
            for (uint32_t i = 0; i < len; i++) {
                const float *k = load_head(kv_at(d->k, pages, P, i, kvh), D, d->k->elem_bytes, tmp);
                s[i] = dot1(q, k, D) * d->scale;
                if (s[i] > max) max = s[i];
            }
            double sum = 0;
            for (uint32_t i = 0; i < len; i++) {
                s[i] = expf(s[i] - max);
                sum += s[i];
            }
            memset(out, 0, D * sizeof(float));
            for (uint32_t i = 0; i < len; i++)
                axpy(out, s[i], load_head(kv_at(d->v, pages, P, i, kvh), D, d->v->elem_bytes, tmp),
                     D);
            for (uint32_t k = 0; k < D; k++) out[k] = (float) (out[k] / sum);
        }
    }
}

static void cpu_silu_mul(void *ctx, float *g, const float *u, size_t count)
{
    (void) ctx;
    for (size_t i = 0; i < count; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void cpu_destroy(void *ctx)
{
    (void) ctx;
}

const kvs_model_ops_t kvs_model_ops_cpu = {
    .name = "cpu",
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .matmul_partial = cpu_matmul_partial,
    .add_partial = cpu_add_partial,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .destroy = cpu_destroy,
};
