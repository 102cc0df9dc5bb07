/* Tests for src/pool: the page allocator (all-or-nothing alloc, validated free), configuration
 * checks, region strides and addresses for NHD and HND, and allocation-failure injection. */
#include "kvs_test.h"

#include <stdlib.h>
#include <string.h>

#include "kvstage/log.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"

static kvs_kv_shape_t mha_shape(uint32_t layers, uint32_t heads, uint32_t dk, uint32_t dv,
                                uint32_t e)
{
    kvs_kv_shape_t s = {.layers = layers,
                        .kv_heads = heads,
                        .head_dim_k = dk,
                        .head_dim_v = dv,
                        .elem_bytes = e,
                        .attn = KVS_ATTN_MHA};
    return s;
}

static kvs_kv_shape_t mla_shape(uint32_t layers, uint32_t latent, uint32_t e)
{
    kvs_kv_shape_t s = {.layers = layers,
                        .kv_heads = 1,
                        .head_dim_k = latent,
                        .head_dim_v = 0,
                        .elem_bytes = e,
                        .attn = KVS_ATTN_MLA};
    return s;
}

static kvs_pool_config_t pool_config(kvs_kv_shape_t shape, uint32_t tp_size, uint32_t tp_rank,
                                     uint32_t page_size, uint32_t pages, kvs_pool_layout_t layout)
{
    kvs_pool_config_t c;
    memset(&c, 0, sizeof(c));
    c.shape = shape;
    c.tp.tp_size = tp_size;
    c.tp.tp_rank = tp_rank;
    c.page_size = page_size;
    c.num_pages = pages;
    c.layout = layout;
    c.mem = KVS_MEM_HOST;
    return c;
}

static kvs_pool_t *make_pool(const kvs_pool_config_t *c)
{
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_create(c, &pool), KVS_OK);
    assert_non_null(pool);
    return pool;
}

static void test_alloc_free_all(void **state)
{
    (void) state;
    kvs_pool_config_t c = pool_config(mha_shape(2, 4, 8, 8, 2), 1, 0, 4, 37, KVS_POOL_NHD);
    kvs_pool_t *pool = make_pool(&c);
    assert_int_equal(kvs_pool_total_pages(pool), 37);
    assert_int_equal(kvs_pool_free_pages(pool), 37);
    assert_int_equal(kvs_pool_heads(pool), 4);
    assert_memory_equal(kvs_pool_config(pool), &c, sizeof(c));

    uint32_t pages[37];
    uint8_t seen[37] = {0};
    for (uint32_t i = 0; i < 37; i++) {
        assert_int_equal(kvs_pool_alloc(pool, 1, &pages[i]), KVS_OK);
        assert_true(pages[i] < 37);
        assert_false(seen[pages[i]]);
        seen[pages[i]] = 1;
        assert_true(kvs_pool_page_allocated(pool, pages[i]));
        assert_int_equal(kvs_pool_free_pages(pool), 36 - i);
    }
    /* a fresh pool hands out ids in order */
    for (uint32_t i = 0; i < 37; i++) assert_int_equal(pages[i], i);

    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    uint32_t one = 12345;
    assert_int_equal(kvs_pool_alloc(pool, 1, &one), KVS_ERR_NOSPACE);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(one, 12345);
    assert_int_equal(cap.calls, 1);
    assert_non_null(strstr(cap.msg, "need 1"));
    assert_non_null(strstr(cap.msg, "0 free"));

    assert_int_equal(kvs_pool_free(pool, pages, 37), KVS_OK);
    assert_int_equal(kvs_pool_free_pages(pool), 37);
    for (uint32_t i = 0; i < 37; i++) assert_false(kvs_pool_page_allocated(pool, i));

    /* all at once, then nothing more; zero-page calls are no-ops */
    assert_int_equal(kvs_pool_alloc(pool, 37, pages), KVS_OK);
    memset(seen, 0, sizeof(seen));
    for (uint32_t i = 0; i < 37; i++) {
        assert_false(seen[pages[i]]);
        seen[pages[i]] = 1;
    }
    assert_int_equal(kvs_pool_free_pages(pool), 0);
    assert_int_equal(kvs_pool_alloc(pool, 0, NULL), KVS_OK);
    assert_int_equal(kvs_pool_free(pool, NULL, 0), KVS_OK);
    assert_int_equal(kvs_pool_free(pool, pages, 37), KVS_OK);
    assert_false(kvs_pool_page_allocated(pool, 37));
    assert_false(kvs_pool_page_allocated(pool, UINT32_MAX));
    kvs_pool_destroy(pool);
    kvs_assert_no_leaks();
}

