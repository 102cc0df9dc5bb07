/* The decode-side room state machine (protocol.md §3): room registration and metadata, the
 * staging ring grants, per-writer arrivals, scatter into the room's pages, status, timeouts,
 * abort with quarantine. One receiver per decode rank, driven by kvs_receiver_progress(). The
 * ring and the copy backend follow the pool's memory kind (host + CPU, or the pool's GPU). */
#include <stdio.h>
#include <string.h>

#include "base/map.h"
#include "base/mem.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/grid.h"
#include "kvstage/log.h"
#include "kvstage/ring.h"
#include "pd/pd_internal.h"

typedef enum {
    RCH_NONE = 0,   /* no request yet */
    RCH_QUEUED,     /* waiting in the ring's FIFO */
    RCH_GRANTED,    /* slot granted; writers arriving */
    RCH_SCATTERING, /* every writer arrived; scatter running */
    RCH_DONE,       /* scattered (or abandoned after a failure); slot freed */
} rchunk_state_t;

typedef struct {
    rchunk_state_t state;
    uint64_t offset, size; /* the grant */
    uint64_t arrived;      /* bit per writer */
    uint64_t grant_acked;  /* bit per writer rank index: it holds the grant (ACK or arrival) */
    uint64_t grant_retry_at;
    uint64_t grant_sent_at; /* first send of the grant, for the round-trip time */
    uint32_t grant_tries;
    uint64_t ticket; /* last scatter copy */
} rchunk_t;

typedef struct {
    uint64_t id;
    uint64_t serial; /* names the room in ring cookies */
    uint64_t base, prompt_len, total_pages, nchunks;
    const uint32_t *pages; /* [total_pages] engine-owned delta pages from `base` */
    kvs_room_status_t status;
    kvs_status_t reason;
    int quiescent;
    kvs_writer_t writers[KVS_MAX_WRITERS];
    uint32_t nwriters;
    uint32_t writer_ranks[KVS_MAX_WRITERS]; /* distinct prefill ranks among writers */
    uint32_t nwriter_ranks;
    uint32_t peers[KVS_MAX_TP];
    uint32_t npeers;
    uint64_t meta_acked, status_ok, status_seen, abort_acked; /* bit per peer index */
    rchunk_t *chunks;                                         /* [nchunks] */
    uint64_t chunks_done;
    uint64_t chunks_in;  /* chunks whose every writer's region arrived (scattering or done) */
    uint32_t scattering; /* chunks in RCH_SCATTERING */
    uint64_t *sums; /* [nchunks][nwriters][2] checksums: from CHUNK_READY, then from the scatter */
    uint64_t unacked_grants;   /* granted chunks some writer rank has not confirmed */
    uint64_t next_grant_retry; /* earliest grant_retry_at among them */
    uint64_t meta_sent_at, all_success_at, failed_at;
    uint64_t next_retry; /* metadata or abort resend */
    int meta_resent;     /* the metadata went out more than once: no round-trip sample */
    uint32_t final_len;
    uint8_t final[KVS_MSG_FINAL_MAX];
} rroom_t;

struct kvs_receiver {
    kvs_receiver_config_t cfg;
    kvs_pool_t *pool;
    kvs_link_t *link;
    kvs_clock_t clock;
    kvs_copy_backend_t copy;
    kvs_ring_t *ring;
    uint8_t *ring_mem;  /* [ring_bytes] the staging ring writers fill, in the pool's memory */
    int ring_from_link; /* ring_mem came from the link's ring_alloc */
    kvs_map_t rooms;    /* id -> rroom_t* */
    kvs_map_t serials;  /* serial -> rroom_t* */
    kvs_map_t early;    /* id -> early_fail_t*: rooms a prefill rank failed before we knew them */
    uint64_t next_serial;
    uint64_t grid;      /* G */
    kvs_dcp_t dcp;      /* this rank's place in its DCP group (size 1 without DCP) */
    uint64_t rank_grid; /* G / N: this rank's tokens in a full slot, in its own pages */
    /* [stages] the layers each prefill stage writes, as a shape: a stage writer's region is
     * [K of its layers][V of its layers] (protocol.md §2) */
    kvs_kv_shape_t stage_shapes[KVS_MAX_TP];
    kvs_pd_metrics_t m;
    uint32_t scattering; /* chunks whose scatter started, not yet seen done, over every room */
    uint64_t srtt_ns;    /* smoothed round trip to the prefill ranks (kvs_pd_rto) */
};

/* A STATUS Failed that arrived before the engine added its room: without it the room would
 * only fail at the waiting timeout, holding its pages all that time. */
typedef struct {
    kvs_status_t reason;
    uint64_t expires_at;
} early_fail_t;

#define COOKIE_CHUNK_BITS 24

static uint32_t grant_slots(kvs_receiver_t *rx);

static uint64_t cookie_of(const rroom_t *r, uint64_t chunk)
{
    return (r->serial << COOKIE_CHUNK_BITS) | chunk;
}

static uint64_t now_ns(const kvs_receiver_t *rx)
{
    return kvs_clock_now(&rx->clock);
}

static void free_ring(kvs_receiver_t *rx)
{
    const kvs_pool_config_t *pc = kvs_pool_config(rx->pool);
    if (rx->ring_from_link)
        rx->link->ops->ring_free(rx->link->ctx, rx->ring_mem);
    else
        kvs_mem_free(pc->mem, pc->device, rx->ring_mem);
}

