/* The decode staging ring: a FIFO request queue in front of a contiguous byte-range allocator.
 * Live grants are kept in allocation order; the oldest one bounds the free space, so grant and
 * reclaim are O(1) amortised. A grant freed out of order is only marked, and its bytes come
 * back when every older grant has been freed. */
#include "kvstage/ring.h"

#include <string.h>

#include "base/map.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"

/* One request; the same node becomes the grant, so granting allocates nothing. */
typedef struct ring_node {
    uint64_t cookie;
    uint64_t size;
    uint64_t offset; /* valid once granted */
    int freed;       /* granted, freed, waiting for older grants to be freed */
    struct ring_node *prev, *next;
} ring_node_t;

struct kvs_ring {
    uint64_t capacity;
    ring_node_t *q_head, *q_tail;     /* queued requests, oldest first (doubly linked for cancel) */
    kvs_map_t queued;                 /* cookie -> queued node */
    ring_node_t *g_oldest, *g_newest; /* grants in allocation order; g_oldest is never freed */
    kvs_map_t live;                   /* offset -> live (not freed) grant */
    uint64_t wpos;                    /* end of g_newest, in (0, capacity]; 0 with no grants */
    uint64_t high_water;
};

kvs_status_t kvs_ring_create(uint64_t capacity, kvs_ring_t **ring_p)
{
    if (capacity == 0 || ring_p == NULL) {
        kvs_error("ring: capacity must be > 0 and the output pointer non-NULL (capacity %llu)",
                  (unsigned long long) capacity);
        return KVS_ERR_INVALID;
    }
    kvs_ring_t *ring = kvs_calloc(1, sizeof(*ring));
    if (ring == NULL) {
        kvs_error("ring: out of memory creating a ring of %llu bytes",
                  (unsigned long long) capacity);
        return KVS_ERR_NOMEM;
    }
    ring->capacity = capacity;
    kvs_map_init(&ring->queued);
    kvs_map_init(&ring->live);
    *ring_p = ring;
    return KVS_OK;
}

static void free_list(ring_node_t *n)
{
    while (n != NULL) {
        ring_node_t *next = n->next;
        kvs_free(n);
        n = next;
    }
}

void kvs_ring_destroy(kvs_ring_t *ring)
{
    if (ring == NULL) return;
    free_list(ring->q_head);
    free_list(ring->g_oldest);
    kvs_map_fini(&ring->queued);
    kvs_map_fini(&ring->live);
    kvs_free(ring);
}

static uint64_t used_bytes(const kvs_ring_t *ring)
{
    if (ring->g_oldest == NULL) return 0;
    uint64_t tail = ring->g_oldest->offset;
    /* wpos == tail with grants present means the arc covers the whole ring */
    return ring->wpos > tail ? ring->wpos - tail : ring->capacity - tail + ring->wpos;
}

/* The placement rule. The occupied arc runs from the oldest grant (tail) to wpos; when it does
 * not wrap, free space is [wpos, capacity) and [0, tail), and only the first is tried before
 * wrapping to 0, so grants stay in address order along the arc. 1 and *offset_p on a fit. */
static int ring_place(const kvs_ring_t *ring, uint64_t size, uint64_t *offset_p)
{
    if (ring->g_oldest == NULL) {
        *offset_p = 0;
        return size <= ring->capacity;
    }
    uint64_t tail = ring->g_oldest->offset, wpos = ring->wpos;
    if (wpos > tail) {
        if (ring->capacity - wpos >= size) {
            *offset_p = wpos;
            return 1;
        }
        *offset_p = 0;
        return tail >= size;
    }
    *offset_p = wpos;
    return tail - wpos >= size;
}

