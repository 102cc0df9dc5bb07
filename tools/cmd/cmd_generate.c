/* `kvstage generate`: a real model served disaggregated through kvstage on this host. It
 * tokenizes the prompts, launches every rank of the prefill and decode instances (or of one
 * colocated instance) as its own process (`kvstage llm-rank`, engine/llm_rank.h), serves the
 * bootstrap registry, submits each prompt to prefill rank 0 and decode rank 0 under one room
 * id, streams the tokens decode rank 0 reports, and prints per request the completion, cache
 * hits on each side, time to first token and the share of it the KV transfer took. */
#include "cmd/commands.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/args.h"
#include "common/instance.h"
#include "common/json.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "model/gguf.h"
#include "engine/llm_rank.h"
#include "engine/rank_line.h"
#include "kvstage/log.h"
#include "model/model.h"
#include "kvstage/registry.h"
#include "model/tokenizer.h"
#include "model/tpgroup.h"
#include "common/spawn.h"

#define MAX_PROMPTS 256
#define MAX_RANKS   (2 * KVS_MAX_TP)
#define EXIT_NS     (15ull * 1000000000ull) /* ranks get this long to exit after quit */

/* ---- shared by `generate` and `llm-rank` ---- */

/* "1,2,3" into a kvs_malloc'd array. 0 on success. */
static int parse_ids(const char *s, uint32_t **ids_p, uint32_t *n_p)
{
    uint32_t n = 1;
    for (const char *p = s; *p; p++) n += *p == ',';
    uint32_t *ids = kvs_malloc((size_t) n * sizeof(uint32_t));
    if (ids == NULL) return -1;
    uint32_t k = 0;
    for (const char *p = s;;) {
        if (*p < '0' || *p > '9') break;
        char *end;
        errno = 0;
        unsigned long v = strtoul(p, &end, 10);
        if (errno != 0 || v >= UINT32_MAX) break;
        ids[k++] = (uint32_t) v;
        if (*end == '\0') {
            *ids_p = ids;
            *n_p = k;
            return 0;
        }
        if (*end != ',') break;
        p = end + 1;
    }
    kvs_free(ids);
    return -1;
}

/* ---- `kvstage llm-rank` (launched by generate; not listed) ---- */

/* Flag values that are not kvs_llm_rank_config_t fields as they stand. */
typedef struct {
    kvs_llm_rank_config_t c;
    int role, data, checksum, device, kv_dtype;
    uint32_t gpu;
    uint64_t peer_idle_s;
    const char *seeded;
    char path[4096]; /* the default model's, when neither --model nor --seeded is given */
} llm_rank_opts_t;

static void llm_rank_default(llm_rank_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    kvs_llm_rank_config_t *c = &o->c;
    c->prefill_tp = c->decode_tp = 1;
    c->page_size = 16;
    c->chunk_tokens = 64;
    c->max_running = 4;
    c->radix = 1;
    o->checksum = 1;
}

