/* The full protocol over real net links across processes: prefill ranks (senders, pools,
 * links) in a child process, decode ranks in this one, on the monotonic clock. Rooms with
 * decode prefixes, prefill cache hits and chunked compute are filled with position-keyed bytes
 * on prefill and checked byte for byte on decode; over shared memory and over tcp. Decode knows
 * the prefill endpoints (as from a bootstrap registry); prefill learns decode's from its
 * heartbeats. With several decode instances (each its own ranks, links and instance id, rank 0
 * in every one) the prefill ranks serve them all at once, each room in the instance that took
 * it. */
#include "pd/pd_harness.h"
#include "transport/net_harness.h"

#include <stdio.h>

#include "kvstage/clock.h"
#include "kvstage/net.h"

#define MS        1000000ull
#define MAX_ROOMS 16
#define MAX_PAGES 160
#define MAX_INSTS 2

typedef struct {
    uint32_t ptp, dtp;
    kvs_net_data_t data;
    uint64_t seed;
    uint32_t nrooms;
    uint64_t corrupt_nth; /* prefill rank 0's link corrupts its n-th write: one room must fail */
    uint32_t insts;       /* decode instances (0: 1); room i goes to instance i % insts */
} run_t;

typedef struct {
    uint64_t id, len, base, hit;
    uint32_t npp, ndp;
    uint32_t pages[H_MAX_RANKS][MAX_PAGES]; /* this process's page ids, per local rank */
    uint64_t computed;
    int added, finished, done;
    kvs_room_status_t status;
    uint64_t bad;
} nroom_t;

static void net_geo(kvs_pd_geometry_t *g, uint32_t ptp, uint32_t dtp)
{
    memset(g, 0, sizeof(*g));
    g->shape = (kvs_kv_shape_t){.layers = 2,
                                .kv_heads = 4,
                                .head_dim_k = 32,
                                .head_dim_v = 16,
                                .elem_bytes = 2,
                                .attn = KVS_ATTN_MHA};
    g->prefill_tp = ptp;
    g->decode_tp = dtp;
    g->page_size = 16;
    g->chunk_tokens = 128;
}

static void net_timeouts(kvs_pd_timeouts_t *t)
{
    *t = (kvs_pd_timeouts_t){
        .retry_ns = 50 * MS,
        .bootstrap_timeout_ns = 15000 * MS,
        .transfer_timeout_ns = 15000 * MS,
        .waiting_timeout_ns = 25000 * MS,
        .completion_timeout_ns = 15000 * MS,
        .release_timeout_ns = 5000 * MS,
    };
}

/* Both processes derive the same rooms from the seed. */
static void plan_rooms(const run_t *run, uint32_t P, nroom_t *rooms)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, run->seed);
    for (uint32_t i = 0; i < run->nrooms; i++) {
        nroom_t *r = &rooms[i];
        memset(r, 0, sizeof(*r));
        r->id = 1000 + i;
        r->len = i == 0 ? 2000 : kvs_rng_range(&rng, 1, 2000); /* room 0: 16 slots */
        r->base = i % 3 == 1 ? kvs_rng_below(&rng, r->len / P + 1) * P : 0;
        r->hit = i % 4 == 2 ? kvs_rng_below(&rng, r->len + 1) : 0;
        r->npp = (uint32_t) ((r->len + P - 1) / P);
        r->ndp = (uint32_t) kvs_grid_total_pages(r->len, r->base, P);
    }
}

static kvs_net_config_t net_cfg(kvs_side_t side, uint32_t rank, uint32_t peer_tp,
                                kvs_net_data_t data)
{
    kvs_net_config_t c;
    memset(&c, 0, sizeof(c));
    c.side = side;
    c.rank = rank;
    c.peer_tp = peer_tp;
    c.bind = "tcp://127.0.0.1:0";
    c.data = data;
    c.net_device = "lo";
    c.heartbeat_ns = 20 * MS;
    c.liveness_timeout_ns = 2000 * MS;
    c.connect_timeout_ns = 5000 * MS;
    c.write_timeout_ns = 5000 * MS;
    return c;
}

