/* The reference serving engine of one tensor-parallel rank: a scheduler over the reference model
 * (model/model.h) whose KV cache lives in the rank's kvstage pool. One engine per rank; the
 * ranks of an instance step in lockstep (kvs_llm_step), meeting in their TP group for the
 * model's all-reduces and for the scheduler's agreements. Rank 0 takes requests and is the only
 * rank that reports events; every rank runs the same deterministic schedule on the inputs rank
 * 0 broadcasts at each step, so page ids and radix caches agree across ranks without being sent.
 *
 * Roles:
 *   COLOCATED - chunked prefill, then decode, in the same pool (no transfer).
 *   PREFILL   - chunked prefill (batched over requests, chunk C per request per pass); each
 *               room is added to the kvstage sender at admission, the cached prefix counts as
 *               computed at once (early send), every pass reports computed/scheduled tokens, and
 *               the first token (sampled from the last prompt logits) is the room's final
 *               metadata, with its logprobs when the request asked (computed on every
 *               rank, as every rank sends the metadata: the logits are identical). Pages are
 *               freed (or kept by the radix cache) once every rank's sender concluded the room.
 *   DECODE    - radix match, pages for [base, prompt), kvstage receiver; once every rank
 *               received the KV (and the first token), the request joins the running batch:
 *               continuous batching, one token per request per pass, until max tokens, EOS or
 *               a stop; finished sequences go into the radix cache.
 * Logprobs: computed by rank 0 (the rank that reports events) from the logits after the
 * all-reduce, before sampling rewrites them; a decode engine reports the first token's from the
 * room's final metadata.
 * Requests fail alone: a room that fails on any rank fails on all of them, and the others go on.
 *
 * Choices (n_choices > 1, decode and colocated): the prompt is computed (or received) once, as
 * choice 0, which samples with the request's seed. Once its prompt KV is at rest (colocated:
 * after its last prompt chunk; decode: once every rank received the KV), that prompt goes into
 * the radix cache and choices 1..n-1 are admitted as local requests of the same room sampling
 * with seed + i: each matches the prompt's whole pages in the radix cache (shared, locked from
 * then until its own admission) and computes only the positions past them (the last partial
 * page; at least the last prompt token, whose logits it samples its first token from), so choice
 * i generates exactly what a request with n_choices 1 and seed + i would. Without a radix cache
 * (or a prompt shorter than a page) each choice computes the prompt itself. Every choice reports
 * its own EV_TOKENs and EV_DONE (event.choice); a choice that fails stops the room's others at
 * the next step (they end FINISH_STOP), and choices not yet admitted when choice 0 ends before
 * its prompt was ready end with it, as it did. The siblings are allocated with choice 0 (when
 * every rank queues the request) and take pages as any request does (admission, growth,
 * preemption and recompute alike). A choice-0 sequence that shared its prompt keeps only the
 * prompt in the radix cache when it ends (not its generated tokens).
 *
 * Pages as the sequence grows (decode, colocated): admission takes pages for the prompt only;
 * a running sequence takes its next page when the token it feeds needs one, so max_new_tokens
 * costs nothing until generated. Admission (FIFO) waits until the pool (free pages plus what the
 * radix cache could evict) holds the request's pages plus one page of headroom for every request
 * already running. When a sequence needs a page and none is left, the newest running request is
 * preempted: its computed KV goes to the radix cache (or back to the pool) like a finished
 * request's, and it is queued again at its old place; once admitted again, a local prefill pass
 * recomputes prompt + generated tokens past its radix hit (decode too: the engine has the whole
 * model) and it goes on from the token it had reached, generating exactly what it would have.
 * A preempted request whose tokens so far need more pages than the whole pool holds could
 * never be admitted again: it ends instead, with KVS_ERR_NOSPACE (FINISH_ERROR). Every decision
 * depends only on the request list and the pool and radix state, which are the same on every rank:
 * the ranks preempt the same request at the same step. */
#ifndef KVSTAGE_LLM_H
#define KVSTAGE_LLM_H

#include <stdint.h>

#include "model/model.h"
#include "kvstage/pd.h"
#include "kvstage/pool.h"
#include "kvstage/status.h"
#include "model/tpgroup.h"

typedef enum {
    KVS_LLM_COLOCATED = 0,
    KVS_LLM_PREFILL = 1,
    KVS_LLM_DECODE = 2,
} kvs_llm_role_t;

