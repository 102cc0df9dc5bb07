/* `kvstage bench transfer --transport ucx`: one request's KV cache from a prefill process to a
 * decode process on this host over the net link (ZeroMQ control, UCX data; host memory, CPU
 * copy backend), three ways, in one run:
 *   staged   - the protocol: senders in the prefill process, receivers in this one; gather into
 *              a staging buffer, one link write per chunk and writer into the decode ring,
 *              scatter into the decode pool; timed from add_room to Success on both sides;
 *   bulk     - the same bytes as one link write from a flat buffer into a flat exposed buffer
 *              (the data plane splits it into 4 MiB puts): the limit here;
 *   per-page - one link write per page x layer x K/V x head slice from the prefill pool into the
 *              flat buffer, timed over the first writes (whole pages) until all completed.
 * Raw writes use a second link pair between the same processes, so the protocol's ring is left
 * alone. The prefill process is forked before any ZeroMQ or UCX object exists and takes
 * commands over a pipe; both processes time on CLOCK_MONOTONIC, which they share. The staged
 * result of every row is checked on the decode side, every byte, against the position-keyed
 * content the prefill process wrote. With --checksum both (the default) staged and direct are
 * timed with chunk checksums on and off, both processes switching between rows, and their
 * cost is printed beside each row. */
#include "bench/bench_transfer_ucx.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "common/json.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/net.h"
#include "kvstage/pd.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "transport/link.h"

#define MS                1000000ull
#define SEC               (1000ull * MS)
#define OP_TIMEOUT_NS     (120ull * SEC)
#define TARGET_BULK_PCT   80.0 /* staged, of the raw bulk write ... */
#define TARGET_MIN_TOKENS 1024 /* ... for requests of at least this many tokens */
#define TARGET_SUM_PCT    10.0 /* the checksum's cost, % of the transfer time (every row) */
#define PP_WINDOW         64   /* per-page writes in flight */
#define PUT_BYTES         (4ull << 20)
#define LAYERS            32
#define KV_HEADS          8

enum { OP_ROOM = 1, OP_BULK, OP_PAGES, OP_MODE, OP_CHECKSUM, OP_QUIT };

/* One command to the prefill process and its answer (each well under PIPE_BUF: atomic). */
typedef struct {
    uint32_t op, tokens;
    uint64_t room, count; /* OP_BULK: bytes; OP_PAGES: writes; OP_MODE: kvs_write_mode_t;
                             OP_CHECKSUM: 1 for checksums off */
} cmd_t;

typedef struct {
    int32_t status; /* kvs_status_t */
    uint32_t pad;
    uint64_t t0, t1;  /* CLOCK_MONOTONIC ns */
    uint64_t writes;  /* link writes issued */
    uint64_t direct;  /* OP_ROOM: of writes, gathered straight into the decode ring */
    uint64_t bytes;   /* bytes written */
    uint64_t pp_each; /* OP_PAGES: writes per page */
} rsp_t;

typedef struct {
    uint32_t tokens;
    uint64_t bytes;
    double staged_gbs, direct_gbs, bulk_gbs, pp_gbs;
    double staged_off_gbs, direct_off_gbs; /* with checksums off (--checksum both), else 0 */
    uint64_t staged_writes, direct_writes, bulk_puts, pp_writes, pp_timed;
    uint64_t bad; /* decode bytes that differ after the checked staged and direct runs */
} row_t;

/* Everything one process holds: pools and page tables of its ranks, the protocol links and
 * objects, and the raw link with its flat buffer. */
typedef struct {
    const kvs_bench_ucx_cfg_t *cfg;
    kvs_pd_geometry_t geo;
    uint32_t tp, num_pages;
    kvs_pool_t *pool[KVS_MAX_TP];
    uint32_t *pages; /* [num_pages] the same ids on every rank: every page, random order */
    kvs_link_t *link[KVS_MAX_TP], *raw;
    kvs_sender_t *tx[KVS_MAX_TP];
    kvs_write_mode_t mode; /* prefill: the senders' write mode */
    kvs_receiver_t *rx[KVS_MAX_TP];
    uint8_t *flat; /* [max request bytes] bulk source (prefill) or raw target (decode) */
    uint64_t flat_bytes;
    kvs_clock_t clock;
} side_t;

static uint64_t bytes_per_token(const kvs_bench_ucx_cfg_t *cfg)
{
    return (uint64_t) LAYERS * 2 * KV_HEADS * cfg->head_dim * 2;
}

/* The content of head g of layer l, component c, token t: 8-byte words from a key of the
 * position, so a row moved to a wrong place cannot compare equal. */
static uint64_t row_key(uint32_t l, uint32_t c, uint32_t g, uint64_t t)
{
    return ((((uint64_t) l * 2 + c) * KV_HEADS + g) << 40) ^ t ^ 0x6b76737461676521ull;
}

static inline uint64_t mix(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void row_fill(uint8_t *dst, uint64_t key, uint64_t n)
{
    for (uint64_t i = 0; i < n; i += 8) {
        uint64_t v = mix(key + i);
        memcpy(dst + i, &v, 8);
    }
}

static uint64_t row_diff(const uint8_t *got, uint64_t key, uint64_t n)
{
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; i += 8) {
        uint64_t v = mix(key + i), w;
        memcpy(&w, got + i, 8);
        if (v != w)
            for (int b = 0; b < 8; b++) bad += ((v >> (8 * b)) & 0xff) != ((w >> (8 * b)) & 0xff);
    }
    return bad;
}

/* Visits every row of tokens [0, tokens) of this side's pools: fills them (prefill) or counts
 * the bytes that differ from the expected content (decode). */
static uint64_t rows_visit(const side_t *s, uint64_t tokens, int check)
{
    const uint32_t P = s->geo.page_size, hr = kvs_tp_heads_per_rank(&s->geo.shape, s->tp);
    uint64_t bad = 0;
    for (uint32_t r = 0; r < s->tp; r++) {
        for (uint32_t l = 0; l < LAYERS; l++) {
            for (uint32_t c = 0; c < 2; c++) {
                const kvs_region_t *rg = kvs_pool_region(s->pool[r], l, c);
                const uint64_t hb = (uint64_t) rg->dim * rg->elem_bytes;
                for (uint64_t t = 0; t < tokens; t++) {
                    for (uint32_t h = 0; h < hr; h++) {
                        uint8_t *a = kvs_region_addr(rg, s->pages[t / P], t % P, h);
                        uint64_t key = row_key(l, c, r * hr + h, t);
                        if (check)
                            bad += row_diff(a, key, hb);
                        else
                            row_fill(a, key, hb);
                    }
                }
            }
        }
    }
    return bad;
}

