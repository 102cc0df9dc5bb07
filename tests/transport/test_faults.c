/* Fault tests of the protocol over real net links (issue 4). Every prefill and decode rank is
 * its own forked process (sender or receiver, pool, net link, and on prefill rank 0 optionally
 * the bootstrap registry) driven through a command pipe; the test process only orchestrates,
 * kills, stops and checks. Prefill ranks fill position-keyed KV; decode ranks check every byte of
 * every room that succeeds and report outcomes, failure times and their counters. Covered: a
 * prefill rank killed mid-transfer and restarted, a decode rank killed and restarted, a prefill
 * rank stopped past the liveness timeout (quarantine, no stale write in reused pages or ring
 * slots, recovery), garbage, truncated, oversized, stale and replayed messages at every endpoint,
 * and two hosts (network namespaces joined by a veth pair) over UCX tcp. Survivors must end with
 * empty rings, no live rooms or slots, every pool page free and no leaked allocation. */
#define _GNU_SOURCE /* setns(2), unshare(2) */
#include "pd/pd_harness.h"
#include "transport/net_harness.h"

#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <sys/mount.h>
#include <zmq.h>

#include "control/zmq_channel.h"
#include "kvstage/net.h"
#include "kvstage/registry.h"

#define MS           NH_MS
#define LIVENESS_MS  500ull
#define HEARTBEAT_MS 25ull
#define SLACK_MS     2500ull /* detection slack on a loaded 2-core machine, ASan included */
#define EVENT_MS     20000ull
#define POOL_PAGES   512
#define CHILD_ROOMS  8
#define MAX_PROCS    8
#define PENDING_MAX  32
#define TAP_MAX      256
#define EP_MAX       96
#define NAME_LEN     32
#define CHUNK_TOKENS 128 /* G: the geometry below has P = 16 and C = 128 */

/* ---- what a rank process is told ---- */

typedef struct {
    kvs_side_t side;
    uint32_t rank;
    kvs_pd_geometry_t geo;
    kvs_pd_timeouts_t timeouts;
    kvs_net_data_t data;
    char bind[EP_MAX];
    char net_device[NAME_LEN];  /* for tcp data */
    char netns[NAME_LEN];       /* network namespace to enter first; "": stay */
    char peers[4][EP_MAX];      /* the other side's control endpoints; "": learn them */
    char registry[EP_MAX];      /* prefill: register there; decode: query it; "": none */
    char registry_bind[EP_MAX]; /* prefill: serve the registry here; "": do not */
    uint32_t staging_buffers;
    uint32_t ring_slots; /* decode: a ring of this many full slots */
} rank_arg_t;

/* ---- the pipe protocol between the test and a rank process ---- */

enum { C_ADD = 1, C_GO, C_METRICS, C_GARBAGE, C_REPLAY, C_QUIT };
enum { E_UP = 1, E_FAILED, E_DONE, E_METRICS, E_SENT, E_FINAL };

typedef struct {
    uint32_t kind;
    uint32_t pace_ms; /* prefill: pause between chunks computed */
    uint32_t types;   /* C_REPLAY: bit per kvs_msg_type_t to re-send */
    uint32_t pad;
    uint64_t room, len;
    uint64_t base;     /* decode: prefix it already holds */
    uint64_t hit;      /* prefill: cached prefix, computed at once */
    uint64_t stall_at; /* prefill: stop computing at this token until C_GO; 0: never */
} cmd_t;

typedef struct {
    uint32_t kind, rank;
    int32_t status, reason; /* the room's outcome */
    int32_t quiescent;      /* E_FAILED: when the failure was first seen */
    int32_t release_st;     /* E_FAILED: what release said then (1: not tried) */
    int32_t meta_ok;        /* E_DONE on decode: the final metadata arrived intact */
    int32_t pad;
    uint64_t room, at_ns;
    uint64_t mismatches; /* E_DONE on decode after Success: bytes that differ from prefill */
    uint64_t tainted;    /* decode: pages of this room that earlier belonged to a failed room */
    uint32_t sent[4];    /* E_SENT: messages sent to each rank of the other side */
    uint64_t pool_free, pool_total, registry_rejected;
    kvs_pd_metrics_t m;
    kvs_net_stats_t net;
    char endpoint[EP_MAX], registry[EP_MAX];
} ev_t;

_Static_assert(sizeof(ev_t) <= PIPE_BUF, "events must be written atomically");

static uint32_t token_of(uint64_t room)
{
    return (uint32_t) room * 7 + 1;
}

/* ---- the rank process: a tap over its link keeps what it sent, for replays ---- */

typedef struct {
    uint32_t peer, len, type;
    uint64_t room;
    uint8_t bytes[128];
} tapped_t;

static struct {
    kvs_link_t *net;
    kvs_link_ops_t ops;
    kvs_link_t link; /* the net link with send() wrapped */
    uint32_t types;  /* bit per kvs_msg_type_t to keep */
    tapped_t *msgs;  /* [TAP_MAX] */
    uint32_t n;
} g_tap;

static uint64_t msg_room(const kvs_msg_t *m)
{
    switch (m->type) {
    case KVS_MSG_CHUNK_READY:
        return m->u.chunk_ready.room;
    case KVS_MSG_STAGING_REQ:
        return m->u.staging_req.room;
    case KVS_MSG_STAGING_GRANT:
        return m->u.staging_grant.room;
    case KVS_MSG_ACK:
        return m->u.ack.room;
    default:
        return 0;
    }
}

static kvs_status_t tap_send(void *ctx, uint32_t peer, const uint8_t *buf, size_t len)
{
    kvs_msg_t m;
    if (g_tap.n < TAP_MAX && len <= sizeof(g_tap.msgs[0].bytes) &&
        kvs_msg_decode(buf, len, &m) == KVS_OK && ((g_tap.types >> m.type) & 1)) {
        int dup = 0;
        for (uint32_t i = 0; i < g_tap.n && !dup; i++)
            dup = g_tap.msgs[i].peer == peer && g_tap.msgs[i].len == len &&
                  memcmp(g_tap.msgs[i].bytes, buf, len) == 0;
        if (!dup) {
            tapped_t *t = &g_tap.msgs[g_tap.n++];
            t->peer = peer;
            t->len = (uint32_t) len;
            t->type = m.type;
            t->room = msg_room(&m);
            memcpy(t->bytes, buf, len);
        }
    }
    return g_tap.net->ops->send(ctx, peer, buf, len);
}

static void tap_destroy(void *ctx)
{
    (void) ctx; /* the net link underneath is destroyed on its own */
}

static kvs_link_t *tap_wrap(kvs_link_t *net, uint32_t types)
{
    g_tap.net = net;
    g_tap.ops = *net->ops;
    g_tap.ops.send = tap_send;
    g_tap.ops.destroy = tap_destroy;
    g_tap.link.ops = &g_tap.ops;
    g_tap.link.ctx = net->ctx;
    g_tap.types = types;
    g_tap.n = 0;
    g_tap.msgs = kvs_calloc(TAP_MAX, sizeof(*g_tap.msgs));
    return g_tap.msgs ? &g_tap.link : NULL;
}

typedef struct {
    int used, finished, failed_seen;
    uint64_t id, len, base, stall_at, computed;
    uint64_t pace_ns, next_at;
    uint32_t npages;
    uint32_t *pages; /* [npages] prefill: page table from token 0; decode: pages from base */
    uint64_t tainted;
} croom_t;

typedef struct {
    const rank_arg_t *a;
    int up, down;
    h_t h; /* geometry and this rank's pool, for h_fill and h_mismatches */
    kvs_clock_t clock;
    kvs_pool_t *pool;
    kvs_link_t *net;
    kvs_link_t *link; /* the tap over net: what the sender or receiver uses */
    kvs_registry_t *registry;
    kvs_sender_t *tx;
    kvs_receiver_t *rx;
    uint8_t *taint; /* [POOL_PAGES] decode: pages that belonged to a failed room */
    croom_t rooms[CHILD_ROOMS];
} rk_t;

static int rk_report(rk_t *k, ev_t *ev)
{
    ev->rank = k->a->rank;
    return nh_write_full(k->up, ev, sizeof(*ev));
}

static void rk_counters(rk_t *k, ev_t *ev)
{
    if (k->tx)
        kvs_sender_metrics(k->tx, &ev->m);
    else
        kvs_receiver_metrics(k->rx, &ev->m);
    kvs_net_link_stats(k->net, &ev->net);
    ev->pool_free = kvs_pool_free_pages(k->pool);
    ev->pool_total = kvs_pool_total_pages(k->pool);
    ev->registry_rejected = k->registry ? kvs_registry_rejected(k->registry) : 0;
}

/* Moves this process into a network namespace made by `ip netns add`, as `ip netns exec` does:
 * UCX lists network devices under /sys/class/net, which shows the namespace sysfs was mounted
 * in, so sysfs is mounted again in a private mount namespace. */
