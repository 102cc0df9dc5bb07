/* The shared-memory TP group. One POSIX shm segment per group:
 *
 *   header | rank records [size] | all-reduce slots [2][size][max_doubles] | broadcast
 * [2][max_bytes]
 *
 * Every collective call is one generation g (1, 2, ...). A rank writes its data into the half
 * of parity g & 1, records which call it made, then publishes g in its rank record (release)
 * and waits until every rank has published g (acquire). No rank can be more than one
 * generation ahead of another (publishing g + 1 needs everybody's g), so when a rank writes
 * the parity-p half for g + 2 every rank has finished reading it for g: the two halves make a
 * second phase unnecessary.
 *
 * Joining uses tokens rather than counters so that a stale segment from a crashed run can
 * never complete a join: each rank > 0 writes a fresh random token into the segment it opened
 * and waits for rank 0 to echo it, which only the live rank 0 of a fresh segment does, after
 * every rank has written one. A rank holding a segment that was unlinked (rank 0 replaced it)
 * reopens the name. */
#include "model/tpgroup.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"

#define TPG_MAGIC   0x3167707473766b00ull /* "\0kvstpg1" */
#define TPG_VERSION 1u
#define TPG_ALIGN   64u

/* Waiting: spin a little (a peer on another core is often microseconds away), then yield
 * (ranks may outnumber cores), then sleep with backoff so an idle rank costs nothing. */
#define TPG_SPIN_POLLS  200u
#define TPG_YIELD_NS    2000000ull  /* yield for this long before sleeping */
#define TPG_SLEEP_MIN   20000ull    /* first sleep */
#define TPG_SLEEP_MAX   1000000ull  /* longest sleep */
#define TPG_LIVENESS_NS 20000000ull /* how often a long wait checks that its peers exist */

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free to work across processes");

typedef enum {
    TPG_OP_ALLREDUCE = 1,
    TPG_OP_BROADCAST = 2,
    TPG_OP_BARRIER = 3,
} tpg_op_t;

typedef struct {
    _Atomic uint64_t magic; /* stored last by rank 0: the rest of the header is valid */
    uint32_t version;
    uint32_t size;
    uint64_t max_doubles;
    uint64_t max_bytes;
    uint64_t total_bytes;
    _Atomic uint32_t aborted_by; /* 0, or 1 + the first rank that failed a call */
    _Atomic int32_t abort_status;
} tpg_header_t;

typedef struct {
    alignas(TPG_ALIGN) _Atomic uint64_t gen; /* last generation this rank arrived at */
    _Atomic uint64_t token;                  /* join: this rank's token for this segment */
    _Atomic uint64_t ack;                    /* join: rank 0's echo of token */
    int64_t pid;                             /* written before token, read after the join */
    uint64_t pidns;                          /* pid namespace inode, 0 if unknown */
    struct {
        uint32_t op; /* tpg_op_t */
        uint32_t pad;
        uint64_t n;
    } call[2]; /* the call of the last generation of each parity */
} tpg_rank_t;

typedef struct {
    size_t ranks_off, slots_off, slot_stride, bcast_off, bcast_stride, total;
} tpg_layout_t;

struct kvs_tpgroup {
    char *name; /* NULL for size 1 without a name */
    uint32_t size, rank;
    size_t max_doubles, max_bytes;
    uint64_t timeout_ns;
    tpg_layout_t lay;
    unsigned char *map; /* the whole segment; NULL for size 1 */
    tpg_header_t *hdr;
    tpg_rank_t *ranks; /* [size] */
    uint64_t gen;      /* generation of this rank's last call */
    kvs_status_t poisoned;
    int64_t pid;
    uint64_t pidns;
};

/* --- arithmetic ---------------------------------------------------------------------------- */

static int add_ok(size_t a, size_t b, size_t *r)
{
    return !__builtin_add_overflow(a, b, r);
}

static int mul_ok(size_t a, size_t b, size_t *r)
{
    return !__builtin_mul_overflow(a, b, r);
}