kvs_status_t kvs_receiver_create(const kvs_receiver_config_t *config, kvs_pool_t *pool,
                                 kvs_link_t *link, const kvs_clock_t *clock,
                                 kvs_receiver_t **receiver_p)
{
    kvs_status_t st = kvs_pd_geometry_validate(&config->geo);
    if (st != KVS_OK) return st;
    const kvs_pool_config_t *pc = kvs_pool_config(pool);
    if (config->rank >= config->geo.decode_tp || pc->tp.tp_size != config->geo.decode_tp ||
        pc->tp.tp_rank != config->rank || pc->page_size != config->geo.page_size ||
        memcmp(&pc->shape, &config->geo.shape, sizeof(pc->shape)) != 0) {
        kvs_error("receiver: decode rank %u of %u does not match its pool (rank %u of %u, "
                  "page %u)",
                  config->rank, config->geo.decode_tp, pc->tp.tp_rank, pc->tp.tp_size,
                  pc->page_size);
        return KVS_ERR_INVALID;
    }
    if (pc->mem == KVS_MEM_DEVICE &&
        (st = kvs_pd_geometry_check_device(&config->geo, KVS_SIDE_DECODE)) != KVS_OK)
        return st;
    if (config->ring_bytes == 0) {
        kvs_error("receiver: ring size must be > 0");
        return KVS_ERR_INVALID;
    }
    kvs_receiver_t *rx = kvs_calloc(1, sizeof(*rx));
    if (rx == NULL) return KVS_ERR_NOMEM;
    rx->cfg = *config;
    rx->pool = pool;
    rx->link = link;
    rx->clock = *clock;
    rx->grid = kvs_grid_tokens(config->geo.chunk_tokens, config->geo.page_size);
    rx->dcp = kvs_pd_geometry_dcp_of(&config->geo, config->rank);
    rx->rank_grid = rx->grid / kvs_pd_geometry_dcp(&config->geo);
    for (uint32_t s = 0; s < kvs_pd_geometry_pp(&config->geo); s++)
        rx->stage_shapes[s] =
            kvs_pp_stage_shape(&config->geo.shape, kvs_pd_geometry_pp(&config->geo), s);
    kvs_map_init(&rx->rooms);
    kvs_map_init(&rx->serials);
    kvs_map_init(&rx->early);
    st = pc->mem == KVS_MEM_DEVICE ? kvs_copy_cuda_create(pc->device, &rx->copy)
                                   : kvs_copy_cpu_create(&rx->copy);
    if (st != KVS_OK) goto err_free;
    st = kvs_ring_create(config->ring_bytes, &rx->ring);
    if (st != KVS_OK) goto err_copy;
    void *ring_mem = NULL;
    st = KVS_ERR_UNSUPPORTED;
    /* A host ring the link allocates can be mapped by writers on this host (direct writes). */
    if (pc->mem == KVS_MEM_HOST && link->ops->ring_alloc != NULL) {
        st = link->ops->ring_alloc(link->ctx, config->ring_bytes, &ring_mem);
        rx->ring_from_link = st == KVS_OK;
    }
    if (st != KVS_OK) st = kvs_mem_alloc(pc->mem, pc->device, config->ring_bytes, &ring_mem);
    if (st != KVS_OK) goto err_ring;
    rx->ring_mem = ring_mem;
    st = link->ops->expose(link->ctx, rx->ring_mem, config->ring_bytes);
    if (st != KVS_OK) goto err_mem;
    rx->m.ring_capacity = config->ring_bytes;
    *receiver_p = rx;
    return KVS_OK;

err_mem:
    free_ring(rx);
err_ring:
    kvs_ring_destroy(rx->ring);
err_copy:
    kvs_copy_backend_destroy(&rx->copy);
err_free:
    kvs_free(rx);
    return st;
}

static void room_free(rroom_t *r)
{
    kvs_free(r->sums);
    kvs_free(r->chunks);
    kvs_free(r);
}

void kvs_receiver_destroy(kvs_receiver_t *rx)
{
    if (rx == NULL) return;
    void *v;
    for (size_t it = 0; kvs_map_next(&rx->rooms, &it, NULL, &v);) room_free(v);
    kvs_map_fini(&rx->rooms);
    kvs_map_fini(&rx->serials);
    for (size_t it = 0; kvs_map_next(&rx->early, &it, NULL, &v);) kvs_free(v);
    kvs_map_fini(&rx->early);
    kvs_ring_destroy(rx->ring);
    kvs_copy_backend_destroy(&rx->copy); /* drains scatters still reading the ring */
    /* Withdraw the ring from writers (the link unregisters it) before its memory goes. */
    (void) rx->link->ops->expose(rx->link->ctx, NULL, 0);
    free_ring(rx);
    kvs_free(rx);
}

/* ---- sending ---- */

static void send_meta(kvs_receiver_t *rx, const rroom_t *r, uint32_t peer)
{
    kvs_msg_t msg = {.type = KVS_MSG_ROOM_META};
    msg.u.room_meta = (kvs_msg_room_meta_t){
        .room = r->id,
        .decode_rank = rx->cfg.rank,
        .decode_tp = rx->cfg.geo.decode_tp,
        .base = r->base,
        .prompt_len = r->prompt_len,
        .total_pages = r->total_pages,
        .grid_tokens = rx->grid,
    };
    kvs_pd_send(rx->link, &rx->m, peer, &msg);
}

static void send_grant(kvs_receiver_t *rx, const rroom_t *r, uint64_t chunk, uint32_t peer)
{
    kvs_msg_t msg = {.type = KVS_MSG_STAGING_GRANT};
    msg.u.staging_grant = (kvs_msg_staging_grant_t){
        .room = r->id,
        .chunk = (uint32_t) chunk,
        .decode_rank = rx->cfg.rank,
        .offset = r->chunks[chunk].offset,
        .size = r->chunks[chunk].size,
    };
    kvs_pd_send(rx->link, &rx->m, peer, &msg);
}

static void send_ack(kvs_receiver_t *rx, uint64_t room, kvs_msg_type_t type, uint32_t chunk,
                     uint32_t writer, uint32_t peer)
{
    kvs_msg_t msg = {.type = KVS_MSG_ACK};
    msg.u.ack = (kvs_msg_ack_t){
        .room = room,
        .acked_type = (uint16_t) type,
        .chunk = chunk,
        .writer = writer,
        .from_rank = rx->cfg.rank,
        .to_rank = peer,
    };
    kvs_pd_send(rx->link, &rx->m, peer, &msg);
}

static void send_abort(kvs_receiver_t *rx, const rroom_t *r, uint32_t peer)
{
    kvs_msg_t msg = {.type = KVS_MSG_ABORT};
    msg.u.abort = (kvs_msg_abort_t){
        .room = r->id,
        .from_rank = rx->cfg.rank,
        .to_rank = peer,
        .reason = r->reason,
    };
    kvs_pd_send(rx->link, &rx->m, peer, &msg);
}

