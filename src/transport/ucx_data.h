/* The UCX (UCP) data plane of a net link (internal): one context and worker, exposed regions
 * (a decode ring mapped and its rkey packed), remotes (an endpoint and unpacked rkey for one
 * peer's region) and puts (one write, posted in pieces and completed only once flushed to the
 * target). Nothing here waits without a bound; failure handling is per remote. */
#ifndef KVSTAGE_TRANSPORT_UCX_DATA_H
#define KVSTAGE_TRANSPORT_UCX_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/status.h"

typedef struct {
    const char *tls;         /* UCX_TLS; NULL keeps UCX's choice (environment) */
    const char *net_devices; /* UCX_NET_DEVICES; NULL keeps UCX's choice */
    /* 1: endpoints use UCP_ERR_HANDLING_MODE_PEER (tcp: dead peers surface as errors);
     * 0: mode NONE, which shared memory needs in UCX 1.13 (PEER removes sm lanes). */
    int peer_errors;
    uint64_t piece_bytes; /* bytes per ucp_put_nbx; 0: 4 MiB */
} kvs_ucx_config_t;

typedef struct kvs_ucx kvs_ucx_t;
typedef struct kvs_ucx_region kvs_ucx_region_t;
typedef struct kvs_ucx_remote kvs_ucx_remote_t;
typedef struct kvs_ucx_put kvs_ucx_put_t;

kvs_status_t kvs_ucx_create(const kvs_ucx_config_t *config, kvs_ucx_t **ucx_p);
/* Every region and remote must be destroyed first. */
void kvs_ucx_destroy(kvs_ucx_t *ucx);
/* The worker address peers need to reach this worker (valid until destroy). */
void kvs_ucx_address(const kvs_ucx_t *ucx, const uint8_t **addr_p, size_t *len_p);
/* Progresses the worker until idle (bounded); returns events. */
uint32_t kvs_ucx_progress(kvs_ucx_t *ucx);

/* Target side: pre-faults and maps [base, base + size) for remote writes. */
kvs_status_t kvs_ucx_region_create(kvs_ucx_t *ucx, void *base, uint64_t size,
                                   kvs_ucx_region_t **region_p);
/* Target side: UCX allocates and maps the region (in shared memory when a shared-memory
 * transport is enabled, so that initiators on this host can map it: kvs_ucx_remote_map). The
 * memory is zeroed and pre-faulted, and lives until kvs_ucx_region_destroy. */
kvs_status_t kvs_ucx_region_alloc(kvs_ucx_t *ucx, uint64_t size, kvs_ucx_region_t **region_p);
void *kvs_ucx_region_base(const kvs_ucx_region_t *region);
void kvs_ucx_region_rkey(const kvs_ucx_region_t *region, const uint8_t **rkey_p, size_t *len_p);
void kvs_ucx_region_destroy(kvs_ucx_region_t *region);

/* Initiator side: an endpoint to the worker at addr and the region (base, size, rkey) there.
 * The endpoint wires up in the background; puts queue until it is ready. */
kvs_status_t kvs_ucx_remote_create(kvs_ucx_t *ucx, const uint8_t *addr, size_t addr_len,
                                   const uint8_t *rkey, size_t rkey_len, uint64_t base,
                                   uint64_t size, kvs_ucx_remote_t **remote_p);
/* 1 once UCX reported an error on the endpoint: every put fails, make a new remote. */
int kvs_ucx_remote_failed(const kvs_ucx_remote_t *remote);
uint64_t kvs_ucx_remote_size(const kvs_ucx_remote_t *remote);
/* [offset, offset + len) of the remote region as a pointer in this process, or NULL when the
 * region cannot be mapped here (not shared memory, another host) or the range is outside it.
 * Valid until the remote is destroyed. */
void *kvs_ucx_remote_map(const kvs_ucx_remote_t *remote, uint64_t offset, uint64_t len);
/* Closes the endpoint. Puts still attached fail with KVS_ERR_IO and stay valid until
 * released; UCX calls nothing of theirs afterwards. peer_gone: do not wait for the peer. */
void kvs_ucx_remote_destroy(kvs_ucx_remote_t *remote, int peer_gone);

/* Starts writing len bytes from src to offset of the remote region; src must stay untouched
 * until poll reports an outcome. KVS_ERR_INVALID outside the region. */
kvs_status_t kvs_ucx_put_start(kvs_ucx_remote_t *remote, uint64_t offset, const void *src,
                               uint64_t len, kvs_ucx_put_t **put_p);
/* Posts more pieces and reports: KVS_OK once every piece completed and a flush confirmed them
 * at the target, KVS_INPROGRESS, or KVS_ERR_IO (then no UCX request of the put is left). */
kvs_status_t kvs_ucx_put_poll(kvs_ucx_put_t *put);
/* Requests of the put completed so far (a measure of progress for stall deadlines). */
uint64_t kvs_ucx_put_completions(const kvs_ucx_put_t *put);
/* Frees the put; one still in flight is abandoned (its requests released to UCX). */
void kvs_ucx_put_release(kvs_ucx_put_t *put);

#endif
