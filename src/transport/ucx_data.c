/* UCX (UCP) data plane: context, worker, mapped regions, endpoints with unpacked rkeys, and
 * puts that complete only after ucp_ep_flush_nbx confirmed them at the target.
 *
 * Failure handling differs by error mode. With PEER (tcp) UCX reports a dead peer through the
 * endpoint's error handler and a forced close cancels every request. With NONE (shared memory;
 * PEER would remove the sm lanes in UCX 1.13) requests to a dead peer may stay pending forever
 * and a forced close is refused, so a remote is torn down by releasing its requests to UCX
 * (ucp_request_free: no callback runs afterwards) and closing the endpoint without waiting. */
#include "transport/ucx_data.h"

#include <assert.h>
#include <string.h>
#include <ucp/api/ucp.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"

#define DEFAULT_PIECE   (4ull << 20)
#define PUT_WINDOW      8             /* pieces of one put in flight */
#define PUT_BURST       8             /* pieces one poll may post (bounds work per call) */
#define PROGRESS_ROUNDS 64            /* ucp_worker_progress calls per kvs_ucx_progress */
#define CLOSE_WAIT_NS   1000000000ull /* graceful close of an endpoint to a live peer */
#define PAGE_BYTES      4096

struct kvs_ucx {
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_address_t *addr;
    size_t addr_len;
    int peer_errors;
    uint64_t piece;
    uint32_t live; /* regions + remotes not yet destroyed */
};

struct kvs_ucx_region {
    kvs_ucx_t *ucx;
    ucp_mem_h memh;
    void *base;    /* [size] */
    uint8_t *rkey; /* [rkey_len] packed */
    size_t rkey_len;
};

struct kvs_ucx_remote {
    kvs_ucx_t *ucx;
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    uint64_t base, size;
    uint8_t *mapped; /* the region in this address space (shared memory), or NULL */
    int failed;
    kvs_ucx_put_t *puts; /* attached puts, doubly linked */
};

typedef struct {
    kvs_ucx_put_t *put;
    void *req; /* outstanding UCX request, or NULL */
} put_slot_t;

struct kvs_ucx_put {
    kvs_ucx_remote_t *remote; /* NULL once detached by remote destroy */
    kvs_ucx_put_t *prev, *next;
    const uint8_t *src; /* [len] */
    uint64_t raddr, len;
    uint64_t posted; /* bytes handed to ucp_put_nbx */
    int flush_posted;
    uint32_t inflight;
    uint64_t completions;
    kvs_status_t status; /* KVS_INPROGRESS until the outcome is known */
    put_slot_t slots[PUT_WINDOW + 1];
};

kvs_status_t kvs_ucx_create(const kvs_ucx_config_t *config, kvs_ucx_t **ucx_p)
{
    kvs_ucx_t *u = kvs_calloc(1, sizeof(*u));
    if (u == NULL) return KVS_ERR_NOMEM;
    u->peer_errors = config->peer_errors;
    u->piece = config->piece_bytes ? config->piece_bytes : DEFAULT_PIECE;
    ucp_config_t *uc;
    ucs_status_t us = ucp_config_read(NULL, NULL, &uc);
    if (us != UCS_OK) {
        kvs_error("ucx: cannot read the UCX configuration: %s", ucs_status_string(us));
        goto err_free;
    }
    if (config->tls != NULL && (us = ucp_config_modify(uc, "TLS", config->tls)) != UCS_OK) {
        kvs_error("ucx: bad UCX_TLS '%s': %s", config->tls, ucs_status_string(us));
        ucp_config_release(uc);
        kvs_free(u);
        return KVS_ERR_INVALID;
    }
    if (config->net_devices != NULL &&
        (us = ucp_config_modify(uc, "NET_DEVICES", config->net_devices)) != UCS_OK) {
        kvs_error("ucx: bad UCX_NET_DEVICES '%s': %s", config->net_devices, ucs_status_string(us));
        ucp_config_release(uc);
        kvs_free(u);
        return KVS_ERR_INVALID;
    }
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM,
    };
    us = ucp_init(&params, uc, &u->ctx);
    ucp_config_release(uc);
    if (us != UCS_OK) {
        kvs_error("ucx: ucp_init failed (UCX_TLS=%s): %s", config->tls ? config->tls : "default",
                  ucs_status_string(us));
        goto err_free;
    }
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    us = ucp_worker_create(u->ctx, &wp, &u->worker);
    if (us != UCS_OK) {
        kvs_error("ucx: cannot create a worker: %s", ucs_status_string(us));
        goto err_ctx;
    }
    us = ucp_worker_get_address(u->worker, &u->addr, &u->addr_len);
    if (us != UCS_OK) {
        kvs_error("ucx: cannot get the worker address: %s", ucs_status_string(us));
        goto err_worker;
    }
    *ucx_p = u;
    return KVS_OK;

