/* `kvstage demo`: what `make demo` runs. By default it launches a local multi-process
 * deployment — every prefill and decode rank its own process (`kvstage prefill|decode`), ZeroMQ
 * control, UCX data, bootstrap through a registry served here — drives the seeded workload
 * through it, shows progress, and prints one summary of every rank's verified result.
 * `--transport inproc` runs the same handoff as the deterministic in-process simulation
 * (`kvstage sim`, which takes the sim's flags). */
#include "cmd/commands.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/args.h"
#include "base/mem.h"
#include "common/json.h"
#include "kvstage/clock.h"
#include "kvstage/grid.h"
#include "kvstage/pd.h"
#include "kvstage/registry.h"
#include "common/rank_flags.h"
#include "common/spawn.h"

#define MAX_CHILDREN (2 * KVS_MAX_TP)

typedef struct {
    pid_t pid;
    int fd; /* its stdout: progress lines, then one JSON result */
    int side_decode;
    uint32_t rank;
    char gpu[12]; /* --gpu of this rank ("": host pools) */
    char buf[4096];
    size_t len;
    uint32_t concluded, requests;
    int exited, status;
    /* Parsed from the result. */
    int have_result, ok;
    unsigned long long succeeded, failed, mismatched, leaked_slots, leaked_pages, leaked_rooms;
    unsigned long long corrupted; /* writes its link corrupted (--corrupt-nth) */
    kvs_pd_metrics_t metrics;     /* the result's transfer counters (rejected: the link's too) */
} child_t;

static const char intro[] =
    "kvstage moves a request's KV cache from the prefill workers that compute it to the decode\n"
    "workers that continue it. Each prefill rank gathers its head slice of a whole chunk into one\n"
    "region of a staging slot on the decode rank, writes it in one bulk transfer, and the decode\n"
    "rank scatters the slot into its KV pool.\n\n";

/* Value of "key": N in a flat JSON object (0 when absent). */
static unsigned long long json_u64(const char *json, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(json, pat);
    return p ? strtoull(p + strlen(pat), NULL, 10) : 0;
}

static void parse_line(child_t *c, const char *line)
{
    unsigned a, b;
    if (sscanf(line, "progress %u %u", &a, &b) == 2) {
        c->concluded = a;
        c->requests = b;
        return;
    }
    if (line[0] != '{') return;
    c->have_result = 1;
    c->ok = strstr(line, "\"ok\":true") != NULL;
    c->succeeded = json_u64(line, "succeeded");
    c->failed = json_u64(line, "failed");
    c->mismatched = json_u64(line, "mismatched_bytes") + json_u64(line, "meta_mismatches");
    c->leaked_slots = json_u64(line, "leaked_slots");
    c->leaked_pages = json_u64(line, "leaked_pages");
    c->leaked_rooms = json_u64(line, "leaked_rooms");
    c->corrupted = json_u64(line, "corrupt_injected");
    uint32_t nf;
    const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&nf);
    for (uint32_t i = 0; i < nf; i++)
        if (f[i].json != NULL) kvs_pd_metrics_set(&c->metrics, &f[i], json_u64(line, f[i].json));
}

static void on_child_line(void *arg, char *line)
{
    parse_line(arg, line);
}

static void read_child(child_t *c)
{
    if (kvs_read_lines(c->fd, c->buf, sizeof(c->buf), &c->len, on_child_line, c)) return;
    close(c->fd);
    c->fd = -1;
}

