/* The fake backend: a thread that "generates" for every live request in steps (token k of
 * choice c echoes prompt[(k + c) % prompt_len]), with delays, failure injection, a prefix cache of
 * finished prompts and a record of every room it saw, for tests and smoke runs without a model. */
#include "http/fake_backend.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"

#define FAKE_RECORDS 4096
#define FAKE_CACHE   64

typedef struct {
    uint64_t room;
    kvs_server_role_t role;
    uint32_t *prompt; /* [prompt_len] */
    uint32_t prompt_len, max_tokens;
    uint32_t *stop_ids; /* [n_stop_ids] */
    uint32_t n_stop_ids;
    kvs_server_sink_t sink;
    uint32_t generated, cached; /* generated: all choices */
    uint32_t n;                 /* choices */
    uint32_t gen[KVS_SERVER_CHOICES_MAX];
    int ended[KVS_SERVER_CHOICES_MAX], stop[KVS_SERVER_CHOICES_MAX];
    kvs_server_finish_t fin[KVS_SERVER_CHOICES_MAX];
    uint32_t n_ended;
    int cancelled;
    int logprobs, prompt_logprobs, prompt_sent;
    uint32_t top_logprobs;
    uint64_t submit_ns, ready_ns, first_ns;
    size_t record; /* index into records, valid while records[record].room == room */
} fake_req_t;

/* What one step decided for one request, delivered after the lock is dropped. */
typedef struct {
    fake_req_t *req;
    int has_token;
    uint32_t choice, token, index;
    int has_done;
    kvs_server_done_t done;
} fake_event_t;

struct kvs_server_fake {
    kvs_server_fake_config_t config;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int stop;
    fake_req_t **live; /* [n_live] */
    uint32_t n_live, cap_live;
    int healthy;
    uint32_t fail_at;
    kvs_server_fake_counts_t counts;
    uint64_t kv_bytes, chunks;
    uint32_t pages_total, pages_free;  /* reported as they were set */
    kvs_server_fake_record_t *records; /* [FAKE_RECORDS], ring */
    uint64_t n_records;                /* ever written */
    uint32_t *cache[FAKE_CACHE];       /* finished prompts, FIFO replacement */
    uint32_t cache_len[FAKE_CACHE];
    uint32_t n_cache, cache_next;
};

static void req_free(fake_req_t *r)
{
    if (r == NULL) return;
    kvs_free(r->prompt);
    kvs_free(r->stop_ids);
    kvs_free(r);
}

static kvs_server_fake_record_t *record_of(kvs_server_fake_t *f, const fake_req_t *r)
{
    kvs_server_fake_record_t *rec = &f->records[r->record];
    return rec->room == r->room ? rec : NULL;
}

static uint32_t cache_match(const kvs_server_fake_t *f, const uint32_t *prompt, uint32_t len)
{
    uint32_t best = 0;
    for (uint32_t c = 0; c < f->n_cache; c++) {
        uint32_t n = f->cache_len[c] < len ? f->cache_len[c] : len, i = 0;
        while (i < n && f->cache[c][i] == prompt[i]) i++;
        if (i > best) best = i;
    }
    return best;
}

static void cache_insert(kvs_server_fake_t *f, const fake_req_t *r)
{
    uint32_t *copy = kvs_malloc(r->prompt_len * sizeof(uint32_t));
    if (copy == NULL) return; /* the cache is an optimisation: skipping it is fine */
    memcpy(copy, r->prompt, r->prompt_len * sizeof(uint32_t));
    uint32_t slot;
    if (f->n_cache < FAKE_CACHE) {
        slot = f->n_cache++;
    } else {
        slot = f->cache_next;
        kvs_free(f->cache[slot]);
        f->cache_next = (slot + 1) % FAKE_CACHE;
    }
    f->cache[slot] = copy;
    f->cache_len[slot] = r->prompt_len;
}