err_worker:
    ucp_worker_destroy(u->worker);
err_ctx:
    ucp_cleanup(u->ctx);
err_free:
    kvs_free(u);
    return KVS_ERR_IO;
}

void kvs_ucx_destroy(kvs_ucx_t *u)
{
    if (u == NULL) return;
    if (u->live != 0) kvs_error("ucx: destroyed with %u regions or remotes open", u->live);
    ucp_worker_release_address(u->worker, u->addr);
    ucp_worker_destroy(u->worker);
    ucp_cleanup(u->ctx);
    kvs_free(u);
}

void kvs_ucx_address(const kvs_ucx_t *u, const uint8_t **addr_p, size_t *len_p)
{
    *addr_p = (const uint8_t *) u->addr;
    *len_p = u->addr_len;
}

uint32_t kvs_ucx_progress(kvs_ucx_t *u)
{
    uint32_t events = 0;
    for (int i = 0; i < PROGRESS_ROUNDS; i++) {
        unsigned n = ucp_worker_progress(u->worker);
        if (n == 0) break;
        events += n;
    }
    return events;
}

/* ---- regions ---- */

/* Maps [base, base + size) (base NULL: UCX allocates it, in shared memory where a shared
 * memory transport is enabled) and packs its rkey. */
static kvs_status_t region_map(kvs_ucx_t *u, void *base, uint64_t size, kvs_ucx_region_t **region_p)
{
    kvs_ucx_region_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) return KVS_ERR_NOMEM;
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        .address = base,
        .length = size,
        .flags = base == NULL ? UCP_MEM_MAP_ALLOCATE : 0,
    };
    ucs_status_t us = ucp_mem_map(u->ctx, &mp, &r->memh);
    if (us != UCS_OK) {
        kvs_error("ucx: cannot %s a %llu-byte region: %s", base ? "map" : "allocate",
                  (unsigned long long) size, ucs_status_string(us));
        kvs_free(r);
        return KVS_ERR_IO;
    }
    r->base = base;
    if (base == NULL) {
        ucp_mem_attr_t attr = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
        us = ucp_mem_query(r->memh, &attr);
        if (us != UCS_OK || attr.address == NULL) {
            kvs_error("ucx: cannot query an allocated region: %s", ucs_status_string(us));
            ucp_mem_unmap(u->ctx, r->memh);
            kvs_free(r);
            return KVS_ERR_IO;
        }
        r->base = attr.address;
        /* Fault every page in now, not during the first transfers. */
        memset(r->base, 0, size);
    }
    void *packed;
    size_t len;
    us = ucp_rkey_pack(u->ctx, r->memh, &packed, &len);
    if (us != UCS_OK) {
        kvs_error("ucx: cannot pack the region's rkey: %s", ucs_status_string(us));
        ucp_mem_unmap(u->ctx, r->memh);
        kvs_free(r);
        return KVS_ERR_IO;
    }
    r->rkey = kvs_malloc(len ? len : 1);
    if (r->rkey == NULL) {
        ucp_rkey_buffer_release(packed);
        ucp_mem_unmap(u->ctx, r->memh);
        kvs_free(r);
        return KVS_ERR_NOMEM;
    }
    memcpy(r->rkey, packed, len);
    r->rkey_len = len;
    ucp_rkey_buffer_release(packed);
    r->ucx = u;
    u->live++;
    *region_p = r;
    return KVS_OK;
}

