/* The shared-memory TP group, with ranks as threads of this process and as forked processes:
 * seeded rounds of all-reduce (compared bitwise with the rank-order sum computed locally),
 * broadcast and barrier at varying n, a slow rank, a peer that dies or stops, a rank that
 * never joins, mismatched calls and capacities, stale segments from a crashed run, invalid
 * arguments and allocation failures. Forked children report through their exit status. */
#include "kvs_test.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/clock.h"
#include "kvstage/rng.h"
#include "kvstage/status.h"
#include "model/tpgroup.h"

#define MAX_RANKS        4
#define MAX_DOUBLES      1000
#define MAX_BYTES        4096
#define CANARY           16 /* elements past n that a call must leave alone */
#define LONG_TIMEOUT_MS  30000
#define SHORT_TIMEOUT_MS 400
#define SLACK_MS         3000 /* how late past a deadline an error may come on a loaded machine */

/* --- helpers ------------------------------------------------------------------------------- */

static void group_name(char *buf, size_t cap, const char *tag)
{
    static unsigned counter;
    snprintf(buf, cap, "/kvs-tp-test-%d-%s-%u", (int) getpid(), tag, counter++);
}

static int shm_exists(const char *name)
{
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) return 0;
    close(fd);
    return 1;
}

static void sleep_us(uint64_t us)
{
    struct timespec ts = {(time_t) (us / 1000000), (long) (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static uint64_t ms_since(uint64_t t0)
{
    return (kvs_now_ns() - t0) / 1000000;
}

/* Thread-safe log collector: keeps expected errors off stderr and lets tests read them. */
typedef struct {
    pthread_mutex_t mu;
    int errors;
    char text[8192];
} collect_t;

static collect_t g_log = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void collect_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                         const char *msg)
{
    (void) file;
    (void) line;
    collect_t *c = arg;
    if (level != KVS_LOG_ERROR) return;
    pthread_mutex_lock(&c->mu);
    c->errors++;
    size_t len = strlen(c->text);
    if (len + 2 < sizeof(c->text)) snprintf(c->text + len, sizeof(c->text) - len, "%s\n", msg);
    pthread_mutex_unlock(&c->mu);
}

static void collect_start(void)
{
    pthread_mutex_lock(&g_log.mu);
    g_log.errors = 0;
    g_log.text[0] = '\0';
    pthread_mutex_unlock(&g_log.mu);
    kvs_log_set_sink(collect_sink, &g_log);
}

static void collect_stop(void)
{
    kvs_log_set_sink(NULL, NULL);
}

static void expect_logged(const char *what)
{
    if (strstr(g_log.text, what) == NULL) fail_msg("log lacks '%s':\n%s", what, g_log.text);
}

/* --- data ---------------------------------------------------------------------------------- */

/* Values whose sum depends on the order of addition: random signs, exponents over
 * 2^-30..2^30, now and then a signed zero. */
static double value(kvs_rng_t *rng)
{
    uint64_t bits = kvs_rng_next(rng);
    if ((bits & 63) == 0) return (bits & 64) ? -0.0 : 0.0;
    double m = 1.0 + (double) (kvs_rng_next(rng) >> 11) * 0x1p-53;
    double v = ldexp(m, (int) kvs_rng_below(rng, 61) - 30);
    return (bits & 128) ? -v : v;
}

/* What rank `rank` contributes in round `round`: every rank can compute every rank's data. */
static void rank_data(double *x, size_t n, uint64_t seed, uint64_t round, uint32_t rank)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, kvs_mix64(seed ^ kvs_mix64(round * 131 + rank + 1)));
    for (size_t i = 0; i < n; i++) x[i] = value(&rng);
}

/* ((x0 + x1) + x2) + ...: what the group must return. tmp: [n] scratch. */
static void rank_order_sum(double *out, double *tmp, size_t n, uint64_t seed, uint64_t round,
                           uint32_t size)
{
    rank_data(out, n, seed, round, 0);
    for (uint32_t r = 1; r < size; r++) {
        rank_data(tmp, n, seed, round, r);
        for (size_t i = 0; i < n; i++) out[i] += tmp[i];
    }
}

static void bcast_data(unsigned char *b, size_t n, uint64_t seed, uint64_t round)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, kvs_mix64(seed ^ kvs_mix64(round * 7 + 0xb0)));
    for (size_t i = 0; i < n; i++) b[i] = (unsigned char) kvs_rng_next(&rng);
}

enum { OP_ALLREDUCE, OP_BROADCAST, OP_BARRIER };

typedef struct {
    int op;
    size_t n;
} plan_t;

/* The same on every rank: which call round `round` makes, and with what n (0 and the maximum
 * now and then). */
static plan_t round_plan(uint64_t seed, uint64_t round)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, kvs_mix64(seed + round * 0x9e3779b97f4a7c15ull));
    plan_t p;
    uint64_t k = kvs_rng_below(&rng, 4);
    p.op = k < 2 ? OP_ALLREDUCE : k == 2 ? OP_BROADCAST : OP_BARRIER;
    size_t max = p.op == OP_BROADCAST ? MAX_BYTES : MAX_DOUBLES;
    uint64_t e = kvs_rng_below(&rng, 8);
    p.n = e == 0 ? 0 : e == 1 ? max : (size_t) kvs_rng_range(&rng, 1, max);
    return p;
}