static void side_destroy(side_t *s)
{
    for (uint32_t r = 0; r < KVS_MAX_TP; r++) {
        kvs_sender_destroy(s->tx[r]);
        kvs_receiver_destroy(s->rx[r]);
    }
    for (uint32_t r = 0; r < KVS_MAX_TP; r++) kvs_link_destroy(s->link[r]);
    kvs_link_destroy(s->raw);
    for (uint32_t r = 0; r < KVS_MAX_TP; r++) kvs_pool_destroy(s->pool[r]);
    kvs_free(s->pages);
    kvs_free(s->flat);
    memset(s, 0, sizeof(*s));
}

static kvs_net_config_t net_cfg(const kvs_bench_ucx_cfg_t *cfg, kvs_side_t side, uint32_t rank,
                                uint32_t peer_tp)
{
    kvs_net_config_t c;
    memset(&c, 0, sizeof(c));
    c.side = side;
    c.rank = rank;
    c.peer_tp = peer_tp;
    c.bind = "tcp://127.0.0.1:0";
    c.data = cfg->tcp ? KVS_NET_DATA_TCP : KVS_NET_DATA_SHM;
    c.net_device = "lo";
    /* timed phases drive one link pair only: the other must not be declared dead meanwhile */
    c.liveness_timeout_ns = 60 * SEC;
    c.connect_timeout_ns = 30 * SEC;
    c.write_timeout_ns = 60 * SEC;
    return c;
}

/* Pools (every page taken, one shuffled table), links and flat buffer of one side; the
 * protocol objects come later, once the peers are known. */
static int side_create(const kvs_bench_ucx_cfg_t *cfg, kvs_side_t side, side_t *s)
{
    memset(s, 0, sizeof(*s));
    s->cfg = cfg;
    s->clock = kvs_clock_monotonic();
    s->geo.shape = (kvs_kv_shape_t){.layers = LAYERS,
                                    .kv_heads = KV_HEADS,
                                    .head_dim_k = cfg->head_dim,
                                    .head_dim_v = cfg->head_dim,
                                    .elem_bytes = 2,
                                    .attn = KVS_ATTN_MHA};
    s->geo.prefill_tp = cfg->prefill_tp;
    s->geo.decode_tp = cfg->decode_tp;
    s->geo.page_size = cfg->page_size;
    s->geo.chunk_tokens =
        cfg->chunk < cfg->page_size ? cfg->page_size : cfg->chunk / cfg->page_size * cfg->page_size;
    s->geo.no_checksum = cfg->checksum == KVS_BT_CSUM_OFF;
    if (kvs_pd_geometry_validate(&s->geo) != KVS_OK) return 0;
    s->tp = side == KVS_SIDE_PREFILL ? cfg->prefill_tp : cfg->decode_tp;
    uint32_t max_tokens = 0;
    for (int i = 0; i < cfg->ntokens; i++)
        if (cfg->tokens[i] > max_tokens) max_tokens = cfg->tokens[i];
    s->num_pages = (max_tokens + cfg->page_size - 1) / cfg->page_size;
    s->flat_bytes = (uint64_t) max_tokens * bytes_per_token(cfg);
    s->pages = kvs_calloc(s->num_pages, sizeof(uint32_t));
    uint32_t *scratch = kvs_calloc(s->num_pages, sizeof(uint32_t));
    s->flat = kvs_malloc(s->flat_bytes);
    int ok = s->pages != NULL && scratch != NULL && s->flat != NULL;
    kvs_rng_t rng;
    kvs_rng_seed(&rng, side == KVS_SIDE_PREFILL ? 0x7066ull : 0x6463ull);
    for (uint32_t r = 0; r < s->tp && ok; r++) {
        kvs_pool_config_t pc;
        memset(&pc, 0, sizeof(pc));
        pc.shape = s->geo.shape;
        pc.tp = (kvs_tp_t){.tp_size = s->tp, .tp_rank = r};
        pc.page_size = cfg->page_size;
        pc.num_pages = s->num_pages;
        pc.layout = cfg->nhd ? KVS_POOL_NHD : KVS_POOL_HND;
        pc.mem = KVS_MEM_HOST;
        ok = kvs_pool_create(&pc, &s->pool[r]) == KVS_OK &&
             kvs_pool_alloc(s->pool[r], s->num_pages, r == 0 ? s->pages : scratch) == KVS_OK;
    }
    for (uint32_t i = s->num_pages; ok && i > 1; i--) {
        uint32_t j = (uint32_t) kvs_rng_below(&rng, i), x = s->pages[i - 1];
        s->pages[i - 1] = s->pages[j];
        s->pages[j] = x;
    }
    kvs_free(scratch);
    /* touched now, so no first-touch fault lands in a timed write */
    if (ok) memset(s->flat, side == KVS_SIDE_PREFILL ? 0x5a : 0, s->flat_bytes);
    const uint32_t peer_tp = side == KVS_SIDE_PREFILL ? cfg->decode_tp : cfg->prefill_tp;
    for (uint32_t r = 0; r < s->tp && ok; r++) {
        kvs_net_config_t c = net_cfg(cfg, side, r, peer_tp);
        ok = kvs_net_link_create(&c, &s->link[r]) == KVS_OK;
    }
    if (ok) {
        kvs_net_config_t c = net_cfg(cfg, side, 0, 1);
        ok = kvs_net_link_create(&c, &s->raw) == KVS_OK;
    }
    if (!ok) {
        fprintf(stderr, "error: setting up the %s side failed\n",
                side == KVS_SIDE_PREFILL ? "prefill" : "decode");
        side_destroy(s);
    }
    return ok;
}

/* ---- pipes ---- */

static void nap_us(long us)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = us * 1000};
    (void) nanosleep(&ts, NULL);
}

static int write_full(int fd, const void *buf, size_t n)
{
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, (const char *) buf + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0;
        done += (size_t) w;
    }
    return 1;
}

