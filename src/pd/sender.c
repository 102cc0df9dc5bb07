/* The prefill-side room state machine (protocol.md §4): waits for room metadata from every
 * decode peer, floors sends to the grid and splits them per slot, requests slots within a
 * bounded window, gathers each destination's head slice into a staging buffer, writes it into
 * the granted slot, announces it with CHUNK_READY, and reports STATUS. One sender per prefill
 * rank, driven by kvs_sender_progress(). Staging buffers and the copy backend follow the pool's
 * memory kind; where the link maps the decode ring, the gather can store straight into the
 * granted slot (direct write) and CHUNK_READY waits for that gather instead of a write.
 *
 * A room's decode ranks are those of one decode instance: the link's peer group that its first
 * ROOM_META (or ABORT) came from (transport/link.h), so a prefill rank serving several decode
 * instances at once addresses each room's peers as (instance, rank); a message about the room
 * from another group is not the room's and is ignored. Before that first message the room's peers
 * are group 0's: the one instance of a link with one group (as always), nobody on a link serving
 * several (group 0 never names an instance there), so a room failed that early is not held
 * for them (pump_room). */
#include <string.h>

#include "base/map.h"
#include "base/mem.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/grid.h"
#include "kvstage/log.h"
#include "pd/pd_internal.h"

typedef enum {
    SD_IDLE = 0,   /* nothing asked yet */
    SD_REQUESTED,  /* STAGING_REQ sent, waiting for the grant */
    SD_QUEUED,     /* decode answered that the request waits in its ring's queue */
    SD_GRANTED,    /* slot granted; waiting for the chunk's KV or a staging buffer */
    SD_WRITING,    /* gathered; the transport write reads the staging buffer */
    SD_WRITTEN,    /* written; CHUNK_READY held until the prompt is at rest (held()) */
    SD_READY_SENT, /* written; CHUNK_READY sent, waiting for its ACK */
    SD_DONE,
} sdest_state_t;

typedef struct {
    sdest_state_t state;
    uint64_t offset, size; /* the grant */
    uint64_t ticket;       /* transport write, or the gather of a direct write */
    int buffer;            /* staging buffer held while SD_WRITING; -1: a direct write */
    uint64_t retry_at;
    uint32_t tries;    /* resends of the current message, for the backoff */
    uint64_t checksum; /* of the region as gathered (protocol.md §5.5), for CHUNK_READY */
    uint64_t sent_at;  /* first send of the current message, for the round-trip time */
} sdest_t;

/* Room metadata from one decode rank, possibly before the engine added the room. */
typedef struct {
    uint64_t base, prompt_len, total_pages, grid;
} smeta_t;

/* Messages about rooms the engine has not added yet (protocol.md §3.2: decode registers first). */
typedef struct {
    uint32_t group;    /* the link's peer group of the decode instance (set by the first message) */
    uint64_t meta_got; /* bit per decode rank */
    uint64_t aborted;  /* bit per decode rank */
    kvs_status_t abort_reason; /* the first ABORT's */
    smeta_t meta[KVS_MAX_TP];
    uint64_t expires_at;
} sstash_t;

typedef struct {
    uint64_t id;
    uint64_t prompt_len;
    const uint32_t *page_table; /* [ceil(prompt_len / P)] engine-owned */
    kvs_room_status_t status;
    kvs_status_t reason;
    int grouped;    /* the decode instance is known (from a message of the room)... */
    uint32_t group; /* ...as this link peer group; 0 until then */
    kvs_dest_t dests[KVS_MAX_TP];
    uint32_t ndests;
    uint32_t dpeers[KVS_MAX_TP]; /* decode ranks exchanging metadata and status */
    uint32_t ndpeers;
    uint64_t meta_got;      /* bit per dpeer index */
    uint64_t aborted_by;    /* bit per dpeer index: sent ABORT, owed an ABORT_ACK */
    uint64_t status_acked;  /* bit per dpeer index */
    int status_sent;        /* our STATUS (Success or Failed) is out */
    uint64_t base, nchunks; /* chunks of the room's grid, G tokens each from base */
    uint64_t computed, scheduled;
    int finished;
    uint32_t final_len;
    uint8_t final[KVS_MSG_FINAL_MAX];
    uint64_t sent_upto;     /* absolute token: sub-sends issued for [base, sent_upto) */
    uint64_t chunks_issued; /* chunks [0, chunks_issued) have their KV at rest */
    uint64_t first_open;    /* lowest chunk not yet DONE for every destination */
    sdest_t *cd;            /* [nchunks][ndests] */
    uint32_t writing;       /* destinations in SD_WRITING */
    int drained_acked;      /* ABORT_ACKs sent once the writes drained */
    uint64_t added_at, failed_at, retry_at;
    uint64_t last_activity; /* last sign of life from decode while we wait on it */
} sroom_t;

struct kvs_sender {
    kvs_sender_config_t cfg;
    kvs_pool_t *pool;
    kvs_link_t *link;
    kvs_clock_t clock;
    kvs_copy_backend_t copy;
    kvs_kv_shape_t shape; /* of the layers this rank's stage holds: its pool's */
    uint64_t grid;
    uint64_t buffer_bytes; /* one writer region of a full slot, at most */
    uint8_t **buffers;     /* [staging_buffers][buffer_bytes], in the pool's memory kind; NULL
                              entries in direct mode */
    int *buffer_busy;
    kvs_map_t direct_ok; /* link peer id -> (void *) 1 once the copy backend's device
                            was found to reach its mapped ring */
    kvs_map_t rooms;     /* id -> sroom_t* */
    kvs_map_t stash;     /* id -> sstash_t* */
    kvs_pd_metrics_t m;
    uint32_t writing; /* writes started, not yet seen complete, over every room */
    uint64_t srtt_ns; /* smoothed round trip to the decode ranks (kvs_pd_rto) */
};

static uint64_t now_ns(const kvs_sender_t *tx)
{
    return kvs_clock_now(&tx->clock);
}