kvs_status_t kvs_ucx_region_create(kvs_ucx_t *u, void *base, uint64_t size,
                                   kvs_ucx_region_t **region_p)
{
    if (base == NULL || size == 0) {
        kvs_error("ucx: cannot expose an empty region");
        return KVS_ERR_INVALID;
    }
    /* First touch of fresh memory is slow: fault every page in now, not during the first
     * transfers. Reading and writing back keeps the contents. */
    volatile uint8_t *p = base;
    for (uint64_t off = 0; off < size; off += PAGE_BYTES) p[off] = p[off];
    p[size - 1] = p[size - 1];
    return region_map(u, base, size, region_p);
}

kvs_status_t kvs_ucx_region_alloc(kvs_ucx_t *u, uint64_t size, kvs_ucx_region_t **region_p)
{
    if (size == 0) {
        kvs_error("ucx: cannot allocate an empty region");
        return KVS_ERR_INVALID;
    }
    return region_map(u, NULL, size, region_p);
}

void *kvs_ucx_region_base(const kvs_ucx_region_t *r)
{
    return r->base;
}

void kvs_ucx_region_rkey(const kvs_ucx_region_t *r, const uint8_t **rkey_p, size_t *len_p)
{
    *rkey_p = r->rkey;
    *len_p = r->rkey_len;
}

void kvs_ucx_region_destroy(kvs_ucx_region_t *r)
{
    if (r == NULL) return;
    ucp_mem_unmap(r->ucx->ctx, r->memh);
    r->ucx->live--;
    kvs_free(r->rkey);
    kvs_free(r);
}

/* ---- remotes ---- */

static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kvs_ucx_remote_t *rm = arg;
    (void) ep;
    /* Info only: the net link names the peer and warns when writes were in flight. */
    if (!rm->failed) kvs_info("ucx: endpoint to the peer failed: %s", ucs_status_string(status));
    rm->failed = 1;
}

kvs_status_t kvs_ucx_remote_create(kvs_ucx_t *u, const uint8_t *addr, size_t addr_len,
                                   const uint8_t *rkey, size_t rkey_len, uint64_t base,
                                   uint64_t size, kvs_ucx_remote_t **remote_p)
{
    (void) addr_len; /* UCX parses the address itself; its length was bounded by the caller */
    (void) rkey_len;
    kvs_ucx_remote_t *rm = kvs_calloc(1, sizeof(*rm));
    if (rm == NULL) return KVS_ERR_NOMEM;
    rm->ucx = u;
    rm->base = base;
    rm->size = size;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = (const ucp_address_t *) addr,
        .err_mode = u->peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
    };
    if (u->peer_errors) {
        ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.err_handler.cb = ep_error;
        ep.err_handler.arg = rm;
    }
    ucs_status_t us = ucp_ep_create(u->worker, &ep, &rm->ep);
    if (us != UCS_OK) {
        kvs_error("ucx: cannot create an endpoint to the peer's worker: %s", ucs_status_string(us));
        kvs_free(rm);
        return us == UCS_ERR_UNREACHABLE ? KVS_ERR_INCOMPATIBLE : KVS_ERR_IO;
    }
    us = ucp_ep_rkey_unpack(rm->ep, rkey, &rm->rkey);
    if (us != UCS_OK) {
        kvs_error("ucx: cannot unpack the peer's rkey: %s", ucs_status_string(us));
        rm->rkey = NULL;
        u->live++;
        kvs_ucx_remote_destroy(rm, 1);
        return KVS_ERR_PROTOCOL;
    }
    /* Shared-memory rkeys can be mapped into this process: kernels and memcpy then store
     * straight into the peer's region (direct write). Other transports say unreachable. */
    void *mapped = NULL;
    if (ucp_rkey_ptr(rm->rkey, base, &mapped) == UCS_OK) rm->mapped = mapped;
    u->live++;
    *remote_p = rm;
    return KVS_OK;
}

