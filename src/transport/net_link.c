/* The net link: kvs_link_ops_t over a ZeroMQ control channel and a UCX data plane, for one
 * rank talking to the ranks of the other side in other processes (or hosts).
 *
 * Every op first runs service(): UCX progress (a decode target must progress for puts and
 * wireup to land), draining control frames (protocol messages into an inbox, wireup frames
 * handled here), heartbeats and liveness, and the state of every write. Writes wait for the
 * decode peer's wireup (worker address, ring base and size, rkey; pushed by decode and asked for
 * by prefill until a deadline), then post their pieces, and complete only after a flush. A peer
 * that dies, restarts or re-exposes its ring invalidates its endpoint: writes in flight to it
 * fail, later writes wire up again. A prefill link with max_instances > 1 serves several decode
 * instances: its peers are the channel's peer groups (ids kvs_peer_id(group, rank)), and a group
 * whose ranks are all dead is closed here (close_dead_groups). */
#include "base/bytes.h"
#include "kvstage/net.h"

#include "base/mem.h"
#include "kvstage/cuda_ipc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>

#include "base/map.h"
#include "control/zmq_channel.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "kvstage/msg.h"
#include "kvstage/registry.h"
#include "transport/link.h"
#include "transport/ucx_data.h"

#define MS                1000000ull
#define DEFAULT_HEARTBEAT (200 * MS)
#define DEFAULT_LIVENESS  (3000 * MS)
#define DEFAULT_CONNECT   (10000 * MS)
#define DEFAULT_WRITE     (30000 * MS)
#define WIREUP_RETRY_NS   (50 * MS)
#define INBOX_CAP         4096     /* protocol messages read ahead of recv */
#define SERVICE_GAP_NS    20000ull /* see maybe_service() */
#define WIREUP_FIXED      32
#define WIREUP_ADDR_MAX   16384
#define WIREUP_RKEY_MAX   4096
#define WIREUP_UCX        0           /* payload: UCX worker address + rkey */
#define WIREUP_CUDA_IPC   1           /* payload: a kvs_cuda_ipc_handle_t (the ring is on a GPU) */
#define RESOLVE_GAP_NS    (1000 * MS) /* registry lookups of one disputed or quiet peer */
#define QUIET_NS          (1000 * MS) /* decode: a prefill peer this silent is looked up again */
#define RESOLVE_WAIT_NS   (50 * MS)

typedef struct {
    size_t len;
    uint32_t from;   /* the sender's peer id */
    uint8_t bytes[]; /* [len] one protocol message */
} inbox_msg_t;

typedef struct {
    uint64_t ticket;
    uint32_t peer; /* index in the channel */
    int wiring;    /* waiting for the peer's wireup */
    int via_ipc;   /* a CUDA IPC peer copy (ipc_ticket), not UCX puts */
    uint64_t ipc_ticket;
    kvs_status_t status; /* KVS_INPROGRESS until the outcome is known */
    const void *src;     /* [len] caller-owned until the outcome is collected */
    void *bounce;        /* a device pool writing a host ring: the staged bytes copied to host */
    uint64_t offset, len;
    kvs_ucx_put_t *put;
    uint64_t deadline;    /* wiring: give up then */
    uint64_t completions; /* putting: requests completed when last seen */
    uint64_t progress_at; /* putting: when completions last moved */
} nwrite_t;

typedef struct {
    kvs_ucx_remote_t *remote; /* prefill: endpoint + rkey of the peer's ring */
    int ipc_ready;            /* prefill: the peer's GPU ring is imported (CUDA IPC) instead */
    int same_device;          /* prefill: that GPU ring is on this rank's own GPU (shares_device) */
    uint64_t remote_inc;      /* the peer incarnation it was built from */
    uint32_t remote_gen;      /* and the ring generation */
    uint64_t next_req;        /* prefill: next WIREUP_REQ may go then */
    kvs_status_t wire_error;  /* prefill: why the last wireup could not be used */
    uint64_t wire_error_inc;  /* and the peer incarnation it came from */
    uint64_t pushed_inc;      /* decode: incarnation our current wireup went to */
    uint64_t next_resolve;    /* decode: next registry lookup of a disputed or dead peer */
    int dead;                 /* liveness as last acted upon */
} npeer_t;

typedef struct {
    kvs_net_config_t cfg;                    /* string pointers are not kept */
    char registry[KVS_ZCH_ENDPOINT_MAX + 1]; /* decode: "" when none */
    kvs_zch_t *ch;
    kvs_ucx_t *ucx;
    kvs_link_t *ipc; /* device pools: the CUDA IPC data plane; NULL for host pools */
    npeer_t *peers;  /* [kvs_zch_peers()], by the channel's peer index */
    /* decode: the exposed ring and the WIREUP payload describing it */
    kvs_ucx_region_t *region;
    kvs_ucx_region_t *owned; /* the ring ring_alloc made (exposed or not) */
    uint32_t gen;
    uint8_t *wireup; /* [wireup_len] */
    size_t wireup_len;
    /* prefill: writes by ticket */
    kvs_map_t writes; /* ticket -> nwrite_t * */
    uint64_t next_ticket;
    inbox_msg_t *inbox[INBOX_CAP]; /* ring of read-ahead protocol messages */
    uint32_t inbox_head, inbox_count;
    kvs_net_stats_t st; /* link-level counters; the channel keeps the rest */
    uint64_t serviced_at;
} net_t;

static const kvs_link_ops_t net_ops;

/* ---- writes ---- */

static void finish_write(net_t *n, nwrite_t *w, kvs_status_t status)
{
    if (w->status != KVS_INPROGRESS) return;
    w->status = status;
    w->wiring = 0;
    if (status != KVS_OK) {
        n->st.writes_failed++;
        kvs_warn("net link: %s rank %u: write %llu to decode rank %u failed: %s",
                 kvs_side_str(n->cfg.side), n->cfg.rank, (unsigned long long) w->ticket, w->peer,
                 kvs_status_str(status));
    }
}