static void make_pool(h_t *h, int decode, uint32_t rank)
{
    uint32_t tp = decode ? h->geo.decode_tp : h->geo.prefill_tp;
    kvs_pool_config_t pc = {.shape = h->geo.shape,
                            .tp = {tp, rank},
                            .page_size = h->geo.page_size,
                            .num_pages = MAX_ROOMS * MAX_PAGES,
                            .layout = rank % 2 ? KVS_POOL_HND : KVS_POOL_NHD,
                            .mem = KVS_MEM_HOST};
    kvs_pool_t **pool = decode ? &h->dpool[rank] : &h->ppool[rank];
    if (kvs_pool_create(&pc, pool) != KVS_OK) abort();
}

/* ---- prefill: the child process ---- */

/* Reports its endpoints on up; EOF on done means decode has finished. */
static int prefill_main(const run_t *run, int up, int done)
{
    h_t h;
    memset(&h, 0, sizeof(h));
    net_geo(&h.geo, run->ptp, run->dtp);
    net_timeouts(&h.timeouts);
    kvs_clock_t clock = kvs_clock_monotonic();
    char eps[H_MAX_RANKS * 64] = "";
    for (uint32_t r = 0; r < run->ptp; r++) {
        make_pool(&h, 0, r);
        kvs_net_config_t c = net_cfg(KVS_SIDE_PREFILL, r, run->dtp, run->data);
        if (r == 0) c.corrupt_nth = run->corrupt_nth;
        c.max_instances = run->insts;
        if (kvs_net_link_create(&c, &h.plink[r]) != KVS_OK) return 2;
        kvs_sender_config_t sc = {.geo = h.geo,
                                  .rank = r,
                                  .timeouts = h.timeouts,
                                  .window_chunks = 2,
                                  .staging_buffers = 2};
        if (kvs_sender_create(&sc, h.ppool[r], h.plink[r], &clock, &h.tx[r]) != KVS_OK) return 3;
        snprintf(eps + strlen(eps), sizeof(eps) - strlen(eps), "%s ",
                 kvs_net_link_endpoint(h.plink[r]));
    }
    uint32_t n = (uint32_t) strlen(eps);
    if (write(up, &n, 4) != 4 || write(up, eps, n) != (ssize_t) n) return 4;

    /* Serving several decode instances, a room that fails before any of them sent its metadata
     * (a request cancelled before the decode side took it) is held for nobody: quiescent at
     * once, well before the release timeout. */
    if (run->insts > 1) {
        uint32_t page[H_MAX_RANKS];
        for (uint32_t r = 0; r < run->ptp; r++)
            if (kvs_pool_alloc(h.ppool[r], 1, &page[r]) != KVS_OK ||
                kvs_sender_add_room(h.tx[r], 99, 16, &page[r]) != KVS_OK ||
                kvs_sender_abort(h.tx[r], 99) != KVS_OK)
                return 17;
        const uint64_t until = kvs_now_ns() + h.timeouts.release_timeout_ns / 2;
        for (uint32_t r = 0; r < run->ptp; r++) {
            kvs_room_info_t info = {0};
            while (kvs_sender_progress(h.tx[r]),
                   kvs_sender_poll(h.tx[r], 99, &info) == KVS_OK && !info.quiescent)
                if (kvs_now_ns() > until) return 18;
            if (kvs_sender_release(h.tx[r], 99) != KVS_OK ||
                kvs_pool_free(h.ppool[r], &page[r], 1) != KVS_OK)
                return 19;
        }
    }
    static nroom_t rooms[MAX_ROOMS];
    plan_rooms(run, h.geo.page_size, rooms);
    const uint64_t C = h.geo.chunk_tokens;
    uint32_t left = run->nrooms;
    int code = 0;
    uint32_t failed = 0; /* rooms concluded Failed */
    uint64_t deadline = kvs_now_ns() + 40000 * MS;
    for (uint64_t step = 0; left > 0; step++) {
        if (kvs_now_ns() > deadline) {
            code = 5;
            break;
        }
        for (uint32_t r = 0; r < run->ptp; r++) kvs_sender_progress(h.tx[r]);
        for (uint32_t i = 0; i < run->nrooms; i++) {
            nroom_t *rm = &rooms[i];
            if (rm->done) continue;
            if (!rm->added) {
                if (step < (uint64_t) i * 40) continue; /* rooms arrive over time */
                for (uint32_t r = 0; r < run->ptp; r++) {
                    if (kvs_pool_alloc(h.ppool[r], rm->npp, rm->pages[r]) != KVS_OK ||
                        kvs_sender_add_room(h.tx[r], rm->id, rm->len, rm->pages[r]) != KVS_OK)
                        return 6;
                    h_fill(&h, r, rm->id, rm->pages[r], 0, rm->hit);
                    if (kvs_sender_advance(h.tx[r], rm->id, rm->hit, rm->hit) != KVS_OK) return 7;
                }
                rm->computed = rm->hit;
                rm->added = 1;
            } else if (!rm->finished && step % 5 == 0) {
                uint64_t next = rm->computed + C;
                if (next > rm->len) next = rm->len;
                for (uint32_t r = 0; r < run->ptp; r++) {
                    h_fill(&h, r, rm->id, rm->pages[r], rm->computed, next);
                    uint32_t token = (uint32_t) rm->id * 7 + 1;
                    kvs_status_t st = next == rm->len
                                          ? kvs_sender_finish(h.tx[r], rm->id, &token, 4)
                                          : kvs_sender_advance(h.tx[r], rm->id, next, next + C);
                    if (st != KVS_OK) return 8;
                }
                rm->computed = next;
                rm->finished = next == rm->len;
            }
            kvs_room_status_t min = KVS_ROOM_SUCCESS;
            int quiet = 1;
            for (uint32_t r = 0; r < run->ptp; r++) {
                kvs_room_info_t info;
                if (kvs_sender_poll(h.tx[r], rm->id, &info) != KVS_OK) return 9;
                if (info.status < min) min = info.status;
                quiet &= info.quiescent;
            }
            if (!quiet || (min != KVS_ROOM_SUCCESS && min != KVS_ROOM_FAILED)) continue;
            /* Every rank concludes before any releases (a failed rank may still be quiescing). */
            int all_concluded = 1;
            for (uint32_t r = 0; r < run->ptp; r++) {
                kvs_room_info_t info;
                kvs_sender_poll(h.tx[r], rm->id, &info);
                all_concluded &= info.status == KVS_ROOM_SUCCESS || info.status == KVS_ROOM_FAILED;
            }
            if (!all_concluded) continue;
            if (min != KVS_ROOM_SUCCESS && (run->corrupt_nth == 0 || failed++ > 0)) code = 10;
            for (uint32_t r = 0; r < run->ptp; r++) {
                if (kvs_sender_release(h.tx[r], rm->id) != KVS_OK ||
                    kvs_pool_free(h.ppool[r], rm->pages[r], rm->npp) != KVS_OK)
                    return 11;
            }
            rm->done = 1;
            left--;
        }
    }
    for (uint32_t r = 0; r < run->ptp; r++) {
        kvs_net_stats_t st;
        kvs_net_link_stats(h.plink[r], &st);
        kvs_pd_metrics_t m;
        kvs_sender_metrics(h.tx[r], &m);
        if (code == 0 && (st.writes_failed != 0 || st.rejected != 0 || m.bulk_writes == 0 ||
                          m.rejected != 0 || st.peer_instances != (run->insts ? run->insts : 1)))
            code = 12;
        /* Over shared memory the decode ring is mapped once wired up: gathers go straight into
         * it (direct writes); over tcp every write is a staged put. */
        int shm = run->data != KVS_NET_DATA_TCP;
        if (code == 0 &&
            (shm ? m.direct_writes == 0 : m.direct_writes != 0 || st.writes != m.bulk_writes))
            code = 16;
        const uint32_t want = run->nrooms - (run->corrupt_nth ? 1 : 0);
        if (code == 0 && (m.live_rooms != 0 || m.rooms_succeeded != want)) code = 13;
        if (code == 0 && kvs_pool_free_pages(h.ppool[r]) != kvs_pool_total_pages(h.ppool[r]))
            code = 14;
    }
    /* Stay reachable until decode has everything (it closes the pipe when done). */
    char c;
    while (read(done, &c, 1) > 0) {
    }
    for (uint32_t r = 0; r < run->ptp; r++) {
        kvs_sender_destroy(h.tx[r]);
        kvs_link_destroy(h.plink[r]);
        kvs_pool_destroy(h.ppool[r]);
    }
    return code;
}

