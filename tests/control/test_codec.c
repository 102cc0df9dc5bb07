/* Tests for src/control/codec.c: round trips of every message type, hand-written golden
 * bytes, and the decoder's refusal of truncated, corrupted, oversized, trailing and
 * out-of-range input (with exact-size heap buffers so ASan sees any over-read). */
#include "kvs_test.h"

#include <string.h>

#include "kvstage/log.h"
#include "kvstage/msg.h"
#include "kvstage/rng.h"

#define TYPE_FIRST KVS_MSG_ROOM_META
#define TYPE_LAST  KVS_MSG_HEARTBEAT

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

static uint32_t rnd32(kvs_rng_t *r)
{
    return (uint32_t) rnd64(r);
}

static int32_t rnd_i32(kvs_rng_t *r)
{
    static const int32_t edges[] = {0, -1, INT32_MIN, INT32_MAX, KVS_ERR_TIMEOUT};
    if (kvs_rng_chance(r, 1, 2)) return edges[kvs_rng_below(r, 5)];
    return (int32_t) (kvs_rng_range(r, 0, UINT32_MAX) - 0x80000000ull);
}

static void random_register(kvs_rng_t *r, kvs_msg_register_t *reg)
{
    static const uint32_t elem[] = {1, 2, 4};
    reg->tp_size = (uint32_t) kvs_rng_range(r, 1, KVS_MAX_TP);
    reg->rank = (uint32_t) kvs_rng_below(r, reg->tp_size);
    reg->shape.layers = rnd32(r);
    reg->shape.kv_heads = rnd32(r);
    reg->shape.head_dim_k = rnd32(r);
    reg->shape.head_dim_v = rnd32(r);
    reg->shape.elem_bytes = elem[kvs_rng_below(r, 3)];
    reg->shape.attn = kvs_rng_chance(r, 1, 2) ? KVS_ATTN_MLA : KVS_ATTN_MHA;
    reg->page_size = rnd32(r);
    reg->chunk_tokens = rnd32(r);
    reg->layout_hash = rnd64(r);
    reg->endpoint_len = (uint32_t) kvs_rng_range(r, 0, KVS_MSG_ENDPOINT_MAX);
    for (uint32_t i = 0; i < reg->endpoint_len; i++)
        reg->endpoint[i] = (char) kvs_rng_range(r, 1, 255);
    reg->endpoint[reg->endpoint_len] = '\0';
}

