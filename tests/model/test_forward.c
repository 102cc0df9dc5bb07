/* Tests for the model and its forward pass (serve/model/model.c, forward.c): configuration and
 * TP validation; chunked prefill and batching give bitwise the logits and pool contents of a
 * one-shot run; seeded models at TP 2 and 4 (one thread per rank, a test-local all-reduce)
 * give bitwise the TP1 logits and the matching head slices of the TP1 pool, with and without
 * replicated KV heads; and the real SmolLM2 model (TP1 and TP3) continues a prompt with the
 * tokens a Python reference chose. */
#include "kvs_test.h"

#include <math.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "model/gguf.h"
#include "model/model.h"
#include "model/model_pool.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "model/gguf_writer.h"
#include "model/model_internal.h"

#define MAX_TP 4

static kvs_model_config_t tiny_config(uint32_t heads, uint32_t kv_heads)
{
    kvs_model_config_t c = {.layers = 2,
                            .dim = 64,
                            .ffn_dim = 128,
                            .heads = heads,
                            .kv_heads = kv_heads,
                            .head_dim = 8,
                            .vocab = 97, /* odd: the output projection's row tail runs */
                            .max_ctx = 128,
                            .rope_theta = 10000.0f,
                            .norm_eps = 1e-5f};
    return c;
}

static float *falloc(size_t n)
{
    float *p = kvs_calloc(n, sizeof(float));
    assert_non_null(p);
    return p;
}

/* Runs tokens [from, to) of one sequence as one forward call; logits [vocab]. */
static void run_chunk(kvs_model_t *m, kvs_pool_t *pool, const uint32_t *tokens, uint32_t from,
                      uint32_t to, const uint32_t *pages, uint32_t npages, kvs_allreduce_fn reduce,
                      void *arg, float *logits)
{
    kvs_model_seq_t s = {
        .tokens = tokens + from, .n = to - from, .pos0 = from, .pages = pages, .npages = npages};
    assert_int_equal(kvs_model_forward(m, pool, &s, 1, reduce, arg, logits), KVS_OK);
}

/* Asserts that K and V of positions [0, len) of a sequence are the same bits in two pools,
 * heads [head_b, head_b + heads of a) of b against all heads of a. */
static void assert_same_kv(const kvs_pool_t *a, const uint32_t *pages_a, const kvs_pool_t *b,
                           const uint32_t *pages_b, uint32_t head_b, uint32_t len)
{
    const kvs_pool_config_t *ca = kvs_pool_config(a), *cb = kvs_pool_config(b);
    const uint32_t heads = kvs_pool_heads(a);
    for (uint32_t l = 0; l < ca->shape.layers; l++)
        for (uint32_t comp = 0; comp < 2; comp++) {
            const kvs_region_t *ra = kvs_pool_region(a, l, comp), *rb = kvs_pool_region(b, l, comp);
            for (uint32_t t = 0; t < len; t++)
                for (uint32_t h = 0; h < heads; h++) {
                    const uint8_t *pa =
                        kvs_region_addr(ra, pages_a[t / ca->page_size], t % ca->page_size, h);
                    const uint8_t *pb = kvs_region_addr(rb, pages_b[t / cb->page_size],
                                                        t % cb->page_size, head_b + h);
                    if (memcmp(pa, pb, (size_t) ra->dim * ra->elem_bytes) != 0)
                        fail_msg("K/V differ: layer %u %s position %u head %u", l, comp ? "V" : "K",
                                 t, h);
                }
        }
}

/* Largest distance in units in the last place between two float arrays (0 = identical). */
static uint32_t max_ulp(const float *a, const float *b, size_t n)
{
    uint32_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t ia, ib;
        memcpy(&ia, &a[i], 4);
        memcpy(&ib, &b[i], 4);
        if (ia < 0) ia = INT32_MIN - ia;
        if (ib < 0) ib = INT32_MIN - ib;
        uint32_t d = ia > ib ? (uint32_t) ia - (uint32_t) ib : (uint32_t) ib - (uint32_t) ia;
        if (d > worst) worst = d;
    }
    return worst;
}

static void random_tokens(kvs_rng_t *rng, uint32_t *t, uint32_t n, uint32_t vocab)
{
    for (uint32_t i = 0; i < n; i++) t[i] = (uint32_t) kvs_rng_below(rng, vocab);
}

/* ---- configuration ---- */