/* --- the worker: one rank running seeded rounds --------------------------------------------- */

typedef struct {
    kvs_tpgroup_config_t cfg;
    uint64_t seed;
    uint64_t rounds;
    int slow;                  /* sleep up to 2 ms before every call */
    int64_t die_at;            /* at this round: a thread leaves, a process kills itself; -1 */
    _Atomic uint64_t *entered; /* barrier rounds: shared count of ranks that entered */
    /* results */
    int code; /* 0: every round right; 100 + -status: a call failed (then later calls gave
                 KVS_ERR_STATE); others: see run_worker */
    int64_t fail_round;
    kvs_status_t fail_status;
    uint64_t fail_ms;
    int is_process;
} worker_t;

static void worker_init(worker_t *w, const char *name, uint32_t size, uint32_t rank,
                        uint64_t timeout_ms, uint64_t seed, uint64_t rounds)
{
    memset(w, 0, sizeof(*w));
    w->cfg.name = name;
    w->cfg.size = size;
    w->cfg.rank = rank;
    w->cfg.max_doubles = MAX_DOUBLES;
    w->cfg.max_bytes = MAX_BYTES;
    w->cfg.timeout_ms = timeout_ms;
    w->seed = seed;
    w->rounds = rounds;
    w->die_at = -1;
    w->fail_round = -1;
}

static int run_rounds(worker_t *w, kvs_tpgroup_t *g, double *x, double *want, double *tmp,
                      unsigned char *b, unsigned char *bwant)
{
    const uint32_t rank = w->cfg.rank, size = w->cfg.size;
    kvs_rng_t slow_rng;
    kvs_rng_seed(&slow_rng, w->seed ^ (rank + 77));
    uint64_t barriers = 0;

    /* Too large: refused, nothing touched, and the group stays usable. */
    for (size_t i = 0; i < MAX_DOUBLES + CANARY; i++) x[i] = (double) i;
    if (kvs_tpgroup_allreduce(g, x, MAX_DOUBLES + 1) != KVS_ERR_INVALID) return 10;
    for (size_t i = 0; i < MAX_DOUBLES + CANARY; i++)
        if (x[i] != (double) i) return 11;
    if (kvs_tpgroup_broadcast(g, b, MAX_BYTES + 1) != KVS_ERR_INVALID) return 12;
    if (kvs_tpgroup_allreduce(g, NULL, 1) != KVS_ERR_INVALID) return 13;

    for (uint64_t i = 0; i < w->rounds; i++) {
        if ((int64_t) i == w->die_at) {
            if (w->is_process) raise(SIGKILL);
            return 0;
        }
        plan_t p = round_plan(w->seed, i);
        if (w->slow) sleep_us(kvs_rng_below(&slow_rng, 2000));
        uint64_t t0 = kvs_now_ns();
        kvs_status_t st;
        if (p.op == OP_ALLREDUCE) {
            rank_data(x, p.n, w->seed, i, rank);
            for (size_t k = p.n; k < p.n + CANARY; k++) x[k] = -1.5;
            st = kvs_tpgroup_allreduce(g, x, p.n);
            if (st == KVS_OK) {
                rank_order_sum(want, tmp, p.n, w->seed, i, size);
                if (memcmp(x, want, p.n * sizeof(double)) != 0) return 20;
                for (size_t k = p.n; k < p.n + CANARY; k++)
                    if (x[k] != -1.5) return 21;
            }
        } else if (p.op == OP_BROADCAST) {
            bcast_data(bwant, p.n, w->seed, i);
            if (rank == 0)
                memcpy(b, bwant, p.n);
            else
                memset(b, 0xa5, p.n);
            memset(b + p.n, 0x5a, CANARY);
            st = kvs_tpgroup_broadcast(g, b, p.n);
            if (st == KVS_OK) {
                if (memcmp(b, bwant, p.n) != 0) return 30;
                for (size_t k = p.n; k < p.n + CANARY; k++)
                    if (b[k] != 0x5a) return 31;
            }
        } else {
            atomic_fetch_add(w->entered, 1);
            st = kvs_tpgroup_barrier(g);
            barriers++;
            /* Everybody entered this barrier before anybody left it. */
            if (st == KVS_OK && atomic_load(w->entered) < barriers * size) return 40;
        }
        if (st != KVS_OK) {
            w->fail_round = (int64_t) i;
            w->fail_status = st;
            w->fail_ms = ms_since(t0);
            if (kvs_tpgroup_barrier(g) != KVS_ERR_STATE) return 50;
            if (kvs_tpgroup_allreduce(g, x, 1) != KVS_ERR_STATE) return 51;
            return 100 + -(int) st;
        }
    }
    return 0;
}

