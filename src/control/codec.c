/* The control-plane message codec (protocol.md §5): encode and decode of kvs_msg_t to the
 * fixed-header, little-endian wire format described in kvstage/msg.h. Both directions share
 * one range check, so anything encode accepts decodes back to the same struct and anything
 * decode accepts re-encodes to the same bytes. */
#include "base/bytes.h"
#include "kvstage/msg.h"

#include <assert.h>
#include <stdio.h>
#include <string.h>

#include "kvstage/log.h"

/* Payload sizes of the fixed parts; variable tails (final metadata, endpoint) come on top. */
#define ROOM_META_SIZE     48
#define STAGING_REQ_SIZE   28
#define STAGING_GRANT_SIZE 32
#define CHUNK_READY_SIZE   44
#define STATUS_SIZE        28 /* + final_len */
#define ABORT_SIZE         20
#define ACK_SIZE           26
#define SHAPE_SIZE         24
#define REGISTER_SIZE      (28 + SHAPE_SIZE) /* + endpoint_len */
#define QUERY_SIZE         4
#define QUERY_REPLY_SIZE   8 /* + a registration when found */
#define HEARTBEAT_SIZE     16

/* Two's complement without relying on the implementation-defined unsigned-to-signed cast. */
static int32_t i32_from_u32(uint32_t v)
{
    return v <= INT32_MAX ? (int32_t) v : (int32_t) (v - 0x80000000u) + INT32_MIN;
}

const char *kvs_msg_type_str(kvs_msg_type_t type)
{
    switch (type) {
    case KVS_MSG_ROOM_META:
        return "ROOM_META";
    case KVS_MSG_STAGING_REQ:
        return "STAGING_REQ";
    case KVS_MSG_STAGING_GRANT:
        return "STAGING_GRANT";
    case KVS_MSG_CHUNK_READY:
        return "CHUNK_READY";
    case KVS_MSG_STATUS:
        return "STATUS";
    case KVS_MSG_ABORT:
        return "ABORT";
    case KVS_MSG_ABORT_ACK:
        return "ABORT_ACK";
    case KVS_MSG_ACK:
        return "ACK";
    case KVS_MSG_REGISTER:
        return "REGISTER";
    case KVS_MSG_QUERY:
        return "QUERY";
    case KVS_MSG_QUERY_REPLY:
        return "QUERY_REPLY";
    case KVS_MSG_HEARTBEAT:
        return "HEARTBEAT";
    }
    return "UNKNOWN";
}

const char *kvs_room_status_str(kvs_room_status_t status)
{
    switch (status) {
    case KVS_ROOM_FAILED:
        return "Failed";
    case KVS_ROOM_BOOTSTRAPPING:
        return "Bootstrapping";
    case KVS_ROOM_WAITING:
        return "WaitingForInput";
    case KVS_ROOM_TRANSFERRING:
        return "Transferring";
    case KVS_ROOM_SUCCESS:
        return "Success";
    }
    return "Unknown";
}

static int type_known(uint32_t type)
{
    return type >= KVS_MSG_ROOM_META && type <= KVS_MSG_HEARTBEAT;
}

/* Range checks shared by encode and decode. On a violation writes a description naming the
 * field into why and returns -1. */
static int check_register(const kvs_msg_register_t *r, char *why, size_t cap)
{
    if (r->tp_size < 1 || r->tp_size > KVS_MAX_TP) {
        snprintf(why, cap, "tp_size %u out of [1, %d]", r->tp_size, KVS_MAX_TP);
        return -1;
    }
    if (r->rank >= r->tp_size) {
        snprintf(why, cap, "rank %u >= tp_size %u", r->rank, r->tp_size);
        return -1;
    }
    uint32_t e = r->shape.elem_bytes;
    if (e != 1 && e != 2 && e != 4) {
        snprintf(why, cap, "shape elem_bytes %u not 1, 2 or 4", e);
        return -1;
    }
    if (r->shape.attn != KVS_ATTN_MHA && r->shape.attn != KVS_ATTN_MLA) {
        snprintf(why, cap, "shape attn %u not 0 or 1", (unsigned) r->shape.attn);
        return -1;
    }
    if (r->endpoint_len > KVS_MSG_ENDPOINT_MAX) {
        snprintf(why, cap, "endpoint_len %u > %d", r->endpoint_len, KVS_MSG_ENDPOINT_MAX);
        return -1;
    }
    /* A NUL inside the counted bytes would make the string and its length disagree. */
    if (memchr(r->endpoint, 0, r->endpoint_len) != NULL) {
        snprintf(why, cap, "endpoint contains a NUL byte");
        return -1;
    }
    return 0;
}

