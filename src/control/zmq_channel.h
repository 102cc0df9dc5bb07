/* The control channel of a net link (internal): one bound PULL socket for everything this rank
 * hears, one connected PUSH socket per peer rank of the other side, a fixed frame header naming
 * the sender, heartbeats and peer liveness. Frames are opaque to the channel beyond the header
 * and heartbeats; nothing it receives is trusted, and no call blocks.
 *
 * Frame (little-endian): kind u8, version u8, sender side u8, zero u8, sender rank u32,
 * sender incarnation u64, sender instance u64, then the payload. The incarnation names one life
 * of a rank (it changes when the process restarts), so frames from an earlier life can be told
 * apart; the instance names the group of ranks the sender belongs to (the ranks of one TP
 * instance share it).
 *
 * Peers are numbered by index. A channel with one peer group (the default) knows one instance
 * of the other side: index = rank. A channel with max_groups > 1 (a prefill rank serving several
 * decode instances) keys its peers by (sender instance, rank): the first frame from an unknown
 * instance takes a free group slot, whose peers are indices [slot * peer_tp, (slot + 1) *
 * peer_tp); the slot's group number (kvs_peer_id) is new for every instance that takes it
 * (until the numbers of a slot wrap, after millions of instances), so a peer id of a closed
 * group never names a later instance's rank, and it is never 0, the number of a one-group
 * channel's only group. The channel's owner closes a group (kvs_zch_close_group) once it is of
 * no more use. */
#ifndef KVSTAGE_CONTROL_ZMQ_CHANNEL_H
#define KVSTAGE_CONTROL_ZMQ_CHANNEL_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/layout.h" /* kvs_side_t */
#include "kvstage/status.h"

#define KVS_ZCH_VERSION      2
#define KVS_ZCH_HEADER_SIZE  24
#define KVS_ZCH_INTERNAL_MAX (64u * 1024u) /* payload bound of a link-internal frame */
#define KVS_ZCH_ENDPOINT_MAX 255           /* bytes of an endpoint string */

typedef enum {
    KVS_ZCH_MSG = 1,        /* a protocol message, at most KVS_MSG_MAX_SIZE bytes */
    KVS_ZCH_HEARTBEAT = 2,  /* handled inside the channel */
    KVS_ZCH_WIREUP_REQ = 3, /* prefill -> decode: send me your data-plane wireup */
    KVS_ZCH_WIREUP = 4,     /* decode -> prefill: worker address, ring, rkey */
} kvs_zch_kind_t;

typedef struct {
    kvs_side_t side;
    uint32_t rank;
    uint32_t peer_tp;    /* ranks of one instance of the other side */
    uint32_t max_groups; /* instances of the other side at once; 0 or 1: one, by rank alone */
    uint64_t instance;   /* this rank's instance, stamped on every frame */
    const char *bind;
    uint64_t heartbeat_ns, liveness_timeout_ns, connect_timeout_ns; /* all > 0 */
} kvs_zch_config_t;

/* One received frame; payload stays valid until the next recv or destroy. */
typedef struct {
    kvs_zch_kind_t kind;
    uint32_t from; /* peer index of the sender */
    uint64_t incarnation;
    const uint8_t *payload;
    size_t len;
} kvs_zch_frame_t;

typedef struct {
    uint64_t sent, received; /* frames of kind MSG */
    uint64_t bytes_sent, bytes_received;
    uint64_t send_failures; /* MSG frames refused */
    uint64_t heartbeats_sent, heartbeats_received;
    uint64_t internal_sent, internal_received; /* WIREUP_REQ and WIREUP frames */
    uint64_t rejected, stale;
    uint64_t dead_peers, restarts;
    uint64_t groups_opened, groups_closed; /* max_groups > 1 */
    uint64_t groups_refused;               /* frames of a new instance while every slot is in use */
} kvs_zch_stats_t;

typedef struct kvs_zch kvs_zch_t;

kvs_status_t kvs_zch_create(const kvs_zch_config_t *config, kvs_zch_t **ch_p);
void kvs_zch_destroy(kvs_zch_t *ch);

/* The bound endpoint with its real port or path. */
const char *kvs_zch_endpoint(const kvs_zch_t *ch);
uint64_t kvs_zch_incarnation(const kvs_zch_t *ch);

