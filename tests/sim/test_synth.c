/* Tests for the synthetic KV: written bytes verify exactly through any strides and TP layout,
 * and a single flipped, misplaced or stale byte is caught. */
#include "kvs_test.h"

#include <string.h>

#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "sim/sim.h"

static kvs_pool_t *make_pool(kvs_kv_shape_t shape, uint32_t tp, uint32_t rank, uint32_t page,
                             uint32_t pages, kvs_pool_layout_t layout)
{
    kvs_pool_config_t c = {.shape = shape,
                           .tp = {.tp_size = tp, .tp_rank = rank},
                           .page_size = page,
                           .num_pages = pages,
                           .layout = layout,
                           .mem = KVS_MEM_HOST};
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_OK);
    return pool;
}

static void random_tokens(kvs_rng_t *rng, int32_t *t, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) t[i] = (int32_t) kvs_rng_below(rng, 1000);
}

static void test_hashes_depend_on_prefix_only(void **state)
{
    (void) state;
    int32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int32_t b[8] = {1, 2, 3, 4, 9, 6, 7, 8};
    uint64_t ha[8], hb[8];
    kvs_synth_hashes(a, 8, ha);
    kvs_synth_hashes(b, 8, hb);
    for (int i = 0; i < 4; i++) assert_true(ha[i] == hb[i]);
    /* The same later tokens after a different one still give different KV. */
    for (int i = 4; i < 8; i++) assert_true(ha[i] != hb[i]);
    /* Coordinates matter: some byte differs between neighbouring heads, layers and K/V. */
    int diff_head = 0, diff_layer = 0, diff_comp = 0;
    for (uint32_t byte = 0; byte < 16; byte++) {
        uint8_t x = kvs_synth_byte(ha[3], 0, 0, 0, byte);
        diff_head |= x != kvs_synth_byte(ha[3], 0, 0, 1, byte);
        diff_layer |= x != kvs_synth_byte(ha[3], 1, 0, 0, byte);
        diff_comp |= x != kvs_synth_byte(ha[3], 0, 1, 0, byte);
    }
    assert_true(diff_head && diff_layer && diff_comp);
}

/* Writes a prompt into every rank of a TP group through a scrambled page table, verifies it,
 * then checks that one flipped byte anywhere is counted exactly once. */
static void write_verify_flip(kvs_kv_shape_t shape, uint32_t tp, uint32_t page,
                              kvs_pool_layout_t layout, uint64_t seed)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const uint64_t len = 3 * page + page / 2 + 1;
    const uint32_t npages = (uint32_t) ((len + page - 1) / page);
    int32_t tokens[512];
    uint64_t hashes[512];
    assert_true(len <= 512);
    random_tokens(&rng, tokens, len);
    kvs_synth_hashes(tokens, len, hashes);
    for (uint32_t r = 0; r < tp; r++) {
        kvs_pool_t *pool = make_pool(shape, tp, r, page, npages + 4, layout);
        uint32_t table[64];
        /* Reverse order, skipping page 0, so position -> page mapping is non-trivial. */
        for (uint32_t i = 0; i < npages; i++) table[i] = npages + 2 - i;
        kvs_synth_write(pool, hashes, table, 0, len);
        assert_int_equal(kvs_synth_verify(pool, hashes, table, 0, len), 0);

        /* One byte flipped at a random coordinate. */
        uint64_t pos = kvs_rng_below(&rng, len);
        uint32_t comps = kvs_kv_shape_components(&shape);
        uint32_t layer = (uint32_t) kvs_rng_below(&rng, shape.layers);
        uint32_t comp = (uint32_t) kvs_rng_below(&rng, comps);
        const kvs_region_t *reg = kvs_pool_region(pool, layer, comp);
        uint32_t head = (uint32_t) kvs_rng_below(&rng, reg->heads);
        uint32_t byte = (uint32_t) kvs_rng_below(&rng, reg->dim * reg->elem_bytes);
        uint8_t *p = kvs_region_addr(reg, table[pos / page], pos % page, head) + byte;
        *p ^= 0x40;
        assert_int_equal(kvs_synth_verify(pool, hashes, table, 0, len), 1);
        /* Outside the flipped position the range still verifies. */
        assert_int_equal(kvs_synth_verify(pool, hashes, table, 0, pos), 0);
        *p ^= 0x40;
        assert_int_equal(kvs_synth_verify(pool, hashes, table, 0, len), 0);

        /* A misplaced page (two table entries swapped) is caught. */
        if (npages >= 2) {
            uint32_t swapped[64];
            memcpy(swapped, table, npages * sizeof(uint32_t));
            swapped[0] = table[1];
            swapped[1] = table[0];
            assert_true(kvs_synth_verify(pool, hashes, swapped, 0, 2 * page) > 0);
        }
        /* Stale KV: a page holding another prompt's tokens is caught. */
        int32_t other[512];
        uint64_t other_hashes[512];
        memcpy(other, tokens, len * sizeof(int32_t));
        other[0] ^= 1;
        kvs_synth_hashes(other, len, other_hashes);
        assert_true(kvs_synth_verify(pool, other_hashes, table, 0, page) > 0);
        /* Never-written pages (zeroed) are caught. */
        uint32_t fresh[1] = {0};
        assert_true(kvs_synth_verify(pool, hashes, fresh, 0, 1) > 0);
        kvs_pool_destroy(pool);
    }
}