static int enter_netns(const char *name)
{
    char path[64];
    snprintf(path, sizeof(path), "/run/netns/%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int r = setns(fd, CLONE_NEWNET);
    close(fd);
    if (r != 0 || unshare(CLONE_NEWNS) != 0 ||
        mount("none", "/", NULL, MS_REC | MS_SLAVE, NULL) != 0)
        return -1;
    umount2("/sys", MNT_DETACH);
    return mount(name, "/sys", "sysfs", 0, NULL);
}

static int rk_setup(rk_t *k)
{
    const rank_arg_t *a = k->a;
    const int prefill = a->side == KVS_SIDE_PREFILL;
    const uint32_t tp = prefill ? a->geo.prefill_tp : a->geo.decode_tp;
    k->h.geo = a->geo;
    k->h.timeouts = a->timeouts;
    k->clock = kvs_clock_monotonic();
    kvs_pool_config_t pc = {.shape = a->geo.shape,
                            .tp = {tp, a->rank},
                            .page_size = a->geo.page_size,
                            .num_pages = POOL_PAGES,
                            .layout = a->rank % 2 ? KVS_POOL_HND : KVS_POOL_NHD,
                            .mem = KVS_MEM_HOST};
    if (kvs_pool_create(&pc, &k->pool) != KVS_OK) return 10;
    if (prefill)
        k->h.ppool[a->rank] = k->pool;
    else
        k->h.dpool[a->rank] = k->pool;
    if (a->registry_bind[0] && kvs_registry_create(a->registry_bind, &k->registry) != KVS_OK)
        return 11;
    kvs_net_config_t nc = {.side = a->side,
                           .rank = a->rank,
                           .peer_tp = prefill ? a->geo.decode_tp : a->geo.prefill_tp,
                           .bind = a->bind,
                           .data = a->data,
                           .net_device = a->net_device,
                           .registry = !prefill && a->registry[0] ? a->registry : NULL,
                           .heartbeat_ns = HEARTBEAT_MS * MS,
                           .liveness_timeout_ns = LIVENESS_MS * MS,
                           .connect_timeout_ns = 5000 * MS,
                           .write_timeout_ns = 5000 * MS};
    for (uint32_t i = 0; i < nc.peer_tp && i < 4; i++)
        if (a->peers[i][0]) nc.peers[i] = a->peers[i];
    if (kvs_net_link_create(&nc, &k->net) != KVS_OK) return 12;
    k->link = tap_wrap(k->net, prefill ? (1u << KVS_MSG_CHUNK_READY) | (1u << KVS_MSG_STAGING_REQ)
                                       : (1u << KVS_MSG_STAGING_GRANT) | (1u << KVS_MSG_ACK));
    if (k->link == NULL) return 13;
    const uint64_t boot_ns = 10000 * MS;
    if (prefill) {
        kvs_msg_register_t reg;
        kvs_registry_describe(&a->geo, a->rank, kvs_net_link_endpoint(k->net), &reg);
        if (k->registry && kvs_registry_add(k->registry, &reg) != KVS_OK) return 14;
        if (!k->registry && a->registry[0] &&
            kvs_registry_register(a->registry, &reg, boot_ns) != KVS_OK)
            return 15;
        kvs_sender_config_t sc = {.geo = a->geo,
                                  .rank = a->rank,
                                  .timeouts = a->timeouts,
                                  .window_chunks = 2,
                                  .staging_buffers = a->staging_buffers};
        if (kvs_sender_create(&sc, k->pool, k->link, &k->clock, &k->tx) != KVS_OK) return 16;
    } else {
        for (uint32_t p = 0; a->registry[0] && p < a->geo.prefill_tp; p++) {
            kvs_msg_register_t reg;
            char why[256];
            if (kvs_registry_query(a->registry, p, boot_ns, &reg) != KVS_OK ||
                kvs_registry_check(&reg, &a->geo, why, sizeof(why)) != KVS_OK ||
                kvs_net_link_set_peer(k->net, p, reg.endpoint) != KVS_OK)
                return 17;
        }
        kvs_writer_t w[KVS_MAX_WRITERS];
        uint32_t n = 0;
        kvs_plan_writers(&a->geo.shape, a->geo.prefill_tp, a->geo.decode_tp, a->rank, 0, w, &n);
        uint64_t slot = kvs_slot_layout(w, n, CHUNK_TOKENS, NULL);
        kvs_receiver_config_t rc = {.geo = a->geo,
                                    .rank = a->rank,
                                    .timeouts = a->timeouts,
                                    .ring_bytes = a->ring_slots * slot};
        if (kvs_receiver_create(&rc, k->pool, k->link, &k->clock, &k->rx) != KVS_OK) return 18;
        k->taint = kvs_calloc(POOL_PAGES, 1);
        if (k->taint == NULL) return 19;
    }
    ev_t ev = {.kind = E_UP};
    snprintf(ev.endpoint, sizeof(ev.endpoint), "%s", kvs_net_link_endpoint(k->net));
    if (k->registry)
        snprintf(ev.registry, sizeof(ev.registry), "%s", kvs_registry_endpoint(k->registry));
    return rk_report(k, &ev) != 0 ? 20 : 0;
}

static int rk_add(rk_t *k, const cmd_t *c)
{
    croom_t *r = NULL;
    for (int i = 0; i < CHILD_ROOMS && r == NULL; i++)
        if (!k->rooms[i].used) r = &k->rooms[i];
    if (r == NULL) return 21;
    memset(r, 0, sizeof(*r));
    const uint64_t P = k->a->geo.page_size;
    r->id = c->room;
    r->len = c->len;
    r->base = c->base;
    r->npages =
        (uint32_t) (k->tx ? (c->len + P - 1) / P : kvs_grid_total_pages(c->len, c->base, P));
    r->pages = kvs_malloc(r->npages * sizeof(uint32_t));
    if (r->pages == NULL || kvs_pool_alloc(k->pool, r->npages, r->pages) != KVS_OK) return 22;
    r->used = 1;
    if (k->tx) {
        if (kvs_sender_add_room(k->tx, r->id, r->len, r->pages) != KVS_OK) return 23;
        h_fill(&k->h, k->a->rank, r->id, r->pages, 0, c->hit);
        if (kvs_sender_advance(k->tx, r->id, c->hit, c->hit) != KVS_OK) return 24;
        r->computed = c->hit;
        r->stall_at = c->stall_at;
        r->pace_ns = c->pace_ms * MS;
        r->next_at = kvs_now_ns();
        return 0;
    }
    for (uint32_t i = 0; i < r->npages; i++) r->tainted += k->taint[r->pages[i]];
    return kvs_receiver_add_room(k->rx, r->id, r->base, r->len, r->pages) == KVS_OK ? 0 : 25;
}

/* Sends one control message straight through the net link (not the tap), retrying briefly. */
static int rk_send_raw(rk_t *k, uint32_t peer, const uint8_t *buf, size_t len)
{
    uint64_t end = kvs_now_ns() + 3000 * MS;
    while (k->net->ops->send(k->net->ctx, peer, buf, len) != KVS_OK) {
        if (kvs_now_ns() > end) return -1;
        kvs_net_link_progress(k->net);
    }
    return 0;
}

static size_t encode(const kvs_msg_t *m, uint8_t *buf)
{
    size_t len = 0;
    return kvs_msg_encode(m, buf, KVS_MSG_MAX_SIZE, &len) == KVS_OK ? len : 0;
}

/* Protocol messages that arrive intact through the link but that the sender or receiver must
 * reject (kvs_pd_metrics_t.rejected), each with no other effect. Room `room` must be live on
 * the receiving decode ranks (some of these name a chunk or writer outside it). */
static int rk_garbage(rk_t *k, uint64_t room)
{
    const kvs_pd_geometry_t *g = &k->a->geo;
    const uint32_t me = k->a->rank;
    const int prefill = k->tx != NULL;
    const uint32_t peers = prefill ? g->decode_tp : g->prefill_tp;
    ev_t ev = {.kind = E_SENT, .room = room};
    kvs_rng_t rng;
    kvs_rng_seed(&rng, kvs_test_seed(7) + me);
    for (uint32_t peer = 0; peer < peers && peer < 4; peer++) {
        uint8_t bufs[12][KVS_MSG_MAX_SIZE + 1];
        size_t lens[12];
        uint32_t n = 0;
        kvs_msg_t good = {.type = prefill ? KVS_MSG_CHUNK_READY : KVS_MSG_STAGING_GRANT};
        if (prefill)
            good.u.chunk_ready = (kvs_msg_chunk_ready_t){
                .room = room, .prefill_rank = me, .decode_rank = peer, .pages = 1, .bytes = 1};
        else
            good.u.staging_grant =
                (kvs_msg_staging_grant_t){.room = room, .decode_rank = me, .offset = 0, .size = 1};
        uint8_t ok[KVS_MSG_MAX_SIZE];
        size_t okn = encode(&good, ok);
        if (okn == 0) return 50;
        lens[n++] = 0; /* empty */
        memcpy(bufs[n], ok, 20);
        lens[n++] = 20; /* truncated */
        memcpy(bufs[n], ok, okn);
        bufs[n][0] ^= 0xff;
        lens[n++] = okn; /* bad magic */
        memcpy(bufs[n], ok, okn);
        bufs[n][okn] = 0;
        lens[n++] = okn + 1; /* a trailing byte */
        memcpy(bufs[n], ok, okn);
        bufs[n][8] += 4;
        lens[n++] = okn; /* the header's payload length disagrees */
        for (int i = 0; i < 48; i++) bufs[n][i] = (uint8_t) kvs_rng_next(&rng);
        bufs[n][0] = 0;
        lens[n++] = 48; /* random bytes */
        kvs_msg_t m[5];
        memset(m, 0, sizeof(m));
        if (prefill) {
            /* Decode never receives ROOM_META or ABORT; a STAGING_REQ for another decode rank,
             * for a chunk beyond the room, a CHUNK_READY from a writer the room does not have. */
            m[0].type = KVS_MSG_ROOM_META;
            m[0].u.room_meta = (kvs_msg_room_meta_t){.room = room,
                                                     .decode_rank = peer,
                                                     .decode_tp = g->decode_tp,
                                                     .prompt_len = 16,
                                                     .total_pages = 1,
                                                     .grid_tokens = CHUNK_TOKENS};
            m[1].type = KVS_MSG_STAGING_REQ;
            m[1].u.staging_req = (kvs_msg_staging_req_t){
                .room = room, .prefill_rank = me, .decode_rank = peer + 1, .slot_bytes = 1};
            m[2].type = KVS_MSG_STAGING_REQ;
            m[2].u.staging_req = (kvs_msg_staging_req_t){
                .room = room, .chunk = 1000, .prefill_rank = me, .decode_rank = peer};
            m[3].type = KVS_MSG_CHUNK_READY;
            m[3].u.chunk_ready = (kvs_msg_chunk_ready_t){.room = room,
                                                         .prefill_rank = me,
                                                         .decode_rank = peer,
                                                         .writer = 60,
                                                         .pages = 1,
                                                         .bytes = 1};
            m[4].type = KVS_MSG_ABORT;
            m[4].u.abort = (kvs_msg_abort_t){.room = room, .from_rank = me, .to_rank = peer};
        } else {
            /* Prefill never receives STAGING_REQ; ABORT and ACK for another prefill rank,
             * ROOM_META from a deployment of another decode TP, ABORT from a rank that does not
             * exist. */
            m[0].type = KVS_MSG_STAGING_REQ;
            m[0].u.staging_req = (kvs_msg_staging_req_t){
                .room = room, .prefill_rank = peer, .decode_rank = me, .slot_bytes = 1};
            m[1].type = KVS_MSG_ABORT;
            m[1].u.abort = (kvs_msg_abort_t){.room = room, .from_rank = me, .to_rank = peer + 1};
            m[2].type = KVS_MSG_ACK;
            m[2].u.ack = (kvs_msg_ack_t){.room = room,
                                         .acked_type = KVS_MSG_CHUNK_READY,
                                         .from_rank = me,
                                         .to_rank = peer + 1};
            m[3].type = KVS_MSG_ROOM_META;
            m[3].u.room_meta = (kvs_msg_room_meta_t){.room = room,
                                                     .decode_rank = me,
                                                     .decode_tp = g->decode_tp + 1,
                                                     .prompt_len = 16,
                                                     .total_pages = 1,
                                                     .grid_tokens = CHUNK_TOKENS};
            m[4].type = KVS_MSG_ABORT;
            m[4].u.abort = (kvs_msg_abort_t){.room = room, .from_rank = 60, .to_rank = peer};
        }
        for (int i = 0; i < 5; i++) {
            lens[n] = encode(&m[i], bufs[n]);
            if (lens[n++] == 0) return 51;
        }
        for (uint32_t i = 0; i < n; i++) {
            if (rk_send_raw(k, peer, bufs[i], lens[i]) != 0) return 52;
            ev.sent[peer]++;
        }
    }
    return rk_report(k, &ev) != 0 ? 53 : 0;
}

/* Re-sends what the tap kept of room `room`, of the given types, to whom it went first. */
static int rk_replay(rk_t *k, uint64_t room, uint32_t types)
{
    ev_t ev = {.kind = E_SENT, .room = room};
    for (uint32_t i = 0; i < g_tap.n; i++) {
        const tapped_t *t = &g_tap.msgs[i];
        if (t->room != room || !((types >> t->type) & 1) || t->peer >= 4) continue;
        if (rk_send_raw(k, t->peer, t->bytes, t->len) != 0) return 54;
        ev.sent[t->peer]++;
    }
    return rk_report(k, &ev) != 0 ? 55 : 0;
}

static int rk_command(rk_t *k, const cmd_t *c)
{
    switch (c->kind) {
    case C_ADD:
        return rk_add(k, c);
    case C_GO:
        for (int i = 0; i < CHILD_ROOMS; i++)
            if (k->rooms[i].used && k->rooms[i].id == c->room) k->rooms[i].stall_at = 0;
        return 0;
    case C_METRICS: {
        ev_t ev = {.kind = E_METRICS};
        rk_counters(k, &ev);
        return rk_report(k, &ev) != 0 ? 56 : 0;
    }
    case C_GARBAGE:
        return rk_garbage(k, c->room);
    case C_REPLAY:
        return rk_replay(k, c->room, c->types);
    default:
        return 57;
    }
}

/* Computes paced chunks, and reports and releases rooms as they conclude. */
static int rk_pump(rk_t *k, uint32_t *work)
{
    const uint64_t C = k->a->geo.chunk_tokens;
    const uint64_t now = kvs_now_ns();
    for (int i = 0; i < CHILD_ROOMS; i++) {
        croom_t *r = &k->rooms[i];
        if (!r->used) continue;
        kvs_room_info_t info;
        if (k->tx) {
            if (!r->finished && !r->failed_seen &&
                (r->stall_at == 0 || r->computed < r->stall_at) && now >= r->next_at) {
                uint64_t next = r->computed + C < r->len ? r->computed + C : r->len;
                h_fill(&k->h, k->a->rank, r->id, r->pages, r->computed, next);
                uint32_t token = token_of(r->id);
                kvs_status_t st = next == r->len ? kvs_sender_finish(k->tx, r->id, &token, 4)
                                                 : kvs_sender_advance(k->tx, r->id, next, next + C);
                if (st != KVS_OK) return 26;
                r->computed = next;
                r->finished = next == r->len;
                r->next_at = now + r->pace_ns;
                (*work)++;
            }
            if (kvs_sender_poll(k->tx, r->id, &info) != KVS_OK) return 27;
        } else if (kvs_receiver_poll(k->rx, r->id, &info) != KVS_OK) {
            return 27;
        }
        if (info.status == KVS_ROOM_FAILED && !r->failed_seen) {
            r->failed_seen = 1;
            ev_t ev = {.kind = E_FAILED,
                       .room = r->id,
                       .status = info.status,
                       .reason = info.reason,
                       .quiescent = info.quiescent,
                       .release_st = 1,
                       .at_ns = now};
            rk_counters(k, &ev);
            if (!info.quiescent) {
                /* The engine may not take the room back yet; the refusal is logged, keep it
                 * out of the test output. */
                kvs_log_capture_t cap = {.errors_only = 1};
                kvs_log_set_sink(kvs_log_capture_sink, &cap);
                ev.release_st =
                    k->tx ? kvs_sender_release(k->tx, r->id) : kvs_receiver_release(k->rx, r->id);
                kvs_log_set_sink(NULL, NULL);
                if (ev.release_st == KVS_OK) return 28;
            }
            if (rk_report(k, &ev) != 0) return 29;
            (*work)++;
        }
        if (!info.quiescent || (info.status != KVS_ROOM_SUCCESS && info.status != KVS_ROOM_FAILED))
            continue;
        ev_t ev = {.kind = E_DONE,
                   .room = r->id,
                   .status = info.status,
                   .reason = info.reason,
                   .meta_ok = 1,
                   .tainted = r->tainted};
        if (k->rx && info.status == KVS_ROOM_SUCCESS) {
            uint32_t token = token_of(r->id);
            ev.mismatches = h_mismatches(&k->h, k->a->rank, r->id, r->pages, r->base, r->len);
            ev.meta_ok = info.final_len == 4 && memcmp(info.final, &token, 4) == 0;
        }
        kvs_status_t st =
            k->tx ? kvs_sender_release(k->tx, r->id) : kvs_receiver_release(k->rx, r->id);
        if (st != KVS_OK) return 30;
        if (k->rx && info.status == KVS_ROOM_FAILED)
            for (uint32_t p = 0; p < r->npages; p++) k->taint[r->pages[p]] = 1;
        if (kvs_pool_free(k->pool, r->pages, r->npages) != KVS_OK) return 31;
        kvs_free(r->pages);
        r->used = 0;
        ev.at_ns = kvs_now_ns();
        rk_counters(k, &ev);
        if (rk_report(k, &ev) != 0) return 32;
        (*work)++;
    }
    return 0;
}

static int rk_loop(rk_t *k)
{
    const uint64_t end = kvs_now_ns() + 120000 * MS; /* an orphan never spins for long */
    for (;;) {
        if (!nh_parent_alive()) return 40;
        if (kvs_now_ns() > end) return 41;
        uint32_t work = k->registry ? kvs_registry_serve(k->registry, 0) : 0;
        work += k->tx ? kvs_sender_progress(k->tx) : kvs_receiver_progress(k->rx);
        struct pollfd p = {.fd = k->down, .events = POLLIN};
        if (poll(&p, 1, 0) > 0) {
            cmd_t c;
            if (nh_read_full(k->down, &c, sizeof(c), 5000) != 0) return 42;
            if (c.kind == C_QUIT) return 0;
            int code = rk_command(k, &c);
            if (code != 0) return code;
            work++;
        }
        int code = rk_pump(k, &work);
        if (code != 0) return code;
        if (work == 0) nh_sleep_us(100);
    }
}

static void rk_teardown(rk_t *k)
{
    kvs_sender_destroy(k->tx);
    kvs_receiver_destroy(k->rx);
    kvs_link_destroy(k->net);
    kvs_registry_destroy(k->registry);
    kvs_pool_destroy(k->pool);
    for (int i = 0; i < CHILD_ROOMS; i++)
        if (k->rooms[i].used) kvs_free(k->rooms[i].pages);
    kvs_free(k->taint);
    kvs_free(g_tap.msgs);
    g_tap.msgs = NULL;
}

/* A rank process: no cmocka here (a failed assert must not unwind into the parent's copy of
 * the test runner); trouble shows as the exit code. */
static int rank_main(int up, int down, void *argp)
{
    const rank_arg_t *a = argp;
    if (getenv("KVS_LOG") == NULL) kvs_log_set_level(KVS_LOG_ERROR); /* faults are expected */
    if (a->netns[0] != '\0' && enter_netns(a->netns) != 0) return 9;
    static rk_t k;
    memset(&k, 0, sizeof(k));
    k.a = a;
    k.up = up;
    k.down = down;
    int code = rk_setup(&k);
    if (code == 0) code = rk_loop(&k);
    if (code == 0) {
        ev_t ev = {.kind = E_FINAL};
        rk_counters(&k, &ev);
        if (rk_report(&k, &ev) != 0) code = 33;
    }
    rk_teardown(&k);
    return code;
}

/* ---- the test process: rank processes and their events ---- */

typedef struct {
    nh_child_t ch;
    rank_arg_t arg;
    char name[32];
    char endpoint[EP_MAX], registry[EP_MAX];
    ev_t pending[PENDING_MAX]; /* events read but not yet asked for */
    uint32_t npending;
} proc_t;

static proc_t g_procs[MAX_PROCS];
static uint32_t g_nprocs;
static nh_shm_list_t g_shm;

static const char *ev_name(uint32_t kind)
{
    static const char *const names[] = {"?", "UP", "FAILED", "DONE", "METRICS", "SENT", "FINAL"};
    return kind < 7 ? names[kind] : "?";
}

/* Reads one event if one comes within wait_ms; fails the test if the process is gone. */
static int proc_read(proc_t *p, int wait_ms, const char *waiting_for)
{
    struct pollfd pf = {.fd = p->ch.up, .events = POLLIN};
    if (poll(&pf, 1, wait_ms) <= 0) return 0;
    ev_t ev;
    if (nh_read_full(p->ch.up, &ev, sizeof(ev), 5000) != 0) {
        int code = nh_reap(p->ch.pid, 5000);
        fail_msg("%s exited with %d while the test waited for %s", p->name, code, waiting_for);
    }
    if (p->npending == PENDING_MAX) fail_msg("%s: too many unread events", p->name);
    p->pending[p->npending++] = ev;
    return 1;
}

static int proc_take(proc_t *p, uint32_t kind, uint64_t room, ev_t *ev_p)
{
    for (uint32_t i = 0; i < p->npending; i++) {
        if (p->pending[i].kind != kind || (room != 0 && p->pending[i].room != room)) continue;
        *ev_p = p->pending[i];
        memmove(&p->pending[i], &p->pending[i + 1], (p->npending - i - 1) * sizeof(ev_t));
        p->npending--;
        return 1;
    }
    return 0;
}

static ev_t proc_await(proc_t *p, uint32_t kind, uint64_t room, uint64_t timeout_ms)
{
    char what[64];
    snprintf(what, sizeof(what), "%s of room %llu", ev_name(kind), (unsigned long long) room);
    uint64_t end = kvs_now_ns() + timeout_ms * MS;
    ev_t ev;
    while (!proc_take(p, kind, room, &ev)) {
        if (kvs_now_ns() > end)
            fail_msg("%s: no %s within %llu ms", p->name, what, (unsigned long long) timeout_ms);
        proc_read(p, 20, what);
    }
    return ev;
}

/* 1 if an event of that kind and room has arrived (reads what is there, never waits). */
static int proc_seen(proc_t *p, uint32_t kind, uint64_t room)
{
    while (proc_read(p, 0, "any event")) {
    }
    for (uint32_t i = 0; i < p->npending; i++)
        if (p->pending[i].kind == kind && p->pending[i].room == room) return 1;
    return 0;
}

static void proc_cmd(proc_t *p, cmd_t c)
{
    if (nh_write_full(p->ch.down, &c, sizeof(c)) != 0) fail_msg("%s: command pipe broken", p->name);
}

static ev_t proc_metrics(proc_t *p)
{
    proc_cmd(p, (cmd_t){.kind = C_METRICS});
    return proc_await(p, E_METRICS, 0, EVENT_MS);
}

static proc_t *proc_start(const rank_arg_t *a)
{
    if (g_nprocs == MAX_PROCS) fail_msg("more than %d rank processes", MAX_PROCS);
    proc_t *p = &g_procs[g_nprocs++];
    memset(p, 0, sizeof(*p));
    p->arg = *a;
    snprintf(p->name, sizeof(p->name), "%s rank %u",
             a->side == KVS_SIDE_PREFILL ? "prefill" : "decode", a->rank);
    p->ch = nh_spawn(rank_main, &p->arg);
    ev_t ev = proc_await(p, E_UP, 0, EVENT_MS);
    snprintf(p->endpoint, sizeof(p->endpoint), "%s", ev.endpoint);
    snprintf(p->registry, sizeof(p->registry), "%s", ev.registry);
    return p;
}

static void proc_kill(proc_t *p)
{
    assert_int_equal(kill(p->ch.pid, SIGKILL), 0);
    assert_int_equal(nh_reap(p->ch.pid, 10000), 128 + SIGKILL);
}

/* Quits a rank process; it must exit cleanly (code 0: no accounted allocation left). */
static ev_t proc_quit(proc_t *p)
{
    proc_cmd(p, (cmd_t){.kind = C_QUIT});
    ev_t ev = proc_await(p, E_FINAL, 0, EVENT_MS);
    int code = nh_reap(p->ch.pid, 20000);
    if (code != 0) fail_msg("%s exited with %d", p->name, code);
    return ev;
}

/* Quits a survivor: nothing of any room may remain (protocol.md §7.1), except that a sender may
 * still hold up to `stash` ABORTs for rooms it no longer (or never) had: a repeat of an ABORT that
 * arrives after the room was released cannot be told from an ABORT that precedes its room, so
 * it is kept until the bootstrap timeout and counted in live_rooms. */
static ev_t proc_quit_clean(proc_t *p, uint64_t stash)
{
    ev_t ev = proc_quit(p);
    int decode = p->arg.side == KVS_SIDE_DECODE;
    if (ev.m.live_rooms > stash || ev.pool_free != ev.pool_total ||
        (decode && (ev.m.ring_used != 0 || ev.m.live_slots != 0)) ||
        (!decode && ev.net.writes_in_flight != 0))
        fail_msg("%s leaks: %llu live rooms, %llu of %llu pages free, ring %llu bytes in %llu "
                 "slots, %llu writes in flight",
                 p->name, (unsigned long long) ev.m.live_rooms, (unsigned long long) ev.pool_free,
                 (unsigned long long) ev.pool_total, (unsigned long long) ev.m.ring_used,
                 (unsigned long long) ev.m.live_slots,
                 (unsigned long long) ev.net.writes_in_flight);
    return ev;
}

/* Waits until the counters of p satisfy cond (an expression over `ev`). */
#define WAIT_COUNTERS(p, ev, cond, timeout_ms, what)                                               \
    do {                                                                                           \
        uint64_t end_ = kvs_now_ns() + (timeout_ms) *MS;                                           \
        for (;;) {                                                                                 \
            ev = proc_metrics(p);                                                                  \
            if (cond) break;                                                                       \
            if (kvs_now_ns() > end_)                                                               \
                fail_msg("%s: %s not reached within %llu ms", (p)->name, what,                     \
                         (unsigned long long) (timeout_ms));                                       \
            nh_sleep_us(5000);                                                                     \
        }                                                                                          \
    } while (0)

/* ---- deployments and rooms ---- */

typedef struct {
    kvs_pd_geometry_t geo;
    kvs_pd_timeouts_t timeouts;
    kvs_net_data_t data;
    const char *prefill_host, *decode_host; /* addresses to bind */
    const char *prefill_dev, *decode_dev;   /* UCX_NET_DEVICES for tcp */
    const char *prefill_ns, *decode_ns;     /* network namespaces, or NULL */
    int registry;                           /* bootstrap through prefill rank 0's registry */
    uint32_t staging_buffers, ring_slots;
} deploy_t;

static deploy_t deploy_default(uint32_t ptp, uint32_t dtp, uint32_t heads, kvs_net_data_t data,
                               uint64_t release_ms)
{
    deploy_t d;
    memset(&d, 0, sizeof(d));
    d.geo.shape = (kvs_kv_shape_t){.layers = 2,
                                   .kv_heads = heads,
                                   .head_dim_k = 32,
                                   .head_dim_v = 16,
                                   .elem_bytes = 2,
                                   .attn = KVS_ATTN_MHA};
    d.geo.prefill_tp = ptp;
    d.geo.decode_tp = dtp;
    d.geo.page_size = 16;
    d.geo.chunk_tokens = CHUNK_TOKENS;
    d.timeouts = (kvs_pd_timeouts_t){.retry_ns = 50 * MS,
                                     .bootstrap_timeout_ns = 10000 * MS,
                                     .transfer_timeout_ns = 15000 * MS,
                                     .waiting_timeout_ns = 20000 * MS,
                                     .completion_timeout_ns = 10000 * MS,
                                     .release_timeout_ns = release_ms * MS};
    d.data = data;
    d.prefill_host = d.decode_host = "127.0.0.1";
    d.prefill_dev = d.decode_dev = "lo";
    d.staging_buffers = 2;
    d.ring_slots = 4;
    return d;
}

static rank_arg_t arg_for(const deploy_t *d, kvs_side_t side, uint32_t rank)
{
    rank_arg_t a;
    memset(&a, 0, sizeof(a));
    const int prefill = side == KVS_SIDE_PREFILL;
    a.side = side;
    a.rank = rank;
    a.geo = d->geo;
    a.timeouts = d->timeouts;
    a.data = d->data;
    snprintf(a.bind, sizeof(a.bind), "tcp://%s:0", prefill ? d->prefill_host : d->decode_host);
    snprintf(a.net_device, sizeof(a.net_device), "%s", prefill ? d->prefill_dev : d->decode_dev);
    const char *ns = prefill ? d->prefill_ns : d->decode_ns;
    if (ns != NULL) snprintf(a.netns, sizeof(a.netns), "%s", ns);
    a.staging_buffers = d->staging_buffers;
    a.ring_slots = d->ring_slots;
    return a;
}

/* Starts every rank: prefill first (rank 0 serves the registry if asked), then decode, which
 * learns the prefill endpoints from the registry or directly; prefill learns decode's from its
 * heartbeats. */
static void deploy(const deploy_t *d, proc_t **pre, proc_t **dec)
{
    for (uint32_t p = 0; p < d->geo.prefill_tp; p++) {
        rank_arg_t a = arg_for(d, KVS_SIDE_PREFILL, p);
        if (d->registry && p == 0)
            snprintf(a.registry_bind, sizeof(a.registry_bind), "tcp://%s:0", d->prefill_host);
        if (d->registry && p > 0) snprintf(a.registry, sizeof(a.registry), "%s", pre[0]->registry);
        pre[p] = proc_start(&a);
    }
    for (uint32_t r = 0; r < d->geo.decode_tp; r++) {
        rank_arg_t a = arg_for(d, KVS_SIDE_DECODE, r);
        if (d->registry)
            snprintf(a.registry, sizeof(a.registry), "%s", pre[0]->registry);
        else
            for (uint32_t p = 0; p < d->geo.prefill_tp; p++)
                snprintf(a.peers[p], sizeof(a.peers[p]), "%s", pre[p]->endpoint);
        dec[r] = proc_start(&a);
    }
}

/* A rank that comes back as a new process with a new endpoint; it knows the other side's
 * endpoints, and the other side learns its new one from its heartbeats. */
static proc_t *restart(const deploy_t *d, kvs_side_t side, uint32_t rank, proc_t **other)
{
    rank_arg_t a = arg_for(d, side, rank);
    uint32_t n = side == KVS_SIDE_PREFILL ? d->geo.decode_tp : d->geo.prefill_tp;
    for (uint32_t i = 0; i < n; i++)
        snprintf(a.peers[i], sizeof(a.peers[i]), "%s", other[i]->endpoint);
    return proc_start(&a);
}

typedef struct {
    uint64_t id, len, base, hit, stall_at;
    uint32_t pace_ms;
} room_t;

static void room_add_to(proc_t *p, const room_t *r)
{
    proc_cmd(p, (cmd_t){.kind = C_ADD,
                        .room = r->id,
                        .len = r->len,
                        .base = r->base,
                        .hit = r->hit,
                        .stall_at = r->stall_at,
                        .pace_ms = r->pace_ms});
}

/* Decode registers the room first (protocol.md §3.2), then prefill computes it. */
static void room_add(const room_t *r, proc_t **pre, uint32_t np, proc_t **dec, uint32_t nd)
{
    for (uint32_t i = 0; i < nd; i++) room_add_to(dec[i], r);
    for (uint32_t i = 0; i < np; i++) room_add_to(pre[i], r);
}

static uint64_t room_chunks(const room_t *r)
{
    return kvs_grid_chunk_count(kvs_grid_total_pages(r->len, r->base, 16), CHUNK_TOKENS, 16);
}

static ev_t expect_done(proc_t *p, uint64_t room, kvs_room_status_t status)
{
    ev_t ev = proc_await(p, E_DONE, room, EVENT_MS);
    if (ev.status != (int32_t) status)
        fail_msg("%s: room %llu %s (%s), expected %s", p->name, (unsigned long long) room,
                 kvs_room_status_str((kvs_room_status_t) ev.status),
                 kvs_status_str((kvs_status_t) ev.reason), kvs_room_status_str(status));
    if (p->arg.side == KVS_SIDE_DECODE && status == KVS_ROOM_SUCCESS &&
        (ev.mismatches != 0 || !ev.meta_ok))
        fail_msg("%s: room %llu succeeded with %llu wrong bytes%s", p->name,
                 (unsigned long long) room, (unsigned long long) ev.mismatches,
                 ev.meta_ok ? "" : " and wrong final metadata");
    return ev;
}

static void expect_all_succeed(const room_t *r, proc_t **pre, uint32_t np, proc_t **dec,
                               uint32_t nd)
{
    for (uint32_t i = 0; i < nd; i++) expect_done(dec[i], r->id, KVS_ROOM_SUCCESS);
    for (uint32_t i = 0; i < np; i++) expect_done(pre[i], r->id, KVS_ROOM_SUCCESS);
}

static int setup(void **state)
{
    (void) state;
    nh_shm_snapshot(&g_shm);
    memset(g_procs, 0, sizeof(g_procs));
    g_nprocs = 0;
    return 0;
}

/* ---- 1: a prefill rank killed mid-transfer, then restarted ---- */

static void test_kill_prefill_mid_transfer(void **state)
{
    (void) state;
    /* Prefill TP2 -> decode TP2 with 2 KV heads: decode rank d's only peer is prefill rank d,
     * so rooms on decode rank 1 do not involve the rank that dies. */
    deploy_t d = deploy_default(2, 2, 2, KVS_NET_DATA_SHM, 2000);
    proc_t *pre[2], *dec[2];
    deploy(&d, pre, dec);
    /* Slow compute keeps every room mid-transfer when the kill comes. */
    const room_t rooms[] = {
        {101, 1024, 0, 0, 0, 60}, {102, 1024, 128, 0, 0, 60}, {103, 1024, 0, 300, 0, 60}};
    for (int i = 0; i < 3; i++) room_add(&rooms[i], pre, 2, dec, 2);
    /* Kill it well into the transfer, and after its heartbeats reached decode: the link adopts
     * the endpoint a restarted peer announces only if an earlier life confirmed the configured
     * one with a heartbeat (test_restart_prefill_unheard covers the other case). */
    ev_t m;
    WAIT_COUNTERS(dec[0], m, m.m.chunks >= 6, EVENT_MS, "6 chunks scattered");
    WAIT_COUNTERS(pre[0], m, m.net.heartbeats_sent >= 20, EVENT_MS, "heartbeats sent");
    const uint64_t killed = kvs_now_ns();
    proc_kill(pre[0]);
    for (int i = 0; i < 3; i++) {
        ev_t ev = proc_await(dec[0], E_FAILED, rooms[i].id, LIVENESS_MS + SLACK_MS);
        if (ev.reason != KVS_ERR_IO || ev.at_ns < killed ||
            ev.at_ns - killed > (LIVENESS_MS + SLACK_MS) * MS)
            fail_msg("room %llu failed on decode rank 0 with %s %llu ms after the kill "
                     "(expected %s within %llu ms)",
                     (unsigned long long) rooms[i].id, kvs_status_str((kvs_status_t) ev.reason),
                     (unsigned long long) ((ev.at_ns - killed) / MS), kvs_status_str(KVS_ERR_IO),
                     (unsigned long long) (LIVENESS_MS + SLACK_MS));
    }
    for (int i = 0; i < 3; i++) {
        expect_done(dec[1], rooms[i].id, KVS_ROOM_SUCCESS);
        expect_done(pre[1], rooms[i].id, KVS_ROOM_SUCCESS);
    }
    /* The rank comes back as a new process on a new endpoint; decode learns it from its
     * heartbeats, and new rooms through it are exact. */
    pre[0] = restart(&d, KVS_SIDE_PREFILL, 0, dec);
    WAIT_COUNTERS(dec[0], m, m.net.peer_restarts >= 1, EVENT_MS, "the restart noticed");
    const room_t again[] = {{104, 1024, 0, 0, 0, 0}, {105, 700, 256, 500, 0, 0}};
    for (int i = 0; i < 2; i++) room_add(&again[i], pre, 2, dec, 2);
    for (int i = 0; i < 2; i++) expect_all_succeed(&again[i], pre, 2, dec, 2);
    /* The failed rooms end quarantine (ABORT_ACK from the new life or the release timeout). */
    for (int i = 0; i < 3; i++)
        assert_int_equal(expect_done(dec[0], rooms[i].id, KVS_ROOM_FAILED).reason, KVS_ERR_IO);
    ev_t f = proc_quit_clean(dec[0], 0);
    assert_int_equal(f.m.rooms_failed, 3);
    assert_int_equal(f.m.rooms_succeeded, 2);
    assert_int_equal(f.net.peer_restarts, 1);
    assert_true(f.net.dead_peers >= 1);
    f = proc_quit_clean(dec[1], 0);
    assert_int_equal(f.m.rooms_succeeded, 5);
    assert_int_equal(f.m.rooms_failed, 0);
    f = proc_quit_clean(pre[1], 0);
    assert_int_equal(f.m.rooms_succeeded, 5);
    f = proc_quit_clean(pre[0], 3); /* the ABORTs of rooms 101-103 reached its new life */
    assert_int_equal(f.m.rooms_succeeded, 2);
    kvs_assert_no_leaks();
}

/* ---- 1b: a prefill rank that dies before decode ever heard it ---- */

static void test_restart_prefill_unheard(void **state)
{
    (void) state;
    /* Prefill rank 1 registers and dies before decode starts: decode bootstraps with its dead
     * endpoint and never hears that life. It comes back on a new port and registers again; its
     * heartbeats dispute the configured endpoint, decode asks the registry again, and rooms
     * through both prefill ranks are exact. */
    deploy_t d = deploy_default(2, 1, 2, KVS_NET_DATA_SHM, 2000);
    d.registry = 1;
    proc_t *pre[2], *dec[1];
    rank_arg_t a = arg_for(&d, KVS_SIDE_PREFILL, 0);
    snprintf(a.registry_bind, sizeof(a.registry_bind), "tcp://%s:0", d.prefill_host);
    pre[0] = proc_start(&a);
    a = arg_for(&d, KVS_SIDE_PREFILL, 1);
    snprintf(a.registry, sizeof(a.registry), "%s", pre[0]->registry);
    pre[1] = proc_start(&a);
    const char *dead_endpoint = pre[1]->endpoint;
    proc_kill(pre[1]);
    a = arg_for(&d, KVS_SIDE_DECODE, 0);
    snprintf(a.registry, sizeof(a.registry), "%s", pre[0]->registry);
    dec[0] = proc_start(&a);
    a = arg_for(&d, KVS_SIDE_PREFILL, 1);
    snprintf(a.registry, sizeof(a.registry), "%s", pre[0]->registry);
    snprintf(a.peers[0], sizeof(a.peers[0]), "%s", dec[0]->endpoint);
    pre[1] = proc_start(&a);
    assert_string_not_equal(pre[1]->endpoint, dead_endpoint);
    const room_t rooms[] = {{201, 1024, 0, 0, 0, 0}, {202, 600, 128, 0, 0, 0}};
    for (int i = 0; i < 2; i++) room_add(&rooms[i], pre, 2, dec, 1);
    for (int i = 0; i < 2; i++) expect_all_succeed(&rooms[i], pre, 2, dec, 1);
    ev_t f = proc_quit_clean(dec[0], 0);
    assert_int_equal(f.m.rooms_succeeded, 2);
    assert_int_equal(f.m.rooms_failed, 0);
    for (int i = 0; i < 2; i++) assert_int_equal(proc_quit_clean(pre[i], 0).m.rooms_succeeded, 2);
    kvs_assert_no_leaks();
}

/* ---- 2: a decode rank killed mid-transfer, then restarted ---- */

static void test_kill_decode_mid_transfer(void **state)
{
    (void) state;
    /* Over tcp (UCX error mode PEER: the dead peer also shows as an endpoint error). One staging
     * buffer per prefill rank: if a failed write kept it, the later room would wedge. */
    deploy_t d = deploy_default(2, 2, 2, KVS_NET_DATA_TCP, 1500);
    d.staging_buffers = 1;
    proc_t *pre[2], *dec[2];
    deploy(&d, pre, dec);
    const room_t rooms[] = {
        {201, 1024, 0, 0, 0, 60}, {202, 1024, 256, 0, 0, 60}, {203, 900, 0, 200, 0, 60}};
    for (int i = 0; i < 3; i++) room_add(&rooms[i], pre, 2, dec, 2);
    ev_t m;
    WAIT_COUNTERS(pre[0], m, m.m.chunks >= 3, EVENT_MS, "3 chunks acknowledged");
    const uint64_t killed = kvs_now_ns();
    proc_kill(dec[0]);
    for (int i = 0; i < 3; i++) {
        ev_t ev = proc_await(pre[0], E_FAILED, rooms[i].id, LIVENESS_MS + SLACK_MS);
        if ((ev.reason != KVS_ERR_IO && ev.reason != KVS_ERR_TIMEOUT) || ev.at_ns < killed ||
            ev.at_ns - killed > (LIVENESS_MS + SLACK_MS) * MS)
            fail_msg("room %llu failed on prefill rank 0 with %s %llu ms after the kill",
                     (unsigned long long) rooms[i].id, kvs_status_str((kvs_status_t) ev.reason),
                     (unsigned long long) ((ev.at_ns - killed) / MS));
    }
    /* Quiescent (no write in flight, status given up on after the release timeout), released. */
    for (int i = 0; i < 3; i++) expect_done(pre[0], rooms[i].id, KVS_ROOM_FAILED);
    m = proc_metrics(pre[0]);
    assert_int_equal(m.m.live_rooms, 0);
    assert_int_equal(m.m.rooms_failed, 3);
    assert_int_equal(m.pool_free, m.pool_total);
    assert_int_equal(m.net.writes_in_flight, 0);
    for (int i = 0; i < 3; i++) {
        expect_done(dec[1], rooms[i].id, KVS_ROOM_SUCCESS);
        expect_done(pre[1], rooms[i].id, KVS_ROOM_SUCCESS);
    }
    /* A new decode rank 0: prefill rank 0 serves it with its one staging buffer. */
    dec[0] = restart(&d, KVS_SIDE_DECODE, 0, pre);
    WAIT_COUNTERS(pre[0], m, m.net.peer_restarts >= 1, EVENT_MS, "the restart noticed");
    const room_t again = {204, 1024, 0, 0, 0, 0};
    room_add(&again, pre, 2, dec, 2);
    expect_all_succeed(&again, pre, 2, dec, 2);
    ev_t f = proc_quit_clean(pre[0], 0);
    assert_int_equal(f.m.rooms_failed, 3);
    assert_int_equal(f.m.rooms_succeeded, 1);
    assert_true(f.net.dead_peers >= 1);
    f = proc_quit_clean(pre[1], 0);
    assert_int_equal(f.m.rooms_succeeded, 4);
    f = proc_quit_clean(dec[1], 0);
    assert_int_equal(f.m.rooms_succeeded, 4);
    f = proc_quit_clean(dec[0], 0);
    assert_int_equal(f.m.rooms_succeeded, 1);
    kvs_assert_no_leaks();
}

/* ---- 3: a prefill rank stopped past the liveness timeout, then resumed ---- */

static void test_stop_prefill_quarantine(void **state)
{
    (void) state;
    /* A three-slot ring: any later room of more than three chunks writes every ring byte the
     * failed room's slots held. */
    const uint64_t release_ms = 8000;
    deploy_t d = deploy_default(2, 2, 2, KVS_NET_DATA_SHM, release_ms);
    d.ring_slots = 3;
    proc_t *pre[2], *dec[2];
    deploy(&d, pre, dec);
    /* Prefill rank 0 computes three chunks, then stalls with the fourth scheduled: decode has
     * granted its slot, so a write into it may still come. */
    const room_t r1 = {301, 1024, 0, 0, 0, 0};
    room_t r1_stall = r1;
    r1_stall.stall_at = 3 * CHUNK_TOKENS;
    r1_stall.pace_ms = 20;
    room_add_to(dec[0], &r1);
    room_add_to(dec[1], &r1);
    room_add_to(pre[0], &r1_stall);
    room_add_to(pre[1], &r1);
    ev_t m;
    WAIT_COUNTERS(dec[0], m, m.m.chunks == 3 && m.m.live_slots == 1, EVENT_MS,
                  "three chunks scattered and the fourth granted");
    const ev_t before = proc_metrics(pre[0]);
    const uint64_t stopped = kvs_now_ns();
    assert_int_equal(kill(pre[0]->ch.pid, SIGSTOP), 0);
    ev_t f = proc_await(dec[0], E_FAILED, r1.id, LIVENESS_MS + SLACK_MS);
    if (f.reason != KVS_ERR_IO || f.at_ns - stopped > (LIVENESS_MS + SLACK_MS) * MS)
        fail_msg("decode rank 0: room failed with %s %llu ms after the stop",
                 kvs_status_str((kvs_status_t) f.reason),
                 (unsigned long long) ((f.at_ns - stopped) / MS));
    /* Failed but quarantined: the granted slot stays, the engine may not take the room back. */
    assert_false(f.quiescent);
    assert_int_equal(f.release_st, KVS_ERR_STATE);
    assert_true(f.m.live_slots >= 1 && f.m.ring_used > 0);
    nh_sleep_us(300000);
    m = proc_metrics(dec[0]);
    assert_true(m.m.live_slots >= 1);
    assert_int_equal(m.m.live_rooms, 1);
    assert_false(proc_seen(dec[0], E_DONE, r1.id));
    /* Resumed, it computes the stalled chunk at once: a late write into the quarantined slot,
     * unless the ABORT is read first. */
    const uint64_t resumed = kvs_now_ns();
    assert_int_equal(kill(pre[0]->ch.pid, SIGCONT), 0);
    proc_cmd(pre[0], (cmd_t){.kind = C_GO, .room = r1.id});
    ev_t done = expect_done(dec[0], r1.id, KVS_ROOM_FAILED);
    assert_int_equal(done.reason, KVS_ERR_IO);
    /* Freed only once the resumed rank confirmed, long before the release timeout. */
    if (done.at_ns < resumed || done.at_ns - f.at_ns >= release_ms * MS)
        fail_msg("decode rank 0 freed the quarantined room %lld ms after the resume",
                 (long long) (done.at_ns - resumed) / (long long) MS);
    assert_int_equal(done.m.live_slots, 0);
    assert_int_equal(done.m.ring_used, 0);
    /* The resumed rank learns the room failed (ABORT, or decode looked dead to it), releases. */
    ev_t pf = expect_done(pre[0], r1.id, KVS_ROOM_FAILED);
    if (pf.reason != KVS_ERR_ABORTED && pf.reason != KVS_ERR_IO)
        fail_msg("prefill rank 0: room failed with %s", kvs_status_str((kvs_status_t) pf.reason));
    expect_done(dec[1], r1.id, KVS_ROOM_SUCCESS);
    expect_done(pre[1], r1.id, KVS_ROOM_SUCCESS);
    /* A new room reuses the failed room's pages and every ring slot: byte-exact, and the
     * resumed rank serves it. */
    const room_t r2 = {302, 1024, 0, 0, 0, 0};
    room_add(&r2, pre, 2, dec, 2);
    ev_t ok = expect_done(dec[0], r2.id, KVS_ROOM_SUCCESS);
    assert_true(ok.tainted > 0);
    assert_true(room_chunks(&r2) > d.ring_slots);
    expect_done(dec[1], r2.id, KVS_ROOM_SUCCESS);
    expect_done(pre[0], r2.id, KVS_ROOM_SUCCESS);
    expect_done(pre[1], r2.id, KVS_ROOM_SUCCESS);
    ev_t fp = proc_quit_clean(pre[0], 1); /* an ABORT repeat may follow its ABORT_ACK */
    /* Writes it made for room 301 after the resume landed in the quarantined slot only. */
    uint64_t late = fp.m.bulk_writes - before.m.bulk_writes - room_chunks(&r2);
    if (getenv("KVS_LOG") != NULL)
        print_message("prefill rank 0 wrote %llu chunk(s) after SIGCONT into the quarantine\n",
                      (unsigned long long) late);
    ev_t fd = proc_quit_clean(dec[0], 0);
    assert_int_equal(fd.m.rooms_failed, 1);
    assert_int_equal(fd.m.rooms_succeeded, 1);
    assert_int_equal(fd.m.chunks, 3 + room_chunks(&r2));
    proc_quit_clean(pre[1], 0);
    proc_quit_clean(dec[1], 0);
    kvs_assert_no_leaks();
}

/* ---- 4: hostile messages at every endpoint ---- */

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t) (v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t) (v >> (8 * i));
}

