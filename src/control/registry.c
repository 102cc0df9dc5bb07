/* The bootstrap registry: a ZeroMQ ROUTER that keeps one registration per prefill rank and
 * answers REGISTER and QUERY with QUERY_REPLY; clients are DEALERs that resend until answered
 * or their deadline passes (a lost request or reply never wedges bootstrap). */
#include "kvstage/registry.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"

#define RESEND_MS 100

struct kvs_registry {
    void *zctx;
    void *sock;
    char endpoint[256];
    kvs_msg_register_t regs[KVS_MAX_TP];
    uint64_t have; /* bit per registered rank */
    uint64_t rejected;
};

static void set_int(void *sock, int opt, int v)
{
    (void) zmq_setsockopt(sock, opt, &v, sizeof(v));
}

kvs_status_t kvs_registry_create(const char *bind, kvs_registry_t **registry_p)
{
    kvs_registry_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) return KVS_ERR_NOMEM;
    r->zctx = zmq_ctx_new();
    r->sock = r->zctx ? zmq_socket(r->zctx, ZMQ_ROUTER) : NULL;
    if (r->sock == NULL) {
        kvs_error("registry: cannot create a ZeroMQ socket: %s", zmq_strerror(errno));
        goto err;
    }
    set_int(r->sock, ZMQ_LINGER, 0);
    set_int(r->sock, ZMQ_ROUTER_MANDATORY, 1);
    set_int(r->sock, ZMQ_SNDTIMEO, 0);
    if (zmq_bind(r->sock, bind) != 0) {
        kvs_error("registry: cannot bind %s: %s", bind, zmq_strerror(errno));
        goto err;
    }
    size_t len = sizeof(r->endpoint);
    if (zmq_getsockopt(r->sock, ZMQ_LAST_ENDPOINT, r->endpoint, &len) != 0)
        snprintf(r->endpoint, sizeof(r->endpoint), "%s", bind);
    *registry_p = r;
    return KVS_OK;
err:
    if (r->sock) zmq_close(r->sock);
    if (r->zctx) zmq_ctx_term(r->zctx);
    kvs_free(r);
    return KVS_ERR_IO;
}

void kvs_registry_destroy(kvs_registry_t *r)
{
    if (r == NULL) return;
    zmq_close(r->sock);
    zmq_ctx_term(r->zctx);
    kvs_free(r);
}

const char *kvs_registry_endpoint(const kvs_registry_t *r)
{
    return r->endpoint;
}

uint32_t kvs_registry_count(const kvs_registry_t *r)
{
    return (uint32_t) __builtin_popcountll(r->have);
}

uint64_t kvs_registry_rejected(const kvs_registry_t *r)
{
    return r->rejected;
}