static void random_msg(kvs_rng_t *r, kvs_msg_type_t type, kvs_msg_t *m)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
    switch (type) {
    case KVS_MSG_ROOM_META: {
        kvs_msg_room_meta_t *x = &m->u.room_meta;
        x->room = rnd64(r);
        x->decode_tp = (uint32_t) kvs_rng_range(r, 1, KVS_MAX_TP);
        x->decode_rank = (uint32_t) kvs_rng_below(r, x->decode_tp);
        x->prompt_len = rnd64(r);
        x->base = kvs_rng_range(r, 0, x->prompt_len);
        x->total_pages = rnd64(r);
        x->grid_tokens = rnd64(r);
        if (x->grid_tokens == 0) x->grid_tokens = 1;
        break;
    }
    case KVS_MSG_STAGING_REQ: {
        kvs_msg_staging_req_t *x = &m->u.staging_req;
        x->room = rnd64(r);
        x->chunk = rnd32(r);
        x->prefill_rank = rnd32(r);
        x->decode_rank = rnd32(r);
        x->slot_bytes = rnd64(r);
        break;
    }
    case KVS_MSG_STAGING_GRANT: {
        kvs_msg_staging_grant_t *x = &m->u.staging_grant;
        x->room = rnd64(r);
        x->chunk = rnd32(r);
        x->decode_rank = rnd32(r);
        x->offset = rnd64(r);
        x->size = rnd64(r);
        break;
    }
    case KVS_MSG_CHUNK_READY: {
        kvs_msg_chunk_ready_t *x = &m->u.chunk_ready;
        x->room = rnd64(r);
        x->chunk = rnd32(r);
        x->prefill_rank = rnd32(r);
        x->decode_rank = rnd32(r);
        x->writer = rnd32(r);
        x->suffix_page_start = rnd64(r);
        x->pages = rnd32(r);
        if (x->pages == 0) x->pages = 1;
        x->bytes = rnd64(r);
        break;
    }
    case KVS_MSG_STATUS: {
        kvs_msg_status_t *x = &m->u.status;
        x->room = rnd64(r);
        x->prefill_rank = rnd32(r);
        x->decode_rank = rnd32(r);
        x->status = kvs_rng_chance(r, 1, 2) ? KVS_ROOM_SUCCESS : KVS_ROOM_FAILED;
        x->reason = rnd_i32(r);
        x->final_len = (uint32_t) kvs_rng_range(r, 0, KVS_MSG_FINAL_MAX);
        for (uint32_t i = 0; i < x->final_len; i++) x->final[i] = (uint8_t) kvs_rng_next(r);
        break;
    }
    case KVS_MSG_ABORT:
    case KVS_MSG_ABORT_ACK: {
        kvs_msg_abort_t *x = &m->u.abort;
        x->room = rnd64(r);
        x->from_rank = rnd32(r);
        x->to_rank = rnd32(r);
        x->reason = rnd_i32(r);
        break;
    }
    case KVS_MSG_ACK: {
        static const uint16_t acked[] = {KVS_MSG_ROOM_META, KVS_MSG_CHUNK_READY, KVS_MSG_STATUS};
        kvs_msg_ack_t *x = &m->u.ack;
        x->room = rnd64(r);
        x->acked_type = acked[kvs_rng_below(r, 3)];
        x->chunk = rnd32(r);
        x->writer = rnd32(r);
        x->from_rank = rnd32(r);
        x->to_rank = rnd32(r);
        break;
    }
    case KVS_MSG_REGISTER:
        random_register(r, &m->u.reg);
        break;
    case KVS_MSG_QUERY:
        m->u.query.rank = rnd32(r);
        break;
    case KVS_MSG_QUERY_REPLY:
        m->u.query.rank = rnd32(r);
        m->u.query.found = kvs_rng_chance(r, 1, 2);
        if (m->u.query.found) random_register(r, &m->u.query.reg);
        break;
    case KVS_MSG_HEARTBEAT:
        m->u.heartbeat.side = (uint32_t) kvs_rng_below(r, 2);
        m->u.heartbeat.rank = rnd32(r);
        m->u.heartbeat.seq = rnd64(r);
        break;
    }
}

/* The wire size, worked out from the format description rather than from the codec. */
static size_t expected_size(const kvs_msg_t *m)
{
    size_t reg = 4 * 2 + 4 * 6 + 4 * 2 + 8 + 4;
    switch (m->type) {
    case KVS_MSG_ROOM_META:
        return 12 + 8 + 4 + 4 + 8 * 4;
    case KVS_MSG_STAGING_REQ:
        return 12 + 8 + 4 * 3 + 8;
    case KVS_MSG_STAGING_GRANT:
        return 12 + 8 + 4 * 2 + 8 * 2;
    case KVS_MSG_CHUNK_READY:
        return 12 + 8 + 4 * 4 + 8 + 4 + 8;
    case KVS_MSG_STATUS:
        return 12 + 8 + 4 * 5 + m->u.status.final_len;
    case KVS_MSG_ABORT:
    case KVS_MSG_ABORT_ACK:
        return 12 + 8 + 4 * 3;
    case KVS_MSG_ACK:
        return 12 + 8 + 2 + 4 * 4;
    case KVS_MSG_REGISTER:
        return 12 + reg + m->u.reg.endpoint_len;
    case KVS_MSG_QUERY:
        return 12 + 4;
    case KVS_MSG_QUERY_REPLY:
        return 12 + 8 + (m->u.query.found ? reg + m->u.query.reg.endpoint_len : 0);
    case KVS_MSG_HEARTBEAT:
        return 12 + 4 + 4 + 8;
    }
    return 0;
}