/* A control-channel frame header (see control/zmq_channel.h). */
static void frame_header(uint8_t *b, uint8_t kind, kvs_side_t side, uint32_t rank, uint64_t inc)
{
    b[0] = kind;
    b[1] = KVS_ZCH_VERSION;
    b[2] = (uint8_t) side;
    b[3] = 0;
    put_u32(b + 4, rank);
    put_u64(b + 8, inc);
    put_u64(b + 16, 0); /* instance */
}

/* Sends one frame (bounded by ZMQ_SNDTIMEO); returns 1, to count what was sent. */
static uint32_t zsend(void *s, const void *b, size_t n, int flags)
{
    if (zmq_send(s, b, n, flags) != (int) n)
        fail_msg("zmq_send of %zu bytes: %s", n, zmq_strerror(zmq_errno()));
    return 1;
}

static void *zsocket(void *zctx, int type, const char *endpoint, int linger_ms)
{
    void *s = zmq_socket(zctx, type);
    assert_non_null(s);
    int timeout = 5000;
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &timeout, sizeof(timeout));
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout, sizeof(timeout));
    zmq_setsockopt(s, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
    assert_int_equal(zmq_connect(s, endpoint), 0);
    return s;
}

/* Frames the control channel of a rank on side `target` must reject and count, coming from
 * "peers" with an incarnation older than the real ones (so nothing here can pass for a restart);
 * returns how many were sent. */
