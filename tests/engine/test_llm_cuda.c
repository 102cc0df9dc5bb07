/* The serving engine disaggregated on GPUs, in one process: a prefill engine and a decode engine
 * of a seeded CUDA model (head dim 64), each with a device pool of bf16 K/V on GPU 0, joined by
 * kvstage over the in-process transport (the CUDA copy backend on both sides). After each room's
 * handoff the K and V of every prompt position in the prefill pool equal, byte for byte, those
 * in the decode pool (the engine's test hook snapshots both sides' pages when the transfer
 * concludes); prompts of many chunks, page sizes 16 (NHD) and 1 (HND), radix caches on and off,
 * one request at a time or all at once. One at a time, the generated tokens equal a colocated
 * run of the same CUDA model exactly (the same passes on the same GPU). Prefill TP2 (both ranks
 * on GPU 0, threads in a TP group) to decode TP1: every head of every position equals the
 * prefill rank's that holds it. Mixed pairs over the same link: a CPU prefill with bf16 K/V
 * feeding a GPU decode, and the reverse, byte for byte as well.
 * The same harness runs everywhere on CPU models with bf16 K/V (host pools): there the tokens
 * equal the colocated ones in every mode (the CPU forward pass is bitwise independent of
 * batching), and it drives admission under random pools, slots and orders with prefill TP2.
 * The GPU tests skip without a CUDA device (scripts/gpu-check.sh runs this binary on a GPU
 * machine and fails if anything is skipped). */
#include "kvs_test.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/mem.h"
#include "engine/llm.h"
#include "kvstage/clock.h"
#include "kvstage/inproc.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "staging/copy.h"
#include "transport/link.h"

#define CHUNK       32
#define MAX_NEW     24
#define NPROMPTS    4
#define MAX_PROMPT  256
#define SHARED      80 /* prompts 0-2 share their first 80 tokens */
#define POOL_TOKENS 2048
#define MAX_PTP     2

static const kvs_model_config_t CFG = {.layers = 2,
                                       .dim = 256,
                                       .ffn_dim = 576,
                                       .heads = 4,
                                       .kv_heads = 2,
                                       .head_dim = 64,
                                       .vocab = 512,
                                       .max_ctx = 1024,
                                       .rope_theta = 10000.0f,
                                       .norm_eps = 1e-5f};
#define MODEL_SEED 11

/* 150 tokens: four whole chunks and a partial fifth; 117; 203: six and a partial seventh;
 * 37: one and a bit. */
static const uint32_t LEN[NPROMPTS] = {150, 117, 203, 37};
static uint32_t g_prompt[NPROMPTS][MAX_PROMPT];

static void make_prompts(void)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 2024);
    for (int p = 0; p < NPROMPTS; p++)
        for (uint32_t i = 0; i < LEN[p]; i++)
            g_prompt[p][i] = p > 0 && p < 3 && i < SHARED
                                 ? g_prompt[0][i]
                                 : (uint32_t) kvs_rng_below(&rng, CFG.vocab);
}

static int setup(void **state)
{
    (void) state;
    make_prompts();
    return 0;
}

static int have_gpu(void)
{
    return kvs_copy_cuda_available();
}

static void require_gpu(void)
{
    static int told;
    if (!have_gpu()) {
        if (!told++) print_message("no CUDA device on this machine: GPU tests skipped\n");
        skip();
    }
}

/* ---- one deployment: what varies between runs ---- */

typedef struct {
    int prefill_device, decode_device; /* CUDA device, or -1: the CPU with bf16 K/V */
    uint32_t prefill_tp;               /* 1 or 2 (decode is TP1) */
    uint32_t page_size;
    kvs_pool_layout_t layout;
    int prefill_radix, decode_radix;
    int concurrent; /* every request at once, else each once the previous one is done */
    /* Admission under pressure (0 or NULL: the defaults): each side's pool pages and max_running,
     * its engines' max_context, each side's order of submission (order[0] prefill, [1] decode: a
     * permutation of the rooms) and its rank 0's pace (a room on one step in `pace`, drawn from
     * `seed`), and the rooms' bootstrap timeout. */
    uint32_t pages[2], slots[2], max_context, pace;
    const int *order[2];
    uint64_t seed, bootstrap_ns;
} setup_t;

static kvs_model_t *model_on(int device, kvs_tp_t tp)
{
    kvs_model_t *m = NULL;
    assert_int_equal(kvs_model_seeded_on(&CFG, MODEL_SEED, tp, device, &m), KVS_OK);
    if (device < 0) assert_int_equal(kvs_model_set_kv_bytes(m, 2), KVS_OK);
    assert_int_equal(kvs_model_kv_shape(m).elem_bytes, 2);
    return m;
}