kvs_status_t kvs_ring_enqueue(kvs_ring_t *ring, uint64_t size, uint64_t cookie)
{
    if (size == 0) {
        kvs_error("ring: request %llu for 0 bytes", (unsigned long long) cookie);
        return KVS_ERR_INVALID;
    }
    if (size > ring->capacity) {
        kvs_error("ring: request %llu for %llu bytes can never fit a staging ring of %llu bytes",
                  (unsigned long long) cookie, (unsigned long long) size,
                  (unsigned long long) ring->capacity);
        return KVS_ERR_NOSPACE;
    }
    if (kvs_map_get(&ring->queued, cookie) != NULL) {
        kvs_error("ring: request %llu is already queued", (unsigned long long) cookie);
        return KVS_ERR_INVALID;
    }
    ring_node_t *n = kvs_calloc(1, sizeof(*n));
    if (n == NULL || kvs_map_put(&ring->queued, cookie, n) != KVS_OK) {
        kvs_free(n);
        kvs_error("ring: out of memory queueing request %llu", (unsigned long long) cookie);
        return KVS_ERR_NOMEM;
    }
    n->cookie = cookie;
    n->size = size;
    n->prev = ring->q_tail;
    if (ring->q_tail != NULL)
        ring->q_tail->next = n;
    else
        ring->q_head = n;
    ring->q_tail = n;
    return KVS_OK;
}

static void unlink_queued(kvs_ring_t *ring, ring_node_t *n)
{
    if (n->prev != NULL)
        n->prev->next = n->next;
    else
        ring->q_head = n->next;
    if (n->next != NULL)
        n->next->prev = n->prev;
    else
        ring->q_tail = n->prev;
    n->prev = n->next = NULL;
}

kvs_status_t kvs_ring_grant(kvs_ring_t *ring, uint64_t *cookie_p, uint64_t *offset_p,
                            uint64_t *size_p)
{
    ring_node_t *n = ring->q_head;
    if (n == NULL) return KVS_ERR_NOT_FOUND;
    uint64_t offset;
    if (!ring_place(ring, n->size, &offset)) return KVS_INPROGRESS;
    /* The only step that can fail comes first, so a failed grant changes nothing. */
    if (kvs_map_put(&ring->live, offset, n) != KVS_OK) {
        kvs_error("ring: out of memory granting request %llu", (unsigned long long) n->cookie);
        return KVS_ERR_NOMEM;
    }
    kvs_map_remove(&ring->queued, n->cookie);
    unlink_queued(ring, n);
    n->offset = offset;
    if (ring->g_newest != NULL)
        ring->g_newest->next = n;
    else
        ring->g_oldest = n;
    ring->g_newest = n;
    ring->wpos = offset + n->size;
    uint64_t used = used_bytes(ring);
    if (used > ring->high_water) ring->high_water = used;
    *cookie_p = n->cookie;
    *offset_p = offset;
    *size_p = n->size;
    return KVS_OK;
}

kvs_status_t kvs_ring_cancel(kvs_ring_t *ring, uint64_t cookie)
{
    ring_node_t *n = kvs_map_remove(&ring->queued, cookie);
    if (n == NULL) {
        kvs_debug("ring: cancel of request %llu, which is not queued", (unsigned long long) cookie);
        return KVS_ERR_NOT_FOUND;
    }
    unlink_queued(ring, n);
    kvs_free(n);
    return KVS_OK;
}

kvs_status_t kvs_ring_free(kvs_ring_t *ring, uint64_t offset)
{
    ring_node_t *n = kvs_map_remove(&ring->live, offset);
    if (n == NULL) {
        kvs_error("ring: free of offset %llu, which is not the start of a live grant",
                  (unsigned long long) offset);
        return KVS_ERR_NOT_FOUND;
    }
    n->freed = 1;
    while (ring->g_oldest != NULL && ring->g_oldest->freed) {
        ring_node_t *old = ring->g_oldest;
        ring->g_oldest = old->next;
        kvs_free(old);
    }
    if (ring->g_oldest == NULL) {
        ring->g_newest = NULL;
        ring->wpos = 0; /* an empty ring restarts at offset 0 */
    }
    return KVS_OK;
}

void kvs_ring_stats(const kvs_ring_t *ring, kvs_ring_stats_t *stats_p)
{
    kvs_ring_stats_t s;
    memset(&s, 0, sizeof(s));
    s.capacity = ring->capacity;
    s.used_bytes = used_bytes(ring);
    s.high_water_bytes = ring->high_water;
    s.live_grants = ring->live.count;
    s.queued = ring->queued.count;
    *stats_p = s;
}
