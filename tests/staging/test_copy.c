/* Tests for gather/scatter through the CPU reference backend: a hand-computed layout vector,
 * descriptor validation, and a seeded property test that gathers from one pool and scatters
 * into another (random shapes, page sizes, NHD/HND on either side, page lists and head ranges)
 * and checks every byte of both pools and the region against independent index arithmetic. */
#include "copy_fixture.h"

#include "staging/checksum.h"

static kvs_pool_t *make_pool(kvs_kv_shape_t shape, uint32_t tp_size, uint32_t page_size,
                             uint32_t pages, kvs_pool_layout_t layout)
{
    kvs_pool_config_t c;
    memset(&c, 0, sizeof(c));
    c.shape = shape;
    c.tp.tp_size = tp_size;
    c.tp.tp_rank = 0;
    c.page_size = page_size;
    c.num_pages = pages;
    c.layout = layout;
    c.mem = KVS_MEM_HOST;
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_OK);
    return pool;
}

/* Copies the pool's regions into an array the descriptor can point at. */
static kvs_region_t *pool_regions(const kvs_pool_t *pool)
{
    const kvs_pool_config_t *c = kvs_pool_config(pool);
    uint32_t comps = c->shape.attn == KVS_ATTN_MLA ? 1 : 2;
    kvs_region_t *r = malloc(sizeof(kvs_region_t) * c->shape.layers * comps);
    assert_non_null(r);
    for (uint32_t l = 0; l < c->shape.layers; l++)
        for (uint32_t k = 0; k < comps; k++) r[l * comps + k] = *kvs_pool_region(pool, l, k);
    return r;
}

/* L=1, H=3, Dk=1, Dv=2, E=1, P=2, NHD, 2 pages; copy pages [2, 0], heads [1, 3). Pool bytes
 * are their own offsets within the region so every expected byte can be written by hand. */
static void test_layout_vector(void **state)
{
    (void) state;
    kvs_kv_shape_t shape = {.layers = 1,
                            .kv_heads = 3,
                            .head_dim_k = 1,
                            .head_dim_v = 2,
                            .elem_bytes = 1,
                            .attn = KVS_ATTN_MHA};
    kvs_pool_t *pool = make_pool(shape, 1, 2, 3, KVS_POOL_NHD);
    kvs_region_t *regions = pool_regions(pool);
    /* K region: page = [2 tokens][3 heads][1] = 6 bytes; V: [2][3][2] = 12 bytes per page */
    for (int i = 0; i < 18; i++) regions[0].base[i] = (uint8_t) i;
    for (int i = 0; i < 36; i++) regions[1].base[i] = (uint8_t) (100 + i);
    uint32_t pages[] = {2, 0};
    uint8_t region[40];
    memset(region, 0xee, sizeof(region));
    assert_int_equal(kvs_copy_region_bytes(&shape, 2, 4), 24);
    kvs_copy_desc_t d = copy_desc(pool, regions, pages, 2, 1, 2, region, 24);
    kvs_copy_backend_t b;
    assert_int_equal(kvs_copy_cpu_create(&b), KVS_OK);
    assert_string_equal(b.ops->name, "cpu");
    run_copy(&b, KVS_COPY_GATHER, &d);
    const uint8_t want[40] = {
        /* K [4 tokens][2 heads][1]: page 2 = bytes 12..17, token t head h at 12 + 3t + h */
        13, 14, 16, 17, 1, 2, 4, 5,
        /* V [4 tokens][2 heads][2]: page 2 = bytes 24..35 (+100), token t head h at 6t + 2h */
        126, 127, 128, 129, 132, 133, 134, 135, 102, 103, 104, 105, 108, 109, 110, 111,
        /* untouched */
        0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee,
        0xee};
    assert_memory_equal(region, want, sizeof(want));

    /* scatter back to pages [1, 2] head 0..1 after clearing the pool */
    memset(regions[0].base, 0, 18);
    memset(regions[1].base, 0, 36);
    uint32_t back[] = {1, 2};
    d = copy_desc(pool, regions, back, 2, 0, 2, region, 24);
    run_copy(&b, KVS_COPY_SCATTER, &d);
    const uint8_t want_k[18] = {0, 0, 0, 0, 0, 0, 13, 14, 0, 16, 17, 0, 1, 2, 0, 4, 5, 0};
    assert_memory_equal(regions[0].base, want_k, 18);
    const uint8_t want_v[36] = {0,   0,   0,   0,   0, 0, 0,   0,   0,   0,   0, 0,
                                126, 127, 128, 129, 0, 0, 132, 133, 134, 135, 0, 0,
                                102, 103, 104, 105, 0, 0, 108, 109, 110, 111, 0, 0};
    assert_memory_equal(regions[1].base, want_v, 36);
    kvs_copy_backend_destroy(&b);
    assert_null(b.ops);
    kvs_copy_backend_destroy(&b); /* idempotent */
    free(regions);
    kvs_pool_destroy(pool);
    kvs_assert_no_leaks();
}