kvs_status_t kvs_sender_create(const kvs_sender_config_t *config, kvs_pool_t *pool,
                               kvs_link_t *link, const kvs_clock_t *clock, kvs_sender_t **sender_p)
{
    kvs_status_t st = kvs_pd_geometry_validate(&config->geo);
    if (st != KVS_OK) return st;
    const kvs_pool_config_t *pc = kvs_pool_config(pool);
    /* The pool holds this rank's heads of its stage's layers (protocol.md §2). */
    const uint32_t pp = kvs_pd_geometry_pp(&config->geo), tp = config->geo.prefill_tp;
    const uint32_t stage = config->rank / tp;
    const kvs_kv_shape_t shape = kvs_pp_stage_shape(&config->geo.shape, pp, stage % pp);
    if (config->rank >= pp * tp || pc->tp.tp_size != tp || pc->tp.tp_rank != config->rank % tp ||
        pc->page_size != kvs_pd_geometry_page(&config->geo, KVS_SIDE_PREFILL) ||
        memcmp(&pc->shape, &shape, sizeof(pc->shape)) != 0) {
        kvs_error("sender: prefill rank %u (stage %u of %u, TP rank %u of %u, %u layers) does "
                  "not match its pool (TP rank %u of %u, %u layers, page %u)",
                  config->rank, stage, pp, config->rank % tp, tp, shape.layers, pc->tp.tp_rank,
                  pc->tp.tp_size, pc->shape.layers, pc->page_size);
        return KVS_ERR_INVALID;
    }
    if (pc->mem == KVS_MEM_DEVICE &&
        (st = kvs_pd_geometry_check_device(&config->geo, KVS_SIDE_PREFILL)) != KVS_OK)
        return st;
    if (config->window_chunks == 0 || config->staging_buffers == 0) {
        kvs_error("sender: window_chunks and staging_buffers must be >= 1");
        return KVS_ERR_INVALID;
    }
    if ((unsigned) config->write_mode > KVS_WRITE_DIRECT) {
        kvs_error("sender: unknown write mode %d", (int) config->write_mode);
        return KVS_ERR_INVALID;
    }
    if (config->write_mode == KVS_WRITE_DIRECT && link->ops->map == NULL) {
        kvs_error("sender: direct writes need a link that maps decode rings (link %s)",
                  link->ops->name);
        return KVS_ERR_UNSUPPORTED;
    }
    kvs_sender_t *tx = kvs_calloc(1, sizeof(*tx));
    if (tx == NULL) return KVS_ERR_NOMEM;
    tx->cfg = *config;
    tx->shape = shape;
    tx->pool = pool;
    tx->link = link;
    tx->clock = *clock;
    tx->grid = kvs_grid_tokens(config->geo.chunk_tokens, config->geo.page_size);
    kvs_map_init(&tx->rooms);
    kvs_map_init(&tx->stash);
    kvs_map_init(&tx->direct_ok);
    const kvs_kv_shape_t *s = &tx->shape;
    uint64_t heads = kvs_tp_heads_per_rank(s, config->geo.prefill_tp);
    uint64_t dims = s->attn == KVS_ATTN_MLA ? s->head_dim_k : s->head_dim_k + s->head_dim_v;
    tx->buffer_bytes = tx->grid * s->layers * heads * dims * s->elem_bytes;
    st = pc->mem == KVS_MEM_DEVICE ? kvs_copy_cuda_create(pc->device, &tx->copy)
                                   : kvs_copy_cpu_create(&tx->copy);
    if (st != KVS_OK) goto err_free;
    tx->buffers = kvs_calloc(config->staging_buffers, sizeof(*tx->buffers));
    tx->buffer_busy = kvs_calloc(config->staging_buffers, sizeof(*tx->buffer_busy));
    if (tx->buffers == NULL || tx->buffer_busy == NULL) {
        st = KVS_ERR_NOMEM;
        goto err_buffers;
    }
    for (uint32_t i = 0; i < config->staging_buffers && config->write_mode != KVS_WRITE_DIRECT;
         i++) {
        void *buf = NULL;
        st = kvs_mem_alloc(pc->mem, pc->device, tx->buffer_bytes, &buf);
        if (st != KVS_OK) goto err_buffers;
        tx->buffers[i] = buf;
    }
    *sender_p = tx;
    return KVS_OK;

err_buffers:
    for (uint32_t i = 0; tx->buffers != NULL && i < config->staging_buffers; i++)
        kvs_mem_free(pc->mem, pc->device, tx->buffers[i]);
    kvs_free(tx->buffers);
    kvs_free(tx->buffer_busy);
    kvs_copy_backend_destroy(&tx->copy);
err_free:
    kvs_map_fini(&tx->direct_ok);
    kvs_free(tx);
    return st;
}

static void room_free(sroom_t *r)
{
    kvs_free(r->cd);
    kvs_free(r);
}

/* Where a destination's write stands: the transport write of a staged write, the gather of a
 * direct one (its bytes are in the decode ring once the gather kernel completed). */
static kvs_status_t write_status(kvs_sender_t *tx, const sdest_t *sd)
{
    if (sd->buffer < 0) return kvs_copy_poll(&tx->copy, sd->ticket);
    return tx->link->ops->write_poll(tx->link->ctx, sd->ticket);
}

/* Waits for a room's writes in flight (teardown only; callers should drain rooms first). */
static void wait_writes(kvs_sender_t *tx, sroom_t *r)
{
    for (uint64_t k = r->first_open; k < r->nchunks && r->writing > 0; k++) {
        for (uint32_t d = 0; d < r->ndests; d++) {
            sdest_t *sd = &r->cd[k * r->ndests + d];
            if (sd->state != SD_WRITING) continue;
            /* Real time, not the sender's clock: a virtual clock may be frozen at teardown. */
            uint64_t deadline = kvs_now_ns() + tx->cfg.timeouts.release_timeout_ns;
            while (write_status(tx, sd) == KVS_INPROGRESS) {
                if (kvs_now_ns() > deadline) {
                    kvs_error("room %llu: a write did not complete before teardown",
                              (unsigned long long) r->id);
                    break;
                }
            }
            sd->state = SD_GRANTED;
            r->writing--;
            tx->writing--;
        }
    }
}

void kvs_sender_destroy(kvs_sender_t *tx)
{
    if (tx == NULL) return;
    void *v;
    for (size_t it = 0; kvs_map_next(&tx->rooms, &it, NULL, &v);) {
        /* A write may still read a staging buffer: wait before freeing it. */
        wait_writes(tx, v);
        room_free(v);
    }
    for (size_t it = 0; kvs_map_next(&tx->stash, &it, NULL, &v);) kvs_free(v);
    kvs_map_fini(&tx->rooms);
    kvs_map_fini(&tx->stash);
    kvs_map_fini(&tx->direct_ok);
    kvs_copy_backend_destroy(&tx->copy); /* drains gathers still in flight */
    const kvs_pool_config_t *pc = kvs_pool_config(tx->pool);
    for (uint32_t i = 0; i < tx->cfg.staging_buffers; i++)
        kvs_mem_free(pc->mem, pc->device, tx->buffers[i]);
    kvs_free(tx->buffers);
    kvs_free(tx->buffer_busy);
    kvs_free(tx);
}

/* ---- sending ---- */

/* Tokens in chunk k's slot at a decode rank (protocol.md §1): the decode pages', up to where
 * this rank's pages end; under DCP only the decode rank's own tokens of them. */
static uint64_t chunk_tokens(const kvs_sender_t *tx, const sroom_t *r, uint64_t k,
                             uint32_t decode_rank)
{
    const kvs_pd_geometry_t *g = &tx->cfg.geo;
    const kvs_dcp_t dcp = kvs_pd_geometry_dcp_of(g, decode_rank);
    return kvs_grid_rank_slot_tokens(k, r->prompt_len, r->base, tx->grid, g->page_size,
                                     kvs_pd_geometry_page(g, KVS_SIDE_PREFILL), &dcp);
}

/* A decode rank's delta pages for the room (protocol.md §1): what its ROOM_META states. */
static uint64_t rank_total_pages(const kvs_sender_t *tx, const sroom_t *r, uint64_t base,
                                 uint32_t decode_rank)
{
    const kvs_pd_geometry_t *g = &tx->cfg.geo;
    const kvs_dcp_t dcp = kvs_pd_geometry_dcp_of(g, decode_rank);
    return kvs_grid_rank_total_pages(r->prompt_len, base, g->page_size,
                                     kvs_pd_geometry_page(g, KVS_SIDE_PREFILL), &dcp);
}

/* Decode pages per slot on a decode rank: G / N tokens of its own, in its pages. */
static uint64_t rank_slot_pages(const kvs_sender_t *tx)
{
    const kvs_pd_geometry_t *g = &tx->cfg.geo;
    return tx->grid / kvs_pd_geometry_dcp(g) / g->page_size;
}

/* The slot of chunk k at destination d as the decode rank lays it out: its total size, and this
 * writer's region offset in it (both NULL-able). */
static uint64_t dest_slot(const kvs_sender_t *tx, const sroom_t *r, uint64_t k, uint32_t d,
                          uint64_t *region_offset_p)
{
    const kvs_pd_geometry_t *g = &tx->cfg.geo;
    kvs_writer_t writers[KVS_MAX_WRITERS];
    uint64_t offsets[KVS_MAX_WRITERS];
    uint32_t n = 0;
    kvs_plan_geo_writers(g, r->dests[d].decode_rank, r->id, writers, &n);
    uint64_t size =
        kvs_slot_layout(writers, n, chunk_tokens(tx, r, k, r->dests[d].decode_rank), offsets);
    if (region_offset_p) *region_offset_p = offsets[r->dests[d].writer];
    return size;
}

