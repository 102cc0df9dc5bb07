/* The prefill engine of one prefill instance: a single scheduler for all of its TP ranks (all
 * ranks follow the same schedule, as in real engines), one radix cache over page ids that are
 * identical on every rank, and chunked prefill of C tokens per room per forward pass for a
 * batch of rooms. It drives one kvs_sender_t per rank.
 *
 * A room's life, as the protocol sees it:
 *   submit:  kvs_sender_add_room on every rank (page table not filled yet)
 *   admit:   radix match + lock, allocate the rest of the prompt's pages; the cached prefix is
 *            a snapshot taken now and is already at rest
 *   forward: advance(computed, scheduled) before each forward pass; the pass writes the KV
 *   last:    advance(len, len) and kvs_sender_finish(first token)
 *   end:     poll until every rank is Success/Failed and quiescent, release every rank, then
 *            give the pages to the radix cache (Success) or back to the pool (Failed). */
#include <string.h>

#include "sim/engine.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"

typedef enum {
    PF_QUEUED,   /* added on every rank, waiting for pages */
    PF_RUNNING,  /* admitted: one chunk per forward pass */
    PF_STALLED,  /* fault: the engine stopped computing it (a hung request); with pipeline
                    stages, the later ones still finish the chunks already in the pipeline */
    PF_FINISHED, /* whole prompt computed, finish() called: the transfer drains */
    PF_FAILING,  /* a rank failed or the engine aborted it: waiting for quiescence */
} pf_state_t;

typedef struct {
    const kvs_request_t *req;
    kvs_engine_fault_t fault;
    pf_state_t state;
    int admitted;     /* holds pages (and maybe a radix lock) */
    int aborted;      /* kvs_sender_abort was called on the ranks */
    kvs_status_t why; /* the engine failed it (not a rank): the reason it reports */
    uint64_t *hashes; /* [len] rolling token hashes for the synthetic KV */
    uint32_t *pages;  /* [npages] page table, same ids on every rank */
    uint32_t npages;
    kvs_radix_node_t *node; /* locked radix match, NULL when none */
    uint64_t cached;        /* the at-rest radix hit, snapshot at admission */
    uint64_t computed;      /* stage 0: KV for [0, computed) is at rest */
    uint64_t scheduled;     /* stage 0: the running forward pass covers [computed, scheduled) */
    uint32_t chunks_done;
    /* [stages] the same per pipeline stage: stage s computes what stage s - 1 finished in the
     * pass before (stage 0's are computed and scheduled) */
    uint64_t *stage_computed, *stage_scheduled;
} pf_room_t;

struct kvs_prefill_engine {
    kvs_prefill_engine_config_t config;
    uint32_t tp;     /* local ranks */
    uint32_t stages; /* of the instance */
    uint32_t *stage; /* [tp] each local rank's stage */
    uint32_t page;
    kvs_pool_t *const *pools; /* [tp], held by ls */
    kvs_sender_t **senders;   /* [tp] */
    kvs_radix_t *radix;
    kvs_lockstep_t ls;
    kvs_engine_done_fn done;
    void *done_arg;
    pf_room_t **rooms; /* live rooms in submission order (FIFO admission) */
    uint32_t nrooms, cap;
    uint32_t running;       /* rooms in PF_RUNNING: the batch */
    kvs_room_info_t *infos; /* [tp] poll scratch */
};

