/* The prefill/decode handoff protocol (protocol.md §3 and §4) as an engine sees it.
 *
 * Each prefill rank owns a kvs_sender_t and each decode rank a kvs_receiver_t. Both are
 * progress-driven: nothing happens between calls; the caller drives kvs_*_progress() (from its
 * scheduler loop or a helper thread). Rooms are identified by a 64-bit id chosen by the router.
 *
 * Engine flow, prefill rank:  add_room -> advance(computed, scheduled)... -> finish(final meta)
 *   -> poll until Success/Failed and quiescent -> release (then free pages and radix locks).
 * Engine flow, decode rank:   add_room(base, delta pages) -> poll until Success/Failed and
 *   quiescent -> release (on Failed, free the delta pages only then). The engine reports a
 *   room's status after all decode TP ranks agree (the MIN of their statuses). */
#ifndef KVSTAGE_PD_H
#define KVSTAGE_PD_H

#include <stdint.h>

#include "kvstage/clock.h"
#include "kvstage/layout.h"
#include "kvstage/link.h"
#include "kvstage/msg.h"
#include "kvstage/pool.h"
#include "kvstage/status.h"

typedef struct {
    uint64_t retry_ns;              /* resend an unacknowledged control message after this */
    uint64_t bootstrap_timeout_ns;  /* prefill: room added -> metadata from every decode peer */
    uint64_t transfer_timeout_ns;   /* prefill: no progress on a started room for this long */
    uint64_t waiting_timeout_ns;    /* decode: metadata sent -> Success */
    uint64_t completion_timeout_ns; /* decode: every writer reported Success -> scatters done */
    uint64_t release_timeout_ns;    /* after a failure: quarantine ends without ABORT_ACK */
} kvs_pd_timeouts_t;

/* Defaults for real deployments (seconds); simulations scale them to their virtual time. */
void kvs_pd_timeouts_default(kvs_pd_timeouts_t *timeouts_p);
/* Sets every zero field of *timeouts to the matching field of *defaults. */
void kvs_pd_timeouts_fill(kvs_pd_timeouts_t *timeouts, const kvs_pd_timeouts_t *defaults);

typedef struct {
    kvs_room_status_t status;
    kvs_status_t reason; /* why it failed; KVS_OK otherwise */
    int quiescent;       /* no write or scatter can still touch the room's pages or slots */
    uint32_t final_len;  /* decode: final metadata from prefill (e.g. first token) */
    uint8_t final[KVS_MSG_FINAL_MAX];
} kvs_room_info_t;

/* Counters a rank keeps (monotonic unless noted). */
typedef struct {
    uint64_t rooms_added, rooms_succeeded, rooms_failed;
    uint64_t live_rooms;    /* now */
    uint64_t stashed_rooms; /* sender, now: metadata or aborts kept for rooms the engine has not
                               added (or already released); each expires after the bootstrap
                               timeout */
    uint64_t chunks;        /* sender: (chunk, destination) writes acknowledged;
                               receiver: chunks scattered */
    uint64_t bulk_writes;   /* transport writes issued (sender), direct writes included */
    uint64_t direct_writes; /* sender: of bulk_writes, gathered straight into the remote slot */
    uint64_t bytes;         /* payload bytes written (sender) / scattered (receiver) */
    uint64_t msgs_sent, msgs_received;
    uint64_t retries;         /* control messages resent on a timer */
    uint64_t rejected;        /* messages that failed to decode or validate */
    uint64_t ignored;         /* late, duplicate or unknown-room messages */
    uint64_t ring_capacity;   /* receiver */
    uint64_t ring_used;       /* receiver, now */
    uint64_t ring_high_water; /* receiver */
    uint64_t live_slots;      /* receiver: granted slots not yet freed, now */
    uint64_t progress_ns;     /* real time spent inside progress calls */
    uint64_t data_ns;         /* of which: gather, scatter and transport write calls */
} kvs_pd_metrics_t;

/* ---- prefill side ---- */

typedef struct kvs_sender kvs_sender_t;

/* How a sender moves a chunk's head slice into the granted slot. Staging buffers, the decode
 * ring and the copy backends live in the memory kind of each rank's pool (host: CPU memcpy;
 * device: the CUDA kernels on the pool's GPU). */
typedef enum {
    KVS_WRITE_AUTO = 0,   /* direct where the link maps the destination ring, else staged */
    KVS_WRITE_STAGED = 1, /* gather into a staging buffer, then one transport write */
    KVS_WRITE_DIRECT = 2, /* the gather kernel stores straight into the granted remote slot;
                             needs a device pool and a link that maps the ring, else the room
                             fails with KVS_ERR_UNSUPPORTED */
} kvs_write_mode_t;

