/* The serving engine (engine/llm.h) in one process: colocated generation equals a direct
 * forward-pass reference token for token (radix cache on and off, chunked prefill, batched
 * requests), TP2 ranks as threads equal TP1, and the disaggregated path (a prefill engine and
 * a decode engine joined by kvstage over the in-process transport, reliable and hostile)
 * generates exactly the colocated tokens, with radix hits on either side. Pages as sequences
 * grow: a pool too small for every running sequence preempts the newest, which is recomputed
 * and still generates exactly the reference (colocated, TP2, decode), and leaves no page
 * behind; a request whose max_new_tokens spans the whole context is admitted with a pool that
 * holds its prompt only, and ends with KVS_ERR_NOSPACE once it outgrows the pool. */
#include "kvs_test.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/inproc.h"
#include "engine/llm.h"

#define PAGE      16
#define CHUNK     32
#define MAX_NEW   40 /* enough to outgrow a small pool's pages while another request runs */
#define NPROMPTS  4
#define MAX_TOKEN 200

static const kvs_model_config_t CFG = {.layers = 2,
                                       .dim = 64,
                                       .ffn_dim = 128,
                                       .heads = 4,
                                       .kv_heads = 2,
                                       .head_dim = 16,
                                       .vocab = 256,
                                       .max_ctx = 512,
                                       .rope_theta = 10000.0f,
                                       .norm_eps = 1e-5f};
#define MODEL_SEED 7

/* Prompts 0-2 share a 40-token prefix (two and a half pages); 3 is unrelated. */
static uint32_t g_prompt[NPROMPTS][MAX_TOKEN];
static uint32_t g_len[NPROMPTS] = {70, 55, 93, 21};
static uint32_t g_ref[NPROMPTS][MAX_NEW]; /* greedy reference */
/* What runs must produce: g_ref when greedy; a colocated sampled run's tokens when sampling. */
static uint32_t (*g_expect)[MAX_NEW] = g_ref;
static const kvs_sample_params_t GREEDY = {.top_p = 0.95f};
static kvs_sample_params_t g_sampling = {.top_p = 0.95f}; /* of every request */
/* Pages of the engines' pools: 64 hold every request at once; 10 force preemptions (prompts 0
 * and 1 are admitted together in 9 and grow to 13). */
#define ROOMY_POOL 64
#define SMALL_POOL 10
#define TIGHT_POOL 6 /* prompt 2 alone */
static uint32_t g_pool_pages = ROOMY_POOL;
static uint32_t g_max_running = 3; /* of every engine */
static uint32_t g_max_context;     /* of every engine; 0: the model's */
/* run_disaggregated, concurrent: the prefill engine gets the requests in the reverse order */
static int g_prefill_reversed;
static uint64_t g_bootstrap_ns; /* run_disaggregated's bootstrap timeout; 0: the default */
static uint32_t g_prefill_pool_pages = ROOMY_POOL; /* run_disaggregated's prefill pool */
/* Logprobs of every request (request()): off, or TOP alternatives and the prompt's too. */
#define TOP 5
static int g_logprobs, g_prompt_logprobs;
/* The reference's, in double from the logits of each position computed alone: of each prompt
 * token from the second, and of each greedy token with the TOP most likely ids. */
static double g_ref_plp[NPROMPTS][MAX_TOKEN];
static double g_ref_lp[NPROMPTS][MAX_NEW];
static uint32_t g_ref_top[NPROMPTS][MAX_NEW][TOP];

static void make_prompts(void)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 42);
    for (uint32_t i = 0; i < 40; i++) g_prompt[0][i] = (uint32_t) kvs_rng_below(&rng, 256);
    for (int p = 1; p < 3; p++) memcpy(g_prompt[p], g_prompt[0], 40 * sizeof(uint32_t));
    for (int p = 0; p < NPROMPTS; p++)
        for (uint32_t i = p < 3 ? 40 : 0; i < g_len[p]; i++)
            g_prompt[p][i] = (uint32_t) kvs_rng_below(&rng, 256);
}

static kvs_pool_t *make_pool(const kvs_model_t *m, uint32_t pages)
{
    kvs_pool_config_t pc = {.shape = kvs_model_kv_shape(m),
                            .tp = kvs_model_tp(m),
                            .page_size = PAGE,
                            .num_pages = pages,
                            .layout = KVS_POOL_HND,
                            .mem = KVS_MEM_HOST};
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_create(&pc, &pool), KVS_OK);
    return pool;
}

/* Greedy tokens straight from the model: the whole prompt in one pass, then one per pass; n of
 * them for each of the count prompts into out (a row of MAX_NEW each). */
static void greedy_reference(uint32_t (*prompt)[MAX_TOKEN], const uint32_t *len, int count, int n,
                             uint32_t (*out)[MAX_NEW])
{
    kvs_model_t *m;
    assert_int_equal(kvs_model_seeded(&CFG, MODEL_SEED, (kvs_tp_t){1, 0}, &m), KVS_OK);
    kvs_pool_t *pool = make_pool(m, 64);
    uint32_t pages[32];
    assert_int_equal(kvs_pool_alloc(pool, 32, pages), KVS_OK);
    static float logits[256];
    for (int p = 0; p < count; p++) {
        kvs_model_seq_t s = {
            .tokens = prompt[p], .n = len[p], .pos0 = 0, .pages = pages, .npages = 32};
        assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_OK);
        for (int t = 0; t < n; t++) {
            out[p][t] = kvs_sample(logits, CFG.vocab, NULL, NULL, NULL);
            s = (kvs_model_seq_t){
                .tokens = &out[p][t], .n = 1, .pos0 = len[p] + t, .pages = pages, .npages = 32};
            if (t + 1 < n)
                assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_OK);
        }
    }
    kvs_pool_destroy(pool);
    kvs_model_destroy(m);
}

static void reference(void)
{
    greedy_reference(g_prompt, g_len, NPROMPTS, MAX_NEW, g_ref);
}

/* log_softmax(logits)[token], written out independently of kvs_logprobs. */
static double log_softmax_at(const float *logits, uint32_t token)
{
    double max = logits[0], sum = 0;
    for (uint32_t i = 1; i < CFG.vocab; i++)
        if (logits[i] > max) max = logits[i];
    for (uint32_t i = 0; i < CFG.vocab; i++) sum += exp((double) logits[i] - max);
    return (double) logits[token] - max - log(sum);
}

/* Every position of prompt + greedy tokens fed one at a time: each position's logits as a last
 * token, so no batching or all-positions path is involved. */
static void reference_logprobs(void)
{
    kvs_model_t *m;
    assert_int_equal(kvs_model_seeded(&CFG, MODEL_SEED, (kvs_tp_t){1, 0}, &m), KVS_OK);
    kvs_pool_t *pool = make_pool(m, 64);
    uint32_t pages[32];
    assert_int_equal(kvs_pool_alloc(pool, 32, pages), KVS_OK);
    static float logits[256];
    for (int p = 0; p < NPROMPTS; p++) {
        uint32_t seq[MAX_TOKEN + MAX_NEW];
        memcpy(seq, g_prompt[p], g_len[p] * sizeof(uint32_t));
        memcpy(seq + g_len[p], g_ref[p], MAX_NEW * sizeof(uint32_t));
        for (uint32_t at = 0; at + 1 < g_len[p] + MAX_NEW; at++) {
            kvs_model_seq_t s = {
                .tokens = seq + at, .n = 1, .pos0 = at, .pages = pages, .npages = 32};
            assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_OK);
            uint32_t next = seq[at + 1];
            if (at + 1 < g_len[p]) {
                g_ref_plp[p][at + 1] = log_softmax_at(logits, next);
                continue;
            }
            uint32_t t = at + 1 - g_len[p];
            g_ref_lp[p][t] = log_softmax_at(logits, next);
            /* The TOP largest, lower id first on ties. */
            for (uint32_t k = 0; k < TOP; k++) {
                uint32_t best = UINT32_MAX;
                for (uint32_t i = 0; i < CFG.vocab; i++) {
                    int taken = 0;
                    for (uint32_t q = 0; q < k; q++) taken |= g_ref_top[p][t][q] == i;
                    if (!taken && (best == UINT32_MAX || logits[i] > logits[best])) best = i;
                }
                g_ref_top[p][t][k] = best;
            }
        }
        /* The first token's logits are the last prompt position's: computed above at
         * at = len - 1 (its logprob is g_ref_lp[p][0]). */
    }
    kvs_pool_destroy(pool);
    kvs_model_destroy(m);
}

