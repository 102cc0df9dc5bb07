/* `kvstage serve-demo`: what `make demo` runs. A real deployment on this host: a prefill server
 * (`kvstage serve`, SmolLM2 on TP3: three rank processes), a decode server (TP1) bound to it,
 * and a prefix-aware router in front, each server in a process group of its own. With
 * `--prefill N` (N >= 2), N prefill servers and a decode server bound to none of them (per-room
 * bootstrap: it takes each room from the instance the router chose): the xPyD shape. It sends two
 * chat requests that share a system prompt through the router, streams both answers, prints
 * the time to first token, the cache hits on each side and the KV bytes each request moved,
 * then stops the router and the servers with SIGTERM and waits for every process. */
#include "cmd/commands.h"

#include <curl/curl.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "common/args.h"
#include "common/instance.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "model/gguf.h"
#include "common/serve_client.h"
#include "common/serve_signal.h"

#define MAX_PREFILL 4
#define NPROC       (MAX_PREFILL + 2)

static const char k_system[] =
    "You are a concise geography tutor. Answer every question in one short sentence that "
    "names the city and the country, without any list, greeting or explanation. If a question "
    "is not about geography, say that you only answer geography questions.";
static const char *const k_questions[2] = {"What is the capital of France?",
                                           "What is the capital of Germany?"};

/* A streamed chat completion through the router, printed as it comes; 0 when it came back. */
static int ask(const char *router, const char *question, kvs_stream_t *s)
{
    json_t *body =
        json_pack("{s:[{s:s, s:s}, {s:s, s:s}], s:i, s:f, s:b, s:{s:b}}", "messages", "role",
                  "system", "content", k_system, "role", "user", "content", question, "max_tokens",
                  48, "temperature", 0.0, "stream", 1, "stream_options", "include_usage", 1);
    json_malloc_t jmalloc;
    json_free_t jfree;
    json_get_alloc_funcs(&jmalloc, &jfree); /* the text is jansson's to free */
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (text == NULL) {
        fprintf(stderr, "error: out of memory building the request\n");
        return -1;
    }
    s->print = 1;
    int rc = kvs_stream_request(router, "/v1/chat/completions", text, s);
    jfree(text);
    if (rc != 0) fprintf(stderr, "\nerror: the request failed: %s\n", s->error);
    return rc;
}

/* ---- the demo ---- */

static const char usage[] =
    "kvstage serve-demo [flags]\n"
    "  a real deployment on this host: router -> prefill server (TP3) -> decode server (TP1),\n"
    "  SmolLM2 on the CPU, every rank a process; two chat requests sharing a system prompt";

typedef struct {
    uint32_t prefill_tp, decode_tp, timeout_s, prefill;
    const char *model;
    int device;       /* 0 cpu, 1 cuda */
    const char *gpus; /* "P,D" or "P" */
    int gpu[2];       /* with cuda: the prefill servers' GPU, the decode server's */
} demo_flags_t;

/* Appends `--device cuda --gpus N` to a server's argv (NULL-terminated, room for four more). */
static void add_device(const demo_flags_t *f, char **argv, int side, char *num, size_t cap)
{
    if (!f->device) return;
    int n = 0;
    while (argv[n] != NULL) n++;
    snprintf(num, cap, "%d", f->gpu[side]);
    argv[n++] = "--device";
    argv[n++] = "cuda";
    argv[n++] = "--gpus";
    argv[n++] = num;
    argv[n] = NULL;
}

/* One run's processes and what its two answers measured. */
typedef struct {
    const demo_flags_t *f;
    char *path; /* the GGUF */
    uint64_t t0;
    kvs_child_t ps[NPROC]; /* prefill servers, decode server, router: started in that order */
    uint32_t n;            /* processes: f->prefill + 2 */
    kvs_stream_t res[2];
    double cached_p[2], handoff_ms[2]; /* from the prefill server's metrics */
    int answers;
} demo_t;

/* Starts c with argv and waits for the line it prints when it serves; 0, or -1 (reported). */
static int start_child(demo_t *d, kvs_child_t *c, char **argv, const char *ready)
{
    printf("starting the %s ... ", c->name);
    fflush(stdout);
    if (kvs_child_start(c, argv) != 0 || kvs_child_wait_line(c, ready, d->f->timeout_s) != 0)
        return -1;
    printf("%s\n", c->line);
    return 0;
}

/* The prefill servers, the decode server (bound to the one prefill instance, or to none) and the
 * router in front; 0, or -1. */
