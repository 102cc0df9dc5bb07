/* The rank backend (kvstage/rank_backend.h) against a scripted rank 0 on two pipes: the lines it
 * writes (submit with the first stop id as EOS, stop, match, stats, quit), and what it makes of
 * rank 0's events (tokens, finish mapping, a stop id beyond the first, refusals, KV bytes, match
 * and stats answers in order, the end of rank 0), and the move to a restarted instance's rank 0. */
#include "kvs_test.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/clock.h"
#include "http/rank_backend.h"

#define BPT 512 /* KV bytes per token of the pretend model */

typedef struct {
    pthread_mutex_t mu;
    uint32_t tokens[64], choice[64];
    uint32_t ntokens;
    int done;
    kvs_server_done_t d;
    int has_lp[64];
    kvs_logprobs_t lp[64];
    uint32_t prompt_at[8], nprompt; /* on_prompt calls */
    kvs_logprobs_t plp[8];
} rec_t;

static void on_token(void *arg, uint32_t choice, uint32_t token, const char *piece, size_t len,
                     const kvs_logprobs_t *lp)
{
    (void) piece, (void) len;
    rec_t *r = arg;
    pthread_mutex_lock(&r->mu);
    if (r->ntokens < 64) {
        r->choice[r->ntokens] = choice;
        r->has_lp[r->ntokens] = lp != NULL;
        if (lp) r->lp[r->ntokens] = *lp;
        r->tokens[r->ntokens++] = token;
    }
    pthread_mutex_unlock(&r->mu);
}

static void on_prompt(void *arg, uint32_t index, uint32_t token, const kvs_logprobs_t *lp)
{
    (void) token;
    rec_t *r = arg;
    pthread_mutex_lock(&r->mu);
    if (r->nprompt < 8) {
        r->prompt_at[r->nprompt] = index;
        r->plp[r->nprompt++] = *lp;
    }
    pthread_mutex_unlock(&r->mu);
}

static void on_done(void *arg, const kvs_server_done_t *d)
{
    rec_t *r = arg;
    pthread_mutex_lock(&r->mu);
    r->done++;
    r->d = *d;
    pthread_mutex_unlock(&r->mu);
}

typedef struct {
    int req[2]; /* the backend writes [1]; rank 0 (the test) reads [0] */
    int ev[2];  /* rank 0 writes [1]; the backend reads [0] */
    kvs_rank_backend_t *b;
    kvs_server_backend_t ops;
    char buf[8192];
    size_t len;
} fix_t;

static void fix_open_t(fix_t *f, kvs_server_role_t role, const char *bootstrap, uint32_t timeout_ms)
{
    memset(f, 0, sizeof(*f));
    assert_int_equal(pipe(f->req), 0);
    assert_int_equal(pipe(f->ev), 0);
    kvs_rank_backend_config_t c = {.in_fd = f->req[1],
                                   .out_fd = f->ev[0],
                                   .role = role,
                                   .bootstrap = bootstrap,
                                   .page_size = 4,
                                   .kv_bytes_per_token = BPT,
                                   .vocab = 100,
                                   .text_vocab = 90,
                                   .max_context = 24,
                                   .query_timeout_ms = timeout_ms};
    assert_int_equal(kvs_rank_backend_create(&c, &f->b), KVS_OK);
    f->ops = kvs_rank_backend_ops(f->b);
}

static void fix_open(fix_t *f, kvs_server_role_t role, const char *bootstrap)
{
    fix_open_t(f, role, bootstrap, 5000);
}

static void fix_close(fix_t *f)
{
    kvs_rank_backend_destroy(f->b);
    close(f->req[0]);
    if (f->ev[1] >= 0) close(f->ev[1]);
}

static void say(fix_t *f, const char *line)
{
    size_t n = strlen(line);
    assert_int_equal(write(f->ev[1], line, n), (ssize_t) n);
}