void *kvs_ucx_remote_map(const kvs_ucx_remote_t *rm, uint64_t offset, uint64_t len)
{
    if (rm->mapped == NULL || rm->failed || offset > rm->size || len > rm->size - offset)
        return NULL;
    return rm->mapped + offset;
}

int kvs_ucx_remote_failed(const kvs_ucx_remote_t *rm)
{
    return rm->failed;
}

uint64_t kvs_ucx_remote_size(const kvs_ucx_remote_t *rm)
{
    return rm->size;
}

static void put_detach(kvs_ucx_put_t *p)
{
    kvs_ucx_remote_t *rm = p->remote;
    if (rm == NULL) return;
    if (p->prev) p->prev->next = p->next;
    if (p->next) p->next->prev = p->prev;
    if (rm->puts == p) rm->puts = p->next;
    p->prev = p->next = NULL;
    p->remote = NULL;
}

/* Hands the put's outstanding requests back to UCX: no callback of theirs runs afterwards. */
static void put_release_requests(kvs_ucx_put_t *p)
{
    for (int i = 0; i < PUT_WINDOW + 1; i++) {
        if (p->slots[i].req == NULL) continue;
        ucp_request_free(p->slots[i].req);
        p->slots[i].req = NULL;
    }
    p->inflight = 0;
}

