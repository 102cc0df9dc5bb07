/* The in-process transport: control messages move between per-rank timed inboxes, data writes
 * land in exposed decode rings at a (possibly delayed) due time. A seeded scheduler injects
 * delay (hence reordering), duplication and loss into control messages. Writes that touch
 * device memory land through the writer's copy queue (an asynchronous CUDA copy, complete when
 * its event fires), host-only writes with memcpy; device rings can also be mapped for direct
 * writes by the sender's gather kernel. */
#include "kvstage/inproc.h"

#include <string.h>

#include "base/heap.h"
#include "base/map.h"
#include "base/mem.h"
#include "kvstage/alloc.h"
#include "kvstage/layout.h"
#include "kvstage/log.h"
#include "kvstage/msg.h"
#include "kvstage/rng.h"
#include "transport/link.h"

typedef struct {
    size_t len;
    uint32_t from;   /* the sender's rank */
    uint8_t bytes[]; /* [len] one encoded control message */
} inproc_msg_t;

typedef struct {
    uint64_t ticket;
    int done;    /* landed and complete; status in st */
    int landing; /* device copy issued on the writer's queue, complete at copy_ticket */
    uint64_t copy_ticket;
    kvs_status_t st;
    const void *src;
    uint8_t *dst;
    uint64_t len;
    int ring_device; /* of the destination ring, -1 for host memory */
    int fail;        /* the write_fail_nth fault: lands half its bytes, then fails */
} inproc_write_t;

typedef struct inproc_ep {
    kvs_inproc_net_t *net;
    kvs_side_t side;
    uint32_t rank;
    int linked;
    kvs_heap_t inbox;  /* inproc_msg_t * by due time */
    kvs_heap_t writes; /* inproc_write_t * by due time (prefill endpoints) */
    kvs_map_t tickets; /* ticket -> inproc_write_t * until polled complete */
    uint64_t next_ticket;
    kvs_mem_queue_t *queue; /* prefill endpoints: device copies, made on the first one */
    uint8_t *ring;          /* decode endpoints: the exposed ring */
    uint64_t ring_size;
    int ring_device; /* the ring's CUDA device, -1 for host memory */
} inproc_ep_t;

struct kvs_inproc_net {
    uint32_t prefill_tp, decode_tp;
    inproc_ep_t *eps; /* [prefill_tp + decode_tp]: prefill ranks first */
    kvs_inproc_faults_t faults;
    kvs_rng_t rng;
    kvs_clock_t clock;
    kvs_inproc_stats_t stats;
    uint64_t writes_since_faults; /* data writes issued since the faults were last set */
    int shared_device;            /* kvs_inproc_net_set_shared_device */
};

static inproc_ep_t *endpoint(kvs_inproc_net_t *net, kvs_side_t side, uint32_t rank)
{
    if (side == KVS_SIDE_PREFILL) return rank < net->prefill_tp ? &net->eps[rank] : NULL;
    return rank < net->decode_tp ? &net->eps[net->prefill_tp + rank] : NULL;
}

kvs_status_t kvs_inproc_net_create(uint32_t prefill_tp, uint32_t decode_tp,
                                   const kvs_inproc_faults_t *faults, const kvs_clock_t *clock,
                                   kvs_inproc_net_t **net_p)
{
    if (prefill_tp == 0 || decode_tp == 0 || prefill_tp > KVS_MAX_TP || decode_tp > KVS_MAX_TP) {
        kvs_error("inproc net: TP sizes %u and %u must be in [1, %u]", prefill_tp, decode_tp,
                  KVS_MAX_TP);
        return KVS_ERR_INVALID;
    }
    kvs_inproc_net_t *net = kvs_calloc(1, sizeof(*net));
    if (net == NULL) return KVS_ERR_NOMEM;
    net->eps = kvs_calloc(prefill_tp + decode_tp, sizeof(*net->eps));
    if (net->eps == NULL) {
        kvs_free(net);
        return KVS_ERR_NOMEM;
    }
    net->prefill_tp = prefill_tp;
    net->decode_tp = decode_tp;
    net->clock = *clock;
    for (uint32_t i = 0; i < prefill_tp + decode_tp; i++) {
        inproc_ep_t *ep = &net->eps[i];
        ep->net = net;
        ep->side = i < prefill_tp ? KVS_SIDE_PREFILL : KVS_SIDE_DECODE;
        ep->rank = i < prefill_tp ? i : i - prefill_tp;
        ep->ring_device = -1;
        kvs_heap_init(&ep->inbox);
        kvs_heap_init(&ep->writes);
        kvs_map_init(&ep->tickets);
    }
    kvs_inproc_net_set_faults(net, faults);
    *net_p = net;
    return KVS_OK;
}

