/* One rank as a process: bootstrap through the registry, a net link, the rank's pool and
 * sender or receiver, and the simulation's engine driving the workload for this one rank.
 * Radix caches stay off here: in separate processes each rank would insert at its own pace and
 * the ranks of one instance could disagree on a prefix hit, which a real engine avoids by
 * scheduling on one rank and broadcasting; that coordination is not built yet. */
#include "kvstage/rank.h"

#include <string.h>
#include <time.h>

#include "engine/engine.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/grid.h"
#include "kvstage/log.h"
#include "kvstage/registry.h"

typedef struct {
    const kvs_rank_config_t *cfg;
    kvs_rank_result_t *res;
    uint32_t concluded;
} rank_t;

static void on_done(void *arg, const kvs_request_t *req, const kvs_engine_outcome_t *o)
{
    rank_t *rk = arg;
    kvs_rank_result_t *res = rk->res;
    rk->concluded++;
    if (o->status == KVS_ROOM_SUCCESS) {
        res->succeeded++;
        res->mismatched_bytes += o->mismatched_bytes;
        if (rk->cfg->side == KVS_SIDE_DECODE && !o->meta_ok) res->meta_mismatches++;
        return;
    }
    res->failed++;
    uint32_t idx = o->reason < 0 && -o->reason < 16 ? (uint32_t) -o->reason : 0;
    res->fail_reasons[idx]++;
    kvs_warn("%s rank %u: room %llx (%u tokens) failed: %s",
             rk->cfg->side == KVS_SIDE_PREFILL ? "prefill" : "decode", rk->cfg->rank,
             (unsigned long long) req->room, req->len, kvs_status_str(o->reason));
}

static void default_timeouts(kvs_pd_timeouts_t *t)
{
    const uint64_t ms = 1000000ull;
    kvs_pd_timeouts_t d = {.retry_ns = 20 * ms,
                           .bootstrap_timeout_ns = 30000 * ms,
                           .transfer_timeout_ns = 20000 * ms,
                           .waiting_timeout_ns = 60000 * ms,
                           .completion_timeout_ns = 10000 * ms,
                           .release_timeout_ns = 10000 * ms};
    kvs_pd_timeouts_fill(t, &d);
}