static void test_out_of_pages_leaves_state(void **state)
{
    (void) state;
    kvs_pool_config_t c = pool_config(mla_shape(1, 16, 2), 2, 1, 8, 10, KVS_POOL_HND);
    kvs_pool_t *pool = make_pool(&c);
    uint32_t held[7];
    assert_int_equal(kvs_pool_alloc(pool, 7, held), KVS_OK);

    uint32_t out[8];
    memset(out, 0xee, sizeof(out));
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_pool_alloc(pool, 4, out), KVS_ERR_NOSPACE);
    kvs_log_set_sink(NULL, NULL);
    assert_non_null(strstr(cap.msg, "need 4"));
    assert_non_null(strstr(cap.msg, "3 free"));
    for (int i = 0; i < 8; i++) assert_int_equal(out[i], 0xeeeeeeeeu);
    assert_int_equal(kvs_pool_free_pages(pool), 3);
    for (uint32_t p = 0; p < 10; p++) {
        int held_p = 0;
        for (int i = 0; i < 7; i++) held_p |= held[i] == p;
        assert_int_equal(kvs_pool_page_allocated(pool, p), held_p);
    }
    /* exactly the remainder still fits */
    assert_int_equal(kvs_pool_alloc(pool, 3, out), KVS_OK);
    assert_int_equal(kvs_pool_free_pages(pool), 0);
    assert_int_equal(kvs_pool_free(pool, out, 3), KVS_OK);
    assert_int_equal(kvs_pool_free(pool, held, 7), KVS_OK);
    kvs_pool_destroy(pool);
    kvs_assert_no_leaks();
}

/* Every rejected free must leave every page exactly as it was. */
static void check_rejected_free(kvs_pool_t *pool, const uint32_t *pages, uint32_t n,
                                const char *expect_in_msg)
{
    uint32_t total = kvs_pool_total_pages(pool);
    uint32_t free_before = kvs_pool_free_pages(pool);
    uint8_t before[64];
    assert_true(total <= 64);
    for (uint32_t p = 0; p < total; p++) before[p] = (uint8_t) kvs_pool_page_allocated(pool, p);
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_pool_free(pool, pages, n), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 1);
    assert_non_null(strstr(cap.msg, expect_in_msg));
    assert_int_equal(kvs_pool_free_pages(pool), free_before);
    for (uint32_t p = 0; p < total; p++)
        assert_int_equal(kvs_pool_page_allocated(pool, p), before[p]);
}

static void test_free_rejects_bad_ids(void **state)
{
    (void) state;
    kvs_pool_config_t c = pool_config(mha_shape(1, 2, 4, 4, 1), 2, 0, 2, 16, KVS_POOL_NHD);
    kvs_pool_t *pool = make_pool(&c);
    uint32_t a[6];
    assert_int_equal(kvs_pool_alloc(pool, 6, a), KVS_OK); /* pages 0..5 */

    uint32_t bad_range[] = {a[0], a[1], 16};
    check_rejected_free(pool, bad_range, 3, "out of range");
    uint32_t huge[] = {UINT32_MAX};
    check_rejected_free(pool, huge, 1, "out of range");
    uint32_t not_alloc[] = {a[2], 9, a[3]};
    check_rejected_free(pool, not_alloc, 3, "not allocated");
    uint32_t dup[] = {a[0], a[1], a[2], a[1]};
    check_rejected_free(pool, dup, 4, "repeated");
    uint32_t dup_first[] = {a[4], a[4]};
    check_rejected_free(pool, dup_first, 2, "repeated");
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_pool_free(pool, NULL, 2), KVS_ERR_INVALID);
    assert_int_equal(kvs_pool_alloc(pool, 2, NULL), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 2);
    assert_int_equal(kvs_pool_free_pages(pool), 10);

    /* the marks made while validating were undone: a valid free of the same ids succeeds */
    uint32_t good[] = {a[1], a[0], a[2]};
    assert_int_equal(kvs_pool_free(pool, good, 3), KVS_OK);
    assert_int_equal(kvs_pool_free_pages(pool), 13);
    /* and a second free of them is a double free */
    check_rejected_free(pool, good, 1, "not allocated");
    uint32_t rest[] = {a[5], a[3], a[4]};
    assert_int_equal(kvs_pool_free(pool, rest, 3), KVS_OK);
    assert_int_equal(kvs_pool_free_pages(pool), 16);
    check_rejected_free(pool, rest, 3, "not allocated");
    kvs_pool_destroy(pool);
    kvs_assert_no_leaks();
}

