/* One rank's net link, bootstrap and sender or receiver (pd/plumbing.h). */
#include "pd/plumbing.h"

#include <string.h>

#include "kvstage/clock.h"
#include "kvstage/grid.h"
#include "kvstage/log.h"
#include "transport/link.h"

#define MS 1000000ull

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

    kvs_net_config_t nc = {.side = c->side,
                           .rank = c->rank,
                           .peer_tp =
                               prefill ? c->geo.decode_tp : kvs_pd_geometry_prefill_ranks(&c->geo),
                           .bind = c->bind ? c->bind : "tcp://127.0.0.1:*",
                           .data = c->data,
                           .net_device = c->net_device,
                           .registry = prefill ? NULL : c->registry,
                           .mem = c->mem,
                           .device = c->device,
                           .liveness_timeout_ns = c->liveness_timeout_ns,
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

void kvs_plumbing_destroy(kvs_plumbing_t *p)
{
    kvs_sender_destroy(p->sender);
    kvs_receiver_destroy(p->receiver);
    kvs_link_destroy(p->link);
    kvs_registry_destroy(p->registry);
    memset(p, 0, sizeof(*p));
}

uint32_t kvs_plumbing_progress(kvs_plumbing_t *p)
{
    uint32_t work = p->registry ? kvs_registry_serve(p->registry, 0) : 0;
    if (p->sender) work += kvs_sender_progress(p->sender);
    if (p->receiver) work += kvs_receiver_progress(p->receiver);
    return work;
}

uint32_t kvs_plumbing_peers_down(const kvs_plumbing_t *p, uint32_t *first_p)
{
    uint32_t down = 0;
    if (p->link == NULL || p->link->ops->peer_status == NULL) return 0;
    for (uint32_t i = 0; i < p->peers; i++) {
        if (p->link->ops->peer_status(p->link->ctx, i) == KVS_OK) continue;
        if (down++ == 0 && first_p) *first_p = i;
    }
    return down;
}

void kvs_plumbing_metrics(const kvs_plumbing_t *p, kvs_pd_metrics_t *metrics_p)
{
    if (p->sender) {
        kvs_sender_metrics(p->sender, metrics_p);
    } else if (p->receiver) {
        kvs_receiver_metrics(p->receiver, metrics_p);
    } else {
        memset(metrics_p, 0, sizeof(*metrics_p));
    }
}