static void test_invalid_descriptors(void **state)
{
    (void) state;
    kvs_kv_shape_t shape = {.layers = 2,
                            .kv_heads = 4,
                            .head_dim_k = 3,
                            .head_dim_v = 5,
                            .elem_bytes = 2,
                            .attn = KVS_ATTN_MHA};
    kvs_pool_t *pool = make_pool(shape, 2, 4, 6, KVS_POOL_HND); /* 2 heads per rank */
    kvs_region_t *regions = pool_regions(pool);
    uint32_t pages[] = {5, 1, 3};
    uint64_t need = kvs_copy_region_bytes(&shape, 2, 12);
    assert_int_equal(need, 12 * 2 * 2 * 2 * (3 + 5));
    uint8_t *region = malloc(need);
    memset(region, 0x5a, need);
    kvs_copy_backend_t b;
    assert_int_equal(kvs_copy_cpu_create(&b), KVS_OK);
    int logged = 0;
    kvs_log_set_sink(quiet_sink, &logged);

    kvs_copy_desc_t good = copy_desc(pool, regions, pages, 3, 0, 2, region, need), d;
    uint64_t ticket = 99;
#define REFUSED(dir)                                                                               \
    do {                                                                                           \
        int before_ = logged;                                                                      \
        assert_int_equal(kvs_copy_submit(&b, dir, &d, &ticket), KVS_ERR_INVALID);                  \
        assert_int_equal(logged, before_ + 1);                                                     \
        assert_int_equal(ticket, 99);                                                              \
    } while (0)
    d = good, d.heads = 3;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.pool_head = 1;
    REFUSED(KVS_COPY_SCATTER);
    d = good, d.pool_head = UINT32_MAX, d.heads = 2;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.heads = 0;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.page_size = 0;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.layers = 1;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.components = 1;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.pool_pages = 5; /* page 5 is then out of range */
    REFUSED(KVS_COPY_SCATTER);
    d = good, d.region_bytes = need - 1;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.region = NULL;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.pages = NULL;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.regions = NULL;
    REFUSED(KVS_COPY_GATHER);
    d = good;
    REFUSED((kvs_copy_dir_t) 5);
    /* runs: run above stride, one of the two without the other, or a reach past the pages (3
     * pages of 4 tokens: 4 tokens in runs of 1 every 4 reach token 13) */
    d = good, d.tokens = 2, d.run = 3, d.stride = 2;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.tokens = 2, d.run = 1, d.stride = 0;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.tokens = 4, d.run = 1, d.stride = 4;
    REFUSED(KVS_COPY_SCATTER);
    d = good, d.tokens = 3, d.run = 1, d.stride = 4; /* reaches token 9, in the last page */
    d.region_bytes = kvs_copy_region_bytes(&shape, 2, 3) - 1;
    REFUSED(KVS_COPY_GATHER);
    d = good, d.tokens = 1, d.run = 1, d.stride = 4; /* ends in the first page of three */
    REFUSED(KVS_COPY_GATHER);
    kvs_kv_shape_t other = shape;
    other.head_dim_v = 4; /* regions no longer match the shape */
    d = good, d.shape = &other;
    REFUSED(KVS_COPY_GATHER);
    other = shape;
    other.elem_bytes = 3;
    d = good, d.shape = &other;
    assert_int_equal(kvs_copy_submit(&b, KVS_COPY_GATHER, &d, &ticket), KVS_ERR_INVALID);
    kvs_region_t saved = regions[3];
    regions[3].base = NULL;
    d = good;
    REFUSED(KVS_COPY_SCATTER);
    regions[3] = saved;
    /* nothing moved: the region still holds its fill, the pool its zeros */
    for (uint64_t i = 0; i < need; i++) assert_int_equal(region[i], 0x5a);
    for (uint32_t i = 0; i < 4; i++)
        for (uint64_t k = 0; k < 6 * regions[i].page_stride; k++)
            assert_int_equal(regions[i].base[k], 0);
    /* poll of a ticket never issued */
    int before = logged;
    assert_int_equal(kvs_copy_poll(&b, 1), KVS_ERR_INVALID);
    assert_int_equal(kvs_copy_poll(&b, 0), KVS_ERR_INVALID);
    assert_int_equal(logged, before + 2);
    kvs_log_set_sink(NULL, NULL);

    /* zero pages is a valid, empty copy; tickets increase and poll completes */
    d = good, d.npages = 0, d.pages = NULL, d.region = NULL, d.region_bytes = 0;
    uint64_t t1 = 0, t2 = 0;
    assert_int_equal(kvs_copy_submit(&b, KVS_COPY_GATHER, &d, &t1), KVS_OK);
    assert_int_equal(kvs_copy_submit(&b, KVS_COPY_SCATTER, &good, &t2), KVS_OK);
    assert_true(t2 > t1 && t1 > 0);
    assert_int_equal(kvs_copy_poll(&b, t1), KVS_OK);
    assert_int_equal(kvs_copy_poll(&b, t2), KVS_OK);
    kvs_copy_backend_destroy(&b);

    kvs_alloc_fail_at(1);
    kvs_copy_backend_t none = {NULL, NULL};
    kvs_log_set_sink(quiet_sink, &logged);
    assert_int_equal(kvs_copy_cpu_create(&none), KVS_ERR_NOMEM);
    kvs_log_set_sink(NULL, NULL);
    assert_null(none.ops);
    free(region);
    free(regions);
    kvs_pool_destroy(pool);
    kvs_assert_no_leaks();
}