static int start_deployment(demo_t *d)
{
    const uint32_t np = d->f->prefill;
    kvs_child_t *pre = &d->ps[0], *dec = &d->ps[np], *rt = &d->ps[np + 1];
    char *path = d->path;
    char ptp[16], dtp[16];
    snprintf(ptp, sizeof(ptp), "%u", d->f->prefill_tp);
    snprintf(dtp, sizeof(dtp), "%u", d->f->decode_tp);
    /* A short context keeps the demo's KV pools small (twice the context, every rank). */
    char *pargs[18] = {"kvstage",         "serve", "--role",  "prefill", "--tp",   ptp,
                       "--peer-tp",       dtp,     "--model", path,      "--port", "0",
                       "--max-model-len", "2048",  NULL};
    char pgpu[16], dgpu[16];
    add_device(d->f, pargs, 0, pgpu, sizeof(pgpu));
    char urls[MAX_PREFILL * 64] = "";
    for (uint32_t i = 0; i < np; i++) {
        if (start_child(d, &pre[i], pargs, "serving on") != 0) return -1;
        snprintf(urls + strlen(urls), sizeof(urls) - strlen(urls), "%s%s", i ? "," : "",
                 pre[i].url);
    }
    char *dargs[20] = {
        "kvstage", "serve",  "--role", "decode",          "--tp", dtp,           "--model",
        path,      "--port", "0",      "--max-model-len", "2048", "--bootstrap", pre->bootstrap,
        NULL};
    if (np > 1) dargs[12] = NULL; /* bound to none: rooms from any of them */
    add_device(d->f, dargs, 1, dgpu, sizeof(dgpu));
    if (start_child(d, dec, dargs, "serving on") != 0) return -1;
    char *rargs[] = {"kvstage", "router", "--prefill", urls,     "--decode", dec->url,
                     "--port",  "0",      "--policy",  "prefix", NULL};
    if (start_child(d, rt, rargs, "routing on") != 0) return -1;
    printf("up in %.1f s\n\n", (double) (kvs_now_ns() - d->t0) / 1e9);
    return 0;
}

/* Question i through the router, with what the prefill server's metrics say it cost; 0 when
 * the answer came back. */
/* A metric summed over the prefill servers (-1 when one does not answer). */
static double prefill_metric(const demo_t *d, const char *name)
{
    double sum = 0;
    for (uint32_t i = 0; i < d->f->prefill; i++) {
        double v = kvs_metric_get(d->ps[i].url, name);
        if (v < 0) return -1;
        sum += v;
    }
    return sum;
}

static int ask_and_report(demo_t *d, int i)
{
    double c0 = prefill_metric(d, "kvstage_cached_prompt_tokens_total");
    double h0 = prefill_metric(d, "kvstage_kv_transfer_seconds_sum");
    printf("[%d] user: %s\n    assistant: ", i + 1, k_questions[i]);
    fflush(stdout);
    if (ask(d->ps[d->n - 1].url, k_questions[i], &d->res[i]) != 0) return -1;
    /* The prefill answer ends at the handoff, which the decode answer may precede. */
    for (int k = 0; k < 50 && prefill_metric(d, "kvstage_kv_transfer_seconds_sum") == h0; k++)
        kvs_serve_signal_wait(20);
    double c1 = prefill_metric(d, "kvstage_cached_prompt_tokens_total");
    double h1 = prefill_metric(d, "kvstage_kv_transfer_seconds_sum");
    d->cached_p[i] = c0 >= 0 && c1 >= c0 ? c1 - c0 : 0;
    d->handoff_ms[i] = h0 >= 0 && h1 >= h0 ? (h1 - h0) * 1e3 : 0;
    const kvs_stream_t *s = &d->res[i];
    printf("\n    -> %ld tokens (%s); TTFT %.0f ms at the client, %.0f ms in the decode "
           "server;\n       prompt %ld tokens, cached %.0f on the prefill side, %ld on the "
           "decode side;\n       KV moved %.2f MiB (%.0f KiB), handoff %.1f ms after the "
           "prompt was computed\n\n",
           s->completion_tokens, s->finish, (double) (s->first_ns - s->t0) / 1e6,
           (double) s->ttft_ns / 1e6, s->prompt_tokens, d->cached_p[i], s->cached,
           (double) s->kv_bytes / 1048576.0, (double) s->kv_bytes / 1024.0, d->handoff_ms[i]);
    d->answers++;
    return 0;
}