static int setup(void **state)
{
    (void) state;
    make_prompts();
    reference();
    reference_logprobs();
    return 0;
}

/* What the tests collect from rank 0's events. */
typedef struct {
    uint32_t tokens[NPROMPTS][MAX_NEW];
    uint32_t ntokens[NPROMPTS];
    int done[NPROMPTS];
    kvs_llm_event_t last[NPROMPTS];
    int has_lp[NPROMPTS][MAX_NEW];
    kvs_logprobs_t lp[NPROMPTS][MAX_NEW];
    kvs_logprobs_t plp[NPROMPTS][MAX_TOKEN]; /* EV_PROMPT, by position */
    uint32_t nprompt[NPROMPTS];
} outcome_t;

static outcome_t g_out; /* the last run's decode (or colocated) outcome */
static outcome_t g_out_prefill;

static void drain(kvs_llm_t *e, outcome_t *o)
{
    kvs_llm_event_t ev;
    while (kvs_llm_next_event(e, &ev) == KVS_OK) {
        assert_true(ev.room >= 1 && ev.room <= NPROMPTS);
        int p = (int) ev.room - 1;
        assert_false(o->done[p]);
        if (ev.kind == KVS_LLM_EV_PROMPT) {
            /* Each prompt position once, in order, before the first token. */
            assert_int_equal(ev.index, o->nprompt[p] + 1);
            assert_int_equal(o->ntokens[p], 0);
            assert_int_equal(ev.token, g_prompt[p][ev.index]);
            assert_true(ev.has_logprobs);
            o->plp[p][ev.index] = ev.lp;
            o->nprompt[p]++;
        } else if (ev.kind == KVS_LLM_EV_TOKEN) {
            assert_int_equal(ev.index, o->ntokens[p]);
            assert_true(o->ntokens[p] < MAX_NEW);
            o->has_lp[p][o->ntokens[p]] = ev.has_logprobs;
            o->lp[p][o->ntokens[p]] = ev.lp;
            o->tokens[p][o->ntokens[p]++] = ev.token;
        } else {
            o->done[p] = 1;
            o->last[p] = ev;
        }
    }
}

static kvs_llm_request_t request(int p)
{
    return (kvs_llm_request_t){.room = (uint64_t) p + 1,
                               .prompt = g_prompt[p],
                               .prompt_len = g_len[p],
                               .max_new_tokens = MAX_NEW,
                               .sampling = g_sampling,
                               .seed = 1000 + (uint64_t) p,
                               .eos = UINT32_MAX,
                               .logprobs = g_logprobs,
                               .top_logprobs = g_logprobs ? TOP : 0,
                               .prompt_logprobs = g_prompt_logprobs};
}

static void expect_reference(const outcome_t *o, int p)
{
    if (!o->done[p] || o->last[p].status != KVS_OK)
        fail_msg("request %d did not finish ok (%s)", p, kvs_status_str(o->last[p].status));
    assert_int_equal(o->ntokens[p], MAX_NEW);
    assert_int_equal(o->last[p].generated, MAX_NEW);
    assert_int_equal(o->last[p].finish, KVS_LLM_FINISH_LENGTH);
    for (int t = 0; t < MAX_NEW; t++)
        if (o->tokens[p][t] != g_expect[p][t])
            fail_msg("request %d token %d: %u, reference %u", p, t, o->tokens[p][t],
                     g_expect[p][t]);
}

/* ---- colocated, one rank ---- */

typedef struct {
    kvs_model_t *model;
    kvs_pool_t *pool;
    kvs_llm_t *llm;
} single_t;

static void single_open(single_t *s, kvs_llm_role_t role, int radix, kvs_sender_t *tx,
                        kvs_receiver_t *rx, kvs_model_t *shared_model, kvs_pool_t *shared_pool)
{
    memset(s, 0, sizeof(*s));
    if (shared_model == NULL)
        assert_int_equal(kvs_model_seeded(&CFG, MODEL_SEED, (kvs_tp_t){1, 0}, &s->model), KVS_OK);
    else
        s->model = shared_model;
    s->pool = shared_pool ? shared_pool : make_pool(s->model, g_pool_pages);
    kvs_llm_config_t c = {.role = role,
                          .model = s->model,
                          .pool = s->pool,
                          .sender = tx,
                          .receiver = rx,
                          .chunk_tokens = CHUNK,
                          .batch_tokens = 2 * CHUNK,
                          .max_running = g_max_running,
                          .max_context = g_max_context,
                          .radix = radix};
    assert_int_equal(kvs_llm_create(&c, &s->llm), KVS_OK);
}

static void single_close(single_t *s, int own)
{
    kvs_llm_destroy(s->llm);
    if (own) {
        assert_int_equal(kvs_pool_free_pages(s->pool), kvs_pool_total_pages(s->pool));
        kvs_pool_destroy(s->pool);
        kvs_model_destroy(s->model);
    }
}

/* Every page of the engine's pool is free or the radix cache's: no request holds one. */
static void expect_pages_back(const kvs_llm_t *e, const kvs_pool_t *pool)
{
    kvs_llm_stats_t st;
    kvs_llm_stats(e, &st);
    assert_int_equal(st.running + st.queued, 0);
    assert_int_equal(kvs_pool_free_pages(pool) + st.radix_pages, kvs_pool_total_pages(pool));
}

/* Every prompt through one colocated engine (sequential: each once the previous finished);
 * stats_p (optional) receives the engine's counters at the end. */
static void colocated(int radix, int sequential, outcome_t *o, kvs_llm_stats_t *stats_p)
{
    single_t s;
    single_open(&s, KVS_LLM_COLOCATED, radix, NULL, NULL, NULL, NULL);
    memset(o, 0, sizeof(*o));
    int next = 0;
    for (int steps = 0; steps < 10000; steps++) {
        if (next < NPROMPTS && (!sequential || next == 0 || o->done[next - 1])) {
            kvs_llm_request_t q = request(next++);
            assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_OK);
        }
        int quit = 0;
        uint32_t work = 0;
        assert_int_equal(kvs_llm_step(s.llm, 0, &quit, &work), KVS_OK);
        drain(s.llm, o);
        if (next == NPROMPTS && kvs_llm_live(s.llm) == 0) break;
    }
    kvs_llm_stats_t st;
    kvs_llm_stats(s.llm, &st);
    assert_int_equal(st.requests_ok, NPROMPTS);
    expect_pages_back(s.llm, s.pool);
    if (stats_p) *stats_p = st;
    single_close(&s, 1);
    g_out = *o;
}

static void run_colocated(int radix, int sequential)
{
    outcome_t o;
    colocated(radix, sequential, &o, NULL);
    for (int p = 0; p < NPROMPTS; p++) expect_reference(&o, p);
    /* Sequential with radix: prompts 1 and 2 find the shared prefix (two full pages). */
    for (int p = 1; p < 3; p++)
        assert_int_equal(o.last[p].cached_tokens, radix && sequential ? 2 * PAGE : 0);
    assert_int_equal(o.last[0].cached_tokens, 0);
}

static void test_colocated_equals_reference(void **state)
{
    (void) state;
    run_colocated(0, 0);
    run_colocated(1, 0);
    run_colocated(1, 1);
    run_colocated(0, 1);
    kvs_assert_no_leaks();
}

/* ---- colocated, TP2 ranks as threads ---- */

typedef struct {
    uint32_t rank;
    outcome_t *o;
    int rc;
    uint64_t preemptions;
} tp_arg_t;

