/* The multi-process link: control messages over ZeroMQ and data writes over UCX (UCP), between
 * one rank of one side and the ranks of the other side. Each rank binds one control endpoint
 * and learns the other side's endpoints from its configuration, kvs_net_link_set_peer() (e.g.
 * from a bootstrap registry), or the peers' own heartbeats. Decode ranks expose their staging
 * ring; prefill ranks write into it with one-sided puts after a link-internal wireup exchange.
 *
 * Progress-driven and single-threaded: every op of the link (send, recv, write, write_poll,
 * flush, peer_status) drives ZeroMQ and UCX progress, heartbeats and liveness itself, so the
 * protocol needs nothing else; kvs_net_link_progress() is there for callers that wait without
 * calling ops. All calls on one link come from one thread at a time. docs/transport.md has the
 * details (sockets, wireup, deadlines, liveness, environment). */
#ifndef KVSTAGE_NET_H
#define KVSTAGE_NET_H

#include <stdint.h>

#include "kvstage/layout.h"
#include "kvstage/link.h"
#include "kvstage/mem.h"
#include "kvstage/status.h"

#define KVS_NET_MAX_INSTANCES 256 /* decode instances one prefill rank serves at once */

/* Which UCX transports carry data writes. */
typedef enum {
    KVS_NET_DATA_AUTO = 0, /* SHM when this rank and every known peer are on loopback or ipc://,
                              TCP otherwise; UCX_TLS from the environment wins if set */
    KVS_NET_DATA_SHM = 1,  /* UCX_TLS=sm (cma puts, posix/sysv for UCX's own wireup); one host
                              and one network namespace only */
    KVS_NET_DATA_TCP = 2,  /* UCX_TLS=tcp: across hosts or network namespaces */
} kvs_net_data_t;

typedef struct {
    kvs_side_t side;
    uint32_t rank;    /* this rank on its side */
    uint32_t peer_tp; /* ranks on the other side, [1, KVS_MAX_TP] */
    /* This rank's control endpoint, e.g. "tcp://127.0.0.1:5600"; port 0 or '*' picks a free
     * port, ipc:// with a '*' path a fresh socket file. kvs_net_link_endpoint() reports the real
     * one. */
    const char *bind;
    /* Control endpoints of the other side's ranks; NULL entries may be set later or learned
     * from the peers' heartbeats. Copied. */
    const char *peers[KVS_MAX_TP];
    kvs_net_data_t data;
    const char *net_device; /* UCX_NET_DEVICES for TCP (e.g. "lo"); NULL: UCX's choice */
    /* Decode: the bootstrap registry the peers' endpoints came from, or NULL. When a prefill
     * rank's heartbeats announce another endpoint than the one configured (it restarted on a
     * new port before this rank ever heard it), or it has been silent for a second or more (a
     * prefill instance restarted on new ports, which knows nothing of this rank), the link asks
     * the registry again, at most once a second per rank, waiting at most 50 ms; a new endpoint
     * is connected at once, so the restarted instance hears this rank's heartbeats and serves
     * its rooms without a restart of this side. Copied. */
    const char *registry;
    /* Where this rank's pool (and so its ring or staging buffers) lives. With KVS_MEM_DEVICE
     * the data plane to a peer whose ring is on a GPU is CUDA IPC (kvstage/cuda_ipc.h: NVLink
     * or PCIe peer copies, and direct writes through the mapped ring) instead of UCX, and both
     * sides must run on one host. */
    kvs_mem_kind_t mem;
    int device; /* CUDA device of this rank, for KVS_MEM_DEVICE */
    /* Zero picks the default (in parentheses). */
    uint64_t heartbeat_ns;        /* heartbeat period to each peer (200 ms) */
    uint64_t liveness_timeout_ns; /* a peer silent this long is dead (3 s) */
    uint64_t connect_timeout_ns;  /* a peer never heard within this is dead; a write waits
                                     this long for its wireup (10 s) */
    uint64_t write_timeout_ns;    /* a write with no completed piece for this long fails (30 s) */
    /* Prefill: how many decode instances this rank serves at once. 0 or 1: one, whose ranks
     * are its peers by rank alone (as configured in `peers`, or learned). Above 1: peers are
     * (instance, rank), told apart by the instance every frame names (`instance` below), and
     * learned from their heartbeats only (configure no peers); kvs_link peer ids then carry a
     * group number per instance (kvs_peer_id, kvstage/layout.h) that the protocol learns from
     * the messages it receives. An instance whose every rank is past the liveness timeout is
     * closed (its sockets and wireups dropped); one more instance than this is ignored until
     * another leaves. At most KVS_NET_MAX_INSTANCES. */
    uint32_t max_instances;
    /* This rank's instance, named in every frame: the ranks of one instance share it, and the
     * decode instances that one prefill instance serves at once must differ in it. */
    uint64_t instance;
    /* Test hook: the corrupt_nth-th (1-based) write of a prefill rank from host memory has one
     * bit of its source flipped as it starts (after the sender computed its checksum), as a
     * bad link or a stray write would; decode's checksum must catch it. 0: off. */
    uint64_t corrupt_nth;
} kvs_net_config_t;