/* Doubles per request in the engine's agreement over its TP ranks (a rank's TP group must
 * all-reduce max_running times this many). */
#define KVS_LLM_AGREE_DOUBLES 6

/* DECODE with per-room bootstrap: a receiver per prefill instance, looked up by the room
 * (pd/plumbing.h implements it over net links). */
typedef struct {
    void *ctx;
    /* Every rank, when a room is added (the same step on each): the receiver of the prefill
     * instance that `peer` (kvs_llm_request_t's, as rank 0 submitted it) describes. An error
     * fails the room on every rank. */
    kvs_status_t (*receiver)(void *ctx, const char *peer, kvs_receiver_t **receiver_p);
    uint32_t (*progress)(void *ctx);                         /* every receiver; the work done */
    void (*metrics)(void *ctx, kvs_pd_metrics_t *metrics_p); /* every receiver's, summed */
} kvs_llm_receivers_t;

/* Tests only (kvs_llm_config_t.test_kv_hook): a room's prompt KV, positions [0, prompt_len),
 * is complete in this rank's pool and its transfer concluded with success on every rank; pages
 * is the room's page table from position 0, valid during the call only. */
typedef void (*kvs_llm_test_kv_hook_t)(void *ctx, uint64_t room, const kvs_pool_t *pool,
                                       const uint32_t *pages, uint32_t prompt_len);

typedef struct {
    kvs_llm_role_t role;
    kvs_model_t *model; /* this rank's shard; borrowed */
    /* in the model's memory (host, or its CUDA device), its KV shape and TP layout; borrowed */
    kvs_pool_t *pool;
    kvs_tpgroup_t *group;          /* the instance's TP group; NULL when the model's tp_size is 1 */
    kvs_sender_t *sender;          /* PREFILL: this rank's sender; borrowed */
    kvs_receiver_t *receiver;      /* DECODE: this rank's receiver; borrowed; or NULL and: */
    kvs_llm_receivers_t receivers; /* DECODE without a receiver: one per prefill instance */
    uint32_t chunk_tokens;         /* prefill tokens per request per pass (use the kvstage C) */
    uint32_t batch_tokens;         /* prompt tokens per pass, all requests (>= chunk_tokens) */
    /* Requests admitted at once; on a prefill instance, those whose prompt is still computing
     * (a computed one waiting for its handoff holds pages but no slot). */
    uint32_t max_running;
    /* Prompt + max_new_tokens at most (the served context, vLLM's max_model_len); 0: the model's
     * max_ctx; above it: refused. A prefill request counts one new token. */
    uint32_t max_context;
    int radix; /* this instance's radix prefix cache */
    /* Tests only, NULL elsewhere: called on every rank of a prefill or decode engine when a
     * room's transfer succeeded, before anything else happens to its pages (prefill: before
     * they go back; decode: before the first decode pass writes past the prompt), e.g. to
     * compare the KV that left prefill's pool with what reached decode's byte for byte. */
    kvs_llm_test_kv_hook_t test_kv_hook;
    void *test_kv_ctx;
} kvs_llm_config_t;

#define KVS_LLM_CHOICES_MAX 16         /* n_choices at most */
#define KVS_LLM_CHOICE_ALL  UINT32_MAX /* kvs_llm_stop: every choice of the room */

typedef struct {
    uint64_t room;           /* chosen by the router: the same on the prefill and decode side */
    const uint32_t *prompt;  /* [prompt_len] token ids; copied */
    uint32_t prompt_len;     /* >= 1 */
    uint32_t max_new_tokens; /* decode, colocated: generated tokens at most, the first included */
    kvs_sample_params_t sampling; /* its logit biases copied too; the penalties see the prompt
                                     and the tokens generated before each one */
    uint64_t seed;                /* sampling seed (unused when greedy) */
    uint32_t eos;                 /* stop token id; UINT32_MAX: none */
    /* 1: every generated token's EV_TOKEN carries its logprob and top_logprobs alternatives
     * (kvs_logprobs: the raw logits, before bias, penalties and temperature) */
    int logprobs;
    uint32_t top_logprobs; /* 0..KVS_LOGPROBS_TOP_MAX */
    /* With logprobs: also an EV_PROMPT for every prompt position from 1 (the logits of
     * every prompt position, computed in the prefill pass). Such a request does not use the
     * radix cache for its prompt (a cached prefix has no logits): it computes it whole, at
     * most 128 positions of such prompts per pass (their logits are kept for the pass). */
    int prompt_logprobs;
    /* DECODE with receivers: the room's prefill instance, a description at most
     * KVS_LLM_PEER_MAX bytes that rank 0 got from whoever chose the instance and every rank
     * hands to receivers.receiver (copied); NULL: none. */
    const char *peer;
    /* Sequences sampled from the prompt (choices, OpenAI's n): 0 or 1 for one, at most
     * KVS_LLM_CHOICES_MAX; a prefill engine takes only one (the decode side samples the others).
     * Choice i samples with seed + i; prompt logprobs are reported once (choice 0). */
    uint32_t n_choices;
} kvs_llm_request_t;

