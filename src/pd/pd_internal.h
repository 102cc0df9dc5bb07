/* Pieces shared by the sender and the receiver state machines (internal). */
#ifndef KVSTAGE_PD_INTERNAL_H
#define KVSTAGE_PD_INTERNAL_H

#include <stdint.h>

#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "kvstage/msg.h"
#include "kvstage/pd.h"
#include "staging/copy.h"
#include "transport/link.h"

/* Bit i of a rank set (TP sizes are at most KVS_MAX_TP = 64). */
#define KVS_BIT(i) (1ull << (i))
static inline uint64_t kvs_all_bits(uint32_t n)
{
    return n >= 64 ? ~0ull : KVS_BIT(n) - 1;
}

/* A request decode answered QUEUED is resent only after this many retry periods: the grant
 * that ends the wait is resent by decode until confirmed, so this resend only matters if
 * decode lost the request itself. */
#define KVS_PD_QUEUED_RETRY_FACTOR 64

/* The retry period adapts to the round trip (protocol.md §5.2): a message is resent after
 * max(retry_ns, 4 x the smoothed round-trip time), capped at 32 x retry_ns, so answers that
 * come late from a loaded host are not taken for losses. Samples come only from messages that
 * were sent once, so a retry's answer is never mistaken for the first one's. */
static inline void kvs_pd_rtt_sample(uint64_t *srtt_ns, uint64_t sample_ns)
{
    *srtt_ns = *srtt_ns == 0 ? sample_ns : (*srtt_ns * 7 + sample_ns) / 8;
}

static inline uint64_t kvs_pd_rto(uint64_t srtt_ns, uint64_t retry_ns)
{
    const uint64_t rto = 4 * srtt_ns;
    if (rto <= retry_ns) return retry_ns;
    return rto < 32 * retry_ns ? rto : 32 * retry_ns;
}

/* KVS_LOG=trace: one line per step of a room's handoff (every control message sent and taken,
 * every write and scatter started and completed), stamped with the monotonic clock in ms so the
 * lines of both sides' processes on one host merge into one timeline. */
#define KVS_PD_TRACE(fmt, ...) kvs_trace("%.3f ms " fmt, (double) kvs_now_ns() / 1e6, __VA_ARGS__)

/* Encodes and sends one control message to peer `peer` (a link peer id: transport/link.h) of
 * the other side; counts it. A send failure is logged and otherwise ignored: every message that
 * matters is retried on a timer. */
void kvs_pd_send(kvs_link_t *link, kvs_pd_metrics_t *metrics, uint32_t peer, const kvs_msg_t *msg);

/* Takes the next received message that decodes: KVS_OK, or KVS_INPROGRESS when none waits;
 * *from_p (NULL-able) is the link's peer id of its sender. Messages that fail to decode are
 * counted as rejected and skipped. */
kvs_status_t kvs_pd_recv(kvs_link_t *link, kvs_pd_metrics_t *metrics, kvs_msg_t *msg_p,
                         uint32_t *from_p);

/* Index of the first peer in ranks[0, n) (ranks of peer group `group`), outside the `done` bit
 * set, that the link reports dead, or -1. */
int kvs_pd_dead_peer(kvs_link_t *link, uint32_t group, const uint32_t *ranks, uint32_t n,
                     uint64_t done);

/* Index of rank in ranks[0, n), or -1. */
int kvs_pd_rank_index(const uint32_t *ranks, uint32_t n, uint32_t rank);

/* Resends of one message back off exponentially up to this shift (x8): more would leave too
 * few tries within the room timeouts on a lossy network. */
#define KVS_PD_BACKOFF_MAX_SHIFT 3

/* The wait before resend number `tries` + 1 of one message (0: after its first send). */
static inline uint64_t kvs_pd_backoff(uint64_t srtt_ns, uint64_t retry_ns, uint32_t tries)
{
    const uint32_t shift = tries < KVS_PD_BACKOFF_MAX_SHIFT ? tries : KVS_PD_BACKOFF_MAX_SHIFT;
    return kvs_pd_rto(srtt_ns, retry_ns) << shift;
}

/* Sets a timer: *timer = min(*timer, t). */
static inline void kvs_pd_arm(uint64_t *timer, uint64_t t)
{
    if (t < *timer) *timer = t;
}

/* Test hooks: the copy backend a rank's gathers (sender) or scatters (receiver) run on, for a
 * test to wrap with faults (kvs__copy_fail_nth). */
kvs_copy_backend_t *kvs__sender_copy_backend(kvs_sender_t *tx);
kvs_copy_backend_t *kvs__receiver_copy_backend(kvs_receiver_t *rx);

#endif
