/* Tests for the ZeroMQ control channel of the net link: frames both ways between two channels
 * in threads and across fork(), malformed, oversized, truncated and stale frames counted and
 * dropped, sends that never block on a dead or stopped peer, liveness, restarts and endpoints
 * learned from heartbeats, peer groups (several instances of the other side told apart). */
#include "kvs_test.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "control/zmq_channel.h"
#include "kvstage/clock.h"
#include "kvstage/msg.h"
#include "kvstage/rng.h"

#define MS 1000000ull

static kvs_zch_t *make_live(kvs_side_t side, uint32_t rank, uint32_t peer_tp, const char *bind,
                            uint64_t liveness_ms)
{
    kvs_zch_config_t c = {.side = side,
                          .rank = rank,
                          .peer_tp = peer_tp,
                          .bind = bind,
                          .heartbeat_ns = 10 * MS,
                          .liveness_timeout_ns = liveness_ms * MS,
                          .connect_timeout_ns = 1000 * MS};
    kvs_zch_t *ch = NULL;
    assert_int_equal(kvs_zch_create(&c, &ch), KVS_OK);
    return ch;
}

static kvs_zch_t *make(kvs_side_t side, uint32_t rank, uint32_t peer_tp, const char *bind)
{
    return make_live(side, rank, peer_tp, bind, 300);
}

/* Receives and ticks for up to ms milliseconds, or until a frame comes (returns 1). */
static int pump(kvs_zch_t *ch, uint64_t ms, kvs_zch_frame_t *f_p)
{
    uint64_t end = kvs_now_ns() + ms * MS;
    kvs_zch_frame_t f;
    do {
        kvs_zch_tick(ch);
        if (kvs_zch_recv(ch, f_p ? f_p : &f) == KVS_OK) return 1;
    } while (kvs_now_ns() < end);
    return 0;
}

/* The child process of the running test; the teardown kills it if a failed test left it. */
static pid_t g_child;

static int kill_child(void **state)
{
    (void) state;
    if (g_child > 0 && waitpid(g_child, NULL, WNOHANG) == 0) {
        kill(g_child, SIGKILL);
        waitpid(g_child, NULL, 0);
    }
    g_child = 0;
    return 0;
}

/* Message i: a length in [1, KVS_MSG_MAX_SIZE] and bytes both sides can recompute. */
static size_t msg_fill(uint64_t i, uint8_t *buf)
{
    size_t len = 1 + (size_t) (kvs_mix64(i) % KVS_MSG_MAX_SIZE);
    for (size_t b = 0; b < len; b++) buf[b] = (uint8_t) kvs_mix64(i * 7919 + b);
    return len;
}

/* The echo side: returns every MSG with its bytes inverted, until `count` were echoed. */
static int echo(kvs_zch_t *ch, uint64_t count)
{
    uint64_t done = 0;
    uint64_t end = kvs_now_ns() + 20000 * MS;
    uint8_t out[KVS_MSG_MAX_SIZE];
    while (done < count && kvs_now_ns() < end) {
        kvs_zch_frame_t f;
        kvs_zch_tick(ch);
        if (kvs_zch_recv(ch, &f) != KVS_OK || f.kind != KVS_ZCH_MSG) continue;
        for (size_t b = 0; b < f.len; b++) out[b] = (uint8_t) ~f.payload[b];
        size_t len = f.len;
        uint64_t give_up = kvs_now_ns() + 5000 * MS;
        while (kvs_zch_send(ch, f.from, KVS_ZCH_MSG, out, len) != KVS_OK) {
            if (kvs_now_ns() > give_up) return 0;
            kvs_zch_tick(ch);
        }
        done++;
    }
    return done == count;
}

