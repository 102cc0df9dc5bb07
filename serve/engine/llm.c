/* The reference serving engine of one TP rank (engine/llm.h).
 *
 * Lockstep without sending page ids: every rank keeps the same request list in the same order
 * and makes the same pool and radix calls, so it gets the same page ids. Only three things can
 * differ between ranks, and each goes through the TP group once per step:
 *   inputs   - rank 0's new requests, stops and quit flag: broadcast (sync_inputs);
 *   outcomes - a room's status on this rank's sender or receiver: summed over the ranks
 *              (agree), so every rank takes the same decision at the same step;
 *   logits   - identical by construction (the model's all-reduce), so sampling agrees.
 * Requests live in one array in admission order; a step runs at most one forward pass holding
 * every prefill chunk and every decode token it can. */
#include "engine/llm.h"

#include <stdlib.h>
#include <string.h>

#include "base/bytes.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "kvstage/msg.h"
#include "kvstage/radix.h"

#define PIECE_BYTES  65536 /* broadcast piece; the group's max_bytes must be at least this */
#define HEADER_BYTES 32
#define REQ_FIXED    64 /* bytes of one request in the broadcast, before its tokens, biases, peer */
/* Prompt positions per pass whose logits rank 0 keeps for prompt logprobs ([rows][vocab] floats:
 * 24 MiB for a vocabulary of 49152); longer chunks of such requests wait for the next pass. */
#define PROMPT_LP_ROWS 128

typedef enum {
    RQ_QUEUED = 0, /* waiting for pages */
    RQ_PREFILL,    /* prompt being computed (prefill, colocated) */
    RQ_HANDOFF,    /* prefill: computed, the transfer concludes */
    RQ_WAIT_KV,    /* decode: the receiver waits for the KV */
    RQ_DECODE,     /* generating (decode, colocated) */
    RQ_SIBLING,    /* choice > 0: waits for choice 0's prompt KV (then queued) */
} rq_state_t;

typedef struct {
    kvs_llm_request_t req; /* req.prompt points into tokens */
    rq_state_t state;
    uint32_t *tokens;       /* [prompt_len + max_new_tokens] prompt, then generated tokens */
    kvs_logit_bias_t *bias; /* [req.sampling.n_bias]; req.sampling.bias points here */
    uint32_t ntokens;       /* prompt_len + tokens generated so far */
    uint32_t *pages;        /* [capacity_pages] page table from position 0; npages in use */
    uint32_t npages;
    uint32_t cached;   /* tokens found in the radix cache at this admission (page multiple) */
    uint32_t computed; /* RQ_PREFILL: tokens of [0, ntokens) whose KV is at rest */
    uint32_t generated;
    kvs_radix_node_t *node; /* locked radix match, or NULL */
    /* prefill: the computed prompt went into the radix cache at once (node locked until the
     * transfer concludes); pages [keep_from, keep_to) became the cache's */
    kvs_radix_node_t *inserted;
    uint32_t keep_from, keep_to;
    int cached_early;
    uint32_t choice;         /* of the room's req.n_choices; 0 computes or receives the prompt */
    kvs_radix_node_t *hold;  /* choice > 0, queued: choice 0's prompt in the cache, locked */
    uint32_t preempted;      /* times sent back to the queue for want of pages */
    uint32_t prompt_lp_next; /* prompt_logprobs: the next prompt position to report */
    int has_first_lp;        /* decode: the first token's logprobs came with it */
    kvs_logprobs_t first_lp;
    /* prefill: decode has spoken of the room (rank 0's sender heard it, broadcast), so its
     * handoff cannot wait on decode's admission; 1 for every other request */
    int ready;
    uint32_t unready_pages; /* prefill, admitted before ready: its pages, cached ones too */
    int in_protocol;        /* added to the sender or receiver, not yet released */
    int aborted;            /* abort sent to the sender or receiver */
    int stop;               /* kvs_llm_stop reached this rank */
    int local_fail;         /* this rank could not add the room to its sender or receiver */
    kvs_receiver_t *rx;     /* decode: the room's receiver, from admission on */
    char *peer;             /* decode: req.peer's copy, or NULL */
    kvs_status_t status;
    kvs_llm_event_t ev; /* timestamps, filled as the request goes */
} rq_t;

typedef struct {
    uint64_t room;
    uint8_t *bytes; /* one request as broadcast */
    size_t len;
} pending_t;

typedef struct {
    uint64_t room;
    uint32_t choice; /* or KVS_LLM_CHOICE_ALL */
} stop_t;

#define STOP_BYTES  12 /* a stop as broadcast: room, choice */
#define READY_BYTES 8  /* a room decode has spoken of, as broadcast */

struct kvs_llm {
    kvs_llm_config_t cfg;
    kvs_model_config_t mc;
    uint32_t tp, rank, page;
    uint32_t max_ctx; /* prompt + new tokens at most: cfg.max_context, or the model's */
    kvs_radix_t *radix;
    rq_t **rqs; /* admission order */
    uint32_t nrqs, cap_rqs;
    /* rank 0: submitted, not yet broadcast */
    pending_t *pending;
    uint32_t npending, cap_pending;
    stop_t *stops;
    uint32_t nstops, cap_stops;
    uint64_t *ready; /* prefill: queued rooms decode has spoken of since the last step */
    uint32_t nready, cap_ready;
    /* rank 0: events not yet taken */
    kvs_llm_event_t *events;
    uint32_t ev_head, ev_count, ev_cap;
    /* scratch */
    kvs_model_seq_t *seqs; /* [max_running] */
    rq_t **seq_rq;         /* [max_running] */
    float *logits;         /* [max_running][vocab] */
    uint32_t *counts;      /* [vocab] the sampler's penalty scratch, all zero between calls */
    float *raw;            /* [vocab] rank 0: a row's logits before sampling rewrites them */
    uint32_t *dev_tok;     /* [max_running] tokens sampled where the model runs (a device) */
    float *all_logits;     /* [all_cap][vocab] rank 0: every position of prompt-logprobs chunks */
    size_t all_cap;
    double *agree;      /* [cap_agree][KVS_LLM_AGREE_DOUBLES] */
    uint32_t cap_agree; /* requests */
    uint8_t *wire;      /* broadcast assembly */
    size_t wire_cap;
    uint32_t *wire_ids; /* [cap_wire_ids] a broadcast request's prompt, decoded */
    kvs_logit_bias_t *wire_bias;
    char *wire_peer; /* its prefill instance's description */
    uint32_t cap_wire_ids, cap_wire_bias, cap_wire_peer;
    int want_metrics;          /* rank 0: collect at the next step */
    kvs_pd_metrics_t instance; /* summed over the ranks at the last collection */
    uint64_t collections;
    kvs_llm_stats_t st;
};

/* ---- small helpers ---- */

static int grow(void **arr, uint32_t *cap, uint32_t need, size_t elem)
{
    if (need <= *cap) return 1;
    uint32_t n = *cap ? *cap * 2 : 16;
    while (n < need) n *= 2;
    void *p = kvs_realloc(*arr, (size_t) n * elem);
    if (p == NULL) return 0;
    *arr = p;
    *cap = n;
    return 1;
}

static void emit(kvs_llm_t *e, const kvs_llm_event_t *ev)
{
    if (e->rank != 0) return;
    if (e->ev_count == e->ev_cap) {
        uint32_t n = e->ev_cap ? e->ev_cap * 2 : 64;
        kvs_llm_event_t *p = kvs_malloc((size_t) n * sizeof(*p));
        if (p == NULL) {
            kvs_error("llm: out of memory queueing an event of room %llu",
                      (unsigned long long) ev->room);
            return;
        }
        for (uint32_t i = 0; i < e->ev_count; i++) p[i] = e->events[(e->ev_head + i) % e->ev_cap];
        kvs_free(e->events);
        e->events = p;
        e->ev_cap = n;
        e->ev_head = 0;
    }
    e->events[(e->ev_head + e->ev_count) % e->ev_cap] = *ev;
    e->ev_count++;
}

/* lp: the token's logprobs, or NULL when the request did not ask. */
static void emit_token(kvs_llm_t *e, rq_t *r, uint32_t token, const kvs_logprobs_t *lp)
{
    kvs_llm_event_t ev = {.kind = KVS_LLM_EV_TOKEN,
                          .room = r->req.room,
                          .choice = r->choice,
                          .token = token,
                          .index = r->generated - 1};
    if (lp != NULL) {
        ev.has_logprobs = 1;
        ev.lp = *lp;
    }
    emit(e, &ev);
}

/* Floats travel in the broadcast as their bits, so every rank samples with the same values. */
static void put_f32(uint8_t *p, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    kvs_put_u32(p, u);
}

