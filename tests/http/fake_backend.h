/* A fake serving backend for tests of the HTTP server and the router: deterministic tokens,
 * delays, failure injection and a record of every room it saw. */
#ifndef KVSTAGE_TESTS_HTTP_FAKE_BACKEND_H
#define KVSTAGE_TESTS_HTTP_FAKE_BACKEND_H

#include <stdint.h>

#include "http/server.h"
#include "kvstage/status.h"

/* The logprobs the fake reports for a token at index (of the generated tokens, or prompt: of
 * the prompt), a function of these alone so that every side agrees: n_top alternatives, the
 * first the token itself. */
void kvs_server_fake_logprobs(uint32_t token, uint32_t index, int prompt, uint32_t n_top,
                              kvs_logprobs_t *lp_p);

/* Generates for every live request in steps: each step (every token_delay_ns) gives each
 * choice of each request its next token. Token k of choice c is prompt[(k + c) % prompt_len]
 * (an echo of the prompt, cycling), so outputs are deterministic and easy to predict; a stop id
 * ends the choice (FINISH_STOP), max_tokens ends it (FINISH_LENGTH), the request ends with its
 * last choice; cancel() of one choice (of n > 1) ends that one, of every choice (or of the only
 * one) the request. PREFILL requests end after one token
 * with FINISH_HANDOFF, prompt_len * kv_bytes_per_token KV bytes and a fake transfer time.
 * A prefix cache of the prompts of requests that completed answers match() and cached_tokens.
 * Sinks are called from the fake's own thread, never under its lock. */
typedef struct {
    uint64_t token_delay_ns;     /* per step; 0: as fast as it can */
    uint64_t first_delay_ns;     /* extra wait before a request's first token */
    uint32_t fail_at;            /* fail each request (FINISH_ERROR, KVS_ERR_IO) instead of
                                    generating its token number fail_at (1-based); 0: never */
    kvs_status_t fail_status;    /* the status of those failures; 0: KVS_ERR_IO */
    uint64_t kv_bytes_per_token; /* 0: 1024 */
    uint64_t ring_capacity;      /* reported as a gauge; 0: 1 MiB */
    uint32_t max_live;           /* submit fails with KVS_ERR_NOSPACE beyond this; 0: 1024 */
} kvs_server_fake_config_t;

typedef struct kvs_server_fake kvs_server_fake_t;

kvs_status_t kvs_server_fake_create(const kvs_server_fake_config_t *config,
                                    kvs_server_fake_t **fake_p);
/* Ends live requests with FINISH_ERROR (KVS_ERR_ABORTED) and frees the fake. */
void kvs_server_fake_destroy(kvs_server_fake_t *fake);
kvs_server_backend_t kvs_server_fake_backend(kvs_server_fake_t *fake);

void kvs_server_fake_set_healthy(kvs_server_fake_t *fake, int healthy);
void kvs_server_fake_set_fail_at(kvs_server_fake_t *fake, uint32_t fail_at);
/* The KV pool gauges its stats report (0 and 0 until set). */
void kvs_server_fake_set_pages(kvs_server_fake_t *fake, uint32_t total, uint32_t free_pages);

typedef struct {
    uint64_t submitted, completed, failed, cancelled; /* cancelled: cancel() found it live */
    uint32_t live;
} kvs_server_fake_counts_t;
void kvs_server_fake_counts(kvs_server_fake_t *fake, kvs_server_fake_counts_t *counts_p);

/* What the fake saw of one room (the last 4096 rooms are kept). */
typedef struct {
    uint64_t room;
    kvs_server_role_t role;
    uint32_t prompt_len, max_tokens;
    uint32_t generated;
    int cancelled; /* cancel() reached it while live */
    int done;      /* on_done was called */
    kvs_server_finish_t finish;
    char bootstrap[128];          /* "" when none */
    kvs_sample_params_t sampling; /* as submitted; bias NULL (n_bias kept) */
    uint64_t seed;
    uint32_t n_stop_ids;
    int logprobs, prompt_logprobs;
    uint32_t top_logprobs;
    uint32_t n; /* choices */
} kvs_server_fake_record_t;
/* KVS_ERR_NOT_FOUND (not logged) for a room it does not know. */
kvs_status_t kvs_server_fake_record(kvs_server_fake_t *fake, uint64_t room,
                                    kvs_server_fake_record_t *record_p);

#endif
