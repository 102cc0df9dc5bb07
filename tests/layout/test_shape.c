/* Tests for src/layout/shape.c: KV shape validation (with the logged reason), components and
 * dims, the TP head layout (heads per rank, replication, first head, divisibility), and the
 * geometry's page sizes, stages and decode context parallel groups. */
#include "kvs_test.h"

#include <string.h>

#include "kvstage/grid.h"
#include "kvstage/layout.h"
#include "kvstage/log.h"

/* Runs a validation under a capturing sink; asserts one error naming `needle` was logged. */
static void expect_shape_error(const kvs_kv_shape_t *shape, const char *needle)
{
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_status_t st = kvs_kv_shape_validate(shape);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(st, KVS_ERR_INVALID);
    assert_int_equal(cap.calls, 1);
    if (strstr(cap.msg, needle) == NULL) fail_msg("log '%s' does not name '%s'", cap.msg, needle);
}

static kvs_kv_shape_t mha(uint32_t heads)
{
    return (kvs_kv_shape_t){.layers = 32,
                            .kv_heads = heads,
                            .head_dim_k = 128,
                            .head_dim_v = 128,
                            .elem_bytes = 2,
                            .attn = KVS_ATTN_MHA};
}

static kvs_kv_shape_t mla(void)
{
    return (kvs_kv_shape_t){.layers = 61,
                            .kv_heads = 1,
                            .head_dim_k = 576,
                            .head_dim_v = 0,
                            .elem_bytes = 2,
                            .attn = KVS_ATTN_MLA};
}

static void test_shape_validate(void **state)
{
    (void) state;
    kvs_kv_shape_t s = mha(8);
    assert_int_equal(kvs_kv_shape_validate(&s), KVS_OK);
    s = mla();
    assert_int_equal(kvs_kv_shape_validate(&s), KVS_OK);
    for (uint32_t e = 1; e <= 4; e *= 2) {
        s = mha(8);
        s.elem_bytes = e;
        assert_int_equal(kvs_kv_shape_validate(&s), KVS_OK);
    }
    s = mha(8);
    s.head_dim_v = 64; /* Dk != Dv is allowed */
    assert_int_equal(kvs_kv_shape_validate(&s), KVS_OK);

    s = mha(8);
    s.layers = 0;
    expect_shape_error(&s, "layers = 0");
    s = mha(0);
    expect_shape_error(&s, "kv_heads = 0");
    s = mha(8);
    s.head_dim_k = 0;
    expect_shape_error(&s, "head_dim_k = 0");
    s = mha(8);
    s.head_dim_v = 0;
    expect_shape_error(&s, "head_dim_v = 0");
    s = mha(8);
    s.elem_bytes = 3;
    expect_shape_error(&s, "elem_bytes = 3");
    s = mha(8);
    s.elem_bytes = 8;
    expect_shape_error(&s, "elem_bytes = 8");
    s = mla();
    s.kv_heads = 2;
    expect_shape_error(&s, "kv_heads = 2");
    s = mla();
    s.head_dim_v = 64;
    expect_shape_error(&s, "head_dim_v = 64");
    s = mha(8);
    s.attn = (kvs_attn_t) 7;
    expect_shape_error(&s, "attn = 7");
    s = mha(UINT32_MAX);
    s.layers = UINT32_MAX;
    expect_shape_error(&s, "too large");

    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_kv_shape_validate(NULL), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 1);
}

static void test_shape_components_and_dims(void **state)
{
    (void) state;
    kvs_kv_shape_t s = mha(8);
    s.head_dim_v = 96;
    assert_int_equal(kvs_kv_shape_components(&s), 2);
    assert_int_equal(kvs_kv_shape_dim(&s, 0), 128);
    assert_int_equal(kvs_kv_shape_dim(&s, 1), 96);
    assert_int_equal(kvs_kv_shape_dim(&s, 2), 0);
    s = mla();
    assert_int_equal(kvs_kv_shape_components(&s), 1);
    assert_int_equal(kvs_kv_shape_dim(&s, 0), 576);
    assert_int_equal(kvs_kv_shape_dim(&s, 1), 0);
}