#define KVS_LLM_PEER_MAX 16384

typedef enum {
    KVS_LLM_EV_TOKEN = 0, /* a token was generated (decode, colocated; prefill: the first) */
    KVS_LLM_EV_DONE = 1,  /* the request ended; nothing more about it follows */
    /* prompt_logprobs: prompt token number `index` (>= 1, in order, all before the first
     * EV_TOKEN) and its logprobs given the tokens before it */
    KVS_LLM_EV_PROMPT = 2,
} kvs_llm_event_kind_t;

typedef enum {
    KVS_LLM_FINISH_LENGTH = 0,  /* max_new_tokens generated */
    KVS_LLM_FINISH_EOS = 1,     /* the EOS token was generated (and reported) */
    KVS_LLM_FINISH_STOP = 2,    /* kvs_llm_stop */
    KVS_LLM_FINISH_HANDOFF = 3, /* prefill: the KV and first token reached decode */
    KVS_LLM_FINISH_ERROR = 4,   /* see status */
} kvs_llm_finish_t;

typedef struct {
    kvs_llm_event_kind_t kind;
    uint64_t room;
    uint32_t choice;         /* EV_TOKEN, EV_DONE: which of the request's choices; EV_PROMPT: 0 */
    uint32_t token;          /* EV_TOKEN, EV_PROMPT */
    uint32_t index;          /* EV_TOKEN: 0 for the first generated token; EV_PROMPT: position */
    int has_logprobs;        /* EV_TOKEN: the request asked (logprobs); EV_PROMPT: 1 */
    kvs_logprobs_t lp;       /* with has_logprobs: of token, and the request's alternatives */
    kvs_status_t status;     /* EV_DONE: KVS_OK, or why the request failed */
    kvs_llm_finish_t finish; /* EV_DONE */
    uint32_t prompt_len;     /* EV_DONE */
    uint32_t cached_tokens;  /* EV_DONE: prompt tokens this side found in its radix cache */
    uint32_t generated;      /* EV_DONE: tokens generated (reported) */
    /* EV_DONE, CLOCK_MONOTONIC ns (comparable across processes of one host): */
    uint64_t submitted_ns;   /* kvs_llm_submit */
    uint64_t admitted_ns;    /* pages allocated, work started */
    uint64_t prefilled_ns;   /* prefill, colocated: the prompt computed */
    uint64_t kv_ready_ns;    /* decode: every rank has the KV and the first token */
    uint64_t first_token_ns; /* the first token known on this side */
    uint64_t done_ns;
} kvs_llm_event_t;

typedef struct {
    uint64_t steps;          /* kvs_llm_step calls */
    uint64_t forward_passes; /* model forward calls */
    uint64_t forward_ns;     /* time inside them */
    uint64_t prompt_tokens;  /* prompt tokens computed (radix hits excluded) */
    uint64_t cached_tokens;  /* prompt tokens served from the radix cache */
    uint64_t decode_tokens;  /* tokens fed to decode passes */
    uint64_t requests_ok, requests_failed;
    uint64_t preemptions;       /* running requests sent back to the queue for want of pages */
    uint64_t recomputed_tokens; /* positions recomputed after a preemption (radix hits excluded) */
    uint32_t queued, running;   /* now */
    uint64_t radix_pages;       /* now: pages the radix cache holds */
    uint32_t pages_total;       /* this rank's KV pool: its pages */
    uint32_t pages_free;        /* now: of which free (neither a request's nor the radix cache's) */
} kvs_llm_stats_t;

typedef struct kvs_llm kvs_llm_t;

/* Checks the configuration against the model (pool shape and TP, group size = tp_size, role
 * objects present, max_context within the model's) and sizes the scratch. Any pool size works:
 * a request is refused at submit when its prompt alone exceeds the pool, and fails when its
 * sequence outgrows it. */