static void send_queued(kvs_receiver_t *rx, const rroom_t *r, uint32_t chunk, uint32_t peer)
{
    kvs_ring_stats_t rs;
    kvs_ring_stats(rx->ring, &rs);
    kvs_msg_t msg = {.type = KVS_MSG_STAGING_QUEUED};
    msg.u.staging_queued = (kvs_msg_staging_queued_t){
        .room = r->id,
        .chunk = chunk,
        .decode_rank = rx->cfg.rank,
        .queued = (uint32_t) (rs.queued > UINT32_MAX ? UINT32_MAX : rs.queued),
    };
    kvs_pd_send(rx->link, &rx->m, peer, &msg);
}

/* ---- grants (protocol.md §5.2: a grant is resent until its writer confirms it) ---- */

static int writer_rank_index(const rroom_t *r, uint32_t prefill_rank)
{
    return kvs_pd_rank_index(r->writer_ranks, r->nwriter_ranks, prefill_rank);
}

static void arm_grant_retry(kvs_receiver_t *rx, rroom_t *r, rchunk_t *c, uint64_t now)
{
    c->grant_retry_at =
        now + kvs_pd_backoff(rx->srtt_ns, rx->cfg.timeouts.retry_ns, c->grant_tries);
    if (r->unacked_grants == 0 || c->grant_retry_at < r->next_grant_retry)
        r->next_grant_retry = c->grant_retry_at;
}

/* Writer rank i holds chunk c's grant: it acknowledged it or wrote the chunk. */
static void grant_confirmed(rroom_t *r, rchunk_t *c, int i)
{
    if (i < 0 || (c->grant_acked & KVS_BIT(i))) return;
    c->grant_acked |= KVS_BIT(i);
    if (c->grant_acked == kvs_all_bits(r->nwriter_ranks)) r->unacked_grants--;
}

/* Resends the grants no writer rank confirmed within their retry time. */
static void retry_grants(kvs_receiver_t *rx, rroom_t *r, uint64_t now)
{
    if (r->unacked_grants == 0 || now < r->next_grant_retry) return;
    uint64_t next = UINT64_MAX;
    for (uint64_t k = 0; k < r->nchunks; k++) {
        rchunk_t *c = &r->chunks[k];
        uint64_t all = kvs_all_bits(r->nwriter_ranks);
        if (c->state != RCH_GRANTED || c->grant_acked == all) continue;
        if (now >= c->grant_retry_at) {
            for (uint32_t i = 0; i < r->nwriter_ranks; i++) {
                if (c->grant_acked & KVS_BIT(i)) continue;
                send_grant(rx, r, k, r->writer_ranks[i]);
                rx->m.retries++;
            }
            c->grant_tries++;
            c->grant_retry_at =
                now + kvs_pd_backoff(rx->srtt_ns, rx->cfg.timeouts.retry_ns, c->grant_tries);
        }
        if (c->grant_retry_at < next) next = c->grant_retry_at;
    }
    r->next_grant_retry = next;
}

/* ---- slots and chunks ---- */

/* Pages and slots count this rank's own tokens, at their local positions (protocol.md §1: all
 * of them without DCP). */
static uint64_t chunk_pages(const kvs_receiver_t *rx, const rroom_t *r, uint64_t chunk)
{
    return kvs_grid_chunk_pages(chunk, r->total_pages, rx->rank_grid, rx->cfg.geo.page_size);
}

/* Tokens in a chunk's slot: its pages' tokens, up to where the prefill pages end too
 * (protocol.md §1). */
static uint64_t chunk_tokens(const kvs_receiver_t *rx, const rroom_t *r, uint64_t chunk)
{
    const kvs_pd_geometry_t *g = &rx->cfg.geo;
    return kvs_grid_rank_slot_tokens(chunk, r->prompt_len, r->base, rx->grid, g->page_size,
                                     kvs_pd_geometry_page(g, KVS_SIDE_PREFILL), &rx->dcp);
}

static uint64_t slot_bytes(const kvs_receiver_t *rx, const rroom_t *r, uint64_t chunk,
                           uint64_t *offsets_p)
{
    return kvs_slot_layout(r->writers, r->nwriters, chunk_tokens(rx, r, chunk), offsets_p);
}

static void free_slot(kvs_receiver_t *rx, rroom_t *r, rchunk_t *c)
{
    if (kvs_ring_free(rx->ring, c->offset) != KVS_OK)
        kvs_error("room %llu: freeing slot at %llu failed", (unsigned long long) r->id,
                  (unsigned long long) c->offset);
}

/* Starts the scatter of a chunk whose writers all arrived. */
static kvs_status_t start_scatter(kvs_receiver_t *rx, rroom_t *r, uint64_t chunk)
{
    rchunk_t *c = &r->chunks[chunk];
    uint64_t offsets[KVS_MAX_WRITERS];
    uint64_t npages = chunk_pages(rx, r, chunk);
    uint64_t tokens = chunk_tokens(rx, r, chunk);
    slot_bytes(rx, r, chunk, offsets);
    /* The writes completed before their CHUNK_READY was sent; make them visible here. */
    kvs_status_t st = rx->link->ops->flush(rx->link->ctx);
    if (st != KVS_OK) return st;
    uint64_t t0 = kvs_now_ns();
    const uint64_t F = rx->rank_grid / rx->cfg.geo.page_size;
    kvs_copy_desc_t descs[KVS_MAX_WRITERS];
    for (uint32_t w = 0; w < r->nwriters; w++) {
        /* into the layers of the writer's stage */
        const kvs_kv_shape_t *shape = &rx->stage_shapes[r->writers[w].stage];
        descs[w] = (kvs_copy_desc_t){
            .regions = kvs_pool_region(rx->pool, r->writers[w].first_layer, 0),
            .layers = shape->layers,
            .components = kvs_kv_shape_components(shape),
            .shape = shape,
            /* lands at local token base/N + chunk*F*P: base and G are N*P multiples */
            .pages = r->pages + chunk * F,
            .npages = (uint32_t) npages,
            .page_size = rx->cfg.geo.page_size,
            .tokens = tokens, /* from the first page's start: base and G are page multiples */
            .pool_head = r->writers[w].dst_head,
            .heads = r->writers[w].heads,
            .pool_pages = kvs_pool_total_pages(rx->pool),
            .region = rx->ring_mem + c->offset + offsets[w],
            .region_bytes = c->size - offsets[w],
            /* summed from the ring's bytes as the scatter reads them; compared once it is done */
            .checksum = r->sums ? &r->sums[(chunk * r->nwriters + w) * 2 + 1] : NULL,
        };
    }
    /* one launch for every writer's region where the backend can: their tails overlap */
    st = kvs_copy_submit_batch(&rx->copy, KVS_COPY_SCATTER, descs, r->nwriters, &c->ticket);
    rx->m.data_ns += kvs_now_ns() - t0;
    if (st != KVS_OK) return st;
    for (uint32_t w = 0; w < r->nwriters; w++)
        rx->m.bytes += tokens * r->writers[w].bytes_per_token;
    KVS_PD_TRACE("decode rank %u: room %llu chunk %llu: scatter started (%llu tokens)",
                 rx->cfg.rank, (unsigned long long) r->id, (unsigned long long) chunk,
                 (unsigned long long) tokens);
    c->state = RCH_SCATTERING;
    r->scattering++;
    rx->scattering++;
    return KVS_OK;
}

