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

#include <stddef.h>
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
    kvs_status_t reason; /* why it failed (on prefill, a decode ABORT's own reason); KVS_OK
                          * otherwise */
    int quiescent;       /* no write or scatter can still touch the room's pages or slots */
    uint32_t final_len;  /* decode: final metadata from prefill (e.g. first token) */
    uint8_t final[KVS_MSG_FINAL_MAX];
} kvs_room_info_t;

/* The counters a rank keeps: one row per kvs_pd_metrics_t field, from which the struct and
 * every output of it (JSON, text and Prometheus) are made, so that a field is named once.
 *   X(field, kind, json, line, text, prom, prom_at, help)
 *   field    the member (a uint64_t); the comment beside the row says what it counts
 *   kind     COUNTER (monotonic) or GAUGE (a value now, or a size or peak)
 *   json     its key in the tools' JSON results (`kvstage prefill|decode --json`)
 *   line     its key in rank 0's stats line (engine/rank_line.h)
 *   text     the words before its value in a rank's text stats line (`kill -USR1`), the
 *            separator from the field before included
 *   prom     its Prometheus metric (the server's /metrics), prom_at its place among them
 *            (from 1), help the metric's HELP
 * NULL (prom_at 0): not in that output. The JSON and text outputs follow the rows' order, so a
 * row moves only with its outputs' bytes in mind. */
#define KVS_PD_METRICS(X)                                                                          \
    X(rooms_added, COUNTER, NULL, NULL, "rooms added ", NULL, 0, NULL)                             \
    X(rooms_succeeded, COUNTER, NULL, "rooms_succeeded", " succeeded ", NULL, 0, NULL)             \
    X(rooms_failed, COUNTER, NULL, "rooms_failed", " failed ", NULL, 0, NULL)                      \
    /* now: rooms added and not released */                                                        \
    X(live_rooms, GAUGE, NULL, "live_rooms", " live ", "kvstage_rooms_live", 8,                    \
      "Rooms added to kvstage and not released (summed over the instance's ranks).")               \
    /* now: of live_rooms, failed rooms whose slots and pages wait for the peers to confirm        \
     * that nothing can still write them (protocol.md's quarantine) */                             \
    X(quarantined_rooms, GAUGE, NULL, "quarantined_rooms", NULL, "kvstage_rooms_quarantined", 9,   \
      "Failed rooms held in quarantine (summed over the instance's ranks).")                       \
    /* sender, now: metadata or aborts kept for rooms the engine has not added (or already         \
     * released); each expires after the bootstrap timeout */                                      \
    X(stashed_rooms, GAUGE, NULL, "stashed_rooms", NULL, "kvstage_rooms_stashed", 10,              \
      "Messages kept for rooms the engine has not added yet (summed over the ranks).")             \
    /* sender: (chunk, destination) writes acknowledged; receiver: chunks scattered */             \
    X(chunks, COUNTER, "chunks", "chunks", "; chunks ", "kvstage_kv_chunks_total", 2,              \
      "KV chunks moved (backend).")                                                                \
    /* transport writes issued (sender), direct writes included */                                 \
    X(bulk_writes, COUNTER, "bulk_writes", "bulk_writes", "; bulk writes ", NULL, 0, NULL)         \
    /* sender: of bulk_writes, gathered straight into the remote slot */                           \
    X(direct_writes, COUNTER, "direct_writes", "direct_writes", NULL, NULL, 0, NULL)               \
    /* payload bytes written (sender) / scattered (receiver) */                                    \
    X(bytes, COUNTER, "bytes_moved", "bytes_moved", "; bytes ", "kvstage_kv_bytes_total", 1,       \
      "KV bytes moved (backend).")                                                                 \
    X(msgs_sent, COUNTER, "control_messages", "control_messages", "; messages sent ", NULL, 0,     \
      NULL)                                                                                        \
    X(msgs_received, COUNTER, NULL, NULL, " received ", NULL, 0, NULL)                             \
    /* control messages resent on a timer */                                                       \
    X(retries, COUNTER, "retries", "retries", "; retries ", "kvstage_control_retries_total", 3,    \
      "Control messages resent (backend).")                                                        \
    /* messages that failed to decode or validate */                                               \
    X(rejected, COUNTER, "rejected_messages", "rejected", "; rejected ",                           \
      "kvstage_control_rejected_total", 4, "Control messages rejected (backend).")                 \
    /* late, duplicate or unknown-room messages */                                                 \
    X(ignored, COUNTER, "ignored_messages", NULL, "; ignored ", NULL, 0, NULL)                     \
    /* receiver, now */                                                                            \
    X(ring_used, GAUGE, NULL, "ring_used", "; ring used ", "kvstage_ring_used_bytes", 5,           \
      "Staging ring bytes in use.")                                                                \
    /* receiver */                                                                                 \
    X(ring_capacity, GAUGE, NULL, "ring_capacity", " of ", "kvstage_ring_capacity_bytes", 6,       \
      "Staging ring bytes.")                                                                       \
    /* receiver */                                                                                 \
    X(ring_high_water, GAUGE, "ring_high_water", NULL, " (high water ", NULL, 0, NULL)             \
    /* receiver: granted slots not yet freed, now */                                               \
    X(live_slots, GAUGE, NULL, NULL, "), live slots ", NULL, 0, NULL)                              \
    /* real time spent inside progress calls */                                                    \
    X(progress_ns, COUNTER, NULL, NULL, NULL, NULL, 0, NULL)                                       \
    /* of which: gather, scatter and transport write calls */                                      \
    X(data_ns, COUNTER, NULL, NULL, NULL, NULL, 0, NULL)                                           \
    /* receiver: writer regions whose bytes in the ring failed their checksum */                   \
    X(checksum_failures, COUNTER, "checksum_failures", "checksum_failures", NULL,                  \
      "kvstage_kv_checksum_failures_total", 7, "KV regions that failed their checksum (backend).") \
    /* decode with per-room bootstrap, now: prefill instances wired (a link and a receiver each)   \
     */                                                                                            \
    X(peer_instances, GAUGE, NULL, "peer_instances", NULL, "kvstage_peer_instances", 11,           \
      "Prefill instances a decode instance is wired to (summed over its ranks).")