/* ---- field-by-field comparison ---- */

#define DIFF(field)                                                                                \
    do {                                                                                           \
        if (a->field != b->field) {                                                                \
            snprintf(why, cap, "%s: %llu != %llu", #field, (unsigned long long) a->field,          \
                     (unsigned long long) b->field);                                               \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static int register_diff(const kvs_msg_register_t *a, const kvs_msg_register_t *b, char *why,
                         size_t cap)
{
    DIFF(rank);
    DIFF(tp_size);
    DIFF(shape.layers);
    DIFF(shape.kv_heads);
    DIFF(shape.head_dim_k);
    DIFF(shape.head_dim_v);
    DIFF(shape.elem_bytes);
    DIFF(shape.attn);
    DIFF(page_size);
    DIFF(chunk_tokens);
    DIFF(layout_hash);
    DIFF(endpoint_len);
    if (memcmp(a->endpoint, b->endpoint, a->endpoint_len) != 0) {
        snprintf(why, cap, "endpoint bytes differ");
        return 1;
    }
    if (b->endpoint[b->endpoint_len] != '\0') {
        snprintf(why, cap, "endpoint not NUL-terminated");
        return 1;
    }
    return 0;
}

/* Compares what went on the wire; b is the decoded side, whose off-wire fields must be 0. */
static int msg_diff(const kvs_msg_t *a, const kvs_msg_t *b, char *why, size_t cap)
{
    DIFF(type);
    switch (a->type) {
    case KVS_MSG_ROOM_META:
        DIFF(u.room_meta.room);
        DIFF(u.room_meta.decode_rank);
        DIFF(u.room_meta.decode_tp);
        DIFF(u.room_meta.base);
        DIFF(u.room_meta.prompt_len);
        DIFF(u.room_meta.total_pages);
        DIFF(u.room_meta.grid_tokens);
        return 0;
    case KVS_MSG_STAGING_REQ:
        DIFF(u.staging_req.room);
        DIFF(u.staging_req.chunk);
        DIFF(u.staging_req.prefill_rank);
        DIFF(u.staging_req.decode_rank);
        DIFF(u.staging_req.slot_bytes);
        return 0;
    case KVS_MSG_STAGING_GRANT:
        DIFF(u.staging_grant.room);
        DIFF(u.staging_grant.chunk);
        DIFF(u.staging_grant.decode_rank);
        DIFF(u.staging_grant.offset);
        DIFF(u.staging_grant.size);
        return 0;
    case KVS_MSG_CHUNK_READY:
        DIFF(u.chunk_ready.room);
        DIFF(u.chunk_ready.chunk);
        DIFF(u.chunk_ready.prefill_rank);
        DIFF(u.chunk_ready.decode_rank);
        DIFF(u.chunk_ready.writer);
        DIFF(u.chunk_ready.suffix_page_start);
        DIFF(u.chunk_ready.pages);
        DIFF(u.chunk_ready.bytes);
        return 0;
    case KVS_MSG_STATUS:
        DIFF(u.status.room);
        DIFF(u.status.prefill_rank);
        DIFF(u.status.decode_rank);
        DIFF(u.status.status);
        DIFF(u.status.reason);
        DIFF(u.status.final_len);
        if (memcmp(a->u.status.final, b->u.status.final, a->u.status.final_len) != 0) {
            snprintf(why, cap, "final bytes differ");
            return 1;
        }
        return 0;
    case KVS_MSG_ABORT:
    case KVS_MSG_ABORT_ACK:
        DIFF(u.abort.room);
        DIFF(u.abort.from_rank);
        DIFF(u.abort.to_rank);
        DIFF(u.abort.reason);
        return 0;
    case KVS_MSG_ACK:
        DIFF(u.ack.room);
        DIFF(u.ack.acked_type);
        DIFF(u.ack.chunk);
        DIFF(u.ack.writer);
        DIFF(u.ack.from_rank);
        DIFF(u.ack.to_rank);
        return 0;
    case KVS_MSG_REGISTER:
        return register_diff(&a->u.reg, &b->u.reg, why, cap);
    case KVS_MSG_QUERY:
        DIFF(u.query.rank);
        if (b->u.query.found != 0) {
            snprintf(why, cap, "QUERY decoded with found set");
            return 1;
        }
        return 0;
    case KVS_MSG_QUERY_REPLY:
        DIFF(u.query.rank);
        DIFF(u.query.found);
        if (a->u.query.found) return register_diff(&a->u.query.reg, &b->u.query.reg, why, cap);
        if (b->u.query.reg.endpoint_len != 0 || b->u.query.reg.tp_size != 0) {
            snprintf(why, cap, "not-found QUERY_REPLY decoded with a registration");
            return 1;
        }
        return 0;
    case KVS_MSG_HEARTBEAT:
        DIFF(u.heartbeat.side);
        DIFF(u.heartbeat.rank);
        DIFF(u.heartbeat.seq);
        return 0;
    }
    snprintf(why, cap, "unknown type");
    return 1;
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

static void put_le(uint8_t *p, uint64_t v, int width)
{
    for (int i = 0; i < width; i++) p[i] = (uint8_t) (v >> (8 * i));
}

/* ---- tests ---- */

static void test_type_and_status_str(void **state)
{
    (void) state;
    static const char *const names[] = {"ROOM_META", "STAGING_REQ", "STAGING_GRANT", "CHUNK_READY",
                                        "STATUS",    "ABORT",       "ABORT_ACK",     "ACK",
                                        "REGISTER",  "QUERY",       "QUERY_REPLY",   "HEARTBEAT"};
    for (int t = TYPE_FIRST; t <= TYPE_LAST; t++)
        assert_string_equal(kvs_msg_type_str((kvs_msg_type_t) t), names[t - TYPE_FIRST]);
    assert_string_equal(kvs_msg_type_str((kvs_msg_type_t) 0), "UNKNOWN");
    assert_string_equal(kvs_msg_type_str((kvs_msg_type_t) 13), "UNKNOWN");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_FAILED), "Failed");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_BOOTSTRAPPING), "Bootstrapping");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_WAITING), "WaitingForInput");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_TRANSFERRING), "Transferring");
    assert_string_equal(kvs_room_status_str(KVS_ROOM_SUCCESS), "Success");
    assert_string_equal(kvs_room_status_str((kvs_room_status_t) 5), "Unknown");
    assert_string_equal(kvs_room_status_str((kvs_room_status_t) -1), "Unknown");
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
    0x4b, 0x56, 0x53, 0x31, 0x01, 0x00, 0x0c, 0x00, 0x10, 0x00, 0x00, 0x00, /* header */
    0x01, 0x00, 0x00, 0x00,                                                 /* side 1 */
    0x04, 0x03, 0x02, 0x01,                                                 /* rank */
    0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,                         /* seq */
};

