/* KV shape, tensor-parallel layout, pipeline stages, decode context parallelism and the
 * transfer plan (protocol.md §1 and §2). Everything here is a pure function of its arguments. */
#ifndef KVSTAGE_LAYOUT_H
#define KVSTAGE_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/grid.h"
#include "kvstage/status.h"

#define KVS_MAX_TP        64  /* largest TP size on either side; most prefill ranks (PP x TP) */
#define KVS_MAX_WRITERS   64  /* most writers one decode rank can have for one slot */
#define KVS_REGION_ALIGN  256 /* writer regions in a slot start at multiples of this */
#define KVS_MAX_PAGE_SIZE (1u << 20) /* largest page size in tokens on either side */

/* A link's name for a rank of the other side (`peer` in the link ops): the rank alone, except
 * on a prefill net link that serves several decode instances at once, whose peers are
 * (instance, rank) with the instance numbered by the link (its "group"; protocol.md §5.3).
 * Group 0 is the only one of every other link, so there a peer is its rank. */
#define KVS_PEER_RANK_BITS 6 /* ranks below KVS_MAX_TP */
#define KVS_PEER_MAX_GROUP ((1u << (32 - KVS_PEER_RANK_BITS)) - 1)
static inline uint32_t kvs_peer_id(uint32_t group, uint32_t rank)
{
    return group << KVS_PEER_RANK_BITS | rank;
}
static inline uint32_t kvs_peer_rank(uint32_t peer)
{
    return peer & ((1u << KVS_PEER_RANK_BITS) - 1);
}
static inline uint32_t kvs_peer_group(uint32_t peer)
{
    return peer >> KVS_PEER_RANK_BITS;
}

typedef enum {
    KVS_ATTN_MHA = 0, /* MHA or GQA: K and V per KV head, sharded by head */
    KVS_ATTN_MLA = 1, /* one latent per token and layer, held whole by every rank */
} kvs_attn_t;

typedef struct {
    uint32_t layers;     /* L */
    uint32_t kv_heads;   /* H; must be 1 for MLA */
    uint32_t head_dim_k; /* Dk elements; for MLA the latent width */
    uint32_t head_dim_v; /* Dv elements; must be 0 for MLA */
    uint32_t elem_bytes; /* E: 1, 2 or 4 */
    kvs_attn_t attn;
} kvs_kv_shape_t;

/* Checks ranges (layers, heads, dims > 0, E in {1,2,4}, MLA rules); logs what is wrong. */
kvs_status_t kvs_kv_shape_validate(const kvs_kv_shape_t *shape);

/* Number of K/V components per layer: 2 for MHA, 1 for MLA. */
uint32_t kvs_kv_shape_components(const kvs_kv_shape_t *shape);
/* Element count of one head of component c (0 = K or latent, 1 = V). */
uint32_t kvs_kv_shape_dim(const kvs_kv_shape_t *shape, uint32_t component);

/* One side's attention tensor-parallel layout. */
typedef struct {
    uint32_t tp_size;
    uint32_t tp_rank;
} kvs_tp_t;

/* Validates that tp_size is in [1, KVS_MAX_TP], tp_rank < tp_size, and that for MHA either
 * H % T == 0 or T % H == 0 (e.g. 3 heads over TP 2 is refused with a clear error). */
kvs_status_t kvs_tp_validate(const kvs_kv_shape_t *shape, const kvs_tp_t *tp);

/* h = max(1, H/T): heads held by each rank (1 for MLA). */
uint32_t kvs_tp_heads_per_rank(const kvs_kv_shape_t *shape, uint32_t tp_size);
/* R = max(1, T/H): how many ranks hold the same head group (T for MLA). */
uint32_t kvs_tp_replication(const kvs_kv_shape_t *shape, uint32_t tp_size);
/* First global head held by rank r: (r / R) * h (0 for MLA). */
uint32_t kvs_tp_first_head(const kvs_kv_shape_t *shape, uint32_t tp_size, uint32_t rank);

/* One writer of a decode rank's slot: a run of consecutive heads from one prefill rank, over
 * the layers that rank holds (all of them without pipeline parallelism). */
typedef struct {
    uint32_t prefill_rank; /* stage * prefill TP + TP rank */
    uint32_t stage;        /* the prefill rank's pipeline stage (0 without PP) */
    uint32_t first_layer;  /* it writes layers [first_layer, first_layer + layers) */
    uint32_t layers;
    uint32_t src_head;        /* head offset within the prefill rank's heads */
    uint32_t dst_head;        /* head offset within the decode rank's heads */
    uint32_t heads;           /* head count (1 for MLA: the latent) */
    uint64_t bytes_per_token; /* layers * heads * (Dk + Dv) * E, or layers * Dk * E for MLA */
} kvs_writer_t;

