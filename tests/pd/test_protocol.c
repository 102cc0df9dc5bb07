/* Protocol tests driven directly through the sender/receiver API over the inproc transport:
 * every TP pair shape, pipeline stages and page sizes per side, decode and prefill prefixes,
 * chunked advance, hostile schedules, and the failure paths of protocol.md §3 and §4 (misaligned
 * prefix, oversize slot, abort with quarantine, timeouts), each checked byte for byte and for
 * leaks. */
#include "pd/pd_harness.h"
#include "pd/pd_internal.h"

#include "kvstage/log.h"

typedef struct {
    uint32_t ptp, dtp, heads;
    int mla;
} pair_t;

static void set_geo(kvs_pd_geometry_t *g, const pair_t *p)
{
    h_default_geo(g, p->ptp, p->dtp, p->heads);
    if (p->mla) {
        g->shape.attn = KVS_ATTN_MLA;
        g->shape.kv_heads = 1;
        g->shape.head_dim_k = 12;
        g->shape.head_dim_v = 0;
    }
}

static const pair_t pairs[] = {
    {1, 1, 2, 0}, {4, 2, 8, 0}, {2, 4, 8, 0}, {3, 2, 6, 0}, {8, 1, 4, 0}, {1, 8, 4, 0},
    {8, 2, 4, 0}, {2, 8, 4, 0}, {2, 1, 1, 1}, {1, 2, 1, 1}, {4, 4, 8, 0}, {6, 4, 12, 0},
};

/* Every TP pair, with decode and prefill prefixes of several sizes, reliable network. */
static void test_tp_pairs_exact(void **state)
{
    (void) state;
    for (size_t p = 0; p < sizeof(pairs) / sizeof(pairs[0]); p++) {
        kvs_pd_geometry_t g;
        set_geo(&g, &pairs[p]);
        h_t h;
        h_setup(&h, &g, NULL, 1 << 16, 256);
        h_run_room_t rooms[5];
        memset(rooms, 0, sizeof(rooms));
        /* plain; decode prefix; prefill hit over several slots; full decode hit; tiny prompt */
        h_room_init(&h, &rooms[0].room, 100 + p, 70, 0);
        h_room_init(&h, &rooms[1].room, 200 + p, 61, 8);
        h_room_init(&h, &rooms[2].room, 300 + p, 90, 4);
        rooms[2].prefill_hit = 52;
        h_room_init(&h, &rooms[3].room, 400 + p, 40, 40);
        rooms[3].prefill_hit = 40;
        h_room_init(&h, &rooms[4].room, 500 + p, 3, 0);
        h_run_rooms(&h, rooms, 5, 20000);
        h_assert_all_succeeded(rooms, 5);
        h_assert_idle(&h);
        h_teardown(&h);
    }
    kvs_assert_no_leaks();
}

/* Layouts beyond TP (protocol.md §1 "Slot tokens", §2 "Pipeline stages"): pipeline stages
 * with uneven layer counts, a page size per side (slots starting inside prefill pages, the last
 * one ending inside a decode page) and both at once, with prefixes on either side. */
static void test_layouts_exact(void **state)
{
    (void) state;
    static const struct {
        pair_t pair;
        uint32_t layers, pp, prefill_page, decode_page;
    } layouts[] = {
        {{4, 2, 8, 0}, 3, 2, 0, 4},  {{1, 2, 2, 0}, 5, 3, 0, 4}, {{2, 1, 1, 1}, 2, 2, 0, 4},
        {{3, 2, 6, 0}, 2, 1, 8, 4},  {{2, 4, 8, 0}, 2, 1, 2, 8}, {{2, 2, 4, 0}, 4, 2, 3, 4},
        {{1, 1, 2, 0}, 3, 3, 16, 1}, {{3, 2, 1, 1}, 4, 4, 5, 8},
    };
    for (size_t i = 0; i < sizeof(layouts) / sizeof(layouts[0]); i++) {
        kvs_pd_geometry_t g;
        set_geo(&g, &layouts[i].pair);
        g.shape.layers = layouts[i].layers;
        g.prefill_pp = layouts[i].pp;
        g.prefill_page_size = layouts[i].prefill_page;
        g.page_size = layouts[i].decode_page;
        const uint64_t P = g.page_size;
        h_t h;
        h_setup(&h, &g, NULL, 1 << 16, 256);
        h_run_room_t rooms[4];
        memset(rooms, 0, sizeof(rooms));
        h_room_init(&h, &rooms[0].room, 100 + i, 70, 0);
        h_room_init(&h, &rooms[1].room, 200 + i, 61, 2 * P);
        h_room_init(&h, &rooms[2].room, 300 + i, 90, P);
        rooms[2].prefill_hit = 52;
        h_room_init(&h, &rooms[3].room, 400 + i, 3, 0);
        h_run_rooms(&h, rooms, 4, 20000);
        h_assert_all_succeeded(rooms, 4);
        h_assert_idle(&h);
        h_teardown(&h);
    }
    kvs_assert_no_leaks();
}