/* The link's name of the room's decode rank. */
static uint32_t peer_of(const sroom_t *r, uint32_t decode_rank)
{
    return kvs_peer_id(r->group, decode_rank);
}

/* Sends msg to the room's decode rank. */
static void room_send(kvs_sender_t *tx, const sroom_t *r, uint32_t decode_rank,
                      const kvs_msg_t *msg)
{
    kvs_pd_send(tx->link, &tx->m, peer_of(r, decode_rank), msg);
}

static void send_staging_req(kvs_sender_t *tx, sroom_t *r, uint64_t chunk, uint32_t d)
{
    uint32_t decode_rank = r->dests[d].decode_rank;
    kvs_msg_t msg = {.type = KVS_MSG_STAGING_REQ};
    msg.u.staging_req = (kvs_msg_staging_req_t){
        .room = r->id,
        .chunk = (uint32_t) chunk,
        .prefill_rank = tx->cfg.rank,
        .decode_rank = decode_rank,
        .slot_bytes = dest_slot(tx, r, chunk, d, NULL),
    };
    room_send(tx, r, decode_rank, &msg);
}

static void send_chunk_ready(kvs_sender_t *tx, sroom_t *r, uint64_t chunk, uint32_t d)
{
    const kvs_dest_t *dest = &r->dests[d];
    const uint64_t F = rank_slot_pages(tx);
    uint64_t pages =
        kvs_grid_chunk_pages(chunk, rank_total_pages(tx, r, r->base, dest->decode_rank),
                             F * tx->cfg.geo.page_size, tx->cfg.geo.page_size);
    kvs_msg_t msg = {.type = KVS_MSG_CHUNK_READY};
    msg.u.chunk_ready = (kvs_msg_chunk_ready_t){
        .room = r->id,
        .chunk = (uint32_t) chunk,
        .prefill_rank = tx->cfg.rank,
        .decode_rank = dest->decode_rank,
        .writer = dest->writer,
        .suffix_page_start = chunk * F, /* in the decode rank's own pages */
        .pages = (uint32_t) pages,
        .bytes = chunk_tokens(tx, r, chunk, dest->decode_rank) * dest->w.bytes_per_token,
        .checksum = r->cd[chunk * r->ndests + d].checksum,
    };
    room_send(tx, r, dest->decode_rank, &msg);
}

static void send_status(kvs_sender_t *tx, sroom_t *r, uint32_t i)
{
    kvs_msg_t msg = {.type = KVS_MSG_STATUS};
    msg.u.status = (kvs_msg_status_t){
        .room = r->id,
        .prefill_rank = tx->cfg.rank,
        .decode_rank = r->dpeers[i],
        .status = r->status == KVS_ROOM_FAILED ? KVS_ROOM_FAILED : KVS_ROOM_SUCCESS,
        .reason = r->status == KVS_ROOM_FAILED ? r->reason : KVS_OK,
        .final_len = r->status == KVS_ROOM_FAILED ? 0 : r->final_len,
    };
    memcpy(msg.u.status.final, r->final, msg.u.status.final_len);
    room_send(tx, r, r->dpeers[i], &msg);
}

/* The answers below go to decode rank decode_rank of peer group `group`. */
static void send_ack(kvs_sender_t *tx, uint64_t room, uint32_t group, uint32_t decode_rank)
{
    kvs_msg_t msg = {.type = KVS_MSG_ACK};
    msg.u.ack = (kvs_msg_ack_t){
        .room = room,
        .acked_type = KVS_MSG_ROOM_META,
        .from_rank = tx->cfg.rank,
        .to_rank = decode_rank,
    };
    kvs_pd_send(tx->link, &tx->m, kvs_peer_id(group, decode_rank), &msg);
}

/* Confirms a grant, so decode stops resending it. */
static void send_grant_ack(kvs_sender_t *tx, const sroom_t *r, uint32_t chunk, uint32_t decode_rank)
{
    kvs_msg_t msg = {.type = KVS_MSG_ACK};
    msg.u.ack = (kvs_msg_ack_t){
        .room = r->id,
        .acked_type = KVS_MSG_STAGING_GRANT,
        .chunk = chunk,
        .from_rank = tx->cfg.rank,
        .to_rank = decode_rank,
    };
    room_send(tx, r, decode_rank, &msg);
}

static void send_abort_ack(kvs_sender_t *tx, uint64_t room, uint32_t group, uint32_t decode_rank)
{
    kvs_msg_t msg = {.type = KVS_MSG_ABORT_ACK};
    msg.u.abort = (kvs_msg_abort_t){
        .room = room,
        .from_rank = tx->cfg.rank,
        .to_rank = decode_rank,
        .reason = KVS_OK,
    };
    kvs_pd_send(tx->link, &tx->m, kvs_peer_id(group, decode_rank), &msg);
}

/* ---- room lifecycle ---- */

/* The failure an ABORT reports: the decode rank's own reason (a checksum mismatch, a failed
 * scatter, a timeout...), or KVS_ERR_ABORTED where it gives none. */
static kvs_status_t abort_reason(int32_t reason)
{
    return reason < 0 ? (kvs_status_t) reason : KVS_ERR_ABORTED;
}

static void fail_room(kvs_sender_t *tx, sroom_t *r, kvs_status_t reason, const char *why)
{
    if (r->status == KVS_ROOM_FAILED || r->status == KVS_ROOM_SUCCESS) return;
    kvs_warn("prefill rank %u: room %llu failed: %s (%s)", tx->cfg.rank, (unsigned long long) r->id,
             why, kvs_status_str(reason));
    r->status = KVS_ROOM_FAILED;
    r->reason = reason;
    r->status_sent = 0;
    r->failed_at = now_ns(tx);
    /* Decode ranks that aborted the room already know; the rest hear STATUS Failed. */
    r->status_acked |= r->aborted_by;
    r->retry_at = 0;
    tx->m.rooms_failed++;
}

/* Applies the metadata of dpeer i; all decode peers must describe the same room. */
static void apply_meta(kvs_sender_t *tx, sroom_t *r, uint32_t i, const smeta_t *meta)
{
    const uint32_t P = tx->cfg.geo.page_size;
    /* The decode prefix lies on a page of every rank of a DCP group (protocol.md §1). */
    if (meta->prompt_len != r->prompt_len || meta->grid != tx->grid ||
        meta->base % kvs_pd_geometry_unit(&tx->cfg.geo) != 0 ||
        meta->total_pages != rank_total_pages(tx, r, meta->base, r->dpeers[i])) {
        fail_room(tx, r, KVS_ERR_PROTOCOL, "room metadata does not match the request");
        return;
    }
    if (r->meta_got != 0 && meta->base != r->base) {
        fail_room(tx, r, KVS_ERR_PROTOCOL, "decode ranks disagree on the decode prefix");
        return;
    }
    r->meta_got |= KVS_BIT(i);
    if (r->cd != NULL) return;
    r->base = meta->base;
    r->nchunks = kvs_grid_chunk_count(kvs_grid_total_pages(r->prompt_len, r->base, P), tx->grid, P);
    r->sent_upto = r->base;
    if (r->nchunks && r->ndests) {
        r->cd = kvs_calloc(r->nchunks * r->ndests, sizeof(*r->cd));
        if (r->cd == NULL) {
            fail_room(tx, r, KVS_ERR_NOMEM, "no memory for the chunk table");
            return;
        }
    }
    /* Under DCP a decode rank holds none of a short last chunk's tokens (its chunks end
     * earlier): nothing goes there. */
    const uint64_t F = rank_slot_pages(tx);
    for (uint32_t d = 0; d < r->ndests; d++) {
        uint64_t pages = rank_total_pages(tx, r, r->base, r->dests[d].decode_rank);
        for (uint64_t k = kvs_grid_chunk_count(pages, F * P, P); k < r->nchunks; k++)
            r->cd[k * r->ndests + d].state = SD_DONE;
    }
}