/* pages 0: POOL_TOKENS' worth. */
static kvs_pool_t *pool_for(const kvs_model_t *m, const setup_t *s, uint32_t pages)
{
    kvs_pool_config_t c;
    memset(&c, 0, sizeof(c));
    c.shape = kvs_model_kv_shape(m);
    c.tp = kvs_model_tp(m);
    c.page_size = s->page_size;
    c.num_pages = pages ? pages : POOL_TOKENS / s->page_size;
    c.layout = s->layout;
    c.mem = kvs_model_device(m) < 0 ? KVS_MEM_HOST : KVS_MEM_DEVICE;
    c.device = kvs_model_device(m) < 0 ? 0 : kvs_model_device(m);
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_OK);
    return pool;
}

/* ---- snapshots of a room's prompt KV, taken by the engine's test hook ---- */

/* One rank's copy of a room's prompt K/V in host memory, [layer][K, V][position][head][dim]
 * bf16, whatever the pool's layout and memory. */
typedef struct {
    uint8_t *bytes;
    uint32_t heads, first_head; /* of the model's KV heads: this rank's */
    uint32_t len;
    int taken;
} snap_t;

typedef struct {
    pthread_mutex_t mu;
    snap_t prefill[MAX_PTP][NPROMPTS], decode[NPROMPTS];
    int bad; /* a hook call that could not copy, or came twice for a room */
} snaps_t;

typedef struct {
    snaps_t *snaps;
    int decode;
    uint32_t rank, tp;
} hook_ctx_t;

static size_t head_bytes(void)
{
    return (size_t) CFG.head_dim * 2;
}

static void kv_hook(void *ctxp, uint64_t room, const kvs_pool_t *pool, const uint32_t *pages,
                    uint32_t prompt_len)
{
    hook_ctx_t *h = ctxp;
    const kvs_pool_config_t *pc = kvs_pool_config(pool);
    const uint32_t heads = kvs_pool_heads(pool), P = pc->page_size;
    const size_t hb = head_bytes();
    int bad = room < 1 || room > NPROMPTS;
    uint8_t *out = NULL, *tmp = NULL;
    if (!bad) {
        out = kvs_calloc((size_t) CFG.layers * 2 * prompt_len * heads, hb);
        bad = out == NULL;
    }
    /* No device-wide wait: what wrote these pages has completed and this rank has seen it (the
     * forward pass returned its logits; the receiver's scatter completed before the room's
     * success), and a device-wide wait could meet another thread's CUDA graph capture. */
    for (uint32_t l = 0; !bad && l < CFG.layers; l++)
        for (uint32_t c = 0; !bad && c < 2; c++) {
            const kvs_region_t *r = kvs_pool_region(pool, l, c);
            /* one page's extent: its last token's last head ends there */
            const size_t extent =
                (size_t) ((P - 1) * r->token_stride + (r->heads - 1) * r->head_stride) + hb;
            if (tmp == NULL && (tmp = kvs_malloc(extent)) == NULL) bad = 1;
            for (uint32_t pg = 0; !bad && pg * P < prompt_len; pg++) {
                if (kvs_mem_copy(tmp, kvs_region_addr(r, pages[pg], 0, 0), extent) != KVS_OK) {
                    bad = 1;
                    break;
                }
                for (uint32_t t = 0; t < P && pg * P + t < prompt_len; t++)
                    for (uint32_t hd = 0; hd < heads; hd++)
                        memcpy(out +
                                   ((((size_t) l * 2 + c) * prompt_len + pg * P + t) * heads + hd) *
                                       hb,
                               tmp + t * r->token_stride + hd * r->head_stride, hb);
            }
        }
    kvs_free(tmp);
    pthread_mutex_lock(&h->snaps->mu);
    snap_t *s = bad         ? NULL
                : h->decode ? &h->snaps->decode[room - 1]
                            : &h->snaps->prefill[h->rank][room - 1];
    if (s == NULL || s->taken) {
        h->snaps->bad = 1;
        kvs_free(out);
    } else {
        s->bytes = out;
        s->heads = heads;
        s->first_head = kvs_tp_first_head(&pc->shape, h->tp, h->rank);
        s->len = prompt_len;
        s->taken = 1;
    }
    pthread_mutex_unlock(&h->snaps->mu);
}

static void snaps_free(snaps_t *s)
{
    for (int p = 0; p < NPROMPTS; p++) {
        kvs_free(s->decode[p].bytes);
        for (int r = 0; r < MAX_PTP; r++) kvs_free(s->prefill[r][p].bytes);
    }
    pthread_mutex_destroy(&s->mu);
}

