/* One rank of a real-model deployment as a process: the model shard (GGUF or seeded), the KV
 * pool, the instance's TP group, for prefill and decode the kvstage plumbing (net link,
 * bootstrap registry, sender or receiver), and the serving engine (engine/llm.h) stepped in
 * lockstep with the instance's other ranks until rank 0 is told to quit. `kvstage generate`
 * launches one process per rank and talks to each instance's rank 0 through two pipes.
 *
 * Rank 0 reads request lines from in_fd and writes event lines to out_fd; every rank writes one
 * last stats line on out_fd as it exits. The format of both directions, and its one encoder and
 * decoder, is engine/rank_line.h. */
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
    /* -1: the model, its KV pool and the transfers on the CPU (f32 KV); else the CUDA device
     * they are on (bf16 KV, model/cuda). */
    int device;
    int kv_bf16; /* on the CPU: bf16 K/V (kvs_model_set_kv_bytes), to pair with a GPU instance */
    /* Engine. */
    uint32_t page_size;
    uint32_t chunk_tokens; /* prefill chunk, also the kvstage chunk C */
    uint32_t batch_tokens; /* prompt tokens per pass, all requests; 0: 4 x chunk_tokens */
    uint32_t max_running;  /* requests admitted at once */
    uint32_t max_context;  /* prompt + new tokens at most (--max-model-len); 0: the model's */
    uint64_t kv_tokens;    /* the KV pool in tokens (every rank its heads of them); 0: default */
    int radix;             /* this instance's radix prefix cache */
    int no_checksum;       /* prefill and decode: chunk checksums off (both sides must agree) */
    /* TP group (tp > 1): a POSIX shm name unique per run and instance ("/kvs-<pid>-p"). */
    const char *group;
    uint64_t group_timeout_ms; /* 0: 120 s (ranks load the model before joining) */
    /* Prefill and decode: the bootstrap registry of the prefill instance. Decode without one:
     * per-room bootstrap (pd/plumbing.h), each room naming its prefill instance (PEER on the
     * submit line); prefill_tp is then only the geometry's placeholder. */
    const char *registry;
    uint32_t max_peer_instances; /* per-room decode: prefill instances wired at once (0: 16) */
    uint64_t peer_idle_ns;       /* per-room decode: an instance idle this long closes (0: 300 s) */
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

/* The KV pool of one rank, in pages of page_size: kv_tokens, or by default twice the context (one
 * request of the whole context and as much again for the others and the radix cache), rounded
 * up to whole pages. Pages are taken as sequences grow, so a smaller pool serves as many
 * requests as their actual lengths allow (the engine preempts the newest when it runs out). */
uint64_t kvs_llm_rank_pool_pages(uint64_t kv_tokens, uint32_t max_context, uint32_t page_size);

/* Runs the rank until quit (rank 0) or the broadcast quit (other ranks). KVS_OK when it ran to
 * the end; an error (logged) when it could not start or its TP group failed. result_p may be
 * NULL; it is written whenever the engine ran. */
kvs_status_t kvs_llm_rank_run(const kvs_llm_rank_config_t *config, kvs_llm_rank_result_t *result_p);

#endif
