/* Tests for the net link (ZeroMQ control + UCX data) across processes: a decode process exposes
 * its ring, a prefill process writes known patterns (1 byte to more than 4 MiB, so in pieces)
 * and announces each completed write with a control message, and decode checks the bytes are
 * there when the message arrives; over shared memory and over tcp. Also: a decode process
 * killed mid-write (errors within the deadline, never a hang), a restarted decode rank with a
 * new ring and rkey, a re-exposed ring, wireup timeouts, argument checks and hostile wireup
 * frames. Children are forked before the parent starts ZeroMQ or UCX. */
#include "kvs_test.h"

#include <dirent.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "control/zmq_channel.h"
#include "kvstage/clock.h"
#include "kvstage/msg.h"
#include "kvstage/net.h"
#include "kvstage/rng.h"
#include "transport/link.h"
#include "transport/net_harness.h"

#define MS          1000000ull
#define MIB         (1ull << 20)
#define LIVENESS_MS 1000ull /* generous: ASan builds on a busy 2-core machine */

/* ---- helpers ---- */

static kvs_net_config_t net_cfg(kvs_side_t side, kvs_net_data_t data)
{
    kvs_net_config_t c;
    memset(&c, 0, sizeof(c));
    c.side = side;
    c.rank = 0;
    c.peer_tp = 1;
    c.bind = "tcp://127.0.0.1:0";
    c.data = data;
    c.net_device = "lo";
    c.heartbeat_ns = 20 * MS;
    c.liveness_timeout_ns = LIVENESS_MS * MS;
    c.connect_timeout_ns = 3000 * MS;
    c.write_timeout_ns = 10000 * MS;
    return c;
}

static int write_str(int fd, const char *s)
{
    uint32_t n = (uint32_t) strlen(s);
    return nh_write_full(fd, &n, 4) == 0 && nh_write_full(fd, s, n) == 0 ? 0 : -1;
}

static int read_str(int fd, char *buf, size_t cap)
{
    uint32_t n;
    if (nh_read_full(fd, &n, 4, 30000) != 0 || n >= cap || nh_read_full(fd, buf, n, 30000) != 0)
        return -1;
    buf[n] = '\0';
    return 0;
}

static void pat_fill_part(uint8_t *dst, uint64_t seed, uint64_t i, uint64_t from, uint64_t to)
{
    for (uint64_t w = from / 8; w * 8 < to; w++) {
        uint64_t v = kvs_mix64(seed * 31 + (i << 36) + w);
        for (uint64_t b = w * 8; b < to && b < w * 8 + 8; b++)
            dst[b] = (uint8_t) (v >> (8 * (b % 8)));
    }
}

static uint64_t pat_bad_part(const uint8_t *src, uint64_t seed, uint64_t i, uint64_t from,
                             uint64_t to)
{
    uint64_t bad = 0;
    for (uint64_t w = from / 8; w * 8 < to; w++) {
        uint64_t v = kvs_mix64(seed * 31 + (i << 36) + w);
        for (uint64_t b = w * 8; b < to && b < w * 8 + 8; b++)
            bad += src[b] != (uint8_t) (v >> (8 * (b % 8)));
    }
    return bad;
}

#define PAT_STEP MIB /* bytes between link progress calls: heartbeats keep flowing */

static void pat_fill(kvs_link_t *link, uint8_t *dst, uint64_t seed, uint64_t i, uint64_t len)
{
    for (uint64_t from = 0; from < len; from += PAT_STEP) {
        pat_fill_part(dst, seed, i, from, from + PAT_STEP < len ? from + PAT_STEP : len);
        if (link) kvs_net_link_progress(link);
    }
}

static uint64_t pat_mismatches(kvs_link_t *link, const uint8_t *src, uint64_t seed, uint64_t i,
                               uint64_t len)
{
    uint64_t bad = 0;
    for (uint64_t from = 0; from < len; from += PAT_STEP) {
        bad += pat_bad_part(src, seed, i, from, from + PAT_STEP < len ? from + PAT_STEP : len);
        if (link) kvs_net_link_progress(link);
    }
    return bad;
}

/* Test control messages (opaque bytes to the link). */
enum { T_WRITTEN = 1, T_ACK = 2, T_BYE = 3 };
typedef struct {
    uint32_t kind, index;
    uint64_t offset, len; /* T_ACK: len = bytes that did not match */
} tmsg_t;

static kvs_status_t tsend(kvs_link_t *link, const tmsg_t *m)
{
    uint64_t end = kvs_now_ns() + 5000 * MS;
    kvs_status_t st;
    while ((st = link->ops->send(link->ctx, 0, (const uint8_t *) m, sizeof(*m))) != KVS_OK &&
           kvs_now_ns() < end) {
    }
    return st;
}

static int trecv(kvs_link_t *link, tmsg_t *m)
{
    uint8_t buf[KVS_MSG_MAX_SIZE];
    size_t len = 0;
    if (link->ops->recv(link->ctx, buf, sizeof(buf), &len, NULL) != KVS_OK || len != sizeof(*m))
        return 0;
    memcpy(m, buf, sizeof(*m));
    return 1;
}

/* ---- the decode process ---- */

typedef struct {
    kvs_net_data_t data;
    uint64_t ring_bytes;
    uint64_t pad_bytes; /* allocated before the ring, so a restart gets another address */
    uint64_t seed;
} decode_arg_t;

/* Exposes a ring, then checks every announced write and acknowledges it, until BYE. Learns the
 * prefill endpoint from the pipe; reports its own endpoint and ring address up the pipe. */