kvs_status_t kvs_sender_add_room(kvs_sender_t *tx, uint64_t room, uint64_t prompt_len,
                                 const uint32_t *page_table)
{
    if (kvs_map_get(&tx->rooms, room) != NULL) {
        kvs_error("prefill rank %u: room %llu already exists", tx->cfg.rank,
                  (unsigned long long) room);
        return KVS_ERR_STATE;
    }
    if (prompt_len > 0 && page_table == NULL) {
        kvs_error("room %llu: a page table is required", (unsigned long long) room);
        return KVS_ERR_INVALID;
    }
    sroom_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) return KVS_ERR_NOMEM;
    r->id = room;
    r->prompt_len = prompt_len;
    r->page_table = page_table;
    r->status = KVS_ROOM_BOOTSTRAPPING;
    const kvs_pd_geometry_t *g = &tx->cfg.geo;
    kvs_status_t st = kvs_plan_geo_destinations(g, tx->cfg.rank, room, r->dests, &r->ndests);
    if (st == KVS_OK) st = kvs_plan_geo_decode_peers(g, tx->cfg.rank, r->dpeers, &r->ndpeers);
    if (st == KVS_OK) st = kvs_map_put(&tx->rooms, room, r);
    if (st != KVS_OK) {
        room_free(r);
        return st;
    }
    tx->m.rooms_added++;
    r->added_at = r->last_activity = now_ns(tx);
    sstash_t *s = kvs_map_remove(&tx->stash, room);
    if (s != NULL) {
        r->grouped = 1;
        r->group = s->group;
        for (uint32_t i = 0; i < r->ndpeers; i++) {
            uint32_t d = r->dpeers[i];
            if (s->aborted & KVS_BIT(d)) r->aborted_by |= KVS_BIT(i);
            if (s->meta_got & KVS_BIT(d)) apply_meta(tx, r, i, &s->meta[d]);
        }
        if (r->aborted_by) fail_room(tx, r, s->abort_reason, "aborted by decode");
        kvs_free(s);
    }
    return KVS_OK;
}

static sroom_t *engine_room(kvs_sender_t *tx, uint64_t room)
{
    sroom_t *r = kvs_map_get(&tx->rooms, room);
    if (r == NULL)
        kvs_error("prefill rank %u: unknown room %llu", tx->cfg.rank, (unsigned long long) room);
    return r;
}

kvs_status_t kvs_sender_advance(kvs_sender_t *tx, uint64_t room, uint64_t computed,
                                uint64_t scheduled)
{
    sroom_t *r = engine_room(tx, room);
    if (r == NULL) return KVS_ERR_NOT_FOUND;
    if (computed > r->prompt_len || scheduled < computed || computed < r->computed ||
        scheduled < r->scheduled) {
        kvs_error("room %llu: advance(%llu, %llu) is not monotonic within the prompt (%llu, "
                  "%llu, prompt %llu)",
                  (unsigned long long) room, (unsigned long long) computed,
                  (unsigned long long) scheduled, (unsigned long long) r->computed,
                  (unsigned long long) r->scheduled, (unsigned long long) r->prompt_len);
        return KVS_ERR_INVALID;
    }
    r->computed = computed;
    r->scheduled = scheduled > r->prompt_len ? r->prompt_len : scheduled;
    r->last_activity = now_ns(tx);
    return KVS_OK;
}

kvs_status_t kvs_sender_finish(kvs_sender_t *tx, uint64_t room, const void *final_meta,
                               uint32_t final_len)
{
    sroom_t *r = engine_room(tx, room);
    if (r == NULL) return KVS_ERR_NOT_FOUND;
    if (final_len > KVS_MSG_FINAL_MAX || (final_len > 0 && final_meta == NULL)) {
        kvs_error("room %llu: final metadata of %u bytes (at most %u)", (unsigned long long) room,
                  final_len, KVS_MSG_FINAL_MAX);
        return KVS_ERR_INVALID;
    }
    r->computed = r->scheduled = r->prompt_len;
    r->finished = 1;
    KVS_PD_TRACE("prefill rank %u: room %llu: the prompt is computed", tx->cfg.rank,
                 (unsigned long long) room);
    r->final_len = final_len;
    if (final_len) memcpy(r->final, final_meta, final_len);
    r->last_activity = now_ns(tx);
    return KVS_OK;
}

kvs_status_t kvs_sender_abort(kvs_sender_t *tx, uint64_t room)
{
    sroom_t *r = engine_room(tx, room);
    if (r == NULL) return KVS_ERR_NOT_FOUND;
    fail_room(tx, r, KVS_ERR_ABORTED, "aborted by the engine");
    return KVS_OK;
}

int kvs_sender_heard(const kvs_sender_t *tx, uint64_t room)
{
    const sroom_t *r = kvs_map_get(&tx->rooms, room);
    if (r != NULL)
        return r->meta_got != 0 || r->aborted_by != 0 || r->status == KVS_ROOM_FAILED ||
               r->status == KVS_ROOM_SUCCESS || r->ndpeers == 0;
    const sstash_t *s = kvs_map_get(&tx->stash, room);
    if (s != NULL) return s->meta_got != 0 || s->aborted != 0;
    uint32_t dpeers[KVS_MAX_TP], n = 0;
    return kvs_plan_geo_decode_peers(&tx->cfg.geo, tx->cfg.rank, dpeers, &n) == KVS_OK && n == 0;
}

static int room_quiescent(const sroom_t *r)
{
    if (r->status == KVS_ROOM_SUCCESS) return 1;
    return r->status == KVS_ROOM_FAILED && r->writing == 0 &&
           r->status_acked == kvs_all_bits(r->ndpeers);
}

kvs_status_t kvs_sender_poll(kvs_sender_t *tx, uint64_t room, kvs_room_info_t *info_p)
{
    sroom_t *r = kvs_map_get(&tx->rooms, room);
    if (r == NULL) return KVS_ERR_NOT_FOUND;
    memset(info_p, 0, sizeof(*info_p));
    info_p->status = r->status;
    info_p->reason = r->reason;
    info_p->quiescent = room_quiescent(r);
    return KVS_OK;
}

kvs_status_t kvs_sender_release(kvs_sender_t *tx, uint64_t room)
{
    sroom_t *r = kvs_map_get(&tx->rooms, room);
    if (r == NULL) return KVS_ERR_NOT_FOUND;
    if (!room_quiescent(r)) {
        kvs_error("room %llu: release before it concluded (%s)", (unsigned long long) room,
                  kvs_room_status_str(r->status));
        return KVS_ERR_STATE;
    }
    kvs_map_remove(&tx->rooms, room);
    room_free(r);
    return KVS_OK;
}

/* ---- message handlers ---- */

/* The stash entry of a room the engine has not added yet, created on first use. */
static sstash_t *stash_for(kvs_sender_t *tx, uint64_t room)
{
    sstash_t *s = kvs_map_get(&tx->stash, room);
    if (s != NULL) return s;
    s = kvs_calloc(1, sizeof(*s));
    if (s == NULL || kvs_map_put(&tx->stash, room, s) != KVS_OK) {
        kvs_free(s);
        return NULL;
    }
    /* As long as decode waits for the room (its waiting timeout) or this side would (bootstrap):
     * a busy prefill instance may add a room decode is ready for much later. */
    const kvs_pd_timeouts_t *t = &tx->cfg.timeouts;
    s->expires_at =
        now_ns(tx) + (t->waiting_timeout_ns > t->bootstrap_timeout_ns ? t->waiting_timeout_ns
                                                                      : t->bootstrap_timeout_ns);
    return s;
}

/* Binds the room (or its stash entry) to the decode instance of `group` on its first message;
 * 0 if the room belongs to another one (a room id two decode instances both use: the later one
 * is refused). */