/* 1: a whole message read; 0: none waiting; -1: the other process is gone. */
static int try_read(int fd, void *buf, size_t n)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 0) <= 0) return 0;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *) buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        got += (size_t) r;
    }
    return 1;
}

/* ---- the prefill process ---- */

static void prefill_idle(side_t *s)
{
    for (uint32_t r = 0; r < s->tp; r++) kvs_sender_progress(s->tx[r]);
    (void) kvs_net_link_progress(s->raw);
}

static uint64_t sender_writes(side_t *s, int direct)
{
    uint64_t n = 0;
    for (uint32_t r = 0; r < s->tp; r++) {
        kvs_pd_metrics_t m;
        kvs_sender_metrics(s->tx[r], &m);
        n += direct ? m.direct_writes : m.bulk_writes;
    }
    return n;
}

/* (Re)creates the senders on the same links when the write mode changes. Only between rooms
 * and before decode adds the next one: a sender may hold (and has acknowledged) metadata of a
 * room it was not given yet, which a new sender would never see. */
static kvs_status_t senders_mode(side_t *s, kvs_write_mode_t mode)
{
    if (s->tx[0] != NULL && s->mode == mode) return KVS_OK;
    kvs_pd_timeouts_t to;
    kvs_pd_timeouts_default(&to);
    for (uint32_t r = 0; r < s->tp; r++) {
        kvs_sender_destroy(s->tx[r]);
        s->tx[r] = NULL;
        kvs_sender_config_t sc = {.geo = s->geo,
                                  .rank = r,
                                  .timeouts = to,
                                  .window_chunks = s->cfg->window,
                                  .staging_buffers = s->cfg->buffers,
                                  .write_mode = mode};
        kvs_status_t st = kvs_sender_create(&sc, s->pool[r], s->link[r], &s->clock, &s->tx[r]);
        if (st != KVS_OK) return st;
    }
    s->mode = mode;
    return KVS_OK;
}

/* Recreates the senders with chunk checksums on or off (no_checksum 1), under the same rule as
 * senders_mode; the decode process recreates its receivers to match right after. */
static kvs_status_t senders_checksum(side_t *s, uint32_t no_checksum)
{
    if (s->geo.no_checksum == no_checksum) return KVS_OK;
    s->geo.no_checksum = no_checksum;
    for (uint32_t r = 0; r < s->tp; r++) {
        kvs_sender_destroy(s->tx[r]);
        s->tx[r] = NULL;
    }
    return senders_mode(s, s->mode);
}

static kvs_status_t prefill_room(side_t *s, const cmd_t *c, rsp_t *out)
{
    const uint32_t final = 42;
    kvs_status_t st = KVS_OK;
    const uint64_t before = sender_writes(s, 0), before_direct = sender_writes(s, 1);
    out->t0 = kvs_now_ns();
    for (uint32_t r = 0; r < s->tp && st == KVS_OK; r++) {
        st = kvs_sender_add_room(s->tx[r], c->room, c->tokens, s->pages);
        if (st == KVS_OK) st = kvs_sender_finish(s->tx[r], c->room, &final, sizeof(final));
    }
    for (uint32_t done = 0; st == KVS_OK && done < s->tp;) {
        uint32_t events = 0;
        for (uint32_t r = 0; r < s->tp; r++) events += kvs_sender_progress(s->tx[r]);
        if (events == 0) sched_yield();
        done = 0;
        for (uint32_t r = 0; r < s->tp && st == KVS_OK; r++) {
            kvs_room_info_t info;
            st = kvs_sender_poll(s->tx[r], c->room, &info);
            if (st == KVS_OK && info.status == KVS_ROOM_FAILED && info.quiescent)
                st = info.reason != KVS_OK ? info.reason : KVS_ERR_IO;
            done += st == KVS_OK && info.status == KVS_ROOM_SUCCESS && info.quiescent;
        }
        if (st == KVS_OK && kvs_now_ns() - out->t0 > OP_TIMEOUT_NS) st = KVS_ERR_TIMEOUT;
    }
    out->t1 = kvs_now_ns();
    out->writes = sender_writes(s, 0) - before;
    out->direct = sender_writes(s, 1) - before_direct;
    for (uint32_t r = 0; r < s->tp; r++) (void) kvs_sender_release(s->tx[r], c->room);
    return st;
}

static kvs_status_t wait_write(kvs_link_t *l, uint64_t ticket, uint64_t t0)
{
    for (;;) {
        kvs_status_t st = l->ops->write_poll(l->ctx, ticket);
        if (st != KVS_INPROGRESS) return st;
        if (kvs_now_ns() - t0 > OP_TIMEOUT_NS) return KVS_ERR_TIMEOUT;
    }
}

static kvs_status_t prefill_bulk(side_t *s, const cmd_t *c, rsp_t *out)
{
    kvs_link_t *l = s->raw;
    uint64_t ticket = 0;
    out->t0 = kvs_now_ns();
    kvs_status_t st = l->ops->write(l->ctx, 0, 0, s->flat, c->count, &ticket);
    if (st == KVS_OK) st = wait_write(l, ticket, out->t0);
    out->t1 = kvs_now_ns();
    out->writes = 1;
    out->bytes = c->count;
    return st;
}

/* Per-page writes [0, count): pages outermost, then decode rank, writer, layer, K/V; write n
 * lands at n * slice bytes of the flat buffer (HND, or NHD with every head: a page's head slice
 * is one run). */