static int decode_main(int up, int down, void *argp)
{
    const decode_arg_t *a = argp;
    char pep[256];
    if (read_str(down, pep, sizeof(pep)) != 0) return 2;
    kvs_net_config_t c = net_cfg(KVS_SIDE_DECODE, a->data);
    c.peers[0] = pep;
    kvs_link_t *link;
    if (kvs_net_link_create(&c, &link) != KVS_OK) return 3;
    uint8_t *pad = a->pad_bytes ? kvs_malloc(a->pad_bytes) : NULL;
    uint8_t *ring = kvs_aligned_alloc(4096, a->ring_bytes);
    if (ring == NULL || link->ops->expose(link->ctx, ring, a->ring_bytes) != KVS_OK) return 4;
    char info[300];
    snprintf(info, sizeof(info), "%s %llx", kvs_net_link_endpoint(link),
             (unsigned long long) (uintptr_t) ring);
    if (write_str(up, info) != 0) return 5;
    int code = 6; /* no BYE within the deadline */
    uint64_t end = kvs_now_ns() + 60000 * MS;
    while (kvs_now_ns() < end && nh_parent_alive()) {
        tmsg_t m;
        if (!trecv(link, &m)) continue;
        if (m.kind == T_BYE) {
            code = 0;
            break;
        }
        if (m.kind != T_WRITTEN || m.offset > a->ring_bytes || m.len > a->ring_bytes - m.offset) {
            code = 7;
            break;
        }
        /* The write completed before its message was sent: the bytes must be here now. */
        link->ops->flush(link->ctx);
        tmsg_t ack = {.kind = T_ACK, .index = m.index, .offset = m.offset};
        ack.len = pat_mismatches(link, ring + m.offset, a->seed, m.index, m.len);
        if (tsend(link, &ack) != KVS_OK) {
            code = 8;
            break;
        }
    }
    kvs_net_stats_t st;
    kvs_net_link_stats(link, &st);
    if (code == 0 && (st.rejected != 0 || st.wireups_sent == 0)) code = 9;
    link->ops->expose(link->ctx, NULL, 0); /* withdraw before freeing the ring */
    kvs_link_destroy(link);
    kvs_free(ring);
    kvs_free(pad);
    return code;
}

/* Connects the parent's prefill link to a decode child: sends our endpoint down, reads the
 * child's endpoint and ring address; sets the peer explicitly if asked (else it is learned from
 * the child's heartbeats). */
static kvs_link_t *prefill_for(nh_child_t *ch, kvs_net_data_t data, int explicit_peer,
                               uint64_t *ring_addr_p)
{
    kvs_net_config_t c = net_cfg(KVS_SIDE_PREFILL, data);
    kvs_link_t *link;
    assert_int_equal(kvs_net_link_create(&c, &link), KVS_OK);
    assert_int_equal(write_str(ch->down, kvs_net_link_endpoint(link)), 0);
    char info[300], ep[256];
    unsigned long long addr = 0;
    assert_int_equal(read_str(ch->up, info, sizeof(info)), 0);
    assert_int_equal(sscanf(info, "%255s %llx", ep, &addr), 2);
    if (explicit_peer) assert_int_equal(kvs_net_link_set_peer(link, 0, ep), KVS_OK);
    if (ring_addr_p) *ring_addr_p = addr;
    return link;
}

/* Points a link at another rank (for a restart that binds a new endpoint). */
static void reconnect_for(nh_child_t *ch, kvs_link_t *link, uint64_t *ring_addr_p)
{
    assert_int_equal(write_str(ch->down, kvs_net_link_endpoint(link)), 0);
    char info[300], ep[256];
    unsigned long long addr = 0;
    assert_int_equal(read_str(ch->up, info, sizeof(info)), 0);
    assert_int_equal(sscanf(info, "%255s %llx", ep, &addr), 2);
    *ring_addr_p = addr;
}

static kvs_status_t wait_write(kvs_link_t *link, uint64_t ticket, uint64_t limit_ms)
{
    uint64_t end = kvs_now_ns() + limit_ms * MS;
    kvs_status_t st;
    while ((st = link->ops->write_poll(link->ctx, ticket)) == KVS_INPROGRESS) {
        if (kvs_now_ns() > end)
            fail_msg("write %llu still running after %llu ms", (unsigned long long) ticket,
                     (unsigned long long) limit_ms);
    }
    return st;
}

/* Writes n patterned writes through `lanes` disjoint parts of the ring, each announced after
 * it completes and acknowledged by decode after checking; returns bytes written. */
static uint64_t write_verified(kvs_link_t *link, uint64_t seed, uint64_t first_index, uint64_t n,
                               uint64_t ring_bytes, uint64_t lane_base, int lanes)
{
    enum { FREE, WRITING, ANNOUNCED };
    const uint64_t lane_bytes = (ring_bytes - lane_base) / (uint64_t) lanes;
    uint8_t *src[4];
    int state[4];
    uint64_t ticket[4], index[4], off[4], len[4];
    for (int l = 0; l < lanes; l++) {
        src[l] = kvs_aligned_alloc(4096, lane_bytes);
        assert_non_null(src[l]);
        state[l] = FREE;
    }
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed + first_index);
    static const uint64_t sizes[] = {1, 7, 4096, 65539, MIB, 4 * MIB, 4 * MIB + 1, 9 * MIB + 5};
    uint64_t next = 0, acked = 0, bytes = 0;
    uint64_t end = kvs_now_ns() + 60000 * MS;
    while (acked < n) {
        if (kvs_now_ns() > end)
            fail_msg("seed %llu: %llu of %llu writes acknowledged", (unsigned long long) seed,
                     (unsigned long long) acked, (unsigned long long) n);
        for (int l = 0; l < lanes; l++) {
            if (state[l] == FREE && next < n) {
                uint64_t i = first_index + next++;
                uint64_t L = next % 3 == 0 ? kvs_rng_range(&rng, 1, lane_bytes)
                                           : sizes[kvs_rng_below(&rng, 8)];
                if (L > lane_bytes) L = lane_bytes;
                off[l] =
                    lane_base + (uint64_t) l * lane_bytes + kvs_rng_below(&rng, lane_bytes - L + 1);
                len[l] = L;
                index[l] = i;
                pat_fill(link, src[l], seed, i, L);
                assert_int_equal(link->ops->write(link->ctx, 0, off[l], src[l], L, &ticket[l]),
                                 KVS_OK);
                state[l] = WRITING;
                bytes += L;
            }
            if (state[l] == WRITING) {
                kvs_status_t st = link->ops->write_poll(link->ctx, ticket[l]);
                if (st == KVS_INPROGRESS) continue;
                assert_int_equal(st, KVS_OK);
                tmsg_t m = {.kind = T_WRITTEN,
                            .index = (uint32_t) index[l],
                            .offset = off[l],
                            .len = len[l]};
                assert_int_equal(tsend(link, &m), KVS_OK);
                state[l] = ANNOUNCED;
            }
        }
        tmsg_t a;
        if (!trecv(link, &a)) continue;
        assert_int_equal(a.kind, T_ACK);
        int l = 0;
        while (l < lanes && !(state[l] == ANNOUNCED && index[l] == a.index)) l++;
        assert_true(l < lanes);
        if (a.len != 0)
            fail_msg("seed %llu: write %u ([%llu, +%llu)) had %llu wrong bytes at decode",
                     (unsigned long long) seed, a.index, (unsigned long long) off[l],
                     (unsigned long long) len[l], (unsigned long long) a.len);
        state[l] = FREE;
        acked++;
    }
    for (int l = 0; l < lanes; l++) kvs_free(src[l]);
    return bytes;
}

