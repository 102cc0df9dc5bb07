/* The simulation driver: a router, one prefill and one decode instance over the in-process
 * transport, all on a virtual clock and one seed, so any run (and any failure) replays exactly.
 * After the last room concludes it checks what protocol.md §7 promises: exact KV, empty rings,
 * no live rooms, every page free or cached, and no heap block left after teardown. */
#include <stdio.h>
#include <string.h>

#include "base/mem.h"
#include "sim/engine.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/grid.h"
#include "kvstage/inproc.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"
#include "sim/sim.h"

/* ---- configuration ---- */

static const char *const fault_names[] = {"reorder", "dup",     "drop",     "abort",
                                          "timeout", "corrupt", "writefail"};
#define FAULT_KINDS (sizeof(fault_names) / sizeof(fault_names[0]))

kvs_status_t kvs_sim_faults_parse(const char *list, uint32_t *faults_p)
{
    uint32_t faults = 0;
    const char *p = list;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t) (comma - p) : strlen(p);
        int found = len == 4 && strncmp(p, "none", 4) == 0;
        for (uint32_t i = 0; i < FAULT_KINDS && !found; i++) {
            if (strlen(fault_names[i]) == len && strncmp(p, fault_names[i], len) == 0) {
                faults |= 1u << i;
                found = 1;
            }
        }
        if (!found) {
            kvs_error("faults: unknown fault '%.*s' in '%s' (expected a comma list of none, "
                      "reorder, dup, drop, abort, timeout, corrupt, writefail)",
                      (int) len, p, list);
            return KVS_ERR_INVALID;
        }
        if (comma == NULL) break;
        p = comma + 1;
    }
    *faults_p = faults;
    return KVS_OK;
}

void kvs_sim_faults_str(uint32_t faults, char *buf, size_t cap)
{
    size_t used = 0;
    if (cap == 0) return;
    buf[0] = '\0';
    for (uint32_t i = 0; i < FAULT_KINDS; i++) {
        if (!(faults & (1u << i))) continue;
        int n = snprintf(buf + used, cap - used, "%s%s", used ? "," : "", fault_names[i]);
        if (n < 0 || (size_t) n >= cap - used) return;
        used += (size_t) n;
    }
    if (used == 0) snprintf(buf, cap, "none");
}

/* One side's page size (prefill_page_size 0: the decode one). */
static uint32_t sim_page(const kvs_sim_config_t *c, kvs_side_t side)
{
    return side == KVS_SIDE_PREFILL && c->prefill_page_size ? c->prefill_page_size : c->page_size;
}

void kvs_sim_config_default(kvs_sim_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->shape = (kvs_kv_shape_t){.layers = 4,
                                .kv_heads = 8,
                                .head_dim_k = 32,
                                .head_dim_v = 32,
                                .elem_bytes = 2,
                                .attn = KVS_ATTN_MHA};
    c->prefill_tp = 4;
    c->decode_tp = 2;
    c->page_size = 16;
    c->chunk_tokens = 256;
    c->prefill_layout = KVS_POOL_NHD; /* SGLang-style prefill ... */
    c->decode_layout = KVS_POOL_HND;  /* ... vLLM-style decode: only the strides differ */
    c->ring_slots = 8;
    c->window_chunks = 2;
    c->staging_buffers = 2;
    c->prefill_batch = 16;
    c->prefill_radix = 1;
    c->decode_radix = 1;
    c->workload = (kvs_workload_config_t){
        .kind = KVS_WORKLOAD_SHARED_PREFIX, .requests = 200, .prompt_len = 2000, .prefix_len = 900};
    c->concurrency = 128;
    c->misaligned_request = -1;
    c->tick_ns = 1000;
    c->step_ns = 50000;
    c->max_iterations = 20000000;
    c->max_virtual_ns = 120ull * 1000000000ull;
    c->seed = 1;
}