static void clear_endpoint(inproc_ep_t *ep)
{
    void *v;
    while ((v = kvs_heap_pop(&ep->inbox)) != NULL) kvs_free(v);
    /* Writes still pending are owned by the tickets map too: free them once, from the map. */
    kvs_heap_fini(&ep->writes);
    uint64_t key;
    for (size_t it = 0; kvs_map_next(&ep->tickets, &it, &key, &v);) kvs_free(v);
    kvs_map_fini(&ep->tickets);
    kvs_heap_fini(&ep->inbox);
    kvs_mem_queue_destroy(ep->queue); /* waits for device copies still reading their sources */
    ep->queue = NULL;
    ep->ring = NULL;
    ep->ring_size = 0;
    ep->ring_device = -1;
}

void kvs_inproc_net_destroy(kvs_inproc_net_t *net)
{
    if (net == NULL) return;
    for (uint32_t i = 0; i < net->prefill_tp + net->decode_tp; i++) {
        if (net->eps[i].linked) kvs_warn("inproc net destroyed while a link is open");
        clear_endpoint(&net->eps[i]);
    }
    kvs_free(net->eps);
    kvs_free(net);
}

void kvs_inproc_net_set_faults(kvs_inproc_net_t *net, const kvs_inproc_faults_t *faults)
{
    if (faults != NULL) {
        net->faults = *faults;
    } else {
        memset(&net->faults, 0, sizeof(net->faults));
    }
    kvs_rng_seed(&net->rng, net->faults.seed);
    memset(net->stats.sent_by_type, 0, sizeof(net->stats.sent_by_type));
    net->stats.host_writes = 0;
    net->writes_since_faults = 0;
}

void kvs_inproc_net_stats(const kvs_inproc_net_t *net, kvs_inproc_stats_t *stats_p)
{
    *stats_p = net->stats;
}

uint64_t kvs_inproc_net_next_event(const kvs_inproc_net_t *net)
{
    uint64_t next = UINT64_MAX;
    for (uint32_t i = 0; i < net->prefill_tp + net->decode_tp; i++) {
        const kvs_heap_entry_t *m = kvs_heap_top(&net->eps[i].inbox);
        const kvs_heap_entry_t *w = kvs_heap_top(&net->eps[i].writes);
        if (m != NULL && m->time < next) next = m->time;
        if (w != NULL && w->time < next) next = w->time;
    }
    return next;
}

/* The corruption fault: flips one bit of a write that just landed in host memory, after the
 * writer computed its checksum, as a bad link or a stray write would. */
static void maybe_corrupt(kvs_inproc_net_t *net, inproc_write_t *w)
{
    const uint64_t nth = ++net->stats.host_writes;
    /* The random draw only when the fault is on: other faults' schedules stay as they were. */
    const int hit = nth == net->faults.corrupt_nth ||
                    (net->faults.corrupt_permille != 0 &&
                     kvs_rng_chance(&net->rng, net->faults.corrupt_permille, 1000));
    if (!hit || w->len == 0) return;
    const uint64_t bit = kvs_rng_below(&net->rng, w->len * 8);
    ((uint8_t *) w->dst)[bit / 8] ^= (uint8_t) (1u << (bit % 8));
    net->stats.corrupted++;
}

/* Starts landing one write: memcpy between host buffers (done at once), otherwise an
 * asynchronous copy on the writer's queue, made on the source's device (or the ring's). */