static void *tp_rank(void *argp)
{
    tp_arg_t *a = argp;
    a->rc = 1;
    kvs_model_t *m = NULL;
    kvs_pool_t *pool = NULL;
    kvs_tpgroup_t *g = NULL;
    kvs_llm_t *e = NULL;
    char name[64];
    snprintf(name, sizeof(name), "/kvs-test-llm-%d", (int) getpid());
    kvs_tpgroup_config_t gc = {.name = name,
                               .size = 2,
                               .rank = a->rank,
                               .max_doubles = 2 * CHUNK * CFG.dim + 64,
                               .max_bytes = 65536,
                               .timeout_ms = 20000};
    if (kvs_model_seeded(&CFG, MODEL_SEED, (kvs_tp_t){2, a->rank}, &m) != KVS_OK) goto out;
    pool = make_pool(m, g_pool_pages);
    if (kvs_tpgroup_join(&gc, &g) != KVS_OK) goto out;
    kvs_llm_config_t c = {.role = KVS_LLM_COLOCATED,
                          .model = m,
                          .pool = pool,
                          .group = g,
                          .chunk_tokens = CHUNK,
                          .batch_tokens = 2 * CHUNK,
                          .max_running = 3,
                          .radix = 1};
    if (kvs_llm_create(&c, &e) != KVS_OK) goto out;
    int next = 0, quit = 0;
    for (int steps = 0; steps < 10000 && !quit; steps++) {
        if (a->rank == 0 && next < NPROMPTS) {
            kvs_llm_request_t q = request(next++);
            if (kvs_llm_submit(e, &q) != KVS_OK) goto out;
        }
        int done = a->rank == 0 && next == NPROMPTS && kvs_llm_live(e) == 0;
        uint32_t work;
        if (kvs_llm_step(e, done, &quit, &work) != KVS_OK) goto out;
        if (a->rank == 0) drain(e, a->o);
    }
    a->rc = quit ? 0 : 2;
    kvs_llm_stats_t st;
    kvs_llm_stats(e, &st);
    a->preemptions = st.preemptions;
out:
    kvs_llm_destroy(e);
    if (pool != NULL && kvs_pool_free_pages(pool) != kvs_pool_total_pages(pool)) a->rc = 3;
    kvs_tpgroup_leave(g);
    kvs_pool_destroy(pool);
    kvs_model_destroy(m);
    return NULL;
}

static void run_tp2_threads(void)
{
    outcome_t o;
    memset(&o, 0, sizeof(o));
    tp_arg_t a[2] = {{0, &o, 1, 0}, {1, &o, 1, 0}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&t[i], NULL, tp_rank, &a[i]), 0);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    assert_int_equal(a[0].rc, 0);
    assert_int_equal(a[1].rc, 0);
    for (int p = 0; p < NPROMPTS; p++) expect_reference(&o, p);
    g_out = o;
    /* Both ranks took the same decisions (a divergence would also have broken the lockstep). */
    assert_int_equal(a[0].preemptions, a[1].preemptions);
    if (g_pool_pages == SMALL_POOL) assert_true(a[0].preemptions > 0);
}

static void test_colocated_tp2_threads(void **state)
{
    (void) state;
    run_tp2_threads();
    g_pool_pages = SMALL_POOL;
    run_tp2_threads();
    g_pool_pages = ROOMY_POOL;
    kvs_assert_no_leaks();
}

/* ---- disaggregated over kvstage, in one process ---- */

/* A prefill engine and a decode engine of one seeded model, joined by kvstage over the
 * in-process transport (TP1 each). */
typedef struct {
    kvs_clock_t clock;
    kvs_model_t *m;
    kvs_pool_t *ppool, *dpool;
    kvs_inproc_net_t *net;
    kvs_link_t *pl, *dl;
    kvs_sender_t *tx;
    kvs_receiver_t *rx;
    single_t pre, dec;
} pair_t;

/* Pools of ppages and dpages; each engine with its radix cache as given and its own
 * max_running (pslots, dslots), both with g_max_context. */
static void pair_open(pair_t *x, const kvs_inproc_faults_t *faults, const kvs_pd_timeouts_t *to,
                      uint32_t ppages, uint32_t dpages, int pradix, int dradix, uint32_t pslots,
                      uint32_t dslots)
{
    x->clock = kvs_clock_monotonic();
    assert_int_equal(kvs_model_seeded(&CFG, MODEL_SEED, (kvs_tp_t){1, 0}, &x->m), KVS_OK);
    x->ppool = make_pool(x->m, ppages);
    x->dpool = make_pool(x->m, dpages);
    assert_int_equal(kvs_inproc_net_create(1, 1, faults, &x->clock, &x->net), KVS_OK);
    assert_int_equal(kvs_inproc_link_create(x->net, KVS_SIDE_PREFILL, 0, &x->pl), KVS_OK);
    assert_int_equal(kvs_inproc_link_create(x->net, KVS_SIDE_DECODE, 0, &x->dl), KVS_OK);
    kvs_pd_geometry_t geo = {.shape = kvs_model_kv_shape(x->m),
                             .prefill_tp = 1,
                             .decode_tp = 1,
                             .page_size = PAGE,
                             .chunk_tokens = CHUNK};
    kvs_sender_config_t sc = {
        .geo = geo, .rank = 0, .timeouts = *to, .window_chunks = 2, .staging_buffers = 2};
    kvs_receiver_config_t rc = {.geo = geo, .rank = 0, .timeouts = *to, .ring_bytes = 1 << 20};
    assert_int_equal(kvs_sender_create(&sc, x->ppool, x->pl, &x->clock, &x->tx), KVS_OK);
    assert_int_equal(kvs_receiver_create(&rc, x->dpool, x->dl, &x->clock, &x->rx), KVS_OK);
    const uint32_t slots = g_max_running;
    g_max_running = pslots;
    single_open(&x->pre, KVS_LLM_PREFILL, pradix, x->tx, NULL, x->m, x->ppool);
    g_max_running = dslots;
    single_open(&x->dec, KVS_LLM_DECODE, dradix, NULL, x->rx, x->m, x->dpool);
    g_max_running = slots;
}

/* One step of each engine; sleeps a little when neither had work. */
static void pair_step(pair_t *x)
{
    int quit;
    uint32_t w1 = 0, w2 = 0;
    assert_int_equal(kvs_llm_step(x->pre.llm, 0, &quit, &w1), KVS_OK);
    assert_int_equal(kvs_llm_step(x->dec.llm, 0, &quit, &w2), KVS_OK);
    if (w1 + w2 == 0) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
}

static int pair_idle(const pair_t *x)
{
    return kvs_llm_live(x->dec.llm) == 0 && kvs_llm_live(x->pre.llm) == 0;
}

/* Every page back in both pools (asserted), everything destroyed. */
static void pair_close(pair_t *x)
{
    expect_pages_back(x->pre.llm, x->ppool);
    expect_pages_back(x->dec.llm, x->dpool);
    single_close(&x->pre, 0);
    single_close(&x->dec, 0);
    kvs_sender_destroy(x->tx);
    kvs_receiver_destroy(x->rx);
    kvs_link_destroy(x->pl);
    kvs_link_destroy(x->dl);
    kvs_inproc_net_destroy(x->net);
    assert_int_equal(kvs_pool_free_pages(x->ppool), kvs_pool_total_pages(x->ppool));
    assert_int_equal(kvs_pool_free_pages(x->dpool), kvs_pool_total_pages(x->dpool));
    kvs_pool_destroy(x->ppool);
    kvs_pool_destroy(x->dpool);
    kvs_model_destroy(x->m);
}

/* Feeds the NPROMPTS requests to both engines of x and steps them until both are idle (at most
 * 60 s), collecting rank 0's events into *po (prefill) and *o (decode). concurrent: all at once
 * (prefill in reverse order with g_prefill_reversed); else one after another, each once decode
 * ended the one before, so later ones can hit both radix caches. */
static void pair_feed(pair_t *x, int concurrent, outcome_t *po, outcome_t *o)
{
    memset(po, 0, sizeof(*po));
    memset(o, 0, sizeof(*o));
    int next = 0;
    const uint64_t deadline = kvs_now_ns() + 60000000000ull;
    while (kvs_now_ns() < deadline) {
        if (concurrent && g_prefill_reversed && next == 0) {
            for (int p = 0; p < NPROMPTS; p++) {
                kvs_llm_request_t q = request(p), r = request(NPROMPTS - 1 - p);
                assert_int_equal(kvs_llm_submit(x->dec.llm, &q), KVS_OK);
                assert_int_equal(kvs_llm_submit(x->pre.llm, &r), KVS_OK);
            }
            next = NPROMPTS;
        }
        if (next < NPROMPTS && (concurrent || next == 0 || o->done[next - 1])) {
            kvs_llm_request_t q = request(next++);
            assert_int_equal(kvs_llm_submit(x->dec.llm, &q), KVS_OK);
            assert_int_equal(kvs_llm_submit(x->pre.llm, &q), KVS_OK);
        }
        pair_step(x);
        drain(x->pre.llm, po);
        drain(x->dec.llm, o);
        if (next == NPROMPTS && pair_idle(x)) break;
    }
}