void kvs_sim_config_cmdline(const kvs_sim_config_t *c, char *buf, size_t cap)
{
    char faults[64];
    kvs_sim_faults_str(c->faults, faults, sizeof(faults));
    const char *lay[] = {"nhd", "hnd"};
    char ring[48];
    if (c->ring_bytes != 0)
        snprintf(ring, sizeof(ring), "--ring-bytes %llu", (unsigned long long) c->ring_bytes);
    else
        snprintf(ring, sizeof(ring), "--ring-slots %u", c->ring_slots);
    char dims[64];
    if (c->shape.attn == KVS_ATTN_MLA)
        snprintf(dims, sizeof(dims), "--mla --head-dim %u", c->shape.head_dim_k);
    else
        snprintf(dims, sizeof(dims), "--kv-heads %u --head-dim-k %u --head-dim-v %u",
                 c->shape.kv_heads, c->shape.head_dim_k, c->shape.head_dim_v);
    snprintf(buf, cap,
             "kvstage sim --prefill-tp %u --decode-tp %u %s --layers %u --dtype-bytes %u "
             "--prefill-pp %u --prefill-page-size %u --decode-page-size %u --decode-dcp %u "
             "--dcp-interleave %u --chunk %u %s "
             "--prefill-layout %s "
             "--decode-layout %s "
             "--prefill-pool-pages %u --decode-pool-pages %u --window %u --staging-buffers %u "
             "--prefill-batch %u --requests %u --concurrency %u --workload %s --prompt-len %u "
             "--prefix-len %u --groups %u --repeat-permille %u --decode-radix %s "
             "--prefill-radix %s --faults %s --fault-rooms %u --seed %llu",
             c->prefill_tp, c->decode_tp, dims, c->shape.layers, c->shape.elem_bytes,
             c->prefill_pp ? c->prefill_pp : 1, sim_page(c, KVS_SIDE_PREFILL), c->page_size,
             c->decode_dcp ? c->decode_dcp : 1, c->dcp_interleave ? c->dcp_interleave : 1,
             c->chunk_tokens, ring, lay[c->prefill_layout & 1], lay[c->decode_layout & 1],
             c->prefill_pool_pages, c->decode_pool_pages, c->window_chunks, c->staging_buffers,
             c->prefill_batch, c->workload.requests, c->concurrency,
             kvs_workload_kind_str(c->workload.kind), c->workload.prompt_len,
             c->workload.prefix_len, c->workload.groups, c->workload.repeat_permille,
             c->decode_radix ? "on" : "off", c->prefill_radix ? "on" : "off", faults,
             c->fault_rooms, (unsigned long long) c->seed);
    /* Knobs that differ from the defaults, so the line replays the same run. */
    kvs_sim_config_t d;
    kvs_sim_config_default(&d);
    const struct {
        const char *flag;
        uint64_t value, dflt;
    } extra[] = {
        {"misaligned-request", (uint64_t) c->misaligned_request, (uint64_t) d.misaligned_request},
        {"retry-us", c->timeouts.retry_ns / 1000, 0},
        {"bootstrap-timeout-us", c->timeouts.bootstrap_timeout_ns / 1000, 0},
        {"transfer-timeout-us", c->timeouts.transfer_timeout_ns / 1000, 0},
        {"waiting-timeout-us", c->timeouts.waiting_timeout_ns / 1000, 0},
        {"completion-timeout-us", c->timeouts.completion_timeout_ns / 1000, 0},
        {"release-timeout-us", c->timeouts.release_timeout_ns / 1000, 0},
        {"write-delay-us", c->write_delay_ns / 1000, 0},
        {"step-us", c->step_ns / 1000, d.step_ns / 1000},
        {"max-iterations", c->max_iterations, d.max_iterations},
    };
    for (size_t i = 0; i < sizeof(extra) / sizeof(extra[0]); i++) {
        size_t used = strlen(buf);
        if (extra[i].value != extra[i].dflt && used < cap)
            snprintf(buf + used, cap - used, " --%s %llu", extra[i].flag,
                     (unsigned long long) extra[i].value);
    }
    size_t used = strlen(buf);
    if (c->mem == KVS_MEM_DEVICE && used < cap)
        snprintf(buf + used, cap - used, " --device cuda --gpus %d,%d", c->prefill_device,
                 c->decode_device);
    static const char *const modes[] = {"auto", "staged", "direct"};
    used = strlen(buf);
    if (c->write_mode != KVS_WRITE_AUTO && (unsigned) c->write_mode <= KVS_WRITE_DIRECT &&
        used < cap)
        snprintf(buf + used, cap - used, " --write-mode %s", modes[c->write_mode]);
    used = strlen(buf);
    if (c->no_checksum && used < cap) snprintf(buf + used, cap - used, " --checksum off");
}

/* Protocol timeouts in virtual time. Healthy rooms finish within a few thousand ticks, so the
 * room-level timeouts sit orders of magnitude above that; retries are a few round trips of the
 * largest injected delay, so drops recover quickly. Decode's waiting timeout is below prefill's
 * transfer timeout so that a stalled prefill is failed by decode (protocol.md §3.8), not by itself.
 */
static kvs_pd_timeouts_t sim_timeouts(const kvs_sim_config_t *c)
{
    uint64_t t = c->tick_ns;
    kvs_pd_timeouts_t d = {
        .retry_ns = 200 * t,
        .bootstrap_timeout_ns = 2000000 * t,
        .transfer_timeout_ns = 2000000 * t,
        .waiting_timeout_ns = 1000000 * t,
        .completion_timeout_ns = 200000 * t,
        .release_timeout_ns = 100000 * t,
    };
    kvs_pd_timeouts_t out = c->timeouts; /* the caller's non-zero fields win */
    kvs_pd_timeouts_fill(&out, &d);
    return out;
}