static int claim(kvs_sender_t *tx, int *grouped, uint32_t *bound, uint32_t group, uint64_t room)
{
    if (!*grouped) {
        *grouped = 1;
        *bound = group;
        return 1;
    }
    if (*bound == group) return 1;
    tx->m.rejected++;
    kvs_warn("prefill rank %u: room %llu belongs to another decode instance (peer group %u, "
             "not %u)",
             tx->cfg.rank, (unsigned long long) room, *bound, group);
    return 0;
}

/* The room a decode message of `group` is about: NULL when unknown or another instance's (a
 * room not bound yet answers group 0's, the one instance of a one-group link). */
static sroom_t *room_from(kvs_sender_t *tx, uint64_t room, uint32_t group)
{
    sroom_t *r = kvs_map_get(&tx->rooms, room);
    return r != NULL && r->group == group ? r : NULL;
}

static void on_room_meta(kvs_sender_t *tx, const kvs_msg_room_meta_t *mm, uint32_t group)
{
    const kvs_pd_geometry_t *g = &tx->cfg.geo;
    if (mm->decode_tp != g->decode_tp) {
        tx->m.rejected++;
        kvs_warn("room %llu: metadata from a decode TP %u deployment (expected %u)",
                 (unsigned long long) mm->room, mm->decode_tp, g->decode_tp);
        return;
    }
    smeta_t meta = {mm->base, mm->prompt_len, mm->total_pages, mm->grid_tokens};
    sroom_t *r = kvs_map_get(&tx->rooms, mm->room);
    if (r == NULL) {
        /* The engine has not added this room yet: keep the metadata until it does. */
        sstash_t *s = stash_for(tx, mm->room);
        if (s == NULL) return; /* not acknowledged: decode resends */
        int grouped = s->meta_got != 0 || s->aborted != 0;
        if (!claim(tx, &grouped, &s->group, group, mm->room)) return;
        s->meta[mm->decode_rank] = meta;
        s->meta_got |= KVS_BIT(mm->decode_rank);
        send_ack(tx, mm->room, group, mm->decode_rank);
        return;
    }
    int i = kvs_pd_rank_index(r->dpeers, r->ndpeers, mm->decode_rank);
    if (i < 0) {
        tx->m.rejected++;
        return;
    }
    if (!claim(tx, &r->grouped, &r->group, group, mm->room)) return;
    send_ack(tx, mm->room, group, mm->decode_rank);
    if (r->meta_got & KVS_BIT(i)) {
        tx->m.ignored++;
        return;
    }
    r->last_activity = now_ns(tx);
    if (r->status != KVS_ROOM_FAILED) apply_meta(tx, r, (uint32_t) i, &meta);
}

static int dest_index(const sroom_t *r, uint32_t decode_rank)
{
    for (uint32_t d = 0; d < r->ndests; d++)
        if (r->dests[d].decode_rank == decode_rank) return (int) d;
    return -1;
}

static void on_grant(kvs_sender_t *tx, const kvs_msg_staging_grant_t *gr, uint32_t group)
{
    sroom_t *r = room_from(tx, gr->room, group);
    int d = r ? dest_index(r, gr->decode_rank) : -1;
    if (r == NULL || d < 0 || r->cd == NULL || gr->chunk >= r->nchunks ||
        r->status == KVS_ROOM_FAILED) {
        tx->m.ignored++;
        return;
    }
    sdest_t *sd = &r->cd[gr->chunk * r->ndests + (uint32_t) d];
    /* Confirmed whether new or a repeat (the first confirmation may have been lost); a grant
     * for a room this rank does not hold yet is not, so decode keeps resending it. */
    send_grant_ack(tx, r, gr->chunk, gr->decode_rank);
    if (sd->state != SD_IDLE && sd->state != SD_REQUESTED && sd->state != SD_QUEUED) {
        tx->m.ignored++; /* a repeat of a grant we already hold */
        return;
    }
    if (sd->state == SD_REQUESTED && sd->tries == 0)
        kvs_pd_rtt_sample(&tx->srtt_ns, now_ns(tx) - sd->sent_at);
    sd->state = SD_GRANTED;
    sd->offset = gr->offset;
    sd->size = gr->size;
    r->last_activity = now_ns(tx);
}

/* The request waits behind a full ring: no resend until the grant (which decode resends until
 * confirmed) or the long queued timeout, so retries count real losses only. */
static void on_queued(kvs_sender_t *tx, const kvs_msg_staging_queued_t *q, uint32_t group)
{
    sroom_t *r = room_from(tx, q->room, group);
    int d = r ? dest_index(r, q->decode_rank) : -1;
    if (r == NULL || d < 0 || r->cd == NULL || q->chunk >= r->nchunks ||
        r->status == KVS_ROOM_FAILED) {
        tx->m.ignored++;
        return;
    }
    sdest_t *sd = &r->cd[q->chunk * r->ndests + (uint32_t) d];
    if (sd->state != SD_REQUESTED && sd->state != SD_QUEUED) {
        tx->m.ignored++; /* late: the grant overtook it */
        return;
    }
    if (sd->state == SD_REQUESTED && sd->tries == 0)
        kvs_pd_rtt_sample(&tx->srtt_ns, now_ns(tx) - sd->sent_at);
    sd->state = SD_QUEUED;
    sd->tries = 0;
    sd->retry_at = now_ns(tx) + KVS_PD_QUEUED_RETRY_FACTOR * tx->cfg.timeouts.retry_ns;
    r->last_activity = now_ns(tx);
}

static void on_ack(kvs_sender_t *tx, const kvs_msg_ack_t *a, uint32_t group)
{
    sroom_t *r = room_from(tx, a->room, group);
    if (r == NULL) {
        tx->m.ignored++;
        return;
    }
    if (a->acked_type == KVS_MSG_STATUS) {
        int i = kvs_pd_rank_index(r->dpeers, r->ndpeers, a->from_rank);
        if (i < 0 || !r->status_sent) {
            tx->m.ignored++;
            return;
        }
        r->status_acked |= KVS_BIT(i);
        return;
    }
    int d = dest_index(r, a->from_rank);
    if (a->acked_type != KVS_MSG_CHUNK_READY || d < 0 || r->cd == NULL || a->chunk >= r->nchunks) {
        tx->m.ignored++;
        return;
    }
    sdest_t *sd = &r->cd[a->chunk * r->ndests + (uint32_t) d];
    if (sd->state != SD_READY_SENT) {
        tx->m.ignored++;
        return;
    }
    if (sd->tries == 0) kvs_pd_rtt_sample(&tx->srtt_ns, now_ns(tx) - sd->sent_at);
    sd->state = SD_DONE;
    tx->m.chunks++;
    r->last_activity = now_ns(tx);
}

static void on_abort(kvs_sender_t *tx, const kvs_msg_abort_t *a, uint32_t group)
{
    if (a->from_rank >= tx->cfg.geo.decode_tp) {
        tx->m.rejected++;
        return;
    }
    sroom_t *r = kvs_map_get(&tx->rooms, a->room);
    if (r == NULL) {
        /* Nothing is in flight for a room we do not hold; remember the abort in case the room
         * comes (unacknowledged if we cannot: decode resends). */
        sstash_t *s = stash_for(tx, a->room);
        if (s == NULL) return;
        int grouped = s->meta_got != 0 || s->aborted != 0;
        if (!claim(tx, &grouped, &s->group, group, a->room)) return;
        if (s->aborted == 0) s->abort_reason = abort_reason(a->reason);
        s->aborted |= KVS_BIT(a->from_rank);
        send_abort_ack(tx, a->room, group, a->from_rank);
        return;
    }
    int i = kvs_pd_rank_index(r->dpeers, r->ndpeers, a->from_rank);
    if (i < 0) {
        tx->m.rejected++;
        return;
    }
    if (!claim(tx, &r->grouped, &r->group, group, a->room)) return;
    r->aborted_by |= KVS_BIT(i);
    r->status_acked |= KVS_BIT(i);
    fail_room(tx, r, abort_reason(a->reason), "aborted by decode");
    if (r->writing == 0) send_abort_ack(tx, r->id, r->group, a->from_rank);
    /* Otherwise the ABORT_ACK goes out once the writes drain (pump_room), and again on every
     * repeated ABORT. */
}