static int round_up_ok(size_t a, size_t *r)
{
    if (!add_ok(a, TPG_ALIGN - 1, r)) return 0;
    *r &= ~(size_t) (TPG_ALIGN - 1);
    return 1;
}

/* 0 if the segment would not fit a size_t or an off_t. */
static int layout_compute(uint32_t size, size_t max_doubles, size_t max_bytes, tpg_layout_t *l)
{
    size_t t;
    if (!round_up_ok(sizeof(tpg_header_t), &l->ranks_off)) return 0;
    if (!mul_ok(size, sizeof(tpg_rank_t), &t) || !add_ok(l->ranks_off, t, &l->slots_off)) return 0;
    if (!mul_ok(max_doubles, sizeof(double), &t) || !round_up_ok(t, &l->slot_stride)) return 0;
    if (!mul_ok(l->slot_stride, (size_t) 2 * size, &t) || !add_ok(l->slots_off, t, &l->bcast_off))
        return 0;
    if (!round_up_ok(max_bytes, &l->bcast_stride)) return 0;
    if (!mul_ok(l->bcast_stride, 2, &t) || !add_ok(l->bcast_off, t, &l->total)) return 0;
    return l->total <= (size_t) INT64_MAX;
}

static double *slot(const kvs_tpgroup_t *g, unsigned parity, uint32_t rank)
{
    return (double *) (g->map + g->lay.slots_off +
                       ((size_t) parity * g->size + rank) * g->lay.slot_stride);
}

static unsigned char *bcast_area(const kvs_tpgroup_t *g, unsigned parity)
{
    return g->map + g->lay.bcast_off + (size_t) parity * g->lay.bcast_stride;
}

static const char *op_name(uint32_t op)
{
    switch (op) {
    case TPG_OP_ALLREDUCE:
        return "all-reduce";
    case TPG_OP_BROADCAST:
        return "broadcast";
    case TPG_OP_BARRIER:
        return "barrier";
    default:
        return "nothing";
    }
}

/* --- waiting ------------------------------------------------------------------------------- */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

typedef struct {
    uint64_t start, deadline, sleep_ns;
    unsigned polls;
} tpg_wait_t;

static void wait_start(tpg_wait_t *w, uint64_t timeout_ns)
{
    w->start = kvs_now_ns();
    w->deadline = w->start + timeout_ns;
    w->sleep_ns = TPG_SLEEP_MIN;
    w->polls = 0;
}

/* One pause between polls. Returns 0 once the deadline has passed. *now_p is the time when it
 * was read, 0 while still spinning. */
static int wait_pause(tpg_wait_t *w, uint64_t *now_p)
{
    *now_p = 0;
    if (w->polls < TPG_SPIN_POLLS) {
        w->polls++;
        cpu_relax();
        return 1;
    }
    uint64_t now = kvs_now_ns();
    *now_p = now;
    if (now >= w->deadline) return 0;
    if (now - w->start < TPG_YIELD_NS) {
        sched_yield();
        return 1;
    }
    uint64_t ns = w->sleep_ns < w->deadline - now ? w->sleep_ns : w->deadline - now;
    struct timespec ts = {(time_t) (ns / 1000000000ull), (long) (ns % 1000000000ull)};
    nanosleep(&ts, NULL); /* EINTR just polls earlier */
    if (w->sleep_ns < TPG_SLEEP_MAX) w->sleep_ns *= 2;
    return 1;
}

static unsigned long long ms_since(const tpg_wait_t *w)
{
    return (unsigned long long) ((kvs_now_ns() - w->start) / 1000000ull);
}

/* Appends rank numbers to a comma-separated list, ending with "..." if it does not fit. */
static void list_add(char *buf, size_t cap, uint32_t r)
{
    size_t len = strlen(buf);
    if (len + 4 >= cap) return;
    int n = snprintf(buf + len, cap - len, "%s%u", len ? "," : "", r);
    if (n < 0 || (size_t) n >= cap - len) snprintf(buf + (cap - 4), 4, "...");
}

