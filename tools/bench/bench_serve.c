/* `kvstage bench serve`: starts a deployment (`kvstage serve` processes, and `kvstage router`
 * for the disaggregated one), runs U users at once for each U of the sweep, each sending its
 * requests one after another as streamed completions with a prompt no other request shares (so
 * that every prompt is computed and moved whole), and reports per deployment and U the client's
 * time to first token (p50, p99) and the output tokens/s per user (a request's tokens over its
 * time) and in total (every token over the level's wall time). The deployments run one after
 * the other, so that they do not share the CPU. */
#include "bench/bench_serve.h"
#include "bench/bench_util.h"

#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/args.h"
#include "common/instance.h"
#include "common/json.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "model/gguf.h"
#include "common/serve_client.h"
#include "common/serve_signal.h"

#define MAX_LEVELS 8
#define MAX_USERS  64

typedef struct {
    const char *model_path, *seeded;
    uint32_t prefill_tp, decode_tp, requests, max_tokens, prompt_words;
    uint32_t levels[MAX_LEVELS], nlevels;
} opts_t;

typedef struct {
    const char *label;
    uint32_t users, requests, failed;
    double ttft_p50, ttft_p99, tok_s_user, tok_s_total, wall_s;
} row_t;

typedef struct {
    const char *url, *label;
    const opts_t *o;
    uint32_t user, level;
    kvs_stream_t *res; /* [requests] */
    int failed;
} user_t;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

/* The q-quantile of n sorted values (nearest rank). */
static double quantile(const double *v, uint32_t n, double q)
{
    if (n == 0) return 0;
    uint32_t i = (uint32_t) (q * n + 0.999999);
    if (i < 1) i = 1;
    return v[(i > n ? n : i) - 1];
}

/* A prompt of about `words` words that starts differently for every request. */
static char *prompt_of(const user_t *u, uint32_t k)
{
    static const char *const words[] = {"the",  "river", "runs",     "past", "an",     "old",
                                        "mill", "where", "children", "once", "played", "under",
                                        "tall", "trees", "and",      "sang", "songs",  "about"};
    size_t cap = 128 + (size_t) u->o->prompt_words * 12;
    char *p = kvs_malloc(cap);
    if (p == NULL) return NULL;
    size_t at = (size_t) snprintf(p, cap, "Story %s-%u-%u-%u:", u->label, u->level, u->user, k);
    for (uint32_t w = 0; w < u->o->prompt_words && at + 16 < cap; w++)
        at +=
            (size_t) snprintf(p + at, cap - at, " %s",
                              words[(w * 7 + u->user * 3 + k) % (sizeof(words) / sizeof(*words))]);
    return p;
}

static void *user_main(void *arg)
{
    user_t *u = arg;
    for (uint32_t k = 0; k < u->o->requests; k++) {
        char *prompt = prompt_of(u, k);
        json_t *body = prompt ? json_pack("{s:s, s:i, s:f, s:b, s:{s:b}}", "prompt", prompt,
                                          "max_tokens", (int) u->o->max_tokens, "temperature", 0.0,
                                          "stream", 1, "stream_options", "include_usage", 1)
                              : NULL;
        kvs_free(prompt);
        json_malloc_t jm;
        json_free_t jf;
        json_get_alloc_funcs(&jm, &jf);
        char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
        json_decref(body);
        if (text == NULL || kvs_stream_request(u->url, "/v1/completions", text, &u->res[k]) != 0) {
            if (u->failed++ == 0)
                fprintf(stderr, "error: %s, user %u: %s\n", u->label, u->user,
                        text ? u->res[k].error : "out of memory");
        }
        if (text) jf(text);
    }
    return NULL;
}

