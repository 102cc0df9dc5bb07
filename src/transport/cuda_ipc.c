/* The CUDA IPC data plane (kvstage/cuda_ipc.h): decode exports its ring, prefill imports it and
 * writes with peer copies on the link's copy queue (a stream on its device; a write completes
 * when its event fires, so a staging buffer is released only after the copy that reads it) or
 * maps it for direct writes. Control ops are refused: this link carries data only. */
#include "base/bytes.h"
#include "kvstage/cuda_ipc.h"

#include <string.h>
#include <unistd.h>

#include "base/mem.h"
#include "kvstage/alloc.h"
#include "kvstage/layout.h"
#include "kvstage/log.h"
#include "transport/link.h"

/* Handle layout: [0,4) magic, [4,8) version, [8,16) ring size, [16,20) exporter pid,
 * [20,24) exporter device, [24,32) zero, [32,96) cudaIpcMemHandle_t. */
#define OFF_SIZE   8
#define OFF_PID    16
#define OFF_DEVICE 20
#define OFF_CUDA   32

uint32_t kvs_cuda_ipc_handle_device(const kvs_cuda_ipc_handle_t *handle)
{
    return kvs_get_u32(handle->bytes + OFF_DEVICE);
}

#if KVS_HAVE_CUDA
#include "base/cuda_util.h"

#define IPC_MAGIC   0x5049564bu /* "KVIP" little-endian */
#define IPC_VERSION 1u

typedef char
    ipc_handle_fits[sizeof(cudaIpcMemHandle_t) <= KVS_CUDA_IPC_HANDLE_BYTES - OFF_CUDA ? 1 : -1];

typedef struct {
    uint8_t *base; /* the opened ring; NULL until imported */
    uint64_t size;
} ipc_remote_t;

typedef struct {
    kvs_cuda_ipc_config_t cfg;
    int told_control;       /* the "no control messages" error was logged */
    kvs_mem_queue_t *queue; /* prefill: peer copies */
    ipc_remote_t *remotes;  /* [peer_tp] */
    uint8_t *ring;          /* decode: the exposed ring */
    uint64_t ring_size;
} ipc_t;

static kvs_status_t no_control(ipc_t *c)
{
    if (!c->told_control++)
        kvs_error("cuda_ipc link (%s rank %u): carries no control messages; pair it with a "
                  "control channel",
                  kvs_side_str(c->cfg.side), c->cfg.rank);
    return KVS_ERR_UNSUPPORTED;
}

static kvs_status_t ipc_send(void *ctx, uint32_t peer, const uint8_t *buf, size_t len)
{
    (void) peer;
    (void) buf;
    (void) len;
    return no_control(ctx);
}

static kvs_status_t ipc_recv(void *ctx, uint8_t *buf, size_t cap, size_t *len_p, uint32_t *from_p)
{
    (void) buf;
    (void) cap;
    (void) len_p;
    (void) from_p;
    return no_control(ctx);
}

static kvs_status_t ipc_write(void *ctx, uint32_t peer, uint64_t offset, const void *src,
                              uint64_t len, uint64_t *ticket_p)
{
    ipc_t *c = ctx;
    if (c->cfg.side != KVS_SIDE_PREFILL || peer >= c->cfg.peer_tp ||
        c->remotes[peer].base == NULL) {
        kvs_error("cuda_ipc write: decode rank %u's ring was not imported", peer);
        return KVS_ERR_NOT_FOUND;
    }
    const ipc_remote_t *r = &c->remotes[peer];
    if (offset > r->size || len > r->size - offset) {
        kvs_error("cuda_ipc write: [%llu, +%llu) is outside decode rank %u's %llu-byte ring",
                  (unsigned long long) offset, (unsigned long long) len, peer,
                  (unsigned long long) r->size);
        return KVS_ERR_INVALID;
    }
    return kvs_mem_queue_copy(c->queue, r->base + offset, src, (size_t) len, ticket_p);
}

static kvs_status_t ipc_write_poll(void *ctx, uint64_t ticket)
{
    ipc_t *c = ctx;
    if (c->queue == NULL) {
        kvs_error("cuda_ipc write_poll: a decode link issues no writes");
        return KVS_ERR_INVALID;
    }
    return kvs_mem_queue_poll(c->queue, ticket);
}

static kvs_status_t ipc_map(void *ctx, uint32_t peer, uint64_t offset, uint64_t len,
                            uint8_t **ptr_p, int *host_p)
{
    ipc_t *c = ctx;
    if (c->cfg.side != KVS_SIDE_PREFILL) return KVS_ERR_INVALID;
    if (peer >= c->cfg.peer_tp) return KVS_ERR_NOT_FOUND;
    const ipc_remote_t *r = &c->remotes[peer];
    if (r->base == NULL) return KVS_INPROGRESS; /* its ring is not imported yet */
    if (offset > r->size || len > r->size - offset) return KVS_ERR_INVALID;
    *host_p = 0;
    *ptr_p = r->base + offset;
    return KVS_OK;
}