static void reply(kvs_registry_t *r, const void *id, size_t id_len, const kvs_msg_t *msg)
{
    uint8_t buf[KVS_MSG_MAX_SIZE];
    size_t len;
    if (kvs_msg_encode(msg, buf, sizeof(buf), &len) != KVS_OK) return;
    /* Non-blocking: a client that went away just misses its answer and asks again. */
    if (zmq_send(r->sock, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) return;
    (void) zmq_send(r->sock, buf, len, ZMQ_DONTWAIT);
}

kvs_status_t kvs_registry_add(kvs_registry_t *r, const kvs_msg_register_t *reg)
{
    if (reg->tp_size == 0 || reg->pp_size == 0 ||
        (uint64_t) reg->tp_size * reg->pp_size > KVS_MAX_TP ||
        reg->rank >= reg->tp_size * reg->pp_size) {
        kvs_error("registry: rank %u of PP %u x TP %u is out of range (at most %d ranks)",
                  reg->rank, reg->pp_size, reg->tp_size, KVS_MAX_TP);
        return KVS_ERR_INVALID;
    }
    const kvs_msg_register_t *first = r->have != 0 ? &r->regs[__builtin_ctzll(r->have)] : NULL;
    if (first != NULL && (first->tp_size != reg->tp_size || first->pp_size != reg->pp_size)) {
        kvs_warn("registry: rank %u registers PP %u x TP %u, but earlier ranks registered PP %u x "
                 "TP %u",
                 reg->rank, reg->pp_size, reg->tp_size, first->pp_size, first->tp_size);
        return KVS_ERR_INCOMPATIBLE;
    }
    if ((r->have >> reg->rank) & 1)
        kvs_info("registry: prefill rank %u registered again (restart?) at %s", reg->rank,
                 reg->endpoint);
    r->regs[reg->rank] = *reg;
    r->have |= 1ull << reg->rank;
    return KVS_OK;
}

static void handle(kvs_registry_t *r, const void *id, size_t id_len, const kvs_msg_t *msg)
{
    kvs_msg_t out = {.type = KVS_MSG_QUERY_REPLY};
    if (msg->type == KVS_MSG_REGISTER) {
        const kvs_msg_register_t *reg = &msg->u.reg;
        if (kvs_registry_add(r, reg) != KVS_OK) {
            r->rejected++;
            return;
        }
        out.u.query.rank = reg->rank;
        out.u.query.found = 1;
        out.u.query.reg = *reg;
    } else if (msg->type == KVS_MSG_QUERY) {
        uint32_t rank = msg->u.query.rank;
        out.u.query.rank = rank;
        out.u.query.found = rank < KVS_MAX_TP && ((r->have >> rank) & 1);
        if (out.u.query.found) out.u.query.reg = r->regs[rank];
    } else {
        r->rejected++;
        kvs_warn("registry: unexpected %s message", kvs_msg_type_str(msg->type));
        return;
    }
    reply(r, id, id_len, &out);
}

uint32_t kvs_registry_serve(kvs_registry_t *r, int timeout_ms)
{
    uint32_t n = 0;
    zmq_pollitem_t item = {r->sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, timeout_ms) <= 0) return 0;
    for (;;) {
        uint8_t id[256], buf[KVS_MSG_MAX_SIZE + 1];
        int id_len = zmq_recv(r->sock, id, sizeof(id), ZMQ_DONTWAIT);
        if (id_len < 0) break;
        int more = 0;
        size_t more_len = sizeof(more);
        zmq_getsockopt(r->sock, ZMQ_RCVMORE, &more, &more_len);
        if (!more) {
            r->rejected++;
            continue;
        }
        int len = zmq_recv(r->sock, buf, sizeof(buf), ZMQ_DONTWAIT);
        /* Drain any further frames of a malformed multi-part message. */
        for (zmq_getsockopt(r->sock, ZMQ_RCVMORE, &more, &more_len); more;
             zmq_getsockopt(r->sock, ZMQ_RCVMORE, &more, &more_len)) {
            (void) zmq_recv(r->sock, buf, sizeof(buf), ZMQ_DONTWAIT);
            len = -1;
        }
        kvs_msg_t msg;
        if (len < 0 || (size_t) len > KVS_MSG_MAX_SIZE || id_len > (int) sizeof(id) ||
            kvs_msg_decode(buf, (size_t) len, &msg) != KVS_OK) {
            r->rejected++;
            continue;
        }
        handle(r, id, (size_t) id_len, &msg);
        n++;
    }
    return n;
}

/* ---- client side ---- */

/* Sends `req` to the registry until a QUERY_REPLY for `rank` with found == 1 comes back or the
 * deadline passes. */