/* ---- room lifecycle ---- */

static void set_quiescent(kvs_receiver_t *rx, rroom_t *r)
{
    /* Quarantine is over: nothing can write into the room's slots any more. */
    for (uint64_t k = 0; k < r->nchunks; k++) {
        rchunk_t *c = &r->chunks[k];
        if (c->state == RCH_GRANTED) {
            free_slot(rx, r, c);
            c->state = RCH_DONE;
        }
    }
    r->quiescent = 1;
}

static void fail_room(kvs_receiver_t *rx, rroom_t *r, kvs_status_t reason, const char *why)
{
    if (r->status == KVS_ROOM_FAILED || r->status == KVS_ROOM_SUCCESS) return;
    kvs_warn("decode rank %u: room %llu failed: %s (%s)", rx->cfg.rank, (unsigned long long) r->id,
             why, kvs_status_str(reason));
    r->status = KVS_ROOM_FAILED;
    r->reason = reason;
    r->failed_at = now_ns(rx);
    rx->m.rooms_failed++;
    for (uint64_t k = 0; k < r->nchunks; k++) {
        rchunk_t *c = &r->chunks[k];
        if (c->state == RCH_QUEUED) {
            kvs_ring_cancel(rx->ring, cookie_of(r, k));
            c->state = RCH_NONE;
        }
    }
    /* Peers that already reported a status have nothing in flight; the others must confirm
     * before the slots and pages may be reused. */
    r->abort_acked = r->status_seen;
    for (uint32_t i = 0; i < r->npeers; i++)
        if (!(r->abort_acked & KVS_BIT(i))) send_abort(rx, r, r->peers[i]);
    r->next_retry = now_ns(rx) + kvs_pd_rto(rx->srtt_ns, rx->cfg.timeouts.retry_ns);
}

static void check_room(kvs_receiver_t *rx, rroom_t *r)
{
    uint64_t all = kvs_all_bits(r->npeers);
    if (r->status == KVS_ROOM_FAILED) {
        if (!r->quiescent && r->scattering == 0 && r->abort_acked == all) set_quiescent(rx, r);
        return;
    }
    if (r->status == KVS_ROOM_SUCCESS) return;
    if (r->status == KVS_ROOM_BOOTSTRAPPING && r->meta_acked == all) r->status = KVS_ROOM_WAITING;
    /* The completion timeout runs once only scatters are left: every peer's Success and every
     * chunk's regions in (a STATUS may overtake the last CHUNK_READY). */
    if (r->status_ok == all && r->chunks_in == r->nchunks && r->all_success_at == 0)
        r->all_success_at = now_ns(rx);
    if (r->status_ok == all && r->chunks_done == r->nchunks) {
        r->status = KVS_ROOM_SUCCESS;
        r->quiescent = 1;
        rx->m.rooms_succeeded++;
        KVS_PD_TRACE("decode rank %u: room %llu: success", rx->cfg.rank,
                     (unsigned long long) r->id);
    }
}

