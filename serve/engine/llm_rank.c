/* One rank of a real-model deployment as a process (engine/llm_rank.h): setup in the order
 * that keeps peers from waiting on each other (model, pool, TP group, then the net link so that
 * no heartbeat goes silent during a model load), the request pipe of rank 0, and the lockstep
 * loop around kvs_llm_step. */
#include "engine/llm_rank.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pd/plumbing.h"
#include "engine/rank_line.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "model/gguf.h"
#include "kvstage/log.h"
#include "kvstage/registry.h"
#include "model/tpgroup.h"

#define MS          1000000ull
#define GROUP_BCAST 65536u /* the engine broadcasts its inputs in pieces of this */
/* Idle steps: poll every 50 us while the rank was busy within the last HOT_NS (a handoff is a
 * few round trips), then back off to IDLE_SLEEP_MAX. Polling fast all the time cost the other
 * instance's forward passes about 10% on a 2-core VM; the first message after a long quiet
 * period waits at most IDLE_SLEEP_MAX. */
#define IDLE_SLEEP_US  50
#define IDLE_SLEEP_MAX 2000
/* While requests are live (a decode rank waiting for a prompt's KV, a prefill rank for the
 * acknowledgements), the back-off stops here: a GPU prefill of a 1k prompt takes tens of ms, and
 * waking up to 2 ms late for its KV was most of the handoff's share of TTFT. */
#define LIVE_SLEEP_MAX 200
#define HOT_NS         (20 * MS)
#define DRAIN_NS       (50 * MS)

static const char *role_str(kvs_llm_role_t role)
{
    return kvs_rank_line_role_str(role);
}

static void sleep_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

/* ---- output lines ---- */

static void write_line(int fd, const char *line, size_t n)
{
    if (fd < 0) return;
    for (size_t at = 0; at < n;) {
        ssize_t w = write(fd, line + at, n - at);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            kvs_warn("llm rank: cannot write an event line: %s", strerror(errno));
            return;
        }
        at += (size_t) w;
    }
}

/* Encodes ev into line[cap]; 0 (and a warning) when it does not fit. */
static size_t encode_event(const kvs_rank_line_event_t *ev, char *line, size_t cap)
{
    size_t n = 0;
    if (kvs_rank_line_event_encode(ev, line, cap, &n) != KVS_OK) {
        kvs_warn("llm rank: an event line does not fit %zu bytes", cap);
        return 0;
    }
    return n;
}

/* Every line fits: the longest is the stats line, and messages are cut to KVS_RANK_LINE_TEXT. */
#define EVENT_LINE_CAP (8 * KVS_RANK_LINE_TEXT + 1024)

static void out_event(int fd, const kvs_rank_line_event_t *ev)
{
    if (fd < 0) return;
    char line[EVENT_LINE_CAP];
    write_line(fd, line, encode_event(ev, line, sizeof(line)));
}

/* Decode rank 0's view of its prefill instance, reported when it changes (the server's /health
 * shows it). Not on the prefill side: decode instances come and go, and one not started yet is
 * no reason for a prefill server to leave the rotation. */
typedef struct {
    uint64_t next_ns;
    uint32_t down;
} peers_seen_t;

#define PEERS_CHECK_NS (500ull * 1000000ull)

static void report_peers(const kvs_llm_rank_config_t *c, const kvs_plumbing_t *pl,
                         peers_seen_t *seen)
{
    const uint64_t now = kvs_now_ns();
    if (c->role != KVS_LLM_DECODE || c->out_fd < 0 || now < seen->next_ns) return;
    seen->next_ns = now + PEERS_CHECK_NS;
    uint32_t first = 0, down = kvs_plumbing_peers_down(pl, &first);
    if (down == seen->down) return;
    seen->down = down;
    kvs_rank_line_event_t ev = {.kind = KVS_RANK_LINE_EV_PEERS,
                                .peers_down = down,
                                .peers_of = pl->peers,
                                .first_down = first};
    out_event(c->out_fd, &ev);
}

