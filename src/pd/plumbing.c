/* One rank's net link, bootstrap and sender or receiver (pd/plumbing.h). */
#include "pd/plumbing.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/grid.h"
#include "kvstage/log.h"
#include "transport/link.h"

#define MS           1000000ull
#define DEFAULT_IDLE (300000 * MS)

/* One prefill instance of a per-room decode rank. */
struct kvs_plumbing_peer {
    char registry[KVS_MSG_ENDPOINT_MAX + 1]; /* the key */
    kvs_pd_geometry_t geo;                   /* this rank's geometry towards the instance */
    kvs_link_t *link;
    kvs_receiver_t *receiver;
    uint64_t used_ns; /* when a room last named it */
};

static void fill_timeouts(kvs_pd_timeouts_t *t)
{
    kvs_pd_timeouts_t d = {.retry_ns = 20 * MS,
                           .bootstrap_timeout_ns = 30000 * MS,
                           .transfer_timeout_ns = 20000 * MS,
                           .waiting_timeout_ns = 60000 * MS,
                           .completion_timeout_ns = 10000 * MS,
                           .release_timeout_ns = 10000 * MS};
    kvs_pd_timeouts_fill(t, &d);
}

/* Decode: every prefill rank's endpoint from the registry, refusing incompatible ones. */
static kvs_status_t bootstrap_decode(const kvs_plumbing_config_t *c, kvs_link_t *link,
                                     uint64_t timeout_ns)
{
    for (uint32_t p = 0; p < kvs_pd_geometry_prefill_ranks(&c->geo); p++) {
        kvs_msg_register_t reg;
        kvs_status_t st = kvs_registry_query(c->registry, p, timeout_ns, &reg);
        if (st != KVS_OK) {
            kvs_error("decode rank %u: prefill rank %u did not register at %s", c->rank, p,
                      c->registry);
            return st;
        }
        if (reg.tp_size != c->geo.prefill_tp) {
            kvs_error("decode rank %u: the prefill instance runs TP %u, this deployment expects "
                      "TP %u",
                      c->rank, reg.tp_size, c->geo.prefill_tp);
            return KVS_ERR_INCOMPATIBLE;
        }
        char why[256];
        if ((st = kvs_registry_check(&reg, &c->geo, why, sizeof(why))) != KVS_OK) return st;
        if ((st = kvs_net_link_set_peer(link, p, reg.endpoint)) != KVS_OK) return st;
    }
    return KVS_OK;
}

static kvs_status_t serve_until_registered(const kvs_plumbing_config_t *c, kvs_registry_t *registry,
                                           kvs_link_t *link, uint64_t timeout_ns)
{
    const uint32_t ranks = kvs_pd_geometry_prefill_ranks(&c->geo);
    uint64_t end = kvs_now_ns() + timeout_ns;
    while (kvs_registry_count(registry) < ranks) {
        if (kvs_now_ns() >= end) {
            kvs_error("prefill rank %u: %u of %u prefill ranks registered in time", c->rank,
                      kvs_registry_count(registry), ranks);
            return KVS_ERR_TIMEOUT;
        }
        kvs_registry_serve(registry, 5);
        kvs_net_link_progress(link);
    }
    return KVS_OK;
}

/* Prefill: this rank's endpoint into the registry, served here or remote. */
static kvs_status_t bootstrap_prefill(const kvs_plumbing_config_t *c, kvs_plumbing_t *p,
                                      uint64_t timeout_ns)
{
    kvs_msg_register_t reg;
    kvs_registry_describe(&c->geo, c->rank, kvs_net_link_endpoint(p->link), &reg);
    if (p->registry == NULL) return kvs_registry_register(c->registry, &reg, timeout_ns);
    kvs_status_t st = kvs_registry_add(p->registry, &reg);
    if (st != KVS_OK || !c->await_registrations) return st;
    return serve_until_registered(c, p->registry, p->link, timeout_ns);
}