/* Joins, runs the rounds, leaves. Sets w->code and returns it. */
static int run_worker(worker_t *w)
{
    kvs_tpgroup_t *g = NULL;
    kvs_status_t st = kvs_tpgroup_join(&w->cfg, &g);
    if (st != KVS_OK) {
        w->fail_status = st;
        return w->code = 100 + -(int) st;
    }
    if (kvs_tpgroup_size(g) != w->cfg.size || kvs_tpgroup_rank(g) != w->cfg.rank) {
        kvs_tpgroup_leave(g);
        return w->code = 2;
    }
    double *x = kvs_malloc((MAX_DOUBLES + CANARY) * sizeof(double)); /* [n + CANARY] */
    double *want = kvs_malloc(MAX_DOUBLES * sizeof(double));         /* [n] */
    double *tmp = kvs_malloc(MAX_DOUBLES * sizeof(double));          /* [n] */
    unsigned char *b = kvs_malloc(MAX_BYTES + CANARY), *bwant = kvs_malloc(MAX_BYTES);
    int code = 3;
    if (x && want && tmp && b && bwant) code = run_rounds(w, g, x, want, tmp, b, bwant);
    kvs_free(x);
    kvs_free(want);
    kvs_free(tmp);
    kvs_free(b);
    kvs_free(bwant);
    kvs_tpgroup_leave(g);
    return w->code = code;
}

static void *thread_main(void *arg)
{
    run_worker(arg);
    return NULL;
}

/* A shared counter that survives fork() (a nameless shm segment: POSIX has no anonymous
 * shared mapping). */
static _Atomic uint64_t *shared_counter(void)
{
    char name[96];
    group_name(name, sizeof(name), "counter");
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    shm_unlink(name);
    assert_int_equal(ftruncate(fd, sizeof(_Atomic uint64_t)), 0);
    void *p = mmap(NULL, sizeof(_Atomic uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    assert_true(p != MAP_FAILED);
    _Atomic uint64_t *c = p;
    atomic_store(c, 0);
    return c;
}

static void run_threads(worker_t *w, uint32_t size, uint64_t stagger_us)
{
    pthread_t th[MAX_RANKS];
    for (uint32_t r = size; r-- > 0;) { /* highest rank first: others wait for rank 0 */
        assert_int_equal(pthread_create(&th[r], NULL, thread_main, &w[r]), 0);
        if (stagger_us) sleep_us(stagger_us);
    }
    for (uint32_t r = 0; r < size; r++) pthread_join(th[r], NULL);
}

/* A group config with room for 8 doubles. */
static kvs_tpgroup_config_t small_config(const char *name, uint32_t size, uint32_t rank,
                                         size_t max_bytes, uint64_t timeout_ms)
{
    return (kvs_tpgroup_config_t){.name = name,
                                  .size = size,
                                  .rank = rank,
                                  .max_doubles = 8,
                                  .max_bytes = max_bytes,
                                  .timeout_ms = timeout_ms};
}

/* Ranks 0..size-1 of one group, sharing the entry counter. */
static void workers_init(worker_t *w, uint32_t size, const char *name, uint64_t timeout_ms,
                         uint64_t seed, uint64_t rounds, _Atomic uint64_t *entered)
{
    for (uint32_t r = 0; r < size; r++) {
        worker_init(&w[r], name, size, r, timeout_ms, seed, rounds);
        w[r].entered = entered;
    }
}

/* Children still running if a test fails half-way; they have deadlines, but don't wait. */
static pid_t g_children[MAX_RANKS];
static int g_nchildren;

static int kill_children(void **state)
{
    (void) state;
    for (int i = 0; i < g_nchildren; i++) {
        kill(g_children[i], SIGKILL);
        waitpid(g_children[i], NULL, 0);
    }
    g_nchildren = 0;
    return 0;
}

static pid_t spawn(worker_t *w)
{
    w->is_process = 1;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        kvs_alloc_stats_t before, after; /* the parent's blocks came along with fork() */
        kvs_alloc_stats(&before);
        int code = run_worker(w);
        kvs_alloc_stats(&after);
        if (code == 0 && after.live_blocks != before.live_blocks) code = 90;
        if (code >= 100 && w->fail_ms > SHORT_TIMEOUT_MS + SLACK_MS &&
            w->cfg.timeout_ms <= SHORT_TIMEOUT_MS)
            code = 91;
        _exit(code);
    }
    g_children[g_nchildren++] = pid;
    return pid;
}

/* Waits for a child, killing it if it outlives timeout_s; returns the wait status. */
static int reap(pid_t pid, int timeout_s)
{
    uint64_t t0 = kvs_now_ns();
    int status = 0;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) break;
        assert_int_equal(r, 0);
        if (ms_since(t0) > (uint64_t) timeout_s * 1000) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            status = -1;
            break;
        }
        sleep_us(1000);
    }
    for (int i = 0; i < g_nchildren; i++)
        if (g_children[i] == pid) g_children[i--] = g_children[--g_nchildren];
    if (status == -1) fail_msg("child %d hung and was killed", (int) pid);
    return status;
}

