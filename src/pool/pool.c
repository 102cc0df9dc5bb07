/* The paged KV pool: an O(1) page allocator (a stack of free page ids plus a per-page state
 * byte that catches double frees and foreign ids) and one strided region per (layer,
 * component), all carved out of a single zeroed allocation of host or device memory
 * (base/mem.h), which builds without CUDA refuse cleanly, or laid over the caller's memory
 * (kvs_pool_wrap). */
#include "kvstage/pool.h"

#include <string.h>

#include "base/mem.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"

/* Region bases are aligned to this (cache line; enough for vector loads and DMA engines). */
#define POOL_REGION_ALIGN 64u

enum {
    PAGE_FREE = 0,
    PAGE_ALLOCATED = 1,
    PAGE_MARKED = 2, /* allocated and named earlier in the kvs_pool_free call being validated */
};

struct kvs_pool {
    kvs_pool_config_t config;
    uint32_t heads;        /* heads this rank holds */
    uint32_t components;   /* 2 for MHA (K, V), 1 for MLA */
    kvs_region_t *regions; /* [layers][components] */
    uint8_t *memory;       /* [layers][components] regions, each [num_pages][page bytes] padded to
                            * POOL_REGION_ALIGN; zeroed. NULL for a wrapped pool (the caller's) */
    uint32_t *free_stack;  /* [num_pages]; the top free_count entries are the free ids */
    uint32_t free_count;
    uint8_t *page_state; /* [num_pages] PAGE_* */
};

kvs_region_t kvs_region_strides(kvs_pool_layout_t layout, uint32_t page_size, uint32_t heads,
                                uint32_t dim, uint32_t elem_bytes)
{
    kvs_region_t r;
    memset(&r, 0, sizeof(r));
    uint64_t head_bytes = (uint64_t) dim * elem_bytes;
    if (layout == KVS_POOL_HND) {
        r.token_stride = head_bytes;
        r.head_stride = (uint64_t) page_size * head_bytes;
        r.page_stride = (uint64_t) heads * r.head_stride;
    } else {
        r.head_stride = head_bytes;
        r.token_stride = (uint64_t) heads * head_bytes;
        r.page_stride = (uint64_t) page_size * r.token_stride;
    }
    r.heads = heads;
    r.dim = dim;
    r.elem_bytes = elem_bytes;
    return r;
}

/* a*b into *out; 0 on overflow. */
static int mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a != 0 && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