/* An instance id unlike any other's: the wall clock and the process id, mixed (splitmix64). */
static uint64_t draw_instance(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
    x ^= (uint64_t) getpid() << 40;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void out_error(int fd, const char *prefix, const char *what)
{
    kvs_rank_line_event_t ev = {.kind = KVS_RANK_LINE_EV_ERROR};
    snprintf(ev.text, sizeof(ev.text), "%s%s", prefix, what);
    out_event(fd, &ev);
}

static void out_rejected(int fd, uint64_t room, kvs_status_t why)
{
    kvs_rank_line_event_t ev = {.kind = KVS_RANK_LINE_EV_REJECTED};
    ev.llm.room = room;
    ev.llm.status = why;
    out_event(fd, &ev);
}

static void write_event(int fd, const kvs_llm_event_t *e)
{
    kvs_rank_line_event_t ev = {.llm = *e};
    ev.kind = e->kind == KVS_LLM_EV_TOKEN    ? KVS_RANK_LINE_EV_TOKEN
              : e->kind == KVS_LLM_EV_PROMPT ? KVS_RANK_LINE_EV_PROMPT
                                             : KVS_RANK_LINE_EV_DONE;
    out_event(fd, &ev);
}

/* ---- rank 0's request pipe ---- */

typedef struct {
    const kvs_llm_rank_config_t *cfg;
    kvs_llm_t *llm;
    const kvs_plumbing_t *pl;
    uint64_t t0;
    double load_s;
    char *buf; /* [cap] bytes read, not yet a whole line */
    size_t len, cap;
    uint32_t *ids;                                /* [max_prompt] scratch for one prompt */
    uint32_t max_prompt;                          /* the longest prompt the context allows */
    kvs_logit_bias_t bias[KVS_SAMPLE_BIAS_LIMIT]; /* scratch for one submit's logit biases */
    int eof, quitting;
    uint64_t quit_at;
    /* Answers held back behind a `stats` (answered after the next step, when the instance's
     * counters were summed), so that answers still come in the order asked: one entry per
     * question, a match line or NULL for a stats line. */
    char **held;
    uint32_t nheld, cap_held;
    uint64_t stats_after; /* the stats answers are due once collections exceed this */
} io_t;

static void parse_error(io_t *io, const char *what)
{
    kvs_warn("llm rank: bad request line: %s", what);
    out_error(io->cfg->out_fd, "bad request line: ", what);
}

static void handle_submit(io_t *io, const kvs_rank_line_submit_t *s)
{
    char peer[KVS_LLM_PEER_MAX + 1];
    memcpy(peer, s->peer ? s->peer : "", s->peer_len); /* the decoder bounds it */
    peer[s->peer_len] = '\0';
    kvs_llm_request_t q = {.room = s->room,
                           .prompt = s->prompt,
                           .prompt_len = s->prompt_len,
                           .max_new_tokens = s->max_new,
                           .sampling = s->sampling,
                           .seed = s->seed,
                           .eos = s->eos < 0 ? UINT32_MAX : (uint32_t) s->eos,
                           .logprobs = s->logprobs,
                           .top_logprobs = s->top_logprobs,
                           .prompt_logprobs = s->prompt_logprobs,
                           .peer = s->peer_len > 0 ? peer : NULL,
                           .n_choices = s->choices};
    kvs_status_t st = kvs_llm_submit(io->llm, &q);
    if (st != KVS_OK) out_rejected(io->cfg->out_fd, s->room, st);
}

static void write_stats(const kvs_llm_rank_config_t *c, const kvs_llm_rank_result_t *r, int final);

/* Queues an answer behind a held stats answer; 0 when out of memory. */
static int hold(io_t *io, char *line)
{
    if (io->nheld == io->cap_held) {
        uint32_t n = io->cap_held ? io->cap_held * 2 : 8;
        char **p = kvs_realloc(io->held, (size_t) n * sizeof(*p));
        if (p == NULL) return 0;
        io->held = p;
        io->cap_held = n;
    }
    io->held[io->nheld++] = line;
    return 1;
}

/* `match N IDS`: answered with one match line whatever happens, so that the asker can pair
 * answers with questions in order. why: the decoder's complaint (NULL: well formed); a prompt
 * longer than max_prompt (fits) is refused on submit, so nothing of it would be reused. */
static void handle_match(io_t *io, const kvs_rank_line_request_t *q, const char *why, int fits)
{
    kvs_rank_line_event_t ev = {.kind = KVS_RANK_LINE_EV_MATCH};
    if (why != NULL) {
        kvs_warn("llm rank: bad request line: %s", why);
        snprintf(ev.text, sizeof(ev.text), "%s", why);
    } else {
        ev.match_len = q->match_len;
        if (fits && kvs_llm_cached(io->llm, q->match, q->match_len, &ev.cached) != KVS_OK)
            ev.cached = 0;
    }
    char line[EVENT_LINE_CAP];
    size_t n = encode_event(&ev, line, sizeof(line));
    if (n == 0) return;
    if (io->nheld == 0) {
        write_line(io->cfg->out_fd, line, n);
        return;
    }
    char *copy = kvs_strdup(line); /* the whole line, its newline included */
    if (copy == NULL || !hold(io, copy)) {
        kvs_free(copy);
        write_line(io->cfg->out_fd, line, n); /* out of memory: late order beats no answer */
    }
}

/* `stats`: the instance's transfer counters are summed over every rank at the next step, so
 * the answer waits for it (answer_held, after each step). */
static void handle_stats(io_t *io)
{
    kvs_pd_metrics_t unused;
    if (io->nheld == 0) io->stats_after = kvs_llm_instance_metrics(io->llm, &unused);
    if (!hold(io, NULL)) {
        parse_error(io, "out of memory holding a stats question");
        return;
    }
    kvs_llm_collect_metrics(io->llm);
}

/* Writes the held answers, in order, once the instance's counters have been summed. */
static void answer_held(io_t *io)
{
    kvs_llm_rank_result_t r;
    memset(&r, 0, sizeof(r));
    if (io->nheld == 0 || kvs_llm_instance_metrics(io->llm, &r.metrics) <= io->stats_after) return;
    kvs_llm_stats(io->llm, &r.stats);
    r.load_s = io->load_s;
    r.wall_s = (double) (kvs_now_ns() - io->t0) / 1e9;
    for (uint32_t i = 0; i < io->nheld; i++) {
        if (io->held[i] == NULL) {
            write_stats(io->cfg, &r, 0);
        } else {
            write_line(io->cfg->out_fd, io->held[i], strlen(io->held[i]));
            kvs_free(io->held[i]);
        }
    }
    io->nheld = 0;
}

static void handle_line(io_t *io, char *line)
{
    if (line[0] == '\0') return;
    kvs_rank_line_request_t q;
    const char *why = NULL;
    kvs_status_t st = kvs_rank_line_request_decode(line, strlen(line), io->ids, io->max_prompt,
                                                   io->bias, &q, &why);
    if (q.kind == KVS_RANK_LINE_MATCH && st != KVS_ERR_INVALID) {
        handle_match(io, &q, NULL, st == KVS_OK);
        return;
    }
    if (q.kind == KVS_RANK_LINE_MATCH) {
        handle_match(io, &q, why, 0);
        return;
    }
    if (q.kind == KVS_RANK_LINE_SUBMIT && st == KVS_ERR_NOSPACE) {
        out_rejected(io->cfg->out_fd, q.submit.room, KVS_ERR_INVALID);
        kvs_warn("llm rank: room %llu: prompt length must be 1..%u",
                 (unsigned long long) q.submit.room, io->max_prompt);
        return;
    }
    if (st != KVS_OK) {
        parse_error(io, why);
        return;
    }
    switch (q.kind) {
    case KVS_RANK_LINE_SUBMIT:
        handle_submit(io, &q.submit);
        break;
    case KVS_RANK_LINE_STOP:
        /* A room that already ended is no error: the stop raced its last token. */
        (void) kvs_llm_stop(io->llm, q.room, q.choice);
        break;
    case KVS_RANK_LINE_STATS:
        handle_stats(io);
        break;
    case KVS_RANK_LINE_QUIT:
        if (!io->quitting) io->quit_at = kvs_now_ns() + io->cfg->quit_grace_ns;
        io->quitting = 1;
        break;
    default:
        break;
    }
}

/* An idle step's sleep of up to `us`, cut short by a control message on the rank's links (a
 * grant, a CHUNK_READY or a STATUS waiting for the end of a sleep was part of every handoff's
 * latency) and, on rank 0, by its input pipe (a request waiting for the end of a back-off sleep
 * counted in its time to first token). */
static void idle_wait(const io_t *io, const kvs_plumbing_t *pl, int rank0, long us)
{
    const int fd = rank0 && !io->eof ? io->cfg->in_fd : -1;
    (void) kvs_plumbing_wait(pl, fd, (uint64_t) us);
}

/* Takes whatever the pipe holds now, without waiting. */
static void read_input(io_t *io)
{
    for (;;) {
        struct pollfd pfd = {io->cfg->in_fd, POLLIN, 0};
        if (poll(&pfd, 1, 0) <= 0) return;
        if (io->len + 65536 > io->cap) {
            size_t ncap = io->cap ? io->cap * 2 : 131072;
            char *b = ncap <= KVS_RANK_LINE_MAX + 131072 ? kvs_realloc(io->buf, ncap) : NULL;
            if (b == NULL) {
                parse_error(io, "line too long");
                io->len = 0;
                continue;
            }
            io->buf = b;
            io->cap = ncap;
        }
        ssize_t n = read(io->cfg->in_fd, io->buf + io->len, 65536);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            /* The launcher is gone or done: the same as quit. */
            io->eof = 1;
            if (!io->quitting) io->quit_at = kvs_now_ns() + io->cfg->quit_grace_ns;
            io->quitting = 1;
            return;
        }
        size_t start = 0, end = io->len + (size_t) n;
        for (size_t i = io->len; i < end; i++) {
            if (io->buf[i] != '\n') continue;
            io->buf[i] = '\0';
            handle_line(io, io->buf + start);
            start = i + 1;
        }
        memmove(io->buf, io->buf + start, end - start);
        io->len = end - start;
    }
}