static void test_config_validation(void **state)
{
    (void) state;
    kvs_pool_t *pool = (kvs_pool_t *) (uintptr_t) 0x1; /* must not be written on error */
    kvs_pool_config_t good = pool_config(mha_shape(2, 4, 8, 8, 2), 2, 1, 16, 8, KVS_POOL_NHD);
    kvs_pool_config_t c;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap); /* every call below but the last logs an error */

    c = good;
    c.page_size = 0;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    c = good;
    c.num_pages = 0;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    c = good;
    c.shape.elem_bytes = 3;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    c = good;
    c.shape.layers = 0;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    c = good;
    c.shape.kv_heads = 3; /* 3 heads over TP 2 */
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    c = good;
    c.tp.tp_rank = 2;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    c = good;
    c.layout = (kvs_pool_layout_t) 7;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    c = good;
    c.mem = (kvs_mem_kind_t) 9;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);

    c = good;
    c.mem = KVS_MEM_DEVICE;
    kvs_status_t st = kvs_pool_create(&c, &pool);
    if (st == KVS_OK) {
        /* a CUDA build on a GPU machine (tests/staging/test_copy_cuda.c covers device pools):
         * count it as the refusal every other build logs */
        kvs_pool_destroy(pool);
        pool = (kvs_pool_t *) (uintptr_t) 0x1;
        cap.calls++;
    } else {
        assert_int_equal(st, KVS_ERR_UNSUPPORTED);
        assert_non_null(strstr(cap.msg, "device memory"));
    }

    /* sizes that overflow are refused rather than wrapped */
    c = good;
    c.num_pages = UINT32_MAX;
    c.page_size = UINT32_MAX;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);

    assert_int_equal(kvs_pool_create(NULL, &pool), KVS_ERR_INVALID);
    assert_int_equal(kvs_pool_create(&good, NULL), KVS_ERR_INVALID);
    assert_ptr_equal(pool, (kvs_pool_t *) (uintptr_t) 0x1);
    assert_int_equal(cap.calls, 12);

    pool = make_pool(&good);
    assert_int_equal(kvs_pool_heads(pool), 2);
    assert_non_null(kvs_pool_region(pool, 1, 1));
    assert_null(kvs_pool_region(pool, 2, 0));
    assert_null(kvs_pool_region(pool, 0, 2));
    kvs_pool_destroy(pool);
    kvs_pool_destroy(NULL);

    c = pool_config(mla_shape(3, 64, 1), 4, 3, 4, 4, KVS_POOL_HND);
    pool = make_pool(&c);
    assert_int_equal(kvs_pool_heads(pool), 1);
    assert_non_null(kvs_pool_region(pool, 2, 0));
    assert_null(kvs_pool_region(pool, 0, 1)); /* MLA has only the latent */
    kvs_log_set_sink(NULL, NULL);
    kvs_pool_destroy(pool);
    kvs_assert_no_leaks();
}

