/* Tests for src/control/codec.c: round trips of every message type, hand-written golden
 * bytes, and the decoder's refusal of truncated, corrupted, oversized, trailing and
 * out-of-range input (with exact-size heap buffers so ASan sees any over-read). Messages are
 * built, compared and pushed out of range through the field table of control/msg_fields.h;
 * the golden bytes and the fixed sizes below pin that table to the wire format. */
#include "kvs_test.h"

#include <string.h>

#include "control/msg_fields.h"
#include "kvstage/log.h"
#include "kvstage/msg.h"
#include "kvstage/rng.h"

#define TYPE_FIRST KVS_MSG_ROOM_META
#define TYPE_LAST  KVS_MSG_STAGING_QUEUED

static uint64_t g_seed;

/* Fails with the seed in the message so a property failure can be replayed. */
#define check(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            char why_[1024];                                                                       \
            snprintf(why_, sizeof(why_), __VA_ARGS__);                                             \
            fail_msg("KVS_SEED=%llu: %s [%s]", (unsigned long long) g_seed, why_, #cond);          \
        }                                                                                          \
    } while (0)

/* ---- log capture: every rejection must log exactly one line naming the problem ---- */

static struct {
    int calls;
    kvs_log_level_t level;
    char msg[256];
} g_log;
static kvs_log_level_t g_old_level;

static void capture_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                         const char *msg)
{
    (void) arg;
    (void) file;
    (void) line;
    g_log.calls++;
    g_log.level = level;
    snprintf(g_log.msg, sizeof(g_log.msg), "%s", msg);
}

static int group_setup(void **state)
{
    (void) state;
    g_old_level = kvs_log_get_level();
    kvs_log_set_level(KVS_LOG_DEBUG);
    kvs_log_set_sink(capture_sink, NULL);
    return 0;
}

static int group_teardown(void **state)
{
    (void) state;
    kvs_log_set_sink(NULL, NULL);
    kvs_log_set_level(g_old_level);
    return 0;
}

/* ---- random valid messages ---- */

/* Extremes are over-represented: they are where width and sign mistakes show. */
static uint64_t rnd64(kvs_rng_t *r)
{
    switch (kvs_rng_below(r, 5)) {
    case 0:
        return 0;
    case 1:
        return UINT64_MAX;
    case 2:
        return kvs_rng_below(r, 1000);
    default:
        return kvs_rng_next(r);
    }
}

static int32_t rnd_i32(kvs_rng_t *r)
{
    static const int32_t edges[] = {0, -1, INT32_MIN, INT32_MAX, KVS_ERR_TIMEOUT};
    if (kvs_rng_chance(r, 1, 2)) return edges[kvs_rng_below(r, 5)];
    return (int32_t) (kvs_rng_range(r, 0, UINT32_MAX) - 0x80000000ull);
}

/* All ones in the field's width. */
static uint64_t width_mask(const kvs_msg_field_t *f)
{
    return f->size >= 8 ? UINT64_MAX : (1ull << (8 * f->size)) - 1;
}

/* The k-th (from 0) value in a SET rule's bit set. */
static uint64_t set_member(uint64_t set, uint64_t k)
{
    for (uint64_t v = 0; v < 64; v++)
        if ((set >> v) & 1 && k-- == 0) return v;
    return 0;
}

static uint64_t set_size(uint64_t set)
{
    uint64_t n = 0;
    for (; set != 0; set &= set - 1) n++;
    return n;
}

/* A random value that satisfies the field's own rule (a BELOW or AT_MOST field is redone once
 * the field it refers to is set). */
static uint64_t random_own(kvs_rng_t *r, const kvs_msg_field_t *f)
{
    uint64_t v = f->kind == KVS_FIELD_I32 ? (uint32_t) rnd_i32(r) : rnd64(r);
    switch (f->rule) {
    case KVS_RULE_NONZERO:
        return (v & width_mask(f)) != 0 ? v : 1;
    case KVS_RULE_RANGE:
        return kvs_rng_range(r, f->lo, f->hi);
    case KVS_RULE_SET:
        return set_member(f->set, kvs_rng_below(r, set_size(f->set)));
    case KVS_RULE_LENGTH:
        return kvs_rng_range(r, 0, f->hi);
    case KVS_RULE_PRESENCE:
        return kvs_rng_below(r, 2);
    default:
        return v;
    }
}

static void random_msg(kvs_rng_t *r, kvs_msg_type_t type, kvs_msg_t *m)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
    const kvs_msg_schema_t *s = kvs_msg_schema(type);
    for (size_t i = 0; i < s->count; i++) {
        const kvs_msg_field_t *f = &s->fields[i];
        if (f->kind == KVS_FIELD_BYTES) continue;
        kvs_msg_field_set(m, f, random_own(r, f));
        if (f->rule == KVS_RULE_PRESENCE && kvs_msg_field_get(m, f) == 0) break;
    }
    size_t n = kvs_msg_fields_on_wire(s, m);
    for (size_t i = 0; i < n; i++) {
        const kvs_msg_field_t *f = &s->fields[i];
        uint64_t limit = 0;
        if (f->rule == KVS_RULE_BELOW || f->rule == KVS_RULE_AT_MOST)
            limit = kvs_msg_field_get(m, kvs_msg_field_at(s, f->ref));
        if (f->rule == KVS_RULE_BELOW) kvs_msg_field_set(m, f, kvs_rng_below(r, limit));
        if (f->rule == KVS_RULE_AT_MOST) kvs_msg_field_set(m, f, kvs_rng_range(r, 0, limit));
        if (f->kind != KVS_FIELD_BYTES) continue;
        uint8_t *p = (uint8_t *) m + f->offset;
        for (size_t k = 0; k < kvs_msg_field_wire_size(s, i, m); k++)
            p[k] =
                (uint8_t) (f->rule == KVS_RULE_NO_NUL ? kvs_rng_range(r, 1, 255) : kvs_rng_next(r));
    }
}

/* A valid message whose fields differ from each other byte for byte where their rules allow:
 * byte b of field i is 8i + b + 1, so a field read from its neighbour's place, or with its
 * bytes swapped, shows. */