static kvs_status_t sim_validate(const kvs_sim_config_t *c, const kvs_pd_geometry_t *geo)
{
    kvs_status_t st = kvs_pd_geometry_validate(geo);
    if (st != KVS_OK) return st;
    if (c->concurrency == 0 || c->prefill_batch == 0 || c->tick_ns == 0 || c->step_ns == 0 ||
        c->window_chunks == 0 || c->staging_buffers == 0) {
        kvs_error("sim: concurrency, prefill batch, window, staging buffers, tick and step must "
                  "be > 0");
        return KVS_ERR_INVALID;
    }
    if (c->ring_bytes == 0 && c->ring_slots == 0) {
        kvs_error("sim: the ring needs ring_bytes or ring_slots > 0");
        return KVS_ERR_INVALID;
    }
    if (c->prefill_layout > KVS_POOL_HND || c->decode_layout > KVS_POOL_HND) {
        kvs_error("sim: unknown pool layout");
        return KVS_ERR_INVALID;
    }
    if (c->mem != KVS_MEM_HOST && c->mem != KVS_MEM_DEVICE) {
        kvs_error("sim: unknown memory kind %d", (int) c->mem);
        return KVS_ERR_INVALID;
    }
    if (c->mem == KVS_MEM_DEVICE && (c->prefill_device < 0 || c->decode_device < 0)) {
        kvs_error("sim: GPU ordinals must be >= 0 (prefill %d, decode %d)", c->prefill_device,
                  c->decode_device);
        return KVS_ERR_INVALID;
    }
    if ((unsigned) c->write_mode > KVS_WRITE_DIRECT) {
        kvs_error("sim: unknown write mode %d", (int) c->write_mode);
        return KVS_ERR_INVALID;
    }
    if (c->misaligned_request >= 0 && kvs_pd_geometry_unit(geo) < 2) {
        kvs_error("sim: a misaligned decode prefix needs a page size > 1");
        return KVS_ERR_INVALID;
    }
    return c->mem == KVS_MEM_DEVICE ? kvs_engine_check_devices(geo) : KVS_OK;
}

/* ---- the run ---- */

typedef struct {
    int submitted, pf_done, dc_done;
    int fault_room; /* a fault targets it: failing is allowed */
    kvs_engine_fault_t pf_fault, dc_fault;
    kvs_engine_outcome_t pf, dc;
} sim_req_t;

typedef struct {
    const kvs_sim_config_t *cfg;
    kvs_pd_geometry_t geo;
    uint64_t now; /* virtual ns: the clock every component reads */
    kvs_clock_t clock;
    kvs_workload_t *wl;
    sim_req_t *reqs;
    kvs_inproc_net_t *net;
    kvs_link_t *pf_links[KVS_MAX_TP], *dc_links[KVS_MAX_TP];
    kvs_pool_t *pf_pools[KVS_MAX_TP], *dc_pools[KVS_MAX_TP];
    kvs_sender_t *senders[KVS_MAX_TP];
    kvs_receiver_t *receivers[KVS_MAX_TP];
    kvs_prefill_engine_t *pe;
    kvs_decode_engine_t *de;
    uint32_t next_submit, inflight;
    kvs_sim_result_t res;
} sim_t;

static uint64_t sim_now(void *arg)
{
    return ((const sim_t *) arg)->now;
}

kvs_pd_geometry_t kvs_sim_geometry(const kvs_sim_config_t *c)
{
    return (kvs_pd_geometry_t){.shape = c->shape,
                               .prefill_tp = c->prefill_tp,
                               .decode_tp = c->decode_tp,
                               .page_size = c->page_size,
                               .prefill_page_size = c->prefill_page_size,
                               .chunk_tokens = c->chunk_tokens,
                               .prefill_pp = c->prefill_pp,
                               .decode_dcp = c->decode_dcp,
                               .dcp_interleave = c->dcp_interleave,
                               .no_checksum = c->no_checksum ? 1u : 0u};
}

uint64_t kvs_sim_full_slot_bytes(const kvs_sim_config_t *c)
{
    kvs_pd_geometry_t geo = kvs_sim_geometry(c);
    uint64_t max = 0;
    /* Writer counts (hence region alignment) differ between decode ranks. No prompt is too long
     * for a full slot. */
    for (uint32_t d = 0; d < c->decode_tp; d++) {
        uint64_t bytes = kvs_engine_slot_bytes(&geo, d, UINT32_MAX);
        if (bytes == 0) return 0;
        if (bytes > max) max = bytes;
    }
    return max;
}

/* Rooms per abort/timeout fault kind. */
static uint32_t fault_rooms_per_kind(const kvs_sim_config_t *c)
{
    uint32_t n = c->fault_rooms ? c->fault_rooms : c->workload.requests / 16 + 1;
    return n < c->workload.requests ? n : c->workload.requests;
}

/* Per-rank pool size: enough for the prefill batch (plus a little) and for a quarter of the
 * requests in flight on decode; admission waits when pages are short, as in real engines. Rooms
 * that stall hold their pages until decode times them out, so they get pages of their own: the
 * fault must stay local to them, not starve admission. */
static void pool_pages(const kvs_sim_config_t *c, uint32_t *prefill_p, uint32_t *decode_p)
{
    uint32_t pf_max =
        kvs_engine_prompt_pages(c->workload.prompt_len, sim_page(c, KVS_SIDE_PREFILL)) + 1;
    const kvs_pd_geometry_t geo = kvs_sim_geometry(c);
    uint32_t dc_max =
        kvs_engine_prompt_pages(c->workload.prompt_len, kvs_pd_geometry_unit(&geo)) + 1;
    uint32_t inflight =
        c->concurrency < c->workload.requests ? c->concurrency : c->workload.requests;
    uint32_t dc_prompts = inflight / 4 > 4 ? inflight / 4 : 4;
    uint32_t stalls = c->faults & KVS_SIM_FAULT_TIMEOUT ? fault_rooms_per_kind(c) : 0;
    *prefill_p =
        c->prefill_pool_pages ? c->prefill_pool_pages : pf_max * (c->prefill_batch + 2 + stalls);
    *decode_p = c->decode_pool_pages ? c->decode_pool_pages : dc_max * (dc_prompts + stalls);
}

