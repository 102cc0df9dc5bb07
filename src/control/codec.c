/* The control-plane message codec (protocol.md §5): encode and decode of kvs_msg_t to the
 * fixed-header, little-endian wire format described in kvstage/msg.h. Both directions walk the
 * field table of msg_fields.h and share one range check, so anything encode accepts decodes
 * back to the same struct and anything decode accepts re-encodes to the same bytes. */
#include "base/bytes.h"
#include "kvstage/msg.h"

#include <assert.h>
#include <stdio.h>
#include <string.h>

#include "control/msg_fields.h"
#include "kvstage/log.h"

const char *kvs_msg_type_str(kvs_msg_type_t type)
{
    const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) type);
    return s != NULL ? s->name : "UNKNOWN";
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

/* A field's value as the struct holds it, for a log line. */
static const char *value_str(const kvs_msg_t *m, const kvs_msg_field_t *f, char *buf, size_t cap)
{
    if (f->kind == KVS_FIELD_I32) {
        int32_t v;
        memcpy(&v, (const uint8_t *) m + f->offset, sizeof(v));
        snprintf(buf, cap, "%d", v);
    } else {
        snprintf(buf, cap, "%llu", (unsigned long long) kvs_msg_field_get(m, f));
    }
    return buf;
}

/* The rules of field f that need no other field. On a violation writes a description naming
 * the field into why and returns -1. */
static int check_own(const kvs_msg_t *m, const kvs_msg_field_t *f, char *why, size_t cap)
{
    uint64_t v = kvs_msg_field_get(m, f);
    char s[32];
    switch (f->rule) {
    case KVS_RULE_NONZERO:
        if (v != 0) return 0;
        snprintf(why, cap, "%s is 0", f->name);
        return -1;
    case KVS_RULE_RANGE:
        if (v >= f->lo && v <= f->hi) return 0;
        snprintf(why, cap, "%s %s out of [%llu, %llu]", f->name, value_str(m, f, s, sizeof(s)),
                 (unsigned long long) f->lo, (unsigned long long) f->hi);
        return -1;
    case KVS_RULE_SET:
        if (v < 64 && (f->set >> v) & 1) return 0;
        snprintf(why, cap, "%s %s not %s", f->name, value_str(m, f, s, sizeof(s)), f->valid);
        return -1;
    case KVS_RULE_LENGTH:
        if (v <= f->hi) return 0;
        snprintf(why, cap, "%s %s > %llu", f->name, value_str(m, f, s, sizeof(s)),
                 (unsigned long long) f->hi);
        return -1;
    case KVS_RULE_PRESENCE:
        if (v <= 1) return 0;
        snprintf(why, cap, "%s %s not 0 or 1", f->name, value_str(m, f, s, sizeof(s)));
        return -1;
    case KVS_RULE_ANY:
    case KVS_RULE_BELOW:
    case KVS_RULE_AT_MOST:
    case KVS_RULE_NO_NUL:
        return 0;
    }
    return 0;
}

/* The rules of field i of s that look at another field: checked after every field's own, so
 * the other field's value is already known to be in range. */
static int check_relation(const kvs_msg_t *m, const kvs_msg_schema_t *sc, size_t i, char *why,
                          size_t cap)
{
    const kvs_msg_field_t *f = &sc->fields[i];
    char s[32], t[32];
    if (f->rule == KVS_RULE_NO_NUL) {
        /* A NUL inside the counted bytes would make the string and its length disagree. */
        if (memchr((const uint8_t *) m + f->offset, 0, kvs_msg_field_wire_size(sc, i, m)) == NULL)
            return 0;
        snprintf(why, cap, "%s contains a NUL byte", f->name);
        return -1;
    }
    if (f->rule != KVS_RULE_BELOW && f->rule != KVS_RULE_AT_MOST) return 0;
    const kvs_msg_field_t *ref = kvs_msg_field_at(sc, f->ref);
    assert(ref != NULL);
    uint64_t v = kvs_msg_field_get(m, f), limit = kvs_msg_field_get(m, ref);
    int below = f->rule == KVS_RULE_BELOW;
    if (below ? v < limit : v <= limit) return 0;
    snprintf(why, cap, "%s %s %s %s %s", f->name, value_str(m, f, s, sizeof(s)), below ? ">=" : ">",
             ref->name, value_str(m, ref, t, sizeof(t)));
    return -1;
}

/* Range checks shared by encode and decode, over the fields m has on the wire. */
static int check_msg(const kvs_msg_t *m, char *why, size_t cap)
{
    const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) m->type);
    if (s == NULL) {
        snprintf(why, cap, "unknown type %d", (int) m->type);
        return -1;
    }
    size_t n = kvs_msg_fields_on_wire(s, m);
    for (size_t i = 0; i < n; i++)
        if (check_own(m, &s->fields[i], why, cap) != 0) return -1;
    for (size_t i = 0; i < n; i++)
        if (check_relation(m, s, i, why, cap) != 0) return -1;
    return 0;
}