/* ---- end to end ---- */

static void run_visibility(kvs_net_data_t data)
{
    decode_arg_t a = {.data = data, .ring_bytes = 24 * MIB, .seed = kvs_test_seed(21)};
    nh_child_t ch = nh_spawn(decode_main, &a);
    kvs_link_t *link = prefill_for(&ch, data, 1, NULL);
    uint64_t n = kvs_test_iters(40);
    write_verified(link, a.seed, 0, n, a.ring_bytes, 0, 2);
    /* Wired up now, to a ring the decode process allocated itself (not through the link's
     * ring_alloc): not shared memory, so it cannot be mapped over either transport (a
     * link-allocated one is: test_rank_processes's direct writes); a range past the ring and an
     * unknown peer are refused. */
    uint8_t *mapped = NULL;
    int host = 0;
    assert_int_equal(link->ops->map(link->ctx, 0, 4096, 4096, &mapped, &host), KVS_ERR_UNSUPPORTED);
    assert_int_equal(link->ops->map(link->ctx, 0, a.ring_bytes - 10, 11, &mapped, &host),
                     KVS_ERR_INVALID);
    assert_int_equal(link->ops->map(link->ctx, 7, 0, 1, &mapped, &host), KVS_ERR_NOT_FOUND);
    tmsg_t bye = {.kind = T_BYE};
    assert_int_equal(tsend(link, &bye), KVS_OK);
    assert_int_equal(nh_reap(ch.pid, 30000), 0);
    kvs_net_stats_t st;
    assert_int_equal(kvs_net_link_stats(link, &st), KVS_OK);
    assert_int_equal(st.writes, n);
    assert_int_equal(st.writes_failed, 0);
    assert_int_equal(st.writes_in_flight, 0);
    assert_int_equal(st.rejected, 0);
    assert_true(st.wireups_received >= 1);
    assert_int_equal(st.msgs_received, n);
    assert_true(st.heartbeats_received > 0);
    kvs_link_destroy(link);
    kvs_assert_no_leaks();
}

static void test_visibility_shm(void **state)
{
    (void) state;
    run_visibility(KVS_NET_DATA_SHM);
}

static void test_visibility_tcp(void **state)
{
    (void) state;
    run_visibility(KVS_NET_DATA_TCP);
}

/* Kills the decode process while four 64 MiB writes are in flight: every one of them fails
 * within the liveness timeout plus slack, peer_status reports the death, later writes fail at
 * once, and nothing hangs. */