kvs_status_t kvs_prefill_engine_create(const kvs_prefill_engine_config_t *config,
                                       kvs_pool_t *const *pools, kvs_sender_t *const *senders,
                                       kvs_engine_done_fn done, void *done_arg,
                                       kvs_prefill_engine_t **engine_p)
{
    uint32_t tp =
        config->local_ranks ? config->local_ranks : kvs_pd_geometry_prefill_ranks(&config->geo);
    kvs_status_t st = kvs_engine_check_pools("prefill engine", "prefill", pools, tp,
                                             kvs_pd_geometry_page(&config->geo, KVS_SIDE_PREFILL),
                                             config->max_prompt_len);
    if (st != KVS_OK) return st;
    kvs_prefill_engine_t *e = kvs_calloc(1, sizeof(*e));
    if (e == NULL) goto err_nomem;
    e->config = *config;
    e->tp = tp;
    e->stages = kvs_pd_geometry_pp(&config->geo);
    e->page = kvs_pd_geometry_page(&config->geo, KVS_SIDE_PREFILL);
    e->done = done;
    e->done_arg = done_arg;
    e->senders = kvs_calloc(e->tp, sizeof(*e->senders));
    e->infos = kvs_calloc(e->tp, sizeof(*e->infos));
    e->stage = kvs_calloc(e->tp, sizeof(*e->stage));
    uint32_t max_pages = (config->max_prompt_len + e->page - 1) / e->page;
    if (e->senders == NULL || e->infos == NULL || e->stage == NULL ||
        kvs_lockstep_init(&e->ls, pools, e->tp, e->page, max_pages, config->radix) != KVS_OK)
        goto err_free;
    memcpy(e->senders, senders, e->tp * sizeof(*e->senders));
    for (uint32_t k = 0; k < e->tp; k++)
        e->stage[k] = (config->first_rank + k) / config->geo.prefill_tp % e->stages;
    e->pools = e->ls.pools;
    e->radix = e->ls.radix;
    *engine_p = e;
    return KVS_OK;

err_free:
    kvs_lockstep_fini(&e->ls);
    kvs_free(e->stage);
    kvs_free(e->infos);
    kvs_free(e->senders);
    kvs_free(e);
err_nomem:
    kvs_error("prefill engine: out of memory");
    return KVS_ERR_NOMEM;
}

static void room_free(pf_room_t *r)
{
    kvs_free(r->hashes);
    kvs_free(r->pages);
    kvs_free(r->stage_computed);
    kvs_free(r);
}

void kvs_prefill_engine_destroy(kvs_prefill_engine_t *e)
{
    if (e == NULL) return;
    for (uint32_t i = 0; i < e->nrooms; i++) room_free(e->rooms[i]);
    kvs_free(e->rooms);
    kvs_lockstep_fini(&e->ls); /* the radix cache hands its pages back to the pools */
    kvs_free(e->stage);
    kvs_free(e->infos);
    kvs_free(e->senders);
    kvs_free(e);
}

kvs_status_t kvs_prefill_engine_submit(kvs_prefill_engine_t *e, const kvs_request_t *req,
                                       const kvs_engine_fault_t *fault)
{
    if (e->nrooms == e->cap) {
        uint32_t cap = e->cap ? e->cap * 2 : 64;
        pf_room_t **rooms = kvs_realloc(e->rooms, cap * sizeof(*rooms));
        if (rooms == NULL) goto err_nomem;
        e->rooms = rooms;
        e->cap = cap;
    }
    pf_room_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) goto err_nomem;
    r->req = req;
    if (fault != NULL) r->fault = *fault;
    r->npages = (req->len + e->page - 1) / e->page;
    r->hashes = kvs_malloc((size_t) req->len * sizeof(uint64_t));
    r->pages = kvs_calloc(r->npages, sizeof(uint32_t));
    r->stage_computed = kvs_calloc(2 * (size_t) e->stages, sizeof(uint64_t));
    r->stage_scheduled = r->stage_computed ? r->stage_computed + e->stages : NULL;
    if (r->hashes == NULL || r->pages == NULL || r->stage_computed == NULL) {
        room_free(r);
        goto err_nomem;
    }
    kvs_synth_hashes(req->tokens, req->len, r->hashes);

    /* Added on every rank before the room is scheduled, so decode's metadata finds it; the page
     * table is filled at admission, before advance() reports any of its tokens. */
    for (uint32_t k = 0; k < e->tp; k++) {
        kvs_status_t st = kvs_sender_add_room(e->senders[k], req->room, req->len, r->pages);
        if (st != KVS_OK) {
            /* Undo the ranks that took it, so no rank keeps a room the engine forgot. */
            for (uint32_t j = 0; j < k; j++) {
                kvs_sender_abort(e->senders[j], req->room);
            }
            kvs_error("prefill engine: room %llx: add_room on rank %u failed: %s",
                      (unsigned long long) req->room, k, kvs_status_str(st));
            if (k == 0) {
                room_free(r);
                return st;
            }
            r->state = PF_FAILING;
            r->aborted = 1;
            break;
        }
    }
    e->rooms[e->nrooms++] = r;
    return KVS_OK;