/* Counters of one link (monotonic unless noted). */
typedef struct {
    uint64_t msgs_sent, msgs_received;   /* protocol messages */
    uint64_t bytes_sent, bytes_received; /* protocol message bytes */
    uint64_t send_failures;              /* sends refused (peer unknown or not connected) */
    uint64_t heartbeats_sent, heartbeats_received;
    uint64_t rejected;      /* frames that failed to parse or were too large */
    uint64_t stale;         /* frames from a peer's earlier incarnation */
    uint64_t dead_peers;    /* alive -> dead transitions (incl. never connected in time) */
    uint64_t peer_restarts; /* a peer came back as a new incarnation */
    uint64_t wireups_sent, wireups_received;
    uint64_t writes, write_bytes, writes_failed;
    uint64_t writes_in_flight;  /* now */
    uint64_t corrupted;         /* writes the corrupt_nth test hook flipped a bit of */
    uint64_t peer_instances;    /* now: instances of the other side connected (1 unless
                                   max_instances > 1) */
    uint64_t instances_refused; /* frames of a new decode instance while max_instances were
                                   connected */
} kvs_net_stats_t;

/* Binds the control endpoint, connects to the known peers and creates the UCX context and
 * worker. Fails with KVS_ERR_INVALID for a bad configuration, KVS_ERR_IO when ZeroMQ or UCX
 * cannot start (e.g. the endpoint is in use). */
kvs_status_t kvs_net_link_create(const kvs_net_config_t *config, kvs_link_t **link_p);

/* The bound control endpoint (with the real port), or NULL if link is not a net link. Valid
 * until the link is destroyed. */
const char *kvs_net_link_endpoint(kvs_link_t *link);

/* Sets or replaces the control endpoint of rank `rank` of the other side. */
kvs_status_t kvs_net_link_set_peer(kvs_link_t *link, uint32_t rank, const char *endpoint);

/* Drives ZeroMQ and UCX, heartbeats, liveness and wireup; returns how many events it handled.
 * The ops do this too: call it only while waiting without calling ops. */
uint32_t kvs_net_link_progress(kvs_link_t *link);

/* Sleeps at most timeout_us, waking as soon as a control message may have come to one of
 * links[0..n) (net links; other links and NULL entries are skipped) or fd (>= 0: a pipe or
 * socket of the caller's) is readable. Returns at once when a link already holds a message.
 * For an engine's idle loop: a rank asleep between steps takes a grant, a CHUNK_READY or a
 * STATUS when it comes, not at the end of a fixed sleep. Writes completing (UCX, CUDA) do not
 * wake it. Returns 1 when woken before the timeout, else 0. */
int kvs_net_link_wait(kvs_link_t *const *links, uint32_t n, int fd, uint64_t timeout_us);

/* KVS_ERR_INVALID if link is not a net link. */
kvs_status_t kvs_net_link_stats(kvs_link_t *link, kvs_net_stats_t *stats_p);

#endif
