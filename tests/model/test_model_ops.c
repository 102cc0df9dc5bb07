/* Tests for the CPU model ops (serve/model/ops_cpu.c) against naive references written here in
 * double: rmsnorm, RoPE (including a rotation checked by hand), projections (and their
 * batch independence), the row-split partials (exactly split-invariant), SwiGLU, K/V writes
 * and attention over a paged pool with random page tables in NHD and HND at several page
 * sizes. Token sampling is tested in test_sample.c. */
#include "kvs_test.h"

#include <math.h>
#include <string.h>

#include "model/model.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "model/ops.h"

static const kvs_model_ops_t *ops = &kvs_model_ops_cpu;

/* Uniform in [-1, 1). */
static float frand(kvs_rng_t *rng)
{
    return (float) ((double) (kvs_rng_next(rng) >> 40) * 0x1p-23 - 1.0);
}

static void fill(kvs_rng_t *rng, float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) x[i] = frand(rng);
}

static float *falloc(size_t n)
{
    float *p = kvs_calloc(n ? n : 1, sizeof(float));
    assert_non_null(p);
    return p;
}

static void assert_close(double got, double want, double tol, const char *what, size_t i,
                         uint64_t seed)
{
    if (!(fabs(got - want) <= tol * (1.0 + fabs(want))))
        fail_msg("%s[%zu]: got %.9g, want %.9g (seed %llu)", what, i, got, want,
                 (unsigned long long) seed);
}

static void test_rmsnorm(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(11);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const uint32_t n = 5, dim = 37;
    float *x = falloc(n * dim), *w = falloc(dim), *y = falloc(n * dim);
    fill(&rng, x, n * dim);
    fill(&rng, w, dim);
    x[3] = 0; /* a zero element changes nothing */
    ops->rmsnorm(NULL, x, w, n, dim, 1e-5f, y);
    for (uint32_t t = 0; t < n; t++) {
        double ss = 0;
        for (uint32_t j = 0; j < dim; j++) ss += (double) x[t * dim + j] * x[t * dim + j];
        const double inv = 1.0 / sqrt(ss / dim + 1e-5);
        for (uint32_t j = 0; j < dim; j++)
            assert_close(y[t * dim + j], x[t * dim + j] * inv * w[j], 1e-6, "rmsnorm", t * dim + j,
                         seed);
    }
    /* all-zero input stays zero (eps keeps it finite) */
    memset(x, 0, dim * sizeof(float));
    ops->rmsnorm(NULL, x, w, 1, dim, 1e-5f, y);
    for (uint32_t j = 0; j < dim; j++) assert_true(y[j] == 0.0f);
    kvs_free(x);
    kvs_free(w);
    kvs_free(y);
    kvs_assert_no_leaks();
}

static void test_rope_by_hand(void **state)
{
    (void) state;
    /* head_dim 4, theta 10000: pair 0 turns by pos rad, pair 1 by pos * 10000^(-1/2) */
    float x[2][4] = {{1, 0, 0, 1}, {1, 0, 0, 1}};
    const uint32_t pos[2] = {0, 1};
    ops->rope(NULL, &x[0][0], pos, 2, 1, 4, 10000.0f);
    /* position 0 is the identity, exactly */
    assert_true(x[0][0] == 1.0f && x[0][1] == 0.0f && x[0][2] == 0.0f && x[0][3] == 1.0f);
    /* (1, 0) by 1 rad -> (cos 1, sin 1); (0, 1) by 0.01 rad -> (-sin 0.01, cos 0.01) */
    assert_true(x[1][0] == (float) cos(1.0));
    assert_true(x[1][1] == (float) sin(1.0));
    assert_true(x[1][2] == (float) -sin(0.01));
    assert_true(x[1][3] == (float) cos(0.01));
    assert_true(fabsf(x[1][0] - 0.5403023f) < 1e-7f && fabsf(x[1][1] - 0.8414710f) < 1e-7f);
}

