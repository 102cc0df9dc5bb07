/* One lost message never wedges anything (protocol.md §5.2): a systematic sweep that, for
 * uneven TP pairs over small rings, first counts the control messages of each type a clean
 * run sends, then reruns the same deterministic schedule once per (type, n), losing exactly
 * the n-th message of that type. Every room must still succeed, byte-exact, and every rank
 * must end idle (no slot, page or room left). */
#include "pd/pd_harness.h"

#include "kvstage/msg.h"

typedef struct {
    uint32_t ptp, dtp, heads;
    uint32_t ring_slots;               /* ring capacity in the largest slot of any decode rank */
    uint32_t rooms;                    /* 4 shaped rooms, then long ones */
    uint32_t pp, prefill_page, layers; /* 0: no stages, the decode page, 2 layers */
} loss_pair_t;

static const loss_pair_t loss_pairs[] = {
    {3, 2, 6, 2, 6, 0, 0, 0}, /* non-integer ratio: decode 0 takes heads from prefill 0 and 1 */
    {2, 4, 4, 1, 6, 0, 0,
     0}, /* fan-out, one slot per ring: every chunk waits for the previous one */
    {8, 2, 8, 2, 6, 0, 0, 0}, /* fan-in */
    {6, 4, 12, 2, 6, 0, 0, 0},
    /* prefill pipeline stages of 2 and 1 layers, prefill pages of 8 against decode pages of 4 */
    {2, 2, 4, 2, 6, 2, 8, 3},
};

#define LOSS_ROOMS_MAX 6

/* The largest slot any decode rank of the pair grants, for the ring's size. */
static uint64_t max_slot_bytes(const kvs_pd_geometry_t *g)
{
    uint64_t max = 0;
    for (uint32_t d = 0; d < g->decode_tp; d++) {
        kvs_writer_t w[KVS_MAX_WRITERS];
        uint32_t n = 0;
        for (uint64_t room = 0; room < 8; room++) { /* replica choice depends on the room */
            assert_int_equal(kvs_plan_geo_writers(g, d, room, w, &n), KVS_OK);
            uint64_t bytes = kvs_slot_layout(w, n, g->chunk_tokens, NULL);
            if (bytes > max) max = bytes;
        }
    }
    return max;
}

/* Runs the fixed schedule once with `faults` (NULL: reliable); fills *stats_p and, in
 * *detected_p, the writer regions the receivers' checksums caught. Returns the number of rooms
 * that did not succeed byte-exact (0 = pass), after checking that everything is idle. */
static uint32_t run_schedule(const loss_pair_t *p, const kvs_inproc_faults_t *faults,
                             kvs_inproc_stats_t *stats_p, uint64_t *detected_p, char *why,
                             size_t why_cap)
{
    kvs_pd_geometry_t g;
    h_default_geo(&g, p->ptp, p->dtp, p->heads);
    g.prefill_pp = p->pp;
    g.prefill_page_size = p->prefill_page;
    if (p->layers) g.shape.layers = p->layers;
    h_t h;
    h_setup(&h, &g, faults, p->ring_slots * max_slot_bytes(&g), 1024);
    h_run_room_t rooms[LOSS_ROOMS_MAX];
    const uint32_t nrooms = p->rooms;
    memset(rooms, 0, sizeof(rooms));
    /* plain (7 chunks); decode prefix; prefill hit sent early; a one-page prompt */
    h_room_init(&h, &rooms[0].room, 11, 100, 0);
    h_room_init(&h, &rooms[1].room, 12, 61, 8);
    h_room_init(&h, &rooms[2].room, 13, 90, 4);
    rooms[2].prefill_hit = 52;
    h_room_init(&h, &rooms[3].room, 14, 3, 0);
    /* more rooms than the rings hold slots, so rooms queue behind each other in every ring */
    for (size_t i = 4; i < nrooms; i++) h_room_init(&h, &rooms[i].room, 11 + i, 120 + 23 * i, 0);
    h_run_rooms(&h, rooms, nrooms, 200000);
    uint32_t bad = 0;
    why[0] = '\0';
    for (size_t i = 0; i < nrooms; i++) {
        const h_run_room_t *rr = &rooms[i];
        if (rr->released && rr->final_status == KVS_ROOM_SUCCESS && rr->mismatched == 0) continue;
        if (bad++ == 0)
            snprintf(why, why_cap, "room %llu: released %d, status %s, %llu bytes differ",
                     (unsigned long long) rr->room.id, rr->released,
                     kvs_room_status_str(rr->final_status), (unsigned long long) rr->mismatched);
    }
    *detected_p = 0;
    for (uint32_t r = 0; r < g.decode_tp; r++) {
        kvs_pd_metrics_t m;
        kvs_receiver_metrics(h.rx[r], &m);
        *detected_p += m.checksum_failures;
    }
    /* Rooms failed by a caught corruption were released (and their pages freed) like any
     * other concluded room, so the ranks must be idle whenever every room concluded. */
    int all_released = 1;
    for (size_t i = 0; i < nrooms; i++) all_released &= rooms[i].released;
    if (all_released) h_assert_idle(&h);
    kvs_inproc_net_stats(h.net, stats_p);
    if (bad != 0) { /* free what the unreleased rooms still hold */
        for (size_t i = 0; i < nrooms; i++) {
            if (rooms[i].released) continue;
            for (uint32_t r = 0; r < h_prefill_ranks(&h); r++)
                kvs_sender_abort(h.tx[r], rooms[i].room.id);
            for (uint32_t r = 0; r < g.decode_tp; r++)
                kvs_receiver_abort(h.rx[r], rooms[i].room.id);
        }
    }
    h_teardown(&h);
    return bad;
}