static void land_write(inproc_ep_t *ep, inproc_write_t *w)
{
    const int src_device = kvs_mem_device_of(w->src), ring_device = w->ring_device;
    if (w->fail) {
        /* A link that breaks mid-write: part of the bytes landed, the writer hears of a
         * failure. */
        if (src_device < 0 && ring_device < 0) memcpy(w->dst, w->src, w->len / 2);
        ep->net->stats.write_failures++;
        w->st = KVS_ERR_IO;
        w->done = 1;
        return;
    }
    if (src_device < 0 && ring_device < 0) {
        memcpy(w->dst, w->src, w->len);
        maybe_corrupt(ep->net, w);
        w->done = 1;
        return;
    }
    kvs_status_t st = KVS_OK;
    if (ep->queue == NULL)
        st = kvs_mem_queue_create(src_device >= 0 ? src_device : ring_device, &ep->queue);
    if (st == KVS_OK)
        st = kvs_mem_queue_copy(ep->queue, w->dst, w->src, (size_t) w->len, &w->copy_ticket);
    if (st != KVS_OK) {
        w->st = st; /* logged by the queue; the write fails and so does its room */
        w->done = 1;
        return;
    }
    w->landing = 1;
}

/* Lands every write whose due time has come, on every endpoint, so a write lands at its time
 * whether or not its writer polls (a late write must be able to hurt if the protocol is
 * wrong). */
static void land_due_writes(kvs_inproc_net_t *net)
{
    uint64_t now = kvs_clock_now(&net->clock);
    for (uint32_t i = 0; i < net->prefill_tp; i++) {
        inproc_ep_t *ep = &net->eps[i];
        const kvs_heap_entry_t *top;
        while ((top = kvs_heap_top(&ep->writes)) != NULL && top->time <= now) {
            inproc_write_t *w = kvs_heap_pop(&ep->writes);
            land_write(ep, w);
            net->stats.writes_in_flight--;
        }
    }
}

static uint64_t random_delay(kvs_inproc_net_t *net, uint64_t max)
{
    return max ? kvs_rng_range(&net->rng, 0, max) : 0;
}

static kvs_status_t enqueue_msg(inproc_ep_t *to, uint32_t from, const uint8_t *buf, size_t len,
                                uint64_t due)
{
    inproc_msg_t *m = kvs_malloc(sizeof(*m) + len);
    if (m == NULL) return KVS_ERR_NOMEM;
    m->len = len;
    m->from = from;
    memcpy(m->bytes, buf, len);
    kvs_status_t st = kvs_heap_push(&to->inbox, due, m);
    if (st != KVS_OK) kvs_free(m);
    return st;
}

static kvs_status_t ep_send(void *ctx, uint32_t peer, const uint8_t *buf, size_t len)
{
    inproc_ep_t *ep = ctx;
    kvs_inproc_net_t *net = ep->net;
    kvs_side_t other = ep->side == KVS_SIDE_PREFILL ? KVS_SIDE_DECODE : KVS_SIDE_PREFILL;
    inproc_ep_t *to = endpoint(net, other, peer);
    if (to == NULL) {
        kvs_error("inproc send: no %s rank %u", other == KVS_SIDE_DECODE ? "decode" : "prefill",
                  peer);
        return KVS_ERR_INVALID;
    }
    net->stats.sent++;
    kvs_msg_type_t peeked;
    uint32_t type = kvs_msg_peek_type(buf, len, &peeked) == KVS_OK ? (uint32_t) peeked : 0;
    uint64_t nth = type < KVS_INPROC_MSG_TYPES ? ++net->stats.sent_by_type[type] : 0;
    if (type != 0 && type == net->faults.drop_type && nth == net->faults.drop_nth) {
        net->stats.dropped++;
        return KVS_OK;
    }
    if (kvs_rng_chance(&net->rng, net->faults.drop_permille, 1000)) {
        net->stats.dropped++;
        return KVS_OK; /* lost in flight: the sender cannot tell */
    }
    uint64_t now = kvs_clock_now(&net->clock);
    int copies = 1 + kvs_rng_chance(&net->rng, net->faults.dup_permille, 1000);
    for (int c = 0; c < copies; c++) {
        kvs_status_t st =
            enqueue_msg(to, ep->rank, buf, len, now + random_delay(net, net->faults.delay_max_ns));
        if (st != KVS_OK) return st;
        net->stats.in_flight++;
    }
    if (copies > 1) net->stats.duplicated++;
    return KVS_OK;
}