kvs_status_t kvs_receiver_add_room(kvs_receiver_t *rx, uint64_t room, uint64_t base,
                                   uint64_t prompt_len, const uint32_t *delta_pages)
{
    if (kvs_map_get(&rx->rooms, room) != NULL) {
        kvs_error("decode rank %u: room %llu already exists", rx->cfg.rank,
                  (unsigned long long) room);
        return KVS_ERR_STATE;
    }
    const uint64_t P = rx->cfg.geo.page_size;
    if (base > prompt_len) {
        kvs_error("room %llu: decode prefix %llu exceeds the prompt length %llu",
                  (unsigned long long) room, (unsigned long long) base,
                  (unsigned long long) prompt_len);
        return KVS_ERR_INVALID;
    }
    const kvs_pd_geometry_t *g = &rx->cfg.geo;
    uint64_t total_pages = kvs_grid_rank_total_pages(
        prompt_len, base, P, kvs_pd_geometry_page(g, KVS_SIDE_PREFILL), &rx->dcp);
    if (total_pages > 0 && delta_pages == NULL) {
        kvs_error("room %llu: %llu delta pages needed but none given", (unsigned long long) room,
                  (unsigned long long) total_pages);
        return KVS_ERR_INVALID;
    }
    uint64_t nchunks = kvs_grid_chunk_count(total_pages, rx->rank_grid, P);
    if (nchunks >= (1ull << COOKIE_CHUNK_BITS)) {
        kvs_error("room %llu: %llu chunks is more than supported", (unsigned long long) room,
                  (unsigned long long) nchunks);
        return KVS_ERR_INVALID;
    }
    rroom_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) return KVS_ERR_NOMEM;
    r->chunks = nchunks ? kvs_calloc(nchunks, sizeof(*r->chunks)) : NULL;
    if (nchunks && r->chunks == NULL) {
        kvs_free(r);
        return KVS_ERR_NOMEM;
    }
    r->id = room;
    r->serial = ++rx->next_serial;
    r->base = base;
    r->prompt_len = prompt_len;
    r->total_pages = total_pages;
    r->nchunks = nchunks;
    r->pages = delta_pages;
    r->status = KVS_ROOM_BOOTSTRAPPING;
    kvs_status_t st = kvs_plan_geo_writers(g, rx->cfg.rank, room, r->writers, &r->nwriters);
    if (st == KVS_OK) st = kvs_plan_geo_peers(g, rx->cfg.rank, r->peers, &r->npeers);
    if (st == KVS_OK && !g->no_checksum && nchunks > 0) {
        r->sums = kvs_calloc(nchunks * r->nwriters * 2, sizeof(uint64_t));
        if (r->sums == NULL) st = KVS_ERR_NOMEM;
    }
    if (st != KVS_OK) {
        room_free(r);
        return st;
    }
    for (uint32_t w = 0; w < r->nwriters; w++) {
        uint32_t p = r->writers[w].prefill_rank;
        if (kvs_pd_rank_index(r->writer_ranks, r->nwriter_ranks, p) < 0)
            r->writer_ranks[r->nwriter_ranks++] = p;
    }
    /* Registered before any prefill rank hears of it (protocol.md §3.2). */
    if ((st = kvs_map_put(&rx->rooms, room, r)) != KVS_OK) {
        room_free(r);
        return st;
    }
    if ((st = kvs_map_put(&rx->serials, r->serial, r)) != KVS_OK) {
        kvs_map_remove(&rx->rooms, room);
        room_free(r);
        return st;
    }
    rx->m.rooms_added++;
    r->meta_sent_at = now_ns(rx);
    const uint64_t unit = kvs_pd_geometry_unit(g);
    if (base % unit != 0) {
        /* The room fails; the process and every other room live on. */
        if (unit != P)
            kvs_error("room %llu: decode prefix %llu is not a multiple of decode DCP %u x page "
                      "size %llu = %llu",
                      (unsigned long long) room, (unsigned long long) base, rx->dcp.size,
                      (unsigned long long) P, (unsigned long long) unit);
        else
            kvs_error("room %llu: decode prefix %llu is not a multiple of the page size %llu",
                      (unsigned long long) room, (unsigned long long) base, (unsigned long long) P);
        fail_room(rx, r, KVS_ERR_INVALID, "misaligned decode prefix");
        return KVS_OK;
    }
    early_fail_t *early = kvs_map_remove(&rx->early, room);
    if (early != NULL) {
        fail_room(rx, r, early->reason, "a prefill rank failed it before it was added");
        kvs_free(early);
        return KVS_OK;
    }
    for (uint32_t i = 0; i < r->npeers; i++) send_meta(rx, r, r->peers[i]);
    r->next_retry = r->meta_sent_at + kvs_pd_rto(rx->srtt_ns, rx->cfg.timeouts.retry_ns);
    return KVS_OK;
}

kvs_status_t kvs_receiver_abort(kvs_receiver_t *rx, uint64_t room)
{
    rroom_t *r = kvs_map_get(&rx->rooms, room);
    if (r == NULL) return KVS_ERR_NOT_FOUND;
    fail_room(rx, r, KVS_ERR_ABORTED, "aborted by the engine");
    check_room(rx, r);
    return KVS_OK;
}

kvs_status_t kvs_receiver_poll(kvs_receiver_t *rx, uint64_t room, kvs_room_info_t *info_p)
{
    rroom_t *r = kvs_map_get(&rx->rooms, room);
    if (r == NULL) return KVS_ERR_NOT_FOUND;
    memset(info_p, 0, sizeof(*info_p));
    info_p->status = r->status;
    info_p->reason = r->reason;
    info_p->quiescent = r->quiescent;
    info_p->final_len = r->final_len;
    memcpy(info_p->final, r->final, r->final_len);
    return KVS_OK;
}

kvs_status_t kvs_receiver_release(kvs_receiver_t *rx, uint64_t room)
{
    rroom_t *r = kvs_map_get(&rx->rooms, room);
    if (r == NULL) return KVS_ERR_NOT_FOUND;
    if (!r->quiescent || (r->status != KVS_ROOM_SUCCESS && r->status != KVS_ROOM_FAILED)) {
        kvs_error("room %llu: release before it concluded (%s%s)", (unsigned long long) room,
                  kvs_room_status_str(r->status), r->quiescent ? "" : ", not quiescent");
        return KVS_ERR_STATE;
    }
    kvs_map_remove(&rx->rooms, room);
    kvs_map_remove(&rx->serials, r->serial);
    room_free(r);
    return KVS_OK;
}

/* ---- message handlers ---- */

static rroom_t *room_for(kvs_receiver_t *rx, uint64_t room)
{
    rroom_t *r = kvs_map_get(&rx->rooms, room);
    if (r == NULL) rx->m.ignored++;
    return r;
}

static void on_staging_req(kvs_receiver_t *rx, const kvs_msg_staging_req_t *q)
{
    rroom_t *r = room_for(rx, q->room);
    if (r == NULL) return;
    int w = -1;
    for (uint32_t i = 0; i < r->nwriters && w < 0; i++)
        if (r->writers[i].prefill_rank == q->prefill_rank) w = (int) i;
    if (q->chunk >= r->nchunks || w < 0) {
        rx->m.rejected++;
        kvs_warn("room %llu: STAGING_REQ for chunk %u from prefill rank %u does not fit the "
                 "room (%llu chunks)",
                 (unsigned long long) q->room, q->chunk, q->prefill_rank,
                 (unsigned long long) r->nchunks);
        return;
    }
    if (r->status == KVS_ROOM_FAILED) {
        rx->m.ignored++;
        return;
    }
    rchunk_t *c = &r->chunks[q->chunk];
    uint64_t want = slot_bytes(rx, r, q->chunk, NULL);
    if (q->slot_bytes != want) {
        fail_room(rx, r, KVS_ERR_PROTOCOL, "prefill and decode disagree on the slot size");
        return;
    }
    switch (c->state) {
    case RCH_NONE: {
        kvs_status_t st = kvs_ring_enqueue(rx->ring, want, cookie_of(r, q->chunk));
        if (st == KVS_ERR_NOSPACE) {
            kvs_error("room %llu: chunk %u needs a %llu-byte slot, larger than the %llu-byte "
                      "ring",
                      (unsigned long long) r->id, q->chunk, (unsigned long long) want,
                      (unsigned long long) rx->cfg.ring_bytes);
            fail_room(rx, r, KVS_ERR_NOSPACE, "slot larger than the staging ring");
        } else if (st != KVS_OK) {
            fail_room(rx, r, st, "cannot queue a staging request");
        } else {
            c->state = RCH_QUEUED;
            grant_slots(rx); /* granted at once when the ring has room */
            if (c->state == RCH_QUEUED) send_queued(rx, r, q->chunk, q->prefill_rank);
        }
        break;
    }
    case RCH_GRANTED:
        /* The grant went to every writer when it was made and is resent until confirmed; a
         * request from a writer that has not confirmed it gets it again now. */
        if (!(c->grant_acked & KVS_BIT(writer_rank_index(r, q->prefill_rank))))
            send_grant(rx, r, q->chunk, q->prefill_rank);
        break;
    case RCH_QUEUED:
        /* The QUEUED answer was lost (or the writer's long wait ran out): answer again. */
        send_queued(rx, r, q->chunk, q->prefill_rank);
        break;
    default:
        rx->m.ignored++; /* late, after the scatter */
        break;
    }
}