/* Every head of every prompt position of every room in the decode snapshot equals the prefill
 * rank's that holds it, and none of it is the pool's zeros. */
static void expect_same_kv(const snaps_t *s, uint32_t ptp)
{
    assert_false(s->bad);
    const size_t hb = head_bytes();
    for (int p = 0; p < NPROMPTS; p++) {
        const snap_t *d = &s->decode[p];
        if (!d->taken) fail_msg("room %d: no decode snapshot", p + 1);
        assert_int_equal(d->len, LEN[p]);
        assert_int_equal(d->heads, CFG.kv_heads);
        size_t nonzero = 0;
        for (uint32_t r = 0; r < ptp; r++) {
            const snap_t *q = &s->prefill[r][p];
            if (!q->taken) fail_msg("room %d: no snapshot of prefill rank %u", p + 1, r);
            assert_int_equal(q->len, LEN[p]);
            for (uint32_t l = 0; l < CFG.layers; l++)
                for (uint32_t c = 0; c < 2; c++)
                    for (uint32_t t = 0; t < LEN[p]; t++)
                        for (uint32_t h = 0; h < q->heads; h++) {
                            const uint8_t *a =
                                q->bytes +
                                ((((size_t) l * 2 + c) * LEN[p] + t) * q->heads + h) * hb;
                            const uint8_t *b =
                                d->bytes + ((((size_t) l * 2 + c) * LEN[p] + t) * d->heads +
                                            q->first_head + h) *
                                               hb;
                            if (memcmp(a, b, hb) != 0)
                                fail_msg("room %d layer %u %s position %u head %u: the decode "
                                         "pool's bytes differ from prefill rank %u's",
                                         p + 1, l, c ? "V" : "K", t, q->first_head + h, r);
                            for (size_t i = 0; i < hb; i++) nonzero += a[i] != 0;
                        }
        }
        /* a KV of zeros on both sides (nothing written) would compare equal */
        assert_true(nonzero > (size_t) CFG.layers * LEN[p] * CFG.kv_heads * CFG.head_dim);
    }
}

/* ---- the in-process link under a lock: ranks are threads here, inproc is not thread-safe ---- */

static pthread_mutex_t g_link_mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
    kvs_link_t *inner;
} locked_t;

#define LOCKED(expr)                                                                               \
    do {                                                                                           \
        pthread_mutex_lock(&g_link_mu);                                                            \
        expr;                                                                                      \
        pthread_mutex_unlock(&g_link_mu);                                                          \
    } while (0)

static kvs_status_t l_send(void *c, uint32_t peer, const uint8_t *buf, size_t len)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st;
    LOCKED(st = in->ops->send(in->ctx, peer, buf, len));
    return st;
}

static kvs_status_t l_recv(void *c, uint8_t *buf, size_t cap, size_t *len_p, uint32_t *from_p)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st;
    LOCKED(st = in->ops->recv(in->ctx, buf, cap, len_p, from_p));
    return st;
}

static kvs_status_t l_write(void *c, uint32_t peer, uint64_t offset, const void *src, uint64_t len,
                            uint64_t *ticket_p)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st;
    LOCKED(st = in->ops->write(in->ctx, peer, offset, src, len, ticket_p));
    return st;
}

static kvs_status_t l_write_poll(void *c, uint64_t ticket)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st;
    LOCKED(st = in->ops->write_poll(in->ctx, ticket));
    return st;
}

static kvs_status_t l_map(void *c, uint32_t peer, uint64_t offset, uint64_t len, uint8_t **ptr_p,
                          int *host_p)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st = KVS_ERR_UNSUPPORTED;
    if (in->ops->map != NULL) LOCKED(st = in->ops->map(in->ctx, peer, offset, len, ptr_p, host_p));
    return st;
}

static kvs_status_t l_ring_alloc(void *c, uint64_t size, void **ring_p)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st = KVS_ERR_UNSUPPORTED;
    if (in->ops->ring_alloc != NULL) LOCKED(st = in->ops->ring_alloc(in->ctx, size, ring_p));
    return st;
}

static void l_ring_free(void *c, void *ring)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    if (in->ops->ring_free != NULL) LOCKED(in->ops->ring_free(in->ctx, ring));
}

static kvs_status_t l_expose(void *c, void *ring, uint64_t size)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st;
    LOCKED(st = in->ops->expose(in->ctx, ring, size));
    return st;
}

static kvs_status_t l_flush(void *c)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st;
    LOCKED(st = in->ops->flush(in->ctx));
    return st;
}

static kvs_status_t l_peer_status(void *c, uint32_t peer)
{
    kvs_link_t *in = ((locked_t *) c)->inner;
    kvs_status_t st = KVS_OK;
    if (in->ops->peer_status != NULL) LOCKED(st = in->ops->peer_status(in->ctx, peer));
    return st;
}