static float get_f32(const uint8_t *p)
{
    uint32_t u = kvs_get_u32(p);
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* A prefill room's final metadata: [0,4) the first token; with its logprobs, [4,8) its logprob
 * (f32), [8,12) n_top, then n_top (token u32, logprob f32) pairs. */
#define META_MAX (12 + 8 * KVS_LOGPROBS_TOP_MAX)
typedef char meta_fits[META_MAX <= KVS_MSG_FINAL_MAX ? 1 : -1];

static size_t meta_put(uint8_t *m, uint32_t token, const kvs_logprobs_t *lp)
{
    kvs_put_u32(m, token);
    if (lp == NULL) return 4;
    put_f32(m + 4, lp->logprob);
    kvs_put_u32(m + 8, lp->n_top);
    for (uint32_t i = 0; i < lp->n_top; i++) {
        kvs_put_u32(m + 12 + 8 * i, lp->top[i].token);
        put_f32(m + 16 + 8 * i, lp->top[i].logprob);
    }
    return 12 + 8 * (size_t) lp->n_top;
}

/* 1 when the metadata carries the token's logprobs (well formed), into *lp_p. */
static int meta_logprobs(const uint8_t *m, size_t len, kvs_logprobs_t *lp_p)
{
    if (len < 12) return 0;
    uint32_t n = kvs_get_u32(m + 8);
    if (n > KVS_LOGPROBS_TOP_MAX || len != 12 + 8 * (size_t) n) return 0;
    memset(lp_p, 0, sizeof(*lp_p));
    lp_p->logprob = get_f32(m + 4);
    lp_p->n_top = n;
    for (uint32_t i = 0; i < n; i++)
        lp_p->top[i] = (kvs_token_logprob_t){.token = kvs_get_u32(m + 12 + 8 * i),
                                             .logprob = get_f32(m + 16 + 8 * i)};
    return 1;
}

static uint32_t pages_for(uint32_t tokens, uint32_t page)
{
    return (tokens + page - 1) / page;
}

/* The most pages a request can come to hold (its page table's size): the prompt, plus (where
 * tokens are generated) the positions fed back; the last generated token is never fed. */
static uint32_t capacity_pages(const kvs_llm_t *e, const kvs_llm_request_t *q)
{
    uint32_t positions = q->prompt_len;
    if (e->cfg.role != KVS_LLM_PREFILL) positions += q->max_new_tokens - 1;
    return pages_for(positions, e->page);
}

static void radix_free(void *arg, const uint32_t *pages, size_t count)
{
    kvs_llm_t *e = arg;
    if (kvs_pool_free(e->cfg.pool, pages, (uint32_t) count) != KVS_OK)
        kvs_error("llm: the radix cache handed back pages the pool did not lend");
}

/* Pages that could be had now: free, or held by the radix cache in nodes no request locks. */
static uint32_t available_pages(const kvs_llm_t *e)
{
    uint64_t n = kvs_pool_free_pages(e->cfg.pool);
    if (e->radix != NULL) {
        kvs_radix_stats_t rs;
        kvs_radix_stats(e->radix, &rs);
        n += rs.evictable_pages;
    }
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t) n;
}

/* n pages, evicting from the radix cache first when short; KVS_ERR_NOSPACE (not logged). */
static kvs_status_t take_pages(kvs_llm_t *e, uint32_t n, uint32_t *pages_p)
{
    if (n == 0) return KVS_OK;
    uint32_t free_pages = kvs_pool_free_pages(e->cfg.pool);
    if (free_pages < n && e->radix != NULL) {
        kvs_radix_evict(e->radix, n - free_pages);
        free_pages = kvs_pool_free_pages(e->cfg.pool);
    }
    if (free_pages < n) return KVS_ERR_NOSPACE;
    return kvs_pool_alloc(e->cfg.pool, n, pages_p);
}

static void give_pages(kvs_llm_t *e, const uint32_t *pages, uint32_t n)
{
    if (n > 0 && kvs_pool_free(e->cfg.pool, pages, n) != KVS_OK)
        kvs_error("llm: freeing %u pages failed (engine bookkeeping)", n);
}

/* ---- lifecycle ---- */

kvs_status_t kvs_llm_create(const kvs_llm_config_t *c, kvs_llm_t **llm_p)
{
    if (c == NULL || c->model == NULL || c->pool == NULL || c->max_running == 0 ||
        c->chunk_tokens == 0 || c->batch_tokens < c->chunk_tokens ||
        (unsigned) c->role > KVS_LLM_DECODE) {
        kvs_error("llm: needs a model, a pool, max_running >= 1, chunk_tokens >= 1, "
                  "batch_tokens >= chunk_tokens and a role");
        return KVS_ERR_INVALID;
    }
    if ((c->role == KVS_LLM_PREFILL && c->sender == NULL) ||
        (c->role == KVS_LLM_DECODE && c->receiver == NULL &&
         (c->receivers.receiver == NULL || c->receivers.progress == NULL ||
          c->receivers.metrics == NULL))) {
        kvs_error("llm: a %s engine needs its %s",
                  c->role == KVS_LLM_PREFILL ? "prefill" : "decode",
                  c->role == KVS_LLM_PREFILL ? "sender" : "receiver");
        return KVS_ERR_INVALID;
    }
    kvs_tp_t tp = kvs_model_tp(c->model);
    const kvs_pool_config_t *pc = kvs_pool_config(c->pool);
    kvs_kv_shape_t shape = kvs_model_kv_shape(c->model);
    const int dev = kvs_model_device(c->model);
    if (pc->mem != (dev < 0 ? KVS_MEM_HOST : KVS_MEM_DEVICE) || (dev >= 0 && pc->device != dev) ||
        memcmp(&pc->shape, &shape, sizeof(shape)) != 0 || pc->tp.tp_size != tp.tp_size ||
        pc->tp.tp_rank != tp.tp_rank) {
        kvs_error("llm: the pool must be in the model's memory (%s) with its KV shape and TP rank "
                  "%u of %u",
                  dev < 0 ? "host" : "its CUDA device", tp.tp_rank, tp.tp_size);
        return KVS_ERR_INVALID;
    }
    if ((tp.tp_size > 1) != (c->group != NULL) ||
        (c->group != NULL &&
         (kvs_tpgroup_size(c->group) != tp.tp_size || kvs_tpgroup_rank(c->group) != tp.tp_rank))) {
        kvs_error("llm: TP rank %u of %u needs %s", tp.tp_rank, tp.tp_size,
                  tp.tp_size > 1 ? "its TP group (same size and rank)" : "no TP group");
        return KVS_ERR_INVALID;
    }
    const kvs_model_config_t *mc = kvs_model_config(c->model);
    if (c->max_context == 1 || c->max_context > mc->max_ctx) {
        kvs_error("llm: max_context %u must be 2..%u (the model's context)", c->max_context,
                  mc->max_ctx);
        return KVS_ERR_INVALID;
    }
    kvs_llm_t *e = kvs_calloc(1, sizeof(*e));
    if (e == NULL) return KVS_ERR_NOMEM;
    e->cfg = *c;
    e->mc = *mc;
    e->tp = tp.tp_size;
    e->rank = tp.tp_rank;
    e->page = pc->page_size;
    e->max_ctx = c->max_context ? c->max_context : mc->max_ctx;
    kvs_status_t st = KVS_ERR_NOMEM;
    e->seqs = kvs_calloc(c->max_running, sizeof(*e->seqs));
    e->seq_rq = kvs_calloc(c->max_running, sizeof(*e->seq_rq));
    e->logits = kvs_malloc((size_t) c->max_running * mc->vocab * sizeof(float));
    e->cap_agree = c->max_running;
    e->agree = kvs_malloc((size_t) KVS_LLM_AGREE_DOUBLES * c->max_running * sizeof(double));
    e->counts = kvs_calloc(mc->vocab, sizeof(uint32_t));
    e->dev_tok = kvs_calloc(c->max_running, sizeof(uint32_t));
    e->raw = kvs_malloc((size_t) mc->vocab * sizeof(float));
    if (e->seqs == NULL || e->seq_rq == NULL || e->logits == NULL || e->agree == NULL ||
        e->counts == NULL || e->raw == NULL || e->dev_tok == NULL)
        goto err;
    if (c->radix && (st = kvs_radix_create(e->page, radix_free, e, &e->radix)) != KVS_OK) goto err;
    *llm_p = e;
    return KVS_OK;
err:
    kvs_llm_destroy(e);
    return st;
}

static void rq_free(rq_t *r)
{
    if (r == NULL) return;
    kvs_free(r->tokens);
    kvs_free(r->bias);
    kvs_free(r->pages);
    kvs_free(r->peer);
    kvs_free(r);
}

void kvs_llm_destroy(kvs_llm_t *e)
{
    if (e == NULL) return;
    for (uint32_t i = 0; i < e->nrqs; i++) {
        rq_t *r = e->rqs[i];
        if (r->npages > 0) {
            /* What it put in the radix cache early goes back with the cache. */
            uint32_t first = r->cached / e->page, from = r->cached_early ? r->keep_from : r->npages;
            uint32_t to = r->cached_early ? r->keep_to : r->npages;
            give_pages(e, r->pages + first, from - first);
            give_pages(e, r->pages + to, r->npages - to);
        }
        rq_free(r);
    }
    kvs_radix_destroy(e->radix); /* its pages go back to the pool */
    for (uint32_t i = 0; i < e->npending; i++) kvs_free(e->pending[i].bytes);
    kvs_free(e->pending);
    kvs_free(e->stops);
    kvs_free(e->ready);
    kvs_free(e->rqs);
    kvs_free(e->events);
    kvs_free(e->seqs);
    kvs_free(e->seq_rq);
    kvs_free(e->logits);
    kvs_free(e->agree);
    kvs_free(e->counts);
    kvs_free(e->dev_tok);
    kvs_free(e->raw);
    kvs_free(e->all_logits);
    kvs_free(e->wire);
    kvs_free(e->wire_ids);
    kvs_free(e->wire_bias);
    kvs_free(e->wire_peer);
    kvs_free(e);
}

/* ---- rank 0's inputs ---- */

static rq_t *find(const kvs_llm_t *e, uint64_t room)
{
    for (uint32_t i = 0; i < e->nrqs; i++)
        if (e->rqs[i]->req.room == room) return e->rqs[i];
    return NULL;
}

