/* The decode engine of one decode instance: one scheduler for all of its TP ranks, one radix
 * cache over page ids identical on every rank, FIFO admission when pages are free. It drives one
 * kvs_receiver_t per rank. Its pages are of U = kvs_pd_geometry_unit tokens: under decode
 * context parallelism page id i holds on every rank of a DCP group that rank's tokens of
 * [i*U, (i+1)*U) (U / N of them, one pool page), so one id list and one radix cache still serve
 * every rank, and a prefix hit is a multiple of U (protocol.md §1).
 *
 * A room's life, as the protocol sees it:
 *   admit:   radix match + lock (base = page-aligned hit), allocate delta pages for
 *            [base, prompt_len) on every rank, kvs_receiver_add_room on every rank
 *   wait:    poll every rank; the room's status is the MIN over ranks
 *   Success: (every rank Success and quiescent) verify every position [0, prompt_len) on every
 *            rank and the final metadata, release every rank, insert the prompt into the radix
 *            cache, unlock
 *   Failed:  abort the ranks still running, wait until every rank is quiescent (pages may be
 *            quarantined until prefill acknowledged the abort), release, free the delta pages,
 *            unlock. */
#include <string.h>

#include "sim/engine.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"

typedef struct {
    const kvs_request_t *req;
    kvs_engine_fault_t fault;
    int added;       /* admitted: pages held, room added on every rank */
    int aborted;     /* kvs_receiver_abort was called on the ranks */
    uint32_t *pages; /* [npages]: radix pages for [0, base) then the delta pages */
    uint32_t npages;
    uint32_t base_pages;         /* base / P */
    uint64_t base;               /* what add_room was given (misaligned only under that fault) */
    kvs_radix_node_t *node;      /* locked radix match, NULL when none */
    uint32_t polls_transferring; /* polls since some rank reported Transferring */
} dc_room_t;

struct kvs_decode_engine {
    kvs_decode_engine_config_t config;
    uint32_t tp;
    uint32_t page;
    kvs_pool_t *const *pools;   /* [tp], held by ls */
    kvs_receiver_t **receivers; /* [tp] */
    kvs_radix_t *radix;
    kvs_lockstep_t ls;
    kvs_engine_done_fn done;
    void *done_arg;
    dc_room_t **rooms; /* live rooms in submission order (FIFO admission) */
    uint32_t nrooms, cap;
    uint32_t queued;        /* rooms not yet admitted */
    kvs_room_info_t *infos; /* [tp] poll scratch */
    uint64_t *hashes;       /* [max_prompt_len] verification scratch */
};

kvs_status_t kvs_decode_engine_create(const kvs_decode_engine_config_t *config,
                                      kvs_pool_t *const *pools, kvs_receiver_t *const *receivers,
                                      kvs_engine_done_fn done, void *done_arg,
                                      kvs_decode_engine_t **engine_p)
{
    uint32_t tp = config->local_ranks ? config->local_ranks : config->geo.decode_tp;
    kvs_status_t st =
        kvs_engine_check_pools("decode engine", "decode", pools, tp,
                               kvs_pd_geometry_unit(&config->geo), config->max_prompt_len);
    if (st != KVS_OK) return st;
    kvs_decode_engine_t *e = kvs_calloc(1, sizeof(*e));
    if (e == NULL) goto err_nomem;
    e->config = *config;
    e->tp = tp;
    e->page = kvs_pd_geometry_unit(&config->geo);
    e->done = done;
    e->done_arg = done_arg;
    e->receivers = kvs_calloc(e->tp, sizeof(*e->receivers));
    e->infos = kvs_calloc(e->tp, sizeof(*e->infos));
    e->hashes = kvs_calloc(config->max_prompt_len + 1, sizeof(uint64_t));
    uint32_t max_pages = (config->max_prompt_len + e->page - 1) / e->page;
    if (e->receivers == NULL || e->infos == NULL || e->hashes == NULL ||
        kvs_lockstep_init(&e->ls, pools, e->tp, e->page, max_pages, config->radix) != KVS_OK)
        goto err_free;
    memcpy(e->receivers, receivers, e->tp * sizeof(*e->receivers));
    e->pools = e->ls.pools;
    e->radix = e->ls.radix;
    *engine_p = e;
    return KVS_OK;

err_free:
    kvs_lockstep_fini(&e->ls);
    kvs_free(e->hashes);
    kvs_free(e->infos);
    kvs_free(e->receivers);
    kvs_free(e);
err_nomem:
    kvs_error("decode engine: out of memory");
    return KVS_ERR_NOMEM;
}