static void run_kill(kvs_net_data_t data)
{
    nh_shm_list_t before;
    nh_shm_snapshot(&before);
    decode_arg_t a = {.data = data, .ring_bytes = 64 * MIB, .seed = 5};
    nh_child_t ch = nh_spawn(decode_main, &a);
    kvs_link_t *link = prefill_for(&ch, data, 1, NULL);
    write_verified(link, a.seed, 0, 2, a.ring_bytes, 0, 1); /* wired and working */
    uint8_t *src = kvs_aligned_alloc(4096, 64 * MIB);
    assert_non_null(src);
    memset(src, 0x5a, 64 * MIB);
    uint64_t t[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(link->ops->write(link->ctx, 0, 0, src, 64 * MIB, &t[i]), KVS_OK);
    assert_int_equal(kill(ch.pid, SIGKILL), 0);
    uint64_t killed = kvs_now_ns();
    assert_int_equal(nh_reap(ch.pid, 30000), 128 + SIGKILL);
    const uint64_t limit_ms = LIVENESS_MS + 3000;
    uint64_t failed = 0;
    for (int i = 0; i < 4; i++) {
        /* Earlier writes may have finished before the kill (the link posts pieces of every
         * write on each call); the last one had half of its pieces unposted. */
        kvs_status_t st = wait_write(link, t[i], limit_ms);
        if (st != KVS_ERR_IO && st != KVS_ERR_TIMEOUT && (st != KVS_OK || i == 3))
            fail_msg("write %d after the kill: %s", i, kvs_status_str(st));
        failed += st != KVS_OK;
    }
    while (link->ops->peer_status(link->ctx, 0) == KVS_OK)
        assert_true(kvs_now_ns() - killed < limit_ms * MS);
    uint64_t ticket;
    assert_int_equal(link->ops->write(link->ctx, 0, 0, src, 4096, &ticket), KVS_ERR_IO);
    kvs_net_stats_t st;
    kvs_net_link_stats(link, &st);
    assert_int_equal(st.dead_peers, 1);
    assert_int_equal(st.writes_failed, failed);
    assert_int_equal(st.writes_in_flight, 0);
    kvs_free(src);
    kvs_link_destroy(link);
    nh_shm_clean(&before);
    kvs_assert_no_leaks();
}

static void test_kill_decode_mid_write_shm(void **state)
{
    (void) state;
    run_kill(KVS_NET_DATA_SHM);
}

static void test_kill_decode_mid_write_tcp(void **state)
{
    (void) state;
    run_kill(KVS_NET_DATA_TCP);
}

/* A decode rank is killed and a new one starts with another endpoint, a larger ring at another
 * address and a new rkey: prefill learns the endpoint from its heartbeats, wires up again and
 * writes land, including beyond the old ring's size. */
static int late_decode_main(int up, int down, void *argp)
{
    char go[8];
    if (read_str(down, go, sizeof(go)) != 0) return 20; /* wait for our turn */
    return decode_main(up, down, argp);
}

static void run_restart(kvs_net_data_t data)
{
    nh_shm_list_t before;
    nh_shm_snapshot(&before);
    uint64_t seed = kvs_test_seed(33);
    decode_arg_t a1 = {.data = data, .ring_bytes = 8 * MIB, .seed = seed};
    decode_arg_t a2 = {.data = data, .ring_bytes = 20 * MIB, .pad_bytes = 3 * MIB, .seed = seed};
    nh_child_t c1 = nh_spawn(decode_main, &a1);
    nh_child_t c2 = nh_spawn(late_decode_main, &a2);
    uint64_t ring1, ring2;
    kvs_link_t *link = prefill_for(&c1, data, 0, &ring1);
    write_verified(link, seed, 0, 6, a1.ring_bytes, 0, 2);
    kill(c1.pid, SIGKILL);
    assert_int_equal(nh_reap(c1.pid, 30000), 128 + SIGKILL);
    uint64_t end = kvs_now_ns() + (LIVENESS_MS + 3000) * MS;
    while (link->ops->peer_status(link->ctx, 0) == KVS_OK) assert_true(kvs_now_ns() < end);
    assert_int_equal(write_str(c2.down, "go"), 0);
    reconnect_for(&c2, link, &ring2);
    assert_true(ring1 != ring2);
    end = kvs_now_ns() + 5000 * MS;
    while (link->ops->peer_status(link->ctx, 0) != KVS_OK) assert_true(kvs_now_ns() < end);
    /* Lanes start at 8 MiB: every byte lands where the old ring had none. */
    write_verified(link, seed, 100, 12, a2.ring_bytes, 8 * MIB, 2);
    tmsg_t bye = {.kind = T_BYE};
    assert_int_equal(tsend(link, &bye), KVS_OK);
    assert_int_equal(nh_reap(c2.pid, 30000), 0);
    kvs_net_stats_t st;
    kvs_net_link_stats(link, &st);
    assert_int_equal(st.peer_restarts, 1);
    assert_int_equal(st.dead_peers, 1);
    assert_int_equal(st.writes_failed, 0);
    assert_true(st.wireups_received >= 2);
    kvs_link_destroy(link);
    nh_shm_clean(&before);
    kvs_assert_no_leaks();
}

static void test_restart_decode_shm(void **state)
{
    (void) state;
    run_restart(KVS_NET_DATA_SHM);
}

static void test_restart_decode_tcp(void **state)
{
    (void) state;
    run_restart(KVS_NET_DATA_TCP);
}

/* ---- prefill processes dying and coming back ---- */

typedef struct {
    kvs_net_data_t data;
    uint64_t seed, first, count; /* count 0: until killed */
    uint64_t len;
    int late; /* waits for "go" first */
} prefill_arg_t;

/* A prefill process without cmocka (a failed assert must not unwind into the parent's copy of
 * the test runner): writes, announces, waits for decode's check, and repeats. */
static int prefill_main(int up, int down, void *argp)
{
    const prefill_arg_t *a = argp;
    char dep[256];
    if (a->late && read_str(down, dep, sizeof(dep)) != 0) return 20;
    if (read_str(down, dep, sizeof(dep)) != 0) return 21;
    kvs_net_config_t c = net_cfg(KVS_SIDE_PREFILL, a->data);
    c.peers[0] = dep;
    kvs_link_t *link;
    if (kvs_net_link_create(&c, &link) != KVS_OK) return 22;
    if (write_str(up, kvs_net_link_endpoint(link)) != 0) return 23;
    uint8_t *src = kvs_aligned_alloc(4096, a->len);
    int code = 0;
    for (uint64_t i = a->first; code == 0 && (a->count == 0 || i < a->first + a->count); i++) {
        pat_fill(link, src, a->seed, i, a->len);
        uint64_t t, end = kvs_now_ns() + 10000 * MS;
        kvs_status_t st = link->ops->write(link->ctx, 0, 0, src, a->len, &t);
        if (st == KVS_OK) {
            while ((st = link->ops->write_poll(link->ctx, t)) == KVS_INPROGRESS &&
                   kvs_now_ns() < end) {
            }
        }
        tmsg_t m = {.kind = T_WRITTEN, .index = (uint32_t) i, .len = a->len}, ack;
        if (st != KVS_OK || tsend(link, &m) != KVS_OK) code = 24;
        while (code == 0 && !trecv(link, &ack))
            if (kvs_now_ns() > end || !nh_parent_alive()) code = 25;
        if (code == 0 && (ack.kind != T_ACK || ack.index != i || ack.len != 0)) code = 26;
    }
    tmsg_t bye = {.kind = T_BYE};
    if (code == 0 && tsend(link, &bye) != KVS_OK) code = 27;
    /* Linger so the BYE leaves before the sockets close. */
    uint64_t end = kvs_now_ns() + 200 * MS;
    while (kvs_now_ns() < end) kvs_net_link_progress(link);
    kvs_link_destroy(link);
    kvs_free(src);
    return code;
}

/* Decode side of the test: checks every announced write; returns announcements handled. */
static uint64_t decode_serve(kvs_link_t *link, const uint8_t *ring, uint64_t seed, uint64_t max,
                             int *bye_p)
{
    uint64_t n = 0;
    uint64_t end = kvs_now_ns() + 20000 * MS;
    *bye_p = 0;
    while (n < max && !*bye_p) {
        assert_true(kvs_now_ns() < end);
        tmsg_t m;
        if (!trecv(link, &m)) continue;
        if (m.kind == T_BYE) {
            *bye_p = 1;
            break;
        }
        assert_int_equal(m.kind, T_WRITTEN);
        link->ops->flush(link->ctx);
        tmsg_t ack = {.kind = T_ACK, .index = m.index};
        ack.len = pat_mismatches(link, ring, seed, m.index, m.len);
        if (ack.len != 0)
            fail_msg("seed %llu: write %u had %llu wrong bytes", (unsigned long long) seed, m.index,
                     (unsigned long long) ack.len);
        assert_int_equal(tsend(link, &ack), KVS_OK);
        n++;
    }
    return n;
}

/* A prefill process is killed mid-transfer: decode notices within the liveness timeout, lives
 * on, and serves the restarted prefill rank (new endpoint, learned from its heartbeats). */
static void run_prefill_restart(kvs_net_data_t data)
{
    nh_shm_list_t before;
    nh_shm_snapshot(&before);
    uint64_t seed = kvs_test_seed(55);
    prefill_arg_t a1 = {.data = data, .seed = seed, .first = 0, .count = 0, .len = 12 * MIB};
    prefill_arg_t a2 = {
        .data = data, .seed = seed, .first = 1000, .count = 5, .len = 12 * MIB, .late = 1};
    nh_child_t c1 = nh_spawn(prefill_main, &a1);
    nh_child_t c2 = nh_spawn(prefill_main, &a2);
    kvs_net_config_t c = net_cfg(KVS_SIDE_DECODE, data);
    kvs_link_t *link;
    assert_int_equal(kvs_net_link_create(&c, &link), KVS_OK);
    uint8_t *ring = kvs_aligned_alloc(4096, 16 * MIB);
    assert_int_equal(link->ops->expose(link->ctx, ring, 16 * MIB), KVS_OK);
    char ep[256];
    assert_int_equal(write_str(c1.down, kvs_net_link_endpoint(link)), 0);
    assert_int_equal(read_str(c1.up, ep, sizeof(ep)), 0);
    assert_int_equal(kvs_net_link_set_peer(link, 0, ep), KVS_OK); /* as from a registry */
    int bye;
    assert_int_equal(decode_serve(link, ring, seed, 3, &bye), 3);
    /* It is writing the next one now: kill it. */
    assert_int_equal(kill(c1.pid, SIGKILL), 0);
    assert_int_equal(nh_reap(c1.pid, 30000), 128 + SIGKILL);
    uint64_t killed = kvs_now_ns();
    while (link->ops->peer_status(link->ctx, 0) == KVS_OK)
        assert_true(kvs_now_ns() - killed < (LIVENESS_MS + 3000) * MS);
    assert_int_equal(write_str(c2.down, "go"), 0);
    assert_int_equal(write_str(c2.down, kvs_net_link_endpoint(link)), 0);
    assert_int_equal(read_str(c2.up, ep, sizeof(ep)), 0);
    assert_int_equal(decode_serve(link, ring, seed, 1000, &bye), 5);
    if (!bye) assert_int_equal(decode_serve(link, ring, seed, 1, &bye), 0);
    assert_true(bye);
    assert_int_equal(nh_reap(c2.pid, 30000), 0);
    kvs_net_stats_t st;
    kvs_net_link_stats(link, &st);
    assert_int_equal(st.peer_restarts, 1);
    assert_true(st.dead_peers >= 1);
    assert_int_equal(st.rejected, 0);
    assert_true(st.wireups_sent >= 2);
    link->ops->expose(link->ctx, NULL, 0);
    kvs_link_destroy(link);
    kvs_free(ring);
    nh_shm_clean(&before);
    kvs_assert_no_leaks();
}

static void test_prefill_restart_shm(void **state)
{
    (void) state;
    run_prefill_restart(KVS_NET_DATA_SHM);
}

static void test_prefill_restart_tcp(void **state)
{
    (void) state;
    run_prefill_restart(KVS_NET_DATA_TCP);
}

/* ---- one process, two links ---- */

typedef struct {
    kvs_link_t *p, *d;
} pair_t;

/* prefill_peers > 1 gives prefill decode ranks that do not exist (for rogue frames). */
static pair_t pair_make_tp(kvs_net_data_t data, uint64_t connect_ms, uint32_t prefill_peers)
{
    pair_t pr;
    kvs_net_config_t dc = net_cfg(KVS_SIDE_DECODE, data);
    dc.connect_timeout_ns = connect_ms * MS;
    assert_int_equal(kvs_net_link_create(&dc, &pr.d), KVS_OK);
    kvs_net_config_t pc = net_cfg(KVS_SIDE_PREFILL, data);
    pc.peer_tp = prefill_peers;
    pc.connect_timeout_ns = connect_ms * MS;
    pc.peers[0] = kvs_net_link_endpoint(pr.d);
    assert_int_equal(kvs_net_link_create(&pc, &pr.p), KVS_OK);
    return pr;
}

static pair_t pair_make(kvs_net_data_t data, uint64_t connect_ms)
{
    return pair_make_tp(data, connect_ms, 1);
}

static void pair_destroy(pair_t *pr)
{
    kvs_link_destroy(pr->p);
    kvs_link_destroy(pr->d);
}

/* Drives both links until the write completes. */
static kvs_status_t pair_wait(pair_t *pr, uint64_t ticket)
{
    uint64_t end = kvs_now_ns() + 10000 * MS;
    kvs_status_t st;
    while ((st = pr->p->ops->write_poll(pr->p->ctx, ticket)) == KVS_INPROGRESS) {
        kvs_net_link_progress(pr->d);
        if (kvs_now_ns() > end) fail_msg("write still running after 10 s");
    }
    return st;
}

static void test_wireup_timeout(void **state)
{
    (void) state;
    pair_t pr = pair_make(KVS_NET_DATA_SHM, 400);
    uint8_t src[64] = {0};
    uint64_t t;
    /* Decode never exposes a ring: the write waits for a wireup that never comes. */
    assert_int_equal(pr.p->ops->write(pr.p->ctx, 0, 0, src, sizeof(src), &t), KVS_OK);
    uint64_t t0 = kvs_now_ns();
    assert_int_equal(pair_wait(&pr, t), KVS_ERR_TIMEOUT);
    uint64_t took = kvs_now_ns() - t0;
    assert_true(took >= 350 * MS && took < 3000 * MS);
    assert_int_equal(pr.p->ops->peer_status(pr.p->ctx, 0), KVS_OK); /* alive, just no ring */
    kvs_net_stats_t st;
    kvs_net_link_stats(pr.p, &st);
    assert_true(st.wireups_sent >= 2); /* asked again while waiting */
    pair_destroy(&pr);
    kvs_assert_no_leaks();
}

/* kvs_net_link_wait sleeps for its timeout when nothing comes, and wakes at once for a control
 * message (one arriving, or one already waiting) and for the caller's fd. Heartbeats are slowed
 * to one a minute so that none wakes it. */
static double wait_ms(kvs_link_t *const *links, uint32_t n, int fd, uint64_t timeout_us, int *woke)
{
    const uint64_t t0 = kvs_now_ns();
    *woke = kvs_net_link_wait(links, n, fd, timeout_us);
    return (double) (kvs_now_ns() - t0) / 1e6;
}

static void test_wait_wakes_on_message(void **state)
{
    (void) state;
    kvs_net_config_t dc = net_cfg(KVS_SIDE_DECODE, KVS_NET_DATA_SHM);
    dc.heartbeat_ns = 60000 * MS;
    dc.liveness_timeout_ns = 120000 * MS;
    kvs_link_t *d = NULL, *p = NULL;
    assert_int_equal(kvs_net_link_create(&dc, &d), KVS_OK);
    kvs_net_config_t pc = net_cfg(KVS_SIDE_PREFILL, KVS_NET_DATA_SHM);
    pc.heartbeat_ns = dc.heartbeat_ns;
    pc.liveness_timeout_ns = dc.liveness_timeout_ns;
    pc.peers[0] = kvs_net_link_endpoint(d);
    assert_int_equal(kvs_net_link_create(&pc, &p), KVS_OK);
    /* Connected both ways: a message from prefill reaches decode (and its first heartbeats).
     * Sent before prefill's connection is up, it is held until prefill's link progresses. */
    tmsg_t m = {.kind = 7, .index = 1};
    assert_int_equal(tsend(p, &m), KVS_OK);
    tmsg_t got;
    int woke = 0;
    for (uint64_t end = kvs_now_ns() + 5000 * MS; !trecv(d, &got);) {
        kvs_net_link_progress(p);
        if (kvs_now_ns() > end) fail_msg("no message within 5 s");
    }
    while (trecv(d, &got)) {
    }
    kvs_net_link_progress(d);
    kvs_link_t *links[] = {NULL, d};
    /* Nothing comes: the whole timeout. */
    double ms = wait_ms(links, 2, -1, 60000, &woke);
    assert_int_equal(woke, 0);
    assert_true(ms >= 55.0);
    /* A message on its way wakes it long before the timeout. */
    m.index = 2;
    assert_int_equal(tsend(p, &m), KVS_OK);
    ms = wait_ms(links, 2, -1, 10000000, &woke);
    assert_int_equal(woke, 1);
    assert_true(ms < 2000.0);
    /* Two waiting: the wait returns at once while one is still to be taken. */
    m.index = 3;
    assert_int_equal(tsend(p, &m), KVS_OK);
    for (uint64_t end = kvs_now_ns() + 5000 * MS; !trecv(d, &got) || got.index != 2;)
        if (kvs_now_ns() > end) fail_msg("message 2 not taken within 5 s");
    for (uint64_t end = kvs_now_ns() + 5000 * MS; kvs_now_ns() < end;) {
        ms = wait_ms(links, 2, -1, 10000000, &woke);
        assert_int_equal(woke, 1);
        if (trecv(d, &got)) break;
    }
    assert_int_equal(got.index, 3);
    /* The caller's fd wakes it too; links that are not net links are skipped. */
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    assert_int_equal(write(fds[1], "x", 1), 1);
    ms = wait_ms(links, 2, fds[0], 10000000, &woke);
    assert_int_equal(woke, 1);
    assert_true(ms < 2000.0);
    close(fds[0]);
    close(fds[1]);
    ms = wait_ms(links, 1, -1, 20000, &woke);
    assert_int_equal(woke, 0);
    assert_true(ms >= 15.0);
    kvs_link_destroy(p);
    kvs_link_destroy(d);
    kvs_assert_no_leaks();
}

/* Shared memory on one side and tcp on the other cannot meet: writes fail at once with a clear
 * error instead of waiting for their deadline. */
static void test_mismatched_transports(void **state)
{
    (void) state;
    kvs_net_config_t dc = net_cfg(KVS_SIDE_DECODE, KVS_NET_DATA_SHM);
    kvs_link_t *d, *p;
    assert_int_equal(kvs_net_link_create(&dc, &d), KVS_OK);
    kvs_net_config_t pc = net_cfg(KVS_SIDE_PREFILL, KVS_NET_DATA_TCP);
    pc.peers[0] = kvs_net_link_endpoint(d);
    pc.connect_timeout_ns = 20000 * MS;
    assert_int_equal(kvs_net_link_create(&pc, &p), KVS_OK);
    uint8_t *ring = kvs_aligned_alloc(4096, MIB);
    assert_int_equal(d->ops->expose(d->ctx, ring, MIB), KVS_OK);
    uint8_t src[64] = {0};
    uint64_t t;
    uint64_t t0 = kvs_now_ns();
    uint8_t *mapped = NULL;
    int host = 0;
    /* Not wired up yet: a direct write would wait and ask again. */
    assert_int_equal(p->ops->map(p->ctx, 0, 0, sizeof(src), &mapped, &host), KVS_INPROGRESS);
    assert_int_equal(p->ops->write(p->ctx, 0, 0, src, sizeof(src), &t), KVS_OK);
    kvs_status_t st;
    while ((st = p->ops->write_poll(p->ctx, t)) == KVS_INPROGRESS) {
        kvs_net_link_progress(d);
        assert_true(kvs_now_ns() - t0 < 10000 * MS);
    }
    assert_int_equal(st, KVS_ERR_INCOMPATIBLE);
    /* The refused wireup: a direct write fails at once with it too, instead of waiting. */
    assert_int_equal(p->ops->map(p->ctx, 0, 0, sizeof(src), &mapped, &host), KVS_ERR_INCOMPATIBLE);
    d->ops->expose(d->ctx, NULL, 0);
    kvs_link_destroy(p);
    kvs_link_destroy(d);
    kvs_free(ring);
    kvs_assert_no_leaks();
}

static void test_argument_checks(void **state)
{
    (void) state;
    pair_t pr = pair_make(KVS_NET_DATA_SHM, 3000);
    uint8_t *ring = kvs_aligned_alloc(4096, MIB);
    uint8_t src[256];
    memset(src, 1, sizeof(src));
    uint64_t t;
    assert_int_equal(pr.d->ops->expose(pr.d->ctx, ring, MIB), KVS_OK);
    assert_int_equal(pr.p->ops->expose(pr.p->ctx, ring, MIB), KVS_ERR_INVALID);
    assert_int_equal(pr.d->ops->write(pr.d->ctx, 0, 0, src, 1, &t), KVS_ERR_INVALID);
    assert_int_equal(pr.p->ops->write(pr.p->ctx, 1, 0, src, 1, &t), KVS_ERR_INVALID);
    assert_int_equal(pr.p->ops->write_poll(pr.p->ctx, 12345), KVS_ERR_NOT_FOUND);
    assert_int_equal(pr.p->ops->peer_status(pr.p->ctx, 1), KVS_ERR_INVALID);
    assert_int_equal(pr.p->ops->send(pr.p->ctx, 0, src, KVS_MSG_MAX_SIZE + 1), KVS_ERR_INVALID);
    /* Out of the ring: known only once wired up, so the write fails at poll time. */
    assert_int_equal(pr.p->ops->write(pr.p->ctx, 0, MIB - 8, src, 16, &t), KVS_OK);
    assert_int_equal(pair_wait(&pr, t), KVS_ERR_INVALID);
    assert_int_equal(pr.p->ops->write(pr.p->ctx, 0, MIB - 16, src, 16, &t), KVS_OK);
    assert_int_equal(pair_wait(&pr, t), KVS_OK);
    assert_memory_equal(ring + MIB - 16, src, 16);
    assert_int_equal(pr.p->ops->write(pr.p->ctx, 0, 0, src, 0, &t), KVS_OK); /* empty */
    assert_int_equal(pair_wait(&pr, t), KVS_OK);
    /* A message larger than the caller's buffer is dropped and reported. */
    uint64_t end = kvs_now_ns() + 5000 * MS;
    while (pr.d->ops->send(pr.d->ctx, 0, src, 200) != KVS_OK) assert_true(kvs_now_ns() < end);
    uint8_t small[100];
    size_t len;
    kvs_status_t st;
    while ((st = pr.p->ops->recv(pr.p->ctx, small, sizeof(small), &len, NULL)) == KVS_INPROGRESS)
        assert_true(kvs_now_ns() < end);
    assert_int_equal(st, KVS_ERR_PROTOCOL);
    assert_null(kvs_net_link_endpoint(NULL));
    kvs_net_config_t bad = net_cfg(KVS_SIDE_PREFILL, KVS_NET_DATA_SHM);
    kvs_link_t *l;
    bad.peer_tp = 0;
    assert_int_equal(kvs_net_link_create(&bad, &l), KVS_ERR_INVALID);
    bad = net_cfg(KVS_SIDE_PREFILL, KVS_NET_DATA_SHM);
    bad.bind = "tcp://256.1.1.1:0";
    assert_int_not_equal(kvs_net_link_create(&bad, &l), KVS_OK);
    pr.d->ops->expose(pr.d->ctx, NULL, 0);
    pair_destroy(&pr);
    kvs_free(ring);
    kvs_assert_no_leaks();
}

/* Decode exposes a new ring: prefill's next writes land in it, not in the old one. */
static void test_reexpose(void **state)
{
    (void) state;
    pair_t pr = pair_make(KVS_NET_DATA_SHM, 3000);
    uint8_t *a = kvs_aligned_alloc(4096, MIB), *b = kvs_aligned_alloc(4096, 2 * MIB);
    memset(a, 0, MIB);
    memset(b, 0, 2 * MIB);
    uint8_t src[4096];
    memset(src, 0xab, sizeof(src));
    uint64_t t;
    assert_int_equal(pr.d->ops->expose(pr.d->ctx, a, MIB), KVS_OK);
    assert_int_equal(pr.p->ops->write(pr.p->ctx, 0, 100, src, sizeof(src), &t), KVS_OK);
    assert_int_equal(pair_wait(&pr, t), KVS_OK);
    assert_memory_equal(a + 100, src, sizeof(src));
    assert_int_equal(pr.d->ops->expose(pr.d->ctx, b, 2 * MIB), KVS_OK);
    memset(src, 0xcd, sizeof(src));
    /* Until the new wireup lands a write may still go to the old ring or fail; after it, every
     * write goes to the new one. */
    kvs_net_stats_t st;
    uint64_t end = kvs_now_ns() + 5000 * MS;
    do {
        kvs_net_link_progress(pr.d);
        kvs_net_link_progress(pr.p);
        kvs_net_link_stats(pr.p, &st);
        assert_true(kvs_now_ns() < end);
    } while (st.wireups_received < 2);
    assert_int_equal(pr.p->ops->write(pr.p->ctx, 0, MIB + 100, src, sizeof(src), &t), KVS_OK);
    assert_int_equal(pair_wait(&pr, t), KVS_OK);
    assert_memory_equal(b + MIB + 100, src, sizeof(src));
    assert_int_equal(a[100], 0xab);
    pr.d->ops->expose(pr.d->ctx, NULL, 0);
    pair_destroy(&pr);
    kvs_free(a);
    kvs_free(b);
    kvs_assert_no_leaks();
}

/* Malformed wireup frames from a rogue sender are counted and dropped; a real wireup after
 * them still works. */
static void test_hostile_wireup(void **state)
{
    (void) state;
    /* The rogue claims to be decode rank 1, which prefill knows of but which never runs. */
    pair_t pr = pair_make_tp(KVS_NET_DATA_SHM, 3000, 2);
    void *zctx = zmq_ctx_new();
    void *s = zmq_socket(zctx, ZMQ_PUSH);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    assert_int_equal(zmq_connect(s, kvs_net_link_endpoint(pr.p)), 0);
    static uint8_t b[KVS_ZCH_HEADER_SIZE + 256];
    kvs_rng_t rng;
    uint64_t seed = kvs_test_seed(44);
    kvs_rng_seed(&rng, seed);
    int sent = 0;
    for (int i = 0; i < 40; i++, sent++) {
        memset(b, 0, sizeof(b));
        b[0] = KVS_ZCH_WIREUP;
        b[1] = KVS_ZCH_VERSION;
        b[2] = KVS_SIDE_DECODE;
        b[4] = 1; /* rank 1 */
        b[8] = 1; /* incarnation 1 */
        size_t len = KVS_ZCH_HEADER_SIZE + kvs_rng_below(&rng, 200);
        for (size_t j = KVS_ZCH_HEADER_SIZE; j < len; j++) b[j] = (uint8_t) kvs_rng_next(&rng);
        assert_int_equal(zmq_send(s, b, len, 0), (int) len);
    }
    /* A WIREUP_REQ to a prefill rank is wrong too. */
    b[0] = KVS_ZCH_WIREUP_REQ;
    assert_int_equal(zmq_send(s, b, KVS_ZCH_HEADER_SIZE, 0), KVS_ZCH_HEADER_SIZE);
    sent++;
    kvs_net_stats_t st;
    uint64_t end = kvs_now_ns() + 5000 * MS;
    do {
        kvs_net_link_progress(pr.p);
        kvs_net_link_stats(pr.p, &st);
        assert_true(kvs_now_ns() < end);
    } while (st.rejected < (uint64_t) sent);
    assert_int_equal(st.rejected, sent);
    zmq_close(s);
    zmq_ctx_term(zctx);
    uint8_t *ring = kvs_aligned_alloc(4096, MIB);
    uint8_t src[512];
    memset(src, 0x3c, sizeof(src));
    uint64_t t;
    assert_int_equal(pr.d->ops->expose(pr.d->ctx, ring, MIB), KVS_OK);
    assert_int_equal(pr.p->ops->write(pr.p->ctx, 0, 4096, src, sizeof(src), &t), KVS_OK);
    assert_int_equal(pair_wait(&pr, t), KVS_OK);
    assert_memory_equal(ring + 4096, src, sizeof(src));
    pr.d->ops->expose(pr.d->ctx, NULL, 0);
    pair_destroy(&pr);
    kvs_free(ring);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_visibility_shm, nh_kill_children),
        cmocka_unit_test_teardown(test_visibility_tcp, nh_kill_children),
        cmocka_unit_test_teardown(test_kill_decode_mid_write_shm, nh_kill_children),
        cmocka_unit_test_teardown(test_kill_decode_mid_write_tcp, nh_kill_children),
        cmocka_unit_test_teardown(test_restart_decode_shm, nh_kill_children),
        cmocka_unit_test_teardown(test_restart_decode_tcp, nh_kill_children),
        cmocka_unit_test_teardown(test_prefill_restart_shm, nh_kill_children),
        cmocka_unit_test_teardown(test_prefill_restart_tcp, nh_kill_children),
        cmocka_unit_test_teardown(test_wireup_timeout, nh_kill_children),
        cmocka_unit_test_teardown(test_wait_wakes_on_message, nh_kill_children),
        cmocka_unit_test_teardown(test_mismatched_transports, nh_kill_children),
        cmocka_unit_test_teardown(test_argument_checks, nh_kill_children),
        cmocka_unit_test_teardown(test_reexpose, nh_kill_children),
        cmocka_unit_test_teardown(test_hostile_wireup, nh_kill_children),
    };
    const char *filter = getenv("KVS_TEST_FILTER"); /* e.g. "*restart*" */
    if (filter != NULL) cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