/* concurrent: every request submitted at once (a step each) instead of one after another, into
 * a decode pool of g_pool_pages; the decode engine's preemptions go to *preemptions_p. */
static void run_disaggregated(const kvs_inproc_faults_t *faults, int prefill_radix,
                              int decode_radix, int concurrent, uint64_t *preemptions_p)
{
    kvs_pd_timeouts_t to;
    kvs_pd_timeouts_default(&to);
    to.retry_ns = 2000000; /* 2 ms: lost messages come back quickly */
    if (g_bootstrap_ns) to.bootstrap_timeout_ns = g_bootstrap_ns;
    pair_t x;
    pair_open(&x, faults, &to, g_prefill_pool_pages, g_pool_pages, prefill_radix, decode_radix,
              g_max_running, g_max_running);
    static outcome_t po, o;
    pair_feed(&x, concurrent, &po, &o);
    for (int p = 0; p < NPROMPTS; p++) {
        expect_reference(&o, p);
        /* prefill: the first token and a finished handoff */
        assert_true(po.done[p]);
        assert_int_equal(po.last[p].status, KVS_OK);
        assert_int_equal(po.last[p].finish, KVS_LLM_FINISH_HANDOFF);
        assert_int_equal(po.ntokens[p], 1);
        assert_int_equal(po.tokens[p][0], g_expect[p][0]);
        assert_true(o.last[p].kv_ready_ns >= o.last[p].admitted_ns);
    }
    for (int p = 1; p < 3 && !concurrent; p++) {
        assert_int_equal(po.last[p].cached_tokens, prefill_radix ? 2 * PAGE : 0);
        /* decode caches prompt + generated tokens: prompt 1 shares 40 tokens with prompt 0 */
        assert_int_equal(o.last[p].cached_tokens, decode_radix ? 2 * PAGE : 0);
    }
    g_out = o;
    g_out_prefill = po;
    kvs_llm_stats_t dst;
    kvs_llm_stats(x.dec.llm, &dst);
    if (preemptions_p) *preemptions_p = dst.preemptions;
    kvs_pd_metrics_t pm;
    kvs_sender_metrics(x.tx, &pm);
    assert_int_equal(pm.rooms_succeeded, NPROMPTS);
    assert_int_equal(pm.live_rooms, 0);
    pair_close(&x);
}

static void test_disaggregated_equals_colocated(void **state)
{
    (void) state;
    for (int pr = 0; pr < 2; pr++)
        for (int dr = 0; dr < 2; dr++) run_disaggregated(NULL, pr, dr, 0, NULL);
    kvs_assert_no_leaks();
}

static void test_disaggregated_hostile_network(void **state)
{
    (void) state;
    kvs_inproc_faults_t f = {.seed = kvs_test_seed(1),
                             .delay_max_ns = 3000000,
                             .drop_permille = 100,
                             .dup_permille = 100,
                             .write_delay_max_ns = 2000000};
    run_disaggregated(&f, 1, 1, 0, NULL);
    g_pool_pages = SMALL_POOL; /* preemptions (not counted: the network decides the timing) */
    run_disaggregated(&f, 1, 1, 1, NULL);
    g_pool_pages = ROOMY_POOL;
    kvs_assert_no_leaks();
}

/* Two instances fed in opposite orders, one compute slot fewer than requests on each side
 * (two slots, four requests): the decode engine admits rooms 1 and 2 and waits for their KV, the
 * prefill engine computes rooms 4 and 3 first, which decode has not admitted. The prefill rooms
 * waiting for their handoff must free their slots for rooms 1 and 2, else both sides wait on
 * each other until the bootstrap timeout fails the rooms (made short here: 10 s). With one slot
 * each, with the decode pool too small for every room at once, and with both pools small: a
 * prefill pool the size of the largest prompt (6 pages), where room 4, started before decode
 * spoke of it, would keep room 1 out while decode's pages wait for rooms 1 and 2. */
static void test_opposite_orders(void **state)
{
    (void) state;
    g_prefill_reversed = 1;
    g_bootstrap_ns = 10000000000ull;
    for (uint32_t slots = 1; slots <= 2; slots++) {
        g_max_running = slots;
        run_disaggregated(NULL, 0, 0, 1, NULL);
        g_pool_pages = SMALL_POOL;
        run_disaggregated(NULL, 1, 1, 1, NULL);
        g_pool_pages = ROOMY_POOL;
        g_prefill_pool_pages = SMALL_POOL;
        run_disaggregated(NULL, 0, 0, 1, NULL);
        g_pool_pages = SMALL_POOL;
        g_prefill_pool_pages = TIGHT_POOL;
        run_disaggregated(NULL, 0, 0, 1, NULL);
        g_pool_pages = ROOMY_POOL;
        g_prefill_pool_pages = ROOMY_POOL;
    }
    g_max_running = 3;
    g_bootstrap_ns = 0;
    g_prefill_reversed = 0;
    kvs_assert_no_leaks();
}

/* ---- admission under random pools, slots and orders ---- */

#define RND_ROOMS 10
#define RND_NEW   6
#define RND_CTX   (128 + RND_NEW) /* prompts of 1..128 tokens; the engines' max_context */

static uint32_t g_rnd_prompt[RND_ROOMS][MAX_TOKEN];
static uint32_t g_rnd_len[RND_ROOMS];
static uint32_t g_rnd_ref[RND_ROOMS][MAX_NEW];
static uint64_t g_rnd_hostile, g_rnd_dropped; /* scenarios on a hostile network, their losses */

/* Rank 0's events of one engine: each room's tokens and its end. */
typedef struct {
    uint32_t tokens[RND_ROOMS][RND_NEW];
    uint32_t ntokens[RND_ROOMS];
    int done[RND_ROOMS];
    kvs_llm_event_t last[RND_ROOMS];
} rnd_outcome_t;

static void rnd_drain(kvs_llm_t *e, rnd_outcome_t *o)
{
    kvs_llm_event_t ev;
    while (kvs_llm_next_event(e, &ev) == KVS_OK) {
        assert_true(ev.room >= 1 && ev.room <= RND_ROOMS);
        int p = (int) ev.room - 1;
        assert_false(o->done[p]);
        if (ev.kind == KVS_LLM_EV_TOKEN) {
            assert_true(o->ntokens[p] < RND_NEW);
            o->tokens[p][o->ntokens[p]++] = ev.token;
        } else if (ev.kind != KVS_LLM_EV_PROMPT) {
            o->done[p] = 1;
            o->last[p] = ev;
        }
    }
}

/* One scenario: rooms of 1..128 tokens (half sharing a prefix with an earlier one), a prefill pool
 * from one largest prompt to three, a decode pool from one request to four, 1-4 slots on each side,
 * radix caches on or off, each side fed the rooms in its own random order at its own random
 * pace, and one scenario in three on a hostile network (control messages lost, duplicated and
 * delayed; writes delayed). Every room must succeed with the reference's tokens well before the
 * bootstrap timeout (10 s): two sides that held each other's pages or slots would fail rooms
 * there, and so would a lost message that nothing recovers. */