/* ---- per-room bootstrap: the engine's receivers are the plumbing's instances ---- */

static kvs_status_t room_receiver(void *ctx, const char *peer, kvs_receiver_t **receiver_p)
{
    return kvs_plumbing_room_receiver(ctx, peer, receiver_p);
}

static uint32_t receivers_progress(void *ctx)
{
    return kvs_plumbing_progress(ctx);
}

static void receivers_metrics(void *ctx, kvs_pd_metrics_t *metrics_p)
{
    kvs_plumbing_metrics(ctx, metrics_p);
}

/* ---- setup ---- */

static kvs_status_t load_model(const kvs_llm_rank_config_t *c, kvs_tp_t tp, kvs_model_t **model_p)
{
    if (c->model_path == NULL)
        return kvs_model_seeded_on(&c->seeded, c->model_seed, tp, c->device, model_p);
    kvs_gguf_t *g = NULL;
    kvs_status_t st = kvs_gguf_open(c->model_path, &g);
    if (st != KVS_OK) return st;
    st = kvs_model_load_on(g, tp, c->device, model_p);
    kvs_gguf_close(g);
    return st;
}

uint64_t kvs_llm_rank_pool_pages(uint64_t kv_tokens, uint32_t max_context, uint32_t page_size)
{
    uint64_t tokens = kv_tokens ? kv_tokens : 2 * (uint64_t) max_context;
    return page_size ? (tokens + page_size - 1) / page_size : 0;
}