static uint32_t send_bad_frames(void *s, kvs_side_t target, uint32_t peer_tp, kvs_rng_t *rng)
{
    const kvs_side_t from = target == KVS_SIDE_PREFILL ? KVS_SIDE_DECODE : KVS_SIDE_PREFILL;
    const size_t H = KVS_ZCH_HEADER_SIZE;
    uint8_t *b = kvs_calloc(1, H + KVS_ZCH_INTERNAL_MAX + 1);
    assert_non_null(b);
    uint32_t n = 0;
    n += zsend(s, b, 0, 0); /* empty */
    frame_header(b, KVS_ZCH_MSG, from, 0, 7);
    n += zsend(s, b, 7, 0); /* shorter than the header */
    for (int i = 0; i < 10; i++, n++) {
        size_t len = 1 + kvs_rng_below(rng, 200);
        for (size_t j = 0; j < len; j++) b[j] = (uint8_t) kvs_rng_next(rng);
        if (len > 1) b[1] = (uint8_t) (KVS_ZCH_VERSION + 1 + kvs_rng_below(rng, 200));
        zsend(s, b, len, 0); /* garbage */
    }
    memset(b, 0, H + 64);
    frame_header(b, 9, from, 0, 7);
    n += zsend(s, b, H + 8, 0); /* unknown kind */
    frame_header(b, 0, from, 0, 7);
    n += zsend(s, b, H + 8, 0); /* kind zero */
    frame_header(b, KVS_ZCH_MSG, from, 0, 7);
    b[1] = KVS_ZCH_VERSION + 1;
    n += zsend(s, b, H + 8, 0); /* unknown version */
    frame_header(b, KVS_ZCH_MSG, target, 0, 7);
    n += zsend(s, b, H + 8, 0); /* from our own side */
    frame_header(b, KVS_ZCH_MSG, from, peer_tp, 7);
    n += zsend(s, b, H + 8, 0); /* a rank that does not exist */
    frame_header(b, KVS_ZCH_MSG, from, 0, 0);
    n += zsend(s, b, H + 8, 0); /* no incarnation */
    frame_header(b, KVS_ZCH_MSG, from, 0, 7);
    b[3] = 1;
    n += zsend(s, b, H + 8, 0); /* reserved byte set */
    frame_header(b, KVS_ZCH_MSG, from, 0, 7);
    n += zsend(s, b, H + KVS_MSG_MAX_SIZE + 1, 0); /* oversized protocol message */
    frame_header(b, KVS_ZCH_HEARTBEAT, from, 0, 7);
    b[H + 8] = 100;
    memcpy(b + H + 10, "tcp:/", 5);
    n += zsend(s, b, H + 15, 0); /* heartbeat whose endpoint length disagrees */
    b[H + 8] = 5;
    b[H + 14] = 0x01;
    n += zsend(s, b, H + 15, 0); /* heartbeat with an unprintable endpoint */
    n += zsend(s, b, H + 4, 0);  /* truncated heartbeat */
    frame_header(b, KVS_ZCH_WIREUP, from, 0, 7);
    n += zsend(s, b, H + KVS_ZCH_INTERNAL_MAX + 1, 0); /* oversized wireup */
    frame_header(b, KVS_ZCH_MSG, from, 0, 7);
    zsend(s, b, H + 8, ZMQ_SNDMORE);
    n += zsend(s, b, H + 8, 0); /* multi-part */
    kvs_free(b);
    return n;
}