/* The initiating side: sends n messages, checks every echo, in order. */
static void exchange(kvs_zch_t *ch, uint64_t n)
{
    uint8_t want[KVS_MSG_MAX_SIZE];
    uint64_t sent = 0, got = 0;
    uint64_t end = kvs_now_ns() + 20000 * MS;
    while (got < n) {
        if (kvs_now_ns() > end)
            fail_msg("only %llu of %llu echoes", (unsigned long long) got, (unsigned long long) n);
        if (sent < n && sent < got + 64) {
            size_t len = msg_fill(sent, want);
            if (kvs_zch_send(ch, 0, KVS_ZCH_MSG, want, len) == KVS_OK) sent++;
        }
        kvs_zch_frame_t f;
        kvs_zch_tick(ch);
        if (kvs_zch_recv(ch, &f) != KVS_OK) continue;
        assert_int_equal(f.kind, KVS_ZCH_MSG);
        assert_int_equal(f.from, 0);
        size_t len = msg_fill(got, want);
        assert_int_equal(f.len, len);
        for (size_t b = 0; b < len; b++)
            if ((uint8_t) (f.payload[b] ^ want[b]) != 0xff)
                fail_msg("echo %llu byte %zu differs", (unsigned long long) got, b);
        got++;
    }
    kvs_zch_stats_t st;
    kvs_zch_stats(ch, &st);
    assert_int_equal(st.sent, n);
    assert_int_equal(st.received, n);
    assert_int_equal(st.rejected, 0);
}

typedef struct {
    kvs_zch_t *ch;
    uint64_t n;
    int ok;
} echo_arg_t;

static void *echo_thread(void *arg)
{
    echo_arg_t *a = arg;
    a->ok = echo(a->ch, a->n);
    return NULL;
}

static void test_threads_both_ways(void **state)
{
    (void) state;
    kvs_zch_t *p = make(KVS_SIDE_PREFILL, 0, 1, "tcp://127.0.0.1:0");
    kvs_zch_t *d = make(KVS_SIDE_DECODE, 0, 1, "tcp://127.0.0.1:*");
    assert_string_not_equal(kvs_zch_endpoint(p), "tcp://127.0.0.1:0");
    assert_true(strncmp(kvs_zch_endpoint(d), "tcp://127.0.0.1:", 16) == 0);
    assert_int_equal(kvs_zch_set_peer(p, 0, kvs_zch_endpoint(d)), KVS_OK);
    assert_int_equal(kvs_zch_set_peer(d, 0, kvs_zch_endpoint(p)), KVS_OK);
    assert_true(kvs_zch_incarnation(p) != kvs_zch_incarnation(d));
    echo_arg_t arg = {.ch = d, .n = kvs_test_iters(3000)};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, echo_thread, &arg), 0);
    exchange(p, arg.n);
    pthread_join(t, NULL);
    assert_true(arg.ok);
    assert_int_equal(kvs_zch_peer_status(p, 0), KVS_OK);
    assert_int_equal(kvs_zch_peer_incarnation(p, 0), kvs_zch_incarnation(d));
    kvs_zch_destroy(p);
    kvs_zch_destroy(d);
    kvs_assert_no_leaks();
}

static int read_full(int fd, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *) buf + got, n - got);
        if (r <= 0) return -1;
        got += (size_t) r;
    }
    return 0;
}

static void write_str(int fd, const char *s)
{
    uint32_t n = (uint32_t) strlen(s);
    assert_int_equal(write(fd, &n, 4), 4);
    assert_int_equal(write(fd, s, n), (ssize_t) n);
}

static int read_str(int fd, char *buf, size_t cap)
{
    uint32_t n;
    if (read_full(fd, &n, 4) != 0 || n >= cap || read_full(fd, buf, n) != 0) return -1;
    buf[n] = '\0';
    return 0;
}

