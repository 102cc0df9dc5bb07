/* Tests for src/layout/plan.c: the protocol.md §2 examples, an exhaustive check of the plan
 * over TP pairs, head counts and rooms, the slot layout, and the `kvstage plan` tool. */
#include "kvs_test.h"

#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvstage/layout.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"

static void discard_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                         const char *msg)
{
    (void) file;
    (void) line;
    (void) msg;
    if (level == KVS_LOG_ERROR) (*(int *) arg)++;
}

static kvs_kv_shape_t mha(uint32_t heads)
{
    /* Dk != Dv and an odd element count catch swapped or dropped factors. */
    return (kvs_kv_shape_t){.layers = 3,
                            .kv_heads = heads,
                            .head_dim_k = 5,
                            .head_dim_v = 7,
                            .elem_bytes = 2,
                            .attn = KVS_ATTN_MHA};
}

static kvs_kv_shape_t mla(void)
{
    return (kvs_kv_shape_t){.layers = 3,
                            .kv_heads = 1,
                            .head_dim_k = 9,
                            .head_dim_v = 0,
                            .elem_bytes = 1,
                            .attn = KVS_ATTN_MLA};
}

static uint32_t writers_of(const kvs_kv_shape_t *s, uint32_t tp_p, uint32_t tp_d, uint32_t d,
                           uint64_t room, kvs_writer_t *w)
{
    uint32_t n = 0;
    assert_int_equal(kvs_plan_writers(s, tp_p, tp_d, d, room, w, &n), KVS_OK);
    return n;
}

static void expect_writer(const kvs_writer_t *w, uint32_t p, uint32_t src, uint32_t dst,
                          uint32_t heads, uint64_t bpt)
{
    assert_int_equal(w->prefill_rank, p);
    assert_int_equal(w->src_head, src);
    assert_int_equal(w->dst_head, dst);
    assert_int_equal(w->heads, heads);
    assert_int_equal(w->bytes_per_token, bpt);
}

static void test_plan_examples(void **state)
{
    (void) state;
    kvs_writer_t w[KVS_MAX_WRITERS];
    kvs_kv_shape_t s = mha(8);
    const uint64_t head_bpt = 3 * (5 + 7) * 2; /* L * (Dk + Dv) * E */

    /* fan-in TP4 -> TP2: decode 0 gets prefill 0 (heads 0-1) and prefill 1 (heads 2-3) */
    assert_int_equal(writers_of(&s, 4, 2, 0, 0, w), 2);
    expect_writer(&w[0], 0, 0, 0, 2, 2 * head_bpt);
    expect_writer(&w[1], 1, 0, 2, 2, 2 * head_bpt);
    assert_int_equal(writers_of(&s, 4, 2, 1, 0, w), 2);
    expect_writer(&w[0], 2, 0, 0, 2, 2 * head_bpt);
    expect_writer(&w[1], 3, 0, 2, 2, 2 * head_bpt);

    /* fan-out TP2 -> TP4: decode 1 takes heads 2-3, the upper half of prefill 0 */
    assert_int_equal(writers_of(&s, 2, 4, 1, 0, w), 1);
    expect_writer(&w[0], 0, 2, 0, 2, 2 * head_bpt);
    assert_int_equal(writers_of(&s, 2, 4, 2, 0, w), 1);
    expect_writer(&w[0], 1, 0, 0, 2, 2 * head_bpt);

    /* equal TP: d <- d, whole slice */
    for (uint32_t d = 0; d < 4; d++) {
        assert_int_equal(writers_of(&s, 4, 4, d, 9, w), 1);
        expect_writer(&w[0], d, 0, 0, 2, 2 * head_bpt);
    }

    /* non-integer ratio TP3 -> TP2 with 6 heads */
    s = mha(6);
    assert_int_equal(writers_of(&s, 3, 2, 0, 0, w), 2);
    expect_writer(&w[0], 0, 0, 0, 2, 2 * head_bpt);
    expect_writer(&w[1], 1, 0, 2, 1, head_bpt);
    assert_int_equal(writers_of(&s, 3, 2, 1, 0, w), 2);
    expect_writer(&w[0], 1, 1, 0, 1, head_bpt);
    expect_writer(&w[1], 2, 0, 1, 2, 2 * head_bpt);

    /* prefill TP8 over 4 heads replicates each head twice; only one replica writes */
    s = mha(4);
    assert_int_equal(writers_of(&s, 8, 1, 0, 0, w), 4);
    for (uint32_t i = 0; i < 4; i++) expect_writer(&w[i], 2 * i, 0, i, 1, head_bpt);
    assert_int_equal(writers_of(&s, 8, 1, 0, 1, w), 4);
    for (uint32_t i = 0; i < 4; i++) expect_writer(&w[i], 2 * i + 1, 0, i, 1, head_bpt);
    /* decode replicas of one head pull from different prefill replicas */
    assert_int_equal(writers_of(&s, 8, 8, 0, 0, w), 1);
    expect_writer(&w[0], 0, 0, 0, 1, head_bpt);
    assert_int_equal(writers_of(&s, 8, 8, 1, 0, w), 1);
    expect_writer(&w[0], 1, 0, 0, 1, head_bpt);

    kvs_dest_t dests[KVS_MAX_TP];
    uint32_t n = 99;
    assert_int_equal(kvs_plan_destinations(&s, 8, 1, 1, 0, dests, &n), KVS_OK);
    assert_int_equal(n, 0); /* replica not chosen for room 0 */
    assert_int_equal(kvs_plan_destinations(&s, 8, 1, 2, 0, dests, &n), KVS_OK);
    assert_int_equal(n, 1);
    assert_int_equal(dests[0].decode_rank, 0);
    assert_int_equal(dests[0].writer, 1);
    expect_writer(&dests[0].w, 2, 0, 1, 1, head_bpt);
    uint32_t ranks[KVS_MAX_TP];
    assert_int_equal(kvs_plan_decode_peers(&s, 8, 1, 1, ranks, &n), KVS_OK);
    assert_int_equal(n, 1); /* ...but it still reports status to decode 0 */
    assert_int_equal(ranks[0], 0);
    assert_int_equal(kvs_plan_peers(&s, 8, 1, 0, ranks, &n), KVS_OK);
    assert_int_equal(n, 8);

    /* MLA: one writer per decode rank, chosen by room; every prefill rank is a peer */
    s = mla();
    assert_int_equal(writers_of(&s, 4, 2, 0, 0, w), 1);
    expect_writer(&w[0], 0, 0, 0, 1, 3 * 9 * 1);
    assert_int_equal(writers_of(&s, 4, 2, 1, 0, w), 1);
    expect_writer(&w[0], 1, 0, 0, 1, 3 * 9 * 1);
    assert_int_equal(writers_of(&s, 4, 2, 1, 6, w), 1);
    expect_writer(&w[0], 3, 0, 0, 1, 3 * 9 * 1);
    assert_int_equal(kvs_plan_peers(&s, 4, 2, 1, ranks, &n), KVS_OK);
    assert_int_equal(n, 4);
    assert_int_equal(kvs_plan_decode_peers(&s, 4, 2, 3, ranks, &n), KVS_OK);
    assert_int_equal(n, 2);
    kvs_assert_no_leaks();
}