static kvs_status_t prefill_pages(side_t *s, const cmd_t *c, rsp_t *out)
{
    const kvs_pd_geometry_t *g = &s->geo;
    kvs_writer_t w[KVS_MAX_TP][KVS_MAX_WRITERS];
    uint32_t nw[KVS_MAX_TP];
    uint64_t each = 0;
    for (uint32_t d = 0; d < g->decode_tp; d++) {
        if (kvs_plan_writers(&g->shape, g->prefill_tp, g->decode_tp, d, 1, w[d], &nw[d]) != KVS_OK)
            return KVS_ERR_INVALID;
        each += (uint64_t) nw[d] * LAYERS * 2;
    }
    const uint64_t hb = (uint64_t) g->shape.head_dim_k * g->shape.elem_bytes;
    kvs_link_t *l = s->raw;
    uint64_t tickets[PP_WINDOW];
    uint64_t issued = 0, done = 0, off = 0;
    kvs_status_t st = KVS_OK;
    out->t0 = kvs_now_ns();
    while (st == KVS_OK && done < c->count) {
        /* retire in order: the oldest write is the one most likely complete */
        while (st == KVS_OK && done < issued) {
            kvs_status_t p = l->ops->write_poll(l->ctx, tickets[done % PP_WINDOW]);
            if (p == KVS_INPROGRESS) break;
            st = p;
            done++;
        }
        while (st == KVS_OK && issued < c->count && issued - done < PP_WINDOW) {
            uint64_t page = issued / each, k = issued % each;
            uint32_t d = 0;
            while (k >= (uint64_t) nw[d] * LAYERS * 2) k -= (uint64_t) nw[d++] * LAYERS * 2;
            const kvs_writer_t *wr = &w[d][k / (LAYERS * 2)];
            uint32_t layer = (uint32_t) (k % (LAYERS * 2)) / 2, comp = (uint32_t) (k % 2);
            const kvs_region_t *rg = kvs_pool_region(s->pool[wr->prefill_rank], layer, comp);
            const uint8_t *src = kvs_region_addr(rg, s->pages[page], 0, wr->src_head);
            const uint64_t len = (uint64_t) wr->heads * g->page_size * hb;
            if (off + len > s->flat_bytes) off = 0;
            st = l->ops->write(l->ctx, 0, off, src, len, &tickets[issued % PP_WINDOW]);
            off += len;
            out->bytes += len;
            issued++;
        }
        if (kvs_now_ns() - out->t0 > OP_TIMEOUT_NS) st = KVS_ERR_TIMEOUT;
    }
    /* on failure, still wait for what is in flight before the pool may be touched again */
    while (done < issued) {
        (void) wait_write(l, tickets[done % PP_WINDOW], kvs_now_ns());
        done++;
    }
    out->t1 = kvs_now_ns();
    out->writes = issued;
    out->pp_each = each;
    return st;
}

/* Sets up, reports the endpoints, then serves commands until OP_QUIT or EOF. */
static int prefill_main(const kvs_bench_ucx_cfg_t *cfg, int cmd_fd, int rsp_fd)
{
    side_t s;
    if (!side_create(cfg, KVS_SIDE_PREFILL, &s)) return 2;
    int ok = senders_mode(&s, KVS_WRITE_STAGED) == KVS_OK;
    uint64_t max_tokens = s.num_pages * (uint64_t) cfg->page_size;
    if (ok) (void) rows_visit(&s, max_tokens, 0);
    char eps[(KVS_MAX_TP + 1) * 128] = "";
    for (uint32_t r = 0; ok && r <= s.tp; r++) {
        const char *ep = kvs_net_link_endpoint(r < s.tp ? s.link[r] : s.raw);
        snprintf(eps + strlen(eps), sizeof(eps) - strlen(eps), "%s ", ep);
    }
    uint32_t n = ok ? (uint32_t) strlen(eps) : 0;
    ok = write_full(rsp_fd, &n, 4) && n > 0 && write_full(rsp_fd, eps, n) && ok;
    int code = ok ? 0 : 3;
    while (ok) {
        cmd_t c;
        int got = try_read(cmd_fd, &c, sizeof(c));
        if (got < 0 || (got == 1 && c.op == OP_QUIT)) break;
        if (got == 0) {
            prefill_idle(&s);
            nap_us(20);
            continue;
        }
        rsp_t out;
        memset(&out, 0, sizeof(out));
        kvs_status_t st = c.op == OP_ROOM       ? prefill_room(&s, &c, &out)
                          : c.op == OP_BULK     ? prefill_bulk(&s, &c, &out)
                          : c.op == OP_PAGES    ? prefill_pages(&s, &c, &out)
                          : c.op == OP_MODE     ? senders_mode(&s, (kvs_write_mode_t) c.count)
                          : c.op == OP_CHECKSUM ? senders_checksum(&s, (uint32_t) c.count)
                                                : KVS_ERR_INVALID;
        out.status = (int32_t) st;
        if (!write_full(rsp_fd, &out, sizeof(out))) code = 4;
        if (st != KVS_OK || code != 0) break;
    }
    side_destroy(&s);
    return code;
}

/* ---- the decode process: drives the run ---- */

typedef struct {
    const kvs_bench_ucx_cfg_t *cfg;
    side_t s;
    pid_t child;
    int cmd_fd, rsp_fd;
    uint64_t next_room;
} run_t;

static void decode_idle(run_t *u)
{
    for (uint32_t r = 0; r < u->s.tp; r++)
        if (u->s.rx[r] != NULL) kvs_receiver_progress(u->s.rx[r]);
    (void) kvs_net_link_progress(u->s.raw);
}

/* Waits for the prefill process's answer, keeping this side's links served. */
static int await(run_t *u, rsp_t *out, const char *what)
{
    const uint64_t t0 = kvs_now_ns();
    for (;;) {
        int got = try_read(u->rsp_fd, out, sizeof(*out));
        if (got == 1) break;
        if (got < 0) {
            fprintf(stderr, "error: %s: the prefill process is gone\n", what);
            return 0;
        }
        decode_idle(u);
        if (kvs_now_ns() - t0 > OP_TIMEOUT_NS) {
            fprintf(stderr, "error: %s: no answer from the prefill process\n", what);
            return 0;
        }
    }
    if (out->status != KVS_OK) {
        fprintf(stderr, "error: %s failed in the prefill process: %s\n", what,
                kvs_status_str((kvs_status_t) out->status));
        return 0;
    }
    return 1;
}

static int command(run_t *u, uint32_t op, uint32_t tokens, uint64_t room, uint64_t count)
{
    cmd_t c = {.op = op, .tokens = tokens, .room = room, .count = count};
    if (write_full(u->cmd_fd, &c, sizeof(c))) return 1;
    fprintf(stderr, "error: cannot reach the prefill process\n");
    return 0;
}

/* One request through the protocol; *sec_p from the first add_room to the last Success of
 * either process. */