static void l_destroy(void *c)
{
    locked_t *l = c;
    LOCKED(kvs_link_destroy(l->inner));
    kvs_free(l);
}

static const kvs_link_ops_t LOCKED_OPS = {.name = "inproc-locked",
                                          .send = l_send,
                                          .recv = l_recv,
                                          .write = l_write,
                                          .write_poll = l_write_poll,
                                          .map = l_map,
                                          .ring_alloc = l_ring_alloc,
                                          .ring_free = l_ring_free,
                                          .expose = l_expose,
                                          .flush = l_flush,
                                          .peer_status = l_peer_status,
                                          .destroy = l_destroy};

static kvs_link_t *locked_link(kvs_inproc_net_t *net, kvs_side_t side, uint32_t rank)
{
    locked_t *l = kvs_calloc(1, sizeof(*l));
    kvs_link_t *link = kvs_calloc(1, sizeof(*link));
    assert_non_null(l);
    assert_non_null(link);
    assert_int_equal(kvs_inproc_link_create(net, side, rank, &l->inner), KVS_OK);
    link->ops = &LOCKED_OPS;
    link->ctx = l;
    return link;
}

/* ---- what the engines report ---- */

typedef struct {
    uint32_t tokens[NPROMPTS][MAX_NEW];
    uint32_t ntokens[NPROMPTS];
    int done[NPROMPTS];
    kvs_llm_event_t last[NPROMPTS];
} outcome_t;

static void drain(kvs_llm_t *e, outcome_t *o)
{
    kvs_llm_event_t ev;
    while (kvs_llm_next_event(e, &ev) == KVS_OK) {
        assert_true(ev.room >= 1 && ev.room <= NPROMPTS);
        const int p = (int) ev.room - 1;
        assert_false(o->done[p]);
        if (ev.kind == KVS_LLM_EV_TOKEN) {
            assert_int_equal(ev.index, o->ntokens[p]);
            assert_true(o->ntokens[p] < MAX_NEW);
            o->tokens[p][o->ntokens[p]++] = ev.token;
        } else if (ev.kind == KVS_LLM_EV_DONE) {
            o->last[p] = ev;
            o->done[p] = 1;
        }
    }
}

static kvs_llm_request_t request(int p)
{
    return (kvs_llm_request_t){.room = (uint64_t) p + 1,
                               .prompt = g_prompt[p],
                               .prompt_len = LEN[p],
                               .max_new_tokens = MAX_NEW,
                               .sampling = {.top_p = 1},
                               .seed = 7,
                               .eos = UINT32_MAX};
}

static kvs_llm_config_t engine_config(kvs_llm_role_t role, kvs_model_t *m, kvs_pool_t *pool,
                                      int radix)
{
    return (kvs_llm_config_t){.role = role,
                              .model = m,
                              .pool = pool,
                              .chunk_tokens = CHUNK,
                              .batch_tokens = 2 * CHUNK,
                              .max_running = 4,
                              .radix = radix};
}

static void expect_ok(const outcome_t *o, int p, uint32_t tokens, kvs_llm_finish_t finish)
{
    if (!o->done[p] || o->last[p].status != KVS_OK)
        fail_msg("room %d did not finish ok (%s)", p + 1, kvs_status_str(o->last[p].status));
    assert_int_equal(o->ntokens[p], tokens);
    assert_int_equal(o->last[p].finish, finish);
}

/* Greedy tokens of a colocated engine on `device`, one request at a time. */
static void colocated(const setup_t *s, int device, int radix, outcome_t *o)
{
    kvs_model_t *m = model_on(device, (kvs_tp_t){1, 0});
    kvs_pool_t *pool = pool_for(m, s, 0);
    kvs_llm_config_t c = engine_config(KVS_LLM_COLOCATED, m, pool, radix);
    kvs_llm_t *e = NULL;
    assert_int_equal(kvs_llm_create(&c, &e), KVS_OK);
    memset(o, 0, sizeof(*o));
    int next = 0;
    for (int steps = 0; steps < 100000; steps++) {
        if (next < NPROMPTS && (next == 0 || o->done[next - 1])) {
            kvs_llm_request_t q = request(next++);
            assert_int_equal(kvs_llm_submit(e, &q), KVS_OK);
        }
        int quit;
        uint32_t work;
        assert_int_equal(kvs_llm_step(e, 0, &quit, &work), KVS_OK);
        drain(e, o);
        if (next == NPROMPTS && kvs_llm_live(e) == 0) break;
    }
    for (int p = 0; p < NPROMPTS; p++) expect_ok(o, p, MAX_NEW, KVS_LLM_FINISH_LENGTH);
    kvs_llm_destroy(e);
    assert_int_equal(kvs_pool_free_pages(pool), kvs_pool_total_pages(pool));
    kvs_pool_destroy(pool);
    kvs_model_destroy(m);
}

