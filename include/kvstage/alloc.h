/* The accounted allocator: every kvstage allocation goes through it, so tests can assert that
 * nothing leaked and can make the Nth allocation fail (fault injection). Thread-safe. */
#ifndef KVSTAGE_ALLOC_H
#define KVSTAGE_ALLOC_H

#include <stddef.h>
#include <stdint.h>

void *kvs_malloc(size_t size);
void *kvs_calloc(size_t count, size_t size);
/* Like realloc; on failure the old block is untouched and NULL is returned. */
void *kvs_realloc(void *ptr, size_t size);
/* align: a power of two >= sizeof(void *). Free with kvs_free. */
void *kvs_aligned_alloc(size_t align, size_t size);
void kvs_free(void *ptr);
char *kvs_strdup(const char *s);

typedef struct {
    uint64_t live_blocks; /* allocated and not yet freed */
    uint64_t live_bytes;
    uint64_t peak_bytes;
    uint64_t total_allocs;  /* successful allocations since start */
    uint64_t failed_allocs; /* real or injected failures */
} kvs_alloc_stats_t;

void kvs_alloc_stats(kvs_alloc_stats_t *stats_p);

/* Make the nth allocation from now fail (1 = the next one); 0 disables injection.
 * Only that one allocation fails; later ones succeed again. */
void kvs_alloc_fail_at(uint64_t nth);
/* Fail every allocation from now on while enabled (for exhaustive out-of-memory tests). */
void kvs_alloc_fail_all(int enabled);

#endif