err_nomem:
    kvs_error("prefill engine: out of memory submitting room %llx", (unsigned long long) req->room);
    return KVS_ERR_NOMEM;
}

/* Reports each rank its stage's progress. */
static void advance_all(kvs_prefill_engine_t *e, pf_room_t *r)
{
    for (uint32_t k = 0; k < e->tp; k++) {
        /* A rank that fails the call has failed the room; poll() sees it and aborts the rest. */
        uint32_t s = e->stage[k];
        (void) kvs_sender_advance(e->senders[k], r->req->room, r->stage_computed[s],
                                  r->stage_scheduled[s]);
    }
}

/* Every stage's progress set to [0, computed) at rest and [computed, scheduled) running. */
static void set_stages(kvs_prefill_engine_t *e, pf_room_t *r, uint64_t computed, uint64_t scheduled)
{
    for (uint32_t s = 0; s < e->stages; s++) {
        r->stage_computed[s] = computed;
        r->stage_scheduled[s] = scheduled;
    }
}

/* Stops the room on every rank that has not concluded it yet. */
static void abort_all(kvs_prefill_engine_t *e, pf_room_t *r)
{
    if (r->state == PF_RUNNING) e->running--;
    r->state = PF_FAILING;
    if (r->aborted) return;
    r->aborted = 1;
    for (uint32_t k = 0; k < e->tp; k++) {
        kvs_room_info_t info;
        if (kvs_sender_poll(e->senders[k], r->req->room, &info) == KVS_OK &&
            (info.status == KVS_ROOM_SUCCESS || info.status == KVS_ROOM_FAILED))
            continue;
        (void) kvs_sender_abort(e->senders[k], r->req->room);
    }
}

static void finish_room(kvs_prefill_engine_t *e, pf_room_t *r)
{
    int32_t first = kvs_synth_first_token(r->hashes[r->req->len - 1]);
    uint8_t meta[4] = {(uint8_t) first, (uint8_t) (first >> 8), (uint8_t) (first >> 16),
                       (uint8_t) (first >> 24)};
    set_stages(e, r, r->req->len, r->req->len);
    advance_all(e, r);
    for (uint32_t k = 0; k < e->tp; k++)
        (void) kvs_sender_finish(e->senders[k], r->req->room, meta, sizeof(meta));
    e->running--;
    r->state = PF_FINISHED;
}

/* The forward pass launched by the previous step completes: its KV is written (only now, so a
 * sender that read pages before advance() reported them computed would ship zeros and fail
 * verification). */
static int pipeline_busy(const kvs_prefill_engine_t *e, const pf_room_t *r)
{
    for (uint32_t s = 0; s < e->stages; s++)
        if (r->stage_scheduled[s] != r->stage_computed[s]) return 1;
    return 0;
}

static uint32_t complete_forward(kvs_prefill_engine_t *e)
{
    uint32_t changed = 0;
    for (uint32_t i = 0; i < e->nrooms; i++) {
        pf_room_t *r = e->rooms[i];
        const uint32_t last = e->stages - 1;
        if ((r->state != PF_RUNNING && r->state != PF_STALLED) || !pipeline_busy(e, r)) continue;
        /* Each stage's pass completes: its layers of [computed, scheduled) are written (the
         * pipeline's stages run at once, on what the stage before finished a pass earlier). */
        for (uint32_t k = 0; k < e->tp; k++) {
            uint32_t s = e->stage[k], first, layers;
            kvs_pp_stage(e->config.geo.shape.layers, e->stages, s, &first, &layers);
            kvs_synth_write_layers(e->pools[k], first, r->hashes, r->pages, r->stage_computed[s],
                                   r->stage_scheduled[s]);
        }
        for (uint32_t s = 0; s < e->stages; s++) r->stage_computed[s] = r->stage_scheduled[s];
        if (r->scheduled != r->computed) r->chunks_done++;
        r->computed = r->scheduled;
        changed++;
        if (r->state == PF_STALLED) continue;
        if (r->fault.kind == KVS_ENGINE_FAULT_ABORT && r->chunks_done >= r->fault.at) {
            abort_all(e, r);
        } else if (r->stage_computed[last] == r->req->len) {
            finish_room(e, r);
        }
    }
    return changed;
}

