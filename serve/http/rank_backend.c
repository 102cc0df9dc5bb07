/* The server backend over rank 0 of a real-model instance (kvstage/rank_backend.h).
 *
 * One I/O thread owns both pipes: it writes what submit(), cancel(), match() and stats()
 * queued (the request pipe is non-blocking and flushed as rank 0 reads it) and reads rank 0's
 * event lines. Nobody else touches the fds, so a caller never blocks on a rank 0 that is busy in
 * a forward pass, and the thread cannot deadlock writing to a rank 0 that is itself blocked
 * writing events nobody reads. SIGPIPE is blocked in the thread: a rank 0 that died shows up as
 * EPIPE and then as the end of its events.
 *
 * Rooms live in a map under mu from submit until their done (or refusal) line; the sink is only
 * called by the I/O thread, outside mu, so calls for one room never overlap. Match and stats
 * questions wait in a FIFO that rank 0's answers pop in order (llm_rank.h: one answer each, in
 * order); a question whose asker gave up stays in the FIFO, marked abandoned, until its answer
 * comes. */
#include "http/rank_backend.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/map.h"
#include "engine/rank_line.h"
#include "pd/plumbing.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "http/server_internal.h"

#define MAX_EVENT_LINE (1u << 20)    /* rank 0's lines are short; anything longer is garbage */
#define PEER_TTL_NS    2000000000ull /* a looked-up prefill instance is reused this long */
#define PEER_WAIT_NS   2000000000ull /* a lookup waits this long for the registry */
#define PEER_CACHE     32

/* Per-room bootstrap: a prefill instance looked up and found compatible. */
typedef struct {
    char registry[KVS_MSG_ENDPOINT_MAX + 1];
    char *desc; /* the peer description rank 0 gets with each room */
    uint64_t at_ns;
} peer_t;

typedef char choices_agree[KVS_SERVER_CHOICES_MAX == KVS_LLM_CHOICES_MAX ? 1 : -1];

typedef struct {
    uint32_t generated; /* tokens reported to the sink */
    int closed;         /* a stop id was reported: later tokens are dropped */
    int stop_sent;
    int done; /* rank 0's done line came */
} choice_t;

typedef struct {
    uint64_t room;
    kvs_server_sink_t sink;
    kvs_server_role_t role;
    uint64_t submit_ns;
    uint32_t prompt_len;
    uint32_t n; /* choices */
    choice_t ch[KVS_SERVER_CHOICES_MAX];
    uint32_t n_done;
    int all_stop_sent;     /* `stop ROOM` (every choice) queued */
    kvs_server_done_t acc; /* the done lines so far, gathered */
    uint32_t *stop_ids;    /* [n_stop_ids] the request's stop ids after the first (rank 0's EOS) */
    uint32_t n_stop_ids;
} room_t;

typedef enum { Q_MATCH = 0, Q_STATS = 1 } qkind_t;

typedef struct query {
    struct query *next;
    qkind_t kind;
    int answered, failed, abandoned;
    uint32_t cached;
    kvs_server_backend_stats_t stats;
} query_t;

struct kvs_rank_backend {
    kvs_rank_backend_config_t cfg;
    char *bootstrap;
    int in_fd, out_fd;
    int wake[2]; /* self-pipe: [0] polled by the I/O thread */
    pthread_t thread;
    int thread_started;

    pthread_mutex_t mu;
    pthread_cond_t cv; /* ready, ended, or a query answered */
    kvs_map_t rooms;   /* room id -> room_t */
    kvs__sb_t out;     /* bytes for rank 0 not yet written */
    int quit_queued;   /* close the request pipe once out is flushed */
    int stopping;      /* destroy: the thread ends */
    int ready, ended;  /* rank 0 said ready; its events ended */
    query_t *qhead, *qtail;
    kvs_server_backend_stats_t last; /* the last stats answer */
    kvs_pd_metrics_t base;           /* the counters of the instances before this one (restart) */
    uint64_t base_preemptions;       /* likewise */
    uint32_t restarts;
    char restart_why[128];                     /* why the last instance ended (restart) */
    uint32_t peers_down, peers_of, first_down; /* rank 0's last peers event */
    peer_t peers[PEER_CACHE];                  /* per-room bootstrap, under mu */
};

/* ---- helpers ---- */

static void wake_thread(kvs_rank_backend_t *b)
{
    char c = 1;
    ssize_t w;
    do {
        w = write(b->wake[1], &c, 1);
    } while (w < 0 && errno == EINTR);
    /* EAGAIN: a wake is already pending, which is all that is needed. */
}

/* Queues a line for rank 0 (under mu). KVS_ERR_IO once the pipe is closing or closed. */
static kvs_status_t queue_line_locked(kvs_rank_backend_t *b, const char *line, size_t len)
{
    if (b->ended || b->quit_queued || b->in_fd < 0) return KVS_ERR_IO;
    size_t before = b->out.len;
    kvs__sb_append(&b->out, line, len);
    if (b->out.oom) {
        b->out.oom = 0;
        b->out.len = before;
        return KVS_ERR_NOMEM;
    }
    return KVS_OK;
}

/* Why a room failed: its error status; "ok" or "in progress" on a failure say nothing. */
static kvs_status_t failure_of(kvs_status_t st)
{
    return st < 0 ? st : KVS_ERR_IO;
}