/* ---- decode: this process ---- */

static void run_protocol(const run_t *run)
{
    int sv[2];
    assert_int_equal(pipe(sv), 0);
    int back[2];
    assert_int_equal(pipe(back), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid > 0) nh_track(pid, -1, -1); /* the teardown kills it if a failed test left it */
    if (pid == 0) {
        close(sv[0]);
        close(back[1]);
        kvs_alloc_stats_t before, after; /* the parent's blocks came along with fork() */
        kvs_alloc_stats(&before);
        int code = prefill_main(run, sv[1], back[0]);
        kvs_alloc_stats(&after);
        _exit(code != 0 ? code : after.live_blocks == before.live_blocks ? 0 : 15);
    }
    close(sv[1]);
    close(back[0]);
    const uint32_t ninst = run->insts ? run->insts : 1;
    static h_t hs[MAX_INSTS]; /* one per decode instance */
    memset(hs, 0, sizeof(hs));
    kvs_clock_t clock = kvs_clock_monotonic();
    uint32_t n;
    static char eps[H_MAX_RANKS * 64];
    assert_int_equal(nh_read_full(sv[0], &n, 4, 30000), 0);
    assert_true(n < sizeof(eps));
    assert_int_equal(nh_read_full(sv[0], eps, n, 30000), 0);
    eps[n] = '\0';
    kvs_net_config_t base = net_cfg(KVS_SIDE_DECODE, 0, run->ptp, run->data);
    char *save = NULL;
    for (uint32_t p = 0; p < run->ptp; p++) {
        base.peers[p] = strtok_r(p == 0 ? eps : NULL, " ", &save);
        assert_non_null(base.peers[p]);
    }
    for (uint32_t k = 0; k < ninst; k++) {
        h_t *h = &hs[k];
        net_geo(&h->geo, run->ptp, run->dtp);
        net_timeouts(&h->timeouts);
        for (uint32_t r = 0; r < run->dtp; r++) {
            make_pool(h, 1, r);
            kvs_net_config_t c = base;
            c.rank = r;
            c.instance = 0x100 + k;
            assert_int_equal(kvs_net_link_create(&c, &h->dlink[r]), KVS_OK);
            kvs_receiver_config_t rc = {
                .geo = h->geo, .rank = r, .timeouts = h->timeouts, .ring_bytes = 1536 * 1024};
            assert_int_equal(kvs_receiver_create(&rc, h->dpool[r], h->dlink[r], &clock, &h->rx[r]),
                             KVS_OK);
        }
    }
    static nroom_t rooms[MAX_ROOMS];
    plan_rooms(run, hs[0].geo.page_size, rooms);
    for (uint32_t i = 0; i < run->nrooms; i++) {
        h_t *h = &hs[i % ninst];
        for (uint32_t r = 0; r < run->dtp; r++) {
            assert_int_equal(kvs_pool_alloc(h->dpool[r], rooms[i].ndp, rooms[i].pages[r]), KVS_OK);
            assert_int_equal(kvs_receiver_add_room(h->rx[r], rooms[i].id, rooms[i].base,
                                                   rooms[i].len, rooms[i].pages[r]),
                             KVS_OK);
        }
    }
    uint32_t left = run->nrooms;
    uint64_t deadline = kvs_now_ns() + 45000 * MS;
    while (left > 0) {
        if (kvs_now_ns() > deadline) {
            kill(pid, SIGKILL);
            fail_msg("seed %llu: %u rooms still open after 45 s", (unsigned long long) run->seed,
                     left);
        }
        for (uint32_t k = 0; k < ninst; k++)
            for (uint32_t r = 0; r < run->dtp; r++) kvs_receiver_progress(hs[k].rx[r]);
        for (uint32_t i = 0; i < run->nrooms; i++) {
            nroom_t *rm = &rooms[i];
            h_t *h = &hs[i % ninst];
            if (rm->done) continue;
            kvs_room_status_t min = KVS_ROOM_SUCCESS;
            int quiet = 1;
            for (uint32_t r = 0; r < run->dtp; r++) {
                kvs_room_info_t info;
                assert_int_equal(kvs_receiver_poll(h->rx[r], rm->id, &info), KVS_OK);
                if (info.status < min) min = info.status;
                quiet &= info.quiescent;
                if (info.status == KVS_ROOM_SUCCESS) {
                    uint32_t token = (uint32_t) rm->id * 7 + 1;
                    assert_int_equal(info.final_len, 4);
                    assert_memory_equal(info.final, &token, 4);
                }
            }
            if (!quiet || (min != KVS_ROOM_SUCCESS && min != KVS_ROOM_FAILED)) continue;
            rm->status = min;
            for (uint32_t r = 0; r < run->dtp; r++) {
                if (min == KVS_ROOM_SUCCESS)
                    rm->bad += h_mismatches(h, r, rm->id, rm->pages[r], rm->base, rm->len);
                assert_int_equal(kvs_receiver_release(h->rx[r], rm->id), KVS_OK);
                assert_int_equal(kvs_pool_free(h->dpool[r], rm->pages[r], rm->ndp), KVS_OK);
            }
            rm->done = 1;
            left--;
        }
    }
    /* Decode is done: let prefill go, answering it until it exits. */
    close(back[1]);
    int status = 0;
    uint64_t end = kvs_now_ns() + 20000 * MS;
    pid_t got = 0;
    while ((got = waitpid(pid, &status, WNOHANG)) == 0) {
        for (uint32_t k = 0; k < ninst; k++)
            for (uint32_t r = 0; r < run->dtp; r++) kvs_receiver_progress(hs[k].rx[r]);
        if (kvs_now_ns() > end) {
            kill(pid, SIGKILL);
            fail_msg("seed %llu: prefill did not finish", (unsigned long long) run->seed);
        }
    }
    nh_forget(pid);
    uint32_t failed = 0, failed_in[MAX_INSTS] = {0};
    for (uint32_t i = 0; i < run->nrooms; i++)
        if (run->corrupt_nth && rooms[i].status == KVS_ROOM_FAILED && failed++ == 0)
            failed_in[i % ninst]++; /* the room of the corrupted write */
        else if (rooms[i].status != KVS_ROOM_SUCCESS || rooms[i].bad != 0)
            fail_msg("seed %llu: room %llu (len %llu, base %llu, hit %llu) %s, %llu bytes wrong",
                     (unsigned long long) run->seed, (unsigned long long) rooms[i].id,
                     (unsigned long long) rooms[i].len, (unsigned long long) rooms[i].base,
                     (unsigned long long) rooms[i].hit, kvs_room_status_str(rooms[i].status),
                     (unsigned long long) rooms[i].bad);
    assert_true(WIFEXITED(status));
    if (WEXITSTATUS(status) != 0)
        fail_msg("seed %llu: prefill process exited with %d", (unsigned long long) run->seed,
                 WEXITSTATUS(status));
    assert_int_equal(failed, run->corrupt_nth ? 1 : 0);
    uint64_t caught = 0;
    for (uint32_t k = 0; k < ninst; k++) {
        h_t *h = &hs[k];
        uint32_t mine = 0;
        for (uint32_t i = k; i < run->nrooms; i += ninst) mine++;
        for (uint32_t r = 0; r < run->dtp; r++) {
            kvs_pd_metrics_t m;
            kvs_receiver_metrics(h->rx[r], &m);
            assert_int_equal(m.live_rooms, 0);
            assert_int_equal(m.ring_used, 0);
            assert_int_equal(m.live_slots, 0);
            assert_int_equal(m.rooms_succeeded, mine - failed_in[k]);
            caught += m.checksum_failures;
            assert_true(m.chunks > 0);
            assert_int_equal(kvs_pool_free_pages(h->dpool[r]), kvs_pool_total_pages(h->dpool[r]));
            kvs_net_stats_t st;
            assert_int_equal(kvs_net_link_stats(h->dlink[r], &st), KVS_OK);
            assert_int_equal(st.rejected, 0);
            assert_true(st.wireups_sent >= run->ptp);
            kvs_receiver_destroy(h->rx[r]);
            kvs_link_destroy(h->dlink[r]);
            kvs_pool_destroy(h->dpool[r]);
        }
    }
    assert_int_equal(caught, run->corrupt_nth ? 1 : 0); /* and the checksum is what failed it */
    close(sv[0]);
    kvs_assert_no_leaks();
}