static kvs_status_t ask(const char *registry, const kvs_msg_t *req, uint32_t rank,
                        uint64_t timeout_ns, kvs_msg_register_t *reg_p)
{
    uint8_t buf[KVS_MSG_MAX_SIZE + 1];
    size_t len;
    kvs_status_t st = kvs_msg_encode(req, buf, sizeof(buf), &len);
    if (st != KVS_OK) return st;
    void *zctx = zmq_ctx_new();
    void *sock = zctx ? zmq_socket(zctx, ZMQ_DEALER) : NULL;
    if (sock == NULL) {
        if (zctx) zmq_ctx_term(zctx);
        kvs_error("registry client: cannot create a ZeroMQ socket: %s", zmq_strerror(errno));
        return KVS_ERR_IO;
    }
    set_int(sock, ZMQ_LINGER, 0);
    set_int(sock, ZMQ_IMMEDIATE, 1);
    st = KVS_ERR_TIMEOUT;
    if (zmq_connect(sock, registry) != 0) {
        kvs_error("registry client: cannot connect to %s: %s", registry, zmq_strerror(errno));
        st = KVS_ERR_IO;
        goto out;
    }
    uint64_t deadline = kvs_now_ns() + timeout_ns;
    /* The first sends fail until the connection is up (ZMQ_IMMEDIATE): resend soon, then back
     * off to RESEND_MS; never wait past the deadline. */
    long wait_ms = 2;
    for (uint64_t now = kvs_now_ns(); now < deadline; now = kvs_now_ns()) {
        (void) zmq_send(sock, buf, len, ZMQ_DONTWAIT);
        long left_ms = (long) ((deadline - now + 999999) / 1000000);
        long poll_ms = wait_ms < left_ms ? wait_ms : left_ms;
        if (wait_ms < RESEND_MS) wait_ms *= 2;
        zmq_pollitem_t item = {sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, poll_ms) <= 0) continue;
        uint8_t in[KVS_MSG_MAX_SIZE + 1];
        int n;
        while ((n = zmq_recv(sock, in, sizeof(in), ZMQ_DONTWAIT)) >= 0) {
            kvs_msg_t msg;
            if ((size_t) n > KVS_MSG_MAX_SIZE || kvs_msg_decode(in, (size_t) n, &msg) != KVS_OK ||
                msg.type != KVS_MSG_QUERY_REPLY || msg.u.query.rank != rank)
                continue;
            if (msg.u.query.found) {
                *reg_p = msg.u.query.reg;
                st = KVS_OK;
                goto out;
            }
        }
        /* Not registered yet: ask again after a pause. */
        zmq_poll(NULL, 0, poll_ms);
    }
    /* Said at debug level: the callers say what the timeout means to them (a bootstrap that
     * failed, or a restarted peer looked up again while it is still down). */
    kvs_debug("registry %s: no answer for prefill rank %u before the deadline", registry, rank);
out:
    zmq_close(sock);
    zmq_ctx_term(zctx);
    return st;
}

kvs_status_t kvs_registry_register(const char *registry, const kvs_msg_register_t *reg,
                                   uint64_t timeout_ns)
{
    kvs_msg_t req = {.type = KVS_MSG_REGISTER};
    req.u.reg = *reg;
    kvs_msg_register_t echo;
    return ask(registry, &req, reg->rank, timeout_ns, &echo);
}

kvs_status_t kvs_registry_query(const char *registry, uint32_t rank, uint64_t timeout_ns,
                                kvs_msg_register_t *reg_p)
{
    kvs_msg_t req = {.type = KVS_MSG_QUERY};
    req.u.query.rank = rank;
    return ask(registry, &req, rank, timeout_ns, reg_p);
}

/* ---- compatibility ---- */

uint64_t kvs_registry_layout_hash(const kvs_pd_geometry_t *geo)
{
    const kvs_kv_shape_t *s = &geo->shape;
    const uint64_t fields[] = {KVS_MSG_VERSION,
                               KVS_REGION_ALIGN,
                               s->layers,
                               s->kv_heads,
                               s->head_dim_k,
                               s->head_dim_v,
                               s->elem_bytes,
                               s->attn,
                               geo->page_size,
                               kvs_pd_geometry_page(geo, KVS_SIDE_PREFILL),
                               geo->chunk_tokens,
                               kvs_pd_geometry_pp(geo),
                               kvs_pd_geometry_dcp(geo),
                               kvs_pd_geometry_interleave(geo)};
    uint64_t h = 0x6b7673746167656bull;
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) h = kvs_mix64(h ^ fields[i]);
    return h;
}