/* The next line the backend wrote to rank 0 (without the newline); "" at end of file. */
static void next_line(fix_t *f, char *out, size_t cap)
{
    uint64_t end = kvs_now_ns() + 5000000000ull;
    for (;;) {
        char *nl = memchr(f->buf, '\n', f->len);
        if (nl != NULL) {
            size_t n = (size_t) (nl - f->buf);
            snprintf(out, cap, "%.*s", (int) n, f->buf);
            memmove(f->buf, nl + 1, f->len - n - 1);
            f->len -= n + 1;
            return;
        }
        assert_true(kvs_now_ns() < end);
        struct pollfd pfd = {f->req[0], POLLIN, 0};
        if (poll(&pfd, 1, 100) <= 0) continue;
        ssize_t r = read(f->req[0], f->buf + f->len, sizeof(f->buf) - f->len);
        if (r == 0) {
            out[0] = '\0';
            return;
        }
        assert_true(r > 0);
        f->len += (size_t) r;
    }
}

static int wait_done(rec_t *r, int n)
{
    uint64_t end = kvs_now_ns() + 5000000000ull;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        int done = r->done;
        pthread_mutex_unlock(&r->mu);
        if (done >= n) return done;
        if (kvs_now_ns() > end) return done;
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
}

static const kvs_logit_bias_t g_bias[2] = {{3, -1.5f}, {99, 100}};

static kvs_server_request_t request(uint64_t room, kvs_server_role_t role, const uint32_t *prompt,
                                    uint32_t n, const uint32_t *stops, uint32_t nstops)
{
    return (kvs_server_request_t){.room = room,
                                  .role = role,
                                  .prompt = prompt,
                                  .prompt_len = n,
                                  .max_tokens = 5,
                                  .sampling = {.temperature = 0.5f,
                                               .top_p = 0.9f,
                                               .top_k = 20,
                                               .min_p = 0.125f,
                                               .presence_penalty = 0.5f,
                                               .frequency_penalty = -1,
                                               .repetition_penalty = 1.5f,
                                               .bias = g_bias,
                                               .n_bias = 2},
                                  .seed = 7,
                                  .stop_ids = stops,
                                  .n_stop_ids = nstops,
                                  .n = 1};
}