static void room_free(dc_room_t *r)
{
    kvs_free(r->pages);
    kvs_free(r);
}

void kvs_decode_engine_destroy(kvs_decode_engine_t *e)
{
    if (e == NULL) return;
    for (uint32_t i = 0; i < e->nrooms; i++) room_free(e->rooms[i]);
    kvs_free(e->rooms);
    kvs_lockstep_fini(&e->ls); /* the radix cache hands its pages back to the pools */
    kvs_free(e->hashes);
    kvs_free(e->infos);
    kvs_free(e->receivers);
    kvs_free(e);
}

kvs_status_t kvs_decode_engine_submit(kvs_decode_engine_t *e, const kvs_request_t *req,
                                      const kvs_engine_fault_t *fault)
{
    if (e->nrooms == e->cap) {
        uint32_t cap = e->cap ? e->cap * 2 : 64;
        dc_room_t **rooms = kvs_realloc(e->rooms, cap * sizeof(*rooms));
        if (rooms == NULL) goto err_nomem;
        e->rooms = rooms;
        e->cap = cap;
    }
    dc_room_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) goto err_nomem;
    r->req = req;
    if (fault != NULL) r->fault = *fault;
    r->npages = (req->len + e->page - 1) / e->page;
    r->pages = kvs_calloc(r->npages + 1, sizeof(uint32_t));
    if (r->pages == NULL) {
        kvs_free(r);
        goto err_nomem;
    }
    e->rooms[e->nrooms++] = r;
    e->queued++;
    return KVS_OK;

err_nomem:
    kvs_error("decode engine: out of memory submitting room %llx", (unsigned long long) req->room);
    return KVS_ERR_NOMEM;
}

/* Radix match + lock, delta pages on every rank, then the room on every rank (which sends its
 * metadata to prefill). 0 when pages are short. */
static int try_admit(kvs_decode_engine_t *e, dc_room_t *r)
{
    const kvs_request_t *req = r->req;
    uint64_t base = 0;
    kvs_radix_node_t *node = NULL;
    if (e->radix != NULL) {
        /* A full hit is fine: decode then only needs prefill's final metadata (and maybe the
         * partial last page). */
        kvs_radix_match_t m;
        if (kvs_radix_match(e->radix, 0, req->tokens, req->len, r->pages, &m) == KVS_OK &&
            m.tokens > 0) {
            kvs_radix_lock(e->radix, m.node); /* before allocating: eviction must spare it */
            node = m.node;
            base = m.tokens;
        }
    }
    uint32_t base_pages = (uint32_t) (base / e->page);
    if (kvs_lockstep_alloc(&e->ls, r->npages - base_pages, r->pages + base_pages) != KVS_OK) {
        if (node != NULL) kvs_radix_unlock(e->radix, node);
        return 0;
    }
    r->node = node;
    r->base_pages = base_pages;
    r->base = base;
    if (r->fault.kind == KVS_ENGINE_FAULT_MISALIGN) {
        /* Test hook: a base off the page grid must fail this room only. */
        r->base = base < req->len ? base + 1 : base - 1;
    }
    r->added = 1;
    e->queued--;
    for (uint32_t k = 0; k < e->tp; k++) {
        kvs_status_t st = kvs_receiver_add_room(e->receivers[k], req->room, r->base, req->len,
                                                r->pages + base_pages);
        if (st != KVS_OK) {
            /* poll() sees the rank that does not know the room as Failed and aborts the
             * others. */
            kvs_error("decode engine: room %llx: add_room on rank %u failed: %s",
                      (unsigned long long) req->room, k, kvs_status_str(st));
        }
    }
    return 1;
}