static void test_every_single_loss(void **state)
{
    (void) state;
    kvs_log_set_level(KVS_LOG_ERROR); /* each loss makes timeouts and retries log warnings */
    uint64_t runs = 0;
    for (size_t pi = 0; pi < sizeof(loss_pairs) / sizeof(loss_pairs[0]); pi++) {
        const loss_pair_t *p = &loss_pairs[pi];
        char why[256];
        kvs_inproc_stats_t clean;
        uint64_t detected = 0;
        if (run_schedule(p, NULL, &clean, &detected, why, sizeof(why)) != 0)
            fail_msg("TP%u -> TP%u, reliable network: %s", p->ptp, p->dtp, why);
        /* Every message type a room's life uses must occur, or the sweep proves nothing. */
        const kvs_msg_type_t needed[] = {KVS_MSG_ROOM_META,     KVS_MSG_STAGING_REQ,
                                         KVS_MSG_STAGING_GRANT, KVS_MSG_CHUNK_READY,
                                         KVS_MSG_STATUS,        KVS_MSG_ACK};
        for (size_t i = 0; i < sizeof(needed) / sizeof(needed[0]); i++)
            if (clean.sent_by_type[needed[i]] == 0)
                fail_msg("TP%u -> TP%u: the clean run sent no %s", p->ptp, p->dtp,
                         kvs_msg_type_str(needed[i]));
        for (uint32_t type = 1; type < KVS_INPROC_MSG_TYPES; type++) {
            for (uint64_t n = 1; n <= clean.sent_by_type[type]; n++) {
                kvs_inproc_faults_t f = {.drop_type = type, .drop_nth = n};
                kvs_inproc_stats_t st;
                if (run_schedule(p, &f, &st, &detected, why, sizeof(why)) != 0)
                    fail_msg("TP%u -> TP%u, ring of %u slot(s): losing %s #%llu (of %llu): %s",
                             p->ptp, p->dtp, p->ring_slots, kvs_msg_type_str((kvs_msg_type_t) type),
                             (unsigned long long) n, (unsigned long long) clean.sent_by_type[type],
                             why);
                assert_int_equal(st.dropped, 1);
                assert_int_equal(detected, 0); /* a lost message corrupts nothing */
                runs++;
            }
        }
    }
    kvs_log_set_level(KVS_LOG_WARN);
    print_message("single-loss sweep: %llu runs, each losing one message\n",
                  (unsigned long long) runs);
    kvs_assert_no_leaks();
}

/* Exactly one data write corrupted, for every write of the schedule: the checksum catches it
 * (detected == injected == 1), only that write's room fails, with the checksum reason, and the
 * others succeed byte-exact; nothing is left held. */
static void test_every_single_corruption(void **state)
{
    (void) state;
    kvs_log_set_level(KVS_LOG_ERROR);
    uint64_t runs = 0;
    for (size_t pi = 0; pi < 2; pi++) {
        const loss_pair_t *p = &loss_pairs[pi];
        char why[256];
        kvs_inproc_stats_t clean;
        uint64_t detected = 0;
        if (run_schedule(p, NULL, &clean, &detected, why, sizeof(why)) != 0)
            fail_msg("TP%u -> TP%u, reliable network: %s", p->ptp, p->dtp, why);
        assert_true(clean.host_writes > 0);
        for (uint64_t n = 1; n <= clean.host_writes; n++) {
            kvs_inproc_faults_t f = {.corrupt_nth = n};
            kvs_inproc_stats_t st;
            uint32_t bad = run_schedule(p, &f, &st, &detected, why, sizeof(why));
            if (st.corrupted != 1 || detected != 1 || bad != 1)
                fail_msg("TP%u -> TP%u: corrupting write %llu of %llu: %llu corrupted, %llu "
                         "detected, %u rooms failed (%s)",
                         p->ptp, p->dtp, (unsigned long long) n,
                         (unsigned long long) clean.host_writes, (unsigned long long) st.corrupted,
                         (unsigned long long) detected, bad, why);
            runs++;
        }
    }
    kvs_log_set_level(KVS_LOG_WARN);
    print_message("single-corruption sweep: %llu runs, each corrupting one write\n",
                  (unsigned long long) runs);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_single_loss),
        cmocka_unit_test(test_every_single_corruption),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