/* ---- property test ---- */

/* Independent addressing: offset of (page, token, head) in a region of `layout`. */
static uint64_t ref_pool_offset(kvs_pool_layout_t layout, uint32_t P, uint32_t heads,
                                uint64_t head_bytes, uint32_t page, uint32_t tok, uint32_t head)
{
    if (layout == KVS_POOL_NHD) return (((uint64_t) page * P + tok) * heads + head) * head_bytes;
    return (((uint64_t) page * heads + head) * P + tok) * head_bytes;
}

/* Independent region layout: K blocks of every layer, then V blocks; [T][heads][D] each. */
static uint64_t ref_region_offset(const kvs_kv_shape_t *s, uint32_t heads, uint64_t T,
                                  uint32_t layer, uint32_t comp, uint64_t tok, uint32_t head)
{
    uint64_t E = s->elem_bytes, dk = s->head_dim_k, dv = s->head_dim_v;
    uint64_t k_block = T * heads * dk * E, v_block = T * heads * dv * E;
    uint64_t D = comp == 0 ? dk : dv;
    uint64_t block = comp == 0 ? layer * k_block : s->layers * k_block + layer * v_block;
    return block + (tok * heads + head) * D * E;
}

static uint8_t fill_byte(uint64_t salt, uint32_t region, uint64_t off)
{
    return (uint8_t) kvs_mix64(salt ^ ((uint64_t) region << 40) ^ off);
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "copy property failed (KVS_SEED=0x%llx, case %llu): ",                 \
                    (unsigned long long) seed, (unsigned long long) iter);                         \
            fail_msg(__VA_ARGS__);                                                                 \
        }                                                                                          \
    } while (0)