static void test_config_validate(void **state)
{
    (void) state;
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_model_config_t c = tiny_config(8, 2);
    assert_int_equal(kvs_model_config_validate(&c, (kvs_tp_t){1, 0}), KVS_OK);
    assert_int_equal(kvs_model_config_validate(&c, (kvs_tp_t){8, 7}), KVS_OK); /* replicated */
    assert_int_equal(kvs_model_config_validate(&c, (kvs_tp_t){3, 0}), KVS_ERR_INVALID);
    c = tiny_config(6, 6);
    assert_int_equal(kvs_model_config_validate(&c, (kvs_tp_t){4, 0}), KVS_ERR_INVALID);
    c = tiny_config(8, 8);
    c.ffn_dim = 100; /* 100 % 8 != 0 */
    cap.calls = 0;
    assert_int_equal(kvs_model_config_validate(&c, (kvs_tp_t){8, 1}), KVS_ERR_INVALID);
    assert_non_null(strstr(cap.msg, "ffn_dim"));
    c = tiny_config(8, 3); /* 8 % 3 */
    assert_int_equal(kvs_model_config_validate(&c, (kvs_tp_t){1, 0}), KVS_ERR_INVALID);
    c = tiny_config(8, 8);
    c.head_dim = 7;
    assert_int_equal(kvs_model_config_validate(&c, (kvs_tp_t){1, 0}), KVS_ERR_INVALID);
    c = tiny_config(8, 8);
    c.rope_theta = 0;
    assert_int_equal(kvs_model_config_validate(&c, (kvs_tp_t){1, 0}), KVS_ERR_INVALID);
    c = tiny_config(8, 8);
    kvs_model_t *m = (kvs_model_t *) &cap; /* untouched on failure */
    assert_int_equal(kvs_model_seeded(&c, 1, (kvs_tp_t){3, 0}, &m), KVS_ERR_INVALID);
    assert_ptr_equal(m, (kvs_model_t *) &cap);
    assert_true(cap.calls > 0);
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

/* Forward refuses mismatched pools, bad page tables and tokens before touching anything. */
static void test_forward_invalid(void **state)
{
    (void) state;
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_model_config_t c = tiny_config(8, 2);
    kvs_model_t *m = NULL, *m2 = NULL;
    assert_int_equal(kvs_model_seeded(&c, 5, (kvs_tp_t){1, 0}, &m), KVS_OK);
    assert_int_equal(kvs_model_seeded(&c, 5, (kvs_tp_t){2, 1}, &m2), KVS_OK);
    kvs_pool_t *pool = make_pool(m, 4, 8, KVS_POOL_NHD);
    kvs_pool_t *pool2 = make_pool(m2, 4, 8, KVS_POOL_NHD);
    uint32_t pages[2];
    assert_int_equal(kvs_pool_alloc(pool, 2, pages), KVS_OK);
    uint32_t tokens[6] = {1, 2, 3, 4, 5, 96};
    float logits[97];
    kvs_model_seq_t s = {.tokens = tokens, .n = 6, .pos0 = 0, .pages = pages, .npages = 2};
    /* wrong TP rank's pool; TP2 without a reduce function */
    assert_int_equal(kvs_model_forward(m, pool2, &s, 1, NULL, NULL, logits), KVS_ERR_INVALID);
    assert_int_equal(kvs_model_forward(m2, pool2, &s, 1, NULL, NULL, logits), KVS_ERR_INVALID);
    /* too few pages for positions 0..8 */
    s.pos0 = 3;
    assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_ERR_INVALID);
    /* a page not allocated */
    s.pos0 = 0;
    uint32_t bad_pages[2] = {pages[0], 7};
    s.pages = bad_pages;
    assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_ERR_INVALID);
    s.pages = pages;
    /* token out of vocab; past the context */
    tokens[5] = 97;
    assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_ERR_INVALID);
    tokens[5] = 96;
    s.pos0 = 125;
    assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_ERR_INVALID);
    s.pos0 = 0;
    s.n = 0;
    assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_ERR_INVALID);
    s.n = 6;
    /* and then it works */
    assert_int_equal(kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits), KVS_OK);
    for (int i = 0; i < 97; i++) assert_true(isfinite(logits[i]));
    kvs_log_set_sink(NULL, NULL);
    kvs_pool_destroy(pool);
    kvs_pool_destroy(pool2);
    kvs_model_destroy(m);
    kvs_model_destroy(m2);
    kvs_assert_no_leaks();
}

/* ---- chunking and batching ---- */

#define PROMPT 23

/* One-shot prefill against chunks of 1, 5 and all, in pools of other layouts and page sizes:
 * the same logits and K/V bit for bit, with K/V elements of kv_bytes (4 f32, 2 bf16); a bf16
 * run's logits are returned in bf16_logits when given. */
static void chunked_prefill(uint32_t kv_bytes, float *bf16_logits)
{
    const uint64_t seed = kvs_test_seed(21);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_model_config_t c = tiny_config(8, 2);
    kvs_model_t *m = NULL;
    assert_int_equal(kvs_model_seeded(&c, seed, (kvs_tp_t){1, 0}, &m), KVS_OK);
    assert_int_equal(kvs_model_set_kv_bytes(m, kv_bytes), KVS_OK);
    assert_int_equal(kvs_model_kv_shape(m).elem_bytes, kv_bytes);
    uint32_t tokens[PROMPT];
    random_tokens(&rng, tokens, PROMPT, c.vocab);

    /* one shot */
    kvs_pool_t *ref = make_pool(m, 4, 8, KVS_POOL_NHD);
    uint32_t ref_pages[6];
    assert_int_equal(kvs_pool_alloc(ref, 6, ref_pages), KVS_OK);
    float *want = falloc(c.vocab), *got = falloc(c.vocab);
    run_chunk(m, ref, tokens, 0, PROMPT, ref_pages, 6, NULL, NULL, want);
    for (uint32_t i = 0; i < c.vocab; i++) assert_true(isfinite(want[i]));

    /* chunks of 1, 5 and all, in pools of other layouts and page sizes */
    const uint32_t chunks[] = {1, 5, PROMPT};
    const uint32_t page_sizes[] = {1, 3, 16};
    for (size_t k = 0; k < 3; k++) {
        for (int layout = 0; layout < 2; layout++) {
            const uint32_t P = page_sizes[(k + (size_t) layout) % 3];
            const uint32_t npages = (PROMPT + P - 1) / P;
            kvs_pool_t *pool = make_pool(m, P, npages + 3, (kvs_pool_layout_t) layout);
            uint32_t pages[PROMPT + 3], spare[3];
            assert_int_equal(kvs_pool_alloc(pool, 3, spare), KVS_OK); /* not page 0.. */
            assert_int_equal(kvs_pool_alloc(pool, npages, pages), KVS_OK);
            for (uint32_t from = 0; from < PROMPT; from += chunks[k]) {
                uint32_t to = from + chunks[k] < PROMPT ? from + chunks[k] : PROMPT;
                run_chunk(m, pool, tokens, from, to, pages, npages, NULL, NULL, got);
            }
            if (memcmp(got, want, c.vocab * sizeof(float)) != 0)
                fail_msg("chunks of %u, page size %u, layout %d: logits differ by %u ulp (seed "
                         "%llu)",
                         chunks[k], P, layout, max_ulp(got, want, c.vocab),
                         (unsigned long long) seed);
            assert_same_kv(ref, ref_pages, pool, pages, 0, PROMPT);
            kvs_pool_destroy(pool);
        }
    }
    if (bf16_logits != NULL) memcpy(bf16_logits, want, c.vocab * sizeof(float));
    kvs_pool_destroy(ref);
    kvs_free(want);
    kvs_free(got);
    kvs_model_destroy(m);
}

