/* The kvstage plumbing of one prefill or decode rank running as its own process (internal to
 * libkvstage, used by the in-tree rank runners): the net link, the bootstrap registry (served,
 * registered with, or queried), and the rank's sender or receiver. The synthetic rank runner
 * (sim/rank.c) and the real-model one (serve/engine/llm_rank.c) set it up and tear it down
 * through here, so both bootstrap the same way. */
#ifndef KVSTAGE_PD_PLUMBING_H
#define KVSTAGE_PD_PLUMBING_H

#include <stdint.h>

#include "kvstage/link.h"
#include "kvstage/mem.h"
#include "kvstage/net.h"
#include "kvstage/pd.h"
#include "kvstage/pool.h"
#include "kvstage/registry.h"

typedef struct {
    kvs_side_t side;
    uint32_t rank; /* on its side */
    kvs_pd_geometry_t geo;
    const char *registry; /* the prefill instance's registry endpoint */
    /* Bind `registry` and serve it from this process; a prefill rank then adds itself to it
     * instead of registering over the wire. */
    int serve_registry;
    /* With serve_registry on a prefill rank: answer the registry (and progress the link) until
     * every prefill rank registered, so that those blocked registering get on with their setup
     * before this rank goes on to work that does not serve it. */
    int await_registrations;
    const char *bind; /* this rank's control endpoint (NULL: tcp://127.0.0.1:*) */
    kvs_net_data_t data;
    const char *net_device;
    kvs_mem_kind_t mem; /* where the pool lives (the ring or staging buffers too) */
    int device;
    uint64_t liveness_timeout_ns; /* 0: the link's default */
    uint64_t corrupt_nth;         /* prefill test hook: kvs_net_config_t.corrupt_nth */
    kvs_pd_timeouts_t timeouts;   /* zero fields: defaults scaled for processes on one host */
    kvs_write_mode_t write_mode;  /* prefill */
    uint64_t ring_bytes;          /* decode: 0 = four full slots */
} kvs_plumbing_config_t;

typedef struct {
    kvs_registry_t *registry; /* served by this process, or NULL */
    kvs_link_t *link;
    kvs_sender_t *sender;     /* prefill, else NULL */
    kvs_receiver_t *receiver; /* decode, else NULL */
    uint32_t peers;           /* ranks of the other side */
} kvs_plumbing_t;

/* Creates the link, bootstraps through the registry (prefill: registers this rank's endpoint;
 * decode: learns every prefill rank's endpoint, refusing an incompatible instance) and creates
 * the sender or receiver on pool, which must outlive the plumbing. On failure nothing is left
 * behind. */
kvs_status_t kvs_plumbing_create(const kvs_plumbing_config_t *config, kvs_pool_t *pool,
                                 kvs_plumbing_t *plumbing_p);
/* Destroys what create made (any of it may be NULL) and clears the handles. */
void kvs_plumbing_destroy(kvs_plumbing_t *plumbing);

/* Serves the registry (when this process does) and progresses the sender or receiver; returns
 * how much work that was (0 = idle). */
uint32_t kvs_plumbing_progress(kvs_plumbing_t *plumbing);
/* How many of the other side's ranks the link believes dead (silent past the liveness timeout),
 * and the first of them in *first_p (may be NULL). 0 for links whose peers never die. */
uint32_t kvs_plumbing_peers_down(const kvs_plumbing_t *plumbing, uint32_t *first_p);
/* The sender's or receiver's counters (all zero when there is neither). */
void kvs_plumbing_metrics(const kvs_plumbing_t *plumbing, kvs_pd_metrics_t *metrics_p);

#endif
