/* The ZeroMQ control channel of a net link: PULL in, one PUSH per peer out, a validated frame
 * header, heartbeats that also announce where this rank listens, liveness per peer, and (with
 * max_groups > 1) peer groups, one per instance of the other side, keyed by the instance every
 * frame names.
 *
 * Socket choices follow the failure behaviour measured on this platform: a send never blocks
 * (ZMQ_DONTWAIT, EAGAIN is a failed send), ZMQ_IMMEDIATE keeps frames from queueing towards a
 * peer that is not connected, ZMQ_LINGER=0 makes close and shutdown immediate, high-water marks
 * bound every queue, and ZMQ_MAXMSGSIZE bounds what a peer can make us allocate. */
#include "base/bytes.h"
#include "control/zmq_channel.h"

#include <errno.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/layout.h"
#include "kvstage/log.h"
#include "kvstage/msg.h"

#define SEND_HWM         4096    /* frames queued towards one peer */
#define RECV_HWM         16384   /* frames queued per incoming connection */
#define MAX_WIRE_SIZE    1048576 /* larger messages make ZeroMQ drop the connection */
#define RECONNECT_MS     100
#define RECONNECT_MAX_MS 1000
#define HELLO_RETRY_NS   20000000ull /* heartbeat retry while a peer is not connected yet */
#define HEARTBEAT_FIXED  10          /* seq u64 + endpoint length u16 */
#define RECV_BATCH       1024        /* frames one recv call may drop before returning */

typedef struct {
    void *push;      /* ZMQ_PUSH connected to endpoint, or NULL */
    char *endpoint;  /* [KVS_ZCH_ENDPOINT_MAX + 1] */
    uint64_t inc;    /* incarnation last heard; 0: never */
    uint64_t ep_inc; /* incarnation that announced `endpoint`; 0: configured, unconfirmed */
    int disputed;    /* the peer announces another endpoint than the unconfirmed configured one */
    uint64_t heard;  /* when a valid frame last came; 0: never */
    uint64_t since;  /* start of the connect timeout (creation or endpoint change) */
    uint64_t next_hb;
    uint64_t hb_seq;
    int dead; /* reported dead; cleared when heard again */
    /* [KVS_ZCH_OUTBOX_MAX] protocol frames waiting for a connection still coming up (until
     * it is, ZMQ_IMMEDIATE fails every send): sent once it is, instead of being lost and
     * resent a retry period later. FIFO. */
    zmq_msg_t *outbox;
    uint32_t out_head, out_count;
} zpeer_t;

/* One instance of the other side (a group of peer_tp peers). */
typedef struct {
    int open;
    uint64_t instance; /* as its frames name it (max_groups > 1) */
    uint32_t group;    /* its number in peer ids: uses * max_groups + slot (uses from 1) */
    uint32_t uses;     /* instances this slot has held */
} zgroup_t;

struct kvs_zch {
    kvs_zch_config_t cfg; /* cfg.bind is not kept; cfg.max_groups at least 1 */
    void *zctx;
    void *pull;
    char endpoint[KVS_ZCH_ENDPOINT_MAX + 1];
    uint64_t incarnation;
    zpeer_t *peers;     /* [max_groups][peer_tp] */
    zgroup_t *groups;   /* [max_groups] */
    uint32_t npeers;    /* max_groups * peer_tp */
    uint32_t ngroups;   /* open */
    uint64_t full_warn; /* when "every slot is in use" may be logged again */
    zmq_msg_t msg;      /* the frame last returned by recv */
    int msg_live;
    kvs_zch_stats_t st;
};

/* Incarnations must differ between lives of a rank and between links of one process. Wall
 * time makes a restarted process's incarnation larger than its predecessor's on one host; the
 * counter keeps links created in the same nanosecond apart. */