/* `group`: the link's peer group of the message's sender. */
static void handle(kvs_sender_t *tx, const kvs_msg_t *msg, uint32_t group)
{
    switch (msg->type) {
    case KVS_MSG_ROOM_META:
        on_room_meta(tx, &msg->u.room_meta, group);
        break;
    case KVS_MSG_STAGING_GRANT:
        on_grant(tx, &msg->u.staging_grant, group);
        break;
    case KVS_MSG_STAGING_QUEUED:
        on_queued(tx, &msg->u.staging_queued, group);
        break;
    case KVS_MSG_ACK:
        on_ack(tx, &msg->u.ack, group);
        break;
    case KVS_MSG_ABORT:
        on_abort(tx, &msg->u.abort, group);
        break;
    default:
        tx->m.rejected++;
        kvs_warn("prefill rank %u: unexpected %s message", tx->cfg.rank,
                 kvs_msg_type_str(msg->type));
        break;
    }
}

static int msg_to_me(const kvs_sender_t *tx, const kvs_msg_t *msg)
{
    switch (msg->type) {
    case KVS_MSG_ACK:
        return msg->u.ack.to_rank == tx->cfg.rank;
    case KVS_MSG_ABORT:
        return msg->u.abort.to_rank == tx->cfg.rank;
    default:
        return 1;
    }
}

/* ---- the per-room pump ---- */

/* Issues sub-sends up to what is computed: a non-last send ends on the grid, the last one at
 * the prompt's end, so every sub-send covers exactly one slot and issuing chunk k means "its KV
 * is at rest". The final, possibly empty, sub-send is the STATUS that carries the final
 * metadata. */
static void issue_sends(kvs_sender_t *tx, sroom_t *r)
{
    const uint64_t P = tx->cfg.geo.page_size;
    uint64_t end = r->finished ? r->prompt_len : kvs_grid_floor(r->computed, r->base, tx->grid, P);
    if (end <= r->sent_upto) return;
    r->chunks_issued = kvs_grid_chunk_count(kvs_grid_total_pages(end, r->base, P), tx->grid, P);
    r->sent_upto = end;
    if (r->status == KVS_ROOM_WAITING) r->status = KVS_ROOM_TRANSFERRING;
}

static int take_buffer(kvs_sender_t *tx)
{
    for (uint32_t i = 0; i < tx->cfg.staging_buffers; i++) {
        if (!tx->buffer_busy[i]) {
            tx->buffer_busy[i] = 1;
            return (int) i;
        }
    }
    return -1;
}

/* The granted slot as a pointer this rank's gather can store to (*ptr_p), or why not:
 * KVS_INPROGRESS while the link is still wiring the peer's ring up, KVS_ERR_UNSUPPORTED for
 * staged mode, a link that cannot map the ring, or a ring this rank's copy backend cannot reach
 * (a device ring for a host pool, another GPU's ring without peer access); the link's error for
 * a bad or dead peer. */
static kvs_status_t map_slot(kvs_sender_t *tx, uint32_t peer, uint64_t offset, uint64_t len,
                             uint8_t **ptr_p)
{
    const kvs_pool_config_t *pc = kvs_pool_config(tx->pool);
    if (tx->cfg.write_mode == KVS_WRITE_STAGED || tx->link->ops->map == NULL)
        return KVS_ERR_UNSUPPORTED;
    int host = 0;
    uint8_t *p = NULL;
    kvs_status_t st = tx->link->ops->map(tx->link->ctx, peer, offset, len, &p, &host);
    if (st != KVS_OK) return st;
    if ((pc->mem == KVS_MEM_HOST) != host) return KVS_ERR_UNSUPPORTED;
    if (kvs_map_get(&tx->direct_ok, peer) == NULL) {
        /* A host pool asks no CUDA call: initialising CUDA could stall progress for seconds. */
        if (pc->mem == KVS_MEM_DEVICE && !kvs_mem_device_can_access(pc->device, p))
            return KVS_ERR_UNSUPPORTED;
        if (kvs_map_put(&tx->direct_ok, peer, (void *) 1) != KVS_OK) return KVS_ERR_NOMEM;
    }
    *ptr_p = p;
    return KVS_OK;
}

/* Gathers chunk k's head slice for destination d and starts the write into the granted slot. */
static kvs_status_t start_write(kvs_sender_t *tx, sroom_t *r, uint64_t k, uint32_t d)
{
    const kvs_pd_geometry_t *g = &tx->cfg.geo;
    sdest_t *sd = &r->cd[k * r->ndests + d];
    const kvs_dest_t *dest = &r->dests[d];
    const uint64_t tokens = chunk_tokens(tx, r, k, dest->decode_rank);
    const uint64_t bytes = tokens * dest->w.bytes_per_token;
    /* The chunk starts at base + k*G, on a decode page but anywhere in a prefill page. Under
     * DCP the decode rank's tokens of it are runs of T every N*T, from its first one; the
     * gather packs them densely, in the order of its local positions (protocol.md §1). */
    const uint32_t Pp = kvs_pd_geometry_page(g, KVS_SIDE_PREFILL);
    const kvs_dcp_t dcp = kvs_pd_geometry_dcp_of(g, dest->decode_rank);
    const uint64_t local = kvs_dcp_count(&dcp, r->base + k * tx->grid);
    const uint64_t first = kvs_dcp_global(&dcp, local);
    const uint64_t reach = tokens ? kvs_dcp_global(&dcp, local + tokens - 1) + 1 - first : 0;
    const kvs_page_span_t src = kvs_grid_page_span(first, reach, Pp);
    uint64_t at;
    dest_slot(tx, r, k, d, &at);
    if (at > sd->size || bytes > sd->size - at) {
        kvs_error("room %llu chunk %llu: region [%llu, +%llu) does not fit the %llu-byte grant",
                  (unsigned long long) r->id, (unsigned long long) k, (unsigned long long) at,
                  (unsigned long long) bytes, (unsigned long long) sd->size);
        return KVS_ERR_PROTOCOL;
    }
    uint8_t *direct = NULL;
    kvs_status_t mapped =
        map_slot(tx, peer_of(r, dest->decode_rank), sd->offset + at, bytes, &direct);
    if (mapped != KVS_OK && tx->cfg.write_mode == KVS_WRITE_DIRECT) {
        /* Not wired up yet: the next progress asks again (the transfer timeout bounds it). */
        if (mapped == KVS_INPROGRESS) return KVS_INPROGRESS;
        kvs_error("room %llu chunk %llu: direct write, but the link cannot map decode rank %u's "
                  "slot into this rank's memory: %s",
                  (unsigned long long) r->id, (unsigned long long) k, dest->decode_rank,
                  kvs_status_str(mapped));
        return mapped;
    }
    int b = -1;
    if (direct == NULL && (b = take_buffer(tx)) < 0) return KVS_INPROGRESS;
    kvs_copy_desc_t desc = {
        .regions = kvs_pool_region(tx->pool, 0, 0),
        .layers = tx->shape.layers,
        .components = kvs_kv_shape_components(&tx->shape),
        .shape = &tx->shape, /* its stage's layers: the region is [K of them][V of them] */
        .pages = r->page_table + src.first,
        .npages = (uint32_t) src.count,
        .page_size = Pp,
        .first_token = (uint32_t) src.offset,
        .tokens = tokens,
        .run = dcp.size > 1 ? dcp.interleave : 0,
        .stride = dcp.size > 1 ? dcp.size * dcp.interleave : 0,
        .pool_head = dest->w.src_head,
        .heads = dest->w.heads,
        .pool_pages = kvs_pool_total_pages(tx->pool),
        /* [K l0..L-1][V l0..L-1] x [tokens][heads][D]: the staging buffer or the remote slot */
        .region = direct != NULL ? direct : tx->buffers[b],
        .region_bytes = direct != NULL ? bytes : tx->buffer_bytes,
        /* computed by the gather from the bytes it writes; ready when the write completes,
         * which is when CHUNK_READY goes out */
        .checksum = tx->cfg.geo.no_checksum ? NULL : &sd->checksum,
    };
    uint64_t copy_ticket;
    uint64_t t0 = kvs_now_ns();
    kvs_status_t st = kvs_copy_submit(&tx->copy, KVS_COPY_GATHER, &desc, &copy_ticket);
    if (st == KVS_OK && direct != NULL) {
        sd->ticket = copy_ticket; /* CHUNK_READY waits for this gather (write_status) */
    } else if (st == KVS_OK) {
        /* The transport reads the staging buffer: the gather must be complete first. */
        while ((st = kvs_copy_poll(&tx->copy, copy_ticket)) == KVS_INPROGRESS) {
        }
        if (st == KVS_OK)
            st = tx->link->ops->write(tx->link->ctx, peer_of(r, dest->decode_rank), sd->offset + at,
                                      tx->buffers[b], bytes, &sd->ticket);
    }
    tx->m.data_ns += kvs_now_ns() - t0;
    if (st != KVS_OK) {
        if (b >= 0) tx->buffer_busy[b] = 0;
        return st;
    }
    if (direct != NULL) tx->m.direct_writes++;
    KVS_PD_TRACE("prefill rank %u: room %llu chunk %llu: %s write of %llu bytes started",
                 tx->cfg.rank, (unsigned long long) r->id, (unsigned long long) k,
                 direct != NULL ? "direct" : "staged", (unsigned long long) bytes);
    sd->buffer = b;
    sd->state = SD_WRITING;
    r->writing++;
    tx->writing++;
    tx->m.bulk_writes++;
    tx->m.bytes += bytes;
    return KVS_OK;
}