static void abort_all(kvs_decode_engine_t *e, dc_room_t *r)
{
    if (r->aborted) return;
    r->aborted = 1;
    for (uint32_t k = 0; k < e->tp; k++) {
        kvs_room_info_t info;
        if (kvs_receiver_poll(e->receivers[k], r->req->room, &info) == KVS_OK &&
            (info.status == KVS_ROOM_SUCCESS || info.status == KVS_ROOM_FAILED))
            continue;
        (void) kvs_receiver_abort(e->receivers[k], r->req->room);
    }
}

/* Every position [0, prompt_len) on every rank, through the radix pages below base and the
 * delta pages above it, plus the final metadata of every rank. */
static void verify(kvs_decode_engine_t *e, dc_room_t *r, kvs_engine_outcome_t *o)
{
    const kvs_request_t *req = r->req;
    kvs_synth_hashes(req->tokens, req->len, e->hashes);
    int32_t first = kvs_synth_first_token(e->hashes[req->len - 1]);
    uint8_t meta[4] = {(uint8_t) first, (uint8_t) (first >> 8), (uint8_t) (first >> 16),
                       (uint8_t) (first >> 24)};
    o->meta_ok = 1;
    for (uint32_t k = 0; k < e->tp; k++) {
        const kvs_dcp_t dcp =
            kvs_pd_geometry_dcp_of(&e->config.geo, kvs_pool_config(e->pools[k])->tp.tp_rank);
        o->mismatched_bytes +=
            kvs_synth_verify_dcp(e->pools[k], &dcp, e->hashes, r->pages, 0, req->len);
        if (e->infos[k].final_len != sizeof(meta) ||
            memcmp(e->infos[k].final, meta, sizeof(meta)) != 0)
            o->meta_ok = 0;
    }
    if (o->mismatched_bytes != 0 || !o->meta_ok)
        kvs_error("decode engine: room %llx (request %u, %u tokens, base %llu): %llu bytes "
                  "differ, final metadata %s",
                  (unsigned long long) req->room, req->index, req->len,
                  (unsigned long long) r->base, (unsigned long long) o->mismatched_bytes,
                  o->meta_ok ? "ok" : "wrong");
}

static void conclude(kvs_decode_engine_t *e, dc_room_t *r, kvs_room_status_t status,
                     kvs_status_t reason)
{
    const kvs_request_t *req = r->req;
    kvs_engine_outcome_t o = {.status = status, .reason = reason, .hit_tokens = r->base};
    o.total_pages = r->npages - r->base_pages;
    if (status == KVS_ROOM_SUCCESS) verify(e, r, &o);
    for (uint32_t k = 0; k < e->tp; k++) (void) kvs_receiver_release(e->receivers[k], req->room);

    uint32_t first = r->base_pages;
    uint32_t keep_from = first, keep_to = first; /* pages now owned by the radix cache */
    size_t present = 0;
    if (status == KVS_ROOM_SUCCESS && e->radix != NULL &&
        kvs_radix_insert(e->radix, 0, req->tokens, req->len, r->pages, &present, NULL) == KVS_OK) {
        uint32_t present_pages = (uint32_t) (present / e->page);
        keep_from = present_pages > first ? present_pages : first;
        keep_to = req->len / e->page;
        if (keep_to < keep_from) keep_to = keep_from;
    }
    kvs_lockstep_free(&e->ls, r->pages + first, keep_from - first);
    kvs_lockstep_free(&e->ls, r->pages + keep_to, r->npages - keep_to);
    if (r->node != NULL) kvs_radix_unlock(e->radix, r->node);
    if (e->done != NULL) e->done(e->done_arg, req, &o);
}

/* A room that can never be admitted concludes Failed at once: it was never added on any rank
 * and holds no pages. */