/* Stages send each chunk as soon as their own layers are computed, and a chunk is complete
 * only when every stage's writers arrived: stage 0 finishes the whole prompt while stage 1 has
 * computed nothing, and decode scatters nothing until stage 1 writes too. */
static void test_chunk_waits_for_every_stage(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 1, 1, 2);
    g.shape.layers = 3;
    g.prefill_pp = 2;
    h_t h;
    h_setup(&h, &g, NULL, 1 << 16, 64);
    h_room_t rm;
    h_room_init(&h, &rm, 77, 40, 0);
    assert_int_equal(kvs_receiver_add_room(h.rx[0], rm.id, 0, rm.prompt_len, rm.dpages), KVS_OK);
    for (uint32_t r = 0; r < 2; r++)
        assert_int_equal(kvs_sender_add_room(h.tx[r], rm.id, rm.prompt_len, rm.ptable), KVS_OK);
    const uint32_t token = 1234;
    h_fill(&h, 0, rm.id, rm.ptable, 0, rm.prompt_len);
    assert_int_equal(kvs_sender_finish(h.tx[0], rm.id, &token, 4), KVS_OK);
    for (int i = 0; i < 2000; i++) h_step(&h);
    kvs_pd_metrics_t m;
    kvs_sender_metrics(h.tx[0], &m);
    assert_int_equal(m.bulk_writes, 3); /* stage 0 wrote its layers of all three chunks */
    kvs_sender_metrics(h.tx[1], &m);
    assert_int_equal(m.bulk_writes, 0);
    kvs_receiver_metrics(h.rx[0], &m);
    assert_int_equal(m.chunks, 0); /* no chunk is complete without stage 1 */
    assert_true(h_status(&h, 1, rm.id, NULL) != KVS_ROOM_SUCCESS);
    /* stage 1 computes the first chunk only: that chunk, and no other, completes */
    h_fill(&h, 1, rm.id, rm.ptable, 0, 16);
    assert_int_equal(kvs_sender_advance(h.tx[1], rm.id, 16, 16), KVS_OK);
    for (int i = 0; i < 200; i++) h_step(&h);
    kvs_receiver_metrics(h.rx[0], &m);
    assert_int_equal(m.chunks, 1);
    h_fill(&h, 1, rm.id, rm.ptable, 16, rm.prompt_len);
    assert_int_equal(kvs_sender_finish(h.tx[1], rm.id, &token, 4), KVS_OK);
    for (int i = 0; i < 2000 && !h_concluded(&h, rm.id); i++) h_step(&h);
    assert_int_equal(h_status(&h, 1, rm.id, NULL), KVS_ROOM_SUCCESS);
    assert_int_equal(h_mismatches(&h, 0, rm.id, rm.dpages, 0, rm.prompt_len), 0);
    kvs_receiver_metrics(h.rx[0], &m);
    assert_int_equal(m.chunks, 3);
    h_release(&h, rm.id);
    h_room_free(&h, &rm);
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* Many rooms at once through a small ring while control messages are delayed, reordered,
 * duplicated and dropped and writes land late: every room exact, nothing left behind. */
static void test_hostile_network(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(7);
    uint64_t iters = kvs_test_iters(6);
    for (uint64_t it = 0; it < iters; it++) {
        kvs_rng_t rng;
        kvs_rng_seed(&rng, seed + it);
        const pair_t *pp = &pairs[kvs_rng_below(&rng, sizeof(pairs) / sizeof(pairs[0]))];
        kvs_pd_geometry_t g;
        set_geo(&g, pp);
        kvs_inproc_faults_t f = {.seed = seed + it,
                                 .delay_max_ns = 40 * H_TICK_NS,
                                 .drop_permille = (uint32_t) kvs_rng_below(&rng, 150),
                                 .dup_permille = (uint32_t) kvs_rng_below(&rng, 300),
                                 .write_delay_max_ns = 30 * H_TICK_NS};
        h_t h;
        /* About three full slots of ring: rooms queue behind each other in the FIFO. */
        h_setup(&h, &g, &f, 3 * 16 * 2 * 8 * 12 * 2 + 4096, 1024);
        enum { N = 16 };
        h_run_room_t rooms[N];
        memset(rooms, 0, sizeof(rooms));
        for (size_t i = 0; i < N; i++) {
            uint64_t len = kvs_rng_range(&rng, 1, 120);
            uint64_t base = kvs_rng_below(&rng, len / g.page_size + 1) * g.page_size;
            h_room_init(&h, &rooms[i].room, 1000 * it + i + 1, len, base);
            rooms[i].prefill_hit = kvs_rng_below(&rng, len + 1);
        }
        h_run_rooms(&h, rooms, N, 200000);
        for (size_t i = 0; i < N; i++) {
            if (rooms[i].final_status != KVS_ROOM_SUCCESS || rooms[i].mismatched)
                fail_msg("seed %llu iteration %llu: room %zu %s, %llu bytes wrong",
                         (unsigned long long) seed, (unsigned long long) it, i,
                         kvs_room_status_str(rooms[i].final_status),
                         (unsigned long long) rooms[i].mismatched);
        }
        h_assert_idle(&h);
        kvs_pd_metrics_t m;
        kvs_receiver_metrics(h.rx[0], &m);
        assert_true(m.ring_high_water <= m.ring_capacity);
        h_teardown(&h);
    }
    kvs_assert_no_leaks();
}