/* ---- the disaggregated run: one thread per engine rank ---- */

typedef struct run run_t;

typedef struct {
    run_t *run;
    int decode;
    uint32_t rank;
    kvs_model_t *model;
    kvs_pool_t *pool;
    kvs_link_t *link;
    kvs_sender_t *tx;
    kvs_receiver_t *rx;
    kvs_tpgroup_t *group;
    hook_ctx_t hook;
    kvs_llm_stats_t stats;
    const char *failed; /* NULL, or what went wrong in the thread */
} rank_t;

struct run {
    const setup_t *s;
    rank_t prefill[MAX_PTP], decode;
    outcome_t po, o;      /* prefill rank 0's and decode's events */
    _Atomic int released; /* requests rank 0 of each side may submit */
    _Atomic int decode_done, abandon;
    snaps_t snaps;
};

static void nap(void)
{
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
}

/* Ends a thread's loop with a reason (the main thread fails the test with it). */
#define RANK_FAIL(r, why)                                                                          \
    do {                                                                                           \
        (r)->failed = (why);                                                                       \
        atomic_store(&(r)->run->abandon, 1);                                                       \
        goto out;                                                                                  \
    } while (0)

static void *rank_main(void *argp)
{
    rank_t *k = argp;
    run_t *run = k->run;
    const setup_t *s = run->s;
    kvs_llm_config_t c = engine_config(k->decode ? KVS_LLM_DECODE : KVS_LLM_PREFILL, k->model,
                                       k->pool, k->decode ? s->decode_radix : s->prefill_radix);
    kvs_llm_t *e = NULL;
    if (!k->decode && s->prefill_tp > 1) {
        char name[64];
        snprintf(name, sizeof(name), "/kvs-test-llm-cuda-%d", (int) getpid());
        kvs_tpgroup_config_t gc = {.name = name,
                                   .size = s->prefill_tp,
                                   .rank = k->rank,
                                   .max_doubles = 2 * CHUNK * CFG.dim + 64,
                                   .max_bytes = 65536,
                                   .timeout_ms = 60000};
        if (kvs_tpgroup_join(&gc, &k->group) != KVS_OK) RANK_FAIL(k, "kvs_tpgroup_join failed");
    }
    c.group = k->group;
    c.sender = k->tx;
    c.receiver = k->rx;
    if (s->slots[k->decode]) c.max_running = s->slots[k->decode];
    c.max_context = s->max_context;
    c.test_kv_hook = kv_hook;
    c.test_kv_ctx = &k->hook;
    if (kvs_llm_create(&c, &e) != KVS_OK) RANK_FAIL(k, "kvs_llm_create failed");
    outcome_t *o = k->decode ? &run->o : &run->po;
    int submitted = 0, quit = 0;
    kvs_rng_t pace;
    kvs_rng_seed(&pace, s->seed ^ (uint64_t) k->decode);
    const uint64_t deadline = kvs_now_ns() + 300000000000ull;
    while (!quit) {
        if (kvs_now_ns() > deadline) RANK_FAIL(k, "not done within 300 s");
        if (atomic_load(&run->abandon) && k->group == NULL) break;
        /* Every room released so far, or with a pace at most one, on one step in `pace`. */
        if (k->rank == 0 && (s->pace == 0 || kvs_rng_below(&pace, s->pace) == 0))
            for (int most = s->pace ? 1 : NPROMPTS;
                 most > 0 && submitted < atomic_load(&run->released); most--) {
                const int *order = s->order[k->decode];
                kvs_llm_request_t q = request(order ? order[submitted] : submitted);
                submitted++;
                if (kvs_llm_submit(e, &q) != KVS_OK) RANK_FAIL(k, "kvs_llm_submit failed");
            }
        /* Prefill rank 0 ends the group once decode has everything; decode ends alone. */
        int end = 0;
        if (k->rank == 0 && !k->decode)
            end = (atomic_load(&run->decode_done) || atomic_load(&run->abandon)) &&
                  kvs_llm_live(e) == 0;
        if (k->decode) {
            end = submitted == NPROMPTS && kvs_llm_live(e) == 0;
            if (end) atomic_store(&run->decode_done, 1);
        }
        uint32_t work = 0;
        if (kvs_llm_step(e, end, &quit, &work) != KVS_OK) RANK_FAIL(k, "kvs_llm_step failed");
        if (k->rank == 0) drain(e, o);
        /* One at a time: the next request once decode finished this one. */
        if (k->decode && !s->concurrent) {
            const int r = atomic_load(&run->released);
            if (r < NPROMPTS && o->done[r - 1]) atomic_store(&run->released, r + 1);
        }
        if (work == 0) nap();
    }
    /* No request holds a page: each is free or the radix cache's. */
    kvs_llm_stats(e, &k->stats);
    if (k->stats.running + k->stats.queued != 0 ||
        kvs_pool_free_pages(k->pool) + k->stats.radix_pages != kvs_pool_total_pages(k->pool))
        RANK_FAIL(k, "pages still held by requests at the end");
out:
    kvs_llm_destroy(e);
    return NULL;
}

