/* Control-plane messages (protocol.md §5) and their codec. The codec is a pair of pure
 * functions: encode writes a fixed binary header and explicit little-endian fields; decode
 * checks every length and range and returns KVS_ERR_PROTOCOL for anything that does not fit.
 *
 * Wire format: header (12 bytes) = magic u32 "KVS1" (0x3153564b as LE u32), version u16,
 * type u16, payload length u32; then the payload of that type (fields below, in order). */
#ifndef KVSTAGE_MSG_H
#define KVSTAGE_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/layout.h"
#include "kvstage/status.h"

#define KVS_MSG_MAGIC 0x3153564bu
/* 2: CHUNK_READY checksum, the registration's checksum setting; 3: the registration's decode
 * page size (a page size per side); 4: its pipeline stages (rank: stage * TP + TP rank); 5: the
 * decode DCP size and interleave it expects */
#define KVS_MSG_VERSION      5
#define KVS_MSG_HEADER_SIZE  12
#define KVS_MSG_MAX_SIZE     1024 /* no valid message is larger */
#define KVS_MSG_FINAL_MAX    192  /* bytes of final metadata (the first token and its logprobs) */
#define KVS_MSG_ENDPOINT_MAX 128  /* bytes of an endpoint string, without terminator */

typedef enum {
    KVS_MSG_ROOM_META = 1,       /* decode -> prefill: a room's geometry */
    KVS_MSG_STAGING_REQ = 2,     /* prefill -> decode: ask for a chunk's slot */
    KVS_MSG_STAGING_GRANT = 3,   /* decode -> prefill: the granted slot (resent until confirmed) */
    KVS_MSG_CHUNK_READY = 4,     /* prefill -> decode: a writer's region is written */
    KVS_MSG_STATUS = 5,          /* prefill -> decode: the rank's outcome for the room */
    KVS_MSG_ABORT = 6,           /* decode -> prefill: stop writing for this room */
    KVS_MSG_ABORT_ACK = 7,       /* prefill -> decode: no write for the room is in flight */
    KVS_MSG_ACK = 8,             /* receipt of ROOM_META, STAGING_GRANT, CHUNK_READY or STATUS */
    KVS_MSG_REGISTER = 9,        /* prefill rank -> bootstrap registry */
    KVS_MSG_QUERY = 10,          /* decode rank -> registry: describe prefill rank `rank` */
    KVS_MSG_QUERY_REPLY = 11,    /* registry -> decode: a registration (or not found) */
    KVS_MSG_HEARTBEAT = 12,      /* any rank -> peer: liveness */
    KVS_MSG_STAGING_QUEUED = 13, /* decode -> prefill: the request waits behind a full ring */
} kvs_msg_type_t;

/* Status values of protocol.md §6, in order; Failed is sticky. */
typedef enum {
    KVS_ROOM_FAILED = 0,
    KVS_ROOM_BOOTSTRAPPING = 1,
    KVS_ROOM_WAITING = 2, /* WaitingForInput */
    KVS_ROOM_TRANSFERRING = 3,
    KVS_ROOM_SUCCESS = 4,
} kvs_room_status_t;

const char *kvs_room_status_str(kvs_room_status_t status);

typedef struct {
    uint64_t room;
    uint32_t decode_rank;
    uint32_t decode_tp;
    uint64_t base;        /* decode prefix, tokens (multiple of the page size) */
    uint64_t prompt_len;  /* tokens */
    uint64_t total_pages; /* ceil((prompt_len - base) / P) */
    uint64_t grid_tokens; /* G: tokens per slot */
} kvs_msg_room_meta_t;

typedef struct {
    uint64_t room;
    uint32_t chunk;
    uint32_t prefill_rank;
    uint32_t decode_rank;
    uint64_t slot_bytes; /* the sender's view of the slot size; decode checks it */
} kvs_msg_staging_req_t;

typedef struct {
    uint64_t room;
    uint32_t chunk;
    uint32_t decode_rank;
    uint64_t offset; /* byte offset of the slot in the decode ring */
    uint64_t size;   /* bytes granted; writes never exceed it */
} kvs_msg_staging_grant_t;

/* The answer to a STAGING_REQ that cannot be granted yet: the writer stops resending it. */
typedef struct {
    uint64_t room;
    uint32_t chunk;
    uint32_t decode_rank;
    uint32_t queued; /* requests waiting in the decode rank's ring queue, this one included */
} kvs_msg_staging_queued_t;