static kvs_status_t check_config(const kvs_llm_rank_config_t *c, uint32_t tp)
{
    const int pd = c->role != KVS_LLM_COLOCATED;
    const char *why = NULL;
    if ((unsigned) c->role > KVS_LLM_DECODE)
        why = "unknown role";
    else if (tp == 0 || tp > KVS_MAX_TP || c->rank >= tp)
        why = "rank out of the instance's TP size";
    else if (pd && (c->decode_tp == 0 || c->decode_tp > KVS_MAX_TP || c->prefill_tp == 0))
        why = "prefill and decode TP sizes must be 1..64";
    else if (c->page_size == 0 || c->chunk_tokens == 0 || c->max_running == 0)
        why = "page size, chunk and max running must be positive";
    else if (c->max_context == 1)
        why = "a context of one token leaves no room for a prompt and a new token";
    else if (c->batch_tokens != 0 && c->batch_tokens < c->chunk_tokens)
        why = "batch tokens below the chunk";
    else if (c->role == KVS_LLM_PREFILL && c->registry == NULL)
        why = "prefill ranks need the registry endpoint";
    else if (c->rank == 0 && c->in_fd < 0)
        why = "rank 0 needs its request pipe";
    else if (tp > 1 && c->group == NULL)
        why = "TP > 1 needs a group name";
    if (why == NULL) return KVS_OK;
    kvs_error("llm rank: %s rank %u of TP %u: %s", role_str(c->role), c->rank, tp, why);
    return KVS_ERR_INVALID;
}