static void add_llm_rank_model_flags(kvs_arg_table_t *t, llm_rank_opts_t *o)
{
    kvs_llm_rank_config_t *c = &o->c;
    const kvs_arg_t g[] = {
        {"role", KVS_ARG_CHOICE, &o->role, "this rank's instance", "colocated|prefill|decode",
         NULL},
        {"rank", KVS_ARG_U32, &c->rank, "rank in the instance", "[0,63]", NULL},
        {"prefill-tp", KVS_ARG_U32, &c->prefill_tp, "prefill (or colocated) TP size", KVS_ARGS_TP,
         NULL},
        {"decode-tp", KVS_ARG_U32, &c->decode_tp, "decode TP size", KVS_ARGS_TP, NULL},
        {"model", KVS_ARG_STR, &c->model_path, "GGUF file (default: the embedded model)", NULL,
         NULL},
        {"seeded", KVS_ARG_STR, &o->seeded, "L,dim,ffn,heads,kv_heads,head_dim,vocab",
         "L,dim,ffn,heads,kv_heads,head_dim,vocab", NULL},
        {"model-seed", KVS_ARG_U64, &c->model_seed, "seed of the seeded weights", NULL, NULL},
        {"device", KVS_ARG_CHOICE, &o->device, "where the model and its KV pool live", "cpu|cuda",
         NULL},
        {"gpu", KVS_ARG_U32, &o->gpu,
         "with --device cuda: this rank's GPU (0); a group's ranks on pairwise distinct "
         "GPUs all-reduce through NCCL when kvstage is built with it, else through the "
         "host TP group",
         "[0,1024]", NULL},
        {"kv-dtype", KVS_ARG_CHOICE, &o->kv_dtype, "K/V elements on the CPU (a GPU keeps bf16)",
         "f32|bf16", NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_llm_rank_engine_flags(kvs_arg_table_t *t, llm_rank_opts_t *o)
{
    kvs_llm_rank_config_t *c = &o->c;
    const kvs_arg_t g[] = {
        {"page-size", KVS_ARG_U32, &c->page_size, "tokens per page", "[1,65536]", NULL},
        {"chunk", KVS_ARG_U32, &c->chunk_tokens, "prefill chunk (the kvstage chunk)", "[1,65536]",
         NULL},
        {"batch-tokens", KVS_ARG_U32, &c->batch_tokens, "prompt tokens per pass (4 x chunk)",
         "[1,1048576]", NULL},
        {"max-running", KVS_ARG_U32, &c->max_running, "requests admitted at once", "[1,1024]",
         NULL},
        {"max-model-len", KVS_ARG_U32, &c->max_context,
         "prompt + new tokens at most (default: the model's context)", "[2,1048576]", NULL},
        {"kv-tokens", KVS_ARG_U64, &c->kv_tokens, "KV pool, tokens (default: twice the context)",
         "[2,4294967296]", NULL},
        {"radix", KVS_ARG_ONOFF, &c->radix, "radix prefix cache", NULL, NULL},
        {"checksum", KVS_ARG_ONOFF, &o->checksum,
         "end-to-end chunk checksums; both instances must agree", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_llm_rank_link_flags(kvs_arg_table_t *t, llm_rank_opts_t *o)
{
    kvs_llm_rank_config_t *c = &o->c;
    const kvs_arg_t g[] = {
        {"group", KVS_ARG_STR, &c->group, "TP group shm name (TP > 1)", NULL, NULL},
        {"registry", KVS_ARG_STR, &c->registry,
         "bootstrap registry endpoint (decode without it: per-room bootstrap)", NULL, NULL},
        {"max-peer-instances", KVS_ARG_U32, &c->max_peer_instances,
         "per-room decode: prefill instances wired at once (16)", "[1,1024]", NULL},
        {"peer-idle-s", KVS_ARG_U64, &o->peer_idle_s,
         "per-room decode: a prefill instance without a room this long is closed (300)",
         "[1,86400]", NULL},
        {"serve-registry", KVS_ARG_FLAG, &c->serve_registry, "prefill rank 0 serves the registry",
         NULL, NULL},
        {"bind", KVS_ARG_STR, &c->bind, "control endpoint", NULL, NULL},
        {"data", KVS_ARG_CHOICE, &o->data, "UCX data transports", "auto|shm|tcp", NULL},
        {"net-device", KVS_ARG_STR, &c->net_device, "UCX_NET_DEVICES for TCP", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* Role, data transports and the model into o->c, with the checks across flags; 0, or the exit
 * code after saying why (2 after the one error line). */
static int llm_rank_config_build(llm_rank_opts_t *o)
{
    kvs_llm_rank_config_t *c = &o->c;
    c->role = (kvs_llm_role_t) o->role;
    c->data = (kvs_net_data_t) o->data;
    c->no_checksum = !o->checksum;
    c->device = o->device ? (int) o->gpu : -1;
    c->kv_bf16 = o->kv_dtype == 1;
    const uint32_t tp = c->role == KVS_LLM_DECODE ? c->decode_tp : c->prefill_tp;
    if (c->rank >= tp)
        return kvs_args_error("--rank", "below the instance's TP size", "%u is not below TP %u",
                              c->rank, tp);
    if (c->role == KVS_LLM_PREFILL && c->registry == NULL)
        return kvs_args_error("--registry", "the prefill instance's registry endpoint",
                              "a prefill rank needs it");
    c->peer_idle_ns = o->peer_idle_s * 1000000000ull;
    if (tp > 1 && c->group == NULL)
        return kvs_args_error("--group", "a shared-memory name such as /kvs-group",
                              "TP %u needs it", tp);
    if (c->batch_tokens != 0 && c->batch_tokens < c->chunk_tokens)
        return kvs_args_error("--batch-tokens", "at least --chunk", "%u is below --chunk %u",
                              c->batch_tokens, c->chunk_tokens);
    if (o->seeded != NULL) {
        if (c->model_path != NULL)
            return kvs_args_error("--seeded", "--model or --seeded", "excludes --model");
        if (kvs_parse_seeded(o->seeded, &c->seeded) != 0)
            return kvs_args_error("--seeded", "L,dim,ffn,heads,kv_heads,head_dim,vocab",
                                  "'%s' is not a model shape", o->seeded);
        c->model_path = NULL;
    } else if (c->model_path == NULL) {
        if (kvs_model_default_path(o->path, sizeof(o->path)) != KVS_OK) return 1;
        c->model_path = o->path;
    }
    c->in_fd = c->rank == 0 ? STDIN_FILENO : -1;
    c->out_fd = STDOUT_FILENO;
    return 0;
}

int kvs_cmd_llm_rank(int argc, char **argv)
{
    llm_rank_opts_t o;
    llm_rank_default(&o);
    kvs_arg_table_t t = {.count = 0};
    add_llm_rank_model_flags(&t, &o);
    add_llm_rank_engine_flags(&t, &o);
    add_llm_rank_link_flags(&t, &o);
    int rc = kvs_arg_table_parse(&t,
                                 "kvstage llm-rank --role R --rank N [flags]  (requests on stdin, "
                                 "events on stdout: see serve/engine/rank_line.h)",
                                 argc, argv, 1);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    if ((rc = llm_rank_config_build(&o)) != 0) return rc;
    signal(SIGPIPE, SIG_IGN); /* a vanished launcher shows up as EOF and write errors */
    /* A rank ends when its launcher closes its pipe (rank 0 then tells the others), so a
     * SIGTERM or SIGINT to the whole process group (a service manager stopping a server, or
     * Ctrl-C) is left to the launcher, which shuts its instance down cleanly. */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    return kvs_llm_rank_run(&o.c, NULL) == KVS_OK ? 0 : 1;
}

/* ---- the launcher ---- */

typedef struct {
    kvs_llm_role_t role;
    uint32_t rank;
    pid_t pid;
    int out_fd; /* its stdout */
    int in_fd;  /* rank 0: its stdin */
    char buf[16384];
    size_t len;
    int ready, exited, status;
    double load_s;
    kvs_pd_metrics_t metrics; /* from its stats line */
} child_t;

/* One side's EV_DONE. */
typedef struct {
    char status[64], finish[16];
    unsigned long long cached, generated, prompt_len, submitted, admitted, prefilled, kv_ready,
        first_token, done;
} side_t;

typedef struct {
    uint64_t room;
    const char *label; /* the prompt as given */
    uint32_t *prompt;  /* [prompt_len] */
    uint32_t prompt_len;
    uint32_t *out; /* [max_tokens] generated ids as decode rank 0 reported them */
    uint32_t nout;
    int submitted, closed; /* closed: a stop token was seen; later tokens are ignored */
    int done[2];           /* [0] prefill side, [1] decode (or colocated) side */
    int rejected;
    side_t side[2];
} req_t;

typedef struct {
    /* flags */
    uint32_t max_tokens, prefill_tp, decode_tp, tp, page_size, chunk, timeout_s, max_running;
    uint32_t max_model_len; /* 0 until checked: the model's context */
    uint64_t seed, model_seed, kv_tokens;
    double temperature, top_p, min_p, presence, frequency, repetition;
    uint32_t top_k;
    int ignore_eos;
    int chat, colocated, prefill_radix, decode_radix, json, sequential, data, tp_seen, checksum;
    int device;   /* 0 cpu, 1 cuda */
    int kv_dtype; /* 0 f32, 1 bf16 (on the CPU) */
    int kv_dtype_seen;
    const char *gpus; /* --gpus "P,D" or "P" */
    int gpu[2];       /* with cuda: the prefill (colocated) ranks' GPU, the decode ranks' */
    const char *system, *model, *seeded;
    /* model */
    char model_path[4096];
    kvs_model_config_t mc;
    kvs_tokenizer_t *tok;
    uint32_t eos, stop_id; /* stop_id: ChatML's <|im_end|> when it differs from eos */
    /* deployment */
    req_t reqs[MAX_PROMPTS];
    uint32_t nreqs;
    child_t cs[MAX_RANKS];
    int nchildren;
    child_t *head[2]; /* rank 0 of the prefill side, of the decode (colocated) side */
    kvs_registry_t *registry;
    char groups[3][64];
    uint64_t t0;
    int failed;
} gen_t;

static void write_all(int fd, const char *s, size_t n)
{
    while (n > 0 && fd >= 0) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return; /* the rank is gone: its exit is reported */
        s += w;
        n -= (size_t) w;
    }
}

static const char *role_name(kvs_llm_role_t r)
{
    return r == KVS_LLM_PREFILL ? "prefill" : r == KVS_LLM_DECODE ? "decode" : "colocated";
}

static int streaming(const gen_t *g)
{
    return !g->json && g->tok != NULL && (g->sequential || g->nreqs == 1);
}

static void print_piece(const gen_t *g, uint32_t id)
{
    const char *b;
    size_t n;
    if (kvs_tokenizer_is_control(g->tok, id)) return;
    if (kvs_tokenizer_piece(g->tok, id, &b, &n) == KVS_OK) fwrite(b, 1, n, stdout);
}

/* "[room] prompt", the prompt cut short when long (token id lists are). */
static void print_label(const req_t *r)
{
    size_t n = strlen(r->label);
    printf("[%llu] %.*s%s\n", (unsigned long long) r->room, n > 120 ? 117 : (int) n, r->label,
           n > 120 ? "..." : "");
}

static void send_line(child_t *c, const char *line)
{
    if (c != NULL) write_all(c->in_fd, line, strlen(line));
}

/* A request without ids (stop: every choice, stats, quit). */
static void send_request(child_t *c, kvs_rank_line_kind_t kind, uint64_t room)
{
    kvs_rank_line_request_t q = {.kind = kind, .room = room, .choice = KVS_LLM_CHOICE_ALL};
    char line[64];
    size_t n;
    if (kvs_rank_line_request_encode(&q, line, sizeof(line), &n) == KVS_OK) send_line(c, line);
}

static void send_stop(child_t *c, uint64_t room)
{
    send_request(c, KVS_RANK_LINE_STOP, room);
}

static kvs_sample_params_t sampling_of(const gen_t *g)
{
    return (kvs_sample_params_t){.temperature = (float) g->temperature,
                                 .top_p = (float) g->top_p,
                                 .top_k = g->top_k,
                                 .min_p = (float) g->min_p,
                                 .presence_penalty = (float) g->presence,
                                 .frequency_penalty = (float) g->frequency,
                                 .repetition_penalty = (float) g->repetition};
}

static void submit(gen_t *g, req_t *r)
{
    kvs_rank_line_request_t q = {.kind = KVS_RANK_LINE_SUBMIT,
                                 .submit = {.room = r->room,
                                            .max_new = g->max_tokens,
                                            .sampling = sampling_of(g),
                                            .seed = g->seed + r->room - 1,
                                            .eos = g->eos == UINT32_MAX ? -1 : (int64_t) g->eos,
                                            .prompt_len = r->prompt_len,
                                            .prompt = r->prompt}};
    size_t cap = kvs_rank_line_request_size(&q), n;
    char *line = kvs_malloc(cap);
    if (line == NULL || kvs_rank_line_request_encode(&q, line, cap, &n) != KVS_OK) {
        kvs_free(line);
        fprintf(stderr, "error: out of memory submitting request %llu\n",
                (unsigned long long) r->room);
        g->failed = 1;
        r->done[0] = r->done[1] = r->rejected = 1;
        return;
    }
    if (streaming(g)) {
        print_label(r);
        fflush(stdout);
    }
    send_line(g->head[0], line);
    send_line(g->head[1], line);
    kvs_free(line);
    r->submitted = 1;
    if (g->colocated) r->done[0] = 1;
}

static int finished(const req_t *r)
{
    return r->done[0] && r->done[1];
}

static void on_done_line(gen_t *g, int side, const kvs_llm_event_t *ev)
{
    uint64_t room = ev->room;
    if (room == 0 || room > g->nreqs) return;
    req_t *r = &g->reqs[room - 1];
    side_t *s = &r->side[side];
    snprintf(s->status, sizeof(s->status), "%s", kvs_status_str(ev->status));
    snprintf(s->finish, sizeof(s->finish), "%s", kvs_rank_line_finish_str(ev->finish));
    s->cached = ev->cached_tokens;
    s->generated = ev->generated;
    s->prompt_len = ev->prompt_len;
    s->submitted = ev->submitted_ns;
    s->admitted = ev->admitted_ns;
    s->prefilled = ev->prefilled_ns;
    s->kv_ready = ev->kv_ready_ns;
    s->first_token = ev->first_token_ns;
    s->done = ev->done_ns;
    r->done[side] = 1;
    if (strcmp(s->status, "ok") != 0) {
        fprintf(stderr, "error: request %llu failed on the %s side: %s\n",
                (unsigned long long) room,
                side == 0      ? "prefill"
                : g->colocated ? "colocated"
                               : "decode",
                s->status);
        g->failed = 1;
        /* The other side may still hold the room: end it there too. */
        send_stop(g->head[1 - side], room);
    }
}

/* Per-request numbers derived from the two sides' events. */
typedef struct {
    double ttft_ms, transfer_ms, share, prefill_ms, decode_ms;
    unsigned long long cached_p, cached_d, kv_bytes;
} derived_t;

/* f32 K/V on the CPU, bf16 on a GPU (kvs_model_kv_shape). */
static uint64_t kv_bytes_per_token(const gen_t *g)
{
    return (uint64_t) g->mc.layers * g->mc.kv_heads * g->mc.head_dim * 2 *
           (g->device || g->kv_dtype == 1 ? 2 : sizeof(float));
}

static derived_t derive(const gen_t *g, const req_t *r)
{
    derived_t d;
    memset(&d, 0, sizeof(d));
    const side_t *p = &r->side[g->colocated ? 1 : 0], *s = &r->side[1];
    /* From the first side that had the request: the router handed it to both at once. */
    uint64_t submitted = s->submitted;
    if (!g->colocated && p->submitted != 0 && p->submitted < submitted) submitted = p->submitted;
    if (s->first_token > submitted) d.ttft_ms = (double) (s->first_token - submitted) / 1e6;
    if (p->prefilled > p->admitted) d.prefill_ms = (double) (p->prefilled - p->admitted) / 1e6;
    if (s->done > s->first_token) d.decode_ms = (double) (s->done - s->first_token) / 1e6;
    d.cached_p = p->cached;
    d.cached_d = s->cached;
    if (!g->colocated) {
        if (s->kv_ready > p->prefilled) d.transfer_ms = (double) (s->kv_ready - p->prefilled) / 1e6;
        d.share = d.ttft_ms > 0 ? d.transfer_ms / d.ttft_ms : 0;
        /* Whole pages move: decode's pages from its cached prefix to the end of the prompt. */
        uint64_t P = g->page_size, pages = (r->prompt_len + P - 1) / P;
        if (pages > s->cached / P) d.kv_bytes = (pages - s->cached / P) * P * kv_bytes_per_token(g);
    }
    return d;
}

static void print_request_summary(const gen_t *g, const req_t *r)
{
    derived_t d = derive(g, r);
    const side_t *s = &r->side[1];
    if (!streaming(g)) {
        print_label(r);
        for (uint32_t i = 0; i < r->nout; i++) {
            if (g->tok != NULL)
                print_piece(g, r->out[i]);
            else
                printf("%s%u", i ? " " : "", r->out[i]);
        }
    }
    printf("\n    -> %llu tokens (%s), prompt %u tokens, ", s->generated,
           s->finish[0] ? s->finish : "?", r->prompt_len);
    if (g->colocated)
        printf("cached %llu", d.cached_d);
    else
        printf("cached %llu prefill / %llu decode", d.cached_p, d.cached_d);
    printf("; TTFT %.1f ms", d.ttft_ms);
    if (!g->colocated)
        printf(", transfer %.2f ms (%.1f%% of TTFT), KV %.1f KiB", d.transfer_ms, 100.0 * d.share,
               (double) d.kv_bytes / 1024.0);
    if (d.decode_ms > 0 && s->generated > 1)
        printf(", decode %.1f tok/s", (double) (s->generated - 1) / (d.decode_ms / 1e3));
    printf("\n\n");
    fflush(stdout);
}

static void on_line(gen_t *g, child_t *c, const char *line)
{
    kvs_rank_line_event_t ev;
    if (kvs_rank_line_event_decode(line, strlen(line), &ev, NULL) != KVS_OK) return;
    const kvs_llm_event_t *e = &ev.llm;
    if (ev.kind == KVS_RANK_LINE_EV_STATS) {
        c->metrics = ev.metrics;
        return;
    }
    const int side = c->role == KVS_LLM_PREFILL ? 0 : 1;
    if (ev.kind == KVS_RANK_LINE_EV_READY) {
        c->ready = 1;
        c->load_s = ev.load_s;
    } else if (ev.kind == KVS_RANK_LINE_EV_TOKEN && side == 1) {
        uint64_t room = e->room;
        if (room == 0 || room > g->nreqs) return;
        req_t *r = &g->reqs[room - 1];
        uint32_t tok = e->token;
        if (r->closed || r->nout >= g->max_tokens) return;
        r->out[r->nout++] = tok;
        if (streaming(g)) {
            print_piece(g, tok);
            fflush(stdout);
        }
        if (tok == g->stop_id && tok != g->eos) {
            send_stop(g->head[1], room);
            r->closed = 1;
        }
    } else if (ev.kind == KVS_RANK_LINE_EV_DONE) {
        uint64_t room = e->room;
        on_done_line(g, side, e);
        if (!g->json && room >= 1 && room <= g->nreqs && finished(&g->reqs[room - 1]))
            print_request_summary(g, &g->reqs[room - 1]);
    } else if (ev.kind == KVS_RANK_LINE_EV_REJECTED) {
        uint64_t room = e->room;
        fprintf(stderr, "error: %s rank 0 refused request %llu: %s\n", role_name(c->role),
                (unsigned long long) room, kvs_status_str(e->status));
        g->failed = 1;
        if (room >= 1 && room <= g->nreqs) {
            req_t *r = &g->reqs[room - 1];
            r->rejected = 1;
            r->done[side] = 1;
            send_stop(g->head[1 - side], room);
            /* Nothing more will come from a side that never took it. */
            if (g->colocated) r->done[0] = 1;
        }
    } else if (ev.kind == KVS_RANK_LINE_EV_ERROR) {
        fprintf(stderr, "error: %s rank 0: %s\n", role_name(c->role), ev.text);
        g->failed = 1;
    }
}

typedef struct {
    gen_t *g;
    child_t *c;
} line_ctx_t;

static void on_child_line(void *arg, char *line)
{
    line_ctx_t *x = arg;
    on_line(x->g, x->c, line);
}

static void read_child(gen_t *g, child_t *c)
{
    line_ctx_t x = {g, c};
    if (kvs_read_lines(c->out_fd, c->buf, sizeof(c->buf), &c->len, on_child_line, &x)) return;
    close(c->out_fd);
    c->out_fd = -1;
}

/* A rank's command line, and the numbers it holds as text. */
typedef struct {
    char *argv[64];
    int argc;
    char num[12][24];
    int nnum;
} rank_argv_t;

static void add_arg(rank_argv_t *a, const char *flag, const char *value)
{
    a->argv[a->argc++] = (char *) flag;
    a->argv[a->argc++] = (char *) value;
}

static void add_num(rank_argv_t *a, const char *flag, unsigned long long value)
{
    char *s = a->num[a->nnum++];
    snprintf(s, sizeof(a->num[0]), "%llu", value);
    add_arg(a, flag, s);
}

/* `kvstage llm-rank ...` for rank c: every rank of the deployment gets the same model and
 * engine flags. */
static void rank_argv(const gen_t *g, const child_t *c, const char *registry, rank_argv_t *a)
{
    a->argc = a->nnum = 0;
    a->argv[a->argc++] = "kvstage";
    a->argv[a->argc++] = "llm-rank";
    add_arg(a, "--role", role_name(c->role));
    add_num(a, "--rank", c->rank);
    add_num(a, "--prefill-tp", g->colocated ? g->tp : g->prefill_tp);
    add_num(a, "--decode-tp", g->colocated ? g->tp : g->decode_tp);
    if (g->seeded != NULL) {
        add_arg(a, "--seeded", g->seeded);
        add_num(a, "--model-seed", g->model_seed);
    } else {
        add_arg(a, "--model", g->model_path);
    }
    add_num(a, "--page-size", g->page_size);
    add_num(a, "--chunk", g->chunk);
    add_num(a, "--max-model-len", g->max_model_len);
    if (g->kv_tokens != 0) add_num(a, "--kv-tokens", g->kv_tokens);
    add_num(a, "--max-running", g->max_running);
    add_arg(a, "--radix",
            (c->role == KVS_LLM_DECODE ? g->decode_radix : g->prefill_radix) ? "on" : "off");
    add_arg(a, "--checksum", g->checksum ? "on" : "off");
    if (g->kv_dtype == 1 && !g->device) add_arg(a, "--kv-dtype", "bf16");
    if (g->device) {
        add_arg(a, "--device", "cuda");
        add_num(a, "--gpu", (unsigned) g->gpu[c->role == KVS_LLM_DECODE]);
    }
    const int gi = c->role == KVS_LLM_PREFILL ? 0 : c->role == KVS_LLM_DECODE ? 1 : 2;
    add_arg(a, "--group", g->groups[gi]);
    if (registry != NULL) add_arg(a, "--registry", registry);
    add_arg(a, "--data", g->data == 1 ? "shm" : g->data == 2 ? "tcp" : "auto");
    a->argv[a->argc] = NULL;
}

/* Starts one rank: `kvstage llm-rank ...` with its stdout (and rank 0's stdin) on pipes. */
static int spawn(gen_t *g, child_t *c, const char *registry)
{
    rank_argv_t a;
    rank_argv(g, c, registry, &a);
    /* Rank 0 reads its requests on stdin; the others get none. The launcher's ends of earlier
     * ranks' pipes are close-on-exec: a rank 0 must see EOF when the launcher goes. */
    kvs_spawned_t k;
    if (kvs_spawn_self("generate", a.argv, c->rank == 0 ? KVS_SPAWN_PIPE : KVS_SPAWN_DEVNULL,
                       KVS_SPAWN_PIPE, &k) != 0)
        return -1;
    c->pid = k.pid;
    c->out_fd = k.out_fd;
    c->in_fd = k.in_fd;
    return 0;
}

static void kill_all(gen_t *g)
{
    for (int i = 0; i < g->nchildren; i++)
        if (!g->cs[i].exited && g->cs[i].pid > 0) kill(g->cs[i].pid, SIGKILL);
}

static void reap(gen_t *g, int *live)
{
    for (int i = 0; i < g->nchildren; i++) {
        child_t *c = &g->cs[i];
        if (c->exited || c->pid <= 0) continue;
        if (waitpid(c->pid, &c->status, WNOHANG) == c->pid) {
            c->exited = 1;
            (*live)--;
        }
    }
}

/* The launcher's state between polls of a running deployment. */
typedef struct {
    int live; /* ranks not reaped yet */
    int quit_sent, ready_reported;
    uint64_t quit_at, deadline;
    uint32_t next; /* the next request to submit */
} drive_t;

/* Serves the registry and starts every rank; 0, or 1 when the registry could not start (a rank
 * that did not start is reported and marks g failed). */
static int start_ranks(gen_t *g)
{
    const char *ep = NULL;
    if (!g->colocated) {
        if (kvs_registry_create("tcp://127.0.0.1:*", &g->registry) != KVS_OK) {
            fprintf(stderr, "error: cannot start the bootstrap registry\n");
            return 1;
        }
        ep = kvs_registry_endpoint(g->registry);
    }
    pid_t me = getpid();
    kvs_tpgroup_reclaim(); /* the groups of runs killed before they could remove them */
    snprintf(g->groups[0], sizeof(g->groups[0]), "/kvs-%ld-p", (long) me);
    snprintf(g->groups[1], sizeof(g->groups[1]), "/kvs-%ld-d", (long) me);
    snprintf(g->groups[2], sizeof(g->groups[2]), "/kvs-%ld-c", (long) me);
    for (int i = 0; i < MAX_RANKS; i++) g->cs[i].out_fd = g->cs[i].in_fd = -1;
    uint32_t np = g->colocated ? g->tp : g->prefill_tp, nd = g->colocated ? 0 : g->decode_tp;
    for (uint32_t i = 0; i < np + nd; i++) {
        child_t *c = &g->cs[g->nchildren];
        c->role = g->colocated ? KVS_LLM_COLOCATED : i < np ? KVS_LLM_PREFILL : KVS_LLM_DECODE;
        c->rank = i < np ? i : i - np;
        if (spawn(g, c, ep) != 0) {
            fprintf(stderr, "error: cannot start rank processes: %s\n", strerror(errno));
            g->failed = 1;
            break;
        }
        g->nchildren++;
        if (c->rank == 0) g->head[c->role == KVS_LLM_PREFILL ? 0 : 1] = c;
    }
    return 0;
}

/* Serves the registry and reads what the ranks wrote, waiting a little for it. */
static void poll_ranks(gen_t *g)
{
    struct pollfd pfd[MAX_RANKS];
    int map[MAX_RANKS], n = 0;
    for (int i = 0; i < g->nchildren; i++)
        if (g->cs[i].out_fd >= 0) {
            pfd[n] = (struct pollfd){g->cs[i].out_fd, POLLIN, 0};
            map[n++] = i;
        }
    if (g->registry) kvs_registry_serve(g->registry, 0);
    if (n > 0 && poll(pfd, (nfds_t) n, g->registry ? 5 : 20) > 0)
        for (int k = 0; k < n; k++)
            if (pfd[k].revents) read_child(g, &g->cs[map[k]]);
}

/* A rank exited before quit: the deployment cannot finish, so every rank goes. */
static void on_early_exit(gen_t *g, drive_t *d)
{
    for (int i = 0; i < g->nchildren; i++) {
        const child_t *c = &g->cs[i];
        if (c->exited)
            fprintf(stderr, "error: %s rank %u exited before the end (%s %d)\n", role_name(c->role),
                    c->rank, WIFEXITED(c->status) ? "status" : "signal",
                    WIFEXITED(c->status) ? WEXITSTATUS(c->status) : WTERMSIG(c->status));
    }
    g->failed = 1;
    kill_all(g);
    d->quit_sent = 1;
    d->quit_at = kvs_now_ns();
}

/* Once both heads are ready: submits what may go now (one at a time when sequential). */
static void submit_ready(gen_t *g, drive_t *d, uint64_t now)
{
    int ready = g->head[1] != NULL && g->head[1]->ready &&
                (g->colocated || (g->head[0] != NULL && g->head[0]->ready));
    if (ready && !d->ready_reported) {
        d->ready_reported = 1;
        if (!g->json) printf("ranks ready in %.1f s\n\n", (double) (now - g->t0) / 1e9);
    }
    while (ready && !d->quit_sent && d->next < g->nreqs &&
           (!g->sequential || d->next == 0 || finished(&g->reqs[d->next - 1])))
        submit(g, &g->reqs[d->next++]);
}

/* Quits the heads when every request finished or the deadline passed; kills ranks that take
 * longer than EXIT_NS to exit after that. */
static void quit_when_done(gen_t *g, drive_t *d, uint64_t now)
{
    int all_done = d->next == g->nreqs;
    for (uint32_t i = 0; i < g->nreqs && all_done; i++) all_done = finished(&g->reqs[i]);
    if (!d->quit_sent && (all_done || now >= d->deadline)) {
        if (!all_done) {
            fprintf(stderr, "error: requests still running after %u s (--timeout-s)\n",
                    g->timeout_s);
            g->failed = 1;
        }
        for (int h = 0; h < 2; h++) {
            if (g->head[h] == NULL || g->head[h]->in_fd < 0) continue;
            send_request(g->head[h], KVS_RANK_LINE_QUIT, 0);
            close(g->head[h]->in_fd);
            g->head[h]->in_fd = -1;
        }
        d->quit_sent = 1;
        d->quit_at = now;
    }
    if (d->quit_sent && now - d->quit_at > EXIT_NS) {
        fprintf(stderr, "error: ranks did not exit within %llu s of quit; killing them\n",
                EXIT_NS / 1000000000ull);
        g->failed = 1;
        kill_all(g);
        d->quit_at = now; /* reaped on the next rounds */
    }
}

/* After every rank exited: what is left in their pipes, their exit statuses, and what a killed
 * rank left behind. */
static void finish_ranks(gen_t *g)
{
    for (int i = 0; i < g->nchildren; i++) {
        child_t *c = &g->cs[i];
        if (c->out_fd >= 0) {
            while (c->out_fd >= 0) read_child(g, c); /* what is left in the pipe */
        }
        if (c->in_fd >= 0) close(c->in_fd);
        c->in_fd = -1;
        if (!WIFEXITED(c->status) || WEXITSTATUS(c->status) != 0) g->failed = 1;
    }
    for (int i = 0; i < 3; i++) shm_unlink(g->groups[i]); /* left only by a killed rank 0 */
    kvs_registry_destroy(g->registry);
    g->registry = NULL;
}

/* Drives the deployment until every request finished, then quits it; 0 when it all went well. */
static int run_deployment(gen_t *g)
{
    if (start_ranks(g) != 0) return 1;
    drive_t d = {.live = g->nchildren,
                 .quit_sent = g->failed,
                 .deadline = g->t0 + (uint64_t) g->timeout_s * 1000000000ull};
    while (d.live > 0) {
        poll_ranks(g);
        int before = d.live;
        reap(g, &d.live);
        if (d.live < before && !d.quit_sent) {
            on_early_exit(g, &d);
            continue;
        }
        uint64_t now = kvs_now_ns();
        submit_ready(g, &d, now);
        quit_when_done(g, &d, now);
    }
    finish_ranks(g);
    return g->failed;
}

/* ---- output ---- */

static void text_of(const gen_t *g, const req_t *r, char *buf, size_t cap)
{
    size_t at = 0;
    buf[0] = '\0';
    for (uint32_t i = 0; i < r->nout && g->tok != NULL; i++) {
        const char *b;
        size_t n;
        if (kvs_tokenizer_is_control(g->tok, r->out[i])) continue;
        if (kvs_tokenizer_piece(g->tok, r->out[i], &b, &n) != KVS_OK) continue;
        for (size_t k = 0; k < n && at + 1 < cap; k++)
            if (b[k] != '\0') buf[at++] = b[k];
    }
    buf[at] = '\0';
}

/* The prefill ranks' counters summed (*tx_p: bytes and writes are the senders') and the decode
 * ranks' (*rx_p: chunks scattered); colocated ranks move nothing. */
static void side_totals(const gen_t *g, kvs_pd_metrics_t *tx_p, kvs_pd_metrics_t *rx_p)
{
    memset(tx_p, 0, sizeof(*tx_p));
    memset(rx_p, 0, sizeof(*rx_p));
    for (int i = 0; i < g->nchildren; i++) {
        const child_t *c = &g->cs[i];
        if (c->role == KVS_LLM_PREFILL) kvs_pd_metrics_add(tx_p, &c->metrics);
        if (c->role == KVS_LLM_DECODE) kvs_pd_metrics_add(rx_p, &c->metrics);
    }
}

static void print_json(gen_t *g, int ok)
{
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_bool(&j, "ok", ok);
    kvs_json_str(&j, "model", g->seeded ? "seeded" : g->model_path);
    kvs_json_str(&j, "mode", g->colocated ? "colocated" : "disaggregated");
    kvs_json_u64(&j, "prefill_tp", g->colocated ? g->tp : g->prefill_tp);
    kvs_json_u64(&j, "decode_tp", g->colocated ? g->tp : g->decode_tp);
    kvs_json_u64(&j, "page_size", g->page_size);
    kvs_json_u64(&j, "chunk", g->chunk);
    kvs_json_bool(&j, "prefill_radix", g->prefill_radix);
    kvs_json_bool(&j, "decode_radix", g->colocated ? g->prefill_radix : g->decode_radix);
    double load = 0;
    for (int i = 0; i < g->nchildren; i++)
        if (g->cs[i].load_s > load) load = g->cs[i].load_s;
    kvs_pd_metrics_t tx, rx;
    side_totals(g, &tx, &rx);
    kvs_json_double(&j, "load_s", load);
    kvs_json_array_begin(&j, "requests");
    static char text[1 << 16];
    for (uint32_t i = 0; i < g->nreqs; i++) {
        const req_t *r = &g->reqs[i];
        derived_t d = derive(g, r);
        kvs_json_object_begin(&j, NULL);
        kvs_json_u64(&j, "room", r->room);
        kvs_json_str(&j, "status", r->side[1].status[0] ? r->side[1].status : "not run");
        kvs_json_str(&j, "finish", r->side[1].finish);
        kvs_json_u64(&j, "prompt_tokens", r->prompt_len);
        kvs_json_u64(&j, "generated", r->nout);
        kvs_json_array_begin(&j, "ids");
        for (uint32_t k = 0; k < r->nout; k++) kvs_json_u64(&j, NULL, r->out[k]);
        kvs_json_array_end(&j);
        text_of(g, r, text, sizeof(text));
        kvs_json_str(&j, "text", text);
        kvs_json_u64(&j, "cached_prefill", d.cached_p);
        kvs_json_u64(&j, "cached_decode", d.cached_d);
        kvs_json_double(&j, "ttft_ms", d.ttft_ms);
        kvs_json_double(&j, "prefill_ms", d.prefill_ms);
        kvs_json_double(&j, "decode_ms", d.decode_ms);
        kvs_json_double(&j, "transfer_ms", d.transfer_ms);
        kvs_json_double(&j, "transfer_share", d.share);
        kvs_json_u64(&j, "kv_bytes", d.kv_bytes);
        kvs_json_object_end(&j);
    }
    kvs_json_array_end(&j);
    kvs_json_u64(&j, "bytes_moved", tx.bytes);
    kvs_json_u64(&j, "chunks", rx.chunks);
    kvs_json_u64(&j, "bulk_writes", tx.bulk_writes);
    kvs_json_u64(&j, "direct_writes", tx.direct_writes);
    kvs_json_double(&j, "wall_s", (double) (kvs_now_ns() - g->t0) / 1e9);
    kvs_json_end(&j);
}

static void print_totals(const gen_t *g, int ok)
{
    kvs_pd_metrics_t tx, rx;
    side_totals(g, &tx, &rx);
    if (!g->colocated)
        printf("kvstage moved %.2f MiB of KV: %llu chunks scattered, %llu bulk writes, %llu "
               "control messages\n",
               (double) tx.bytes / 1048576.0, (unsigned long long) rx.chunks,
               (unsigned long long) tx.bulk_writes,
               (unsigned long long) (tx.msgs_sent + rx.msgs_sent));
    printf("%s in %.2f s\n", ok ? "done" : "FAILED", (double) (kvs_now_ns() - g->t0) / 1e9);
}

/* ---- flags and prompts ---- */

static const char usage[] =
    "kvstage generate --prompt TEXT [--prompt TEXT ...] | --prompt-ids 1,2,3 [...] [flags]\n"
    "  runs the model disaggregated (every prefill and decode rank a process, KV through "
    "kvstage)\n  or --colocated; --prompt and --prompt-ids repeat, one request each";

/* The prompts as given, in order: each a text (--prompt) or a token id list (--prompt-ids). */
typedef struct {
    const char *text[MAX_PROMPTS], *ids[MAX_PROMPTS];
    int is_ids[MAX_PROMPTS];
    int n;
} prompts_t;

/* Takes the prompts (repeatable flags) out of argv; the rest goes to the table parser. */
static int split_prompts(int argc, char **argv, prompts_t *p, char **rest, int *nrest_p)
{
    int n = 0, nrest = 0;
    rest[nrest++] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int is_text = strcmp(a, "--prompt") == 0, is_ids = strcmp(a, "--prompt-ids") == 0;
        const char *v = NULL;
        if (strncmp(a, "--prompt=", 9) == 0) {
            is_text = 1;
            v = a + 9;
        } else if (strncmp(a, "--prompt-ids=", 13) == 0) {
            is_ids = 1;
            v = a + 13;
        } else if (is_text || is_ids) {
            if (i + 1 >= argc) {
                kvs_args_error(a, is_text ? "a text" : "token ids, e.g. 1,2,3", "needs a value");
                return -1;
            }
            v = argv[++i];
        }
        if (!is_text && !is_ids) {
            rest[nrest++] = argv[i];
            continue;
        }
        if (n == MAX_PROMPTS) {
            kvs_args_error(a, "at most " KVS_ARGS_STR(MAX_PROMPTS) " prompts", "too many prompts");
            return -1;
        }
        p->text[n] = is_text ? v : NULL;
        p->ids[n] = is_ids ? v : NULL;
        p->is_ids[n++] = is_ids;
    }
    rest[nrest] = NULL;
    p->n = n;
    *nrest_p = nrest;
    return 0;
}

/* The model's configuration and, for a GGUF, its tokenizer. 0, 1 (runtime) or 2 (usage). */
static int open_model(gen_t *g)
{
    if (g->seeded != NULL) {
        if (g->model != NULL)
            return kvs_args_error("--seeded", "--model or --seeded", "excludes --model");
        kvs_args_capture_t lib;
        kvs_args_capture_begin(&lib);
        int bad = kvs_parse_seeded(g->seeded, &g->mc) != 0 ||
                  kvs_model_config_validate(&g->mc, (kvs_tp_t){1, 0}) != KVS_OK;
        kvs_args_capture_end(&lib, bad);
        if (bad)
            return kvs_args_error("--seeded", "L,dim,ffn,heads,kv_heads,head_dim,vocab",
                                  "'%s' is not a model shape%s%s", g->seeded,
                                  lib.msg[0] ? ": " : "", lib.msg);
        return 0;
    }
    if (g->model != NULL) {
        snprintf(g->model_path, sizeof(g->model_path), "%s", g->model);
    } else if (kvs_model_default_path(g->model_path, sizeof(g->model_path)) != KVS_OK) {
        return 1;
    }
    kvs_gguf_t *gguf = NULL;
    if (kvs_gguf_open(g->model_path, &gguf) != KVS_OK) {
        fprintf(stderr, "error: cannot open the model %s\n", g->model_path);
        return 1;
    }
    int rc = 0;
    if (kvs_model_config_from_gguf(gguf, &g->mc) != KVS_OK) {
        fprintf(stderr, "error: %s is not a model this engine runs\n", g->model_path);
        rc = 1;
    } else if (kvs_tokenizer_from_gguf(gguf, &g->tok) != KVS_OK) {
        fprintf(stderr, "error: %s has no tokenizer this tool reads\n", g->model_path);
        rc = 1;
    }
    kvs_gguf_close(gguf);
    return rc;
}

static int tokenize(gen_t *g, req_t *r, const char *text)
{
    char *formatted = NULL;
    const char *src = text;
    if (g->chat) {
        kvs_chat_msg_t msgs[2];
        size_t n = 0;
        if (g->system != NULL) msgs[n++] = (kvs_chat_msg_t){"system", g->system};
        msgs[n++] = (kvs_chat_msg_t){"user", text};
        if (kvs_chat_format(kvs_tokenizer_chat_template(g->tok), msgs, n, 1, &formatted) !=
            KVS_OK) {
            fprintf(stderr, "error: the model's chat template is not one this tool renders\n");
            return 1;
        }
        src = formatted;
    }
    size_t n = 0;
    kvs_status_t st = kvs_tokenizer_encode_alloc(g->tok, src, strlen(src), g->chat, &r->prompt, &n);
    kvs_free(formatted);
    if (st != KVS_OK) {
        fprintf(stderr, "error: cannot tokenize the prompt '%s'\n", text);
        return 1;
    }
    r->prompt_len = (uint32_t) n;
    return 0;
}

static void gen_free(gen_t *g)
{
    for (uint32_t i = 0; i < g->nreqs; i++) {
        kvs_free(g->reqs[i].prompt);
        kvs_free(g->reqs[i].out);
    }
    kvs_tokenizer_destroy(g->tok);
}

static void gen_default(gen_t *g)
{
    memset(g, 0, sizeof(*g));
    g->t0 = kvs_now_ns();
    g->max_tokens = 32;
    g->top_p = 1.0;
    g->repetition = 1.0;
    g->prefill_tp = g->decode_tp = 1;
    g->page_size = 16;
    g->chunk = 64;
    g->prefill_radix = g->decode_radix = 1;
    g->checksum = 1;
    g->sequential = 1;
    g->seed = 1;
    g->timeout_s = 300;
}

static void add_sampling_flags(kvs_arg_table_t *t, gen_t *g)
{
    const kvs_arg_t a[] = {
        {"chat", KVS_ARG_FLAG, &g->chat, "render each prompt with the model's chat template", NULL,
         NULL},
        {"system", KVS_ARG_STR, &g->system, "system message (with --chat)", NULL, NULL},
        {"max-tokens", KVS_ARG_U32, &g->max_tokens, "tokens to generate at most (32)",
         "[1,1048576]", NULL},
        {"temperature", KVS_ARG_DOUBLE, &g->temperature, "sampling temperature (0: greedy)",
         "[0,100]", NULL},
        {"top-p", KVS_ARG_DOUBLE, &g->top_p, "nucleus mass (1)", "(0,1]", NULL},
        {"top-k", KVS_ARG_U32, &g->top_k, "keep the k most likely tokens (0: off)", "[0,1048576]",
         NULL},
        {"min-p", KVS_ARG_DOUBLE, &g->min_p,
         "keep tokens at least this fraction as likely as the top (0)", "[0,1]", NULL},
        {"presence-penalty", KVS_ARG_DOUBLE, &g->presence,
         "minus this for tokens generated before (0)", "[-2,2]", NULL},
        {"frequency-penalty", KVS_ARG_DOUBLE, &g->frequency,
         "minus this per time a token was generated (0)", "[-2,2]", NULL},
        {"repetition-penalty", KVS_ARG_DOUBLE, &g->repetition,
         "divides (or multiplies) the logits of prompt and generated tokens (1)", "(0,2]", NULL},
        {"ignore-eos", KVS_ARG_FLAG, &g->ignore_eos,
         "the end-of-text token (with --chat, end-of-turn too) does not end a request", NULL, NULL},
        {"seed", KVS_ARG_U64, &g->seed, "sampling seed of the first request (+1 for each next)",
         NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, a);
}

static void add_instance_flags(kvs_arg_table_t *t, gen_t *g)
{
    const kvs_arg_t a[] = {
        {"prefill-tp", KVS_ARG_U32, &g->prefill_tp, "prefill ranks (1)", KVS_ARGS_TP, NULL},
        {"decode-tp", KVS_ARG_U32, &g->decode_tp, "decode ranks (1)", KVS_ARGS_TP, NULL},
        {"colocated", KVS_ARG_FLAG, &g->colocated,
         "one instance does prefill and decode: no transfer", NULL, NULL},
        {"tp", KVS_ARG_U32, &g->tp, "ranks of the colocated instance (default: --prefill-tp)",
         KVS_ARGS_TP, &g->tp_seen},
        {"device", KVS_ARG_CHOICE, &g->device,
         "where the model runs: cpu (f32 KV) or cuda (bf16 KV; TP ranks sharing a GPU reduce "
         "through the host: correct, slow; on distinct GPUs through NCCL when built with it)",
         "cpu|cuda", NULL},
        {"gpus", KVS_ARG_STR, &g->gpus,
         "with --device cuda: the prefill (or colocated) and decode instances' GPUs (0 or 0,0), "
         "all of an instance's ranks on its GPU; ranks sharing a GPU reduce through the host TP "
         "group (correct, slow), ranks on distinct GPUs (llm-rank --gpu) through NCCL when kvstage "
         "is built with it",
         KVS_ARGS_GPUS_ACCEPTED, NULL},
        {"kv-dtype", KVS_ARG_CHOICE, &g->kv_dtype,
         "K/V elements: f32 (the CPU's default) or bf16 (what a GPU keeps)", "f32|bf16",
         &g->kv_dtype_seen},
    };
    KVS_ARG_TABLE_ADD(t, a);
}

static void add_model_flags(kvs_arg_table_t *t, gen_t *g)
{
    const kvs_arg_t a[] = {
        {"model", KVS_ARG_STR, &g->model, "GGUF file (default: the embedded SmolLM2)", NULL, NULL},
        {"seeded", KVS_ARG_STR, &g->seeded,
         "random weights of shape L,dim,ffn,heads,kv_heads,head_dim,vocab (needs --prompt-ids)",
         "L,dim,ffn,heads,kv_heads,head_dim,vocab", NULL},
        {"model-seed", KVS_ARG_U64, &g->model_seed, "seed of --seeded weights", NULL, NULL},
        {"page-size", KVS_ARG_U32, &g->page_size, "tokens per KV page (16)", "[1,65536]", NULL},
        {"chunk", KVS_ARG_U32, &g->chunk, "prefill chunk, also kvstage's chunk (64)", "[1,65536]",
         NULL},
        {"max-model-len", KVS_ARG_U32, &g->max_model_len,
         "prompt + --max-tokens at most (default: the model's context)", "[2,1048576]", NULL},
        {"kv-tokens", KVS_ARG_U64, &g->kv_tokens,
         "KV pool of each rank, tokens (default: twice --max-model-len)", "[2,4294967296]", NULL},
        {"prefill-radix", KVS_ARG_ONOFF, &g->prefill_radix,
         "prefill (or colocated) radix prefix cache (on)", NULL, NULL},
        {"decode-radix", KVS_ARG_ONOFF, &g->decode_radix, "decode radix prefix cache (on)", NULL,
         NULL},
        {"checksum", KVS_ARG_ONOFF, &g->checksum,
         "end-to-end chunk checksums of the KV handoff (on)", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, a);
}

static void add_run_flags(kvs_arg_table_t *t, gen_t *g)
{
    const kvs_arg_t a[] = {
        {"sequential", KVS_ARG_ONOFF, &g->sequential,
         "submit each request once the previous one finished (on)", NULL, NULL},
        {"max-running", KVS_ARG_U32, &g->max_running,
         "requests admitted at once (default: all, at most 16)", "[1,1024]", NULL},
        {"data", KVS_ARG_CHOICE, &g->data, "UCX data transports", "auto|shm|tcp", NULL},
        {"timeout-s", KVS_ARG_U32, &g->timeout_s, "give up after this long (300)", "[1,86400]",
         NULL},
        {"json", KVS_ARG_FLAG, &g->json, "one JSON object with every request", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, a);
}

enum { GO_ON = -1 };

/* The prompts into p and the other flags through t. GO_ON, or the exit code (0 after --help)
 * after saying why. */
static int parse_flags(const kvs_arg_table_t *t, int argc, char **argv, prompts_t *p)
{
    char **rest = kvs_calloc((size_t) argc + 1, sizeof(char *));
    if (rest == NULL) return 1;
    int nrest = 0;
    if (split_prompts(argc, argv, p, rest, &nrest) != 0) {
        kvs_free(rest);
        return 2;
    }
    int rc = kvs_arg_table_parse(t, usage, nrest, rest, 1);
    kvs_free(rest);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    if (p->n == 0)
        return kvs_args_error("--prompt", "--prompt TEXT or --prompt-ids 1,2,3, repeated",
                              "give at least one prompt");
    return GO_ON;
}

/* The checks that need no model; 0, or 2 after saying why. */
static int check_flags(gen_t *g)
{
    /* The ranges are the flag table's; the sampler's own check covers what they do not. */
    const kvs_sample_params_t sp = sampling_of(g);
    const char *why = kvs_sample_params_invalid(&sp, 0);
    if (why != NULL) return kvs_args_error(NULL, NULL, "bad sampling flags: %s", why);
    if (!g->colocated && g->tp_seen)
        return kvs_args_error("--tp", "--tp with --colocated, else --prefill-tp and --decode-tp",
                              "is for --colocated");
    if (!g->tp_seen) g->tp = g->prefill_tp;
    if (g->gpus != NULL && !g->device)
        return kvs_args_error("--gpus", "--gpus with --device cuda", "needs --device cuda");
    if (g->device && g->kv_dtype_seen && g->kv_dtype == 0)
        return kvs_args_error("--kv-dtype", "bf16 with --device cuda",
                              "a GPU keeps its KV in bf16");
    if (g->gpus != NULL && kvs_args_parse_gpus(g->gpus, &g->gpu[0], &g->gpu[1]) != 0)
        return kvs_args_error("--gpus", KVS_ARGS_GPUS_ACCEPTED, "'%s' is malformed", g->gpus);
    return 0;
}

/* The checks against the opened model, and its stop tokens; 0, or 2 after saying why. */
static int check_model(gen_t *g)
{
    if (g->tok == NULL && g->chat)
        return kvs_args_error("--chat", "--chat with a GGUF model (not --seeded)",
                              "needs a model with a tokenizer");
    if (g->colocated ? kvs_model_tp_check(&g->mc, "--tp", g->tp) != 0
                     : kvs_model_tp_check(&g->mc, "--prefill-tp", g->prefill_tp) != 0 ||
                           kvs_model_tp_check(&g->mc, "--decode-tp", g->decode_tp) != 0)
        return 2;
    if (kvs_check_context_flags(&g->max_model_len, g->kv_tokens, g->page_size, g->mc.max_ctx) != 0)
        return 2;
    g->eos = g->tok && !g->ignore_eos ? kvs_tokenizer_eos(g->tok) : UINT32_MAX;
    g->stop_id = g->eos;
    if (g->chat && !g->ignore_eos) {
        uint32_t id;
        if (kvs_tokenizer_token_id(g->tok, "<|im_end|>", 10, &id) == KVS_OK) g->stop_id = id;
    }
    return 0;
}

/* Prompt i (of the command line) into r: its token ids, checked against the model, and room for
 * its output. 0, or the exit code after saying why. */
static int load_prompt(gen_t *g, req_t *r, const prompts_t *p, int i)
{
    if (p->is_ids[i]) {
        r->label = p->ids[i];
        if (parse_ids(p->ids[i], &r->prompt, &r->prompt_len) != 0)
            return kvs_args_error("--prompt-ids", "token ids, e.g. 1,2,3", "'%s' is malformed",
                                  p->ids[i]);
    } else {
        r->label = p->text[i];
        if (g->tok == NULL)
            return kvs_args_error("--prompt", "--prompt-ids with --seeded",
                                  "a seeded model has no tokenizer");
        if (tokenize(g, r, p->text[i]) != 0) return 1;
    }
    const char *flag = p->is_ids[i] ? "--prompt-ids" : "--prompt";
    if (r->prompt_len == 0)
        return kvs_args_error(flag, "a prompt of at least one token", "prompt %d has no tokens",
                              i + 1);
    for (uint32_t k = 0; k < r->prompt_len; k++)
        if (r->prompt[k] >= g->mc.vocab)
            return kvs_args_error(flag, "ids below the vocabulary size",
                                  "token id %u of prompt %d is outside the vocabulary (%u)",
                                  r->prompt[k], i + 1, g->mc.vocab);
    if ((uint64_t) r->prompt_len + g->max_tokens > g->max_model_len)
        return kvs_args_error("--max-tokens", "prompt + --max-tokens within --max-model-len",
                              "prompt %d (%u tokens) plus --max-tokens %u exceeds the context of "
                              "%u tokens",
                              i + 1, r->prompt_len, g->max_tokens, g->max_model_len);
    r->out = kvs_calloc(g->max_tokens, sizeof(uint32_t));
    return r->out == NULL ? 1 : 0;
}

/* Checks the flags, opens the model and turns every prompt into a request; 0, or the exit code
 * after saying why. */
static int gen_config_build(gen_t *g, const prompts_t *p)
{
    int rc;
    if ((rc = check_flags(g)) != 0 || (rc = open_model(g)) != 0 || (rc = check_model(g)) != 0)
        return rc;
    for (int i = 0; i < p->n; i++) {
        req_t *r = &g->reqs[g->nreqs++];
        r->room = g->nreqs;
        if ((rc = load_prompt(g, r, p, i)) != 0) return rc;
    }
    if (g->max_running == 0) g->max_running = g->nreqs < 16 ? g->nreqs : 16;
    return 0;
}

static void print_banner(const gen_t *g)
{
    const char *name = g->seeded ? "seeded model" : strrchr(g->model_path, '/');
    name = name && name[0] == '/' ? name + 1 : name ? name : g->model_path;
    char where[48] = "";
    if (g->device && g->colocated)
        snprintf(where, sizeof(where), " on GPU %d", g->gpu[0]);
    else if (g->device)
        snprintf(where, sizeof(where), " on GPUs %d -> %d", g->gpu[0], g->gpu[1]);
    if (g->colocated)
        printf("kvstage generate: %s%s, colocated TP%u (no transfer), page %u, chunk %u, radix "
               "%s\n",
               name, where, g->tp, g->page_size, g->chunk, g->prefill_radix ? "on" : "off");
    else
        printf("kvstage generate: %s%s, prefill TP%u -> decode TP%u, every rank a process "
               "(ZeroMQ control, UCX data);\npage %u, chunk %u, radix prefill %s / decode "
               "%s, %u request%s%s\n",
               name, where, g->prefill_tp, g->decode_tp, g->page_size, g->chunk,
               g->prefill_radix ? "on" : "off", g->decode_radix ? "on" : "off", g->nreqs,
               g->nreqs == 1 ? "" : "s", g->sequential && g->nreqs > 1 ? " one after another" : "");
    fflush(stdout);
}

/* Runs the deployment over every request and prints the result; 0 when each one succeeded. */
static int gen_run(gen_t *g)
{
    if (!g->json) print_banner(g);
    signal(SIGPIPE, SIG_IGN);
    int ok = run_deployment(g) == 0;
    for (uint32_t i = 0; i < g->nreqs; i++)
        ok &= finished(&g->reqs[i]) && !g->reqs[i].rejected &&
              strcmp(g->reqs[i].side[1].status, "ok") == 0 &&
              (g->colocated || strcmp(g->reqs[i].side[0].status, "ok") == 0);
    if (g->json)
        print_json(g, ok);
    else
        print_totals(g, ok);
    return ok ? 0 : 1;
}

int kvs_cmd_generate(int argc, char **argv)
{
    static gen_t gen; /* too large for the stack: every request's and rank's buffers */
    gen_t *g = &gen;
    gen_default(g);
    kvs_arg_table_t t = {.count = 0};
    add_sampling_flags(&t, g);
    add_instance_flags(&t, g);
    add_model_flags(&t, g);
    add_run_flags(&t, g);
    prompts_t p;
    int rc = parse_flags(&t, argc, argv, &p);
    if (rc != GO_ON) return rc;
    if ((rc = gen_config_build(g, &p)) == 0) rc = gen_run(g);
    gen_free(g);
    return rc;
}