/* Payload size of a message that passed check_msg. */
static size_t payload_size(const kvs_msg_t *m)
{
    const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) m->type);
    size_t n = kvs_msg_fields_on_wire(s, m), size = 0;
    for (size_t i = 0; i < n; i++) size += kvs_msg_field_wire_size(s, i, m);
    return size;
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

static void out_u64(wire_out_t *w, uint64_t v)
{
    kvs_put_u64(out_take(w, 8), v);
}

static void out_bytes(wire_out_t *w, const void *src, size_t n)
{
    if (n > 0) memcpy(out_take(w, n), src, n);
}

static void out_payload(wire_out_t *w, const kvs_msg_t *m)
{
    const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) m->type);
    size_t n = kvs_msg_fields_on_wire(s, m);
    for (size_t i = 0; i < n; i++) {
        const kvs_msg_field_t *f = &s->fields[i];
        uint64_t v = kvs_msg_field_get(m, f);
        if (f->kind == KVS_FIELD_BYTES)
            out_bytes(w, (const uint8_t *) m + f->offset, kvs_msg_field_wire_size(s, i, m));
        else if (f->size == 2)
            out_u16(w, (uint16_t) v);
        else if (f->size == 4)
            out_u32(w, (uint32_t) v);
        else
            out_u64(w, v);
    }
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

static uint64_t in_uint(wire_in_t *r, size_t width)
{
    const uint8_t *p = in_take(r, width);
    if (p == NULL) return 0;
    return width == 2 ? kvs_get_u16(p) : width == 4 ? kvs_get_u32(p) : kvs_get_u64(p);
}

static void in_bytes(wire_in_t *r, void *dst, size_t n)
{
    const uint8_t *p = in_take(r, n);
    if (p != NULL && n > 0) memcpy(dst, p, n);
}

/* Reads the payload's fields into *m (zeroed, so a BYTES field's terminator is there). The
 * fields that say how much follows (a length, a presence flag) are checked as they arrive, so
 * nothing is read on their word; the rest are left to check_msg. */
static int in_payload(wire_in_t *r, kvs_msg_t *m, char *why, size_t cap)
{
    const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) m->type);
    for (size_t i = 0; i < s->count; i++) {
        const kvs_msg_field_t *f = &s->fields[i];
        if (f->kind == KVS_FIELD_BYTES) {
            in_bytes(r, (uint8_t *) m + f->offset, kvs_msg_field_wire_size(s, i, m));
            continue;
        }
        kvs_msg_field_set(m, f, in_uint(r, f->size));
        if (f->rule != KVS_RULE_LENGTH && f->rule != KVS_RULE_PRESENCE) continue;
        if (check_own(m, f, why, cap) != 0) return -1;
        if (f->rule == KVS_RULE_PRESENCE && kvs_msg_field_get(m, f) == 0) break;
    }
    return 0;
}

/* The header's checks: sizes, magic, version, a known type, the declared length. */
static kvs_status_t check_header(const uint8_t *buf, size_t len, uint16_t *type_p)
{
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
    if (kvs_msg_schema(type) == NULL) {
        kvs_debug("msg decode: unknown type %u", type);
        return KVS_ERR_PROTOCOL;
    }
    const char *name = kvs_msg_type_str((kvs_msg_type_t) type);
    if (declared != len - KVS_MSG_HEADER_SIZE) {
        kvs_debug("msg decode %s: header length %u, but %zu payload bytes arrived", name, declared,
                  len - KVS_MSG_HEADER_SIZE);
        return KVS_ERR_PROTOCOL;
    }
    *type_p = type;
    return KVS_OK;
}

kvs_status_t kvs_msg_peek_type(const uint8_t *buf, size_t len, kvs_msg_type_t *type_p)
{
    uint16_t type;
    if (buf == NULL || check_header(buf, len, &type) != KVS_OK) return KVS_ERR_PROTOCOL;
    *type_p = (kvs_msg_type_t) type;
    return KVS_OK;
}

kvs_status_t kvs_msg_decode(const uint8_t *buf, size_t len, kvs_msg_t *msg_p)
{
    if (msg_p == NULL || (buf == NULL && len > 0)) {
        kvs_error("msg decode: NULL argument");
        return KVS_ERR_INVALID;
    }
    uint16_t type;
    kvs_status_t hst = check_header(buf, len, &type);
    if (hst != KVS_OK) return hst;
    const char *name = kvs_msg_type_str((kvs_msg_type_t) type);
    const uint32_t declared = (uint32_t) (len - KVS_MSG_HEADER_SIZE);

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
