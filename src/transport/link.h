/* The link ops table that every transport implements (internal). Control messages are opaque
 * encoded bytes; the protocol layer encodes and decodes them. Data writes are asynchronous:
 * the source buffer must stay untouched until poll reports the write complete. */
#ifndef KVSTAGE_TRANSPORT_LINK_H
#define KVSTAGE_TRANSPORT_LINK_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/link.h"
#include "kvstage/status.h"

typedef struct {
    const char *name;
    /* Queues one control message to peer `peer` of the other side (a rank, or on a prefill
     * link serving several decode instances an (instance, rank) id: kvs_peer_id in
     * kvstage/layout.h; every op's `peer` is such an id). Success means queued, not delivered:
     * the protocol retries what matters. */
    kvs_status_t (*send)(void *ctx, uint32_t peer, const uint8_t *buf, size_t len);
    /* Takes the next received control message: KVS_OK, or KVS_INPROGRESS when none is waiting.
     * *from_p (NULL-able) is its sender's peer id. A message larger than cap is dropped and
     * reported as KVS_ERR_PROTOCOL. */
    kvs_status_t (*recv)(void *ctx, uint8_t *buf, size_t cap, size_t *len_p, uint32_t *from_p);
    /* Prefill: starts writing len bytes from src to offset of decode rank peer's ring. */
    kvs_status_t (*write)(void *ctx, uint32_t peer, uint64_t offset, const void *src, uint64_t len,
                          uint64_t *ticket_p);
    /* Prefill: KVS_OK when the write is complete (src may be reused), KVS_INPROGRESS, or an
     * error (the write failed; its room fails). */
    kvs_status_t (*write_poll)(void *ctx, uint64_t ticket);
    /* Prefill: *ptr_p, a pointer through which a kernel of this process can store straight
     * into [offset, offset + len) of decode rank peer's ring (direct write: no staging buffer
     * and no separate copy). *host_p says whether it is host memory (CPU stores) or device
     * memory (kernel stores); the caller needs no CUDA call to find out. Bytes stored there are
     * visible to the decode rank once the storing copy has completed. KVS_OK; KVS_INPROGRESS:
     * not yet (the peer's ring is still being wired up; ask again); KVS_ERR_UNSUPPORTED: this
     * link cannot map that ring (remote hosts, tcp, a host ring in process); another error: a
     * bad peer or range, or a dead peer. NULL op: the link never maps. */
    kvs_status_t (*map)(void *ctx, uint32_t peer, uint64_t offset, uint64_t len, uint8_t **ptr_p,
                        int *host_p);
    /* Decode: allocates a host ring of size bytes that writers on this host can map (direct
     * writes), zeroed; freed with ring_free after expose(NULL). NULL op, or KVS_ERR_UNSUPPORTED:
     * the receiver allocates the ring itself. */
    kvs_status_t (*ring_alloc)(void *ctx, uint64_t size, void **ring_p);
    void (*ring_free)(void *ctx, void *ring);
    /* Decode: exposes this rank's staging ring to writers. */
    kvs_status_t (*expose)(void *ctx, void *ring, uint64_t size);
    /* Decode: makes every completed incoming write visible to local readers (scatter). */
    kvs_status_t (*flush)(void *ctx);
    /* KVS_OK while peer `peer` of the other side is believed alive, KVS_ERR_IO once it has been
     * silent past the liveness timeout (its rooms fail) or its instance is gone. NULL: peers
     * never die (inproc). */
    kvs_status_t (*peer_status)(void *ctx, uint32_t peer);
    /* Prefill: 1 when decode rank peer's ring is on this rank's own GPU but in another process
     * (another CUDA context: the GPU time-slices between the two processes' kernels, so a
     * scatter of decode's runs in place of this rank's work, not beside it), else 0. Compared
     * by device number: both processes must see the GPUs in one order (the same
     * CUDA_VISIBLE_DEVICES). NULL: never. */
    int (*shares_device)(void *ctx, uint32_t peer);
    void (*destroy)(void *ctx);
} kvs_link_ops_t;

struct kvs_link {
    const kvs_link_ops_t *ops;
    void *ctx;
};

#endif