/* Four full slots of this rank's writers. */
static uint64_t default_ring_bytes(const kvs_pd_geometry_t *geo, uint32_t rank)
{
    kvs_writer_t w[KVS_MAX_WRITERS];
    uint32_t n = 0;
    kvs_plan_geo_writers(geo, rank, 0, w, &n);
    return 4 * kvs_slot_layout(w, n, kvs_grid_tokens(geo->chunk_tokens, geo->page_size), NULL);
}

kvs_status_t kvs_plumbing_create(const kvs_plumbing_config_t *config, kvs_pool_t *pool,
                                 kvs_plumbing_t *plumbing_p)
{
    const kvs_plumbing_config_t *c = config;
    const int prefill = c->side == KVS_SIDE_PREFILL;
    const kvs_clock_t clock = kvs_clock_monotonic();
    kvs_pd_timeouts_t timeouts = c->timeouts;
    fill_timeouts(&timeouts);
    kvs_plumbing_t p;
    memset(&p, 0, sizeof(p));
    kvs_status_t st;

    if (!prefill && c->registry == NULL) {
        /* Per-room bootstrap: instances are wired by the rooms that name them. */
        p.cfg = *c;
        p.pool = pool;
        if (p.cfg.max_instances == 0) p.cfg.max_instances = KVS_PLUMBING_MAX_INSTANCES;
        if (p.cfg.idle_ns == 0) p.cfg.idle_ns = DEFAULT_IDLE;
        p.cfg.timeouts = timeouts;
        if (c->bind != NULL && strchr(c->bind, '*') == NULL) {
            kvs_error("decode rank %u: per-room bootstrap binds one endpoint per prefill "
                      "instance, so its bind must pick a free port (tcp://HOST:*), not %s",
                      c->rank, c->bind);
            return KVS_ERR_INVALID;
        }
        p.insts = kvs_calloc(p.cfg.max_instances, sizeof(*p.insts));
        if (p.insts == NULL) return KVS_ERR_NOMEM;
        *plumbing_p = p;
        return KVS_OK;
    }
    kvs_net_config_t nc = {
        .side = c->side,
        .rank = c->rank,
        .peer_tp = prefill ? c->geo.decode_tp : kvs_pd_geometry_prefill_ranks(&c->geo),
        .bind = c->bind ? c->bind : "tcp://127.0.0.1:*",
        .data = c->data,
        .net_device = c->net_device,
        .registry = prefill ? NULL : c->registry,
        .mem = c->mem,
        .device = c->device,
        .liveness_timeout_ns = c->liveness_timeout_ns,
        .max_instances =
            prefill ? (c->max_instances ? c->max_instances : KVS_PLUMBING_MAX_INSTANCES) : 0,
        .instance = c->instance,
        .corrupt_nth = prefill ? c->corrupt_nth : 0};
    if ((st = kvs_net_link_create(&nc, &p.link)) != KVS_OK) goto fail;
    p.peers = nc.peer_tp;
    if (c->serve_registry && (st = kvs_registry_create(c->registry, &p.registry)) != KVS_OK)
        goto fail;
    const uint64_t boot_ns = timeouts.bootstrap_timeout_ns;
    if (prefill) {
        if ((st = bootstrap_prefill(c, &p, boot_ns)) != KVS_OK) goto fail;
        kvs_sender_config_t sc = {.geo = c->geo,
                                  .rank = c->rank,
                                  .timeouts = timeouts,
                                  .window_chunks = 4,
                                  .staging_buffers = 4,
                                  .write_mode = c->write_mode};
        if ((st = kvs_sender_create(&sc, pool, p.link, &clock, &p.sender)) != KVS_OK) goto fail;
    } else {
        if ((st = bootstrap_decode(c, p.link, boot_ns)) != KVS_OK) goto fail;
        kvs_receiver_config_t rc = {
            .geo = c->geo,
            .rank = c->rank,
            .timeouts = timeouts,
            .ring_bytes = c->ring_bytes ? c->ring_bytes : default_ring_bytes(&c->geo, c->rank)};
        if ((st = kvs_receiver_create(&rc, pool, p.link, &clock, &p.receiver)) != KVS_OK) goto fail;
    }
    *plumbing_p = p;
    return KVS_OK;
fail:
    kvs_plumbing_destroy(&p);
    return st;
}