static void test_rope_random(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(12);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const uint32_t n = 6, heads = 3, hd = 16;
    const float theta = 100000.0f;
    float *x = falloc(n * heads * hd), *y = falloc(n * heads * hd);
    uint32_t pos[6];
    for (uint32_t t = 0; t < n; t++) pos[t] = (uint32_t) kvs_rng_below(&rng, 5000);
    fill(&rng, x, n * heads * hd);
    memcpy(y, x, n * heads * hd * sizeof(float));
    ops->rope(NULL, y, pos, n, heads, hd, theta);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < heads; h++)
            for (uint32_t i = 0; i < hd / 2; i++) {
                const size_t o = (t * heads + h) * hd + 2 * i;
                const double a = pos[t] * pow(theta, -2.0 * i / hd);
                const double x0 = x[o], x1 = x[o + 1];
                assert_close(y[o], x0 * cos(a) - x1 * sin(a), 1e-6, "rope", o, seed);
                assert_close(y[o + 1], x0 * sin(a) + x1 * cos(a), 1e-6, "rope", o + 1, seed);
            }
    kvs_free(x);
    kvs_free(y);
    kvs_assert_no_leaks();
}

static void test_matmul(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(13);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    /* in not a multiple of 8 and out not of 4: every tail path runs */
    const uint32_t shapes[][3] = {{1, 8, 4}, {3, 37, 7}, {70, 64, 9}, {5, 3, 2}, {2, 200, 13}};
    for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++) {
        const uint32_t n = shapes[k][0], in = shapes[k][1], out = shapes[k][2];
        float *x = falloc(n * in), *w = falloc(out * in), *y = falloc(n * out);
        float *y1 = falloc(out);
        fill(&rng, x, n * in);
        fill(&rng, w, out * in);
        ops->matmul(NULL, x, w, n, in, out, y);
        for (uint32_t t = 0; t < n; t++) {
            for (uint32_t i = 0; i < out; i++) {
                double ref = 0;
                for (uint32_t j = 0; j < in; j++) ref += (double) x[t * in + j] * w[i * in + j];
                assert_close(y[t * out + i], ref, 1e-5, "matmul", t * out + i, seed);
            }
            /* one token alone gives bitwise the same row as inside the batch */
            ops->matmul(NULL, x + (size_t) t * in, w, 1, in, out, y1);
            assert_memory_equal(y1, y + (size_t) t * out, out * sizeof(float));
        }
        kvs_free(x);
        kvs_free(w);
        kvs_free(y);
        kvs_free(y1);
    }
    kvs_assert_no_leaks();
}

/* The accumulation order of ops.h, written out plainly: the SSE2 path must equal it. */
static float dot_contract(const float *x, const float *w, uint32_t n)
{
    float a[8] = {0};
    for (uint32_t j = 0; j < n; j++) a[j % 8] += x[j] * w[j];
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static void test_matmul_order(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(14);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const uint32_t n = 3, in = 61, out = 6;
    float x[3 * 61], w[6 * 61], y[3 * 6];
    fill(&rng, x, n * in);
    fill(&rng, w, out * in);
    ops->matmul(NULL, x, w, n, in, out, y);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t i = 0; i < out; i++)
            assert_true(y[t * out + i] == dot_contract(x + t * in, w + i * in, in));
}