static void refuse(kvs_decode_engine_t *e, uint32_t i)
{
    dc_room_t *r = e->rooms[i];
    kvs_error("decode engine: room %llx: a prompt of %u tokens is longer than the %u the pools "
              "are sized for; it fails at admission",
              (unsigned long long) r->req->room, r->req->len, e->config.max_prompt_len);
    e->queued--;
    memmove(&e->rooms[i], &e->rooms[i + 1], (e->nrooms - i - 1) * sizeof(*e->rooms));
    e->nrooms--;
    kvs_engine_outcome_t o = {.status = KVS_ROOM_FAILED, .reason = KVS_ERR_NOSPACE};
    if (e->done != NULL) e->done(e->done_arg, r->req, &o);
    room_free(r);
}

static uint32_t admit(kvs_decode_engine_t *e)
{
    uint32_t changed = 0;
    for (uint32_t i = 0; i < e->nrooms && e->queued > 0;) {
        dc_room_t *r = e->rooms[i];
        if (r->added) {
            i++;
            continue;
        }
        /* Waiting for pages it can never get would block every later room (FIFO). */
        if (r->req->len > e->config.max_prompt_len) {
            refuse(e, i);
            changed++;
            continue;
        }
        if (!try_admit(e, r)) break; /* FIFO: later rooms wait behind the head */
        changed++;
        i++;
    }
    return changed;
}

static uint32_t poll_rooms(kvs_decode_engine_t *e)
{
    uint32_t changed = 0;
    for (uint32_t i = 0; i < e->nrooms;) {
        dc_room_t *r = e->rooms[i];
        if (!r->added) {
            i++;
            continue;
        }
        kvs_room_status_t min = KVS_ROOM_SUCCESS;
        kvs_status_t reason = KVS_OK;
        int terminal = 1, quiescent = 1, transferring = 0;
        for (uint32_t k = 0; k < e->tp; k++) {
            kvs_room_info_t *info = &e->infos[k];
            if (kvs_receiver_poll(e->receivers[k], r->req->room, info) != KVS_OK) {
                memset(info, 0, sizeof(*info));
                info->status = KVS_ROOM_FAILED;
                info->reason = KVS_ERR_NOT_FOUND;
                info->quiescent = 1;
            }
            if (info->status < min) min = info->status;
            if (info->status == KVS_ROOM_FAILED)
                reason = kvs_engine_root_cause(reason, info->reason);
            terminal &= info->status == KVS_ROOM_SUCCESS || info->status == KVS_ROOM_FAILED;
            quiescent &= info->quiescent != 0;
            transferring |= info->status == KVS_ROOM_TRANSFERRING;
        }
        if (min == KVS_ROOM_FAILED && !r->aborted) {
            abort_all(e, r); /* the request failed: stop its other ranks too */
            changed++;
        }
        if (r->fault.kind == KVS_ENGINE_FAULT_ABORT && !r->aborted &&
            (transferring || r->polls_transferring) && ++r->polls_transferring >= r->fault.at) {
            abort_all(e, r); /* fault: the request is cancelled mid-transfer */
            changed++;
        }
        if (!terminal || !quiescent) {
            i++;
            continue;
        }
        conclude(e, r, min, reason);
        room_free(r);
        memmove(&e->rooms[i], &e->rooms[i + 1], (e->nrooms - i - 1) * sizeof(*e->rooms));
        e->nrooms--;
        changed++;
    }
    return changed;
}

uint32_t kvs_decode_engine_step(kvs_decode_engine_t *e)
{
    uint32_t changed = poll_rooms(e);
    changed += admit(e);
    return changed;
}

uint32_t kvs_decode_engine_live_rooms(const kvs_decode_engine_t *e)
{
    return e->nrooms;
}

size_t kvs_decode_engine_cached_pages(const kvs_decode_engine_t *e)
{
    if (e->radix == NULL) return 0;
    kvs_radix_stats_t st;
    kvs_radix_stats(e->radix, &st);
    return st.total_pages;
}