static void inst_close(kvs_plumbing_t *p, uint32_t i)
{
    kvs_plumbing_peer_t *x = &p->insts[i];
    kvs_info("decode rank %u: closing the prefill instance of %s", p->cfg.rank, x->registry);
    kvs_receiver_destroy(x->receiver);
    kvs_link_destroy(x->link);
    p->peers -= kvs_pd_geometry_prefill_ranks(&x->geo);
    p->insts[i] = p->insts[--p->ninsts];
    memset(&p->insts[p->ninsts], 0, sizeof(p->insts[p->ninsts]));
}

void kvs_plumbing_destroy(kvs_plumbing_t *p)
{
    while (p->ninsts > 0) inst_close(p, p->ninsts - 1);
    kvs_free(p->insts);
    kvs_sender_destroy(p->sender);
    kvs_receiver_destroy(p->receiver);
    kvs_link_destroy(p->link);
    kvs_registry_destroy(p->registry);
    memset(p, 0, sizeof(*p));
}

/* Down ranks of one link, the first in *first_p when there is one. */
static uint32_t link_down(kvs_link_t *link, uint32_t ranks, uint32_t *first_p)
{
    uint32_t down = 0;
    if (link == NULL || link->ops->peer_status == NULL) return 0;
    for (uint32_t i = 0; i < ranks; i++) {
        if (link->ops->peer_status(link->ctx, i) == KVS_OK) continue;
        if (down++ == 0 && first_p) *first_p = i;
    }
    return down;
}

static uint64_t live_rooms(const kvs_receiver_t *rx)
{
    kvs_pd_metrics_t m;
    kvs_receiver_metrics(rx, &m);
    return m.live_rooms;
}

/* An instance without a live room goes once idle past the limit or wholly past the liveness
 * timeout (it failed its rooms; the next room naming it wires it again). */
static void close_idle(kvs_plumbing_t *p)
{
    const uint64_t now = kvs_now_ns();
    for (uint32_t i = 0; i < p->ninsts;) {
        kvs_plumbing_peer_t *x = &p->insts[i];
        const uint32_t ranks = kvs_pd_geometry_prefill_ranks(&x->geo);
        if (live_rooms(x->receiver) == 0 &&
            (now - x->used_ns >= p->cfg.idle_ns || link_down(x->link, ranks, NULL) == ranks)) {
            inst_close(p, i);
            continue;
        }
        i++;
    }
}

uint32_t kvs_plumbing_progress(kvs_plumbing_t *p)
{
    uint32_t work = p->registry ? kvs_registry_serve(p->registry, 0) : 0;
    if (p->sender) work += kvs_sender_progress(p->sender);
    if (p->receiver) work += kvs_receiver_progress(p->receiver);
    for (uint32_t i = 0; i < p->ninsts; i++) work += kvs_receiver_progress(p->insts[i].receiver);
    if (p->insts != NULL) close_idle(p);
    return work;
}

int kvs_plumbing_wait(const kvs_plumbing_t *p, int fd, uint64_t timeout_us)
{
    kvs_link_t *links[1 + KVS_NET_MAX_INSTANCES];
    uint32_t n = 0;
    links[n++] = p->link;
    for (uint32_t i = 0; i < p->ninsts && n < sizeof(links) / sizeof(links[0]); i++)
        links[n++] = p->insts[i].link;
    return kvs_net_link_wait(links, n, fd, timeout_us);
}