/* Radix match + lock and page allocation on every rank; 0 when pages are short. */
static int try_admit(kvs_prefill_engine_t *e, pf_room_t *r)
{
    const kvs_request_t *req = r->req;
    uint64_t cached = 0;
    kvs_radix_node_t *node = NULL;
    /* Match all but the last token: the forward pass must compute at least one token to
     * produce the first generated token. */
    if (e->radix != NULL && req->len > e->page) {
        kvs_radix_match_t m;
        if (kvs_radix_match(e->radix, 0, req->tokens, req->len - 1, r->pages, &m) == KVS_OK &&
            m.tokens > 0) {
            /* Locked before allocating: eviction below must not take the matched pages. */
            kvs_radix_lock(e->radix, m.node);
            node = m.node;
            cached = m.tokens;
        }
    }
    uint32_t first = (uint32_t) (cached / e->page);
    if (kvs_lockstep_alloc(&e->ls, r->npages - first, r->pages + first) != KVS_OK) {
        if (node != NULL) kvs_radix_unlock(e->radix, node);
        return 0;
    }
    r->node = node;
    r->cached = r->computed = r->scheduled = cached;
    set_stages(e, r, cached, cached);
    r->admitted = 1;
    r->state = PF_RUNNING;
    e->running++;
    return 1;
}

static uint32_t admit(kvs_prefill_engine_t *e)
{
    uint32_t changed = 0;
    for (uint32_t i = 0; i < e->nrooms && e->running < e->config.batch; i++) {
        pf_room_t *r = e->rooms[i];
        if (r->state != PF_QUEUED) continue;
        if (r->req->len > e->config.max_prompt_len) {
            /* The pools are sized for max_prompt_len: waiting for pages could block every later
             * room forever, so this one fails alone (poll concludes it once the ranks let go). */
            kvs_error("prefill engine: room %llx: a prompt of %u tokens is longer than the %u "
                      "the pools are sized for; it fails at admission",
                      (unsigned long long) r->req->room, r->req->len, e->config.max_prompt_len);
            r->why = KVS_ERR_NOSPACE;
            abort_all(e, r);
            changed++;
            continue;
        }
        if (!try_admit(e, r)) break; /* FIFO: later rooms wait behind the head */
        changed++;
    }
    return changed;
}

/* Launches the next forward pass: one chunk of every running room. The first advance() of a
 * room reports its radix snapshot as computed, which lets the sender ship the cached prefix
 * while this pass runs. */
static uint32_t launch_forward(kvs_prefill_engine_t *e)
{
    uint32_t launched = 0;
    uint64_t chunk = e->config.geo.chunk_tokens;
    for (uint32_t i = 0; i < e->nrooms; i++) {
        pf_room_t *r = e->rooms[i];
        if (r->state == PF_STALLED) {
            /* Stage 0 launches nothing; the later stages drain what it computed, and report
             * what the last pass did. */
            for (uint32_t s = 1; s < e->stages; s++)
                r->stage_scheduled[s] = r->stage_computed[s - 1];
            advance_all(e, r);
            continue;
        }
        if (r->state != PF_RUNNING) continue;
        if (r->fault.kind == KVS_ENGINE_FAULT_STALL && r->chunks_done >= r->fault.at &&
            r->computed < r->req->len) {
            /* A hung request: never scheduled again. What the last pass computed is reported
             * at rest, and nothing as scheduled, so the sender asks for no slot whose compute
             * will never come (a later stage's slot comes within a pass per stage). */
            r->stage_scheduled[0] = r->stage_computed[0];
            for (uint32_t s = 1; s < e->stages; s++)
                r->stage_scheduled[s] = r->stage_computed[s - 1];
            advance_all(e, r);
            e->running--;
            r->state = PF_STALLED;
            continue;
        }
        uint64_t end = r->computed + chunk < r->req->len ? r->computed + chunk : r->req->len;
        r->scheduled = end;
        /* The next pass: stage 0 the next chunk, every later stage what the one before did. */
        r->stage_scheduled[0] = end;
        for (uint32_t s = 1; s < e->stages; s++) r->stage_scheduled[s] = r->stage_computed[s - 1];
        advance_all(e, r);
        launched++;
    }
    return launched;
}