/* Every message duplicated: duplicate arrivals are ignored and counted, never scattered
 * twice. */
static void test_duplicates_ignored(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 2, 1, 4);
    kvs_inproc_faults_t f = {.seed = 3, .delay_max_ns = 20 * H_TICK_NS, .dup_permille = 1000};
    h_t h;
    h_setup(&h, &g, &f, 1 << 16, 256);
    h_run_room_t rooms[3];
    memset(rooms, 0, sizeof(rooms));
    for (int i = 0; i < 3; i++) h_room_init(&h, &rooms[i].room, 10 + i, 50 + 10 * i, 0);
    h_run_rooms(&h, rooms, 3, 50000);
    h_assert_all_succeeded(rooms, 3);
    kvs_pd_metrics_t m;
    kvs_receiver_metrics(h.rx[0], &m);
    assert_true(m.ignored > 0);
    assert_int_equal(m.chunks, 4 + 4 + 5); /* each chunk scattered exactly once */
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* Half the messages lost: retries recover every room. */
static void test_drops_recovered_by_retry(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 4, 2, 8);
    kvs_inproc_faults_t f = {.seed = 11, .delay_max_ns = 5 * H_TICK_NS, .drop_permille = 500};
    h_t h;
    h_setup(&h, &g, &f, 1 << 16, 256);
    h_run_room_t rooms[4];
    memset(rooms, 0, sizeof(rooms));
    for (int i = 0; i < 4; i++) h_room_init(&h, &rooms[i].room, 20 + i, 33 + 17 * i, 4 * i);
    h_run_rooms(&h, rooms, 4, 200000);
    h_assert_all_succeeded(rooms, 4);
    uint64_t retries = 0;
    kvs_pd_metrics_t m;
    for (uint32_t r = 0; r < 4; r++) {
        kvs_sender_metrics(h.tx[r], &m);
        retries += m.retries;
    }
    kvs_receiver_metrics(h.rx[0], &m);
    retries += m.retries;
    assert_true(retries > 0);
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* A misaligned decode prefix fails that room only, on both sides; the next room succeeds. */
static void test_misaligned_prefix_fails_room_only(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 2, 2, 4);
    h_t h;
    h_setup(&h, &g, NULL, 1 << 16, 256);
    h_run_room_t rooms[2];
    memset(rooms, 0, sizeof(rooms));
    h_room_init(&h, &rooms[0].room, 1, 40, 4);
    rooms[0].room.base = 6; /* not a multiple of the page size 4 */
    h_room_init(&h, &rooms[1].room, 2, 40, 4);
    h_run_rooms(&h, rooms, 2, 20000);
    assert_true(rooms[0].released);
    assert_int_equal(rooms[0].final_status, KVS_ROOM_FAILED);
    assert_int_equal(rooms[1].final_status, KVS_ROOM_SUCCESS);
    assert_int_equal(rooms[1].mismatched, 0);
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* A slot larger than the whole ring fails the room at once, not after a timeout. */
static void test_slot_larger_than_ring_fails_fast(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 1, 1, 2);
    h_t h;
    h_setup(&h, &g, NULL, 512, 64); /* a full slot is 16 tokens * 2 layers * 2 heads * 24 B */
    h_run_room_t rooms[1];
    memset(rooms, 0, sizeof(rooms));
    h_room_init(&h, &rooms[0].room, 5, 40, 0);
    uint64_t steps = h_run_rooms(&h, rooms, 1, 20000);
    assert_true(rooms[0].released);
    assert_int_equal(rooms[0].final_status, KVS_ROOM_FAILED);
    assert_true(steps < 1000); /* far below every timeout */
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* Prefill stalls forever: decode's waiting timeout fails the room, prefill hears of it, and
 * everything is released. */