static void distinct_msg(kvs_msg_type_t type, kvs_msg_t *m)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
    const kvs_msg_schema_t *s = kvs_msg_schema(type);
    for (size_t i = 0; i < s->count; i++) {
        const kvs_msg_field_t *f = &s->fields[i];
        uint64_t v = 0;
        for (size_t b = 0; b < f->size && b < 8; b++) v |= (uint64_t) (8 * i + b + 1) << (8 * b);
        switch (f->rule) {
        case KVS_RULE_RANGE:
            v = f->lo + v % (f->hi - f->lo + 1);
            break;
        case KVS_RULE_SET:
            v = set_member(f->set, i % set_size(f->set));
            break;
        case KVS_RULE_LENGTH:
            v = f->hi - i;
            break;
        case KVS_RULE_PRESENCE:
            v = 1;
            break;
        default:
            break;
        }
        if (f->kind != KVS_FIELD_BYTES) kvs_msg_field_set(m, f, v);
    }
    for (size_t i = 0; i < s->count; i++) {
        const kvs_msg_field_t *f = &s->fields[i];
        if (f->rule == KVS_RULE_BELOW || f->rule == KVS_RULE_AT_MOST) {
            uint64_t limit = kvs_msg_field_get(m, kvs_msg_field_at(s, f->ref));
            kvs_msg_field_set(m, f, f->rule == KVS_RULE_BELOW ? limit - 1 : limit / 2);
        }
        if (f->kind != KVS_FIELD_BYTES) continue;
        uint8_t *p = (uint8_t *) m + f->offset;
        for (size_t k = 0; k < kvs_msg_field_wire_size(s, i, m); k++)
            p[k] = (uint8_t) (0x80 + (i + k) % 0x7f);
    }
}

/* Payload bytes of each type's fields when byte tails are empty and a registration follows:
 * from the format in protocol.md §5.1, not from the table, which must agree. */
static const size_t fixed_payload[TYPE_LAST + 1] = {
    [KVS_MSG_ROOM_META] = 8 + 4 + 4 + 8 * 4,
    [KVS_MSG_STAGING_REQ] = 8 + 4 * 3 + 8,
    [KVS_MSG_STAGING_GRANT] = 8 + 4 * 2 + 8 * 2,
    [KVS_MSG_CHUNK_READY] = 8 + 4 * 4 + 8 + 4 + 8 + 8,
    [KVS_MSG_STATUS] = 8 + 4 * 5,
    [KVS_MSG_ABORT] = 8 + 4 * 3,
    [KVS_MSG_ABORT_ACK] = 8 + 4 * 3,
    [KVS_MSG_ACK] = 8 + 2 + 4 * 4,
    [KVS_MSG_REGISTER] = 4 * 3 + 4 * 6 + 4 * 6 + 8 + 4,
    [KVS_MSG_QUERY] = 4,
    [KVS_MSG_QUERY_REPLY] = 8 + 4 * 3 + 4 * 6 + 4 * 6 + 8 + 4,
    [KVS_MSG_HEARTBEAT] = 4 + 4 + 8,
    [KVS_MSG_STAGING_QUEUED] = 8 + 4 * 3,
};

/* Payload offset of field i of s in m: the widths before it, as the table says. */
static size_t wire_offset(const kvs_msg_schema_t *s, size_t i, const kvs_msg_t *m)
{
    size_t off = 0;
    for (size_t j = 0; j < i; j++) off += kvs_msg_field_wire_size(s, j, m);
    return off;
}

/* The wire size the table gives m. */
static size_t expected_size(const kvs_msg_t *m)
{
    const kvs_msg_schema_t *s = kvs_msg_schema(m->type);
    return KVS_MSG_HEADER_SIZE + wire_offset(s, kvs_msg_fields_on_wire(s, m), m);
}

/* Compares what went on the wire; b is the decoded side, whose off-wire fields must be 0. */
static int msg_diff(const kvs_msg_t *a, const kvs_msg_t *b, char *why, size_t cap)
{
    return kvs_msg_fields_diff(a, b, why, cap) || kvs_msg_fields_off_wire_zero(b, why, cap);
}

/* ---- helpers ---- */

static size_t encode_ok(const kvs_msg_t *m, uint8_t *buf)
{
    size_t len = 0;
    kvs_status_t st = kvs_msg_encode(m, buf, KVS_MSG_MAX_SIZE, &len);
    check(st == KVS_OK, "encode %s: %s (log: %s)", kvs_msg_type_str(m->type), kvs_status_str(st),
          g_log.msg);
    return len;
}

/* Decodes from an exact-size heap copy so ASan catches any read past the end. */
static kvs_status_t decode_exact(const uint8_t *buf, size_t len, kvs_msg_t *m)
{
    uint8_t *copy = kvs_malloc(len ? len : 1);
    assert_non_null(copy);
    if (len) memcpy(copy, buf, len);
    kvs_status_t st = kvs_msg_decode(copy, len, m);
    kvs_free(copy);
    return st;
}

/* The decoder refuses buf with KVS_ERR_PROTOCOL, leaves *msg_p alone, and logs exactly one
 * debug line containing needle (when given). */
static void expect_reject(const uint8_t *buf, size_t len, const char *needle, const char *ctx)
{
    kvs_msg_t m, before;
    memset(&m, 0x5a, sizeof(m));
    memcpy(&before, &m, sizeof(m));
    g_log.calls = 0;
    g_log.msg[0] = '\0';
    kvs_status_t st = decode_exact(buf, len, &m);
    check(st == KVS_ERR_PROTOCOL, "%s: decode of %zu bytes returned %s", ctx, len,
          kvs_status_str(st));
    check(memcmp(&m, &before, sizeof(m)) == 0, "%s: msg_p written on failure", ctx);
    check(g_log.calls == 1, "%s: %d log lines", ctx, g_log.calls);
    check(g_log.level == KVS_LOG_DEBUG, "%s: logged at level %d", ctx, (int) g_log.level);
    if (needle != NULL)
        check(strstr(g_log.msg, needle) != NULL, "%s: log \"%s\" does not mention \"%s\"", ctx,
              g_log.msg, needle);
}

/* Accepted input must be exactly what re-encoding the decoded message produces. */
static void expect_consistent(const uint8_t *buf, size_t len, const kvs_msg_t *m, const char *ctx)
{
    uint8_t again[KVS_MSG_MAX_SIZE];
    size_t n = encode_ok(m, again);
    check(n == len, "%s: accepted %zu bytes, re-encodes to %zu", ctx, len, n);
    check(memcmp(again, buf, len) == 0, "%s: accepted bytes re-encode differently", ctx);
}

static void put_le(uint8_t *p, uint64_t v, size_t width)
{
    for (size_t i = 0; i < width; i++) p[i] = (uint8_t) (v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, size_t width)
{
    uint64_t v = 0;
    for (size_t i = width; i-- > 0;) v = (v << 8) | p[i];
    return v;
}

/* ---- tests ---- */

static void test_type_and_status_str(void **state)
{
    (void) state;
    static const char *const names[] = {
        "ROOM_META",   "STAGING_REQ", "STAGING_GRANT", "CHUNK_READY", "STATUS",
        "ABORT",       "ABORT_ACK",   "ACK",           "REGISTER",    "QUERY",
        "QUERY_REPLY", "HEARTBEAT",   "STAGING_QUEUED"};
    for (int t = TYPE_FIRST; t <= TYPE_LAST; t++)
        assert_string_equal(kvs_msg_type_str((kvs_msg_type_t) t), names[t - TYPE_FIRST]);
    assert_string_equal(kvs_msg_type_str((kvs_msg_type_t) 0), "UNKNOWN");
    assert_string_equal(kvs_msg_type_str((kvs_msg_type_t) 14), "UNKNOWN");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_FAILED), "Failed");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_BOOTSTRAPPING), "Bootstrapping");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_WAITING), "WaitingForInput");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_TRANSFERRING), "Transferring");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_SUCCESS), "Success");
    assert_string_equal(kvs_room_status_str((kvs_room_status_t) 5), "Unknown");
    assert_string_equal(kvs_room_status_str((kvs_room_status_t) -1), "Unknown");
}