static void test_chunked_prefill(void **state)
{
    (void) state;
    chunked_prefill(sizeof(float), NULL);
    kvs_assert_no_leaks();
}

/* bf16 K/V (the GPU's dtype, so a CPU instance can pair with a GPU one): still bitwise
 * independent of chunking, page size and layout, and close to the f32 K/V logits; odd sizes
 * are refused. */
static void test_chunked_prefill_bf16_kv(void **state)
{
    (void) state;
    kvs_model_config_t c = tiny_config(8, 2);
    float *lb = falloc(c.vocab), *lf = falloc(c.vocab);
    chunked_prefill(2, lb);
    chunked_prefill(sizeof(float), lf);
    double worst = 0, big = 0;
    for (uint32_t i = 0; i < c.vocab; i++) {
        worst = fmax(worst, fabs((double) lb[i] - lf[i]));
        big = fmax(big, fabs((double) lf[i]));
    }
    /* bf16 keeps 8 significant bits: a few parts in a thousand of the logits' scale */
    if (!(worst <= 0.02 * big + 1e-3) || worst == 0)
        fail_msg("bf16 K/V logits differ from f32 K/V's by %g (largest logit %g)", worst, big);
    kvs_model_t *m = NULL;
    assert_int_equal(kvs_model_seeded(&c, 1, (kvs_tp_t){1, 0}, &m), KVS_OK);
    assert_int_equal(kvs_model_set_kv_bytes(m, 3), KVS_ERR_INVALID);
    kvs_model_destroy(m);
    kvs_free(lb);
    kvs_free(lf);
    kvs_assert_no_leaks();
}

static void count_waits(void *arg)
{
    ++*(uint32_t *) arg;
}

static void test_batch_equals_alone(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(22);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_model_config_t c = tiny_config(8, 8);
    kvs_model_t *m = NULL;
    assert_int_equal(kvs_model_seeded(&c, seed, (kvs_tp_t){1, 0}, &m), KVS_OK);
    const uint32_t P = 4;
    enum { NSEQ = 3 };
    /* sequence i: a prefix of pre[i] tokens already in the pool, then new[i] tokens */
    const uint32_t pre[NSEQ] = {0, 5, 9}, add[NSEQ] = {7, 6, 1};
    uint32_t tokens[NSEQ][16], pages_a[NSEQ][4], pages_b[NSEQ][4];
    kvs_pool_t *alone = make_pool(m, P, 12, KVS_POOL_HND);
    kvs_pool_t *batch = make_pool(m, P, 12, KVS_POOL_NHD);
    float *want = falloc((size_t) NSEQ * c.vocab), *got = falloc((size_t) NSEQ * c.vocab);
    float *prefix = falloc(c.vocab);
    kvs_model_seq_t seqs[NSEQ];
    for (uint32_t i = 0; i < NSEQ; i++) {
        random_tokens(&rng, tokens[i], pre[i] + add[i], c.vocab);
        assert_int_equal(kvs_pool_alloc(alone, 4, pages_a[i]), KVS_OK);
        assert_int_equal(kvs_pool_alloc(batch, 4, pages_b[i]), KVS_OK);
        if (pre[i] > 0) {
            run_chunk(m, alone, tokens[i], 0, pre[i], pages_a[i], 4, NULL, NULL, prefix);
            run_chunk(m, batch, tokens[i], 0, pre[i], pages_b[i], 4, NULL, NULL, prefix);
        }
        run_chunk(m, alone, tokens[i], pre[i], pre[i] + add[i], pages_a[i], 4, NULL, NULL,
                  want + (size_t) i * c.vocab);
        seqs[i] = (kvs_model_seq_t){.tokens = tokens[i] + pre[i],
                                    .n = add[i],
                                    .pos0 = pre[i],
                                    .pages = pages_b[i],
                                    .npages = 4};
    }
    /* with a wait hook (kvs_model_set_wait): called after every layer, changing no bit */
    uint32_t waits = 0;
    kvs_model_set_wait(m, count_waits, &waits);
    assert_int_equal(kvs_model_forward(m, batch, seqs, NSEQ, NULL, NULL, got), KVS_OK);
    kvs_model_set_wait(m, NULL, NULL);
    assert_int_equal(waits, c.layers);
    assert_memory_equal(got, want, (size_t) NSEQ * c.vocab * sizeof(float));
    for (uint32_t i = 0; i < NSEQ; i++)
        assert_same_kv(alone, pages_a[i], batch, pages_b[i], 0, pre[i] + add[i]);
    /* different sequences give different logits (the comparison above is not vacuous) */
    assert_true(memcmp(got, got + c.vocab, c.vocab * sizeof(float)) != 0);
    kvs_pool_destroy(alone);
    kvs_pool_destroy(batch);
    kvs_free(want);
    kvs_free(got);
    kvs_free(prefix);
    kvs_model_destroy(m);
    kvs_assert_no_leaks();
}

/* ---- tensor parallelism, one thread per rank ---- */

/* A test-local all-reduce between threads: every rank posts its buffer, each sums all of them
 * in rank order into its own temporary, and copies it back once everyone has read. */
typedef struct {
    pthread_barrier_t barrier;
    uint32_t size;
    double *bufs[MAX_TP];
    size_t n[MAX_TP];
} tgroup_t;

typedef struct {
    tgroup_t *g;
    uint32_t rank;
    double *tmp;
    size_t cap;
} tmember_t;

