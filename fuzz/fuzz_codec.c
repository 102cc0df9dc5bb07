/* libFuzzer target for the message codec (src/control/codec.c): decode must survive any
 * input, and whatever it accepts must re-encode to exactly the same bytes and decode again to
 * the same fields, compared through the field table of control/msg_fields.h.
 *
 * Built with -DKVS_FUZZ_WRITE_SEEDS and without -fsanitize=fuzzer, the file is instead a
 * program that writes the seed corpus (one valid encoding of each message type) into the
 * directory given as its argument. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control/msg_fields.h"
#include "kvstage/msg.h"

/* Aborts with the table check's description, so a crash input says what went wrong. */
static void fail(const char *what, const char *why)
{
    fprintf(stderr, "fuzz_codec: %s: %s\n", what, why);
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvs_msg_t msg, again;
    char why[256];
    if (kvs_msg_decode(data, size, &msg) != KVS_OK) return 0;
    if (kvs_msg_fields_off_wire_zero(&msg, why, sizeof(why)) != 0) fail("decode", why);
    uint8_t buf[KVS_MSG_MAX_SIZE];
    size_t len = 0;
    if (kvs_msg_encode(&msg, buf, sizeof(buf), &len) != KVS_OK) abort();
    if (len != size || memcmp(buf, data, size) != 0) abort();
    if (kvs_msg_decode(buf, len, &again) != KVS_OK) abort();
    if (kvs_msg_fields_diff(&msg, &again, why, sizeof(why)) != 0) fail("decode again", why);
    /* Sizing is exact: one byte less must be refused without writing past it. */
    if (kvs_msg_encode(&msg, buf, len - 1, &len) != KVS_ERR_NOSPACE) abort();
    return 0;
}

#ifdef KVS_FUZZ_WRITE_SEEDS
static void seed_register(kvs_msg_register_t *reg)
{
    reg->rank = 1;
    reg->tp_size = 2;
    reg->pp_size = 2;
    reg->shape = (kvs_kv_shape_t){.layers = 32,
                                  .kv_heads = 8,
                                  .head_dim_k = 128,
                                  .head_dim_v = 128,
                                  .elem_bytes = 2,
                                  .attn = KVS_ATTN_MHA};
    reg->page_size = 16;
    reg->decode_page_size = 32;
    reg->decode_dcp = 2;
    reg->dcp_interleave = 4;
    reg->chunk_tokens = 512;
    reg->checksum = 1;
    reg->layout_hash = 0x5eed5eed12345678ull;
    reg->endpoint_len = (uint32_t) strlen("tcp://10.0.0.7:7000");
    memcpy(reg->endpoint, "tcp://10.0.0.7:7000", reg->endpoint_len + 1);
}

static void seed_msg(kvs_msg_type_t type, kvs_msg_t *m)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
    switch (type) {
    case KVS_MSG_ROOM_META:
        m->u.room_meta = (kvs_msg_room_meta_t){.room = 42,
                                               .decode_rank = 1,
                                               .decode_tp = 2,
                                               .base = 64,
                                               .prompt_len = 1000,
                                               .total_pages = 59,
                                               .grid_tokens = 256};
        break;
    case KVS_MSG_STAGING_REQ:
        m->u.staging_req = (kvs_msg_staging_req_t){
            .room = 42, .chunk = 3, .prefill_rank = 0, .decode_rank = 1, .slot_bytes = 1 << 20};
        break;
    case KVS_MSG_STAGING_GRANT:
        m->u.staging_grant = (kvs_msg_staging_grant_t){
            .room = 42, .chunk = 3, .decode_rank = 1, .offset = 1 << 21, .size = 1 << 20};
        break;
    case KVS_MSG_CHUNK_READY:
        m->u.chunk_ready = (kvs_msg_chunk_ready_t){.room = 42,
                                                   .chunk = 3,
                                                   .prefill_rank = 0,
                                                   .decode_rank = 1,
                                                   .writer = 0,
                                                   .suffix_page_start = 48,
                                                   .pages = 16,
                                                   .bytes = 1 << 19};
        break;
    case KVS_MSG_STATUS:
        m->u.status.room = 42;
        m->u.status.decode_rank = 1;
        m->u.status.status = KVS_ROOM_SUCCESS;
        m->u.status.final_len = 4;
        memcpy(m->u.status.final, "\x11\x22\x33\x44", 4);
        break;
    case KVS_MSG_ABORT:
    case KVS_MSG_ABORT_ACK:
        m->u.abort =
            (kvs_msg_abort_t){.room = 42, .from_rank = 1, .to_rank = 0, .reason = KVS_ERR_TIMEOUT};
        break;
    case KVS_MSG_ACK:
        m->u.ack = (kvs_msg_ack_t){.room = 42,
                                   .acked_type = KVS_MSG_CHUNK_READY,
                                   .chunk = 3,
                                   .writer = 0,
                                   .from_rank = 1,
                                   .to_rank = 0};
        break;
    case KVS_MSG_REGISTER:
        seed_register(&m->u.reg);
        break;
    case KVS_MSG_QUERY:
        m->u.query.rank = 1;
        break;
    case KVS_MSG_QUERY_REPLY:
        m->u.query.rank = 1;
        m->u.query.found = 1;
        seed_register(&m->u.query.reg);
        break;
    case KVS_MSG_HEARTBEAT:
        m->u.heartbeat = (kvs_msg_heartbeat_t){.side = 1, .rank = 1, .seq = 1000};
        break;
    case KVS_MSG_STAGING_QUEUED:
        m->u.staging_queued =
            (kvs_msg_staging_queued_t){.room = 42, .chunk = 3, .decode_rank = 1, .queued = 5};
        break;
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    for (int t = KVS_MSG_ROOM_META; t <= KVS_MSG_STAGING_QUEUED; t++) {
        kvs_msg_t m;
        uint8_t buf[KVS_MSG_MAX_SIZE];
        size_t len;
        seed_msg((kvs_msg_type_t) t, &m);
        if (kvs_msg_encode(&m, buf, sizeof(buf), &len) != KVS_OK) return 1;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%02d_%s", argv[1], t, kvs_msg_type_str(m.type));
        FILE *f = fopen(path, "wb");
        if (f == NULL || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
            perror(path);
            return 1;
        }
    }
    return 0;
}
#endif