static void test_matmul_partial(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(15);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const double unscale = 1.0 / (double) (UINT64_C(1) << KVS_MODEL_FIX_SHIFT);
    const uint32_t n = 4, in = 96, out = 7;
    float *x = falloc(n * in), *w = falloc(out * in);
    double *y = kvs_calloc(n * out, sizeof(double)), *part = kvs_calloc(n * out, sizeof(double));
    double *sum = kvs_calloc(n * out, sizeof(double));
    assert_non_null(y);
    assert_non_null(part);
    assert_non_null(sum);
    const uint32_t blocks[] = {16, 32, 3, 96};
    for (uint32_t iter = 0; iter < kvs_test_iters(20); iter++) {
        const uint32_t block = blocks[iter % 4];
        fill(&rng, x, n * in);
        fill(&rng, w, out * in);
        for (size_t i = 0; i < (size_t) out * in; i++) w[i] *= (float) (1 + iter); /* scales */
        ops->matmul_partial(NULL, x, w, n, in, out, block, y);
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t i = 0; i < out; i++) {
                double ref = 0;
                for (uint32_t j = 0; j < in; j++) ref += (double) x[t * in + j] * w[i * in + j];
                assert_true(y[t * out + i] == floor(y[t * out + i])); /* integers */
                assert_close(y[t * out + i] * unscale, ref, 1e-9, "partial", t * out + i, seed);
                /* a row alone (the scalar path) equals the row in a group of four */
                double one;
                ops->matmul_partial(NULL, x + t * in, w + i * in, 1, in, 1, block, &one);
                assert_true(one == y[t * out + i]);
            }
        if (block != 16) continue;
        /* Split the inputs as TP 2, 3 and 6 would (each rank its own columns of w, whole
         * blocks): the sum of the ranks' partials in rank order is bitwise the unsplit one. */
        const uint32_t splits[] = {2, 3, 6};
        for (size_t k = 0; k < 3; k++) {
            const uint32_t T = splits[k], cols = in / T;
            memset(sum, 0, n * out * sizeof(double));
            float *xs = falloc(n * cols), *ws = falloc(out * cols);
            for (uint32_t r = 0; r < T; r++) {
                for (uint32_t t = 0; t < n; t++)
                    memcpy(xs + t * cols, x + t * in + r * cols, cols * sizeof(float));
                for (uint32_t i = 0; i < out; i++)
                    memcpy(ws + i * cols, w + i * in + r * cols, cols * sizeof(float));
                ops->matmul_partial(NULL, xs, ws, n, cols, out, block, part);
                for (uint32_t e = 0; e < n * out; e++) sum[e] += part[e];
            }
            assert_memory_equal(sum, y, n * out * sizeof(double));
            kvs_free(xs);
            kvs_free(ws);
        }
    }
    /* add_partial: one rounding of x + d * 2^-S */
    float xr[3] = {1.0f, -2.5f, 0.0f};
    const double d[3] = {0x1p36, 3.0 * 0x1p35, -1.0};
    ops->add_partial(NULL, xr, d, 3);
    assert_true(xr[0] == 2.0f && xr[1] == -1.0f && xr[2] == (float) -unscale);
    kvs_free(x);
    kvs_free(w);
    kvs_free(y);
    kvs_free(part);
    kvs_free(sum);
    kvs_assert_no_leaks();
}

static void test_silu_mul(void **state)
{
    (void) state;
    float g[5] = {-3, -0.5f, 0, 0.5f, 4}, u[5] = {1, 2, 3, -1, 0.25f};
    float g0[5];
    memcpy(g0, g, sizeof(g));
    ops->silu_mul(NULL, g, u, 5);
    for (int i = 0; i < 5; i++)
        assert_close(g[i], g0[i] / (1.0 + exp(-g0[i])) * u[i], 1e-6, "silu", (size_t) i, 0);
    assert_true(g[2] == 0.0f);
}

/* ---- K/V writes and attention over a paged pool ---- */

#define A_KVH      2
#define A_QH       4
#define A_D        12 /* not a multiple of 8: the dot tail runs */
#define A_LEN      37
#define A_PAGE_MAX 64

/* Writes random K/V for positions 0..A_LEN-1 into a pool of the given layout and page size
 * through a random page table, checks where they landed, and runs attention for every
 * position; out receives [A_LEN][A_QH][A_D]. */
