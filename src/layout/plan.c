/* The transfer plan of protocol.md §2: which prefill rank writes which heads (and, with
 * pipeline stages, which layers) of each decode rank's slot, the converse destinations and
 * status peers, and the slot's region layout. */
#include "kvstage/layout.h"

#include <assert.h>

#include "kvstage/log.h"

/* Validates the shape and both layouts; the rank a caller asks about is range-checked as the
 * rank of its side's layout (the other side's rank is a placeholder 0). */
static kvs_status_t plan_check(const kvs_kv_shape_t *shape, uint32_t prefill_tp,
                               uint32_t prefill_rank, uint32_t decode_tp, uint32_t decode_rank)
{
    kvs_tp_t p = {.tp_size = prefill_tp, .tp_rank = prefill_rank};
    kvs_tp_t d = {.tp_size = decode_tp, .tp_rank = decode_rank};
    kvs_status_t st = kvs_tp_validate(shape, &p);
    if (st != KVS_OK) return st;
    return kvs_tp_validate(shape, &d);
}

static uint64_t writer_bytes_per_token(const kvs_kv_shape_t *shape, uint32_t layers, uint32_t heads)
{
    uint64_t dims = (uint64_t) shape->head_dim_k + shape->head_dim_v;
    return (uint64_t) layers * heads * dims * shape->elem_bytes;
}

/* The prefill rank that ships global head g to decode rank d. When prefill replicates the
 * head group over R ranks, the replica is (room + d) mod R: varying it with the room spreads
 * load across replicas over many requests, and adding the decode rank makes decode replicas
 * of the same head pull from different prefill replicas within one request. Both sides
 * compute this independently, so it must stay a pure function of its arguments. */
static uint32_t plan_source_rank(const kvs_kv_shape_t *shape, uint32_t prefill_tp,
                                 uint32_t decode_rank, uint64_t room, uint32_t g)
{
    uint32_t hp = kvs_tp_heads_per_rank(shape, prefill_tp);
    uint32_t rp = kvs_tp_replication(shape, prefill_tp);
    uint32_t replica = (uint32_t) ((room % rp + decode_rank % rp) % rp);
    return (g / hp) * rp + replica;
}

/* Whether prefill rank p holds at least one of the heads decode rank d needs. */
static int plan_overlaps(const kvs_kv_shape_t *shape, uint32_t prefill_tp, uint32_t p,
                         uint32_t decode_tp, uint32_t d)
{
    if (shape->attn == KVS_ATTN_MLA) return 1;
    uint32_t pf = kvs_tp_first_head(shape, prefill_tp, p);
    uint32_t pe = pf + kvs_tp_heads_per_rank(shape, prefill_tp);
    uint32_t df = kvs_tp_first_head(shape, decode_tp, d);
    uint32_t de = df + kvs_tp_heads_per_rank(shape, decode_tp);
    return pf < de && df < pe;
}

/* Writers for a layout already validated. */
static uint32_t plan_writers_valid(const kvs_kv_shape_t *shape, uint32_t prefill_tp,
                                   uint32_t decode_tp, uint32_t decode_rank, uint64_t room,
                                   kvs_writer_t *writers /* [KVS_MAX_WRITERS] */)
{
    if (shape->attn == KVS_ATTN_MLA) {
        writers[0] = (kvs_writer_t){
            .prefill_rank = (uint32_t) ((room % prefill_tp + decode_rank) % prefill_tp),
            .src_head = 0,
            .dst_head = 0,
            .layers = shape->layers,
            .heads = 1,
            .bytes_per_token = writer_bytes_per_token(shape, shape->layers, 1),
        };
        return 1;
    }
    uint32_t hd = kvs_tp_heads_per_rank(shape, decode_tp);
    uint32_t first = kvs_tp_first_head(shape, decode_tp, decode_rank);
    uint32_t n = 0;
    for (uint32_t g = first; g < first + hd; g++) {
        uint32_t p = plan_source_rank(shape, prefill_tp, decode_rank, room, g);
        if (n > 0 && writers[n - 1].prefill_rank == p) {
            writers[n - 1].heads++;
            continue;
        }
        /* Each prefill rank holds one contiguous head range, so it can contribute at most
         * one run of d's ascending heads: n never exceeds prefill_tp <= KVS_MAX_WRITERS. */
        assert(n < KVS_MAX_WRITERS);
        writers[n++] = (kvs_writer_t){
            .prefill_rank = p,
            .src_head = g - kvs_tp_first_head(shape, prefill_tp, p),
            .dst_head = g - first,
            .layers = shape->layers,
            .heads = 1,
        };
    }
    for (uint32_t i = 0; i < n; i++)
        writers[i].bytes_per_token = writer_bytes_per_token(shape, shape->layers, writers[i].heads);
    return n;
}