static void test_tp2_to_tp1_shm(void **state)
{
    (void) state;
    run_t run = {
        .ptp = 2, .dtp = 1, .data = KVS_NET_DATA_SHM, .seed = kvs_test_seed(1), .nrooms = 12};
    run_protocol(&run);
}

static void test_tp2_to_tp1_tcp(void **state)
{
    (void) state;
    run_t run = {
        .ptp = 2, .dtp = 1, .data = KVS_NET_DATA_TCP, .seed = kvs_test_seed(2), .nrooms = 12};
    run_protocol(&run);
}

/* Fan-out the other way round, with the transport picked automatically (loopback: shm). */
/* One bit of one write flipped in flight (the link's test hook, after the sender's checksum):
 * decode's checksum catches it, that room alone fails, the others arrive exact. */
static void test_corrupted_write_caught(void **state)
{
    (void) state;
    run_t run = {.ptp = 2,
                 .dtp = 1,
                 .data = KVS_NET_DATA_TCP,
                 .seed = kvs_test_seed(4),
                 .nrooms = 6,
                 .corrupt_nth = 3};
    run_protocol(&run);
}

static void test_tp1_to_tp2_auto(void **state)
{
    (void) state;
    run_t run = {
        .ptp = 1, .dtp = 2, .data = KVS_NET_DATA_AUTO, .seed = kvs_test_seed(3), .nrooms = 8};
    run_protocol(&run);
}

/* One prefill instance (TP2) serving two decode instances (TP2 each) at once: both have ranks 0
 * and 1, which used to collide on prefill. Rooms alternate between them; every one arrives
 * exact in its own instance, over shared memory. */
static void test_two_decode_instances(void **state)
{
    (void) state;
    run_t run = {.ptp = 2,
                 .dtp = 2,
                 .data = KVS_NET_DATA_SHM,
                 .seed = kvs_test_seed(5),
                 .nrooms = 10,
                 .insts = 2};
    run_protocol(&run);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_tp2_to_tp1_shm, nh_kill_children),
        cmocka_unit_test_teardown(test_tp2_to_tp1_tcp, nh_kill_children),
        cmocka_unit_test_teardown(test_tp1_to_tp2_auto, nh_kill_children),
        cmocka_unit_test_teardown(test_corrupted_write_caught, nh_kill_children),
        cmocka_unit_test_teardown(test_two_decode_instances, nh_kill_children),
    };
    const char *filter = getenv("KVS_TEST_FILTER"); /* e.g. "*tcp*" */
    if (filter != NULL) cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