/* Encodes a request line into line[cap] and queues it (under mu). */
static kvs_status_t queue_request_locked(kvs_rank_backend_t *b, const kvs_rank_line_request_t *q,
                                         char *line, size_t cap)
{
    size_t n;
    kvs_status_t st = kvs_rank_line_request_encode(q, line, cap, &n);
    return st == KVS_OK ? queue_line_locked(b, line, n) : st;
}

/* choice: KVS_LLM_CHOICE_ALL for every one. */
static kvs_status_t queue_stop_locked(kvs_rank_backend_t *b, uint64_t room, uint32_t choice)
{
    kvs_rank_line_request_t q = {.kind = KVS_RANK_LINE_STOP, .room = room, .choice = choice};
    char line[64];
    return queue_request_locked(b, &q, line, sizeof(line));
}

static void room_free(room_t *r)
{
    if (r == NULL) return;
    kvs_free(r->stop_ids);
    kvs_free(r);
}

/* Ends a room that is out of the map: on_done, then free. I/O thread, outside mu. */
static void room_end(room_t *r, const kvs_server_done_t *done)
{
    kvs_server_done_t d = *done;
    d.generated = 0;
    for (uint32_t c = 0; c < r->n; c++) d.generated += r->ch[c].generated;
    if (d.prompt_tokens == 0) d.prompt_tokens = r->prompt_len;
    r->sink.on_done(r->sink.arg, &d);
    room_free(r);
}

static void room_fail(room_t *r, kvs_status_t why)
{
    kvs_server_done_t d;
    memset(&d, 0, sizeof(d));
    d.finish = KVS_SERVER_FINISH_ERROR;
    for (uint32_t c = 0; c < KVS_SERVER_CHOICES_MAX; c++) d.choice_finish[c] = d.finish;
    d.status = why;
    room_end(r, &d);
}

