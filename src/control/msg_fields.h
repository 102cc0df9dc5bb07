/* The control messages' fields as one table (protocol.md §5.1): for every message type, its
 * payload fields in wire order with their width, place in kvs_msg_t and range rule. The codec
 * encodes, decodes and range-checks by walking it, and the codec tests and the fuzz target
 * build and compare messages through it, so a field is added or changed here and nowhere else
 * (internal to the control layer). */
#ifndef KVSTAGE_CONTROL_MSG_FIELDS_H
#define KVSTAGE_CONTROL_MSG_FIELDS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvstage/msg.h"

typedef enum {
    KVS_FIELD_U16, /* integers: little-endian on the wire, host order in the struct */
    KVS_FIELD_U32,
    KVS_FIELD_I32, /* two's complement; kvs_msg_field_get sign-extends it */
    KVS_FIELD_U64,
    KVS_FIELD_BYTES, /* as many bytes as the LENGTH field just before says, into an array */
} kvs_field_kind_t;

typedef enum {
    KVS_RULE_ANY,
    KVS_RULE_NONZERO,
    KVS_RULE_RANGE,    /* lo <= v <= hi */
    KVS_RULE_SET,      /* v < 64 and bit v of set is 1 */
    KVS_RULE_BELOW,    /* v < the field at ref (a rank below its TP size) */
    KVS_RULE_AT_MOST,  /* v <= the field at ref */
    KVS_RULE_LENGTH,   /* v <= hi: the byte count of the BYTES field right after */
    KVS_RULE_PRESENCE, /* 0 or 1: the fields after it are on the wire only when it is 1 */
    KVS_RULE_NO_NUL,   /* BYTES: none of them is NUL; decode leaves a terminator after them */
} kvs_field_rule_t;

typedef struct {
    const char *name; /* as logs name it: the member below the type's struct */
    kvs_field_kind_t kind;
    size_t offset; /* of the member in kvs_msg_t */
    size_t size;   /* of the member: an integer's wire width, an array's capacity */
    kvs_field_rule_t rule;
    uint64_t lo, hi;   /* RANGE; LENGTH: hi */
    uint64_t set;      /* SET */
    size_t ref;        /* BELOW, AT_MOST: offset of the other field in kvs_msg_t */
    const char *valid; /* SET: the valid values, for the log */
} kvs_msg_field_t;

typedef struct {
    const char *name; /* what kvs_msg_type_str says */
    const kvs_msg_field_t *fields;
    size_t count;
} kvs_msg_schema_t;

/* Offset of member u.path of kvs_msg_t, which must be width bytes: where the struct and the
 * table disagree the array size goes negative and the build fails. */
#define KVS_MSG_AT(path, width)                                                                    \
    (offsetof(kvs_msg_t, u.path) +                                                                 \
     0 * sizeof(char[sizeof(((kvs_msg_t *) 0)->u.path) == (width) ? 1 : -1]))

/* Row and rule spellings, local to the table (undefined again below). S is the member of
 * kvs_msg_t.u that holds the type's struct, m the field in it. The table is laid out by hand,
 * one field a line, so clang-format leaves it alone. */