/* Decode: learns every prefill rank's endpoint from the registry, refusing incompatible ones. */
static kvs_status_t bootstrap_decode(const kvs_rank_config_t *c, kvs_link_t *link,
                                     uint64_t timeout_ns)
{
    for (uint32_t p = 0; p < c->geo.prefill_tp; p++) {
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

static void sleep_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

/* Rooms in flight never exceed the concurrency; both instances submit in workload order, so
 * they work on the same rooms at the same time. */
static uint32_t submit_more(const kvs_rank_config_t *c, const kvs_workload_t *wl, uint32_t *next,
                            kvs_prefill_engine_t *pe, kvs_decode_engine_t *de)
{
    static const kvs_engine_fault_t no_fault = {KVS_ENGINE_FAULT_NONE, 0};
    uint32_t live = pe ? kvs_prefill_engine_live_rooms(pe) : kvs_decode_engine_live_rooms(de);
    uint32_t n = 0;
    while (*next < wl->count && live < c->concurrency) {
        const kvs_request_t *req = &wl->requests[(*next)++];
        kvs_status_t st = pe ? kvs_prefill_engine_submit(pe, req, &no_fault)
                             : kvs_decode_engine_submit(de, req, &no_fault);
        if (st != KVS_OK)
            kvs_error("room %llx could not be submitted", (unsigned long long) req->room);
        live++;
        n++;
    }
    return n;
}

kvs_status_t kvs_rank_run(const kvs_rank_config_t *config, kvs_rank_result_t *result_p)
{
    kvs_rank_config_t c = *config;
    kvs_rank_result_t res;
    memset(&res, 0, sizeof(res));
    rank_t rk = {&c, &res, 0};
    const int prefill = c.side == KVS_SIDE_PREFILL;
    const uint32_t tp = prefill ? c.geo.prefill_tp : c.geo.decode_tp;
    kvs_status_t st = kvs_pd_geometry_validate(&c.geo);
    if (st != KVS_OK) return st;
    if (c.rank >= tp || c.registry == NULL || c.concurrency == 0) {
        kvs_error("rank: rank %u of TP %u, registry %s, concurrency %u: invalid", c.rank, tp,
                  c.registry ? c.registry : "(none)", c.concurrency);
        return KVS_ERR_INVALID;
    }
    default_timeouts(&c.timeouts);
    if (!c.deadline_ns) c.deadline_ns = 600ull * 1000000000ull;
    if (!c.drain_ns) c.drain_ns = 500ull * 1000000ull;
    const uint64_t t0 = kvs_now_ns();
    const uint64_t P = c.geo.page_size;
    const kvs_clock_t clock = kvs_clock_monotonic();

    kvs_registry_t *registry = NULL;
    kvs_workload_t *wl = NULL;
    kvs_pool_t *pool = NULL;
    kvs_link_t *link = NULL;
    kvs_sender_t *tx = NULL;
    kvs_receiver_t *rx = NULL;
    kvs_prefill_engine_t *pe = NULL;
    kvs_decode_engine_t *de = NULL;

    if (c.serve_registry && (st = kvs_registry_create(c.registry, &registry)) != KVS_OK) goto out;
    if ((st = kvs_workload_create(&c.workload, &wl)) != KVS_OK) goto out;
    res.requests = wl->count;

    uint64_t pages_per_room = (c.workload.prompt_len + P - 1) / P;
    kvs_pool_config_t pc = {.shape = c.geo.shape,
                            .tp = {tp, c.rank},
                            .page_size = c.geo.page_size,
                            .num_pages = (uint32_t) (pages_per_room * c.concurrency + 16),
                            .layout = c.layout,
                            .mem = c.mem,
                            .device = c.device};
    if ((st = kvs_pool_create(&pc, &pool)) != KVS_OK) goto out;

    kvs_net_config_t nc = {.side = c.side,
                           .rank = c.rank,
                           .peer_tp = prefill ? c.geo.decode_tp : c.geo.prefill_tp,
                           .bind = c.bind ? c.bind : "tcp://127.0.0.1:*",
                           .data = c.data,
                           .net_device = c.net_device,
                           .registry = prefill ? NULL : c.registry,
                           .mem = c.mem,
                           .device = c.device,
                           .liveness_timeout_ns = c.liveness_timeout_ns};
    if ((st = kvs_net_link_create(&nc, &link)) != KVS_OK) goto out;
    const uint64_t boot_ns = c.timeouts.bootstrap_timeout_ns;
    if (prefill) {
        kvs_msg_register_t reg;
        kvs_registry_describe(&c.geo, c.rank, kvs_net_link_endpoint(link), &reg);
        st = registry ? kvs_registry_add(registry, &reg)
                      : kvs_registry_register(c.registry, &reg, boot_ns);
        if (st != KVS_OK) goto out;
        kvs_sender_config_t sc = {.geo = c.geo,
                                  .rank = c.rank,
                                  .timeouts = c.timeouts,
                                  .window_chunks = 4,
                                  .staging_buffers = 4,
                                  .write_mode = c.write_mode};
        if ((st = kvs_sender_create(&sc, pool, link, &clock, &tx)) != KVS_OK) goto out;
        kvs_prefill_engine_config_t ec = {.geo = c.geo,
                                          .batch = c.concurrency,
                                          .max_prompt_len = c.workload.prompt_len,
                                          .local_ranks = 1};
        if ((st = kvs_prefill_engine_create(&ec, &pool, &tx, on_done, &rk, &pe)) != KVS_OK)
            goto out;
    } else {
        if ((st = bootstrap_decode(&c, link, boot_ns)) != KVS_OK) goto out;
        uint64_t ring = c.ring_bytes;
        if (ring == 0) {
            kvs_writer_t w[KVS_MAX_WRITERS];
            uint32_t n = 0;
            kvs_plan_writers(&c.geo.shape, c.geo.prefill_tp, c.geo.decode_tp, c.rank, 0, w, &n);
            ring = 4 * kvs_slot_layout(w, n, kvs_grid_tokens(c.geo.chunk_tokens, P), NULL);
        }
        kvs_receiver_config_t rc = {
            .geo = c.geo, .rank = c.rank, .timeouts = c.timeouts, .ring_bytes = ring};
        if ((st = kvs_receiver_create(&rc, pool, link, &clock, &rx)) != KVS_OK) goto out;
        kvs_decode_engine_config_t ec = {
            .geo = c.geo, .max_prompt_len = c.workload.prompt_len, .local_ranks = 1};
        if ((st = kvs_decode_engine_create(&ec, &pool, &rx, on_done, &rk, &de)) != KVS_OK) goto out;
    }

    uint32_t next = 0;
    uint64_t last_report = 0;
    for (;;) {
        uint64_t now = kvs_now_ns();
        int finished = rk.concluded == wl->count;
        if (c.progress && (finished || now - last_report >= 100000000ull)) {
            c.progress(c.progress_arg, rk.concluded, wl->count);
            last_report = now;
        }
        if (c.metrics_request && *c.metrics_request && c.metrics) {
            *c.metrics_request = 0;
            kvs_pd_metrics_t m;
            kvs_net_stats_t ns;
            if (prefill)
                kvs_sender_metrics(tx, &m);
            else
                kvs_receiver_metrics(rx, &m);
            kvs_net_link_stats(link, &ns);
            c.metrics(c.progress_arg, &m, &ns);
        }
        if (finished) break;
        if (now - t0 >= c.deadline_ns) {
            kvs_error("%s rank %u: %u of %u rooms concluded before the deadline",
                      prefill ? "prefill" : "decode", c.rank, rk.concluded, wl->count);
            res.timed_out = 1;
            break;
        }
        uint32_t work = registry ? kvs_registry_serve(registry, 0) : 0;
        work += prefill ? kvs_sender_progress(tx) : kvs_receiver_progress(rx);
        work += submit_more(&c, wl, &next, pe, de);
        work += prefill ? kvs_prefill_engine_step(pe) : kvs_decode_engine_step(de);
        if (work == 0) sleep_us(50);
    }
    /* Keep answering peers a little longer: late ACKs, repeats, the other side's last rooms. */
    for (uint64_t end = kvs_now_ns() + c.drain_ns; kvs_now_ns() < end;) {
        uint32_t work = registry ? kvs_registry_serve(registry, 0) : 0;
        work += prefill ? kvs_sender_progress(tx) : kvs_receiver_progress(rx);
        if (work == 0) sleep_us(200);
    }
    if (prefill) {
        kvs_sender_metrics(tx, &res.metrics);
    } else {
        kvs_receiver_metrics(rx, &res.metrics);
        res.leaked_slots = res.metrics.live_slots + (res.metrics.ring_used != 0);
    }
    res.leaked_rooms = res.metrics.live_rooms;
    res.leaked_pages = kvs_pool_total_pages(pool) - kvs_pool_free_pages(pool);
    kvs_net_link_stats(link, &res.net);
    st = KVS_OK;
out:
    kvs_prefill_engine_destroy(pe);
    kvs_decode_engine_destroy(de);
    kvs_sender_destroy(tx);
    kvs_receiver_destroy(rx);
    kvs_link_destroy(link);
    kvs_pool_destroy(pool);
    kvs_workload_destroy(wl);
    kvs_registry_destroy(registry);
    res.wall_s = (double) (kvs_now_ns() - t0) / 1e9;
    *result_p = res;
    return st;
}