/* Requests the registry must reject and count; returns how many were sent. */
static uint32_t send_bad_registry(void *s, const kvs_pd_geometry_t *geo, kvs_rng_t *rng)
{
    uint8_t q[64], b[2048];
    size_t qn = 0, n = 0;
    kvs_msg_t query = {.type = KVS_MSG_QUERY};
    assert_int_equal(kvs_msg_encode(&query, q, sizeof(q), &qn), KVS_OK);
    uint32_t sent = 0;
    for (int i = 0; i < 50; i++) b[i] = (uint8_t) kvs_rng_next(rng);
    b[0] = 0;
    sent += zsend(s, b, 50, 0); /* garbage */
    sent += zsend(s, b, 0, 0);  /* empty */
    sent += zsend(s, q, 8, 0);  /* truncated */
    memcpy(b, q, qn);
    b[qn] = 0;
    sent += zsend(s, b, qn + 1, 0); /* a trailing byte */
    memset(b, 0, sizeof(b));
    memcpy(b, q, qn);
    sent += zsend(s, b, sizeof(b), 0); /* larger than any message */
    uint8_t *huge = kvs_calloc(1, 2u << 20);
    assert_non_null(huge);
    sent += zsend(s, huge, 2u << 20, 0); /* much larger */
    kvs_free(huge);
    kvs_msg_t req = {.type = KVS_MSG_STAGING_REQ};
    assert_int_equal(kvs_msg_encode(&req, b, sizeof(b), &n), KVS_OK);
    sent += zsend(s, b, n, 0); /* a valid message the registry does not serve */
    zsend(s, q, qn, ZMQ_SNDMORE);
    sent += zsend(s, q, qn, 0); /* multi-part */
    kvs_pd_geometry_t other = *geo;
    other.prefill_tp = geo->prefill_tp + 1;
    kvs_msg_t reg = {.type = KVS_MSG_REGISTER};
    kvs_registry_describe(&other, 0, "tcp://127.0.0.1:9", &reg.u.reg);
    assert_int_equal(kvs_msg_encode(&reg, b, sizeof(b), &n), KVS_OK);
    sent += zsend(s, b, n, 0); /* a rank of another TP size */
    kvs_registry_describe(geo, 1, "tcp://127.0.0.1:9", &reg.u.reg);
    assert_int_equal(kvs_msg_encode(&reg, b, sizeof(b), &n), KVS_OK);
    b[KVS_MSG_HEADER_SIZE] = 5; /* rank 5 of TP 2: out of range */
    sent += zsend(s, b, n, 0);
    return sent;
}