/* 1 once writes to the peer's ring can start (UCX endpoint, or imported GPU ring). */
static int wired(const npeer_t *p)
{
    return p->remote != NULL || p->ipc_ready;
}

/* Drops the endpoint to a peer: its puts fail, later writes wire up again. (An imported GPU
 * ring stays open until the next import replaces it: its copies in flight still land.) */
static void drop_remote(net_t *n, uint32_t peer, int peer_gone, const char *why)
{
    npeer_t *p = &n->peers[peer];
    if (!wired(p)) return;
    /* A peer that leaves between transfers (the end of a run, a scale-down) is routine; one
     * that takes writes down with it is worth a warning (their rooms fail with their own). */
    uint32_t inflight = 0;
    void *v;
    for (size_t it = 0; kvs_map_next(&n->writes, &it, NULL, &v);) {
        const nwrite_t *w = v;
        if (w->peer == peer && w->status == KVS_INPROGRESS && !w->wiring) inflight++;
    }
    if (inflight != 0)
        kvs_warn("net link: prefill rank %u drops its endpoint to decode rank %u with %u writes "
                 "in flight: %s",
                 n->cfg.rank, peer, inflight, why);
    else
        kvs_info("net link: prefill rank %u drops its endpoint to decode rank %u: %s", n->cfg.rank,
                 peer, why);
    kvs_ucx_remote_destroy(p->remote, peer_gone);
    p->remote = NULL;
    p->ipc_ready = 0;
    p->remote_inc = 0;
    p->remote_gen = 0;
}

static void start_put(net_t *n, nwrite_t *w)
{
    npeer_t *p = &n->peers[w->peer];
    kvs_status_t st;
    if (p->ipc_ready) {
        st = n->ipc->ops->write(n->ipc->ctx, w->peer, w->offset, w->src, w->len, &w->ipc_ticket);
        w->via_ipc = st == KVS_OK;
    } else if (n->cfg.mem == KVS_MEM_DEVICE) {
        /* A GPU pool writing a host ring: UCX here moves host memory only, so the staged
         * bytes go through a host copy first (correct, and slower than a GPU-to-GPU pair). */
        w->bounce = kvs_malloc(w->len);
        st = w->bounce != NULL ? kvs_mem_copy(w->bounce, w->src, w->len) : KVS_ERR_NOMEM;
        if (st == KVS_OK) st = kvs_ucx_put_start(p->remote, w->offset, w->bounce, w->len, &w->put);
    } else {
        st = kvs_ucx_put_start(p->remote, w->offset, w->src, w->len, &w->put);
    }
    if (st != KVS_OK) {
        finish_write(n, w, st);
        return;
    }
    w->wiring = 0;
    w->completions = 0;
    w->progress_at = kvs_now_ns();
}

static void send_wireup_req(net_t *n, uint32_t peer, uint64_t now)
{
    npeer_t *p = &n->peers[peer];
    if (now < p->next_req) return;
    p->next_req = now + WIREUP_RETRY_NS;
    if (kvs_zch_send(n->ch, peer, KVS_ZCH_WIREUP_REQ, NULL, 0) == KVS_OK) n->st.wireups_sent++;
}

static uint32_t advance_write(net_t *n, nwrite_t *w, uint64_t now)
{
    if (w->status != KVS_INPROGRESS) return 0;
    npeer_t *p = &n->peers[w->peer];
    if (w->wiring) {
        if (wired(p)) {
            start_put(n, w);
            return 1;
        }
        if (p->wire_error != KVS_OK &&
            p->wire_error_inc == kvs_zch_peer_incarnation(n->ch, w->peer)) {
            finish_write(n, w, p->wire_error);
            return 1;
        }
        if (now >= w->deadline) {
            kvs_error("net link: prefill rank %u: no wireup from decode rank %u within %llu ms",
                      n->cfg.rank, w->peer, (unsigned long long) (n->cfg.connect_timeout_ns / MS));
            finish_write(n, w, KVS_ERR_TIMEOUT);
            return 1;
        }
        send_wireup_req(n, w->peer, now);
        return 0;
    }
    if (w->via_ipc) {
        /* A peer copy on this GPU's queue: it completes (or fails) on its own. */
        kvs_status_t st = n->ipc->ops->write_poll(n->ipc->ctx, w->ipc_ticket);
        if (st == KVS_INPROGRESS) return 0;
        finish_write(n, w, st);
        return 1;
    }
    kvs_status_t st = kvs_ucx_put_poll(w->put);
    if (st != KVS_INPROGRESS) {
        finish_write(n, w, st);
        return 1;
    }
    uint64_t c = kvs_ucx_put_completions(w->put);
    if (c != w->completions) {
        w->completions = c;
        w->progress_at = now;
    } else if (now >= w->progress_at + n->cfg.write_timeout_ns && p->remote != NULL) {
        /* The peer is alive but its endpoint does not move (e.g. shared memory across network
         * namespaces wires up forever): give up on the endpoint. */
        kvs_error("net link: prefill rank %u: write %llu to decode rank %u made no progress "
                  "for %llu ms",
                  n->cfg.rank, (unsigned long long) w->ticket, w->peer,
                  (unsigned long long) (n->cfg.write_timeout_ns / MS));
        drop_remote(n, w->peer, 1, "write stalled");
        finish_write(n, w, KVS_ERR_TIMEOUT);
        return 1;
    }
    return 0;
}

/* ---- wireup ---- */

/* A prefill rank with a host pool facing a decode ring on GPU `device` of this host: the CUDA
 * IPC data plane that writes such rings, on that GPU (its copies read host memory). */