uint32_t kvs_plumbing_copies_in_flight(const kvs_plumbing_t *p)
{
    uint32_t n = 0;
    if (p->sender) n += kvs_sender_copies_in_flight(p->sender);
    if (p->receiver) n += kvs_receiver_copies_in_flight(p->receiver);
    for (uint32_t i = 0; i < p->ninsts; i++)
        n += kvs_receiver_copies_in_flight(p->insts[i].receiver);
    return n;
}

uint32_t kvs_plumbing_peers_down(const kvs_plumbing_t *p, uint32_t *first_p)
{
    /* Per-room bootstrap: a dead prefill instance fails only the rooms that name it (and is
     * dropped at its liveness timeout); the rank can still wire any other one, so it is not
     * down. Counting its dead instances made a decode server unhealthy exactly when the router
     * needed it for a newly added prefill server, and flapped while a new instance wired up. */
    if (p->insts != NULL) return 0;
    return link_down(p->link, p->peers, first_p);
}

void kvs_plumbing_metrics(const kvs_plumbing_t *p, kvs_pd_metrics_t *metrics_p)
{
    memset(metrics_p, 0, sizeof(*metrics_p));
    if (p->sender) kvs_sender_metrics(p->sender, metrics_p);
    if (p->receiver) kvs_receiver_metrics(p->receiver, metrics_p);
    for (uint32_t i = 0; i < p->ninsts; i++) {
        kvs_pd_metrics_t m;
        kvs_receiver_metrics(p->insts[i].receiver, &m);
        kvs_pd_metrics_add(metrics_p, &m);
    }
    metrics_p->peer_instances = p->ninsts;
}

/* ---- per-room bootstrap ---- */

/* 1 if an endpoint can travel in a peer description (no separator, no space). */
static int desc_safe(const char *ep)
{
    if (ep[0] == '\0' || strlen(ep) > KVS_MSG_ENDPOINT_MAX) return 0;
    for (const char *c = ep; *c; c++)
        if (*c == ',' || *c <= ' ' || *c > '~') return 0;
    return 1;
}

static void adopt(const kvs_pd_geometry_t *mine, const kvs_msg_register_t *reg,
                  kvs_pd_geometry_t *geo_p)
{
    *geo_p = *mine;
    geo_p->prefill_tp = reg->tp_size;
    geo_p->prefill_pp = reg->pp_size > 1 ? reg->pp_size : 0;
    geo_p->prefill_page_size = reg->page_size == mine->page_size ? 0 : reg->page_size;
}

kvs_status_t kvs_plumbing_peer_lookup(const kvs_pd_geometry_t *mine, const char *registry,
                                      uint64_t timeout_ns, char *desc, size_t cap, char *why,
                                      size_t why_cap)
{
    if (!desc_safe(registry)) {
        snprintf(why, why_cap, "'%.64s' is not a registry endpoint", registry);
        return KVS_ERR_INVALID;
    }
    const uint64_t end = kvs_now_ns() + timeout_ns;
    kvs_msg_register_t reg;
    kvs_status_t st = kvs_registry_query(registry, 0, timeout_ns, &reg);
    if (st != KVS_OK) {
        snprintf(why, why_cap, "no prefill instance answered at %s", registry);
        return st;
    }
    kvs_pd_geometry_t geo;
    adopt(mine, &reg, &geo);
    if (kvs_pd_geometry_validate(&geo) != KVS_OK) {
        snprintf(why, why_cap,
                 "the prefill instance at %s (TP %u, %u stages) cannot feed "
                 "decode TP %u",
                 registry, reg.tp_size, reg.pp_size, mine->decode_tp);
        return KVS_ERR_INCOMPATIBLE;
    }
    const uint32_t ranks = kvs_pd_geometry_prefill_ranks(&geo);
    int n = snprintf(desc, cap, "%s,%u,%u", registry, reg.tp_size, reg.pp_size);
    for (uint32_t r = 0; r < ranks; r++) {
        uint64_t now = kvs_now_ns();
        if (r > 0 &&
            (now >= end || (st = kvs_registry_query(registry, r, end - now, &reg)) != KVS_OK)) {
            snprintf(why, why_cap, "prefill rank %u did not register at %s", r, registry);
            return st != KVS_OK ? st : KVS_ERR_TIMEOUT;
        }
        if (reg.tp_size != geo.prefill_tp || reg.pp_size != (geo.prefill_pp ? geo.prefill_pp : 1)) {
            snprintf(why, why_cap, "the ranks at %s disagree on their TP size", registry);
            return KVS_ERR_INCOMPATIBLE;
        }
        if ((st = kvs_registry_check(&reg, &geo, why, why_cap)) != KVS_OK) return st;
        if (!desc_safe(reg.endpoint)) {
            snprintf(why, why_cap, "prefill rank %u's endpoint cannot be carried", r);
            return KVS_ERR_INVALID;
        }
        if (n >= 0 && (size_t) n < cap)
            n += snprintf(desc + n, cap - (size_t) n, ",%s", reg.endpoint);
    }
    if (n < 0 || (size_t) n >= cap) {
        snprintf(why, why_cap, "the peer description of %s does not fit", registry);
        return KVS_ERR_NOSPACE;
    }
    if (why_cap) why[0] = '\0';
    return KVS_OK;
}