static void test_waiting_timeout(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 2, 1, 4);
    h_t h;
    h_setup(&h, &g, NULL, 1 << 16, 256);
    h_run_room_t rooms[2];
    memset(rooms, 0, sizeof(rooms));
    h_room_init(&h, &rooms[0].room, 1, 80, 0);
    rooms[0].stall = 1;
    rooms[0].prefill_hit = 20; /* one chunk goes, the rest never comes */
    h_room_init(&h, &rooms[1].room, 2, 80, 0);
    uint64_t steps = h_run_rooms(&h, rooms, 2, 200000);
    assert_int_equal(rooms[0].final_status, KVS_ROOM_FAILED);
    assert_int_equal(rooms[1].final_status, KVS_ROOM_SUCCESS);
    assert_true(steps * H_TICK_NS >= h.timeouts.waiting_timeout_ns);
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* Decode aborts mid-transfer while writes land late: the room's slots stay quarantined until
 * every prefill rank confirms no write is in flight. */
static void test_abort_quarantines_until_ack(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 2, 1, 4);
    kvs_inproc_faults_t f = {
        .seed = 5, .delay_max_ns = 10 * H_TICK_NS, .write_delay_max_ns = 400 * H_TICK_NS};
    h_t h;
    h_setup(&h, &g, &f, 1 << 16, 256);
    h_room_t room;
    h_room_init(&h, &room, 9, 64, 0);
    assert_int_equal(kvs_receiver_add_room(h.rx[0], 9, 0, 64, room.dpages), KVS_OK);
    for (uint32_t r = 0; r < 2; r++) {
        assert_int_equal(kvs_sender_add_room(h.tx[r], 9, 64, room.ptable), KVS_OK);
        h_fill(&h, r, 9, room.ptable, 0, 64);
        assert_int_equal(kvs_sender_advance(h.tx[r], 9, 64, 64), KVS_OK);
    }
    /* Run until at least one write is in flight, then abort. */
    kvs_inproc_stats_t ns;
    int steps = 0;
    do {
        h_step(&h);
        kvs_inproc_net_stats(h.net, &ns);
    } while (ns.writes_in_flight == 0 && ++steps < 5000);
    assert_true(ns.writes_in_flight > 0);
    /* The senders count a write until they see it complete (a rank loop polls while any is) */
    assert_true(kvs_sender_copies_in_flight(h.tx[0]) + kvs_sender_copies_in_flight(h.tx[1]) >=
                ns.writes_in_flight);
    assert_int_equal(kvs_receiver_abort(h.rx[0], 9), KVS_OK);
    int q;
    assert_int_equal(h_status(&h, 1, 9, &q), KVS_ROOM_FAILED);
    assert_false(q); /* a write is still in flight: quarantined */
    assert_int_equal(kvs_receiver_release(h.rx[0], 9), KVS_ERR_STATE);
    for (steps = 0; steps < 20000 && !h_concluded(&h, 9); steps++) {
        kvs_inproc_net_stats(h.net, &ns);
        int dq;
        h_status(&h, 1, 9, &dq);
        /* Quiescent decode implies no write can still land. */
        if (dq) assert_int_equal(ns.writes_in_flight, 0);
        assert_true(kvs_sender_copies_in_flight(h.tx[0]) + kvs_sender_copies_in_flight(h.tx[1]) >=
                    ns.writes_in_flight);
        h_step(&h);
    }
    assert_true(h_concluded(&h, 9));
    assert_int_equal(h_status(&h, 0, 9, NULL), KVS_ROOM_FAILED);
    kvs_room_info_t info;
    assert_int_equal(kvs_receiver_poll(h.rx[0], 9, &info), KVS_OK);
    assert_int_equal(info.reason, KVS_ERR_ABORTED);
    h_release(&h, 9);
    assert_int_equal(kvs_receiver_release(h.rx[0], 9), KVS_ERR_NOT_FOUND); /* idempotent */
    h_room_free(&h, &room);
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* The prefill engine aborts: decode learns through STATUS Failed. */
static void test_prefill_abort(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 1, 2, 4);
    h_t h;
    h_setup(&h, &g, NULL, 1 << 16, 256);
    h_room_t room;
    h_room_init(&h, &room, 4, 64, 0);
    for (uint32_t r = 0; r < 2; r++)
        assert_int_equal(kvs_receiver_add_room(h.rx[r], 4, 0, 64, room.dpages), KVS_OK);
    assert_int_equal(kvs_sender_add_room(h.tx[0], 4, 64, room.ptable), KVS_OK);
    h_fill(&h, 0, 4, room.ptable, 0, 16);
    assert_int_equal(kvs_sender_advance(h.tx[0], 4, 16, 32), KVS_OK);
    for (int i = 0; i < 50; i++) h_step(&h);
    assert_int_equal(kvs_sender_abort(h.tx[0], 4), KVS_OK);
    for (int i = 0; i < 5000 && !h_concluded(&h, 4); i++) h_step(&h);
    assert_true(h_concluded(&h, 4));
    assert_int_equal(h_status(&h, 1, 4, NULL), KVS_ROOM_FAILED);
    h_release(&h, 4);
    h_room_free(&h, &room);
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* kvs_sender_heard: 0 until a decode rank's ROOM_META (or ABORT) of a room reaches the prefill
 * rank, 1 from then on, whether the room was added before (room 6) or after (room 4); the room
 * then runs as usual. A decode rank's ABORT of a room never added counts too. */