kvs_status_t kvs_plan_writers(const kvs_kv_shape_t *shape, uint32_t prefill_tp, uint32_t decode_tp,
                              uint32_t decode_rank, uint64_t room, kvs_writer_t *writers_p,
                              uint32_t *count_p)
{
    kvs_status_t st = plan_check(shape, prefill_tp, 0, decode_tp, decode_rank);
    if (st != KVS_OK) return st;
    kvs_writer_t w[KVS_MAX_WRITERS];
    uint32_t n = plan_writers_valid(shape, prefill_tp, decode_tp, decode_rank, room, w);
    for (uint32_t i = 0; i < n; i++) writers_p[i] = w[i];
    *count_p = n;
    return KVS_OK;
}

kvs_status_t kvs_plan_destinations(const kvs_kv_shape_t *shape, uint32_t prefill_tp,
                                   uint32_t decode_tp, uint32_t prefill_rank, uint64_t room,
                                   kvs_dest_t *dests_p, uint32_t *count_p)
{
    kvs_status_t st = plan_check(shape, prefill_tp, prefill_rank, decode_tp, 0);
    if (st != KVS_OK) return st;
    kvs_dest_t dests[KVS_MAX_TP];
    uint32_t n = 0;
    for (uint32_t d = 0; d < decode_tp; d++) {
        kvs_writer_t w[KVS_MAX_WRITERS];
        uint32_t nw = plan_writers_valid(shape, prefill_tp, decode_tp, d, room, w);
        for (uint32_t i = 0; i < nw; i++) {
            if (w[i].prefill_rank != prefill_rank) continue;
            /* A prefill rank is at most one writer per decode rank (see above). */
            assert(n < KVS_MAX_TP);
            dests[n++] = (kvs_dest_t){.decode_rank = d, .writer = i, .w = w[i]};
        }
    }
    for (uint32_t i = 0; i < n; i++) dests_p[i] = dests[i];
    *count_p = n;
    return KVS_OK;
}

kvs_status_t kvs_plan_peers(const kvs_kv_shape_t *shape, uint32_t prefill_tp, uint32_t decode_tp,
                            uint32_t decode_rank, uint32_t *ranks_p, uint32_t *count_p)
{
    kvs_status_t st = plan_check(shape, prefill_tp, 0, decode_tp, decode_rank);
    if (st != KVS_OK) return st;
    uint32_t n = 0;
    for (uint32_t p = 0; p < prefill_tp; p++) {
        if (plan_overlaps(shape, prefill_tp, p, decode_tp, decode_rank)) ranks_p[n++] = p;
    }
    *count_p = n;
    return KVS_OK;
}

kvs_status_t kvs_plan_decode_peers(const kvs_kv_shape_t *shape, uint32_t prefill_tp,
                                   uint32_t decode_tp, uint32_t prefill_rank, uint32_t *ranks_p,
                                   uint32_t *count_p)
{
    kvs_status_t st = plan_check(shape, prefill_tp, prefill_rank, decode_tp, 0);
    if (st != KVS_OK) return st;
    uint32_t n = 0;
    for (uint32_t d = 0; d < decode_tp; d++) {
        if (plan_overlaps(shape, prefill_tp, prefill_rank, decode_tp, d)) ranks_p[n++] = d;
    }
    *count_p = n;
    return KVS_OK;
}

/* ---- pipeline stages: the TP plan once per stage ---- */