static kvs_status_t ipc_expose(void *ctx, void *ring, uint64_t size)
{
    ipc_t *c = ctx;
    if (c->cfg.side != KVS_SIDE_DECODE) {
        kvs_error("cuda_ipc expose: a prefill link has no ring");
        return KVS_ERR_INVALID;
    }
    if (ring == NULL) { /* withdrawn: later exports are refused */
        c->ring = NULL;
        c->ring_size = 0;
        return KVS_OK;
    }
    int where = kvs_mem_device_of(ring);
    if (where != c->cfg.device) {
        kvs_error("cuda_ipc expose: the ring must be device memory on GPU %d (it is %s %d)",
                  c->cfg.device, where < 0 ? "host memory," : "on GPU", where);
        return KVS_ERR_INVALID;
    }
    c->ring = ring;
    c->ring_size = size;
    return KVS_OK;
}

static kvs_status_t ipc_flush(void *ctx)
{
    /* A write's copy completed on the writer's GPU before CHUNK_READY was sent (and a direct
     * write's kernel finished): the bytes are in this GPU's memory for the scatter. */
    (void) ctx;
    return KVS_OK;
}

/* Closes every imported ring; no write may be in flight. */
static void close_remotes(ipc_t *c)
{
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess) prev = c->cfg.device;
    (void) cudaSetDevice(c->cfg.device);
    for (uint32_t i = 0; i < c->cfg.peer_tp; i++) {
        if (c->remotes[i].base == NULL) continue;
        (void) KVS_CUDA_CHECK(cudaIpcCloseMemHandle(c->remotes[i].base),
                              "cuda_ipc: closing decode rank %u's ring", i);
        c->remotes[i].base = NULL;
    }
    (void) cudaSetDevice(prev);
}

static void ipc_destroy(void *ctx)
{
    ipc_t *c = ctx;
    kvs_mem_queue_destroy(c->queue); /* waits for copies still reading their sources */
    close_remotes(c);
    kvs_free(c->remotes);
    kvs_free(c);
}

static const kvs_link_ops_t ipc_ops = {
    .name = "cuda_ipc",
    .send = ipc_send,
    .recv = ipc_recv,
    .write = ipc_write,
    .write_poll = ipc_write_poll,
    .map = ipc_map,
    .expose = ipc_expose,
    .flush = ipc_flush,
    .peer_status = NULL, /* liveness belongs to the control channel */
    .destroy = ipc_destroy,
};

kvs_status_t kvs_cuda_ipc_link_create(const kvs_cuda_ipc_config_t *config, kvs_link_t **link_p)
{
    if (config == NULL || link_p == NULL ||
        (config->side != KVS_SIDE_PREFILL && config->side != KVS_SIDE_DECODE) ||
        config->peer_tp == 0 || config->peer_tp > KVS_CUDA_IPC_MAX_PEERS || config->device < 0) {
        kvs_error("cuda_ipc link: invalid configuration (side, peers in [1, %u], device >= 0)",
                  KVS_CUDA_IPC_MAX_PEERS);
        return KVS_ERR_INVALID;
    }
    int count = kvs_mem_device_count();
    if (config->device >= count) {
        kvs_error("cuda_ipc link: GPU %d, but this machine has %d CUDA device(s)", config->device,
                  count);
        return count == 0 ? KVS_ERR_UNSUPPORTED : KVS_ERR_INVALID;
    }
    ipc_t *c = kvs_calloc(1, sizeof(*c));
    kvs_link_t *link = kvs_malloc(sizeof(*link));
    if (c != NULL) c->remotes = kvs_calloc(config->peer_tp, sizeof(*c->remotes));
    if (c == NULL || link == NULL || c->remotes == NULL) {
        if (c != NULL) kvs_free(c->remotes);
        kvs_free(c);
        kvs_free(link);
        kvs_error("cuda_ipc link: out of memory");
        return KVS_ERR_NOMEM;
    }
    c->cfg = *config;
    if (config->side == KVS_SIDE_PREFILL) {
        kvs_status_t st = kvs_mem_queue_create(config->device, &c->queue);
        if (st != KVS_OK) {
            kvs_free(c->remotes);
            kvs_free(c);
            kvs_free(link);
            return st;
        }
    }
    link->ops = &ipc_ops;
    link->ctx = c;
    *link_p = link;
    return KVS_OK;
}