/* --- liveness ------------------------------------------------------------------------------ */

static uint64_t own_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t) st.st_ino : 0;
}

/* 1 only when the peer is certainly gone. A peer in another process of our pid namespace can
 * be checked with kill(pid, 0); threads of this process, peers in other namespaces and
 * unreaped zombies all look alive and are left to the deadline. */
static int peer_gone(const kvs_tpgroup_t *g, uint32_t r)
{
    const tpg_rank_t *p = &g->ranks[r];
    if (p->pid <= 0 || p->pid == g->pid || g->pidns == 0 || p->pidns != g->pidns) return 0;
    return kill((pid_t) p->pid, 0) != 0 && errno == ESRCH;
}

/* --- failure ------------------------------------------------------------------------------- */

/* Poisons this handle and marks the segment aborted (the first failing rank is recorded), so
 * peers stop waiting for us. */
static kvs_status_t poison(kvs_tpgroup_t *g, kvs_status_t st)
{
    g->poisoned = st;
    if (g->hdr != NULL) {
        uint32_t none = 0;
        if (atomic_compare_exchange_strong(&g->hdr->aborted_by, &none, g->rank + 1))
            atomic_store_explicit(&g->hdr->abort_status, (int32_t) st, memory_order_release);
    }
    return st;
}

static kvs_status_t seen_abort(kvs_tpgroup_t *g, uint32_t by, const char *what)
{
    kvs_status_t why =
        (kvs_status_t) atomic_load_explicit(&g->hdr->abort_status, memory_order_acquire);
    kvs_error("tpgroup %s rank %u: %s (generation %llu): rank %u aborted the group (%s)", g->name,
              g->rank, what, (unsigned long long) g->gen, by - 1,
              why < 0 ? kvs_status_str(why) : "reason not yet recorded");
    g->poisoned = KVS_ERR_ABORTED;
    return KVS_ERR_ABORTED;
}

static kvs_status_t check_usable(kvs_tpgroup_t *g, const char *what)
{
    if (g->poisoned != KVS_OK) {
        kvs_error("tpgroup %s rank %u: %s on a group that failed earlier (%s); leave it",
                  g->name ? g->name : "(local)", g->rank, what, kvs_status_str(g->poisoned));
        return KVS_ERR_STATE;
    }
    if (g->hdr != NULL) {
        uint32_t by = atomic_load_explicit(&g->hdr->aborted_by, memory_order_acquire);
        if (by != 0) return seen_abort(g, by, what);
    }
    return KVS_OK;
}

/* --- collectives --------------------------------------------------------------------------- */

static int all_arrived(const kvs_tpgroup_t *g, uint64_t gen, uint32_t *next_p)
{
    uint32_t r = *next_p;
    while (r < g->size && atomic_load_explicit(&g->ranks[r].gen, memory_order_acquire) >= gen) r++;
    *next_p = r;
    return r == g->size;
}