static kvs_status_t thread_allreduce(void *arg, double *buf, size_t n)
{
    tmember_t *me = arg;
    tgroup_t *g = me->g;
    if (n > me->cap) {
        kvs_free(me->tmp);
        me->tmp = kvs_malloc(n * sizeof(double));
        me->cap = me->tmp ? n : 0;
    }
    g->bufs[me->rank] = buf;
    g->n[me->rank] = n;
    pthread_barrier_wait(&g->barrier);
    /* between the barriers everyone only reads the posted buffers */
    int ok = me->tmp != NULL;
    for (uint32_t r = 0; r < g->size; r++) ok &= g->n[r] == n;
    for (size_t i = 0; ok && i < n; i++) {
        double s = g->bufs[0][i];
        for (uint32_t r = 1; r < g->size; r++) s += g->bufs[r][i];
        me->tmp[i] = s;
    }
    pthread_barrier_wait(&g->barrier);
    if (!ok) return KVS_ERR_STATE;
    memcpy(buf, me->tmp, n * sizeof(double));
    return KVS_OK;
}

/* The script every rank runs: a prompt in two chunks, three decode steps, then a batch with a
 * second sequence. Logits of every call are kept. */
#define TP_PROMPT 13
#define TP_STEPS  6 /* forward calls */
typedef struct {
    kvs_model_t *model;
    kvs_pool_t *pool;
    uint32_t pages[2][8];
    const uint32_t *tokens[2]; /* [2][TP_PROMPT + 3] */
    tmember_t member;
    float *logits; /* [TP_STEPS + 1][vocab]: the batch call yields two rows */
    kvs_status_t status;
} trank_t;

static void *rank_main(void *arg)
{
    trank_t *r = arg;
    const uint32_t V = kvs_model_config(r->model)->vocab;
    kvs_allreduce_fn reduce = r->member.g ? thread_allreduce : NULL;
    void *rarg = r->member.g ? &r->member : NULL;
    const uint32_t cuts[] = {0, 4, TP_PROMPT, TP_PROMPT + 1, TP_PROMPT + 2};
    kvs_status_t st = KVS_OK;
    for (int i = 0; i < 4 && st == KVS_OK; i++) {
        kvs_model_seq_t s = {.tokens = r->tokens[0] + cuts[i],
                             .n = cuts[i + 1] - cuts[i],
                             .pos0 = cuts[i],
                             .pages = r->pages[0],
                             .npages = 8};
        st = kvs_model_forward(r->model, r->pool, &s, 1, reduce, rarg, r->logits + (size_t) i * V);
    }
    /* sequence 0 decodes its next token while sequence 1 prefills */
    kvs_model_seq_t b[2] = {
        {.tokens = r->tokens[0] + TP_PROMPT + 2,
         .n = 1,
         .pos0 = TP_PROMPT + 2,
         .pages = r->pages[0],
         .npages = 8},
        {.tokens = r->tokens[1], .n = 9, .pos0 = 0, .pages = r->pages[1], .npages = 8}};
    if (st == KVS_OK)
        st = kvs_model_forward(r->model, r->pool, b, 2, reduce, rarg, r->logits + 4 * (size_t) V);
    r->status = st;
    return NULL;
}

/* Runs the script on TP T (T threads) and leaves each rank's logits and pool in ranks[]. */
static void run_tp(const kvs_model_config_t *c, uint64_t seed, uint32_t T, const uint32_t *tok0,
                   const uint32_t *tok1, trank_t *ranks, tgroup_t *g)
{
    memset(g, 0, sizeof(*g));
    g->size = T;
    assert_int_equal(pthread_barrier_init(&g->barrier, NULL, T), 0);
    pthread_t th[MAX_TP];
    for (uint32_t r = 0; r < T; r++) {
        trank_t *k = &ranks[r];
        memset(k, 0, sizeof(*k));
        assert_int_equal(kvs_model_seeded(c, seed, (kvs_tp_t){T, r}, &k->model), KVS_OK);
        k->pool = make_pool(k->model, 3, 16, r % 2 ? KVS_POOL_HND : KVS_POOL_NHD);
        assert_int_equal(kvs_pool_alloc(k->pool, 8, k->pages[1]), KVS_OK);
        assert_int_equal(kvs_pool_alloc(k->pool, 8, k->pages[0]), KVS_OK);
        k->tokens[0] = tok0;
        k->tokens[1] = tok1;
        k->member = (tmember_t){.g = T > 1 ? g : NULL, .rank = r};
        k->logits = falloc((size_t) (TP_STEPS) *c->vocab);
    }
    for (uint32_t r = 0; r < T; r++)
        assert_int_equal(pthread_create(&th[r], NULL, rank_main, &ranks[r]), 0);
    for (uint32_t r = 0; r < T; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g->barrier);
    for (uint32_t r = 0; r < T; r++) assert_int_equal(ranks[r].status, KVS_OK);
}

static void free_ranks(trank_t *ranks, uint32_t T)
{
    for (uint32_t r = 0; r < T; r++) {
        kvs_free(ranks[r].logits);
        kvs_free(ranks[r].member.tmp);
        kvs_pool_destroy(ranks[r].pool);
        kvs_model_destroy(ranks[r].model);
    }
}

static void tp_equivalence(uint32_t heads, uint32_t kv_heads)
{
    const uint64_t seed = kvs_test_seed(23);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_model_config_t c = tiny_config(heads, kv_heads);
    uint32_t tok0[TP_PROMPT + 3], tok1[9];
    random_tokens(&rng, tok0, TP_PROMPT + 3, c.vocab);
    random_tokens(&rng, tok1, 9, c.vocab);
    const size_t nlog = (size_t) TP_STEPS * c.vocab;

    trank_t one[1], many[MAX_TP];
    tgroup_t g1, g;
    run_tp(&c, seed, 1, tok0, tok1, one, &g1);
    const uint32_t sizes[] = {2, 4};
    for (size_t k = 0; k < 2; k++) {
        const uint32_t T = sizes[k];
        run_tp(&c, seed, T, tok0, tok1, many, &g);
        kvs_kv_shape_t shape = kvs_model_kv_shape(one[0].model);
        for (uint32_t r = 0; r < T; r++) {
            const uint32_t ulp = max_ulp(many[r].logits, one[0].logits, nlog);
            if (ulp != 0)
                fail_msg("heads %u/%u TP%u rank %u: logits differ from TP1 by up to %u ulp "
                         "(seed %llu)",
                         heads, kv_heads, T, r, ulp, (unsigned long long) seed);
            const uint32_t first = kvs_tp_first_head(&shape, T, r);
            for (int s = 0; s < 2; s++)
                assert_same_kv(many[r].pool, many[r].pages[s], one[0].pool, one[0].pages[s], first,
                               s == 0 ? TP_PROMPT + 3 : 9);
        }
        free_ranks(many, T);
    }
    free_ranks(one, 1);
    kvs_assert_no_leaks();
}