kvs_status_t kvs_llm_submit(kvs_llm_t *e, const kvs_llm_request_t *q)
{
    if (e->rank != 0) {
        kvs_error("llm: requests go to rank 0 (this is rank %u)", e->rank);
        return KVS_ERR_INVALID;
    }
    const int generates = e->cfg.role != KVS_LLM_PREFILL;
    /* A prefill request yields one token, which must fit the context too. */
    const uint32_t new_tokens = generates ? (q ? q->max_new_tokens : 0) : 1;
    if (q == NULL || q->prompt == NULL || q->prompt_len == 0 || new_tokens == 0 ||
        (uint64_t) q->prompt_len + new_tokens > e->max_ctx) {
        kvs_error("llm: room %llu: a prompt of %u tokens with %u new tokens does not fit the "
                  "context of %u tokens (at least one of each)",
                  q ? (unsigned long long) q->room : 0ull, q ? q->prompt_len : 0, new_tokens,
                  e->max_ctx);
        return KVS_ERR_INVALID;
    }
    const char *why = kvs_sample_params_invalid(&q->sampling, e->mc.vocab);
    if (why == NULL && q->top_logprobs > KVS_LOGPROBS_TOP_MAX) why = "top_logprobs must be 0..20";
    if (why == NULL && q->prompt_logprobs && !q->logprobs) why = "prompt logprobs need logprobs";
    if (why == NULL && q->n_choices > KVS_LLM_CHOICES_MAX) why = "n_choices must be 1..16";
    if (why == NULL && q->n_choices > 1 && !generates)
        why = "a prefill engine computes one choice (the decode side samples the others)";
    if (why != NULL) {
        kvs_error("llm: room %llu: %s", (unsigned long long) q->room, why);
        return KVS_ERR_INVALID;
    }
    /* Admission is FIFO and waits for pages: a prompt the whole pool cannot hold would wait
     * forever and block every later request. Its new tokens take pages as they come; every
     * further choice takes a page of its own at admission (the prompt's last one). */
    const uint32_t choices = q->n_choices > 1 ? q->n_choices : 1;
    uint64_t need = (uint64_t) pages_for(q->prompt_len, e->page) + (choices - 1);
    uint32_t have = kvs_pool_total_pages(e->cfg.pool);
    if (need > have) {
        kvs_error("llm: room %llu: a prompt of %u tokens with %u choice%s needs %llu pages of %u "
                  "tokens, more than the whole pool of %u: it can never be admitted",
                  (unsigned long long) q->room, q->prompt_len, choices, choices == 1 ? "" : "s",
                  (unsigned long long) need, e->page, have);
        return KVS_ERR_NOSPACE;
    }
    for (uint32_t i = 0; i < q->prompt_len; i++) {
        if (q->prompt[i] >= e->mc.vocab) {
            kvs_error("llm: room %llu: token %u at %u is outside the vocabulary (%u)",
                      (unsigned long long) q->room, q->prompt[i], i, e->mc.vocab);
            return KVS_ERR_INVALID;
        }
    }
    int live = find(e, q->room) != NULL;
    for (uint32_t i = 0; i < e->npending && !live; i++) live = e->pending[i].room == q->room;
    if (live) {
        kvs_error("llm: room %llu is already live", (unsigned long long) q->room);
        return KVS_ERR_INVALID;
    }
    if (!grow((void **) &e->pending, &e->cap_pending, e->npending + 1, sizeof(pending_t)))
        return KVS_ERR_NOMEM;
    const size_t peer_len = q->peer ? strlen(q->peer) : 0;
    if (peer_len > KVS_LLM_PEER_MAX) {
        kvs_error("llm: room %llu: a prefill instance description of %zu bytes (at most %u)",
                  (unsigned long long) q->room, peer_len, KVS_LLM_PEER_MAX);
        return KVS_ERR_INVALID;
    }
    const kvs_sample_params_t *sp = &q->sampling;
    size_t len = REQ_FIXED + (size_t) q->prompt_len * 4 + (size_t) sp->n_bias * 8 + 4 + peer_len;
    uint8_t *b = kvs_malloc(len);
    if (b == NULL) return KVS_ERR_NOMEM;
    kvs_put_u64(b, q->room);
    kvs_put_u32(b + 8, q->prompt_len);
    kvs_put_u32(b + 12, q->max_new_tokens);
    put_f32(b + 16, sp->temperature);
    put_f32(b + 20, sp->top_p);
    kvs_put_u64(b + 24, q->seed);
    kvs_put_u32(b + 32, q->eos);
    kvs_put_u32(b + 36, sp->n_bias);
    kvs_put_u32(b + 40, sp->top_k);
    put_f32(b + 44, sp->min_p);
    put_f32(b + 48, sp->presence_penalty);
    put_f32(b + 52, sp->frequency_penalty);
    put_f32(b + 56, sp->repetition_penalty);
    /* bits 0-7: top_logprobs; bit 8: logprobs; bit 9: prompt logprobs; bits 16-23: choices */
    kvs_put_u32(b + 60, q->top_logprobs | (q->logprobs ? 0x100u : 0) |
                            (q->prompt_logprobs ? 0x200u : 0) | (choices << 16));
    uint8_t *at = b + REQ_FIXED;
    for (uint32_t i = 0; i < q->prompt_len; i++, at += 4) kvs_put_u32(at, q->prompt[i]);
    for (uint32_t i = 0; i < sp->n_bias; i++, at += 8) {
        kvs_put_u32(at, sp->bias[i].token);
        put_f32(at + 4, sp->bias[i].bias);
    }
    kvs_put_u32(at, (uint32_t) peer_len);
    if (peer_len > 0) memcpy(at + 4, q->peer, peer_len);
    e->pending[e->npending++] = (pending_t){.room = q->room, .bytes = b, .len = len};
    return KVS_OK;
}

kvs_status_t kvs_llm_stop(kvs_llm_t *e, uint64_t room, uint32_t choice)
{
    if (e->rank != 0) {
        kvs_error("llm: stops go to rank 0 (this is rank %u)", e->rank);
        return KVS_ERR_INVALID;
    }
    int live = find(e, room) != NULL;
    for (uint32_t i = 0; i < e->npending && !live; i++) live = e->pending[i].room == room;
    if (!live) return KVS_ERR_NOT_FOUND;
    if (!grow((void **) &e->stops, &e->cap_stops, e->nstops + 1, sizeof(stop_t)))
        return KVS_ERR_NOMEM;
    e->stops[e->nstops++] = (stop_t){room, choice};
    return KVS_OK;
}

/* A request's arrays for its description q (prompt and biases copied from q's), its events'
 * fields filled; NULL when out of memory. */
static rq_t *rq_new(kvs_llm_t *e, const kvs_llm_request_t *q)
{
    rq_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) return NULL;
    r->req = *q;
    uint32_t n = q->prompt_len, nb = q->sampling.n_bias;
    uint32_t cap = n + (e->cfg.role == KVS_LLM_PREFILL ? 1 : q->max_new_tokens);
    r->tokens = kvs_malloc((size_t) cap * sizeof(uint32_t));
    r->pages = kvs_malloc((size_t) capacity_pages(e, q) * sizeof(uint32_t));
    r->bias = nb > 0 ? kvs_malloc((size_t) nb * sizeof(kvs_logit_bias_t)) : NULL;
    const size_t peer_len = q->peer != NULL ? strlen(q->peer) : 0;
    r->peer = q->peer != NULL ? kvs_malloc(peer_len + 1) : NULL;
    if (r->tokens == NULL || r->pages == NULL || (nb > 0 && r->bias == NULL) ||
        (q->peer != NULL && r->peer == NULL)) {
        rq_free(r);
        return NULL;
    }
    memcpy(r->tokens, q->prompt, (size_t) n * sizeof(uint32_t));
    if (nb > 0) memcpy(r->bias, q->sampling.bias, (size_t) nb * sizeof(kvs_logit_bias_t));
    if (r->peer != NULL) memcpy(r->peer, q->peer, peer_len + 1);
    r->req.sampling.bias = r->bias;
    r->req.peer = r->peer;
    r->req.prompt = r->tokens;
    r->ntokens = n;
    r->ev.room = q->room;
    r->ev.prompt_len = n;
    r->ev.submitted_ns = kvs_now_ns();
    r->ready = e->cfg.role != KVS_LLM_PREFILL;
    return r;
}

/* Builds a request from its broadcast bytes and queues it (every rank), its further choices
 * (RQ_SIBLING) right behind it. */
