/* One instance of a real-model deployment (colocated, prefill or decode) as processes: every
 * rank runs `kvstage llm-rank` (engine/llm_rank.h), rank 0 with its stdin and stdout on pipes
 * for its request and event lines, the other ranks with neither. How `kvstage serve` launches
 * the instance behind its HTTP server; also the seeded-model flag and the model's TP check
 * shared with `generate`. */
#ifndef KVSTAGE_TOOLS_INSTANCE_H
#define KVSTAGE_TOOLS_INSTANCE_H

#include <stdint.h>
#include <sys/types.h>

#include "kvstage/layout.h"
#include "engine/llm.h"
#include "model/model.h"

/* "L,dim,ffn,heads,kv_heads,head_dim,vocab" into a model configuration (context 4096).
 * 0 on success, -1 for a malformed value (not reported). */
int kvs_parse_seeded(const char *s, kvs_model_config_t *cfg_p);

/* 0 when tp splits the model over that many ranks; else the one error line, naming flag, the
 * model's reason, the TP sizes it allows and why, and 2. */
int kvs_model_tp_check(const kvs_model_config_t *mc, const char *flag, uint32_t tp);

/* --max-model-len and --kv-tokens (serve, generate) against the model's context: the served
 * context is 2..model_ctx (*max_model_len_p: 0 becomes model_ctx), and an explicit pool must
 * hold one request of all of it in 32-bit page ids. 0, or 2 after a one-line usage error. */
int kvs_check_context_flags(uint32_t *max_model_len_p, uint64_t kv_tokens, uint32_t page_size,
                            uint32_t model_ctx);

typedef struct {
    kvs_llm_role_t role;
    uint32_t tp;            /* this instance's ranks */
    uint32_t peer_tp;       /* prefill: the decode instance's TP; decode: the prefill instance's */
    const char *model_path; /* a GGUF, or NULL with seeded */
    const char *seeded;     /* "L,dim,..." (kvs_parse_seeded), or NULL */
    uint64_t model_seed;
    uint32_t page_size, chunk, max_running;
    uint32_t max_context; /* --max-model-len: prompt + new tokens at most */
    uint64_t kv_tokens;   /* the KV pool in tokens; 0: twice max_context */
    int radix;
    int no_checksum; /* prefill and decode: chunk checksums off */
    /* prefill and decode: the prefill instance's registry endpoint; decode NULL: per-room
     * bootstrap, with at most max_peer_instances wired, each closed after peer_idle_s idle
     * (0: the ranks' defaults) */
    const char *registry;
    uint32_t max_peer_instances;
    uint32_t peer_idle_s;
    int data;    /* UCX data: 0 auto, 1 shm, 2 tcp */
    int gpu;     /* -1: the model on the CPU; else every rank's CUDA device */
    int kv_bf16; /* on the CPU: bf16 K/V, to pair with a GPU instance */
    /* 0 for the launcher's first instance; restarts (serve --restart-ranks) count up, so each
     * instance's TP group has a name of its own: "/kvs-PID-R" then "/kvs-PID-RG" (R the role's
     * initial, G the generation). */
    uint32_t generation;
} kvs_instance_config_t;

typedef struct {
    pid_t pids[KVS_MAX_TP];
    int exited[KVS_MAX_TP];
    int status[KVS_MAX_TP]; /* waitpid status once exited */
    uint32_t n;             /* ranks started */
    int in_fd, out_fd;      /* rank 0's stdin and stdout; -1 once handed over */
    char group[64];         /* the TP group's shm name (config.generation) */
} kvs_instance_t;

/* Starts every rank. The ranks ignore SIGINT (a terminal's Ctrl-C reaches the launcher, which
 * ends them through rank 0's quit). 0 on success; -1 (reported on stderr) with every rank
 * started so far killed and reaped. */
int kvs_instance_start(const kvs_instance_config_t *config, kvs_instance_t *inst);
/* Reaps ranks that exited, without waiting; returns how many are still running. */
uint32_t kvs_instance_poll(kvs_instance_t *inst);
/* Waits up to timeout_ms for every rank to exit, then kills what is left (SIGKILL) and reaps it;
 * removes the TP group's shm name. 0 when every rank exited by itself with status 0. */
int kvs_instance_wait(kvs_instance_t *inst, uint32_t timeout_ms);
/* A short description of the first rank that exited abnormally or too early, for messages. */
void kvs_instance_describe_exit(const kvs_instance_t *inst, char *buf, size_t cap);

#endif