/* Starts the deployment, asks both questions, stops every process; the exit code. */
static int run_demo(demo_t *d)
{
    d->t0 = kvs_now_ns();
    printf("kvstage serve-demo: an OpenAI-compatible deployment on this host, every process its "
           "own:\n  router (prefix-aware) -> %u prefill server%s, TP%u (%u rank processes each) "
           "-> decode server, TP%u%s;\n  the KV of each request moves from prefill to decode "
           "through kvstage (ZeroMQ control, UCX data)\n  model %s, CPU\n\n",
           d->f->prefill, d->f->prefill > 1 ? "s" : "", d->f->prefill_tp, d->f->prefill_tp,
           d->f->decode_tp, d->f->prefill > 1 ? " (bound to none: rooms from either)" : "",
           d->path);
    int ok = 0;
    if (start_deployment(d) == 0) {
        printf("system: %s\n\n", k_system);
        for (int i = 0; i < 2; i++)
            if (ask_and_report(d, i) != 0) break;
        ok = d->answers == 2;
        if (ok && (d->cached_p[1] <= 0 || d->res[1].cached <= 0))
            printf("note: the second request found no cached prefix on the %s side\n",
                   d->cached_p[1] <= 0 ? "prefill" : "decode");
    }
    printf("stopping the router, the decode server and the prefill server%s (SIGTERM)\n",
           d->f->prefill > 1 ? "s" : "");
    fflush(stdout);
    int clean = 1;
    for (int i = (int) d->n - 1; i >= 0; i--) clean &= kvs_child_stop(&d->ps[i], 30);
    printf("%s\n", clean ? "every process exited cleanly" : "not every process exited cleanly");
    if (d->answers < 2) fprintf(stderr, "FAILED: %d of 2 answers came back\n", d->answers);
    printf("%s in %.1f s\n", ok && clean ? "done" : "FAILED",
           (double) (kvs_now_ns() - d->t0) / 1e9);
    return ok && clean ? 0 : 1;
}

int kvs_cmd_serve_demo(int argc, char **argv)
{
    demo_flags_t f = {.prefill_tp = 3, .decode_tp = 1, .timeout_s = 300, .prefill = 1};
    const kvs_arg_t args[] = {
        {"prefill", KVS_ARG_U32, &f.prefill,
         "prefill servers (1); with 2 or more the decode server is bound to none of them", "[1,4]",
         NULL},
        {"prefill-tp", KVS_ARG_U32, &f.prefill_tp, "prefill server ranks (3)", KVS_ARGS_TP, NULL},
        {"decode-tp", KVS_ARG_U32, &f.decode_tp, "decode server ranks (1)", KVS_ARGS_TP, NULL},
        {"model", KVS_ARG_STR, &f.model, "GGUF file (default: the embedded SmolLM2)", NULL, NULL},
        {"timeout-s", KVS_ARG_U32, &f.timeout_s, "give up on a server after this long (300)",
         "[1,86400]", NULL},
        {"device", KVS_ARG_CHOICE, &f.device, "where the servers run the model", "cpu|cuda", NULL},
        {"gpus", KVS_ARG_STR, &f.gpus,
         "with --device cuda: the prefill servers' and the decode server's GPUs (0), all of a "
         "server's ranks on its GPU; ranks sharing a GPU reduce through the host TP group "
         "(correct, slow), ranks on distinct GPUs (llm-rank --gpu) through NCCL when kvstage is "
         "built with it",
         KVS_ARGS_GPUS_ACCEPTED, NULL},
    };
    const size_t nargs = sizeof(args) / sizeof(args[0]);
    int rc = kvs_args_parse(usage, args, nargs, argc, argv, 1);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    if (f.gpus != NULL && !f.device)
        return kvs_args_error("--gpus", "--gpus with --device cuda", "needs --device cuda");
    if (f.gpus != NULL && kvs_args_parse_gpus(f.gpus, &f.gpu[0], &f.gpu[1]) != 0)
        return kvs_args_error("--gpus", KVS_ARGS_GPUS_ACCEPTED, "'%s' is malformed", f.gpus);
    char path[4096];
    if (f.model != NULL)
        snprintf(path, sizeof(path), "%s", f.model);
    else if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
        return 1;
    /* The TP sizes against the model, before any server starts. */
    kvs_gguf_t *g = NULL;
    kvs_model_config_t mc;
    if (kvs_gguf_open(path, &g) != KVS_OK) {
        fprintf(stderr, "error: cannot open the model %s\n", path);
        return 1;
    }
    kvs_status_t st = kvs_model_config_from_gguf(g, &mc);
    kvs_gguf_close(g);
    if (st != KVS_OK) {
        fprintf(stderr, "error: %s is not a model this engine runs\n", path);
        return 1;
    }
    if (kvs_model_tp_check(&mc, "--prefill-tp", f.prefill_tp) != 0 ||
        kvs_model_tp_check(&mc, "--decode-tp", f.decode_tp) != 0)
        return 2;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fprintf(stderr, "error: libcurl did not initialise\n");
        return 1;
    }
    kvs_serve_signal_install();
    static demo_t d; /* two 8 KiB answers: off the stack */
    d.f = &f;
    d.path = path;
    d.n = f.prefill + 2;
    for (uint32_t i = 0; i < d.n; i++)
        d.ps[i] = (kvs_child_t){.name = i < f.prefill    ? "prefill server"
                                        : i == f.prefill ? "decode server"
                                                         : "router",
                                .out_fd = -1};
    rc = run_demo(&d);
    curl_global_cleanup();
    return rc;
}