/* Every live room ends with `why`, and every waiting question fails. I/O thread. */
static void fail_everything(kvs_rank_backend_t *b, kvs_status_t why)
{
    for (;;) {
        room_t *r = NULL;
        pthread_mutex_lock(&b->mu);
        size_t it = 0;
        uint64_t key;
        void *val;
        if (kvs_map_next(&b->rooms, &it, &key, &val)) {
            r = val;
            kvs_map_remove(&b->rooms, key);
        }
        pthread_mutex_unlock(&b->mu);
        if (r == NULL) break;
        room_fail(r, why);
    }
    pthread_mutex_lock(&b->mu);
    for (query_t *q = b->qhead; q != NULL;) {
        query_t *next = q->next;
        if (q->abandoned) {
            kvs_free(q);
        } else {
            q->failed = 1;
            q->answered = 1;
        }
        q = next;
    }
    b->qhead = b->qtail = NULL;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

/* ---- rank 0's events ---- */

static void on_token(kvs_rank_backend_t *b, const kvs_llm_event_t *ev)
{
    uint64_t room = ev->room;
    uint32_t token = ev->token, c = ev->choice;
    pthread_mutex_lock(&b->mu);
    room_t *r = kvs_map_get(&b->rooms, room);
    if (r == NULL || c >= r->n || r->ch[c].closed) {
        pthread_mutex_unlock(&b->mu);
        if (r != NULL && c >= r->n)
            kvs_warn("rank backend: room %llu: a token of choice %u of %u",
                     (unsigned long long) room, c, r->n);
        return;
    }
    choice_t *ch = &r->ch[c];
    ch->generated++;
    for (uint32_t i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == token) ch->closed = 1;
    if (ch->closed && !ch->stop_sent && !r->all_stop_sent) {
        if (r->n == 1) /* the whole room: a later cancel() has nothing left to say */
            r->all_stop_sent = queue_stop_locked(b, room, KVS_LLM_CHOICE_ALL) == KVS_OK;
        else
            ch->stop_sent = queue_stop_locked(b, room, c) == KVS_OK;
    }
    pthread_mutex_unlock(&b->mu);
    /* Only this thread ends rooms, so r stays valid outside mu. */
    int empty = b->cfg.text_vocab != 0 && token >= b->cfg.text_vocab;
    r->sink.on_token(r->sink.arg, c, token, empty ? "" : NULL, 0,
                     ev->has_logprobs ? &ev->lp : NULL);
}

static void on_prompt(kvs_rank_backend_t *b, const kvs_llm_event_t *ev)
{
    pthread_mutex_lock(&b->mu);
    room_t *r = kvs_map_get(&b->rooms, ev->room);
    int live = r != NULL && !r->ch[0].closed && r->ch[0].generated == 0;
    pthread_mutex_unlock(&b->mu);
    /* Only this thread ends rooms, so r stays valid outside mu. */
    if (live && ev->has_logprobs && r->sink.on_prompt != NULL)
        r->sink.on_prompt(r->sink.arg, ev->index, ev->token, &ev->lp);
}

static kvs_server_finish_t finish_of(kvs_llm_finish_t finish, kvs_status_t status)
{
    if (status != KVS_OK) return KVS_SERVER_FINISH_ERROR;
    switch (finish) {
    case KVS_LLM_FINISH_LENGTH:
        return KVS_SERVER_FINISH_LENGTH;
    case KVS_LLM_FINISH_HANDOFF:
        return KVS_SERVER_FINISH_HANDOFF;
    case KVS_LLM_FINISH_EOS:
    case KVS_LLM_FINISH_STOP:
        return KVS_SERVER_FINISH_STOP;
    default:
        return KVS_SERVER_FINISH_ERROR;
    }
}

/* A done line (one per choice) or a refusal (the whole room). The room ends with its last
 * choice: its finish the first failure, else choice 0's; the prompt's figures are choice 0's
 * (the one that computed or received it). */
static void on_done(kvs_rank_backend_t *b, const kvs_llm_event_t *ev, int refused)
{
    uint64_t room = ev->room;
    uint32_t c = refused ? 0 : ev->choice;
    pthread_mutex_lock(&b->mu);
    room_t *r = kvs_map_get(&b->rooms, room);
    int last = 0;
    if (r != NULL && !refused && (c >= r->n || r->ch[c].done)) {
        pthread_mutex_unlock(&b->mu);
        kvs_warn("rank backend: room %llu: an unexpected done line for choice %u of %u",
                 (unsigned long long) room, c, r->n);
        return;
    }
    if (r != NULL && !refused) {
        r->ch[c].done = 1;
        last = ++r->n_done == r->n;
    }
    if (r != NULL && (refused || last)) kvs_map_remove(&b->rooms, room);
    pthread_mutex_unlock(&b->mu);
    if (r == NULL) return;
    kvs_server_done_t *d = &r->acc;
    if (refused) {
        d->finish = KVS_SERVER_FINISH_ERROR;
        d->status = failure_of(ev->status);
        kvs_warn("rank backend: rank 0 refused room %llu: %s", (unsigned long long) room,
                 kvs_status_str(ev->status));
        for (uint32_t k = 0; k < KVS_SERVER_CHOICES_MAX; k++) d->choice_finish[k] = d->finish;
        room_end(r, d);
        return;
    }
    /* Only this thread touches a room's figures. */
    kvs_server_finish_t f = finish_of(ev->finish, ev->status);
    d->choice_finish[c] = f;
    if (f == KVS_SERVER_FINISH_ERROR && d->status == KVS_OK) d->status = failure_of(ev->status);
    if (c == 0) {
        d->prompt_tokens = ev->prompt_len;
        d->cached_tokens = ev->cached_tokens;
        uint64_t first = ev->first_token_ns, prefilled = ev->prefilled_ns, done_ns = ev->done_ns;
        if (first > r->submit_ns) d->ttft_ns = first - r->submit_ns;
        if (r->role == KVS_SERVER_ROLE_PREFILL && prefilled != 0 && done_ns > prefilled)
            d->transfer_ns = done_ns - prefilled;
        if (r->role == KVS_SERVER_ROLE_DECODE && f != KVS_SERVER_FINISH_ERROR) {
            uint64_t P = b->cfg.page_size, pages = (d->prompt_tokens + P - 1) / P;
            uint64_t hit = d->cached_tokens / P;
            if (pages > hit) d->kv_bytes = (pages - hit) * P * b->cfg.kv_bytes_per_token;
        }
    }
    if (!last) return;
    d->finish = d->status != KVS_OK ? KVS_SERVER_FINISH_ERROR : d->choice_finish[0];
    if (d->finish == KVS_SERVER_FINISH_ERROR) d->kv_bytes = 0;
    room_end(r, d);
}

/* Pops the oldest question; rank 0 answers in order, so it is the one answered. */
static void on_answer(kvs_rank_backend_t *b, const kvs_rank_line_event_t *ev, qkind_t kind)
{
    pthread_mutex_lock(&b->mu);
    query_t *q = b->qhead;
    if (q == NULL || q->kind != kind) {
        pthread_mutex_unlock(&b->mu);
        kvs_warn("rank backend: rank 0 answered a %s question nobody asked",
                 kind == Q_MATCH ? "match" : "stats");
        return;
    }
    b->qhead = q->next;
    if (b->qhead == NULL) b->qtail = NULL;
    if (kind == Q_MATCH) {
        q->cached = ev->cached;
    } else {
        kvs_server_backend_stats_t s;
        memset(&s, 0, sizeof(s));
        s.metrics = ev->metrics;
        s.queued = ev->stats.queued;
        s.running = ev->stats.running;
        s.preemptions = ev->stats.preemptions;
        s.pages_total = ev->stats.pages_total;
        s.pages_free = ev->stats.pages_free;
        q->stats = s;
        b->last = s;
    }
    if (q->abandoned) {
        kvs_free(q);
    } else {
        q->answered = 1;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
}

static void on_line(kvs_rank_backend_t *b, const char *line, size_t len)
{
    kvs_rank_line_event_t ev;
    const char *why = NULL;
    kvs_status_t st = kvs_rank_line_event_decode(line, len, &ev, &why);
    if (st == KVS_ERR_UNSUPPORTED) return; /* an event this side does not know */
    if (st != KVS_OK) {
        kvs_warn("rank backend: rank 0 wrote a line that is not an event (%s): %.*s", why,
                 (int) (len > 200 ? 200 : len), line);
        return;
    }
    switch (ev.kind) {
    case KVS_RANK_LINE_EV_TOKEN:
        on_token(b, &ev.llm);
        break;
    case KVS_RANK_LINE_EV_PROMPT:
        on_prompt(b, &ev.llm);
        break;
    case KVS_RANK_LINE_EV_DONE:
        on_done(b, &ev.llm, 0);
        break;
    case KVS_RANK_LINE_EV_REJECTED:
        on_done(b, &ev.llm, 1);
        break;
    case KVS_RANK_LINE_EV_MATCH:
        on_answer(b, &ev, Q_MATCH);
        break;
    case KVS_RANK_LINE_EV_STATS:
        if (!ev.final) on_answer(b, &ev, Q_STATS);
        break;
    case KVS_RANK_LINE_EV_READY:
        pthread_mutex_lock(&b->mu);
        b->ready = 1;
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        break;
    case KVS_RANK_LINE_EV_ERROR:
        kvs_warn("rank backend: rank 0 reports: %s", ev.text);
        break;
    case KVS_RANK_LINE_EV_PEERS:
        pthread_mutex_lock(&b->mu);
        b->peers_down = ev.peers_down;
        b->peers_of = ev.peers_of;
        b->first_down = ev.first_down;
        pthread_mutex_unlock(&b->mu);
        break;
    }
}

/* ---- the I/O thread ---- */

/* Writes what is queued without blocking; closes the request pipe after a quit. */
static void flush_out(kvs_rank_backend_t *b)
{
    pthread_mutex_lock(&b->mu);
    while (b->in_fd >= 0 && b->out.len > 0) {
        ssize_t w = write(b->in_fd, b->out.ptr, b->out.len);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (w <= 0) {
            /* Rank 0 is gone; its events end soon and say so. */
            kvs_debug("rank backend: writing to rank 0: %s", strerror(errno));
            b->out.len = 0;
            close(b->in_fd);
            b->in_fd = -1;
            break;
        }
        kvs__sb_consume(&b->out, (size_t) w);
    }
    if (b->in_fd >= 0 && b->quit_queued && b->out.len == 0) {
        close(b->in_fd);
        b->in_fd = -1;
    }
    pthread_mutex_unlock(&b->mu);
}

static void *io_thread(void *arg)
{
    kvs_rank_backend_t *b = arg;
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    kvs__sb_t in;
    kvs__sb_init(&in);
    kvs_status_t end = KVS_ERR_IO;
    for (;;) {
        flush_out(b);
        pthread_mutex_lock(&b->mu);
        int stopping = b->stopping;
        int want_out = b->in_fd >= 0 && b->out.len > 0;
        int in_fd = b->in_fd;
        pthread_mutex_unlock(&b->mu);
        if (stopping) {
            end = KVS_ERR_ABORTED;
            break;
        }
        struct pollfd pfd[3] = {{b->wake[0], POLLIN, 0}, {b->out_fd, POLLIN, 0}, {-1, 0, 0}};
        nfds_t n = 2;
        if (want_out) pfd[n++] = (struct pollfd){in_fd, POLLOUT, 0};
        if (poll(pfd, n, -1) < 0) {
            if (errno == EINTR) continue;
            kvs_error("rank backend: poll failed: %s", strerror(errno));
            break;
        }
        if (pfd[0].revents) {
            char drain[64];
            while (read(b->wake[0], drain, sizeof(drain)) > 0) {
            }
        }
        if (!pfd[1].revents) continue;
        char buf[65536];
        ssize_t r = read(b->out_fd, buf, sizeof(buf));
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r <= 0) break; /* rank 0 exited or closed its events */
        kvs__sb_append(&in, buf, (size_t) r);
        if (in.oom) {
            kvs_error("rank backend: out of memory reading rank 0's events");
            break;
        }
        size_t start = 0;
        for (size_t i = in.len - (size_t) r; i < in.len; i++) {
            if (in.ptr[i] != '\n') continue;
            on_line(b, in.ptr + start, i - start);
            start = i + 1;
        }
        kvs__sb_consume(&in, start);
        if (in.len > MAX_EVENT_LINE) {
            kvs_warn("rank backend: dropping %zu bytes of rank 0's output without a line end",
                     in.len);
            in.len = 0;
        }
    }
    kvs__sb_fini(&in);
    pthread_mutex_lock(&b->mu);
    b->ended = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    if (end == KVS_ERR_IO) kvs_debug("rank backend: rank 0's events ended");
    fail_everything(b, end);
    return NULL;
}

/* ---- the ops ---- */

static kvs_status_t check_request(const kvs_rank_backend_t *b, const kvs_server_request_t *q)
{
    static const char *names[] = {"colocated", "prefill", "decode"};
    const kvs_rank_backend_config_t *c = &b->cfg;
    if (q->role != c->role) {
        kvs_debug("rank backend: room %llu: a %s request for a %s instance",
                  (unsigned long long) q->room, names[q->role % 3], names[c->role % 3]);
        return KVS_ERR_UNSUPPORTED;
    }
    if (c->role == KVS_SERVER_ROLE_DECODE && b->bootstrap != NULL && q->bootstrap != NULL &&
        strcmp(q->bootstrap, b->bootstrap) != 0) {
        kvs_debug("rank backend: room %llu names the prefill instance %s; this one is bound to %s",
                  (unsigned long long) q->room, q->bootstrap, b->bootstrap);
        return KVS_ERR_INVALID;
    }
    /* The server checked the lengths against the same context (http/server.h max_context);
     * this is the last line before rank 0. A prefill request yields one token. */
    uint32_t new_tokens = c->role == KVS_SERVER_ROLE_PREFILL ? 1 : q->max_tokens;
    if (q->prompt_len == 0 || new_tokens == 0 ||
        (uint64_t) q->prompt_len + new_tokens > c->max_context) {
        kvs_debug("rank backend: room %llu: %u prompt tokens and %u new exceed the context of %u",
                  (unsigned long long) q->room, q->prompt_len, new_tokens, c->max_context);
        return KVS_ERR_INVALID;
    }
    for (uint32_t i = 0; i < q->prompt_len; i++)
        if (q->prompt[i] >= c->vocab) return KVS_ERR_INVALID;
    if (q->n == 0 || q->n > KVS_SERVER_CHOICES_MAX) {
        kvs_debug("rank backend: room %llu: n must be 1..%u, not %u", (unsigned long long) q->room,
                  KVS_SERVER_CHOICES_MAX, q->n);
        return KVS_ERR_INVALID;
    }
    const char *why = kvs_sample_params_invalid(&q->sampling, c->vocab);
    if (why != NULL) {
        kvs_debug("rank backend: room %llu: %s", (unsigned long long) q->room, why);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

static int per_room(const kvs_rank_backend_t *b)
{
    return b->cfg.role == KVS_SERVER_ROLE_DECODE && b->cfg.per_room;
}

/* The peer description of the prefill instance at registry, from the cache while fresh, else
 * looked up (outside mu: it waits for the network); a copy in *desc_p. */
static kvs_status_t peer_desc(kvs_rank_backend_t *b, const char *registry, char *why, size_t cap,
                              char **desc_p)
{
    const uint64_t now = kvs_now_ns();
    pthread_mutex_lock(&b->mu);
    for (uint32_t i = 0; i < PEER_CACHE; i++) {
        peer_t *p = &b->peers[i];
        if (p->desc == NULL || strcmp(p->registry, registry) != 0 || now - p->at_ns >= PEER_TTL_NS)
            continue;
        *desc_p = kvs_strdup(p->desc);
        pthread_mutex_unlock(&b->mu);
        return *desc_p ? KVS_OK : KVS_ERR_NOMEM;
    }
    pthread_mutex_unlock(&b->mu);
    char *desc = kvs_malloc(KVS_PLUMBING_PEER_MAX + 1);
    if (desc == NULL) return KVS_ERR_NOMEM;
    kvs_status_t st = kvs_plumbing_peer_lookup(&b->cfg.geo, registry, PEER_WAIT_NS, desc,
                                               KVS_PLUMBING_PEER_MAX + 1, why, cap);
    if (st != KVS_OK) {
        kvs_free(desc);
        return st;
    }
    pthread_mutex_lock(&b->mu);
    uint32_t slot = 0; /* the same registry's entry, else the oldest */
    for (uint32_t i = 0; i < PEER_CACHE; i++) {
        if (b->peers[i].desc != NULL && strcmp(b->peers[i].registry, registry) == 0) {
            slot = i;
            break;
        }
        if (b->peers[i].at_ns < b->peers[slot].at_ns) slot = i;
    }
    peer_t *p = &b->peers[slot];
    kvs_free(p->desc);
    snprintf(p->registry, sizeof(p->registry), "%s", registry);
    p->desc = kvs_strdup(desc);
    p->at_ns = kvs_now_ns();
    pthread_mutex_unlock(&b->mu);
    *desc_p = desc;
    return KVS_OK;
}

static kvs_status_t op_peer(void *ctx, const char *bootstrap, char *why, size_t cap)
{
    kvs_rank_backend_t *b = ctx;
    char *desc = NULL;
    kvs_status_t st = peer_desc(b, bootstrap, why, cap, &desc);
    kvs_free(desc);
    return st;
}

static kvs_status_t op_submit(void *ctx, const kvs_server_request_t *q,
                              const kvs_server_sink_t *sink)
{
    kvs_rank_backend_t *b = ctx;
    kvs_status_t st = check_request(b, q);
    if (st != KVS_OK) return st;
    char *peer = NULL;
    if (per_room(b)) {
        char why[256];
        if (q->bootstrap == NULL) return KVS_ERR_INVALID;
        if ((st = peer_desc(b, q->bootstrap, why, sizeof(why), &peer)) != KVS_OK) {
            kvs_warn("rank backend: room %llu: %s", (unsigned long long) q->room, why);
            return st == KVS_ERR_INCOMPATIBLE ? KVS_ERR_INVALID : st;
        }
    }
    room_t *r = kvs_calloc(1, sizeof(*r));
    /* Rank 0 knows one EOS: the first stop id (the tokenizer's EOS when it has one). */
    kvs_rank_line_request_t line_q = {
        .kind = KVS_RANK_LINE_SUBMIT,
        .submit = {.room = q->room,
                   .max_new = q->role == KVS_SERVER_ROLE_PREFILL ? 1 : q->max_tokens,
                   .sampling = q->sampling,
                   .seed = q->seed,
                   .eos = q->n_stop_ids > 0 ? (int64_t) q->stop_ids[0] : -1,
                   .logprobs = q->logprobs,
                   .top_logprobs = q->top_logprobs,
                   .prompt_logprobs =
                       q->logprobs && q->prompt_logprobs && q->role != KVS_SERVER_ROLE_DECODE,
                   .prompt_len = q->prompt_len,
                   .prompt = q->prompt,
                   .peer = peer,
                   .peer_len = peer ? strlen(peer) : 0,
                   .choices = q->role == KVS_SERVER_ROLE_PREFILL ? 1 : q->n}};
    size_t cap = kvs_rank_line_request_size(&line_q), n = 0;
    char *line = kvs_malloc(cap);
    if (r == NULL || line == NULL) goto nomem;
    r->room = q->room;
    r->sink = *sink;
    r->role = q->role;
    r->prompt_len = q->prompt_len;
    r->n = line_q.submit.choices;
    if (q->n_stop_ids > 1) {
        r->stop_ids = kvs_malloc((size_t) (q->n_stop_ids - 1) * sizeof(uint32_t));
        if (r->stop_ids == NULL) goto nomem;
        memcpy(r->stop_ids, q->stop_ids + 1, (size_t) (q->n_stop_ids - 1) * sizeof(uint32_t));
        r->n_stop_ids = q->n_stop_ids - 1;
    }
    if (kvs_rank_line_request_encode(&line_q, line, cap, &n) != KVS_OK) goto nomem;
    kvs_free(peer);
    peer = NULL;

    pthread_mutex_lock(&b->mu);
    if (!b->ready || b->ended || b->quit_queued) {
        st = KVS_ERR_STATE; /* not ready, or its ranks ended: the health detail says which */
    } else if (kvs_map_get(&b->rooms, q->room) != NULL) {
        kvs_debug("rank backend: room %llu is already live", (unsigned long long) q->room);
        st = KVS_ERR_INVALID;
    } else {
        r->submit_ns = kvs_now_ns();
        st = kvs_map_put(&b->rooms, q->room, r);
        if (st == KVS_OK) {
            st = queue_line_locked(b, line, n);
            if (st != KVS_OK) kvs_map_remove(&b->rooms, q->room);
        }
    }
    pthread_mutex_unlock(&b->mu);
    kvs_free(line);
    if (st != KVS_OK) {
        room_free(r);
        return st;
    }
    wake_thread(b);
    return KVS_OK;
nomem:
    kvs_free(peer);
    kvs_free(line);
    room_free(r);
    kvs_error("rank backend: out of memory submitting room %llu", (unsigned long long) q->room);
    return KVS_ERR_NOMEM;
}

static kvs_status_t op_cancel(void *ctx, uint64_t room, uint32_t choice)
{
    kvs_rank_backend_t *b = ctx;
    pthread_mutex_lock(&b->mu);
    room_t *r = kvs_map_get(&b->rooms, room);
    kvs_status_t st = KVS_ERR_NOT_FOUND;
    if (r != NULL && choice == KVS_SERVER_CHOICE_ALL) {
        st = KVS_OK;
        if (!r->all_stop_sent && queue_stop_locked(b, room, KVS_LLM_CHOICE_ALL) == KVS_OK)
            r->all_stop_sent = 1;
    } else if (r != NULL && choice < r->n) {
        st = KVS_OK;
        choice_t *ch = &r->ch[choice];
        if (!ch->stop_sent && !r->all_stop_sent && queue_stop_locked(b, room, choice) == KVS_OK)
            ch->stop_sent = 1;
    }
    pthread_mutex_unlock(&b->mu);
    if (st == KVS_OK) wake_thread(b);
    return st;
}

static kvs_status_t op_health(void *ctx)
{
    kvs_rank_backend_t *b = ctx;
    pthread_mutex_lock(&b->mu);
    int ok = b->ready && !b->ended && !b->quit_queued && b->peers_down == 0;
    pthread_mutex_unlock(&b->mu);
    return ok ? KVS_OK : KVS_ERR_IO;
}

static void op_health_detail(void *ctx, char *buf, size_t cap)
{
    kvs_rank_backend_t *b = ctx;
    pthread_mutex_lock(&b->mu);
    const char *other = b->cfg.role == KVS_SERVER_ROLE_DECODE ? "prefill" : "decode";
    if (!b->ready && b->restarts > 0)
        snprintf(buf, cap, "the instance is restarting (restart %u; %s)", b->restarts,
                 b->restart_why);
    else if (!b->ready)
        snprintf(buf, cap, "the instance is not ready");
    else if (b->ended || b->quit_queued)
        snprintf(buf, cap, "the instance has ended");
    else if (b->peers_down > 0)
        snprintf(buf, cap, "%u of %u %s ranks unreachable (first: %s rank %u)", b->peers_down,
                 b->peers_of, other, other, b->first_down);
    else
        buf[0] = '\0';
    pthread_mutex_unlock(&b->mu);
}

/* Asks rank 0 (req, encoded into line[cap]) and waits for its answer (or the timeout). */
static kvs_status_t ask(kvs_rank_backend_t *b, const kvs_rank_line_request_t *req, char *line,
                        size_t cap, query_t *answer_p)
{
    query_t *q = kvs_calloc(1, sizeof(*q));
    if (q == NULL) return KVS_ERR_NOMEM;
    q->kind = req->kind == KVS_RANK_LINE_MATCH ? Q_MATCH : Q_STATS;
    pthread_mutex_lock(&b->mu);
    kvs_status_t st = b->ready ? queue_request_locked(b, req, line, cap) : KVS_ERR_STATE;
    if (st != KVS_OK) {
        pthread_mutex_unlock(&b->mu);
        kvs_free(q);
        return st;
    }
    if (b->qtail)
        b->qtail->next = q;
    else
        b->qhead = q;
    b->qtail = q;
    pthread_mutex_unlock(&b->mu);
    wake_thread(b);

    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    uint64_t ns = (uint64_t) dl.tv_nsec + (uint64_t) b->cfg.query_timeout_ms * 1000000ull;
    dl.tv_sec += (time_t) (ns / 1000000000ull);
    dl.tv_nsec = (long) (ns % 1000000000ull);
    pthread_mutex_lock(&b->mu);
    while (!q->answered)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &dl) == ETIMEDOUT) break;
    if (!q->answered) {
        q->abandoned = 1; /* freed when its answer comes (or with the backend) */
        pthread_mutex_unlock(&b->mu);
        return KVS_ERR_TIMEOUT;
    }
    st = q->failed ? KVS_ERR_IO : KVS_OK;
    if (st == KVS_OK) *answer_p = *q;
    pthread_mutex_unlock(&b->mu);
    kvs_free(q);
    return st;
}

static kvs_status_t op_match(void *ctx, const uint32_t *prompt, uint32_t prompt_len,
                             uint32_t *cached_p)
{
    kvs_rank_backend_t *b = ctx;
    if (prompt_len == 0 || prompt_len >= b->cfg.max_context) {
        *cached_p = 0; /* nothing of it can be served here */
        return KVS_OK;
    }
    kvs_rank_line_request_t req = {
        .kind = KVS_RANK_LINE_MATCH, .match_len = prompt_len, .match = prompt};
    size_t cap = kvs_rank_line_request_size(&req);
    char *line = kvs_malloc(cap);
    if (line == NULL) return KVS_ERR_NOMEM;
    query_t a;
    kvs_status_t st = ask(b, &req, line, cap, &a);
    kvs_free(line);
    if (st != KVS_OK) return st;
    *cached_p = a.cached;
    return KVS_OK;
}

/* The counters of c added to those of m; gauges untouched. */
static void counters_add(kvs_pd_metrics_t *m, const kvs_pd_metrics_t *c)
{
    uint32_t n;
    const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&n);
    for (uint32_t i = 0; i < n; i++)
        if (f[i].kind == KVS_PD_COUNTER)
            kvs_pd_metrics_set(m, &f[i],
                               kvs_pd_metrics_get(m, &f[i]) + kvs_pd_metrics_get(c, &f[i]));
}