/* Peer indices run over [0, kvs_zch_peers()): max_groups (at least 1) x peer_tp. */
uint32_t kvs_zch_peers(const kvs_zch_t *ch);
/* 1 while the group slot of peer index `peer` holds an instance (always, with one group). */
int kvs_zch_peer_open(const kvs_zch_t *ch, uint32_t peer);
/* The peer id (kvs_peer_id: group, rank) of an open peer index. */
uint32_t kvs_zch_peer_id(const kvs_zch_t *ch, uint32_t peer);
/* The index of peer id `id`: KVS_OK, or KVS_ERR_NOT_FOUND when its group is closed (or never
 * was) and KVS_ERR_INVALID for a rank not below peer_tp. */
kvs_status_t kvs_zch_peer_index(const kvs_zch_t *ch, uint32_t id, uint32_t *index_p);
/* Groups open now. */
uint32_t kvs_zch_groups(const kvs_zch_t *ch);
/* Closes the group slot of peer index `peer` (max_groups > 1): its sockets and held frames go,
 * its ids stop resolving, and its slot is free for the next new instance. */
void kvs_zch_close_group(kvs_zch_t *ch, uint32_t peer);

/* How long peer has been silent: since its last frame, or since its endpoint was set when it was
 * never heard. */
uint64_t kvs_zch_peer_silence_ns(const kvs_zch_t *ch, uint32_t peer);
/* The endpoint peer's PUSH socket connects to, or NULL when none is set. */
const char *kvs_zch_peer_endpoint(const kvs_zch_t *ch, uint32_t peer);
/* Connects (or reconnects) the PUSH socket of peer to endpoint; same endpoint: nothing to do. */
kvs_status_t kvs_zch_set_peer(kvs_zch_t *ch, uint32_t peer, const char *endpoint);

/* Protocol frames (KVS_ZCH_MSG) held per peer while its connection comes up. */
#define KVS_ZCH_OUTBOX_MAX 1024

/* Queues one frame without blocking: KVS_ERR_IO when the peer has no endpoint, is not connected
 * or its queue is full (the caller retries what matters), KVS_ERR_INVALID for a bad peer or an
 * oversized payload. A protocol frame refused by a connection that may still be coming up
 * (within the connect timeout of setting the endpoint, the peer not reported dead) is held
 * instead, up to KVS_ZCH_OUTBOX_MAX, and sent by later sends and ticks as soon as it can go:
 * KVS_OK. Frames still held when the peer is reported dead are dropped and count as failed
 * sends. */
kvs_status_t kvs_zch_send(kvs_zch_t *ch, uint32_t peer, kvs_zch_kind_t kind, const void *payload,
                          size_t len);

/* Takes the next valid frame that is not a heartbeat: KVS_OK, or KVS_INPROGRESS when none
 * waits. Malformed, oversized and stale frames are counted and dropped. Every valid frame,
 * heartbeat or not, counts as a sign of life from its sender. */
kvs_status_t kvs_zch_recv(kvs_zch_t *ch, kvs_zch_frame_t *frame_p);

/* For a caller about to sleep: 1 when a frame may be waiting now (take it first); 0 when none
 * is, and then *fd_p becomes readable once one may have come (ZeroMQ's ZMQ_FD: only a wake-up,
 * never to be read; checking ZMQ_EVENTS here re-arms it). */
int kvs_zch_wait_fd(kvs_zch_t *ch, int *fd_p);

/* Sends the heartbeats that are due and updates liveness; returns frames sent. */
uint32_t kvs_zch_tick(kvs_zch_t *ch);

/* KVS_OK while peer is believed alive, KVS_ERR_IO once silent past the liveness timeout (or
 * never heard within the connect timeout), KVS_ERR_INVALID for a bad rank. */
kvs_status_t kvs_zch_peer_status(kvs_zch_t *ch, uint32_t peer);
/* The incarnation last heard from peer (0: never heard). */
uint64_t kvs_zch_peer_incarnation(const kvs_zch_t *ch, uint32_t peer);
/* 1 when the peer's heartbeats announce another endpoint than the configured one, which no
 * heartbeat ever confirmed: a proxy address, or the endpoint of a life that died before it was
 * heard. The channel keeps the configured one; whoever configured it should look it up again
 * (kvs_zch_set_peer with the same endpoint is a no-op and clears the flag). */
int kvs_zch_peer_disputed(const kvs_zch_t *ch, uint32_t peer);

/* For payloads that the channel's user finds malformed. */
void kvs_zch_count_rejected(kvs_zch_t *ch);
void kvs_zch_stats(const kvs_zch_t *ch, kvs_zch_stats_t *stats_p);

#endif