static void test_write_verify_layouts(void **state)
{
    (void) state;
    kvs_kv_shape_t mha = {.layers = 3,
                          .kv_heads = 8,
                          .head_dim_k = 16,
                          .head_dim_v = 8,
                          .elem_bytes = 2,
                          .attn = KVS_ATTN_MHA};
    write_verify_flip(mha, 1, 16, KVS_POOL_NHD, 1);
    write_verify_flip(mha, 4, 16, KVS_POOL_HND, 2);
    write_verify_flip(mha, 2, 1, KVS_POOL_NHD, 3);
    write_verify_flip(mha, 16, 4, KVS_POOL_HND, 4); /* replicated heads */
    kvs_kv_shape_t odd = {.layers = 1,
                          .kv_heads = 2,
                          .head_dim_k = 3,
                          .head_dim_v = 5,
                          .elem_bytes = 1,
                          .attn = KVS_ATTN_MHA};
    write_verify_flip(odd, 2, 8, KVS_POOL_NHD, 5);
    kvs_kv_shape_t mla = {.layers = 2,
                          .kv_heads = 1,
                          .head_dim_k = 72,
                          .head_dim_v = 0,
                          .elem_bytes = 4,
                          .attn = KVS_ATTN_MLA};
    write_verify_flip(mla, 3, 16, KVS_POOL_HND, 6);
    kvs_assert_no_leaks();
}

/* Two ranks holding the same head (replication) hold the same bytes; ranks holding different
 * heads do not. */
static void test_heads_are_global(void **state)
{
    (void) state;
    kvs_kv_shape_t shape = {.layers = 1,
                            .kv_heads = 2,
                            .head_dim_k = 8,
                            .head_dim_v = 8,
                            .elem_bytes = 2,
                            .attn = KVS_ATTN_MHA};
    int32_t tokens[4] = {5, 6, 7, 8};
    uint64_t hashes[4];
    kvs_synth_hashes(tokens, 4, hashes);
    uint32_t table[1] = {0};
    kvs_pool_t *p[4];
    for (uint32_t r = 0; r < 4; r++) {
        p[r] = make_pool(shape, 4, r, 4, 1, KVS_POOL_NHD);
        kvs_synth_write(p[r], hashes, table, 0, 4);
    }
    const kvs_region_t *k0 = kvs_pool_region(p[0], 0, 0), *k1 = kvs_pool_region(p[1], 0, 0),
                       *k2 = kvs_pool_region(p[2], 0, 0);
    assert_memory_equal(kvs_region_addr(k0, 0, 2, 0), kvs_region_addr(k1, 0, 2, 0), 16);
    assert_memory_not_equal(kvs_region_addr(k0, 0, 2, 0), kvs_region_addr(k2, 0, 2, 0), 16);
    /* Rank 2 holds global head 1: rank 0's pool verifies as wrong with rank 2's bytes. */
    memcpy(kvs_region_addr(k0, 0, 2, 0), kvs_region_addr(k2, 0, 2, 0), 16);
    assert_int_equal(kvs_synth_verify(p[0], hashes, table, 0, 4) > 0, 1);
    for (uint32_t r = 0; r < 4; r++) kvs_pool_destroy(p[r]);
    kvs_assert_no_leaks();
}

static void test_first_token(void **state)
{
    (void) state;
    int32_t a = kvs_synth_first_token(123), b = kvs_synth_first_token(124);
    assert_true(a >= 0 && a < KVS_WORKLOAD_VOCAB);
    assert_true(b >= 0 && b < KVS_WORKLOAD_VOCAB);
    assert_int_equal(a, kvs_synth_first_token(123));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hashes_depend_on_prefix_only),
        cmocka_unit_test(test_write_verify_layouts),
        cmocka_unit_test(test_heads_are_global),
        cmocka_unit_test(test_first_token),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