static void on_chunk_ready(kvs_receiver_t *rx, const kvs_msg_chunk_ready_t *cr)
{
    rroom_t *r = room_for(rx, cr->room);
    if (r == NULL) {
        /* Unknown (e.g. already released) room: acknowledge so the writer stops resending. */
        send_ack(rx, cr->room, KVS_MSG_CHUNK_READY, cr->chunk, cr->writer, cr->prefill_rank);
        return;
    }
    const uint64_t F = rx->rank_grid / rx->cfg.geo.page_size;
    if (cr->chunk >= r->nchunks || cr->writer >= r->nwriters ||
        r->writers[cr->writer].prefill_rank != cr->prefill_rank) {
        rx->m.rejected++;
        kvs_warn("room %llu: CHUNK_READY chunk %u writer %u from prefill rank %u does not fit",
                 (unsigned long long) cr->room, cr->chunk, cr->writer, cr->prefill_rank);
        return;
    }
    rchunk_t *c = &r->chunks[cr->chunk];
    uint64_t npages = chunk_pages(rx, r, cr->chunk);
    uint64_t bytes = chunk_tokens(rx, r, cr->chunk) * r->writers[cr->writer].bytes_per_token;
    send_ack(rx, cr->room, KVS_MSG_CHUNK_READY, cr->chunk, cr->writer, cr->prefill_rank);
    if (r->status == KVS_ROOM_FAILED || c->state == RCH_SCATTERING || c->state == RCH_DONE ||
        (c->arrived & KVS_BIT(cr->writer))) {
        rx->m.ignored++; /* late or duplicate: never scatter twice */
        return;
    }
    if (cr->suffix_page_start != cr->chunk * F || cr->pages != npages || cr->bytes != bytes) {
        fail_room(rx, r, KVS_ERR_PROTOCOL, "CHUNK_READY geometry does not match the room");
        return;
    }
    if (c->state != RCH_GRANTED) {
        fail_room(rx, r, KVS_ERR_PROTOCOL, "CHUNK_READY for a chunk that has no slot");
        return;
    }
    c->arrived |= KVS_BIT(cr->writer);
    if (r->sums) r->sums[(cr->chunk * r->nwriters + cr->writer) * 2] = cr->checksum;
    grant_confirmed(r, c, writer_rank_index(r, cr->prefill_rank));
    if (c->arrived == kvs_all_bits(r->nwriters)) {
        r->chunks_in++;
        kvs_status_t st = start_scatter(rx, r, cr->chunk);
        if (st != KVS_OK) fail_room(rx, r, st, "scatter failed to start");
    }
    if (r->status == KVS_ROOM_WAITING || r->status == KVS_ROOM_BOOTSTRAPPING)
        r->status = KVS_ROOM_TRANSFERRING;
}

static void on_status(kvs_receiver_t *rx, const kvs_msg_status_t *s)
{
    rroom_t *r = room_for(rx, s->room);
    send_ack(rx, s->room, KVS_MSG_STATUS, 0, 0, s->prefill_rank);
    if (r == NULL) {
        if (s->status == KVS_ROOM_FAILED && kvs_map_get(&rx->early, s->room) == NULL) {
            early_fail_t *e = kvs_malloc(sizeof(*e));
            if (e == NULL) return;
            e->reason = s->reason != KVS_OK ? (kvs_status_t) s->reason : KVS_ERR_ABORTED;
            e->expires_at = now_ns(rx) + rx->cfg.timeouts.waiting_timeout_ns;
            if (kvs_map_put(&rx->early, s->room, e) != KVS_OK) kvs_free(e);
        }
        return;
    }
    int i = kvs_pd_rank_index(r->peers, r->npeers, s->prefill_rank);
    if (i < 0) {
        rx->m.rejected++;
        kvs_warn("room %llu: STATUS from prefill rank %u, which is not a peer",
                 (unsigned long long) s->room, s->prefill_rank);
        return;
    }
    if (r->status_seen & KVS_BIT(i)) {
        rx->m.ignored++;
        return;
    }
    r->status_seen |= KVS_BIT(i);
    r->meta_acked |= KVS_BIT(i); /* a status implies the metadata arrived */
    if (s->status == KVS_ROOM_FAILED) {
        if (r->status == KVS_ROOM_FAILED) r->abort_acked |= KVS_BIT(i);
        fail_room(rx, r, s->reason != KVS_OK ? (kvs_status_t) s->reason : KVS_ERR_ABORTED,
                  "a prefill rank reported Failed");
        return;
    }
    r->status_ok |= KVS_BIT(i);
    if (r->final_len == 0 && s->final_len > 0) {
        r->final_len = s->final_len;
        memcpy(r->final, s->final, s->final_len);
    }
}

