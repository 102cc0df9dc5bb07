/* `kvstage serve`: one instance of a real model (colocated, prefill or decode) behind the
 * OpenAI-compatible HTTP server. It launches the instance's rank processes (instance.h), serves
 * a prefill instance's bootstrap registry from a thread of its own, puts a rank backend
 * (kvstage/rank_backend.h) over rank 0, and serves HTTP until SIGINT or SIGTERM; then it stops
 * the server (live requests end), quits rank 0 and waits for every rank.
 *
 * A rank that dies takes its instance down (TP ranks run in lockstep). Without --restart-ranks
 * the server then exits 1, naming the rank and how it ended. With it, the server kills the rest
 * of the instance (its requests in flight fail: the rank backend ends them), removes its TP group
 * segment and launches a fresh instance under a new group name, behind the same HTTP server and
 * port and (prefill) the same registry, where the new ranks register again so that decode ranks
 * find them; /health is 503 until it is ready. At most --max-restarts restarts in any
 * RESTART_WINDOW_S: the next death within them exits 1.
 *
 * A seeded model has no tokenizer: the server then uses the byte tokenizer (ids 0-255 are
 * bytes, 256 its EOS), so the seeded vocabulary must hold at least 257 ids; generated ids above
 * 256 render as nothing. Token-id prompts work either way. */
#include "cmd/commands.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/args.h"
#include "common/http_flags.h"
#include "common/instance.h"
#include "common/port.h"
#include "kvstage/clock.h"
#include "model/gguf.h"
#include "http/rank_backend.h"
#include "kvstage/registry.h"
#include "http/server.h"
#include "model/tokenizer.h"
#include "common/serve_signal.h"

#define EXIT_WAIT_MS      15000 /* ranks get this long to exit after quit */
#define RESTART_WINDOW_S  600   /* --max-restarts counts the restarts of this long */
#define MAX_RESTARTS_FLAG 1000  /* --max-restarts at most */

typedef struct {
    kvs_registry_t *registry;
    int stop; /* atomic */
} reg_thread_t;

static void *registry_main(void *arg)
{
    reg_thread_t *t = arg;
    while (!__atomic_load_n(&t->stop, __ATOMIC_RELAXED)) kvs_registry_serve(t->registry, 50);
    return NULL;
}

static const char usage[] =
    "kvstage serve --role prefill|decode|colocated [--model PATH | --seeded L,dim,ffn,heads,"
    "kv_heads,head_dim,vocab] --tp N [--port P] [flags]\n"
    "  one instance of a real model (every rank a process) behind an OpenAI-compatible HTTP\n"
    "  server; a decode instance is bound to the prefill instance whose registry --bootstrap\n"
    "  names, or without it takes rooms from any compatible prefill instance; put\n"
    "  `kvstage router` in front of prefill and decode servers";

typedef struct {
    int role; /* 0 colocated, 1 prefill, 2 decode (the llm roles) */
    const char *model, *seeded, *host, *bootstrap, *registry, *name;
    uint64_t model_seed;
    uint32_t tp, peer_tp, port, page_size, chunk, max_running, threads;
    uint32_t max_model_len; /* 0 until checked: the model's context */
    uint64_t kv_tokens;     /* 0: twice max_model_len */
    uint32_t startup_s;
    uint32_t max_peer_instances, peer_idle_s; /* per-room decode; 0: the ranks' defaults */
    int restart_ranks;
    uint32_t max_restarts;
    int max_restarts_seen;
    int radix, data, peer_tp_seen, page_seen, chunk_seen, checksum;
    int device; /* 0 cpu, 1 cuda */
    uint32_t gpus;
    int gpus_seen;
    int kv_dtype, kv_dtype_seen; /* 0 f32, 1 bf16 */
    kvs_http_flags_t http;
} serve_flags_t;