static void test_region_strides(void **state)
{
    (void) state;
    /* P=16, heads=4, dim=5, E=2: a head is 10 bytes */
    kvs_region_t n = kvs_region_strides(KVS_POOL_NHD, 16, 4, 5, 2);
    assert_null(n.base);
    assert_int_equal(n.head_stride, 10);
    assert_int_equal(n.token_stride, 40);
    assert_int_equal(n.page_stride, 640);
    assert_int_equal(n.heads, 4);
    assert_int_equal(n.dim, 5);
    assert_int_equal(n.elem_bytes, 2);
    kvs_region_t h = kvs_region_strides(KVS_POOL_HND, 16, 4, 5, 2);
    assert_int_equal(h.token_stride, 10);
    assert_int_equal(h.head_stride, 160);
    assert_int_equal(h.page_stride, 640);
    /* byte offsets of (page 2, token 3, head 1) */
    assert_int_equal(2 * n.page_stride + 3 * n.token_stride + n.head_stride, 1280 + 120 + 10);
    assert_int_equal(2 * h.page_stride + 3 * h.token_stride + h.head_stride, 1280 + 30 + 160);
    /* P=1 makes both layouts identical */
    kvs_region_t n1 = kvs_region_strides(KVS_POOL_NHD, 1, 3, 7, 4);
    kvs_region_t h1 = kvs_region_strides(KVS_POOL_HND, 1, 3, 7, 4);
    assert_int_equal(n1.page_stride, h1.page_stride);
    assert_int_equal(n1.head_stride, h1.head_stride);
    assert_int_equal(n1.page_stride, 84);
}

/* Writes a distinct owner id to a shadow map for every byte any (layer, comp, page, token,
 * head, dim byte) coordinate addresses through kvs_region_addr: each byte must be claimed once,
 * lie inside its own region's extent, and be zero before the test writes a pattern there. */
static void check_region_addresses(const kvs_pool_config_t *c)
{
    kvs_pool_t *pool = make_pool(c);
    const uint32_t comps = c->shape.attn == KVS_ATTN_MLA ? 1 : 2;
    const uint32_t heads = kvs_pool_heads(pool);
    const uint32_t P = c->page_size;
    uint8_t *lo = NULL, *hi = NULL;
    uint64_t expected_bytes = 0;
    for (uint32_t l = 0; l < c->shape.layers; l++) {
        for (uint32_t k = 0; k < comps; k++) {
            const kvs_region_t *r = kvs_pool_region(pool, l, k);
            assert_non_null(r);
            assert_int_equal((uintptr_t) r->base % 64, 0);
            uint32_t dim = k == 0 ? c->shape.head_dim_k : c->shape.head_dim_v;
            kvs_region_t want = kvs_region_strides(c->layout, P, heads, dim, c->shape.elem_bytes);
            assert_int_equal(r->page_stride, want.page_stride);
            assert_int_equal(r->token_stride, want.token_stride);
            assert_int_equal(r->head_stride, want.head_stride);
            assert_int_equal(r->heads, heads);
            assert_int_equal(r->dim, dim);
            assert_int_equal(r->elem_bytes, c->shape.elem_bytes);
            uint8_t *end = r->base + (uint64_t) c->num_pages * r->page_stride;
            if (lo == NULL || r->base < lo) lo = r->base;
            if (hi == NULL || end > hi) hi = end;
            expected_bytes += (uint64_t) c->num_pages * r->page_stride;
        }
    }
    size_t span = (size_t) (hi - lo);
    uint32_t *owner = calloc(span, sizeof(uint32_t));
    assert_non_null(owner);
    uint32_t id = 0;
    uint64_t claimed = 0;
    for (uint32_t l = 0; l < c->shape.layers; l++) {
        for (uint32_t k = 0; k < comps; k++) {
            const kvs_region_t *r = kvs_pool_region(pool, l, k);
            uint8_t *end = r->base + (uint64_t) c->num_pages * r->page_stride;
            uint32_t head_bytes = r->dim * r->elem_bytes;
            for (uint32_t p = 0; p < c->num_pages; p++) {
                for (uint32_t t = 0; t < P; t++) {
                    for (uint32_t h = 0; h < heads; h++) {
                        uint8_t *a = kvs_region_addr(r, p, t, h);
                        id++;
                        for (uint32_t b = 0; b < head_bytes; b++) {
                            assert_true(a + b >= r->base && a + b < end);
                            size_t idx = (size_t) (a + b - lo);
                            assert_int_equal(owner[idx], 0);
                            owner[idx] = id;
                            assert_int_equal(a[b], 0); /* zero-initialised */
                            a[b] = (uint8_t) kvs_mix64(id * 131u + b);
                            claimed++;
                        }
                    }
                }
            }
        }
    }
    /* dense: the regions hold nothing but KV bytes */
    assert_int_equal(claimed, expected_bytes);
    /* the pattern survived, so no write clobbered another coordinate */
    id = 0;
    for (uint32_t l = 0; l < c->shape.layers; l++) {
        for (uint32_t k = 0; k < comps; k++) {
            const kvs_region_t *r = kvs_pool_region(pool, l, k);
            uint32_t head_bytes = r->dim * r->elem_bytes;
            for (uint32_t p = 0; p < c->num_pages; p++)
                for (uint32_t t = 0; t < P; t++)
                    for (uint32_t h = 0; h < heads; h++) {
                        const uint8_t *a = kvs_region_addr(r, p, t, h);
                        id++;
                        for (uint32_t b = 0; b < head_bytes; b++)
                            assert_int_equal(a[b], (uint8_t) kvs_mix64(id * 131u + b));
                    }
        }
    }
    free(owner);
    kvs_pool_destroy(pool);
    kvs_assert_no_leaks();
}