static void on_ack(kvs_receiver_t *rx, const kvs_msg_ack_t *a)
{
    rroom_t *r = room_for(rx, a->room);
    if (r == NULL) return;
    if (a->acked_type == KVS_MSG_STAGING_GRANT) {
        int w = writer_rank_index(r, a->from_rank);
        if (w < 0 || a->chunk >= r->nchunks) {
            rx->m.rejected++;
            return;
        }
        rchunk_t *c = &r->chunks[a->chunk];
        if (c->state == RCH_GRANTED && c->grant_tries == 0 && !(c->grant_acked & KVS_BIT(w)))
            kvs_pd_rtt_sample(&rx->srtt_ns, now_ns(rx) - c->grant_sent_at);
        if (c->state == RCH_GRANTED)
            grant_confirmed(r, c, w);
        else
            rx->m.ignored++; /* a late ACK: the chunk moved on */
        return;
    }
    int i = kvs_pd_rank_index(r->peers, r->npeers, a->from_rank);
    if (a->acked_type != KVS_MSG_ROOM_META || i < 0) {
        rx->m.rejected++;
        return;
    }
    if (!r->meta_resent && !(r->meta_acked & KVS_BIT(i)))
        kvs_pd_rtt_sample(&rx->srtt_ns, now_ns(rx) - r->meta_sent_at);
    r->meta_acked |= KVS_BIT(i);
}

static void on_abort_ack(kvs_receiver_t *rx, const kvs_msg_abort_t *a)
{
    rroom_t *r = room_for(rx, a->room);
    if (r == NULL) return;
    int i = kvs_pd_rank_index(r->peers, r->npeers, a->from_rank);
    if (i < 0) {
        rx->m.rejected++;
        return;
    }
    if (r->status == KVS_ROOM_FAILED) r->abort_acked |= KVS_BIT(i);
}

static void handle(kvs_receiver_t *rx, const kvs_msg_t *msg)
{
    switch (msg->type) {
    case KVS_MSG_STAGING_REQ:
        on_staging_req(rx, &msg->u.staging_req);
        break;
    case KVS_MSG_CHUNK_READY:
        on_chunk_ready(rx, &msg->u.chunk_ready);
        break;
    case KVS_MSG_STATUS:
        on_status(rx, &msg->u.status);
        break;
    case KVS_MSG_ACK:
        on_ack(rx, &msg->u.ack);
        break;
    case KVS_MSG_ABORT_ACK:
        on_abort_ack(rx, &msg->u.abort);
        break;
    default:
        rx->m.rejected++;
        kvs_warn("decode rank %u: unexpected %s message", rx->cfg.rank,
                 kvs_msg_type_str(msg->type));
        return;
    }
}

static int msg_to_me(const kvs_receiver_t *rx, const kvs_msg_t *msg)
{
    switch (msg->type) {
    case KVS_MSG_STAGING_REQ:
        return msg->u.staging_req.decode_rank == rx->cfg.rank;
    case KVS_MSG_CHUNK_READY:
        return msg->u.chunk_ready.decode_rank == rx->cfg.rank;
    case KVS_MSG_STATUS:
        return msg->u.status.decode_rank == rx->cfg.rank;
    case KVS_MSG_ACK:
        return msg->u.ack.to_rank == rx->cfg.rank;
    case KVS_MSG_ABORT_ACK:
        return msg->u.abort.to_rank == rx->cfg.rank;
    default:
        return 1;
    }
}

/* ---- progress ---- */

static uint32_t grant_slots(kvs_receiver_t *rx)
{
    uint32_t n = 0;
    uint64_t cookie, offset, size;
    while (kvs_ring_grant(rx->ring, &cookie, &offset, &size) == KVS_OK) {
        rroom_t *r = kvs_map_get(&rx->serials, cookie >> COOKIE_CHUNK_BITS);
        uint64_t chunk = cookie & ((1ull << COOKIE_CHUNK_BITS) - 1);
        n++;
        if (r == NULL || chunk >= r->nchunks || r->chunks[chunk].state != RCH_QUEUED) {
            /* Cannot happen: failed rooms cancel their queued requests. */
            kvs_error("ring granted an unknown request %llx", (unsigned long long) cookie);
            kvs_ring_free(rx->ring, offset);
            continue;
        }
        rchunk_t *c = &r->chunks[chunk];
        c->state = RCH_GRANTED;
        c->offset = offset;
        c->size = size;
        /* Every writer of the chunk gets the grant, requested yet or not, and it is resent
         * until each confirms it: a writer that has not asked yet may not ask for a long time
         * (its window can wait on another decode rank), so its request cannot be what
         * recovers a lost grant. */
        for (uint32_t i = 0; i < r->nwriter_ranks; i++)
            send_grant(rx, r, chunk, r->writer_ranks[i]);
        c->grant_acked = 0;
        c->grant_tries = 0;
        c->grant_sent_at = now_ns(rx);
        arm_grant_retry(rx, r, c, now_ns(rx));
        r->unacked_grants++;
    }
    return n;
}

/* Compares each writer's checksum with the one the scatter computed over the ring's bytes; a
 * mismatch fails the room (its pages are never handed on) and names the chunk and writer. */
static void verify_chunk(kvs_receiver_t *rx, rroom_t *r, uint64_t chunk)
{
    if (r->sums == NULL || r->status == KVS_ROOM_FAILED) return;
    for (uint32_t w = 0; w < r->nwriters; w++) {
        const uint64_t *s = &r->sums[(chunk * r->nwriters + w) * 2];
        if (s[0] == s[1]) continue;
        rx->m.checksum_failures++;
        char why[160];
        snprintf(why, sizeof(why),
                 "chunk %llu from writer %u (prefill rank %u) failed its checksum (sent %016llx, "
                 "found %016llx in the ring)",
                 (unsigned long long) chunk, w, r->writers[w].prefill_rank,
                 (unsigned long long) s[0], (unsigned long long) s[1]);
        fail_room(rx, r, KVS_ERR_CORRUPT, why);
    }
}