/* Fills the end of a request; the caller removes it from the live list. */
static void finish(kvs_server_fake_t *f, fake_req_t *r, kvs_server_finish_t how,
                   kvs_status_t status, fake_event_t *ev)
{
    ev->has_done = 1;
    kvs_server_done_t *d = &ev->done;
    memset(d, 0, sizeof(*d));
    d->finish = how;
    for (uint32_t c = 0; c < KVS_SERVER_CHOICES_MAX; c++)
        d->choice_finish[c] = c < r->n && r->ended[c] ? r->fin[c] : how;
    d->status = status;
    d->prompt_tokens = r->prompt_len;
    d->cached_tokens = r->cached;
    d->generated = r->generated;
    d->ttft_ns = r->first_ns ? r->first_ns - r->submit_ns : 0;
    if (r->role != KVS_SERVER_ROLE_NONE && how != KVS_SERVER_FINISH_ERROR) {
        d->kv_bytes = (uint64_t) (r->prompt_len - r->cached) * f->config.kv_bytes_per_token;
        d->transfer_ns = (uint64_t) r->prompt_len * 1000u;
        f->kv_bytes += d->kv_bytes;
        f->chunks += (r->prompt_len - r->cached + 15) / 16;
    }
    if (how == KVS_SERVER_FINISH_ERROR)
        f->counts.failed++;
    else
        f->counts.completed++;
    if (how != KVS_SERVER_FINISH_ERROR) cache_insert(f, r);
    kvs_server_fake_record_t *rec = record_of(f, r);
    if (rec) {
        rec->done = 1;
        rec->finish = how;
        rec->generated = r->generated;
    }
}

static int is_stop(const fake_req_t *r, uint32_t token)
{
    for (uint32_t i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == token) return 1;
    return 0;
}

static void end_choice(fake_req_t *r, uint32_t c, kvs_server_finish_t how)
{
    r->ended[c] = 1;
    r->fin[c] = how;
    r->n_ended++;
}

/* One step over every live request, under the lock: each choice still going gives a token (or
 * ends: stopped, failed). Returns the events (n_p of them) in an array the caller frees, and
 * the earliest time a waiting request becomes ready. */
static fake_event_t *step(kvs_server_fake_t *f, uint64_t now, uint32_t *n_p, uint64_t *wake_p)
{
    *n_p = 0;
    *wake_p = UINT64_MAX;
    size_t per = KVS_SERVER_CHOICES_MAX + 1;
    fake_event_t *evs = kvs_calloc(f->n_live ? f->n_live * per : 1, sizeof(*evs));
    if (evs == NULL) return NULL; /* retried at the next step */
    uint32_t n = 0, keep = 0;
    for (uint32_t i = 0; i < f->n_live; i++) {
        fake_req_t *r = f->live[i];
        if (r->cancelled) {
            evs[n].req = r;
            finish(f, r, KVS_SERVER_FINISH_STOP, KVS_OK, &evs[n++]);
            continue;
        }
        if (now < r->ready_ns) {
            if (r->ready_ns < *wake_p) *wake_p = r->ready_ns;
            f->live[keep++] = r;
            continue;
        }
        int failed = 0;
        for (uint32_t c = 0; c < r->n && !failed; c++) {
            if (r->ended[c]) continue;
            if (r->stop[c]) {
                end_choice(r, c, KVS_SERVER_FINISH_STOP);
                continue;
            }
            if (f->fail_at != 0 && r->gen[c] + 1 == f->fail_at) {
                failed = 1;
                continue;
            }
            uint32_t tok = r->prompt[(r->gen[c] + c) % r->prompt_len];
            r->gen[c]++;
            r->generated++;
            if (r->first_ns == 0) r->first_ns = now;
            fake_event_t *ev = &evs[n++];
            ev->req = r;
            ev->has_token = 1;
            ev->choice = c;
            ev->token = tok;
            ev->index = r->gen[c] - 1;
            if (r->role == KVS_SERVER_ROLE_PREFILL)
                end_choice(r, c, KVS_SERVER_FINISH_HANDOFF);
            else if (is_stop(r, tok))
                end_choice(r, c, KVS_SERVER_FINISH_STOP);
            else if (r->gen[c] >= r->max_tokens)
                end_choice(r, c, KVS_SERVER_FINISH_LENGTH);
        }
        if (failed || r->n_ended == r->n) {
            evs[n].req = r;
            if (failed)
                finish(f, r, KVS_SERVER_FINISH_ERROR,
                       f->config.fail_status != KVS_OK ? f->config.fail_status : KVS_ERR_IO,
                       &evs[n++]);
            else
                finish(f, r, r->fin[0], KVS_OK, &evs[n++]);
        } else {
            f->live[keep++] = r;
        }
    }
    f->n_live = keep;
    *n_p = n;
    return evs;
}