static kvs_status_t ep_recv(void *ctx, uint8_t *buf, size_t cap, size_t *len_p, uint32_t *from_p)
{
    inproc_ep_t *ep = ctx;
    kvs_inproc_net_t *net = ep->net;
    land_due_writes(net);
    const kvs_heap_entry_t *top = kvs_heap_top(&ep->inbox);
    if (top == NULL || top->time > kvs_clock_now(&net->clock)) return KVS_INPROGRESS;
    inproc_msg_t *m = kvs_heap_pop(&ep->inbox);
    net->stats.in_flight--;
    net->stats.delivered++;
    kvs_status_t st = KVS_OK;
    if (m->len > cap) {
        kvs_warn("inproc recv: dropping a %zu-byte message (buffer %zu)", m->len, cap);
        st = KVS_ERR_PROTOCOL;
    } else {
        memcpy(buf, m->bytes, m->len);
        *len_p = m->len;
        if (from_p != NULL) *from_p = kvs_peer_id(0, m->from);
    }
    kvs_free(m);
    return st;
}

static kvs_status_t ep_write(void *ctx, uint32_t peer, uint64_t offset, const void *src,
                             uint64_t len, uint64_t *ticket_p)
{
    inproc_ep_t *ep = ctx;
    kvs_inproc_net_t *net = ep->net;
    inproc_ep_t *to = endpoint(net, KVS_SIDE_DECODE, peer);
    if (ep->side != KVS_SIDE_PREFILL || to == NULL || to->ring == NULL) {
        kvs_error("inproc write: decode rank %u has no exposed ring", peer);
        return KVS_ERR_NOT_FOUND;
    }
    if (offset > to->ring_size || len > to->ring_size - offset) {
        kvs_error("inproc write: [%llu, +%llu) is outside decode rank %u's %llu-byte ring",
                  (unsigned long long) offset, (unsigned long long) len, peer,
                  (unsigned long long) to->ring_size);
        return KVS_ERR_INVALID;
    }
    inproc_write_t *w = kvs_malloc(sizeof(*w));
    if (w == NULL) return KVS_ERR_NOMEM;
    memset(w, 0, sizeof(*w));
    w->ticket = ++ep->next_ticket;
    w->src = src;
    w->dst = to->ring + offset;
    w->len = len;
    w->ring_device = to->ring_device;
    /* The random draw only when the fault is on: other faults' schedules stay as they were. */
    w->fail = ++net->writes_since_faults == net->faults.write_fail_nth ||
              (net->faults.write_fail_permille != 0 &&
               kvs_rng_chance(&net->rng, net->faults.write_fail_permille, 1000));
    uint64_t due = kvs_clock_now(&net->clock) + random_delay(net, net->faults.write_delay_max_ns);
    kvs_status_t st = kvs_map_put(&ep->tickets, w->ticket, w);
    if (st == KVS_OK) {
        st = kvs_heap_push(&ep->writes, due, w);
        if (st != KVS_OK) kvs_map_remove(&ep->tickets, w->ticket);
    }
    if (st != KVS_OK) {
        kvs_free(w);
        return st;
    }
    net->stats.writes++;
    net->stats.write_bytes += len;
    net->stats.writes_in_flight++;
    land_due_writes(net);
    *ticket_p = w->ticket;
    return KVS_OK;
}

static kvs_status_t ep_write_poll(void *ctx, uint64_t ticket)
{
    inproc_ep_t *ep = ctx;
    land_due_writes(ep->net);
    inproc_write_t *w = kvs_map_get(&ep->tickets, ticket);
    if (w == NULL) {
        kvs_error("inproc write_poll: unknown ticket %llu", (unsigned long long) ticket);
        return KVS_ERR_NOT_FOUND;
    }
    if (w->landing && !w->done) {
        kvs_status_t st = kvs_mem_queue_poll(ep->queue, w->copy_ticket);
        if (st == KVS_INPROGRESS) return KVS_INPROGRESS;
        w->st = st;
        w->done = 1;
    }
    if (!w->done) return KVS_INPROGRESS;
    kvs_status_t st = w->st;
    kvs_map_remove(&ep->tickets, ticket);
    kvs_free(w);
    return st;
}