void kvs_ucx_remote_destroy(kvs_ucx_remote_t *rm, int peer_gone)
{
    if (rm == NULL) return;
    kvs_ucx_t *u = rm->ucx;
    int force = u->peer_errors;
    if (!force) {
        /* Mode NONE: requests to a dead peer may never complete; release them first. */
        for (kvs_ucx_put_t *p = rm->puts; p != NULL; p = p->next) put_release_requests(p);
    }
    ucp_request_param_t cp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
        .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0,
    };
    ucs_status_ptr_t req = ucp_ep_close_nbx(rm->ep, &cp);
    if (UCS_PTR_IS_PTR(req)) {
        /* A forced close finishes locally; a graceful one needs the peer, so wait only for a
         * live peer and never for long. */
        uint64_t deadline = kvs_now_ns() + (force || !peer_gone ? CLOSE_WAIT_NS : 0);
        while (ucp_request_check_status(req) == UCS_INPROGRESS && kvs_now_ns() < deadline)
            ucp_worker_progress(u->worker);
        ucp_request_free(req);
    } else if (UCS_PTR_IS_ERR(req) && !peer_gone) {
        kvs_debug("ucx: closing an endpoint: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    }
    /* Forced close cancelled the requests through their callbacks; whatever is left goes. */
    while (rm->puts != NULL) {
        kvs_ucx_put_t *p = rm->puts;
        put_release_requests(p);
        if (p->status == KVS_INPROGRESS) p->status = KVS_ERR_IO;
        put_detach(p);
    }
    if (rm->rkey != NULL) ucp_rkey_destroy(rm->rkey);
    u->live--;
    kvs_free(rm);
}

/* ---- puts ---- */

static void put_done(void *request, ucs_status_t status, void *user_data)
{
    put_slot_t *slot = user_data;
    kvs_ucx_put_t *p = slot->put;
    slot->req = NULL;
    ucp_request_free(request);
    p->inflight--;
    p->completions++;
    if (status != UCS_OK && p->status == KVS_INPROGRESS) {
        kvs_debug("ucx: a put request failed: %s", ucs_status_string(status));
        p->status = KVS_ERR_IO;
        if (p->remote != NULL) p->remote->failed = 1;
    }
}

kvs_status_t kvs_ucx_put_start(kvs_ucx_remote_t *rm, uint64_t offset, const void *src, uint64_t len,
                               kvs_ucx_put_t **put_p)
{
    if (offset > rm->size || len > rm->size - offset || (len > 0 && src == NULL)) {
        kvs_error("ucx: put [%llu, +%llu) is outside the %llu-byte remote region",
                  (unsigned long long) offset, (unsigned long long) len,
                  (unsigned long long) rm->size);
        return KVS_ERR_INVALID;
    }
    kvs_ucx_put_t *p = kvs_calloc(1, sizeof(*p));
    if (p == NULL) return KVS_ERR_NOMEM;
    p->src = src;
    p->raddr = rm->base + offset;
    p->len = len;
    p->status = KVS_INPROGRESS;
    for (int i = 0; i < PUT_WINDOW + 1; i++) p->slots[i].put = p;
    p->remote = rm;
    p->next = rm->puts;
    if (rm->puts) rm->puts->prev = p;
    rm->puts = p;
    *put_p = p;
    kvs_ucx_put_poll(p); /* post the first pieces now */
    return KVS_OK;
}

/* At most PUT_WINDOW puts and one flush are outstanding, so a slot is always free. */
static put_slot_t *free_slot(kvs_ucx_put_t *p)
{
    for (int i = 0; i < PUT_WINDOW + 1; i++)
        if (p->slots[i].req == NULL) return &p->slots[i];
    assert(0 && "no free request slot");
    return &p->slots[0];
}

/* Records the outcome of posting one request. */
static void posted(kvs_ucx_put_t *p, put_slot_t *slot, ucs_status_ptr_t req)
{
    if (UCS_PTR_IS_ERR(req)) {
        kvs_debug("ucx: posting to the peer failed: %s", ucs_status_string(UCS_PTR_STATUS(req)));
        if (p->status == KVS_INPROGRESS) p->status = KVS_ERR_IO;
        p->remote->failed = 1;
    } else if (req != NULL) {
        slot->req = req;
        p->inflight++;
    } else {
        p->completions++;
    }
}

kvs_status_t kvs_ucx_put_poll(kvs_ucx_put_t *p)
{
    kvs_ucx_remote_t *rm = p->remote;
    if (p->status == KVS_INPROGRESS && (rm == NULL || rm->failed)) p->status = KVS_ERR_IO;
    if (p->status == KVS_INPROGRESS) {
        for (int burst = 0; burst < PUT_BURST && p->posted < p->len && p->inflight < PUT_WINDOW &&
                            p->status == KVS_INPROGRESS;
             burst++) {
            uint64_t n = p->len - p->posted;
            if (n > rm->ucx->piece) n = rm->ucx->piece;
            put_slot_t *slot = free_slot(p);
            ucp_request_param_t rp = {
                .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                .cb.send = put_done,
                .user_data = slot,
            };
            posted(p, slot,
                   ucp_put_nbx(rm->ep, p->src + p->posted, n, p->raddr + p->posted, rm->rkey, &rp));
            p->posted += n;
        }
        if (p->status == KVS_INPROGRESS && p->posted == p->len && !p->flush_posted) {
            /* The flush completes once every earlier put on the endpoint is complete at the
             * target, which is what makes CHUNK_READY after it safe. */
            put_slot_t *slot = free_slot(p);
            ucp_request_param_t rp = {
                .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                .cb.send = put_done,
                .user_data = slot,
            };
            p->flush_posted = 1;
            if (p->len > 0) posted(p, slot, ucp_ep_flush_nbx(rm->ep, &rp));
        }
        if (p->status == KVS_INPROGRESS && p->flush_posted && p->inflight == 0) p->status = KVS_OK;
    }
    /* A failure is reported only once UCX holds no request of the put (the remote's teardown
     * releases them), so the caller may reuse src as soon as it hears of it. */
    if (p->status != KVS_INPROGRESS && p->status != KVS_OK && p->inflight > 0)
        return KVS_INPROGRESS;
    return p->status;
}

uint64_t kvs_ucx_put_completions(const kvs_ucx_put_t *p)
{
    return p->completions;
}

void kvs_ucx_put_release(kvs_ucx_put_t *p)
{
    if (p == NULL) return;
    put_release_requests(p);
    put_detach(p);
    kvs_free(p);
}
