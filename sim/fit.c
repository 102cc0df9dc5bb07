/* What one request needs of a deployment, so that configurations that can never succeed (a pool
 * or a staging ring smaller than one request) are refused before anything runs, instead of
 * stalling admission or failing every room. */
#include "kvstage/grid.h"
#include "kvstage/log.h"
#include "sim/engine.h"

uint32_t kvs_engine_prompt_pages(uint32_t len, uint32_t page_size)
{
    return (uint32_t) (((uint64_t) len + page_size - 1) / page_size);
}

uint64_t kvs_engine_slot_bytes(const kvs_pd_geometry_t *geo, uint32_t decode_rank,
                               uint32_t max_prompt_len)
{
    /* A chunk is at most one grid step; a prompt shorter than that only ever asks for its own
     * pages. Under DCP a decode rank holds a page of every N x P tokens, G / N of a chunk. */
    const uint32_t n_dcp = kvs_pd_geometry_dcp(geo);
    uint64_t tokens = kvs_grid_tokens(geo->chunk_tokens, geo->page_size) / n_dcp;
    uint64_t prompt =
        (uint64_t) kvs_engine_prompt_pages(max_prompt_len, n_dcp * geo->page_size) * geo->page_size;
    if (prompt < tokens) tokens = prompt;
    kvs_writer_t writers[KVS_MAX_WRITERS];
    uint32_t n = 0;
    uint64_t max = 0;
    /* The room id only picks which replica writes, not the region sizes; check two anyway. */
    for (uint64_t room = 0; room < 2; room++) {
        if (kvs_plan_geo_writers(geo, decode_rank, room, writers, &n) != KVS_OK) return 0;
        uint64_t bytes = kvs_slot_layout(writers, n, tokens, NULL);
        if (bytes > max) max = bytes;
    }
    return max;
}

kvs_status_t kvs_engine_check_pool(const char *who, const char *side, const char *flag,
                                   uint32_t pool_pages, uint32_t page_size, uint32_t max_prompt_len)
{
    uint32_t need = kvs_engine_prompt_pages(max_prompt_len, page_size);
    if (pool_pages >= need) return KVS_OK;
    if (flag != NULL)
        kvs_error("%s: a %s pool of %u pages per rank can never hold one request: the longest "
                  "prompt (%u tokens) needs %u pages of %u tokens (%s >= %u)",
                  who, side, pool_pages, max_prompt_len, need, page_size, flag, need);
    else
        kvs_error("%s: a %s pool of %u pages per rank can never hold one request: the longest "
                  "prompt (%u tokens) needs %u pages of %u tokens",
                  who, side, pool_pages, max_prompt_len, need, page_size);
    return KVS_ERR_INVALID;
}

kvs_status_t kvs_engine_check_pools(const char *who, const char *side, kvs_pool_t *const *pools,
                                    uint32_t tp, uint32_t page_size, uint32_t max_prompt_len)
{
    for (uint32_t k = 0; k < tp; k++) {
        kvs_status_t st = kvs_engine_check_pool(who, side, NULL, kvs_pool_total_pages(pools[k]),
                                                page_size, max_prompt_len);
        if (st != KVS_OK) return st;
    }
    return KVS_OK;
}

kvs_status_t kvs_engine_check_ring(const char *who, const kvs_pd_geometry_t *geo,
                                   uint32_t max_prompt_len, uint64_t ring_bytes)
{
    uint64_t need = 0;
    uint32_t rank = 0;
    for (uint32_t d = 0; d < geo->decode_tp; d++) {
        uint64_t bytes = kvs_engine_slot_bytes(geo, d, max_prompt_len);
        if (bytes > need) {
            need = bytes;
            rank = d;
        }
    }
    if (ring_bytes >= need) return KVS_OK;
    kvs_error("%s: a staging ring of %llu bytes per decode rank can never hold one slot: one "
              "chunk needs %llu bytes on decode rank %u (--ring-bytes >= %llu)",
              who, (unsigned long long) ring_bytes, (unsigned long long) need, rank,
              (unsigned long long) need);
    return KVS_ERR_INVALID;
}

kvs_status_t kvs_engine_check_devices(const kvs_pd_geometry_t *geo)
{
    kvs_status_t st = kvs_pd_geometry_check_device(geo, KVS_SIDE_PREFILL);
    return st == KVS_OK ? kvs_pd_geometry_check_device(geo, KVS_SIDE_DECODE) : st;
}