static kvs_status_t ep_map(void *ctx, uint32_t peer, uint64_t offset, uint64_t len, uint8_t **ptr_p,
                           int *host_p)
{
    inproc_ep_t *ep = ctx;
    inproc_ep_t *to = endpoint(ep->net, KVS_SIDE_DECODE, peer);
    if (ep->side != KVS_SIDE_PREFILL || to == NULL) return KVS_ERR_INVALID;
    if (to->ring == NULL) return KVS_INPROGRESS; /* not exposed yet */
    /* Host rings are written through the (delayable) write path only, so CPU runs keep their
     * adversarial landing schedule. */
    if (to->ring_device < 0) return KVS_ERR_UNSUPPORTED;
    if (offset > to->ring_size || len > to->ring_size - offset) return KVS_ERR_INVALID;
    *host_p = 0;
    *ptr_p = to->ring + offset;
    return KVS_OK;
}

static kvs_status_t ep_expose(void *ctx, void *ring, uint64_t size)
{
    inproc_ep_t *ep = ctx;
    if (ep->side != KVS_SIDE_DECODE) return KVS_ERR_INVALID;
    ep->ring = ring;
    ep->ring_size = size;
    ep->ring_device = kvs_mem_device_of(ring);
    return KVS_OK;
}

static kvs_status_t ep_flush(void *ctx)
{
    /* Writes complete (memcpy, or a device copy whose event fired) before their CHUNK_READY
     * is sent: nothing more to make visible. */
    (void) ctx;
    return KVS_OK;
}

static int ep_shares_device(void *ctx, uint32_t peer)
{
    const inproc_ep_t *ep = ctx;
    (void) peer;
    return ep->side == KVS_SIDE_PREFILL && ep->net->shared_device;
}

void kvs_inproc_net_set_shared_device(kvs_inproc_net_t *net, int shared)
{
    net->shared_device = shared != 0;
}

static void ep_destroy(void *ctx)
{
    inproc_ep_t *ep = ctx;
    kvs_inproc_net_t *net = ep->net;
    /* Pending writes are dropped: their sources are going away with the caller. */
    net->stats.writes_in_flight -= ep->writes.count;
    net->stats.in_flight -= ep->inbox.count;
    clear_endpoint(ep);
    kvs_heap_init(&ep->inbox);
    kvs_heap_init(&ep->writes);
    kvs_map_init(&ep->tickets);
    ep->linked = 0;
}

static const kvs_link_ops_t inproc_ops = {
    .name = "inproc",
    .send = ep_send,
    .recv = ep_recv,
    .write = ep_write,
    .write_poll = ep_write_poll,
    .map = ep_map,
    .expose = ep_expose,
    .flush = ep_flush,
    .peer_status = NULL, /* in one process no peer dies */
    .shares_device = ep_shares_device,
    .destroy = ep_destroy,
};

kvs_status_t kvs_inproc_link_create(kvs_inproc_net_t *net, kvs_side_t side, uint32_t rank,
                                    kvs_link_t **link_p)
{
    inproc_ep_t *ep = endpoint(net, side, rank);
    if (ep == NULL) {
        kvs_error("inproc link: no %s rank %u", side == KVS_SIDE_PREFILL ? "prefill" : "decode",
                  rank);
        return KVS_ERR_INVALID;
    }
    if (ep->linked) {
        kvs_error("inproc link: rank %u already has a link", rank);
        return KVS_ERR_STATE;
    }
    kvs_link_t *link = kvs_malloc(sizeof(*link));
    if (link == NULL) return KVS_ERR_NOMEM;
    link->ops = &inproc_ops;
    link->ctx = ep;
    ep->linked = 1;
    *link_p = link;
    return KVS_OK;
}