static kvs_status_t open_host_ipc(net_t *n, uint32_t device)
{
    kvs_cuda_ipc_config_t ic = {.side = KVS_SIDE_PREFILL,
                                .rank = n->cfg.rank,
                                .peer_tp = n->cfg.max_instances * n->cfg.peer_tp,
                                .device = (int) device};
    kvs_status_t st = kvs_cuda_ipc_link_create(&ic, &n->ipc);
    if (st == KVS_OK)
        kvs_info("net link: prefill rank %u (host pool) writes GPU %u's rings through CUDA copies",
                 n->cfg.rank, device);
    else
        kvs_error("net link: prefill rank %u has its pool in host memory and cannot open CUDA "
                  "IPC to write a decode ring on GPU %u: %s",
                  n->cfg.rank, device, kvs_status_str(st));
    return st;
}

static void handle_wireup(net_t *n, const kvs_zch_frame_t *f)
{
    if (n->cfg.side != KVS_SIDE_PREFILL || f->len < WIREUP_FIXED) goto reject;
    const uint8_t *b = f->payload;
    uint32_t gen = kvs_get_u32(b);
    uint32_t addr_len = kvs_get_u32(b + 4);
    uint32_t rkey_len = kvs_get_u32(b + 8);
    uint32_t kind = kvs_get_u32(b + 12);
    uint64_t base = kvs_get_u64(b + 16);
    uint64_t size = kvs_get_u64(b + 24);
    int ipc = kind == WIREUP_CUDA_IPC;
    if ((kind != WIREUP_UCX && !ipc) || gen == 0 ||
        (ipc ? addr_len != 0 || rkey_len != KVS_CUDA_IPC_HANDLE_BYTES
             : addr_len == 0 || addr_len > WIREUP_ADDR_MAX || rkey_len == 0 ||
                   rkey_len > WIREUP_RKEY_MAX) ||
        f->len != WIREUP_FIXED + (size_t) addr_len + rkey_len || size == 0 || base + size < base)
        goto reject;
    npeer_t *p = &n->peers[f->from];
    n->st.wireups_received++;
    if (wired(p) && p->remote_inc == f->incarnation && gen <= p->remote_gen)
        return; /* a repeat, or older than what we use */
    /* A new incarnation means the old process is gone: do not wait for it. */
    drop_remote(n, f->from, p->remote_inc != f->incarnation,
                "the decode rank announced a new ring");
    kvs_ucx_remote_t *rm = NULL;
    kvs_status_t st;
    int same_device = 0;
    if (ipc) {
        /* A GPU ring on this host. A host pool writes it by CUDA copies from its host staging
         * buffers, through a CUDA IPC data plane opened at the first such ring. */
        kvs_cuda_ipc_handle_t h;
        memcpy(h.bytes, b + WIREUP_FIXED, sizeof(h.bytes));
        st = n->ipc != NULL ? KVS_OK : open_host_ipc(n, kvs_cuda_ipc_handle_device(&h));
        if (st == KVS_OK) st = kvs_cuda_ipc_import(n->ipc, f->from, &h);
        /* A host pool computes nothing on the GPU: only a device pool competes there. */
        same_device = n->cfg.mem == KVS_MEM_DEVICE &&
                      kvs_cuda_ipc_handle_device(&h) == (uint32_t) n->cfg.device;
    } else {
        /* A host ring: UCX puts (a GPU pool's writes go through a host copy, start_put). */
        st = kvs_ucx_remote_create(n->ucx, b + WIREUP_FIXED, addr_len, b + WIREUP_FIXED + addr_len,
                                   rkey_len, base, size, &rm);
    }
    if (st != KVS_OK) {
        kvs_error("net link: prefill rank %u cannot reach decode rank %u's ring: %s (do both "
                  "sides use the same data transport?)",
                  n->cfg.rank, f->from, kvs_status_str(st));
        p->wire_error = st; /* writes waiting for it fail now, not at their deadline */
        p->wire_error_inc = f->incarnation;
        return;
    }
    p->wire_error = KVS_OK;
    p->remote = rm;
    p->ipc_ready = ipc;
    p->same_device = same_device;
    p->remote_inc = f->incarnation;
    p->remote_gen = gen;
    kvs_debug("net link: prefill rank %u wired to decode rank %u (ring of %llu bytes, gen %u)",
              n->cfg.rank, f->from, (unsigned long long) size, gen);
    return;
reject:
    kvs_zch_count_rejected(n->ch);
    kvs_warn("net link: %s rank %u rejected a %zu-byte wireup frame from rank %u",
             kvs_side_str(n->cfg.side), n->cfg.rank, f->len, f->from);
}

/* Returns 1 if the wireup went out (not yet connected peers get it on a later call). */
static int push_wireup(net_t *n, uint32_t peer)
{
    if (kvs_zch_send(n->ch, peer, KVS_ZCH_WIREUP, n->wireup, n->wireup_len) != KVS_OK) return 0;
    n->st.wireups_sent++;
    n->peers[peer].pushed_inc = kvs_zch_peer_incarnation(n->ch, peer);
    return 1;
}

static void handle_frame(net_t *n, const kvs_zch_frame_t *f)
{
    switch (f->kind) {
    case KVS_ZCH_MSG: {
        inbox_msg_t *m = kvs_malloc(sizeof(*m) + f->len);
        if (m == NULL) return; /* lost like any message: the protocol retries */
        m->len = f->len;
        m->from = kvs_zch_peer_id(n->ch, f->from);
        memcpy(m->bytes, f->payload, f->len);
        n->inbox[(n->inbox_head + n->inbox_count) % INBOX_CAP] = m;
        n->inbox_count++;
        return;
    }
    case KVS_ZCH_WIREUP_REQ:
        if (n->cfg.side != KVS_SIDE_DECODE || f->len != 0) {
            kvs_zch_count_rejected(n->ch);
            return;
        }
        n->st.wireups_received++;
        if (n->wireup != NULL) push_wireup(n, f->from);
        return;
    case KVS_ZCH_WIREUP:
        handle_wireup(n, f);
        return;
    default:
        kvs_zch_count_rejected(n->ch);
        return;
    }
}

