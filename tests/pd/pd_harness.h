/* A direct harness for protocol tests: one prefill and one decode deployment over the inproc
 * transport on a virtual clock, host pools filled with position-keyed bytes, and helpers to
 * run rooms and check every byte that decode received. No engine, no radix: tests drive the
 * sender and receiver APIs by hand. Prefill may have pipeline stages (rank = stage * TP + TP
 * rank, its pool holding its stage's layers) and its own page size. */
#ifndef KVSTAGE_TESTS_PD_HARNESS_H
#define KVSTAGE_TESTS_PD_HARNESS_H

#include "kvs_test.h"

#include <string.h>

#include "kvstage/grid.h"
#include "kvstage/inproc.h"
#include "kvstage/pd.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "transport/link.h"

#define H_MAX_RANKS 16
#define H_TICK_NS   1000ull

typedef struct {
    kvs_pd_geometry_t geo;
    kvs_pd_timeouts_t timeouts;
    uint64_t now;
    kvs_clock_t clock;
    kvs_inproc_net_t *net;
    kvs_pool_t *ppool[H_MAX_RANKS], *dpool[H_MAX_RANKS];
    kvs_link_t *plink[H_MAX_RANKS], *dlink[H_MAX_RANKS];
    kvs_sender_t *tx[H_MAX_RANKS];
    kvs_receiver_t *rx[H_MAX_RANKS];
} h_t;

static uint64_t h_now(void *arg)
{
    return ((h_t *) arg)->now;
}

static inline uint32_t h_prefill_ranks(const h_t *h)
{
    return kvs_pd_geometry_prefill_ranks(&h->geo);
}

/* The byte every side must hold for (room, position, layer, component, global head, byte). */
static inline uint8_t h_value(uint64_t room, uint64_t pos, uint32_t layer, uint32_t comp,
                              uint32_t head, uint32_t byte)
{
    uint64_t x = kvs_mix64(room * 0x9e3779b97f4a7c15ull + pos);
    x = kvs_mix64(x ^ ((uint64_t) layer << 40) ^ ((uint64_t) comp << 36) ^ ((uint64_t) head << 20) ^
                  byte);
    return (uint8_t) x;
}

static inline void h_default_geo(kvs_pd_geometry_t *g, uint32_t ptp, uint32_t dtp, uint32_t heads)
{
    memset(g, 0, sizeof(*g));
    g->shape = (kvs_kv_shape_t){.layers = 2,
                                .kv_heads = heads,
                                .head_dim_k = 8,
                                .head_dim_v = 4,
                                .elem_bytes = 2,
                                .attn = KVS_ATTN_MHA};
    g->prefill_tp = ptp;
    g->decode_tp = dtp;
    g->page_size = 4;
    g->chunk_tokens = 16;
}