/* One level: `users` users at once against url. */
static int run_level(const char *url, const char *label, const opts_t *o, uint32_t users,
                     row_t *row)
{
    user_t us[MAX_USERS];
    pthread_t th[MAX_USERS];
    memset(us, 0, sizeof(us));
    memset(row, 0, sizeof(*row));
    row->label = label;
    row->users = users;
    int rc = 0;
    uint32_t started = 0;
    for (uint32_t i = 0; i < users; i++) {
        us[i] = (user_t){.url = url, .label = label, .o = o, .user = i, .level = users};
        us[i].res = kvs_calloc(o->requests, sizeof(kvs_stream_t));
        if (us[i].res == NULL) rc = -1;
    }
    uint64_t t0 = kvs_now_ns();
    for (uint32_t i = 0; rc == 0 && i < users; i++, started++)
        if (pthread_create(&th[i], NULL, user_main, &us[i]) != 0) rc = -1;
    for (uint32_t i = 0; i < started; i++) pthread_join(th[i], NULL);
    row->wall_s = (double) (kvs_now_ns() - t0) / 1e9;
    double *ttft = kvs_calloc((size_t) users * o->requests + 1, sizeof(double));
    uint32_t n = 0;
    double tokens = 0, per_user = 0;
    for (uint32_t i = 0; i < users; i++) {
        row->failed += (uint32_t) us[i].failed;
        for (uint32_t k = 0; us[i].res && k < o->requests; k++) {
            const kvs_stream_t *s = &us[i].res[k];
            if (s->status != 200 || s->first_ns == 0) continue;
            if (ttft) ttft[n] = (double) (s->first_ns - s->t0) / 1e6;
            n++;
            tokens += (double) s->completion_tokens;
            per_user += (double) s->completion_tokens / ((double) (s->end_ns - s->t0) / 1e9);
        }
        kvs_free(us[i].res);
    }
    row->requests = n;
    if (ttft != NULL) {
        qsort(ttft, n, sizeof(double), cmp_double);
        row->ttft_p50 = quantile(ttft, n, 0.5);
        row->ttft_p99 = quantile(ttft, n, 0.99);
    }
    kvs_free(ttft);
    row->tok_s_user = n ? per_user / n : 0;
    row->tok_s_total = row->wall_s > 0 ? tokens / row->wall_s : 0;
    return rc != 0 || row->failed != 0 || ttft == NULL ? -1 : 0;
}

/* ---- deployments ---- */

static void model_args(const opts_t *o, char **args, int *n)
{
    if (o->seeded != NULL) {
        args[(*n)++] = "--seeded";
        args[(*n)++] = (char *) o->seeded;
    } else {
        args[(*n)++] = "--model";
        args[(*n)++] = (char *) o->model_path;
    }
}

/* Appends one server's command line: role, its TP size and (disaggregated) the peer's, the
 * model, a free port and the engine limits. */
static void server_args(const opts_t *o, const char *role, const char *tp, const char *peer_tp,
                        const char *bootstrap, const char *running, const char *max_model_len,
                        char **args, int *n)
{
    args[(*n)++] = "kvstage";
    args[(*n)++] = "serve";
    args[(*n)++] = "--role";
    args[(*n)++] = (char *) role;
    args[(*n)++] = "--tp";
    args[(*n)++] = (char *) tp;
    if (peer_tp != NULL) {
        args[(*n)++] = "--peer-tp";
        args[(*n)++] = (char *) peer_tp;
    }
    model_args(o, args, n);
    if (bootstrap != NULL) {
        args[(*n)++] = "--bootstrap";
        args[(*n)++] = (char *) bootstrap;
    }
    args[(*n)++] = "--port";
    args[(*n)++] = "0";
    args[(*n)++] = "--max-running";
    args[(*n)++] = (char *) running;
    args[(*n)++] = "--max-model-len";
    args[(*n)++] = (char *) max_model_len;
    args[*n] = NULL;
}

/* Starts the deployment (colocated, or router + prefill + decode); url_p: where clients go. */
static int deploy(const opts_t *o, int disaggregated, kvs_child_t *cs, const char **url_p)
{
    char ptp[16], dtp[16], running[16], max_model_len[16];
    snprintf(ptp, sizeof(ptp), "%u", o->prefill_tp);
    snprintf(dtp, sizeof(dtp), "%u", o->decode_tp);
    uint32_t top = 1;
    for (uint32_t i = 0; i < o->nlevels; i++)
        if (o->levels[i] > top) top = o->levels[i];
    snprintf(running, sizeof(running), "%u", top);
    /* Prompts of up to 1024 tokens and their completions. */
    snprintf(max_model_len, sizeof(max_model_len), "%u", 1024 + o->max_tokens);
    char *args[40];
    int n = 0;
    server_args(o, disaggregated ? "prefill" : "colocated", disaggregated ? ptp : dtp,
                disaggregated ? dtp : NULL, NULL, running, max_model_len, args, &n);
    cs[0].name = disaggregated ? "prefill server" : "colocated server";
    if (kvs_child_start(&cs[0], args) != 0 || kvs_child_wait_line(&cs[0], "serving on", 300) != 0)
        return -1;
    if (!disaggregated) {
        *url_p = cs[0].url;
        return 0;
    }
    n = 0;
    server_args(o, "decode", dtp, NULL, cs[0].bootstrap, running, max_model_len, args, &n);
    cs[1].name = "decode server";
    if (kvs_child_start(&cs[1], args) != 0 || kvs_child_wait_line(&cs[1], "serving on", 300) != 0)
        return -1;
    char *rargs[] = {"kvstage", "router", "--prefill", cs[0].url, "--decode",
                     cs[1].url, "--port", "0",         NULL};
    cs[2].name = "router";
    if (kvs_child_start(&cs[2], rargs) != 0 || kvs_child_wait_line(&cs[2], "routing on", 60) != 0)
        return -1;
    *url_p = cs[2].url;
    return 0;
}