/* ---- service: everything an op call drives ---- */

/* Decode: asks the registry where prefill rank `peer` listens now: its configured endpoint is
 * disputed by its heartbeats, or it has gone quiet (a prefill instance restarted on new ports
 * knows nothing of this rank, so only this rank can find it again, and waiting for the liveness
 * timeout first would fail every room that arrives meanwhile). A short, rate-limited wait: this
 * runs only while a peer is unreachable. */
static uint32_t resolve(net_t *n, uint32_t peer)
{
    npeer_t *p = &n->peers[peer];
    uint64_t now = kvs_now_ns();
    if (now < p->next_resolve) return 0;
    p->next_resolve = now + RESOLVE_GAP_NS;
    kvs_msg_register_t reg;
    if (kvs_registry_query(n->registry, peer, RESOLVE_WAIT_NS, &reg) != KVS_OK) return 0;
    const char *cur = kvs_zch_peer_endpoint(n->ch, peer);
    if (cur == NULL || strcmp(cur, reg.endpoint) != 0)
        kvs_info("net link: decode rank %u: the registry places prefill rank %u at %s", n->cfg.rank,
                 peer, reg.endpoint);
    return kvs_zch_set_peer(n->ch, peer, reg.endpoint) == KVS_OK;
}

/* Prefill serving several decode instances: an instance whose every rank is past the liveness
 * timeout has failed its rooms (the sender sees its peers dead); its group is closed, so a
 * long-lived prefill rank does not gather the sockets of decode instances that left. Its ids
 * never resolve again: a room still naming it sees dead peers, and the instance, should it come
 * back, gets a new group. */
static uint32_t close_dead_groups(net_t *n)
{
    const uint32_t tp = n->cfg.peer_tp;
    uint32_t closed = 0;
    if (n->cfg.max_instances <= 1) return 0;
    for (uint32_t first = 0; first < kvs_zch_peers(n->ch); first += tp) {
        if (!kvs_zch_peer_open(n->ch, first)) continue;
        uint32_t r = 0;
        while (r < tp && n->peers[first + r].dead) r++;
        if (r < tp) continue;
        /* Puts in flight fail with their endpoint (UCX) or land (a peer copy); writes still
         * waiting for a wireup fail now. */
        for (r = 0; r < tp; r++) {
            drop_remote(n, first + r, 1, "its decode instance is gone");
            memset(&n->peers[first + r], 0, sizeof(n->peers[first + r]));
        }
        void *v;
        for (size_t it = 0; kvs_map_next(&n->writes, &it, NULL, &v);) {
            nwrite_t *w = v;
            if (w->peer >= first && w->peer < first + tp && w->wiring)
                finish_write(n, w, KVS_ERR_IO);
        }
        kvs_zch_close_group(n->ch, first);
        closed++;
    }
    return closed;
}

static uint32_t check_peers(net_t *n)
{
    uint32_t events = 0;
    for (uint32_t i = 0; i < kvs_zch_peers(n->ch); i++) {
        if (!kvs_zch_peer_open(n->ch, i)) continue;
        npeer_t *p = &n->peers[i];
        uint64_t inc = kvs_zch_peer_incarnation(n->ch, i);
        int dead = kvs_zch_peer_status(n->ch, i) != KVS_OK;
        if (n->cfg.side == KVS_SIDE_DECODE) {
            if (n->registry[0] && (dead || kvs_zch_peer_disputed(n->ch, i) ||
                                   kvs_zch_peer_silence_ns(n->ch, i) >= QUIET_NS))
                events += resolve(n, i);
            /* A new prefill life (or a new ring) needs our wireup. */
            if (n->wireup != NULL && !dead && inc != 0 && inc != p->pushed_inc)
                events += (uint32_t) push_wireup(n, i);
            continue;
        }
        if (wired(p) && dead) {
            drop_remote(n, i, 1, "the decode rank is dead");
            events++;
        } else if (wired(p) && inc != p->remote_inc) {
            drop_remote(n, i, 1, "the decode rank restarted");
            events++;
        } else if (p->remote != NULL && kvs_ucx_remote_failed(p->remote)) {
            drop_remote(n, i, 1, "UCX reported an endpoint error");
            events++;
        }
        if (dead && !p->dead) {
            /* Writes waiting for a dead peer's wireup fail now, not at their deadline. */
            void *v;
            for (size_t it = 0; kvs_map_next(&n->writes, &it, NULL, &v);) {
                nwrite_t *w = v;
                if (w->peer == i && w->wiring) finish_write(n, w, KVS_ERR_IO);
            }
        }
        p->dead = dead;
    }
    return events + close_dead_groups(n);
}

static uint32_t service(net_t *n)
{
    n->serviced_at = kvs_now_ns();
    uint32_t events = kvs_ucx_progress(n->ucx);
    kvs_zch_frame_t f;
    while (n->inbox_count < INBOX_CAP && kvs_zch_recv(n->ch, &f) == KVS_OK) {
        handle_frame(n, &f);
        events++;
    }
    events += kvs_zch_tick(n->ch);
    events += check_peers(n);
    if (n->writes.count > 0) {
        uint64_t now = kvs_now_ns();
        void *v;
        for (size_t it = 0; kvs_map_next(&n->writes, &it, NULL, &v);)
            events += advance_write(n, v, now);
    }
    return events;
}

/* Ops the protocol calls many times per progress pass (send per message, write_poll per
 * write, peer_status per room and peer) share one service pass per SERVICE_GAP_NS. */
static void maybe_service(net_t *n)
{
    if (kvs_now_ns() - n->serviced_at >= SERVICE_GAP_NS) service(n);
}

/* ---- ops ---- */

/* The channel's index of peer id `peer` (kvs_peer_id): KVS_OK; KVS_ERR_IO for a peer of a
 * decode instance whose group is closed (gone, as good as dead); KVS_ERR_INVALID for a rank
 * not on the other side. */