static void run_random_admission(kvs_rng_t *rng)
{
    const int n = (int) kvs_rng_range(rng, 3, RND_ROOMS);
    for (int p = 0; p < n; p++) {
        g_rnd_len[p] = (uint32_t) kvs_rng_range(rng, 1, RND_CTX - RND_NEW);
        /* Half of them begin with a part of an earlier one: radix hits on both sides. */
        const int from = p > 0 && kvs_rng_below(rng, 2) ? (int) kvs_rng_below(rng, p) : -1;
        const uint32_t shared = from < 0 ? 0 : (uint32_t) kvs_rng_range(rng, 0, g_rnd_len[from]);
        for (uint32_t i = 0; i < g_rnd_len[p]; i++)
            g_rnd_prompt[p][i] =
                i < shared ? g_rnd_prompt[from][i] : (uint32_t) kvs_rng_below(rng, 256);
    }
    greedy_reference(g_rnd_prompt, g_rnd_len, n, RND_NEW, g_rnd_ref);
    const uint32_t largest = (RND_CTX - 1 + PAGE - 1) / PAGE, request = (RND_CTX + PAGE - 1) / PAGE;
    const uint32_t ppages = (uint32_t) kvs_rng_range(rng, largest, 3 * largest);
    const uint32_t dpages = (uint32_t) kvs_rng_range(rng, request, 4 * request);
    const uint32_t pslots = (uint32_t) kvs_rng_range(rng, 1, 4);
    const uint32_t dslots = (uint32_t) kvs_rng_range(rng, 1, 4);
    const int pradix = (int) kvs_rng_below(rng, 2), dradix = (int) kvs_rng_below(rng, 2);
    int porder[RND_ROOMS], dorder[RND_ROOMS];
    kvs_test_shuffle(rng, porder, n);
    kvs_test_shuffle(rng, dorder, n);
    const uint32_t pace = (uint32_t) kvs_rng_range(rng, 1, 4); /* 1: a room per step */

    const int hostile = kvs_rng_below(rng, 3) == 0;
    const kvs_inproc_faults_t f = {.seed = kvs_rng_next(rng),
                                   .delay_max_ns = 2000000,
                                   .drop_permille = 50,
                                   .dup_permille = 50,
                                   .write_delay_max_ns = 1000000};

    kvs_pd_timeouts_t to;
    kvs_pd_timeouts_default(&to);
    to.bootstrap_timeout_ns = 10000000000ull;
    to.retry_ns = 2000000; /* 2 ms: lost messages come back quickly */
    pair_t x;
    g_max_context = RND_CTX;
    pair_open(&x, hostile ? &f : NULL, &to, ppages, dpages, pradix, dradix, pslots, dslots);
    g_max_context = 0;
    static rnd_outcome_t po, o;
    memset(&po, 0, sizeof(po));
    memset(&o, 0, sizeof(o));
    int pnext = 0, dnext = 0;
    const uint64_t deadline = kvs_now_ns() + 60000000000ull;
    while (kvs_now_ns() < deadline) {
        for (int side = 0; side < 2; side++) {
            int *next = side ? &dnext : &pnext;
            if (*next == n || kvs_rng_below(rng, pace) != 0) continue;
            const int p = side ? dorder[(*next)++] : porder[(*next)++];
            kvs_llm_request_t q = {.room = (uint64_t) p + 1,
                                   .prompt = g_rnd_prompt[p],
                                   .prompt_len = g_rnd_len[p],
                                   .max_new_tokens = RND_NEW,
                                   .sampling = GREEDY,
                                   .seed = 1,
                                   .eos = UINT32_MAX};
            assert_int_equal(kvs_llm_submit(side ? x.dec.llm : x.pre.llm, &q), KVS_OK);
        }
        pair_step(&x);
        rnd_drain(x.pre.llm, &po);
        rnd_drain(x.dec.llm, &o);
        if (pnext == n && dnext == n && pair_idle(&x)) break;
    }
    for (int p = 0; p < n; p++) {
        if (!o.done[p] || o.last[p].status != KVS_OK || !po.done[p] || po.last[p].status != KVS_OK)
            fail_msg("room %d of %d (%u tokens) did not succeed: decode %s, prefill %s; prefill "
                     "pool %u pages, %u slots, radix %d; decode pool %u pages, %u slots, radix "
                     "%d; network %s",
                     p + 1, n, g_rnd_len[p], o.done[p] ? kvs_status_str(o.last[p].status) : "live",
                     po.done[p] ? kvs_status_str(po.last[p].status) : "live", ppages, pslots,
                     pradix, dpages, dslots, dradix, hostile ? "hostile" : "reliable");
        assert_int_equal(po.last[p].finish, KVS_LLM_FINISH_HANDOFF);
        assert_int_equal(o.ntokens[p], RND_NEW);
        assert_memory_equal(o.tokens[p], g_rnd_ref[p], RND_NEW * sizeof(uint32_t));
    }
    if (hostile) {
        kvs_inproc_stats_t ns;
        kvs_inproc_net_stats(x.net, &ns);
        g_rnd_hostile++;
        g_rnd_dropped += ns.dropped;
    }
    pair_close(&x);
}

static void test_random_admission(void **state)
{
    (void) state;
    kvs_rng_t rng;
    const uint64_t seed = kvs_test_seed(5);
    kvs_rng_seed(&rng, seed);
    const uint64_t iters = kvs_test_iters(48);
    for (uint64_t i = 0; i < iters; i++) run_random_admission(&rng);
    /* The hostile scenarios did lose messages (some 5% of their control messages). */
    if (g_rnd_hostile >= 4) assert_true(g_rnd_dropped > 0);
    kvs_assert_no_leaks();
}

/* ---- one data write broken or corrupted ---- */

/* The four requests one after another, with the nth data write of the run failed (corrupt 0) or
 * landed with a bit flipped (corrupt 1); nth 0: none. The room that write belonged to fails
 * alone, with the reason the side that found it saw (i/o error on prefill, checksum mismatch on
 * decode) on both sides; every other room gives the reference's tokens, and both pools come back
 * whole (pair_close). Returns the run's data writes. */
static uint64_t run_write_fault(int corrupt, uint64_t nth)
{
    kvs_inproc_faults_t f = {.seed = 1};
    if (corrupt)
        f.corrupt_nth = nth;
    else
        f.write_fail_nth = nth;
    kvs_pd_timeouts_t to;
    kvs_pd_timeouts_default(&to);
    to.retry_ns = 2000000;
    pair_t x;
    pair_open(&x, &f, &to, ROOMY_POOL, ROOMY_POOL, 0, 0, 3, 3);
    static outcome_t po, o;
    pair_feed(&x, 0, &po, &o);
    kvs_inproc_stats_t ns;
    kvs_inproc_net_stats(x.net, &ns);
    const uint64_t hit = corrupt ? ns.corrupted : ns.write_failures;
    const kvs_status_t want = corrupt ? KVS_ERR_CORRUPT : KVS_ERR_IO;
    uint64_t failed = 0;
    for (int p = 0; p < NPROMPTS; p++) {
        if (!o.done[p] || !po.done[p])
            fail_msg("%s write %llu: room %d never ended (decode %s, prefill %s)",
                     corrupt ? "corrupted" : "failed", (unsigned long long) nth, p + 1,
                     o.done[p] ? "done" : "live", po.done[p] ? "done" : "live");
        if (o.last[p].status == KVS_OK && po.last[p].status == KVS_OK) {
            expect_reference(&o, p);
            continue;
        }
        /* Prefill ends with decode's reason, or ok where its writes had all been acknowledged
         * before decode found the corruption (its part done). */
        failed++;
        if (o.last[p].status != want || (po.last[p].status != want && po.last[p].status != KVS_OK))
            fail_msg("%s write %llu: room %d ended with decode %s, prefill %s; want %s",
                     corrupt ? "corrupted" : "failed", (unsigned long long) nth, p + 1,
                     kvs_status_str(o.last[p].status), kvs_status_str(po.last[p].status),
                     kvs_status_str(want));
    }
    if (failed != hit)
        fail_msg("%s write %llu: %llu rooms failed, %llu writes hit",
                 corrupt ? "corrupted" : "failed", (unsigned long long) nth,
                 (unsigned long long) failed, (unsigned long long) hit);
    pair_close(&x);
    return ns.writes;
}

/* Every data write of a clean run in turn, failed and then corrupted. */
static void test_write_faults(void **state)
{
    (void) state;
    const uint64_t writes = run_write_fault(0, 0);
    assert_true(writes >= NPROMPTS);
    for (uint64_t nth = 1; nth <= writes; nth++) {
        run_write_fault(0, nth);
        run_write_fault(1, nth);
    }
    print_message("%llu data writes, each failed and each corrupted in turn\n",
                  (unsigned long long) writes);
    kvs_assert_no_leaks();
}

/* Sampling: every token's draw depends on (seed, token index) only, and its penalties on the
 * prompt and the tokens before it, which the decode side has too (the prompt, and the first
 * token from the prefill side); so the prefill side's first token and the decode side's later
 * ones give exactly the tokens of one colocated run (and TP2 ranks, which each sample from the
 * broadcast parameters, those of TP1). Greedy with penalties and a bias, temperature and top-p
 * alone, and every knob together. */