/* A pool or ring that cannot hold one request of the longest prompt the workload makes can
 * never succeed: it would stall admission until rooms time out, or fail every room. Refused
 * before anything runs. The automatic sizes always fit. */
static kvs_status_t sim_check_fit(const kvs_sim_config_t *c, const kvs_pd_geometry_t *geo)
{
    uint32_t pf_pages, dc_pages;
    pool_pages(c, &pf_pages, &dc_pages);
    uint32_t longest = c->workload.prompt_len;
    kvs_status_t st = kvs_engine_check_pool("sim", "prefill", "--prefill-pool-pages", pf_pages,
                                            sim_page(c, KVS_SIDE_PREFILL), longest);
    if (st == KVS_OK)
        st = kvs_engine_check_pool("sim", "decode", "--decode-pool-pages", dc_pages,
                                   kvs_pd_geometry_unit(geo), longest);
    if (st == KVS_OK && c->ring_bytes != 0)
        st = kvs_engine_check_ring("sim", geo, longest, c->ring_bytes);
    return st;
}

/* A rank's pool: a prefill rank's holds its stage's layers (rank = stage * TP + TP rank). */
static kvs_status_t make_pool(const kvs_sim_config_t *c, kvs_side_t side, uint32_t rank,
                              uint32_t pages, kvs_pool_layout_t layout, int device,
                              kvs_pool_t **pool_p)
{
    const kvs_pd_geometry_t geo = kvs_sim_geometry(c);
    const uint32_t tp = side == KVS_SIDE_PREFILL ? c->prefill_tp : c->decode_tp;
    kvs_pool_config_t pc = {
        .shape = side == KVS_SIDE_PREFILL
                     ? kvs_pp_stage_shape(&c->shape, kvs_pd_geometry_pp(&geo), rank / tp)
                     : c->shape,
        .tp = {.tp_size = tp, .tp_rank = rank % tp},
        .page_size = sim_page(c, side),
        .num_pages = pages,
        .layout = layout,
        .mem = c->mem,
        .device = device};
    return kvs_pool_create(&pc, pool_p);
}

static void on_done(sim_t *s, const kvs_request_t *req);

static void on_prefill_done(void *arg, const kvs_request_t *req, const kvs_engine_outcome_t *o)
{
    sim_t *s = arg;
    s->reqs[req->index].pf = *o;
    s->reqs[req->index].pf_done = 1;
    on_done(s, req);
}

static void on_decode_done(void *arg, const kvs_request_t *req, const kvs_engine_outcome_t *o)
{
    sim_t *s = arg;
    s->reqs[req->index].dc = *o;
    s->reqs[req->index].dc_done = 1;
    on_done(s, req);
}

/* What a per-page transfer path would issue for a succeeded room: one write per page, layer,
 * component and writer (the head slice of one writer is contiguous within a page row; a
 * stage's writer writes its layers), and the chunks each decode rank scatters; under DCP a
 * rank's pages and chunks hold its tokens only. */
static void count_writes(sim_t *s, const kvs_request_t *req, uint64_t base)
{
    const kvs_sim_config_t *c = s->cfg;
    kvs_writer_t writers[KVS_MAX_WRITERS];
    uint32_t comps = kvs_kv_shape_components(&c->shape);
    const uint64_t P = c->page_size;
    const uint64_t rank_grid = kvs_grid_tokens(c->chunk_tokens, P) / kvs_pd_geometry_dcp(&s->geo);
    for (uint32_t d = 0; d < c->decode_tp; d++) {
        uint32_t n = 0;
        if (kvs_plan_geo_writers(&s->geo, d, req->room, writers, &n) != KVS_OK) continue;
        const kvs_dcp_t dcp = kvs_pd_geometry_dcp_of(&s->geo, d);
        uint64_t pages = kvs_grid_rank_total_pages(
            req->len, base, P, kvs_pd_geometry_page(&s->geo, KVS_SIDE_PREFILL), &dcp);
        for (uint32_t i = 0; i < n; i++)
            s->res.per_page_writes += pages * writers[i].layers * comps;
        s->res.expected_chunks += kvs_grid_chunk_count(pages, rank_grid, P);
    }
}