static pid_t spawn(child_t *c, const char *registry, int argc, char **argv, int first)
{
    char rank[16];
    snprintf(rank, sizeof(rank), "%u", c->rank);
    char *args[160];
    int n = 0;
    args[n++] = "kvstage";
    args[n++] = c->side_decode ? "decode" : "prefill";
    args[n++] = "--rank";
    args[n++] = rank;
    args[n++] = "--registry";
    args[n++] = (char *) registry;
    args[n++] = "--json";
    args[n++] = "--progress";
    if (c->gpu[0]) {
        args[n++] = "--gpu";
        args[n++] = c->gpu;
    }
    for (int i = first; i < argc && n < 158; i++) args[n++] = argv[i];
    args[n] = NULL;
    kvs_spawned_t k;
    if (kvs_spawn_self("demo", args, KVS_SPAWN_INHERIT, KVS_SPAWN_PIPE, &k) != 0) return -1;
    c->fd = k.out_fd;
    c->pid = k.pid;
    return k.pid;
}

/* Redraws the progress line when the count changed, or every half second. */
static void draw(const child_t *cs, int n, uint32_t requests, double secs)
{
    static uint32_t last_done = UINT32_MAX;
    static double last_secs;
    uint32_t done = requests;
    for (int i = 0; i < n; i++)
        if (cs[i].side_decode && cs[i].concluded < done) done = cs[i].concluded;
    if (done == last_done && secs - last_secs < 0.5) return;
    last_done = done;
    last_secs = secs;
    int width = 30, fill = requests ? (int) ((uint64_t) done * width / requests) : width;
    fprintf(stderr, "\r  [%.*s%*s] %u/%u rooms verified on every decode rank, %.1f s", fill,
            "##############################", width - fill, "", done, requests, secs);
}

/* What a per-page path would issue for the workload's succeeded rooms: one write per page,
 * layer, component and writer (radix caches are off in this deployment: every page moves). */
static unsigned long long per_page_writes(const kvs_rank_config_t *c)
{
    kvs_workload_t *wl;
    if (kvs_workload_create(&c->workload, &wl) != KVS_OK) return 0;
    const kvs_pd_geometry_t *g = &c->geo;
    unsigned long long n = 0;
    for (uint32_t i = 0; i < wl->count; i++) {
        for (uint32_t d = 0; d < g->decode_tp; d++) {
            /* under DCP a decode rank's pages hold its tokens only */
            const kvs_dcp_t dcp = kvs_pd_geometry_dcp_of(g, d);
            const uint64_t pages =
                kvs_grid_rank_total_pages(wl->requests[i].len, 0, g->page_size,
                                          kvs_pd_geometry_page(g, KVS_SIDE_PREFILL), &dcp);
            kvs_writer_t w[KVS_MAX_WRITERS];
            uint32_t nw = 0;
            if (kvs_plan_geo_writers(g, d, wl->requests[i].room, w, &nw) != KVS_OK) continue;
            for (uint32_t k = 0; k < nw; k++)
                n += pages * w[k].layers * kvs_kv_shape_components(&g->shape);
        }
    }
    kvs_workload_destroy(wl);
    return n;
}

enum { GO_ON = -1 };

/* Parses what the ranks will get, to catch bad flags here and to know the deployment: into f,
 * and *json_p for --json. GO_ON, or the exit code (0 after --help) after saying why. */
static int parse_deployment(int argc, char **argv, int first, kvs_rank_flags_t *f, int *json_p)
{
    kvs_rank_flags_default(f);
    char *pargv[160];
    int pargc = 0;
    pargv[pargc++] = "demo";
    for (int i = first; i < argc && pargc < 159; i++) pargv[pargc++] = argv[i];
    int json = 0;
    for (int i = 1; i < pargc; i++) {
        json |= strcmp(pargv[i], "--json") == 0;
        /* The launcher assigns these per rank. */
        if (strncmp(pargv[i], "--rank", 6) == 0 || strncmp(pargv[i], "--registry", 10) == 0 ||
            strcmp(pargv[i], "--serve-registry") == 0 || strncmp(pargv[i], "--bind", 6) == 0 ||
            strcmp(pargv[i], "--gpu") == 0 || strncmp(pargv[i], "--gpu=", 6) == 0)
            return kvs_args_error(pargv[i], "the other flags of `kvstage demo --help`",
                                  "the demo sets it for each rank itself");
    }
    int rc = kvs_rank_flags_parse(
        f,
        "kvstage demo [--transport ucx|inproc] [--gpus P,D] [deployment flags below; the demo "
        "sets --rank, --registry, --bind and --gpu for each rank: with --device cuda, prefill "
        "ranks on GPU P and decode ranks on GPU D (default 0,1, or 0 on a one-GPU host)]",
        pargc, pargv);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    *json_p = json;
    return GO_ON;
}