/* The table is well formed, names exactly the known types and gives each the fixed size of the
 * format. */
static void test_table_matches_format(void **state)
{
    (void) state;
    g_seed = 0;
    for (uint32_t t = 0; t <= 0xffff; t++)
        check((kvs_msg_schema(t) != NULL) == (t >= TYPE_FIRST && t <= TYPE_LAST), "type %u", t);
    for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
        const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) t);
        const char *name = s->name;
        size_t fixed = 0, presence = 0;
        check(s->count > 0, "%s has no fields", name);
        for (size_t i = 0; i < s->count; i++) {
            const kvs_msg_field_t *f = &s->fields[i];
            check(f->name != NULL && f->name[0] != '\0', "%s field %zu unnamed", name, i);
            check(f->offset >= offsetof(kvs_msg_t, u) && f->offset + f->size <= sizeof(kvs_msg_t),
                  "%s %s outside the union", name, f->name);
            if (f->kind != KVS_FIELD_BYTES) fixed += f->size;
            /* A byte tail comes right after its length, which fits the array (with a
             * terminator where the bytes are a string). */
            if (f->kind == KVS_FIELD_BYTES) {
                check(i > 0 && f[-1].rule == KVS_RULE_LENGTH, "%s %s: no length before", name,
                      f->name);
                check(f[-1].hi + (f->rule == KVS_RULE_NO_NUL) <= f->size, "%s %s: %llu > %zu", name,
                      f->name, (unsigned long long) f[-1].hi, f->size);
            } else {
                check(f->rule != KVS_RULE_NO_NUL, "%s %s: NO_NUL on an integer", name, f->name);
            }
            if (f->rule == KVS_RULE_LENGTH)
                check(i + 1 < s->count && f[1].kind == KVS_FIELD_BYTES, "%s %s: no bytes after",
                      name, f->name);
            if (f->rule == KVS_RULE_BELOW || f->rule == KVS_RULE_AT_MOST)
                check(kvs_msg_field_at(s, f->ref) != NULL, "%s %s: ref outside the type", name,
                      f->name);
            if (f->rule == KVS_RULE_SET)
                check(f->set != 0 && f->valid != NULL, "%s %s: empty set", name, f->name);
            if (f->rule == KVS_RULE_RANGE)
                check(f->lo <= f->hi && f->hi <= width_mask(f), "%s %s: range", name, f->name);
            presence += f->rule == KVS_RULE_PRESENCE;
        }
        check(presence <= 1, "%s: %zu presence fields", name, presence);
        check(fixed == fixed_payload[t], "%s: table has %zu fixed payload bytes, format %zu", name,
              fixed, fixed_payload[t]);
    }
}

/* Every field lands at the offset the table gives it, little-endian, after the header. */
static void test_fields_at_table_offsets(void **state)
{
    (void) state;
    g_seed = 0;
    uint8_t buf[KVS_MSG_MAX_SIZE];
    char why[256];
    for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
        kvs_msg_t m, d;
        distinct_msg((kvs_msg_type_t) t, &m);
        const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) t);
        size_t len = encode_ok(&m, buf);
        check(len == expected_size(&m), "%s: %zu bytes, table says %zu", s->name, len,
              expected_size(&m));
        check(get_le(buf, 4) == KVS_MSG_MAGIC && get_le(buf + 4, 2) == KVS_MSG_VERSION &&
                  get_le(buf + 6, 2) == (uint64_t) t &&
                  get_le(buf + 8, 4) == len - KVS_MSG_HEADER_SIZE,
              "%s: header", s->name);
        size_t n = kvs_msg_fields_on_wire(s, &m);
        check(n == s->count, "%s: distinct message leaves fields off", s->name);
        for (size_t i = 0; i < n; i++) {
            const kvs_msg_field_t *f = &s->fields[i];
            const uint8_t *at = buf + KVS_MSG_HEADER_SIZE + wire_offset(s, i, &m);
            if (f->kind == KVS_FIELD_BYTES) {
                size_t k = kvs_msg_field_wire_size(s, i, &m);
                check(k > 0, "%s %s: empty", s->name, f->name);
                check(memcmp(at, (const uint8_t *) &m + f->offset, k) == 0, "%s %s bytes", s->name,
                      f->name);
            } else {
                check(get_le(at, f->size) == (kvs_msg_field_get(&m, f) & width_mask(f)),
                      "%s %s at payload offset %zu: 0x%llx, field 0x%llx", s->name, f->name,
                      wire_offset(s, i, &m), (unsigned long long) get_le(at, f->size),
                      (unsigned long long) kvs_msg_field_get(&m, f));
            }
        }
        assert_int_equal(decode_exact(buf, len, &d), KVS_OK);
        check(msg_diff(&m, &d, why, sizeof(why)) == 0, "%s distinct: %s", s->name, why);
    }
}

static void test_round_trip_every_type(void **state)
{
    (void) state;
    g_seed = kvs_test_seed(0xc0dec001);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, g_seed);
    uint64_t iters = kvs_test_iters(2000);
    uint8_t buf[KVS_MSG_MAX_SIZE];
    char why[256];
    for (uint64_t i = 0; i < iters; i++) {
        for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
            kvs_msg_t m, d;
            random_msg(&rng, (kvs_msg_type_t) t, &m);
            size_t len = encode_ok(&m, buf);
            check(len == expected_size(&m), "%s: encoded %zu bytes, format says %zu",
                  kvs_msg_type_str(m.type), len, expected_size(&m));
            check(len <= KVS_MSG_MAX_SIZE, "too long");
            kvs_status_t st = decode_exact(buf, len, &d);
            check(st == KVS_OK, "decode %s: %s (log: %s)", kvs_msg_type_str(m.type),
                  kvs_status_str(st), g_log.msg);
            check(msg_diff(&m, &d, why, sizeof(why)) == 0, "%s iter %llu: %s",
                  kvs_msg_type_str(m.type), (unsigned long long) i, why);
            expect_consistent(buf, len, &d, "round trip");
        }
    }
}

/* Golden encodings written by hand from the format in msg.h. */
static const uint8_t golden_heartbeat[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x0c, 0x00, 0x10, 0x00, 0x00, 0x00, /* header */
    0x01, 0x00, 0x00, 0x00,                                                 /* side 1 */
    0x04, 0x03, 0x02, 0x01,                                                 /* rank */
    0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,                         /* seq */
};