/* Across fork() over ipc:// and tcp: the child is the decode rank and echoes. */
static void run_fork(const char *parent_bind, const char *child_bind)
{
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    uint64_t n = kvs_test_iters(2000);
    pid_t pid = fork();
    g_child = pid;
    assert_true(pid >= 0);
    if (pid == 0) {
        kvs_alloc_stats_t before; /* the parent's blocks came along with fork() */
        kvs_alloc_stats(&before);
        kvs_zch_config_t c = {.side = KVS_SIDE_DECODE,
                              .rank = 0,
                              .peer_tp = 1,
                              .bind = child_bind,
                              .heartbeat_ns = 10 * MS,
                              .liveness_timeout_ns = 300 * MS,
                              .connect_timeout_ns = 1000 * MS};
        kvs_zch_t *ch;
        char ep[512];
        if (kvs_zch_create(&c, &ch) != KVS_OK) _exit(2);
        write_str(up[1], kvs_zch_endpoint(ch));
        if (read_str(down[0], ep, sizeof(ep)) != 0 || kvs_zch_set_peer(ch, 0, ep) != KVS_OK)
            _exit(3);
        int ok = echo(ch, n);
        /* Stay until the parent says it got everything (its last echoes must go out). */
        char done[8];
        if (read_str(down[0], done, sizeof(done)) != 0) ok = 0;
        kvs_zch_destroy(ch);
        kvs_alloc_stats_t as;
        kvs_alloc_stats(&as);
        _exit(ok && as.live_blocks == before.live_blocks ? 0 : 4);
    }
    kvs_zch_t *ch = make(KVS_SIDE_PREFILL, 0, 1, parent_bind);
    char ep[512];
    assert_int_equal(read_str(up[0], ep, sizeof(ep)), 0);
    assert_int_equal(kvs_zch_set_peer(ch, 0, ep), KVS_OK);
    write_str(down[1], kvs_zch_endpoint(ch));
    exchange(ch, n);
    write_str(down[1], "done");
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    kvs_zch_destroy(ch);
    close(up[0]);
    close(up[1]);
    close(down[0]);
    close(down[1]);
    kvs_assert_no_leaks();
}

static void test_fork_tcp(void **state)
{
    (void) state;
    run_fork("tcp://127.0.0.1:0", "tcp://127.0.0.1:0");
}

static void test_fork_ipc(void **state)
{
    (void) state;
    char dir[] = "/tmp/kvs-zch-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char a[128], b[128];
    snprintf(a, sizeof(a), "ipc://%s/prefill", dir);
    snprintf(b, sizeof(b), "ipc://%s/decode", dir);
    run_fork(a, b);
    unlink(a + 6);
    unlink(b + 6);
    assert_int_equal(rmdir(dir), 0);
}

/* ---- hostile input ---- */

static size_t header(uint8_t *b, uint8_t kind, uint8_t version, uint8_t side, uint32_t rank,
                     uint64_t inc)
{
    b[0] = kind;
    b[1] = version;
    b[2] = side;
    b[3] = 0;
    for (int i = 0; i < 4; i++) b[4 + i] = (uint8_t) (rank >> (8 * i));
    for (int i = 0; i < 8; i++) b[8 + i] = (uint8_t) (inc >> (8 * i));
    memset(b + 16, 0, 8); /* instance 0 */
    return KVS_ZCH_HEADER_SIZE;
}

static void raw_send(void *sock, const void *buf, size_t len, int flags)
{
    assert_int_equal(zmq_send(sock, buf, len, flags), (int) len);
}

/* Expects exactly one MSG frame with the given payload next, and nothing else. */
static void expect_only(kvs_zch_t *ch, uint32_t from, const char *payload)
{
    kvs_zch_frame_t f;
    assert_true(pump(ch, 5000, &f));
    assert_int_equal(f.kind, KVS_ZCH_MSG);
    assert_int_equal(f.from, from);
    assert_int_equal(f.len, strlen(payload));
    assert_memory_equal(f.payload, payload, f.len);
}