static int protocol_room(run_t *u, uint32_t tokens, double *sec_p, rsp_t *out_p)
{
    side_t *s = &u->s;
    const uint64_t room = ++u->next_room;
    if (!command(u, OP_ROOM, tokens, room, 0)) return 0;
    const uint64_t t0 = kvs_now_ns();
    kvs_status_t st = KVS_OK;
    for (uint32_t r = 0; r < s->tp && st == KVS_OK; r++)
        st = kvs_receiver_add_room(s->rx[r], room, 0, tokens, s->pages);
    for (uint32_t done = 0; st == KVS_OK && done < s->tp;) {
        uint32_t events = 0;
        for (uint32_t r = 0; r < s->tp; r++) events += kvs_receiver_progress(s->rx[r]);
        if (events == 0) sched_yield();
        done = 0;
        for (uint32_t r = 0; r < s->tp && st == KVS_OK; r++) {
            kvs_room_info_t info;
            st = kvs_receiver_poll(s->rx[r], room, &info);
            if (st == KVS_OK && info.status == KVS_ROOM_FAILED && info.quiescent)
                st = info.reason != KVS_OK ? info.reason : KVS_ERR_IO;
            done += st == KVS_OK && info.status == KVS_ROOM_SUCCESS && info.quiescent;
        }
        if (st == KVS_OK && kvs_now_ns() - t0 > OP_TIMEOUT_NS) st = KVS_ERR_TIMEOUT;
    }
    const uint64_t t1 = kvs_now_ns();
    for (uint32_t r = 0; r < s->tp; r++) (void) kvs_receiver_release(s->rx[r], room);
    if (st != KVS_OK) {
        fprintf(stderr, "error: a %u-token request failed on decode: %s\n", tokens,
                kvs_status_str(st));
        return 0;
    }
    rsp_t out;
    if (!await(u, &out, "the protocol request")) return 0;
    const uint64_t a = t0 < out.t0 ? t0 : out.t0, b = t1 > out.t1 ? t1 : out.t1;
    *sec_p = (double) (b - a) / 1e9;
    *out_p = out;
    return 1;
}

/* Timed protocol requests in one write mode; the last one is checked on decode, every byte,
 * after poisoning the decode pools. Adds the wrong bytes to row->bad. */
static int protocol_rows(run_t *u, row_t *row, kvs_write_mode_t mode, double *gbs_p, rsp_t *last_p)
{
    const kvs_bench_ucx_cfg_t *cfg = u->cfg;
    const side_t *s = &u->s;
    const uint32_t n = cfg->warmup + cfg->reps;
    double t[1000];
    rsp_t ack;
    if (!command(u, OP_MODE, 0, 0, (uint64_t) mode) || !await(u, &ack, "the write mode switch"))
        return 0;
    for (uint32_t i = 0; i < n; i++) {
        if (i + 1 == n)
            for (uint32_t r = 0; r < s->tp; r++) {
                const kvs_region_t *first = kvs_pool_region(s->pool[r], 0, 0);
                const kvs_region_t *last = kvs_pool_region(s->pool[r], LAYERS - 1, 1);
                memset(first->base, 0xee,
                       (uint64_t) (last->base - first->base) +
                           (uint64_t) s->num_pages * last->page_stride);
            }
        double sec = 0;
        if (!protocol_room(u, row->tokens, &sec, last_p)) return 0;
        if (i >= cfg->warmup) t[i - cfg->warmup] = sec;
    }
    *gbs_p = (double) row->bytes / 1e9 / kvs_bt_median(t, cfg->reps);
    row->bad += rows_visit(&u->s, row->tokens, 1);
    return 1;
}

/* The raw link writes of one row: the bulk write and the per-page writes. */
static int measure_raw(run_t *u, row_t *row)
{
    const kvs_bench_ucx_cfg_t *cfg = u->cfg;
    const uint32_t n = cfg->warmup + cfg->reps;
    double t[1000];
    rsp_t out;
    /* raw bulk write */
    for (uint32_t i = 0; i < n; i++) {
        if (!command(u, OP_BULK, row->tokens, 0, row->bytes) || !await(u, &out, "the bulk write"))
            return 0;
        if (i >= cfg->warmup) t[i - cfg->warmup] = (double) (out.t1 - out.t0) / 1e9;
    }
    row->bulk_gbs = (double) row->bytes / 1e9 / kvs_bt_median(t, cfg->reps);
    row->bulk_puts = (row->bytes + PUT_BYTES - 1) / PUT_BYTES;
    /* per-page writes, whole pages, capped */
    const side_t *s = &u->s;
    const uint64_t pages = (row->tokens + s->geo.page_size - 1) / s->geo.page_size;
    uint64_t each = 0;
    for (uint32_t d = 0; d < cfg->decode_tp; d++) {
        kvs_writer_t w[KVS_MAX_WRITERS];
        uint32_t nw = 0;
        if (kvs_plan_writers(&s->geo.shape, cfg->prefill_tp, cfg->decode_tp, d, 1, w, &nw) !=
            KVS_OK)
            return 0;
        each += (uint64_t) nw * LAYERS * 2;
    }
    row->pp_writes = pages * each;
    uint64_t count = row->pp_writes;
    if (count > cfg->per_page_max)
        count = (cfg->per_page_max / each > 0 ? cfg->per_page_max / each : 1) * each;
    for (uint32_t i = 0; i < n; i++) {
        if (!command(u, OP_PAGES, row->tokens, 0, count) || !await(u, &out, "the per-page writes"))
            return 0;
        if (i >= cfg->warmup) t[i - cfg->warmup] = (double) (out.t1 - out.t0) / 1e9;
    }
    row->pp_timed = count;
    row->pp_gbs = (double) out.bytes / 1e9 / kvs_bt_median(t, cfg->reps);
    return 1;
}

/* The decode ranks' receivers on their links, in this side's geometry. */
static int receivers_create(run_t *u)
{
    side_t *s = &u->s;
    kvs_pd_timeouts_t to;
    kvs_pd_timeouts_default(&to);
    for (uint32_t r = 0; r < s->tp; r++) {
        kvs_receiver_config_t rc = {.geo = s->geo,
                                    .rank = r,
                                    .timeouts = to,
                                    .ring_bytes =
                                        u->cfg->ring_slots * kvs_bt_full_slot_bytes(&s->geo)};
        if (kvs_receiver_create(&rc, s->pool[r], s->link[r], &s->clock, &s->rx[r]) != KVS_OK)
            return 0;
    }
    return 1;
}