static const uint8_t golden_ack[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x08, 0x00, 0x1a, 0x00, 0x00, 0x00, /* header, 26 */
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,                         /* room */
    0x04, 0x00,                                                             /* acked_type */
    0x0d, 0x0c, 0x0b, 0x0a,                                                 /* chunk */
    0x02, 0x00, 0x00, 0x00,                                                 /* writer */
    0x03, 0x00, 0x00, 0x00,                                                 /* from_rank */
    0xfe, 0xff, 0xff, 0xff,                                                 /* to_rank */
};

static const uint8_t golden_status[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x05, 0x00, 0x1f, 0x00, 0x00, 0x00, /* header, 31 */
    0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* room */
    0x01, 0x00, 0x00, 0x00,                                                 /* prefill_rank */
    0x02, 0x00, 0x00, 0x00,                                                 /* decode_rank */
    0x00, 0x00, 0x00, 0x00,                                                 /* Failed */
    0xfb, 0xff, 0xff, 0xff,                                                 /* reason -5 */
    0x03, 0x00, 0x00, 0x00,                                                 /* final_len */
    0xaa, 0xbb, 0xcc,                                                       /* final */
};

static const uint8_t golden_query_reply[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x0b, 0x00, 0x53, 0x00, 0x00, 0x00, /* header, 83 */
    0x01, 0x00, 0x00, 0x00,                                                 /* rank */
    0x01, 0x00, 0x00, 0x00,                                                 /* found */
    0x01, 0x00, 0x00, 0x00,                                                 /* reg.rank */
    0x02, 0x00, 0x00, 0x00,                                                 /* tp_size */
    0x03, 0x00, 0x00, 0x00,                                                 /* pp_size */
    0x20, 0x00, 0x00, 0x00,                                                 /* layers */
    0x08, 0x00, 0x00, 0x00,                                                 /* kv_heads */
    0x80, 0x00, 0x00, 0x00,                                                 /* head_dim_k */
    0x80, 0x00, 0x00, 0x00,                                                 /* head_dim_v */
    0x02, 0x00, 0x00, 0x00,                                                 /* elem_bytes */
    0x00, 0x00, 0x00, 0x00,                                                 /* attn MHA */
    0x10, 0x00, 0x00, 0x00,                                                 /* page_size */
    0x20, 0x00, 0x00, 0x00,                                                 /* decode_page_size */
    0x04, 0x00, 0x00, 0x00,                                                 /* decode_dcp */
    0x02, 0x00, 0x00, 0x00,                                                 /* dcp_interleave */
    0x00, 0x02, 0x00, 0x00,                                                 /* chunk_tokens */
    0x01, 0x00, 0x00, 0x00,                                                 /* checksum on */
    0x0d, 0xf0, 0xfe, 0xca, 0xef, 0xbe, 0xad, 0xde,                         /* layout_hash */
    0x03, 0x00, 0x00, 0x00,                                                 /* endpoint_len */
    'h',  ':',  '1',                                                        /* endpoint */
};

static const uint8_t golden_room_meta[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x01, 0x00, 0x30, 0x00, 0x00, 0x00, /* header, 48 */
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,                         /* room */
    0x03, 0x00, 0x00, 0x00,                                                 /* decode_rank */
    0x04, 0x00, 0x00, 0x00,                                                 /* decode_tp */
    0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* base */
    0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,                         /* prompt_len */
    0x11, 0x10, 0x0f, 0x0e, 0x0d, 0x0c, 0x0b, 0x0a,                         /* total_pages */
    0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* grid_tokens */
};

static const uint8_t golden_staging_req[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x02, 0x00, 0x1c, 0x00, 0x00, 0x00, /* header, 28 */
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* room */
    0x04, 0x03, 0x02, 0x01,                                                 /* chunk */
    0x05, 0x00, 0x00, 0x00,                                                 /* prefill_rank */
    0x06, 0x00, 0x00, 0x00,                                                 /* decode_rank */
    0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,                         /* slot_bytes */
};

static const uint8_t golden_staging_grant[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x03, 0x00, 0x20, 0x00, 0x00, 0x00, /* header, 32 */
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* room */
    0x04, 0x03, 0x02, 0x01,                                                 /* chunk */
    0x06, 0x00, 0x00, 0x00,                                                 /* decode_rank */
    0x00, 0x00, 0x20, 0x00, 0x01, 0x00, 0x00, 0x00,                         /* offset */
    0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* size */
};

static const uint8_t golden_chunk_ready[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x04, 0x00, 0x34, 0x00, 0x00, 0x00, /* header, 52 */
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* room */
    0x07, 0x00, 0x00, 0x00,                                                 /* chunk */
    0x01, 0x00, 0x00, 0x00,                                                 /* prefill_rank */
    0x02, 0x00, 0x00, 0x00,                                                 /* decode_rank */
    0x03, 0x00, 0x00, 0x00,                                                 /* writer */
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08,                         /* suffix_page_start */
    0x10, 0x00, 0x00, 0x00,                                                 /* pages */
    0x01, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff,                         /* bytes */
    0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01,                         /* checksum */
};

static const uint8_t golden_abort[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x06, 0x00, 0x14, 0x00, 0x00, 0x00, /* header, 20 */
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* room */
    0x01, 0x00, 0x00, 0x00,                                                 /* from_rank */
    0x00, 0x00, 0x00, 0x00,                                                 /* to_rank */
    0xfb, 0xff, 0xff, 0xff,                                                 /* reason -5 */
};

static const uint8_t golden_abort_ack[] = {
    0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x07, 0x00, 0x14, 0x00, 0x00, 0x00, /* header, 20 */
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* room */
    0x00, 0x00, 0x00, 0x00,                                                 /* from_rank */
    0x01, 0x00, 0x00, 0x00,                                                 /* to_rank */
    0xff, 0xff, 0xff, 0x7f,                                                 /* reason INT32_MAX */
};

static void check_golden(const kvs_msg_t *m, const uint8_t *golden, size_t golden_len)
{
    uint8_t buf[KVS_MSG_MAX_SIZE];
    char why[256];
    size_t len = encode_ok(m, buf);
    assert_int_equal(len, golden_len);
    for (size_t i = 0; i < len; i++)
        check(buf[i] == golden[i], "%s byte %zu: 0x%02x, golden 0x%02x", kvs_msg_type_str(m->type),
              i, buf[i], golden[i]);
    kvs_msg_t d;
    assert_int_equal(decode_exact(golden, golden_len, &d), KVS_OK);
    check(msg_diff(m, &d, why, sizeof(why)) == 0, "golden decode: %s", why);
}