/* Waits until every rank has published generation g->gen. */
static kvs_status_t wait_all(kvs_tpgroup_t *g, const char *what)
{
    uint64_t gen = g->gen;
    uint32_t next = 0; /* ranks below it have arrived */
    tpg_wait_t w;
    wait_start(&w, g->timeout_ns);
    uint64_t next_liveness = w.start + TPG_YIELD_NS;
    for (;;) {
        if (all_arrived(g, gen, &next)) return KVS_OK;
        uint32_t by = atomic_load_explicit(&g->hdr->aborted_by, memory_order_acquire);
        /* A generation everybody reached is complete even if somebody failed afterwards. */
        if (by != 0) return all_arrived(g, gen, &next) ? KVS_OK : seen_abort(g, by, what);
        uint64_t now;
        int more = wait_pause(&w, &now);
        if (!more || now >= next_liveness) {
            char missing[128] = "", gone[128] = "";
            for (uint32_t r = next; r < g->size; r++) {
                if (atomic_load_explicit(&g->ranks[r].gen, memory_order_acquire) >= gen) continue;
                list_add(missing, sizeof(missing), r);
                if (peer_gone(g, r)) list_add(gone, sizeof(gone), r);
            }
            if (gone[0] != '\0') {
                kvs_error("tpgroup %s rank %u: %s (generation %llu): rank(s) %s exited without "
                          "arriving (after %llu ms)",
                          g->name, g->rank, what, (unsigned long long) gen, gone, ms_since(&w));
                return poison(g, KVS_ERR_IO);
            }
            if (!more && missing[0] != '\0') {
                kvs_error("tpgroup %s rank %u: %s (generation %llu) timed out after %llu ms "
                          "waiting for rank(s) %s",
                          g->name, g->rank, what, (unsigned long long) gen, ms_since(&w), missing);
                return poison(g, KVS_ERR_TIMEOUT);
            }
            next_liveness = now + TPG_LIVENESS_NS;
        }
    }
}

/* Publishes this rank's call as the next generation, waits for every rank, and checks that
 * they all made the same call. The caller has written its data for parity (g->gen + 1) & 1. */
static kvs_status_t arrive_and_wait(kvs_tpgroup_t *g, tpg_op_t op, size_t n)
{
    uint64_t gen = g->gen + 1;
    unsigned p = (unsigned) (gen & 1);
    tpg_rank_t *me = &g->ranks[g->rank];
    me->call[p].op = op;
    me->call[p].n = n;
    atomic_store_explicit(&me->gen, gen, memory_order_release);
    g->gen = gen;
    kvs_status_t st = wait_all(g, op_name(op));
    if (st != KVS_OK) return st;
    for (uint32_t r = 0; r < g->size; r++) {
        const tpg_rank_t *o = &g->ranks[r];
        if (o->call[p].op != (uint32_t) op || o->call[p].n != n) {
            kvs_error("tpgroup %s rank %u: generation %llu: this rank called %s(n=%zu) but rank "
                      "%u called %s(n=%llu); every rank must make the same calls in order",
                      g->name, g->rank, (unsigned long long) gen, op_name(op), n, r,
                      op_name(o->call[p].op), (unsigned long long) o->call[p].n);
            return poison(g, KVS_ERR_INCOMPATIBLE);
        }
    }
    return KVS_OK;
}