void kvs_server_fake_logprobs(uint32_t token, uint32_t index, int prompt, uint32_t n_top,
                              kvs_logprobs_t *lp_p)
{
    memset(lp_p, 0, sizeof(*lp_p));
    lp_p->logprob = prompt ? -0.125f * (float) (index % 9) - 0.5f : -0.25f * (float) (index % 7);
    lp_p->n_top = n_top;
    for (uint32_t i = 0; i < n_top; i++)
        lp_p->top[i] = (kvs_token_logprob_t){.token = (token + i) % 256,
                                             .logprob = lp_p->logprob - 0.5f * (float) i};
}

static void deliver(fake_event_t *evs, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        fake_req_t *r = evs[i].req;
        kvs_logprobs_t lp;
        if (evs[i].has_token && r->prompt_logprobs && !r->prompt_sent && r->sink.on_prompt) {
            r->prompt_sent = 1;
            for (uint32_t k = 1; k < r->prompt_len; k++) {
                kvs_server_fake_logprobs(r->prompt[k], k, 1, r->top_logprobs, &lp);
                r->sink.on_prompt(r->sink.arg, k, r->prompt[k], &lp);
            }
        }
        if (evs[i].has_token && r->logprobs)
            kvs_server_fake_logprobs(evs[i].token, evs[i].index, 0, r->top_logprobs, &lp);
        if (evs[i].has_token)
            r->sink.on_token(r->sink.arg, evs[i].choice, evs[i].token, NULL, 0,
                             r->logprobs ? &lp : NULL);
        if (evs[i].has_done) {
            r->sink.on_done(r->sink.arg, &evs[i].done);
            req_free(r);
        }
    }
}

static void wait_until(kvs_server_fake_t *f, uint64_t deadline_ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t now = kvs_now_ns();
    uint64_t wait = deadline_ns > now ? deadline_ns - now : 0;
    uint64_t ns = (uint64_t) ts.tv_nsec + wait % 1000000000u;
    ts.tv_sec += (time_t) (wait / 1000000000u + ns / 1000000000u);
    ts.tv_nsec = (long) (ns % 1000000000u);
    pthread_cond_timedwait(&f->cv, &f->mu, &ts);
}

