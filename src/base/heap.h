/* A binary min-heap of (time, sequence, pointer) entries: ties on time pop in insertion order
 * (internal container, used for timed queues). */
#ifndef KVSTAGE_BASE_HEAP_H
#define KVSTAGE_BASE_HEAP_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/status.h"

typedef struct {
    uint64_t time;
    uint64_t seq;
    void *val;
} kvs_heap_entry_t;

typedef struct {
    kvs_heap_entry_t *items;
    size_t count, cap;
    uint64_t next_seq;
} kvs_heap_t;

void kvs_heap_init(kvs_heap_t *heap);
void kvs_heap_fini(kvs_heap_t *heap);
kvs_status_t kvs_heap_push(kvs_heap_t *heap, uint64_t time, void *val);
/* The earliest entry, or NULL when empty. */
const kvs_heap_entry_t *kvs_heap_top(const kvs_heap_t *heap);
/* Removes the earliest entry and returns its value (NULL when empty). */
void *kvs_heap_pop(kvs_heap_t *heap);

#endif