static void rank_open(run_t *run, rank_t *k, int decode, uint32_t rank, kvs_inproc_net_t *net,
                      const kvs_clock_t *clock)
{
    const setup_t *s = run->s;
    const uint32_t tp = decode ? 1 : s->prefill_tp;
    memset(k, 0, sizeof(*k));
    k->run = run;
    k->decode = decode;
    k->rank = rank;
    k->model = model_on(decode ? s->decode_device : s->prefill_device, (kvs_tp_t){tp, rank});
    k->pool = pool_for(k->model, s, s->pages[decode]);
    k->link = locked_link(net, decode ? KVS_SIDE_DECODE : KVS_SIDE_PREFILL, rank);
    k->hook = (hook_ctx_t){.snaps = &run->snaps, .decode = decode, .rank = rank, .tp = tp};
    kvs_pd_geometry_t geo = {.shape = kvs_model_kv_shape(k->model),
                             .prefill_tp = s->prefill_tp,
                             .decode_tp = 1,
                             .page_size = s->page_size,
                             .chunk_tokens = CHUNK};
    kvs_pd_timeouts_t to;
    kvs_pd_timeouts_default(&to);
    to.retry_ns = 20000000;
    if (s->bootstrap_ns) to.bootstrap_timeout_ns = s->bootstrap_ns;
    if (decode) {
        kvs_receiver_config_t rc = {.geo = geo, .rank = 0, .timeouts = to, .ring_bytes = 4 << 20};
        assert_int_equal(kvs_receiver_create(&rc, k->pool, k->link, clock, &k->rx), KVS_OK);
    } else {
        kvs_sender_config_t sc = {
            .geo = geo, .rank = rank, .timeouts = to, .window_chunks = 2, .staging_buffers = 2};
        assert_int_equal(kvs_sender_create(&sc, k->pool, k->link, clock, &k->tx), KVS_OK);
    }
}

static void rank_close(rank_t *k)
{
    kvs_sender_destroy(k->tx);
    kvs_receiver_destroy(k->rx);
    kvs_link_destroy(k->link);
    kvs_tpgroup_leave(k->group);
    assert_int_equal(kvs_pool_free_pages(k->pool), kvs_pool_total_pages(k->pool));
    kvs_pool_destroy(k->pool);
    kvs_model_destroy(k->model);
}

/* Runs every prompt through prefill and decode and checks what reached decode's pool; *out_p
 * (optional) receives decode's outcome. */