static inline void h_setup(h_t *h, const kvs_pd_geometry_t *geo, const kvs_inproc_faults_t *faults,
                           uint64_t ring_bytes, uint32_t pool_pages)
{
    memset(h, 0, sizeof(*h));
    h->geo = *geo;
    h->now = 1;
    h->clock = (kvs_clock_t){h_now, h};
    h->timeouts = (kvs_pd_timeouts_t){
        .retry_ns = 50 * H_TICK_NS,
        .bootstrap_timeout_ns = 20000 * H_TICK_NS,
        .transfer_timeout_ns = 20000 * H_TICK_NS,
        .waiting_timeout_ns = 40000 * H_TICK_NS,
        .completion_timeout_ns = 20000 * H_TICK_NS,
        .release_timeout_ns = 20000 * H_TICK_NS,
    };
    const uint32_t pranks = kvs_pd_geometry_prefill_ranks(geo);
    assert_true(pranks <= H_MAX_RANKS);
    assert_int_equal(kvs_inproc_net_create(pranks, geo->decode_tp, faults, &h->clock, &h->net),
                     KVS_OK);
    for (uint32_t side = 0; side < 2; side++) {
        uint32_t tp = side == 0 ? geo->prefill_tp : geo->decode_tp;
        for (uint32_t r = 0; r < (side == 0 ? pranks : tp); r++) {
            kvs_pool_config_t pc = {
                .shape = side == 0
                             ? kvs_pp_stage_shape(&geo->shape, kvs_pd_geometry_pp(geo), r / tp)
                             : geo->shape,
                .tp = {tp, r % tp},
                .page_size = kvs_pd_geometry_page(geo, (kvs_side_t) side),
                .num_pages = pool_pages,
                .layout = (r % 2) ? KVS_POOL_HND : KVS_POOL_NHD,
                .mem = KVS_MEM_HOST};
            kvs_pool_t **pool = side == 0 ? &h->ppool[r] : &h->dpool[r];
            kvs_link_t **link = side == 0 ? &h->plink[r] : &h->dlink[r];
            assert_int_equal(kvs_pool_create(&pc, pool), KVS_OK);
            assert_int_equal(kvs_inproc_link_create(h->net, (kvs_side_t) side, r, link), KVS_OK);
            if (side == 0) {
                kvs_sender_config_t sc = {.geo = *geo,
                                          .rank = r,
                                          .timeouts = h->timeouts,
                                          .window_chunks = 2,
                                          .staging_buffers = 2};
                assert_int_equal(kvs_sender_create(&sc, *pool, *link, &h->clock, &h->tx[r]),
                                 KVS_OK);
            } else {
                kvs_receiver_config_t rc = {
                    .geo = *geo, .rank = r, .timeouts = h->timeouts, .ring_bytes = ring_bytes};
                assert_int_equal(kvs_receiver_create(&rc, *pool, *link, &h->clock, &h->rx[r]),
                                 KVS_OK);
            }
        }
    }
}

static inline void h_teardown(h_t *h)
{
    for (uint32_t r = 0; r < h_prefill_ranks(h); r++) {
        kvs_sender_destroy(h->tx[r]);
        kvs_link_destroy(h->plink[r]);
        kvs_pool_destroy(h->ppool[r]);
    }
    for (uint32_t r = 0; r < h->geo.decode_tp; r++) {
        kvs_receiver_destroy(h->rx[r]);
        kvs_link_destroy(h->dlink[r]);
        kvs_pool_destroy(h->dpool[r]);
    }
    kvs_inproc_net_destroy(h->net);
}

/* Sends raw bytes as a control message (for malformed-input tests). */
static inline void h_send_raw(kvs_link_t *link, uint32_t peer, const uint8_t *buf, size_t len)
{
    assert_int_equal(link->ops->send(link->ctx, peer, buf, len), KVS_OK);
}

static inline void h_step(h_t *h)
{
    h->now += H_TICK_NS;
    for (uint32_t r = 0; r < h_prefill_ranks(h); r++) kvs_sender_progress(h->tx[r]);
    for (uint32_t r = 0; r < h->geo.decode_tp; r++) kvs_receiver_progress(h->rx[r]);
}

/* Writes the room's KV for positions [from, to) into a prefill rank's pages. */
static inline void h_fill(h_t *h, uint32_t rank, uint64_t room, const uint32_t *page_table,
                          uint64_t from, uint64_t to)
{
    const kvs_kv_shape_t *s = &h->geo.shape;
    const uint32_t tp = h->geo.prefill_tp, P = kvs_pd_geometry_page(&h->geo, KVS_SIDE_PREFILL);
    uint32_t heads = kvs_pool_heads(h->ppool[rank]);
    uint32_t first = kvs_tp_first_head(s, tp, rank % tp);
    uint32_t layer0, layers; /* the rank's stage's */
    kvs_pp_stage(s->layers, kvs_pd_geometry_pp(&h->geo), rank / tp, &layer0, &layers);
    for (uint64_t pos = from; pos < to; pos++) {
        for (uint32_t l = 0; l < layers; l++) {
            for (uint32_t c = 0; c < kvs_kv_shape_components(s); c++) {
                const kvs_region_t *reg = kvs_pool_region(h->ppool[rank], l, c);
                for (uint32_t j = 0; j < heads; j++) {
                    uint8_t *p = kvs_region_addr(reg, page_table[pos / P], pos % P, j);
                    for (uint32_t b = 0; b < reg->dim * reg->elem_bytes; b++)
                        p[b] = h_value(room, pos, layer0 + l, c, first + j, b);
                }
            }
        }
    }
}