static void test_tp_mha(void **state)
{
    (void) state;
    tp_equivalence(8, 8);
}

static void test_tp_gqa_replicated(void **state)
{
    (void) state;
    tp_equivalence(8, 2); /* TP4: each KV head held by two ranks */
}

/* Allocation failures anywhere in seeding or forward are reported, leak nothing, and leave
 * a model that still works. */
static void test_alloc_failures(void **state)
{
    (void) state;
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_model_config_t c = tiny_config(8, 2);
    uint32_t tokens[5] = {3, 1, 4, 1, 5};
    float logits[97], want[97];
    {
        kvs_model_t *m = NULL;
        assert_int_equal(kvs_model_seeded(&c, 9, (kvs_tp_t){1, 0}, &m), KVS_OK);
        kvs_pool_t *pool = make_pool(m, 8, 1, KVS_POOL_NHD);
        uint32_t page;
        assert_int_equal(kvs_pool_alloc(pool, 1, &page), KVS_OK);
        run_chunk(m, pool, tokens, 0, 5, &page, 1, NULL, NULL, want);
        kvs_pool_destroy(pool);
        kvs_model_destroy(m);
    }
    int created = 0, forwarded = 0;
    for (uint64_t nth = 1; nth < 64 && !forwarded; nth++) {
        kvs_model_t *m = NULL;
        kvs_alloc_fail_at(nth);
        kvs_status_t st = kvs_model_seeded(&c, 9, (kvs_tp_t){1, 0}, &m);
        if (st != KVS_OK) {
            kvs_alloc_fail_at(0);
            assert_int_equal(st, KVS_ERR_NOMEM);
            assert_null(m);
            kvs_assert_no_leaks();
            continue;
        }
        created = 1;
        kvs_alloc_fail_at(0);
        kvs_pool_t *pool = make_pool(m, 8, 1, KVS_POOL_NHD);
        uint32_t page;
        assert_int_equal(kvs_pool_alloc(pool, 1, &page), KVS_OK);
        kvs_model_seq_t s = {.tokens = tokens, .n = 5, .pos0 = 0, .pages = &page, .npages = 1};
        /* fail the same count into forward's scratch instead */
        for (uint64_t k = 1; k < 32; k++) {
            kvs_alloc_fail_at(k);
            st = kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits);
            kvs_alloc_fail_at(0);
            if (st == KVS_OK) {
                forwarded = 1;
                break;
            }
            assert_int_equal(st, KVS_ERR_NOMEM);
        }
        assert_true(forwarded);
        assert_memory_equal(logits, want, sizeof(want));
        kvs_pool_destroy(pool);
        kvs_model_destroy(m);
        kvs_assert_no_leaks();
    }
    assert_true(created && forwarded);
    kvs_log_set_sink(NULL, NULL);
}

/* ---- loading from GGUF ---- */

/* What to get wrong in the GGUF written from a model. */
typedef enum {
    GG_OK,
    GG_HALF,
    GG_TIED,
    GG_NO_TENSOR,
    GG_BAD_SHAPE,
    GG_ARCH,
    GG_NO_LAYERS
} gg_fault_t;

/* Writes the (TP1) model m as an F32 GGUF; kvs_free the result. With GG_HALF the output matrix
 * holds half of m's; with GG_TIED there is none (the embeddings serve as output). */
static uint8_t *write_gguf(const kvs_model_t *m, gg_fault_t fault, size_t *len_p)
{
    const kvs_model_config_t *c = kvs_model_config(m);
    const uint64_t dim = c->dim, q = (uint64_t) c->heads * c->head_dim;
    const uint64_t kv = (uint64_t) c->kv_heads * c->head_dim, f = c->ffn_dim;
    gw_t w;
    gw_init(&w, 3);
    gw_kv_str(&w, "general.architecture", fault == GG_ARCH ? "gpt2" : "llama");
    if (fault != GG_NO_LAYERS) gw_kv_u32(&w, "llama.block_count", c->layers);
    gw_kv_u32(&w, "llama.context_length", c->max_ctx);
    gw_kv_u32(&w, "llama.embedding_length", c->dim);
    gw_kv_u32(&w, "llama.feed_forward_length", c->ffn_dim);
    gw_kv_u32(&w, "llama.attention.head_count", c->heads);
    gw_kv_u32(&w, "llama.attention.head_count_kv", c->kv_heads);
    gw_kv_u32(&w, "llama.rope.dimension_count", c->head_dim);
    gw_kv_f32(&w, "llama.rope.freq_base", c->rope_theta);
    gw_kv_f32(&w, "llama.attention.layer_norm_rms_epsilon", c->norm_eps);
    const uint64_t ne_embed[2] = {dim, c->vocab}, ne_norm[1] = {dim};
    gw_tensor_f32(&w, "token_embd.weight", KVS_GGML_F32, 2, ne_embed, m->embed);
    float *half = NULL;
    if (fault == GG_HALF) {
        half = falloc((size_t) c->vocab * dim);
        for (size_t i = 0; i < (size_t) c->vocab * dim; i++) half[i] = m->output[i] * 0.5f;
    }
    if (fault != GG_TIED)
        gw_tensor_f32(&w, "output.weight", KVS_GGML_F32, 2, ne_embed, half ? half : m->output);
    gw_tensor_f32(&w, "output_norm.weight", KVS_GGML_F32, 1, ne_norm, m->output_norm);
    for (uint32_t l = 0; l < c->layers; l++) {
        const kvs_model_layer_t *L = &m->layers[l];
        struct {
            const char *kind;
            uint32_t dims;
            uint64_t ne0, ne1;
            const float *data;
        } t[] = {{"attn_norm", 1, dim, 1, L->attn_norm}, {"attn_q", 2, dim, q, L->wq},
                 {"attn_k", 2, dim, kv, L->wk},          {"attn_v", 2, dim, kv, L->wv},
                 {"attn_output", 2, q, dim, L->wo},      {"ffn_norm", 1, dim, 1, L->ffn_norm},
                 {"ffn_gate", 2, dim, f, L->w_gate},     {"ffn_up", 2, dim, f, L->w_up},
                 {"ffn_down", 2, f, dim, L->w_down}};
        for (size_t k = 0; k < sizeof(t) / sizeof(t[0]); k++) {
            if (fault == GG_NO_TENSOR && l == 1 && k == 6) continue;
            char name[64];
            snprintf(name, sizeof(name), "blk.%u.%s.weight", l, t[k].kind);
            uint64_t ne[2] = {t[k].ne0, t[k].ne1};
            if (fault == GG_BAD_SHAPE && l == 0 && k == 2) { /* attn_k as [kv x dim] */
                ne[0] = kv;
                ne[1] = dim;
            }
            gw_tensor_f32(&w, name, KVS_GGML_F32, t[k].dims, ne, t[k].data);
        }
    }
    uint8_t *buf = gw_finish(&w, len_p);
    assert_non_null(buf);
    gw_free(&w);
    kvs_free(half);
    return buf;
}