static void *fake_thread(void *arg)
{
    kvs_server_fake_t *f = arg;
    uint64_t next_step = 0;
    pthread_mutex_lock(&f->mu);
    while (!f->stop) {
        if (f->n_live == 0) {
            pthread_cond_wait(&f->cv, &f->mu);
            continue;
        }
        uint64_t now = kvs_now_ns();
        if (now < next_step) {
            wait_until(f, next_step);
            continue;
        }
        uint32_t n;
        uint64_t wake;
        fake_event_t *evs = step(f, now, &n, &wake);
        next_step = now + f->config.token_delay_ns;
        pthread_mutex_unlock(&f->mu);
        if (evs) deliver(evs, n);
        kvs_free(evs);
        pthread_mutex_lock(&f->mu);
        /* Nothing happened: every live request waits for its first-token delay. */
        if (evs && n == 0 && wake != UINT64_MAX && !f->stop) wait_until(f, wake);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

static kvs_status_t fake_submit(void *ctx, const kvs_server_request_t *q,
                                const kvs_server_sink_t *sink)
{
    kvs_server_fake_t *f = ctx;
    if (q->prompt_len == 0 || q->max_tokens == 0 || sink == NULL || q->n == 0 ||
        q->n > KVS_SERVER_CHOICES_MAX) {
        kvs_error("fake backend: room %llu: empty prompt, max_tokens 0 or n outside 1..%u",
                  (unsigned long long) q->room, KVS_SERVER_CHOICES_MAX);
        return KVS_ERR_INVALID;
    }
    fake_req_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) return KVS_ERR_NOMEM;
    r->prompt = kvs_malloc(q->prompt_len * sizeof(uint32_t));
    r->stop_ids = kvs_malloc((q->n_stop_ids ? q->n_stop_ids : 1) * sizeof(uint32_t));
    if (r->prompt == NULL || r->stop_ids == NULL) {
        req_free(r);
        return KVS_ERR_NOMEM;
    }
    memcpy(r->prompt, q->prompt, q->prompt_len * sizeof(uint32_t));
    r->logprobs = q->logprobs;
    r->top_logprobs = q->top_logprobs;
    r->prompt_logprobs = q->logprobs && q->prompt_logprobs && q->role != KVS_SERVER_ROLE_DECODE;
    if (q->n_stop_ids) memcpy(r->stop_ids, q->stop_ids, q->n_stop_ids * sizeof(uint32_t));
    r->n_stop_ids = q->n_stop_ids;
    r->room = q->room;
    r->role = q->role;
    r->prompt_len = q->prompt_len;
    r->max_tokens = q->max_tokens;
    r->n = q->n;
    r->sink = *sink;
    r->submit_ns = kvs_now_ns();
    r->ready_ns = r->submit_ns + f->config.first_delay_ns;

    pthread_mutex_lock(&f->mu);
    kvs_status_t st = KVS_OK;
    for (uint32_t i = 0; i < f->n_live; i++) {
        if (f->live[i]->room == q->room) {
            kvs_warn("fake backend: room %llu is already live", (unsigned long long) q->room);
            st = KVS_ERR_INVALID;
        }
    }
    if (st == KVS_OK && (f->stop || f->n_live >= f->config.max_live)) {
        kvs_warn("fake backend: room %llu refused: %u requests live", (unsigned long long) q->room,
                 f->n_live);
        st = KVS_ERR_NOSPACE;
    }
    if (st == KVS_OK && f->n_live == f->cap_live) {
        uint32_t cap = f->cap_live ? 2 * f->cap_live : 16;
        fake_req_t **live = kvs_realloc(f->live, cap * sizeof(*live));
        if (live == NULL)
            st = KVS_ERR_NOMEM;
        else {
            f->live = live;
            f->cap_live = cap;
        }
    }
    if (st != KVS_OK) {
        pthread_mutex_unlock(&f->mu);
        req_free(r);
        return st;
    }
    r->cached = cache_match(f, r->prompt, r->prompt_len);
    r->record = (size_t) (f->n_records++ % FAKE_RECORDS);
    kvs_server_fake_record_t *rec = &f->records[r->record];
    memset(rec, 0, sizeof(*rec));
    rec->room = r->room;
    rec->role = r->role;
    rec->prompt_len = r->prompt_len;
    rec->max_tokens = r->max_tokens;
    rec->sampling = q->sampling;
    rec->sampling.bias = NULL; /* borrowed for submit only */
    rec->seed = q->seed;
    rec->logprobs = q->logprobs;
    rec->top_logprobs = q->top_logprobs;
    rec->prompt_logprobs = q->prompt_logprobs;
    rec->n_stop_ids = q->n_stop_ids;
    rec->n = q->n;
    if (q->bootstrap) snprintf(rec->bootstrap, sizeof(rec->bootstrap), "%s", q->bootstrap);
    f->live[f->n_live++] = r;
    f->counts.submitted++;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return KVS_OK;
}

static kvs_status_t fake_cancel(void *ctx, uint64_t room, uint32_t choice)
{
    kvs_server_fake_t *f = ctx;
    kvs_status_t st = KVS_ERR_NOT_FOUND;
    pthread_mutex_lock(&f->mu);
    for (uint32_t i = 0; i < f->n_live; i++) {
        fake_req_t *r = f->live[i];
        if (r->room != room || r->cancelled) continue;
        if (choice != KVS_SERVER_CHOICE_ALL && r->n > 1) { /* one choice: the others go on */
            if (choice < r->n) r->stop[choice] = 1;
            st = choice < r->n ? KVS_OK : st;
            continue;
        }
        r->cancelled = 1;
        f->counts.cancelled++;
        kvs_server_fake_record_t *rec = record_of(f, r);
        if (rec) rec->cancelled = 1;
        st = KVS_OK;
        pthread_cond_signal(&f->cv);
    }
    pthread_mutex_unlock(&f->mu);
    if (st != KVS_OK)
        kvs_debug("fake backend: cancel: room %llu is not live", (unsigned long long) room);
    return st;
}

static kvs_status_t fake_health(void *ctx)
{
    kvs_server_fake_t *f = ctx;
    int ok = __atomic_load_n(&f->healthy, __ATOMIC_RELAXED);
    return ok ? KVS_OK : KVS_ERR_STATE;
}

/* What a real backend says of its failure (its ranks' end): here the injected one. */
static void fake_health_detail(void *ctx, char *buf, size_t cap)
{
    kvs_server_fake_t *f = ctx;
    pthread_mutex_lock(&f->mu);
    uint32_t at = f->fail_at;
    pthread_mutex_unlock(&f->mu);
    if (at != 0)
        snprintf(buf, cap, "the fake fails every request at token %u", at);
    else
        buf[0] = '\0';
}

static kvs_status_t fake_match(void *ctx, const uint32_t *prompt, uint32_t len, uint32_t *cached_p)
{
    kvs_server_fake_t *f = ctx;
    pthread_mutex_lock(&f->mu);
    *cached_p = cache_match(f, prompt, len);
    pthread_mutex_unlock(&f->mu);
    return KVS_OK;
}

static void fake_stats(void *ctx, kvs_server_backend_stats_t *s)
{
    kvs_server_fake_t *f = ctx;
    memset(s, 0, sizeof(*s));
    pthread_mutex_lock(&f->mu);
    s->metrics.bytes = f->kv_bytes;
    s->metrics.chunks = f->chunks;
    s->metrics.ring_capacity = f->config.ring_capacity;
    uint64_t used = (uint64_t) f->n_live * 4096u;
    s->metrics.ring_used = used < s->metrics.ring_capacity ? used : s->metrics.ring_capacity;
    s->pages_total = f->pages_total;
    s->pages_free = f->pages_free;
    for (uint32_t i = 0; i < f->n_live; i++) {
        if (f->live[i]->generated == 0)
            s->queued++;
        else
            s->running++;
    }
    pthread_mutex_unlock(&f->mu);
}

kvs_status_t kvs_server_fake_create(const kvs_server_fake_config_t *config,
                                    kvs_server_fake_t **fake_p)
{
    kvs_server_fake_t *f = kvs_calloc(1, sizeof(*f));
    if (f == NULL) return KVS_ERR_NOMEM;
    if (config) f->config = *config;
    if (f->config.kv_bytes_per_token == 0) f->config.kv_bytes_per_token = 1024;
    if (f->config.ring_capacity == 0) f->config.ring_capacity = 1u << 20;
    if (f->config.max_live == 0) f->config.max_live = 1024;
    f->healthy = 1;
    f->fail_at = f->config.fail_at;
    f->records = kvs_calloc(FAKE_RECORDS, sizeof(*f->records));
    if (f->records == NULL) {
        kvs_free(f);
        return KVS_ERR_NOMEM;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&f->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&f->mu, NULL);
    if (pthread_create(&f->thread, NULL, fake_thread, f) != 0) {
        kvs_error("fake backend: cannot start its thread");
        pthread_cond_destroy(&f->cv);
        pthread_mutex_destroy(&f->mu);
        kvs_free(f->records);
        kvs_free(f);
        return KVS_ERR_IO;
    }
    *fake_p = f;
    return KVS_OK;
}

void kvs_server_fake_destroy(kvs_server_fake_t *f)
{
    if (f == NULL) return;
    pthread_mutex_lock(&f->mu);
    f->stop = 1;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
    /* Whoever still waits on a request hears that it ended. */
    for (uint32_t i = 0; i < f->n_live; i++) {
        fake_req_t *r = f->live[i];
        kvs_server_done_t d;
        memset(&d, 0, sizeof(d));
        d.finish = KVS_SERVER_FINISH_ERROR;
        d.status = KVS_ERR_ABORTED;
        d.prompt_tokens = r->prompt_len;
        d.generated = r->generated;
        r->sink.on_done(r->sink.arg, &d);
        req_free(r);
    }
    kvs_free(f->live);
    for (uint32_t c = 0; c < f->n_cache; c++) kvs_free(f->cache[c]);
    kvs_free(f->records);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    kvs_free(f);
}

kvs_server_backend_t kvs_server_fake_backend(kvs_server_fake_t *fake)
{
    kvs_server_backend_t b;
    memset(&b, 0, sizeof(b));
    b.ctx = fake;
    b.submit = fake_submit;
    b.cancel = fake_cancel;
    b.health = fake_health;
    b.health_detail = fake_health_detail;
    b.match = fake_match;
    b.stats = fake_stats;
    return b;
}

void kvs_server_fake_set_healthy(kvs_server_fake_t *fake, int healthy)
{
    __atomic_store_n(&fake->healthy, healthy ? 1 : 0, __ATOMIC_RELAXED);
}

void kvs_server_fake_set_pages(kvs_server_fake_t *fake, uint32_t total, uint32_t free_pages)
{
    pthread_mutex_lock(&fake->mu);
    fake->pages_total = total;
    fake->pages_free = free_pages;
    pthread_mutex_unlock(&fake->mu);
}

void kvs_server_fake_set_fail_at(kvs_server_fake_t *fake, uint32_t fail_at)
{
    pthread_mutex_lock(&fake->mu);
    fake->fail_at = fail_at;
    pthread_mutex_unlock(&fake->mu);
}

void kvs_server_fake_counts(kvs_server_fake_t *fake, kvs_server_fake_counts_t *counts_p)
{
    pthread_mutex_lock(&fake->mu);
    kvs_server_fake_counts_t c = fake->counts;
    c.live = fake->n_live;
    pthread_mutex_unlock(&fake->mu);
    *counts_p = c;
}

kvs_status_t kvs_server_fake_record(kvs_server_fake_t *fake, uint64_t room,
                                    kvs_server_fake_record_t *record_p)
{
    kvs_status_t st = KVS_ERR_NOT_FOUND;
    pthread_mutex_lock(&fake->mu);
    uint64_t n = fake->n_records < FAKE_RECORDS ? fake->n_records : FAKE_RECORDS;
    for (uint64_t i = 0; i < n; i++) {
        if (fake->records[i].room == room) {
            *record_p = fake->records[i];
            st = KVS_OK;
        }
    }
    pthread_mutex_unlock(&fake->mu);
    return st;
}