typedef struct {
#define KVS_PD_METRIC_MEMBER_(field, ...) uint64_t field;
    KVS_PD_METRICS(KVS_PD_METRIC_MEMBER_)
#undef KVS_PD_METRIC_MEMBER_
} kvs_pd_metrics_t;

typedef enum { KVS_PD_COUNTER = 0, KVS_PD_GAUGE = 1 } kvs_pd_metric_kind_t;

/* One row of KVS_PD_METRICS. */
typedef struct {
    const char *field; /* the member's name */
    size_t offset;     /* of the uint64_t in kvs_pd_metrics_t */
    kvs_pd_metric_kind_t kind;
    const char *json, *line, *text, *prom; /* NULL: not in that output */
    uint32_t prom_at;                      /* 0: not exported */
    const char *help;
} kvs_pd_metric_field_t;

/* The table, in the struct's order; *count_p: its rows. */
const kvs_pd_metric_field_t *kvs_pd_metrics_fields(uint32_t *count_p);
/* The value of one field of *metrics. */
uint64_t kvs_pd_metrics_get(const kvs_pd_metrics_t *metrics, const kvs_pd_metric_field_t *field);
void kvs_pd_metrics_set(kvs_pd_metrics_t *metrics, const kvs_pd_metric_field_t *field,
                        uint64_t value);
/* Adds every field of *src to *dst: counters sum, and so do gauges (an instance's ring is its
 * ranks' rings together). */
void kvs_pd_metrics_add(kvs_pd_metrics_t *dst, const kvs_pd_metrics_t *src);

/* ---- prefill side ---- */

typedef struct kvs_sender kvs_sender_t;

/* How a sender moves a chunk's head slice into the granted slot. Staging buffers, the decode
 * ring and the copy backends live in the memory kind of each rank's pool (host: CPU memcpy;
 * device: the CUDA kernels on the pool's GPU). */
typedef enum {
    KVS_WRITE_AUTO = 0,   /* direct where the link maps the destination ring, else staged */
    KVS_WRITE_STAGED = 1, /* gather into a staging buffer, then one transport write */
    KVS_WRITE_DIRECT = 2, /* the gather stores straight into the granted remote slot; needs a
                             link that maps the ring into this pool's memory kind (the net link:
                             UCX shared memory for host pools, CUDA IPC for device pools; the
                             in-process link: device rings only), else the room fails with
                             KVS_ERR_UNSUPPORTED */
} kvs_write_mode_t;

typedef struct {
    kvs_pd_geometry_t geo;
    uint32_t rank; /* this prefill rank: stage * prefill TP + TP rank */
    kvs_pd_timeouts_t timeouts;
    uint32_t window_chunks;   /* most chunks per room with an allocation outstanding (>= 1) */
    uint32_t staging_buffers; /* gather buffers per rank (>= 1; unused in direct mode) */
    kvs_write_mode_t write_mode;
} kvs_sender_config_t;