/* Asserts that two models of the same config and TP layout hold the same bits everywhere. */
static void assert_same_weights(const kvs_model_t *a, const kvs_model_t *b)
{
    const kvs_model_config_t *c = kvs_model_config(a);
    const size_t dim = c->dim, q = (size_t) a->q_heads * c->head_dim;
    const size_t kv = (size_t) a->kv_heads * c->head_dim, f = a->ffn_cols;
    assert_memory_equal(a->embed, b->embed, (size_t) c->vocab * dim * sizeof(float));
    assert_memory_equal(a->output, b->output, (size_t) c->vocab * dim * sizeof(float));
    assert_memory_equal(a->output_norm, b->output_norm, dim * sizeof(float));
    for (uint32_t l = 0; l < c->layers; l++) {
        const kvs_model_layer_t *x = &a->layers[l], *y = &b->layers[l];
        assert_memory_equal(x->attn_norm, y->attn_norm, dim * sizeof(float));
        assert_memory_equal(x->wq, y->wq, q * dim * sizeof(float));
        assert_memory_equal(x->wk, y->wk, kv * dim * sizeof(float));
        assert_memory_equal(x->wv, y->wv, kv * dim * sizeof(float));
        assert_memory_equal(x->wo, y->wo, dim * q * sizeof(float));
        assert_memory_equal(x->ffn_norm, y->ffn_norm, dim * sizeof(float));
        assert_memory_equal(x->w_gate, y->w_gate, f * dim * sizeof(float));
        assert_memory_equal(x->w_up, y->w_up, f * dim * sizeof(float));
        assert_memory_equal(x->w_down, y->w_down, dim * f * sizeof(float));
    }
}

static void test_load_gguf(void **state)
{
    (void) state;
    kvs_model_config_t c = tiny_config(8, 2);
    kvs_model_t *seeded = NULL;
    assert_int_equal(kvs_model_seeded(&c, 31, (kvs_tp_t){1, 0}, &seeded), KVS_OK);
    size_t len;
    uint8_t *buf = write_gguf(seeded, GG_OK, &len);
    kvs_gguf_t *g = NULL;
    assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
    kvs_model_config_t got;
    assert_int_equal(kvs_model_config_from_gguf(g, &got), KVS_OK);
    assert_memory_equal(&got, &c, sizeof(c));

    /* every rank of TP 1, 2 and 4 (KV heads replicated) loads the slices seeding makes */
    const uint32_t sizes[] = {1, 2, 4};
    for (size_t k = 0; k < 3; k++)
        for (uint32_t r = 0; r < sizes[k]; r++) {
            kvs_model_t *loaded = NULL, *want = NULL;
            assert_int_equal(kvs_model_load(g, (kvs_tp_t){sizes[k], r}, &loaded), KVS_OK);
            assert_int_equal(kvs_model_seeded(&c, 31, (kvs_tp_t){sizes[k], r}, &want), KVS_OK);
            assert_ptr_not_equal(loaded->output, loaded->embed); /* seeded: untied */
            assert_same_weights(loaded, want);
            kvs_model_destroy(loaded);
            kvs_model_destroy(want);
        }
    kvs_gguf_close(g);
    kvs_free(buf);

    /* without output.weight the embeddings are the output matrix */
    buf = write_gguf(seeded, GG_TIED, &len);
    assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
    kvs_model_t *tied = NULL;
    assert_int_equal(kvs_model_load(g, (kvs_tp_t){1, 0}, &tied), KVS_OK);
    assert_ptr_equal(tied->output, tied->embed);
    kvs_model_destroy(tied);
    kvs_gguf_close(g);
    kvs_free(buf);

    /* output.weight is what the logits use */
    buf = write_gguf(seeded, GG_HALF, &len);
    assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
    kvs_model_t *untied = NULL;
    assert_int_equal(kvs_model_load(g, (kvs_tp_t){1, 0}, &untied), KVS_OK);
    assert_ptr_not_equal(untied->output, untied->embed);
    kvs_pool_t *p1 = make_pool(seeded, 4, 2, KVS_POOL_NHD),
               *p2 = make_pool(untied, 4, 2, KVS_POOL_NHD);
    uint32_t pg1[2], pg2[2], tokens[6] = {5, 9, 2, 6, 5, 3};
    assert_int_equal(kvs_pool_alloc(p1, 2, pg1), KVS_OK);
    assert_int_equal(kvs_pool_alloc(p2, 2, pg2), KVS_OK);
    float *l1 = falloc(c.vocab), *l2 = falloc(c.vocab);
    run_chunk(seeded, p1, tokens, 0, 6, pg1, 2, NULL, NULL, l1);
    run_chunk(untied, p2, tokens, 0, 6, pg2, 2, NULL, NULL, l2);
    for (uint32_t i = 0; i < c.vocab; i++) assert_true(l2[i] == l1[i] * 0.5f);
    kvs_free(l1);
    kvs_free(l2);
    kvs_pool_destroy(p1);
    kvs_pool_destroy(p2);
    kvs_model_destroy(untied);
    kvs_gguf_close(g);
    kvs_free(buf);

    /* broken files are refused with a message naming what is wrong */
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    const struct {
        gg_fault_t fault;
        kvs_status_t st;
        const char *says;
    } bad[] = {{GG_NO_TENSOR, KVS_ERR_INVALID, "blk.1.ffn_gate.weight"},
               {GG_BAD_SHAPE, KVS_ERR_INVALID, "blk.0.attn_k.weight"},
               {GG_ARCH, KVS_ERR_UNSUPPORTED, "gpt2"},
               {GG_NO_LAYERS, KVS_ERR_INVALID, "llama.block_count"}};
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        buf = write_gguf(seeded, bad[k].fault, &len);
        assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
        kvs_model_t *m = NULL;
        cap.calls = 0;
        assert_int_equal(kvs_model_load(g, (kvs_tp_t){2, 1}, &m), bad[k].st);
        assert_null(m);
        assert_true(cap.calls > 0);
        if (strstr(cap.msg, bad[k].says) == NULL)
            fail_msg("error \"%s\" does not name %s", cap.msg, bad[k].says);
        kvs_gguf_close(g);
        kvs_free(buf);
    }
    kvs_log_set_sink(NULL, NULL);
    kvs_model_destroy(seeded);
    kvs_assert_no_leaks();
}