/* Release on every rank, then hand the pages to the radix cache or the pool. */
static void conclude(kvs_prefill_engine_t *e, pf_room_t *r, kvs_room_status_t status,
                     kvs_status_t reason)
{
    const kvs_request_t *req = r->req;
    for (uint32_t k = 0; k < e->tp; k++) (void) kvs_sender_release(e->senders[k], req->room);
    if (r->admitted) {
        uint32_t first = (uint32_t) (r->cached / e->page);
        uint32_t keep_from = first, keep_to = first; /* pages now owned by the radix cache */
        size_t present = 0;
        if (status == KVS_ROOM_SUCCESS && e->radix != NULL &&
            kvs_radix_insert(e->radix, 0, req->tokens, req->len, r->pages, &present, NULL) ==
                KVS_OK) {
            /* [cached, present) was inserted meanwhile by another room: ours are duplicates.
             * The partial last page is not inserted. */
            uint32_t present_pages = (uint32_t) (present / e->page);
            keep_from = present_pages > first ? present_pages : first;
            keep_to = req->len / e->page;
            if (keep_to < keep_from) keep_to = keep_from;
        }
        kvs_lockstep_free(&e->ls, r->pages + first, keep_from - first);
        kvs_lockstep_free(&e->ls, r->pages + keep_to, r->npages - keep_to);
        if (r->node != NULL) kvs_radix_unlock(e->radix, r->node);
    }
    if (e->done != NULL) {
        kvs_engine_outcome_t o = {
            .status = status, .reason = reason, .hit_tokens = r->cached, .meta_ok = 1};
        e->done(e->done_arg, req, &o);
    }
}

uint32_t kvs_prefill_engine_poll(kvs_prefill_engine_t *e)
{
    uint32_t changed = 0;
    for (uint32_t i = 0; i < e->nrooms;) {
        pf_room_t *r = e->rooms[i];
        kvs_room_status_t min = KVS_ROOM_SUCCESS;
        kvs_status_t reason = KVS_OK;
        int terminal = 1, quiescent = 1;
        for (uint32_t k = 0; k < e->tp; k++) {
            kvs_room_info_t *info = &e->infos[k];
            if (kvs_sender_poll(e->senders[k], r->req->room, info) != KVS_OK) {
                /* The rank no longer knows the room: nothing of it can be in flight there. */
                info->status = KVS_ROOM_FAILED;
                info->reason = KVS_ERR_NOT_FOUND;
                info->quiescent = 1;
            }
            if (info->status < min) min = info->status;
            if (info->status == KVS_ROOM_FAILED)
                reason = kvs_engine_root_cause(reason, info->reason);
            terminal &= info->status == KVS_ROOM_SUCCESS || info->status == KVS_ROOM_FAILED;
            quiescent &= info->quiescent != 0;
        }
        /* One failed rank fails the request: stop the others instead of letting them run on. */
        if (min == KVS_ROOM_FAILED && r->state != PF_FAILING) {
            abort_all(e, r);
            changed++;
        }
        if (!terminal || !quiescent) {
            i++;
            continue;
        }
        if (r->state == PF_RUNNING) e->running--;
        if (r->why != KVS_OK) {
            min = KVS_ROOM_FAILED;
            reason = r->why;
        }
        conclude(e, r, min, reason);
        room_free(r);
        memmove(&e->rooms[i], &e->rooms[i + 1], (e->nrooms - i - 1) * sizeof(*e->rooms));
        e->nrooms--;
        changed++;
    }
    return changed;
}

uint32_t kvs_prefill_engine_step(kvs_prefill_engine_t *e)
{
    uint32_t changed = complete_forward(e);
    changed += kvs_prefill_engine_poll(e);
    changed += admit(e);
    changed += launch_forward(e);
    return changed;
}

int kvs_prefill_engine_busy(const kvs_prefill_engine_t *e)
{
    if (e->running > 0) return 1;
    for (uint32_t i = 0; i < e->nrooms; i++)
        if (e->rooms[i]->state == PF_STALLED && pipeline_busy(e, e->rooms[i])) return 1;
    return 0;
}

uint32_t kvs_prefill_engine_live_rooms(const kvs_prefill_engine_t *e)
{
    return e->nrooms;
}

size_t kvs_prefill_engine_cached_pages(const kvs_prefill_engine_t *e)
{
    if (e->radix == NULL) return 0;
    kvs_radix_stats_t st;
    kvs_radix_stats(e->radix, &st);
    return st.total_pages;
}