static void test_region_addresses(void **state)
{
    (void) state;
    for (int layout = KVS_POOL_NHD; layout <= KVS_POOL_HND; layout++) {
        kvs_pool_layout_t lay = (kvs_pool_layout_t) layout;
        kvs_pool_config_t cfgs[] = {
            pool_config(mha_shape(2, 4, 8, 8, 2), 1, 0, 4, 5, lay),
            pool_config(mha_shape(3, 8, 6, 5, 1), 2, 1, 3, 4, lay),  /* Dk != Dv, odd sizes */
            pool_config(mha_shape(1, 2, 3, 7, 4), 4, 3, 1, 6, lay),  /* replicated heads */
            pool_config(mha_shape(2, 6, 5, 5, 2), 3, 2, 16, 2, lay), /* 2 heads of 6 */
            pool_config(mla_shape(3, 9, 2), 2, 0, 8, 3, lay),
            pool_config(mla_shape(1, 1, 1), 1, 0, 1, 1, lay),
        };
        for (size_t i = 0; i < sizeof(cfgs) / sizeof(cfgs[0]); i++)
            check_region_addresses(&cfgs[i]);
    }
}

static void test_create_alloc_failure(void **state)
{
    (void) state;
    kvs_pool_config_t c = pool_config(mha_shape(2, 4, 8, 8, 2), 2, 0, 4, 8, KVS_POOL_HND);
    uint64_t nth;
    int failures = 0;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    for (nth = 1; nth < 64; nth++) {
        kvs_pool_t *pool = NULL;
        kvs_alloc_fail_at(nth);
        kvs_status_t st = kvs_pool_create(&c, &pool);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) {
            assert_non_null(pool);
            kvs_pool_destroy(pool);
            break;
        }
        assert_int_equal(st, KVS_ERR_NOMEM);
        assert_null(pool);
        failures++;
        kvs_assert_no_leaks();
    }
    kvs_log_set_sink(NULL, NULL);
    assert_true(failures >= 2); /* every allocation of create was made to fail once */
    assert_int_equal(failures, nth - 1);
    assert_int_equal(cap.calls, failures); /* one message per failure */
    assert_non_null(strstr(cap.msg, "out of memory"));
    kvs_assert_no_leaks();
}