static void disaggregated(const setup_t *s, outcome_t *out_p)
{
    print_message("  prefill %s TP%u -> decode %s, page %u %s, radix %d/%d, %s\n",
                  s->prefill_device < 0 ? "CPU" : "GPU", s->prefill_tp,
                  s->decode_device < 0 ? "CPU" : "GPU", s->page_size,
                  s->layout == KVS_POOL_NHD ? "NHD" : "HND", s->prefill_radix, s->decode_radix,
                  s->concurrent ? "all at once" : "one at a time");
    if (s->pages[0])
        print_message("    pools %u/%u pages, slots %u/%u, pace %u\n", s->pages[0], s->pages[1],
                      s->slots[0], s->slots[1], s->pace);
    static run_t run;
    memset(&run, 0, sizeof(run));
    run.s = s;
    pthread_mutex_init(&run.snaps.mu, NULL);
    run.released = s->concurrent ? NPROMPTS : 1;
    kvs_clock_t clock = kvs_clock_monotonic();
    kvs_inproc_net_t *net;
    assert_int_equal(kvs_inproc_net_create(s->prefill_tp, 1, NULL, &clock, &net), KVS_OK);
    for (uint32_t r = 0; r < s->prefill_tp; r++)
        rank_open(&run, &run.prefill[r], 0, r, net, &clock);
    rank_open(&run, &run.decode, 1, 0, net, &clock);
    pthread_t th[MAX_PTP + 1];
    for (uint32_t r = 0; r < s->prefill_tp; r++)
        assert_int_equal(pthread_create(&th[r], NULL, rank_main, &run.prefill[r]), 0);
    assert_int_equal(pthread_create(&th[s->prefill_tp], NULL, rank_main, &run.decode), 0);
    for (uint32_t r = 0; r <= s->prefill_tp; r++) pthread_join(th[r], NULL);
    for (uint32_t r = 0; r < s->prefill_tp; r++)
        if (run.prefill[r].failed) fail_msg("prefill rank %u: %s", r, run.prefill[r].failed);
    if (run.decode.failed) fail_msg("decode: %s", run.decode.failed);

    for (int p = 0; p < NPROMPTS; p++) {
        expect_ok(&run.o, p, MAX_NEW, KVS_LLM_FINISH_LENGTH);
        expect_ok(&run.po, p, 1, KVS_LLM_FINISH_HANDOFF);
        assert_int_equal(run.po.tokens[p][0], run.o.tokens[p][0]);
    }
    /* One at a time, prompts 1 and 2 find the shared prefix's whole pages in each cache. */
    for (int p = 1; p < 3 && !s->concurrent; p++) {
        const uint32_t hit = SHARED / s->page_size * s->page_size;
        assert_int_equal(run.po.last[p].cached_tokens, s->prefill_radix ? hit : 0);
        assert_int_equal(run.o.last[p].cached_tokens, s->decode_radix ? hit : 0);
    }
    expect_same_kv(&run.snaps, s->prefill_tp);
    kvs_pd_metrics_t pm;
    for (uint32_t r = 0; r < s->prefill_tp; r++) {
        kvs_sender_metrics(run.prefill[r].tx, &pm);
        assert_int_equal(pm.rooms_succeeded, NPROMPTS);
    }
    kvs_receiver_metrics(run.decode.rx, &pm);
    assert_int_equal(pm.rooms_succeeded, NPROMPTS);
    assert_int_equal(pm.checksum_failures, 0);
    if (out_p) *out_p = run.o;
    for (uint32_t r = 0; r < s->prefill_tp; r++) rank_close(&run.prefill[r]);
    rank_close(&run.decode);
    kvs_inproc_net_destroy(net);
    snaps_free(&run.snaps);
}

/* Disaggregated on one device: the KV byte for byte, and (where exact) the colocated TP1
 * tokens. */
static void same_device(int device, uint32_t prefill_tp, uint32_t page_size,
                        kvs_pool_layout_t layout, int radix, int concurrent)
{
    setup_t s = {.prefill_device = device,
                 .decode_device = device,
                 .prefill_tp = prefill_tp,
                 .page_size = page_size,
                 .layout = layout,
                 .prefill_radix = radix,
                 .decode_radix = radix,
                 .concurrent = concurrent};
    static outcome_t colo, o;
    disaggregated(&s, &o);
    /* On the GPU, batched passes round differently from one sequence's, and TP2's sums from
     * TP1's: exact only one at a time from TP1 (the same passes colocated and disaggregated).
     * The CPU's results depend on neither. */
    if (device >= 0 && (concurrent || prefill_tp > 1)) return;
    colocated(&s, device, radix, &colo);
    for (int p = 0; p < NPROMPTS; p++)
        for (int t = 0; t < MAX_NEW; t++)
            if (o.tokens[p][t] != colo.tokens[p][t])
                fail_msg("room %d token %d: %u disaggregated, %u colocated", p + 1, t,
                         o.tokens[p][t], colo.tokens[p][t]);
}

/* ---- the tests ---- */

/* The harness itself on CPU models with bf16 K/V, where it runs everywhere: TP1 and TP2
 * prefill, both page sizes, and the colocated tokens every time. */
static void test_cpu_bf16(void **state)
{
    (void) state;
    same_device(-1, 1, 16, KVS_POOL_NHD, 1, 0);
    same_device(-1, 1, 1, KVS_POOL_HND, 0, 1);
    same_device(-1, 2, 16, KVS_POOL_HND, 1, 1);
    kvs_assert_no_leaks();
}

/* Admission under random pressure with prefill TP2, on CPU models (so everywhere): the four
 * rooms into a prefill pool from the largest prompt's pages to three times that and a decode pool
 * from one request's to four times, 1-3 compute slots a side, radix caches on or off, either pool
 * layout, each side fed in its own random order at its own random pace. The two prefill ranks
 * must take the same admission decisions whatever comes (else their lockstep breaks), and every
 * room must succeed with the colocated tokens, decode's KV byte for byte the prefill ranks',
 * well before the bootstrap timeout (10 s), where two sides holding each other's pages or slots
 * would fail rooms. */