static int check_msg(const kvs_msg_t *m, char *why, size_t cap)
{
    switch (m->type) {
    case KVS_MSG_ROOM_META: {
        const kvs_msg_room_meta_t *r = &m->u.room_meta;
        if (r->decode_tp < 1 || r->decode_tp > KVS_MAX_TP) {
            snprintf(why, cap, "decode_tp %u out of [1, %d]", r->decode_tp, KVS_MAX_TP);
            return -1;
        }
        if (r->decode_rank >= r->decode_tp) {
            snprintf(why, cap, "decode_rank %u >= decode_tp %u", r->decode_rank, r->decode_tp);
            return -1;
        }
        if (r->base > r->prompt_len) {
            snprintf(why, cap, "base %llu > prompt_len %llu", (unsigned long long) r->base,
                     (unsigned long long) r->prompt_len);
            return -1;
        }
        if (r->grid_tokens == 0) {
            snprintf(why, cap, "grid_tokens is 0");
            return -1;
        }
        return 0;
    }
    case KVS_MSG_CHUNK_READY:
        if (m->u.chunk_ready.pages == 0) {
            snprintf(why, cap, "pages is 0");
            return -1;
        }
        return 0;
    case KVS_MSG_STATUS: {
        const kvs_msg_status_t *s = &m->u.status;
        if (s->status != KVS_ROOM_SUCCESS && s->status != KVS_ROOM_FAILED) {
            snprintf(why, cap, "status %d is neither Success nor Failed", s->status);
            return -1;
        }
        if (s->final_len > KVS_MSG_FINAL_MAX) {
            snprintf(why, cap, "final_len %u > %d", s->final_len, KVS_MSG_FINAL_MAX);
            return -1;
        }
        return 0;
    }
    case KVS_MSG_ACK: {
        uint16_t t = m->u.ack.acked_type;
        if (t != KVS_MSG_ROOM_META && t != KVS_MSG_CHUNK_READY && t != KVS_MSG_STATUS) {
            snprintf(why, cap, "acked_type %u is not ROOM_META, CHUNK_READY or STATUS", t);
            return -1;
        }
        return 0;
    }
    case KVS_MSG_REGISTER:
        return check_register(&m->u.reg, why, cap);
    case KVS_MSG_QUERY_REPLY:
        if (m->u.query.found != 0 && m->u.query.found != 1) {
            snprintf(why, cap, "found %d not 0 or 1", m->u.query.found);
            return -1;
        }
        return m->u.query.found ? check_register(&m->u.query.reg, why, cap) : 0;
    case KVS_MSG_HEARTBEAT:
        if (m->u.heartbeat.side > 1) {
            snprintf(why, cap, "side %u not 0 or 1", m->u.heartbeat.side);
            return -1;
        }
        return 0;
    case KVS_MSG_STAGING_REQ:
    case KVS_MSG_STAGING_GRANT:
    case KVS_MSG_ABORT:
    case KVS_MSG_ABORT_ACK:
    case KVS_MSG_QUERY:
        return 0;
    }
    snprintf(why, cap, "unknown type %d", (int) m->type);
    return -1;
}

/* Payload size of a message that passed check_msg. */
static size_t payload_size(const kvs_msg_t *m)
{
    switch (m->type) {
    case KVS_MSG_ROOM_META:
        return ROOM_META_SIZE;
    case KVS_MSG_STAGING_REQ:
        return STAGING_REQ_SIZE;
    case KVS_MSG_STAGING_GRANT:
        return STAGING_GRANT_SIZE;
    case KVS_MSG_CHUNK_READY:
        return CHUNK_READY_SIZE;
    case KVS_MSG_STATUS:
        return STATUS_SIZE + m->u.status.final_len;
    case KVS_MSG_ABORT:
    case KVS_MSG_ABORT_ACK:
        return ABORT_SIZE;
    case KVS_MSG_ACK:
        return ACK_SIZE;
    case KVS_MSG_REGISTER:
        return REGISTER_SIZE + m->u.reg.endpoint_len;
    case KVS_MSG_QUERY:
        return QUERY_SIZE;
    case KVS_MSG_QUERY_REPLY:
        return QUERY_REPLY_SIZE +
               (m->u.query.found ? REGISTER_SIZE + m->u.query.reg.endpoint_len : 0);
    case KVS_MSG_HEARTBEAT:
        return HEARTBEAT_SIZE;
    }
    assert(!"payload_size of an unchecked message");
    return 0;
}