static kvs_status_t enqueue(kvs_llm_t *e, const uint8_t *b, size_t len, size_t *used_p)
{
    if (len < REQ_FIXED) return KVS_ERR_PROTOCOL;
    uint32_t n = kvs_get_u32(b + 8), nb = kvs_get_u32(b + 36);
    uint32_t lpf = kvs_get_u32(b + 60), choices = (lpf >> 16) & 0xff;
    const size_t body = (size_t) n * 4 + (size_t) nb * 8;
    if (n == 0 || nb > KVS_SAMPLE_BIAS_LIMIT || choices == 0 || choices > KVS_LLM_CHOICES_MAX ||
        len - REQ_FIXED < body + 4)
        return KVS_ERR_PROTOCOL;
    const uint32_t peer_len = kvs_get_u32(b + REQ_FIXED + body);
    if (peer_len > KVS_LLM_PEER_MAX || len - REQ_FIXED - body - 4 < peer_len)
        return KVS_ERR_PROTOCOL;
    *used_p = REQ_FIXED + body + 4 + peer_len;
    if (!grow((void **) &e->rqs, &e->cap_rqs, e->nrqs + choices, sizeof(rq_t *)) ||
        !grow((void **) &e->wire_ids, &e->cap_wire_ids, n, sizeof(uint32_t)) ||
        !grow((void **) &e->wire_bias, &e->cap_wire_bias, nb, sizeof(kvs_logit_bias_t)) ||
        !grow((void **) &e->wire_peer, &e->cap_wire_peer, peer_len + 1, 1))
        return KVS_ERR_NOMEM;
    kvs_llm_request_t req, *q = &req;
    memset(q, 0, sizeof(*q));
    q->room = kvs_get_u64(b);
    q->prompt_len = n;
    q->max_new_tokens = kvs_get_u32(b + 12);
    kvs_sample_params_t *sp = &q->sampling;
    sp->temperature = get_f32(b + 16);
    sp->top_p = get_f32(b + 20);
    q->seed = kvs_get_u64(b + 24);
    q->eos = kvs_get_u32(b + 32);
    sp->n_bias = nb;
    sp->top_k = kvs_get_u32(b + 40);
    sp->min_p = get_f32(b + 44);
    sp->presence_penalty = get_f32(b + 48);
    sp->frequency_penalty = get_f32(b + 52);
    sp->repetition_penalty = get_f32(b + 56);
    q->top_logprobs = lpf & 0xff;
    q->logprobs = (lpf >> 8) & 1;
    q->prompt_logprobs = (lpf >> 9) & 1;
    q->n_choices = choices;
    const uint8_t *at = b + REQ_FIXED;
    for (uint32_t i = 0; i < n; i++, at += 4) e->wire_ids[i] = kvs_get_u32(at);
    for (uint32_t i = 0; i < nb; i++, at += 8)
        e->wire_bias[i] = (kvs_logit_bias_t){.token = kvs_get_u32(at), .bias = get_f32(at + 4)};
    sp->bias = e->wire_bias;
    q->prompt = e->wire_ids;
    if (peer_len > 0) {
        memcpy(e->wire_peer, b + REQ_FIXED + body + 4, peer_len);
        e->wire_peer[peer_len] = '\0';
        q->peer = e->wire_peer;
    }
    rq_t *rs[KVS_LLM_CHOICES_MAX];
    const uint64_t seed = q->seed;
    for (uint32_t c = 0; c < choices; c++) {
        if (c > 0) {
            q->seed = seed + c;     /* choice c samples with the request's seed + c */
            q->prompt_logprobs = 0; /* reported once, by choice 0 */
        }
        if ((rs[c] = rq_new(e, q)) == NULL) {
            while (c-- > 0) rq_free(rs[c]);
            return KVS_ERR_NOMEM;
        }
        rs[c]->choice = rs[c]->ev.choice = c;
        rs[c]->state = c > 0 ? RQ_SIBLING : RQ_QUEUED;
    }
    for (uint32_t c = 0; c < choices; c++) e->rqs[e->nrqs++] = rs[c];
    return KVS_OK;
}

/* Every rank's sender or receiver counters, summed over the group (every field is a u64
 * counter or gauge, so the sum is the instance's). */
static kvs_status_t collect_metrics(kvs_llm_t *e)
{
    enum { N = sizeof(kvs_pd_metrics_t) / sizeof(uint64_t) };
    typedef char all_u64[sizeof(kvs_pd_metrics_t) == N * sizeof(uint64_t) ? 1 : -1];
    (void) sizeof(all_u64);
    kvs_pd_metrics_t m;
    memset(&m, 0, sizeof(m));
    if (e->cfg.sender != NULL) kvs_sender_metrics(e->cfg.sender, &m);
    if (e->cfg.receiver != NULL) kvs_receiver_metrics(e->cfg.receiver, &m);
    if (e->cfg.role == KVS_LLM_DECODE && e->cfg.receiver == NULL)
        e->cfg.receivers.metrics(e->cfg.receivers.ctx, &m);
    uint64_t u[N];
    double d[N];
    memcpy(u, &m, sizeof(u));
    for (size_t i = 0; i < N; i++) d[i] = (double) u[i]; /* exact below 2^53 */
    if (e->cfg.group != NULL) {
        kvs_status_t st = kvs_tpgroup_allreduce(e->cfg.group, d, N);
        if (st != KVS_OK) return st;
    }
    for (size_t i = 0; i < N; i++) u[i] = (uint64_t) d[i];
    memcpy(&e->instance, u, sizeof(u));
    e->collections++;
    return KVS_OK;
}

static void cache_prompt_early(kvs_llm_t *e, rq_t *r);

/* Rank 0 of a prefill instance: the rooms its sender has heard decode speak of since the last
 * step, to broadcast (every rank then admits them, or counts their pages, alike). 0: out of
 * memory. */
static int heard_rooms(kvs_llm_t *e)
{
    if (e->cfg.role != KVS_LLM_PREFILL) return 1;
    for (uint32_t i = 0; i < e->nrqs; i++) {
        const rq_t *r = e->rqs[i];
        if (r->ready || !kvs_sender_heard(e->cfg.sender, r->req.room)) continue;
        if (!grow((void **) &e->ready, &e->cap_ready, e->nready + 1, sizeof(uint64_t))) return 0;
        e->ready[e->nready++] = r->req.room;
    }
    return 1;
}

/* The step header: [0,4) quit, [4,8) new requests, [8,12) stops, [12,16) flags (bit 0:
 * collect metrics), [16,24) payload bytes, [24,28) rooms decode has spoken of. */
static kvs_status_t sync_inputs(kvs_llm_t *e, int quit, int *quit_p)
{
    uint8_t head[HEADER_BYTES] = {0};
    size_t payload = 0;
    if (e->rank == 0) {
        if (!heard_rooms(e)) return KVS_ERR_NOMEM; /* fatal: the ranks would diverge */
        for (uint32_t i = 0; i < e->npending; i++) payload += e->pending[i].len;
        payload += (size_t) e->nstops * STOP_BYTES + (size_t) e->nready * READY_BYTES;
        kvs_put_u32(head + 24, e->nready);
        kvs_put_u32(head, (uint32_t) (quit != 0));
        kvs_put_u32(head + 4, e->npending);
        kvs_put_u32(head + 8, e->nstops);
        kvs_put_u32(head + 12, (uint32_t) (e->want_metrics != 0));
        kvs_put_u64(head + 16, payload);
        e->want_metrics = 0;
    }
    kvs_status_t st;
    if (e->cfg.group != NULL &&
        (st = kvs_tpgroup_broadcast(e->cfg.group, head, sizeof(head))) != KVS_OK)
        return st;
    *quit_p = kvs_get_u32(head) != 0;
    uint32_t nnew = kvs_get_u32(head + 4), nstop = kvs_get_u32(head + 8);
    const uint32_t nready = kvs_get_u32(head + 24);
    if ((kvs_get_u32(head + 12) & 1) && (st = collect_metrics(e)) != KVS_OK) return st;
    payload = kvs_get_u64(head + 16);
    if (payload == 0) return KVS_OK;
    if (payload > e->wire_cap) {
        uint8_t *w = kvs_realloc(e->wire, payload);
        if (w == NULL) return KVS_ERR_NOMEM; /* fatal: the ranks would diverge */
        e->wire = w;
        e->wire_cap = payload;
    }
    if (e->rank == 0) {
        size_t at = 0;
        for (uint32_t i = 0; i < e->npending; i++) {
            memcpy(e->wire + at, e->pending[i].bytes, e->pending[i].len);
            at += e->pending[i].len;
            kvs_free(e->pending[i].bytes);
        }
        for (uint32_t i = 0; i < e->nstops; i++, at += STOP_BYTES) {
            kvs_put_u64(e->wire + at, e->stops[i].room);
            kvs_put_u32(e->wire + at + 8, e->stops[i].choice);
        }
        for (uint32_t i = 0; i < e->nready; i++, at += READY_BYTES)
            kvs_put_u64(e->wire + at, e->ready[i]);
        e->npending = e->nstops = e->nready = 0;
    }
    for (size_t at = 0; e->cfg.group != NULL && at < payload; at += PIECE_BYTES) {
        size_t n = payload - at < PIECE_BYTES ? payload - at : PIECE_BYTES;
        if ((st = kvs_tpgroup_broadcast(e->cfg.group, e->wire + at, n)) != KVS_OK) return st;
    }
    size_t at = 0;
    for (uint32_t i = 0; i < nnew; i++) {
        size_t used = 0;
        if ((st = enqueue(e, e->wire + at, payload - at, &used)) != KVS_OK) {
            kvs_error("llm: rank %u cannot queue a broadcast request: %s", e->rank,
                      kvs_status_str(st));
            return st;
        }
        at += used;
    }
    for (uint32_t i = 0; i < nstop && at + STOP_BYTES <= payload; i++, at += STOP_BYTES) {
        uint64_t room = kvs_get_u64(e->wire + at);
        uint32_t choice = kvs_get_u32(e->wire + at + 8);
        for (uint32_t j = 0; j < e->nrqs; j++) {
            rq_t *r = e->rqs[j];
            if (r->req.room == room && (choice == KVS_LLM_CHOICE_ALL || r->choice == choice))
                r->stop = 1;
        }
    }
    for (uint32_t i = 0; i < nready && at + READY_BYTES <= payload; i++, at += READY_BYTES) {
        rq_t *r = find(e, kvs_get_u64(e->wire + at));
        if (r == NULL || r->ready) continue;
        r->ready = 1; /* its handoff no longer waits on decode: its pages are lent no more */
        r->unready_pages = 0;
        if (r->state == RQ_HANDOFF) cache_prompt_early(e, r);
    }
    return KVS_OK;
}

/* ---- ending requests ---- */

/* Inserts tokens [0, valid) with the request's pages into the radix cache and works out which
 * of its pages the cache now owns ([keep_from, keep_to)); node_p (optional) receives the node
 * ending the key. Without a cache, or on failure, the cache owns none. */