/* Counts bytes of positions [base, to) on a decode rank that differ from what prefill held. */
static inline uint64_t h_mismatches(h_t *h, uint32_t rank, uint64_t room,
                                    const uint32_t *delta_pages, uint64_t base, uint64_t to)
{
    const kvs_kv_shape_t *s = &h->geo.shape;
    uint32_t heads = kvs_pool_heads(h->dpool[rank]);
    uint32_t first = kvs_tp_first_head(s, h->geo.decode_tp, rank);
    uint64_t bad = 0;
    for (uint64_t pos = base; pos < to; pos++) {
        uint64_t rel = pos - base;
        for (uint32_t l = 0; l < s->layers; l++) {
            for (uint32_t c = 0; c < kvs_kv_shape_components(s); c++) {
                const kvs_region_t *reg = kvs_pool_region(h->dpool[rank], l, c);
                for (uint32_t j = 0; j < heads; j++) {
                    const uint8_t *p = kvs_region_addr(reg, delta_pages[rel / h->geo.page_size],
                                                       rel % h->geo.page_size, j);
                    for (uint32_t b = 0; b < reg->dim * reg->elem_bytes; b++)
                        bad += p[b] != h_value(room, pos, l, c, first + j, b);
                }
            }
        }
    }
    return bad;
}

/* One room as the tests drive it: prefill page table (same ids on every prefill rank) and
 * decode delta pages (same ids on every decode rank). */
typedef struct {
    uint64_t id, prompt_len, base;
    uint32_t ptable[4096];
    uint32_t dpages[4096];
    uint32_t npp, ndp;
} h_room_t;

static inline void h_room_init(h_t *h, h_room_t *room, uint64_t id, uint64_t prompt_len,
                               uint64_t base)
{
    memset(room, 0, sizeof(*room));
    room->id = id;
    room->prompt_len = prompt_len;
    room->base = base;
    const uint64_t P = h->geo.page_size, Pp = kvs_pd_geometry_page(&h->geo, KVS_SIDE_PREFILL);
    room->npp = (uint32_t) ((prompt_len + Pp - 1) / Pp);
    room->ndp = (uint32_t) kvs_grid_total_pages(prompt_len, base, P);
    for (uint32_t r = 0; r < h_prefill_ranks(h); r++) {
        uint32_t pages[4096];
        assert_int_equal(kvs_pool_alloc(h->ppool[r], room->npp, pages), KVS_OK);
        if (r == 0)
            memcpy(room->ptable, pages, room->npp * sizeof(uint32_t));
        else
            assert_memory_equal(room->ptable, pages, room->npp * sizeof(uint32_t));
    }
    for (uint32_t r = 0; r < h->geo.decode_tp; r++) {
        uint32_t pages[4096];
        assert_int_equal(kvs_pool_alloc(h->dpool[r], room->ndp, pages), KVS_OK);
        if (r == 0)
            memcpy(room->dpages, pages, room->ndp * sizeof(uint32_t));
        else
            assert_memory_equal(room->dpages, pages, room->ndp * sizeof(uint32_t));
    }
}

static inline void h_room_free(h_t *h, h_room_t *room)
{
    for (uint32_t r = 0; r < h_prefill_ranks(h); r++)
        assert_int_equal(kvs_pool_free(h->ppool[r], room->ptable, room->npp), KVS_OK);
    for (uint32_t r = 0; r < h->geo.decode_tp; r++)
        assert_int_equal(kvs_pool_free(h->dpool[r], room->dpages, room->ndp), KVS_OK);
}