kvs_status_t kvs_cuda_ipc_export(kvs_link_t *link, kvs_cuda_ipc_handle_t *handle_p)
{
    if (link == NULL || link->ops != &ipc_ops || handle_p == NULL) {
        kvs_error("cuda_ipc export: not a cuda_ipc link");
        return KVS_ERR_INVALID;
    }
    ipc_t *c = link->ctx;
    if (c->cfg.side != KVS_SIDE_DECODE || c->ring == NULL) {
        kvs_error("cuda_ipc export: only a decode link with an exposed ring exports it");
        return KVS_ERR_STATE;
    }
    cudaIpcMemHandle_t h;
    int prev = 0;
    kvs_status_t st = KVS_CUDA_CHECK(cudaGetDevice(&prev), "cuda_ipc export: current device");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaSetDevice(c->cfg.device), "cuda_ipc export on GPU %d",
                            c->cfg.device);
    if (st == KVS_OK) {
        st = KVS_CUDA_CHECK(cudaIpcGetMemHandle(&h, c->ring), "cuda_ipc export of a %llu-byte ring",
                            (unsigned long long) c->ring_size);
        (void) cudaSetDevice(prev);
    }
    if (st != KVS_OK) return st;
    kvs_cuda_ipc_handle_t out;
    memset(&out, 0, sizeof(out));
    kvs_put_u32(out.bytes, IPC_MAGIC);
    kvs_put_u32(out.bytes + 4, IPC_VERSION);
    kvs_put_u64(out.bytes + OFF_SIZE, c->ring_size);
    kvs_put_u32(out.bytes + OFF_PID, (uint32_t) getpid());
    kvs_put_u32(out.bytes + OFF_DEVICE, (uint32_t) c->cfg.device);
    memcpy(out.bytes + OFF_CUDA, &h, sizeof(h));
    *handle_p = out;
    return KVS_OK;
}

kvs_status_t kvs_cuda_ipc_import(kvs_link_t *link, uint32_t peer,
                                 const kvs_cuda_ipc_handle_t *handle)
{
    if (link == NULL || link->ops != &ipc_ops || handle == NULL) {
        kvs_error("cuda_ipc import: not a cuda_ipc link");
        return KVS_ERR_INVALID;
    }
    ipc_t *c = link->ctx;
    if (c->cfg.side != KVS_SIDE_PREFILL || peer >= c->cfg.peer_tp) {
        kvs_error("cuda_ipc import: only a prefill link imports, from decode ranks [0, %u) "
                  "(got %u)",
                  c->cfg.peer_tp, peer);
        return KVS_ERR_INVALID;
    }
    const uint8_t *b = handle->bytes;
    uint64_t size = kvs_get_u64(b + OFF_SIZE);
    if (kvs_get_u32(b) != IPC_MAGIC || kvs_get_u32(b + 4) != IPC_VERSION || size == 0) {
        kvs_error("cuda_ipc import: decode rank %u's handle is malformed (magic %08x, version "
                  "%u, size %llu)",
                  peer, kvs_get_u32(b), kvs_get_u32(b + 4), (unsigned long long) size);
        return KVS_ERR_INVALID;
    }
    if (kvs_get_u32(b + OFF_PID) == (uint32_t) getpid()) {
        kvs_error("cuda_ipc import: decode rank %u's ring was exported by this process; CUDA IPC "
                  "works between processes only (use the inproc link here)",
                  peer);
        return KVS_ERR_INVALID;
    }
    cudaIpcMemHandle_t h;
    memcpy(&h, b + OFF_CUDA, sizeof(h));
    int prev = 0;
    kvs_status_t st = KVS_CUDA_CHECK(cudaGetDevice(&prev), "cuda_ipc import: current device");
    if (st != KVS_OK) return st;
    st = KVS_CUDA_CHECK(cudaSetDevice(c->cfg.device), "cuda_ipc import on GPU %d", c->cfg.device);
    void *base = NULL;
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess),
                            "cuda_ipc import of decode rank %u's ring (GPU %u of process %u) "
                            "on GPU %d",
                            peer, kvs_get_u32(b + OFF_DEVICE), kvs_get_u32(b + OFF_PID),
                            c->cfg.device);
    if (st == KVS_OK && c->remotes[peer].base != NULL)
        (void) KVS_CUDA_CHECK(cudaIpcCloseMemHandle(c->remotes[peer].base),
                              "cuda_ipc: closing decode rank %u's previous ring", peer);
    (void) cudaSetDevice(prev);
    if (st != KVS_OK) return st == KVS_ERR_INVALID ? KVS_ERR_IO : st;
    c->remotes[peer].base = base;
    c->remotes[peer].size = size;
    return KVS_OK;
}

#else /* built without CUDA */

kvs_status_t kvs_cuda_ipc_link_create(const kvs_cuda_ipc_config_t *config, kvs_link_t **link_p)
{
    (void) config;
    (void) link_p;
    kvs_error("cuda_ipc link: this kvstage was built without CUDA");
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs_cuda_ipc_export(kvs_link_t *link, kvs_cuda_ipc_handle_t *handle_p)
{
    (void) link;
    (void) handle_p;
    kvs_error("cuda_ipc export: this kvstage was built without CUDA");
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs_cuda_ipc_import(kvs_link_t *link, uint32_t peer,
                                 const kvs_cuda_ipc_handle_t *handle)
{
    (void) link;
    (void) peer;
    (void) handle;
    kvs_error("cuda_ipc import: this kvstage was built without CUDA");
    return KVS_ERR_UNSUPPORTED;
}

#endif