static void cache_insert(kvs_llm_t *e, rq_t *r, uint32_t valid, kvs_radix_node_t **node_p)
{
    uint32_t first = r->cached / e->page;
    r->keep_from = r->keep_to = first;
    size_t present = 0;
    if (e->radix == NULL || valid < e->page ||
        kvs_radix_insert(e->radix, 0, (const int32_t *) r->tokens, valid, r->pages, &present,
                         node_p) != KVS_OK)
        return;
    /* [cached, present) was inserted meanwhile by another request: ours are duplicates. The
     * partial last page is not inserted. */
    uint32_t present_pages = (uint32_t) (present / e->page);
    r->keep_from = present_pages > first ? present_pages : first;
    r->keep_to = valid / e->page;
    if (r->keep_to < r->keep_from) r->keep_to = r->keep_from;
}

/* The computed prompt's KV into the radix cache now, locked while the request lives, so later
 * requests (or its other choices) share it while it still runs or is still being sent (the
 * sender only reads the pages). Once per request. */
static void cache_prompt_early(kvs_llm_t *e, rq_t *r)
{
    if (r->cached_early) return;
    cache_insert(e, r, r->req.prompt_len, &r->inserted);
    if (r->inserted != NULL) kvs_radix_lock(e->radix, r->inserted);
    r->cached_early = 1;
}

/* Positions [0, n) whose KV the request's pages hold at rest. */
static uint32_t valid_tokens(const rq_t *r)
{
    switch (r->state) {
    case RQ_PREFILL:
        return r->computed;
    case RQ_HANDOFF:
        return r->req.prompt_len;
    case RQ_DECODE:
        return r->ntokens - 1; /* every position fed; the last token is not yet */
    default:
        return r->cached; /* queued, or the KV still arriving: only the cached prefix */
    }
}

/* Gives back every page the request holds: what it computed to the radix cache (keep) and the
 * rest to the pool; its radix locks are dropped. It holds nothing afterwards. */
static void release_pages(kvs_llm_t *e, rq_t *r, int keep)
{
    uint32_t first = r->cached / e->page;
    if (r->npages > 0 && r->cached_early) {
        /* Prefill put its prompt in the cache when it was computed. */
        give_pages(e, r->pages + first, r->keep_from - first);
        give_pages(e, r->pages + r->keep_to, r->npages - r->keep_to);
        if (r->inserted != NULL) (void) kvs_radix_unlock(e->radix, r->inserted);
    } else if (r->npages > 0) {
        if (keep)
            cache_insert(e, r, valid_tokens(r), NULL);
        else
            r->keep_from = r->keep_to = first;
        give_pages(e, r->pages + first, r->keep_from - first);
        give_pages(e, r->pages + r->keep_to, r->npages - r->keep_to);
    }
    if (r->node != NULL) (void) kvs_radix_unlock(e->radix, r->node);
    if (r->hold != NULL) (void) kvs_radix_unlock(e->radix, r->hold);
    r->node = r->inserted = r->hold = NULL;
    r->npages = r->cached = r->keep_from = r->keep_to = 0;
    r->cached_early = 0;
}

/* Removes request i: pages to the radix cache (what it computed) or the pool, then EV_DONE.
 * The room's other choices: those still waiting for choice 0's prompt (behind it) end with it,
 * as it did; when it failed, the others stop at the next step. */
static void finish(kvs_llm_t *e, uint32_t i, kvs_status_t status, kvs_llm_finish_t why)
{
    rq_t *r = e->rqs[i];
    const uint64_t room = r->req.room;
    const int others = r->req.n_choices > 1, first = r->choice == 0;
    release_pages(e, r, status == KVS_OK);
    if (status == KVS_OK)
        e->st.requests_ok++;
    else
        e->st.requests_failed++;
    r->ev.kind = KVS_LLM_EV_DONE;
    r->ev.status = status;
    r->ev.finish = why;
    r->ev.generated = r->generated;
    r->ev.done_ns = kvs_now_ns();
    emit(e, &r->ev);
    rq_free(r);
    memmove(e->rqs + i, e->rqs + i + 1, (size_t) (e->nrqs - i - 1) * sizeof(rq_t *));
    e->nrqs--;
    for (uint32_t j = 0; others && j < e->nrqs;) {
        rq_t *s = e->rqs[j];
        if (first && s->req.room == room && s->state == RQ_SIBLING) {
            finish(e, j, status, why); /* behind choice 0: j >= i */
            continue;
        }
        if (s->req.room == room && status != KVS_OK) s->stop = 1;
        j++;
    }
}

/* ---- transfer outcomes, agreed over the ranks ---- */

static int in_agreement(const kvs_llm_t *e, const rq_t *r)
{
    return r->in_protocol || r->local_fail;
}

/* A rank's part of a request's agreement: [0] transfer done here, [1] failed here, [2] quiet
 * here (nothing of it can still move), [3..5] its failure reason (kvs__llm_reason_part). */
static void local_outcome(kvs_llm_t *e, rq_t *r, double *v)
{
    kvs_room_info_t info;
    int ok = 0, failed = r->local_fail, quiet = r->local_fail;
    if (!r->local_fail) {
        kvs_status_t st = e->cfg.role == KVS_LLM_PREFILL
                              ? kvs_sender_poll(e->cfg.sender, r->req.room, &info)
                              : kvs_receiver_poll(r->rx, r->req.room, &info);
        if (st != KVS_OK) {
            failed = quiet = 1;
        } else {
            ok = info.status == KVS_ROOM_SUCCESS && info.quiescent;
            failed = info.status == KVS_ROOM_FAILED;
            quiet = info.quiescent;
            if (failed && r->status == KVS_OK) r->status = info.reason ? info.reason : KVS_ERR_IO;
            if (ok && e->cfg.role == KVS_LLM_DECODE && r->generated == 0 && info.final_len >= 4) {
                r->tokens[r->ntokens] = kvs_get_u32(info.final); /* the first token */
                r->has_first_lp = meta_logprobs(info.final, info.final_len, &r->first_lp);
            }
        }
    }
    v[0] = ok;
    v[1] = failed;
    v[2] = quiet;
    kvs__llm_reason_part(failed ? r->status : KVS_OK, v + 3);
}

void kvs__llm_reason_part(kvs_status_t reason, double *part)
{
    const int root = reason != KVS_OK && reason != KVS_ERR_ABORTED;
    const double code = root ? (double) -reason : 0.0;
    part[0] = root;
    part[1] = code;
    part[2] = code * code;
}

/* The reason every rank that failed a request by a root cause of its own agrees on (the sums
 * of local_outcome's [3..5]: all codes equal exactly when n * sum of squares = sum^2), or
 * KVS_OK when none did or they differ. So every rank reports one rank's broken write, say, and
 * not the "aborted" that the others saw. */
kvs_status_t kvs__llm_agreed_reason(const double *v)
{
    if (v[3] < 1 || v[3] * v[5] != v[4] * v[4]) return KVS_OK;
    return (kvs_status_t) - (int) (v[4] / v[3]);
}

static void protocol_abort(kvs_llm_t *e, rq_t *r)
{
    if (r->aborted || !r->in_protocol) return;
    r->aborted = 1;
    if (e->cfg.role == KVS_LLM_PREFILL)
        (void) kvs_sender_abort(e->cfg.sender, r->req.room);
    else
        (void) kvs_receiver_abort(r->rx, r->req.room);
}

static void protocol_release(kvs_llm_t *e, rq_t *r)
{
    if (!r->in_protocol) return;
    r->in_protocol = 0;
    if (e->cfg.role == KVS_LLM_PREFILL)
        (void) kvs_sender_release(e->cfg.sender, r->req.room);
    else
        (void) kvs_receiver_release(r->rx, r->req.room);
}

/* Choice 0's prompt KV is at rest on every rank (and its first token known): the prompt goes
 * into the radix cache (kept there while the sequence lives), and the room's other choices are
 * queued, each holding the cached prompt until its admission matches it. */
static void release_siblings(kvs_llm_t *e, rq_t *r)
{
    if (r->choice != 0 || r->req.n_choices <= 1) return;
    cache_prompt_early(e, r);
    for (uint32_t i = 0; i < e->nrqs; i++) {
        rq_t *s = e->rqs[i];
        if (s->req.room != r->req.room || s->state != RQ_SIBLING) continue;
        s->state = RQ_QUEUED;
        if (r->inserted != NULL) {
            kvs_radix_lock(e->radix, r->inserted);
            s->hold = r->inserted;
        }
    }
}