/* Sequential writer; encode sizes the buffer first, so running past the end is a bug. */
typedef struct {
    uint8_t *p;
    size_t off;
    size_t len;
} wire_out_t;

static uint8_t *out_take(wire_out_t *w, size_t n)
{
    assert(w->len - w->off >= n);
    uint8_t *p = w->p + w->off;
    w->off += n;
    return p;
}

static void out_u16(wire_out_t *w, uint16_t v)
{
    kvs_put_u16(out_take(w, 2), v);
}

static void out_u32(wire_out_t *w, uint32_t v)
{
    kvs_put_u32(out_take(w, 4), v);
}

static void out_i32(wire_out_t *w, int32_t v)
{
    kvs_put_u32(out_take(w, 4), (uint32_t) v);
}

static void out_u64(wire_out_t *w, uint64_t v)
{
    kvs_put_u64(out_take(w, 8), v);
}

static void out_bytes(wire_out_t *w, const void *src, size_t n)
{
    if (n > 0) memcpy(out_take(w, n), src, n);
}

static void out_register(wire_out_t *w, const kvs_msg_register_t *r)
{
    out_u32(w, r->rank);
    out_u32(w, r->tp_size);
    out_u32(w, r->shape.layers);
    out_u32(w, r->shape.kv_heads);
    out_u32(w, r->shape.head_dim_k);
    out_u32(w, r->shape.head_dim_v);
    out_u32(w, r->shape.elem_bytes);
    out_u32(w, (uint32_t) r->shape.attn);
    out_u32(w, r->page_size);
    out_u32(w, r->chunk_tokens);
    out_u64(w, r->layout_hash);
    out_u32(w, r->endpoint_len);
    out_bytes(w, r->endpoint, r->endpoint_len);
}

static void out_payload(wire_out_t *w, const kvs_msg_t *m)
{
    switch (m->type) {
    case KVS_MSG_ROOM_META: {
        const kvs_msg_room_meta_t *r = &m->u.room_meta;
        out_u64(w, r->room);
        out_u32(w, r->decode_rank);
        out_u32(w, r->decode_tp);
        out_u64(w, r->base);
        out_u64(w, r->prompt_len);
        out_u64(w, r->total_pages);
        out_u64(w, r->grid_tokens);
        return;
    }
    case KVS_MSG_STAGING_REQ: {
        const kvs_msg_staging_req_t *r = &m->u.staging_req;
        out_u64(w, r->room);
        out_u32(w, r->chunk);
        out_u32(w, r->prefill_rank);
        out_u32(w, r->decode_rank);
        out_u64(w, r->slot_bytes);
        return;
    }
    case KVS_MSG_STAGING_GRANT: {
        const kvs_msg_staging_grant_t *g = &m->u.staging_grant;
        out_u64(w, g->room);
        out_u32(w, g->chunk);
        out_u32(w, g->decode_rank);
        out_u64(w, g->offset);
        out_u64(w, g->size);
        return;
    }
    case KVS_MSG_CHUNK_READY: {
        const kvs_msg_chunk_ready_t *c = &m->u.chunk_ready;
        out_u64(w, c->room);
        out_u32(w, c->chunk);
        out_u32(w, c->prefill_rank);
        out_u32(w, c->decode_rank);
        out_u32(w, c->writer);
        out_u64(w, c->suffix_page_start);
        out_u32(w, c->pages);
        out_u64(w, c->bytes);
        return;
    }
    case KVS_MSG_STATUS: {
        const kvs_msg_status_t *s = &m->u.status;
        out_u64(w, s->room);
        out_u32(w, s->prefill_rank);
        out_u32(w, s->decode_rank);
        out_i32(w, s->status);
        out_i32(w, s->reason);
        out_u32(w, s->final_len);
        out_bytes(w, s->final, s->final_len);
        return;
    }
    case KVS_MSG_ABORT:
    case KVS_MSG_ABORT_ACK: {
        const kvs_msg_abort_t *a = &m->u.abort;
        out_u64(w, a->room);
        out_u32(w, a->from_rank);
        out_u32(w, a->to_rank);
        out_i32(w, a->reason);
        return;
    }
    case KVS_MSG_ACK: {
        const kvs_msg_ack_t *a = &m->u.ack;
        out_u64(w, a->room);
        out_u16(w, a->acked_type);
        out_u32(w, a->chunk);
        out_u32(w, a->writer);
        out_u32(w, a->from_rank);
        out_u32(w, a->to_rank);
        return;
    }
    case KVS_MSG_REGISTER:
        out_register(w, &m->u.reg);
        return;
    case KVS_MSG_QUERY:
        out_u32(w, m->u.query.rank);
        return;
    case KVS_MSG_QUERY_REPLY:
        out_u32(w, m->u.query.rank);
        out_i32(w, m->u.query.found);
        if (m->u.query.found) out_register(w, &m->u.query.reg);
        return;
    case KVS_MSG_HEARTBEAT:
        out_u32(w, m->u.heartbeat.side);
        out_u32(w, m->u.heartbeat.rank);
        out_u64(w, m->u.heartbeat.seq);
        return;
    }
    assert(!"out_payload of an unchecked message");
}