static void test_tp_heads_and_replication(void **state)
{
    (void) state;
    kvs_kv_shape_t s = mha(8);
    /* TP 4 over 8 heads: 2 heads each, no replication. */
    assert_int_equal(kvs_tp_heads_per_rank(&s, 4), 2);
    assert_int_equal(kvs_tp_replication(&s, 4), 1);
    for (uint32_t r = 0; r < 4; r++) assert_int_equal(kvs_tp_first_head(&s, 4, r), 2 * r);
    /* TP 1 holds everything. */
    assert_int_equal(kvs_tp_heads_per_rank(&s, 1), 8);
    assert_int_equal(kvs_tp_first_head(&s, 1, 0), 0);
    /* TP 32 over 8 heads: one head each, replicated 4 times: ranks 0-3 hold head 0. */
    assert_int_equal(kvs_tp_heads_per_rank(&s, 32), 1);
    assert_int_equal(kvs_tp_replication(&s, 32), 4);
    for (uint32_t r = 0; r < 32; r++) assert_int_equal(kvs_tp_first_head(&s, 32, r), r / 4);

    s = mha(4);
    assert_int_equal(kvs_tp_heads_per_rank(&s, 8), 1);
    assert_int_equal(kvs_tp_replication(&s, 8), 2);
    assert_int_equal(kvs_tp_first_head(&s, 8, 5), 2);

    s = mla();
    for (uint32_t t = 1; t <= 16; t *= 2) {
        assert_int_equal(kvs_tp_heads_per_rank(&s, t), 1);
        assert_int_equal(kvs_tp_replication(&s, t), t);
        for (uint32_t r = 0; r < t; r++) assert_int_equal(kvs_tp_first_head(&s, t, r), 0);
    }
}

static void test_tp_validate(void **state)
{
    (void) state;
    kvs_kv_shape_t s = mha(8);
    static const uint32_t ok_sizes[] = {1, 2, 4, 8, 16, 32, 64};
    for (size_t i = 0; i < sizeof(ok_sizes) / sizeof(ok_sizes[0]); i++) {
        kvs_tp_t tp = {.tp_size = ok_sizes[i], .tp_rank = ok_sizes[i] - 1};
        assert_int_equal(kvs_tp_validate(&s, &tp), KVS_OK);
    }

    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    s = mha(3);
    kvs_tp_t tp = {.tp_size = 2, .tp_rank = 0};
    assert_int_equal(kvs_tp_validate(&s, &tp), KVS_ERR_INVALID);
    assert_int_equal(cap.calls, 1);
    assert_non_null(strstr(cap.msg, "3 KV heads cannot be split over TP 2"));
    assert_non_null(strstr(cap.msg, "H % T == 0 or T % H == 0"));

    s = mha(6);
    tp = (kvs_tp_t){.tp_size = 4, .tp_rank = 0};
    assert_int_equal(kvs_tp_validate(&s, &tp), KVS_ERR_INVALID);
    assert_non_null(strstr(cap.msg, "6 KV heads cannot be split over TP 4"));

    s = mha(8);
    tp = (kvs_tp_t){.tp_size = 0, .tp_rank = 0};
    assert_int_equal(kvs_tp_validate(&s, &tp), KVS_ERR_INVALID);
    assert_non_null(strstr(cap.msg, "TP size 0"));
    tp = (kvs_tp_t){.tp_size = KVS_MAX_TP * 2, .tp_rank = 0};
    assert_int_equal(kvs_tp_validate(&s, &tp), KVS_ERR_INVALID);
    assert_non_null(strstr(cap.msg, "TP size 128"));
    tp = (kvs_tp_t){.tp_size = 4, .tp_rank = 4};
    assert_int_equal(kvs_tp_validate(&s, &tp), KVS_ERR_INVALID);
    assert_non_null(strstr(cap.msg, "TP rank 4"));
    /* A bad shape is reported by the shape check, once. */
    int before = cap.calls;
    s.layers = 0;
    tp = (kvs_tp_t){.tp_size = 2, .tp_rank = 0};
    assert_int_equal(kvs_tp_validate(&s, &tp), KVS_ERR_INVALID);
    assert_int_equal(cap.calls, before + 1);
    assert_non_null(strstr(cap.msg, "layers = 0"));
    kvs_log_set_sink(NULL, NULL);

    /* MLA never shards, so any TP size works. */
    s = mla();
    for (uint32_t t = 1; t <= KVS_MAX_TP; t++) {
        tp = (kvs_tp_t){.tp_size = t, .tp_rank = t / 2};
        assert_int_equal(kvs_tp_validate(&s, &tp), KVS_OK);
    }
}

