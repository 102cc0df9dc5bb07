/* The accounted allocator: a small header before every block records its size (and, for
 * aligned blocks, the start of the underlying malloc block). */
#include "kvstage/alloc.h"
#include "kvstage/log.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    void *raw;   /* what malloc returned */
    size_t size; /* bytes the caller asked for */
} block_hdr_t;

/* Header slot size keeps the payload aligned for any fundamental type. */
#define HDR_SLOT ((sizeof(block_hdr_t) + 15u) & ~(size_t) 15u)

static uint64_t g_live_blocks, g_live_bytes, g_peak_bytes, g_total, g_failed;
static uint64_t g_fail_countdown; /* 0: off */
static int g_fail_all;

static int should_fail(void)
{
    if (__atomic_load_n(&g_fail_all, __ATOMIC_RELAXED)) return 1;
    uint64_t cur = __atomic_load_n(&g_fail_countdown, __ATOMIC_RELAXED);
    while (cur != 0) {
        if (__atomic_compare_exchange_n(&g_fail_countdown, &cur, cur - 1, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return cur == 1;
    }
    return 0;
}

static void account_alloc(size_t size)
{
    __atomic_add_fetch(&g_live_blocks, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_total, 1, __ATOMIC_RELAXED);
    uint64_t live = __atomic_add_fetch(&g_live_bytes, size, __ATOMIC_RELAXED);
    uint64_t peak = __atomic_load_n(&g_peak_bytes, __ATOMIC_RELAXED);
    while (live > peak && !__atomic_compare_exchange_n(&g_peak_bytes, &peak, live, 0,
                                                       __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void *alloc_impl(size_t align, size_t size)
{
    if (should_fail() || size > SIZE_MAX / 2) {
        __atomic_add_fetch(&g_failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    size_t pad = align > HDR_SLOT ? align : HDR_SLOT;
    unsigned char *raw = malloc(size + pad + align);
    if (raw == NULL) {
        __atomic_add_fetch(&g_failed, 1, __ATOMIC_RELAXED);
        kvs_error("out of memory allocating %zu bytes", size);
        return NULL;
    }
    uintptr_t p = (uintptr_t) raw + HDR_SLOT;
    p = (p + (align - 1)) & ~(uintptr_t) (align - 1);
    block_hdr_t *hdr = (block_hdr_t *) (p - sizeof(block_hdr_t));
    hdr->raw = raw;
    hdr->size = size;
    account_alloc(size);
    return (void *) p;
}

void *kvs_malloc(size_t size)
{
    return alloc_impl(16, size);
}

void *kvs_aligned_alloc(size_t align, size_t size)
{
    if (align < sizeof(void *) || (align & (align - 1)) != 0) return NULL;
    return alloc_impl(align, size);
}

void *kvs_calloc(size_t count, size_t size)
{
    if (size != 0 && count > SIZE_MAX / size) return NULL;
    void *p = kvs_malloc(count * size);
    if (p != NULL) memset(p, 0, count * size);
    return p;
}

void kvs_free(void *ptr)
{
    if (ptr == NULL) return;
    block_hdr_t *hdr = (block_hdr_t *) ((uintptr_t) ptr - sizeof(block_hdr_t));
    __atomic_sub_fetch(&g_live_blocks, 1, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&g_live_bytes, hdr->size, __ATOMIC_RELAXED);
    free(hdr->raw);
}

void *kvs_realloc(void *ptr, size_t size)
{
    if (ptr == NULL) return kvs_malloc(size);
    block_hdr_t *hdr = (block_hdr_t *) ((uintptr_t) ptr - sizeof(block_hdr_t));
    void *fresh = kvs_malloc(size);
    if (fresh == NULL) return NULL;
    memcpy(fresh, ptr, hdr->size < size ? hdr->size : size);
    kvs_free(ptr);
    return fresh;
}

char *kvs_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = kvs_malloc(n);
    if (d != NULL) memcpy(d, s, n);
    return d;
}

void kvs_alloc_stats(kvs_alloc_stats_t *stats_p)
{
    stats_p->live_blocks = __atomic_load_n(&g_live_blocks, __ATOMIC_RELAXED);
    stats_p->live_bytes = __atomic_load_n(&g_live_bytes, __ATOMIC_RELAXED);
    stats_p->peak_bytes = __atomic_load_n(&g_peak_bytes, __ATOMIC_RELAXED);
    stats_p->total_allocs = __atomic_load_n(&g_total, __ATOMIC_RELAXED);
    stats_p->failed_allocs = __atomic_load_n(&g_failed, __ATOMIC_RELAXED);
}

void kvs_alloc_fail_at(uint64_t nth)
{
    __atomic_store_n(&g_fail_countdown, nth, __ATOMIC_RELAXED);
}

void kvs_alloc_fail_all(int enabled)
{
    __atomic_store_n(&g_fail_all, enabled, __ATOMIC_RELAXED);
}