typedef struct {
    char registry[KVS_MSG_ENDPOINT_MAX + 1];
    uint32_t tp, pp, ranks;
    char eps[KVS_MAX_TP][KVS_MSG_ENDPOINT_MAX + 1];
} peer_desc_t;

/* Splits "REGISTRY,TP,PP,EP_0,...": 0 when malformed. */
static int desc_parse(const char *s, peer_desc_t *d)
{
    char *fields[3 + KVS_MAX_TP];
    char buf[KVS_PLUMBING_PEER_MAX + 1];
    if (strlen(s) > KVS_PLUMBING_PEER_MAX) return 0;
    memcpy(buf, s, strlen(s) + 1);
    uint32_t n = 0;
    for (char *at = buf; n < 3 + KVS_MAX_TP;) {
        fields[n++] = at;
        char *comma = strchr(at, ',');
        if (comma == NULL) break;
        *comma = '\0';
        at = comma + 1;
    }
    if (n < 4) return 0;
    char *e1, *e2;
    unsigned long tp = strtoul(fields[1], &e1, 10), pp = strtoul(fields[2], &e2, 10);
    if (*e1 || *e2 || tp == 0 || pp == 0 || tp * pp > KVS_MAX_TP || n != 3 + tp * pp) return 0;
    for (uint32_t i = 0; i < n; i++)
        if ((i == 0 || i >= 3) && !desc_safe(fields[i])) return 0;
    snprintf(d->registry, sizeof(d->registry), "%s", fields[0]);
    d->tp = (uint32_t) tp;
    d->pp = (uint32_t) pp;
    d->ranks = (uint32_t) (tp * pp);
    for (uint32_t r = 0; r < d->ranks; r++)
        snprintf(d->eps[r], sizeof(d->eps[r]), "%s", fields[3 + r]);
    return 1;
}