kvs_status_t kvs_msg_encode(const kvs_msg_t *msg, uint8_t *buf, size_t cap, size_t *len_p)
{
    char why[160];
    if (msg == NULL || len_p == NULL || (buf == NULL && cap > 0)) {
        kvs_error("msg encode: NULL argument");
        return KVS_ERR_INVALID;
    }
    if (check_msg(msg, why, sizeof(why)) != 0) {
        kvs_error("msg encode %s: %s", kvs_msg_type_str(msg->type), why);
        return KVS_ERR_INVALID;
    }
    size_t payload = payload_size(msg);
    size_t total = KVS_MSG_HEADER_SIZE + payload;
    assert(total <= KVS_MSG_MAX_SIZE);
    if (cap < total) {
        /* Callers may size buffers by trial, so this is not worth more than a debug line. */
        kvs_debug("msg encode %s: needs %zu bytes, buffer holds %zu", kvs_msg_type_str(msg->type),
                  total, cap);
        return KVS_ERR_NOSPACE;
    }
    wire_out_t w = {.p = buf, .off = 0, .len = total};
    out_u32(&w, KVS_MSG_MAGIC);
    out_u16(&w, KVS_MSG_VERSION);
    out_u16(&w, (uint16_t) msg->type);
    out_u32(&w, (uint32_t) payload);
    out_payload(&w, msg);
    assert(w.off == total);
    *len_p = total;
    return KVS_OK;
}

/* Sequential reader over untrusted bytes: a read past the end sets `truncated` and yields
 * zeros, so field parsing can run straight through and be judged once at the end. */
typedef struct {
    const uint8_t *p;
    size_t off;
    size_t len;
    int truncated;
} wire_in_t;

static const uint8_t *in_take(wire_in_t *r, size_t n)
{
    if (r->truncated || r->len - r->off < n) {
        r->truncated = 1;
        return NULL;
    }
    const uint8_t *p = r->p + r->off;
    r->off += n;
    return p;
}

static uint16_t in_u16(wire_in_t *r)
{
    const uint8_t *p = in_take(r, 2);
    return p ? kvs_get_u16(p) : 0;
}

static uint32_t in_u32(wire_in_t *r)
{
    const uint8_t *p = in_take(r, 4);
    return p ? kvs_get_u32(p) : 0;
}

static int32_t in_i32(wire_in_t *r)
{
    return i32_from_u32(in_u32(r));
}

static uint64_t in_u64(wire_in_t *r)
{
    const uint8_t *p = in_take(r, 8);
    return p ? kvs_get_u64(p) : 0;
}

static void in_bytes(wire_in_t *r, void *dst, size_t n)
{
    const uint8_t *p = in_take(r, n);
    if (p != NULL && n > 0) memcpy(dst, p, n);
}