static void test_golden_bytes(void **state)
{
    (void) state;
    kvs_msg_t m;

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_HEARTBEAT;
    m.u.heartbeat = (kvs_msg_heartbeat_t){.side = 1, .rank = 0x01020304, .seq = 0x1122334455667788};
    check_golden(&m, golden_heartbeat, sizeof(golden_heartbeat));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_ACK;
    m.u.ack = (kvs_msg_ack_t){.room = 0x0102030405060708,
                              .acked_type = KVS_MSG_CHUNK_READY,
                              .chunk = 0x0a0b0c0d,
                              .writer = 2,
                              .from_rank = 3,
                              .to_rank = 0xfffffffe};
    check_golden(&m, golden_ack, sizeof(golden_ack));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_STATUS;
    m.u.status.room = 5;
    m.u.status.prefill_rank = 1;
    m.u.status.decode_rank = 2;
    m.u.status.status = KVS_ROOM_FAILED;
    m.u.status.reason = KVS_ERR_TIMEOUT;
    m.u.status.final_len = 3;
    memcpy(m.u.status.final, "\xaa\xbb\xcc", 3);
    check_golden(&m, golden_status, sizeof(golden_status));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_QUERY_REPLY;
    m.u.query.rank = 1;
    m.u.query.found = 1;
    kvs_msg_register_t *reg = &m.u.query.reg;
    reg->rank = 1;
    reg->tp_size = 2;
    reg->pp_size = 3;
    reg->shape = (kvs_kv_shape_t){.layers = 32,
                                  .kv_heads = 8,
                                  .head_dim_k = 128,
                                  .head_dim_v = 128,
                                  .elem_bytes = 2,
                                  .attn = KVS_ATTN_MHA};
    reg->page_size = 16;
    reg->decode_page_size = 32;
    reg->decode_dcp = 4;
    reg->dcp_interleave = 2;
    reg->chunk_tokens = 512;
    reg->checksum = 1;
    reg->layout_hash = 0xdeadbeefcafef00dull;
    reg->endpoint_len = 3;
    memcpy(reg->endpoint, "h:1", 4);
    check_golden(&m, golden_query_reply, sizeof(golden_query_reply));

    /* REGISTER is that registration alone: the golden above after its rank and found. */
    kvs_msg_register_t alone = *reg;
    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_REGISTER;
    m.u.reg = alone;
    static const uint8_t register_header[KVS_MSG_HEADER_SIZE] = {
        0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x09, 0x00, 0x4b, 0x00, 0x00, 0x00}; /* 75 */
    uint8_t golden_register[sizeof(golden_query_reply) - 8];
    memcpy(golden_register, register_header, KVS_MSG_HEADER_SIZE);
    memcpy(golden_register + KVS_MSG_HEADER_SIZE, golden_query_reply + KVS_MSG_HEADER_SIZE + 8,
           sizeof(golden_query_reply) - KVS_MSG_HEADER_SIZE - 8);
    check_golden(&m, golden_register, sizeof(golden_register));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_ROOM_META;
    m.u.room_meta = (kvs_msg_room_meta_t){.room = 0x0102030405060708,
                                          .decode_rank = 3,
                                          .decode_tp = 4,
                                          .base = 0x40,
                                          .prompt_len = 0x1122334455667788,
                                          .total_pages = 0x0a0b0c0d0e0f1011,
                                          .grid_tokens = 0x100};
    check_golden(&m, golden_room_meta, sizeof(golden_room_meta));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_STAGING_REQ;
    m.u.staging_req = (kvs_msg_staging_req_t){.room = 42,
                                              .chunk = 0x01020304,
                                              .prefill_rank = 5,
                                              .decode_rank = 6,
                                              .slot_bytes = 0xf0e0d0c0b0a09080};
    check_golden(&m, golden_staging_req, sizeof(golden_staging_req));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_STAGING_GRANT;
    m.u.staging_grant = (kvs_msg_staging_grant_t){
        .room = 42, .chunk = 0x01020304, .decode_rank = 6, .offset = 0x100200000, .size = 1 << 20};
    check_golden(&m, golden_staging_grant, sizeof(golden_staging_grant));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_CHUNK_READY;
    m.u.chunk_ready = (kvs_msg_chunk_ready_t){.room = 42,
                                              .chunk = 7,
                                              .prefill_rank = 1,
                                              .decode_rank = 2,
                                              .writer = 3,
                                              .suffix_page_start = 0x0807060504030201,
                                              .pages = 16,
                                              .bytes = 0xffffffff00000001,
                                              .checksum = 0x0123456789abcdef};
    check_golden(&m, golden_chunk_ready, sizeof(golden_chunk_ready));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_ABORT;
    m.u.abort = (kvs_msg_abort_t){.room = 42, .from_rank = 1, .to_rank = 0, .reason = -5};
    check_golden(&m, golden_abort, sizeof(golden_abort));

    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_ABORT_ACK;
    m.u.abort = (kvs_msg_abort_t){.room = 42, .from_rank = 0, .to_rank = 1, .reason = INT32_MAX};
    check_golden(&m, golden_abort_ack, sizeof(golden_abort_ack));

    /* Fields off the wire are ignored by encode and zero after decode. */
    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_QUERY;
    m.u.query.rank = 9;
    m.u.query.found = 1;
    m.u.query.reg.endpoint_len = 500;
    uint8_t buf[KVS_MSG_MAX_SIZE];
    static const uint8_t golden_query[] = {0x4b, 0x56, 0x53, 0x31, 0x05, 0x00, 0x0a, 0x00,
                                           0x04, 0x00, 0x00, 0x00, 0x09, 0x00, 0x00, 0x00};
    size_t len = encode_ok(&m, buf);
    assert_int_equal(len, sizeof(golden_query));
    assert_memory_equal(buf, golden_query, len);
}

static void test_every_truncation_rejected(void **state)
{
    (void) state;
    g_seed = kvs_test_seed(0xc0dec002);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, g_seed);
    uint64_t iters = kvs_test_iters(50);
    uint8_t buf[KVS_MSG_MAX_SIZE];
    char ctx[64];
    for (uint64_t i = 0; i < iters; i++) {
        for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
            /* The first pass cuts the message whose every field is on the wire and distinct. */
            kvs_msg_t m;
            if (i == 0)
                distinct_msg((kvs_msg_type_t) t, &m);
            else
                random_msg(&rng, (kvs_msg_type_t) t, &m);
            size_t len = encode_ok(&m, buf);
            snprintf(ctx, sizeof(ctx), "%s truncated", kvs_msg_type_str(m.type));
            for (size_t k = 0; k < len; k++) {
                /* As cut: the header's length no longer matches. */
                expect_reject(buf, k, k < KVS_MSG_HEADER_SIZE ? "header" : "header length", ctx);
                if (k < KVS_MSG_HEADER_SIZE) continue;
                /* A consistent header over a short payload: the payload parser must notice. */
                uint8_t cut[KVS_MSG_MAX_SIZE];
                memcpy(cut, buf, k);
                put_le(cut + 8, k - KVS_MSG_HEADER_SIZE, 4);
                expect_reject(cut, k, "truncated", ctx);
            }
        }
    }
}