static void test_lines_and_events(void **state)
{
    (void) state;
    fix_t f;
    fix_open(&f, KVS_SERVER_ROLE_DECODE, "tcp://p:1");
    rec_t r;
    memset(&r, 0, sizeof(r));
    pthread_mutex_init(&r.mu, NULL);
    kvs_server_sink_t sink = {on_token, on_done, &r, NULL};
    const uint32_t prompt[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, stops[2] = {99, 42};

    /* Not ready yet: nothing is taken. */
    assert_int_equal(kvs_rank_backend_wait_ready(f.b, 20), KVS_ERR_TIMEOUT);
    assert_int_not_equal(f.ops.health(f.ops.ctx), KVS_OK);
    kvs_server_request_t q = request(5, KVS_SERVER_ROLE_DECODE, prompt, 10, stops, 2);
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_ERR_STATE);
    say(&f, "{\"event\":\"ready\",\"role\":\"decode\",\"tp\":1,\"load_s\":0.1}\n");
    assert_int_equal(kvs_rank_backend_wait_ready(f.b, 2000), KVS_OK);
    assert_int_equal(f.ops.health(f.ops.ctx), KVS_OK);

    /* What the backend refuses itself. */
    kvs_server_request_t bad = request(6, KVS_SERVER_ROLE_PREFILL, prompt, 10, stops, 2);
    assert_int_equal(f.ops.submit(f.ops.ctx, &bad, &sink), KVS_ERR_UNSUPPORTED);
    bad = request(6, KVS_SERVER_ROLE_DECODE, prompt, 10, stops, 2);
    bad.bootstrap = "tcp://other:2";
    assert_int_equal(f.ops.submit(f.ops.ctx, &bad, &sink), KVS_ERR_INVALID);
    bad.bootstrap = NULL;
    bad.max_tokens = 15; /* 10 + 15: one above the context */
    assert_int_equal(f.ops.submit(f.ops.ctx, &bad, &sink), KVS_ERR_INVALID);
    uint32_t outside[2] = {1, 100};
    bad = request(6, KVS_SERVER_ROLE_DECODE, outside, 2, stops, 2);
    assert_int_equal(f.ops.submit(f.ops.ctx, &bad, &sink), KVS_ERR_INVALID);
    static uint32_t longp[20]; /* with its 5 new tokens one above the context */
    bad = request(6, KVS_SERVER_ROLE_DECODE, longp, 20, stops, 2);
    assert_int_equal(f.ops.submit(f.ops.ctx, &bad, &sink), KVS_ERR_INVALID);
    const kvs_logit_bias_t far[1] = {{100, 1}}; /* outside the vocabulary of 100 */
    bad = request(6, KVS_SERVER_ROLE_DECODE, prompt, 10, stops, 2);
    bad.sampling.bias = far;
    bad.sampling.n_bias = 1;
    assert_int_equal(f.ops.submit(f.ops.ctx, &bad, &sink), KVS_ERR_INVALID);
    bad.sampling.n_bias = 0;
    bad.sampling.min_p = 2;
    assert_int_equal(f.ops.submit(f.ops.ctx, &bad, &sink), KVS_ERR_INVALID);

    /* A submit line: the first stop id is rank 0's EOS. */
    q.bootstrap = "tcp://p:1";
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_ERR_INVALID); /* live */
    char line[512];
    next_line(&f, line, sizeof(line));
    assert_string_equal(
        line, "submit 5 1 5 0.5 0.899999976 20 0.125 0.5 -1 1.5 7 99 -1 0 2 3 -1.5 99 100 10 "
              "1 2 3 4 5 6 7 8 9 10");

    /* Tokens, then the second stop id: reported, a stop sent, later tokens dropped. */
    say(&f, "{\"event\":\"token\",\"room\":5,\"token\":11,\"index\":0}\n"
            "{\"event\":\"token\",\"room\":5,\"token\":42,\"index\":1}\n"
            "{\"event\":\"token\",\"room\":5,\"token\":12,\"index\":2}\n");
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "stop 5");
    assert_int_equal(f.ops.cancel(f.ops.ctx, 5, KVS_SERVER_CHOICE_ALL),
                     KVS_OK); /* no second stop line follows */
    char done[512];
    uint64_t now = kvs_now_ns();
    snprintf(done, sizeof(done),
             "{\"event\":\"done\",\"room\":5,\"status\":\"ok\",\"finish\":\"stop\","
             "\"prompt_len\":10,\"cached\":4,\"generated\":3,\"submitted_ns\":1,"
             "\"admitted_ns\":2,\"prefilled_ns\":0,\"kv_ready_ns\":3,\"first_token_ns\":%llu,"
             "\"done_ns\":%llu}\n",
             (unsigned long long) now, (unsigned long long) now + 10);
    say(&f, done);
    assert_int_equal(wait_done(&r, 1), 1);
    assert_int_equal(r.ntokens, 2);
    assert_int_equal(r.tokens[0], 11);
    assert_int_equal(r.tokens[1], 42);
    assert_int_equal(r.d.finish, KVS_SERVER_FINISH_STOP);
    assert_int_equal(r.d.generated, 2);
    assert_int_equal(r.d.prompt_tokens, 10);
    assert_int_equal(r.d.cached_tokens, 4);
    assert_int_equal(r.d.kv_bytes, (3 - 1) * 4 * BPT); /* pages 3, the cached one not moved */
    assert_true(r.d.ttft_ns > 0);
    assert_int_equal(f.ops.cancel(f.ops.ctx, 5, KVS_SERVER_CHOICE_ALL), KVS_ERR_NOT_FOUND);

    /* A refusal by rank 0, and the finish names. */
    static const struct {
        const char *finish, *status;
        kvs_server_finish_t want;
    } cases[] = {{"length", "ok", KVS_SERVER_FINISH_LENGTH},
                 {"eos", "ok", KVS_SERVER_FINISH_STOP},
                 {"error", "aborted", KVS_SERVER_FINISH_ERROR},
                 {"stop", "invalid argument", KVS_SERVER_FINISH_ERROR}};
    for (uint64_t i = 0; i < 5; i++) {
        q.room = 10 + i;
        assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
        next_line(&f, line, sizeof(line));
        assert_true(strncmp(line, "submit 1", 8) == 0);
        if (i == 4) {
            say(&f, "{\"event\":\"rejected\",\"room\":14,\"status\":\"invalid argument\"}\n");
        } else {
            snprintf(done, sizeof(done),
                     "{\"event\":\"done\",\"room\":%llu,\"status\":\"%s\",\"finish\":\"%s\","
                     "\"prompt_len\":10,\"cached\":0}\n",
                     (unsigned long long) q.room, cases[i].status, cases[i].finish);
            say(&f, done);
        }
        assert_int_equal(wait_done(&r, 2 + (int) i), 2 + (int) i);
        kvs_server_finish_t want = i == 4 ? KVS_SERVER_FINISH_ERROR : cases[i].want;
        assert_int_equal(r.d.finish, want);
        if (i == 2) assert_int_equal(r.d.status, KVS_ERR_ABORTED);
        if (i >= 3) assert_int_equal(r.d.status, KVS_ERR_INVALID);
    }

    /* A room that is live when rank 0 goes away ends with an error; nothing is taken after. */
    q.room = 20;
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
    next_line(&f, line, sizeof(line));
    close(f.ev[1]);
    f.ev[1] = -1;
    assert_int_equal(wait_done(&r, 7), 7);
    assert_int_equal(r.d.finish, KVS_SERVER_FINISH_ERROR);
    assert_int_equal(r.d.status, KVS_ERR_IO);
    assert_true(kvs_rank_backend_ended(f.b));
    assert_int_not_equal(f.ops.health(f.ops.ctx), KVS_OK);
    q.room = 21; /* refused as not ready (the server's 503), saying why */
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_ERR_STATE);
    char why[128];
    f.ops.health_detail(f.ops.ctx, why, sizeof(why));
    assert_string_equal(why, "the instance has ended");
    uint32_t cached = 77;
    assert_int_not_equal(f.ops.match(f.ops.ctx, prompt, 10, &cached), KVS_OK);
    fix_close(&f);
    pthread_mutex_destroy(&r.mu);
    kvs_assert_no_leaks();
}