/* The prefill ranks' GPU into gpu[0], the decode ranks' into gpu[1]: from gpus ("P,D" or "P" of
 * --gpus, or NULL), else 0 and 1 (both 0 when there is one). 0, or 2 after saying why. */
static int pick_gpus(const kvs_rank_config_t *c, const char *gpus, int gpu[2])
{
    gpu[0] = 0;
    gpu[1] = c->mem == KVS_MEM_DEVICE && kvs_mem_device_count() > 1;
    if (gpus != NULL && c->mem != KVS_MEM_DEVICE)
        return kvs_args_error("--gpus", "--gpus with --device cuda", "needs --device cuda");
    if (gpus != NULL && kvs_args_parse_gpus(gpus, &gpu[0], &gpu[1]) != 0)
        return kvs_args_error("--gpus", KVS_ARGS_GPUS_ACCEPTED, "'%s' is malformed", gpus);
    return 0;
}

static void print_deployment(const kvs_rank_config_t *c, const int gpu[2],
                             const kvs_registry_t *registry)
{
    printf("%s", intro);
    char data[96] = "UCX data (host pools)";
    if (c->mem == KVS_MEM_DEVICE)
        snprintf(data, sizeof(data), "CUDA IPC data (prefill pools on GPU %d, decode on GPU %d)",
                 gpu[0], gpu[1]);
    char pages[48];
    if (kvs_pd_geometry_page(&c->geo, KVS_SIDE_PREFILL) != c->geo.page_size)
        snprintf(pages, sizeof(pages), "pages %u prefill / %u decode",
                 kvs_pd_geometry_page(&c->geo, KVS_SIDE_PREFILL), c->geo.page_size);
    else
        snprintf(pages, sizeof(pages), "page %u", c->geo.page_size);
    char pp[24] = "", dcp[48] = "";
    if (kvs_pd_geometry_pp(&c->geo) > 1)
        snprintf(pp, sizeof(pp), "PP%u x ", kvs_pd_geometry_pp(&c->geo));
    if (kvs_pd_geometry_dcp(&c->geo) > 1)
        snprintf(dcp, sizeof(dcp), " (DCP%u, interleave %u)", kvs_pd_geometry_dcp(&c->geo),
                 kvs_pd_geometry_interleave(&c->geo));
    printf("kvstage demo: prefill %sTP%u -> decode TP%u%s, each rank a process; ZeroMQ control, "
           "%s;\n%u KV heads x %u layers x %u dims x %u B, %s, chunk %u; %u "
           "requests (prompts <= %u tokens), %u in flight\nregistry %s\n\n",
           pp, c->geo.prefill_tp, c->geo.decode_tp, dcp, data, c->geo.shape.kv_heads,
           c->geo.shape.layers, c->geo.shape.head_dim_k, c->geo.shape.elem_bytes, pages,
           c->geo.chunk_tokens, c->workload.requests, c->workload.prompt_len, c->concurrency,
           kvs_registry_endpoint(registry));
    fflush(stdout);
}

/* Starts the n ranks, prefill ones first, into cs; returns how many started (all of them, or
 * those before the one that could not, after saying why). */