static kvs_status_t peer_index(net_t *n, uint32_t peer, uint32_t *index_p)
{
    kvs_status_t st = kvs_zch_peer_index(n->ch, peer, index_p);
    if (st == KVS_ERR_NOT_FOUND) return KVS_ERR_IO;
    if (st != KVS_OK)
        kvs_error("net link: no rank %u on the other side (of %u)", kvs_peer_rank(peer),
                  n->cfg.peer_tp);
    return st;
}

static kvs_status_t net_send(void *ctx, uint32_t peer, const uint8_t *buf, size_t len)
{
    net_t *n = ctx;
    uint32_t i = 0;
    kvs_status_t st = len > KVS_MSG_MAX_SIZE ? KVS_ERR_INVALID : peer_index(n, peer, &i);
    if (st != KVS_OK) {
        if (st == KVS_ERR_INVALID)
            kvs_error("net link: cannot send %zu bytes to peer %u", len, peer);
        return st;
    }
    maybe_service(n);
    return kvs_zch_send(n->ch, i, KVS_ZCH_MSG, buf, len);
}

static kvs_status_t net_recv(void *ctx, uint8_t *buf, size_t cap, size_t *len_p, uint32_t *from_p)
{
    net_t *n = ctx;
    if (n->inbox_count == 0) service(n);
    if (n->inbox_count == 0) return KVS_INPROGRESS;
    inbox_msg_t *m = n->inbox[n->inbox_head];
    n->inbox_head = (n->inbox_head + 1) % INBOX_CAP;
    n->inbox_count--;
    kvs_status_t st = KVS_OK;
    if (m->len > cap) {
        kvs_warn("net link: dropping a %zu-byte message (buffer %zu)", m->len, cap);
        st = KVS_ERR_PROTOCOL;
    } else {
        memcpy(buf, m->bytes, m->len);
        *len_p = m->len;
        if (from_p != NULL) *from_p = m->from;
    }
    kvs_free(m);
    return st;
}

static kvs_status_t net_write(void *ctx, uint32_t id, uint64_t offset, const void *src,
                              uint64_t len, uint64_t *ticket_p)
{
    net_t *n = ctx;
    uint32_t peer = 0;
    if (n->cfg.side != KVS_SIDE_PREFILL || (len > 0 && src == NULL) ||
        kvs_zch_peer_index(n->ch, id, &peer) == KVS_ERR_INVALID) {
        kvs_error("net link: %s rank %u cannot write to decode rank %u", kvs_side_str(n->cfg.side),
                  n->cfg.rank, kvs_peer_rank(id));
        return KVS_ERR_INVALID;
    }
    service(n);
    if (peer_index(n, id, &peer) != KVS_OK || kvs_zch_peer_status(n->ch, peer) != KVS_OK) {
        kvs_error("net link: prefill rank %u: decode rank %u (peer %u) is not alive", n->cfg.rank,
                  kvs_peer_rank(id), id);
        return KVS_ERR_IO;
    }
    nwrite_t *w = kvs_calloc(1, sizeof(*w));
    if (w == NULL) return KVS_ERR_NOMEM;
    w->ticket = ++n->next_ticket;
    w->peer = peer;
    w->status = KVS_INPROGRESS;
    if (n->cfg.corrupt_nth != 0 && w->ticket == n->cfg.corrupt_nth && len > 0 &&
        n->cfg.mem == KVS_MEM_HOST) {
        /* The test hook: the source is the sender's staging buffer, checksummed already. */
        ((uint8_t *) src)[len / 2] ^= 0x10;
        n->st.corrupted++;
    }
    w->src = src;
    w->offset = offset;
    w->len = len;
    kvs_status_t st = kvs_map_put(&n->writes, w->ticket, w);
    if (st != KVS_OK) {
        kvs_free(w);
        return st;
    }
    npeer_t *p = &n->peers[peer];
    if (wired(p)) {
        start_put(n, w);
    } else {
        uint64_t now = kvs_now_ns();
        w->wiring = 1;
        w->deadline = now + n->cfg.connect_timeout_ns;
        send_wireup_req(n, peer, now);
    }
    n->st.writes++;
    n->st.write_bytes += len;
    *ticket_p = w->ticket;
    return KVS_OK;
}

static kvs_status_t net_write_poll(void *ctx, uint64_t ticket)
{
    net_t *n = ctx;
    nwrite_t *w = kvs_map_get(&n->writes, ticket);
    if (w == NULL) {
        kvs_error("net link: unknown write ticket %llu", (unsigned long long) ticket);
        return KVS_ERR_NOT_FOUND;
    }
    if (w->status == KVS_INPROGRESS) maybe_service(n);
    if (w->status == KVS_INPROGRESS) return KVS_INPROGRESS;
    kvs_status_t st = w->status;
    kvs_map_remove(&n->writes, ticket);
    kvs_ucx_put_release(w->put);
    kvs_free(w->bounce);
    kvs_free(w);
    return st;
}

/* The WIREUP payload: [0,4) generation, [4,8) address length, [8,12) key length, [12,16) kind,
 * [16,24) ring base, [24,32) ring size, then the address and the key (UCX worker address and
 * rkey; or no address and a CUDA IPC handle as the key). */