/* The MIN status over ranks of one side, and whether every rank is quiescent. */
static inline kvs_room_status_t h_status(h_t *h, int decode, uint64_t room, int *quiescent_p)
{
    kvs_room_status_t min = KVS_ROOM_SUCCESS;
    int q = 1;
    uint32_t tp = decode ? h->geo.decode_tp : h_prefill_ranks(h);
    for (uint32_t r = 0; r < tp; r++) {
        kvs_room_info_t info;
        kvs_status_t st = decode ? kvs_receiver_poll(h->rx[r], room, &info)
                                 : kvs_sender_poll(h->tx[r], room, &info);
        assert_int_equal(st, KVS_OK);
        if (info.status < min) min = info.status;
        q &= info.quiescent;
    }
    if (quiescent_p) *quiescent_p = q;
    return min;
}

static inline int h_concluded(h_t *h, uint64_t room)
{
    int qp, qd;
    kvs_room_status_t sp = h_status(h, 0, room, &qp), sd = h_status(h, 1, room, &qd);
    return qp && qd && (sp == KVS_ROOM_SUCCESS || sp == KVS_ROOM_FAILED) &&
           (sd == KVS_ROOM_SUCCESS || sd == KVS_ROOM_FAILED);
}

static inline void h_release(h_t *h, uint64_t room)
{
    for (uint32_t r = 0; r < h_prefill_ranks(h); r++)
        assert_int_equal(kvs_sender_release(h->tx[r], room), KVS_OK);
    for (uint32_t r = 0; r < h->geo.decode_tp; r++)
        assert_int_equal(kvs_receiver_release(h->rx[r], room), KVS_OK);
}

/* protocol.md §7.1 on the protocol objects: nothing live on any rank. */
static inline void h_assert_idle(h_t *h)
{
    kvs_pd_metrics_t m;
    for (uint32_t r = 0; r < h_prefill_ranks(h); r++) {
        kvs_sender_metrics(h->tx[r], &m);
        assert_int_equal(m.live_rooms, 0);
        assert_int_equal(kvs_sender_copies_in_flight(h->tx[r]), 0);
    }
    for (uint32_t r = 0; r < h->geo.decode_tp; r++) {
        kvs_receiver_metrics(h->rx[r], &m);
        assert_int_equal(m.live_rooms, 0);
        assert_int_equal(m.live_slots, 0);
        assert_int_equal(m.ring_used, 0);
        assert_int_equal(kvs_receiver_copies_in_flight(h->rx[r]), 0);
        assert_int_equal(kvs_pool_free_pages(h->dpool[r]), kvs_pool_total_pages(h->dpool[r]));
    }
    for (uint32_t r = 0; r < h_prefill_ranks(h); r++)
        assert_int_equal(kvs_pool_free_pages(h->ppool[r]), kvs_pool_total_pages(h->ppool[r]));
}

/* One room as an engine drives it in h_run_rooms. */
typedef struct {
    h_room_t room;
    uint64_t computed;    /* what the "engine" has computed so far */
    uint64_t prefill_hit; /* at-rest prefix on prefill (early send) */
    int added_prefill, finished, released;
    int stall; /* never finishes: for timeout tests */
    kvs_room_status_t final_status;
    uint64_t mismatched;
    uint64_t reasons; /* bit -reason of every rank, either side, that failed the room */
} h_run_room_t;

/* The bit of a failure reason in h_run_room_t.reasons. */
#define H_REASON(st) (1ull << ((uint32_t) - (st) &63))

/* Adds the reason of every rank of both sides that failed the room to *reasons. */
static inline void h_collect_reasons(h_t *h, uint64_t room, uint64_t *reasons)
{
    kvs_room_info_t info;
    for (uint32_t r = 0; r < h_prefill_ranks(h); r++) {
        assert_int_equal(kvs_sender_poll(h->tx[r], room, &info), KVS_OK);
        if (info.status == KVS_ROOM_FAILED) *reasons |= H_REASON(info.reason);
    }
    for (uint32_t r = 0; r < h->geo.decode_tp; r++) {
        assert_int_equal(kvs_receiver_poll(h->rx[r], room, &info), KVS_OK);
        if (info.status == KVS_ROOM_FAILED) *reasons |= H_REASON(info.reason);
    }
}

/* Drives rooms like an engine would: decode registers first, prefill adds the room a little
 * later, computes one chunk every few ticks and finishes; concluded rooms are verified, then
 * released and their pages freed. Returns the number of steps taken. */