kvs_status_t kvs_tpgroup_allreduce(kvs_tpgroup_t *g, double *buf, size_t n)
{
    if (g == NULL || (buf == NULL && n > 0) || (g != NULL && n > g->max_doubles)) {
        kvs_error("tpgroup: all-reduce of %zu doubles: needs a group, a buffer and n <= "
                  "max_doubles (%zu)",
                  n, g ? g->max_doubles : 0);
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = check_usable(g, "all-reduce");
    if (st != KVS_OK || g->size == 1) return st;

    unsigned p = (unsigned) ((g->gen + 1) & 1);
    if (n > 0) memcpy(slot(g, p, g->rank), buf, n * sizeof(double));
    st = arrive_and_wait(g, TPG_OP_ALLREDUCE, n);
    if (st != KVS_OK) return st;
    /* Rank order, element by element: ((s0 + s1) + s2) + ... on every rank. */
    const double *s0 = slot(g, p, 0); /* [n] */
    for (size_t i = 0; i < n; i++) buf[i] = s0[i];
    for (uint32_t r = 1; r < g->size; r++) {
        const double *s = slot(g, p, r); /* [n] */
        for (size_t i = 0; i < n; i++) buf[i] += s[i];
    }
    return KVS_OK;
}

kvs_status_t kvs_tpgroup_allreduce_cb(void *group, double *buf, size_t n)
{
    return kvs_tpgroup_allreduce(group, buf, n);
}

kvs_status_t kvs_tpgroup_broadcast(kvs_tpgroup_t *g, void *buf, size_t n)
{
    if (g == NULL || (buf == NULL && n > 0) || (g != NULL && n > g->max_bytes)) {
        kvs_error("tpgroup: broadcast of %zu bytes: needs a group, a buffer and n <= max_bytes "
                  "(%zu)",
                  n, g ? g->max_bytes : 0);
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = check_usable(g, "broadcast");
    if (st != KVS_OK || g->size == 1) return st;

    unsigned p = (unsigned) ((g->gen + 1) & 1);
    if (g->rank == 0 && n > 0) memcpy(bcast_area(g, p), buf, n);
    st = arrive_and_wait(g, TPG_OP_BROADCAST, n);
    if (st != KVS_OK) return st;
    if (g->rank != 0 && n > 0) memcpy(buf, bcast_area(g, p), n);
    return KVS_OK;
}

kvs_status_t kvs_tpgroup_barrier(kvs_tpgroup_t *g)
{
    if (g == NULL) {
        kvs_error("tpgroup: barrier without a group");
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = check_usable(g, "barrier");
    if (st != KVS_OK || g->size == 1) return st;
    return arrive_and_wait(g, TPG_OP_BARRIER, 0);
}

uint32_t kvs_tpgroup_size(const kvs_tpgroup_t *g)
{
    return g->size;
}

uint32_t kvs_tpgroup_rank(const kvs_tpgroup_t *g)
{
    return g->rank;
}

uint64_t kvs_tpgroup_timeout_ns(const kvs_tpgroup_t *g)
{
    return g->timeout_ns;
}

/* --- join and leave ------------------------------------------------------------------------ */

static int name_valid(const char *name)
{
    if (name == NULL || name[0] != '/') return 0;
    size_t len = strlen(name);
    return len >= 2 && len <= NAME_MAX && strchr(name + 1, '/') == NULL;
}

static void attach(kvs_tpgroup_t *g, void *map)
{
    g->map = map;
    g->hdr = map;
    g->ranks = (tpg_rank_t *) (g->map + g->lay.ranks_off);
}

/* Rank 0: a fresh segment, then wait for every rank's token and echo them all. */
static kvs_status_t join_create(kvs_tpgroup_t *g)
{
    tpg_wait_t w;
    wait_start(&w, g->timeout_ns);
    if (shm_unlink(g->name) == 0)
        kvs_info("tpgroup %s: removed a stale segment left by an earlier run", g->name);
    int fd = shm_open(g->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        kvs_error("tpgroup %s rank 0: cannot create the segment: %s", g->name, strerror(errno));
        return KVS_ERR_IO;
    }
    kvs_status_t st = KVS_OK;
    if (ftruncate(fd, (off_t) g->lay.total) != 0) {
        kvs_error("tpgroup %s rank 0: cannot size the segment to %zu bytes: %s", g->name,
                  g->lay.total, strerror(errno));
        st = KVS_ERR_IO;
        goto out_unlink;
    }
    /* Reserve the pages now: a full /dev/shm is then an error here, not SIGBUS later. */
    int err = posix_fallocate(fd, 0, (off_t) g->lay.total);
    if (err != 0) {
        kvs_error("tpgroup %s rank 0: cannot reserve %zu bytes of shared memory: %s", g->name,
                  g->lay.total, strerror(err));
        st = err == ENOSPC ? KVS_ERR_NOMEM : KVS_ERR_IO;
        goto out_unlink;
    }
    void *map = mmap(NULL, g->lay.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        kvs_error("tpgroup %s rank 0: cannot map %zu bytes: %s", g->name, g->lay.total,
                  strerror(errno));
        st = KVS_ERR_IO;
        goto out_unlink;
    }
    close(fd);
    fd = -1;
    attach(g, map);
    g->hdr->version = TPG_VERSION;
    g->hdr->size = g->size;
    g->hdr->max_doubles = g->max_doubles;
    g->hdr->max_bytes = g->max_bytes;
    g->hdr->total_bytes = g->lay.total;
    g->ranks[0].pid = g->pid;
    g->ranks[0].pidns = g->pidns;
    atomic_store_explicit(&g->hdr->magic, TPG_MAGIC, memory_order_release);

    uint32_t next = 1; /* ranks below it have written their token */
    for (;;) {
        while (next < g->size &&
               atomic_load_explicit(&g->ranks[next].token, memory_order_acquire) != 0)
            next++;
        if (next == g->size) break;
        uint64_t now;
        if (!wait_pause(&w, &now)) {
            char missing[128] = "";
            for (uint32_t r = next; r < g->size; r++)
                if (atomic_load_explicit(&g->ranks[r].token, memory_order_acquire) == 0)
                    list_add(missing, sizeof(missing), r);
            kvs_error("tpgroup %s rank 0: join timed out after %llu ms: rank(s) %s never "
                      "joined",
                      g->name, ms_since(&w), missing);
            st = KVS_ERR_TIMEOUT;
            goto out_unmap;
        }
    }
    for (uint32_t r = 1; r < g->size; r++)
        atomic_store_explicit(&g->ranks[r].ack,
                              atomic_load_explicit(&g->ranks[r].token, memory_order_relaxed),
                              memory_order_release);
    return KVS_OK;

out_unmap:
    munmap(g->map, g->lay.total);
    g->map = NULL;
    g->hdr = NULL;
    g->ranks = NULL;
out_unlink:
    if (fd >= 0) close(fd);
    shm_unlink(g->name);
    return st;
}

/* What a rank > 0 has found so far under the group's name. */
typedef struct {
    int fd;
    void *map;
    int token_written;
    int replaced;       /* a segment we held was unlinked: rank 0 replaced or removed it */
    char mismatch[160]; /* why the last segment seen did not fit this rank, "" if it did */
} tpg_open_t;

static void open_drop(tpg_open_t *o, size_t total)
{
    if (o->map != NULL) munmap(o->map, total);
    if (o->fd >= 0) close(o->fd);
    o->map = NULL;
    o->fd = -1;
    o->token_written = 0;
}

/* One look at the name. KVS_OK: joined; KVS_INPROGRESS: not yet; errors are final. */
static kvs_status_t join_poll(kvs_tpgroup_t *g, tpg_open_t *o, uint64_t token)
{
    if (o->map != NULL && o->token_written) {
        /* Before the unlink check: rank 0 may echo, leave and unlink before we look. */
        const tpg_rank_t *me =
            (const tpg_rank_t *) ((unsigned char *) o->map + g->lay.ranks_off) + g->rank;
        if (atomic_load_explicit(&me->ack, memory_order_acquire) == token) return KVS_OK;
    }
    if (o->fd < 0) {
        o->fd = shm_open(g->name, O_RDWR, 0);
        if (o->fd < 0) {
            if (errno == ENOENT) return KVS_INPROGRESS;
            kvs_error("tpgroup %s rank %u: cannot open the segment: %s", g->name, g->rank,
                      strerror(errno));
            return KVS_ERR_IO;
        }
    }
    struct stat st;
    if (fstat(o->fd, &st) != 0) {
        kvs_error("tpgroup %s rank %u: cannot stat the segment: %s", g->name, g->rank,
                  strerror(errno));
        return KVS_ERR_IO;
    }
    if (st.st_nlink == 0) { /* stale: rank 0 has replaced it */
        kvs_debug("tpgroup %s rank %u: the segment was replaced; opening the new one", g->name,
                  g->rank);
        open_drop(o, g->lay.total);
        o->replaced = 1;
        return KVS_INPROGRESS;
    }
    if (o->map == NULL) {
        if (st.st_size == 0) return KVS_INPROGRESS; /* rank 0 is still sizing it */
        if ((uint64_t) st.st_size != (uint64_t) g->lay.total) {
            snprintf(o->mismatch, sizeof(o->mismatch),
                     "the segment has %lld bytes where this rank's size and capacities need %zu",
                     (long long) st.st_size, g->lay.total);
            return KVS_INPROGRESS; /* maybe stale: rank 0 will replace it */
        }
        void *map = mmap(NULL, g->lay.total, PROT_READ | PROT_WRITE, MAP_SHARED, o->fd, 0);
        if (map == MAP_FAILED) {
            kvs_error("tpgroup %s rank %u: cannot map %zu bytes: %s", g->name, g->rank,
                      g->lay.total, strerror(errno));
            return KVS_ERR_IO;
        }
        o->map = map;
    }
    tpg_header_t *hdr = o->map;
    if (atomic_load_explicit(&hdr->magic, memory_order_acquire) != TPG_MAGIC) return KVS_INPROGRESS;
    if (hdr->version != TPG_VERSION || hdr->size != g->size || hdr->max_doubles != g->max_doubles ||
        hdr->max_bytes != g->max_bytes) {
        snprintf(o->mismatch, sizeof(o->mismatch),
                 "the segment is version %u, size %u, max_doubles %llu, max_bytes %llu; this "
                 "rank has version %u, size %u, max_doubles %zu, max_bytes %zu",
                 hdr->version, hdr->size, (unsigned long long) hdr->max_doubles,
                 (unsigned long long) hdr->max_bytes, TPG_VERSION, g->size, g->max_doubles,
                 g->max_bytes);
        return KVS_INPROGRESS;
    }
    o->mismatch[0] = '\0';
    if (!o->token_written) {
        tpg_rank_t *me = (tpg_rank_t *) ((unsigned char *) o->map + g->lay.ranks_off) + g->rank;
        me->pid = g->pid;
        me->pidns = g->pidns;
        atomic_store_explicit(&me->token, token, memory_order_release);
        o->token_written = 1;
    }
    return KVS_INPROGRESS;
}

/* Rank > 0: open (retrying, moving off stale segments), write a token, wait for its echo. */
static kvs_status_t join_open(kvs_tpgroup_t *g)
{
    uint64_t token =
        kvs_mix64(kvs_now_ns() ^ ((uint64_t) g->pid << 20) ^ g->rank ^ (uintptr_t) g) | 1;
    tpg_open_t o = {.fd = -1};
    tpg_wait_t w;
    wait_start(&w, g->timeout_ns);
    for (;;) {
        kvs_status_t st = join_poll(g, &o, token);
        if (st == KVS_OK) break;
        if (st != KVS_INPROGRESS) {
            open_drop(&o, g->lay.total);
            return st;
        }
        uint64_t now;
        if (wait_pause(&w, &now)) continue;
        if (o.mismatch[0] != '\0') {
            kvs_error("tpgroup %s rank %u: join: %s", g->name, g->rank, o.mismatch);
            st = KVS_ERR_INCOMPATIBLE;
        } else if (o.map == NULL || atomic_load_explicit(&((tpg_header_t *) o.map)->magic,
                                                         memory_order_acquire) != TPG_MAGIC) {
            kvs_error("tpgroup %s rank %u: join timed out after %llu ms: %s", g->name, g->rank,
                      ms_since(&w),
                      o.replaced ? "the segment went away and no new one came (rank 0 gave up?)"
                                 : "rank 0 never created the group");
            st = KVS_ERR_TIMEOUT;
        } else {
            const tpg_rank_t *ranks =
                (const tpg_rank_t *) ((unsigned char *) o.map + g->lay.ranks_off);
            char missing[128] = "";
            for (uint32_t r = 1; r < g->size; r++)
                if (atomic_load_explicit(&ranks[r].token, memory_order_acquire) == 0)
                    list_add(missing, sizeof(missing), r);
            kvs_error("tpgroup %s rank %u: join timed out after %llu ms waiting for rank(s) %s",
                      g->name, g->rank, ms_since(&w), missing[0] ? missing : "0");
            st = KVS_ERR_TIMEOUT;
        }
        open_drop(&o, g->lay.total);
        return st;
    }
    close(o.fd);
    attach(g, o.map);
    return KVS_OK;
}

kvs_status_t kvs_tpgroup_join(const kvs_tpgroup_config_t *c, kvs_tpgroup_t **group_p)
{
    if (c == NULL || group_p == NULL || c->size == 0 || c->size > KVS_TPGROUP_MAX_RANKS ||
        c->rank >= c->size || c->timeout_ms == 0 || (c->size > 1 && !name_valid(c->name))) {
        kvs_error("tpgroup: invalid join (name %s, size %u, rank %u, timeout %llu ms): needs "
                  "1 <= size <= %u, rank < size, a timeout, and for size > 1 a name '/' + "
                  "1..%d characters without '/'",
                  c && c->name ? c->name : "(none)", c ? c->size : 0, c ? c->rank : 0,
                  c ? (unsigned long long) c->timeout_ms : 0ull, KVS_TPGROUP_MAX_RANKS,
                  NAME_MAX - 1);
        return KVS_ERR_INVALID;
    }
    tpg_layout_t lay = {0};
    if (c->size > 1 && !layout_compute(c->size, c->max_doubles, c->max_bytes, &lay)) {
        kvs_error("tpgroup %s: a segment for %u ranks, %zu doubles and %zu bytes is too large",
                  c->name, c->size, c->max_doubles, c->max_bytes);
        return KVS_ERR_INVALID;
    }
    kvs_tpgroup_t *g = kvs_calloc(1, sizeof(*g));
    if (g == NULL) goto out_nomem;
    if (c->name != NULL && (g->name = kvs_strdup(c->name)) == NULL) goto out_free;
    g->size = c->size;
    g->rank = c->rank;
    g->max_doubles = c->max_doubles;
    g->max_bytes = c->max_bytes;
    g->timeout_ns =
        c->timeout_ms < UINT64_MAX / 2000000ull ? c->timeout_ms * 1000000ull : UINT64_MAX / 2;
    g->lay = lay;
    g->pid = (int64_t) getpid();
    g->pidns = own_pidns();
    if (g->size > 1) {
        kvs_status_t st = g->rank == 0 ? join_create(g) : join_open(g);
        if (st != KVS_OK) {
            kvs_free(g->name);
            kvs_free(g);
            return st;
        }
    }
    *group_p = g;
    return KVS_OK;

out_free:
    kvs_free(g);
out_nomem:
    kvs_error("tpgroup %s rank %u: out of memory joining", c->name ? c->name : "(local)", c->rank);
    return KVS_ERR_NOMEM;
}

void kvs_tpgroup_leave(kvs_tpgroup_t *g)
{
    if (g == NULL) return;
    if (g->map != NULL) {
        munmap(g->map, g->lay.total);
        if (g->rank == 0 && shm_unlink(g->name) != 0 && errno != ENOENT)
            kvs_warn("tpgroup %s: cannot remove the segment: %s", g->name, strerror(errno));
    }
    kvs_free(g->name);
    kvs_free(g);
}

uint32_t kvs_tpgroup_reclaim(void)
{
    DIR *dir = opendir("/dev/shm");
    if (dir == NULL) return 0;
    uint32_t removed = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        const char *n = e->d_name;
        if (strncmp(n, "kvs-", 4) != 0 || !isdigit((unsigned char) n[4])) continue;
        char *end;
        errno = 0;
        long pid = strtol(n + 4, &end, 10);
        if (errno != 0 || *end != '-' || pid <= 0 || pid != (long) (pid_t) pid) continue;
        if (kill((pid_t) pid, 0) == 0 || errno != ESRCH) continue; /* alive (EPERM: someone's) */
        char name[NAME_MAX + 2];
        snprintf(name, sizeof(name), "/%s", n);
        if (shm_unlink(name) == 0) {
            removed++;
            kvs_info("tpgroup: removed %s, left behind by process %ld, which is gone", name, pid);
        }
    }
    closedir(dir);
    return removed;
}
