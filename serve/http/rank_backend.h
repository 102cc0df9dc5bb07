/* A server backend (http/server.h) over rank 0 of a real-model instance running as processes
 * (engine/llm_rank.h): requests become `submit` lines on rank 0's request pipe, and one I/O
 * thread reads rank 0's event lines and reports each room's tokens and end to its sink. Rank 0's
 * `match` and `stats` answer the router's prefix queries and /metrics. The caller launches the
 * rank processes and hands over rank 0's two pipe ends.
 *
 * What it adds to rank 0's protocol:
 *   - stop ids beyond the first: rank 0 knows one EOS (the request's first stop id); when
 *     another stop id is generated the backend reports it, drops that choice's later tokens and
 *     sends `stop ROOM` (n = 1) or `stop ROOM CHOICE` (finish "stop");
 *   - choices: n on the submit line (PREFILL: 1); rank 0's token lines name their choice, its
 *     done lines come one per choice, and the room ends (on_done) with the last of them: its
 *     finish ERROR when any choice failed, else choice 0's; the prompt's figures (cached
 *     tokens, ttft, KV bytes) are choice 0's;
 *   - finish mapping: eos and stop -> STOP, length -> LENGTH, handoff -> HANDOFF, a status other
 *     than "ok" or a refused submit -> ERROR with that status;
 *   - per room: ttft_ns from submit() to rank 0's first token (one host: CLOCK_MONOTONIC is
 *     shared by the processes); transfer_ns on the prefill side only, from the prompt computed
 *     to every prefill rank concluded the handoff; kv_bytes on the decode side only (it knows
 *     its cache hit): the whole pages past the hit, ceil(prompt / P) - cached / P, times P times
 *     the model's KV bytes per token, which is what every prefill rank together moved;
 *   - logprobs: the request's logprobs and top_logprobs, and prompt logprobs unless DECODE
 *     (it has no prompt logits), on the submit line; rank 0's prompt events become on_prompt,
 *     the token events' logprobs on_token's;
 *   - stats for /metrics from rank 0's stats line: rank 0's own sender or receiver counters
 *     (metrics.bytes is the bytes rank 0 sent or scattered) and the instance's queued and running
 *     requests (every rank has the same).
 * A room whose rank 0 went away (end of file on its events) ends with FINISH_ERROR
 * (KVS_ERR_IO), and every later submit fails, until kvs_rank_backend_restart hands the backend
 * a new instance's rank 0. All sink calls come from the I/O thread. */
#ifndef KVSTAGE_RANK_BACKEND_H
#define KVSTAGE_RANK_BACKEND_H

#include <stdint.h>

#include "http/server.h"
#include "kvstage/status.h"

typedef struct {
    int in_fd;  /* rank 0's request pipe (its stdin): owned from create on */
    int out_fd; /* rank 0's event pipe (its stdout): owned from create on */
    /* The requests this instance takes: NONE (colocated) takes requests without "kvstage",
     * PREFILL and DECODE only their own role (KVS_ERR_UNSUPPORTED otherwise). */
    kvs_server_role_t role;
    /* DECODE: the prefill instance's registry endpoint the ranks bootstrapped from; a request
     * naming another one is refused (KVS_ERR_INVALID). NULL: not checked. */
    const char *bootstrap;
    /* DECODE, 1: per-room bootstrap (the ranks have no registry): each room's prefill instance
     * (its "kvstage.bootstrap", required) is looked up and checked against geo by the backend's
     * peer op (kvs_plumbing_peer_lookup; a result is reused for 2 s), and its peer description
     * goes to rank 0 with the room. */
    int per_room;
    kvs_pd_geometry_t geo;       /* per_room: this instance's (prefill_tp unused) */
    uint32_t page_size;          /* the instance's KV page, tokens */
    uint64_t kv_bytes_per_token; /* the whole model's: layers x kv_heads x head_dim x 2 x 4 */
    uint32_t vocab;              /* the model's: prompt ids must be below it */
    /* Generated ids at or above this reach the sink as empty text (a seeded model's vocabulary
     * beyond the server's tokenizer); 0: every id is left to the server's tokenizer. */
    uint32_t text_vocab;
    uint32_t max_context;      /* the ranks' (--max-model-len): prompt + max_tokens at most */
    uint32_t query_timeout_ms; /* waiting for a match or stats answer; 0: 5000 */
} kvs_rank_backend_config_t;

typedef struct kvs_rank_backend kvs_rank_backend_t;

/* Takes both fds (closed by destroy, also on failure) and starts the I/O thread. */
kvs_status_t kvs_rank_backend_create(const kvs_rank_backend_config_t *config,
                                     kvs_rank_backend_t **backend_p);
/* Waits up to timeout_ms for rank 0's ready line: KVS_OK, KVS_ERR_TIMEOUT (not yet; call again)
 * or KVS_ERR_IO (rank 0 ended before it was ready). Not logged. */
kvs_status_t kvs_rank_backend_wait_ready(kvs_rank_backend_t *backend, uint32_t timeout_ms);
/* The ops table for kvs_server_config_t.backend; valid until destroy. */
kvs_server_backend_t kvs_rank_backend_ops(kvs_rank_backend_t *backend);
/* Sends `quit` and then closes the request pipe: rank 0 ends the instance once no request is
 * live (or after its grace time). Later submits fail. Idempotent. */
void kvs_rank_backend_quit(kvs_rank_backend_t *backend);
/* 1 once rank 0's event pipe reached its end (it exited, or closed it). */
int kvs_rank_backend_ended(kvs_rank_backend_t *backend);
/* `kvstage serve --restart-ranks`: the backend moves to a fresh instance's rank 0, whose two
 * pipe ends it takes (closed by destroy, also on failure). The I/O thread ends first: rooms still
 * live end with FINISH_ERROR (KVS_ERR_IO when rank 0's events had ended, else KVS_ERR_ABORTED),
 * waiting questions fail; the old pipes close. Then, as after create, submits fail with
 * KVS_ERR_STATE until the new rank 0 is ready (kvs_rank_backend_wait_ready), and health fails
 * with "the instance is restarting (restart K; why)". Stats: the counters carry on from the old
 * instance's last stats answer (what it did after that answer is lost with it), the gauges start
 * at the new one's, and stats.restarts counts the calls. KVS_ERR_IO when the thread cannot start
 * again (every op then fails, as after rank 0's end). Not concurrent with quit or destroy. */
kvs_status_t kvs_rank_backend_restart(kvs_rank_backend_t *backend, int in_fd, int out_fd,
                                      const char *why);
/* Stops the I/O thread (rooms still live end with FINISH_ERROR, KVS_ERR_ABORTED), closes both
 * fds and frees. Call after the server that uses it is destroyed. */
void kvs_rank_backend_destroy(kvs_rank_backend_t *backend);

#endif