void kvs_registry_describe(const kvs_pd_geometry_t *geo, uint32_t rank, const char *endpoint,
                           kvs_msg_register_t *reg_p)
{
    memset(reg_p, 0, sizeof(*reg_p));
    reg_p->rank = rank;
    reg_p->tp_size = geo->prefill_tp;
    reg_p->pp_size = kvs_pd_geometry_pp(geo);
    reg_p->shape = geo->shape;
    reg_p->page_size = kvs_pd_geometry_page(geo, KVS_SIDE_PREFILL);
    reg_p->decode_page_size = geo->page_size;
    reg_p->decode_dcp = kvs_pd_geometry_dcp(geo);
    reg_p->dcp_interleave = kvs_pd_geometry_interleave(geo);
    reg_p->chunk_tokens = geo->chunk_tokens;
    reg_p->checksum = geo->no_checksum ? 0 : 1;
    reg_p->layout_hash = kvs_registry_layout_hash(geo);
    size_t n = strlen(endpoint);
    if (n > KVS_MSG_ENDPOINT_MAX) n = KVS_MSG_ENDPOINT_MAX;
    memcpy(reg_p->endpoint, endpoint, n);
    reg_p->endpoint[n] = '\0';
    reg_p->endpoint_len = (uint32_t) n;
}

kvs_status_t kvs_registry_check(const kvs_msg_register_t *p, const kvs_pd_geometry_t *mine,
                                char *why, size_t cap)
{
    const kvs_kv_shape_t *a = &p->shape, *b = &mine->shape;
    char msg[256] = "";
    if (a->attn != b->attn)
        snprintf(msg, sizeof(msg), "attention kind %s vs %s here",
                 a->attn == KVS_ATTN_MLA ? "MLA" : "MHA", b->attn == KVS_ATTN_MLA ? "MLA" : "MHA");
    else if (a->layers != b->layers || a->kv_heads != b->kv_heads ||
             a->head_dim_k != b->head_dim_k || a->head_dim_v != b->head_dim_v)
        snprintf(msg, sizeof(msg),
                 "KV shape %u layers x %u heads x %u/%u dims vs %u x %u x %u/%u here", a->layers,
                 a->kv_heads, a->head_dim_k, a->head_dim_v, b->layers, b->kv_heads, b->head_dim_k,
                 b->head_dim_v);
    else if (p->pp_size != kvs_pd_geometry_pp(mine))
        snprintf(msg, sizeof(msg), "prefill pipeline stages %u vs %u here", p->pp_size,
                 kvs_pd_geometry_pp(mine));
    else if (a->elem_bytes != b->elem_bytes)
        snprintf(msg, sizeof(msg), "element size %u bytes vs %u here", a->elem_bytes,
                 b->elem_bytes);
    else if (p->page_size != kvs_pd_geometry_page(mine, KVS_SIDE_PREFILL))
        snprintf(msg, sizeof(msg), "prefill page size %u vs %u here", p->page_size,
                 kvs_pd_geometry_page(mine, KVS_SIDE_PREFILL));
    else if (p->decode_page_size != mine->page_size)
        snprintf(msg, sizeof(msg), "decode page size %u expected there vs %u here",
                 p->decode_page_size, mine->page_size);
    else if (p->decode_dcp != kvs_pd_geometry_dcp(mine) ||
             p->dcp_interleave != kvs_pd_geometry_interleave(mine))
        snprintf(msg, sizeof(msg), "decode DCP %u, interleave %u expected there vs %u, %u here",
                 p->decode_dcp, p->dcp_interleave, kvs_pd_geometry_dcp(mine),
                 kvs_pd_geometry_interleave(mine));
    else if (p->chunk_tokens != mine->chunk_tokens)
        snprintf(msg, sizeof(msg), "chunk size %u vs %u here", p->chunk_tokens, mine->chunk_tokens);
    else if (p->checksum != (mine->no_checksum ? 0u : 1u))
        snprintf(msg, sizeof(msg), "chunk checksums %s vs %s here", p->checksum ? "on" : "off",
                 mine->no_checksum ? "off" : "on");
    else if (p->layout_hash != kvs_registry_layout_hash(mine))
        snprintf(msg, sizeof(msg),
                 "layout hash %016llx vs %016llx here (different kvstage "
                 "protocol or slot layout version)",
                 (unsigned long long) p->layout_hash,
                 (unsigned long long) kvs_registry_layout_hash(mine));
    if (msg[0] == '\0') {
        if (cap) why[0] = '\0';
        return KVS_OK;
    }
    kvs_error("prefill rank %u at %s is incompatible: %s", p->rank, p->endpoint, msg);
    if (cap) snprintf(why, cap, "prefill rank %u is incompatible: %s", p->rank, msg);
    return KVS_ERR_INCOMPATIBLE;
}