/* Random alloc/free (including rejected frees) against a model of which pages are held. */
static void test_random_alloc_free(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(0x9001);
    const uint64_t iters = kvs_test_iters(20000);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const uint32_t N = 50;
    kvs_pool_config_t c = pool_config(mla_shape(1, 2, 1), 1, 0, 1, N, KVS_POOL_NHD);
    kvs_pool_t *pool = make_pool(&c);
    uint32_t held[50], nheld = 0, buf[64];
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink,
                     &cap); /* rejected calls are expected; keep stderr quiet */
    for (uint64_t it = 0; it < iters; it++) {
        uint64_t op = kvs_rng_below(&rng, 3);
        if (op == 0) {
            uint32_t n = (uint32_t) kvs_rng_below(&rng, 8);
            kvs_status_t st = kvs_pool_alloc(pool, n, buf);
            if (n > N - nheld) {
                if (st != KVS_ERR_NOSPACE)
                    fail_msg("seed 0x%llx: expected NOSPACE", (unsigned long long) seed);
            } else {
                if (st != KVS_OK) fail_msg("seed 0x%llx: alloc failed", (unsigned long long) seed);
                for (uint32_t i = 0; i < n; i++) {
                    for (uint32_t j = 0; j < nheld; j++)
                        if (held[j] == buf[i])
                            fail_msg("seed 0x%llx: page %u handed out twice",
                                     (unsigned long long) seed, buf[i]);
                    held[nheld++] = buf[i];
                }
            }
        } else if (op == 1 && nheld > 0) {
            /* free a random subset: swap chosen ones to the end */
            uint32_t n = (uint32_t) kvs_rng_range(&rng, 1, nheld < 6 ? nheld : 6);
            for (uint32_t i = 0; i < n; i++) {
                uint32_t k = (uint32_t) kvs_rng_below(&rng, nheld - i);
                uint32_t tmp = held[k];
                held[k] = held[nheld - 1 - i];
                held[nheld - 1 - i] = tmp;
            }
            if (kvs_pool_free(pool, &held[nheld - n], n) != KVS_OK)
                fail_msg("seed 0x%llx: valid free rejected", (unsigned long long) seed);
            nheld -= n;
        } else {
            /* a free that is wrong somewhere: must change nothing */
            uint32_t n = 0;
            for (uint32_t i = 0; i < nheld && n < 4; i++) buf[n++] = held[i];
            uint64_t kind = kvs_rng_below(&rng, 3);
            if (kind == 0 || nheld == N) {
                buf[n++] = N + (uint32_t) kvs_rng_below(&rng, 10);
            } else if (kind == 1 && n > 0) {
                uint32_t dup = buf[kvs_rng_below(&rng, n)];
                buf[n++] = dup;
            } else {
                uint32_t p;
                do p = (uint32_t) kvs_rng_below(&rng, N);
                while (kvs_pool_page_allocated(pool, p));
                buf[n++] = p;
            }
            uint32_t at = (uint32_t) kvs_rng_below(&rng, n);
            uint32_t tmp = buf[at];
            buf[at] = buf[n - 1];
            buf[n - 1] = tmp;
            if (kvs_pool_free(pool, buf, n) != KVS_ERR_INVALID)
                fail_msg("seed 0x%llx: bad free accepted", (unsigned long long) seed);
        }
        if (kvs_pool_free_pages(pool) != N - nheld)
            fail_msg("seed 0x%llx iter %llu: free count %u, model %u", (unsigned long long) seed,
                     (unsigned long long) it, kvs_pool_free_pages(pool), N - nheld);
        if ((it & 63) == 0) {
            uint8_t model[50] = {0};
            for (uint32_t j = 0; j < nheld; j++) model[held[j]] = 1;
            for (uint32_t p = 0; p < N; p++)
                if (kvs_pool_page_allocated(pool, p) != model[p])
                    fail_msg("seed 0x%llx: page %u state differs", (unsigned long long) seed, p);
        }
    }
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(kvs_pool_free(pool, held, nheld), KVS_OK);
    assert_int_equal(kvs_pool_free_pages(pool), N);
    kvs_pool_destroy(pool);
    kvs_assert_no_leaks();
}

/* kvs_pool_wrap: regions over the test's own buffer, in NHD, HND and a page-innermost nesting;
 * every mismatch or overlap refused naming the region; destroy leaves the memory alone. */