static void test_sender_heard(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 1, 2, 4);
    h_t h;
    h_setup(&h, &g, NULL, 1 << 16, 256);
    h_room_t room, other;
    h_room_init(&h, &room, 4, 64, 0);
    h_room_init(&h, &other, 5, 16, 0);
    assert_false(kvs_sender_heard(h.tx[0], 4));
    for (uint32_t r = 0; r < 2; r++)
        assert_int_equal(kvs_receiver_add_room(h.rx[r], 4, 0, 64, room.dpages), KVS_OK);
    assert_int_equal(kvs_receiver_add_room(h.rx[0], 5, 0, 16, other.dpages), KVS_OK);
    assert_int_equal(kvs_receiver_abort(h.rx[0], 5), KVS_OK);
    for (int i = 0; i < 200 && !(kvs_sender_heard(h.tx[0], 4) && kvs_sender_heard(h.tx[0], 5)); i++)
        h_step(&h);
    assert_true(kvs_sender_heard(h.tx[0], 4));
    assert_true(kvs_sender_heard(h.tx[0], 5));
    assert_false(kvs_sender_heard(h.tx[0], 6));
    assert_int_equal(kvs_sender_add_room(h.tx[0], 4, 64, room.ptable), KVS_OK);
    assert_true(kvs_sender_heard(h.tx[0], 4)); /* its stashed metadata came with it */
    h_room_t late;
    h_room_init(&h, &late, 6, 16, 0);
    assert_int_equal(kvs_sender_add_room(h.tx[0], 6, 16, late.ptable), KVS_OK);
    for (int i = 0; i < 20; i++) h_step(&h);
    assert_false(kvs_sender_heard(h.tx[0], 6)); /* added, decode silent */
    for (uint32_t r = 0; r < 2; r++)
        assert_int_equal(kvs_receiver_add_room(h.rx[r], 6, 0, 16, late.dpages), KVS_OK);
    for (int i = 0; i < 200 && !kvs_sender_heard(h.tx[0], 6); i++) h_step(&h);
    assert_true(kvs_sender_heard(h.tx[0], 6));
    h_fill(&h, 0, 4, room.ptable, 0, 64);
    assert_int_equal(kvs_sender_advance(h.tx[0], 4, 64, 64), KVS_OK);
    assert_int_equal(kvs_sender_finish(h.tx[0], 4, NULL, 0), KVS_OK);
    for (int i = 0; i < 20000 && !h_concluded(&h, 4); i++) h_step(&h);
    assert_int_equal(h_status(&h, 1, 4, NULL), KVS_ROOM_SUCCESS);
    for (uint32_t r = 0; r < 2; r++)
        assert_int_equal(h_mismatches(&h, r, 4, room.dpages, 0, 64), 0);
    h_release(&h, 4);
    h_fill(&h, 0, 6, late.ptable, 0, 16);
    assert_int_equal(kvs_sender_advance(h.tx[0], 6, 16, 16), KVS_OK);
    assert_int_equal(kvs_sender_finish(h.tx[0], 6, NULL, 0), KVS_OK);
    for (int i = 0; i < 20000 && !h_concluded(&h, 6); i++) h_step(&h);
    assert_int_equal(h_status(&h, 1, 6, NULL), KVS_ROOM_SUCCESS);
    assert_true(kvs_sender_heard(h.tx[0], 6));
    h_release(&h, 6);
    kvs_room_info_t info = {0};
    for (int i = 0; i < 20000 && !info.quiescent; i++) {
        h_step(&h);
        assert_int_equal(kvs_receiver_poll(h.rx[0], 5, &info), KVS_OK);
    }
    assert_true(info.quiescent);
    assert_int_equal(info.status, KVS_ROOM_FAILED);
    assert_int_equal(kvs_receiver_release(h.rx[0], 5), KVS_OK);
    h_room_free(&h, &room);
    h_room_free(&h, &other);
    h_room_free(&h, &late);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* Room 7 of 4 chunks (64 tokens) from two prefill ranks to one decode rank, the whole prompt at
 * rest from the start; finished (with a 4-byte final token) now, or later by finish_room. */
static const uint32_t final_token = 1234;

static void finish_room(h_t *h)
{
    for (uint32_t r = 0; r < 2; r++)
        assert_int_equal(kvs_sender_finish(h->tx[r], 7, &final_token, 4), KVS_OK);
}