/* Sets the next resend: the interval doubles with every resend, up to 32x, so a request
 * queued behind a full ring is not resent at full rate while a lost one is still resent. */
static void arm_retry(const kvs_sender_t *tx, sdest_t *sd, uint64_t now, uint32_t tries)
{
    sd->tries = tries;
    sd->retry_at = now + kvs_pd_backoff(tx->srtt_ns, tx->cfg.timeouts.retry_ns, tries);
    if (tries == 0) sd->sent_at = now;
}

/* 1 if the room waits for an answer from decode (a grant, an ACK). */
static int waiting_on_decode(const sroom_t *r)
{
    if (r->status_sent && r->status_acked != kvs_all_bits(r->ndpeers)) return 1;
    for (uint64_t k = r->first_open; r->cd != NULL && k < r->nchunks; k++) {
        for (uint32_t d = 0; d < r->ndests; d++) {
            sdest_state_t st = r->cd[k * r->ndests + d].state;
            if (st == SD_REQUESTED || st == SD_QUEUED || st == SD_READY_SENT) return 1;
            if (st == SD_IDLE) return 0;
        }
    }
    return 0;
}

/* 1 while a chunk written to destination d waits for its CHUNK_READY: the decode rank shares this
 * rank's GPU from another process, and prompt passes of the room are still to come. Decode's
 * scatter would take the GPU from them (the GPU time-slices between two processes' kernels:
 * about 0.4 ms of an 8B prefill pass per scatter, measured), so the room's chunks are announced
 * together once its whole prompt is at rest. The ring cannot wedge on it: the prompt is computed
 * whether or not slots come back. */
static int held(const kvs_sender_t *tx, const sroom_t *r, uint32_t d)
{
    return !r->finished && r->status != KVS_ROOM_FAILED && tx->link->ops->shares_device != NULL &&
           tx->link->ops->shares_device(tx->link->ctx, peer_of(r, r->dests[d].decode_rank));
}

/* Chunk k is written to destination d: CHUNK_READY goes out. */
static void announce(kvs_sender_t *tx, sroom_t *r, uint64_t k, uint32_t d, uint64_t now)
{
    r->cd[k * r->ndests + d].state = SD_READY_SENT;
    if (r->status == KVS_ROOM_FAILED) return;
    send_chunk_ready(tx, r, k, d);
    arm_retry(tx, &r->cd[k * r->ndests + d], now, 0);
}

/* Collects a write of chunk k to destination d if it completed: its buffer comes back and
 * CHUNK_READY goes out (at once, unless held(): the receiver can scatter while we gather the next
 * chunk). Returns 1 if it completed (successfully or not). */
static uint32_t collect_write(kvs_sender_t *tx, sroom_t *r, uint64_t k, uint32_t d, uint64_t now)
{
    sdest_t *sd = &r->cd[k * r->ndests + d];
    kvs_status_t st = write_status(tx, sd);
    if (st == KVS_INPROGRESS) return 0;
    if (sd->buffer >= 0) tx->buffer_busy[sd->buffer] = 0;
    r->writing--;
    tx->writing--;
    if (st != KVS_OK) {
        sd->state = SD_GRANTED;
        fail_room(tx, r, st, "transport write failed");
        return 1;
    }
    KVS_PD_TRACE("prefill rank %u: room %llu chunk %llu: write done", tx->cfg.rank,
                 (unsigned long long) r->id, (unsigned long long) k);
    if (held(tx, r, d))
        sd->state = SD_WRITTEN;
    else
        announce(tx, r, k, d, now);
    return 1;
}

/* 1 once every (chunk, destination) of the room is written and its CHUNK_READY sent. */
static int all_written(const sroom_t *r)
{
    if (r->writing > 0) return 0;
    for (uint64_t k = r->first_open; k < r->nchunks; k++)
        for (uint32_t d = 0; d < r->ndests; d++) {
            sdest_state_t st = r->cd[k * r->ndests + d].state;
            if (st != SD_READY_SENT && st != SD_DONE) return 0;
        }
    return 1;
}