static void test_disaggregated_sampling(void **state)
{
    (void) state;
    static const kvs_logit_bias_t bias[3] = {{0, 3}, {17, -100}, {200, 1.5f}};
    /* Three tokens lifted far above the rest: the penalties of what was generated before
     * (the first token included, on the decode side) decide between them at every step. */
    static const kvs_logit_bias_t top3[3] = {{5, 100}, {6, 100}, {7, 100}};
    const kvs_sample_params_t sets[4] = {
        {.top_p = 1,
         .presence_penalty = 0.8f,
         .frequency_penalty = 0.6f,
         .repetition_penalty = 1.4f,
         .bias = bias,
         .n_bias = 3},
        {.temperature = 0.9f, .top_p = 0.95f},
        {.temperature = 0.8f,
         .top_p = 0.9f,
         .top_k = 20,
         .min_p = 0.02f,
         .presence_penalty = 0.4f,
         .frequency_penalty = -0.3f,
         .repetition_penalty = 1.3f,
         .bias = bias,
         .n_bias = 3},
        {.top_p = 1,
         .presence_penalty = 1.5f,
         .frequency_penalty = 1.5f,
         .bias = top3,
         .n_bias = 3},
    };
    static uint32_t sampled[NPROMPTS][MAX_NEW];
    for (int k = 0; k < 4; k++) {
        outcome_t o;
        g_sampling = sets[k];
        g_expect = sampled;
        /* The colocated run defines the expectation: fill it from a first run, then require
         * it. */
        int differs = 0;
        colocated(0, 0, &o, NULL);
        for (int p = 0; p < NPROMPTS; p++) {
            assert_int_equal(o.ntokens[p], MAX_NEW);
            memcpy(sampled[p], o.tokens[p], sizeof(sampled[p]));
            differs |= memcmp(sampled[p], g_ref[p], sizeof(sampled[p])) != 0;
        }
        /* the knobs changed something, or this test would prove nothing */
        if (!differs) fail_msg("parameter set %d gives the greedy reference", k);
        run_colocated(1, 1);
        run_tp2_threads();
        run_disaggregated(NULL, 1, 1, 0, NULL);
        run_disaggregated(NULL, 0, 1, 0, NULL);
        g_pool_pages = SMALL_POOL; /* sampled tokens survive a preemption too */
        kvs_llm_stats_t st;
        colocated(1, 0, &o, &st);
        assert_true(st.preemptions > 0);
        for (int p = 0; p < NPROMPTS; p++) expect_reference(&o, p);
        g_pool_pages = ROOMY_POOL;
    }
    g_sampling = GREEDY;
    g_expect = g_ref;
    kvs_assert_no_leaks();
}

/* ---- pages as sequences grow ---- */

/* SMALL_POOL pages: prompts 0 and 1 are admitted together (5 + 4 pages, the last one headroom)
 * and grow to 7 + 6, so the newer is preempted, recomputed once the older one is done, and
 * every request still generates exactly the reference; afterwards no request holds a page. */
static void test_preemption_colocated(void **state)
{
    (void) state;
    g_pool_pages = SMALL_POOL;
    for (int radix = 0; radix < 2; radix++) {
        outcome_t o;
        kvs_llm_stats_t st;
        colocated(radix, 0, &o, &st);
        for (int p = 0; p < NPROMPTS; p++) expect_reference(&o, p);
        assert_true(st.preemptions > 0);
        assert_true(st.recomputed_tokens > 0);
        /* The event reports the first admission's cache hit, not the recompute's. */
        assert_int_equal(o.last[1].cached_tokens, 0);
    }
    g_pool_pages = ROOMY_POOL;
    kvs_assert_no_leaks();
}

/* The same on the decode side of a handoff: the preempted request is recomputed by a local
 * prefill pass of the decode engine (its KV is not asked for again). */
static void test_preemption_decode(void **state)
{
    (void) state;
    g_pool_pages = SMALL_POOL;
    for (int radix = 0; radix < 2; radix++) {
        uint64_t preemptions = 0;
        run_disaggregated(NULL, radix, radix, 1, &preemptions);
        assert_true(preemptions > 0);
    }
    g_pool_pages = ROOMY_POOL;
    kvs_assert_no_leaks();
}

/* ---- bad input ---- */

static void test_submit_refusals(void **state)
{
    (void) state;
    single_t s;
    single_open(&s, KVS_LLM_COLOCATED, 1, NULL, NULL, NULL, NULL);
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_llm_request_t q = request(0);
    q.prompt_len = 0;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_INVALID);
    q = request(0);
    q.max_new_tokens = CFG.max_ctx - g_len[0] + 1; /* one over the context */
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_INVALID);
    assert_non_null(strstr(cap.msg, "room 1: a prompt of 70 tokens with 443 new tokens does not "
                                    "fit the context of 512 tokens"));
    q = request(0);
    q.max_new_tokens = 0;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_INVALID);
    uint32_t bad[3] = {1, 256, 2};
    q = request(0);
    q.prompt = bad;
    q.prompt_len = 3;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_INVALID);
    const kvs_logit_bias_t outside[1] = {{256, 1}};
    q = request(0);
    q.sampling.bias = outside;
    q.sampling.n_bias = 1;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_INVALID);
    q = request(0);
    q.sampling.frequency_penalty = 2.5f;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_INVALID);
    q = request(0);
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_OK);
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_INVALID); /* room already live */
    assert_int_equal(kvs_llm_stop(s.llm, 99, KVS_LLM_CHOICE_ALL), KVS_ERR_NOT_FOUND);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 7);
    /* A stop ends the request at the next step, with what it generated so far. */
    assert_int_equal(kvs_llm_stop(s.llm, 1, KVS_LLM_CHOICE_ALL), KVS_OK);
    int quit;
    uint32_t work;
    assert_int_equal(kvs_llm_step(s.llm, 0, &quit, &work), KVS_OK);
    outcome_t o;
    memset(&o, 0, sizeof(o));
    drain(s.llm, &o);
    assert_true(o.done[0]);
    assert_int_equal(o.last[0].finish, KVS_LLM_FINISH_STOP);
    assert_int_equal(kvs_llm_live(s.llm), 0);
    single_close(&s, 1);
    kvs_assert_no_leaks();
}

/* Runs the engine until request p (0-based) is done. */
static void run_until_done(kvs_llm_t *e, outcome_t *o, int p)
{
    for (int steps = 0; steps < 10000 && !o->done[p]; steps++) {
        int quit;
        uint32_t work;
        assert_int_equal(kvs_llm_step(e, 0, &quit, &work), KVS_OK);
        drain(e, o);
    }
    assert_true(o->done[p]);
}

/* Admission takes pages for the prompt alone: max_new_tokens may span the whole context with a
 * pool that holds the prompt only. The sequence then takes pages as it grows; when even alone
 * it cannot have the next one it ends with KVS_ERR_NOSPACE (the tokens it generated are the
 * reference's) and gives its pages back, and the request queued behind it runs. A prompt larger
 * than the whole pool is refused at submit; a context above the model's at create. */
static void test_whole_context_max_new(void **state)
{
    (void) state;
    kvs_model_t *m;
    assert_int_equal(kvs_model_seeded(&CFG, MODEL_SEED, (kvs_tp_t){1, 0}, &m), KVS_OK);
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_pool_t *pool = make_pool(m, 5); /* prompt 0: 70 tokens in 5 pages of 16 */
    kvs_llm_config_t c = {.role = KVS_LLM_COLOCATED,
                          .model = m,
                          .pool = pool,
                          .chunk_tokens = CHUNK,
                          .batch_tokens = 2 * CHUNK,
                          .max_running = 3,
                          .max_context = CFG.max_ctx + 1};
    kvs_llm_t *e = NULL;
    assert_int_equal(kvs_llm_create(&c, &e), KVS_ERR_INVALID);
    assert_null(e);
    assert_non_null(strstr(cap.msg, "max_context 513 must be 2..512"));
    kvs_pool_destroy(pool);

    single_t s;
    single_open(&s, KVS_LLM_COLOCATED, 1, NULL, NULL, m, make_pool(m, 5));
    kvs_llm_request_t q = request(2); /* 93 tokens: 6 pages */
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_NOSPACE);
    assert_non_null(
        strstr(cap.msg, "room 3: a prompt of 93 tokens with 1 choice needs 6 pages of 16 tokens, "
                        "more than the whole pool of 5: it can never be admitted"));
    q = request(0);
    q.max_new_tokens = CFG.max_ctx - g_len[0];
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_OK);
    q = request(3); /* queued behind it: 21 tokens growing to 60, 4 pages */
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_OK);
    outcome_t o;
    memset(&o, 0, sizeof(o));
    run_until_done(s.llm, &o, 0);
    /* Positions 0..79 fit: the prompt's 70, then 10 tokens fed back, 11 generated. */
    assert_int_equal(o.last[0].status, KVS_ERR_NOSPACE);
    assert_int_equal(o.last[0].finish, KVS_LLM_FINISH_ERROR);
    assert_int_equal(o.last[0].generated, 11);
    assert_int_equal(o.ntokens[0], 11);
    assert_memory_equal(o.tokens[0], g_ref[0], 11 * sizeof(uint32_t));
    assert_non_null(strstr(cap.msg, "room 1: its 81 tokens (70 prompt, 11 generated) need 6 pages "
                                    "of 16 tokens, more than the whole KV pool of 5"));
    kvs_log_set_sink(NULL, NULL);
    run_until_done(s.llm, &o, 3);
    expect_reference(&o, 3);
    expect_pages_back(s.llm, s.pool);
    single_close(&s, 1);
    kvs_assert_no_leaks();
}

