/* The copy ops table (internal): gather pool pages into a writer region of a staging slot and
 * scatter a region back into pool pages. CPU (cpu/copy_cpu.c) is the reference backend; every
 * other backend implements the same table and is tested against it byte for byte. */
#ifndef KVSTAGE_STAGING_COPY_H
#define KVSTAGE_STAGING_COPY_H

#include <stdint.h>

#include "kvstage/layout.h"
#include "kvstage/pool.h"
#include "kvstage/status.h"

/* One gather or scatter: `tokens` tokens starting at token `first_token` of the first of npages
 * pages (ids in `pages`) of a pool, heads [pool_head, pool_head + heads) of the pool rank, all
 * layers and components, to or from one writer region of a slot. Token t of the region is pool
 * token x = first_token + t (counted from the first page's start), i.e. token x % page_size of
 * page pages[x / page_size]; with runs (run > 0) it is x = first_token + (t / run) * stride +
 * t % run instead: runs of `run` tokens every `stride`, the tokens of one decode context
 * parallel rank (protocol.md §1). first_token and tokens both 0 (and no runs) mean whole pages
 * (tokens = npages * page_size); otherwise the tokens must end in the last page (a page size
 * per side, protocol.md §1). */
typedef struct {
    const kvs_region_t *regions; /* [layers][components], from the pool */
    uint32_t layers, components;
    const kvs_kv_shape_t *shape;
    const uint32_t *pages; /* [npages] pool page ids */
    uint32_t npages;
    uint32_t pool_pages; /* pages in the pool: every id must be below it */
    uint32_t page_size;
    uint32_t first_token; /* < page_size */
    uint64_t tokens;      /* 0 with first_token 0: npages * page_size */
    uint32_t run;         /* 0: consecutive tokens; else 1 <= run <= stride */
    uint32_t stride;
    uint32_t pool_head; /* first head, within the pool rank's heads */
    uint32_t heads;
    /* The writer region: kvs_copy_desc_tokens() tokens laid out as kvs_region_block_offset says,
     * [K layer 0..L-1][V layer 0..L-1] each [tokens][heads][D]; region_bytes is the room
     * available there, at least kvs_copy_region_bytes() or the copy is refused. */
    uint8_t *region;
    uint64_t region_bytes;
    /* Optional (NULL: none): receives the region's checksum (staging/checksum.h) of the bytes
     * the copy moved, computed as it moves them; valid once the copy's ticket polls done. */
    uint64_t *checksum;
} kvs_copy_desc_t;

typedef enum {
    KVS_COPY_GATHER = 0,  /* pool -> region */
    KVS_COPY_SCATTER = 1, /* region -> pool */
} kvs_copy_dir_t;

typedef struct kvs_copy_ops {
    const char *name;
    /* Starts a copy; *ticket_p (> 0, increasing) identifies it for poll. May complete
     * synchronously. Invalid descriptors are refused (KVS_ERR_INVALID) before any byte moves. */
    kvs_status_t (*submit)(void *ctx, kvs_copy_dir_t dir, const kvs_copy_desc_t *desc,
                           uint64_t *ticket_p);
    /* KVS_OK when the copy with this ticket (and every one before it) has finished,
     * KVS_INPROGRESS otherwise; KVS_ERR_INVALID for a ticket never issued. */
    kvs_status_t (*poll)(void *ctx, uint64_t ticket);
    /* Callers poll their last ticket to completion first. */
    void (*destroy)(void *ctx);
    /* Optional (NULL: kvs_copy_submit_batch submits one at a time): starts n >= 1 copies in
     * one direction as one unit of work, each with its own checksum; *ticket_p is the ticket
     * of the last, done once every one of them is. */
    kvs_status_t (*submit_batch)(void *ctx, kvs_copy_dir_t dir, const kvs_copy_desc_t *descs,
                                 uint32_t n, uint64_t *ticket_p);
} kvs_copy_ops_t;

typedef struct {
    const kvs_copy_ops_t *ops;
    void *ctx;
} kvs_copy_backend_t;

/* Bytes of one writer region: tokens * heads * E * sum over layers and components of D. */
uint64_t kvs_copy_region_bytes(const kvs_kv_shape_t *shape, uint32_t heads, uint64_t tokens);

/* The region's token count: tokens, or npages * page_size for whole pages. */
static inline uint64_t kvs_copy_desc_tokens(const kvs_copy_desc_t *d)
{
    if (d->tokens == 0 && d->first_token == 0 && d->run == 0)
        return (uint64_t) d->npages * d->page_size;
    return d->tokens;
}

/* Pool token (from the first page's start) of region token t. */
static inline uint64_t kvs_copy_desc_pos(const kvs_copy_desc_t *d, uint64_t t)
{
    if (d->run == 0) return d->first_token + t;
    return d->first_token + t / d->run * d->stride + t % d->run;
}

/* Checks a descriptor against its shape, regions, pool size and region room; logs the first
 * problem. Backends call it before touching memory. */
kvs_status_t kvs_copy_desc_validate(kvs_copy_dir_t dir, const kvs_copy_desc_t *desc);

static inline kvs_status_t kvs_copy_submit(const kvs_copy_backend_t *b, kvs_copy_dir_t dir,
                                           const kvs_copy_desc_t *desc, uint64_t *ticket_p)
{
    return b->ops->submit(b->ctx, dir, desc, ticket_p);
}

static inline kvs_status_t kvs_copy_poll(const kvs_copy_backend_t *b, uint64_t ticket)
{
    return b->ops->poll(b->ctx, ticket);
}

/* Test hook: wraps *b so that its fail_nth-th copy from now on (1-based) fails. Polls of that
 * copy and of every copy submitted before a poll first reported the failure (the copies queued
 * behind it, as a device error takes them) return KVS_ERR_IO once the inner backend has
 * finished them; everything else passes through. Destroying *b destroys the inner backend. */
kvs_status_t kvs__copy_fail_nth(kvs_copy_backend_t *b, uint64_t fail_nth);

/* Starts the n >= 1 copies of descs (e.g. every writer region of one staging slot) as the
 * backend does best: the CUDA backend launches compatible copies (equal page lists, page size
 * and heads) as one kernel, so their tails overlap. *ticket_p names the last copy; when it polls
 * done, all are. On an error no copy of the batch is left running (CPU copies are synchronous,
 * the CUDA backend drains its stream after any failed submit). */
kvs_status_t kvs_copy_submit_batch(const kvs_copy_backend_t *b, kvs_copy_dir_t dir,
                                   const kvs_copy_desc_t *descs, uint32_t n, uint64_t *ticket_p);

/* Destroys the backend's context and clears *b; a cleared or zeroed backend is a no-op. */
void kvs_copy_backend_destroy(kvs_copy_backend_t *b);

/* The CPU reference backend: synchronous memcpy on the calling thread. */
kvs_status_t kvs_copy_cpu_create(kvs_copy_backend_t *backend_p);

/* The CUDA backend (cuda/copy_cuda.cu): one kernel launch per copy (per batch of copies over
 * the same pages) on the backend's own non-blocking stream on `device`; pool regions and the writer
 * region are device memory. Builds without CUDA link a stub that logs and returns
 * KVS_ERR_UNSUPPORTED, as does a CUDA build on a machine without that device. */
kvs_status_t kvs_copy_cuda_create(int device, kvs_copy_backend_t *backend_p);
/* 1 when this build has CUDA and the runtime sees at least one device, else 0; never logs. */
int kvs_copy_cuda_available(void);

#endif