static void test_gather_scatter_property(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(0xc0b1e5);
    const uint64_t iters = kvs_test_iters(600);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_copy_backend_t b;
    assert_int_equal(kvs_copy_cpu_create(&b), KVS_OK);
    static const uint32_t page_sizes[] = {1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 64, 100, 128};
    static const uint32_t head_counts[] = {1, 2, 3, 4, 6, 8};
    static const uint32_t elems[] = {1, 2, 4};
    for (uint64_t iter = 0; iter < iters; iter++) {
        kvs_kv_shape_t s;
        memset(&s, 0, sizeof(s));
        s.layers = (uint32_t) kvs_rng_range(&rng, 1, 4);
        s.elem_bytes = elems[kvs_rng_below(&rng, 3)];
        int mla = kvs_rng_chance(&rng, 1, 4);
        if (mla) {
            s.attn = KVS_ATTN_MLA;
            s.kv_heads = 1;
            s.head_dim_k = (uint32_t) kvs_rng_range(&rng, 1, 72);
        } else {
            s.attn = KVS_ATTN_MHA;
            s.kv_heads = head_counts[kvs_rng_below(&rng, 6)];
            s.head_dim_k = (uint32_t) kvs_rng_range(&rng, 1, 24);
            s.head_dim_v =
                kvs_rng_chance(&rng, 1, 2) ? s.head_dim_k : (uint32_t) kvs_rng_range(&rng, 1, 24);
        }
        uint32_t P = page_sizes[kvs_rng_below(&rng, sizeof(page_sizes) / sizeof(page_sizes[0]))];
        uint32_t max_pages = P >= 128 ? 1 : 160 / P + 1;
        uint32_t npages = (uint32_t) kvs_rng_range(&rng, 1, max_pages);
        uint32_t pages_a = npages + (uint32_t) kvs_rng_below(&rng, 3);
        uint32_t pages_b = npages + (uint32_t) kvs_rng_below(&rng, 3);
        kvs_pool_layout_t lay_a = (kvs_pool_layout_t) kvs_rng_below(&rng, 2);
        kvs_pool_layout_t lay_b = (kvs_pool_layout_t) kvs_rng_below(&rng, 2);
        kvs_pool_t *pa = make_pool(s, pick_tp(&rng, s.kv_heads), P, pages_a, lay_a);
        kvs_pool_t *pb = make_pool(s, pick_tp(&rng, s.kv_heads), P, pages_b, lay_b);
        const uint32_t ha = kvs_pool_heads(pa), hb = kvs_pool_heads(pb);
        const uint32_t heads = (uint32_t) kvs_rng_range(&rng, 1, ha < hb ? ha : hb);
        const uint32_t head_a = (uint32_t) kvs_rng_below(&rng, ha - heads + 1);
        const uint32_t head_b = (uint32_t) kvs_rng_below(&rng, hb - heads + 1);
        const uint32_t comps = mla ? 1 : 2;
        uint32_t *list_a = malloc(sizeof(uint32_t) * npages);
        uint32_t *list_b = malloc(sizeof(uint32_t) * npages);
        int32_t *slot_of_b = malloc(sizeof(int32_t) * pages_b); /* page of B -> index, or -1 */
        pick_pages(&rng, pages_a, npages, list_a);
        pick_pages(&rng, pages_b, npages, list_b);
        for (uint32_t p = 0; p < pages_b; p++) slot_of_b[p] = -1;
        for (uint32_t i = 0; i < npages; i++) slot_of_b[list_b[i]] = (int32_t) i;

        kvs_region_t *ra = pool_regions(pa), *rb = pool_regions(pb);
        const uint64_t salt_a = kvs_rng_next(&rng), salt_b = kvs_rng_next(&rng);
        const uint64_t salt_r = kvs_rng_next(&rng);
        for (uint32_t i = 0; i < s.layers * comps; i++) {
            for (uint64_t k = 0; k < pages_a * ra[i].page_stride; k++)
                ra[i].base[k] = fill_byte(salt_a, i, k);
            for (uint64_t k = 0; k < pages_b * rb[i].page_stride; k++)
                rb[i].base[k] = fill_byte(salt_b, i, k);
        }
        /* A third of the time part of the pages (a page size per side): tokens from `first` in
         * the first page to somewhere in the last. */
        uint32_t first = 0;
        uint64_t T = (uint64_t) npages * P;
        const int partial = kvs_rng_chance(&rng, 1, 3);
        if (partial) {
            first = (uint32_t) kvs_rng_below(&rng, P);
            uint64_t lo = (uint64_t) (npages - 1) * P + 1;
            lo = lo > first ? lo - first : 1;
            T = kvs_rng_range(&rng, lo, (uint64_t) npages * P - first);
        }
        /* A third of the time runs (a decode context parallel rank's tokens): `run` tokens
         * every `stride` from `first`, as many as end in the last page. */
        uint32_t run = 0, stride = 0;
        if (kvs_rng_chance(&rng, 1, 3)) {
            uint32_t r = (uint32_t) kvs_rng_range(&rng, 1, 4);
            uint32_t st = r * (uint32_t) kvs_rng_range(&rng, 1, 4);
            uint64_t lo = 0, hi = 0; /* token counts whose reach ends in the last page */
            for (uint64_t n = 1;; n++) {
                uint64_t reach = first + (n - 1) / r * st + (n - 1) % r + 1;
                if (reach > (uint64_t) npages * P) break;
                if (reach > (uint64_t) (npages - 1) * P) {
                    if (lo == 0) lo = n;
                    hi = n;
                }
            }
            if (lo != 0) {
                run = r;
                stride = st;
                T = kvs_rng_range(&rng, lo, hi);
            }
        }
        /* pool token (from the first page's start) of region token t */
#define POS(t) (run ? first + (t) / run * stride + (t) % run : first + (t))
        const uint64_t rbytes = kvs_copy_region_bytes(&s, heads, T);
        const uint64_t guard = 64;
        uint8_t *buf = malloc(rbytes + 2 * guard);
        for (uint64_t k = 0; k < rbytes + 2 * guard; k++) buf[k] = fill_byte(salt_r, 0, k);
        uint8_t *region = buf + guard;

        /* gather A -> region */
        kvs_copy_desc_t d = copy_desc(pa, ra, list_a, npages, head_a, heads, region, rbytes);
        if (partial || run) d.first_token = first, d.tokens = T;
        d.run = run;
        d.stride = stride;
        uint64_t gsum = 0;
        d.checksum = &gsum; /* the fused checksum equals the one over the region it wrote */
        run_copy(&b, KVS_COPY_GATHER, &d);
        CHECK(gsum == kvs_csum_of(region, rbytes), "gather checksum");
        for (uint64_t k = 0; k < guard; k++) {
            CHECK(buf[k] == fill_byte(salt_r, 0, k), "gather wrote before the region");
            uint64_t e = guard + rbytes + k;
            CHECK(buf[e] == fill_byte(salt_r, 0, e), "gather wrote past the region");
        }
        uint64_t covered = 0;
        for (uint32_t l = 0; l < s.layers; l++) {
            for (uint32_t c = 0; c < comps; c++) {
                uint32_t ri = l * comps + c;
                uint64_t hbytes = (uint64_t) (c == 0 ? s.head_dim_k : s.head_dim_v) * s.elem_bytes;
                CHECK(kvs_region_block_offset(&s, heads, T, l, c) ==
                          ref_region_offset(&s, heads, T, l, c, 0, 0),
                      "block offset of layer %u component %u", l, c);
                for (uint64_t t = 0; t < T; t++) {
                    for (uint32_t j = 0; j < heads; j++) {
                        uint64_t src = ref_pool_offset(lay_a, P, ha, hbytes, list_a[POS(t) / P],
                                                       (uint32_t) (POS(t) % P), head_a + j);
                        uint64_t dst = ref_region_offset(&s, heads, T, l, c, t, j);
                        CHECK(dst + hbytes <= rbytes, "reference offset outside the region");
                        for (uint64_t x = 0; x < hbytes; x++)
                            CHECK(region[dst + x] == fill_byte(salt_a, ri, src + x),
                                  "gathered byte %llu of layer %u comp %u token %llu head %u",
                                  (unsigned long long) x, l, c, (unsigned long long) t, j);
                        covered += hbytes;
                    }
                }
            }
        }
        CHECK(covered == rbytes, "region holds %llu bytes, the references cover %llu",
              (unsigned long long) rbytes, (unsigned long long) covered);
        /* gather only reads the pool */
        for (uint32_t i = 0; i < s.layers * comps; i++)
            for (uint64_t k = 0; k < pages_a * ra[i].page_stride; k++)
                CHECK(ra[i].base[k] == fill_byte(salt_a, i, k), "gather wrote the pool");

        /* scatter region -> B */
        uint8_t *snapshot = malloc(rbytes);
        memcpy(snapshot, region, rbytes);
        d = copy_desc(pb, rb, list_b, npages, head_b, heads, region, rbytes);
        if (partial || run) d.first_token = first, d.tokens = T;
        d.run = run;
        d.stride = stride;
        uint64_t ssum = 0;
        d.checksum = &ssum;
        run_copy(&b, KVS_COPY_SCATTER, &d);
        CHECK(ssum == gsum, "scatter checksum differs from the gather's");
        CHECK(memcmp(snapshot, region, rbytes) == 0, "scatter wrote the region");
        for (uint32_t l = 0; l < s.layers; l++) {
            for (uint32_t c = 0; c < comps; c++) {
                uint32_t ri = l * comps + c;
                uint64_t hbytes = (uint64_t) (c == 0 ? s.head_dim_k : s.head_dim_v) * s.elem_bytes;
                for (uint32_t p = 0; p < pages_b; p++) {
                    for (uint32_t t = 0; t < P; t++) {
                        for (uint32_t h = 0; h < hb; h++) {
                            uint64_t off = ref_pool_offset(lay_b, P, hb, hbytes, p, t, h);
                            const uint64_t at = (uint64_t) slot_of_b[p] * P + t; /* in the span */
                            int member = at >= first && at < first + T;
                            if (run && at >= first) {
                                const uint64_t q = (at - first) / stride, r = (at - first) % stride;
                                member = r < run && q * run + r < T;
                            }
                            int copied =
                                slot_of_b[p] >= 0 && h >= head_b && h < head_b + heads && member;
                            for (uint64_t x = 0; x < hbytes; x++) {
                                uint8_t want = fill_byte(salt_b, ri, off + x);
                                if (copied) {
                                    uint32_t i = (uint32_t) slot_of_b[p];
                                    uint64_t src = ref_pool_offset(lay_a, P, ha, hbytes, list_a[i],
                                                                   t, head_a + h - head_b);
                                    want = fill_byte(salt_a, ri, src + x);
                                }
                                CHECK(rb[ri].base[off + x] == want,
                                      "pool B byte %llu of layer %u comp %u page %u token %u "
                                      "head %u (%s)",
                                      (unsigned long long) x, l, c, p, t, h,
                                      copied ? "copied" : "untouched");
                            }
                        }
                    }
                }
            }
        }
#undef POS
        free(snapshot);
        free(buf);
        free(ra);
        free(rb);
        free(list_a);
        free(list_b);
        free(slot_of_b);
        kvs_pool_destroy(pa);
        kvs_pool_destroy(pb);
    }
    kvs_copy_backend_destroy(&b);
    kvs_assert_no_leaks();
}