static kvs_status_t build_wireup(net_t *n, void *ring, uint64_t size)
{
    const uint8_t *addr, *rkey;
    size_t addr_len, rkey_len;
    kvs_cuda_ipc_handle_t h;
    if (n->ipc != NULL) {
        kvs_status_t st = kvs_cuda_ipc_export(n->ipc, &h);
        if (st != KVS_OK) return st;
        addr = NULL;
        addr_len = 0;
        rkey = h.bytes;
        rkey_len = sizeof(h.bytes);
    } else {
        kvs_ucx_address(n->ucx, &addr, &addr_len);
        kvs_ucx_region_rkey(n->region, &rkey, &rkey_len);
    }
    if (addr_len > WIREUP_ADDR_MAX || rkey_len > WIREUP_RKEY_MAX) {
        kvs_error("net link: UCX address (%zu bytes) or rkey (%zu) too large for a wireup",
                  addr_len, rkey_len);
        return KVS_ERR_UNSUPPORTED;
    }
    size_t len = WIREUP_FIXED + addr_len + rkey_len;
    uint8_t *b = kvs_malloc(len);
    if (b == NULL) return KVS_ERR_NOMEM;
    kvs_put_u32(b, n->gen);
    kvs_put_u32(b + 4, (uint32_t) addr_len);
    kvs_put_u32(b + 8, (uint32_t) rkey_len);
    kvs_put_u32(b + 12, n->ipc != NULL ? WIREUP_CUDA_IPC : WIREUP_UCX);
    kvs_put_u64(b + 16, (uint64_t) (uintptr_t) ring);
    kvs_put_u64(b + 24, size);
    if (addr_len > 0) memcpy(b + WIREUP_FIXED, addr, addr_len);
    memcpy(b + WIREUP_FIXED + addr_len, rkey, rkey_len);
    kvs_free(n->wireup);
    n->wireup = b;
    n->wireup_len = len;
    return KVS_OK;
}

static void withdraw(net_t *n)
{
    if (n->region != n->owned) kvs_ucx_region_destroy(n->region);
    n->region = NULL;
    if (n->ipc != NULL && n->cfg.side == KVS_SIDE_DECODE)
        (void) n->ipc->ops->expose(n->ipc->ctx, NULL, 0);
    kvs_free(n->wireup);
    n->wireup = NULL;
    n->wireup_len = 0;
}

/* ring NULL withdraws the exposed ring (before the caller frees it). */
static kvs_status_t net_expose(void *ctx, void *ring, uint64_t size)
{
    net_t *n = ctx;
    if (n->cfg.side != KVS_SIDE_DECODE) {
        kvs_error("net link: only decode ranks expose a ring");
        return KVS_ERR_INVALID;
    }
    withdraw(n);
    if (ring == NULL) return KVS_OK;
    kvs_status_t st = KVS_OK;
    if (n->ipc != NULL)
        st = n->ipc->ops->expose(n->ipc->ctx, ring, size); /* a GPU ring: CUDA IPC */
    else if (n->owned != NULL && ring == kvs_ucx_region_base(n->owned))
        n->region = n->owned; /* mapped when it was allocated */
    else
        st = kvs_ucx_region_create(n->ucx, ring, size, &n->region);
    if (st != KVS_OK) return st;
    n->gen++;
    if ((st = build_wireup(n, ring, size)) != KVS_OK) {
        withdraw(n);
        return st;
    }
    /* Prefill ranks holding the old ring's rkey must hear of the new one. */
    for (uint32_t i = 0; i < kvs_zch_peers(n->ch); i++) {
        n->peers[i].pushed_inc = 0;
        push_wireup(n, i);
    }
    return KVS_OK;
}