static int exit_code(int status)
{
    return WIFEXITED(status) ? WEXITSTATUS(status)
                             : 1000 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

/* Rank 0 in this process, the others forked; all must pass every round. */
static void run_processes(worker_t *w, uint32_t size)
{
    pid_t pids[MAX_RANKS];
    for (uint32_t r = 1; r < size; r++) pids[r] = spawn(&w[r]);
    run_worker(&w[0]);
    for (uint32_t r = 1; r < size; r++) {
        int code = exit_code(reap(pids[r], 120));
        if (code != 0)
            fail_msg("rank %u (process) failed with code %d (seed %llu)", r, code,
                     (unsigned long long) w[r].seed);
    }
}

static void check_all_ok(const worker_t *w, uint32_t size)
{
    for (uint32_t r = 0; r < size; r++)
        if (w[r].code != 0)
            fail_msg("rank %u failed with code %d (status %s, round %lld, seed %llu)", r, w[r].code,
                     kvs_status_str(w[r].fail_status), (long long) w[r].fail_round,
                     (unsigned long long) w[r].seed);
}

/* --- correctness --------------------------------------------------------------------------- */

/* The data must make summation order visible, or the rank-order check would prove nothing. */
static void test_data_is_order_sensitive(void **state)
{
    (void) state;
    double a[3][MAX_DOUBLES];
    for (uint32_t r = 0; r < 3; r++) rank_data(a[r], MAX_DOUBLES, 1, 0, r);
    int differ = 0;
    for (size_t i = 0; i < MAX_DOUBLES; i++) {
        double fwd = (a[0][i] + a[1][i]) + a[2][i], rev = (a[2][i] + a[1][i]) + a[0][i];
        differ += memcmp(&fwd, &rev, sizeof(double)) != 0;
    }
    assert_true(differ > MAX_DOUBLES / 10);
}

/* Every rank runs the rounds, as threads or as processes (run_processes checks the children,
 * so only rank 0 is left to check here). */
static void run_rounds_group(int processes, uint32_t size, int slow_rank, uint64_t rounds,
                             uint64_t seed)
{
    char name[96];
    group_name(name, sizeof(name), processes ? "proc" : "thr");
    _Atomic uint64_t *entered = shared_counter();
    worker_t w[MAX_RANKS];
    workers_init(w, size, name, LONG_TIMEOUT_MS, seed, rounds, entered);
    for (uint32_t r = 0; r < size; r++) w[r].slow = (int) r == slow_rank;
    collect_start(); /* the refused oversized calls log errors */
    if (processes)
        run_processes(w, size);
    else
        run_threads(w, size, 0);
    collect_stop();
    munmap((void *) entered, sizeof(*entered));
    check_all_ok(w, processes ? 1 : size);
    assert_false(shm_exists(name));
    kvs_assert_no_leaks();
}

static void test_threads(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0x7e57), n = kvs_test_iters(400);
    for (uint32_t size = 2; size <= 4; size++) {
        run_rounds_group(0, size, -1, n, seed + size);
        run_rounds_group(0, size, (int) size - 1, n / 8 + 1, seed + 10 + size); /* slow last rank */
        run_rounds_group(0, size, 0, n / 8 + 1, seed + 20 + size);              /* slow rank 0 */
    }
}

static void test_processes(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0x9a0c), n = kvs_test_iters(400);
    for (uint32_t size = 2; size <= 3; size++) {
        run_rounds_group(1, size, -1, n, seed + size);
        run_rounds_group(1, size, 1, n / 8 + 1, seed + 10 + size); /* a slow child */
        run_rounds_group(1, size, 0, n / 8 + 1, seed + 20 + size); /* a slow rank 0 */
    }
}

/* A size-1 group needs no shared memory and returns its input bit for bit. */
static void test_size_one(void **state)
{
    (void) state;
    kvs_tpgroup_config_t c = {
        .size = 1, .rank = 0, .max_doubles = 4, .max_bytes = 8, .timeout_ms = 100};
    kvs_tpgroup_t *g = NULL;
    collect_start();
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_OK);
    assert_int_equal(kvs_tpgroup_size(g), 1);
    assert_int_equal(kvs_tpgroup_rank(g), 0);
    double x[5] = {-0.0, 1e300, -3.25, NAN, 7.0}, y[5];
    memcpy(y, x, sizeof(x));
    assert_int_equal(kvs_tpgroup_allreduce(g, x, 4), KVS_OK);
    assert_int_equal(kvs_tpgroup_allreduce_cb(g, x, 4), KVS_OK);
    assert_memory_equal(x, y, sizeof(x));
    assert_int_equal(kvs_tpgroup_allreduce(g, x, 5), KVS_ERR_INVALID);
    assert_int_equal(kvs_tpgroup_allreduce(g, NULL, 1), KVS_ERR_INVALID);
    assert_int_equal(kvs_tpgroup_allreduce(g, NULL, 0), KVS_OK);
    unsigned char b[9] = "abcdefgh";
    assert_int_equal(kvs_tpgroup_broadcast(g, b, 8), KVS_OK);
    assert_string_equal((char *) b, "abcdefgh");
    assert_int_equal(kvs_tpgroup_broadcast(g, b, 9), KVS_ERR_INVALID);
    assert_int_equal(kvs_tpgroup_barrier(g), KVS_OK);
    kvs_tpgroup_leave(g);
    kvs_tpgroup_leave(NULL);
    collect_stop();
    assert_int_equal(g_log.errors, 3);
    kvs_assert_no_leaks();
}