static void test_header_corruption_rejected(void **state)
{
    (void) state;
    g_seed = kvs_test_seed(0xc0dec003);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, g_seed);
    uint64_t iters = kvs_test_iters(8);
    uint8_t buf[KVS_MSG_MAX_SIZE], bad[KVS_MSG_MAX_SIZE];
    char ctx[96];
    uint64_t accepted = 0;
    for (uint64_t i = 0; i < iters; i++) {
        for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
            kvs_msg_t m;
            random_msg(&rng, (kvs_msg_type_t) t, &m);
            size_t len = encode_ok(&m, buf);
            for (size_t pos = 0; pos < KVS_MSG_HEADER_SIZE; pos++) {
                for (int x = 1; x < 256; x++) {
                    memcpy(bad, buf, len);
                    bad[pos] ^= (uint8_t) x;
                    snprintf(ctx, sizeof(ctx), "%s header byte %zu ^ 0x%02x",
                             kvs_msg_type_str(m.type), pos, x);
                    if (pos != 6) {
                        expect_reject(bad, len, NULL, ctx);
                        continue;
                    }
                    /* The low type byte may name another type whose payload happens to
                     * parse (ABORT and ABORT_ACK share one format; a STAGING_REQ can read as
                     * a STATUS with no final bytes): then it must decode consistently. */
                    kvs_msg_t d;
                    kvs_status_t st = decode_exact(bad, len, &d);
                    if (st == KVS_OK) {
                        accepted++;
                        check(d.type == (kvs_msg_type_t) bad[6], "%s decoded as %s", ctx,
                              kvs_msg_type_str(d.type));
                        expect_consistent(bad, len, &d, ctx);
                    } else {
                        check(st == KVS_ERR_PROTOCOL, "%s: %s", ctx, kvs_status_str(st));
                    }
                }
            }
        }
    }
    /* ABORT ^ 1 is ABORT_ACK, so the accepting branch above did run. */
    check(accepted >= iters * 2, "only %llu type flips accepted", (unsigned long long) accepted);
}

static void test_payload_corruption_consistent(void **state)
{
    (void) state;
    g_seed = kvs_test_seed(0xc0dec004);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, g_seed);
    uint64_t iters = kvs_test_iters(40);
    uint8_t buf[KVS_MSG_MAX_SIZE], bad[KVS_MSG_MAX_SIZE];
    char ctx[96];
    uint64_t accepted = 0, rejected = 0;
    for (uint64_t i = 0; i < iters; i++) {
        for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
            kvs_msg_t m;
            random_msg(&rng, (kvs_msg_type_t) t, &m);
            size_t len = encode_ok(&m, buf);
            for (size_t pos = KVS_MSG_HEADER_SIZE; pos < len; pos++) {
                for (int k = 0; k < 12; k++) {
                    /* Single-bit flips, a full inversion and random values. */
                    uint8_t x = k < 8 ? (uint8_t) (1u << k)
                                      : (k == 8 ? 0xff : (uint8_t) kvs_rng_range(&rng, 1, 255));
                    memcpy(bad, buf, len);
                    bad[pos] ^= x;
                    snprintf(ctx, sizeof(ctx), "%s payload byte %zu ^ 0x%02x",
                             kvs_msg_type_str(m.type), pos, x);
                    kvs_msg_t d;
                    g_log.calls = 0;
                    kvs_status_t st = decode_exact(bad, len, &d);
                    if (st == KVS_OK) {
                        accepted++;
                        check(d.type == m.type, "%s changed type", ctx);
                        expect_consistent(bad, len, &d, ctx);
                    } else {
                        rejected++;
                        check(st == KVS_ERR_PROTOCOL, "%s: %s", ctx, kvs_status_str(st));
                        check(g_log.calls == 1, "%s: rejected with %d log lines", ctx, g_log.calls);
                    }
                }
            }
        }
    }
    /* Both outcomes occur, so the test exercises both branches. */
    check(accepted > 0 && rejected > 0, "accepted %llu rejected %llu",
          (unsigned long long) accepted, (unsigned long long) rejected);
}

static void test_trailing_bytes_rejected(void **state)
{
    (void) state;
    g_seed = kvs_test_seed(0xc0dec005);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, g_seed);
    uint64_t iters = kvs_test_iters(20);
    uint8_t buf[KVS_MSG_MAX_SIZE + 64];
    char ctx[64];
    for (uint64_t i = 0; i < iters; i++) {
        for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
            kvs_msg_t m;
            random_msg(&rng, (kvs_msg_type_t) t, &m);
            size_t len = encode_ok(&m, buf);
            snprintf(ctx, sizeof(ctx), "%s with trailing bytes", kvs_msg_type_str(m.type));
            for (size_t extra = 1; extra <= 16; extra++) {
                for (size_t j = 0; j < extra; j++) buf[len + j] = (uint8_t) kvs_rng_next(&rng);
                put_le(buf + 8, len - KVS_MSG_HEADER_SIZE, 4);
                expect_reject(buf, len + extra, "header length", ctx);
                put_le(buf + 8, len + extra - KVS_MSG_HEADER_SIZE, 4);
                expect_reject(buf, len + extra, "trailing", ctx);
            }
        }
    }
}

/* The header alone names the type (links count messages by it without decoding them); a bad
 * header is refused, a bad payload under a good header is not looked at. */
static void test_peek_type(void **state)
{
    (void) state;
    uint8_t buf[KVS_MSG_MAX_SIZE];
    for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
        kvs_msg_t m;
        distinct_msg((kvs_msg_type_t) t, &m);
        size_t len = encode_ok(&m, buf);
        kvs_msg_type_t got = (kvs_msg_type_t) 0;
        assert_int_equal(kvs_msg_peek_type(buf, len, &got), KVS_OK);
        assert_int_equal(got, t);
        assert_int_equal(kvs_msg_peek_type(buf, len - 1, &got), KVS_ERR_PROTOCOL); /* length */
        buf[len - 1] ^= 0xff; /* the payload: not the header's business */
        assert_int_equal(kvs_msg_peek_type(buf, len, &got), KVS_OK);
        buf[0] ^= 0xff; /* magic */
        assert_int_equal(kvs_msg_peek_type(buf, len, &got), KVS_ERR_PROTOCOL);
    }
    kvs_msg_type_t got;
    assert_int_equal(kvs_msg_peek_type(NULL, 0, &got), KVS_ERR_PROTOCOL);
}