typedef struct {
    fix_t *f;
    uint32_t cached[2];
    kvs_status_t st[2];
    kvs_server_backend_stats_t stats;
} asker_t;

static void *asker_main(void *arg)
{
    asker_t *a = arg;
    static const uint32_t p1[3] = {1, 2, 3}, p2[9] = {9, 8, 7, 6, 5, 4, 3, 2, 1};
    a->st[0] = a->f->ops.match(a->f->ops.ctx, p1, 3, &a->cached[0]);
    a->f->ops.stats(a->f->ops.ctx, &a->stats);
    a->st[1] = a->f->ops.match(a->f->ops.ctx, p2, 9, &a->cached[1]);
    return NULL;
}

/* match and stats wait for rank 0's answers, taken in order; quit closes the pipe after it. */
static void test_questions_and_quit(void **state)
{
    (void) state;
    fix_t f;
    fix_open(&f, KVS_SERVER_ROLE_NONE, NULL);
    say(&f, "{\"event\":\"ready\",\"role\":\"colocated\",\"tp\":1,\"load_s\":0.1}\n");
    assert_int_equal(kvs_rank_backend_wait_ready(f.b, 2000), KVS_OK);
    asker_t a = {.f = &f};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, asker_main, &a), 0);
    char line[512];
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "match 3 1 2 3");
    /* The exit-time stats line answers nothing; a stats line with "final":false does. */
    say(&f, "{\"event\":\"stats\",\"role\":\"colocated\",\"rank\":1,\"final\":true}\n"
            "{\"event\":\"match\",\"cached\":0,\"prompt_len\":3}\n");
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "stats");
    say(&f, "{\"event\":\"stats\",\"role\":\"colocated\",\"rank\":0,\"chunks\":3,"
            "\"bytes_moved\":4096,\"retries\":2,\"rejected\":1,\"ring_used\":5,"
            "\"ring_capacity\":6,\"queued\":7,\"running\":2,\"final\":false}\n");
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "match 9 9 8 7 6 5 4 3 2 1");
    say(&f, "{\"event\":\"match\",\"cached\":8,\"prompt_len\":9}\n");
    pthread_join(th, NULL);
    assert_int_equal(a.st[0], KVS_OK);
    assert_int_equal(a.cached[0], 0);
    assert_int_equal(a.st[1], KVS_OK);
    assert_int_equal(a.cached[1], 8);
    assert_int_equal(a.stats.metrics.bytes, 4096);
    assert_int_equal(a.stats.metrics.chunks, 3);
    assert_int_equal(a.stats.metrics.retries, 2);
    assert_int_equal(a.stats.metrics.rejected, 1);
    assert_int_equal(a.stats.metrics.ring_used, 5);
    assert_int_equal(a.stats.metrics.ring_capacity, 6);
    assert_int_equal(a.stats.queued, 7);
    assert_int_equal(a.stats.running, 2);
    /* A prompt that leaves the context no room for a token is not asked about. */
    static const uint32_t longp[24];
    uint32_t cached = 5;
    assert_int_equal(f.ops.match(f.ops.ctx, longp, 24, &cached), KVS_OK);
    assert_int_equal(cached, 0);
    /* Colocated: requests for a role are not taken. */
    rec_t r;
    memset(&r, 0, sizeof(r));
    kvs_server_sink_t sink = {on_token, on_done, &r, NULL};
    kvs_server_request_t q = request(1, KVS_SERVER_ROLE_DECODE, longp, 3, NULL, 0);
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_ERR_UNSUPPORTED);

    kvs_rank_backend_quit(f.b);
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "quit");
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, ""); /* the pipe was closed */
    assert_int_not_equal(f.ops.health(f.ops.ctx), KVS_OK);
    q.role = KVS_SERVER_ROLE_NONE;
    assert_int_not_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
    assert_int_equal(r.done, 0);
    fix_close(&f);
    kvs_assert_no_leaks();
}