/* --- failures ------------------------------------------------------------------------------ */

static void test_invalid_args(void **state)
{
    (void) state;
    collect_start();
    kvs_tpgroup_t *g = (kvs_tpgroup_t *) 0x1;
    kvs_tpgroup_config_t ok = {.name = "/kvs-tp-test-invalid",
                               .size = 2,
                               .rank = 1,
                               .max_doubles = 4,
                               .max_bytes = 4,
                               .timeout_ms = 100};
    kvs_tpgroup_config_t c;
    assert_int_equal(kvs_tpgroup_join(NULL, &g), KVS_ERR_INVALID);
    assert_int_equal(kvs_tpgroup_join(&ok, NULL), KVS_ERR_INVALID);
    c = ok, c.size = 0;
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_INVALID);
    c = ok, c.size = KVS_TPGROUP_MAX_RANKS + 1;
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_INVALID);
    c = ok, c.rank = 2;
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_INVALID);
    c = ok, c.timeout_ms = 0;
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_INVALID);
    const char *bad_names[] = {NULL, "", "/", "no-slash", "/a/b"};
    for (size_t i = 0; i < sizeof(bad_names) / sizeof(bad_names[0]); i++) {
        c = ok, c.name = bad_names[i];
        assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_INVALID);
    }
    char longname[300];
    memset(longname, 'x', sizeof(longname) - 1);
    longname[0] = '/';
    longname[sizeof(longname) - 1] = '\0';
    c = ok, c.name = longname;
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_INVALID);
    c = ok, c.max_doubles = SIZE_MAX / 4; /* the segment would not fit in memory */
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_INVALID);
    assert_ptr_equal(g, (kvs_tpgroup_t *) 0x1); /* never written on failure */
    double x = 1;
    assert_int_equal(kvs_tpgroup_allreduce(NULL, &x, 1), KVS_ERR_INVALID);
    assert_int_equal(kvs_tpgroup_allreduce_cb(NULL, &x, 1), KVS_ERR_INVALID);
    assert_int_equal(kvs_tpgroup_broadcast(NULL, &x, 1), KVS_ERR_INVALID);
    assert_int_equal(kvs_tpgroup_barrier(NULL), KVS_ERR_INVALID);
    collect_stop();
    assert_true(g_log.errors >= 14);
    kvs_assert_no_leaks();
}

static void test_join_alloc_failure(void **state)
{
    (void) state;
    collect_start();
    char name[96];
    group_name(name, sizeof(name), "nomem");
    kvs_tpgroup_config_t c = {.name = name, .size = 1, .max_doubles = 8, .timeout_ms = 100};
    for (uint32_t size = 1; size <= 2; size++) {
        c.size = size;
        /* Size 2 rank 0 alone would time out once allocation succeeds: stop before that. */
        for (uint64_t nth = 1; nth <= 2; nth++) {
            kvs_tpgroup_t *g = NULL;
            kvs_alloc_fail_at(nth);
            kvs_status_t st = kvs_tpgroup_join(&c, &g);
            kvs_alloc_fail_at(0);
            assert_int_equal(st, KVS_ERR_NOMEM);
            assert_null(g);
            assert_false(shm_exists(name));
            kvs_assert_no_leaks();
        }
    }
    collect_stop();
}

/* Rank 0 alone, then rank 1 alone: both time out, naming who is missing, leaving nothing. */
static void test_join_timeout(void **state)
{
    (void) state;
    char name[96];
    group_name(name, sizeof(name), "alone");
    kvs_tpgroup_config_t c = small_config(name, 3, 0, 8, SHORT_TIMEOUT_MS);
    kvs_tpgroup_t *g = NULL;
    collect_start();
    uint64_t t0 = kvs_now_ns();
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_TIMEOUT);
    uint64_t ms = ms_since(t0);
    collect_stop();
    assert_true(ms >= SHORT_TIMEOUT_MS && ms < SHORT_TIMEOUT_MS + SLACK_MS);
    assert_null(g);
    expect_logged("rank(s) 1,2 never joined");
    assert_false(shm_exists(name));

    c.rank = 2;
    collect_start();
    t0 = kvs_now_ns();
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_ERR_TIMEOUT);
    ms = ms_since(t0);
    collect_stop();
    assert_true(ms >= SHORT_TIMEOUT_MS && ms < SHORT_TIMEOUT_MS + SLACK_MS);
    assert_null(g);
    expect_logged("rank 0 never created the group");
    kvs_assert_no_leaks();
}

/* Rank 0 and rank 2 of three join; rank 1 never comes: rank 2's message names it. */
static void test_join_partial(void **state)
{
    (void) state;
    char name[96];
    group_name(name, sizeof(name), "partial");
    worker_t w[3];
    for (uint32_t r = 0; r < 3; r++) worker_init(&w[r], name, 3, r, SHORT_TIMEOUT_MS, 1, 1);
    collect_start();
    pthread_t t0, t2;
    assert_int_equal(pthread_create(&t0, NULL, thread_main, &w[0]), 0);
    assert_int_equal(pthread_create(&t2, NULL, thread_main, &w[2]), 0);
    pthread_join(t0, NULL);
    pthread_join(t2, NULL);
    collect_stop();
    assert_int_equal(w[0].code, 100 - KVS_ERR_TIMEOUT);
    assert_int_equal(w[2].code, 100 - KVS_ERR_TIMEOUT);
    expect_logged("rank(s) 1 never joined");
    assert_false(shm_exists(name));
    kvs_assert_no_leaks();
}