/* Exhaustive: every valid (H, T) gives a partition of heads into groups of h, each held by
 * exactly R consecutive ranks, and the validation agrees with the divisibility rule. */
static void test_tp_layout_exhaustive(void **state)
{
    (void) state;
    kvs_log_capture_t cap = {.errors_only = 1}; /* swallows the expected rejections */
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    int rejected = 0;
    for (uint32_t heads = 1; heads <= 128; heads++) {
        kvs_kv_shape_t s = mha(heads);
        for (uint32_t t = 1; t <= KVS_MAX_TP; t++) {
            kvs_tp_t tp = {.tp_size = t, .tp_rank = 0};
            int valid = heads % t == 0 || t % heads == 0;
            assert_int_equal(kvs_tp_validate(&s, &tp), valid ? KVS_OK : KVS_ERR_INVALID);
            rejected += !valid;
            if (!valid) continue;
            uint32_t h = kvs_tp_heads_per_rank(&s, t);
            uint32_t r = kvs_tp_replication(&s, t);
            assert_int_equal(h * t, heads * r);
            uint32_t holders[128] = {0};
            for (uint32_t rank = 0; rank < t; rank++) {
                uint32_t f = kvs_tp_first_head(&s, t, rank);
                assert_true(f + h <= heads);
                for (uint32_t g = f; g < f + h; g++) holders[g]++;
            }
            for (uint32_t g = 0; g < heads; g++) assert_int_equal(holders[g], r);
        }
    }
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, rejected);
}

