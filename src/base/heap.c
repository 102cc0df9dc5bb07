/* Binary min-heap ordered by (time, seq). */
#include "base/heap.h"

#include "kvstage/alloc.h"

void kvs_heap_init(kvs_heap_t *heap)
{
    heap->items = NULL;
    heap->count = heap->cap = 0;
    heap->next_seq = 0;
}

void kvs_heap_fini(kvs_heap_t *heap)
{
    kvs_free(heap->items);
    kvs_heap_init(heap);
}

static int before(const kvs_heap_entry_t *a, const kvs_heap_entry_t *b)
{
    return a->time < b->time || (a->time == b->time && a->seq < b->seq);
}

kvs_status_t kvs_heap_push(kvs_heap_t *heap, uint64_t time, void *val)
{
    if (heap->count == heap->cap) {
        size_t cap = heap->cap ? heap->cap * 2 : 16;
        kvs_heap_entry_t *items = kvs_realloc(heap->items, cap * sizeof(*items));
        if (items == NULL) return KVS_ERR_NOMEM;
        heap->items = items;
        heap->cap = cap;
    }
    size_t i = heap->count++;
    kvs_heap_entry_t e = {time, heap->next_seq++, val};
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!before(&e, &heap->items[parent])) break;
        heap->items[i] = heap->items[parent];
        i = parent;
    }
    heap->items[i] = e;
    return KVS_OK;
}

const kvs_heap_entry_t *kvs_heap_top(const kvs_heap_t *heap)
{
    return heap->count ? &heap->items[0] : NULL;
}

void *kvs_heap_pop(kvs_heap_t *heap)
{
    if (heap->count == 0) return NULL;
    void *val = heap->items[0].val;
    kvs_heap_entry_t last = heap->items[--heap->count];
    size_t i = 0, n = heap->count;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const kvs_heap_entry_t *best = &last;
        if (l < n && before(&heap->items[l], best)) {
            m = l;
            best = &heap->items[l];
        }
        if (r < n && before(&heap->items[r], best)) m = r;
        if (m == i) break;
        heap->items[i] = heap->items[m];
        i = m;
    }
    if (n > 0) heap->items[i] = last;
    return val;
}