typedef struct {
    uint64_t room;
    uint32_t chunk;
    uint32_t prefill_rank;
    uint32_t decode_rank;
    uint32_t writer; /* index in decode rank's writer list */
    uint64_t suffix_page_start;
    uint32_t pages;
    uint64_t bytes;    /* bytes this writer wrote */
    uint64_t checksum; /* of the region as written (protocol.md §5.5); 0 with checksums off */
} kvs_msg_chunk_ready_t;

typedef struct {
    uint64_t room;
    uint32_t prefill_rank;
    uint32_t decode_rank;
    int32_t status;     /* kvs_room_status_t: SUCCESS or FAILED */
    int32_t reason;     /* kvs_status_t explaining a failure, KVS_OK otherwise */
    uint32_t final_len; /* <= KVS_MSG_FINAL_MAX */
    uint8_t final[KVS_MSG_FINAL_MAX];
} kvs_msg_status_t;

typedef struct {
    uint64_t room;
    uint32_t from_rank; /* decode rank for ABORT, prefill rank for ABORT_ACK */
    uint32_t to_rank;
    int32_t reason; /* kvs_status_t */
} kvs_msg_abort_t;

typedef struct {
    uint64_t room;
    uint16_t acked_type; /* ROOM_META, STAGING_GRANT, CHUNK_READY or STATUS */
    uint32_t chunk;      /* STAGING_GRANT, CHUNK_READY: the chunk; otherwise 0 */
    uint32_t writer;     /* CHUNK_READY: the writer; otherwise 0 */
    uint32_t from_rank;  /* who acknowledges */
    uint32_t to_rank;
} kvs_msg_ack_t;

typedef struct {
    uint32_t rank; /* stage * tp_size + TP rank, below tp_size * pp_size */
    uint32_t tp_size;
    uint32_t pp_size;          /* pipeline stages of the prefill instance */
    kvs_kv_shape_t shape;      /* the whole model's (every stage registers the same) */
    uint32_t page_size;        /* the registering prefill rank's pool pages */
    uint32_t decode_page_size; /* the decode page size that rank's geometry expects */
    uint32_t decode_dcp;       /* the decode DCP group size it expects (1: none) */
    uint32_t dcp_interleave;   /* and the DCP interleave (1 without DCP) */
    uint32_t chunk_tokens;
    uint32_t checksum;    /* 1: chunk checksums on (the default), 0: off */
    uint64_t layout_hash; /* hash of pool layout details both sides must agree on */
    uint32_t endpoint_len;
    char endpoint[KVS_MSG_ENDPOINT_MAX + 1]; /* NUL-terminated after decode */
} kvs_msg_register_t;

typedef struct {
    uint32_t rank; /* QUERY: which prefill rank */
    int32_t found; /* QUERY_REPLY: 1 if reg is valid */
    kvs_msg_register_t reg;
} kvs_msg_query_t;

typedef struct {
    uint32_t side; /* 0 prefill, 1 decode */
    uint32_t rank;
    uint64_t seq;
} kvs_msg_heartbeat_t;

typedef struct {
    kvs_msg_type_t type;
    union {
        kvs_msg_room_meta_t room_meta;
        kvs_msg_staging_req_t staging_req;
        kvs_msg_staging_grant_t staging_grant;
        kvs_msg_staging_queued_t staging_queued;
        kvs_msg_chunk_ready_t chunk_ready;
        kvs_msg_status_t status;
        kvs_msg_abort_t abort; /* ABORT and ABORT_ACK */
        kvs_msg_ack_t ack;
        kvs_msg_register_t reg;
        kvs_msg_query_t query; /* QUERY and QUERY_REPLY */
        kvs_msg_heartbeat_t heartbeat;
    } u;
} kvs_msg_t;

/* Encodes msg into buf (capacity cap); KVS_ERR_INVALID if a field is out of range,
 * KVS_ERR_NOSPACE if cap is too small. *len_p receives the encoded size. */
kvs_status_t kvs_msg_encode(const kvs_msg_t *msg, uint8_t *buf, size_t cap, size_t *len_p);

/* Decodes exactly len bytes into *msg_p; KVS_ERR_PROTOCOL (with a debug log naming the
 * problem) for a bad magic, version, type, length, truncation, trailing bytes or a field out of
 * range. Never reads outside [buf, buf + len). */
kvs_status_t kvs_msg_decode(const uint8_t *buf, size_t len, kvs_msg_t *msg_p);

/* The type of an encoded message, from its header alone (sizes, magic, version, a known type,
 * the declared length; the payload is not looked at): KVS_ERR_PROTOCOL where the header is bad.
 * For links that sort or count messages without decoding them. */
kvs_status_t kvs_msg_peek_type(const uint8_t *buf, size_t len, kvs_msg_type_t *type_p);

const char *kvs_msg_type_str(kvs_msg_type_t type);

#endif