static const uint8_t golden_ack[] = {
    0x4b, 0x56, 0x53, 0x31, 0x01, 0x00, 0x08, 0x00, 0x1a, 0x00, 0x00, 0x00, /* header, 26 */
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,                         /* room */
    0x04, 0x00,                                                             /* acked_type */
    0x0d, 0x0c, 0x0b, 0x0a,                                                 /* chunk */
    0x02, 0x00, 0x00, 0x00,                                                 /* writer */
    0x03, 0x00, 0x00, 0x00,                                                 /* from_rank */
    0xfe, 0xff, 0xff, 0xff,                                                 /* to_rank */
};

static const uint8_t golden_status[] = {
    0x4b, 0x56, 0x53, 0x31, 0x01, 0x00, 0x05, 0x00, 0x1f, 0x00, 0x00, 0x00, /* header, 31 */
    0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,                         /* room */
    0x01, 0x00, 0x00, 0x00,                                                 /* prefill_rank */
    0x02, 0x00, 0x00, 0x00,                                                 /* decode_rank */
    0x00, 0x00, 0x00, 0x00,                                                 /* Failed */
    0xfb, 0xff, 0xff, 0xff,                                                 /* reason -5 */
    0x03, 0x00, 0x00, 0x00,                                                 /* final_len */
    0xaa, 0xbb, 0xcc,                                                       /* final */
};