static uint64_t new_incarnation(void)
{
    static uint64_t last;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t t = (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
    uint64_t prev = __atomic_load_n(&last, __ATOMIC_RELAXED);
    uint64_t next;
    do {
        next = t > prev ? t : prev + 1;
    } while (
        !__atomic_compare_exchange_n(&last, &prev, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return next;
}

static size_t kind_max(kvs_zch_kind_t kind)
{
    switch (kind) {
    case KVS_ZCH_MSG:
        return KVS_MSG_MAX_SIZE;
    case KVS_ZCH_HEARTBEAT:
        return HEARTBEAT_FIXED + KVS_ZCH_ENDPOINT_MAX;
    case KVS_ZCH_WIREUP_REQ:
    case KVS_ZCH_WIREUP:
        return KVS_ZCH_INTERNAL_MAX;
    }
    return 0;
}

/* An endpoint we may connect to: printable, bounded, tcp:// or ipc://, not a wildcard host. */
static int endpoint_ok(const char *ep, size_t len)
{
    if (len == 0 || len > KVS_ZCH_ENDPOINT_MAX) return 0;
    for (size_t i = 0; i < len; i++)
        if (ep[i] < 0x21 || ep[i] > 0x7e) return 0;
    if (len > 6 && strncmp(ep, "ipc://", 6) == 0) return 1;
    if (len <= 6 || strncmp(ep, "tcp://", 6) != 0) return 0;
    const char *host = ep + 6;
    size_t hlen = len - 6;
    static const char *const wild[] = {"*:", "0.0.0.0:", "[::]:", "[*]:"};
    for (size_t i = 0; i < sizeof(wild) / sizeof(wild[0]); i++) {
        size_t n = strlen(wild[i]);
        if (hlen >= n && strncmp(host, wild[i], n) == 0) return 0;
    }
    return memchr(host, ':', hlen) != NULL;
}

static int set_int(void *sock, int opt, int value)
{
    return zmq_setsockopt(sock, opt, &value, sizeof(value));
}

static int ms_of(uint64_t ns)
{
    uint64_t ms = ns / 1000000ull;
    if (ms == 0) ms = 1;
    return ms > 0x7fffffff ? 0x7fffffff : (int) ms;
}

kvs_status_t kvs_zch_create(const kvs_zch_config_t *config, kvs_zch_t **ch_p)
{
    if (config->peer_tp == 0 || config->peer_tp > KVS_MAX_TP || config->bind == NULL ||
        config->max_groups > KVS_PEER_MAX_GROUP || strlen(config->bind) > KVS_ZCH_ENDPOINT_MAX ||
        config->heartbeat_ns == 0 || config->liveness_timeout_ns == 0 ||
        config->connect_timeout_ns == 0) {
        kvs_error("zmq channel: needs 1..%u peers, at most %u peer groups, a bind endpoint of "
                  "at most %u bytes and non-zero timeouts",
                  KVS_MAX_TP, KVS_PEER_MAX_GROUP, KVS_ZCH_ENDPOINT_MAX);
        return KVS_ERR_INVALID;
    }
    kvs_zch_t *ch = kvs_calloc(1, sizeof(*ch));
    if (ch == NULL) return KVS_ERR_NOMEM;
    const uint32_t groups = config->max_groups > 1 ? config->max_groups : 1;
    ch->npeers = groups * config->peer_tp;
    ch->peers = kvs_calloc(ch->npeers, sizeof(*ch->peers));
    ch->groups = kvs_calloc(groups, sizeof(*ch->groups));
    if (ch->peers == NULL || ch->groups == NULL) {
        kvs_free(ch->peers);
        kvs_free(ch->groups);
        kvs_free(ch);
        return KVS_ERR_NOMEM;
    }
    ch->cfg = *config;
    ch->cfg.bind = NULL;
    ch->cfg.max_groups = groups;
    if (groups == 1) {
        ch->groups[0].open = 1; /* the one instance, whatever it calls itself */
        ch->ngroups = 1;
    }
    kvs_status_t st = KVS_ERR_IO;
    ch->zctx = zmq_ctx_new();
    if (ch->zctx == NULL) {
        kvs_error("zmq channel: cannot create a context: %s", zmq_strerror(errno));
        goto err_peers;
    }
    /* One I/O thread is plenty for control traffic; BLOCKY=0 keeps shutdown from waiting. */
    zmq_ctx_set(ch->zctx, ZMQ_IO_THREADS, 1);
    zmq_ctx_set(ch->zctx, ZMQ_BLOCKY, 0);
    ch->pull = zmq_socket(ch->zctx, ZMQ_PULL);
    if (ch->pull == NULL) {
        kvs_error("zmq channel: cannot create the PULL socket: %s", zmq_strerror(errno));
        goto err_ctx;
    }
    int64_t maxmsg = MAX_WIRE_SIZE;
    if (set_int(ch->pull, ZMQ_LINGER, 0) != 0 || set_int(ch->pull, ZMQ_RCVHWM, RECV_HWM) != 0 ||
        zmq_setsockopt(ch->pull, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg)) != 0) {
        kvs_error("zmq channel: cannot set PULL socket options: %s", zmq_strerror(errno));
        goto err_pull;
    }
    if (zmq_bind(ch->pull, config->bind) != 0) {
        kvs_error("zmq channel: cannot bind %s: %s", config->bind, zmq_strerror(errno));
        st = errno == EINVAL || errno == EPROTONOSUPPORT ? KVS_ERR_INVALID : KVS_ERR_IO;
        goto err_pull;
    }
    size_t eplen = sizeof(ch->endpoint);
    if (zmq_getsockopt(ch->pull, ZMQ_LAST_ENDPOINT, ch->endpoint, &eplen) != 0) {
        kvs_error("zmq channel: cannot read the bound endpoint: %s", zmq_strerror(errno));
        goto err_pull;
    }
    ch->endpoint[sizeof(ch->endpoint) - 1] = '\0';
    ch->incarnation = new_incarnation();
    uint64_t now = kvs_now_ns();
    for (uint32_t i = 0; i < ch->npeers; i++) ch->peers[i].since = now;
    kvs_debug("zmq channel: %s rank %u listens on %s (incarnation %llx)",
              config->side == KVS_SIDE_PREFILL ? "prefill" : "decode", config->rank, ch->endpoint,
              (unsigned long long) ch->incarnation);
    *ch_p = ch;
    return KVS_OK;

err_pull:
    zmq_close(ch->pull);
err_ctx:
    zmq_ctx_term(ch->zctx);
err_peers:
    kvs_free(ch->peers);
    kvs_free(ch->groups);
    kvs_free(ch);
    return st;
}

static void drop_outbox(zpeer_t *p)
{
    for (uint32_t i = 0; i < p->out_count; i++)
        zmq_msg_close(&p->outbox[(p->out_head + i) % KVS_ZCH_OUTBOX_MAX]);
    p->out_head = p->out_count = 0;
}

/* Closes the peer's socket; frames it holds stay for the next connection (they are protocol
 * messages for that rank, whichever endpoint it now has). */
static void close_peer(zpeer_t *p)
{
    if (p->push != NULL) zmq_close(p->push);
    p->push = NULL;
    kvs_free(p->endpoint);
    p->endpoint = NULL;
}

void kvs_zch_destroy(kvs_zch_t *ch)
{
    if (ch == NULL) return;
    if (ch->msg_live) zmq_msg_close(&ch->msg);
    for (uint32_t i = 0; i < ch->npeers; i++) {
        close_peer(&ch->peers[i]);
        drop_outbox(&ch->peers[i]);
        kvs_free(ch->peers[i].outbox);
    }
    zmq_close(ch->pull);
    zmq_ctx_term(ch->zctx);
    kvs_free(ch->peers);
    kvs_free(ch->groups);
    kvs_free(ch);
}

const char *kvs_zch_endpoint(const kvs_zch_t *ch)
{
    return ch->endpoint;
}

static const zgroup_t *group_of(const kvs_zch_t *ch, uint32_t peer)
{
    return &ch->groups[peer / ch->cfg.peer_tp];
}

uint32_t kvs_zch_peers(const kvs_zch_t *ch)
{
    return ch->npeers;
}

int kvs_zch_peer_open(const kvs_zch_t *ch, uint32_t peer)
{
    return peer < ch->npeers && group_of(ch, peer)->open;
}

uint32_t kvs_zch_peer_id(const kvs_zch_t *ch, uint32_t peer)
{
    return kvs_peer_id(group_of(ch, peer)->group, peer % ch->cfg.peer_tp);
}

kvs_status_t kvs_zch_peer_index(const kvs_zch_t *ch, uint32_t id, uint32_t *index_p)
{
    const uint32_t rank = kvs_peer_rank(id), group = kvs_peer_group(id);
    if (rank >= ch->cfg.peer_tp) return KVS_ERR_INVALID;
    const uint32_t slot = group % ch->cfg.max_groups;
    if (!ch->groups[slot].open || ch->groups[slot].group != group) return KVS_ERR_NOT_FOUND;
    *index_p = slot * ch->cfg.peer_tp + rank;
    return KVS_OK;
}

uint32_t kvs_zch_groups(const kvs_zch_t *ch)
{
    return ch->ngroups;
}

void kvs_zch_close_group(kvs_zch_t *ch, uint32_t peer)
{
    if (ch->cfg.max_groups == 1 || !kvs_zch_peer_open(ch, peer)) return;
    const uint32_t slot = peer / ch->cfg.peer_tp;
    zgroup_t *g = &ch->groups[slot];
    for (uint32_t r = 0; r < ch->cfg.peer_tp; r++) {
        zpeer_t *p = &ch->peers[slot * ch->cfg.peer_tp + r];
        close_peer(p);
        ch->st.send_failures += p->out_count;
        drop_outbox(p);
        zmq_msg_t *outbox = p->outbox;
        memset(p, 0, sizeof(*p));
        p->outbox = outbox;
    }
    kvs_info("zmq channel: rank %u closed peer group %u (instance %llx)", ch->cfg.rank, g->group,
             (unsigned long long) g->instance);
    g->open = 0;
    ch->ngroups--;
    ch->st.groups_closed++;
}

/* The group slot of a frame from `instance`: the open one, else a free one opened for it, else
 * -1 (every slot is in use). */
static int group_for(kvs_zch_t *ch, uint64_t instance, uint64_t now)
{
    if (ch->cfg.max_groups == 1) return 0;
    int free_slot = -1;
    for (uint32_t s = 0; s < ch->cfg.max_groups; s++) {
        if (ch->groups[s].open && ch->groups[s].instance == instance) return (int) s;
        if (!ch->groups[s].open && free_slot < 0) free_slot = (int) s;
    }
    if (free_slot < 0) {
        ch->st.groups_refused++;
        if (now >= ch->full_warn) {
            kvs_warn("zmq channel: rank %u: instance %llx refused, %u instances are connected "
                     "already",
                     ch->cfg.rank, (unsigned long long) instance, ch->cfg.max_groups);
            ch->full_warn = now + 1000000000ull;
        }
        return -1;
    }
    zgroup_t *g = &ch->groups[free_slot];
    /* Numbers from max_groups up (0 never names an instance here), within the id space. */
    const uint32_t uses_max = (KVS_PEER_MAX_GROUP + 1) / ch->cfg.max_groups - 1;
    g->uses = g->uses >= uses_max ? 1 : g->uses + 1;
    g->group = g->uses * ch->cfg.max_groups + (uint32_t) free_slot;
    g->instance = instance;
    g->open = 1;
    for (uint32_t r = 0; r < ch->cfg.peer_tp; r++)
        ch->peers[(uint32_t) free_slot * ch->cfg.peer_tp + r].since = now;
    ch->ngroups++;
    ch->st.groups_opened++;
    kvs_info("zmq channel: rank %u: instance %llx is peer group %u", ch->cfg.rank,
             (unsigned long long) instance, g->group);
    return free_slot;
}

uint64_t kvs_zch_peer_silence_ns(const kvs_zch_t *ch, uint32_t peer)
{
    if (!kvs_zch_peer_open(ch, peer)) return 0;
    const zpeer_t *p = &ch->peers[peer];
    const uint64_t now = kvs_now_ns(), from = p->heard ? p->heard : p->since;
    return now > from ? now - from : 0;
}

const char *kvs_zch_peer_endpoint(const kvs_zch_t *ch, uint32_t peer)
{
    return kvs_zch_peer_open(ch, peer) ? ch->peers[peer].endpoint : NULL;
}

uint64_t kvs_zch_incarnation(const kvs_zch_t *ch)
{
    return ch->incarnation;
}

static kvs_status_t connect_peer(kvs_zch_t *ch, uint32_t peer, const char *endpoint, size_t len,
                                 uint64_t ep_inc)
{
    zpeer_t *p = &ch->peers[peer];
    if (p->endpoint != NULL && strlen(p->endpoint) == len &&
        memcmp(p->endpoint, endpoint, len) == 0)
        return KVS_OK;
    char *copy = kvs_malloc(len + 1);
    if (copy == NULL) return KVS_ERR_NOMEM;
    memcpy(copy, endpoint, len);
    copy[len] = '\0';
    void *push = zmq_socket(ch->zctx, ZMQ_PUSH);
    if (push == NULL) {
        kvs_error("zmq channel: cannot create a PUSH socket: %s", zmq_strerror(errno));
        kvs_free(copy);
        return KVS_ERR_IO;
    }
    /* ZMTP heartbeats let ZeroMQ drop a connection whose peer vanished without a FIN (another
     * host crashed); ZMQ_IMMEDIATE then makes sends to it fail instead of queueing. */
    if (set_int(push, ZMQ_LINGER, 0) != 0 || set_int(push, ZMQ_IMMEDIATE, 1) != 0 ||
        set_int(push, ZMQ_SNDHWM, SEND_HWM) != 0 || set_int(push, ZMQ_SNDTIMEO, 0) != 0 ||
        set_int(push, ZMQ_RECONNECT_IVL, RECONNECT_MS) != 0 ||
        set_int(push, ZMQ_RECONNECT_IVL_MAX, RECONNECT_MAX_MS) != 0 ||
        set_int(push, ZMQ_HEARTBEAT_IVL, ms_of(ch->cfg.heartbeat_ns)) != 0 ||
        set_int(push, ZMQ_HEARTBEAT_TIMEOUT, ms_of(ch->cfg.liveness_timeout_ns)) != 0) {
        kvs_error("zmq channel: cannot set PUSH socket options: %s", zmq_strerror(errno));
        zmq_close(push);
        kvs_free(copy);
        return KVS_ERR_IO;
    }
    if (zmq_connect(push, copy) != 0) {
        kvs_error("zmq channel: cannot connect to %s: %s", copy, zmq_strerror(errno));
        zmq_close(push);
        kvs_free(copy);
        return KVS_ERR_INVALID;
    }
    close_peer(p);
    p->push = push;
    p->endpoint = copy;
    p->ep_inc = ep_inc;
    p->since = kvs_now_ns();
    p->next_hb = 0; /* say hello at once */
    kvs_debug("zmq channel: rank %u -> peer %u at %s", ch->cfg.rank, peer, copy);
    return KVS_OK;
}

kvs_status_t kvs_zch_set_peer(kvs_zch_t *ch, uint32_t peer, const char *endpoint)
{
    size_t len = endpoint ? strlen(endpoint) : 0;
    if (!kvs_zch_peer_open(ch, peer) || len == 0 || len > KVS_ZCH_ENDPOINT_MAX) {
        kvs_error("zmq channel: bad peer %u (of %u) or endpoint", peer, ch->npeers);
        return KVS_ERR_INVALID;
    }
    ch->peers[peer].disputed = 0;
    return connect_peer(ch, peer, endpoint, len, 0);
}

int kvs_zch_peer_disputed(const kvs_zch_t *ch, uint32_t peer)
{
    return kvs_zch_peer_open(ch, peer) && ch->peers[peer].disputed;
}

/* Sends what waits in the outbox, oldest first, until the connection refuses one; frames
 * still waiting when the connect window has passed are dropped (the protocol resends). */
static void flush_outbox(kvs_zch_t *ch, zpeer_t *p, uint64_t now)
{
    while (p->out_count > 0 && p->push != NULL) {
        zmq_msg_t *m = &p->outbox[p->out_head];
        const size_t len = zmq_msg_size(m);
        if (zmq_msg_send(m, p->push, ZMQ_DONTWAIT) < 0) break;
        ch->st.sent++;
        ch->st.bytes_sent += len - KVS_ZCH_HEADER_SIZE;
        p->out_head = (p->out_head + 1) % KVS_ZCH_OUTBOX_MAX;
        p->out_count--;
    }
    if (p->out_count > 0 && (p->dead || now - p->since >= ch->cfg.connect_timeout_ns)) {
        ch->st.send_failures += p->out_count;
        drop_outbox(p);
    }
}

/* Holds a protocol frame while the peer's connection comes up; 0 if it cannot be held. */
static int hold_frame(const kvs_zch_t *ch, zpeer_t *p, zmq_msg_t *m, uint64_t now)
{
    if (p->dead || now - p->since >= ch->cfg.connect_timeout_ns ||
        p->out_count == KVS_ZCH_OUTBOX_MAX)
        return 0;
    if (p->outbox == NULL &&
        (p->outbox = kvs_calloc(KVS_ZCH_OUTBOX_MAX, sizeof(zmq_msg_t))) == NULL)
        return 0;
    zmq_msg_t *slot = &p->outbox[(p->out_head + p->out_count) % KVS_ZCH_OUTBOX_MAX];
    zmq_msg_init(slot);
    zmq_msg_move(slot, m);
    zmq_msg_close(m);
    p->out_count++;
    return 1;
}

static kvs_status_t send_frame(kvs_zch_t *ch, uint32_t peer, kvs_zch_kind_t kind,
                               const void *payload, size_t len)
{
    zpeer_t *p = &ch->peers[peer];
    const uint64_t now = kvs_now_ns();
    if (p->out_count > 0) flush_outbox(ch, p, now);
    zmq_msg_t m;
    if (zmq_msg_init_size(&m, KVS_ZCH_HEADER_SIZE + len) != 0) return KVS_ERR_NOMEM;
    uint8_t *b = zmq_msg_data(&m);
    b[0] = (uint8_t) kind;
    b[1] = KVS_ZCH_VERSION;
    b[2] = (uint8_t) ch->cfg.side;
    b[3] = 0;
    kvs_put_u32(b + 4, ch->cfg.rank);
    kvs_put_u64(b + 8, ch->incarnation);
    kvs_put_u64(b + 16, ch->cfg.instance);
    if (len) memcpy(b + KVS_ZCH_HEADER_SIZE, payload, len);
    /* Behind held frames, before the peer's endpoint is known, or refused while its connection
     * may still be coming up: held. */
    if (kind == KVS_ZCH_MSG && (p->out_count > 0 || p->push == NULL) && hold_frame(ch, p, &m, now))
        return KVS_INPROGRESS;
    if (p->push == NULL) {
        zmq_msg_close(&m);
        kvs_debug("zmq channel: no endpoint for peer %u yet", peer);
        return KVS_ERR_IO;
    }
    if (zmq_msg_send(&m, p->push, ZMQ_DONTWAIT) < 0) {
        int err = errno;
        if (kind == KVS_ZCH_MSG && err == EAGAIN && hold_frame(ch, p, &m, now))
            return KVS_INPROGRESS;
        zmq_msg_close(&m);
        /* EAGAIN: not connected (ZMQ_IMMEDIATE) or the queue is full; either way not sent. */
        kvs_debug("zmq channel: send to peer %u failed: %s", peer, zmq_strerror(err));
        return KVS_ERR_IO;
    }
    return KVS_OK;
}

kvs_status_t kvs_zch_send(kvs_zch_t *ch, uint32_t peer, kvs_zch_kind_t kind, const void *payload,
                          size_t len)
{
    if (!kvs_zch_peer_open(ch, peer) || kind_max(kind) == 0 || len > kind_max(kind) ||
        kind == KVS_ZCH_HEARTBEAT) {
        kvs_error("zmq channel: cannot send a %zu-byte frame of kind %d to peer %u (of %u)", len,
                  (int) kind, peer, ch->npeers);
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = send_frame(ch, peer, kind, payload, len);
    if (st == KVS_INPROGRESS) return KVS_OK; /* held; counted as sent when it goes out */
    if (st != KVS_OK) {
        if (kind == KVS_ZCH_MSG) ch->st.send_failures++;
        return st;
    }
    if (kind == KVS_ZCH_MSG) {
        ch->st.sent++;
        ch->st.bytes_sent += len;
    } else {
        ch->st.internal_sent++;
    }
    return KVS_OK;
}

static int send_heartbeat(kvs_zch_t *ch, uint32_t peer)
{
    zpeer_t *p = &ch->peers[peer];
    uint8_t b[HEARTBEAT_FIXED + KVS_ZCH_ENDPOINT_MAX];
    size_t eplen = strlen(ch->endpoint);
    kvs_put_u64(b, p->hb_seq + 1);
    b[8] = (uint8_t) eplen;
    b[9] = (uint8_t) (eplen >> 8);
    memcpy(b + HEARTBEAT_FIXED, ch->endpoint, eplen);
    if (send_frame(ch, peer, KVS_ZCH_HEARTBEAT, b, HEARTBEAT_FIXED + eplen) != KVS_OK) return 0;
    p->hb_seq++;
    ch->st.heartbeats_sent++;
    return 1;
}

/* Liveness of one peer at time now, counting alive -> dead transitions once. */
static int peer_alive(kvs_zch_t *ch, uint32_t peer, uint64_t now)
{
    zpeer_t *p = &ch->peers[peer];
    int alive = p->heard ? now < p->heard + ch->cfg.liveness_timeout_ns
                         : now < p->since + ch->cfg.connect_timeout_ns;
    if (!alive && !p->dead) {
        p->dead = 1;
        ch->st.dead_peers++;
        if (p->heard)
            kvs_warn("zmq channel: rank %u: peer %u silent for %llu ms, considered dead",
                     ch->cfg.rank, peer, (unsigned long long) ((now - p->heard) / 1000000ull));
        else
            kvs_warn("zmq channel: rank %u: peer %u (%s) not heard within %llu ms of connecting",
                     ch->cfg.rank, peer, p->endpoint ? p->endpoint : "no endpoint",
                     (unsigned long long) (ch->cfg.connect_timeout_ns / 1000000ull));
    }
    return alive;
}

int kvs_zch_wait_fd(kvs_zch_t *ch, int *fd_p)
{
    int events = 0, fd = -1;
    size_t len = sizeof(events), fd_len = sizeof(fd);
    if (zmq_getsockopt(ch->pull, ZMQ_EVENTS, &events, &len) != 0 || (events & ZMQ_POLLIN)) return 1;
    if (zmq_getsockopt(ch->pull, ZMQ_FD, &fd, &fd_len) != 0 || fd < 0) return 1;
    *fd_p = fd;
    return 0;
}

uint32_t kvs_zch_tick(kvs_zch_t *ch)
{
    uint64_t now = kvs_now_ns();
    uint32_t sent = 0;
    for (uint32_t i = 0; i < ch->npeers; i++) {
        zpeer_t *p = &ch->peers[i];
        if (!group_of(ch, i)->open) continue;
        peer_alive(ch, i, now);
        if (p->out_count > 0) flush_outbox(ch, p, now);
        if (p->push == NULL || now < p->next_hb) continue;
        if (send_heartbeat(ch, i)) {
            sent++;
            p->next_hb = now + ch->cfg.heartbeat_ns;
        } else {
            /* Not connected yet: retry soon so the peer hears of us quickly. */
            uint64_t retry =
                ch->cfg.heartbeat_ns < HELLO_RETRY_NS ? ch->cfg.heartbeat_ns : HELLO_RETRY_NS;
            p->next_hb = now + retry;
        }
    }
    return sent;
}

kvs_status_t kvs_zch_peer_status(kvs_zch_t *ch, uint32_t peer)
{
    if (peer >= ch->npeers) {
        kvs_error("zmq channel: no peer %u (of %u)", peer, ch->npeers);
        return KVS_ERR_INVALID;
    }
    if (!group_of(ch, peer)->open) return KVS_ERR_IO;
    return peer_alive(ch, peer, kvs_now_ns()) ? KVS_OK : KVS_ERR_IO;
}

uint64_t kvs_zch_peer_incarnation(const kvs_zch_t *ch, uint32_t peer)
{
    return kvs_zch_peer_open(ch, peer) ? ch->peers[peer].inc : 0;
}

void kvs_zch_count_rejected(kvs_zch_t *ch)
{
    ch->st.rejected++;
}

void kvs_zch_stats(const kvs_zch_t *ch, kvs_zch_stats_t *stats_p)
{
    *stats_p = ch->st;
}

/* Accepts a frame from incarnation inc of peer, or says it is stale. A larger incarnation is a
 * restart; a smaller one is a late frame from an earlier life, unless the current life has
 * gone silent (a restarted peer whose clock is behind must still get back in). */
static int accept_incarnation(kvs_zch_t *ch, uint32_t peer, uint64_t inc, uint64_t now)
{
    zpeer_t *p = &ch->peers[peer];
    if (inc == p->inc) return 1;
    if (p->inc != 0 && inc < p->inc && peer_alive(ch, peer, now)) return 0;
    if (p->inc != 0) {
        ch->st.restarts++;
        kvs_info("zmq channel: rank %u: peer %u restarted (incarnation %llx -> %llx)", ch->cfg.rank,
                 peer, (unsigned long long) p->inc, (unsigned long long) inc);
    }
    p->inc = inc;
    p->next_hb = 0; /* greet the new life at once */
    return 1;
}

/* Validates a heartbeat payload; on success returns the announced endpoint. */
static int parse_heartbeat(const uint8_t *b, size_t len, const char **ep_p, size_t *eplen_p)
{
    if (len < HEARTBEAT_FIXED) return 0;
    size_t eplen = (size_t) b[8] | ((size_t) b[9] << 8);
    if (len != HEARTBEAT_FIXED + eplen || eplen > KVS_ZCH_ENDPOINT_MAX) return 0;
    const char *ep = (const char *) b + HEARTBEAT_FIXED;
    for (size_t i = 0; i < eplen; i++)
        if (ep[i] < 0x21 || ep[i] > 0x7e) return 0;
    *ep_p = ep;
    *eplen_p = eplen;
    return 1;
}

/* A heartbeat tells where its sender listens. It is adopted when we know no endpoint for the
 * peer, or when ours was announced by an earlier life of the peer (a restart on another port).
 * An endpoint configured by the caller and never announced otherwise wins: it may be an address
 * the peer cannot know (e.g. behind a proxy). */
static void learn_endpoint(kvs_zch_t *ch, uint32_t peer, uint64_t inc, const char *ep, size_t eplen)
{
    zpeer_t *p = &ch->peers[peer];
    if (!endpoint_ok(ep, eplen)) return;
    if (p->endpoint != NULL) {
        if (strlen(p->endpoint) == eplen && memcmp(p->endpoint, ep, eplen) == 0) {
            p->ep_inc = inc; /* confirmed by this life */
            p->disputed = 0;
            return;
        }
        /* Keep a configured endpoint (a proxy address?), but let the owner of the
         * configuration look again (kvs_zch_peer_disputed): it may be a dead life's. */
        if (p->ep_inc == 0) p->disputed = 1;
        if (p->ep_inc == 0 || p->ep_inc == inc) return;
    }
    if (connect_peer(ch, peer, ep, eplen, inc) == KVS_OK)
        kvs_debug("zmq channel: rank %u learned peer %u's endpoint %.*s", ch->cfg.rank, peer,
                  (int) eplen, ep);
}

static void drop_msg(kvs_zch_t *ch)
{
    if (ch->msg_live) zmq_msg_close(&ch->msg);
    ch->msg_live = 0;
}

kvs_status_t kvs_zch_recv(kvs_zch_t *ch, kvs_zch_frame_t *frame_p)
{
    drop_msg(ch);
    for (uint32_t n = 0; n < RECV_BATCH; n++) {
        zmq_msg_init(&ch->msg);
        ch->msg_live = 1;
        if (zmq_msg_recv(&ch->msg, ch->pull, ZMQ_DONTWAIT) < 0) {
            drop_msg(ch);
            return KVS_INPROGRESS; /* EAGAIN, or EINTR: nothing now either way */
        }
        if (zmq_msg_more(&ch->msg)) {
            /* Our frames are single-part: drain and drop the whole multi-part message. */
            while (zmq_msg_more(&ch->msg)) {
                drop_msg(ch);
                zmq_msg_init(&ch->msg);
                ch->msg_live = 1;
                if (zmq_msg_recv(&ch->msg, ch->pull, ZMQ_DONTWAIT) < 0) break;
            }
            drop_msg(ch);
            ch->st.rejected++;
            kvs_debug("zmq channel: dropped a multi-part message");
            continue;
        }
        const uint8_t *b = zmq_msg_data(&ch->msg);
        size_t size = zmq_msg_size(&ch->msg);
        kvs_side_t other = ch->cfg.side == KVS_SIDE_PREFILL ? KVS_SIDE_DECODE : KVS_SIDE_PREFILL;
        kvs_zch_kind_t kind = size ? (kvs_zch_kind_t) b[0] : (kvs_zch_kind_t) 0;
        if (size < KVS_ZCH_HEADER_SIZE || kind_max(kind) == 0 || b[1] != KVS_ZCH_VERSION ||
            b[2] != (uint8_t) other || b[3] != 0 || kvs_get_u32(b + 4) >= ch->cfg.peer_tp ||
            kvs_get_u64(b + 8) == 0 || size - KVS_ZCH_HEADER_SIZE > kind_max(kind)) {
            ch->st.rejected++;
            kvs_debug("zmq channel: rejected a %zu-byte frame (kind %u)", size, size ? b[0] : 0u);
            drop_msg(ch);
            continue;
        }
        uint32_t rank = kvs_get_u32(b + 4);
        uint64_t inc = kvs_get_u64(b + 8);
        uint64_t instance = kvs_get_u64(b + 16);
        const uint8_t *payload = b + KVS_ZCH_HEADER_SIZE;
        size_t len = size - KVS_ZCH_HEADER_SIZE;
        const char *ep = NULL;
        size_t eplen = 0;
        if (kind == KVS_ZCH_HEARTBEAT && !parse_heartbeat(payload, len, &ep, &eplen)) {
            ch->st.rejected++;
            kvs_debug("zmq channel: rejected a malformed heartbeat from rank %u", rank);
            drop_msg(ch);
            continue;
        }
        uint64_t now = kvs_now_ns();
        const int slot = group_for(ch, instance, now);
        if (slot < 0) {
            drop_msg(ch);
            continue;
        }
        const uint32_t from = (uint32_t) slot * ch->cfg.peer_tp + rank;
        zpeer_t *p = &ch->peers[from];
        if (!accept_incarnation(ch, from, inc, now)) {
            ch->st.stale++;
            drop_msg(ch);
            continue;
        }
        p->heard = now;
        if (p->dead) {
            p->dead = 0;
            kvs_info("zmq channel: rank %u: peer %u is back", ch->cfg.rank, from);
        }
        if (kind == KVS_ZCH_HEARTBEAT) {
            ch->st.heartbeats_received++;
            learn_endpoint(ch, from, inc, ep, eplen);
            drop_msg(ch);
            continue;
        }
        if (kind == KVS_ZCH_MSG) {
            ch->st.received++;
            ch->st.bytes_received += len;
        } else {
            ch->st.internal_received++;
        }
        frame_p->kind = kind;
        frame_p->from = from;
        frame_p->incarnation = inc;
        frame_p->payload = payload;
        frame_p->len = len;
        return KVS_OK;
    }
    return KVS_INPROGRESS;
}