/* A request concludes when both engines have let go of it. */
static void on_done(sim_t *s, const kvs_request_t *req)
{
    sim_req_t *q = &s->reqs[req->index];
    if (!q->pf_done || !q->dc_done) return;
    kvs_sim_result_t *res = &s->res;
    s->inflight--;
    res->decode_hit_tokens += q->dc.hit_tokens;
    res->prefill_hit_tokens += q->pf.hit_tokens;
    if (q->pf.hit_tokens > res->max_prefill_hit_tokens)
        res->max_prefill_hit_tokens = q->pf.hit_tokens;
    if (q->dc.status == KVS_ROOM_SUCCESS) {
        /* Whatever prefill says, decode accepted this KV: it must be exact. */
        res->mismatched_bytes += q->dc.mismatched_bytes;
        if (q->dc.mismatched_bytes != 0) res->exact = 0;
        if (!q->dc.meta_ok) {
            res->meta_mismatches++;
            res->exact = 0;
        }
    }
    if (q->dc.status == KVS_ROOM_SUCCESS && q->pf.status == KVS_ROOM_SUCCESS) {
        res->succeeded++;
        if (q->dc.total_pages == 0) res->full_decode_hits++;
        count_writes(s, req, q->dc.hit_tokens);
    } else {
        res->failed++;
        kvs_status_t reason = q->dc.status == KVS_ROOM_FAILED ? q->dc.reason : q->pf.reason;
        uint32_t idx = reason < 0 && -reason < 16 ? (uint32_t) -reason : 0;
        res->fail_reasons[idx]++;
        /* A room failed by its checksum under the corruption fault, or by a broken write under
         * that fault, is the fault working. */
        const int broken = (s->cfg->faults & KVS_SIM_FAULT_WRITEFAIL) &&
                           (q->dc.reason == KVS_ERR_IO || q->pf.reason == KVS_ERR_IO);
        if (q->fault_room || broken ||
            ((s->cfg->faults & KVS_SIM_FAULT_CORRUPT) && q->dc.reason == KVS_ERR_CORRUPT)) {
            res->expected_failures++;
        } else {
            res->unexpected_failures++;
            if (q->dc.status != q->pf.status) res->side_mismatches++;
            kvs_warn("sim: request %u (room %llx, %u tokens) failed: decode %s (%s), prefill %s "
                     "(%s)",
                     req->index, (unsigned long long) req->room, req->len,
                     kvs_room_status_str(q->dc.status), kvs_status_str(q->dc.reason),
                     kvs_room_status_str(q->pf.status), kvs_status_str(q->pf.reason));
        }
    }
    const kvs_sim_config_t *c = s->cfg;
    if (c->progress != NULL) {
        kvs_sim_progress_t p = {.concluded = res->succeeded + res->failed,
                                .requests = res->requests,
                                .succeeded = res->succeeded,
                                .failed = res->failed,
                                .virtual_ns = s->now};
        c->progress(c->progress_arg, &p);
    }
}

/* Picks the fault rooms: a few are aborted (by decode or by prefill, at a random moment) and a
 * few stall forever in prefill; one may get a misaligned decode base. */
static void plan_faults(sim_t *s)
{
    const kvs_sim_config_t *c = s->cfg;
    kvs_rng_t rng;
    kvs_rng_seed(&rng, kvs_mix64(c->seed ^ 0x6661756c7473ull));
    uint32_t n = s->wl->count;
    uint32_t per_kind = fault_rooms_per_kind(c);
    for (int kind = 0; kind < 2; kind++) {
        uint32_t mask = kind == 0 ? KVS_SIM_FAULT_ABORT : KVS_SIM_FAULT_TIMEOUT;
        if (!(c->faults & mask)) continue;
        for (uint32_t k = 0, tries = 0; k < per_kind && tries < 100 * per_kind; tries++) {
            uint32_t i = (uint32_t) kvs_rng_below(&rng, n);
            sim_req_t *q = &s->reqs[i];
            if (q->fault_room) continue;
            q->fault_room = 1;
            k++;
            uint32_t chunks = (s->wl->requests[i].len + c->chunk_tokens - 1) / c->chunk_tokens;
            uint32_t at = (uint32_t) kvs_rng_range(&rng, 1, chunks);
            if (kind == 1) {
                /* Stalls before a forward pass, never between the last pass and finish(). */
                q->pf_fault = (kvs_engine_fault_t){KVS_ENGINE_FAULT_STALL, at - 1};
            } else if (kvs_rng_chance(&rng, 1, 2)) {
                q->pf_fault = (kvs_engine_fault_t){KVS_ENGINE_FAULT_ABORT, at};
            } else {
                q->dc_fault = (kvs_engine_fault_t){KVS_ENGINE_FAULT_ABORT,
                                                   (uint32_t) kvs_rng_range(&rng, 1, 30)};
            }
        }
    }
    if (c->misaligned_request >= 0 && (uint64_t) c->misaligned_request < n) {
        sim_req_t *q = &s->reqs[c->misaligned_request];
        q->fault_room = 1;
        q->dc_fault = (kvs_engine_fault_t){KVS_ENGINE_FAULT_MISALIGN, 0};
    }
}

/* The router: hands requests to both instances while fewer than `concurrency` are in flight. */
static uint32_t route(sim_t *s)
{
    uint32_t routed = 0;
    while (s->inflight < s->cfg->concurrency && s->next_submit < s->wl->count) {
        const kvs_request_t *req = &s->wl->requests[s->next_submit];
        sim_req_t *q = &s->reqs[s->next_submit];
        s->next_submit++;
        s->inflight++;
        q->submitted = 1;
        kvs_engine_outcome_t failed = {.status = KVS_ROOM_FAILED, .reason = KVS_ERR_NOMEM};
        if (kvs_prefill_engine_submit(s->pe, req, &q->pf_fault) != KVS_OK) {
            q->pf = failed;
            q->pf_done = 1;
        }
        if (kvs_decode_engine_submit(s->de, req, &q->dc_fault) != KVS_OK) {
            q->dc = failed;
            q->dc_done = 1;
        }
        on_done(s, req);
        routed++;
    }
    return routed;
}