static void write_stats(const kvs_llm_rank_config_t *c, const kvs_llm_rank_result_t *r, int final)
{
    kvs_rank_line_event_t ev = {.kind = KVS_RANK_LINE_EV_STATS,
                                .role = c->role,
                                .rank = c->rank,
                                .load_s = r->load_s,
                                .wall_s = r->wall_s,
                                .final = final,
                                .stats = r->stats,
                                .metrics = r->metrics};
    out_event(c->out_fd, &ev);
}

kvs_status_t kvs_llm_rank_run(const kvs_llm_rank_config_t *config, kvs_llm_rank_result_t *result_p)
{
    kvs_llm_rank_config_t c = *config;
    const int prefill = c.role == KVS_LLM_PREFILL, decode = c.role == KVS_LLM_DECODE;
    const uint32_t tp = decode ? c.decode_tp : c.prefill_tp;
    kvs_status_t st = check_config(&c, tp);
    if (st != KVS_OK) return st;
    if (c.batch_tokens == 0) c.batch_tokens = 4 * c.chunk_tokens;
    if (c.group_timeout_ms == 0) c.group_timeout_ms = 120000;
    if (c.liveness_timeout_ns == 0) c.liveness_timeout_ns = 10000 * MS;
    if (c.quit_grace_ns == 0) c.quit_grace_ns = 5000 * MS;
    const uint64_t t0 = kvs_now_ns();

    kvs_llm_rank_result_t res;
    memset(&res, 0, sizeof(res));
    kvs_model_t *model = NULL;
    kvs_pool_t *pool = NULL;
    kvs_tpgroup_t *group = NULL;
    kvs_plumbing_t pl;
    memset(&pl, 0, sizeof(pl));
    kvs_llm_t *llm = NULL;
    io_t io;
    memset(&io, 0, sizeof(io));
    io.cfg = &c;

    if ((st = load_model(&c, (kvs_tp_t){tp, c.rank}, &model)) != KVS_OK) goto out;
    if (c.kv_bf16 && (st = kvs_model_set_kv_bytes(model, 2)) != KVS_OK) goto out;
    const kvs_model_config_t *mc = kvs_model_config(model);
    const kvs_pd_geometry_t geo = {.shape = kvs_model_kv_shape(model),
                                   .prefill_tp = c.prefill_tp,
                                   .decode_tp = decode || prefill ? c.decode_tp : c.prefill_tp,
                                   .page_size = c.page_size,
                                   .chunk_tokens = c.chunk_tokens,
                                   .no_checksum = c.no_checksum ? 1u : 0u};
    if ((prefill || decode) && (st = kvs_pd_geometry_validate(&geo)) != KVS_OK) goto out;

    if (c.max_context > mc->max_ctx) {
        kvs_error("llm rank: a context of %u tokens is above the model's %u", c.max_context,
                  mc->max_ctx);
        st = KVS_ERR_INVALID;
        goto out;
    }
    if (c.max_context == 0) c.max_context = mc->max_ctx;
    uint64_t pages = kvs_llm_rank_pool_pages(c.kv_tokens, c.max_context, c.page_size);
    if (pages * c.page_size < c.max_context || pages > UINT32_MAX) {
        kvs_error("llm rank: a KV pool of %llu tokens cannot hold one request of the whole "
                  "context (%u tokens) in at most 2^32 - 1 pages of %u",
                  (unsigned long long) c.kv_tokens, c.max_context, c.page_size);
        st = KVS_ERR_INVALID;
        goto out;
    }
    kvs_pool_config_t pc = {.shape = geo.shape,
                            .tp = {tp, c.rank},
                            .page_size = c.page_size,
                            .num_pages = (uint32_t) pages,
                            .layout = KVS_POOL_NHD,
                            .mem = c.device < 0 ? KVS_MEM_HOST : KVS_MEM_DEVICE,
                            .device = c.device < 0 ? 0 : c.device};
    if ((st = kvs_pool_create(&pc, &pool)) != KVS_OK) goto out;

    /* The group before the link: a rank waiting here for a slow loader sends no heartbeats. */
    if (tp > 1) {
        size_t tokens = (size_t) c.batch_tokens + c.max_running;
        size_t doubles = tokens * mc->dim;
        if (doubles < KVS_LLM_AGREE_DOUBLES * (size_t) c.max_running)
            doubles = KVS_LLM_AGREE_DOUBLES * (size_t) c.max_running;
        kvs_tpgroup_config_t gc = {.name = c.group,
                                   .size = tp,
                                   .rank = c.rank,
                                   .max_doubles = doubles,
                                   .max_bytes = GROUP_BCAST,
                                   .timeout_ms = c.group_timeout_ms};
        if ((st = kvs_tpgroup_join(&gc, &group)) != KVS_OK) goto out;
        /* Ranks on distinct GPUs all-reduce through NCCL (when built with it), others through
         * the group; every rank takes the same decision. */
        if ((st = kvs_model_use_group(model, group, NULL)) != KVS_OK) goto out;
    }

    /* The decode instance's id, which the prefill ranks it talks to tell it from other decode
     * instances by: rank 0 draws it, the group takes it from rank 0. */
    uint64_t instance = 0;
    if (decode) {
        instance = draw_instance();
        if (group != NULL &&
            (st = kvs_tpgroup_broadcast(group, &instance, sizeof(instance))) != KVS_OK)
            goto out;
    }

    if (prefill || decode) {
        kvs_plumbing_config_t plc = {.side = prefill ? KVS_SIDE_PREFILL : KVS_SIDE_DECODE,
                                     .rank = c.rank,
                                     .geo = geo,
                                     .registry = c.registry,
                                     .serve_registry = prefill && c.serve_registry && c.rank == 0,
                                     .await_registrations = 1,
                                     .bind = c.bind,
                                     .data = c.data,
                                     .net_device = c.net_device,
                                     .mem = pc.mem,
                                     .device = pc.device,
                                     .liveness_timeout_ns = c.liveness_timeout_ns,
                                     .write_mode = KVS_WRITE_AUTO,
                                     .max_instances = c.max_peer_instances,
                                     .idle_ns = c.peer_idle_ns,
                                     .instance = instance};
        if ((st = kvs_plumbing_create(&plc, pool, &pl)) != KVS_OK) goto out;
    }

    kvs_llm_config_t lc = {.role = c.role,
                           .model = model,
                           .pool = pool,
                           .group = group,
                           .sender = pl.sender,
                           .receiver = pl.receiver,
                           .receivers = {&pl, room_receiver, receivers_progress, receivers_metrics},
                           .chunk_tokens = c.chunk_tokens,
                           .batch_tokens = c.batch_tokens,
                           .max_running = c.max_running,
                           .max_context = c.max_context,
                           .radix = c.radix};
    if ((st = kvs_llm_create(&lc, &llm)) != KVS_OK) goto out;
    io.llm = llm;
    io.pl = &pl;
    io.t0 = t0;
    io.max_prompt = c.max_context - 1;
    if (c.rank == 0) {
        io.ids = kvs_malloc((size_t) io.max_prompt * sizeof(uint32_t));
        if (io.ids == NULL) {
            st = KVS_ERR_NOMEM;
            goto out;
        }
    }
    res.load_s = io.load_s = (double) (kvs_now_ns() - t0) / 1e9;
    if (c.rank == 0) {
        kvs_rank_line_event_t ready = {
            .kind = KVS_RANK_LINE_EV_READY, .role = c.role, .tp = tp, .load_s = res.load_s};
        out_event(c.out_fd, &ready);
    }

    long idle_us = IDLE_SLEEP_US;
    uint64_t last_work = kvs_now_ns();
    peers_seen_t peers = {0};
    for (;;) {
        int want_quit = 0;
        if (c.rank == 0) {
            if (!io.eof) read_input(&io);
            if (io.quitting) {
                uint32_t live = kvs_llm_live(llm);
                want_quit = live == 0 || kvs_now_ns() >= io.quit_at;
                if (want_quit && live > 0)
                    kvs_warn("%s rank 0: quitting with %u requests still live", role_str(c.role),
                             live);
            }
        }
        uint32_t work = pl.registry ? kvs_registry_serve(pl.registry, 0) : 0, stepped = 0;
        int quit = 0;
        if ((st = kvs_llm_step(llm, want_quit, &quit, &stepped)) != KVS_OK) {
            kvs_error("%s rank %u: the instance cannot go on: %s", role_str(c.role), c.rank,
                      kvs_status_str(st));
            if (c.rank == 0) out_error(c.out_fd, "TP group failed: ", kvs_status_str(st));
            break;
        }
        work += stepped;
        kvs_llm_event_t ev;
        while (c.rank == 0 && kvs_llm_next_event(llm, &ev) == KVS_OK) write_event(c.out_fd, &ev);
        if (c.rank == 0) report_peers(&c, &pl, &peers);
        if (c.rank == 0) answer_held(&io);
        if (quit) break;
        if (work != 0) {
            last_work = kvs_now_ns();
            idle_us = IDLE_SLEEP_US;
        } else if (kvs_plumbing_copies_in_flight(&pl) > 0 && kvs_now_ns() - last_work < HOT_NS) {
            /* A write or scatter runs, and its completion wakes no wait: poll for it. Each
             * sleep here was part of every handoff's latency (about 0.1 ms of the 0.5 ms from
             * a prompt computed to its KV on decode, on one GPU). */
            sched_yield();
        } else {
            idle_wait(&io, &pl, c.rank == 0, idle_us);
            const long cap = kvs_llm_live(llm) > 0 ? LIVE_SLEEP_MAX : IDLE_SLEEP_MAX;
            if (kvs_now_ns() - last_work > HOT_NS && idle_us < cap)
                idle_us = idle_us * 2 < cap ? idle_us * 2 : cap;
            else if (idle_us > cap)
                idle_us = cap;
        }
    }
    /* Late acknowledgements and repeats from the other side. */
    for (uint64_t end = kvs_now_ns() + DRAIN_NS;
         (pl.sender || pl.receiver || pl.ninsts) && kvs_now_ns() < end;) {
        if (kvs_plumbing_progress(&pl) == 0) sleep_us(200);
    }
    kvs_llm_stats(llm, &res.stats);
    kvs_plumbing_metrics(&pl, &res.metrics);
    res.wall_s = (double) (kvs_now_ns() - t0) / 1e9;
    write_stats(&c, &res, 1);
    if (result_p) *result_p = res;
out:
    if (st != KVS_OK && llm == NULL)
        kvs_error("%s rank %u of TP %u could not start: %s", role_str(c.role), c.rank, tp,
                  kvs_status_str(st));
    kvs_llm_destroy(llm);
    kvs_plumbing_destroy(&pl);
    kvs_tpgroup_leave(group);
    kvs_pool_destroy(pool);
    kvs_model_destroy(model);
    for (uint32_t i = 0; i < io.nheld; i++) kvs_free(io.held[i]);
    kvs_free(io.held);
    kvs_free(io.buf);
    kvs_free(io.ids);
    return st;
}
