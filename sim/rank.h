/* One prefill or decode rank as its own process: its KV pool, its sender or receiver, a net
 * link (ZeroMQ control + UCX data), bootstrap through the registry, and the synthetic engine of
 * the simulation driving the seeded workload — every rank of an instance runs the same
 * schedule, as TP ranks of a real engine do. Decode ranks verify every position of every room
 * they receive. `kvstage prefill`, `kvstage decode` and the multi-process `kvstage demo` are
 * thin wrappers around kvs_rank_run(). */
#ifndef KVSTAGE_RANK_H
#define KVSTAGE_RANK_H

#include <stdint.h>

#include "kvstage/link.h"
#include "kvstage/mem.h"
#include "kvstage/net.h"
#include "kvstage/pd.h"
#include "sim/sim.h"
#include "kvstage/status.h"

typedef struct {
    kvs_side_t side;
    uint32_t rank;
    kvs_pd_geometry_t geo;
    kvs_pool_layout_t layout;
    const char *registry; /* the prefill instance's registry endpoint */
    int serve_registry;   /* prefill rank 0: bind `registry` and serve it from this process */
    const char *bind;     /* this rank's control endpoint (default tcp://127.0.0.1:*) */
    kvs_net_data_t data;
    const char *net_device;
    kvs_mem_kind_t mem; /* the pool, ring and staging buffers: host, or GPU `device` (then the
                           data plane between processes is CUDA IPC) */
    int device;
    kvs_write_mode_t write_mode;    /* prefill: staged, direct, or auto (direct where mapped) */
    kvs_workload_config_t workload; /* identical on every rank of both instances */
    uint32_t concurrency;           /* rooms in flight on this rank */
    uint64_t ring_bytes;            /* decode: 0 = four full slots */
    kvs_pd_timeouts_t timeouts;     /* zero fields: defaults scaled for a local demo */
    uint64_t liveness_timeout_ns;   /* 0: the link's default */
    uint64_t corrupt_nth;           /* prefill test hook: corrupt this write (kvstage/net.h) */
    uint64_t deadline_ns;           /* give up after this much real time (0: 10 minutes) */
    uint64_t drain_ns;              /* keep answering peers this long after the last room */
    /* Called about every 100 ms and at the end, with this rank's counts so far. */
    void (*progress)(void *arg, uint32_t concluded, uint32_t requests);
    void *progress_arg;
    /* Metrics on request: while *metrics_request is non-zero (e.g. set by a SIGUSR1 handler),
     * the runner clears it and calls metrics() with this rank's counters. */
    volatile int *metrics_request;
    void (*metrics)(void *arg, const kvs_pd_metrics_t *pd, const kvs_net_stats_t *net);
} kvs_rank_config_t;

typedef struct {
    uint32_t requests, succeeded, failed;
    uint32_t fail_reasons[16]; /* by -reason (KVS_ERR_*) */
    uint64_t mismatched_bytes; /* decode: bytes that differ from the prefill KV */
    uint32_t meta_mismatches;  /* decode: wrong final metadata */
    uint64_t leaked_pages, leaked_slots, leaked_rooms;
    kvs_pd_metrics_t metrics; /* of this rank's sender or receiver */
    kvs_net_stats_t net;
    int timed_out; /* the deadline passed before every room concluded */
    double wall_s;
} kvs_rank_result_t;

/* KVS_ERR_INVALID (logged as "who: ...", with what is needed and what was given) for a
 * deployment that can never serve its workload: an invalid geometry, or a decode staging ring
 * (ring_bytes, when set) smaller than one slot of the longest prompt. Every rank checks it at
 * startup, prefill ranks included (they share the flags), so a whole deployment refuses at once
 * instead of some ranks waiting on peers that refused; `kvstage demo` checks it before starting
 * any process. */
kvs_status_t kvs_rank_check(const kvs_rank_config_t *config, const char *who);

/* Runs the rank until every request of the workload concluded on it (then drains). KVS_OK when
 * it ran (the verdict is in the result); an error when it could not start (bad configuration,
 * see kvs_rank_check; bootstrap failure, incompatible peer). */
kvs_status_t kvs_rank_run(const kvs_rank_config_t *config, kvs_rank_result_t *result_p);

#endif