static void start_room_at_rest(h_t *h, h_room_t *room, const kvs_inproc_faults_t *f, int finish)
{
    kvs_pd_geometry_t g;
    h_default_geo(&g, 2, 1, 4);
    h_setup(h, &g, f, 1 << 16, 256);
    h_room_init(h, room, 7, 64, 0);
    assert_int_equal(kvs_receiver_add_room(h->rx[0], 7, 0, 64, room->dpages), KVS_OK);
    for (uint32_t r = 0; r < 2; r++) {
        assert_int_equal(kvs_sender_add_room(h->tx[r], 7, 64, room->ptable), KVS_OK);
        h_fill(h, r, 7, room->ptable, 0, 64);
        assert_int_equal(kvs_sender_advance(h->tx[r], 7, 64, 64), KVS_OK);
    }
    if (finish) finish_room(h);
}

/* Steps room 7 to its conclusion on both sides, checks it succeeded exact with its final token
 * and releases it; the harness is left idle. */
static void conclude_room_at_rest(h_t *h, h_room_t *room)
{
    for (uint64_t i = 1; i < 20000 && !h_concluded(h, 7); i++) h_step(h);
    assert_true(h_concluded(h, 7));
    assert_int_equal(h_status(h, 0, 7, NULL), KVS_ROOM_SUCCESS);
    assert_int_equal(h_mismatches(h, 0, 7, room->dpages, 0, 64), 0);
    kvs_room_info_t info;
    assert_int_equal(kvs_receiver_poll(h->rx[0], 7, &info), KVS_OK);
    assert_int_equal(info.final_len, 4);
    assert_memory_equal(info.final, &final_token, 4);
    h_release(h, 7);
    h_room_free(h, room);
    h_assert_idle(h);
}

/* The room at rest, losing the drop_nth-th ACK (0: none). Returns the step at which decode
 * reached Success; *acks_p: the ACKs sent in all. The room then concludes on both sides,
 * exact. */
static uint64_t run_losing_ack(uint64_t drop_nth, uint64_t *acks_p)
{
    kvs_inproc_faults_t f = {.seed = 3, .drop_type = KVS_MSG_ACK, .drop_nth = drop_nth};
    h_t h;
    h_room_t room;
    start_room_at_rest(&h, &room, &f, 1);
    uint64_t at = 0;
    for (uint64_t i = 1; i < 20000 && at == 0; i++) {
        h_step(&h);
        if (h_status(&h, 1, 7, NULL) == KVS_ROOM_SUCCESS) at = i;
    }
    conclude_room_at_rest(&h, &room);
    kvs_inproc_stats_t ns;
    kvs_inproc_net_stats(h.net, &ns);
    if (drop_nth != 0) assert_int_equal(ns.dropped, 1);
    *acks_p = ns.sent_by_type[KVS_MSG_ACK];
    h_teardown(&h);
    return at;
}

/* A decode rank that shares the prefill rank's GPU from another process gets the room's
 * CHUNK_READYs only once the whole prompt is computed (sender.c held(): its scatters would take
 * the GPU from prefill's passes); slots are granted and written meanwhile, and the room then
 * succeeds exact. Other decode ranks get each chunk's CHUNK_READY as soon as it is written. */
static void test_ready_held_while_gpu_shared(void **state)
{
    (void) state;
    for (int shared = 0; shared <= 1; shared++) {
        h_t h;
        h_room_t room;
        start_room_at_rest(&h, &room, NULL, 0);
        kvs_inproc_net_set_shared_device(h.net, shared);
        for (int i = 0; i < 300; i++) h_step(&h); /* six retry timeouts */
        kvs_inproc_stats_t ns;
        kvs_inproc_net_stats(h.net, &ns);
        kvs_pd_metrics_t m;
        kvs_receiver_metrics(h.rx[0], &m);
        if (shared) {
            assert_int_equal(ns.sent_by_type[KVS_MSG_CHUNK_READY], 0);
            assert_int_equal(ns.sent_by_type[KVS_MSG_STAGING_GRANT] > 0, 1); /* slots granted */
            assert_int_equal(m.live_slots > 0, 1);                           /* and held */
        } else {
            assert_int_equal(ns.sent_by_type[KVS_MSG_CHUNK_READY] >= 8, 1); /* 4 chunks x 2 */
        }
        assert_int_equal(ns.sent_by_type[KVS_MSG_STATUS], 0);
        assert_int_not_equal(h_status(&h, 1, 7, NULL), KVS_ROOM_SUCCESS);
        finish_room(&h);
        conclude_room_at_rest(&h, &room);
        kvs_inproc_net_stats(h.net, &ns);
        assert_int_equal(ns.sent_by_type[KVS_MSG_CHUNK_READY] >= 8, 1);
        h_teardown(&h);
    }
    kvs_assert_no_leaks();
}