static kvs_status_t agree(kvs_llm_t *e, uint32_t *work)
{
    if (e->cfg.role == KVS_LLM_COLOCATED) return KVS_OK;
    uint32_t n = 0;
    for (uint32_t i = 0; i < e->nrqs; i++) n += in_agreement(e, e->rqs[i]);
    if (n == 0) return KVS_OK;
    /* More than max_running: a prefill instance's handoffs hold no compute slot (admit). */
    if (!grow((void **) &e->agree, &e->cap_agree, n, KVS_LLM_AGREE_DOUBLES * sizeof(double)))
        return KVS_ERR_NOMEM; /* fatal: the ranks would diverge */
    n = 0;
    for (uint32_t i = 0; i < e->nrqs; i++)
        if (in_agreement(e, e->rqs[i]))
            local_outcome(e, e->rqs[i], e->agree + KVS_LLM_AGREE_DOUBLES * n++);
    /* In pieces of max_running requests: what the group's all-reduce is sized for. */
    const size_t piece = (size_t) KVS_LLM_AGREE_DOUBLES * e->cfg.max_running;
    for (size_t at = 0, all = (size_t) KVS_LLM_AGREE_DOUBLES * n; e->cfg.group != NULL && at < all;
         at += piece) {
        kvs_status_t st =
            kvs_tpgroup_allreduce(e->cfg.group, e->agree + at, all - at < piece ? all - at : piece);
        if (st != KVS_OK) return st;
    }
    const double T = e->tp;
    uint32_t k = 0;
    for (uint32_t i = 0; i < e->nrqs;) {
        rq_t *r = e->rqs[i];
        if (!in_agreement(e, r)) {
            i++;
            continue;
        }
        const double *v = e->agree + KVS_LLM_AGREE_DOUBLES * k++;
        if (v[1] > 0) {
            /* Failed somewhere: stop everywhere, and conclude once no rank can still write. */
            protocol_abort(e, r);
            if (v[2] < T) {
                i++;
                continue;
            }
            protocol_release(e, r);
            (*work)++;
            const kvs_status_t agreed = kvs__llm_agreed_reason(v);
            finish(e, i,
                   r->stop               ? KVS_OK
                   : agreed != KVS_OK    ? agreed
                   : r->status != KVS_OK ? r->status
                                         : KVS_ERR_IO,
                   r->stop ? KVS_LLM_FINISH_STOP : KVS_LLM_FINISH_ERROR);
            continue;
        }
        if (v[0] < T) {
            i++;
            continue;
        }
        protocol_release(e, r);
        (*work)++;
        if (e->cfg.test_kv_hook != NULL)
            e->cfg.test_kv_hook(e->cfg.test_kv_ctx, r->req.room, e->cfg.pool, r->pages,
                                r->req.prompt_len);
        if (e->cfg.role == KVS_LLM_PREFILL) {
            finish(e, i, KVS_OK, KVS_LLM_FINISH_HANDOFF);
            continue;
        }
        /* Decode: the KV and the first token are on every rank. */
        uint32_t first = r->tokens[r->ntokens];
        r->ntokens++;
        r->generated = 1;
        r->computed = r->req.prompt_len;
        r->ev.kv_ready_ns = r->ev.first_token_ns = kvs_now_ns();
        kvs_trace("%.3f ms decode rank %u: room %llu: the KV is here on every rank",
                  (double) r->ev.kv_ready_ns / 1e6, e->rank, (unsigned long long) r->req.room);
        emit_token(e, r, first, r->req.logprobs && r->has_first_lp ? &r->first_lp : NULL);
        release_siblings(e, r);
        if (first == r->req.eos || r->req.max_new_tokens == 1) {
            finish(e, i, KVS_OK, first == r->req.eos ? KVS_LLM_FINISH_EOS : KVS_LLM_FINISH_LENGTH);
            continue;
        }
        r->state = RQ_DECODE;
        i++;
    }
    return KVS_OK;
}

/* ---- admission ---- */

static uint32_t running(const kvs_llm_t *e)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < e->nrqs; i++)
        n += e->rqs[i]->state != RQ_QUEUED && e->rqs[i]->state != RQ_SIBLING;
    return n;
}

/* Whether an admitted request holds one of the max_running slots. A prefill request whose
 * prompt is computed (RQ_HANDOFF) holds none: its transfer may wait for the decode instance to
 * admit the room, and the decode instance, which admits in the order requests reached it, may
 * be waiting for its own rooms' KV, computed here only once a slot frees. Counted, the two
 * sides' first max_running rooms could each wait on the other's until the bootstrap timeout
 * failed them (two instances fed in different orders: 16 clients at once through the router).
 * A decode request waiting for its KV (RQ_WAIT_KV) holds its slot: the prefill side computes
 * every room it admits whatever decode does, so its KV comes. */
static int holds_slot(const rq_t *r)
{
    return r->state != RQ_QUEUED && r->state != RQ_SIBLING && r->state != RQ_HANDOFF;
}

/* Radix match, pages, and the protocol room; 0 when pages are short (FIFO: wait) or it would
 * hold more than `most`, its cached prefix included (locked, those pages are no one else's to
 * take either). Pages for the tokens known (the prompt; after a preemption, prompt +
 * generated), and where sequences grow, one page of headroom left for each of the `running`
 * requests. */
static int admit_one(kvs_llm_t *e, rq_t *r, uint32_t running, uint32_t most)
{
    const kvs_llm_request_t *q = &r->req;
    uint32_t cached = 0;
    kvs_radix_node_t *node = NULL;
    /* All but the last known token: at least one is computed here (prefill: it yields the
     * first token; decode: at least one position is transferred; a recompute: the next
     * token). */
    /* Prompt logprobs need the logits of every prompt position, which a cached prefix lacks. */
    const int whole = q->prompt_logprobs && r->generated == 0 && e->cfg.role != KVS_LLM_DECODE;
    if (e->radix != NULL && r->ntokens > e->page && !whole) {
        kvs_radix_match_t m;
        if (kvs_radix_match(e->radix, 0, (const int32_t *) r->tokens, r->ntokens - 1, r->pages,
                            &m) == KVS_OK &&
            m.tokens > 0) {
            kvs_radix_lock(e->radix, m.node); /* before allocating: eviction must spare it */
            node = m.node;
            cached = (uint32_t) m.tokens;
        }
    }
    uint32_t first = cached / e->page, total = pages_for(r->ntokens, e->page);
    uint32_t headroom = e->cfg.role == KVS_LLM_PREFILL ? 0 : running;
    if (total > most || (uint64_t) total - first + headroom > available_pages(e) ||
        take_pages(e, total - first, r->pages + first) != KVS_OK) {
        if (node != NULL) (void) kvs_radix_unlock(e->radix, node);
        return 0;
    }
    r->node = node;
    r->npages = total;
    r->unready_pages = r->ready ? 0 : total;
    r->cached = r->computed = cached;
    if (r->hold != NULL) { /* its own match holds what it shares now */
        (void) kvs_radix_unlock(e->radix, r->hold);
        r->hold = NULL;
    }
    if (!r->preempted) {
        r->ev.admitted_ns = kvs_now_ns();
        r->ev.cached_tokens = cached;
        e->st.cached_tokens += cached;
    }
    if (r->generated > 0 || r->choice > 0) {
        /* Back after a preemption, or a further choice: computed locally, whatever the role. */
        r->state = RQ_PREFILL;
        return 1;
    }
    kvs_status_t st = KVS_OK;
    if (e->cfg.role == KVS_LLM_PREFILL) {
        st = kvs_sender_add_room(e->cfg.sender, q->room, q->prompt_len, r->pages);
        /* The cached prefix is at rest now: the sender may ship it during the first pass. */
        if (st == KVS_OK) st = kvs_sender_advance(e->cfg.sender, q->room, cached, cached);
        r->state = RQ_PREFILL;
    } else if (e->cfg.role == KVS_LLM_DECODE) {
        r->rx = e->cfg.receiver;
        if (r->rx == NULL) st = e->cfg.receivers.receiver(e->cfg.receivers.ctx, q->peer, &r->rx);
        if (st == KVS_OK)
            st = kvs_receiver_add_room(r->rx, q->room, cached, q->prompt_len, r->pages + first);
        r->state = RQ_WAIT_KV;
    } else {
        r->state = RQ_PREFILL;
    }
    if (e->cfg.role != KVS_LLM_COLOCATED) {
        r->in_protocol = st == KVS_OK;
        if (st != KVS_OK) {
            r->local_fail = 1; /* agreed next step: the room fails on every rank */
            r->status = st;
        }
    }
    return 1;
}

/* Pages held or locked (a cached prefix) by prefill requests admitted before decode spoke of
 * their room. */
static uint32_t unready_pages(const kvs_llm_t *e)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < e->nrqs; i++) n += e->rqs[i]->unready_pages;
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t) n;
}

/* Pages a prefill instance lends to rooms decode has not spoken of yet: its pool less the
 * largest prompt it accepts (max_ctx - 1 tokens). */
static uint32_t unready_budget(const kvs_llm_t *e)
{
    const uint32_t total = kvs_pool_total_pages(e->cfg.pool);
    const uint32_t largest = pages_for(e->max_ctx - 1, e->page);
    return largest < total ? total - largest : 0;
}

/* FIFO, as slots and pages allow. A prefill instance admits a room decode has not spoken of
 * yet (counting every such room until decode speaks of it or it ends) only into what its pool holds
 * beyond the largest prompt it accepts: such a room's handoff waits for decode's admission, and
 * decode may be holding its pages for rooms of its own, which need pages here. What is kept back
 * always frees for them (the rooms decode has spoken of end without waiting on anything else), so
 * the two sides cannot hold each other's pages until the bootstrap timeout (a small pool under
 * many clients, or prompts near the pool's size). While the lent pages are taken, such rooms
 * are passed over (the rooms behind them that decode waits for go first), and one that decode
 * has spoken of waits for pages at its place. A pool no larger than one prompt lends nothing:
 * every room waits for decode's word (a round trip of its bootstrap) before it starts. */
static uint32_t admit(kvs_llm_t *e)
{
    uint32_t n = 0, live = running(e), slots = 0;
    for (uint32_t i = 0; i < e->nrqs; i++) slots += holds_slot(e->rqs[i]);
    const uint32_t budget = unready_budget(e);
    uint32_t unready = unready_pages(e);
    for (uint32_t i = 0; i < e->nrqs && slots < e->cfg.max_running; i++) {
        rq_t *r = e->rqs[i];
        if (r->state != RQ_QUEUED) continue;
        const uint32_t most = r->ready ? UINT32_MAX : unready < budget ? budget - unready : 0;
        if (!admit_one(e, r, live, most)) {
            if (r->ready) break;
            continue;
        }
        unready += r->unready_pages;
        live++;
        slots++;
        n++;
    }
    return n;
}