/* Ranks that disagree on capacities cannot join: a segment of another size, or of the same
 * size with other capacities in its header. */
static void test_join_incompatible(void **state)
{
    (void) state;
    const size_t other_bytes[] = {MAX_BYTES + 64, MAX_BYTES - 6};
    const char *why[] = {"the segment has", "max_bytes 4096"};
    for (int i = 0; i < 2; i++) {
        char name[96];
        group_name(name, sizeof(name), "incompat");
        worker_t w[2];
        for (uint32_t r = 0; r < 2; r++) worker_init(&w[r], name, 2, r, SHORT_TIMEOUT_MS, 1, 1);
        w[1].cfg.max_bytes = other_bytes[i];
        collect_start();
        run_threads(w, 2, 0);
        collect_stop();
        assert_int_equal(w[0].code, 100 - KVS_ERR_TIMEOUT);
        assert_int_equal(w[1].code, 100 - KVS_ERR_INCOMPATIBLE);
        expect_logged(why[i]);
        assert_false(shm_exists(name));
    }
    kvs_assert_no_leaks();
}

typedef struct {
    kvs_tpgroup_config_t cfg;
    int op;
    size_t n;
    kvs_status_t st, after;
} mismatch_t;

static void *mismatch_main(void *arg)
{
    mismatch_t *m = arg;
    kvs_tpgroup_t *g;
    m->st = kvs_tpgroup_join(&m->cfg, &g);
    if (m->st != KVS_OK) return NULL;
    double x[8] = {0};
    m->st = m->op == OP_ALLREDUCE   ? kvs_tpgroup_allreduce(g, x, m->n)
            : m->op == OP_BROADCAST ? kvs_tpgroup_broadcast(g, x, m->n)
                                    : kvs_tpgroup_barrier(g);
    m->after = kvs_tpgroup_barrier(g);
    kvs_tpgroup_leave(g);
    return NULL;
}

/* Ranks that make different calls in the same generation all get KVS_ERR_INCOMPATIBLE. */
static void test_mismatched_calls(void **state)
{
    (void) state;
    const struct {
        int op0;
        size_t n0;
        int op1;
        size_t n1;
    } cases[] = {
        {OP_ALLREDUCE, 5, OP_ALLREDUCE, 6},
        {OP_ALLREDUCE, 4, OP_BARRIER, 0},
        {OP_BROADCAST, 8, OP_ALLREDUCE, 8},
    };
    collect_start();
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char name[96];
        group_name(name, sizeof(name), "mismatch");
        mismatch_t m[2];
        memset(m, 0, sizeof(m));
        for (uint32_t r = 0; r < 2; r++) m[r].cfg = small_config(name, 2, r, 64, LONG_TIMEOUT_MS);
        m[0].op = cases[i].op0, m[0].n = cases[i].n0;
        m[1].op = cases[i].op1, m[1].n = cases[i].n1;
        pthread_t th[2];
        for (uint32_t r = 0; r < 2; r++)
            assert_int_equal(pthread_create(&th[r], NULL, mismatch_main, &m[r]), 0);
        for (uint32_t r = 0; r < 2; r++) pthread_join(th[r], NULL);
        for (uint32_t r = 0; r < 2; r++) {
            assert_int_equal(m[r].st, KVS_ERR_INCOMPATIBLE);
            assert_int_equal(m[r].after, KVS_ERR_STATE);
        }
    }
    collect_stop();
    expect_logged("every rank must make the same calls");
    kvs_assert_no_leaks();
}

/* Three threads; rank 2 stops calling at round 5. The others fail within the deadline (the
 * first to time out names rank 2 and aborts the group for the other) and stay failed. */
static void test_peer_stops_threads(void **state)
{
    (void) state;
    char name[96];
    group_name(name, sizeof(name), "stop");
    _Atomic uint64_t *entered = shared_counter();
    worker_t w[3];
    workers_init(w, 3, name, SHORT_TIMEOUT_MS, kvs_test_seed(5), 50, entered);
    w[2].die_at = 5;
    collect_start();
    run_threads(w, 3, 0);
    collect_stop();
    munmap((void *) entered, sizeof(*entered));
    assert_int_equal(w[2].code, 0);
    int timeouts = 0;
    for (uint32_t r = 0; r < 2; r++) {
        if (w[r].code != 100 - KVS_ERR_TIMEOUT && w[r].code != 100 - KVS_ERR_ABORTED)
            fail_msg("rank %u: code %d", r, w[r].code);
        assert_int_equal(w[r].fail_round, 5);
        assert_true(w[r].fail_ms < SHORT_TIMEOUT_MS + SLACK_MS);
        timeouts += w[r].fail_status == KVS_ERR_TIMEOUT;
    }
    assert_true(timeouts >= 1);
    expect_logged("waiting for rank(s) 2");
    assert_false(shm_exists(name));
    kvs_assert_no_leaks();
}

