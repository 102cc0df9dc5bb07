/* The in-process transport: every prefill and decode rank of one deployment lives in this
 * process, control messages are encoded bytes moved between queues, and data writes are
 * memcpy into the decode rings. A seeded adversarial scheduler delays, reorders, duplicates
 * and drops control messages and delays write completion, so tests can drive the protocol
 * through hostile schedules reproducibly. Time is whatever the given clock says. */
#ifndef KVSTAGE_INPROC_H
#define KVSTAGE_INPROC_H

#include <stdint.h>

#include "kvstage/clock.h"
#include "kvstage/link.h"
#include "kvstage/status.h"

typedef struct {
    uint64_t seed;
    uint64_t delay_max_ns;       /* control messages arrive after a uniform delay in [0, max] */
    uint32_t drop_permille;      /* chance that a control message is lost */
    uint32_t dup_permille;       /* chance that a control message is delivered twice */
    uint64_t write_delay_max_ns; /* data writes land (and complete) after up to this */
    /* Exactly one loss, for systematic sweeps: the drop_nth-th (1-based) control message of
     * type drop_type (a kvs_msg_type_t; 0: none) sent since the net was created or its faults
     * were last set is lost, whatever the random mix says. */
    uint32_t drop_type;
    uint64_t drop_nth;
    /* Corruption: after a host data write lands, one random bit of it is flipped, with this
     * chance per write, and always for the corrupt_nth-th (1-based; 0: none) write since the
     * faults were set. Writes into device memory are never corrupted. */
    uint32_t corrupt_permille;
    uint64_t corrupt_nth;
    /* A broken write lands half its bytes (host memory) and completes with KVS_ERR_IO: each
     * data write with this chance, and always the write_fail_nth-th (1-based; 0: none) since
     * the faults were set. */
    uint32_t write_fail_permille;
    uint64_t write_fail_nth;
} kvs_inproc_faults_t;

/* Control message types counted per type in the stats (kvs_msg_type_t values below this). */
#define KVS_INPROC_MSG_TYPES 32

typedef struct kvs_inproc_net kvs_inproc_net_t;

typedef struct {
    uint64_t sent, delivered, dropped, duplicated, in_flight;
    uint64_t writes, write_bytes, writes_in_flight;
    uint64_t host_writes;    /* landed in host memory since the faults were last set */
    uint64_t corrupted;      /* of those, writes with a bit flipped */
    uint64_t write_failures; /* writes failed by the broken-write fault */
    uint64_t sent_by_type[KVS_INPROC_MSG_TYPES]; /* since the faults were last set */
} kvs_inproc_stats_t;

/* faults may be NULL (reliable, immediate). The clock must outlive the net. */
kvs_status_t kvs_inproc_net_create(uint32_t prefill_tp, uint32_t decode_tp,
                                   const kvs_inproc_faults_t *faults, const kvs_clock_t *clock,
                                   kvs_inproc_net_t **net_p);
/* All links must be destroyed first. */
void kvs_inproc_net_destroy(kvs_inproc_net_t *net);
/* Changes the fault mix from now on (e.g. heal the network at the end of a test). */
void kvs_inproc_net_set_faults(kvs_inproc_net_t *net, const kvs_inproc_faults_t *faults);
void kvs_inproc_net_stats(const kvs_inproc_net_t *net, kvs_inproc_stats_t *stats_p);
/* Test hook: with shared set, every prefill link reports each decode peer as sharing its GPU
 * from another process (a sender then holds the room's CHUNK_READYs until the prompt is
 * computed, protocol.md §4.6; in one process that never happens). */
void kvs_inproc_net_set_shared_device(kvs_inproc_net_t *net, int shared);
/* Earliest time at which something queued becomes due (UINT64_MAX when idle). */
uint64_t kvs_inproc_net_next_event(const kvs_inproc_net_t *net);

kvs_status_t kvs_inproc_link_create(kvs_inproc_net_t *net, kvs_side_t side, uint32_t rank,
                                    kvs_link_t **link_p);

#endif