/* The model's configuration and tokenizer (GGUF) or the seeded configuration. 0, 1 or 2. */
static int open_model(serve_flags_t *f, char *path, size_t cap, kvs_model_config_t *mc,
                      kvs_tokenizer_t **tok_p)
{
    if (f->seeded != NULL) {
        kvs_args_capture_t lib;
        kvs_args_capture_begin(&lib);
        int bad = kvs_parse_seeded(f->seeded, mc) != 0 ||
                  kvs_model_config_validate(mc, (kvs_tp_t){1, 0}) != KVS_OK;
        kvs_args_capture_end(&lib, bad);
        if (bad)
            return kvs_args_error("--seeded", "L,dim,ffn,heads,kv_heads,head_dim,vocab",
                                  "'%s' is not a model shape%s%s", f->seeded,
                                  lib.msg[0] ? ": " : "", lib.msg);
        if (mc->vocab < 257)
            return kvs_args_error("--seeded", "a vocab of at least 257",
                                  "a seeded model is served with the byte tokenizer, which needs "
                                  "257 ids");
        return 0;
    }
    if (f->model != NULL)
        snprintf(path, cap, "%s", f->model);
    else if (kvs_model_default_path(path, cap) != KVS_OK)
        return 1;
    kvs_gguf_t *g = NULL;
    if (kvs_gguf_open(path, &g) != KVS_OK) {
        fprintf(stderr, "error: cannot open the model %s\n", path);
        return 1;
    }
    int rc = 0;
    if (kvs_model_config_from_gguf(g, mc) != KVS_OK) {
        fprintf(stderr, "error: %s is not a model this engine runs\n", path);
        rc = 1;
    } else if (kvs_tokenizer_from_gguf(g, tok_p) != KVS_OK) {
        fprintf(stderr, "error: %s has no tokenizer this tool reads\n", path);
        rc = 1;
    }
    kvs_gguf_close(g);
    return rc;
}

/* The served model's name: the GGUF's file name without ".gguf", or "seeded". */
static void model_name(const serve_flags_t *f, const char *path, char *buf, size_t cap)
{
    if (f->name != NULL) {
        snprintf(buf, cap, "%s", f->name);
        return;
    }
    if (f->seeded != NULL) {
        snprintf(buf, cap, "seeded");
        return;
    }
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t n = strlen(base);
    if (n > 5 && strcmp(base + n - 5, ".gguf") == 0) n -= 5;
    snprintf(buf, cap, "%.*s", (int) n, base);
}

/* Bytes of one K/V element: bf16 on a GPU or with --kv-dtype bf16, else f32. */
static uint32_t kv_bytes(const serve_flags_t *f)
{
    return f->device || f->kv_dtype == 1 ? 2 : sizeof(float);
}

/* The checks that need no model, before anything starts; 0, or 2 after the error line. */
static int check_flags(const serve_flags_t *f)
{
    const int role = f->role;
    const char *per_room = f->max_peer_instances ? "--max-peer-instances"
                           : f->peer_idle_s      ? "--peer-idle-s"
                                                 : NULL;
    if (per_room != NULL && (role != KVS_LLM_DECODE || f->bootstrap != NULL))
        return kvs_args_error(per_room, "with --role decode and no --bootstrap",
                              "is for decode servers that take rooms from any prefill instance");
    if (role == KVS_LLM_DECODE && f->bootstrap == NULL && f->peer_tp_seen)
        return kvs_args_error("--peer-tp", "--peer-tp with --bootstrap",
                              "a decode server without --bootstrap learns each prefill "
                              "instance's TP from its registry");
    if (role != KVS_LLM_DECODE && f->bootstrap != NULL)
        return kvs_args_error("--bootstrap", "--bootstrap with --role decode",
                              "is for --role decode");
    if (f->bootstrap != NULL && strncmp(f->bootstrap, "tcp://", 6) != 0)
        return kvs_args_error("--bootstrap", "tcp://HOST:PORT", "'%s' is not a tcp:// endpoint",
                              f->bootstrap);
    if (f->registry != NULL && role != KVS_LLM_PREFILL)
        return kvs_args_error("--registry", "--registry with --role prefill",
                              "is for --role prefill");
    if (f->peer_tp_seen && role == KVS_LLM_COLOCATED)
        return kvs_args_error("--peer-tp", "--peer-tp with --role prefill or decode",
                              "is for prefill and decode servers");
    if (f->model != NULL && f->seeded != NULL)
        return kvs_args_error("--seeded", "--model or --seeded", "excludes --model");
    if (f->max_restarts_seen && !f->restart_ranks)
        return kvs_args_error("--max-restarts", "--max-restarts with --restart-ranks",
                              "limits the restarts of --restart-ranks");
    if (f->gpus_seen && !f->device)
        return kvs_args_error("--gpus", "--gpus with --device cuda", "needs --device cuda");
    if (f->device && f->kv_dtype_seen && f->kv_dtype == 0)
        return kvs_args_error("--kv-dtype", "bf16 with --device cuda",
                              "a GPU keeps its KV in bf16");
    return 0;
}