/* The fused checksum on the shapes the vector loops are written for (head rows of 256 and 96
 * bytes, HND with a head slice, NHD with all heads), the region at offsets 16 and 32 of an
 * aligned buffer (16- and 32-byte streaming stores), and head_dim_k giving 40-byte heads
 * (the scalar path): the gather's sum is the region's, the scatter's equals it and moves the
 * same bytes, and a changed byte anywhere in the region makes the scatter's sum differ. */
static void test_checksum_vector_paths(void **state)
{
    (void) state;
    static const struct {
        uint32_t dim, elem, heads, pool_head, sel;
        kvs_pool_layout_t layout;
    } cases[] = {
        {128, 2, 8, 0, 8, KVS_POOL_HND}, {128, 2, 8, 4, 4, KVS_POOL_HND},
        {128, 2, 8, 0, 8, KVS_POOL_NHD}, {128, 2, 8, 2, 3, KVS_POOL_NHD},
        {48, 2, 4, 1, 2, KVS_POOL_HND},  {20, 2, 4, 0, 4, KVS_POOL_HND},
    };
    kvs_copy_backend_t b;
    assert_int_equal(kvs_copy_cpu_create(&b), KVS_OK);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 0x5eed);
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        for (uint32_t shift = 16; shift <= 32; shift += 16) {
            kvs_kv_shape_t s = {.layers = 3,
                                .kv_heads = cases[ci].heads,
                                .head_dim_k = cases[ci].dim,
                                .head_dim_v = cases[ci].dim,
                                .elem_bytes = cases[ci].elem,
                                .attn = KVS_ATTN_MHA};
            const uint32_t P = 16, npages = 5, total = 8;
            kvs_pool_t *pa = make_pool(s, 1, P, total, cases[ci].layout);
            kvs_pool_t *pb = make_pool(s, 1, P, total, cases[ci].layout);
            kvs_region_t *ra = pool_regions(pa), *rb = pool_regions(pb);
            for (uint32_t i = 0; i < s.layers * 2; i++)
                for (uint64_t k = 0; k < total * ra[i].page_stride; k++)
                    ra[i].base[k] = (uint8_t) kvs_rng_next(&rng);
            uint32_t list_a[5], list_b[5];
            pick_pages(&rng, total, npages, list_a);
            pick_pages(&rng, total, npages, list_b);
            const uint32_t h0 = cases[ci].pool_head, nh = cases[ci].sel;
            const uint64_t rbytes = kvs_copy_region_bytes(&s, nh, (uint64_t) npages * P);
            const size_t cap =
                (size_t) (rbytes + 127) / 64 * 64; /* aligned_alloc wants a multiple */
            uint8_t *buf = aligned_alloc(64, cap), *region = buf + shift;
            uint8_t *again = aligned_alloc(64, cap), *region2 = again + shift;
            assert_non_null(buf);
            assert_non_null(again);

            kvs_copy_desc_t d = copy_desc(pa, ra, list_a, npages, h0, nh, region, rbytes);
            uint64_t gsum = 0, ssum = 0, g2 = 0;
            d.checksum = &gsum;
            run_copy(&b, KVS_COPY_GATHER, &d);
            assert_true(gsum == kvs_csum_of(region, rbytes));

            d = copy_desc(pb, rb, list_b, npages, h0, nh, region, rbytes);
            d.checksum = &ssum;
            run_copy(&b, KVS_COPY_SCATTER, &d);
            assert_true(ssum == gsum);
            /* the scattered bytes gather back to the same region */
            d = copy_desc(pb, rb, list_b, npages, h0, nh, region2, rbytes);
            d.checksum = &g2;
            run_copy(&b, KVS_COPY_GATHER, &d);
            assert_memory_equal(region, region2, rbytes);
            assert_true(g2 == gsum);

            /* one changed byte (first, last, and random ones) changes the scatter's sum */
            for (int k = 0; k < 8; k++) {
                const uint64_t at = k == 0 ? 0 : k == 1 ? rbytes - 1 : kvs_rng_below(&rng, rbytes);
                const uint8_t flip = (uint8_t) (1u << kvs_rng_below(&rng, 8));
                region[at] ^= flip;
                d = copy_desc(pb, rb, list_b, npages, h0, nh, region, rbytes);
                d.checksum = &ssum;
                run_copy(&b, KVS_COPY_SCATTER, &d);
                assert_true(ssum != gsum);
                assert_true(ssum == kvs_csum_of(region, rbytes));
                region[at] ^= flip;
            }
            free(buf);
            free(again);
            free(ra);
            free(rb);
            kvs_pool_destroy(pa);
            kvs_pool_destroy(pb);
        }
    }
    kvs_copy_backend_destroy(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_vector),
        cmocka_unit_test(test_invalid_descriptors),
        cmocka_unit_test(test_gather_scatter_property),
        cmocka_unit_test(test_checksum_vector_paths),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