static kvs_status_t sim_setup(sim_t *s)
{
    const kvs_sim_config_t *c = s->cfg;
    kvs_status_t st;
    kvs_workload_config_t wc = c->workload;
    wc.seed = kvs_mix64(c->seed ^ 0x776f726b6c6f6164ull);
    if ((st = kvs_workload_create(&wc, &s->wl)) != KVS_OK) return st;
    s->res.requests = s->wl->count;
    s->reqs = kvs_calloc(s->wl->count, sizeof(sim_req_t));
    if (s->reqs == NULL) return KVS_ERR_NOMEM;
    plan_faults(s);

    kvs_inproc_faults_t nf = {.seed = kvs_mix64(c->seed ^ 0x6e6574ull)};
    if (c->faults & KVS_SIM_FAULT_REORDER) {
        nf.delay_max_ns = 20 * c->tick_ns;
        nf.write_delay_max_ns = 20 * c->tick_ns;
    }
    if (c->write_delay_ns) nf.write_delay_max_ns = c->write_delay_ns;
    if (c->faults & KVS_SIM_FAULT_DUP) nf.dup_permille = 50;
    if (c->faults & KVS_SIM_FAULT_DROP) nf.drop_permille = 30;
    if (c->faults & KVS_SIM_FAULT_CORRUPT) nf.corrupt_permille = 20;
    if (c->faults & KVS_SIM_FAULT_WRITEFAIL) nf.write_fail_permille = 10;
    if ((st = kvs_inproc_net_create(kvs_pd_geometry_prefill_ranks(&s->geo), c->decode_tp, &nf,
                                    &s->clock, &s->net)) != KVS_OK)
        return st;

    if (c->mem == KVS_MEM_DEVICE && c->prefill_device != c->decode_device &&
        kvs_mem_device_count() >
            (c->prefill_device > c->decode_device ? c->prefill_device : c->decode_device)) {
        /* Peer copies (and direct writes) between the two GPUs; without a peer path writes
         * still work, staged through the host by the CUDA runtime. */
        if (kvs_mem_peer_enable(c->prefill_device, c->decode_device) != KVS_OK)
            kvs_warn("sim: no peer access from GPU %d to GPU %d; writes go through the host",
                     c->prefill_device, c->decode_device);
    }
    uint32_t pf_pages, dc_pages;
    pool_pages(c, &pf_pages, &dc_pages);
    kvs_pd_timeouts_t to = sim_timeouts(c);
    for (uint32_t r = 0; r < kvs_pd_geometry_prefill_ranks(&s->geo); r++) {
        if ((st = make_pool(c, KVS_SIDE_PREFILL, r, pf_pages, c->prefill_layout, c->prefill_device,
                            &s->pf_pools[r])) != KVS_OK ||
            (st = kvs_inproc_link_create(s->net, KVS_SIDE_PREFILL, r, &s->pf_links[r])) != KVS_OK)
            return st;
        kvs_sender_config_t sc = {.geo = s->geo,
                                  .rank = r,
                                  .timeouts = to,
                                  .window_chunks = c->window_chunks,
                                  .staging_buffers = c->staging_buffers,
                                  .write_mode = c->write_mode};
        if ((st = kvs_sender_create(&sc, s->pf_pools[r], s->pf_links[r], &s->clock,
                                    &s->senders[r])) != KVS_OK)
            return st;
    }
    uint64_t ring = c->ring_bytes ? c->ring_bytes : c->ring_slots * kvs_sim_full_slot_bytes(c);
    for (uint32_t r = 0; r < c->decode_tp; r++) {
        if ((st = make_pool(c, KVS_SIDE_DECODE, r, dc_pages, c->decode_layout, c->decode_device,
                            &s->dc_pools[r])) != KVS_OK ||
            (st = kvs_inproc_link_create(s->net, KVS_SIDE_DECODE, r, &s->dc_links[r])) != KVS_OK)
            return st;
        kvs_receiver_config_t rc = {.geo = s->geo, .rank = r, .timeouts = to, .ring_bytes = ring};
        if ((st = kvs_receiver_create(&rc, s->dc_pools[r], s->dc_links[r], &s->clock,
                                      &s->receivers[r])) != KVS_OK)
            return st;
    }

    kvs_prefill_engine_config_t pc = {.geo = s->geo,
                                      .batch = c->prefill_batch,
                                      .radix = c->prefill_radix,
                                      .max_prompt_len = c->workload.prompt_len};
    if ((st = kvs_prefill_engine_create(&pc, s->pf_pools, s->senders, on_prefill_done, s,
                                        &s->pe)) != KVS_OK)
        return st;
    kvs_decode_engine_config_t dcfg = {
        .geo = s->geo, .radix = c->decode_radix, .max_prompt_len = c->workload.prompt_len};
    return kvs_decode_engine_create(&dcfg, s->dc_pools, s->receivers, on_decode_done, s, &s->de);
}

/* NULL members are skipped, so it also undoes a partial setup. Senders go before receivers:
 * a sender may still wait for a write that lands in a receiver's ring. */
static void sim_teardown(sim_t *s)
{
    const kvs_sim_config_t *c = s->cfg;
    kvs_prefill_engine_destroy(s->pe); /* radix caches hand their pages back to the pools */
    kvs_decode_engine_destroy(s->de);
    for (uint32_t r = 0; r < kvs_pd_geometry_prefill_ranks(&s->geo); r++) {
        if (s->senders[r]) kvs_sender_destroy(s->senders[r]);
        kvs_link_destroy(s->pf_links[r]);
    }
    for (uint32_t r = 0; r < c->decode_tp; r++) {
        if (s->receivers[r]) kvs_receiver_destroy(s->receivers[r]);
        kvs_link_destroy(s->dc_links[r]);
    }
    for (uint32_t r = 0; r < kvs_pd_geometry_prefill_ranks(&s->geo); r++)
        if (s->pf_pools[r]) kvs_pool_destroy(s->pf_pools[r]);
    for (uint32_t r = 0; r < c->decode_tp; r++)
        if (s->dc_pools[r]) kvs_pool_destroy(s->dc_pools[r]);
    if (s->net) kvs_inproc_net_destroy(s->net);
    kvs_free(s->reqs);
    kvs_workload_destroy(s->wl);
}