static void test_bad_headers_rejected(void **state)
{
    (void) state;
    kvs_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_HEARTBEAT;
    uint8_t buf[KVS_MSG_MAX_SIZE + 16];
    size_t len = encode_ok(&m, buf);

    expect_reject(NULL, 0, "header", "empty");
    expect_reject(buf, KVS_MSG_HEADER_SIZE - 1, "header", "short header");

    uint8_t bad[KVS_MSG_MAX_SIZE + 16];
    memcpy(bad, buf, len);
    put_le(bad, 0x3253564b, 4); /* "KVS2" */
    expect_reject(bad, len, "magic", "magic");
    memcpy(bad, buf, len);
    put_le(bad + 4, KVS_MSG_VERSION + 1, 2);
    expect_reject(bad, len, "version", "the next version");
    put_le(bad + 4, KVS_MSG_VERSION - 1, 2);
    expect_reject(bad, len, "version", "the previous version");
    put_le(bad + 4, 0, 2);
    expect_reject(bad, len, "version", "version 0");
    static const uint16_t bad_types[] = {0, 14, 0x100, 0xffff};
    for (size_t i = 0; i < sizeof(bad_types) / sizeof(bad_types[0]); i++) {
        memcpy(bad, buf, len);
        put_le(bad + 6, bad_types[i], 2);
        expect_reject(bad, len, "type", "unknown type");
    }
    memcpy(bad, buf, len);
    put_le(bad + 8, 0xffffffffu, 4);
    expect_reject(bad, len, "header length", "huge length field");

    /* Nothing past KVS_MSG_MAX_SIZE is read, even with a self-consistent header. */
    memset(bad, 0, sizeof(bad));
    memcpy(bad, buf, KVS_MSG_HEADER_SIZE);
    put_le(bad + 8, KVS_MSG_MAX_SIZE + 1 - KVS_MSG_HEADER_SIZE, 4);
    expect_reject(bad, KVS_MSG_MAX_SIZE + 1, "maximum", "oversized");

    /* A caller's bug, not a peer's: NULL arguments are invalid, not protocol errors. */
    assert_int_equal(kvs_msg_decode(buf, len, NULL), KVS_ERR_INVALID);
    assert_int_equal(kvs_msg_decode(NULL, len, &m), KVS_ERR_INVALID);
    size_t n = 7;
    assert_int_equal(kvs_msg_encode(NULL, buf, sizeof(buf), &n), KVS_ERR_INVALID);
    assert_int_equal(kvs_msg_encode(&m, buf, sizeof(buf), NULL), KVS_ERR_INVALID);
    assert_int_equal(kvs_msg_encode(&m, NULL, 64, &n), KVS_ERR_INVALID);
    assert_int_equal(n, 7);
}

static void test_random_garbage(void **state)
{
    (void) state;
    g_seed = kvs_test_seed(0xc0dec006);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, g_seed);
    uint64_t iters = kvs_test_iters(100000);
    uint8_t buf[2048];
    uint64_t accepted = 0;
    char ctx[64];
    for (uint64_t i = 0; i < iters; i++) {
        /* Pure noise dies at the magic; a plausible header over noise reaches the payload
         * parser; a header with its type's minimum length makes some noise payloads fit. */
        size_t len;
        uint64_t mode = kvs_rng_below(&rng, 3);
        int type = (int) kvs_rng_range(&rng, 0, TYPE_LAST + 1);
        if (mode == 0) {
            len = (size_t) kvs_rng_range(&rng, 0, sizeof(buf));
        } else if (mode == 1 || type < TYPE_FIRST || type > TYPE_LAST) {
            len = (size_t) kvs_rng_range(&rng, KVS_MSG_HEADER_SIZE, KVS_MSG_HEADER_SIZE + 80);
        } else {
            kvs_msg_t zero;
            memset(&zero, 0, sizeof(zero));
            zero.type = (kvs_msg_type_t) type;
            len = expected_size(&zero);
        }
        for (size_t j = 0; j < len; j++) buf[j] = (uint8_t) kvs_rng_next(&rng);
        if (mode != 0) {
            put_le(buf, KVS_MSG_MAGIC, 4);
            put_le(buf + 4, KVS_MSG_VERSION, 2);
            put_le(buf + 6, (uint64_t) type, 2);
            put_le(buf + 8, len - KVS_MSG_HEADER_SIZE, 4);
        }
        kvs_msg_t d;
        g_log.calls = 0;
        kvs_status_t st = decode_exact(buf, len, &d);
        snprintf(ctx, sizeof(ctx), "garbage %llu (%zu bytes)", (unsigned long long) i, len);
        if (st == KVS_OK) {
            accepted++;
            check(len <= KVS_MSG_MAX_SIZE, "%s accepted", ctx);
            expect_consistent(buf, len, &d, ctx);
        } else {
            check(st == KVS_ERR_PROTOCOL, "%s: %s", ctx, kvs_status_str(st));
            check(g_log.calls == 1, "%s: %d log lines", ctx, g_log.calls);
        }
    }
    /* About one in ten buffers fits; far fewer would mean the generator is broken. */
    if (iters >= 1000)
        check(accepted > iters / 50, "only %llu of %llu garbage buffers accepted",
              (unsigned long long) accepted, (unsigned long long) iters);
}

static void test_encode_nospace(void **state)
{
    (void) state;
    g_seed = kvs_test_seed(0xc0dec007);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, g_seed);
    uint64_t iters = kvs_test_iters(10);
    uint8_t ref[KVS_MSG_MAX_SIZE];
    for (uint64_t i = 0; i < iters; i++) {
        for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
            kvs_msg_t m;
            random_msg(&rng, (kvs_msg_type_t) t, &m);
            size_t len = encode_ok(&m, ref);
            for (size_t cap = 0; cap <= len; cap++) {
                /* Exact-size buffers: ASan flags any write past cap. */
                uint8_t *buf = kvs_malloc(cap ? cap : 1);
                assert_non_null(buf);
                size_t out = 12345;
                kvs_status_t st = kvs_msg_encode(&m, cap ? buf : NULL, cap, &out);
                if (cap < len) {
                    check(st == KVS_ERR_NOSPACE, "%s cap %zu of %zu: %s", kvs_msg_type_str(m.type),
                          cap, len, kvs_status_str(st));
                    check(out == 12345, "len_p written on failure");
                } else {
                    check(st == KVS_OK && out == len, "%s exact cap", kvs_msg_type_str(m.type));
                    check(memcmp(buf, ref, len) == 0, "exact-cap encoding differs");
                }
                kvs_free(buf);
            }
        }
    }
    kvs_assert_no_leaks();
}

/* Values of integer field f that its rule refuses, given the valid message m, into out (room
 * for 128); returns how many. Just past each bound, the width's maximum, every small value a
 * set leaves out, and set members with a high byte or the sign bit added (where a width or
 * sign mistake would let them through). */