static kvs_status_t net_ring_alloc(void *ctx, uint64_t size, void **ring_p)
{
    net_t *n = ctx;
    if (n->cfg.side != KVS_SIDE_DECODE || n->owned != NULL) {
        kvs_error("net link: %s rank %u cannot allocate a%s ring", kvs_side_str(n->cfg.side),
                  n->cfg.rank, n->owned ? " second" : "");
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = kvs_ucx_region_alloc(n->ucx, size, &n->owned);
    if (st != KVS_OK) return st;
    *ring_p = kvs_ucx_region_base(n->owned);
    return KVS_OK;
}

static void net_ring_free(void *ctx, void *ring)
{
    net_t *n = ctx;
    if (ring == NULL || n->owned == NULL || ring != kvs_ucx_region_base(n->owned)) return;
    if (n->region == n->owned) withdraw(n);
    kvs_ucx_region_destroy(n->owned);
    n->owned = NULL;
}

/* Prefill: the decode ring through shared memory, once wired up to it (else staged writes). */
static kvs_status_t net_map(void *ctx, uint32_t id, uint64_t offset, uint64_t len, uint8_t **ptr_p,
                            int *host_p)
{
    net_t *n = ctx;
    uint32_t peer = 0;
    if (n->cfg.side != KVS_SIDE_PREFILL) return KVS_ERR_INVALID;
    maybe_service(n);
    if (kvs_zch_peer_index(n->ch, id, &peer) != KVS_OK) return KVS_ERR_NOT_FOUND;
    npeer_t *p = &n->peers[peer];
    if (p->dead) return KVS_ERR_IO;
    if (!wired(p)) {
        /* A wireup this life of the peer refused (as waiting writes fail with it). */
        if (p->wire_error != KVS_OK && p->wire_error_inc == kvs_zch_peer_incarnation(n->ch, peer))
            return p->wire_error;
        /* Ask now: the caller asks again and finds the ring mapped once the wireup lands. */
        send_wireup_req(n, peer, kvs_now_ns());
        return KVS_INPROGRESS;
    }
    if (p->ipc_ready) return n->ipc->ops->map(n->ipc->ctx, peer, offset, len, ptr_p, host_p);
    *host_p = 1; /* UCX moves host memory only */
    if (kvs_ucx_remote_failed(p->remote)) return KVS_ERR_IO;
    const uint64_t size = kvs_ucx_remote_size(p->remote);
    if (offset > size || len > size - offset) return KVS_ERR_INVALID;
    uint8_t *m = kvs_ucx_remote_map(p->remote, offset, len);
    if (m == NULL) return KVS_ERR_UNSUPPORTED; /* tcp: not mappable */
    *ptr_p = m;
    return KVS_OK;
}

static kvs_status_t net_flush(void *ctx)
{
    net_t *n = ctx;
    service(n);
    /* Completed puts were confirmed by the writer's flush before it sent CHUNK_READY: the bytes
     * are in our memory; order our later reads after everything seen so far. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return KVS_OK;
}

static kvs_status_t net_peer_status(void *ctx, uint32_t id)
{
    net_t *n = ctx;
    uint32_t peer = 0;
    maybe_service(n);
    kvs_status_t st = peer_index(n, id, &peer);
    return st != KVS_OK ? st : kvs_zch_peer_status(n->ch, peer);
}

static void net_destroy(void *ctx)
{
    net_t *n = ctx;
    void *v;
    for (size_t it = 0; kvs_map_next(&n->writes, &it, NULL, &v);) {
        nwrite_t *w = v;
        kvs_ucx_put_release(w->put);
        kvs_free(w->bounce);
        kvs_free(w);
    }
    kvs_map_fini(&n->writes);
    for (uint32_t i = 0; i < kvs_zch_peers(n->ch); i++)
        if (kvs_zch_peer_open(n->ch, i))
            drop_remote(n, i, kvs_zch_peer_status(n->ch, i) != KVS_OK, "the link is closing");
    withdraw(n);
    if (n->owned != NULL) kvs_ucx_region_destroy(n->owned); /* the receiver did not free it */
    kvs_link_destroy(n->ipc); /* waits for peer copies still reading staging buffers */
    kvs_ucx_destroy(n->ucx);
    kvs_zch_destroy(n->ch);
    while (n->inbox_count > 0) {
        kvs_free(n->inbox[n->inbox_head]);
        n->inbox_head = (n->inbox_head + 1) % INBOX_CAP;
        n->inbox_count--;
    }
    kvs_free(n->peers);
    kvs_free(n);
}

static int net_shares_device(void *ctx, uint32_t id)
{
    net_t *n = ctx;
    uint32_t peer = 0;
    if (n->cfg.side != KVS_SIDE_PREFILL || kvs_zch_peer_index(n->ch, id, &peer) != KVS_OK) return 0;
    const npeer_t *p = &n->peers[peer];
    return wired(p) && p->same_device; /* set only for an imported GPU ring */
}

static const kvs_link_ops_t net_ops = {
    .name = "net",
    .send = net_send,
    .recv = net_recv,
    .write = net_write,
    .write_poll = net_write_poll,
    .map = net_map,
    .ring_alloc = net_ring_alloc,
    .ring_free = net_ring_free,
    .expose = net_expose,
    .flush = net_flush,
    .peer_status = net_peer_status,
    .shares_device = net_shares_device,
    .destroy = net_destroy,
};

/* ---- public API ---- */

/* 1 if an endpoint can only be reached from this host and network namespace. */
static int endpoint_local(const char *ep)
{
    static const char *const local[] = {"ipc://",           "inproc://",    "tcp://127.",
                                        "tcp://localhost:", "tcp://[::1]:", "tcp://lo:"};
    for (size_t i = 0; i < sizeof(local) / sizeof(local[0]); i++)
        if (strncmp(ep, local[i], strlen(local[i])) == 0) return 1;
    return 0;
}

/* Picks UCX_TLS and the error mode for the data plane. */
static void choose_data(const kvs_net_config_t *c, kvs_ucx_config_t *u_p)
{
    memset(u_p, 0, sizeof(*u_p));
    kvs_net_data_t data = c->data;
    const char *env = getenv("UCX_TLS");
    if (data == KVS_NET_DATA_AUTO && env != NULL && env[0] != '\0') {
        /* The operator chose; PEER error mode would silently drop shared memory from it. */
        int shm = strstr(env, "sm") || strstr(env, "posix") || strstr(env, "sysv") ||
                  strstr(env, "cma") || strstr(env, "all");
        u_p->tls = NULL;
        u_p->peer_errors = !shm;
        u_p->net_devices = c->net_device;
        kvs_info("net link: data plane uses UCX_TLS=%s from the environment", env);
        return;
    }
    if (data == KVS_NET_DATA_AUTO) {
        int local = endpoint_local(c->bind);
        for (uint32_t i = 0; i < c->peer_tp; i++)
            if (c->peers[i] != NULL && !endpoint_local(c->peers[i])) local = 0;
        data = local ? KVS_NET_DATA_SHM : KVS_NET_DATA_TCP;
    }
    if (data == KVS_NET_DATA_SHM) {
        u_p->tls = "sm";
        u_p->peer_errors = 0;
    } else {
        u_p->tls = "tcp";
        u_p->peer_errors = 1;
        u_p->net_devices = c->net_device;
    }
    kvs_info("net link: data plane uses UCX_TLS=%s", u_p->tls);
}

kvs_status_t kvs_net_link_create(const kvs_net_config_t *config, kvs_link_t **link_p)
{
    if ((config->side != KVS_SIDE_PREFILL && config->side != KVS_SIDE_DECODE) ||
        config->peer_tp == 0 || config->peer_tp > KVS_MAX_TP || config->bind == NULL ||
        config->data > KVS_NET_DATA_TCP || config->max_instances > KVS_NET_MAX_INSTANCES) {
        kvs_error("net link: needs a side, 1..%u peers, a bind endpoint, a data transport and at "
                  "most %u decode instances",
                  KVS_MAX_TP, KVS_NET_MAX_INSTANCES);
        return KVS_ERR_INVALID;
    }
    const int multi = config->side == KVS_SIDE_PREFILL && config->max_instances > 1;
    for (uint32_t i = 0; multi && i < config->peer_tp; i++) {
        if (config->peers[i] != NULL) {
            kvs_error("net link: a prefill rank serving several decode instances learns their "
                      "endpoints from their heartbeats; configure no peers");
            return KVS_ERR_INVALID;
        }
    }
    const uint32_t groups = multi ? config->max_instances : 1;
    net_t *n = kvs_calloc(1, sizeof(*n));
    kvs_link_t *link = kvs_malloc(sizeof(*link));
    if (n != NULL) n->peers = kvs_calloc((size_t) groups * config->peer_tp, sizeof(*n->peers));
    if (n == NULL || link == NULL || n->peers == NULL) {
        if (n != NULL) kvs_free(n->peers);
        kvs_free(n);
        kvs_free(link);
        return KVS_ERR_NOMEM;
    }
    n->cfg = *config;
    kvs_net_config_t *c = &n->cfg;
    c->max_instances = groups;
    if (c->heartbeat_ns == 0) c->heartbeat_ns = DEFAULT_HEARTBEAT;
    if (c->liveness_timeout_ns == 0) c->liveness_timeout_ns = DEFAULT_LIVENESS;
    if (c->connect_timeout_ns == 0) c->connect_timeout_ns = DEFAULT_CONNECT;
    if (c->write_timeout_ns == 0) c->write_timeout_ns = DEFAULT_WRITE;
    kvs_map_init(&n->writes);
    kvs_ucx_config_t uc;
    choose_data(config, &uc);
    kvs_zch_config_t zc = {
        .side = c->side,
        .rank = c->rank,
        .peer_tp = c->peer_tp,
        .max_groups = groups,
        .instance = c->instance,
        .bind = config->bind,
        .heartbeat_ns = c->heartbeat_ns,
        .liveness_timeout_ns = c->liveness_timeout_ns,
        .connect_timeout_ns = c->connect_timeout_ns,
    };
    kvs_status_t st = kvs_zch_create(&zc, &n->ch);
    if (st != KVS_OK) goto err_free;
    for (uint32_t i = 0; i < c->peer_tp; i++) {
        if (config->peers[i] == NULL) continue;
        if ((st = kvs_zch_set_peer(n->ch, i, config->peers[i])) != KVS_OK) goto err_ch;
    }
    if ((st = kvs_ucx_create(&uc, &n->ucx)) != KVS_OK) goto err_ch;
    if (c->mem == KVS_MEM_DEVICE) {
        kvs_cuda_ipc_config_t ic = {
            .side = c->side, .rank = c->rank, .peer_tp = groups * c->peer_tp, .device = c->device};
        if ((st = kvs_cuda_ipc_link_create(&ic, &n->ipc)) != KVS_OK) {
            kvs_ucx_destroy(n->ucx);
            goto err_ch;
        }
    }
    if (config->registry != NULL && c->side == KVS_SIDE_DECODE)
        snprintf(n->registry, sizeof(n->registry), "%s", config->registry);
    /* Nothing below keeps the caller's strings. */
    c->bind = NULL;
    c->net_device = NULL;
    c->registry = NULL;
    memset(c->peers, 0, sizeof(c->peers));
    link->ops = &net_ops;
    link->ctx = n;
    *link_p = link;
    return KVS_OK;

err_ch:
    kvs_zch_destroy(n->ch);
err_free:
    kvs_map_fini(&n->writes);
    kvs_free(n->peers);
    kvs_free(n);
    kvs_free(link);
    return st;
}

static net_t *net_of(kvs_link_t *link)
{
    if (link == NULL || link->ops != &net_ops) {
        kvs_error("net link: not a net link");
        return NULL;
    }
    return link->ctx;
}

const char *kvs_net_link_endpoint(kvs_link_t *link)
{
    net_t *n = net_of(link);
    return n ? kvs_zch_endpoint(n->ch) : NULL;
}

kvs_status_t kvs_net_link_set_peer(kvs_link_t *link, uint32_t rank, const char *endpoint)
{
    net_t *n = net_of(link);
    if (n == NULL) return KVS_ERR_INVALID;
    if (n->cfg.max_instances > 1) {
        kvs_error("net link: prefill rank %u learns its decode peers from their heartbeats",
                  n->cfg.rank);
        return KVS_ERR_INVALID;
    }
    return kvs_zch_set_peer(n->ch, rank, endpoint);
}

int kvs_net_link_wait(kvs_link_t *const *links, uint32_t n, int fd, uint64_t timeout_us)
{
    fd_set in;
    FD_ZERO(&in);
    int top = -1;
    if (fd >= 0 && fd < FD_SETSIZE) {
        FD_SET(fd, &in);
        top = fd;
    }
    for (uint32_t i = 0; i < n; i++) {
        net_t *nt = links[i] != NULL ? net_of(links[i]) : NULL;
        if (nt == NULL) continue;
        int zfd = -1;
        if (nt->inbox_count > 0 || kvs_zch_wait_fd(nt->ch, &zfd)) return 1;
        if (zfd >= FD_SETSIZE) continue; /* only the timeout wakes for it */
        FD_SET(zfd, &in);
        if (zfd > top) top = zfd;
    }
    const struct timespec ts = {(time_t) (timeout_us / 1000000),
                                (long) (timeout_us % 1000000) * 1000};
    return pselect(top + 1, &in, NULL, NULL, &ts, NULL) > 0;
}

uint32_t kvs_net_link_progress(kvs_link_t *link)
{
    net_t *n = net_of(link);
    return n ? service(n) : 0;
}

kvs_status_t kvs_net_link_stats(kvs_link_t *link, kvs_net_stats_t *stats_p)
{
    net_t *n = net_of(link);
    if (n == NULL) return KVS_ERR_INVALID;
    kvs_zch_stats_t z;
    kvs_zch_stats(n->ch, &z);
    kvs_net_stats_t s = n->st;
    s.msgs_sent = z.sent;
    s.msgs_received = z.received;
    s.bytes_sent = z.bytes_sent;
    s.bytes_received = z.bytes_received;
    s.send_failures = z.send_failures;
    s.heartbeats_sent = z.heartbeats_sent;
    s.heartbeats_received = z.heartbeats_received;
    s.rejected = z.rejected;
    s.stale = z.stale;
    s.dead_peers = z.dead_peers;
    s.peer_restarts = z.restarts;
    s.peer_instances = kvs_zch_groups(n->ch);
    s.instances_refused = z.groups_refused;
    s.writes_in_flight = n->writes.count;
    *stats_p = s;
    return KVS_OK;
}