static int start_children(child_t *cs, int n, const kvs_rank_config_t *c, const int gpu[2],
                          const char *ep, int argc, char **argv, int first)
{
    int started = 0;
    for (int i = 0; i < n; i++) {
        const uint32_t prefill_ranks = kvs_pd_geometry_prefill_ranks(&c->geo);
        cs[i].side_decode = (uint32_t) i >= prefill_ranks;
        cs[i].rank = cs[i].side_decode ? (uint32_t) i - prefill_ranks : (uint32_t) i;
        if (c->mem == KVS_MEM_DEVICE)
            snprintf(cs[i].gpu, sizeof(cs[i].gpu), "%d", gpu[cs[i].side_decode]);
        if (spawn(&cs[i], ep, argc, argv, first) < 0) {
            fprintf(stderr, "error: cannot start rank processes: %s\n", strerror(errno));
            break;
        }
        started++;
    }
    return started;
}

/* Serves the registry and reads the ranks' lines until every rank exited; draws the progress
 * (counted from t0) unless json. */
static void wait_children(child_t *cs, int started, kvs_registry_t *registry, uint32_t requests,
                          int json, uint64_t t0)
{
    int live = started;
    while (live > 0) {
        struct pollfd pfd[MAX_CHILDREN];
        int map[MAX_CHILDREN], np = 0;
        for (int i = 0; i < started; i++)
            if (cs[i].fd >= 0) {
                pfd[np] = (struct pollfd){cs[i].fd, POLLIN, 0};
                map[np++] = i;
            }
        kvs_registry_serve(registry, 0);
        if (np > 0 && poll(pfd, (nfds_t) np, 20) > 0)
            for (int k = 0; k < np; k++)
                if (pfd[k].revents) read_child(&cs[map[k]]);
        for (int i = 0; i < started; i++) {
            if (cs[i].exited || cs[i].fd >= 0) continue;
            if (waitpid(cs[i].pid, &cs[i].status, WNOHANG) == cs[i].pid) {
                cs[i].exited = 1;
                live--;
            }
        }
        if (!json) draw(cs, started, requests, (kvs_now_ns() - t0) / 1e9);
    }
}

/* Every rank's result folded into one. */
typedef struct {
    int ok;
    unsigned long long succeeded, failed, mismatched, lslots, lpages, lrooms;
    /* Chunks scattered are the receivers', writes and bytes the senders', messages both's. */
    unsigned long long chunks, writes, direct, bytes, msgs, retries, rejected;
    unsigned long long corrupt_injected, corrupt_detected; /* --corrupt-nth */
} totals_t;

/* Folds the started ranks' results into *t (ok only if all_started too); unless json, prints a
 * line for each rank. */
static void sum_children(const child_t *cs, int started, int all_started, int json, totals_t *t)
{
    memset(t, 0, sizeof(*t));
    t->ok = all_started;
    t->succeeded = ~0ull;
    kvs_pd_metrics_t tx = {0}, rx = {0}; /* the prefill ranks' counters, the decode ranks' */
    for (int i = 0; i < started; i++) {
        const child_t *k = &cs[i];
        int exited_ok = WIFEXITED(k->status) && WEXITSTATUS(k->status) == 0;
        t->ok &= exited_ok && k->have_result && k->ok;
        if (k->side_decode && k->succeeded < t->succeeded) t->succeeded = k->succeeded;
        if (k->failed > t->failed) t->failed = k->failed;
        t->mismatched += k->mismatched;
        t->lslots += k->leaked_slots;
        t->lpages += k->leaked_pages;
        t->lrooms += k->leaked_rooms;
        t->corrupt_injected += k->corrupted;
        kvs_pd_metrics_add(k->side_decode ? &rx : &tx, &k->metrics);
        if (!json)
            printf("  %-7s rank %u: %s, %llu succeeded, %llu failed%s\n",
                   k->side_decode ? "decode" : "prefill", k->rank,
                   !k->have_result ? "no result"
                   : k->ok         ? "ok"
                                   : "FAILED",
                   k->succeeded, k->failed, exited_ok ? "" : " (exited abnormally)");
    }
    if (t->succeeded == ~0ull) t->succeeded = 0;
    t->chunks = rx.chunks;
    t->writes = tx.bulk_writes;
    t->direct = tx.direct_writes;
    t->bytes = tx.bytes;
    t->msgs = tx.msgs_sent + rx.msgs_sent;
    t->retries = tx.retries + rx.retries;
    t->rejected = tx.rejected + rx.rejected;
    t->corrupt_detected = rx.checksum_failures;
}