/* A page size per side: each side's page, and the chunk a multiple of the decode page only. */
static void test_geometry_page_sizes(void **state)
{
    (void) state;
    kvs_pd_geometry_t g = {
        .shape = mha(8), .prefill_tp = 4, .decode_tp = 2, .page_size = 16, .chunk_tokens = 256};
    assert_int_equal(kvs_pd_geometry_validate(&g), KVS_OK);
    assert_int_equal(kvs_pd_geometry_page(&g, KVS_SIDE_PREFILL), 16);
    assert_int_equal(kvs_pd_geometry_page(&g, KVS_SIDE_DECODE), 16);
    g.prefill_page_size = 48; /* not a divisor of the chunk: prefill pages are cut anywhere */
    assert_int_equal(kvs_pd_geometry_validate(&g), KVS_OK);
    assert_int_equal(kvs_pd_geometry_page(&g, KVS_SIDE_PREFILL), 48);
    assert_int_equal(kvs_pd_geometry_page(&g, KVS_SIDE_DECODE), 16);
    static const struct {
        uint32_t decode, prefill, chunk;
        const char *needle;
    } bad[] = {
        {64, 16, 96, "chunk size 96 must be a positive multiple of the decode page size 64"},
        {0, 16, 96, "decode page size 0 is out of range [1, 1048576]"},
        {16, (1u << 20) + 1, 256, "prefill page size 1048577 is out of range"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        g.page_size = bad[i].decode;
        g.prefill_page_size = bad[i].prefill;
        g.chunk_tokens = bad[i].chunk;
        kvs_log_capture_t cap = {.errors_only = 1};
        kvs_log_set_sink(kvs_log_capture_sink, &cap);
        kvs_status_t st = kvs_pd_geometry_validate(&g);
        kvs_log_set_sink(NULL, NULL);
        assert_int_equal(st, KVS_ERR_INVALID);
        if (strstr(cap.msg, bad[i].needle) == NULL)
            fail_msg("case %zu: '%s' lacks '%s'", i, cap.msg, bad[i].needle);
    }
    /* pipeline stages: at most one per layer, at most KVS_MAX_TP prefill ranks */
    g.page_size = 16;
    g.prefill_page_size = 0;
    g.chunk_tokens = 256;
    g.shape.layers = 4;
    g.prefill_pp = 4;
    assert_int_equal(kvs_pd_geometry_validate(&g), KVS_OK);
    assert_int_equal(kvs_pd_geometry_prefill_ranks(&g), 16);
    static const struct {
        uint32_t pp, tp;
        const char *needle;
    } stages[] = {
        {5, 4, "5 prefill pipeline stages for 4 layers: a stage needs at least one layer"},
        {4, 32, "prefill PP 4 x TP 32 = 128 ranks, more than the 64"},
    };
    for (size_t i = 0; i < sizeof(stages) / sizeof(stages[0]); i++) {
        g.prefill_pp = stages[i].pp;
        g.prefill_tp = stages[i].tp;
        kvs_log_capture_t cap = {.errors_only = 1};
        kvs_log_set_sink(kvs_log_capture_sink, &cap);
        kvs_status_t st = kvs_pd_geometry_validate(&g);
        kvs_log_set_sink(NULL, NULL);
        assert_int_equal(st, KVS_ERR_INVALID);
        if (strstr(cap.msg, stages[i].needle) == NULL)
            fail_msg("stages %zu: '%s' lacks '%s'", i, cap.msg, stages[i].needle);
    }
    g.prefill_pp = 0;
    g.prefill_tp = 4;
    g.shape.layers = mha(8).layers;
    /* every pair of powers of two from 1 to 256 */
    for (uint32_t d = 1; d <= 256; d *= 2) {
        for (uint32_t p = 1; p <= 256; p *= 2) {
            g.page_size = d;
            g.prefill_page_size = p;
            g.chunk_tokens = 256;
            assert_int_equal(kvs_pd_geometry_validate(&g), KVS_OK);
        }
    }
}

/* GPU pools: kvs_pd_geometry_check_device accepts a side exactly when every copy that side
 * makes is whole pages of its own size (what the CUDA kernels move): each chunk's slot, from
 * the grid (kvs_grid_slot_tokens), starts and ends on that side's pages, for every prompt
 * length and decode prefix. DCP is refused on both sides. */
static void test_geometry_check_device(void **state)
{
    (void) state;
    static const uint32_t sizes[] = {1, 2, 4, 8, 16, 24, 32, 48, 64};
    const size_t n = sizeof(sizes) / sizeof(sizes[0]);
    kvs_pd_geometry_t g = {.shape = mha(8), .prefill_tp = 4, .decode_tp = 2};
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < n; j++) {
            g.prefill_page_size = sizes[i];
            g.page_size = sizes[j];
            g.chunk_tokens = 2 * sizes[j];
            assert_int_equal(kvs_pd_geometry_validate(&g), KVS_OK);
            const uint64_t grid = kvs_grid_tokens(g.chunk_tokens, g.page_size);
            for (int side = KVS_SIDE_PREFILL; side <= KVS_SIDE_DECODE; side++) {
                const uint32_t P = kvs_pd_geometry_page(&g, (kvs_side_t) side);
                int whole = 1;
                for (uint64_t len = 1; len <= 200 && whole; len++) {
                    for (uint64_t base = 0; base < len && whole; base += g.page_size) {
                        for (uint64_t k = 0;; k++) {
                            uint64_t t = kvs_grid_slot_tokens(k, len, base, grid, g.page_size,
                                                              g.prefill_page_size);
                            if (t == 0) break;
                            if ((base + k * grid) % P != 0 || t % P != 0) whole = 0;
                        }
                    }
                }
                kvs_log_capture_t cap = {.errors_only = 1};
                kvs_log_set_sink(kvs_log_capture_sink, &cap);
                kvs_status_t st = kvs_pd_geometry_check_device(&g, (kvs_side_t) side);
                kvs_log_set_sink(NULL, NULL);
                if ((st == KVS_OK) != whole)
                    fail_msg("%s side, prefill page %u, decode page %u: check says %s, the grid "
                             "%s",
                             kvs_side_str((kvs_side_t) side), g.prefill_page_size, g.page_size,
                             kvs_status_str(st), whole ? "has whole pages only" : "cuts a page");
                if (st != KVS_OK && strstr(cap.msg, "move whole pages only") == NULL)
                    fail_msg("refusal without its reason: '%s'", cap.msg);
            }
        }
    }
    /* DCP: refused on both sides, naming it */
    g = (kvs_pd_geometry_t){.shape = mha(2),
                            .prefill_tp = 2,
                            .decode_tp = 4,
                            .page_size = 16,
                            .chunk_tokens = 64,
                            .decode_dcp = 2};
    assert_int_equal(kvs_pd_geometry_validate(&g), KVS_OK);
    for (int side = KVS_SIDE_PREFILL; side <= KVS_SIDE_DECODE; side++) {
        kvs_log_capture_t cap = {.errors_only = 1};
        kvs_log_set_sink(kvs_log_capture_sink, &cap);
        assert_int_equal(kvs_pd_geometry_check_device(&g, (kvs_side_t) side), KVS_ERR_UNSUPPORTED);
        kvs_log_set_sink(NULL, NULL);
        assert_non_null(strstr(cap.msg, "decode context parallelism (DCP 2)"));
    }
}