static size_t bad_values(const kvs_msg_t *m, const kvs_msg_schema_t *s, const kvs_msg_field_t *f,
                         uint64_t *out)
{
    uint64_t max = width_mask(f), set = f->rule == KVS_RULE_SET ? f->set : 3;
    size_t n = 0;
    switch (f->rule) {
    case KVS_RULE_NONZERO:
        out[n++] = 0;
        break;
    case KVS_RULE_RANGE:
        if (f->lo > 0) out[n++] = f->lo - 1;
        if (f->hi < max) out[n++] = f->hi + 1;
        out[n++] = max;
        break;
    case KVS_RULE_SET:
    case KVS_RULE_PRESENCE:
        for (uint64_t v = 0; v < 64; v++)
            if (!((set >> v) & 1)) out[n++] = v;
        for (uint64_t v = 0; v < 64; v++) {
            if (!((set >> v) & 1)) continue;
            out[n++] = v | 0x100;
            out[n++] = v | (1ull << (8 * f->size - 1));
        }
        out[n++] = max;
        break;
    case KVS_RULE_BELOW:
    case KVS_RULE_AT_MOST: {
        uint64_t limit = kvs_msg_field_get(m, kvs_msg_field_at(s, f->ref));
        for (uint64_t k = f->rule == KVS_RULE_AT_MOST; k < 8; k++)
            if (limit < max - k) out[n++] = limit + k;
        out[n++] = max;
        break;
    }
    default:
        break;
    }
    return n;
}

/* Encode refuses the struct with KVS_ERR_INVALID and one error line naming the field. */
static void expect_encode_invalid(const kvs_msg_t *m, const char *needle, const char *ctx)
{
    uint8_t buf[KVS_MSG_MAX_SIZE];
    size_t len = 777;
    g_log.calls = 0;
    kvs_status_t st = kvs_msg_encode(m, buf, sizeof(buf), &len);
    check(st == KVS_ERR_INVALID, "%s: encode returned %s", ctx, kvs_status_str(st));
    check(len == 777, "%s: len_p written on failure", ctx);
    check(g_log.calls == 1 && g_log.level == KVS_LOG_ERROR, "%s: %d log lines", ctx, g_log.calls);
    check(strstr(g_log.msg, needle) != NULL, "%s: log \"%s\" lacks \"%s\"", ctx, g_log.msg, needle);
}

static void test_out_of_range_fields(void **state)
{
    (void) state;
    g_seed = 0;
    uint8_t buf[KVS_MSG_MAX_SIZE + 8], bad[KVS_MSG_MAX_SIZE + 8];
    char ctx[128];
    size_t cases[KVS_RULE_NO_NUL + 1] = {0};
    kvs_msg_t m;
    for (int t = TYPE_FIRST; t <= TYPE_LAST; t++) {
        const kvs_msg_schema_t *s = kvs_msg_schema((uint32_t) t);
        for (size_t i = 0; i < s->count; i++) {
            const kvs_msg_field_t *f = &s->fields[i];
            distinct_msg((kvs_msg_type_t) t, &m);
            size_t at = KVS_MSG_HEADER_SIZE + wire_offset(s, i, &m);

            /* One field out of its own range or relation, on the wire and in the struct. */
            uint64_t values[128];
            size_t n = bad_values(&m, s, f, values);
            for (size_t k = 0; k < n; k++) {
                snprintf(ctx, sizeof(ctx), "%s %s = 0x%llx", s->name, f->name,
                         (unsigned long long) values[k]);
                distinct_msg((kvs_msg_type_t) t, &m);
                size_t len = encode_ok(&m, buf);
                put_le(buf + at, values[k], f->size);
                expect_reject(buf, len, f->name, ctx);
                kvs_msg_field_set(&m, f, values[k]);
                expect_encode_invalid(&m, f->name, ctx);
                cases[f->rule]++;
            }

            /* A length one past its maximum, with the bytes present so only the range check
             * can refuse it. */
            if (f->rule == KVS_RULE_LENGTH) {
                kvs_msg_field_set(&m, f, f->hi);
                memset((uint8_t *) &m + f[1].offset, 'e', f->hi);
                size_t len = encode_ok(&m, buf);
                buf[len] = 'e';
                put_le(buf + 8, len + 1 - KVS_MSG_HEADER_SIZE, 4);
                snprintf(ctx, sizeof(ctx), "%s %s = max + 1", s->name, f->name);
                put_le(buf + at, f->hi + 1, f->size);
                expect_reject(buf, len + 1, f->name, ctx);
                put_le(buf + at, width_mask(f), f->size);
                expect_reject(buf, len + 1, f->name, ctx);
                kvs_msg_field_set(&m, f, f->hi + 1);
                expect_encode_invalid(&m, f->name, ctx);
                cases[f->rule]++;
            }

            /* A NUL anywhere inside counted string bytes would make strlen and the length
             * disagree. */
            if (f->rule == KVS_RULE_NO_NUL) {
                size_t len = encode_ok(&m, buf);
                for (size_t k = 0; k < kvs_msg_field_wire_size(s, i, &m); k++) {
                    snprintf(ctx, sizeof(ctx), "%s %s with NUL at %zu", s->name, f->name, k);
                    memcpy(bad, buf, len);
                    bad[at + k] = '\0';
                    expect_reject(bad, len, "NUL", ctx);
                    kvs_msg_t z = m;
                    ((uint8_t *) &z)[f->offset + k] = '\0';
                    expect_encode_invalid(&z, "NUL", ctx);
                    cases[f->rule]++;
                }
            }
        }
    }
    /* Every kind of rule the table uses was pushed out of range. */
    for (int r = KVS_RULE_NONZERO; r <= KVS_RULE_NO_NUL; r++)
        check(cases[r] > 0, "no out-of-range case for rule %d", r);

    for (int t = 0; t <= 0xffff; t += (t < 20 ? 1 : 997)) {
        if (t >= TYPE_FIRST && t <= TYPE_LAST) continue;
        memset(&m, 0, sizeof(m));
        m.type = (kvs_msg_type_t) t;
        expect_encode_invalid(&m, "type", "unknown type");
    }

    /* A not-found QUERY_REPLY carries no registration, so a bad one is not looked at. */
    distinct_msg(KVS_MSG_QUERY_REPLY, &m);
    m.u.query.found = 0;
    m.u.query.reg.tp_size = 0;
    size_t len = encode_ok(&m, buf);
    assert_int_equal(len, KVS_MSG_HEADER_SIZE + 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_type_and_status_str),
        cmocka_unit_test(test_table_matches_format),
        cmocka_unit_test(test_fields_at_table_offsets),
        cmocka_unit_test(test_round_trip_every_type),
        cmocka_unit_test(test_golden_bytes),
        cmocka_unit_test(test_every_truncation_rejected),
        cmocka_unit_test(test_header_corruption_rejected),
        cmocka_unit_test(test_payload_corruption_consistent),
        cmocka_unit_test(test_trailing_bytes_rejected),
        cmocka_unit_test(test_peek_type),
        cmocka_unit_test(test_bad_headers_rejected),
        cmocka_unit_test(test_random_garbage),
        cmocka_unit_test(test_encode_nospace),
        cmocka_unit_test(test_out_of_range_fields),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