static void test_rejects_hostile_frames(void **state)
{
    (void) state;
    /* A long liveness timeout: the stale-frame check below must not race it. */
    kvs_zch_t *d = make_live(KVS_SIDE_DECODE, 0, 2, "tcp://127.0.0.1:0", 10000);
    void *zctx = zmq_ctx_new();
    void *s = zmq_socket(zctx, ZMQ_PUSH);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    assert_int_equal(zmq_connect(s, kvs_zch_endpoint(d)), 0);
    static uint8_t b[KVS_ZCH_HEADER_SIZE + KVS_ZCH_INTERNAL_MAX + 16];
    const uint8_t P = KVS_SIDE_PREFILL, D = KVS_SIDE_DECODE, V = KVS_ZCH_VERSION;
    const size_t H = KVS_ZCH_HEADER_SIZE;
    uint32_t bad = 0;
    raw_send(s, b, 0, 0), bad++;                                     /* empty */
    raw_send(s, "\x01\x01\x00", 3, 0), bad++;                        /* truncated header */
    header(b, 99, V, P, 0, 5), raw_send(s, b, H, 0), bad++;          /* unknown kind */
    header(b, 0, V, P, 0, 5), raw_send(s, b, H, 0), bad++;           /* kind 0 */
    header(b, 1, V + 1, P, 0, 5), raw_send(s, b, H, 0), bad++;       /* version */
    header(b, 1, V, D, 0, 5), raw_send(s, b, H, 0), bad++;           /* from our own side */
    header(b, 1, V, 7, 0, 5), raw_send(s, b, H, 0), bad++;           /* no such side */
    header(b, 1, V, P, 2, 5), raw_send(s, b, H, 0), bad++;           /* rank >= peer_tp */
    header(b, 1, V, P, 0, 0), raw_send(s, b, H, 0), bad++;           /* incarnation 0 */
    header(b, 1, V, P, 0, 5), b[3] = 1, raw_send(s, b, H, 0), bad++; /* reserved byte */
    header(b, 1, V, P, 0, 5);
    raw_send(s, b, H + KVS_MSG_MAX_SIZE + 1, 0), bad++; /* oversized protocol message */
    header(b, 4, V, P, 0, 5);
    raw_send(s, b, H + KVS_ZCH_INTERNAL_MAX + 1, 0), bad++; /* oversized internal frame */
    header(b, 2, V, P, 0, 5);
    raw_send(s, b, H + 5, 0), bad++; /* heartbeat shorter than its fixed part */
    memset(b + H, 0, 10);
    b[H + 8] = 40; /* endpoint length 40, none given */
    raw_send(s, b, H + 10 + 3, 0), bad++;
    memcpy(b + H + 10, "tcp://1\x01\x02", 9); /* unprintable endpoint */
    b[H + 8] = 9;
    raw_send(s, b, H + 10 + 9, 0), bad++;
    header(b, 1, V, P, 0, 5);
    raw_send(s, b, H, ZMQ_SNDMORE), raw_send(s, b, H, 0), bad++; /* multi-part */
    kvs_rng_t rng;
    uint64_t seed = kvs_test_seed(11);
    kvs_rng_seed(&rng, seed);
    for (int i = 0; i < 64; i++, bad++) {
        size_t len = kvs_rng_below(&rng, 200);
        for (size_t j = 0; j < len; j++) b[j] = (uint8_t) kvs_rng_next(&rng);
        if (len > 1 && b[1] == KVS_ZCH_VERSION) b[1] = 0; /* never valid by accident */
        raw_send(s, b, len, 0);
    }
    /* The largest valid protocol message gets through, then a marker. */
    header(b, 1, V, P, 1, 5);
    memset(b + H, 'x', KVS_MSG_MAX_SIZE);
    raw_send(s, b, H + KVS_MSG_MAX_SIZE, 0);
    header(b, 1, V, P, 0, 5);
    memcpy(b + H, "ok", 2);
    raw_send(s, b, H + 2, 0);
    kvs_zch_frame_t f;
    assert_true(pump(d, 5000, &f));
    assert_int_equal(f.from, 1);
    assert_int_equal(f.len, KVS_MSG_MAX_SIZE);
    expect_only(d, 0, "ok");
    kvs_zch_stats_t st;
    kvs_zch_stats(d, &st);
    if (st.rejected != bad)
        fail_msg("seed %llu: %llu frames rejected, %u expected", (unsigned long long) seed,
                 (unsigned long long) st.rejected, bad);
    assert_int_equal(st.received, 2);

    /* A late frame from rank 0's earlier life is stale while that life is alive; a later life is
     * a restart. */
    header(b, 1, V, P, 0, 4);
    memcpy(b + H, "old", 3);
    raw_send(s, b, H + 3, 0);
    header(b, 1, V, P, 0, 6);
    memcpy(b + H, "new", 3);
    raw_send(s, b, H + 3, 0);
    expect_only(d, 0, "new");
    kvs_zch_stats(d, &st);
    assert_int_equal(st.stale, 1);
    assert_int_equal(st.restarts, 1);
    assert_int_equal(kvs_zch_peer_incarnation(d, 0), 6);
    assert_false(pump(d, 50, NULL));

    /* The channel refuses to send what the other end would reject. */
    assert_int_equal(kvs_zch_send(d, 0, KVS_ZCH_MSG, b, KVS_MSG_MAX_SIZE + 1), KVS_ERR_INVALID);
    assert_int_equal(kvs_zch_send(d, 2, KVS_ZCH_MSG, b, 1), KVS_ERR_INVALID);
    assert_int_equal(kvs_zch_send(d, 0, KVS_ZCH_HEARTBEAT, b, 1), KVS_ERR_INVALID);
    assert_int_equal(kvs_zch_set_peer(d, 0, ""), KVS_ERR_INVALID);
    assert_int_equal(kvs_zch_set_peer(d, 0, "bogus://x"), KVS_ERR_INVALID);
    zmq_close(s);
    zmq_ctx_term(zctx);
    kvs_zch_destroy(d);
    kvs_assert_no_leaks();
}