static inline uint64_t h_run_rooms(h_t *h, h_run_room_t *rooms, size_t n, uint64_t max_steps)
{
    const uint64_t C = h->geo.chunk_tokens;
    for (size_t i = 0; i < n; i++) {
        h_room_t *rm = &rooms[i].room;
        for (uint32_t r = 0; r < h->geo.decode_tp; r++)
            assert_int_equal(
                kvs_receiver_add_room(h->rx[r], rm->id, rm->base, rm->prompt_len, rm->dpages),
                KVS_OK);
    }
    size_t left = n;
    uint64_t step = 0;
    for (; step < max_steps && left > 0; step++) {
        h_step(h);
        for (size_t i = 0; i < n; i++) {
            h_run_room_t *rr = &rooms[i];
            h_room_t *rm = &rr->room;
            if (rr->released) continue;
            if (!rr->added_prefill && step >= i % 7) {
                for (uint32_t r = 0; r < h_prefill_ranks(h); r++) {
                    assert_int_equal(
                        kvs_sender_add_room(h->tx[r], rm->id, rm->prompt_len, rm->ptable), KVS_OK);
                    h_fill(h, r, rm->id, rm->ptable, 0, rr->prefill_hit);
                    /* The cached prefix is at rest: it may go before any forward pass. */
                    assert_int_equal(
                        kvs_sender_advance(h->tx[r], rm->id, rr->prefill_hit, rr->prefill_hit),
                        KVS_OK);
                }
                rr->computed = rr->prefill_hit;
                rr->added_prefill = 1;
            } else if (rr->added_prefill && !rr->finished && !rr->stall && step % 3 == 0) {
                uint64_t next = rr->computed + C;
                if (next > rm->prompt_len) next = rm->prompt_len;
                for (uint32_t r = 0; r < h_prefill_ranks(h); r++) {
                    h_fill(h, r, rm->id, rm->ptable, rr->computed, next);
                    if (next == rm->prompt_len) {
                        uint32_t token = (uint32_t) rm->id * 7 + 1;
                        assert_int_equal(kvs_sender_finish(h->tx[r], rm->id, &token, 4), KVS_OK);
                    } else {
                        assert_int_equal(kvs_sender_advance(h->tx[r], rm->id, next, next + C),
                                         KVS_OK);
                    }
                }
                rr->computed = next;
                rr->finished = next == rm->prompt_len;
            }
            if (!rr->added_prefill || !h_concluded(h, rm->id)) continue;
            rr->final_status = h_status(h, 1, rm->id, NULL);
            h_collect_reasons(h, rm->id, &rr->reasons);
            if (rr->final_status == KVS_ROOM_SUCCESS) {
                for (uint32_t r = 0; r < h->geo.decode_tp; r++) {
                    rr->mismatched +=
                        h_mismatches(h, r, rm->id, rm->dpages, rm->base, rm->prompt_len);
                    kvs_room_info_t info;
                    assert_int_equal(kvs_receiver_poll(h->rx[r], rm->id, &info), KVS_OK);
                    uint32_t token = (uint32_t) rm->id * 7 + 1;
                    assert_int_equal(info.final_len, 4);
                    assert_memory_equal(info.final, &token, 4);
                }
                /* Success on decode implies Success on prefill. */
                assert_int_equal(h_status(h, 0, rm->id, NULL), KVS_ROOM_SUCCESS);
            }
            h_release(h, rm->id);
            h_room_free(h, rm);
            rr->released = 1;
            left--;
        }
    }
    return step;
}

static inline void h_assert_all_succeeded(h_run_room_t *rooms, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!rooms[i].released || rooms[i].final_status != KVS_ROOM_SUCCESS ||
            rooms[i].mismatched != 0)
            fail_msg("room %llu: released %d status %s mismatched %llu",
                     (unsigned long long) rooms[i].room.id, rooms[i].released,
                     kvs_room_status_str(rooms[i].final_status),
                     (unsigned long long) rooms[i].mismatched);
    }
}

#endif