typedef struct {
    kvs_pd_geometry_t geo;
    uint32_t rank; /* this prefill rank */
    kvs_pd_timeouts_t timeouts;
    uint32_t window_chunks;   /* most chunks per room with an allocation outstanding (>= 1) */
    uint32_t staging_buffers; /* gather buffers per rank (>= 1; unused in direct mode) */
    kvs_write_mode_t write_mode;
} kvs_sender_config_t;

/* pool: this rank's KV pool (geometry must match); link: this rank's prefill link. Both must
 * outlive the sender. The clock is copied. */
kvs_status_t kvs_sender_create(const kvs_sender_config_t *config, kvs_pool_t *pool,
                               kvs_link_t *link, const kvs_clock_t *clock, kvs_sender_t **sender_p);
/* Frees everything, including rooms still live (their writes are waited for first). */
void kvs_sender_destroy(kvs_sender_t *sender);

/* page_table: the engine's page ids for tokens [0, prompt_len), ceil(prompt_len / P) entries,
 * owned by the engine and kept valid until release; an entry must be set before advance()
 * reports its tokens as computed or scheduled. */
kvs_status_t kvs_sender_add_room(kvs_sender_t *sender, uint64_t room, uint64_t prompt_len,
                                 const uint32_t *page_table);
/* KV for [0, computed) is at rest; the forward pass now running covers up to scheduled
 * (>= computed). Monotonic. Sends [sent, floor_to_grid(computed)) as soon as bootstrapped. */
kvs_status_t kvs_sender_advance(kvs_sender_t *sender, uint64_t room, uint64_t computed,
                                uint64_t scheduled);
/* The whole prompt is computed; final metadata (<= KVS_MSG_FINAL_MAX bytes) rides with the last
 * send. */
kvs_status_t kvs_sender_finish(kvs_sender_t *sender, uint64_t room, const void *final_meta,
                               uint32_t final_len);
kvs_status_t kvs_sender_abort(kvs_sender_t *sender, uint64_t room);
kvs_status_t kvs_sender_poll(kvs_sender_t *sender, uint64_t room, kvs_room_info_t *info_p);
/* Drops a concluded, quiescent room (KVS_ERR_STATE otherwise). Idempotent: releasing an unknown
 * room returns KVS_ERR_NOT_FOUND and changes nothing. */
kvs_status_t kvs_sender_release(kvs_sender_t *sender, uint64_t room);
/* Handles messages, timers and completions; returns how many events it processed. */
uint32_t kvs_sender_progress(kvs_sender_t *sender);
void kvs_sender_metrics(const kvs_sender_t *sender, kvs_pd_metrics_t *metrics_p);

/* ---- decode side ---- */

typedef struct kvs_receiver kvs_receiver_t;

typedef struct {
    kvs_pd_geometry_t geo;
    uint32_t rank; /* this decode rank */
    kvs_pd_timeouts_t timeouts;
    uint64_t ring_bytes; /* staging ring capacity */
} kvs_receiver_config_t;

kvs_status_t kvs_receiver_create(const kvs_receiver_config_t *config, kvs_pool_t *pool,
                                 kvs_link_t *link, const kvs_clock_t *clock,
                                 kvs_receiver_t **receiver_p);
void kvs_receiver_destroy(kvs_receiver_t *receiver);

/* base: tokens already held (decode radix hit), a multiple of P, else the room fails (the call
 * returns KVS_OK and poll reports Failed with KVS_ERR_INVALID). delta_pages: page ids for
 * [base, prompt_len), ceil((prompt_len - base) / P) entries, owned by the engine and kept valid
 * until release. Registers the room, then sends metadata to every prefill peer. */
kvs_status_t kvs_receiver_add_room(kvs_receiver_t *receiver, uint64_t room, uint64_t base,
                                   uint64_t prompt_len, const uint32_t *delta_pages);
kvs_status_t kvs_receiver_abort(kvs_receiver_t *receiver, uint64_t room);
kvs_status_t kvs_receiver_poll(kvs_receiver_t *receiver, uint64_t room, kvs_room_info_t *info_p);
kvs_status_t kvs_receiver_release(kvs_receiver_t *receiver, uint64_t room);
uint32_t kvs_receiver_progress(kvs_receiver_t *receiver);
void kvs_receiver_metrics(const kvs_receiver_t *receiver, kvs_pd_metrics_t *metrics_p);

#endif