/* Stops that reached this step: queued or generating requests end now; requests inside the
 * protocol are aborted and end through the agreement. */
static uint32_t apply_stops(kvs_llm_t *e)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < e->nrqs;) {
        rq_t *r = e->rqs[i];
        if (!r->stop) {
            i++;
            continue;
        }
        if (r->in_protocol || r->local_fail) {
            protocol_abort(e, r);
            i++;
            continue;
        }
        n++;
        finish(e, i, KVS_OK, KVS_LLM_FINISH_STOP);
    }
    return n;
}

/* ---- pages as sequences grow ---- */

/* Request i goes back to the queue at its place, its computed KV left to the radix cache for its
 * return (or to the pool). It ends instead (KVS_ERR_NOSPACE) when the whole pool could never
 * hold the tokens it knows: it would never be admitted again. */
static void preempt(kvs_llm_t *e, uint32_t i)
{
    rq_t *r = e->rqs[i];
    uint32_t need = pages_for(r->ntokens, e->page), have = kvs_pool_total_pages(e->cfg.pool);
    if (need > have) {
        if (e->rank == 0)
            kvs_warn("llm: room %llu: its %u tokens (%u prompt, %u generated) need %u pages of %u "
                     "tokens, more than the whole KV pool of %u: it ends before its max tokens",
                     (unsigned long long) r->req.room, r->ntokens, r->req.prompt_len, r->generated,
                     need, e->page, have);
        finish(e, i, KVS_ERR_NOSPACE, KVS_LLM_FINISH_ERROR);
        return;
    }
    release_pages(e, r, 1);
    r->state = RQ_QUEUED;
    r->computed = 0;
    r->preempted++;
    e->st.preemptions++;
}

/* The newest request whose pages can be taken back: generating, or computing its prompt
 * (colocated) or its recompute. Not one in the protocol: the receiver may be writing its pages. */
static uint32_t newest_preemptable(const kvs_llm_t *e)
{
    uint32_t i = e->nrqs;
    while (i-- > 0) {
        rq_state_t s = e->rqs[i]->state;
        if (s == RQ_DECODE || (s == RQ_PREFILL && e->cfg.role != KVS_LLM_PREFILL)) return i;
    }
    return e->nrqs;
}

/* Each generating sequence whose next position starts a page takes one, oldest first; when none
 * is left, the newest running request gives its pages back (preempt) until one is. Returns how
 * many requests were preempted or ended. */
static uint32_t grow_sequences(kvs_llm_t *e)
{
    if (e->cfg.role == KVS_LLM_PREFILL) return 0;
    uint32_t n = 0;
    for (uint32_t i = 0; i < e->nrqs;) {
        rq_t *r = e->rqs[i];
        if (r->state != RQ_DECODE || (r->ntokens - 1) / e->page < r->npages) {
            i++;
            continue;
        }
        if (take_pages(e, 1, r->pages + r->npages) == KVS_OK) {
            r->npages++;
            i++;
            continue;
        }
        /* r itself qualifies, so the victim is r or a newer request: none already passed. When
         * it is r, index i now holds a queued r or (r ended) the next request. */
        uint32_t v = newest_preemptable(e);
        preempt(e, v);
        n++;
    }
    return n;
}

/* ---- the forward pass ---- */

/* Token number `index` of a request (logits: its row of the pass, rewritten). Its random draw
 * depends on (seed, index) only, not on how many draws came before, and its penalties on the
 * prompt and the tokens generated before it, which the decode side has too (the prompt, and
 * the first token from the prefill side): so the prefill side's first token and the decode
 * side's later ones form the same stream as one colocated run. */
static void token_rng(const rq_t *r, uint32_t index, kvs_rng_t *rng)
{
    kvs_rng_seed(rng, kvs_mix64(r->req.seed ^ kvs_mix64(index)));
}

static uint32_t sample(kvs_llm_t *e, const rq_t *r, float *logits, uint32_t index)
{
    kvs_rng_t rng;
    token_rng(r, index, &rng);
    const kvs_sample_history_t h = {.tokens = r->tokens,
                                    .len = r->ntokens,
                                    .prompt_len = r->req.prompt_len,
                                    .counts = e->counts};
    return kvs_sample(logits, e->mc.vocab, &r->req.sampling, &h, &rng);
}

/* The sequence of the pass whose row of e->logits this is. */
static uint32_t logits_row(const kvs_llm_t *e, const float *logits)
{
    return (uint32_t) ((size_t) (logits - e->logits) / e->mc.vocab);
}

/* The pass samples the next token of request r (number `index`) where the model runs when it
 * can: a model on a device, no logprobs to report, no bias or penalties (which need the
 * history on the host). Every rank decides alike: the inputs are the same on all of them. */
static void sample_on_device(kvs_llm_t *e, const rq_t *r, kvs_model_seq_t *s, uint32_t j,
                             uint32_t index)
{
    if (kvs_model_device(e->cfg.model) < 0 || r->req.logprobs ||
        !kvs_sample_on_device_ok(&r->req.sampling))
        return;
    kvs_rng_t rng;
    token_rng(r, index, &rng);
    s->sample = &r->req.sampling;
    s->draw = kvs_sample_draw(&rng);
    s->token = &e->dev_tok[j];
}

/* Samples token number `index` from logits (rewritten) and, where the request asked and this
 * rank computes them (rank 0; every rank for the prefill side's first token, which every rank
 * sends), its logprobs from the raw row into *lp_p; *has_p says whether. */
static uint32_t sample_lp(kvs_llm_t *e, const rq_t *r, float *logits, uint32_t index,
                          int every_rank, kvs_logprobs_t *lp_p, int *has_p)
{
    const kvs_model_seq_t *s = &e->seqs[logits_row(e, logits)];
    if (s->sample != NULL) { /* sampled on the device; never with logprobs */
        *has_p = 0;
        return *s->token;
    }
    *has_p = r->req.logprobs && (e->rank == 0 || every_rank);
    if (*has_p) memcpy(e->raw, logits, (size_t) e->mc.vocab * sizeof(float));
    uint32_t tok = sample(e, r, logits, index);
    if (*has_p) kvs_logprobs(e->raw, e->mc.vocab, tok, r->req.top_logprobs, lp_p);
    return tok;
}

/* After the last prompt chunk: the first token. */
static void prompt_done(kvs_llm_t *e, rq_t *r, float *logits)
{
    kvs_logprobs_t lp;
    int has;
    uint32_t tok = sample_lp(e, r, logits, 0, e->cfg.role == KVS_LLM_PREFILL, &lp, &has);
    r->ev.prefilled_ns = r->ev.first_token_ns = kvs_now_ns();
    r->tokens[r->ntokens++] = tok;
    r->generated = 1;
    emit_token(e, r, tok, has ? &lp : NULL);
    if (e->cfg.role == KVS_LLM_PREFILL) {
        /* The prompt's KV is final: later requests may share it now, while it is still being
         * sent. A room decode has not spoken of waits until it has (sync_inputs): its lock
         * would hold the cache's pages of a prefix it also computed itself, beyond the pages
         * admit() lends it. */
        if (r->ready) cache_prompt_early(e, r);
        uint8_t meta[META_MAX];
        size_t mlen = meta_put(meta, tok, has ? &lp : NULL);
        if (kvs_sender_finish(e->cfg.sender, r->req.room, meta, mlen) != KVS_OK)
            protocol_abort(e, r);
        r->state = RQ_HANDOFF;
        return;
    }
    r->state = RQ_DECODE;
    release_siblings(e, r);
}

/* A prompt chunk of a request reporting prompt logprobs (and not yet past them). */
static int reports_prompt(const rq_t *r, const kvs_model_seq_t *s)
{
    return r->req.prompt_logprobs && r->state == RQ_PREFILL && r->generated == 0 &&
           s->pos0 + s->n > r->prompt_lp_next;
}

/* Rank 0: points the prompt-logprobs chunks of this pass at rows of all_logits (grown to fit).
 * 0 when it cannot grow (fatal for the step: rank 0 alone would diverge from its reports). */
static int want_all_logits(kvs_llm_t *e, uint32_t nseq)
{
    size_t rows = 0;
    for (uint32_t j = 0; j < nseq; j++)
        if (reports_prompt(e->seq_rq[j], &e->seqs[j])) rows += e->seqs[j].n;
    if (rows > e->all_cap) {
        float *p = kvs_realloc(e->all_logits, rows * e->mc.vocab * sizeof(float));
        if (p == NULL) {
            kvs_error("llm: no memory for the logits of %zu prompt positions", rows);
            return 0;
        }
        e->all_logits = p;
        e->all_cap = rows;
    }
    rows = 0;
    for (uint32_t j = 0; j < nseq; j++) {
        if (!reports_prompt(e->seq_rq[j], &e->seqs[j])) continue;
        e->seqs[j].all_logits = e->all_logits + rows * e->mc.vocab;
        rows += e->seqs[j].n;
    }
    return 1;
}

/* EV_PROMPT for the prompt tokens this chunk's logits predict (the one after each position),
 * from the next one not yet reported (a recompute after a preemption reports nothing twice). */