/* kvs_llm_cached answers what the next admission finds, and asking changes nothing: the cache
 * hit a later request gets is the same whether or not the question was asked before. */
static void test_cached_query(void **state)
{
    (void) state;
    uint32_t hit[2];
    for (int ask = 0; ask < 2; ask++) {
        single_t s;
        single_open(&s, KVS_LLM_COLOCATED, 1, NULL, NULL, NULL, NULL);
        uint32_t cached = 999;
        assert_int_equal(kvs_llm_cached(s.llm, g_prompt[1], g_len[1], &cached), KVS_OK);
        assert_int_equal(cached, 0);
        outcome_t o;
        memset(&o, 0, sizeof(o));
        kvs_llm_request_t q = request(0);
        assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_OK);
        while (!o.done[0]) {
            int quit;
            uint32_t work;
            assert_int_equal(kvs_llm_step(s.llm, 0, &quit, &work), KVS_OK);
            drain(s.llm, &o);
        }
        /* Prompt 1 shares 40 tokens (two whole pages) with prompt 0, now cached. */
        uint32_t expect = 40 / PAGE * PAGE;
        if (ask) {
            for (int i = 0; i < 3; i++) {
                assert_int_equal(kvs_llm_cached(s.llm, g_prompt[1], g_len[1], &cached), KVS_OK);
                assert_int_equal(cached, expect);
            }
            assert_int_equal(kvs_llm_cached(s.llm, g_prompt[3], g_len[3], &cached), KVS_OK);
            assert_int_equal(cached, 0);
            assert_int_equal(kvs_llm_cached(s.llm, g_prompt[0], PAGE, &cached), KVS_OK);
            assert_int_equal(cached, 0); /* one page: the last token is always computed */
        }
        q = request(1);
        assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_OK);
        while (!o.done[1]) {
            int quit;
            uint32_t work;
            assert_int_equal(kvs_llm_step(s.llm, 0, &quit, &work), KVS_OK);
            drain(s.llm, &o);
        }
        hit[ask] = o.last[1].cached_tokens;
        assert_int_equal(hit[ask], expect);
        assert_memory_equal(o.tokens[1], g_ref[1], sizeof(g_ref[1]));
        single_close(&s, 1);
    }
    assert_int_equal(hit[0], hit[1]);
    kvs_assert_no_leaks();
}

/* Every reported logprob equals the reference's within 1e-4 (the same floats in double: in
 * practice exactly), the alternatives are the reference's TOP ids, most likely first, the first
 * of which each token's own (greedy). */
static void expect_ref_logprobs(const outcome_t *o, int prompt_too)
{
    for (int p = 0; p < NPROMPTS; p++) {
        for (int t = 0; t < MAX_NEW; t++) {
            const kvs_logprobs_t *lp = &o->lp[p][t];
            if (!o->has_lp[p][t]) fail_msg("request %d token %d: no logprobs", p, t);
            if (fabs(lp->logprob - g_ref_lp[p][t]) > 1e-4)
                fail_msg("request %d token %d: logprob %.9g, reference %.9g", p, t,
                         (double) lp->logprob, g_ref_lp[p][t]);
            assert_int_equal(lp->n_top, TOP);
            for (int k = 0; k < TOP; k++) {
                assert_int_equal(lp->top[k].token, g_ref_top[p][t][k]);
                if (k > 0) assert_true(lp->top[k].logprob <= lp->top[k - 1].logprob);
            }
            assert_int_equal(lp->top[0].token, g_ref[p][t]);
            assert_true(lp->top[0].logprob == lp->logprob);
        }
        assert_int_equal(o->nprompt[p], prompt_too ? g_len[p] - 1 : 0);
        for (uint32_t i = 1; prompt_too && i < g_len[p]; i++)
            if (fabs(o->plp[p][i].logprob - g_ref_plp[p][i]) > 1e-4)
                fail_msg("request %d prompt token %u: logprob %.9g, reference %.9g", p, i,
                         (double) o->plp[p][i].logprob, g_ref_plp[p][i]);
    }
}

/* Two outcomes' logprobs agree within 1e-4, alternatives id for id. */
static void expect_same_logprobs(const outcome_t *a, const outcome_t *b)
{
    for (int p = 0; p < NPROMPTS; p++)
        for (int t = 0; t < MAX_NEW; t++) {
            assert_true(a->has_lp[p][t] && b->has_lp[p][t]);
            assert_true(fabs(a->lp[p][t].logprob - b->lp[p][t].logprob) <= 1e-4);
            assert_int_equal(a->lp[p][t].n_top, b->lp[p][t].n_top);
            for (uint32_t k = 0; k < a->lp[p][t].n_top; k++) {
                assert_int_equal(a->lp[p][t].top[k].token, b->lp[p][t].top[k].token);
                assert_true(fabs(a->lp[p][t].top[k].logprob - b->lp[p][t].top[k].logprob) <= 1e-4);
            }
        }
}

/* Logprobs: of each generated token (with TOP alternatives) and of each prompt token, equal to a
 * direct log-softmax of the reference forward's logits, colocated (batched, chunked, radix on:
 * a prompt-logprobs request bypasses it), after preemptions (no prompt position reported
 * twice), on TP2 ranks, and disaggregated (the prefill side reports the prompt's, the decode
 * side the generated ones, the first token's carried in the room's final metadata). Without
 * logprobs asked, tokens carry none. */
static void test_logprobs(void **state)
{
    (void) state;
    static outcome_t colo, o;
    g_logprobs = 1;
    g_prompt_logprobs = 1;
    kvs_llm_stats_t st;
    colocated(1, 1, &o, &st);
    for (int p = 0; p < NPROMPTS; p++) expect_reference(&o, p);
    expect_ref_logprobs(&o, 1);
    for (int p = 0; p < NPROMPTS; p++) assert_int_equal(o.last[p].cached_tokens, 0);
    colo = o;
    g_pool_pages = SMALL_POOL;
    colocated(0, 0, &o, &st);
    assert_true(st.preemptions > 0);
    expect_ref_logprobs(&o, 1);
    g_pool_pages = ROOMY_POOL;
    run_tp2_threads();
    expect_ref_logprobs(&g_out, 1);
    expect_same_logprobs(&g_out, &colo);

    run_disaggregated(NULL, 0, 1, 0, NULL);
    expect_ref_logprobs(&g_out, 0); /* decode: the generated tokens' */
    expect_same_logprobs(&g_out, &colo);
    for (int p = 0; p < NPROMPTS; p++) {
        assert_int_equal(g_out_prefill.nprompt[p], g_len[p] - 1);
        for (uint32_t i = 1; i < g_len[p]; i++)
            assert_true(fabs(g_out_prefill.plp[p][i].logprob - colo.plp[p][i].logprob) <= 1e-4);
        assert_true(g_out_prefill.has_lp[p][0]);
        assert_true(fabs(g_out_prefill.lp[p][0].logprob - colo.lp[p][0].logprob) <= 1e-4);
    }
    /* Generated logprobs only (decode with its radix cache, prefill with its). */
    g_prompt_logprobs = 0;
    run_disaggregated(NULL, 1, 1, 0, NULL);
    expect_ref_logprobs(&g_out, 0);
    g_logprobs = 0;
    colocated(0, 0, &o, &st);
    for (int p = 0; p < NPROMPTS; p++) {
        assert_int_equal(o.nprompt[p], 0);
        for (int t = 0; t < MAX_NEW; t++) assert_false(o.has_lp[p][t]);
    }
    /* Out of range: refused at submit. */
    single_t one;
    single_open(&one, KVS_LLM_COLOCATED, 0, NULL, NULL, NULL, NULL);
    kvs_llm_request_t q = request(0);
    q.logprobs = 1;
    q.top_logprobs = KVS_LOGPROBS_TOP_MAX + 1;
    assert_int_equal(kvs_llm_submit(one.llm, &q), KVS_ERR_INVALID);
    q.logprobs = 0;
    q.top_logprobs = 0;
    q.prompt_logprobs = 1;
    assert_int_equal(kvs_llm_submit(one.llm, &q), KVS_ERR_INVALID);
    single_close(&one, 1);
    kvs_assert_no_leaks();
}