/* ---- failures of the other side ---- */

/* A loopback endpoint nobody listens on, kept so until *fd_p is closed. */
static void dead_endpoint(char *buf, size_t cap, int *fd_p)
{
    snprintf(buf, cap, "tcp://127.0.0.1:%u", kvs_test_dead_port(fd_p));
}

static void test_dead_peer_never_blocks(void **state)
{
    (void) state;
    char ep[256];
    int dead_fd;
    dead_endpoint(ep, sizeof(ep), &dead_fd);
    kvs_zch_t *p = make(KVS_SIDE_PREFILL, 0, 1, "tcp://127.0.0.1:0");
    /* No endpoint yet: held, as are the first frames after it while the connection may still
     * come up; then sends fail. */
    assert_int_equal(kvs_zch_send(p, 0, KVS_ZCH_MSG, "x", 1), KVS_OK);
    assert_int_equal(kvs_zch_set_peer(p, 0, ep), KVS_OK);
    uint64_t t0 = kvs_now_ns();
    for (int i = 0; i < 20000; i++)
        assert_int_equal(kvs_zch_send(p, 0, KVS_ZCH_MSG, "hello", 5),
                         i < KVS_ZCH_OUTBOX_MAX - 1 ? KVS_OK : KVS_ERR_IO);
    assert_true(kvs_now_ns() - t0 < 2000 * MS);
    assert_int_equal(kvs_zch_peer_status(p, 0), KVS_OK); /* still within the connect timeout */
    pump(p, 1100, NULL);
    assert_int_equal(kvs_zch_peer_status(p, 0), KVS_ERR_IO);
    kvs_zch_stats_t st;
    kvs_zch_stats(p, &st);
    assert_int_equal(st.send_failures, 20001); /* the held frames too, dropped once it died */
    assert_int_equal(st.dead_peers, 1);
    kvs_zch_destroy(p);
    close(dead_fd);
    kvs_assert_no_leaks();
}

/* A live peer is stopped (its queues fill), then killed: sends never block and liveness reports
 * it dead within the timeout. */