static uint32_t finish_scatters(kvs_receiver_t *rx, rroom_t *r)
{
    uint32_t n = 0;
    for (uint64_t k = 0; k < r->nchunks && r->scattering > 0; k++) {
        rchunk_t *c = &r->chunks[k];
        if (c->state != RCH_SCATTERING) continue;
        const kvs_status_t st = kvs_copy_poll(&rx->copy, c->ticket);
        if (st == KVS_INPROGRESS) continue;
        r->scattering--;
        rx->scattering--;
        n++;
        if (st != KVS_OK) {
            /* The copy is over, its bytes are not trustworthy: the room fails and the slot
             * stays quarantined with the others (set_quiescent frees it). */
            c->state = RCH_GRANTED;
            char why[96];
            snprintf(why, sizeof(why), "the scatter of chunk %llu failed", (unsigned long long) k);
            fail_room(rx, r, st, why);
            continue;
        }
        KVS_PD_TRACE("decode rank %u: room %llu chunk %llu: scatter done", rx->cfg.rank,
                     (unsigned long long) r->id, (unsigned long long) k);
        verify_chunk(rx, r, k);
        if (r->status == KVS_ROOM_FAILED) {
            /* Keep the slot quarantined until the peers confirm; set_quiescent frees it. */
            c->state = RCH_GRANTED;
            continue;
        }
        free_slot(rx, r, c);
        c->state = RCH_DONE;
        r->chunks_done++;
        rx->m.chunks++;
    }
    return n;
}

/* The peers with nothing left to do for the room: their STATUS came and every region they
 * write has arrived (a STATUS Success may overtake the last CHUNK_READY: protocol.md §4.7). */
static uint64_t peers_through(const rroom_t *r)
{
    uint64_t through = r->status_seen;
    for (uint32_t w = 0; w < r->nwriters && through != 0; w++) {
        int i = kvs_pd_rank_index(r->peers, r->npeers, r->writers[w].prefill_rank);
        if (i < 0 || !(through & KVS_BIT(i))) continue;
        for (uint64_t k = 0; k < r->nchunks; k++) {
            const rchunk_t *c = &r->chunks[k];
            if (c->state != RCH_SCATTERING && c->state != RCH_DONE && !(c->arrived & KVS_BIT(w))) {
                through &= ~KVS_BIT(i);
                break;
            }
        }
    }
    return through;
}

static void run_timers(kvs_receiver_t *rx, rroom_t *r, uint64_t now)
{
    const kvs_pd_timeouts_t *t = &rx->cfg.timeouts;
    uint64_t all = kvs_all_bits(r->npeers);
    if (r->status == KVS_ROOM_FAILED) {
        if (r->quiescent) return;
        if (r->scattering == 0 && now - r->failed_at >= t->release_timeout_ns) {
            kvs_warn("room %llu: no ABORT_ACK from every prefill rank within the release "
                     "timeout; releasing its slots",
                     (unsigned long long) r->id);
            r->abort_acked = all;
        } else if (now >= r->next_retry) {
            for (uint32_t i = 0; i < r->npeers; i++) {
                if (r->abort_acked & KVS_BIT(i)) continue;
                send_abort(rx, r, r->peers[i]);
                rx->m.retries++;
            }
            r->next_retry = now + kvs_pd_rto(rx->srtt_ns, t->retry_ns);
        }
        return;
    }
    if (r->status == KVS_ROOM_SUCCESS) return;
    if (kvs_pd_dead_peer(rx->link, 0, r->peers, r->npeers, peers_through(r)) >= 0) {
        fail_room(rx, r, KVS_ERR_IO, "a prefill peer stopped answering (liveness timeout)");
        return;
    }
    if (now - r->meta_sent_at >= t->waiting_timeout_ns) {
        fail_room(rx, r, KVS_ERR_TIMEOUT, "waiting timeout");
        return;
    }
    if (r->all_success_at != 0 && now - r->all_success_at >= t->completion_timeout_ns) {
        fail_room(rx, r, KVS_ERR_TIMEOUT, "completion timeout");
        return;
    }
    retry_grants(rx, r, now);
    if (r->meta_acked != all && now >= r->next_retry) {
        for (uint32_t i = 0; i < r->npeers; i++) {
            if (r->meta_acked & KVS_BIT(i)) continue;
            send_meta(rx, r, r->peers[i]);
            rx->m.retries++;
        }
        r->meta_resent = 1;
        r->next_retry = now + kvs_pd_rto(rx->srtt_ns, t->retry_ns);
    }
}

uint32_t kvs_receiver_progress(kvs_receiver_t *rx)
{
    uint64_t t0 = kvs_now_ns();
    uint32_t events = 0;
    kvs_msg_t msg;
    while (kvs_pd_recv(rx->link, &rx->m, &msg, NULL) == KVS_OK) {
        events++;
        if (!msg_to_me(rx, &msg)) {
            rx->m.rejected++;
            continue;
        }
        handle(rx, &msg);
        /* Grant as requests come in, not after the pass: a CPU scatter started by a message
         * takes milliseconds, and writers waiting for a slot would idle through it. */
        events += grant_slots(rx);
    }
    events += grant_slots(rx);
    uint64_t now = now_ns(rx);
    void *v;
    for (size_t it = 0; kvs_map_next(&rx->rooms, &it, NULL, &v);) {
        rroom_t *r = v;
        if (r->scattering) events += finish_scatters(rx, r);
        run_timers(rx, r, now);
        check_room(rx, r);
    }
    uint64_t id;
    for (size_t it = 0; kvs_map_next(&rx->early, &it, &id, &v);) {
        if (now < ((early_fail_t *) v)->expires_at) continue;
        kvs_map_remove(&rx->early, id);
        kvs_free(v);
    }
    /* Slots freed above may let queued requests through. */
    events += grant_slots(rx);
    rx->m.progress_ns += kvs_now_ns() - t0;
    return events;
}

uint32_t kvs_receiver_copies_in_flight(const kvs_receiver_t *rx)
{
    return rx->scattering;
}

void kvs_receiver_metrics(const kvs_receiver_t *rx, kvs_pd_metrics_t *metrics_p)
{
    *metrics_p = rx->m;
    kvs_ring_stats_t rs;
    kvs_ring_stats(rx->ring, &rs);
    metrics_p->ring_used = rs.used_bytes;
    metrics_p->ring_high_water = rs.high_water_bytes;
    metrics_p->live_slots = rs.live_grants;
    metrics_p->live_rooms = rx->rooms.count;
    metrics_p->quarantined_rooms = 0;
    void *v;
    for (size_t it = 0; kvs_map_next(&rx->rooms, &it, NULL, &v);) {
        const rroom_t *r = v;
        metrics_p->quarantined_rooms += r->status == KVS_ROOM_FAILED && !r->quiescent;
    }
}

kvs_copy_backend_t *kvs__receiver_copy_backend(kvs_receiver_t *rx)
{
    return &rx->copy;
}