/* Three processes; rank 2 is SIGKILLed at round 5 (and not reaped until the end, so it is a
 * zombie: only the deadline can tell). Rank 0 here and rank 1 in a child get an error. */
static void test_killed_child(void **state)
{
    (void) state;
    char name[96];
    group_name(name, sizeof(name), "kill");
    _Atomic uint64_t *entered = shared_counter();
    worker_t w[3];
    workers_init(w, 3, name, SHORT_TIMEOUT_MS, kvs_test_seed(6), 50, entered);
    w[2].die_at = 5;
    collect_start();
    pid_t p1 = spawn(&w[1]), p2 = spawn(&w[2]);
    run_worker(&w[0]);
    collect_stop();
    int c1 = exit_code(reap(p1, 60)), c2 = exit_code(reap(p2, 60));
    munmap((void *) entered, sizeof(*entered));
    assert_int_equal(c2, 1000 + SIGKILL);
    if (c1 != 100 - KVS_ERR_TIMEOUT && c1 != 100 - KVS_ERR_ABORTED && c1 != 100 - KVS_ERR_IO)
        fail_msg("rank 1: code %d", c1);
    if (w[0].code != 100 - KVS_ERR_TIMEOUT && w[0].code != 100 - KVS_ERR_ABORTED &&
        w[0].code != 100 - KVS_ERR_IO)
        fail_msg("rank 0: code %d", w[0].code);
    assert_int_equal(w[0].fail_round, 5);
    assert_true(w[0].fail_ms < SHORT_TIMEOUT_MS + SLACK_MS);
    if (w[0].fail_status == KVS_ERR_TIMEOUT) expect_logged("waiting for rank(s) 2");
    assert_false(shm_exists(name));
    kvs_assert_no_leaks();
}

/* A peer that is gone for good (killed and reaped) is noticed long before a long deadline. */
static void test_dead_peer_detected(void **state)
{
    (void) state;
    char name[96];
    group_name(name, sizeof(name), "dead");
    kvs_tpgroup_config_t c = small_config(name, 2, 1, 8, LONG_TIMEOUT_MS);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        kvs_tpgroup_t *cg;
        if (kvs_tpgroup_join(&c, &cg) != KVS_OK) _exit(1);
        raise(SIGKILL);
        _exit(2);
    }
    g_children[g_nchildren++] = pid;
    c.rank = 0;
    kvs_tpgroup_t *g;
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_OK);
    assert_int_equal(exit_code(reap(pid, 60)), 1000 + SIGKILL);
    double x[8] = {1};
    collect_start();
    uint64_t t0 = kvs_now_ns();
    assert_int_equal(kvs_tpgroup_allreduce(g, x, 8), KVS_ERR_IO);
    uint64_t ms = ms_since(t0);
    assert_int_equal(kvs_tpgroup_barrier(g), KVS_ERR_STATE);
    collect_stop();
    assert_true(ms < SLACK_MS);
    expect_logged("rank(s) 1 exited without arriving");
    kvs_tpgroup_leave(g);
    assert_false(shm_exists(name));
    kvs_assert_no_leaks();
}

/* A segment left by a crashed run (both ranks SIGKILLed mid-run) is replaced, even when rank 1
 * starts first and opens the stale one; so is a garbage file of the wrong size. */
static void test_stale_segment(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0x57a1e);
    char name[96];
    group_name(name, sizeof(name), "stale");
    _Atomic uint64_t *entered = shared_counter();
    worker_t w[2];
    workers_init(w, 2, name, LONG_TIMEOUT_MS, seed, 20, entered);
    w[0].die_at = w[1].die_at = 7;
    collect_start();
    pid_t p0 = spawn(&w[0]), p1 = spawn(&w[1]);
    collect_stop();
    assert_int_equal(exit_code(reap(p0, 60)), 1000 + SIGKILL);
    assert_int_equal(exit_code(reap(p1, 60)), 1000 + SIGKILL);
    assert_true(shm_exists(name)); /* the crash left it behind */

    for (int garbage = 0; garbage <= 1; garbage++) {
        if (garbage) {
            int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
            assert_true(fd >= 0);
            char junk[100];
            memset(junk, 0xff, sizeof(junk));
            assert_int_equal(write(fd, junk, sizeof(junk)), (ssize_t) sizeof(junk));
            close(fd);
        }
        workers_init(w, 2, name, LONG_TIMEOUT_MS, seed + 1, 40, entered);
        atomic_store(entered, 0);
        collect_start();
        run_threads(w, 2, 100000); /* rank 1, then 100 ms later rank 0 */
        collect_stop();
        check_all_ok(w, 2);
        assert_false(shm_exists(name));
    }
    munmap((void *) entered, sizeof(*entered));
    kvs_assert_no_leaks();
}

/* --- latency (printed, never asserted) ----------------------------------------------------- */

#define LAT_N      576
#define LAT_WARMUP 200
#define LAT_ITERS  2000

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *) a, y = *(const uint64_t *) b;
    return x < y ? -1 : x > y;
}

