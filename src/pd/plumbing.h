/* The kvstage plumbing of one prefill or decode rank running as its own process (internal to
 * libkvstage, used by the in-tree rank runners): the net link, the bootstrap registry (served,
 * registered with, or queried), and the rank's sender or receiver. The synthetic rank runner
 * (sim/rank.c) and the real-model one (serve/engine/llm_rank.c) set it up and tear it down
 * through here, so both bootstrap the same way.
 *
 * Per-room bootstrap (a decode rank configured without a registry): the rank's peers are
 * addressed as (prefill instance, rank) through a table with one net link and one receiver per
 * prefill instance, keyed by the instance's registry endpoint. Nothing is wired at create; the
 * first room naming an instance wires it, from a peer description (kvs_plumbing_peer_lookup:
 * the instance's registrations, checked against this geometry) that the instance's rank 0
 * decided and every rank received with the room, so the ranks never query a registry on their
 * own and never disagree on an instance's layout. A receiver per instance keeps each one's plan
 * (prefill TP and stages) whole, and no wire format changes: to a prefill rank each link is
 * simply a decode rank. An instance with no live room is closed once it has been idle for
 * idle_ns or every one of its ranks is past the liveness timeout, and the table holds at most
 * max_instances (the least recently used idle instance makes room for a new one).
 *
 * A prefill rank serves up to max_instances decode instances at once: its net link tells them
 * apart by the instance id in their frames (kvs_net_config_t.max_instances) and its sender
 * addresses each room's peers in the decode instance the room's metadata came from. */
#ifndef KVSTAGE_PD_PLUMBING_H
#define KVSTAGE_PD_PLUMBING_H

#include <stdint.h>

#include "kvstage/link.h"
#include "kvstage/msg.h"
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
    /* Decode with registry NULL (per-room bootstrap); the config's strings must then outlive
     * the plumbing (instances are wired later), and bind must pick a free port or path. */
    uint32_t max_instances; /* instances of the other side at once: per-room decode, prefill
                               instances wired; prefill, decode instances served (the net
                               link's max_instances); 0: KVS_PLUMBING_MAX_INSTANCES */
    uint64_t idle_ns;       /* per-room decode: an instance this long without a room is closed
                               (0: 300 s) */
    /* Decode: this instance's id, the same on all its ranks and different from every other
     * decode instance that talks to the same prefill instance (kvs_net_config_t.instance). */
    uint64_t instance;
} kvs_plumbing_config_t;

#define KVS_PLUMBING_MAX_INSTANCES 16
/* A peer description: "REGISTRY,TP,PP,EP_0,...,EP_n-1" (n = TP x PP prefill ranks). */
#define KVS_PLUMBING_PEER_MAX (KVS_MAX_TP * (KVS_MSG_ENDPOINT_MAX + 1) + 2 * KVS_MSG_ENDPOINT_MAX)

typedef struct kvs_plumbing_peer kvs_plumbing_peer_t;

typedef struct {
    kvs_registry_t *registry; /* served by this process, or NULL */
    kvs_link_t *link;
    kvs_sender_t *sender;     /* prefill, else NULL */
    kvs_receiver_t *receiver; /* decode, else NULL */
    uint32_t peers;           /* ranks of the other side (per-room: of every wired instance) */
    /* per-room bootstrap: the instance table ([cfg.max_instances], ninsts wired) */
    kvs_plumbing_config_t cfg;
    kvs_pool_t *pool;
    kvs_plumbing_peer_t *insts;
    uint32_t ninsts;
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
/* Sleeps at most timeout_us, woken early by a control message on any of the plumbing's links
 * or by fd (>= 0) becoming readable (kvs_net_link_wait). Returns 1 if woken early. */
int kvs_plumbing_wait(const kvs_plumbing_t *plumbing, int fd, uint64_t timeout_us);
/* Data copies (writes, scatters) started and not yet seen complete, over the sender and every
 * receiver. Their completions wake no wait: a loop polls rather than sleeps while they run. */
uint32_t kvs_plumbing_copies_in_flight(const kvs_plumbing_t *plumbing);
/* Decode: how many of the other side's ranks the link believes dead (silent past the liveness
 * timeout), and the first of them in *first_p (may be NULL). 0 for links whose peers never die.
 * Per-room bootstrap: always 0 (a dead instance fails only the rooms naming it and is closed
 * once they are released; the rank can wire any other instance). */
uint32_t kvs_plumbing_peers_down(const kvs_plumbing_t *plumbing, uint32_t *first_p);
/* The sender's or receiver's counters (all zero when there is neither); with per-room
 * bootstrap, every instance's receiver summed, and peer_instances. */
void kvs_plumbing_metrics(const kvs_plumbing_t *plumbing, kvs_pd_metrics_t *metrics_p);

/* Per-room bootstrap, on whoever decides for the decode instance (its rank 0, or the server in
 * front of it): asks the prefill instance's registry for every rank (at most timeout_ns in
 * all), checks each registration against mine (the decode geometry; the prefill TP, stages and
 * page size are the instance's own), and writes the peer description into desc[cap].
 * KVS_ERR_INCOMPATIBLE with why naming the mismatch, KVS_ERR_TIMEOUT when the registry or a
 * rank did not answer (why says which), KVS_ERR_INVALID for an endpoint a description cannot
 * carry. */
kvs_status_t kvs_plumbing_peer_lookup(const kvs_pd_geometry_t *mine, const char *registry,
                                      uint64_t timeout_ns, char *desc, size_t cap, char *why,
                                      size_t why_cap);
/* Every rank, when a room is added: the receiver of the prefill instance that desc describes
 * (NULL with a registry configured: the one receiver), wiring the instance on first use. The
 * receiver stays valid while it holds a room. KVS_ERR_INVALID for a malformed description,
 * KVS_ERR_INCOMPATIBLE when the instance changed its layout while rooms of its old one live,
 * KVS_ERR_NOSPACE when max_instances are wired and none is idle. */
kvs_status_t kvs_plumbing_room_receiver(kvs_plumbing_t *plumbing, const char *desc,
                                        kvs_receiver_t **receiver_p);

#endif