static void test_stopped_then_killed_peer(void **state)
{
    (void) state;
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    /* Fork before this process starts ZeroMQ: a child must not inherit a live context. */
    pid_t pid = fork();
    g_child = pid;
    assert_true(pid >= 0);
    if (pid == 0) {
        kvs_zch_config_t c = {.side = KVS_SIDE_DECODE,
                              .rank = 0,
                              .peer_tp = 1,
                              .bind = "tcp://127.0.0.1:0",
                              .heartbeat_ns = 10 * MS,
                              .liveness_timeout_ns = 300 * MS,
                              .connect_timeout_ns = 1000 * MS};
        kvs_zch_t *ch;
        char pep[256];
        if (read_str(down[0], pep, sizeof(pep)) != 0) _exit(2);
        if (kvs_zch_create(&c, &ch) != KVS_OK || kvs_zch_set_peer(ch, 0, pep) != KVS_OK) _exit(3);
        write_str(up[1], "up");
        for (;;) { /* heartbeats only; never reads, so the parent's queue fills */
            kvs_zch_tick(ch);
            struct timespec ms1 = {0, 1000000};
            nanosleep(&ms1, NULL);
        }
    }
    kvs_zch_t *p = make(KVS_SIDE_PREFILL, 0, 1, "tcp://127.0.0.1:0");
    write_str(down[1], kvs_zch_endpoint(p));
    char buf[8];
    assert_int_equal(read_str(up[0], buf, sizeof(buf)), 0);
    /* Learn the child's endpoint from its heartbeats. */
    uint64_t end = kvs_now_ns() + 5000 * MS;
    while (kvs_zch_peer_incarnation(p, 0) == 0) {
        assert_true(kvs_now_ns() < end);
        pump(p, 1, NULL);
    }
    assert_int_equal(kvs_zch_send(p, 0, KVS_ZCH_MSG, "a", 1), KVS_OK);
    assert_int_not_equal(kvs_zch_peer_incarnation(p, 0), 0);
    kill(pid, SIGSTOP);
    uint64_t worst = 0, failed = 0;
    uint8_t big[KVS_MSG_MAX_SIZE] = {0};
    for (int i = 0; i < 200000 && failed == 0; i++) {
        uint64_t t = kvs_now_ns();
        if (kvs_zch_send(p, 0, KVS_ZCH_MSG, big, sizeof(big)) != KVS_OK) failed++;
        t = kvs_now_ns() - t;
        if (t > worst) worst = t;
    }
    assert_true(failed > 0); /* the high-water mark bounds the queue */
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    uint64_t killed = kvs_now_ns();
    while (kvs_zch_peer_status(p, 0) == KVS_OK) {
        uint64_t t = kvs_now_ns();
        kvs_zch_send(p, 0, KVS_ZCH_MSG, "z", 1);
        kvs_zch_tick(p);
        t = kvs_now_ns() - t;
        if (t > worst) worst = t;
        assert_true(kvs_now_ns() - killed < 2000 * MS);
    }
    if (worst > 100 * MS) fail_msg("a send took %llu ms", (unsigned long long) (worst / MS));
    kvs_zch_destroy(p);
    close(up[0]);
    close(up[1]);
    close(down[0]);
    close(down[1]);
    kvs_assert_no_leaks();
}

/* The prefill side knows no endpoint: it learns the decode rank's from its heartbeats, notices
 * its death, and adopts the new endpoint of its next life. */
static void test_learn_liveness_restart(void **state)
{
    (void) state;
    kvs_zch_t *p = make(KVS_SIDE_PREFILL, 0, 1, "tcp://127.0.0.1:0");
    for (int life = 0; life < 2; life++) {
        kvs_zch_t *d = make(KVS_SIDE_DECODE, 0, 1, "tcp://127.0.0.1:0");
        assert_int_equal(kvs_zch_set_peer(d, 0, kvs_zch_endpoint(p)), KVS_OK);
        uint64_t end = kvs_now_ns() + 5000 * MS;
        kvs_zch_frame_t f;
        int got = 0;
        char tag[8];
        snprintf(tag, sizeof(tag), "life%d", life);
        while (!got) {
            assert_true(kvs_now_ns() < end);
            kvs_zch_tick(d);
            kvs_zch_recv(p, &f);
            kvs_zch_tick(p);
            kvs_zch_send(p, 0, KVS_ZCH_MSG, tag, strlen(tag));
            got = kvs_zch_recv(d, &f) == KVS_OK && f.kind == KVS_ZCH_MSG;
        }
        assert_memory_equal(f.payload, tag, strlen(tag));
        assert_int_equal(kvs_zch_peer_incarnation(p, 0), kvs_zch_incarnation(d));
        assert_int_equal(kvs_zch_peer_status(p, 0), KVS_OK);
        kvs_zch_destroy(d);
        uint64_t gone = kvs_now_ns();
        while (kvs_zch_peer_status(p, 0) == KVS_OK) {
            assert_true(kvs_now_ns() - gone < 1300 * MS); /* liveness 300 ms + slack */
            pump(p, 1, NULL);
        }
    }
    kvs_zch_stats_t st;
    kvs_zch_stats(p, &st);
    assert_int_equal(st.restarts, 1);
    assert_int_equal(st.dead_peers, 2);
    assert_true(st.heartbeats_received > 0);
    kvs_zch_destroy(p);
    kvs_assert_no_leaks();
}