/* One destination of a prefill rank: it is writer number `writer` of decode rank
 * `decode_rank`. */
typedef struct {
    uint32_t decode_rank;
    uint32_t writer; /* index into that decode rank's writer list */
    kvs_writer_t w;
} kvs_dest_t;

/* The TP plan (one prefill stage holding every layer). Writers of decode rank d, in writer
 * order (ascending dst_head). Replicated prefill heads
 * ship once, from the replica chosen by room id; MLA has one writer per decode rank, chosen
 * by room id. writers_p needs KVS_MAX_WRITERS entries. */
kvs_status_t kvs_plan_writers(const kvs_kv_shape_t *shape, uint32_t prefill_tp, uint32_t decode_tp,
                              uint32_t decode_rank, uint64_t room, kvs_writer_t *writers_p,
                              uint32_t *count_p);

/* Destinations of prefill rank p, ascending decode rank. dests_p needs KVS_MAX_TP entries.
 * A rank may have none (a replica not chosen for this room): it still reports status. */
kvs_status_t kvs_plan_destinations(const kvs_kv_shape_t *shape, uint32_t prefill_tp,
                                   uint32_t decode_tp, uint32_t prefill_rank, uint64_t room,
                                   kvs_dest_t *dests_p, uint32_t *count_p);

/* Prefill ranks that decode rank d exchanges room metadata and status with: every prefill
 * rank holding at least one head that d needs (for MLA: every prefill rank), ascending.
 * ranks_p needs KVS_MAX_TP entries. */
kvs_status_t kvs_plan_peers(const kvs_kv_shape_t *shape, uint32_t prefill_tp, uint32_t decode_tp,
                            uint32_t decode_rank, uint32_t *ranks_p, uint32_t *count_p);

/* The converse: decode ranks that prefill rank p expects metadata from and reports status
 * to, ascending. ranks_p needs KVS_MAX_TP entries. */
kvs_status_t kvs_plan_decode_peers(const kvs_kv_shape_t *shape, uint32_t prefill_tp,
                                   uint32_t decode_tp, uint32_t prefill_rank, uint32_t *ranks_p,
                                   uint32_t *count_p);

/* Slot layout for `tokens` tokens: writer i's region starts at offsets_p[i] (multiples of
 * KVS_REGION_ALIGN, in writer order) and holds tokens * bytes_per_token bytes laid out as
 * [K of its layers][V of its layers], each layer block [tokens][heads][D]. Returns the slot's
 * total size (end of the last region rounded up to KVS_REGION_ALIGN). offsets_p may be NULL. */
uint64_t kvs_slot_layout(const kvs_writer_t *writers, uint32_t count, uint64_t tokens,
                         uint64_t *offsets_p);

/* Byte offset, inside one writer region of `tokens` tokens, of the block for (layer,
 * component): component 0 = K (or latent), 1 = V. A pipeline stage's writer passes its stage's
 * shape (kvs_pp_stage_shape) and a layer counted from its first. */
uint64_t kvs_region_block_offset(const kvs_kv_shape_t *shape, uint32_t heads, uint64_t tokens,
                                 uint32_t layer, uint32_t component);

/* Which side of a deployment a rank is on. */
typedef enum { KVS_SIDE_PREFILL = 0, KVS_SIDE_DECODE = 1 } kvs_side_t;

static inline const char *kvs_side_str(kvs_side_t side)
{
    return side == KVS_SIDE_PREFILL ? "prefill" : "decode";
}

/* What both sides of a deployment must agree on (checked at bootstrap). */
typedef struct {
    kvs_kv_shape_t shape;
    uint32_t prefill_tp;
    uint32_t decode_tp;
    /* Pd: the decode pool's page size, to which the grid is aligned (protocol.md §1). */
    uint32_t page_size;
    /* Pp: the prefill pool's page size; 0 = page_size. Any pair works: prefill pages are
     * gathered at any token offset (protocol.md §1, "page sizes"). */
    uint32_t prefill_page_size;
    uint32_t chunk_tokens; /* C: chunked-prefill size, a multiple of Pd; G = C */
    /* Pipeline stages on prefill (0 or 1: none): the prefill instance is prefill_pp x
     * prefill_tp ranks, rank = stage * prefill_tp + TP rank, stage s holding the layers
     * kvs_pp_stage gives it (protocol.md §2, "Pipeline stages"). */
    uint32_t prefill_pp;
    /* Decode context parallelism (0 or 1: none; protocol.md §1 "Context parallelism"): the
     * decode ranks form groups of decode_dcp consecutive ranks that hold the same heads (so it
     * divides the ranks holding each head) and different tokens: token t on group rank
     * (t / T) mod N, T = dcp_interleave (0: 1), which divides the decode page. The decode
     * prefix and the chunk size are then multiples of N x Pd (kvs_pd_geometry_unit). */
    uint32_t decode_dcp;
    uint32_t dcp_interleave;
    /* 0 (the default): every CHUNK_READY carries its region's checksum and decode verifies it
     * before the chunk counts (protocol.md §5.5); 1: off. Both sides must agree. */
    uint32_t no_checksum;
} kvs_pd_geometry_t;