/* The checks against the model (and, for decode, the prefill instance's geometry); 0, or 2
 * after the error line. */
static int check_model(serve_flags_t *f, const kvs_model_config_t *mc)
{
    if (kvs_check_context_flags(&f->max_model_len, f->kv_tokens, f->page_size, mc->max_ctx) != 0)
        return 2;
    if (kvs_model_tp_check(mc, "--tp", f->tp) != 0) return 2;
    if (f->role != KVS_LLM_COLOCATED && kvs_model_tp_check(mc, "--peer-tp", f->peer_tp) != 0)
        return 2;
    return 0;
}

/* Decode: what the prefill instance registered fills the flags not given; the wait ends at
 * deadline (--startup-timeout-s from the start). */
static int learn_from_prefill(serve_flags_t *f, uint64_t deadline)
{
    kvs_msg_register_t reg;
    const uint64_t now = kvs_now_ns();
    if (now >= deadline || kvs_registry_query(f->bootstrap, 0, deadline - now, &reg) != KVS_OK) {
        fprintf(stderr,
                "error: no prefill instance answered at %s within %u s "
                "(--startup-timeout-s)\n",
                f->bootstrap, f->startup_s);
        return 1;
    }
    if (!f->peer_tp_seen) f->peer_tp = reg.tp_size;
    if (!f->page_seen) f->page_size = reg.page_size;
    if (!f->chunk_seen) f->chunk = reg.chunk_tokens;
    return 0;
}

static const char *role_str(int role)
{
    return role == KVS_LLM_PREFILL ? "prefill" : role == KVS_LLM_DECODE ? "decode" : "colocated";
}

static void serve_flags_default(serve_flags_t *f)
{
    memset(f, 0, sizeof(*f));
    f->host = "127.0.0.1";
    f->tp = f->peer_tp = 1;
    f->page_size = 16;
    f->chunk = 64;
    f->max_running = 4;
    f->radix = 1;
    f->checksum = 1;
    f->threads = 4;
    f->startup_s = 300;
    f->max_restarts = 3;
}

