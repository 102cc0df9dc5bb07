/* Default timeouts and message I/O shared by sender and receiver. */
#include "pd/pd_internal.h"

#include "kvstage/grid.h"
#include "kvstage/log.h"

void kvs_pd_timeouts_default(kvs_pd_timeouts_t *timeouts_p)
{
    const uint64_t ms = 1000000ull;
    timeouts_p->retry_ns = 200 * ms;
    timeouts_p->bootstrap_timeout_ns = 30000 * ms;
    timeouts_p->transfer_timeout_ns = 60000 * ms;
    timeouts_p->waiting_timeout_ns = 300000 * ms;
    timeouts_p->completion_timeout_ns = 30000 * ms;
    timeouts_p->release_timeout_ns = 30000 * ms;
}

void kvs_pd_timeouts_fill(kvs_pd_timeouts_t *t, const kvs_pd_timeouts_t *d)
{
    if (!t->retry_ns) t->retry_ns = d->retry_ns;
    if (!t->bootstrap_timeout_ns) t->bootstrap_timeout_ns = d->bootstrap_timeout_ns;
    if (!t->transfer_timeout_ns) t->transfer_timeout_ns = d->transfer_timeout_ns;
    if (!t->waiting_timeout_ns) t->waiting_timeout_ns = d->waiting_timeout_ns;
    if (!t->completion_timeout_ns) t->completion_timeout_ns = d->completion_timeout_ns;
    if (!t->release_timeout_ns) t->release_timeout_ns = d->release_timeout_ns;
}

/* The room a message names (every room message starts with it), for the trace. */
static void trace_msg(const char *what, uint32_t peer, const kvs_msg_t *m)
{
    if (!kvs_log_enabled(KVS_LOG_TRACE)) return;
    int roomed = m->type <= KVS_MSG_ACK || m->type == KVS_MSG_STAGING_QUEUED;
    uint32_t chunk = m->type == KVS_MSG_STAGING_REQ     ? m->u.staging_req.chunk
                     : m->type == KVS_MSG_STAGING_GRANT ? m->u.staging_grant.chunk
                     : m->type == KVS_MSG_CHUNK_READY   ? m->u.chunk_ready.chunk
                     : m->type == KVS_MSG_ACK           ? m->u.ack.chunk
                                                        : 0;
    if (roomed)
        KVS_PD_TRACE("%s %s%s%s room %llu chunk %u, peer %u", what, kvs_msg_type_str(m->type),
                     m->type == KVS_MSG_ACK ? " of " : "",
                     m->type == KVS_MSG_ACK ? kvs_msg_type_str(m->u.ack.acked_type) : "",
                     (unsigned long long) m->u.ack.room, chunk, peer);
}

void kvs_pd_send(kvs_link_t *link, kvs_pd_metrics_t *metrics, uint32_t peer, const kvs_msg_t *msg)
{
    uint8_t buf[KVS_MSG_MAX_SIZE];
    size_t len;
    kvs_status_t st = kvs_msg_encode(msg, buf, sizeof(buf), &len);
    if (st != KVS_OK) {
        kvs_error("cannot encode %s: %s", kvs_msg_type_str(msg->type), kvs_status_str(st));
        return;
    }
    st = link->ops->send(link->ctx, peer, buf, len);
    if (st != KVS_OK) {
        kvs_debug("sending %s to rank %u failed: %s (will retry)", kvs_msg_type_str(msg->type),
                  peer, kvs_status_str(st));
        return;
    }
    metrics->msgs_sent++;
    trace_msg("sent", peer, msg);
}

kvs_status_t kvs_pd_recv(kvs_link_t *link, kvs_pd_metrics_t *metrics, kvs_msg_t *msg_p,
                         uint32_t *from_p)
{
    uint8_t buf[KVS_MSG_MAX_SIZE];
    for (;;) {
        size_t len = 0;
        kvs_status_t st = link->ops->recv(link->ctx, buf, sizeof(buf), &len, from_p);
        if (st == KVS_INPROGRESS) return st;
        metrics->msgs_received++;
        if (st == KVS_OK) st = kvs_msg_decode(buf, len, msg_p);
        if (st == KVS_OK) {
            trace_msg("took", from_p ? *from_p : 0, msg_p);
            return KVS_OK;
        }
        metrics->rejected++;
        kvs_warn("rejected a %zu-byte control message: %s", len, kvs_status_str(st));
    }
}

int kvs_pd_rank_index(const uint32_t *ranks, uint32_t n, uint32_t rank)
{
    for (uint32_t i = 0; i < n; i++)
        if (ranks[i] == rank) return (int) i;
    return -1;
}

int kvs_pd_dead_peer(kvs_link_t *link, uint32_t group, const uint32_t *ranks, uint32_t n,
                     uint64_t done)
{
    if (link->ops->peer_status == NULL) return -1;
    for (uint32_t i = 0; i < n; i++)
        if (!(done & KVS_BIT(i)) &&
            link->ops->peer_status(link->ctx, kvs_peer_id(group, ranks[i])) != KVS_OK)
            return (int) i;
    return -1;
}