/* clang-format off */
#define ROW(S, m, k, w, ...) \
    {.name = #m, .kind = KVS_FIELD_##k, .offset = KVS_MSG_AT(S.m, w), .size = w, __VA_ARGS__}
#define U16(S, m, ...) ROW(S, m, U16, 2, __VA_ARGS__)
#define U32(S, m, ...) ROW(S, m, U32, 4, __VA_ARGS__)
#define I32(S, m, ...) ROW(S, m, I32, 4, __VA_ARGS__)
#define U64(S, m, ...) ROW(S, m, U64, 8, __VA_ARGS__)
#define BYTES(S, m, ...) \
    {.name = #m, .kind = KVS_FIELD_BYTES, .offset = offsetof(kvs_msg_t, u.S.m), \
     .size = sizeof(((kvs_msg_t *) 0)->u.S.m), __VA_ARGS__}
#define ANY           .rule = KVS_RULE_ANY
#define NONZERO       .rule = KVS_RULE_NONZERO
#define RANGE(l, h)   .rule = KVS_RULE_RANGE, .lo = (l), .hi = (h)
#define SET(bits, v)  .rule = KVS_RULE_SET, .set = (bits), .valid = (v)
#define BELOW(S, m)   .rule = KVS_RULE_BELOW, .ref = offsetof(kvs_msg_t, u.S.m)
#define AT_MOST(S, m) .rule = KVS_RULE_AT_MOST, .ref = offsetof(kvs_msg_t, u.S.m)
#define LENGTH(h)     .rule = KVS_RULE_LENGTH, .hi = (h)
#define PRESENCE      .rule = KVS_RULE_PRESENCE
#define NO_NUL        .rule = KVS_RULE_NO_NUL
#define BIT(v)        (1ull << (v))

static const kvs_msg_field_t kvs_msg_fields_room_meta[] = {
    U64(room_meta, room,        ANY),
    U32(room_meta, decode_rank, BELOW(room_meta, decode_tp)),
    U32(room_meta, decode_tp,   RANGE(1, KVS_MAX_TP)),
    U64(room_meta, base,        AT_MOST(room_meta, prompt_len)),
    U64(room_meta, prompt_len,  ANY),
    U64(room_meta, total_pages, ANY),
    U64(room_meta, grid_tokens, NONZERO),
};

static const kvs_msg_field_t kvs_msg_fields_staging_req[] = {
    U64(staging_req, room,         ANY),
    U32(staging_req, chunk,        ANY),
    U32(staging_req, prefill_rank, ANY),
    U32(staging_req, decode_rank,  ANY),
    U64(staging_req, slot_bytes,   ANY),
};

static const kvs_msg_field_t kvs_msg_fields_staging_grant[] = {
    U64(staging_grant, room,        ANY),
    U32(staging_grant, chunk,       ANY),
    U32(staging_grant, decode_rank, ANY),
    U64(staging_grant, offset,      ANY),
    U64(staging_grant, size,        ANY),
};

static const kvs_msg_field_t kvs_msg_fields_staging_queued[] = {
    U64(staging_queued, room,        ANY),
    U32(staging_queued, chunk,       ANY),
    U32(staging_queued, decode_rank, ANY),
    U32(staging_queued, queued,      NONZERO),
};

static const kvs_msg_field_t kvs_msg_fields_chunk_ready[] = {
    U64(chunk_ready, room,              ANY),
    U32(chunk_ready, chunk,             ANY),
    U32(chunk_ready, prefill_rank,      ANY),
    U32(chunk_ready, decode_rank,       ANY),
    U32(chunk_ready, writer,            ANY),
    U64(chunk_ready, suffix_page_start, ANY),
    U32(chunk_ready, pages,             NONZERO),
    U64(chunk_ready, bytes,             ANY),
    U64(chunk_ready, checksum,          ANY),
};

static const kvs_msg_field_t kvs_msg_fields_status[] = {
    U64(status,   room,         ANY),
    U32(status,   prefill_rank, ANY),
    U32(status,   decode_rank,  ANY),
    I32(status,   status,       SET(BIT(KVS_ROOM_SUCCESS) | BIT(KVS_ROOM_FAILED),
                                    "Success or Failed")),
    I32(status,   reason,       ANY),
    U32(status,   final_len,    LENGTH(KVS_MSG_FINAL_MAX)),
    BYTES(status, final,        ANY),
};

/* ABORT and ABORT_ACK */
static const kvs_msg_field_t kvs_msg_fields_abort[] = {
    U64(abort, room,      ANY),
    U32(abort, from_rank, ANY),
    U32(abort, to_rank,   ANY),
    I32(abort, reason,    ANY),
};

static const kvs_msg_field_t kvs_msg_fields_ack[] = {
    U64(ack, room,       ANY),
    U16(ack, acked_type, SET(BIT(KVS_MSG_ROOM_META) | BIT(KVS_MSG_STAGING_GRANT) |
                             BIT(KVS_MSG_CHUNK_READY) | BIT(KVS_MSG_STATUS),
                             "ROOM_META, STAGING_GRANT, CHUNK_READY or STATUS")),
    U32(ack, chunk,      ANY),
    U32(ack, writer,     ANY),
    U32(ack, from_rank,  ANY),
    U32(ack, to_rank,    ANY),
};

/* A registration: all of REGISTER, and QUERY_REPLY's tail when found. */
#define REGISTRATION(S) \
    U32(S,   rank,             RANGE(0, KVS_MAX_TP - 1)), \
    U32(S,   tp_size,          RANGE(1, KVS_MAX_TP)), \
    U32(S,   pp_size,          RANGE(1, KVS_MAX_TP)), \
    U32(S,   shape.layers,     ANY), \
    U32(S,   shape.kv_heads,   ANY), \
    U32(S,   shape.head_dim_k, ANY), \
    U32(S,   shape.head_dim_v, ANY), \
    U32(S,   shape.elem_bytes, SET(BIT(1) | BIT(2) | BIT(4), "1, 2 or 4")), \
    U32(S,   shape.attn,       SET(BIT(KVS_ATTN_MHA) | BIT(KVS_ATTN_MLA), "0 or 1")), \
    U32(S,   page_size,        ANY), \
    U32(S,   decode_page_size, ANY), \
    U32(S,   decode_dcp,       RANGE(1, KVS_MAX_TP)), \
    U32(S,   dcp_interleave,   RANGE(1, KVS_MAX_PAGE_SIZE)), \
    U32(S,   chunk_tokens,     ANY), \
    U32(S,   checksum,         SET(BIT(0) | BIT(1), "0 or 1")), \
    U64(S,   layout_hash,      ANY), \
    U32(S,   endpoint_len,     LENGTH(KVS_MSG_ENDPOINT_MAX)), \
    BYTES(S, endpoint,         NO_NUL)

static const kvs_msg_field_t kvs_msg_fields_register[] = {
    REGISTRATION(reg),
};

static const kvs_msg_field_t kvs_msg_fields_query[] = {
    U32(query, rank, ANY),
};

static const kvs_msg_field_t kvs_msg_fields_query_reply[] = {
    U32(query, rank,  ANY),
    I32(query, found, PRESENCE),
    REGISTRATION(query.reg),
};

static const kvs_msg_field_t kvs_msg_fields_heartbeat[] = {
    U32(heartbeat, side, SET(BIT(0) | BIT(1), "0 or 1")),
    U32(heartbeat, rank, ANY),
    U64(heartbeat, seq,  ANY),
};

#define SCHEMA(n, f) {.name = n, .fields = f, .count = sizeof(f) / sizeof(f[0])}
static const kvs_msg_schema_t kvs_msg_schemas[] = {
    [KVS_MSG_ROOM_META]     = SCHEMA("ROOM_META",     kvs_msg_fields_room_meta),
    [KVS_MSG_STAGING_REQ]   = SCHEMA("STAGING_REQ",   kvs_msg_fields_staging_req),
    [KVS_MSG_STAGING_GRANT] = SCHEMA("STAGING_GRANT", kvs_msg_fields_staging_grant),
    [KVS_MSG_CHUNK_READY]   = SCHEMA("CHUNK_READY",   kvs_msg_fields_chunk_ready),
    [KVS_MSG_STATUS]        = SCHEMA("STATUS",        kvs_msg_fields_status),
    [KVS_MSG_ABORT]         = SCHEMA("ABORT",         kvs_msg_fields_abort),
    [KVS_MSG_ABORT_ACK]     = SCHEMA("ABORT_ACK",     kvs_msg_fields_abort),
    [KVS_MSG_ACK]           = SCHEMA("ACK",           kvs_msg_fields_ack),
    [KVS_MSG_REGISTER]      = SCHEMA("REGISTER",      kvs_msg_fields_register),
    [KVS_MSG_QUERY]         = SCHEMA("QUERY",         kvs_msg_fields_query),
    [KVS_MSG_QUERY_REPLY]   = SCHEMA("QUERY_REPLY",   kvs_msg_fields_query_reply),
    [KVS_MSG_HEARTBEAT]     = SCHEMA("HEARTBEAT",     kvs_msg_fields_heartbeat),
    [KVS_MSG_STAGING_QUEUED] = SCHEMA("STAGING_QUEUED", kvs_msg_fields_staging_queued),
};
/* clang-format on */

#undef SCHEMA
#undef REGISTRATION
#undef BIT
#undef NO_NUL
#undef PRESENCE
#undef LENGTH
#undef AT_MOST
#undef BELOW
#undef SET
#undef RANGE
#undef NONZERO
#undef ANY
#undef BYTES
#undef U64
#undef I32
#undef U32
#undef U16
#undef ROW

/* The schema of a message type, NULL for a number that names none. */
static inline const kvs_msg_schema_t *kvs_msg_schema(uint32_t type)
{
    if (type >= sizeof(kvs_msg_schemas) / sizeof(kvs_msg_schemas[0])) return NULL;
    return kvs_msg_schemas[type].fields != NULL ? &kvs_msg_schemas[type] : NULL;
}

/* An integer field's value; a signed one as the bit pattern of its 64-bit sign extension.
 * Copied byte-wise because an integer's place is known only as an offset. */
static inline uint64_t kvs_msg_field_get(const kvs_msg_t *m, const kvs_msg_field_t *f)
{
    const uint8_t *p = (const uint8_t *) m + f->offset;
    switch (f->kind) {
    case KVS_FIELD_U16: {
        uint16_t v;
        memcpy(&v, p, sizeof(v));
        return v;
    }
    case KVS_FIELD_U32: {
        uint32_t v;
        memcpy(&v, p, sizeof(v));
        return v;
    }
    case KVS_FIELD_I32: {
        int32_t v;
        memcpy(&v, p, sizeof(v));
        return (uint64_t) (int64_t) v;
    }
    case KVS_FIELD_U64: {
        uint64_t v;
        memcpy(&v, p, sizeof(v));
        return v;
    }
    case KVS_FIELD_BYTES:
        break;
    }
    return 0;
}

/* Stores the low bytes of v (the field's width) into an integer field. */
static inline void kvs_msg_field_set(kvs_msg_t *m, const kvs_msg_field_t *f, uint64_t v)
{
    uint8_t *p = (uint8_t *) m + f->offset;
    if (f->size == 2) {
        uint16_t x = (uint16_t) v;
        memcpy(p, &x, sizeof(x));
    } else if (f->size == 4) {
        uint32_t x = (uint32_t) v;
        memcpy(p, &x, sizeof(x));
    } else if (f->size == 8) {
        memcpy(p, &v, sizeof(v));
    }
}

/* The field of s at offset (a BELOW or AT_MOST rule's ref); NULL if none. */
static inline const kvs_msg_field_t *kvs_msg_field_at(const kvs_msg_schema_t *s, size_t offset)
{
    for (size_t i = 0; i < s->count; i++)
        if (s->fields[i].offset == offset && s->fields[i].kind != KVS_FIELD_BYTES)
            return &s->fields[i];
    return NULL;
}

/* How many of s's fields m has on the wire: all of them, or up to a PRESENCE field that is 0. */
static inline size_t kvs_msg_fields_on_wire(const kvs_msg_schema_t *s, const kvs_msg_t *m)
{
    for (size_t i = 0; i < s->count; i++)
        if (s->fields[i].rule == KVS_RULE_PRESENCE && kvs_msg_field_get(m, &s->fields[i]) == 0)
            return i + 1;
    return s->count;
}

/* Wire bytes of field i of s in m: an integer's width, or the value of a BYTES field's
 * LENGTH (the field before it). */
static inline size_t kvs_msg_field_wire_size(const kvs_msg_schema_t *s, size_t i,
                                             const kvs_msg_t *m)
{
    const kvs_msg_field_t *f = &s->fields[i];
    return f->kind == KVS_FIELD_BYTES ? (size_t) kvs_msg_field_get(m, f - 1) : f->size;
}

/* ---- checks of decoded messages, for the codec tests and the fuzz target ---- */

/* 0 if a and b carry the same type and the same value in every field on a's wire; otherwise 1
 * with the first difference in why. */
static inline int kvs_msg_fields_diff(const kvs_msg_t *a, const kvs_msg_t *b, char *why, size_t cap)
{
    if (a->type != b->type) {
        snprintf(why, cap, "type: %d != %d", (int) a->type, (int) b->type);
        return 1;
    }
    const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) a->type);
    if (s == NULL) {
        snprintf(why, cap, "unknown type %d", (int) a->type);
        return 1;
    }
    size_t n = kvs_msg_fields_on_wire(s, a);
    for (size_t i = 0; i < n; i++) {
        const kvs_msg_field_t *f = &s->fields[i];
        if (f->kind == KVS_FIELD_BYTES) {
            size_t len = kvs_msg_field_wire_size(s, i, a);
            if (memcmp((const uint8_t *) a + f->offset, (const uint8_t *) b + f->offset, len)) {
                snprintf(why, cap, "%s: bytes differ", f->name);
                return 1;
            }
        } else if (kvs_msg_field_get(a, f) != kvs_msg_field_get(b, f)) {
            snprintf(why, cap, "%s: %llu != %llu", f->name,
                     (unsigned long long) kvs_msg_field_get(a, f),
                     (unsigned long long) kvs_msg_field_get(b, f));
            return 1;
        }
    }
    return 0;
}