/* pool: this rank's KV pool (geometry must match: the prefill page size, this TP rank's heads
 * of its stage's layers); link: this rank's prefill link. Both must outlive the sender. The
 * clock is copied. */
kvs_status_t kvs_sender_create(const kvs_sender_config_t *config, kvs_pool_t *pool,
                               kvs_link_t *link, const kvs_clock_t *clock, kvs_sender_t **sender_p);
/* Frees everything, including rooms still live (their writes are waited for first). */
void kvs_sender_destroy(kvs_sender_t *sender);

/* page_table: the engine's page ids for tokens [0, prompt_len), ceil(prompt_len / Pp) entries,
 * owned by the engine and kept valid until release; an entry must be set before advance()
 * reports its tokens as computed or scheduled. */
kvs_status_t kvs_sender_add_room(kvs_sender_t *sender, uint64_t room, uint64_t prompt_len,
                                 const uint32_t *page_table);
/* KV for [0, computed) is at rest; the forward pass now running covers up to scheduled
 * (>= computed). Monotonic. Sends [sent, floor_to_grid(computed)) as soon as bootstrapped.
 * With pipeline stages both are this rank's stage's: its layers of those tokens. */
kvs_status_t kvs_sender_advance(kvs_sender_t *sender, uint64_t room, uint64_t computed,
                                uint64_t scheduled);
/* The whole prompt is computed; final metadata (<= KVS_MSG_FINAL_MAX bytes) rides with the last
 * send. */
kvs_status_t kvs_sender_finish(kvs_sender_t *sender, uint64_t room, const void *final_meta,
                               uint32_t final_len);
kvs_status_t kvs_sender_abort(kvs_sender_t *sender, uint64_t room);
/* 1 when decode has spoken of the room: a ROOM_META or ABORT of it came (stashed, for a room
 * not added yet), the room has concluded, or this rank has no decode peer to wait for; 0
 * otherwise. A room decode has spoken of concludes without waiting on decode's admission: an
 * engine short of pages may start those first, and count the pages of rooms it added before
 * decode spoke as lent until this turns 1. */
int kvs_sender_heard(const kvs_sender_t *sender, uint64_t room);
kvs_status_t kvs_sender_poll(kvs_sender_t *sender, uint64_t room, kvs_room_info_t *info_p);
/* Drops a concluded, quiescent room (KVS_ERR_STATE otherwise). Idempotent: releasing an unknown
 * room returns KVS_ERR_NOT_FOUND and changes nothing. */
kvs_status_t kvs_sender_release(kvs_sender_t *sender, uint64_t room);
/* Handles messages, timers and completions; returns how many events it processed. */
uint32_t kvs_sender_progress(kvs_sender_t *sender);
/* Writes started and not yet seen complete. Their completions wake no wait (kvs_net_link_wait
 * watches control messages only), so a loop that sleeps between progress calls polls instead
 * while this is nonzero: each such sleep was part of a handoff's latency. */
uint32_t kvs_sender_copies_in_flight(const kvs_sender_t *sender);
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

/* base: tokens already held (decode radix hit), a multiple of P (of N x P under DCP:
 * kvs_pd_geometry_unit), else the room fails (the call returns KVS_OK and poll reports Failed
 * with KVS_ERR_INVALID). delta_pages: page ids for [base, prompt_len), ceil((prompt_len - base)
 * / P) entries (under DCP this rank's tokens of it from its local position base / N:
 * kvs_grid_rank_total_pages entries, at most ceil((prompt_len - base) / (N x P)), so a pool's
 * page of N x P tokens suits every rank), owned by the engine and kept valid until release.
 * Registers the room, then sends metadata to every prefill peer. */
kvs_status_t kvs_receiver_add_room(kvs_receiver_t *receiver, uint64_t room, uint64_t base,
                                   uint64_t prompt_len, const uint32_t *delta_pages);
kvs_status_t kvs_receiver_abort(kvs_receiver_t *receiver, uint64_t room);
kvs_status_t kvs_receiver_poll(kvs_receiver_t *receiver, uint64_t room, kvs_room_info_t *info_p);
kvs_status_t kvs_receiver_release(kvs_receiver_t *receiver, uint64_t room);
uint32_t kvs_receiver_progress(kvs_receiver_t *receiver);
/* Chunks whose scatter started and was not yet seen done (see kvs_sender_copies_in_flight). */
uint32_t kvs_receiver_copies_in_flight(const kvs_receiver_t *receiver);
void kvs_receiver_metrics(const kvs_receiver_t *receiver, kvs_pd_metrics_t *metrics_p);

#endif