static void op_stats(void *ctx, kvs_server_backend_stats_t *stats_p)
{
    kvs_rank_backend_t *b = ctx;
    query_t a;
    kvs_rank_line_request_t req = {.kind = KVS_RANK_LINE_STATS};
    char line[32];
    kvs_status_t st = ask(b, &req, line, sizeof(line), &a);
    pthread_mutex_lock(&b->mu);
    /* Else the last answer, when rank 0 is slow or gone (zero gauges while it restarts). */
    kvs_server_backend_stats_t s = st == KVS_OK ? a.stats : b->last;
    counters_add(&s.metrics, &b->base);
    s.preemptions += b->base_preemptions;
    s.restarts = b->restarts;
    pthread_mutex_unlock(&b->mu);
    *stats_p = s;
}

/* ---- lifetime ---- */

static int set_flags(int fd, int fl_add, int fd_add)
{
    int fl = fcntl(fd, F_GETFL), fdf = fcntl(fd, F_GETFD);
    return fl < 0 || fdf < 0 || fcntl(fd, F_SETFL, fl | fl_add) != 0 ||
                   fcntl(fd, F_SETFD, fdf | fd_add) != 0
               ? -1
               : 0;
}

kvs_status_t kvs_rank_backend_create(const kvs_rank_backend_config_t *config,
                                     kvs_rank_backend_t **backend_p)
{
    const kvs_rank_backend_config_t *c = config;
    if (c == NULL || c->in_fd < 0 || c->out_fd < 0 || c->page_size == 0 || c->vocab == 0 ||
        c->max_context < 2 || (unsigned) c->role > KVS_SERVER_ROLE_DECODE) {
        kvs_error("rank backend: needs rank 0's two pipes, the page size, vocabulary, a context "
                  "of at least 2 tokens and a role");
        if (c != NULL && c->in_fd >= 0) close(c->in_fd);
        if (c != NULL && c->out_fd >= 0) close(c->out_fd);
        return KVS_ERR_INVALID;
    }
    kvs__json_init();
    kvs_rank_backend_t *b = kvs_calloc(1, sizeof(*b));
    if (b == NULL) {
        close(c->in_fd);
        close(c->out_fd);
        return KVS_ERR_NOMEM;
    }
    b->cfg = *c;
    if (b->cfg.query_timeout_ms == 0) b->cfg.query_timeout_ms = 5000;
    b->in_fd = c->in_fd;
    b->out_fd = c->out_fd;
    b->wake[0] = b->wake[1] = -1;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    kvs_map_init(&b->rooms);
    kvs__sb_init(&b->out);
    kvs_status_t st = KVS_ERR_NOMEM;
    if (c->bootstrap != NULL && (b->bootstrap = kvs_strdup(c->bootstrap)) == NULL) goto fail;
    st = KVS_ERR_IO;
    if (pipe(b->wake) != 0 || set_flags(b->wake[0], O_NONBLOCK, FD_CLOEXEC) != 0 ||
        set_flags(b->wake[1], O_NONBLOCK, FD_CLOEXEC) != 0 ||
        set_flags(b->in_fd, O_NONBLOCK, FD_CLOEXEC) != 0 ||
        set_flags(b->out_fd, 0, FD_CLOEXEC) != 0) {
        kvs_error("rank backend: cannot set up its pipes: %s", strerror(errno));
        goto fail;
    }
    if (pthread_create(&b->thread, NULL, io_thread, b) != 0) {
        kvs_error("rank backend: cannot start its I/O thread");
        goto fail;
    }
    b->thread_started = 1;
    *backend_p = b;
    return KVS_OK;
fail:
    kvs_rank_backend_destroy(b);
    return st;
}

