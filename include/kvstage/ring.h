/* The decode staging ring (protocol.md §3.4): a byte-range allocator over one ring of
 * `capacity` bytes, shared by every prefill peer and room of a decode rank. Requests queue in
 * FIFO order and are granted contiguous ranges only when the space is free: a grant never
 * overlaps another live grant and is never revoked. Not thread-safe: the owner drives it. */
#ifndef KVSTAGE_RING_H
#define KVSTAGE_RING_H

#include <stdint.h>

#include "kvstage/status.h"

typedef struct kvs_ring kvs_ring_t;

typedef struct {
    uint64_t capacity;
    /* Bytes from the oldest live grant to the write position, including skipped tail gaps and
     * grants freed out of order but not yet reclaimed; 0 when no grant is live. */
    uint64_t used_bytes;
    uint64_t high_water_bytes; /* largest used_bytes seen */
    uint64_t live_grants;      /* granted and not yet freed */
    uint64_t queued;           /* requests waiting for a grant */
} kvs_ring_stats_t;

/* capacity > 0. */
kvs_status_t kvs_ring_create(uint64_t capacity, kvs_ring_t **ring_p);
/* Frees the ring and every queued request; live grants simply cease to exist. */
void kvs_ring_destroy(kvs_ring_t *ring);

/* Queues a request for `size` contiguous bytes. cookie is the caller's name for it and must be
 * unique among queued requests (KVS_ERR_INVALID otherwise). size 0 -> KVS_ERR_INVALID; size >
 * capacity -> KVS_ERR_NOSPACE at once, since it could never be granted. */
kvs_status_t kvs_ring_enqueue(kvs_ring_t *ring, uint64_t size, uint64_t cookie);

/* Grants the oldest queued request if it fits now, and nothing else: a later request never
 * overtakes an earlier one. KVS_OK: the grant [*offset_p, *offset_p + *size_p) is live;
 * KVS_INPROGRESS: the head does not fit yet; KVS_ERR_NOT_FOUND: nothing is queued. Call in a
 * loop until it returns something other than KVS_OK.
 *
 * Placement: right after the newest live grant; if the space up to the end of the ring is too
 * small, at offset 0 (the tail gap is skipped until the ring wraps past it); at offset 0
 * whenever no grant is live. */
kvs_status_t kvs_ring_grant(kvs_ring_t *ring, uint64_t *cookie_p, uint64_t *offset_p,
                            uint64_t *size_p);

/* Withdraws a request that is still queued; KVS_ERR_NOT_FOUND if no queued request has this
 * cookie (e.g. it was already granted). */
kvs_status_t kvs_ring_cancel(kvs_ring_t *ring, uint64_t cookie);

/* Frees the live grant starting at offset. Frees may come in any order; space is reclaimed
 * once every older grant is freed too. KVS_ERR_NOT_FOUND (nothing changes) if no live grant
 * starts there. */
kvs_status_t kvs_ring_free(kvs_ring_t *ring, uint64_t offset);

void kvs_ring_stats(const kvs_ring_t *ring, kvs_ring_stats_t *stats_p);

#endif