/* ---- choices ---- */

typedef struct {
    uint32_t tokens[KVS_LLM_CHOICES_MAX][MAX_NEW];
    uint32_t ntokens[KVS_LLM_CHOICES_MAX];
    int done[KVS_LLM_CHOICES_MAX];
    kvs_llm_event_t last[KVS_LLM_CHOICES_MAX];
} choices_t;

/* Prompt p with n choices and this seed through a colocated engine (radix on) of pool pages;
 * stats_p receives its counters. */
static void run_choices(int p, uint32_t n, uint64_t seed, uint32_t pages, choices_t *o,
                        kvs_llm_stats_t *stats_p)
{
    g_pool_pages = pages;
    single_t s;
    single_open(&s, KVS_LLM_COLOCATED, 1, NULL, NULL, NULL, NULL);
    g_pool_pages = ROOMY_POOL;
    memset(o, 0, sizeof(*o));
    kvs_llm_request_t q = request(p);
    q.n_choices = n;
    q.seed = seed;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_OK);
    for (int steps = 0; steps < 20000 && kvs_llm_live(s.llm) > 0; steps++) {
        int quit = 0;
        uint32_t work = 0;
        assert_int_equal(kvs_llm_step(s.llm, 0, &quit, &work), KVS_OK);
        kvs_llm_event_t ev;
        while (kvs_llm_next_event(s.llm, &ev) == KVS_OK) {
            assert_int_equal(ev.room, (uint64_t) p + 1);
            assert_true(ev.choice < n);
            assert_false(o->done[ev.choice]);
            if (ev.kind == KVS_LLM_EV_TOKEN) {
                assert_int_equal(ev.index, o->ntokens[ev.choice]);
                o->tokens[ev.choice][o->ntokens[ev.choice]++] = ev.token;
            } else if (ev.kind == KVS_LLM_EV_DONE) {
                o->done[ev.choice] = 1;
                o->last[ev.choice] = ev;
            }
        }
    }
    assert_int_equal(kvs_llm_live(s.llm), 0);
    kvs_llm_stats(s.llm, stats_p);
    expect_pages_back(s.llm, s.pool);
    single_close(&s, 1);
    for (uint32_t c = 0; c < n; c++) {
        if (!o->done[c] || o->last[c].status != KVS_OK)
            fail_msg("choice %u did not finish ok (%s)", c, kvs_status_str(o->last[c].status));
        assert_int_equal(o->ntokens[c], MAX_NEW);
        assert_int_equal(o->last[c].finish, KVS_LLM_FINISH_LENGTH);
    }
}

/* n choices of one prompt: choice c generates exactly what the request alone with seed + c
 * does, sampled choices differ, greedy ones are all the reference. The prompt is computed once:
 * the further choices find its whole pages in the radix cache and compute only the last,
 * partial one. With a small pool the choices preempt each other and still generate the same,
 * and every page comes back. */
static void test_choices(void **state)
{
    (void) state;
    const int p = 2; /* 93 tokens: five whole pages and 13 more */
    choices_t many, one;
    kvs_llm_stats_t st, st1;
    g_sampling = (kvs_sample_params_t){.temperature = 1.0f, .top_p = 0.95f};
    for (int small = 0; small < 2; small++) {
        run_choices(p, 3, 500, small ? SMALL_POOL : ROOMY_POOL, &many, &st);
        for (uint32_t c = 0; c < 3; c++) {
            run_choices(p, 1, 500 + c, small ? SMALL_POOL : ROOMY_POOL, &one, &st1);
            for (int t = 0; t < MAX_NEW; t++)
                if (many.tokens[c][t] != one.tokens[0][t])
                    fail_msg("%s pool, choice %u token %d: %u, alone with seed %u: %u",
                             small ? "small" : "roomy", c, t, many.tokens[c][t], 500 + c,
                             one.tokens[0][t]);
        }
        assert_memory_not_equal(many.tokens[0], many.tokens[1], sizeof(many.tokens[0]));
        assert_memory_not_equal(many.tokens[1], many.tokens[2], sizeof(many.tokens[0]));
        if (small) {
            assert_true(st.preemptions > 0);
        } else {
            assert_int_equal(st.preemptions, 0);
            assert_int_equal(st.prompt_tokens, g_len[p] + 2 * (g_len[p] - 5 * PAGE));
            assert_int_equal(st.cached_tokens, 2 * 5 * PAGE);
            assert_int_equal(many.last[0].cached_tokens, 0);
            assert_int_equal(many.last[1].cached_tokens, 5 * PAGE);
        }
    }
    g_sampling = GREEDY;
    run_choices(p, 3, 1, ROOMY_POOL, &many, &st);
    for (uint32_t c = 0; c < 3; c++)
        assert_memory_equal(many.tokens[c], g_ref[p], sizeof(g_ref[p]));
    /* Refused: too many choices; more than the pool could ever hold (the prompt's 6 pages and
     * one for each further choice, of 10). */
    g_pool_pages = SMALL_POOL;
    single_t s;
    single_open(&s, KVS_LLM_COLOCATED, 1, NULL, NULL, NULL, NULL);
    g_pool_pages = ROOMY_POOL;
    kvs_llm_request_t q = request(p);
    q.n_choices = KVS_LLM_CHOICES_MAX + 1;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_INVALID);
    q.n_choices = 6;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_ERR_NOSPACE);
    q.n_choices = 5;
    assert_int_equal(kvs_llm_submit(s.llm, &q), KVS_OK);
    single_close(&s, 1);
    kvs_assert_no_leaks();
}

/* The failure reason TP ranks agree on: one rank's own cause wins over the others' "aborted"
 * (how the engine stops them), and ranks with different causes leave each its own. */
static void test_agreed_reason(void **state)
{
    (void) state;
    static const kvs_status_t cases[][4] = {
        /* rank reasons (KVS_OK: succeeded), then the agreed reason */
        {KVS_ERR_IO, KVS_ERR_ABORTED, KVS_OK, KVS_ERR_IO},
        {KVS_ERR_ABORTED, KVS_ERR_CORRUPT, KVS_ERR_ABORTED, KVS_ERR_CORRUPT},
        {KVS_ERR_IO, KVS_ERR_IO, KVS_ERR_ABORTED, KVS_ERR_IO},
        {KVS_ERR_IO, KVS_ERR_TIMEOUT, KVS_OK, KVS_OK},
        {KVS_ERR_ABORTED, KVS_ERR_ABORTED, KVS_OK, KVS_OK},
        {KVS_OK, KVS_OK, KVS_OK, KVS_OK},
        {KVS_ERR_NOSPACE, KVS_ERR_INVALID, KVS_ERR_PROTOCOL, KVS_OK},
        {KVS_ERR_INCOMPATIBLE, KVS_OK, KVS_ERR_INCOMPATIBLE, KVS_ERR_INCOMPATIBLE},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        double v[KVS_LLM_AGREE_DOUBLES] = {0}; /* the all-reduce: a sum over the ranks */
        for (int r = 0; r < 3; r++) {
            double part[3];
            kvs__llm_reason_part(cases[c][r], part);
            for (int k = 0; k < 3; k++) v[3 + k] += part[k];
        }
        assert_int_equal(kvs__llm_agreed_reason(v), cases[c][3]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_agreed_reason),
        cmocka_unit_test(test_colocated_equals_reference),
        cmocka_unit_test(test_colocated_tp2_threads),
        cmocka_unit_test(test_disaggregated_equals_colocated),
        cmocka_unit_test(test_disaggregated_hostile_network),
        cmocka_unit_test(test_opposite_orders),
        cmocka_unit_test(test_random_admission),
        cmocka_unit_test(test_write_faults),
        cmocka_unit_test(test_disaggregated_sampling),
        cmocka_unit_test(test_submit_refusals),
        cmocka_unit_test(test_whole_context_max_new),
        cmocka_unit_test(test_preemption_colocated),
        cmocka_unit_test(test_preemption_decode),
        cmocka_unit_test(test_cached_query),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_choices),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