/* A question nobody answers in time fails alone, and its late answer goes nowhere. */
static void test_question_timeout(void **state)
{
    (void) state;
    fix_t f;
    fix_open_t(&f, KVS_SERVER_ROLE_NONE, NULL, 500);
    say(&f, "{\"event\":\"ready\",\"role\":\"colocated\",\"tp\":1,\"load_s\":0.1}\n");
    assert_int_equal(kvs_rank_backend_wait_ready(f.b, 2000), KVS_OK);
    static const uint32_t p[2] = {4, 5};
    uint32_t cached = 3;
    assert_int_equal(f.ops.match(f.ops.ctx, p, 2, &cached), KVS_ERR_TIMEOUT);
    assert_int_equal(cached, 3);
    char line[128];
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "match 2 4 5");
    say(&f, "{\"event\":\"match\",\"cached\":1,\"prompt_len\":2}\n");
    asker_t a = {.f = &f};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, asker_main, &a), 0);
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "match 3 1 2 3");
    say(&f, "{\"event\":\"match\",\"cached\":2,\"prompt_len\":3}\n");
    next_line(&f, line, sizeof(line));
    say(&f, "{\"event\":\"stats\",\"final\":false,\"queued\":1}\n");
    next_line(&f, line, sizeof(line));
    say(&f, "{\"event\":\"match\",\"cached\":4,\"prompt_len\":9}\n");
    pthread_join(th, NULL);
    assert_int_equal(a.cached[0], 2);
    assert_int_equal(a.cached[1], 4);
    assert_int_equal(a.stats.queued, 1);
    fix_close(&f);
    kvs_assert_no_leaks();
}

static void *stats_main(void *arg)
{
    asker_t *a = arg;
    a->f->ops.stats(a->f->ops.ctx, &a->stats);
    return NULL;
}

/* The stats as an answer to `stats` from the fixture's rank 0, with the line it answers. */
static kvs_server_backend_stats_t answered_stats(fix_t *f, const char *answer)
{
    asker_t a = {.f = f};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, stats_main, &a), 0);
    char line[64];
    next_line(f, line, sizeof(line));
    assert_string_equal(line, "stats");
    say(f, answer);
    pthread_join(th, NULL);
    return a.stats;
}

/* New pipes for the fixture's rank 0 (a restarted instance), handed to the backend. */
static void fix_restart(fix_t *f, const char *why)
{
    int req[2], ev[2];
    assert_int_equal(pipe(req), 0);
    assert_int_equal(pipe(ev), 0);
    assert_int_equal(kvs_rank_backend_restart(f->b, req[1], ev[0], why), KVS_OK);
    close(f->req[0]);
    if (f->ev[1] >= 0) close(f->ev[1]);
    f->req[0] = req[0];
    f->ev[1] = ev[1];
    f->len = 0;
}