/* ---- the real model ---- */

/* "The capital of France is" in SmolLM2's tokenizer (HF tokenizers over the GGUF's vocab and
 * merges, as scripts/gen_tokenizer_cases.py builds it). */
static const uint32_t smol_prompt[] = {504, 3575, 282, 4649, 314};
/* Its greedy continuation " Paris.\n\nThe answer is:" from a NumPy reference,
 * tests/model/data/smollm2_greedy_ref.py: the GGUF's tensors dequantised with gguf-py's
 * gguf.quants.dequantize, then the Llama forward pass in float64, argmax at each step. The
 * top-2 logit margins there were 2.48 1.28 1.43 1.34 0.84 0.22 1.63 1.96, and this float32
 * forward pass differs from it by at most 2e-5 per logit (measured at the first step), so all
 * 8 tokens are asserted. */
static const uint32_t smol_expect[] = {7042, 30, 198, 198, 504, 2988, 314, 42};
#define SMOL_GEN 8

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    trank_t r;
    uint32_t out[SMOL_GEN];
    double prefill_s, decode_s;
} smol_rank_t;

/* Prefills the prompt and decodes greedily; every rank picks the same tokens (its logits are
 * the replicated ones). */
static void *smol_main(void *arg)
{
    smol_rank_t *s = arg;
    trank_t *r = &s->r;
    const uint32_t V = kvs_model_config(r->model)->vocab;
    kvs_allreduce_fn reduce = r->member.g ? thread_allreduce : NULL;
    void *rarg = r->member.g ? &r->member : NULL;
    uint32_t seq[16];
    const uint32_t n0 = sizeof(smol_prompt) / sizeof(smol_prompt[0]);
    memcpy(seq, smol_prompt, sizeof(smol_prompt));
    double t0 = now_s();
    kvs_status_t st = KVS_OK;
    uint32_t len = n0, from = 0;
    for (uint32_t i = 0; i < SMOL_GEN && st == KVS_OK; i++) {
        kvs_model_seq_t q = {
            .tokens = seq + from, .n = len - from, .pos0 = from, .pages = r->pages[0], .npages = 1};
        st = kvs_model_forward(r->model, r->pool, &q, 1, reduce, rarg, r->logits);
        if (i == 0) s->prefill_s = now_s() - t0;
        s->out[i] = seq[len] = kvs_sample(r->logits, V, NULL, NULL, NULL);
        from = len++;
    }
    s->decode_s = now_s() - t0 - s->prefill_s;
    r->status = st;
    return NULL;
}

static void smol_run(const kvs_gguf_t *g, uint32_t T, smol_rank_t *ranks)
{
    tgroup_t grp;
    memset(&grp, 0, sizeof(grp));
    grp.size = T;
    assert_int_equal(pthread_barrier_init(&grp.barrier, NULL, T), 0);
    const double t0 = now_s();
    for (uint32_t r = 0; r < T; r++) {
        trank_t *k = &ranks[r].r;
        memset(&ranks[r], 0, sizeof(ranks[r]));
        assert_int_equal(kvs_model_load(g, (kvs_tp_t){T, r}, &k->model), KVS_OK);
        k->pool = make_pool(k->model, 16, 2, KVS_POOL_NHD);
        assert_int_equal(kvs_pool_alloc(k->pool, 1, k->pages[0]), KVS_OK);
        k->member = (tmember_t){.g = T > 1 ? &grp : NULL, .rank = r};
        k->logits = falloc(kvs_model_config(k->model)->vocab);
    }
    const double load_s = now_s() - t0;
    pthread_t th[MAX_TP];
    for (uint32_t r = 0; r < T; r++)
        assert_int_equal(pthread_create(&th[r], NULL, smol_main, &ranks[r]), 0);
    for (uint32_t r = 0; r < T; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&grp.barrier);
    for (uint32_t r = 0; r < T; r++) assert_int_equal(ranks[r].r.status, KVS_OK);
    print_message("SmolLM2 TP%u: load %.2f s, prefill %u tokens %.1f tok/s, decode %.1f tok/s\n", T,
                  load_s, (unsigned) (sizeof(smol_prompt) / sizeof(smol_prompt[0])),
                  (sizeof(smol_prompt) / sizeof(smol_prompt[0])) / ranks[0].prefill_s,
                  (SMOL_GEN - 1) / ranks[0].decode_s);
}