static kvs_status_t validate_config(const kvs_pool_config_t *c)
{
    kvs_status_t st = kvs_kv_shape_validate(&c->shape);
    if (st != KVS_OK) return st;
    st = kvs_tp_validate(&c->shape, &c->tp);
    if (st != KVS_OK) return st;
    if (c->page_size == 0 || c->num_pages == 0) {
        kvs_error("pool: page_size (%u) and num_pages (%u) must be > 0", c->page_size,
                  c->num_pages);
        return KVS_ERR_INVALID;
    }
    if (c->layout != KVS_POOL_NHD && c->layout != KVS_POOL_HND) {
        kvs_error("pool: unknown layout %d", (int) c->layout);
        return KVS_ERR_INVALID;
    }
#if !KVS_HAVE_CUDA
    if (c->mem == KVS_MEM_DEVICE) {
        kvs_error("pool: device memory needs a CUDA build (this kvstage was built without "
                  "CUDA); use KVS_MEM_HOST");
        return KVS_ERR_UNSUPPORTED;
    }
#endif
    if (c->mem == KVS_MEM_DEVICE && c->device < 0) {
        kvs_error("pool: device memory on device %d: the ordinal must be >= 0", c->device);
        return KVS_ERR_INVALID;
    }
    if (c->mem != KVS_MEM_HOST && c->mem != KVS_MEM_DEVICE) {
        kvs_error("pool: unknown memory kind %d", (int) c->mem);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

/* Bytes of one region of component comp for a rank holding `heads` heads, rounded up to
 * POOL_REGION_ALIGN so the next region stays aligned; 0 when it does not fit in 64 bits. */
static uint64_t region_span(const kvs_pool_config_t *c, uint32_t heads, uint32_t comp)
{
    uint64_t head_bytes = (uint64_t) kvs_kv_shape_dim(&c->shape, comp) * c->shape.elem_bytes;
    uint64_t page_bytes, bytes;
    if (!mul_u64((uint64_t) c->page_size * heads, head_bytes, &page_bytes) ||
        !mul_u64(page_bytes, c->num_pages, &bytes) || bytes > UINT64_MAX - POOL_REGION_ALIGN)
        return 0;
    return (bytes + POOL_REGION_ALIGN - 1) & ~(uint64_t) (POOL_REGION_ALIGN - 1);
}

/* The pool object with its region table and page allocator, but no region memory:
 * *regions_p has layers * components entries for the caller to fill. */
static kvs_status_t pool_new(const kvs_pool_config_t *config, kvs_pool_t **pool_p)
{
    kvs_pool_t *pool = kvs_calloc(1, sizeof(*pool));
    if (pool == NULL) goto err_nomem;
    pool->config = *config;
    pool->heads = kvs_tp_heads_per_rank(&config->shape, config->tp.tp_size);
    pool->components = kvs_kv_shape_components(&config->shape);
    const uint32_t pages = config->num_pages;
    pool->regions =
        kvs_calloc((size_t) config->shape.layers * pool->components, sizeof(kvs_region_t));
    if (pool->regions == NULL) goto err_free_pool;
    pool->free_stack = kvs_malloc((size_t) pages * sizeof(uint32_t));
    if (pool->free_stack == NULL) goto err_free_regions;
    pool->page_state = kvs_calloc(pages, 1);
    if (pool->page_state == NULL) goto err_free_stack;
    /* Stack top is the end of the array: pushing ids in reverse hands out 0, 1, 2, ... first,
     * which keeps fresh pools deterministic and easy to read in logs. */
    for (uint32_t i = 0; i < pages; i++) pool->free_stack[i] = pages - 1 - i;
    pool->free_count = pages;
    *pool_p = pool;
    return KVS_OK;

err_free_stack:
    kvs_free(pool->free_stack);
err_free_regions:
    kvs_free(pool->regions);
err_free_pool:
    kvs_free(pool);
err_nomem:
    kvs_error("pool: out of memory creating a pool of %u pages", config->num_pages);
    return KVS_ERR_NOMEM;
}

static void pool_free(kvs_pool_t *pool)
{
    kvs_free(pool->page_state);
    kvs_free(pool->free_stack);
    kvs_free(pool->regions);
    kvs_free(pool);
}

kvs_status_t kvs_pool_create(const kvs_pool_config_t *config, kvs_pool_t **pool_p)
{
    if (config == NULL || pool_p == NULL) {
        kvs_error("pool: NULL config or output pointer");
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = validate_config(config);
    if (st != KVS_OK) return st;

    /* Sizes first: a pool that cannot fit is refused before anything is allocated. */
    const uint32_t layers = config->shape.layers;
    const uint32_t heads = kvs_tp_heads_per_rank(&config->shape, config->tp.tp_size);
    const uint32_t components = kvs_kv_shape_components(&config->shape);
    uint64_t span[2] = {0, 0}, layer_bytes = 0, total = 0;
    for (uint32_t comp = 0; comp < components; comp++) {
        span[comp] = region_span(config, heads, comp);
        if (span[comp] == 0 || span[comp] > UINT64_MAX - layer_bytes) goto err_too_big;
        layer_bytes += span[comp];
    }
    if (!mul_u64(layer_bytes, layers, &total) || total > SIZE_MAX) goto err_too_big;

    kvs_pool_t *pool = NULL;
    st = pool_new(config, &pool);
    if (st != KVS_OK) return st;
    void *memory = NULL;
    st = kvs_mem_alloc(config->mem, config->device, (size_t) total, &memory);
    if (st != KVS_OK) { /* kvs_mem_alloc logs its own failures */
        pool_free(pool);
        return st;
    }
    pool->memory = memory;

    uint64_t off = 0;
    for (uint32_t l = 0; l < layers; l++) {
        for (uint32_t comp = 0; comp < components; comp++) {
            kvs_region_t *r = &pool->regions[l * components + comp];
            *r = kvs_region_strides(config->layout, config->page_size, heads,
                                    kvs_kv_shape_dim(&config->shape, comp),
                                    config->shape.elem_bytes);
            r->base = pool->memory + off;
            off += span[comp];
        }
    }

    kvs_debug("pool: %u pages x %u tokens, %u heads, %u layers x %u components, %s, %llu bytes "
              "of %s memory",
              config->num_pages, config->page_size, heads, layers, components,
              config->layout == KVS_POOL_HND ? "HND" : "NHD", (unsigned long long) total,
              config->mem == KVS_MEM_DEVICE ? "device" : "host");
    *pool_p = pool;
    return KVS_OK;

err_too_big:
    kvs_error("pool: %u pages of %u tokens x %u heads x %u layers do not fit in memory",
              config->num_pages, config->page_size, heads, layers);
    return KVS_ERR_INVALID;
}

/* Checks one caller region of a wrapped pool: its heads, dim and element size are the pool's,
 * and no two (page, token, head) of it share a byte: its axes of more than one entry, sorted by
 * stride, each step over the whole extent of the axes below (true of NHD, HND and any
 * other nesting of the three). */
static kvs_status_t check_wrapped_region(const kvs_pool_t *pool, uint32_t layer, uint32_t comp,
                                         const kvs_region_t *r)
{
    const kvs_pool_config_t *c = &pool->config;
    const char *what = comp == 0 ? (c->shape.attn == KVS_ATTN_MLA ? "latent" : "K") : "V";
    uint32_t dim = kvs_kv_shape_dim(&c->shape, comp);
    if (r->base == NULL) {
        kvs_error("pool: layer %u %s region: NULL base", layer, what);
        return KVS_ERR_INVALID;
    }
    if (r->heads != pool->heads || r->dim != dim || r->elem_bytes != c->shape.elem_bytes) {
        kvs_error("pool: layer %u %s region has %u heads x %u elements of %u bytes; this rank "
                  "holds %u heads x %u elements of %u bytes",
                  layer, what, r->heads, r->dim, r->elem_bytes, pool->heads, dim,
                  c->shape.elem_bytes);
        return KVS_ERR_INVALID;
    }
    uint64_t stride[3] = {r->page_stride, r->token_stride, r->head_stride};
    uint64_t count[3] = {c->num_pages, c->page_size, r->heads};
    for (int i = 1; i < 3; i++) /* insertion sort by stride */
        for (int j = i; j > 0 && stride[j] < stride[j - 1]; j--) {
            uint64_t s = stride[j], n = count[j];
            stride[j] = stride[j - 1], count[j] = count[j - 1];
            stride[j - 1] = s, count[j - 1] = n;
        }
    uint64_t extent = (uint64_t) dim * c->shape.elem_bytes; /* bytes spanned by the axes below */
    for (int i = 0; i < 3; i++) {
        if (count[i] == 1) continue;
        uint64_t next;
        if (stride[i] < extent || !mul_u64(stride[i], count[i], &next)) {
            kvs_error("pool: layer %u %s region: strides (page %llu, token %llu, head %llu "
                      "bytes) overlap for %u pages x %u tokens x %u heads of %llu bytes",
                      layer, what, (unsigned long long) r->page_stride,
                      (unsigned long long) r->token_stride, (unsigned long long) r->head_stride,
                      c->num_pages, c->page_size, r->heads,
                      (unsigned long long) dim * c->shape.elem_bytes);
            return KVS_ERR_INVALID;
        }
        extent = next;
    }
    return KVS_OK;
}

kvs_status_t kvs_pool_wrap(const kvs_pool_config_t *config, const kvs_region_t *regions,
                           kvs_pool_t **pool_p)
{
    if (config == NULL || regions == NULL || pool_p == NULL) {
        kvs_error("pool: NULL config, regions or output pointer");
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = validate_config(config);
    if (st != KVS_OK) return st;
    kvs_pool_t *pool = NULL;
    st = pool_new(config, &pool);
    if (st != KVS_OK) return st;
    uint32_t n = config->shape.layers * pool->components;
    for (uint32_t i = 0; i < n; i++) {
        st = check_wrapped_region(pool, i / pool->components, i % pool->components, &regions[i]);
        if (st != KVS_OK) {
            pool_free(pool);
            return st;
        }
        pool->regions[i] = regions[i];
    }
    kvs_debug("pool: wrapped %u pages x %u tokens, %u heads, %u layers x %u components of %s "
              "memory",
              config->num_pages, config->page_size, pool->heads, config->shape.layers,
              pool->components, config->mem == KVS_MEM_DEVICE ? "device" : "host");
    *pool_p = pool;
    return KVS_OK;
}

void kvs_pool_destroy(kvs_pool_t *pool)
{
    if (pool == NULL) return;
    kvs_mem_free(pool->config.mem, pool->config.device, pool->memory);
    pool_free(pool);
}

const kvs_pool_config_t *kvs_pool_config(const kvs_pool_t *pool)
{
    return &pool->config;
}

uint32_t kvs_pool_heads(const kvs_pool_t *pool)
{
    return pool->heads;
}

const kvs_region_t *kvs_pool_region(const kvs_pool_t *pool, uint32_t layer, uint32_t component)
{
    if (layer >= pool->config.shape.layers || component >= pool->components) {
        kvs_error("pool: no region for layer %u component %u (%u layers, %u components)", layer,
                  component, pool->config.shape.layers, pool->components);
        return NULL;
    }
    return &pool->regions[layer * pool->components + component];
}

kvs_status_t kvs_pool_alloc(kvs_pool_t *pool, uint32_t n, uint32_t *pages_p)
{
    if (n > 0 && pages_p == NULL) {
        kvs_error("pool: NULL output array for %u pages", n);
        return KVS_ERR_INVALID;
    }
    if (n > pool->free_count) {
        kvs_error("pool: out of pages: need %u, %u free of %u", n, pool->free_count,
                  pool->config.num_pages);
        return KVS_ERR_NOSPACE;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t page = pool->free_stack[--pool->free_count];
        pool->page_state[page] = PAGE_ALLOCATED;
        pages_p[i] = page;
    }
    return KVS_OK;
}

kvs_status_t kvs_pool_free(kvs_pool_t *pool, const uint32_t *pages, uint32_t n)
{
    if (n > 0 && pages == NULL) {
        kvs_error("pool: NULL page array for %u pages", n);
        return KVS_ERR_INVALID;
    }
    /* Validate all ids before freeing any: marking each one catches a page named twice in
     * this call in O(n) without scratch memory; the marks are undone on error. */
    uint32_t i;
    for (i = 0; i < n; i++) {
        uint32_t page = pages[i];
        if (page >= pool->config.num_pages) {
            kvs_error("pool: free of page %u (index %u of %u): out of range (%u pages)", page, i, n,
                      pool->config.num_pages);
            break;
        }
        if (pool->page_state[page] != PAGE_ALLOCATED) {
            kvs_error("pool: free of page %u (index %u of %u): %s", page, i, n,
                      pool->page_state[page] == PAGE_MARKED ? "repeated in this call"
                                                            : "not allocated (double free?)");
            break;
        }
        pool->page_state[page] = PAGE_MARKED;
    }
    if (i < n) {
        for (uint32_t j = 0; j < i; j++) pool->page_state[pages[j]] = PAGE_ALLOCATED;
        return KVS_ERR_INVALID;
    }
    for (i = 0; i < n; i++) {
        pool->page_state[pages[i]] = PAGE_FREE;
        pool->free_stack[pool->free_count++] = pages[i];
    }
    return KVS_OK;
}

uint32_t kvs_pool_free_pages(const kvs_pool_t *pool)
{
    return pool->free_count;
}

uint32_t kvs_pool_total_pages(const kvs_pool_t *pool)
{
    return pool->config.num_pages;
}

int kvs_pool_page_allocated(const kvs_pool_t *pool, uint32_t page)
{
    return page < pool->config.num_pages && pool->page_state[page] != PAGE_FREE;
}