/* Validates the geometry and the rank asked about (decode, or prefill among all stages). */
static kvs_status_t geo_check(const kvs_pd_geometry_t *geo, kvs_side_t side, uint32_t rank)
{
    kvs_status_t st = kvs_pd_geometry_validate(geo);
    if (st != KVS_OK) return st;
    uint32_t n = side == KVS_SIDE_PREFILL ? kvs_pd_geometry_prefill_ranks(geo) : geo->decode_tp;
    if (rank >= n) {
        kvs_error("%s rank %u is out of range for %u %s ranks", kvs_side_str(side), rank, n,
                  kvs_side_str(side));
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

/* A TP writer as the writer of stage s: its rank in that stage, and that stage's layers. */
static kvs_writer_t stage_writer(const kvs_pd_geometry_t *geo, kvs_writer_t w, uint32_t s)
{
    const uint32_t pp = kvs_pd_geometry_pp(geo);
    w.prefill_rank += s * geo->prefill_tp;
    w.stage = s;
    kvs_pp_stage(geo->shape.layers, pp, s, &w.first_layer, &w.layers);
    w.bytes_per_token = writer_bytes_per_token(&geo->shape, w.layers, w.heads);
    return w;
}

kvs_status_t kvs_plan_geo_writers(const kvs_pd_geometry_t *geo, uint32_t decode_rank, uint64_t room,
                                  kvs_writer_t *writers_p, uint32_t *count_p)
{
    kvs_status_t st = geo_check(geo, KVS_SIDE_DECODE, decode_rank);
    if (st != KVS_OK) return st;
    kvs_writer_t tp[KVS_MAX_WRITERS];
    uint32_t n =
        plan_writers_valid(&geo->shape, geo->prefill_tp, geo->decode_tp, decode_rank, room, tp);
    /* n <= prefill TP, so stages x n <= the prefill ranks <= KVS_MAX_WRITERS */
    const uint32_t pp = kvs_pd_geometry_pp(geo);
    for (uint32_t s = 0; s < pp; s++)
        for (uint32_t i = 0; i < n; i++) writers_p[s * n + i] = stage_writer(geo, tp[i], s);
    *count_p = pp * n;
    return KVS_OK;
}

kvs_status_t kvs_plan_geo_destinations(const kvs_pd_geometry_t *geo, uint32_t prefill_rank,
                                       uint64_t room, kvs_dest_t *dests_p, uint32_t *count_p)
{
    kvs_status_t st = geo_check(geo, KVS_SIDE_PREFILL, prefill_rank);
    if (st != KVS_OK) return st;
    const uint32_t s = prefill_rank / geo->prefill_tp;
    kvs_dest_t tp[KVS_MAX_TP];
    uint32_t n = 0;
    kvs_plan_destinations(&geo->shape, geo->prefill_tp, geo->decode_tp,
                          prefill_rank % geo->prefill_tp, room, tp, &n);
    for (uint32_t i = 0; i < n; i++) {
        kvs_writer_t w[KVS_MAX_WRITERS];
        uint32_t nw = plan_writers_valid(&geo->shape, geo->prefill_tp, geo->decode_tp,
                                         tp[i].decode_rank, room, w);
        dests_p[i] = (kvs_dest_t){.decode_rank = tp[i].decode_rank,
                                  .writer = s * nw + tp[i].writer,
                                  .w = stage_writer(geo, tp[i].w, s)};
    }
    *count_p = n;
    return KVS_OK;
}

kvs_status_t kvs_plan_geo_peers(const kvs_pd_geometry_t *geo, uint32_t decode_rank,
                                uint32_t *ranks_p, uint32_t *count_p)
{
    kvs_status_t st = geo_check(geo, KVS_SIDE_DECODE, decode_rank);
    if (st != KVS_OK) return st;
    uint32_t tp[KVS_MAX_TP], n = 0;
    kvs_plan_peers(&geo->shape, geo->prefill_tp, geo->decode_tp, decode_rank, tp, &n);
    const uint32_t pp = kvs_pd_geometry_pp(geo);
    for (uint32_t s = 0; s < pp; s++)
        for (uint32_t i = 0; i < n; i++) ranks_p[s * n + i] = s * geo->prefill_tp + tp[i];
    *count_p = pp * n;
    return KVS_OK;
}

kvs_status_t kvs_plan_geo_decode_peers(const kvs_pd_geometry_t *geo, uint32_t prefill_rank,
                                       uint32_t *ranks_p, uint32_t *count_p)
{
    kvs_status_t st = geo_check(geo, KVS_SIDE_PREFILL, prefill_rank);
    if (st != KVS_OK) return st;
    /* A stage's rank talks to the decode ranks its TP rank talks to. */
    return kvs_plan_decode_peers(&geo->shape, geo->prefill_tp, geo->decode_tp,
                                 prefill_rank % geo->prefill_tp, ranks_p, count_p);
}

static uint64_t align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

uint64_t kvs_slot_layout(const kvs_writer_t *writers, uint32_t count, uint64_t tokens,
                         uint64_t *offsets_p)
{
    uint64_t off = 0;
    for (uint32_t i = 0; i < count; i++) {
        off = align_up(off, KVS_REGION_ALIGN);
        if (offsets_p != NULL) offsets_p[i] = off;
        off += tokens * writers[i].bytes_per_token;
    }
    return align_up(off, KVS_REGION_ALIGN);
}

uint64_t kvs_region_block_offset(const kvs_kv_shape_t *shape, uint32_t heads, uint64_t tokens,
                                 uint32_t layer, uint32_t component)
{
    /* [K layer 0..L-1][V layer 0..L-1], each block [tokens][heads][D] */
    uint64_t row = tokens * heads * shape->elem_bytes;
    uint64_t k_block = row * kvs_kv_shape_dim(shape, 0);
    if (component == 0) return layer * k_block;
    return shape->layers * k_block + layer * row * kvs_kv_shape_dim(shape, 1);
}