static void attend_in_pool(kvs_pool_layout_t layout, uint32_t P, const float *k_new,
                           const float *v_new, const float *q, kvs_rng_t *rng, float *out)
{
    kvs_pool_config_t c;
    memset(&c, 0, sizeof(c));
    c.shape = (kvs_kv_shape_t){.layers = 1,
                               .kv_heads = A_KVH,
                               .head_dim_k = A_D,
                               .head_dim_v = A_D,
                               .elem_bytes = 4,
                               .attn = KVS_ATTN_MHA};
    c.tp = (kvs_tp_t){1, 0};
    c.page_size = P;
    c.num_pages = A_LEN + 5;
    c.layout = layout;
    c.mem = KVS_MEM_HOST;
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_OK);
    uint32_t all[A_LEN + 5];
    assert_int_equal(kvs_pool_alloc(pool, c.num_pages, all), KVS_OK);
    for (uint32_t i = c.num_pages - 1; i > 0; i--) { /* shuffle: a random page table */
        uint32_t j = (uint32_t) kvs_rng_below(rng, i + 1), tmp = all[i];
        all[i] = all[j];
        all[j] = tmp;
    }
    uint32_t pos[A_LEN];
    const uint32_t *pages[A_LEN];
    for (uint32_t t = 0; t < A_LEN; t++) {
        pos[t] = t;
        pages[t] = all;
    }
    float scores[A_LEN];
    const uint32_t q_kv[A_QH] = {0, 0, 1, 1};
    kvs_model_kv_desc_t d = {.k = kvs_pool_region(pool, 0, 0),
                             .v = kvs_pool_region(pool, 0, 1),
                             .page_size = P,
                             .n = A_LEN,
                             .pos = pos,
                             .pages = pages,
                             .kv_heads = A_KVH,
                             .head_dim = A_D,
                             .k_new = k_new,
                             .v_new = v_new,
                             .q_heads = A_QH,
                             .q_kv = q_kv,
                             .scale = (float) (1.0 / sqrt(A_D)),
                             .q = q,
                             .out = out,
                             .scores = scores};
    ops->kv_write(NULL, &d);
    for (uint32_t t = 0; t < A_LEN; t++)
        for (uint32_t h = 0; h < A_KVH; h++) {
            const size_t o = ((size_t) t * A_KVH + h) * A_D;
            assert_memory_equal(kvs_region_addr(d.k, all[t / P], t % P, h), k_new + o,
                                A_D * sizeof(float));
            assert_memory_equal(kvs_region_addr(d.v, all[t / P], t % P, h), v_new + o,
                                A_D * sizeof(float));
        }
    ops->attention(NULL, &d);

    /* the last token alone (decode) attends exactly as it did inside the batch */
    float last[A_QH * A_D];
    d.n = 1;
    d.pos = &pos[A_LEN - 1];
    d.pages = &pages[A_LEN - 1];
    d.q = q + (size_t) (A_LEN - 1) * A_QH * A_D;
    d.out = last;
    ops->attention(NULL, &d);
    assert_memory_equal(last, out + (size_t) (A_LEN - 1) * A_QH * A_D, sizeof(last));
    kvs_pool_destroy(pool);
}

static void test_attention_paged(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(16);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const size_t kv_n = (size_t) A_LEN * A_KVH * A_D, q_n = (size_t) A_LEN * A_QH * A_D;
    float *k = falloc(kv_n), *v = falloc(kv_n), *q = falloc(q_n);
    float *first = falloc(q_n), *out = falloc(q_n);
    fill(&rng, k, kv_n);
    fill(&rng, v, kv_n);
    fill(&rng, q, q_n);
    for (size_t i = 0; i < q_n; i++) q[i] *= 4; /* sharper softmax */

    const uint32_t page_sizes[] = {1, 3, 16};
    int have_first = 0;
    for (int layout = 0; layout < 2; layout++) {
        for (size_t p = 0; p < 3; p++) {
            attend_in_pool((kvs_pool_layout_t) layout, page_sizes[p], k, v, q, &rng, out);
            if (!have_first) {
                memcpy(first, out, q_n * sizeof(float));
                have_first = 1;
            }
            /* the pool's layout and page size never change a bit of the result */
            assert_memory_equal(out, first, q_n * sizeof(float));
        }
    }
    /* ...which equals causal attention over contiguous arrays, in double */
    double s[A_LEN];
    for (uint32_t t = 0; t < A_LEN; t++)
        for (uint32_t h = 0; h < A_QH; h++) {
            const uint32_t kvh = h / 2;
            const float *qv = q + ((size_t) t * A_QH + h) * A_D;
            double max = -INFINITY, sum = 0;
            for (uint32_t i = 0; i <= t; i++) {
                double dot = 0;
                for (uint32_t j = 0; j < A_D; j++)
                    dot += (double) qv[j] * k[((size_t) i * A_KVH + kvh) * A_D + j];
                s[i] = dot / sqrt(A_D);
                if (s[i] > max) max = s[i];
            }
            for (uint32_t i = 0; i <= t; i++) sum += (s[i] = exp(s[i] - max));
            for (uint32_t j = 0; j < A_D; j++) {
                double o = 0;
                for (uint32_t i = 0; i <= t; i++)
                    o += s[i] * v[((size_t) i * A_KVH + kvh) * A_D + j];
                const size_t e = ((size_t) t * A_QH + h) * A_D + j;
                assert_close(first[e], o / sum, 1e-5, "attention", e, seed);
            }
        }
    kvs_free(k);
    kvs_free(v);
    kvs_free(q);
    kvs_free(first);
    kvs_free(out);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),      cmocka_unit_test(test_rope_by_hand),
        cmocka_unit_test(test_rope_random),  cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_matmul_order), cmocka_unit_test(test_matmul_partial),
        cmocka_unit_test(test_silu_mul),     cmocka_unit_test(test_attention_paged),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