/* Asks the registry for a prefill rank over the test's own socket: the same request twice (a
 * replay is answered again), then a rank that does not exist. */
static void registry_replays(void *s, const char *want_endpoint)
{
    uint8_t b[KVS_MSG_MAX_SIZE];
    size_t n = 0;
    kvs_msg_t query = {.type = KVS_MSG_QUERY};
    query.u.query.rank = 1;
    assert_int_equal(kvs_msg_encode(&query, b, sizeof(b), &n), KVS_OK);
    zsend(s, b, n, 0);
    zsend(s, b, n, 0);
    query.u.query.rank = 9;
    assert_int_equal(kvs_msg_encode(&query, b, sizeof(b), &n), KVS_OK);
    zsend(s, b, n, 0);
    for (int i = 0; i < 3; i++) {
        int got = zmq_recv(s, b, sizeof(b), 0); /* ZMQ_RCVTIMEO bounds the wait */
        if (got < 0) fail_msg("the registry did not answer request %d", i);
        kvs_msg_t reply;
        assert_int_equal(kvs_msg_decode(b, (size_t) got, &reply), KVS_OK);
        assert_int_equal(reply.type, KVS_MSG_QUERY_REPLY);
        assert_int_equal(reply.u.query.rank, i < 2 ? 1 : 9);
        assert_int_equal(reply.u.query.found, i < 2);
        if (i < 2) assert_string_equal(reply.u.query.reg.endpoint, want_endpoint);
    }
}