/* --restart-ranks: the backend moves to a new rank 0; rooms of the old one fail (IO when it
 * ended, ABORTED when it was still there), health says it restarts until the new one is ready,
 * counters carry on, gauges start again, and the restarts are counted. */
static void test_restart(void **state)
{
    (void) state;
    fix_t f;
    fix_open(&f, KVS_SERVER_ROLE_NONE, NULL);
    say(&f, "{\"event\":\"ready\",\"role\":\"colocated\",\"tp\":2,\"load_s\":0.1}\n");
    assert_int_equal(kvs_rank_backend_wait_ready(f.b, 2000), KVS_OK);
    kvs_server_backend_stats_t st = answered_stats(
        &f, "{\"event\":\"stats\",\"chunks\":3,\"bytes_moved\":4096,\"live_rooms\":2,"
            "\"queued\":7,\"running\":2,\"final\":false}\n");
    assert_int_equal(st.metrics.bytes, 4096);
    assert_int_equal(st.restarts, 0);
    rec_t r;
    memset(&r, 0, sizeof(r));
    pthread_mutex_init(&r.mu, NULL);
    kvs_server_sink_t sink = {on_token, on_done, &r, NULL};
    static const uint32_t prompt[3] = {1, 2, 3};
    kvs_server_request_t q = request(1, KVS_SERVER_ROLE_NONE, prompt, 3, NULL, 0);
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
    char line[512];
    next_line(&f, line, sizeof(line));

    /* Rank 0 is killed: its room fails; the backend moves to the next instance. */
    close(f.ev[1]);
    f.ev[1] = -1;
    assert_int_equal(wait_done(&r, 1), 1);
    assert_int_equal(r.d.status, KVS_ERR_IO);
    fix_restart(&f, "rank 1 was killed by signal 9");
    assert_false(kvs_rank_backend_ended(f.b));
    assert_int_not_equal(f.ops.health(f.ops.ctx), KVS_OK);
    char why[256];
    f.ops.health_detail(f.ops.ctx, why, sizeof(why));
    assert_string_equal(why,
                        "the instance is restarting (restart 1; rank 1 was killed by signal 9)");
    q.room = 2;
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_ERR_STATE);
    f.ops.stats(f.ops.ctx, &st); /* no rank 0 to ask: the counters so far, no gauges */
    assert_int_equal(st.metrics.bytes, 4096);
    assert_int_equal(st.metrics.chunks, 3);
    assert_int_equal(st.metrics.live_rooms, 0);
    assert_int_equal(st.queued, 0);
    assert_int_equal(st.running, 0);
    assert_int_equal(st.restarts, 1);

    /* The new rank 0 serves. */
    say(&f, "{\"event\":\"ready\",\"role\":\"colocated\",\"tp\":2,\"load_s\":0.1}\n");
    assert_int_equal(kvs_rank_backend_wait_ready(f.b, 2000), KVS_OK);
    assert_int_equal(f.ops.health(f.ops.ctx), KVS_OK);
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
    next_line(&f, line, sizeof(line));
    assert_true(strncmp(line, "submit 2 ", 9) == 0);
    say(&f, "{\"event\":\"token\",\"room\":2,\"token\":11,\"index\":0}\n"
            "{\"event\":\"done\",\"room\":2,\"status\":\"ok\",\"finish\":\"length\","
            "\"prompt_len\":3,\"cached\":0}\n");
    assert_int_equal(wait_done(&r, 2), 2);
    assert_int_equal(r.d.finish, KVS_SERVER_FINISH_LENGTH);
    assert_int_equal(r.d.generated, 1);
    st =
        answered_stats(&f, "{\"event\":\"stats\",\"chunks\":1,\"bytes_moved\":100,\"live_rooms\":1,"
                           "\"queued\":0,\"running\":1,\"final\":false}\n");
    assert_int_equal(st.metrics.bytes, 4196);
    assert_int_equal(st.metrics.chunks, 4);
    assert_int_equal(st.metrics.live_rooms, 1);
    assert_int_equal(st.running, 1);
    assert_int_equal(st.restarts, 1);

    /* Restarted while rank 0 is still there (another rank died): its room is aborted. */
    q.room = 3;
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
    next_line(&f, line, sizeof(line));
    fix_restart(&f, "rank 1 exited with status 1");
    assert_int_equal(wait_done(&r, 3), 3);
    assert_int_equal(r.d.finish, KVS_SERVER_FINISH_ERROR);
    assert_int_equal(r.d.status, KVS_ERR_ABORTED);
    f.ops.stats(f.ops.ctx, &st);
    assert_int_equal(st.metrics.bytes, 4196);
    assert_int_equal(st.restarts, 2);
    fix_close(&f);
    pthread_mutex_destroy(&r.mu);
    kvs_assert_no_leaks();
}