/* protocol.md §7.1 from outside: empty rings, no live rooms, every page free or cached. */
static void check_leaks(sim_t *s)
{
    const kvs_sim_config_t *c = s->cfg;
    kvs_sim_result_t *res = &s->res;
    /* Each side's counters summed over its ranks: writes and bytes are the senders', chunks
     * scattered the receivers', messages and time both sides'. */
    kvs_pd_metrics_t m, tx = {0}, rx = {0};
    for (uint32_t r = 0; r < kvs_pd_geometry_prefill_ranks(&s->geo); r++) {
        kvs_sender_metrics(s->senders[r], &m);
        kvs_pd_metrics_add(&tx, &m);
        uint64_t total = kvs_pool_total_pages(s->pf_pools[r]);
        uint64_t held =
            kvs_pool_free_pages(s->pf_pools[r]) + kvs_prefill_engine_cached_pages(s->pe);
        res->leaked_pages += total > held ? total - held : 0;
    }
    for (uint32_t r = 0; r < c->decode_tp; r++) {
        kvs_receiver_metrics(s->receivers[r], &m);
        kvs_pd_metrics_add(&rx, &m);
        res->leaked_slots += m.live_slots + (m.live_slots == 0 && m.ring_used != 0);
        /* Per decode rank, not summed. */
        if (m.ring_capacity > res->ring_capacity) res->ring_capacity = m.ring_capacity;
        if (m.ring_high_water > res->ring_high_water) res->ring_high_water = m.ring_high_water;
        uint64_t total = kvs_pool_total_pages(s->dc_pools[r]);
        uint64_t held = kvs_pool_free_pages(s->dc_pools[r]) + kvs_decode_engine_cached_pages(s->de);
        res->leaked_pages += total > held ? total - held : 0;
    }
    kvs_pd_metrics_t both = tx;
    kvs_pd_metrics_add(&both, &rx);
    res->leaked_rooms += both.live_rooms;
    res->bulk_writes += tx.bulk_writes;
    res->direct_writes += tx.direct_writes;
    res->bytes_moved += tx.bytes;
    res->chunks += rx.chunks;
    res->control_messages += both.msgs_sent;
    res->retries += both.retries;
    res->rejected_messages += both.rejected;
    res->ignored_messages += both.ignored;
    res->protocol_ns += both.progress_ns;
    res->data_ns += both.data_ns;
    kvs_inproc_stats_t ns;
    kvs_inproc_net_stats(s->net, &ns);
    res->net_dropped = ns.dropped;
    res->net_duplicated = ns.duplicated;
    res->corrupt_injected = ns.corrupted;
    res->write_failures = ns.write_failures;
    res->corrupt_detected += rx.checksum_failures;
}

/* Progress on every rank; returns the events processed. */
static uint64_t progress_all(sim_t *s)
{
    uint64_t work = 0;
    for (uint32_t r = 0; r < kvs_pd_geometry_prefill_ranks(&s->geo); r++)
        work += kvs_sender_progress(s->senders[r]);
    for (uint32_t r = 0; r < s->cfg->decode_tp; r++) work += kvs_receiver_progress(s->receivers[r]);
    return work;
}

/* On devices, gathers, writes and scatters run on GPU streams in real time while the virtual
 * clock waits for nobody: before idle time jumps ahead (and timers fire), let the GPUs finish
 * what they have queued and progress once more, so device work takes no virtual time. Returns
 * the events that progress found. */
static uint64_t settle_devices(sim_t *s)
{
    const kvs_sim_config_t *c = s->cfg;
    if (c->mem != KVS_MEM_DEVICE) return 0;
    (void) kvs_mem_device_sync(c->prefill_device); /* logs failures; the rooms fail on their own */
    if (c->decode_device != c->prefill_device) (void) kvs_mem_device_sync(c->decode_device);
    return progress_all(s);
}

/* Advances virtual time: one tick after work; otherwise a jump to the next thing known to be due
 * (a message, a write, the next forward pass), at most idle_jump ahead, since the protocol's
 * timers are invisible from here. The jump grows while idle; the cap keeps a retry at most a few
 * retry periods late. */
static void advance_time(sim_t *s, uint64_t work, uint64_t next_step, uint64_t *idle_jump)
{
    const kvs_sim_config_t *c = s->cfg;
    if (work > 0) {
        *idle_jump = c->tick_ns;
        s->now += c->tick_ns;
        return;
    }
    uint64_t target = s->now + *idle_jump;
    uint64_t ev = kvs_inproc_net_next_event(s->net);
    if (ev < target) target = ev;
    if (next_step < target) target = next_step;
    if (target <= s->now) target = s->now + c->tick_ns;
    s->now = target;
    uint64_t cap = 8 * sim_timeouts(c).retry_ns;
    *idle_jump = *idle_jump * 2 < cap ? *idle_jump * 2 : cap;
}