/* 0 if every byte of m that belongs to some type's field but is not on m's wire is zero, as
 * decode leaves it (a QUERY's reply fields, a not-found reply's registration, unused array
 * bytes, the endpoint's terminator); otherwise 1 with the field in why. */
static inline int kvs_msg_fields_off_wire_zero(const kvs_msg_t *m, char *why, size_t cap)
{
    bool on_wire[sizeof(kvs_msg_t)] = {false};
    const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) m->type);
    if (s == NULL) {
        snprintf(why, cap, "unknown type %d", (int) m->type);
        return 1;
    }
    size_t n = kvs_msg_fields_on_wire(s, m);
    for (size_t i = 0; i < n; i++) {
        size_t len = kvs_msg_field_wire_size(s, i, m);
        for (size_t k = 0; k < len && s->fields[i].offset + k < sizeof(on_wire); k++)
            on_wire[s->fields[i].offset + k] = true;
    }
    for (size_t t = 0; t < sizeof(kvs_msg_schemas) / sizeof(kvs_msg_schemas[0]); t++) {
        for (size_t i = 0; i < kvs_msg_schemas[t].count; i++) {
            const kvs_msg_field_t *f = &kvs_msg_schemas[t].fields[i];
            for (size_t k = 0; k < f->size; k++) {
                if (!on_wire[f->offset + k] && ((const uint8_t *) m)[f->offset + k] != 0) {
                    snprintf(why, cap, "%s %s byte %zu is off the wire but not 0",
                             kvs_msg_schemas[t].name, f->name, k);
                    return 1;
                }
            }
        }
    }
    return 0;
}

#endif