/* Does everything the room can do now; returns how many steps it took. */
static uint32_t pump_room(kvs_sender_t *tx, sroom_t *r, uint64_t now)
{
    const kvs_pd_timeouts_t *t = &tx->cfg.timeouts;
    const kvs_pd_geometry_t *g = &tx->cfg.geo;
    uint32_t events = 0;
    uint64_t all = kvs_all_bits(r->ndpeers);

    /* Writes in flight complete first, failed room or not: buffers come back only then. */
    for (uint64_t k = r->first_open; k < r->nchunks && r->writing > 0; k++)
        for (uint32_t d = 0; d < r->ndests; d++)
            if (r->cd[k * r->ndests + d].state == SD_WRITING)
                events += collect_write(tx, r, k, d, now);

    if (r->status == KVS_ROOM_FAILED) {
        if (r->writing > 0) return events;
        if (!r->drained_acked) {
            for (uint32_t i = 0; i < r->ndpeers; i++)
                if (r->aborted_by & KVS_BIT(i)) send_abort_ack(tx, r->id, r->group, r->dpeers[i]);
            r->drained_acked = 1;
        }
        /* Failed before any decode rank wrote: a peer the link reports gone (on a link serving
         * several decode instances, every peer of the not yet known one) has nothing to hear. */
        for (uint32_t i = 0; !r->grouped && tx->link->ops->peer_status != NULL && i < r->ndpeers;
             i++)
            if (tx->link->ops->peer_status(tx->link->ctx, peer_of(r, r->dpeers[i])) != KVS_OK)
                r->status_acked |= KVS_BIT(i);
        if (r->status_acked == all || (r->status_sent && now < r->retry_at)) return events;
        if (r->status_sent && now - r->failed_at >= t->release_timeout_ns) {
            r->status_acked = all; /* the decode side is gone; stop telling it */
            return events + 1;
        }
        for (uint32_t i = 0; i < r->ndpeers; i++) {
            if (r->status_acked & KVS_BIT(i)) continue;
            send_status(tx, r, i);
            if (r->status_sent) tx->m.retries++;
        }
        r->status_sent = 1;
        r->retry_at = now + kvs_pd_rto(tx->srtt_ns, t->retry_ns);
        return events + 1;
    }
    if (r->status == KVS_ROOM_SUCCESS) return events;

    /* Timeouts and dead peers. A decode peer is looked at once its metadata came: before, a
     * silent peer may be one that connects only for this room (per-room bootstrap wires a
     * prefill instance on its first room, or again after closing it idle), and the bootstrap
     * timeout bounds the wait. */
    if (kvs_pd_dead_peer(tx->link, r->group, r->dpeers, r->ndpeers, ~r->meta_got) >= 0) {
        fail_room(tx, r, KVS_ERR_IO, "a decode peer stopped answering (liveness timeout)");
        return events + 1;
    }
    if (r->meta_got != all) {
        if (now - r->added_at >= t->bootstrap_timeout_ns)
            fail_room(tx, r, KVS_ERR_TIMEOUT, "bootstrap timeout: no metadata from decode");
        return events;
    }
    if (!waiting_on_decode(r)) {
        r->last_activity = now;
    } else if (now - r->last_activity >= t->transfer_timeout_ns) {
        fail_room(tx, r, KVS_ERR_TIMEOUT, "transfer timeout: decode stopped answering");
        return events + 1;
    }
    if (r->status == KVS_ROOM_BOOTSTRAPPING) r->status = KVS_ROOM_WAITING;

    issue_sends(tx, r);

    /* Request chunks in the window; write every granted chunk whose KV is at rest and keep
     * its CHUNK_READY retried, inside the window or not: a grant goes to every writer of a
     * chunk, so one may arrive unrequested for a chunk beyond this room's window, and holding
     * it would keep the slot while the window waits on another decode rank. */
    const uint64_t F = tx->grid / g->page_size;
    while (r->first_open < r->nchunks) {
        int done = 1;
        for (uint32_t d = 0; d < r->ndests; d++)
            done &= r->cd[r->first_open * r->ndests + d].state == SD_DONE;
        if (!done) break;
        r->first_open++;
    }
    uint64_t window_end = r->first_open + tx->cfg.window_chunks;
    if (window_end > r->nchunks) window_end = r->nchunks;
    for (uint64_t k = r->first_open; k < r->nchunks; k++) {
        /* A slot only for a chunk whose whole KV is computed or in the forward pass now
         * running: a granted slot must be written soon (protocol.md §4.5). */
        uint64_t k_end = r->base + (k + 1) * F * g->page_size;
        if (k_end > r->prompt_len) k_end = r->prompt_len;
        int may_request = k < window_end && (r->finished || k_end <= r->scheduled);
        for (uint32_t d = 0; d < r->ndests; d++) {
            sdest_t *sd = &r->cd[k * r->ndests + d];
            switch (sd->state) {
            case SD_IDLE:
                if (!may_request) break;
                send_staging_req(tx, r, k, d);
                sd->state = SD_REQUESTED;
                arm_retry(tx, sd, now, 0);
                events++;
                break;
            case SD_REQUESTED:
                if (now < sd->retry_at) break;
                send_staging_req(tx, r, k, d);
                tx->m.retries++;
                arm_retry(tx, sd, now, sd->tries + 1);
                break;
            case SD_QUEUED:
                /* Only if decode lost the request (a restart the liveness check missed). */
                if (now < sd->retry_at) break;
                send_staging_req(tx, r, k, d);
                tx->m.retries++;
                sd->state = SD_REQUESTED;
                arm_retry(tx, sd, now, 0);
                break;
            case SD_GRANTED:
                if (k < r->chunks_issued) {
                    kvs_status_t st = start_write(tx, r, k, d);
                    if (st == KVS_OK)
                        events += 1 + collect_write(tx, r, k, d, now);
                    else if (st != KVS_INPROGRESS)
                        fail_room(tx, r, st, "cannot start a write");
                }
                break;
            case SD_WRITTEN:
                if (held(tx, r, d)) break;
                announce(tx, r, k, d, now);
                events++;
                break;
            case SD_READY_SENT:
                if (now < sd->retry_at) break;
                send_chunk_ready(tx, r, k, d);
                tx->m.retries++;
                arm_retry(tx, sd, now, sd->tries + 1);
                break;
            default:
                break;
            }
            if (r->status == KVS_ROOM_FAILED) return events;
        }
    }

    /* STATUS Success goes out once the last send is out and every chunk is written with its
     * CHUNK_READY sent (protocol.md §4.7): decode needs all of them and takes them in any order,
     * so STATUS need not wait for the chunks' acknowledgements (a round trip in every prompt's
     * time to first token). Success once every chunk is acknowledged as well. */
    if (r->finished && r->sent_upto == r->prompt_len && all_written(r)) {
        if (r->status_acked == all) {
            if (r->first_open < r->nchunks) return events;
            r->status = KVS_ROOM_SUCCESS;
            tx->m.rooms_succeeded++;
            return events + 1;
        }
        if (!r->status_sent || now >= r->retry_at) {
            for (uint32_t i = 0; i < r->ndpeers; i++) {
                if (r->status_acked & KVS_BIT(i)) continue;
                send_status(tx, r, i);
                if (r->status_sent) tx->m.retries++;
            }
            r->status_sent = 1;
            r->retry_at = now + kvs_pd_rto(tx->srtt_ns, t->retry_ns);
            events++;
        }
    }
    return events;
}

static uint32_t expire_stash(kvs_sender_t *tx, uint64_t now)
{
    uint32_t n = 0;
    uint64_t id;
    void *v;
    for (size_t it = 0; kvs_map_next(&tx->stash, &it, &id, &v);) {
        sstash_t *s = v;
        if (now < s->expires_at) continue;
        kvs_warn("prefill rank %u: dropping metadata for room %llu, which never arrived",
                 tx->cfg.rank, (unsigned long long) id);
        kvs_map_remove(&tx->stash, id);
        kvs_free(s);
        n++;
    }
    return n;
}

uint32_t kvs_sender_progress(kvs_sender_t *tx)
{
    uint64_t t0 = kvs_now_ns();
    uint32_t events = 0;
    kvs_msg_t msg;
    uint32_t from = 0;
    while (kvs_pd_recv(tx->link, &tx->m, &msg, &from) == KVS_OK) {
        events++;
        if (!msg_to_me(tx, &msg)) {
            tx->m.rejected++;
            continue;
        }
        handle(tx, &msg, kvs_peer_group(from));
    }
    uint64_t now = now_ns(tx);
    void *v;
    for (size_t it = 0; kvs_map_next(&tx->rooms, &it, NULL, &v);) events += pump_room(tx, v, now);
    events += expire_stash(tx, now);
    tx->m.progress_ns += kvs_now_ns() - t0;
    return events;
}

uint32_t kvs_sender_copies_in_flight(const kvs_sender_t *tx)
{
    return tx->writing;
}

void kvs_sender_metrics(const kvs_sender_t *tx, kvs_pd_metrics_t *metrics_p)
{
    *metrics_p = tx->m;
    metrics_p->live_rooms = tx->rooms.count;
    metrics_p->stashed_rooms = tx->stash.count;
    metrics_p->quarantined_rooms = 0;
    void *v;
    for (size_t it = 0; kvs_map_next(&tx->rooms, &it, NULL, &v);) {
        const sroom_t *r = v;
        metrics_p->quarantined_rooms += r->status == KVS_ROOM_FAILED && !room_quiescent(r);
    }
}

kvs_copy_backend_t *kvs__sender_copy_backend(kvs_sender_t *tx)
{
    return &tx->copy;
}