static void test_cpu_tp2_random_admission(void **state)
{
    (void) state;
    uint32_t longest = 0;
    for (int p = 0; p < NPROMPTS; p++) longest = LEN[p] > longest ? LEN[p] : longest;
    const setup_t base = {.prefill_device = -1,
                          .decode_device = -1,
                          .prefill_tp = 2,
                          .page_size = 16,
                          .layout = KVS_POOL_NHD,
                          .concurrent = 1,
                          .max_context = longest + MAX_NEW,
                          .bootstrap_ns = 10000000000ull};
    static outcome_t colo, o;
    colocated(&base, -1, 0, &colo);
    const uint32_t page = base.page_size;
    const uint32_t largest = (base.max_context - 1 + page - 1) / page;
    const uint32_t whole = (base.max_context + page - 1) / page;
    kvs_rng_t rng;
    kvs_rng_seed(&rng, kvs_test_seed(9));
    const uint64_t iters = kvs_test_iters(16);
    for (uint64_t i = 0; i < iters; i++) {
        setup_t s = base;
        s.pages[0] = (uint32_t) kvs_rng_range(&rng, largest, 3 * largest);
        s.pages[1] = (uint32_t) kvs_rng_range(&rng, whole, 4 * whole);
        s.slots[0] = (uint32_t) kvs_rng_range(&rng, 1, 3);
        s.slots[1] = (uint32_t) kvs_rng_range(&rng, 1, 3);
        s.prefill_radix = (int) kvs_rng_below(&rng, 2);
        s.decode_radix = (int) kvs_rng_below(&rng, 2);
        s.layout = kvs_rng_below(&rng, 2) ? KVS_POOL_HND : KVS_POOL_NHD;
        int order[2][NPROMPTS];
        for (int side = 0; side < 2; side++) {
            kvs_test_shuffle(&rng, order[side], NPROMPTS);
            s.order[side] = order[side];
        }
        s.pace = (uint32_t) kvs_rng_range(&rng, 1, 4);
        s.seed = kvs_rng_next(&rng);
        disaggregated(&s, &o);
        for (int p = 0; p < NPROMPTS; p++)
            assert_memory_equal(o.tokens[p], colo.tokens[p], MAX_NEW * sizeof(uint32_t));
    }
    kvs_assert_no_leaks();
}

static void test_gpu_page16(void **state)
{
    (void) state;
    require_gpu();
    same_device(0, 1, 16, KVS_POOL_NHD, 0, 0);
    same_device(0, 1, 16, KVS_POOL_NHD, 1, 0);
    same_device(0, 1, 16, KVS_POOL_HND, 1, 1);
    kvs_assert_no_leaks();
}

static void test_gpu_page1(void **state)
{
    (void) state;
    require_gpu();
    same_device(0, 1, 1, KVS_POOL_HND, 1, 0);
    same_device(0, 1, 1, KVS_POOL_NHD, 0, 1);
    kvs_assert_no_leaks();
}

/* Prefill TP2, both ranks on GPU 0 (threads in a TP group), to decode TP1: each decode head
 * equals the prefill rank's that holds it. (No colocated run computes these tokens on the GPU:
 * TP2's sums round differently from TP1's.) */
static void test_gpu_prefill_tp2(void **state)
{
    (void) state;
    require_gpu();
    same_device(0, 2, 16, KVS_POOL_NHD, 0, 1);
    same_device(0, 2, 16, KVS_POOL_NHD, 1, 0);
    kvs_assert_no_leaks();
}

/* A CPU prefill (bf16 K/V, host pool) feeding a GPU decode, and a GPU prefill feeding a CPU
 * decode: the host and device pools meet over the same link, byte for byte. */
static void test_gpu_mixed_pairs(void **state)
{
    (void) state;
    require_gpu();
    setup_t s = {.prefill_device = -1,
                 .prefill_tp = 1,
                 .page_size = 16,
                 .layout = KVS_POOL_NHD,
                 .prefill_radix = 1,
                 .decode_radix = 1};
    disaggregated(&s, NULL);
    s.prefill_device = 0;
    s.decode_device = -1;
    disaggregated(&s, NULL);
    s.prefill_device = -1;
    s.prefill_tp = 2;
    s.decode_device = 0;
    s.concurrent = 1;
    disaggregated(&s, NULL);
    kvs_assert_no_leaks();
}

/* argv[1], when given: run only the tests matching it (a cmocka filter). */
int main(int argc, char **argv)
{
    if (argc > 1) cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_bf16),        cmocka_unit_test(test_cpu_tp2_random_admission),
        cmocka_unit_test(test_gpu_page16),      cmocka_unit_test(test_gpu_page1),
        cmocka_unit_test(test_gpu_prefill_tp2), cmocka_unit_test(test_gpu_mixed_pairs),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