/* No lost acknowledgement delays decode's Success (protocol.md §4.7): STATUS Success leaves with
 * the last CHUNK_READY, not after its ACK, and whatever else an ACK confirms a later message
 * confirms too. Losing any one ACK of a clean run, decode succeeds as soon as in the clean run,
 * long before a retry timer (50 steps here) could have run out. */
static void test_lost_ack_never_delays_decode(void **state)
{
    (void) state;
    uint64_t acks = 0, ignored;
    const uint64_t clean = run_losing_ack(0, &acks);
    assert_true(clean > 0 && acks >= 8);
    for (uint64_t n = 1; n <= acks; n++) {
        uint64_t at = run_losing_ack(n, &ignored);
        if (at == 0 || at > clean + 2)
            fail_msg("losing ACK %llu of %llu: decode succeeded at step %llu, %llu without loss",
                     (unsigned long long) n, (unsigned long long) acks, (unsigned long long) at,
                     (unsigned long long) clean);
    }
    kvs_assert_no_leaks();
}

/* KVS_LOG=trace (docs/transport.md): one line per step of a room's handoff, stamped with the
 * monotonic clock in ms. The sink checks the stamps never go back and notes which steps came. */
static const char *const trace_steps[] = {
    "the prompt is computed", "sent STAGING_REQ", "took STAGING_REQ", "sent STAGING_GRANT",
    "took STAGING_GRANT",     "write of",         "write done",       "sent CHUNK_READY",
    "took CHUNK_READY",       "sent STATUS",      "took STATUS",      "scatter started",
    "scatter done",           "room 7: success"};
#define TRACE_STEPS (sizeof(trace_steps) / sizeof(trace_steps[0]))

typedef struct {
    double last_ms;
    uint32_t lines, backwards, seen[TRACE_STEPS];
} trace_capture_t;

static void trace_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                       const char *msg)
{
    (void) file, (void) line;
    trace_capture_t *t = arg;
    double ms = 0;
    if (level != KVS_LOG_TRACE || sscanf(msg, "%lf ms ", &ms) != 1) return;
    t->lines++;
    t->backwards += ms < t->last_ms;
    t->last_ms = ms;
    for (size_t i = 0; i < TRACE_STEPS; i++) t->seen[i] += strstr(msg, trace_steps[i]) != NULL;
}

static void test_trace_timeline(void **state)
{
    (void) state;
    const kvs_log_level_t was = kvs_log_get_level();
    trace_capture_t t = {0};
    kvs_log_set_sink(trace_sink, &t);
    kvs_log_set_level(KVS_LOG_TRACE);
    uint64_t acks;
    (void) run_losing_ack(0, &acks);
    kvs_log_set_level(was);
    kvs_log_set_sink(NULL, NULL);
    assert_true(t.lines > 20);
    assert_int_equal(t.backwards, 0);
    for (size_t i = 0; i < TRACE_STEPS; i++)
        if (t.seen[i] == 0) fail_msg("no trace line of \"%s\"", trace_steps[i]);
    kvs_assert_no_leaks();
}