/* Reads a registration; the fields whose bad values cannot even be stored (enum, array
 * length) are refused here, the rest by check_register. */
static int in_register(wire_in_t *r, kvs_msg_register_t *reg, char *why, size_t cap)
{
    reg->rank = in_u32(r);
    reg->tp_size = in_u32(r);
    reg->shape.layers = in_u32(r);
    reg->shape.kv_heads = in_u32(r);
    reg->shape.head_dim_k = in_u32(r);
    reg->shape.head_dim_v = in_u32(r);
    reg->shape.elem_bytes = in_u32(r);
    uint32_t attn = in_u32(r);
    if (attn != KVS_ATTN_MHA && attn != KVS_ATTN_MLA) {
        snprintf(why, cap, "shape attn %u not 0 or 1", attn);
        return -1;
    }
    reg->shape.attn = (kvs_attn_t) attn;
    reg->page_size = in_u32(r);
    reg->chunk_tokens = in_u32(r);
    reg->layout_hash = in_u64(r);
    reg->endpoint_len = in_u32(r);
    if (reg->endpoint_len > KVS_MSG_ENDPOINT_MAX) {
        snprintf(why, cap, "endpoint_len %u > %d", reg->endpoint_len, KVS_MSG_ENDPOINT_MAX);
        return -1;
    }
    in_bytes(r, reg->endpoint, reg->endpoint_len);
    reg->endpoint[reg->endpoint_len] = '\0';
    return 0;
}

static int in_payload(wire_in_t *r, kvs_msg_t *m, char *why, size_t cap)
{
    switch (m->type) {
    case KVS_MSG_ROOM_META: {
        kvs_msg_room_meta_t *rm = &m->u.room_meta;
        rm->room = in_u64(r);
        rm->decode_rank = in_u32(r);
        rm->decode_tp = in_u32(r);
        rm->base = in_u64(r);
        rm->prompt_len = in_u64(r);
        rm->total_pages = in_u64(r);
        rm->grid_tokens = in_u64(r);
        return 0;
    }
    case KVS_MSG_STAGING_REQ: {
        kvs_msg_staging_req_t *q = &m->u.staging_req;
        q->room = in_u64(r);
        q->chunk = in_u32(r);
        q->prefill_rank = in_u32(r);
        q->decode_rank = in_u32(r);
        q->slot_bytes = in_u64(r);
        return 0;
    }
    case KVS_MSG_STAGING_GRANT: {
        kvs_msg_staging_grant_t *g = &m->u.staging_grant;
        g->room = in_u64(r);
        g->chunk = in_u32(r);
        g->decode_rank = in_u32(r);
        g->offset = in_u64(r);
        g->size = in_u64(r);
        return 0;
    }
    case KVS_MSG_CHUNK_READY: {
        kvs_msg_chunk_ready_t *c = &m->u.chunk_ready;
        c->room = in_u64(r);
        c->chunk = in_u32(r);
        c->prefill_rank = in_u32(r);
        c->decode_rank = in_u32(r);
        c->writer = in_u32(r);
        c->suffix_page_start = in_u64(r);
        c->pages = in_u32(r);
        c->bytes = in_u64(r);
        return 0;
    }
    case KVS_MSG_STATUS: {
        kvs_msg_status_t *s = &m->u.status;
        s->room = in_u64(r);
        s->prefill_rank = in_u32(r);
        s->decode_rank = in_u32(r);
        s->status = in_i32(r);
        s->reason = in_i32(r);
        s->final_len = in_u32(r);
        if (s->final_len > KVS_MSG_FINAL_MAX) {
            snprintf(why, cap, "final_len %u > %d", s->final_len, KVS_MSG_FINAL_MAX);
            return -1;
        }
        in_bytes(r, s->final, s->final_len);
        return 0;
    }
    case KVS_MSG_ABORT:
    case KVS_MSG_ABORT_ACK: {
        kvs_msg_abort_t *a = &m->u.abort;
        a->room = in_u64(r);
        a->from_rank = in_u32(r);
        a->to_rank = in_u32(r);
        a->reason = in_i32(r);
        return 0;
    }
    case KVS_MSG_ACK: {
        kvs_msg_ack_t *a = &m->u.ack;
        a->room = in_u64(r);
        a->acked_type = in_u16(r);
        a->chunk = in_u32(r);
        a->writer = in_u32(r);
        a->from_rank = in_u32(r);
        a->to_rank = in_u32(r);
        return 0;
    }
    case KVS_MSG_REGISTER:
        return in_register(r, &m->u.reg, why, cap);
    case KVS_MSG_QUERY:
        m->u.query.rank = in_u32(r);
        return 0;
    case KVS_MSG_QUERY_REPLY:
        m->u.query.rank = in_u32(r);
        m->u.query.found = in_i32(r);
        if (m->u.query.found != 0 && m->u.query.found != 1) {
            snprintf(why, cap, "found %d not 0 or 1", m->u.query.found);
            return -1;
        }
        return m->u.query.found ? in_register(r, &m->u.query.reg, why, cap) : 0;
    case KVS_MSG_HEARTBEAT:
        m->u.heartbeat.side = in_u32(r);
        m->u.heartbeat.rank = in_u32(r);
        m->u.heartbeat.seq = in_u64(r);
        return 0;
    }
    assert(!"in_payload of an unknown type");
    return -1;
}