kvs_status_t kvs_rank_backend_wait_ready(kvs_rank_backend_t *b, uint32_t timeout_ms)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    uint64_t ns = (uint64_t) dl.tv_nsec + (uint64_t) timeout_ms * 1000000ull;
    dl.tv_sec += (time_t) (ns / 1000000000ull);
    dl.tv_nsec = (long) (ns % 1000000000ull);
    pthread_mutex_lock(&b->mu);
    while (!b->ready && !b->ended)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &dl) == ETIMEDOUT) break;
    kvs_status_t st = b->ready && !b->ended ? KVS_OK : b->ended ? KVS_ERR_IO : KVS_ERR_TIMEOUT;
    pthread_mutex_unlock(&b->mu);
    return st;
}

kvs_server_backend_t kvs_rank_backend_ops(kvs_rank_backend_t *b)
{
    kvs_server_backend_t ops = {.ctx = b,
                                .submit = op_submit,
                                .cancel = op_cancel,
                                .health = op_health,
                                .health_detail = op_health_detail,
                                .match = op_match,
                                .stats = op_stats,
                                .peer = per_room(b) ? op_peer : NULL};
    return ops;
}

void kvs_rank_backend_quit(kvs_rank_backend_t *b)
{
    pthread_mutex_lock(&b->mu);
    kvs_rank_line_request_t req = {.kind = KVS_RANK_LINE_QUIT};
    char line[32];
    size_t n;
    if (!b->quit_queued && b->in_fd >= 0 && !b->ended &&
        kvs_rank_line_request_encode(&req, line, sizeof(line), &n) == KVS_OK)
        kvs__sb_append(&b->out, line, n);
    b->quit_queued = 1; /* the pipe closes once flushed: end of file is a quit too */
    pthread_mutex_unlock(&b->mu);
    wake_thread(b);
}