static void test_hostile_messages(void **state)
{
    (void) state;
    /* Prefill TP2 -> decode TP1 (two writers per slot), bootstrap through the registry. */
    deploy_t d = deploy_default(2, 1, 4, KVS_NET_DATA_SHM, 3000);
    d.registry = 1;
    proc_t *pre[2], *dec[1];
    deploy(&d, pre, dec);
    proc_t *all[3] = {pre[0], pre[1], dec[0]};
    const room_t a = {401, 1024, 128, 0, 0, 0};
    const room_t b = {402, 1024, 0, 0, 3 * CHUNK_TOKENS, 0}; /* stalls after three chunks */
    const room_t c = {403, 700, 0, 500, 0, 0};
    room_add(&a, pre, 2, dec, 1);
    expect_all_succeed(&a, pre, 2, dec, 1);
    /* Room b is mid-transfer while everything below arrives: chunks 0-2 scattered, chunk 3's
     * slot granted and waiting for its writers. */
    room_add(&b, pre, 2, dec, 1);
    ev_t m;
    WAIT_COUNTERS(dec[0], m, m.m.chunks == room_chunks(&a) + 3 && m.m.live_slots == 1, EVENT_MS,
                  "room b stalled with a granted slot");
    ev_t before[3];
    for (int i = 0; i < 3; i++) before[i] = proc_metrics(all[i]);

    void *zctx = zmq_ctx_new();
    assert_non_null(zctx);
    kvs_rng_t rng;
    uint64_t seed = kvs_test_seed(404);
    kvs_rng_seed(&rng, seed);
    /* Beyond the transport's own bound (ZMQ_MAXMSGSIZE): ZeroMQ drops that connection. */
    void *huge[3];
    uint8_t *big = kvs_calloc(1, 2u << 20);
    assert_non_null(big);
    for (int i = 0; i < 3; i++) {
        huge[i] = zsocket(zctx, ZMQ_PUSH, all[i]->endpoint, 0);
        zsend(huge[i], big, 2u << 20, 0);
    }
    kvs_free(big);
    /* Control channel: malformed frames (rejected) and a frame of an earlier life (stale). */
    void *push[3];
    uint32_t bad[3];
    for (int i = 0; i < 3; i++) {
        push[i] = zsocket(zctx, ZMQ_PUSH, all[i]->endpoint, 2000);
        uint32_t peer_tp = all[i]->arg.side == KVS_SIDE_PREFILL ? 1 : 2;
        bad[i] = send_bad_frames(push[i], all[i]->arg.side, peer_tp, &rng);
        uint8_t st[KVS_ZCH_HEADER_SIZE + 8] = {0};
        frame_header(st, KVS_ZCH_MSG,
                     all[i]->arg.side == KVS_SIDE_PREFILL ? KVS_SIDE_DECODE : KVS_SIDE_PREFILL, 0,
                     1);
        zsend(push[i], st, sizeof(st), 0);
    }
    /* The registry: malformed and unexpected requests, then replayed queries still answered. */
    void *dealer = zsocket(zctx, ZMQ_DEALER, pre[0]->registry, 2000);
    uint32_t reg_bad = send_bad_registry(dealer, &d.geo, &rng);
    registry_replays(dealer, pre[1]->endpoint);
    /* Protocol messages through the ranks' own links: malformed or misaddressed ones... */
    ev_t garbage[3], replay[3][2];
    for (int i = 0; i < 3; i++) {
        proc_cmd(all[i], (cmd_t){.kind = C_GARBAGE, .room = b.id});
        garbage[i] = proc_await(all[i], E_SENT, b.id, EVENT_MS);
    }
    /* ...and valid ones each rank sent before, replayed: for a released room and for chunks
     * already scattered (never a second scatter), and grants and ACKs back to prefill. */
    const uint32_t tx_types = (1u << KVS_MSG_CHUNK_READY) | (1u << KVS_MSG_STAGING_REQ);
    const uint32_t rx_types = (1u << KVS_MSG_STAGING_GRANT) | (1u << KVS_MSG_ACK);
    for (int i = 0; i < 3; i++) {
        int prefill = all[i]->arg.side == KVS_SIDE_PREFILL;
        proc_cmd(all[i],
                 (cmd_t){.kind = C_REPLAY, .room = a.id, .types = prefill ? tx_types : rx_types});
        replay[i][0] = proc_await(all[i], E_SENT, a.id, EVENT_MS);
        proc_cmd(all[i], (cmd_t){.kind = C_REPLAY,
                                 .room = b.id,
                                 .types = prefill ? 1u << KVS_MSG_CHUNK_READY : rx_types});
        replay[i][1] = proc_await(all[i], E_SENT, b.id, EVENT_MS);
    }
    /* What each rank must have counted: index 0, 1 prefill ranks, 2 the decode rank. */
    uint64_t rej[3], ign[3];
    rej[2] = garbage[0].sent[0] + garbage[1].sent[0];
    ign[2] =
        replay[0][0].sent[0] + replay[0][1].sent[0] + replay[1][0].sent[0] + replay[1][1].sent[0];
    for (int p = 0; p < 2; p++) {
        rej[p] = garbage[2].sent[p];
        ign[p] = replay[2][0].sent[p] + replay[2][1].sent[p];
    }
    for (int i = 0; i < 3; i++) assert_true(rej[i] > 0 && ign[i] > 0);
    /* The replays include messages about room b, which is live. */
    for (int i = 0; i < 2; i++) assert_true(replay[i][1].sent[0] > 0 && replay[2][1].sent[i] > 0);
    ev_t now[3];
    for (int pass = 0; pass < 2; pass++) {
        uint64_t end = kvs_now_ns() + EVENT_MS * MS;
        for (int i = 0; i < 3; i++) {
            for (;;) {
                now[i] = proc_metrics(all[i]);
                int done =
                    now[i].net.rejected - before[i].net.rejected >= bad[i] &&
                    now[i].net.stale - before[i].net.stale >= 1 &&
                    now[i].m.rejected - before[i].m.rejected >= rej[i] &&
                    now[i].m.ignored - before[i].m.ignored >= ign[i] &&
                    (i != 0 || now[i].registry_rejected - before[i].registry_rejected >= reg_bad);
                if (done) break;
                if (kvs_now_ns() > end)
                    fail_msg("seed %llu: %s counted %llu of %u rejected frames, %llu of 1 stale, "
                             "%llu of %llu rejected and %llu of %llu ignored messages, %llu of "
                             "%u rejected registry requests",
                             (unsigned long long) seed, all[i]->name,
                             (unsigned long long) (now[i].net.rejected - before[i].net.rejected),
                             bad[i], (unsigned long long) (now[i].net.stale - before[i].net.stale),
                             (unsigned long long) (now[i].m.rejected - before[i].m.rejected),
                             (unsigned long long) rej[i],
                             (unsigned long long) (now[i].m.ignored - before[i].m.ignored),
                             (unsigned long long) ign[i],
                             (unsigned long long) (now[i].registry_rejected -
                                                   before[i].registry_rejected),
                             reg_bad);
                nh_sleep_us(5000);
            }
        }
        if (pass == 0) nh_sleep_us(300000); /* then nothing more may be counted */
    }
    for (int i = 0; i < 3; i++) {
        assert_int_equal(now[i].net.rejected - before[i].net.rejected, bad[i]);
        assert_int_equal(now[i].net.stale - before[i].net.stale, 1);
        assert_int_equal(now[i].m.rejected - before[i].m.rejected, rej[i]);
    }
    assert_int_equal(now[0].registry_rejected - before[0].registry_rejected, reg_bad);
    /* Nothing was scattered again, and room b's slot is still the only one. */
    assert_int_equal(now[2].m.chunks, before[2].m.chunks);
    assert_int_equal(now[2].m.bytes, before[2].m.bytes);
    assert_int_equal(now[2].m.live_slots, 1);
    for (int i = 0; i < 3; i++) {
        zmq_close(huge[i]);
        zmq_close(push[i]);
    }
    zmq_close(dealer);
    zmq_ctx_term(zctx);
    /* Every process kept serving: room b completes, a new room too, both exact. */
    for (int p = 0; p < 2; p++) proc_cmd(pre[p], (cmd_t){.kind = C_GO, .room = b.id});
    expect_all_succeed(&b, pre, 2, dec, 1);
    room_add(&c, pre, 2, dec, 1);
    expect_all_succeed(&c, pre, 2, dec, 1);
    kvs_msg_register_t reg;
    assert_int_equal(kvs_registry_query(pre[0]->registry, 1, 5000 * MS, &reg), KVS_OK);
    assert_string_equal(reg.endpoint, pre[1]->endpoint);
    ev_t f = proc_quit_clean(dec[0], 0);
    assert_int_equal(f.m.chunks, room_chunks(&a) + room_chunks(&b) + room_chunks(&c));
    assert_int_equal(f.m.rooms_succeeded, 3);
    for (int p = 0; p < 2; p++) assert_int_equal(proc_quit_clean(pre[p], 0).m.rooms_succeeded, 3);
    kvs_assert_no_leaks();
}