/* Checks the shape, both TP layouts, both page sizes in [1, KVS_MAX_PAGE_SIZE], the prefill
 * stages (at most one per layer, at most KVS_MAX_TP prefill ranks), the decode DCP groups (N
 * dividing the decode ranks that hold each head, T dividing the decode page) and the chunk
 * size (a positive multiple of kvs_pd_geometry_unit); logs what is wrong, naming the numbers. */
kvs_status_t kvs_pd_geometry_validate(const kvs_pd_geometry_t *geo);

/* Whether one side's pools may live on a GPU (kvs_sender_create and kvs_receiver_create ask it
 * of device pools): the CUDA copy kernels move whole pages only, so a GPU prefill pool needs
 * its page size to divide the decode page size, a GPU decode pool needs its page size to divide
 * the prefill page size (both: equal sizes), and neither runs decode context parallelism. The
 * CPU backend does partial pages and DCP runs. KVS_ERR_UNSUPPORTED, logged with the numbers. */
kvs_status_t kvs_pd_geometry_check_device(const kvs_pd_geometry_t *geo, kvs_side_t side);

/* The page size of one side's pools: page_size for decode, prefill_page_size (or page_size when
 * that is 0) for prefill. */
uint32_t kvs_pd_geometry_page(const kvs_pd_geometry_t *geo, kvs_side_t side);

/* DCP group size N (decode_dcp, or 1 when 0) and interleave T (dcp_interleave, or 1). */
uint32_t kvs_pd_geometry_dcp(const kvs_pd_geometry_t *geo);
uint32_t kvs_pd_geometry_interleave(const kvs_pd_geometry_t *geo);
/* Decode rank d's place in its DCP group: {N, T, d mod N}. */
kvs_dcp_t kvs_pd_geometry_dcp_of(const kvs_pd_geometry_t *geo, uint32_t decode_rank);
/* U = N x Pd: the tokens of one page on every rank of a DCP group (Pd without DCP). The decode
 * prefix and the chunk size are multiples of it, and decode allocates and caches prefixes in
 * such pages, page id i holding [i*U, (i+1)*U) on every rank (protocol.md §1). */
uint32_t kvs_pd_geometry_unit(const kvs_pd_geometry_t *geo);

/* ---- pipeline stages (protocol.md §2, "Pipeline stages") ---- */

/* Stage s of pp over L layers holds L/pp layers, one more for the first L % pp stages, in
 * order: first_p = s * (L/pp) + min(s, L % pp). Needs 1 <= pp <= L and s < pp. */
void kvs_pp_stage(uint32_t layers, uint32_t pp, uint32_t stage, uint32_t *first_p,
                  uint32_t *count_p);
/* The KV shape of the layers stage s holds (layers = its count): its pools' shape. */
kvs_kv_shape_t kvs_pp_stage_shape(const kvs_kv_shape_t *shape, uint32_t pp, uint32_t stage);

/* Pipeline stages of the geometry's prefill side (prefill_pp, or 1 when 0). */
uint32_t kvs_pd_geometry_pp(const kvs_pd_geometry_t *geo);
/* Prefill ranks: stages x prefill TP. */
uint32_t kvs_pd_geometry_prefill_ranks(const kvs_pd_geometry_t *geo);

/* The plan of a whole deployment: the TP plan once per prefill stage. Decode rank d's writers
 * are stage 0's TP writers, then stage 1's, ... (each for its stage's layers); a prefill rank
 * (stage s, TP rank p) has p's TP destinations, as writers of stage s; a decode rank's peers
 * are its TP peers in every stage. Output capacities as for the TP functions. */
kvs_status_t kvs_plan_geo_writers(const kvs_pd_geometry_t *geo, uint32_t decode_rank, uint64_t room,
                                  kvs_writer_t *writers_p, uint32_t *count_p);
kvs_status_t kvs_plan_geo_destinations(const kvs_pd_geometry_t *geo, uint32_t prefill_rank,
                                       uint64_t room, kvs_dest_t *dests_p, uint32_t *count_p);
kvs_status_t kvs_plan_geo_peers(const kvs_pd_geometry_t *geo, uint32_t decode_rank,
                                uint32_t *ranks_p, uint32_t *count_p);
kvs_status_t kvs_plan_geo_decode_peers(const kvs_pd_geometry_t *geo, uint32_t prefill_rank,
                                       uint32_t *ranks_p, uint32_t *count_p);

#endif