static void test_wrap(void **state)
{
    (void) state;
    kvs_kv_shape_t shape = mha_shape(2, 4, 8, 6, 2);
    kvs_pool_config_t c = pool_config(shape, 2, 1, 4, 5, KVS_POOL_NHD); /* 2 heads per rank */
    const uint64_t kbytes = 5ull * 4 * 2 * 8 * 2, vbytes = 5ull * 4 * 2 * 6 * 2;
    uint8_t *mem = malloc(2 * (kbytes + vbytes));
    assert_non_null(mem);
    for (int layout = KVS_POOL_NHD; layout <= KVS_POOL_HND + 1; layout++) {
        kvs_region_t regions[4];
        uint8_t *at = mem;
        for (uint32_t l = 0; l < 2; l++)
            for (uint32_t comp = 0; comp < 2; comp++) {
                uint32_t dim = comp == 0 ? 8 : 6;
                kvs_region_t *r = &regions[l * 2 + comp];
                if (layout <= KVS_POOL_HND) {
                    *r = kvs_region_strides((kvs_pool_layout_t) layout, 4, 2, dim, 2);
                } else { /* [heads][tokens][pages][dim]: pages innermost */
                    memset(r, 0, sizeof(*r));
                    r->page_stride = dim * 2;
                    r->token_stride = 5 * r->page_stride;
                    r->head_stride = 4 * r->token_stride;
                    r->heads = 2, r->dim = dim, r->elem_bytes = 2;
                }
                r->base = at;
                at += comp == 0 ? kbytes : vbytes;
            }
        kvs_pool_t *pool = NULL;
        assert_int_equal(kvs_pool_wrap(&c, regions, &pool), KVS_OK);
        assert_int_equal(kvs_pool_total_pages(pool), 5);
        assert_int_equal(kvs_pool_heads(pool), 2);
        for (uint32_t i = 0; i < 4; i++)
            assert_memory_equal(kvs_pool_region(pool, i / 2, i % 2), &regions[i],
                                sizeof(kvs_region_t));
        uint32_t pages[5];
        assert_int_equal(kvs_pool_alloc(pool, 5, pages), KVS_OK);
        assert_int_equal(kvs_pool_free(pool, pages, 5), KVS_OK);
        kvs_pool_destroy(pool);
        kvs_assert_no_leaks(); /* and mem is still ours: */
        memset(mem, 0x5a, 2 * (kbytes + vbytes));

        /* each kind of bad region, in the last slot so the earlier ones were accepted */
        for (int bad = 0; bad < 6; bad++) {
            kvs_region_t b[4];
            memcpy(b, regions, sizeof(b));
            const char *want = "layer 1 V region";
            if (bad == 0) b[3].base = NULL;
            if (bad == 1) b[3].heads = 4;
            if (bad == 2) b[3].dim = 8;
            if (bad == 3) b[3].elem_bytes = 4;
            if (bad == 4) b[3].head_stride = b[3].head_stride / 2 + 1;      /* heads overlap */
            if (bad == 5) b[2].token_stride = 8, want = "layer 1 K region"; /* tokens overlap */
            kvs_log_capture_t cap = {0};
            kvs_log_set_sink(kvs_log_capture_sink, &cap);
            pool = (kvs_pool_t *) &cap;
            kvs_status_t st = kvs_pool_wrap(&c, b, &pool);
            kvs_log_set_sink(NULL, NULL);
            assert_int_equal(st, KVS_ERR_INVALID);
            assert_ptr_equal(pool, &cap); /* untouched */
            assert_non_null(strstr(cap.msg, want));
            kvs_assert_no_leaks();
        }
    }
    /* an axis of one entry may have any stride (numpy gives size-1 axes arbitrary ones) */
    kvs_pool_config_t one = pool_config(mla_shape(1, 4, 1), 1, 0, 1, 3, KVS_POOL_NHD);
    kvs_region_t r = kvs_region_strides(KVS_POOL_NHD, 1, 1, 4, 1);
    r.base = mem, r.token_stride = 0, r.head_stride = 0;
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_wrap(&one, &r, &pool), KVS_OK);
    kvs_pool_destroy(pool);
    r.page_stride = 3; /* pages of 4 bytes 3 apart */
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_pool_wrap(&one, &r, &pool), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_non_null(strstr(cap.msg, "layer 0 latent region: strides (page 3"));

    /* allocation failures: KVS_ERR_NOMEM and nothing leaked, at every allocation */
    r.page_stride = 4;
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    int failures = 0;
    for (uint64_t nth = 1; nth < 16; nth++) {
        pool = NULL;
        kvs_alloc_fail_at(nth);
        kvs_status_t st = kvs_pool_wrap(&one, &r, &pool);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) {
            kvs_pool_destroy(pool);
            break;
        }
        assert_int_equal(st, KVS_ERR_NOMEM);
        assert_null(pool);
        failures++;
        kvs_assert_no_leaks();
    }
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(failures, 4); /* pool, regions, free stack, page states */
    kvs_assert_no_leaks();
    free(mem);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_free_all),
        cmocka_unit_test(test_out_of_pages_leaves_state),
        cmocka_unit_test(test_free_rejects_bad_ids),
        cmocka_unit_test(test_config_validation),
        cmocka_unit_test(test_region_strides),
        cmocka_unit_test(test_region_addresses),
        cmocka_unit_test(test_create_alloc_failure),
        cmocka_unit_test(test_random_alloc_free),
        cmocka_unit_test(test_wrap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