/* Garbage on the control channel is counted and dropped; the rank keeps working. */
static void test_garbage_rejected(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    h_default_geo(&g, 1, 1, 2);
    h_t h;
    h_setup(&h, &g, NULL, 1 << 16, 64);
    /* Garbage both ways through the ranks' own links. */
    uint8_t junk[64];
    for (size_t i = 0; i < sizeof(junk); i++) junk[i] = (uint8_t) (i * 37);
    h_send_raw(h.plink[0], 0, junk, sizeof(junk));
    h_send_raw(h.dlink[0], 0, junk, 5);
    for (int i = 0; i < 5; i++) h_step(&h);
    kvs_pd_metrics_t m;
    kvs_receiver_metrics(h.rx[0], &m);
    assert_int_equal(m.rejected, 1);
    kvs_sender_metrics(h.tx[0], &m);
    assert_int_equal(m.rejected, 1);
    h_run_room_t rooms[1];
    memset(rooms, 0, sizeof(rooms));
    h_room_init(&h, &rooms[0].room, 1, 30, 0);
    h_run_rooms(&h, rooms, 1, 20000);
    h_assert_all_succeeded(rooms, 1);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

static int quiet_logs(void **state)
{
    (void) state;
    if (getenv("KVS_LOG") == NULL) kvs_log_set_level((kvs_log_level_t) -1);
    return 0;
}

/* Which copy fails in test_failed_copies_fail_their_rooms. */
typedef enum { FAIL_SCATTER, FAIL_GATHER, FAIL_WRITE } fail_kind_t;

/* One run with the nth copy of one kind failing: 1 when it was injected (nth within the run's
 * copies of that kind), 0 when every room succeeded without it. */
static int run_with_failed_copy(uint32_t ptp, uint32_t dtp, fail_kind_t kind, uint64_t nth)
{
    kvs_pd_geometry_t g;
    h_default_geo(&g, ptp, dtp, 4);
    kvs_inproc_faults_t f = {.seed = nth, .delay_max_ns = 3 * H_TICK_NS};
    if (kind == FAIL_WRITE) f.write_fail_nth = nth;
    h_t h;
    h_setup(&h, &g, &f, 1 << 16, 256);
    /* Every gather of prefill rank 0, or every scatter of decode rank 0 */
    kvs_copy_backend_t *b = kind == FAIL_GATHER    ? kvs__sender_copy_backend(h.tx[0])
                            : kind == FAIL_SCATTER ? kvs__receiver_copy_backend(h.rx[0])
                                                   : NULL;
    if (b != NULL) assert_int_equal(kvs__copy_fail_nth(b, nth), KVS_OK);
    h_run_room_t rooms[3];
    memset(rooms, 0, sizeof(rooms));
    for (int i = 0; i < 3; i++) h_room_init(&h, &rooms[i].room, 40 + i, 40 + 9 * i, 0);
    const uint64_t steps = h_run_rooms(&h, rooms, 3, 20000);
    uint32_t failed = 0;
    for (int i = 0; i < 3; i++) {
        if (!rooms[i].released)
            fail_msg("%u->%u, copy kind %d, nth %llu: room %llu not concluded", ptp, dtp, kind,
                     (unsigned long long) nth, (unsigned long long) rooms[i].room.id);
        if (rooms[i].final_status == KVS_ROOM_SUCCESS) {
            assert_int_equal(rooms[i].mismatched, 0);
            continue;
        }
        failed++;
        /* The failure is named: the copy's own error, on the rank whose copy failed */
        if (!(rooms[i].reasons & H_REASON(KVS_ERR_IO)))
            fail_msg("%u->%u, copy kind %d, nth %llu: room %llu failed without KVS_ERR_IO "
                     "(reasons %llx)",
                     ptp, dtp, kind, (unsigned long long) nth,
                     (unsigned long long) rooms[i].room.id, (unsigned long long) rooms[i].reasons);
    }
    /* concluded by the failure itself, far below every timeout (20000 ticks) */
    assert_true(steps < 5000);
    kvs_inproc_stats_t ns;
    kvs_inproc_net_stats(h.net, &ns);
    if (kind == FAIL_WRITE) assert_int_equal(ns.write_failures, failed > 0);
    h_assert_idle(&h);
    h_teardown(&h);
    kvs_assert_no_leaks();
    return failed > 0;
}

/* A scatter, gather or transport write that fails (each copy of each kind in turn, over fan-in
 * and fan-out pairs) fails its room with the copy's error, and only the rooms whose copies
 * failed; every other room succeeds exact, and the slots, pages and buffers of the failed ones
 * come back once quarantine ends: nothing leaks and nothing waits for a timeout. */
static void test_failed_copies_fail_their_rooms(void **state)
{
    (void) state;
    static const uint32_t tp_pairs[][2] = {{2, 1}, {1, 2}, {2, 2}};
    for (size_t p = 0; p < sizeof(tp_pairs) / sizeof(tp_pairs[0]); p++) {
        for (int kind = FAIL_SCATTER; kind <= FAIL_WRITE; kind++) {
            uint64_t nth = 1;
            while (run_with_failed_copy(tp_pairs[p][0], tp_pairs[p][1], (fail_kind_t) kind, nth))
                nth++;
            /* every copy of the runs was failed once: 3 rooms of 3-5 chunks */
            assert_true(nth > 9);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tp_pairs_exact),
        cmocka_unit_test(test_layouts_exact),
        cmocka_unit_test(test_chunk_waits_for_every_stage),
        cmocka_unit_test(test_hostile_network),
        cmocka_unit_test(test_duplicates_ignored),
        cmocka_unit_test(test_drops_recovered_by_retry),
        cmocka_unit_test(test_misaligned_prefix_fails_room_only),
        cmocka_unit_test(test_slot_larger_than_ring_fails_fast),
        cmocka_unit_test(test_waiting_timeout),
        cmocka_unit_test(test_abort_quarantines_until_ack),
        cmocka_unit_test(test_prefill_abort),
        cmocka_unit_test(test_sender_heard),
        cmocka_unit_test(test_lost_ack_never_delays_decode),
        cmocka_unit_test(test_ready_held_while_gpu_shared),
        cmocka_unit_test(test_trace_timeline),
        cmocka_unit_test(test_garbage_rejected),
        cmocka_unit_test(test_failed_copies_fail_their_rooms),
    };
    return cmocka_run_group_tests(tests, quiet_logs, NULL);
}