/* Logprobs asked: LOGPROBS and PROMPT_LOGPROBS on the submit line (never prompt logprobs for a
 * decode side: it has no prompt logits), and rank 0's prompt and token events reach the sink
 * with theirs. */
static void test_logprobs(void **state)
{
    (void) state;
    fix_t f;
    fix_open(&f, KVS_SERVER_ROLE_NONE, NULL);
    rec_t r;
    memset(&r, 0, sizeof(r));
    pthread_mutex_init(&r.mu, NULL);
    kvs_server_sink_t sink = {on_token, on_done, &r, on_prompt};
    const uint32_t prompt[3] = {1, 2, 3}, stops[1] = {99};
    say(&f, "{\"event\":\"ready\",\"role\":\"colocated\",\"tp\":1,\"load_s\":0.1}\n");
    assert_int_equal(kvs_rank_backend_wait_ready(f.b, 2000), KVS_OK);
    kvs_server_request_t q = request(8, KVS_SERVER_ROLE_NONE, prompt, 3, stops, 1);
    q.sampling = (kvs_sample_params_t){.top_p = 1};
    q.logprobs = 1;
    q.top_logprobs = 2;
    q.prompt_logprobs = 1;
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
    char line[512];
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "submit 8 1 5 0 1 0 0 0 0 0 7 99 2 1 0 3 1 2 3");
    say(&f, "{\"event\":\"prompt\",\"room\":8,\"token\":2,\"index\":1,\"logprob\":-2.5,"
            "\"top\":\"7 -0.25 2 -2.5\"}\n"
            "{\"event\":\"prompt\",\"room\":8,\"token\":3,\"index\":2,\"logprob\":-1,"
            "\"top\":\"3 -1 4 -3\"}\n"
            "{\"event\":\"token\",\"room\":8,\"token\":5,\"index\":0,\"logprob\":-0.125,"
            "\"top\":\"5 -0.125 6 -4\"}\n"
            "{\"event\":\"done\",\"room\":8,\"status\":\"ok\",\"finish\":\"length\","
            "\"prompt_len\":3}\n");
    assert_int_equal(wait_done(&r, 1), 1);
    assert_int_equal(r.nprompt, 2);
    assert_int_equal(r.prompt_at[0], 1);
    assert_true(r.plp[0].logprob == -2.5f && r.plp[0].n_top == 2 && r.plp[0].top[0].token == 7);
    assert_int_equal(r.prompt_at[1], 2);
    assert_true(r.plp[1].top[1].logprob == -3.0f);
    assert_int_equal(r.ntokens, 1);
    assert_true(r.has_lp[0] && r.lp[0].logprob == -0.125f && r.lp[0].top[1].token == 6);
    fix_close(&f);

    /* A decode side asks rank 0 for the generated tokens' logprobs only. */
    fix_open(&f, KVS_SERVER_ROLE_DECODE, NULL);
    say(&f, "{\"event\":\"ready\",\"role\":\"decode\",\"tp\":1,\"load_s\":0.1}\n");
    assert_int_equal(kvs_rank_backend_wait_ready(f.b, 2000), KVS_OK);
    q.role = KVS_SERVER_ROLE_DECODE;
    q.top_logprobs = 0;
    assert_int_equal(f.ops.submit(f.ops.ctx, &q, &sink), KVS_OK);
    next_line(&f, line, sizeof(line));
    assert_string_equal(line, "submit 8 1 5 0 1 0 0 0 0 0 7 99 0 0 0 3 1 2 3");
    fix_close(&f);
    pthread_mutex_destroy(&r.mu);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lines_and_events),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_questions_and_quit),
        cmocka_unit_test(test_question_timeout),
        cmocka_unit_test(test_restart),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
