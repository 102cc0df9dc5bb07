/* One rank as a process: the rank's pool, its plumbing (engine/plumbing.h: net link, bootstrap
 * through the registry, sender or receiver), and the simulation's engine driving the workload
 * for this one rank.
 * Radix caches stay off here: in separate processes each rank would insert at its own pace and
 * the ranks of one instance could disagree on a prefix hit, which a real engine avoids by
 * scheduling on one rank and broadcasting; that coordination is not built yet. */
#include "sim/rank.h"

#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "sim/engine.h"
#include "pd/plumbing.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"

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

kvs_status_t kvs_rank_check(const kvs_rank_config_t *c, const char *who)
{
    kvs_status_t st = kvs_pd_geometry_validate(&c->geo);
    if (st != KVS_OK) return st;
    /* Every rank of a deployment takes the same --device: both sides' pools on GPUs. */
    if (c->mem == KVS_MEM_DEVICE && (st = kvs_engine_check_devices(&c->geo)) != KVS_OK) return st;
    if (c->workload.requests == 0 || c->workload.prompt_len == 0 || c->concurrency == 0) {
        kvs_error("%s: requests (%u), prompt length (%u) and concurrency (%u) must be > 0", who,
                  c->workload.requests, c->workload.prompt_len, c->concurrency);
        return KVS_ERR_INVALID;
    }
    /* Without --ring-bytes the ring is four full slots: it always fits. The pool is sized from
     * the workload (and the engine checks it). */
    if (c->ring_bytes == 0) return KVS_OK;
    return kvs_engine_check_ring(who, &c->geo, c->workload.prompt_len, c->ring_bytes);
}

kvs_status_t kvs_rank_run(const kvs_rank_config_t *config, kvs_rank_result_t *result_p)
{
    kvs_rank_config_t c = *config;
    kvs_rank_result_t res;
    memset(&res, 0, sizeof(res));
    rank_t rk = {&c, &res, 0};
    const int prefill = c.side == KVS_SIDE_PREFILL;
    /* prefill: every rank of every stage (rank = stage * TP + TP rank) */
    const uint32_t ranks = prefill ? kvs_pd_geometry_prefill_ranks(&c.geo) : c.geo.decode_tp;
    const uint32_t tp = prefill ? c.geo.prefill_tp : c.geo.decode_tp;
    char who[32];
    snprintf(who, sizeof(who), "%s rank %u", prefill ? "prefill" : "decode", c.rank);
    kvs_status_t st = kvs_rank_check(&c, who);
    if (st != KVS_OK) return st;
    if (c.rank >= ranks || c.registry == NULL) {
        kvs_error("rank: rank %u of %u, registry %s: invalid", c.rank, ranks,
                  c.registry ? c.registry : "(none)");
        return KVS_ERR_INVALID;
    }
    if (!c.deadline_ns) c.deadline_ns = 600ull * 1000000000ull;
    if (!c.drain_ns) c.drain_ns = 500ull * 1000000ull;
    const uint64_t t0 = kvs_now_ns();
    const uint64_t P = kvs_pd_geometry_page(&c.geo, c.side);

    kvs_workload_t *wl = NULL;
    kvs_pool_t *pool = NULL;
    kvs_plumbing_t pl;
    memset(&pl, 0, sizeof(pl));
    kvs_prefill_engine_t *pe = NULL;
    kvs_decode_engine_t *de = NULL;

    if ((st = kvs_workload_create(&c.workload, &wl)) != KVS_OK) goto out;
    res.requests = wl->count;

    uint64_t pages_per_room = (c.workload.prompt_len + P - 1) / P;
    kvs_pool_config_t pc = {
        .shape = prefill ? kvs_pp_stage_shape(&c.geo.shape, kvs_pd_geometry_pp(&c.geo), c.rank / tp)
                         : c.geo.shape,
        .tp = {tp, c.rank % tp},
        .page_size = (uint32_t) P,
        .num_pages = (uint32_t) (pages_per_room * c.concurrency + 16),
        .layout = c.layout,
        .mem = c.mem,
        .device = c.device};
    if ((st = kvs_pool_create(&pc, &pool)) != KVS_OK) goto out;

    kvs_plumbing_config_t plc = {.side = c.side,
                                 .rank = c.rank,
                                 .geo = c.geo,
                                 .registry = c.registry,
                                 .serve_registry = c.serve_registry,
                                 .bind = c.bind,
                                 .data = c.data,
                                 .net_device = c.net_device,
                                 .mem = c.mem,
                                 .device = c.device,
                                 .liveness_timeout_ns = c.liveness_timeout_ns,
                                 .corrupt_nth = c.corrupt_nth,
                                 .timeouts = c.timeouts,
                                 .write_mode = c.write_mode,
                                 .ring_bytes = c.ring_bytes};
    if ((st = kvs_plumbing_create(&plc, pool, &pl)) != KVS_OK) goto out;
    if (prefill) {
        kvs_prefill_engine_config_t ec = {.geo = c.geo,
                                          .batch = c.concurrency,
                                          .max_prompt_len = c.workload.prompt_len,
                                          .local_ranks = 1,
                                          .first_rank = c.rank};
        if ((st = kvs_prefill_engine_create(&ec, &pool, &pl.sender, on_done, &rk, &pe)) != KVS_OK)
            goto out;
    } else {
        kvs_decode_engine_config_t ec = {
            .geo = c.geo, .max_prompt_len = c.workload.prompt_len, .local_ranks = 1};
        if ((st = kvs_decode_engine_create(&ec, &pool, &pl.receiver, on_done, &rk, &de)) != KVS_OK)
            goto out;
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
            kvs_plumbing_metrics(&pl, &m);
            kvs_net_link_stats(pl.link, &ns);
            c.metrics(c.progress_arg, &m, &ns);
        }
        if (finished) break;
        if (now - t0 >= c.deadline_ns) {
            kvs_error("%s rank %u: %u of %u rooms concluded before the deadline",
                      prefill ? "prefill" : "decode", c.rank, rk.concluded, wl->count);
            res.timed_out = 1;
            break;
        }
        uint32_t work = kvs_plumbing_progress(&pl);
        work += submit_more(&c, wl, &next, pe, de);
        work += prefill ? kvs_prefill_engine_step(pe) : kvs_decode_engine_step(de);
        if (work == 0 && kvs_plumbing_copies_in_flight(&pl) > 0)
            sched_yield(); /* a write or scatter runs: its completion wakes no wait */
        else if (work == 0)
            kvs_plumbing_wait(&pl, -1, 50); /* woken by the next message */
    }
    /* Keep answering peers a little longer: late ACKs, repeats, the other side's last rooms. */
    for (uint64_t end = kvs_now_ns() + c.drain_ns; kvs_now_ns() < end;) {
        if (kvs_plumbing_progress(&pl) == 0) sleep_us(200);
    }
    kvs_plumbing_metrics(&pl, &res.metrics);
    if (!prefill) res.leaked_slots = res.metrics.live_slots + (res.metrics.ring_used != 0);
    res.leaked_rooms = res.metrics.live_rooms;
    res.leaked_pages = kvs_pool_total_pages(pool) - kvs_pool_free_pages(pool);
    kvs_net_link_stats(pl.link, &res.net);
    st = KVS_OK;
out:
    kvs_prefill_engine_destroy(pe);
    kvs_decode_engine_destroy(de);
    kvs_plumbing_destroy(&pl);
    kvs_pool_destroy(pool);
    kvs_workload_destroy(wl);
    res.wall_s = (double) (kvs_now_ns() - t0) / 1e9;
    *result_p = res;
    return st;
}