static void print_json(const kvs_rank_config_t *c, const totals_t *t, uint64_t t0)
{
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_bool(&j, "ok", t->ok);
    kvs_json_str(&j, "transport", "ucx");
    kvs_json_u64(&j, "prefill_tp", c->geo.prefill_tp);
    kvs_json_u64(&j, "prefill_pp", kvs_pd_geometry_pp(&c->geo));
    kvs_json_u64(&j, "decode_tp", c->geo.decode_tp);
    kvs_json_u64(&j, "prefill_page_size", kvs_pd_geometry_page(&c->geo, KVS_SIDE_PREFILL));
    kvs_json_u64(&j, "decode_page_size", c->geo.page_size);
    kvs_json_u64(&j, "decode_dcp", kvs_pd_geometry_dcp(&c->geo));
    kvs_json_u64(&j, "dcp_interleave", kvs_pd_geometry_interleave(&c->geo));
    kvs_json_u64(&j, "requests", c->workload.requests);
    kvs_json_u64(&j, "succeeded", t->succeeded);
    kvs_json_u64(&j, "failed", t->failed);
    kvs_json_bool(&j, "exact", t->mismatched == 0);
    kvs_json_u64(&j, "mismatched_bytes", t->mismatched);
    kvs_json_u64(&j, "leaked_slots", t->lslots);
    kvs_json_u64(&j, "leaked_pages", t->lpages);
    kvs_json_u64(&j, "leaked_rooms", t->lrooms);
    kvs_json_u64(&j, "chunks", t->chunks);
    kvs_json_str(&j, "device", c->mem == KVS_MEM_DEVICE ? "cuda" : "cpu");
    kvs_json_u64(&j, "bulk_writes", t->writes);
    kvs_json_u64(&j, "direct_writes", t->direct);
    kvs_json_u64(&j, "per_page_writes", t->ok ? per_page_writes(c) : 0);
    kvs_json_u64(&j, "control_messages", t->msgs);
    kvs_json_u64(&j, "retries", t->retries);
    kvs_json_u64(&j, "rejected_messages", t->rejected);
    kvs_json_u64(&j, "bytes_moved", t->bytes);
    kvs_json_u64(&j, "corrupt_injected", t->corrupt_injected);
    kvs_json_u64(&j, "corrupt_detected", t->corrupt_detected);
    kvs_json_double(&j, "wall_s", (kvs_now_ns() - t0) / 1e9);
    kvs_json_end(&j);
}

static void print_summary(const kvs_rank_config_t *c, const totals_t *t, uint64_t t0)
{
    printf("\n  rooms      %llu/%u succeeded on every decode rank, %llu failed\n", t->succeeded,
           c->workload.requests, t->failed);
    printf("  exact      %s (%llu mismatched bytes)\n", t->mismatched ? "NO" : "yes",
           t->mismatched);
    printf("  leaks      slots %llu, pages %llu, rooms %llu\n", t->lslots, t->lpages, t->lrooms);
    unsigned long long pp = per_page_writes(c);
    printf("  transfers  %llu chunks scattered, %llu bulk writes of which %llu direct (a "
           "per-page path: %llu, %.0fx more), %.1f MiB\n",
           t->chunks, t->writes, t->direct, pp, t->writes ? (double) pp / (double) t->writes : 0.0,
           t->bytes / 1048576.0);
    printf("  control    %llu messages (retries %llu = %.1f%%, rejected %llu)\n", t->msgs,
           t->retries, t->msgs ? 100.0 * (double) t->retries / (double) t->msgs : 0.0, t->rejected);
    printf("  time       %.2f s wall\n\n%s\n", (kvs_now_ns() - t0) / 1e9,
           t->ok ? "PASS: every room succeeded byte-exact on every rank, nothing leaked"
                 : "FAIL: see the rank lines above");
}