kvs_status_t kvs_msg_decode(const uint8_t *buf, size_t len, kvs_msg_t *msg_p)
{
    if (msg_p == NULL || (buf == NULL && len > 0)) {
        kvs_error("msg decode: NULL argument");
        return KVS_ERR_INVALID;
    }
    if (len < KVS_MSG_HEADER_SIZE) {
        kvs_debug("msg decode: %zu bytes, shorter than the %d-byte header", len,
                  KVS_MSG_HEADER_SIZE);
        return KVS_ERR_PROTOCOL;
    }
    if (len > KVS_MSG_MAX_SIZE) {
        kvs_debug("msg decode: %zu bytes, longer than the %d-byte maximum", len, KVS_MSG_MAX_SIZE);
        return KVS_ERR_PROTOCOL;
    }
    uint32_t magic = kvs_get_u32(buf);
    uint16_t version = kvs_get_u16(buf + 4);
    uint16_t type = kvs_get_u16(buf + 6);
    uint32_t declared = kvs_get_u32(buf + 8);
    if (magic != KVS_MSG_MAGIC) {
        kvs_debug("msg decode: bad magic 0x%08x", magic);
        return KVS_ERR_PROTOCOL;
    }
    if (version != KVS_MSG_VERSION) {
        kvs_debug("msg decode: unknown version %u", version);
        return KVS_ERR_PROTOCOL;
    }
    if (!type_known(type)) {
        kvs_debug("msg decode: unknown type %u", type);
        return KVS_ERR_PROTOCOL;
    }
    const char *name = kvs_msg_type_str((kvs_msg_type_t) type);
    if (declared != len - KVS_MSG_HEADER_SIZE) {
        kvs_debug("msg decode %s: header length %u, but %zu payload bytes arrived", name, declared,
                  len - KVS_MSG_HEADER_SIZE);
        return KVS_ERR_PROTOCOL;
    }

    /* Built aside and zeroed so *msg_p stays untouched on failure and everything not on the
     * wire (unused array bytes, a QUERY's reply fields) reads as zero. */
    kvs_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = (kvs_msg_type_t) type;
    wire_in_t r = {.p = buf + KVS_MSG_HEADER_SIZE, .off = 0, .len = declared, .truncated = 0};
    char why[160];
    if (in_payload(&r, &m, why, sizeof(why)) != 0) {
        kvs_debug("msg decode %s: %s", name, why);
        return KVS_ERR_PROTOCOL;
    }
    if (r.truncated) {
        kvs_debug("msg decode %s: payload truncated at %u bytes", name, declared);
        return KVS_ERR_PROTOCOL;
    }
    if (r.off != r.len) {
        kvs_debug("msg decode %s: %zu trailing bytes after the payload", name, r.len - r.off);
        return KVS_ERR_PROTOCOL;
    }
    if (check_msg(&m, why, sizeof(why)) != 0) {
        kvs_debug("msg decode %s: %s", name, why);
        return KVS_ERR_PROTOCOL;
    }
    *msg_p = m;
    return KVS_OK;
}