static void report_prompt(kvs_llm_t *e, rq_t *r, const kvs_model_seq_t *s)
{
    for (uint32_t j = 0; j < s->n; j++) {
        uint32_t at = s->pos0 + j + 1; /* the token these logits predict */
        if (at < r->prompt_lp_next || at >= r->req.prompt_len) continue;
        kvs_llm_event_t ev = {.kind = KVS_LLM_EV_PROMPT,
                              .room = r->req.room,
                              .token = r->tokens[at],
                              .index = at,
                              .has_logprobs = 1};
        kvs_logprobs(s->all_logits + (size_t) j * e->mc.vocab, e->mc.vocab, r->tokens[at],
                     r->req.top_logprobs, &ev.lp);
        emit(e, &ev);
        r->prompt_lp_next = at + 1;
    }
}

/* One turn of the KV handoff: the sender, the receiver, or the receivers of a decode instance
 * fed by several prefill instances. */
static uint32_t progress_kv(kvs_llm_t *e)
{
    uint32_t work = 0;
    if (e->cfg.sender != NULL) work += kvs_sender_progress(e->cfg.sender);
    if (e->cfg.receiver != NULL) work += kvs_receiver_progress(e->cfg.receiver);
    if (e->cfg.role == KVS_LLM_DECODE && e->cfg.receiver == NULL)
        work += e->cfg.receivers.progress(e->cfg.receivers.ctx);
    return work;
}

/* While a pass runs (kvs_model_set_wait): the KV handoff goes on, so a chunk
 * computed by the previous pass is written while this one computes, and the grants and chunks
 * that arrive meanwhile are taken at once. It touches no request in the pass: the sender only
 * reads pages at rest, the receiver writes only the pages of requests waiting for their KV. */
static void move_kv(void *arg)
{
    (void) progress_kv(arg);
}

static kvs_status_t forward(kvs_llm_t *e, uint32_t *work)
{
    uint32_t nseq = 0, budget = e->cfg.batch_tokens, lp_rows = PROMPT_LP_ROWS;
    for (uint32_t i = 0; i < e->nrqs && nseq < e->cfg.max_running; i++) {
        rq_t *r = e->rqs[i];
        kvs_model_seq_t *s = &e->seqs[nseq];
        if (r->state == RQ_PREFILL && budget > 0 && !r->aborted) {
            uint32_t n = r->ntokens - r->computed; /* the prompt, or a recompute */
            if (n > e->cfg.chunk_tokens) n = e->cfg.chunk_tokens;
            if (n > budget) n = budget;
            /* Every rank makes the same cut: the flag is broadcast with the request. */
            if (r->req.prompt_logprobs && r->generated == 0) {
                if (lp_rows == 0) continue;
                if (n > lp_rows) n = lp_rows;
                lp_rows -= n;
            }
            budget -= n;
            *s = (kvs_model_seq_t){.tokens = r->tokens + r->computed,
                                   .n = n,
                                   .pos0 = r->computed,
                                   .pages = r->pages,
                                   .npages = r->npages,
                                   .no_logits = r->computed + n < r->ntokens};
            if (r->computed + n == r->ntokens) sample_on_device(e, r, s, nseq, r->generated);
        } else if (r->state == RQ_DECODE) {
            *s = (kvs_model_seq_t){.tokens = r->tokens + r->ntokens - 1,
                                   .n = 1,
                                   .pos0 = r->ntokens - 1,
                                   .pages = r->pages,
                                   .npages = r->npages};
            sample_on_device(e, r, s, nseq, r->generated);
        } else {
            continue;
        }
        e->seq_rq[nseq++] = r;
    }
    if (nseq == 0) return KVS_OK;
    if (e->rank == 0 && !want_all_logits(e, nseq)) return KVS_ERR_NOMEM;
    int advanced = 0;
    for (uint32_t j = 0; j < nseq; j++) {
        rq_t *r = e->seq_rq[j];
        if (r->state == RQ_PREFILL && e->cfg.role == KVS_LLM_PREFILL) {
            (void) kvs_sender_advance(e->cfg.sender, r->req.room, r->computed,
                                      r->computed + e->seqs[j].n);
            advanced = 1;
        }
    }
    /* The slots of the chunks this pass computes are asked for now, so their grants come back
     * during the pass and the last chunk's write starts as soon as it ends (asked after the
     * pass, the grant's round trip was part of every prompt's time to first token). */
    if (advanced) *work += kvs_sender_progress(e->cfg.sender);
    uint64_t t0 = kvs_now_ns();
    if (e->cfg.role != KVS_LLM_COLOCATED) kvs_model_set_wait(e->cfg.model, move_kv, e);
    kvs_status_t st =
        kvs_model_forward(e->cfg.model, e->cfg.pool, e->seqs, nseq,
                          e->cfg.group ? kvs_tpgroup_allreduce_cb : NULL, e->cfg.group, e->logits);
    kvs_model_set_wait(e->cfg.model, NULL, NULL);
    e->st.forward_ns += kvs_now_ns() - t0;
    e->st.forward_passes++;
    if (st != KVS_OK) {
        kvs_error("llm: rank %u: forward pass failed: %s", e->rank, kvs_status_str(st));
        return st;
    }
    (*work) += nseq;
    for (uint32_t j = 0; j < nseq; j++) {
        rq_t *r = e->seq_rq[j];
        float *lg = e->logits + (size_t) j * e->mc.vocab;
        if (r->state == RQ_PREFILL) {
            if (e->seqs[j].all_logits != NULL) report_prompt(e, r, &e->seqs[j]);
            r->computed += e->seqs[j].n;
            *(r->preempted ? &e->st.recomputed_tokens : &e->st.prompt_tokens) += e->seqs[j].n;
            if (e->cfg.role == KVS_LLM_PREFILL)
                (void) kvs_sender_advance(e->cfg.sender, r->req.room, r->computed, r->computed);
            if (r->computed < r->ntokens) continue;
            if (r->generated == 0) {
                prompt_done(e, r, lg);
                continue;
            }
            r->state = RQ_DECODE; /* recomputed: on from the token it had reached */
        } else {
            e->st.decode_tokens++;
        }
        kvs_logprobs_t lp;
        int has;
        uint32_t tok = sample_lp(e, r, lg, r->generated, 0, &lp, &has);
        r->tokens[r->ntokens++] = tok;
        r->generated++;
        emit_token(e, r, tok, has ? &lp : NULL);
    }
    /* The chunks this pass computed start moving now, not a loop turn later. */
    if (advanced) *work += kvs_sender_progress(e->cfg.sender);
    /* Requests that reached a stop condition end after the pass. */
    for (uint32_t i = 0; i < e->nrqs;) {
        rq_t *r = e->rqs[i];
        if (r->state != RQ_DECODE || r->generated == 0) {
            i++;
            continue;
        }
        uint32_t last = r->tokens[r->ntokens - 1];
        if (last == r->req.eos)
            finish(e, i, KVS_OK, KVS_LLM_FINISH_EOS);
        else if (r->generated >= r->req.max_new_tokens)
            finish(e, i, KVS_OK, KVS_LLM_FINISH_LENGTH);
        else
            i++;
    }
    return KVS_OK;
}

/* ---- the step ---- */

kvs_status_t kvs_llm_step(kvs_llm_t *e, int quit, int *quit_p, uint32_t *work_p)
{
    uint32_t work = 0;
    int q = 0;
    e->st.steps++;
    kvs_status_t st = sync_inputs(e, quit, &q);
    if (st != KVS_OK) return st;
    work += progress_kv(e);
    work += apply_stops(e);
    if ((st = agree(e, &work)) != KVS_OK) return st;
    work += grow_sequences(e);
    work += admit(e);
    if ((st = forward(e, &work)) != KVS_OK) return st;
    *quit_p = q;
    *work_p = work;
    return KVS_OK;
}

kvs_status_t kvs_llm_next_event(kvs_llm_t *e, kvs_llm_event_t *ev_p)
{
    if (e->ev_count == 0) return KVS_INPROGRESS;
    *ev_p = e->events[e->ev_head];
    e->ev_head = (e->ev_head + 1) % e->ev_cap;
    e->ev_count--;
    return KVS_OK;
}

kvs_status_t kvs_llm_cached(const kvs_llm_t *e, const uint32_t *prompt, uint32_t prompt_len,
                            uint32_t *cached_p)
{
    if (prompt == NULL && prompt_len > 0) {
        kvs_error("llm: cached-prefix query without a prompt (%u tokens)", prompt_len);
        return KVS_ERR_INVALID;
    }
    /* As admit_one: all but the last token, and only past the first page. */
    size_t cached = 0;
    if (e->radix != NULL && prompt_len > e->page) {
        kvs_status_t st =
            kvs_radix_lookup(e->radix, 0, (const int32_t *) prompt, prompt_len - 1, &cached);
        if (st != KVS_OK) return st;
    }
    *cached_p = (uint32_t) cached;
    return KVS_OK;
}

uint32_t kvs_llm_live(const kvs_llm_t *e)
{
    return e->nrqs + e->npending;
}

void kvs_llm_stats(const kvs_llm_t *e, kvs_llm_stats_t *stats_p)
{
    kvs_llm_stats_t s = e->st;
    s.running = running(e);
    s.queued = e->nrqs - s.running;
    s.pages_total = kvs_pool_total_pages(e->cfg.pool);
    s.pages_free = kvs_pool_free_pages(e->cfg.pool);
    if (e->radix != NULL) {
        kvs_radix_stats_t rs;
        kvs_radix_stats(e->radix, &rs);
        s.radix_pages = rs.total_pages;
    }
    *stats_p = s;
}

void kvs_llm_collect_metrics(kvs_llm_t *e)
{
    if (e->rank == 0) e->want_metrics = 1;
}

uint64_t kvs_llm_instance_metrics(const kvs_llm_t *e, kvs_pd_metrics_t *metrics_p)
{
    if (e->collections > 0) *metrics_p = e->instance;
    return e->collections;
}
