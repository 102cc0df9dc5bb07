/* KV shape validation, the tensor-parallel head layout of one side and the geometry both sides
 * agree on: page sizes, pipeline stages, decode context parallel groups (protocol.md §1, §2). */
#include "kvstage/layout.h"

#include "kvstage/log.h"

/* a * b, or 0 with *overflow set when the product does not fit in 64 bits. */
static uint64_t mul_checked(uint64_t a, uint64_t b, int *overflow)
{
    if (a != 0 && b > UINT64_MAX / a) {
        *overflow = 1;
        return 0;
    }
    return a * b;
}

kvs_status_t kvs_kv_shape_validate(const kvs_kv_shape_t *shape)
{
    if (shape == NULL) {
        kvs_error("KV shape is NULL");
        return KVS_ERR_INVALID;
    }
    if (shape->attn != KVS_ATTN_MHA && shape->attn != KVS_ATTN_MLA) {
        kvs_error("KV shape: attn = %d is neither MHA (0) nor MLA (1)", (int) shape->attn);
        return KVS_ERR_INVALID;
    }
    if (shape->layers == 0) {
        kvs_error("KV shape: layers = 0, need at least 1");
        return KVS_ERR_INVALID;
    }
    if (shape->kv_heads == 0) {
        kvs_error("KV shape: kv_heads = 0, need at least 1");
        return KVS_ERR_INVALID;
    }
    if (shape->head_dim_k == 0) {
        kvs_error("KV shape: head_dim_k = 0, need at least 1");
        return KVS_ERR_INVALID;
    }
    if (shape->elem_bytes != 1 && shape->elem_bytes != 2 && shape->elem_bytes != 4) {
        kvs_error("KV shape: elem_bytes = %u, must be 1, 2 or 4", shape->elem_bytes);
        return KVS_ERR_INVALID;
    }
    if (shape->attn == KVS_ATTN_MHA) {
        if (shape->head_dim_v == 0) {
            kvs_error("KV shape: head_dim_v = 0, MHA needs a V head dim of at least 1");
            return KVS_ERR_INVALID;
        }
    } else {
        if (shape->kv_heads != 1) {
            kvs_error("KV shape: kv_heads = %u, MLA has exactly one latent (kv_heads = 1)",
                      shape->kv_heads);
            return KVS_ERR_INVALID;
        }
        if (shape->head_dim_v != 0) {
            kvs_error("KV shape: head_dim_v = %u, MLA has no V (head_dim_v = 0)",
                      shape->head_dim_v);
            return KVS_ERR_INVALID;
        }
    }
    /* Every byte count downstream (writer bytes_per_token, slot sizes) derives from the
     * whole model's bytes per token; refusing an overflow here keeps them all exact. */
    int overflow = 0;
    uint64_t dims = (uint64_t) shape->head_dim_k + shape->head_dim_v;
    uint64_t per_token = mul_checked(shape->layers, shape->kv_heads, &overflow);
    per_token = mul_checked(per_token, dims, &overflow);
    per_token = mul_checked(per_token, shape->elem_bytes, &overflow);
    if (overflow || per_token > UINT32_MAX * (uint64_t) 1024) {
        kvs_error("KV shape: %u layers x %u heads x (%u + %u) dims x %u bytes per token is "
                  "too large",
                  shape->layers, shape->kv_heads, shape->head_dim_k, shape->head_dim_v,
                  shape->elem_bytes);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

uint32_t kvs_kv_shape_components(const kvs_kv_shape_t *shape)
{
    return shape->attn == KVS_ATTN_MLA ? 1 : 2;
}

uint32_t kvs_kv_shape_dim(const kvs_kv_shape_t *shape, uint32_t component)
{
    if (component == 0) return shape->head_dim_k;
    if (component == 1 && shape->attn == KVS_ATTN_MHA) return shape->head_dim_v;
    return 0;
}

kvs_status_t kvs_tp_validate(const kvs_kv_shape_t *shape, const kvs_tp_t *tp)
{
    kvs_status_t st = kvs_kv_shape_validate(shape);
    if (st != KVS_OK) return st;
    if (tp == NULL) {
        kvs_error("TP layout is NULL");
        return KVS_ERR_INVALID;
    }
    if (tp->tp_size == 0 || tp->tp_size > KVS_MAX_TP) {
        kvs_error("TP size %u is out of range [1, %d]", tp->tp_size, KVS_MAX_TP);
        return KVS_ERR_INVALID;
    }
    if (tp->tp_rank >= tp->tp_size) {
        kvs_error("TP rank %u is out of range for TP size %u", tp->tp_rank, tp->tp_size);
        return KVS_ERR_INVALID;
    }
    uint32_t h = shape->kv_heads, t = tp->tp_size;
    if (shape->attn == KVS_ATTN_MHA && h % t != 0 && t % h != 0) {
        kvs_error("%u KV heads cannot be split over TP %u: need H %% T == 0 or T %% H == 0", h, t);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

uint32_t kvs_tp_heads_per_rank(const kvs_kv_shape_t *shape, uint32_t tp_size)
{
    if (shape->attn == KVS_ATTN_MLA || tp_size == 0) return 1;
    uint32_t h = shape->kv_heads / tp_size;
    return h > 0 ? h : 1;
}

uint32_t kvs_tp_replication(const kvs_kv_shape_t *shape, uint32_t tp_size)
{
    if (tp_size == 0) return 1;
    if (shape->attn == KVS_ATTN_MLA) return tp_size;
    uint32_t r = shape->kv_heads > 0 ? tp_size / shape->kv_heads : 1;
    return r > 0 ? r : 1;
}

uint32_t kvs_tp_first_head(const kvs_kv_shape_t *shape, uint32_t tp_size, uint32_t rank)
{
    if (shape->attn == KVS_ATTN_MLA) return 0;
    return (rank / kvs_tp_replication(shape, tp_size)) * kvs_tp_heads_per_rank(shape, tp_size);
}

kvs_status_t kvs_pd_geometry_check_device(const kvs_pd_geometry_t *geo, kvs_side_t side)
{
    const uint32_t own = kvs_pd_geometry_page(geo, side);
    const uint32_t other =
        kvs_pd_geometry_page(geo, side == KVS_SIDE_PREFILL ? KVS_SIDE_DECODE : KVS_SIDE_PREFILL);
    /* Every chunk starts on a decode page; the last ends where both sides' pages do
     * (protocol.md §1), so this side's copies are whole pages exactly when its page size
     * divides the other's. */
    if (own == 0 || other % own != 0) {
        kvs_error("%s pools on a GPU need their page size (%u) to divide the %s page size (%u): "
                  "the CUDA copy kernels move whole pages only (partial pages are the CPU "
                  "backend's for now)",
                  kvs_side_str(side), own,
                  kvs_side_str(side == KVS_SIDE_PREFILL ? KVS_SIDE_DECODE : KVS_SIDE_PREFILL),
                  other);
        return KVS_ERR_UNSUPPORTED;
    }
    if (kvs_pd_geometry_dcp(geo) > 1) {
        kvs_error("%s pools on a GPU cannot run decode context parallelism (DCP %u): the CUDA "
                  "copy kernels move whole pages only (DCP runs are the CPU backend's for now)",
                  kvs_side_str(side), kvs_pd_geometry_dcp(geo));
        return KVS_ERR_UNSUPPORTED;
    }
    return KVS_OK;
}

kvs_status_t kvs_pd_geometry_validate(const kvs_pd_geometry_t *geo)
{
    kvs_status_t st = kvs_kv_shape_validate(&geo->shape);
    if (st != KVS_OK) return st;
    kvs_tp_t p = {geo->prefill_tp, 0}, d = {geo->decode_tp, 0};
    if ((st = kvs_tp_validate(&geo->shape, &p)) != KVS_OK) return st;
    if ((st = kvs_tp_validate(&geo->shape, &d)) != KVS_OK) return st;
    if (geo->page_size == 0 || geo->page_size > KVS_MAX_PAGE_SIZE) {
        kvs_error("decode page size %u is out of range [1, %u]", geo->page_size, KVS_MAX_PAGE_SIZE);
        return KVS_ERR_INVALID;
    }
    if (geo->prefill_page_size > KVS_MAX_PAGE_SIZE) {
        kvs_error("prefill page size %u is out of range [1, %u] (0: the decode page size)",
                  geo->prefill_page_size, KVS_MAX_PAGE_SIZE);
        return KVS_ERR_INVALID;
    }
    uint32_t pp = kvs_pd_geometry_pp(geo);
    if (pp > geo->shape.layers) {
        kvs_error("%u prefill pipeline stages for %u layers: a stage needs at least one layer", pp,
                  geo->shape.layers);
        return KVS_ERR_INVALID;
    }
    if ((uint64_t) pp * geo->prefill_tp > KVS_MAX_TP) {
        kvs_error("prefill PP %u x TP %u = %u ranks, more than the %d a deployment supports", pp,
                  geo->prefill_tp, pp * geo->prefill_tp, KVS_MAX_TP);
        return KVS_ERR_INVALID;
    }
    const uint32_t n = kvs_pd_geometry_dcp(geo), t = kvs_pd_geometry_interleave(geo);
    if (n > KVS_MAX_TP || geo->decode_tp % n != 0) {
        kvs_error("decode DCP %u does not divide decode TP %u", n, geo->decode_tp);
        return KVS_ERR_INVALID;
    }
    /* A DCP group holds the same heads: its N ranks must be replicas of one head group. */
    const uint32_t replicas = kvs_tp_replication(&geo->shape, geo->decode_tp);
    if (replicas % n != 0) {
        kvs_error("decode DCP %u needs %u decode ranks holding the same KV heads, but decode TP "
                  "%u over %u KV heads holds each head on %u (DCP must divide max(1, TP / heads))",
                  n, n, geo->decode_tp, geo->shape.kv_heads, replicas);
        return KVS_ERR_INVALID;
    }
    if (t > geo->page_size || geo->page_size % t != 0) {
        kvs_error("DCP interleave %u must divide the decode page size %u (a page holds whole "
                  "runs of a rank's tokens)",
                  t, geo->page_size);
        return KVS_ERR_INVALID;
    }
    /* Slot boundaries lie at base + k*C and must fall on decode pages (of every DCP rank);
     * prefill pages are gathered at any offset, so C need not be a multiple of the prefill
     * page. */
    const uint32_t unit = kvs_pd_geometry_unit(geo);
    if (geo->chunk_tokens == 0 || geo->chunk_tokens % unit != 0) {
        if (n > 1)
            kvs_error("chunk size %u must be a positive multiple of decode DCP %u x decode page "
                      "size %u = %u",
                      geo->chunk_tokens, n, geo->page_size, unit);
        else
            kvs_error("chunk size %u must be a positive multiple of the decode page size %u",
                      geo->chunk_tokens, geo->page_size);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

uint32_t kvs_pd_geometry_dcp(const kvs_pd_geometry_t *geo)
{
    return geo->decode_dcp > 1 ? geo->decode_dcp : 1;
}

uint32_t kvs_pd_geometry_interleave(const kvs_pd_geometry_t *geo)
{
    return geo->dcp_interleave > 1 ? geo->dcp_interleave : 1;
}

kvs_dcp_t kvs_pd_geometry_dcp_of(const kvs_pd_geometry_t *geo, uint32_t decode_rank)
{
    const uint32_t n = kvs_pd_geometry_dcp(geo);
    return (kvs_dcp_t){
        .size = n, .interleave = kvs_pd_geometry_interleave(geo), .rank = decode_rank % n};
}

uint32_t kvs_pd_geometry_unit(const kvs_pd_geometry_t *geo)
{
    return kvs_pd_geometry_dcp(geo) * geo->page_size;
}

uint32_t kvs_pd_geometry_pp(const kvs_pd_geometry_t *geo)
{
    return geo->prefill_pp > 1 ? geo->prefill_pp : 1;
}

uint32_t kvs_pd_geometry_prefill_ranks(const kvs_pd_geometry_t *geo)
{
    return kvs_pd_geometry_pp(geo) * geo->prefill_tp;
}

void kvs_pp_stage(uint32_t layers, uint32_t pp, uint32_t stage, uint32_t *first_p,
                  uint32_t *count_p)
{
    const uint32_t base = layers / pp, extra = layers % pp;
    *first_p = stage * base + (stage < extra ? stage : extra);
    *count_p = base + (stage < extra);
}

kvs_kv_shape_t kvs_pp_stage_shape(const kvs_kv_shape_t *shape, uint32_t pp, uint32_t stage)
{
    kvs_kv_shape_t s = *shape;
    uint32_t first;
    kvs_pp_stage(shape->layers, pp, stage, &first, &s.layers);
    return s;
}

uint32_t kvs_pd_geometry_page(const kvs_pd_geometry_t *geo, kvs_side_t side)
{
    if (side == KVS_SIDE_PREFILL && geo->prefill_page_size != 0) return geo->prefill_page_size;
    return geo->page_size;
}