/* gpus: "P,D" or "P" from --gpus (prefill ranks' and decode ranks' GPU), or NULL. */
static int run_processes(int argc, char **argv, int first, const char *gpus)
{
    kvs_rank_flags_t f;
    int json = 0, gpu[2];
    int rc = parse_deployment(argc, argv, first, &f, &json);
    if (rc != GO_ON) return rc;
    const kvs_rank_config_t *c = &f.cfg;
    /* Every rank would refuse it at startup; say so once, before starting any. */
    if (kvs_rank_flags_check(&f, "demo") != 0) return 2;
    int n = (int) (kvs_pd_geometry_prefill_ranks(&c->geo) + c->geo.decode_tp);
    if (pick_gpus(c, gpus, gpu) != 0) return 2;
    kvs_registry_t *registry;
    if (kvs_registry_create("tcp://127.0.0.1:*", &registry) != KVS_OK) {
        fprintf(stderr, "error: cannot start the bootstrap registry\n");
        return 1;
    }
    if (!json) print_deployment(c, gpu, registry);
    child_t cs[MAX_CHILDREN];
    memset(cs, 0, sizeof(cs));
    int started = start_children(cs, n, c, gpu, kvs_registry_endpoint(registry), argc, argv, first);
    uint64_t t0 = kvs_now_ns();
    wait_children(cs, started, registry, c->workload.requests, json, t0);
    if (!json) fprintf(stderr, "\n\n");
    kvs_registry_destroy(registry);
    totals_t t;
    sum_children(cs, started, started == n, json, &t);
    if (json)
        print_json(c, &t, t0);
    else
        print_summary(c, &t, t0);
    return t.ok ? 0 : 1;
}

int kvs_cmd_demo(int argc, char **argv)
{
    /* --transport picks the mode; everything else goes to the mode. */
    const char *transport = "ucx";
    char *rest[256];
    int n = 0;
    rest[n++] = argv[0];
    for (int i = 1; i < argc && n < 255; i++) {
        if (strcmp(argv[i], "--transport") == 0 && i + 1 >= argc)
            return kvs_args_error("--transport", "ucx|inproc", "needs a value");
        if (strcmp(argv[i], "--transport") == 0)
            transport = argv[++i];
        else if (strncmp(argv[i], "--transport=", 12) == 0)
            transport = argv[i] + 12;
        else
            rest[n++] = argv[i];
    }
    rest[n] = NULL;
    if (strcmp(transport, "inproc") == 0) return kvs_cmd_sim_intro(n, rest, intro);
    if (strcmp(transport, "ucx") != 0)
        return kvs_args_error("--transport", "ucx|inproc", "'%s' is not one of the choices",
                              transport);
    /* --gpus maps the two sides to GPUs; each rank gets its own --gpu. */
    const char *gpus = NULL;
    int kept = 1;
    for (int i = 1; i < n; i++) {
        if (strcmp(rest[i], "--gpus") == 0 && i + 1 >= n)
            return kvs_args_error("--gpus", KVS_ARGS_GPUS_ACCEPTED, "needs a value");
        if (strcmp(rest[i], "--gpus") == 0) {
            gpus = rest[++i];
            continue;
        }
        if (strncmp(rest[i], "--gpus=", 7) == 0) {
            gpus = rest[i] + 7;
            continue;
        }
        rest[kept++] = rest[i];
    }
    n = kept;
    rest[n] = NULL;
    return run_processes(n, rest, 1, gpus);
}