static void test_plan_rejects_invalid(void **state)
{
    (void) state;
    int errors = 0;
    kvs_log_set_sink(discard_sink, &errors);
    kvs_writer_t w[KVS_MAX_WRITERS];
    kvs_dest_t dests[KVS_MAX_TP];
    uint32_t ranks[KVS_MAX_TP];
    uint32_t n = 12345;
    static const struct {
        uint32_t heads, tp_p, tp_d, rank;
    } bad[] = {
        {3, 2, 1, 0}, {3, 1, 2, 0},  {6, 4, 2, 0},  {6, 2, 4, 0}, {8, 0, 2, 0},
        {8, 2, 0, 0}, {8, 65, 2, 0}, {8, 2, 65, 0}, {8, 2, 2, 2}, {0, 2, 2, 0},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvs_kv_shape_t s = mha(bad[i].heads);
        int before = errors;
        assert_int_equal(kvs_plan_writers(&s, bad[i].tp_p, bad[i].tp_d, bad[i].rank, 0, w, &n),
                         KVS_ERR_INVALID);
        assert_int_equal(errors, before + 1); /* logged exactly once */
        assert_int_equal(
            kvs_plan_destinations(&s, bad[i].tp_p, bad[i].tp_d, bad[i].rank, 0, dests, &n),
            KVS_ERR_INVALID);
        assert_int_equal(kvs_plan_peers(&s, bad[i].tp_p, bad[i].tp_d, bad[i].rank, ranks, &n),
                         KVS_ERR_INVALID);
        assert_int_equal(
            kvs_plan_decode_peers(&s, bad[i].tp_p, bad[i].tp_d, bad[i].rank, ranks, &n),
            KVS_ERR_INVALID);
    }
    assert_int_equal(n, 12345); /* outputs untouched on error */
    kvs_kv_shape_t s = mla();
    s.kv_heads = 2;
    assert_int_equal(kvs_plan_writers(&s, 2, 2, 0, 0, w, &n), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
}

/* One plan: every decode rank's writers (decode TP <= 16 in the exhaustive check). */
#define MAX_TP_T 16

typedef struct {
    kvs_writer_t w[MAX_TP_T][KVS_MAX_WRITERS];
    uint32_t n[MAX_TP_T];
} plan_t;

static uint64_t expected_bpt(const kvs_kv_shape_t *s, uint32_t heads)
{
    if (s->attn == KVS_ATTN_MLA) return (uint64_t) s->layers * s->head_dim_k * s->elem_bytes;
    return (uint64_t) s->layers * heads * (s->head_dim_k + s->head_dim_v) * s->elem_bytes;
}

static int holds(const kvs_kv_shape_t *s, uint32_t tp, uint32_t rank, uint32_t g)
{
    uint32_t f = kvs_tp_first_head(s, tp, rank);
    return g >= f && g < f + kvs_tp_heads_per_rank(s, tp);
}

/* Checks every plan invariant for one (shape, TP pair, room); fills plan_p. */
static void check_plan(const kvs_kv_shape_t *s, uint32_t tp_p, uint32_t tp_d, uint64_t room,
                       plan_t *plan_p)
{
    const int is_mla = s->attn == KVS_ATTN_MLA;
    const uint32_t hp = kvs_tp_heads_per_rank(s, tp_p), hd = kvs_tp_heads_per_rank(s, tp_d);
    uint64_t sum_bpt = 0, want_bpt = 0;
    uint32_t total_writers = 0;
    for (uint32_t d = 0; d < tp_d; d++) {
        kvs_writer_t *w = plan_p->w[d];
        uint32_t n = writers_of(s, tp_p, tp_d, d, room, w);
        plan_p->n[d] = n;
        assert_true(n >= 1 && n <= KVS_MAX_WRITERS && n <= tp_p);
        uint32_t fd = kvs_tp_first_head(s, tp_d, d);
        uint32_t next_dst = 0;
        for (uint32_t i = 0; i < n; i++) {
            /* dst ranges tile [0, hd) in order, no overlap, no gap */
            assert_int_equal(w[i].dst_head, next_dst);
            assert_true(w[i].heads >= 1);
            next_dst += w[i].heads;
            assert_true(w[i].prefill_rank < tp_p);
            /* maximal merging: neighbours come from different prefill ranks */
            if (i > 0) assert_int_not_equal(w[i].prefill_rank, w[i - 1].prefill_rank);
            /* src heads lie within what that prefill rank holds, and map to the same
             * global heads as the destination */
            assert_true(w[i].src_head + w[i].heads <= hp);
            uint32_t fp = kvs_tp_first_head(s, tp_p, w[i].prefill_rank);
            for (uint32_t j = 0; j < w[i].heads; j++) {
                uint32_t g = fd + w[i].dst_head + j;
                assert_int_equal(fp + w[i].src_head + j, g);
                assert_true(holds(s, tp_p, w[i].prefill_rank, g));
            }
            assert_int_equal(w[i].bytes_per_token, expected_bpt(s, w[i].heads));
            sum_bpt += w[i].bytes_per_token;
        }
        assert_int_equal(next_dst, hd);
        want_bpt += expected_bpt(s, hd);
        total_writers += n;
        if (is_mla) {
            assert_int_equal(n, 1);
            assert_int_equal(w[0].prefill_rank, (room % tp_p + d) % tp_p);
        }

        /* slot layout: aligned, in order, non-overlapping, tight */
        static const uint64_t token_counts[] = {1, 7, 256};
        for (size_t t = 0; t < 3; t++) {
            uint64_t tokens = token_counts[t];
            uint64_t off[KVS_MAX_WRITERS];
            uint64_t total = kvs_slot_layout(w, n, tokens, off);
            assert_int_equal(kvs_slot_layout(w, n, tokens, NULL), total);
            uint64_t prev_end = 0;
            for (uint32_t i = 0; i < n; i++) {
                assert_int_equal(off[i] % KVS_REGION_ALIGN, 0);
                assert_true(off[i] >= prev_end && off[i] - prev_end < KVS_REGION_ALIGN);
                prev_end = off[i] + tokens * w[i].bytes_per_token;
            }
            assert_int_equal(total % KVS_REGION_ALIGN, 0);
            assert_true(total >= prev_end && total - prev_end < KVS_REGION_ALIGN);
        }

        /* status peers: exactly the prefill ranks holding a needed head */
        uint32_t peers[KVS_MAX_TP], np = 0;
        assert_int_equal(kvs_plan_peers(s, tp_p, tp_d, d, peers, &np), KVS_OK);
        uint32_t k = 0;
        for (uint32_t p = 0; p < tp_p; p++) {
            int needed = 0;
            for (uint32_t g = fd; g < fd + hd; g++) needed |= holds(s, tp_p, p, g);
            if (!needed) continue;
            assert_true(k < np);
            assert_int_equal(peers[k++], p);
        }
        assert_int_equal(k, np);
        for (uint32_t i = 0; i < n; i++) {
            int found = 0;
            for (uint32_t j = 0; j < np; j++) found |= peers[j] == w[i].prefill_rank;
            assert_true(found);
        }
    }
    /* bytes conserved: each decode rank receives exactly its slice */
    assert_int_equal(sum_bpt, want_bpt);

    /* destinations over all prefill ranks are exactly the writers, each once */
    uint8_t seen[MAX_TP_T][KVS_MAX_WRITERS];
    memset(seen, 0, sizeof(seen));
    uint32_t total_dests = 0;
    for (uint32_t p = 0; p < tp_p; p++) {
        kvs_dest_t dests[KVS_MAX_TP];
        uint32_t nd = 0;
        assert_int_equal(kvs_plan_destinations(s, tp_p, tp_d, p, room, dests, &nd), KVS_OK);
        for (uint32_t i = 0; i < nd; i++) {
            const kvs_dest_t *x = &dests[i];
            if (i > 0) assert_true(x->decode_rank > dests[i - 1].decode_rank);
            assert_true(x->decode_rank < tp_d && x->writer < plan_p->n[x->decode_rank]);
            const kvs_writer_t *ref = &plan_p->w[x->decode_rank][x->writer];
            assert_int_equal(x->w.prefill_rank, p);
            assert_memory_equal(&x->w, ref, sizeof(*ref));
            assert_int_equal(seen[x->decode_rank][x->writer], 0);
            seen[x->decode_rank][x->writer] = 1;
        }
        total_dests += nd;

        /* decode peers are the converse of peers */
        uint32_t dp[KVS_MAX_TP], ndp = 0;
        assert_int_equal(kvs_plan_decode_peers(s, tp_p, tp_d, p, dp, &ndp), KVS_OK);
        assert_true(ndp >= 1);
        uint32_t k = 0;
        for (uint32_t d = 0; d < tp_d; d++) {
            uint32_t peers[KVS_MAX_TP], np = 0;
            assert_int_equal(kvs_plan_peers(s, tp_p, tp_d, d, peers, &np), KVS_OK);
            int in = 0;
            for (uint32_t j = 0; j < np; j++) in |= peers[j] == p;
            if (!in) continue;
            assert_true(k < ndp);
            assert_int_equal(dp[k++], d);
        }
        assert_int_equal(k, ndp);
        /* a destination is always a status peer */
        for (uint32_t i = 0; i < nd; i++) {
            int in = 0;
            for (uint32_t j = 0; j < ndp; j++) in |= dp[j] == dests[i].decode_rank;
            assert_true(in);
        }
    }
    assert_int_equal(total_dests, total_writers);
}

/* Across rooms, a replicated head (or the MLA latent) must not always come from the same
 * replica, and within one room decode replicas of a head pull from different replicas. */
static void check_replica_spread(const kvs_kv_shape_t *s, uint32_t tp_p, uint32_t tp_d,
                                 const plan_t *plans /* [16 rooms] */)
{
    uint32_t rp = kvs_tp_replication(s, tp_p), rd = kvs_tp_replication(s, tp_d);
    if (rp < 2) return;
    uint32_t hd = kvs_tp_heads_per_rank(s, tp_d);
    for (uint32_t d = 0; d < tp_d; d++) {
        for (uint32_t h = 0; h < hd; h++) {
            uint64_t chosen = 0; /* bitmap of prefill ranks over the rooms */
            for (uint32_t r = 0; r < 16; r++) {
                const plan_t *pl = &plans[r];
                for (uint32_t i = 0; i < pl->n[d]; i++) {
                    const kvs_writer_t *w = &pl->w[d][i];
                    if (h >= w->dst_head && h < w->dst_head + w->heads)
                        chosen |= 1ULL << w->prefill_rank;
                }
            }
            assert_true(__builtin_popcountll(chosen) > 1);
        }
    }
    if (rd < 2) return;
    for (uint32_t r = 0; r < 16; r++) {
        /* decode ranks 0 and 1 hold the same heads; their first writers differ */
        assert_int_not_equal(plans[r].w[0][0].prefill_rank, plans[r].w[1][0].prefill_rank);
    }
}

static void test_plan_exhaustive(void **state)
{
    (void) state;
    static const uint32_t tps[] = {1, 2, 3, 4, 6, 8, 16};
    static const uint32_t heads[] = {1, 2, 3, 4, 8, 16, 32, 64};
    static const uint64_t extra_rooms[] = {12345, 0xdeadbeefcafeULL, UINT64_MAX};
    const size_t ntp = sizeof(tps) / sizeof(tps[0]);
    plan_t *plans = kvs_calloc(16, sizeof(plan_t));
    assert_non_null(plans);
    plan_t extra;
    int errors = 0;
    uint32_t valid = 0, invalid = 0;
    for (size_t hi = 0; hi <= sizeof(heads) / sizeof(heads[0]); hi++) {
        /* the last round is MLA */
        int is_mla = hi == sizeof(heads) / sizeof(heads[0]);
        kvs_kv_shape_t s = is_mla ? mla() : mha(heads[hi]);
        for (size_t a = 0; a < ntp; a++) {
            for (size_t b = 0; b < ntp; b++) {
                uint32_t tp_p = tps[a], tp_d = tps[b];
                uint32_t h = s.kv_heads;
                int ok = (h % tp_p == 0 || tp_p % h == 0) && (h % tp_d == 0 || tp_d % h == 0);
                if (!ok) {
                    kvs_writer_t w[KVS_MAX_WRITERS];
                    uint32_t n;
                    kvs_log_set_sink(discard_sink, &errors);
                    assert_int_equal(kvs_plan_writers(&s, tp_p, tp_d, 0, 0, w, &n),
                                     KVS_ERR_INVALID);
                    kvs_log_set_sink(NULL, NULL);
                    invalid++;
                    continue;
                }
                valid++;
                for (uint32_t r = 0; r < 16; r++) check_plan(&s, tp_p, tp_d, r, &plans[r]);
                for (size_t r = 0; r < 3; r++) check_plan(&s, tp_p, tp_d, extra_rooms[r], &extra);
                check_replica_spread(&s, tp_p, tp_d, plans);
            }
        }
    }
    kvs_free(plans);
    assert_int_equal(errors, (int) invalid);
    assert_true(valid > 200 && invalid > 50); /* the grid really covered both */
    kvs_assert_no_leaks();
}

static void test_slot_layout_and_blocks(void **state)
{
    (void) state;
    kvs_kv_shape_t s = mha(6);
    kvs_writer_t w[KVS_MAX_WRITERS];
    /* TP3 -> TP2, decode 0: 2 heads then 1 head; 3 layers, Dk 5, Dv 7, E 2 */
    assert_int_equal(writers_of(&s, 3, 2, 0, 0, w), 2);
    uint64_t off[2];
    uint64_t total = kvs_slot_layout(w, 2, 10, off);
    /* region 0: 10 tokens * 2 heads * 3 * 12 * 2 = 1440 bytes, region 1 at 1536 (aligned) */
    assert_int_equal(off[0], 0);
    assert_int_equal(off[1], 1536);
    assert_int_equal(total, 1536 + 720 + (256 - (1536 + 720) % 256));
    assert_int_equal(kvs_slot_layout(w, 0, 10, NULL), 0);

    /* inside region 0: [K l0][K l1][K l2][V l0][V l1][V l2], each [10][2][D] * 2 bytes */
    uint64_t k_block = 10 * 2 * 5 * 2, v_block = 10 * 2 * 7 * 2;
    assert_int_equal(kvs_region_block_offset(&s, 2, 10, 0, 0), 0);
    assert_int_equal(kvs_region_block_offset(&s, 2, 10, 2, 0), 2 * k_block);
    assert_int_equal(kvs_region_block_offset(&s, 2, 10, 0, 1), 3 * k_block);
    assert_int_equal(kvs_region_block_offset(&s, 2, 10, 2, 1), 3 * k_block + 2 * v_block);
    /* the blocks exactly fill the region */
    assert_int_equal(kvs_region_block_offset(&s, 2, 10, 2, 1) + v_block, 10 * w[0].bytes_per_token);

    s = mla();
    assert_int_equal(writers_of(&s, 2, 2, 0, 0, w), 1);
    assert_int_equal(kvs_region_block_offset(&s, 1, 10, 2, 0), 2 * 10 * 9);
    assert_int_equal(kvs_region_block_offset(&s, 1, 10, 2, 0) + 10 * 9, 10 * w[0].bytes_per_token);
    assert_int_equal(kvs_slot_layout(w, 1, 10, NULL), 512);
}

/* Runs the built tool (KVS_TOOL) and captures its stdout; returns the exit code. */
/* The stage split rule (protocol.md §2, "Pipeline stages"): vectors, then every L and PP. */
static void test_pp_stage_splits(void **state)
{
    (void) state;
    static const struct {
        uint32_t layers, pp, first[5], count[5];
    } v[] = {
        {7, 3, {0, 3, 5}, {3, 2, 2}},
        {10, 4, {0, 3, 6, 8}, {3, 3, 2, 2}},
        {32, 4, {0, 8, 16, 24}, {8, 8, 8, 8}},
        {5, 5, {0, 1, 2, 3, 4}, {1, 1, 1, 1, 1}},
        {1, 1, {0}, {1}},
        {30, 1, {0}, {30}},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        for (uint32_t st = 0; st < v[i].pp; st++) {
            uint32_t first = 99, count = 99;
            kvs_pp_stage(v[i].layers, v[i].pp, st, &first, &count);
            if (first != v[i].first[st] || count != v[i].count[st])
                fail_msg("L %u PP %u stage %u: layers [%u, +%u), want [%u, +%u)", v[i].layers,
                         v[i].pp, st, first, count, v[i].first[st], v[i].count[st]);
        }
    }
    for (uint32_t layers = 1; layers <= 80; layers++) {
        for (uint32_t pp = 1; pp <= layers && pp <= KVS_MAX_TP; pp++) {
            uint32_t at = 0, prev = UINT32_MAX;
            for (uint32_t st = 0; st < pp; st++) {
                uint32_t first, count;
                kvs_pp_stage(layers, pp, st, &first, &count);
                assert_int_equal(first, at);              /* contiguous, in order */
                assert_true(count >= 1 && count <= prev); /* earlier stages never hold fewer */
                assert_true(count == layers / pp || count == layers / pp + 1);
                kvs_kv_shape_t sh = mha(4);
                sh.layers = layers;
                assert_int_equal(kvs_pp_stage_shape(&sh, pp, st).layers, count);
                prev = count;
                at += count;
            }
            assert_int_equal(at, layers);
        }
    }
}

/* The whole-deployment plan over random PP x TP layouts: every (layer, head) a decode rank
 * needs is written exactly once, by a rank of the stage holding that layer that holds that
 * head; destinations and peers are the converse; with one stage it is the TP plan. */
static void test_geo_plan_property(void **state)
{
    (void) state;
    static const uint32_t tps[] = {1, 2, 3, 4, 6, 8};
    static const uint32_t heads[] = {1, 2, 3, 4, 6, 8, 12};
    kvs_rng_t rng;
    const uint64_t seed = kvs_test_seed(0x9e0b1a);
    kvs_rng_seed(&rng, seed);
    for (int it = 0; it < 3000; it++) {
        kvs_pd_geometry_t g = {.page_size = 4, .chunk_tokens = 8};
        g.shape = kvs_rng_chance(&rng, 1, 5) ? mla() : mha(heads[kvs_rng_below(&rng, 7)]);
        g.shape.layers = (uint32_t) kvs_rng_range(&rng, 1, 12);
        const uint32_t h = g.shape.kv_heads;
        do g.prefill_tp = tps[kvs_rng_below(&rng, 6)];
        while (g.shape.attn == KVS_ATTN_MHA && h % g.prefill_tp && g.prefill_tp % h);
        do g.decode_tp = tps[kvs_rng_below(&rng, 6)];
        while (g.shape.attn == KVS_ATTN_MHA && h % g.decode_tp && g.decode_tp % h);
        g.prefill_pp = (uint32_t) kvs_rng_range(&rng, 0, g.shape.layers < 8 ? g.shape.layers : 8);
        const uint32_t pp = kvs_pd_geometry_pp(&g), tp = g.prefill_tp;
        const uint64_t room = kvs_rng_next(&rng);
        const uint32_t hd = kvs_tp_heads_per_rank(&g.shape, g.decode_tp);
        uint8_t written[12][64];
        kvs_writer_t w[KVS_MAX_TP][KVS_MAX_WRITERS];
        uint32_t nw[KVS_MAX_TP];
        for (uint32_t d = 0; d < g.decode_tp; d++) {
            assert_int_equal(kvs_plan_geo_writers(&g, d, room, w[d], &nw[d]), KVS_OK);
            kvs_writer_t tpw[KVS_MAX_WRITERS];
            uint32_t ntp = 0;
            assert_int_equal(kvs_plan_writers(&g.shape, tp, g.decode_tp, d, room, tpw, &ntp),
                             KVS_OK);
            assert_int_equal(nw[d], ntp * pp);
            memset(written, 0, sizeof(written));
            const uint32_t dfirst = kvs_tp_first_head(&g.shape, g.decode_tp, d);
            for (uint32_t i = 0; i < nw[d]; i++) {
                const kvs_writer_t *x = &w[d][i];
                uint32_t first, layers;
                kvs_pp_stage(g.shape.layers, pp, x->stage, &first, &layers);
                assert_int_equal(x->stage, i / ntp); /* stage-major order */
                assert_int_equal(x->prefill_rank / tp, x->stage);
                assert_int_equal(x->first_layer, first);
                assert_int_equal(x->layers, layers);
                /* the same heads from the same TP rank as the TP plan's writer */
                const kvs_writer_t *t = &tpw[i % ntp];
                assert_int_equal(x->prefill_rank % tp, t->prefill_rank);
                assert_int_equal(x->src_head, t->src_head);
                assert_int_equal(x->dst_head, t->dst_head);
                assert_int_equal(x->heads, t->heads);
                uint64_t dims = (uint64_t) g.shape.head_dim_k + g.shape.head_dim_v;
                assert_int_equal(x->bytes_per_token,
                                 (uint64_t) layers * x->heads * dims * g.shape.elem_bytes);
                for (uint32_t l = first; l < first + layers; l++)
                    for (uint32_t j = 0; j < x->heads; j++) {
                        uint32_t gh = dfirst + x->dst_head + j;
                        assert_true(g.shape.attn == KVS_ATTN_MLA ||
                                    holds(&g.shape, tp, x->prefill_rank % tp, gh));
                        written[l][x->dst_head + j]++;
                    }
            }
            for (uint32_t l = 0; l < g.shape.layers; l++)
                for (uint32_t j = 0; j < hd; j++)
                    if (written[l][j] != 1)
                        fail_msg("seed 0x%llx: decode %u layer %u head %u written %u times",
                                 (unsigned long long) seed, d, l, j, written[l][j]);
            /* peers: the TP peers in every stage, the writers among them */
            uint32_t peers[KVS_MAX_TP], np = 0, tpp[KVS_MAX_TP], ntpp = 0;
            assert_int_equal(kvs_plan_geo_peers(&g, d, peers, &np), KVS_OK);
            kvs_plan_peers(&g.shape, tp, g.decode_tp, d, tpp, &ntpp);
            assert_int_equal(np, ntpp * pp);
            for (uint32_t i = 0; i < np; i++)
                assert_int_equal(peers[i], (i / ntpp) * tp + tpp[i % ntpp]);
            for (uint32_t i = 0; i < nw[d]; i++) {
                int found = 0;
                for (uint32_t k = 0; k < np; k++) found |= peers[k] == w[d][i].prefill_rank;
                assert_true(found);
            }
        }
        /* destinations are the converse of the writers; decode peers of peers */
        for (uint32_t p = 0; p < pp * tp; p++) {
            kvs_dest_t dests[KVS_MAX_TP];
            uint32_t n = 0, expect = 0;
            assert_int_equal(kvs_plan_geo_destinations(&g, p, room, dests, &n), KVS_OK);
            for (uint32_t d = 0; d < g.decode_tp; d++)
                for (uint32_t i = 0; i < nw[d]; i++) expect += w[d][i].prefill_rank == p;
            assert_int_equal(n, expect);
            for (uint32_t i = 0; i < n; i++) {
                const kvs_dest_t *x = &dests[i];
                assert_true(x->writer < nw[x->decode_rank]);
                const kvs_writer_t *y = &w[x->decode_rank][x->writer];
                assert_true(x->w.prefill_rank == y->prefill_rank && x->w.stage == y->stage &&
                            x->w.first_layer == y->first_layer && x->w.layers == y->layers &&
                            x->w.src_head == y->src_head && x->w.dst_head == y->dst_head &&
                            x->w.heads == y->heads && x->w.bytes_per_token == y->bytes_per_token);
            }
            uint32_t dp[KVS_MAX_TP], ndp = 0;
            assert_int_equal(kvs_plan_geo_decode_peers(&g, p, dp, &ndp), KVS_OK);
            for (uint32_t d = 0; d < g.decode_tp; d++) {
                uint32_t peers[KVS_MAX_TP], np = 0;
                kvs_plan_geo_peers(&g, d, peers, &np);
                int in_peers = 0, in_dp = 0;
                for (uint32_t k = 0; k < np; k++) in_peers |= peers[k] == p;
                for (uint32_t k = 0; k < ndp; k++) in_dp |= dp[k] == d;
                assert_int_equal(in_peers, in_dp);
            }
        }
    }
    /* out of range: a prefill rank beyond PP x TP, more stages than layers */
    kvs_pd_geometry_t g = {.shape = mha(4),
                           .prefill_tp = 2,
                           .decode_tp = 2,
                           .page_size = 4,
                           .chunk_tokens = 8,
                           .prefill_pp = 2};
    g.shape.layers = 3;
    kvs_dest_t dests[KVS_MAX_TP];
    kvs_writer_t wr[KVS_MAX_WRITERS];
    uint32_t n;
    int errors = 0;
    kvs_log_set_sink(discard_sink, &errors);
    assert_int_equal(kvs_plan_geo_destinations(&g, 4, 0, dests, &n), KVS_ERR_INVALID);
    g.prefill_pp = 4;
    assert_int_equal(kvs_plan_geo_writers(&g, 0, 0, wr, &n), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(errors, 2);
}

static int run_tool(const char *args, char *out, size_t cap)
{
    const char *tool = getenv("KVS_TOOL");
    if (access(tool, X_OK) != 0) fail_msg("KVS_TOOL=%s is not an executable (build kvstage)", tool);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "\"%s\" %s 2>/dev/null", tool, args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t len = fread(out, 1, cap - 1, f);
    out[len] = '\0';
    int st = pclose(f);
    assert_true(WIFEXITED(st));
    return WEXITSTATUS(st);
}

static void expect_contains(const char *out, const char *needle)
{
    if (strstr(out, needle) == NULL) fail_msg("output lacks '%s':\n%s", needle, out);
}

static void test_tool_plan(void **state)
{
    (void) state;
    if (getenv("KVS_TOOL") == NULL) skip();
    static char out[1 << 16];

    /* defaults: TP4 -> TP2, 8 heads, 32 layers, page 16, chunk 256: 4 writers in all,
     * 16 pages x 32 layers x 2 x 4 = 4096 per-page writes */
    assert_int_equal(run_tool("plan --json", out, sizeof(out)), 0);
    expect_contains(out, "\"bulk_writes_per_chunk\":4,");
    expect_contains(out, "\"per_page_writes_per_chunk\":4096,");
    expect_contains(out, "\"grid_tokens\":256,");
    expect_contains(out, "\"pages_per_slot\":16,");
    /* 2 heads x 32 layers x 256 dims x 2 bytes x 256 tokens per region, two regions */
    expect_contains(out, "\"slot_bytes\":16777216");

    /* prefill replicas: 4 heads over TP8 -> decode TP1 ships 4 writes, not 8 */
    assert_int_equal(run_tool("plan --json --prefill-tp 8 --decode-tp 1 --kv-heads 4 --room 1", out,
                              sizeof(out)),
                     0);
    expect_contains(out, "\"bulk_writes_per_chunk\":4,");
    expect_contains(out, "\"destinations\":[]");

    assert_int_equal(run_tool("plan --prefill-tp 8 --decode-tp 1 --kv-heads 4", out, sizeof(out)),
                     0);
    expect_contains(out, "none (replica not chosen; reports status only)");

    assert_int_equal(run_tool("plan --mla --prefill-tp 4 --decode-tp 2 --json", out, sizeof(out)),
                     0);
    expect_contains(out, "\"bulk_writes_per_chunk\":2,");
    expect_contains(out, "\"per_page_writes_per_chunk\":1024,");

    /* invalid layouts and flags are usage errors */
    assert_int_equal(run_tool("plan --kv-heads 3 --decode-tp 2", out, sizeof(out)), 2);
    assert_int_equal(run_tool("plan --page-size 0", out, sizeof(out)), 2);
    assert_int_equal(run_tool("plan --dtype-bytes 3", out, sizeof(out)), 2);
    assert_int_equal(run_tool("plan --prefill-tp 65", out, sizeof(out)), 2);
    assert_int_equal(run_tool("plan --no-such-flag", out, sizeof(out)), 2);
    /* pipeline stages: the same layers in all, over twice the writers; a stage's writer its
     * layers only */
    assert_int_equal(run_tool("plan --json --prefill-pp 2", out, sizeof(out)), 0);
    expect_contains(out, "\"prefill_pp\":2,");
    expect_contains(out, "\"bulk_writes_per_chunk\":8,");
    expect_contains(out, "\"per_page_writes_per_chunk\":4096,");
    expect_contains(out, "\"stage\":1,\"first_layer\":16,\"layers\":16,");
    expect_contains(out, "\"slot_bytes\":16777216");
    assert_int_equal(run_tool("plan --prefill-pp 3 --layers 7", out, sizeof(out)), 0);
    expect_contains(out, "prefill rank 11 (stage 2, TP rank 3: layers 5-6, heads 6-7)");
    assert_int_equal(run_tool("plan --prefill-pp 9 --layers 8", out, sizeof(out)), 2);
    assert_int_equal(run_tool("plan --prefill-pp 32", out, sizeof(out)), 2);
    assert_int_equal(run_tool("plan --help", out, sizeof(out)), 0);
    expect_contains(out, "--prefill-tp");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_examples),   cmocka_unit_test(test_plan_rejects_invalid),
        cmocka_unit_test(test_plan_exhaustive), cmocka_unit_test(test_slot_layout_and_blocks),
        cmocka_unit_test(test_pp_stage_splits), cmocka_unit_test(test_geo_plan_property),
        cmocka_unit_test(test_tool_plan),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