static kvs_status_t inst_open(kvs_plumbing_t *p, const peer_desc_t *d, kvs_plumbing_peer_t *x)
{
    const kvs_plumbing_config_t *c = &p->cfg;
    kvs_msg_register_t reg = {.tp_size = d->tp, .pp_size = d->pp, .page_size = c->geo.page_size};
    memset(x, 0, sizeof(*x));
    snprintf(x->registry, sizeof(x->registry), "%s", d->registry);
    adopt(&c->geo, &reg, &x->geo);
    kvs_status_t st = kvs_pd_geometry_validate(&x->geo);
    if (st != KVS_OK) return st;
    kvs_net_config_t nc = {.side = KVS_SIDE_DECODE,
                           .rank = c->rank,
                           .peer_tp = d->ranks,
                           .bind = c->bind ? c->bind : "tcp://127.0.0.1:*",
                           .data = c->data,
                           .net_device = c->net_device,
                           .registry = d->registry,
                           .mem = c->mem,
                           .device = c->device,
                           .liveness_timeout_ns = c->liveness_timeout_ns,
                           .instance = c->instance};
    for (uint32_t r = 0; r < d->ranks; r++) nc.peers[r] = d->eps[r];
    if ((st = kvs_net_link_create(&nc, &x->link)) != KVS_OK) return st;
    const kvs_clock_t clock = kvs_clock_monotonic();
    kvs_receiver_config_t rc = {.geo = x->geo,
                                .rank = c->rank,
                                .timeouts = c->timeouts,
                                .ring_bytes = c->ring_bytes ? c->ring_bytes
                                                            : default_ring_bytes(&x->geo, c->rank)};
    if ((st = kvs_receiver_create(&rc, p->pool, x->link, &clock, &x->receiver)) != KVS_OK) {
        kvs_link_destroy(x->link);
        x->link = NULL;
        return st;
    }
    kvs_info("decode rank %u: wired the prefill instance of %s (TP %u x %u stages)", c->rank,
             d->registry, d->tp, d->pp);
    return KVS_OK;
}

kvs_status_t kvs_plumbing_room_receiver(kvs_plumbing_t *p, const char *desc,
                                        kvs_receiver_t **receiver_p)
{
    if (p->insts == NULL || desc == NULL) {
        if (p->receiver == NULL) {
            kvs_error("plumbing: a room without its prefill instance on a per-room decode rank");
            return KVS_ERR_INVALID;
        }
        *receiver_p = p->receiver;
        return KVS_OK;
    }
    peer_desc_t d;
    if (!desc_parse(desc, &d)) {
        kvs_error("decode rank %u: a malformed prefill instance description", p->cfg.rank);
        return KVS_ERR_INVALID;
    }
    const uint64_t now = kvs_now_ns();
    for (uint32_t i = 0; i < p->ninsts; i++) {
        kvs_plumbing_peer_t *x = &p->insts[i];
        if (strcmp(x->registry, d.registry) != 0) continue;
        if (x->geo.prefill_tp == d.tp && (x->geo.prefill_pp ? x->geo.prefill_pp : 1) == d.pp) {
            x->used_ns = now;
            *receiver_p = x->receiver;
            return KVS_OK;
        }
        if (live_rooms(x->receiver) > 0) {
            kvs_error("decode rank %u: the prefill instance of %s changed its layout to TP %u x "
                      "%u stages while rooms of the old one live",
                      p->cfg.rank, d.registry, d.tp, d.pp);
            return KVS_ERR_INCOMPATIBLE;
        }
        inst_close(p, i);
        break;
    }
    if (p->ninsts == p->cfg.max_instances) {
        /* Room for a new one: the least recently used instance without a live room. */
        uint32_t lru = UINT32_MAX;
        for (uint32_t i = 0; i < p->ninsts; i++)
            if (live_rooms(p->insts[i].receiver) == 0 &&
                (lru == UINT32_MAX || p->insts[i].used_ns < p->insts[lru].used_ns))
                lru = i;
        if (lru == UINT32_MAX) {
            kvs_error("decode rank %u: %u prefill instances are wired, all with live rooms",
                      p->cfg.rank, p->ninsts);
            return KVS_ERR_NOSPACE;
        }
        inst_close(p, lru);
    }
    kvs_plumbing_peer_t *x = &p->insts[p->ninsts];
    kvs_status_t st = inst_open(p, &d, x);
    if (st != KVS_OK) {
        memset(x, 0, sizeof(*x));
        return st;
    }
    x->used_ns = now;
    p->ninsts++;
    p->peers += d.ranks;
    *receiver_p = x->receiver;
    return KVS_OK;
}