static void test_smollm2(void **state)
{
    (void) state;
    char path[4096];
    if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
        fail_msg("SmolLM2 GGUF not found: run scripts/setup.sh (or set KVS_MODEL)");
    kvs_gguf_t *g = NULL;
    assert_int_equal(kvs_gguf_open(path, &g), KVS_OK);
    kvs_model_config_t c;
    assert_int_equal(kvs_model_config_from_gguf(g, &c), KVS_OK);
    assert_int_equal(c.layers, 30);
    assert_int_equal(c.dim, 576);
    assert_int_equal(c.ffn_dim, 1536);
    assert_int_equal(c.heads, 9);
    assert_int_equal(c.kv_heads, 3);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.vocab, 49152);
    assert_int_equal(c.max_ctx, 8192);
    assert_true(c.rope_theta == 100000.0f);
    assert_true(fabsf(c.norm_eps - 1e-5f) < 1e-9f);

    smol_rank_t *one = kvs_calloc(1, sizeof(smol_rank_t));
    smol_rank_t *three = kvs_calloc(3, sizeof(smol_rank_t));
    assert_non_null(one);
    assert_non_null(three);
    smol_run(g, 1, one);
    for (int i = 0; i < SMOL_GEN; i++)
        if (one->out[i] != smol_expect[i])
            fail_msg("TP1 greedy token %d is %u, the reference chose %u", i, one->out[i],
                     smol_expect[i]);
    smol_run(g, 3, three);
    for (uint32_t r = 0; r < 3; r++) {
        assert_memory_equal(three[r].out, one->out, sizeof(one->out));
        const uint32_t ulp = max_ulp(three[r].r.logits, one->r.logits, c.vocab);
        if (ulp != 0) fail_msg("TP3 rank %u: last logits differ from TP1 by %u ulp", r, ulp);
    }
    free_ranks(&one->r, 1);
    for (uint32_t r = 0; r < 3; r++) free_ranks(&three[r].r, 1);
    kvs_free(one);
    kvs_free(three);
    kvs_gguf_close(g);
    kvs_assert_no_leaks();
}

/* all_logits: each new token's row, bitwise the logits it gets as the last token of a pass of
 * its own; the last row equals the pass's logits; a sequence without it is unaffected. */
static void test_all_positions(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(23);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_model_config_t c = tiny_config(8, 2);
    kvs_model_t *m = NULL;
    assert_int_equal(kvs_model_seeded(&c, seed, (kvs_tp_t){1, 0}, &m), KVS_OK);
    uint32_t tokens[PROMPT];
    random_tokens(&rng, tokens, PROMPT, c.vocab);
    const uint32_t npages = (PROMPT + 3) / 4;
    kvs_pool_t *one = make_pool(m, 4, npages, KVS_POOL_NHD),
               *all = make_pool(m, 4, 2 * npages, KVS_POOL_HND);
    uint32_t p1[PROMPT], pa[PROMPT], pb[PROMPT];
    assert_int_equal(kvs_pool_alloc(one, npages, p1), KVS_OK);
    assert_int_equal(kvs_pool_alloc(all, npages, pa), KVS_OK);
    assert_int_equal(kvs_pool_alloc(all, npages, pb), KVS_OK);
    float *want = falloc((size_t) PROMPT * c.vocab), *rows = falloc((size_t) PROMPT * c.vocab);
    float *last = falloc(2 * (size_t) c.vocab);
    for (uint32_t t = 0; t < PROMPT; t++)
        run_chunk(m, one, tokens, t, t + 1, p1, npages, NULL, NULL, want + (size_t) t * c.vocab);
    /* Two sequences in one pass, chunks [0, 7) and then the rest, only the first asking. */
    const uint32_t cut = 7;
    for (int k = 0; k < 2; k++) {
        uint32_t from = k ? cut : 0, to = k ? PROMPT : cut;
        kvs_model_seq_t s[2] = {
            {.tokens = tokens + from,
             .n = to - from,
             .pos0 = from,
             .pages = pa,
             .npages = npages,
             .all_logits = rows + (size_t) from * c.vocab},
            {.tokens = tokens + from, .n = to - from, .pos0 = from, .pages = pb, .npages = npages}};
        assert_int_equal(kvs_model_forward(m, all, s, 2, NULL, NULL, last), KVS_OK);
        assert_memory_equal(last, rows + (size_t) (to - 1) * c.vocab, c.vocab * sizeof(float));
        assert_memory_equal(last + c.vocab, last, c.vocab * sizeof(float));
    }
    for (uint32_t t = 0; t < PROMPT; t++)
        if (memcmp(rows + (size_t) t * c.vocab, want + (size_t) t * c.vocab,
                   c.vocab * sizeof(float)) != 0)
            fail_msg("position %u: all-positions row differs by %u ulp (seed %llu)", t,
                     max_ulp(rows + (size_t) t * c.vocab, want + (size_t) t * c.vocab, c.vocab),
                     (unsigned long long) seed);
    kvs_free(want);
    kvs_free(rows);
    kvs_free(last);
    kvs_pool_destroy(one);
    kvs_pool_destroy(all);
    kvs_model_destroy(m);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_validate), cmocka_unit_test(test_forward_invalid),
        cmocka_unit_test(test_chunked_prefill), cmocka_unit_test(test_chunked_prefill_bf16_kv),
        cmocka_unit_test(test_all_positions),   cmocka_unit_test(test_batch_equals_alone),
        cmocka_unit_test(test_tp_mha),          cmocka_unit_test(test_tp_gqa_replicated),
        cmocka_unit_test(test_alloc_failures),  cmocka_unit_test(test_load_gguf),
        cmocka_unit_test(test_smollm2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
