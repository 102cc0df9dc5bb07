/* One rank of a real-model deployment as a process: the model shard (GGUF or seeded), the KV
 * pool, the instance's TP group, for prefill and decode the kvstage plumbing (net link,
 * bootstrap registry, sender or receiver), and the serving engine (engine/llm.h) stepped in
 * lockstep with the instance's other ranks until rank 0 is told to quit. `kvstage generate`
 * launches one process per rank and talks to each instance's rank 0 through two pipes.
 *
 * Rank 0 reads requests from in_fd, one line each (fields separated by single spaces):
 *   submit ROOM MAX_NEW TEMPERATURE TOP_P SEED EOS N ID_1 ... ID_N
 *                         EOS: a token id, or -1 for none; N >= 1 prompt token ids
 *   stop ROOM             ends a live request at the next step
 *   match N ID_1 ... ID_N how many of these prompt tokens admission would find in the radix
 *                         cache now (kvs_llm_cached: read-only, so the ranks' caches stay equal)
 *   stats                 the stats line below (with "final":false), after the next step: its
 *                         transfer counters (bytes_moved, chunks, retries, ring...) are then
 *                         summed over every rank of the instance (kvs_llm_collect_metrics);
 *                         answers asked after it wait behind it
 *   quit                  ends the instance once no request is live (or after quit_grace_ns);
 *                         end of file means the same
 * Lines are taken between steps, so an answer can wait for one forward pass. Every match and
 * stats line is answered by exactly one line, in the order asked, so a client pairs answers
 * with questions in order. It writes to out_fd one JSON object per line:
 *   {"event":"ready","role":R,"tp":T,"load_s":X}          engine up, peers bootstrapped
 *   {"event":"token","room":N,"token":ID,"index":I}
 *   {"event":"done","room":N,"status":S,"finish":F,"prompt_len":..,"cached":..,
 *    "generated":..,"submitted_ns":..,"admitted_ns":..,"prefilled_ns":..,"kv_ready_ns":..,
 *    "first_token_ns":..,"done_ns":..}                     status "ok" or an error string
 *   {"event":"rejected","room":N,"status":S}               the submit was refused
 *   {"event":"error","message":S}                          a line it could not parse
 *   {"event":"match","cached":C,"prompt_len":N}            the answer to match ("cached":0 and
 *                                                          "error":S for a malformed one)
 * Every rank, rank 0 included, writes one last line on out_fd (when out_fd >= 0) as it exits:
 *   {"event":"stats","role":R,"rank":r,...,"final":true}   kvs_llm_stats (steps, forward
 *                                                          passes, prompt, cached and decode
 *                                                          tokens, requests ok and failed,
 *                                                          radix pages, queued, running), this
 *                                                          rank's sender/receiver metrics
 *                                                          (rooms, chunks, bulk and direct
 *                                                          writes, bytes_moved, control
 *                                                          messages, retries, rejected,
 *                                                          ring_used, ring_capacity), load_s
 *                                                          and wall_s; rank 0 writes the same
 *                                                          line with "final":false for stats,
 *                                                          its metrics those of the instance */
#ifndef KVSTAGE_LLM_RANK_H
#define KVSTAGE_LLM_RANK_H

#include <stdint.h>

#include "engine/llm.h"
#include "model/model.h"
#include "kvstage/net.h"
#include "kvstage/pd.h"
#include "kvstage/status.h"

typedef struct {
    kvs_llm_role_t role;
    uint32_t rank;       /* this rank in its instance */
    uint32_t prefill_tp; /* the prefill instance's TP size (colocated: this instance's) */
    uint32_t decode_tp;  /* the decode instance's TP size (unused when colocated) */
    /* The model: a GGUF file, or (model_path NULL) seeded weights of this configuration. */
    const char *model_path;
    kvs_model_config_t seeded;
    uint64_t model_seed;
    /* Engine. */
    uint32_t page_size;
    uint32_t chunk_tokens; /* prefill chunk, also the kvstage chunk C */
    uint32_t batch_tokens; /* prompt tokens per pass, all requests; 0: 4 x chunk_tokens */
    uint32_t max_running;  /* requests admitted at once */
    uint32_t max_prompt;   /* longest prompt */
    uint32_t max_new;      /* most tokens generated per request (sizes the pool) */
    int radix;             /* this instance's radix prefix cache */
    /* TP group (tp > 1): a POSIX shm name unique per run and instance ("/kvs-<pid>-p"). */
    const char *group;
    uint64_t group_timeout_ms; /* 0: 120 s (ranks load the model before joining) */
    /* Prefill and decode: the bootstrap registry of the prefill instance. */
    const char *registry;
    int serve_registry; /* prefill rank 0 binds `registry` and serves it from this process */
    const char *bind;   /* this rank's control endpoint (default tcp://127.0.0.1:*) */
    kvs_net_data_t data;
    const char *net_device;
    uint64_t liveness_timeout_ns; /* 0: 10 s (a forward pass on a busy CPU is long) */
    uint64_t quit_grace_ns;       /* 0: 5 s */
    int in_fd;                    /* rank 0: request lines */
    int out_fd;                   /* event lines (rank 0) and the stats line (every rank); -1 */
} kvs_llm_rank_config_t;

typedef struct {
    kvs_llm_stats_t stats;
    kvs_pd_metrics_t metrics; /* this rank's sender or receiver (zero when colocated) */
    double load_s;            /* start -> engine ready (model, pool, group, bootstrap) */
    double wall_s;
} kvs_llm_rank_result_t;

/* Runs the rank until quit (rank 0) or the broadcast quit (other ranks). KVS_OK when it ran to
 * the end; an error (logged) when it could not start or its TP group failed. result_p may be
 * NULL; it is written whenever the engine ran. */
kvs_status_t kvs_llm_rank_run(const kvs_llm_rank_config_t *config, kvs_llm_rank_result_t *result_p);

#endif