kvs_status_t kvs_llm_create(const kvs_llm_config_t *config, kvs_llm_t **llm_p);
/* Frees the engine's requests (without telling the sender or receiver: drain first), pages
 * and radix cache. */
void kvs_llm_destroy(kvs_llm_t *llm);

/* Rank 0 only: queues a request, validated now (KVS_ERR_INVALID: empty prompt, prompt +
 * max_new_tokens above max_context, token id outside the vocabulary, max_new_tokens 0 where
 * tokens are generated, sampling parameters kvs_sample_params_invalid refuses, top_logprobs above
 * KVS_LOGPROBS_TOP_MAX or prompt_logprobs without logprobs, n_choices above KVS_LLM_CHOICES_MAX
 * (or above 1 on a prefill engine), a room id already live; KVS_ERR_NOSPACE: its prompt, plus a
 * page for each further choice, needs more pages than the whole pool holds, so it could never
 * be admitted). Every rank admits it at the same later step. One EV_DONE per choice follows. */
kvs_status_t kvs_llm_submit(kvs_llm_t *llm, const kvs_llm_request_t *request);
/* Rank 0 only: ends choice `choice` of a live request (KVS_LLM_CHOICE_ALL: all of them) at the
 * next step (FINISH_STOP), e.g. a stop string seen by the caller. KVS_ERR_NOT_FOUND for a room
 * that is not live. */
kvs_status_t kvs_llm_stop(kvs_llm_t *llm, uint64_t room, uint32_t choice);

/* Read-only, between steps: how many tokens of prompt[0, prompt_len) admission would find in
 * this rank's radix cache now (0 without a cache), e.g. for a router's prefix-aware choice.
 * Unlike admission it neither splits a node nor touches the LRU order, so a query answered by
 * one rank leaves the caches (and page ids) of the ranks identical. */
kvs_status_t kvs_llm_cached(const kvs_llm_t *llm, const uint32_t *prompt, uint32_t prompt_len,
                            uint32_t *cached_p);

/* One scheduler iteration on every rank of the instance, in lockstep: rank 0's new requests,
 * stops and quit flag are broadcast; transfers progress; transfer outcomes are agreed; queued
 * requests are admitted; one forward pass runs (prefill chunks and decode tokens together).
 * quit (rank 0's value counts) asks every rank to stop stepping; *quit_p receives it on every
 * rank. *work_p receives how much happened (0: idle; sleep a little before the next step).
 * An error means the TP group failed (a peer died): the instance cannot continue. */
kvs_status_t kvs_llm_step(kvs_llm_t *llm, int quit, int *quit_p, uint32_t *work_p);

/* Rank 0: takes the next event; KVS_INPROGRESS when none is waiting. Other ranks record none. */
kvs_status_t kvs_llm_next_event(kvs_llm_t *llm, kvs_llm_event_t *event_p);
/* Sequences (each choice of a request counts) queued or running on this rank (as of the last
 * step; rank 0 also counts the requests submitted since). */
uint32_t kvs_llm_live(const kvs_llm_t *llm);
void kvs_llm_stats(const kvs_llm_t *llm, kvs_llm_stats_t *stats_p);

/* Rank 0: asks every rank of the instance for its sender's or receiver's counters at the next
 * step (they are summed over the TP group there: bytes moved, chunks, retries, ring use... of
 * the whole instance, not of rank 0 alone). */
void kvs_llm_collect_metrics(kvs_llm_t *llm);
/* Rank 0: the instance's summed counters as of the last collection; returns how many
 * collections have completed (0: none yet, *metrics_p untouched). */
uint64_t kvs_llm_instance_metrics(const kvs_llm_t *llm, kvs_pd_metrics_t *metrics_p);

/* Internal (exposed for tests): a rank's failure reason as three doubles of its agreement part,
 * to be summed over the ranks: 1, the reason's code and its square for a cause of its own,
 * zeros for KVS_OK and for KVS_ERR_ABORTED (how the engine stops the other ranks once one
 * failed: no cause of its own). */
void kvs__llm_reason_part(kvs_status_t reason, double *part);
/* The failure reason the TP ranks agree on, from the all-reduced sums of one request's
 * KVS_LLM_AGREE_DOUBLES: the cause of the ranks that failed by one of their own when they all
 * had the same, else KVS_OK (then each rank reports its own). */
kvs_status_t kvs__llm_agreed_reason(const double *agreed);

#endif