/* Turns chunk checksums on or off on both sides, between rooms: the prefill process recreates
 * its senders first, then this one its receivers (a new ring, exposed anew). */
static int receivers_checksum(run_t *u, uint32_t no_checksum)
{
    side_t *s = &u->s;
    if (s->geo.no_checksum == no_checksum) return 1;
    rsp_t ack;
    if (!command(u, OP_CHECKSUM, 0, 0, no_checksum) || !await(u, &ack, "the checksum switch"))
        return 0;
    for (uint32_t r = 0; r < s->tp; r++) {
        kvs_receiver_destroy(s->rx[r]);
        s->rx[r] = NULL;
    }
    s->geo.no_checksum = no_checksum;
    return receivers_create(u);
}

/* The protocol rows of one row, staged puts then direct writes where the link maps the ring
 * (auto), in each checksum setting --checksum names. With both, the setting left from the row
 * before goes first, so the order alternates row by row and only one switch is needed. */
static int measure_protocol(run_t *u, row_t *row)
{
    const int both = u->cfg->checksum == KVS_BT_CSUM_BOTH;
    uint32_t no_checksum = u->s.geo.no_checksum;
    rsp_t out;
    for (int k = 0; k < (both ? 2 : 1); k++, no_checksum ^= 1) {
        if (!receivers_checksum(u, no_checksum)) return 0;
        const int off = both && no_checksum;
        if (!protocol_rows(u, row, KVS_WRITE_STAGED, off ? &row->staged_off_gbs : &row->staged_gbs,
                           &out))
            return 0;
        row->staged_writes = out.writes;
        if (!protocol_rows(u, row, KVS_WRITE_AUTO, off ? &row->direct_off_gbs : &row->direct_gbs,
                           &out))
            return 0;
        row->direct_writes = out.direct;
    }
    return 1;
}

static int measure_row(run_t *u, row_t *row)
{
    return measure_raw(u, row) && measure_protocol(u, row);
}

static int decode_setup(run_t *u)
{
    const kvs_bench_ucx_cfg_t *cfg = u->cfg;
    side_t *s = &u->s;
    uint32_t n = 0;
    static char eps[(KVS_MAX_TP + 1) * 128];
    uint64_t t0 = kvs_now_ns();
    for (int got = 0; got == 0;) {
        got = try_read(u->rsp_fd, &n, 4);
        if (got < 0 || (got == 1 && (n == 0 || n >= sizeof(eps))) ||
            kvs_now_ns() - t0 > OP_TIMEOUT_NS) {
            fprintf(stderr, "error: the prefill process did not start\n");
            return 0;
        }
        if (got == 0) nap_us(1000);
    }
    size_t have = 0;
    while (have < n) {
        ssize_t r = read(u->rsp_fd, eps + have, n - have);
        if (r <= 0) return 0;
        have += (size_t) r;
    }
    eps[n] = '\0';
    char *save = NULL;
    const char *ep[KVS_MAX_TP + 1];
    for (uint32_t p = 0; p <= cfg->prefill_tp; p++) {
        ep[p] = strtok_r(p == 0 ? eps : NULL, " ", &save);
        if (ep[p] == NULL) return 0;
    }
    for (uint32_t r = 0; r < s->tp; r++)
        for (uint32_t p = 0; p < cfg->prefill_tp; p++)
            if (kvs_net_link_set_peer(s->link[r], p, ep[p]) != KVS_OK) return 0;
    if (kvs_net_link_set_peer(s->raw, 0, ep[cfg->prefill_tp]) != KVS_OK ||
        s->raw->ops->expose(s->raw->ctx, s->flat, s->flat_bytes) != KVS_OK)
        return 0;
    return receivers_create(u);
}

/* ---- output ---- */

static void print_row(const row_t *r)
{
    char sum_st[16], sum_dir[16];
    kvs_bt_csum_cell(sum_st, sizeof(sum_st), 7, r->staged_gbs, r->staged_off_gbs, "-");
    kvs_bt_csum_cell(sum_dir, sizeof(sum_dir), 7, r->direct_gbs, r->direct_off_gbs, "-");
    printf("%6u %8.1f %6.2f %6.2f %6.1f%% %6.2f %6.1f%% %8.3f %6.1fx %6llu %6llu %5llu %8llu "
           "%7llu %-6s %s %s\n",
           r->tokens, (double) r->bytes / (1 << 20), r->bulk_gbs, r->staged_gbs,
           100.0 * r->staged_gbs / r->bulk_gbs, r->direct_gbs, 100.0 * r->direct_gbs / r->bulk_gbs,
           r->pp_gbs, r->direct_gbs / r->pp_gbs, (unsigned long long) r->staged_writes,
           (unsigned long long) r->direct_writes, (unsigned long long) r->bulk_puts,
           (unsigned long long) r->pp_writes, (unsigned long long) r->pp_timed,
           r->bad ? "FAILED" : "ok", sum_st, sum_dir);
    fflush(stdout);
}

/* The rows against the targets: the direct one and the checksum's cost. */
typedef struct {
    int rows, met, rows_sum, met_sum, failed;
    double worst, worst_sum;
} summary_t;

/* The checksum's cost in row r's staged and direct runs, where measured. */
static void json_csum(kvs_json_t *j, const row_t *r)
{
    double pct = 0;
    if (kvs_bt_csum_cost(r->staged_gbs, r->staged_off_gbs, &pct)) {
        kvs_json_double(j, "staged_gbs_no_checksum", r->staged_off_gbs);
        kvs_json_double(j, "staged_checksum_cost_pct", pct);
    }
    if (kvs_bt_csum_cost(r->direct_gbs, r->direct_off_gbs, &pct)) {
        kvs_json_double(j, "direct_gbs_no_checksum", r->direct_off_gbs);
        kvs_json_double(j, "direct_checksum_cost_pct", pct);
    }
}