/* A prefill channel with two peer groups: decode instances 1 and 2 (both rank 0) are told apart
 * by the instance in their frames, answered each on its own socket; a third waits for a free
 * slot and gets a group number of its own once the first instance's group is closed. */
static void test_peer_groups(void **state)
{
    (void) state;
    kvs_zch_config_t pc = {.side = KVS_SIDE_PREFILL,
                           .rank = 0,
                           .peer_tp = 1,
                           .max_groups = 2,
                           .bind = "tcp://127.0.0.1:0",
                           .heartbeat_ns = 10 * MS,
                           .liveness_timeout_ns = 300 * MS,
                           .connect_timeout_ns = 1000 * MS};
    kvs_zch_t *p = NULL;
    assert_int_equal(kvs_zch_create(&pc, &p), KVS_OK);
    assert_int_equal(kvs_zch_peers(p), 2);
    assert_int_equal(kvs_zch_groups(p), 0);
    kvs_zch_t *d[3];
    for (int i = 0; i < 3; i++) {
        kvs_zch_config_t dc = {.side = KVS_SIDE_DECODE,
                               .rank = 0,
                               .peer_tp = 1,
                               .instance = (uint64_t) i + 1,
                               .bind = "tcp://127.0.0.1:0",
                               .heartbeat_ns = 10 * MS,
                               .liveness_timeout_ns = 5000 * MS,
                               .connect_timeout_ns = 5000 * MS};
        assert_int_equal(kvs_zch_create(&dc, &d[i]), KVS_OK);
        assert_int_equal(kvs_zch_set_peer(d[i], 0, kvs_zch_endpoint(p)), KVS_OK);
    }
    /* Instances 1 and 2 say who they are; each is a group of its own. */
    uint32_t id[2] = {0, 0}, index[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        char text[2] = {(char) ('a' + i), 0};
        uint64_t end = kvs_now_ns() + 5000 * MS;
        kvs_zch_frame_t f;
        int got = 0;
        while (!got) {
            assert_true(kvs_now_ns() < end);
            kvs_zch_tick(d[i]);
            kvs_zch_send(d[i], 0, KVS_ZCH_MSG, text, 1);
            got = pump(p, 20, &f);
            if (got && (f.len != 1 || f.payload[0] != text[0])) got = 0; /* an earlier try */
        }
        index[i] = f.from;
        id[i] = kvs_zch_peer_id(p, f.from);
        assert_int_equal(kvs_peer_rank(id[i]), 0);
    }
    assert_int_not_equal(index[0], index[1]);
    assert_int_not_equal(kvs_peer_group(id[0]), kvs_peer_group(id[1]));
    assert_int_equal(kvs_zch_groups(p), 2);
    for (int i = 0; i < 2; i++) {
        uint32_t back = 99;
        assert_int_equal(kvs_zch_peer_index(p, id[i], &back), KVS_OK);
        assert_int_equal(back, index[i]);
    }
    /* Each is answered on its own connection (learned from its heartbeats). */
    for (int i = 0; i < 2; i++) {
        char text[2] = {(char) ('A' + i), 0};
        uint64_t end = kvs_now_ns() + 5000 * MS;
        kvs_zch_frame_t f;
        int got = 0;
        while (!got) {
            assert_true(kvs_now_ns() < end);
            for (int j = 0; j < 2; j++) kvs_zch_tick(d[j]);
            kvs_zch_tick(p);
            while (kvs_zch_recv(p, &f) == KVS_OK) {
            }
            kvs_zch_send(p, index[i], KVS_ZCH_MSG, text, 1);
            got = pump(d[i], 20, &f);
        }
        assert_int_equal(f.len, 1);
        assert_int_equal(f.payload[0], text[0]);
        kvs_zch_frame_t other;
        assert_false(kvs_zch_recv(d[1 - i], &other) == KVS_OK && other.kind == KVS_ZCH_MSG &&
                     other.payload[0] == text[0]);
    }
    /* Instance 3 is refused while both slots are taken. */
    kvs_zch_stats_t st;
    uint64_t end = kvs_now_ns() + 5000 * MS;
    do {
        assert_true(kvs_now_ns() < end);
        kvs_zch_tick(d[2]);
        kvs_zch_tick(d[1]);
        pump(p, 5, NULL);
        kvs_zch_stats(p, &st);
    } while (st.groups_refused == 0);
    assert_int_equal(kvs_zch_groups(p), 2);
    /* Instance 1 leaves; once it is dead its group is closed, and its id no longer resolves. */
    kvs_zch_destroy(d[0]);
    end = kvs_now_ns() + 5000 * MS;
    while (kvs_zch_peer_status(p, index[0]) == KVS_OK) {
        assert_true(kvs_now_ns() < end);
        kvs_zch_tick(d[1]);
        pump(p, 5, NULL);
    }
    kvs_zch_close_group(p, index[0]);
    uint32_t back;
    assert_int_equal(kvs_zch_peer_index(p, id[0], &back), KVS_ERR_NOT_FOUND);
    assert_int_equal(kvs_zch_peer_index(p, id[1], &back), KVS_OK);
    assert_int_equal(kvs_zch_peer_status(p, index[0]), KVS_ERR_IO);
    /* Instance 3 takes the free slot under a new group number. */
    end = kvs_now_ns() + 5000 * MS;
    kvs_zch_frame_t f;
    int got = 0;
    while (!got) {
        assert_true(kvs_now_ns() < end);
        kvs_zch_tick(d[1]);
        kvs_zch_tick(d[2]);
        kvs_zch_send(d[2], 0, KVS_ZCH_MSG, "c", 1);
        got = pump(p, 20, &f) && f.len == 1 && f.payload[0] == 'c';
    }
    assert_int_equal(f.from, index[0]); /* the slot */
    uint32_t id3 = kvs_zch_peer_id(p, f.from);
    assert_int_not_equal(id3, id[0]);
    assert_int_not_equal(id3, id[1]);
    kvs_zch_stats(p, &st);
    assert_int_equal(st.groups_opened, 3);
    assert_int_equal(st.groups_closed, 1);
    assert_int_equal(kvs_zch_groups(p), 2);
    kvs_zch_destroy(d[1]);
    kvs_zch_destroy(d[2]);
    kvs_zch_destroy(p);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_threads_both_ways, kill_child),
        cmocka_unit_test_teardown(test_fork_tcp, kill_child),
        cmocka_unit_test_teardown(test_fork_ipc, kill_child),
        cmocka_unit_test_teardown(test_rejects_hostile_frames, kill_child),
        cmocka_unit_test_teardown(test_dead_peer_never_blocks, kill_child),
        cmocka_unit_test_teardown(test_stopped_then_killed_peer, kill_child),
        cmocka_unit_test_teardown(test_learn_liveness_restart, kill_child),
        cmocka_unit_test_teardown(test_peer_groups, kill_child),
    };
    const char *filter = getenv("KVS_TEST_FILTER"); /* e.g. "*restart*" */
    if (filter != NULL) cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