static const uint8_t golden_query_reply[] = {
    0x4b, 0x56, 0x53, 0x31, 0x01, 0x00, 0x0b, 0x00, 0x3f, 0x00, 0x00, 0x00, /* header, 63 */
    0x01, 0x00, 0x00, 0x00,                                                 /* rank */
    0x01, 0x00, 0x00, 0x00,                                                 /* found */
    0x01, 0x00, 0x00, 0x00,                                                 /* reg.rank */
    0x02, 0x00, 0x00, 0x00,                                                 /* tp_size */
    0x20, 0x00, 0x00, 0x00,                                                 /* layers */
    0x08, 0x00, 0x00, 0x00,                                                 /* kv_heads */
    0x80, 0x00, 0x00, 0x00,                                                 /* head_dim_k */
    0x80, 0x00, 0x00, 0x00,                                                 /* head_dim_v */
    0x02, 0x00, 0x00, 0x00,                                                 /* elem_bytes */
    0x00, 0x00, 0x00, 0x00,                                                 /* attn MHA */
    0x10, 0x00, 0x00, 0x00,                                                 /* page_size */
    0x00, 0x02, 0x00, 0x00,                                                 /* chunk_tokens */
    0x0d, 0xf0, 0xfe, 0xca, 0xef, 0xbe, 0xad, 0xde,                         /* layout_hash */
    0x03, 0x00, 0x00, 0x00,                                                 /* endpoint_len */
    'h',  ':',  '1',                                                        /* endpoint */
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
    reg->shape = (kvs_kv_shape_t){.layers = 32,
                                  .kv_heads = 8,
                                  .head_dim_k = 128,
                                  .head_dim_v = 128,
                                  .elem_bytes = 2,
                                  .attn = KVS_ATTN_MHA};
    reg->page_size = 16;
    reg->chunk_tokens = 512;
    reg->layout_hash = 0xdeadbeefcafef00dull;
    reg->endpoint_len = 3;
    memcpy(reg->endpoint, "h:1", 4);
    check_golden(&m, golden_query_reply, sizeof(golden_query_reply));

    /* Fields off the wire are ignored by encode and zero after decode. */
    memset(&m, 0, sizeof(m));
    m.type = KVS_MSG_QUERY;
    m.u.query.rank = 9;
    m.u.query.found = 1;
    m.u.query.reg.endpoint_len = 500;
    uint8_t buf[KVS_MSG_MAX_SIZE];
    static const uint8_t golden_query[] = {0x4b, 0x56, 0x53, 0x31, 0x01, 0x00, 0x0a, 0x00,
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
            kvs_msg_t m;
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
    put_le(bad + 4, 2, 2);
    expect_reject(bad, len, "version", "version 2");
    put_le(bad + 4, 0, 2);
    expect_reject(bad, len, "version", "version 0");
    static const uint16_t bad_types[] = {0, 13, 0x100, 0xffff};
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

/* Valid messages that the out-of-range cases below start from. */
static void base_msg(kvs_msg_type_t type, kvs_msg_t *m)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
    switch (type) {
    case KVS_MSG_ROOM_META:
        m->u.room_meta = (kvs_msg_room_meta_t){.room = 7,
                                               .decode_rank = 1,
                                               .decode_tp = 2,
                                               .base = 16,
                                               .prompt_len = 100,
                                               .total_pages = 6,
                                               .grid_tokens = 64};
        break;
    case KVS_MSG_CHUNK_READY:
        m->u.chunk_ready.pages = 3;
        m->u.chunk_ready.bytes = 4096;
        break;
    case KVS_MSG_STATUS:
        m->u.status.status = KVS_ROOM_SUCCESS;
        m->u.status.final_len = 2;
        m->u.status.final[0] = 0x12;
        m->u.status.final[1] = 0x34;
        break;
    case KVS_MSG_ACK:
        m->u.ack.acked_type = KVS_MSG_ROOM_META;
        break;
    case KVS_MSG_HEARTBEAT:
        m->u.heartbeat.side = 1;
        break;
    case KVS_MSG_REGISTER:
    case KVS_MSG_QUERY_REPLY: {
        kvs_msg_register_t *reg = &m->u.reg;
        if (type == KVS_MSG_QUERY_REPLY) {
            m->u.query.found = 1;
            reg = &m->u.query.reg;
        }
        reg->rank = 0;
        reg->tp_size = 1;
        reg->shape = (kvs_kv_shape_t){.layers = 2,
                                      .kv_heads = 1,
                                      .head_dim_k = 64,
                                      .head_dim_v = 0,
                                      .elem_bytes = 2,
                                      .attn = KVS_ATTN_MLA};
        reg->page_size = 16;
        reg->chunk_tokens = 256;
        reg->endpoint_len = 19;
        memcpy(reg->endpoint, "tcp://10.0.0.1:5000", 20);
        break;
    }
    default:
        break;
    }
}

typedef struct {
    kvs_msg_type_t type;
    size_t struct_off; /* offset of the field in kvs_msg_t */
    int width;         /* bytes, both in the struct and on the wire */
    uint64_t value;
    size_t wire_off; /* offset of the field in the payload */
    const char *needle;
} bad_field_t;

#define REG_Q(f) offsetof(kvs_msg_t, u.query.reg.f)
static const bad_field_t bad_fields[] = {
    {KVS_MSG_ROOM_META, offsetof(kvs_msg_t, u.room_meta.decode_tp), 4, 0, 12, "decode_tp"},
    {KVS_MSG_ROOM_META, offsetof(kvs_msg_t, u.room_meta.decode_tp), 4, KVS_MAX_TP + 1, 12,
     "decode_tp"},
    {KVS_MSG_ROOM_META, offsetof(kvs_msg_t, u.room_meta.decode_tp), 4, 0xffffffff, 12, "decode_tp"},
    {KVS_MSG_ROOM_META, offsetof(kvs_msg_t, u.room_meta.decode_rank), 4, 2, 8, "decode_rank"},
    {KVS_MSG_ROOM_META, offsetof(kvs_msg_t, u.room_meta.base), 8, 101, 16, "base"},
    {KVS_MSG_ROOM_META, offsetof(kvs_msg_t, u.room_meta.base), 8, UINT64_MAX, 16, "base"},
    {KVS_MSG_ROOM_META, offsetof(kvs_msg_t, u.room_meta.grid_tokens), 8, 0, 40, "grid_tokens"},
    {KVS_MSG_CHUNK_READY, offsetof(kvs_msg_t, u.chunk_ready.pages), 4, 0, 32, "pages"},
    {KVS_MSG_STATUS, offsetof(kvs_msg_t, u.status.status), 4, KVS_ROOM_BOOTSTRAPPING, 16, "status"},
    {KVS_MSG_STATUS, offsetof(kvs_msg_t, u.status.status), 4, KVS_ROOM_WAITING, 16, "status"},
    {KVS_MSG_STATUS, offsetof(kvs_msg_t, u.status.status), 4, KVS_ROOM_TRANSFERRING, 16, "status"},
    {KVS_MSG_STATUS, offsetof(kvs_msg_t, u.status.status), 4, 5, 16, "status"},
    {KVS_MSG_STATUS, offsetof(kvs_msg_t, u.status.status), 4, 0xffffffff, 16, "status"},
    {KVS_MSG_STATUS, offsetof(kvs_msg_t, u.status.status), 4, 0x80000004, 16, "status"},
    {KVS_MSG_ACK, offsetof(kvs_msg_t, u.ack.acked_type), 2, 0, 8, "acked_type"},
    {KVS_MSG_ACK, offsetof(kvs_msg_t, u.ack.acked_type), 2, KVS_MSG_STAGING_REQ, 8, "acked_type"},
    {KVS_MSG_ACK, offsetof(kvs_msg_t, u.ack.acked_type), 2, KVS_MSG_ACK, 8, "acked_type"},
    {KVS_MSG_ACK, offsetof(kvs_msg_t, u.ack.acked_type), 2, 0x0104, 8, "acked_type"},
    {KVS_MSG_HEARTBEAT, offsetof(kvs_msg_t, u.heartbeat.side), 4, 2, 0, "side"},
    {KVS_MSG_HEARTBEAT, offsetof(kvs_msg_t, u.heartbeat.side), 4, 0x100, 0, "side"},
    {KVS_MSG_REGISTER, offsetof(kvs_msg_t, u.reg.tp_size), 4, 0, 4, "tp_size"},
    {KVS_MSG_REGISTER, offsetof(kvs_msg_t, u.reg.tp_size), 4, KVS_MAX_TP + 1, 4, "tp_size"},
    {KVS_MSG_REGISTER, offsetof(kvs_msg_t, u.reg.rank), 4, 1, 0, "rank"},
    {KVS_MSG_REGISTER, offsetof(kvs_msg_t, u.reg.shape.elem_bytes), 4, 0, 24, "elem_bytes"},
    {KVS_MSG_REGISTER, offsetof(kvs_msg_t, u.reg.shape.elem_bytes), 4, 3, 24, "elem_bytes"},
    {KVS_MSG_REGISTER, offsetof(kvs_msg_t, u.reg.shape.elem_bytes), 4, 8, 24, "elem_bytes"},
    {KVS_MSG_REGISTER, offsetof(kvs_msg_t, u.reg.shape.attn), 4, 2, 28, "attn"},
    {KVS_MSG_REGISTER, offsetof(kvs_msg_t, u.reg.shape.attn), 4, 0xffffffff, 28, "attn"},
    {KVS_MSG_QUERY_REPLY, offsetof(kvs_msg_t, u.query.found), 4, 2, 4, "found"},
    {KVS_MSG_QUERY_REPLY, offsetof(kvs_msg_t, u.query.found), 4, 0xffffffff, 4, "found"},
    {KVS_MSG_QUERY_REPLY, REG_Q(tp_size), 4, 0, 8 + 4, "tp_size"},
    {KVS_MSG_QUERY_REPLY, REG_Q(rank), 4, 5, 8 + 0, "rank"},
    {KVS_MSG_QUERY_REPLY, REG_Q(shape.elem_bytes), 4, 3, 8 + 24, "elem_bytes"},
    {KVS_MSG_QUERY_REPLY, REG_Q(shape.attn), 4, 7, 8 + 28, "attn"},
};

static void set_field(kvs_msg_t *m, size_t off, int width, uint64_t value)
{
    uint8_t *p = (uint8_t *) m + off;
    if (width == 2) {
        uint16_t v = (uint16_t) value;
        memcpy(p, &v, 2);
    } else if (width == 4) {
        uint32_t v = (uint32_t) value;
        memcpy(p, &v, 4);
    } else {
        memcpy(p, &value, 8);
    }
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
    uint8_t buf[KVS_MSG_MAX_SIZE + 8];
    char ctx[96];
    for (size_t i = 0; i < sizeof(bad_fields) / sizeof(bad_fields[0]); i++) {
        const bad_field_t *b = &bad_fields[i];
        snprintf(ctx, sizeof(ctx), "%s %s = 0x%llx", kvs_msg_type_str(b->type), b->needle,
                 (unsigned long long) b->value);
        kvs_msg_t m;
        base_msg(b->type, &m);
        size_t len = encode_ok(&m, buf);
        put_le(buf + KVS_MSG_HEADER_SIZE + b->wire_off, b->value, b->width);
        expect_reject(buf, len, b->needle, ctx);
        set_field(&m, b->struct_off, b->width, b->value);
        expect_encode_invalid(&m, b->needle, ctx);
    }

    kvs_msg_t m;
    for (int t = 0; t <= 0xffff; t += (t < 20 ? 1 : 997)) {
        if (t >= TYPE_FIRST && t <= TYPE_LAST) continue;
        memset(&m, 0, sizeof(m));
        m.type = (kvs_msg_type_t) t;
        expect_encode_invalid(&m, "type", "unknown type");
    }

    /* final_len one past the maximum, with the bytes present so only the range check can
     * refuse it. */
    base_msg(KVS_MSG_STATUS, &m);
    m.u.status.final_len = KVS_MSG_FINAL_MAX;
    size_t len = encode_ok(&m, buf);
    buf[len] = 0x99;
    put_le(buf + 8, len + 1 - KVS_MSG_HEADER_SIZE, 4);
    put_le(buf + KVS_MSG_HEADER_SIZE + 24, KVS_MSG_FINAL_MAX + 1, 4);
    expect_reject(buf, len + 1, "final_len", "final_len 65");
    put_le(buf + KVS_MSG_HEADER_SIZE + 24, 0xffffffff, 4);
    expect_reject(buf, len + 1, "final_len", "final_len huge");
    m.u.status.final_len = KVS_MSG_FINAL_MAX + 1;
    expect_encode_invalid(&m, "final_len", "final_len 65");

    /* endpoint_len likewise, in REGISTER and in a found QUERY_REPLY. */
    for (int q = 0; q < 2; q++) {
        kvs_msg_type_t type = q ? KVS_MSG_QUERY_REPLY : KVS_MSG_REGISTER;
        base_msg(type, &m);
        kvs_msg_register_t *reg = q ? &m.u.query.reg : &m.u.reg;
        size_t at = KVS_MSG_HEADER_SIZE + (q ? 8 : 0) + 48;
        memset(reg->endpoint, 'e', KVS_MSG_ENDPOINT_MAX);
        reg->endpoint_len = KVS_MSG_ENDPOINT_MAX;
        len = encode_ok(&m, buf);
        buf[len] = 'e';
        put_le(buf + 8, len + 1 - KVS_MSG_HEADER_SIZE, 4);
        put_le(buf + at, KVS_MSG_ENDPOINT_MAX + 1, 4);
        expect_reject(buf, len + 1, "endpoint_len", "endpoint_len 129");
        put_le(buf + at, 0xffffffff, 4);
        expect_reject(buf, len + 1, "endpoint_len", "endpoint_len huge");
        reg->endpoint_len = KVS_MSG_ENDPOINT_MAX + 1;
        expect_encode_invalid(&m, "endpoint_len", "endpoint_len 129");

        /* A NUL inside the counted bytes would make strlen and endpoint_len disagree. */
        base_msg(type, &m);
        reg = q ? &m.u.query.reg : &m.u.reg;
        len = encode_ok(&m, buf);
        buf[at + 4 + 5] = '\0';
        expect_reject(buf, len, "NUL", "endpoint with NUL");
        reg->endpoint[5] = '\0';
        expect_encode_invalid(&m, "NUL", "endpoint with NUL");
    }

    /* A not-found QUERY_REPLY carries no registration, so a bad one is not looked at. */
    base_msg(KVS_MSG_QUERY_REPLY, &m);
    m.u.query.found = 0;
    m.u.query.reg.tp_size = 0;
    len = encode_ok(&m, buf);
    assert_int_equal(len, KVS_MSG_HEADER_SIZE + 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_type_and_status_str),
        cmocka_unit_test(test_round_trip_every_type),
        cmocka_unit_test(test_golden_bytes),
        cmocka_unit_test(test_every_truncation_rejected),
        cmocka_unit_test(test_header_corruption_rejected),
        cmocka_unit_test(test_payload_corruption_consistent),
        cmocka_unit_test(test_trailing_bytes_rejected),
        cmocka_unit_test(test_bad_headers_rejected),
        cmocka_unit_test(test_random_garbage),
        cmocka_unit_test(test_encode_nospace),
        cmocka_unit_test(test_out_of_range_fields),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