static void print_json(const kvs_bench_ucx_cfg_t *cfg, uint32_t chunk_tokens, const row_t *rows,
                       int nrows, const char *hw, const summary_t *sm)
{
    static const char *const csum_names[] = {"both", "on", "off"};
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_str(&j, "transport", "ucx");
    kvs_json_str(&j, "device", "cpu");
    kvs_json_str(&j, "data", cfg->tcp ? "tcp" : "shm");
    kvs_json_str(&j, "hardware", hw);
    kvs_json_object_begin(&j, "shape");
    kvs_json_u64(&j, "layers", LAYERS);
    kvs_json_u64(&j, "kv_heads", KV_HEADS);
    kvs_json_u64(&j, "head_dim", cfg->head_dim);
    kvs_json_u64(&j, "elem_bytes", 2);
    kvs_json_object_end(&j);
    kvs_json_u64(&j, "prefill_tp", cfg->prefill_tp);
    kvs_json_u64(&j, "decode_tp", cfg->decode_tp);
    kvs_json_str(&j, "layout", cfg->nhd ? "nhd" : "hnd");
    kvs_json_u64(&j, "page_size", cfg->page_size);
    kvs_json_u64(&j, "chunk_tokens", chunk_tokens);
    kvs_json_u64(&j, "reps", cfg->reps);
    kvs_json_str(&j, "checksum", csum_names[cfg->checksum]);
    kvs_json_array_begin(&j, "rows");
    for (int i = 0; i < nrows; i++) {
        const row_t *r = &rows[i];
        kvs_json_object_begin(&j, NULL);
        kvs_json_u64(&j, "tokens", r->tokens);
        kvs_json_u64(&j, "bytes", r->bytes);
        kvs_json_double(&j, "bulk_gbs", r->bulk_gbs);
        kvs_json_double(&j, "staged_gbs", r->staged_gbs);
        kvs_json_double(&j, "per_page_gbs", r->pp_gbs);
        kvs_json_double(&j, "direct_gbs", r->direct_gbs);
        kvs_json_double(&j, "staged_over_bulk", r->staged_gbs / r->bulk_gbs);
        kvs_json_double(&j, "direct_over_bulk", r->direct_gbs / r->bulk_gbs);
        kvs_json_double(&j, "direct_over_per_page", r->direct_gbs / r->pp_gbs);
        kvs_json_u64(&j, "staged_writes", r->staged_writes);
        kvs_json_u64(&j, "direct_writes", r->direct_writes);
        kvs_json_u64(&j, "bulk_writes", 1);
        kvs_json_u64(&j, "bulk_puts", r->bulk_puts);
        kvs_json_u64(&j, "per_page_writes", r->pp_writes);
        kvs_json_u64(&j, "per_page_writes_timed", r->pp_timed);
        json_csum(&j, r);
        kvs_json_u64(&j, "bytes_wrong", r->bad);
        kvs_json_bool(&j, "check_ok", r->bad == 0);
        kvs_json_object_end(&j);
    }
    kvs_json_array_end(&j);
    kvs_json_object_begin(&j, "targets");
    kvs_json_double(&j, "direct_over_bulk_min", TARGET_BULK_PCT / 100.0);
    kvs_json_u64(&j, "min_tokens", TARGET_MIN_TOKENS);
    kvs_json_u64(&j, "rows", (uint64_t) sm->rows);
    kvs_json_u64(&j, "rows_met", (uint64_t) sm->met);
    kvs_json_double(&j, "checksum_cost_max_pct", TARGET_SUM_PCT);
    kvs_json_u64(&j, "checksum_rows", (uint64_t) sm->rows_sum);
    kvs_json_u64(&j, "checksum_rows_met", (uint64_t) sm->met_sum);
    kvs_json_object_end(&j);
    kvs_json_end(&j);
}

static void print_header(const kvs_bench_ucx_cfg_t *cfg, const char *hw, uint64_t bpt)
{
    printf("kvstage bench transfer --transport ucx: one request's KV cache, prefill process "
           "-> decode process on this host\n");
    printf("hardware: %s\n", hw);
    printf("link: ZeroMQ control + UCX data over %s (loopback); CPU copy backend\n",
           cfg->tcp ? "tcp" : "shared memory (cma puts; decode rings in UCX shared memory)");
    printf("shape: 8B-class scaled down: %u layers, %u KV heads, head dim %u, bf16 (%llu "
           "KiB/token); %s pools, page %u, pages in random order; TP %u -> %u; chunk %u "
           "tokens, window %u, %u staging buffers, ring %u slots\n",
           LAYERS, KV_HEADS, cfg->head_dim, (unsigned long long) (bpt >> 10),
           cfg->nhd ? "NHD" : "HND", cfg->page_size, cfg->prefill_tp, cfg->decode_tp, cfg->chunk,
           cfg->window, cfg->buffers, cfg->ring_slots);
    printf("staged: the protocol, sender and receiver in two processes, timed from add_room "
           "to Success on both; gather into a staging buffer, one put per chunk and writer\n");
    printf("direct: the same in the default write mode (auto): where the link maps the decode "
           "ring (shared memory), the gather stores straight into the granted slot\n");
    printf("bulk: one link write of the same bytes, flat buffer to flat exposed buffer "
           "(4 MiB puts + flush): the limit\n");
    printf("per-page: one link write per page x layer x K/V x head slice into a flat buffer, "
           "%d in flight, timed over up to %llu writes (whole pages), rate extrapolated\n",
           PP_WINDOW, (unsigned long long) cfg->per_page_max);
    printf("each: median of %u after %u warm-up; GB/s = payload bytes / time, 1 GB = 1e9 B; "
           "check: every byte of the last staged run, on decode\n",
           cfg->reps, cfg->warmup);
    printf("checksums %s: staged and direct %s\n",
           cfg->checksum == KVS_BT_CSUM_BOTH ? "both"
           : cfg->checksum == KVS_BT_CSUM_ON ? "on"
                                             : "off",
           cfg->checksum == KVS_BT_CSUM_BOTH
               ? "with chunk checksums on (the default); sum-st, sum-dir: their cost, (time on - "
                 "time off) / time off, the same runs repeated with checksums off"
           : cfg->checksum == KVS_BT_CSUM_ON ? "with chunk checksums on (the default)"
                                             : "with chunk checksums OFF");
    printf("target: the default path (direct) >= %.0f%% of bulk for requests >= %u tokens\n",
           TARGET_BULK_PCT, TARGET_MIN_TOKENS);
    printf("  checksum cost <= %.0f%% of the transfer time with staged and direct\n\n",
           TARGET_SUM_PCT);
    printf("%6s %8s %6s %6s %7s %6s %7s %8s %7s %6s %6s %5s %8s %7s %-6s %7s %7s\n", "tokens",
           "MiB", "bulk", "staged", "%bulk", "direct", "%bulk", "per-page", "dir/pp", "st-wr",
           "dir-wr", "puts", "pp-wr", "pp-time", "check", "sum-st", "sum-dir");
}