/* Decode context parallelism: N divides the decode ranks holding each head (every rank for
 * MLA), T divides the decode page, the chunk is a multiple of N x Pd; refusals name the
 * numbers. */
static void test_geometry_dcp(void **state)
{
    (void) state;
    kvs_pd_geometry_t g = {.shape = mla(),
                           .prefill_tp = 2,
                           .decode_tp = 8,
                           .page_size = 16,
                           .chunk_tokens = 256,
                           .decode_dcp = 8,
                           .dcp_interleave = 4};
    assert_int_equal(kvs_pd_geometry_validate(&g), KVS_OK);
    assert_int_equal(kvs_pd_geometry_dcp(&g), 8);
    assert_int_equal(kvs_pd_geometry_interleave(&g), 4);
    assert_int_equal(kvs_pd_geometry_unit(&g), 128);
    kvs_dcp_t d = kvs_pd_geometry_dcp_of(&g, 5);
    assert_int_equal(d.size, 8);
    assert_int_equal(d.interleave, 4);
    assert_int_equal(d.rank, 5);
    /* GQA: 4 heads on TP 8 replicate each head twice, so DCP 2 groups ranks 0-1, 2-3, ... */
    g = (kvs_pd_geometry_t){.shape = mha(4),
                            .prefill_tp = 4,
                            .decode_tp = 8,
                            .page_size = 16,
                            .chunk_tokens = 64,
                            .decode_dcp = 2};
    assert_int_equal(kvs_pd_geometry_validate(&g), KVS_OK);
    assert_int_equal(kvs_pd_geometry_dcp_of(&g, 3).rank, 1);
    assert_int_equal(kvs_tp_first_head(&g.shape, 8, 2), kvs_tp_first_head(&g.shape, 8, 3));
    /* none: 0 and 1 both mean plain TP */
    g.decode_dcp = 0;
    assert_int_equal(kvs_pd_geometry_dcp(&g), 1);
    assert_int_equal(kvs_pd_geometry_unit(&g), 16);
    static const struct {
        int is_mla;
        uint32_t heads, decode_tp, dcp, interleave, page, chunk;
        const char *needle;
    } bad[] = {
        {1, 1, 8, 3, 1, 16, 256, "decode DCP 3 does not divide decode TP 8"},
        {1, 1, 4, 65, 1, 16, 256, "decode DCP 65 does not divide decode TP 4"},
        {0, 8, 8, 2, 1, 16, 256,
         "decode DCP 2 needs 2 decode ranks holding the same KV heads, but decode TP 8 over 8 KV "
         "heads holds each head on 1"},
        {0, 2, 8, 8, 1, 16, 256, "decode TP 8 over 2 KV heads holds each head on 4"},
        {1, 1, 4, 4, 3, 16, 256, "DCP interleave 3 must divide the decode page size 16"},
        {1, 1, 4, 4, 32, 16, 256, "DCP interleave 32 must divide the decode page size 16"},
        {1, 1, 4, 4, 1, 16, 96,
         "chunk size 96 must be a positive multiple of decode DCP 4 x decode page size 16 = 64"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        g = (kvs_pd_geometry_t){.shape = bad[i].is_mla ? mla() : mha(bad[i].heads),
                                .prefill_tp = 1,
                                .decode_tp = bad[i].decode_tp,
                                .page_size = bad[i].page,
                                .chunk_tokens = bad[i].chunk,
                                .decode_dcp = bad[i].dcp,
                                .dcp_interleave = bad[i].interleave};
        kvs_log_capture_t cap = {.errors_only = 1};
        kvs_log_set_sink(kvs_log_capture_sink, &cap);
        kvs_status_t st = kvs_pd_geometry_validate(&g);
        kvs_log_set_sink(NULL, NULL);
        assert_int_equal(st, KVS_ERR_INVALID);
        if (strstr(cap.msg, bad[i].needle) == NULL)
            fail_msg("dcp %zu: '%s' lacks '%s'", i, cap.msg, bad[i].needle);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shape_validate),
        cmocka_unit_test(test_geometry_dcp),
        cmocka_unit_test(test_shape_components_and_dims),
        cmocka_unit_test(test_tp_heads_and_replication),
        cmocka_unit_test(test_tp_validate),
        cmocka_unit_test(test_tp_layout_exhaustive),
        cmocka_unit_test(test_geometry_page_sizes),
        cmocka_unit_test(test_geometry_check_device),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