static int parse_levels(const char *s, opts_t *o)
{
    o->nlevels = 0;
    for (const char *p = s;;) {
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (end == p || v == 0 || v > MAX_USERS || o->nlevels == MAX_LEVELS) return -1;
        o->levels[o->nlevels++] = (uint32_t) v;
        if (*end == '\0') return 0;
        if (*end != ',') return -1;
        p = end + 1;
    }
}

static const char usage[] =
    "kvstage bench serve [--concurrency 1,2,4] [--requests N] [--max-tokens M] [flags]\n"
    "  concurrent streaming clients against a colocated server and against a router over a\n"
    "  prefill and a decode server: TTFT p50/p99, output tokens/s per user and in total";

static void serve_bench_flags(kvs_arg_table_t *t, opts_t *o, const char **levels_p, int *json_p)
{
    const kvs_arg_t g[] = {
        {"concurrency", KVS_ARG_STR, levels_p, "users at once, a sweep (1,2,4)",
         "comma-separated users per level", NULL},
        {"requests", KVS_ARG_U32, &o->requests, "requests per user, one after another (3)",
         "[1,100000]", NULL},
        {"max-tokens", KVS_ARG_U32, &o->max_tokens, "tokens generated per request at most (24)",
         "[1,1048576]", NULL},
        {"prompt-words", KVS_ARG_U32, &o->prompt_words, "words per prompt (60)", "[1,600]", NULL},
        {"prefill-tp", KVS_ARG_U32, &o->prefill_tp, "prefill server ranks (1)", KVS_ARGS_TP, NULL},
        {"decode-tp", KVS_ARG_U32, &o->decode_tp,
         "decode server ranks, also the colocated server's (1)", KVS_ARGS_TP, NULL},
        {"model", KVS_ARG_STR, &o->model_path, "GGUF file (default: the embedded SmolLM2)", NULL,
         NULL},
        {"seeded", KVS_ARG_STR, &o->seeded,
         "random weights of shape L,dim,ffn,heads,kv_heads,head_dim,vocab (vocab >= 257)", NULL,
         NULL},
        {"json", KVS_ARG_FLAG, json_p, "one JSON object instead of the table", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* Every level on the colocated deployment, then on the disaggregated one, each deployment
 * started and stopped in turn; 0 when something failed (said on stderr). */
static int run_deployments(const opts_t *o, int json, char labels[2][64], row_t rows[2][MAX_LEVELS])
{
    int ok = 1;
    for (int mode = 0; mode < 2 && ok; mode++) {
        kvs_child_t cs[3] = {{.out_fd = -1}, {.out_fd = -1}, {.out_fd = -1}};
        const char *url = NULL;
        if (deploy(o, mode, cs, &url) != 0) {
            ok = 0;
        } else {
            /* One request first: pools and caches warm, every rank's pages touched. */
            opts_t warm = *o;
            warm.requests = 1;
            row_t w;
            ok = run_level(url, "warmup", &warm, 1, &w) == 0;
            for (uint32_t i = 0; ok && i < o->nlevels; i++) {
                ok = run_level(url, labels[mode], o, o->levels[i], &rows[mode][i]) == 0;
                if (!json && ok)
                    fprintf(stderr, "  %s, %u users: %.1f s\n", labels[mode], o->levels[i],
                            rows[mode][i].wall_s);
            }
        }
        for (int i = 2; i >= 0; i--)
            if (cs[i].pid > 0) kvs_child_stop(&cs[i], 30);
    }
    return ok;
}

static void print_rows_json(const opts_t *o, int ok, row_t rows[2][MAX_LEVELS])
{
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_bool(&j, "ok", ok);
    kvs_json_str(&j, "model", o->seeded ? "seeded" : o->model_path);
    kvs_json_array_begin(&j, "rows");
    for (int mode = 0; mode < 2; mode++)
        for (uint32_t i = 0; i < o->nlevels; i++) {
            const row_t *r = &rows[mode][i];
            if (r->label == NULL) continue;
            kvs_json_object_begin(&j, NULL);
            kvs_json_str(&j, "deployment", r->label);
            kvs_json_u64(&j, "users", r->users);
            kvs_json_u64(&j, "requests", r->requests);
            kvs_json_double(&j, "ttft_p50_ms", r->ttft_p50);
            kvs_json_double(&j, "ttft_p99_ms", r->ttft_p99);
            kvs_json_double(&j, "tok_s_per_user", r->tok_s_user);
            kvs_json_double(&j, "tok_s_total", r->tok_s_total);
            kvs_json_object_end(&j);
        }
    kvs_json_array_end(&j);
    kvs_json_end(&j);
}

static void print_rows_table(const opts_t *o, int ok, row_t rows[2][MAX_LEVELS])
{
    printf("%-20s %5s %8s %11s %11s %12s %12s\n", "deployment", "users", "requests", "TTFT p50",
           "TTFT p99", "tok/s/user", "tok/s total");
    for (int mode = 0; mode < 2; mode++)
        for (uint32_t i = 0; i < o->nlevels; i++) {
            const row_t *r = &rows[mode][i];
            if (r->label == NULL) continue;
            printf("%-20s %5u %8u %8.0f ms %8.0f ms %12.1f %12.1f\n", r->label, r->users,
                   r->requests, r->ttft_p50, r->ttft_p99, r->tok_s_user, r->tok_s_total);
        }
    printf("\nTTFT at the client (request sent -> first text); tok/s/user: a request's output "
           "tokens over its whole time; p99 of a few requests is close to their maximum\n");
    if (!ok) printf("FAILED: see the errors above\n");
}

/* Starts each deployment in turn and prints what the sweep measured; the exit code. */
static int bench_serve_run(const opts_t *o, int json)
{
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) return 1;
    kvs_serve_signal_install();
    char cpu[256];
    long cores;
    kvs_bench_cpu_info(cpu, sizeof(cpu), &cores);
    char labels[2][64];
    snprintf(labels[0], sizeof(labels[0]), "colocated TP%u", o->decode_tp);
    snprintf(labels[1], sizeof(labels[1]), "disagg TP%u->TP%u", o->prefill_tp, o->decode_tp);
    if (!json)
        printf("kvstage bench serve: %s, %s (%ld cores); %u requests per user, %u prompt words, "
               "up to %u tokens each, greedy, streamed; every prompt distinct (no cache hits)\n\n",
               o->seeded ? "seeded model" : o->model_path, cpu, cores, o->requests, o->prompt_words,
               o->max_tokens);
    row_t rows[2][MAX_LEVELS];
    memset(rows, 0, sizeof(rows));
    int ok = run_deployments(o, json, labels, rows);
    if (json)
        print_rows_json(o, ok, rows);
    else
        print_rows_table(o, ok, rows);
    curl_global_cleanup();
    return ok ? 0 : 1;
}

/* The TP sizes against the model, before any server starts (they would each refuse it). */
static int check_tp(const opts_t *o)
{
    kvs_model_config_t mc;
    if (o->seeded != NULL) {
        if (kvs_parse_seeded(o->seeded, &mc) != 0)
            return kvs_args_error("--seeded", "L,dim,ffn,heads,kv_heads,head_dim,vocab",
                                  "'%s' is not a model shape", o->seeded);
    } else {
        kvs_gguf_t *g = NULL;
        if (kvs_gguf_open(o->model_path, &g) != KVS_OK) {
            fprintf(stderr, "error: cannot open the model %s\n", o->model_path);
            return 1;
        }
        kvs_status_t st = kvs_model_config_from_gguf(g, &mc);
        kvs_gguf_close(g);
        if (st != KVS_OK) {
            fprintf(stderr, "error: %s is not a model this engine runs\n", o->model_path);
            return 1;
        }
    }
    if (kvs_model_tp_check(&mc, "--prefill-tp", o->prefill_tp) != 0 ||
        kvs_model_tp_check(&mc, "--decode-tp", o->decode_tp) != 0)
        return 2;
    return 0;
}

int kvs_bench_serve(int argc, char **argv)
{
    opts_t o;
    memset(&o, 0, sizeof(o));
    o.prefill_tp = o.decode_tp = 1;
    o.requests = 3;
    o.max_tokens = 24;
    o.prompt_words = 60;
    const char *levels = "1,2,4";
    int json = 0;
    kvs_arg_table_t t = {.count = 0};
    serve_bench_flags(&t, &o, &levels, &json);
    int rc = kvs_arg_table_parse(&t, usage, argc, argv, 1);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    if (parse_levels(levels, &o) != 0)
        return kvs_args_error("--concurrency",
                              "comma-separated levels of [1," KVS_ARGS_STR(
                                  MAX_USERS) "] users, at most " KVS_ARGS_STR(MAX_LEVELS) " levels",
                              "'%s' is malformed", levels);
    char path[4096];
    if (o.seeded == NULL) {
        if (o.model_path != NULL)
            snprintf(path, sizeof(path), "%s", o.model_path);
        else if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
            return 1;
        o.model_path = path;
    }
    if ((rc = check_tp(&o)) != 0) return rc;
    return bench_serve_run(&o, json);
}