/* The instance's role, model and endpoints. */
static void add_instance_flags(kvs_arg_table_t *t, serve_flags_t *f)
{
    const kvs_arg_t g[] = {
        {"role", KVS_ARG_CHOICE, &f->role, "what this instance does", "colocated|prefill|decode",
         NULL},
        {"model", KVS_ARG_STR, &f->model, "GGUF file (default: the embedded SmolLM2)", NULL, NULL},
        {"seeded", KVS_ARG_STR, &f->seeded,
         "random weights of shape L,dim,ffn,heads,kv_heads,head_dim,vocab (byte tokenizer)",
         "L,dim,ffn,heads,kv_heads,head_dim,vocab", NULL},
        {"model-seed", KVS_ARG_U64, &f->model_seed, "seed of --seeded weights", NULL, NULL},
        {"tp", KVS_ARG_U32, &f->tp, "ranks of this instance (1)", KVS_ARGS_TP, NULL},
        {"peer-tp", KVS_ARG_U32, &f->peer_tp,
         "prefill: the decode instance's TP (1); decode: the prefill instance's (default: from "
         "its registry)",
         KVS_ARGS_TP, &f->peer_tp_seen},
        {"port", KVS_ARG_U32, &f->port, "HTTP port (0: a free one, printed)", "[0,65535]", NULL},
        {"host", KVS_ARG_STR, &f->host, "IPv4 address to bind (127.0.0.1)", "an IPv4 address",
         NULL},
        {"bootstrap", KVS_ARG_STR, &f->bootstrap,
         "decode: the prefill instance's registry endpoint (its server prints it); without it, "
         "rooms from any compatible prefill instance (each room names its own)",
         "tcp://HOST:PORT", NULL},
        {"max-peer-instances", KVS_ARG_U32, &f->max_peer_instances,
         "decode without --bootstrap: prefill instances wired at once; the least recently used "
         "idle one makes room for a new one (16)",
         "[1,1024]", NULL},
        {"peer-idle-s", KVS_ARG_U32, &f->peer_idle_s,
         "decode without --bootstrap: a prefill instance without a room this long is closed "
         "(300)",
         "[1,86400]", NULL},
        {"registry", KVS_ARG_STR, &f->registry,
         "prefill: where to serve the registry (default tcp://127.0.0.1:*, a free port)",
         "tcp://HOST:PORT or tcp://HOST:*", NULL},
        {"name", KVS_ARG_STR, &f->name, "model name served (default: the GGUF's file name)", NULL,
         NULL},
        {"restart-ranks", KVS_ARG_FLAG, &f->restart_ranks,
         "when a rank dies, fail the requests in flight and start the instance's ranks again "
         "behind the same port (and registry); without it the server exits 1",
         NULL, NULL},
        {"max-restarts", KVS_ARG_U32, &f->max_restarts,
         "with --restart-ranks: restarts allowed in any 10 minutes; a rank death past them exits "
         "1 (3)",
         "[1,1000]", &f->max_restarts_seen},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* The engine's geometry and limits, and the server's threads. */
static void add_engine_flags(kvs_arg_table_t *t, serve_flags_t *f)
{
    const kvs_arg_t g[] = {
        {"page-size", KVS_ARG_U32, &f->page_size,
         "tokens per KV page (16; decode: the prefill instance's)", "[1,65536]", &f->page_seen},
        {"chunk", KVS_ARG_U32, &f->chunk,
         "prefill chunk, also kvstage's chunk (64; decode: the prefill instance's)", "[1,65536]",
         &f->chunk_seen},
        {"radix", KVS_ARG_ONOFF, &f->radix, "radix prefix cache (on)", NULL, NULL},
        {"checksum", KVS_ARG_ONOFF, &f->checksum,
         "end-to-end chunk checksums of the KV handoff; a decode server refuses a prefill "
         "instance with the other setting (on)",
         NULL, NULL},
        {"max-running", KVS_ARG_U32, &f->max_running,
         "requests admitted at once (4); on a prefill server, prompts computing at once; on a "
         "decode server, requests generating or receiving their KV",
         "[1,1024]", NULL},
        {"max-model-len", KVS_ARG_U32, &f->max_model_len,
         "prompt + max_tokens of a request at most; a request without max_tokens may use the "
         "rest (default: the model's context length)",
         "[2,1048576]", NULL},
        {"kv-tokens", KVS_ARG_U64, &f->kv_tokens,
         "KV pool of each rank, tokens; pages are taken as sequences grow, and the newest request "
         "is preempted and recomputed when it runs out (kvstage_preemptions_total in /metrics); a "
         "prefill server starts a prompt before decode asks for it only in what its pool holds "
         "beyond one --max-model-len (default: twice --max-model-len)",
         "[2,4294967296]", NULL},
        {"threads", KVS_ARG_U32, &f->threads, "HTTP worker threads (4)", "[1,1024]", NULL},
        {"data", KVS_ARG_CHOICE, &f->data, "UCX data transports", "auto|shm|tcp", NULL},
        {"device", KVS_ARG_CHOICE, &f->device,
         "where the model runs: cpu (f32 KV) or cuda (bf16 KV; both servers of a pair must "
         "agree; TP ranks share the GPU and reduce through the host: correct, slow)",
         "cpu|cuda", NULL},
        {"gpus", KVS_ARG_U32, &f->gpus,
         "with --device cuda: the GPU of all this instance's ranks (0); ranks sharing a GPU reduce "
         "through the host TP group (correct, slow), ranks on distinct GPUs (llm-rank --gpu) "
         "through NCCL when kvstage is built with it",
         "[0,1024]", &f->gpus_seen},
        {"kv-dtype", KVS_ARG_CHOICE, &f->kv_dtype,
         "K/V elements: f32 (the CPU's default) or bf16 (a GPU's only one; a CPU server pairs "
         "with a GPU server in bf16)",
         "f32|bf16", &f->kv_dtype_seen},
        {"startup-timeout-s", KVS_ARG_U32, &f->startup_s,
         "give up when the instance is not ready this long after the start, a decode "
         "server's wait for its prefill instance included (300)",
         "[1,86400]", NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* What one serve run has started, so that serve_teardown ends it whatever step failed. */
typedef struct {
    const serve_flags_t *f;
    const char *role; /* role_str, for messages */
    const char *path; /* the GGUF ("" when seeded) */
    const kvs_model_config_t *mc;
    kvs_tokenizer_t *tok; /* NULL: the byte tokenizer */
    const char *ep;       /* the prefill instance's registry: served here, or --bootstrap */
    kvs_registry_t *registry;
    reg_thread_t rt;
    pthread_t reg_thread;
    int reg_started;
    kvs_instance_t inst;
    int inst_started;
    uint32_t generation; /* instances started before the current one (restarts) */
    uint64_t restart_ns[MAX_RESTARTS_FLAG]; /* ring of the last max_restarts restarts' times */
    kvs_rank_backend_t *backend;
    kvs_server_t *srv;
    uint64_t deadline; /* --startup-timeout-s from the start: ready by then */
} serve_run_t;

/* Prefill: the bootstrap registry, served from a thread of its own. 0, or 1 after saying why. */
static int start_registry(serve_run_t *s)
{
    const char *bind = s->f->registry ? s->f->registry : "tcp://127.0.0.1:*";
    if (kvs_registry_create(bind, &s->registry) != KVS_OK) {
        fprintf(stderr, "error: cannot serve the bootstrap registry at %s\n", bind);
        return 1;
    }
    s->ep = kvs_registry_endpoint(s->registry);
    s->rt.registry = s->registry;
    if (pthread_create(&s->reg_thread, NULL, registry_main, &s->rt) != 0) {
        fprintf(stderr, "error: cannot start the registry thread\n");
        return 1;
    }
    s->reg_started = 1;
    return 0;
}

static kvs_server_role_t server_role(int role)
{
    return role == KVS_LLM_PREFILL  ? KVS_SERVER_ROLE_PREFILL
           : role == KVS_LLM_DECODE ? KVS_SERVER_ROLE_DECODE
                                    : KVS_SERVER_ROLE_NONE;
}

/* The rank processes (s->inst, generation s->generation). 0, or 1 after saying why. */
static int start_ranks(serve_run_t *s)
{
    const serve_flags_t *f = s->f;
    kvs_instance_config_t ic = {.role = (kvs_llm_role_t) f->role,
                                .tp = f->tp,
                                .peer_tp = f->peer_tp,
                                .model_path = f->seeded ? NULL : s->path,
                                .seeded = f->seeded,
                                .model_seed = f->model_seed,
                                .page_size = f->page_size,
                                .chunk = f->chunk,
                                .max_running = f->max_running,
                                .max_context = f->max_model_len,
                                .kv_tokens = f->kv_tokens,
                                .radix = f->radix,
                                .no_checksum = !f->checksum,
                                .registry = s->ep,
                                .max_peer_instances = f->max_peer_instances,
                                .peer_idle_s = f->peer_idle_s,
                                .data = f->data,
                                .gpu = f->device ? (int) f->gpus : -1,
                                .kv_bf16 = f->kv_dtype == 1,
                                .generation = s->generation};
    if (kvs_instance_start(&ic, &s->inst) != 0) return 1;
    s->inst_started = 1;
    return 0;
}

/* The rank processes and the backend over rank 0. 0, or 1 after saying why. */
static int start_instance(serve_run_t *s)
{
    const serve_flags_t *f = s->f;
    const kvs_model_config_t *mc = s->mc;
    if (start_ranks(s) != 0) return 1;
    kvs_rank_backend_config_t bc = {.in_fd = s->inst.in_fd,
                                    .out_fd = s->inst.out_fd,
                                    .role = server_role(f->role),
                                    .bootstrap = f->role == KVS_LLM_DECODE ? s->ep : NULL,
                                    .page_size = f->page_size,
                                    .kv_bytes_per_token = (uint64_t) mc->layers * mc->kv_heads *
                                                          mc->head_dim * 2 * kv_bytes(f),
                                    .vocab = mc->vocab,
                                    .text_vocab = s->tok ? 0 : 257,
                                    .max_context = f->max_model_len,
                                    .per_room = f->role == KVS_LLM_DECODE && s->ep == NULL,
                                    .geo = {.shape = kvs_model_config_kv_shape(mc, kv_bytes(f)),
                                            .prefill_tp = 1,
                                            .decode_tp = f->tp,
                                            .page_size = f->page_size,
                                            .chunk_tokens = f->chunk,
                                            .no_checksum = f->checksum ? 0u : 1u}};
    s->inst.in_fd = s->inst.out_fd = -1; /* the backend's now */
    if (kvs_rank_backend_create(&bc, &s->backend) != KVS_OK) {
        fprintf(stderr, "error: cannot start the backend over rank 0\n");
        return 1;
    }
    return 0;
}

/* Until rank 0 is ready: 0; 1 when the instance failed or took too long (said why); -1 when a
 * signal came first. */
static int wait_ready(serve_run_t *s)
{
    kvs_instance_t *inst = &s->inst;
    const uint64_t deadline = s->deadline;
    for (;;) {
        kvs_status_t st = kvs_rank_backend_wait_ready(s->backend, 200);
        if (st == KVS_OK) return 0;
        char why[128] = "rank 0 ended";
        if (st == KVS_ERR_IO || kvs_instance_poll(inst) < inst->n) {
            kvs_instance_poll(inst);
            if (kvs_instance_poll(inst) < inst->n)
                kvs_instance_describe_exit(inst, why, sizeof(why));
            fprintf(stderr, "error: the %s instance did not start (%s)\n", s->role, why);
            return 1;
        }
        if (kvs_serve_signal_wait(0)) return -1;
        if (kvs_now_ns() >= deadline) {
            fprintf(stderr, "error: the %s instance was not ready after %u s\n", s->role,
                    s->f->startup_s);
            return 1;
        }
    }
}

/* The HTTP server over the backend; prints where it serves. 0, or 1 after saying why. */
static int start_server(serve_run_t *s)
{
    const serve_flags_t *f = s->f;
    kvs_server_tokenizer_t stok;
    if (s->tok != NULL) {
        if (kvs_server_tokenizer_from(s->tok, &stok) != KVS_OK) return 1;
    } else {
        stok = kvs_server_byte_tokenizer();
    }
    char name[256]; /* the server keeps a copy */
    model_name(f, s->path, name, sizeof(name));
    kvs_server_config_t sc = {.host = f->host,
                              .port = (uint16_t) f->port,
                              .threads = f->threads,
                              .model = name,
                              .max_context = f->max_model_len,
                              .role = server_role(f->role),
                              .bootstrap = s->ep,
                              .strict_role = 1,
                              .strict = f->http.strict,
                              .api_key = f->http.api_key,
                              .max_connections = f->http.max_connections,
                              .idle_timeout_s = f->http.idle_timeout_s,
                              .backend = kvs_rank_backend_ops(s->backend),
                              .tokenizer = stok};
    if (kvs_server_create(&sc, &s->srv) != KVS_OK) {
        /* Free when checked at the start: something took it since. */
        if (!kvs_port_explain(f->host, f->port))
            fprintf(stderr, "error: cannot serve HTTP on %s:%u\n", f->host, f->port);
        return 1;
    }
    printf("serving on http://%s:%u (role %s, TP %u, bootstrap %s)\n", f->host,
           (unsigned) kvs_server_port(s->srv), s->role, f->tp, s->ep ? s->ep : "none");
    fflush(stdout);
    return 0;
}

/* --restart-ranks, after the instance failed (why): ends what is left of it (its rooms fail
 * through the backend; its segment is removed), launches a fresh one and moves the backend to
 * its rank 0. A fresh instance that does not start counts as another failure. 0 once one is
 * ready; 1 when past --max-restarts (said why) or the backend cannot move; -1 on a signal. */
static int restart_instance(serve_run_t *s, const char *failure)
{
    const serve_flags_t *f = s->f;
    const uint32_t max = f->max_restarts;
    char why[160];
    snprintf(why, sizeof(why), "%s", failure);
    for (;;) {
        const uint64_t now = kvs_now_ns();
        const uint32_t done = s->generation; /* restarts so far */
        kvs_instance_wait(&s->inst, 0);      /* the ranks left are killed and reaped */
        /* The ring holds the last max restarts: the oldest of them within the window means one
         * more would be past the limit. */
        if (done >= max && now - s->restart_ns[done % max] < RESTART_WINDOW_S * 1000000000ull) {
            fprintf(stderr,
                    "error: kvstage serve (%s): the instance failed (%s); giving up after %u "
                    "restart%s within %d s (--max-restarts)\n",
                    s->role, why, max, max == 1 ? "" : "s", RESTART_WINDOW_S);
            return 1;
        }
        s->restart_ns[done % max] = now;
        s->generation++;
        fprintf(stderr,
                "kvstage serve (%s): the instance failed (%s); restarting its ranks "
                "(restart %u)\n",
                s->role, why, s->generation);
        if (start_ranks(s) == 0) {
            kvs_status_t st =
                kvs_rank_backend_restart(s->backend, s->inst.in_fd, s->inst.out_fd, why);
            s->inst.in_fd = s->inst.out_fd = -1; /* the backend's now */
            if (st != KVS_OK) {
                fprintf(stderr, "error: cannot move the backend to the new rank 0\n");
                return 1;
            }
            s->deadline = kvs_now_ns() + (uint64_t) f->startup_s * 1000000000ull;
            int rc = wait_ready(s);
            if (rc < 0) return -1;
            if (rc == 0) {
                fprintf(stderr, "kvstage serve (%s): serving again (restart %u)\n", s->role,
                        s->generation);
                return 0;
            }
        }
        if (kvs_serve_signal_wait(0)) return -1;
        snprintf(why, sizeof(why), "restart %u did not start", s->generation);
    }
}

/* Runs until a signal or a rank failure that is not restarted; 0 when stopped by a signal. */
static int serve_loop(serve_run_t *s)
{
    kvs_instance_t *inst = &s->inst;
    for (;;) {
        if (kvs_serve_signal_wait(200)) {
            fprintf(stderr, "kvstage serve (%s): shutting down\n", s->role);
            return 0;
        }
        if (kvs_instance_poll(inst) < inst->n || kvs_rank_backend_ended(s->backend)) {
            char why[128];
            kvs_instance_poll(inst);
            kvs_instance_describe_exit(inst, why, sizeof(why));
            if (s->f->restart_ranks) {
                int rc = restart_instance(s, why);
                if (rc == 0) continue;
                if (rc < 0) fprintf(stderr, "kvstage serve (%s): shutting down\n", s->role);
                return rc < 0 ? 0 : 1;
            }
            fprintf(stderr, "error: kvstage serve (%s): the instance failed (%s); shutting down\n",
                    s->role, why);
            return 1;
        }
    }
}

/* Starts everything and serves until a signal or a failure; the exit code. */
static int serve_instance(serve_run_t *s)
{
    kvs_serve_signal_install();
    s->ep = s->f->bootstrap;
    if (s->f->role == KVS_LLM_PREFILL && start_registry(s) != 0) return 1;
    if (start_instance(s) != 0) return 1;
    int rc = wait_ready(s);
    if (rc != 0) return rc < 0 ? 0 : 1;
    if (start_server(s) != 0) return 1;
    return serve_loop(s);
}

/* Ends what s started, in order: the server (live requests end first, through the backend),
 * rank 0 through quit, every rank, the registry. Returns rc, or 1 when rc was 0 and a rank did
 * not end cleanly. */
static int serve_teardown(serve_run_t *s, int rc)
{
    kvs_server_destroy(s->srv);
    if (s->backend != NULL) kvs_rank_backend_quit(s->backend);
    if (s->inst_started && kvs_instance_wait(&s->inst, EXIT_WAIT_MS) != 0 && rc == 0) {
        char why[128];
        kvs_instance_describe_exit(&s->inst, why, sizeof(why));
        fprintf(stderr, "error: the %s instance did not end cleanly (%s)\n", s->role, why);
        rc = 1;
    }
    kvs_rank_backend_destroy(s->backend);
    if (s->inst.in_fd >= 0) close(s->inst.in_fd);
    if (s->inst.out_fd >= 0) close(s->inst.out_fd);
    if (s->reg_started) {
        __atomic_store_n(&s->rt.stop, 1, __ATOMIC_RELAXED);
        pthread_join(s->reg_thread, NULL);
    }
    kvs_registry_destroy(s->registry);
    kvs_tokenizer_destroy(s->tok);
    return rc;
}

int kvs_cmd_serve(int argc, char **argv)
{
    serve_flags_t f;
    serve_flags_default(&f);
    kvs_arg_table_t t = {.count = 0};
    add_instance_flags(&t, &f);
    add_engine_flags(&t, &f);
    kvs_http_flags_add(&t, &f.http);
    int rc = kvs_arg_table_parse(&t, usage, argc, argv, 1);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    if ((rc = kvs_http_flags_check(&f.http)) != 0) return rc;

    if ((rc = check_flags(&f)) != 0 || (rc = kvs_port_check(f.host, f.port)) != 0) return rc;

    char path[4096] = "";
    kvs_model_config_t mc;
    serve_run_t s = {.f = &f,
                     .role = role_str(f.role),
                     .path = path,
                     .mc = &mc,
                     .deadline = kvs_now_ns() + (uint64_t) f.startup_s * 1000000000ull};
    s.inst.in_fd = s.inst.out_fd = -1; /* not started: nothing to close */
    if ((rc = open_model(&f, path, sizeof(path), &mc, &s.tok)) != 0) return rc;
    /* The model's limits first: a bad --tp is a usage error even before a prefill answers. */
    if ((rc = check_model(&f, &mc)) != 0) return serve_teardown(&s, rc);
    if (f.role == KVS_LLM_DECODE && f.bootstrap != NULL &&
        (rc = learn_from_prefill(&f, s.deadline)) == 0)
        rc = check_model(&f, &mc); /* --peer-tp may be the prefill instance's now */
    if (rc == 0) rc = serve_instance(&s);
    return serve_teardown(&s, rc);
}
