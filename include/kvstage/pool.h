/* The paged KV pool of one rank: an O(1) page allocator and, for every layer's K and V (or MLA
 * latent), a strided region descriptor. NHD (token-major, SGLang style) and HND (head-major per
 * page, vLLM style) are just two choices of strides. */
#ifndef KVSTAGE_POOL_H
#define KVSTAGE_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/layout.h"
#include "kvstage/mem.h"
#include "kvstage/status.h"

/* One (layer, component) region: the bytes of head h of token t of page p start at
 * base + p*page_stride + t*token_stride + h*head_stride; a head's dim elements are contiguous. */
typedef struct {
    uint8_t *base;
    uint64_t page_stride;
    uint64_t token_stride;
    uint64_t head_stride;
    uint32_t heads; /* heads this rank holds */
    uint32_t dim;   /* elements per head */
    uint32_t elem_bytes;
} kvs_region_t;

static inline uint8_t *kvs_region_addr(const kvs_region_t *r, uint64_t page, uint64_t token,
                                       uint64_t head)
{
    return r->base + page * r->page_stride + token * r->token_stride + head * r->head_stride;
}

typedef enum {
    KVS_POOL_NHD = 0, /* page = [P][heads][dim] */
    KVS_POOL_HND = 1, /* page = [heads][P][dim] */
} kvs_pool_layout_t;

/* Strides of one region for page size P; base is left NULL. */
kvs_region_t kvs_region_strides(kvs_pool_layout_t layout, uint32_t page_size, uint32_t heads,
                                uint32_t dim, uint32_t elem_bytes);

typedef struct {
    kvs_kv_shape_t shape;
    kvs_tp_t tp;        /* which heads this rank holds */
    uint32_t page_size; /* P tokens per page */
    uint32_t num_pages;
    kvs_pool_layout_t layout;
    kvs_mem_kind_t mem;
    int device; /* CUDA device ordinal for KVS_MEM_DEVICE; ignored for host memory */
} kvs_pool_config_t;

typedef struct kvs_pool kvs_pool_t;

/* Validates the configuration (shape, TP layout, page size > 0, pages > 0) and allocates the
 * regions and the page allocator. Region memory is zeroed; for KVS_MEM_DEVICE the region bases
 * are device pointers (only the copy backends may touch them) and the call fails with
 * KVS_ERR_UNSUPPORTED in builds without CUDA or where the device is absent. */
kvs_status_t kvs_pool_create(const kvs_pool_config_t *config, kvs_pool_t **pool_p);
/* A pool over memory the caller owns (an engine's KV cache tensors), which destroy leaves alone.
 * regions[layer * components + component] (components: 2 for MHA, 1 for MLA) gives each
 * region's base and strides; its heads, dim and elem_bytes must be this rank's, and no two
 * (page, token, head) of a region may share a byte (KVS_ERR_INVALID, naming the region,
 * otherwise). config->layout (NHD or HND) only labels the pool: the strides say it. For
 * KVS_MEM_DEVICE the bases are device pointers on config->device. The memory must outlive the pool.
 */
kvs_status_t kvs_pool_wrap(const kvs_pool_config_t *config, const kvs_region_t *regions,
                           kvs_pool_t **pool_p);
void kvs_pool_destroy(kvs_pool_t *pool);

const kvs_pool_config_t *kvs_pool_config(const kvs_pool_t *pool);
/* Heads this rank holds (h of protocol.md §1). */
uint32_t kvs_pool_heads(const kvs_pool_t *pool);
/* component 0 = K (or latent), 1 = V. */
const kvs_region_t *kvs_pool_region(const kvs_pool_t *pool, uint32_t layer, uint32_t component);

/* Takes n pages, all or nothing; KVS_ERR_NOSPACE (with a message naming need and free) when
 * fewer than n are free. pages_p receives n ids. */
kvs_status_t kvs_pool_alloc(kvs_pool_t *pool, uint32_t n, uint32_t *pages_p);
/* Returns pages; KVS_ERR_INVALID (nothing freed) for an id out of range or not allocated,
 * including a page repeated within the call. */
kvs_status_t kvs_pool_free(kvs_pool_t *pool, const uint32_t *pages, uint32_t n);
uint32_t kvs_pool_free_pages(const kvs_pool_t *pool);
uint32_t kvs_pool_total_pages(const kvs_pool_t *pool);
/* 1 if page is currently allocated. */
int kvs_pool_page_allocated(const kvs_pool_t *pool, uint32_t page);

#endif