static void test_latency_processes(void **state)
{
    (void) state;
    char name[96];
    group_name(name, sizeof(name), "lat");
    const uint32_t size = 3;
    kvs_tpgroup_config_t c = {.name = name,
                              .size = size,
                              .max_doubles = LAT_N,
                              .max_bytes = 64,
                              .timeout_ms = LONG_TIMEOUT_MS};
    pid_t pids[3];
    for (uint32_t r = 1; r < size; r++) {
        pids[r] = fork();
        assert_true(pids[r] >= 0);
        if (pids[r] == 0) {
            c.rank = r;
            kvs_tpgroup_t *cg;
            double x[LAT_N];
            if (kvs_tpgroup_join(&c, &cg) != KVS_OK) _exit(1);
            int code = 0;
            for (int i = 0; i < LAT_WARMUP + LAT_ITERS && code == 0; i++) {
                for (int k = 0; k < LAT_N; k++) x[k] = r + k;
                if (kvs_tpgroup_allreduce(cg, x, LAT_N) != KVS_OK) code = 2;
            }
            kvs_tpgroup_leave(cg);
            _exit(code);
        }
        g_children[g_nchildren++] = pids[r];
    }
    c.rank = 0;
    kvs_tpgroup_t *g;
    assert_int_equal(kvs_tpgroup_join(&c, &g), KVS_OK);
    uint64_t *t = kvs_malloc(LAT_ITERS * sizeof(uint64_t)); /* [iters] ns */
    assert_non_null(t);
    double x[LAT_N];
    uint64_t total0 = 0;
    for (int i = 0; i < LAT_WARMUP + LAT_ITERS; i++) {
        for (int k = 0; k < LAT_N; k++) x[k] = k;
        uint64_t t0 = kvs_now_ns();
        if (i == LAT_WARMUP) total0 = t0;
        assert_int_equal(kvs_tpgroup_allreduce(g, x, LAT_N), KVS_OK);
        if (i >= LAT_WARMUP) t[i - LAT_WARMUP] = kvs_now_ns() - t0;
        assert_true(x[5] == 15.0 + 3.0); /* 5 + 6 + 7 */
    }
    uint64_t total = kvs_now_ns() - total0;
    kvs_tpgroup_leave(g);
    for (uint32_t r = 1; r < size; r++) assert_int_equal(exit_code(reap(pids[r], 60)), 0);
    qsort(t, LAT_ITERS, sizeof(uint64_t), cmp_u64);
    printf("tpgroup all-reduce latency, %u ranks as processes, n=%d doubles, %ld online cpus: "
           "mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us (%d calls)\n",
           size, LAT_N, sysconf(_SC_NPROCESSORS_ONLN), (double) total / LAT_ITERS / 1e3,
           (double) t[LAT_ITERS / 2] / 1e3, (double) t[LAT_ITERS * 99 / 100] / 1e3,
           (double) t[LAT_ITERS - 1] / 1e3, LAT_ITERS);
    kvs_free(t);
    kvs_assert_no_leaks();
}

static void shm_make(const char *name)
{
    int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
    assert_true(fd >= 0);
    close(fd);
}

/* kvs_tpgroup_reclaim removes the "/kvs-PID-..." segments of owners that are gone, and only
 * those: a live owner's stays, as does a name of another form. */
static void test_reclaim(void **state)
{
    (void) state;
    pid_t dead = fork();
    assert_true(dead >= 0);
    if (dead == 0) _exit(0);
    assert_int_equal(waitpid(dead, NULL, 0), dead);
    char gone[64], alive[64], other[64];
    snprintf(gone, sizeof(gone), "/kvs-%ld-p", (long) dead);
    snprintf(alive, sizeof(alive), "/kvs-%ld-d", (long) getpid());
    snprintf(other, sizeof(other), "/kvs-x%ld-p", (long) dead);
    shm_make(gone);
    shm_make(alive);
    shm_make(other);
    assert_true(kvs_tpgroup_reclaim() >= 1);
    assert_false(shm_exists(gone));
    assert_true(shm_exists(alive));
    assert_true(shm_exists(other));
    shm_unlink(alive);
    shm_unlink(other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_data_is_order_sensitive),
        cmocka_unit_test(test_size_one),
        cmocka_unit_test(test_invalid_args),
        cmocka_unit_test(test_reclaim),
        cmocka_unit_test(test_join_alloc_failure),
        cmocka_unit_test(test_threads),
        cmocka_unit_test_teardown(test_processes, kill_children),
        cmocka_unit_test(test_join_timeout),
        cmocka_unit_test(test_join_partial),
        cmocka_unit_test(test_join_incompatible),
        cmocka_unit_test(test_mismatched_calls),
        cmocka_unit_test(test_peer_stops_threads),
        cmocka_unit_test_teardown(test_killed_child, kill_children),
        cmocka_unit_test_teardown(test_dead_peer_detected, kill_children),
        cmocka_unit_test_teardown(test_stale_segment, kill_children),
        cmocka_unit_test_teardown(test_latency_processes, kill_children),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