/* Forks the prefill process, commands on one pipe and answers on another, into u; 0, or -1
 * after saying why. */
static int start_prefill(const kvs_bench_ucx_cfg_t *cfg, run_t *u)
{
    int cmd[2], rsp[2];
    if (pipe(cmd) != 0 || pipe(rsp) != 0) {
        fprintf(stderr, "error: pipe: %s\n", strerror(errno));
        return -1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "error: fork: %s\n", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        close(cmd[1]);
        close(rsp[0]);
        signal(SIGPIPE, SIG_IGN);
        _exit(prefill_main(cfg, cmd[0], rsp[1]));
    }
    close(cmd[0]);
    close(rsp[1]);
    memset(u, 0, sizeof(*u));
    u->cfg = cfg;
    u->child = pid;
    u->cmd_fd = cmd[1];
    u->rsp_fd = rsp[0];
    return 0;
}

/* Lets the prefill process go (after ok, with a quit command), serving our links until it has
 * exited; kills it after a failure or 30 s. Returns ok, cleared when it did not exit cleanly. */
static int stop_prefill(run_t *u, int ok, int have_side)
{
    if (ok) ok = command(u, OP_QUIT, 0, 0, 0);
    close(u->cmd_fd);
    int status = 0;
    const uint64_t end = kvs_now_ns() + 30 * SEC;
    pid_t got;
    while ((got = waitpid(u->child, &status, WNOHANG)) == 0) {
        if (have_side) decode_idle(u);
        if (!ok || kvs_now_ns() > end) {
            kill(u->child, SIGKILL);
            (void) waitpid(u->child, &status, 0);
            break;
        }
        nap_us(100);
    }
    if (ok && (got != u->child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)) {
        fprintf(stderr, "error: the prefill process did not exit cleanly\n");
        ok = 0;
    }
    close(u->rsp_fd);
    return ok;
}

static void summarize(const row_t *rows, int nrows, summary_t *sm)
{
    *sm = (summary_t){.worst = 1e9, .worst_sum = -1e9};
    for (int i = 0; i < nrows; i++) {
        const row_t *r = &rows[i];
        sm->failed += r->bad != 0;
        if (r->tokens >= TARGET_MIN_TOKENS) {
            double pct = 100.0 * r->direct_gbs / r->bulk_gbs;
            sm->rows++;
            sm->met += pct >= TARGET_BULK_PCT;
            if (pct < sm->worst) sm->worst = pct;
        }
        double st = 0, dir = 0;
        if (kvs_bt_csum_cost(r->staged_gbs, r->staged_off_gbs, &st) &&
            kvs_bt_csum_cost(r->direct_gbs, r->direct_off_gbs, &dir)) {
            const double worst = st > dir ? st : dir;
            sm->rows_sum++;
            sm->met_sum += worst <= TARGET_SUM_PCT;
            if (worst > sm->worst_sum) sm->worst_sum = worst;
        }
    }
}

/* Rows against the targets, printed as the summary or the JSON object; the rows that failed
 * their check. */
static int report(const kvs_bench_ucx_cfg_t *cfg, int ok, uint32_t chunk_tokens, const row_t *rows,
                  int nrows, const char *hw)
{
    summary_t sm;
    summarize(rows, nrows, &sm);
    if (cfg->json) {
        print_json(cfg, chunk_tokens, rows, nrows, hw, &sm);
        return sm.failed;
    }
    printf("\n");
    if (!ok) printf("summary: FAILED to run (see the error above)\n");
    if (sm.rows)
        printf("summary: %d/%d rows from %u tokens reach %.0f%% of bulk with direct (worst "
               "%.1f%%)\n",
               sm.met, sm.rows, TARGET_MIN_TOKENS, TARGET_BULK_PCT, sm.worst);
    if (sm.rows_sum)
        printf("summary: %d/%d rows keep the checksum's cost <= %.0f%% of the transfer time with "
               "staged and direct (worst %.1f%%)\n",
               sm.met_sum, sm.rows_sum, TARGET_SUM_PCT, sm.worst_sum);
    printf("check: %s\n",
           sm.failed ? "FAILED" : "every byte of every staged and direct row exact on decode");
    return sm.failed;
}

int kvs_bench_transfer_ucx(const kvs_bench_ucx_cfg_t *cfg)
{
    char model[128], hw[256];
    long cores = 0;
    kvs_bench_cpu_info(model, sizeof(model), &cores);
    snprintf(hw, sizeof(hw), "%s, %ld cores, host memory", model, cores);
    const uint64_t bpt = bytes_per_token(cfg);
    if (!cfg->json) print_header(cfg, hw, bpt);
    fflush(stdout);
    fflush(stderr);
    run_t u;
    if (start_prefill(cfg, &u) != 0) return 1;
    void (*old_pipe)(int) = signal(SIGPIPE, SIG_IGN);
    row_t *rows = kvs_calloc((size_t) cfg->ntokens, sizeof(row_t));
    int ok = rows != NULL && side_create(cfg, KVS_SIDE_DECODE, &u.s);
    int have_side = ok;
    if (ok) ok = decode_setup(&u);
    int nrows = 0;
    for (int i = 0; ok && i < cfg->ntokens; i++) {
        row_t *r = &rows[i];
        r->tokens = cfg->tokens[i];
        r->bytes = (uint64_t) r->tokens * bpt;
        ok = measure_row(&u, r);
        if (ok) {
            nrows++;
            if (!cfg->json) print_row(r);
        }
    }
    ok = stop_prefill(&u, ok, have_side);
    const uint32_t chunk_tokens = u.s.geo.chunk_tokens;
    if (have_side) side_destroy(&u.s);
    signal(SIGPIPE, old_pipe);
    int failed = report(cfg, ok, chunk_tokens, rows, nrows, hw);
    kvs_free(rows);
    return !ok || failed ? 1 : 0;
}