static int over_limits(sim_t *s)
{
    return s->res.iterations >= s->cfg->max_iterations || s->now >= s->cfg->max_virtual_ns;
}

static void sim_loop(sim_t *s)
{
    const kvs_sim_config_t *c = s->cfg;
    kvs_sim_result_t *res = &s->res;
    uint64_t idle_jump = c->tick_ns;
    uint64_t next_step = 0;
    while (res->succeeded + res->failed < res->requests) {
        if (over_limits(s)) {
            res->stalled = 1;
            res->unconcluded = res->requests - res->succeeded - res->failed;
            kvs_error("sim: gave up after %llu iterations and %.3f virtual s with %u requests "
                      "unconcluded (prefill %u live rooms, decode %u)",
                      (unsigned long long) res->iterations, (double) s->now / 1e9, res->unconcluded,
                      kvs_prefill_engine_live_rooms(s->pe), kvs_decode_engine_live_rooms(s->de));
            return;
        }
        res->iterations++;
        uint64_t work = route(s);
        work += progress_all(s);
        if (s->now >= next_step) {
            work += kvs_prefill_engine_step(s->pe);
            next_step = s->now + c->step_ns;
        } else {
            work += kvs_prefill_engine_poll(s->pe);
        }
        /* Engines poll on every iteration: a room can conclude inside progress without it
         * counting as an event (a timer firing). */
        work += kvs_decode_engine_step(s->de);
        if (work == 0) work = settle_devices(s);
        advance_time(s, work, kvs_prefill_engine_busy(s->pe) ? next_step : UINT64_MAX, &idle_jump);
    }
}

/* 1 when no rank holds room state, slots or messages in flight. */
static int sim_quiet(sim_t *s)
{
    kvs_pd_metrics_t m;
    for (uint32_t r = 0; r < kvs_pd_geometry_prefill_ranks(&s->geo); r++) {
        kvs_sender_metrics(s->senders[r], &m);
        if (m.live_rooms) return 0;
    }
    for (uint32_t r = 0; r < s->cfg->decode_tp; r++) {
        kvs_receiver_metrics(s->receivers[r], &m);
        if (m.live_rooms || m.live_slots || m.ring_used) return 0;
    }
    kvs_inproc_stats_t ns;
    kvs_inproc_net_stats(s->net, &ns);
    return ns.in_flight == 0 && ns.writes_in_flight == 0;
}

/* After the last room concluded, late duplicates may still be in flight, and a sender may keep
 * a note about a room it no longer holds until its bootstrap timeout: let the protocol run
 * (without the engines) until it is quiet or every such timer must have expired. */
static void sim_drain(sim_t *s)
{
    kvs_pd_timeouts_t to = sim_timeouts(s->cfg);
    uint64_t longest = to.bootstrap_timeout_ns > to.release_timeout_ns ? to.bootstrap_timeout_ns
                                                                       : to.release_timeout_ns;
    uint64_t start = s->now, deadline = s->now + 2 * longest;
    uint64_t idle_jump = s->cfg->tick_ns;
    while (!sim_quiet(s) && s->now < deadline && !over_limits(s)) {
        s->res.iterations++;
        uint64_t work = progress_all(s);
        if (work == 0) work = settle_devices(s);
        advance_time(s, work, UINT64_MAX, &idle_jump);
    }
    s->res.drain_ns = s->now - start;
}

kvs_status_t kvs_sim_run(const kvs_sim_config_t *config, kvs_sim_result_t *result_p)
{
    if (config == NULL || result_p == NULL) {
        kvs_error("sim: NULL config or result");
        return KVS_ERR_INVALID;
    }
    kvs_pd_geometry_t geo = kvs_sim_geometry(config);
    kvs_status_t st = sim_validate(config, &geo);
    if (st == KVS_OK) st = sim_check_fit(config, &geo);
    if (st != KVS_OK) return st;

    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);
    uint64_t wall0 = kvs_now_ns();
    sim_t *s = kvs_calloc(1, sizeof(*s));
    if (s == NULL) {
        kvs_error("sim: out of memory");
        return KVS_ERR_NOMEM;
    }
    s->cfg = config;
    s->geo = geo;
    s->clock = (kvs_clock_t){sim_now, s};
    s->res.exact = 1;

    st = sim_setup(s);
    if (st == KVS_OK) {
        sim_loop(s);
        if (!s->res.stalled) sim_drain(s);
        check_leaks(s);
    }
    kvs_sim_result_t res = s->res;
    res.virtual_ns = s->now;
    sim_teardown(s);
    kvs_free(s);
    if (st != KVS_OK) return st;

    kvs_alloc_stats(&after);
    res.leaked_allocs =
        after.live_blocks > before.live_blocks ? after.live_blocks - before.live_blocks : 0;
    res.wall_s = (double) (kvs_now_ns() - wall0) / 1e9;
    *result_p = res;
    return KVS_OK;
}

int kvs_sim_result_ok(const kvs_sim_result_t *r)
{
    return !r->stalled && r->unexpected_failures == 0 && r->exact && r->mismatched_bytes == 0 &&
           r->meta_mismatches == 0 && r->leaked_slots == 0 && r->leaked_pages == 0 &&
           r->leaked_rooms == 0 && r->leaked_allocs == 0 && r->succeeded + r->failed == r->requests;
}