/* ---- 5: two hosts, as network namespaces joined by a veth pair ---- */

static char g_ns[2][NAME_LEN]; /* prefill's and decode's namespace, also their veth ends */
static int g_ns_made[2], g_veth_made;

/* Runs a shell command quietly; returns its exit status (127: command not found). */
static int sh(const char *fmt, ...)
{
    char cmd[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd) - 20, fmt, ap);
    va_end(ap);
    strcat(cmd, " >/dev/null 2>&1");
    int st = system(cmd);
    if (st == -1) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void ns_cleanup(void)
{
    for (int i = 0; i < 2; i++) {
        if (g_ns_made[i]) sh("ip netns delete %s", g_ns[i]);
        g_ns_made[i] = 0;
    }
    /* Only still there if it never moved into its namespace. */
    if (g_veth_made) sh("ip link delete %s", g_ns[0]);
    g_veth_made = 0;
}

/* Creates both namespaces and the veth pair with 10.199.x.1 (prefill) and 10.199.x.2 (decode);
 * on failure says why in `why`. */
static int ns_setup(unsigned x, char *why, size_t cap)
{
    snprintf(g_ns[0], NAME_LEN, "kvsf%dp", (int) getpid());
    snprintf(g_ns[1], NAME_LEN, "kvsf%dd", (int) getpid());
    int st = sh("ip netns add %s", g_ns[0]);
    if (st == 127) {
        snprintf(why, cap, "the ip command (iproute2) is not installed");
        return -1;
    }
    if (st != 0) {
        snprintf(why, cap,
                 "cannot create a network namespace (ip netns add exited %d: needs "
                 "root or CAP_SYS_ADMIN)",
                 st);
        return -1;
    }
    g_ns_made[0] = 1;
    if (sh("ip netns add %s", g_ns[1]) != 0) {
        snprintf(why, cap, "cannot create a second network namespace");
        return -1;
    }
    g_ns_made[1] = 1;
    if (sh("ip link add %s type veth peer name %s", g_ns[0], g_ns[1]) != 0) {
        snprintf(why, cap, "cannot create a veth pair");
        return -1;
    }
    g_veth_made = 1;
    for (int i = 0; i < 2; i++) {
        if (sh("ip link set %s netns %s", g_ns[i], g_ns[i]) != 0 ||
            sh("ip -n %s addr add 10.199.%u.%d/30 dev %s", g_ns[i], x, i + 1, g_ns[i]) != 0 ||
            sh("ip -n %s link set lo up", g_ns[i]) != 0 ||
            sh("ip -n %s link set %s up", g_ns[i], g_ns[i]) != 0) {
            snprintf(why, cap, "cannot configure the veth end %s", g_ns[i]);
            return -1;
        }
    }
    /* The ranks must be able to enter it (setns, and a private sysfs mount). */
    pid_t pid = fork();
    if (pid == 0) _exit(enter_netns(g_ns[0]) == 0 ? 0 : 1);
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
        snprintf(why, cap, "cannot enter a network namespace and mount sysfs there");
        return -1;
    }
    return 0;
}

static void test_two_hosts_veth(void **state)
{
    (void) state;
    char why[256];
    unsigned x = (unsigned) getpid() % 250 + 1;
    if (ns_setup(x, why, sizeof(why)) != 0) {
        ns_cleanup();
        print_message("two hosts test skipped: %s\n", why);
        skip();
    }
    char prefill_host[32], decode_host[32];
    snprintf(prefill_host, sizeof(prefill_host), "10.199.%u.1", x);
    snprintf(decode_host, sizeof(decode_host), "10.199.%u.2", x);
    deploy_t d = deploy_default(2, 1, 4, KVS_NET_DATA_TCP, 3000);
    d.registry = 1;
    d.prefill_host = prefill_host;
    d.decode_host = decode_host;
    d.prefill_dev = d.prefill_ns = g_ns[0];
    d.decode_dev = d.decode_ns = g_ns[1];
    proc_t *pre[2], *dec[1];
    deploy(&d, pre, dec);
    const room_t rooms[] = {{501, 1024, 0, 0, 0, 0}, {502, 777, 128, 300, 0, 0}};
    for (int i = 0; i < 2; i++) room_add(&rooms[i], pre, 2, dec, 1);
    for (int i = 0; i < 2; i++) expect_all_succeed(&rooms[i], pre, 2, dec, 1);
    ev_t f = proc_quit_clean(dec[0], 0);
    assert_int_equal(f.m.rooms_succeeded, 2);
    assert_int_equal(f.net.rejected, 0);
    for (int p = 0; p < 2; p++) {
        f = proc_quit_clean(pre[p], 0);
        assert_int_equal(f.m.rooms_succeeded, 2);
        assert_true(f.net.writes > 0);
        assert_int_equal(f.net.writes_failed, 0);
    }
    ns_cleanup();
    kvs_assert_no_leaks();
}

static int teardown(void **state)
{
    nh_kill_children(state);
    ns_cleanup();
    nh_shm_clean(&g_shm);
    return 0;
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN); /* a killed rank's pipe must not kill the test */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_kill_prefill_mid_transfer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_restart_prefill_unheard, setup, teardown),
        cmocka_unit_test_setup_teardown(test_kill_decode_mid_transfer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stop_prefill_quarantine, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hostile_messages, setup, teardown),
        cmocka_unit_test_setup_teardown(test_two_hosts_veth, setup, teardown),
    };
    const char *filter = getenv("KVS_TEST_FILTER"); /* e.g. "*hostile*" */
    if (filter != NULL) cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