int kvs_rank_backend_ended(kvs_rank_backend_t *b)
{
    pthread_mutex_lock(&b->mu);
    int ended = b->ended;
    pthread_mutex_unlock(&b->mu);
    return ended;
}

/* Ends the I/O thread: rooms still live end with FINISH_ERROR (KVS_ERR_IO once rank 0's events
 * ended, else KVS_ERR_ABORTED), waiting questions fail. */
static void stop_thread(kvs_rank_backend_t *b)
{
    if (!b->thread_started) return;
    pthread_mutex_lock(&b->mu);
    b->stopping = 1;
    pthread_mutex_unlock(&b->mu);
    wake_thread(b);
    pthread_join(b->thread, NULL);
    b->thread_started = 0;
}

kvs_status_t kvs_rank_backend_restart(kvs_rank_backend_t *b, int in_fd, int out_fd, const char *why)
{
    stop_thread(b);
    pthread_mutex_lock(&b->mu);
    if (b->in_fd >= 0) close(b->in_fd);
    if (b->out_fd >= 0) close(b->out_fd);
    b->in_fd = in_fd;
    b->out_fd = out_fd;
    b->stopping = b->ready = b->ended = b->quit_queued = 0;
    b->out.len = 0;
    b->peers_down = b->peers_of = b->first_down = 0;
    /* The old instance's counters carry on; its gauges are gone with it. */
    counters_add(&b->base, &b->last.metrics);
    b->base_preemptions += b->last.preemptions;
    memset(&b->last, 0, sizeof(b->last));
    b->restarts++;
    snprintf(b->restart_why, sizeof(b->restart_why), "%s", why ? why : "the instance ended");
    kvs_status_t st = KVS_OK;
    if (set_flags(in_fd, O_NONBLOCK, FD_CLOEXEC) != 0 || set_flags(out_fd, 0, FD_CLOEXEC) != 0) {
        kvs_error("rank backend: cannot set up the new rank 0's pipes: %s", strerror(errno));
        st = KVS_ERR_IO;
    } else if (pthread_create(&b->thread, NULL, io_thread, b) != 0) {
        kvs_error("rank backend: cannot start its I/O thread again");
        st = KVS_ERR_IO;
    }
    if (st != KVS_OK) {
        b->ended = 1; /* every op fails, as after rank 0's end */
    } else {
        b->thread_started = 1;
    }
    pthread_mutex_unlock(&b->mu);
    return st;
}

void kvs_rank_backend_destroy(kvs_rank_backend_t *b)
{
    if (b == NULL) return;
    stop_thread(b);
    for (query_t *q = b->qhead; q != NULL;) {
        query_t *next = q->next;
        kvs_free(q); /* only abandoned ones can be left: no asker waits once the thread ended */
        q = next;
    }
    size_t it = 0;
    uint64_t key;
    void *val;
    while (kvs_map_next(&b->rooms, &it, &key, &val)) room_free(val); /* none unless it failed */
    kvs_map_fini(&b->rooms);
    kvs__sb_fini(&b->out);
    if (b->in_fd >= 0) close(b->in_fd);
    if (b->out_fd >= 0) close(b->out_fd);
    for (int i = 0; i < 2; i++)
        if (b->wake[i] >= 0) close(b->wake[i]);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    kvs_free(b->bootstrap);
    for (uint32_t i = 0; i < PEER_CACHE; i++) kvs_free(b->peers[i].desc);
    kvs_free(b);
}
