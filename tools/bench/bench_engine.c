/* `kvstage bench engine`: runs `kvstage generate --json` deployments of SmolLM2 and of a seeded
 * Llama shape, colocated and disaggregated (every rank a process, the KV through kvstage), one
 * request after another with the radix caches off so every prompt is computed and moved whole,
 * and reports the medians of prefill and decode tokens/s, time to first token and the share of
 * it the KV transfer took. */
#include "bench/bench_engine.h"
#include "bench/bench_util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/args.h"
#include "common/json.h"
#include "kvstage/alloc.h"
#include "model/gguf.h"
#include "kvstage/rng.h"
#include "common/spawn.h"

#define MAX_RUNS 32
#define SEEDED   "8,512,1536,8,8,64,4096" /* layers, dim, ffn, heads, kv heads, head dim, vocab */

typedef struct {
    const char *model; /* label */
    int seeded;
    uint32_t prefill_tp, decode_tp; /* colocated: prefill_tp is the instance's TP */
    int colocated;
    const char *shape;   /* seeded: L,dim,... (NULL: SEEDED) */
    uint32_t prompt_len; /* 0: --prompt-len */
} config_t;

typedef struct {
    double prefill_tok_s, decode_tok_s, ttft_ms, transfer_ms, share, kv_bytes, load_s;
    double ttft_each[MAX_RUNS]; /* each request's, in the order served */
    int n_each;
    int ok;
} row_t;

/* The GPU goal: disaggregated TTFT within this fraction of colocated from 1k-token prompts. */
#define TTFT_GOAL      0.03
#define TTFT_GOAL_FROM 1000

static const config_t configs[] = {
    {"SmolLM2-135M", 0, 1, 1, 1, NULL, 0},  {"SmolLM2-135M", 0, 1, 1, 0, NULL, 0},
    {"SmolLM2-135M", 0, 3, 1, 0, NULL, 0},  {"seeded 8L/512", 1, 1, 1, 1, NULL, 0},
    {"seeded 8L/512", 1, 1, 1, 0, NULL, 0}, {"seeded 8L/512", 1, 2, 1, 0, NULL, 0},
};

/* On a GPU (--device cuda): both instances on one GPU, the KV through CUDA IPC. */
#define LLAMA8B "32,4096,14336,32,8,128,128256"
static const config_t gpu_configs[] = {
    {"SmolLM2-135M", 0, 1, 1, 1, NULL, 1024},  {"SmolLM2-135M", 0, 1, 1, 0, NULL, 1024},
    {"SmolLM2-135M", 0, 1, 1, 1, NULL, 4096},  {"SmolLM2-135M", 0, 1, 1, 0, NULL, 4096},
    {"Llama-3-8B", 1, 1, 1, 1, LLAMA8B, 1024}, {"Llama-3-8B", 1, 1, 1, 0, LLAMA8B, 1024},
    {"Llama-3-8B", 1, 1, 1, 1, LLAMA8B, 4000}, {"Llama-3-8B", 1, 1, 1, 0, LLAMA8B, 4000},
};

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    if (n == 0) return 0;
    qsort(v, (size_t) n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double num_after(const char *from, const char *key, const char **end_p)
{
    const char *p = strstr(from, key);
    if (p == NULL) return -1;
    char *end;
    double v = strtod(p + strlen(key), &end);
    if (end_p) *end_p = end;
    return v;
}

/* Runs the tool with argv and returns its stdout (kvs_free it), or NULL if it failed. */
static char *run_tool(char **argv)
{
    kvs_spawned_t k;
    if (kvs_spawn_self("bench engine", argv, KVS_SPAWN_INHERIT, KVS_SPAWN_PIPE, &k) != 0)
        return NULL;
    size_t len = 0, cap = 1 << 16;
    char *out = kvs_malloc(cap);
    for (;;) {
        if (out != NULL && len + 4096 > cap) {
            char *p = kvs_realloc(out, cap * 2);
            if (p == NULL) {
                kvs_free(out);
                out = NULL;
            } else {
                out = p;
                cap *= 2;
            }
        }
        char sink[4096];
        char *dst = out ? out + len : sink;
        ssize_t n = read(k.out_fd, dst, out ? cap - len - 1 : sizeof(sink));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        if (out) len += (size_t) n;
    }
    close(k.out_fd);
    int status = 0;
    while (waitpid(k.pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (out != NULL) out[len] = '\0';
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        kvs_free(out);
        return NULL;
    }
    return out;
}

/* One deployment serving `runs` distinct random prompts one after another; gpu >= 0: on that
 * GPU, after one more prompt whose numbers are not counted (a GPU instance's first request also
 * pays for its CUDA graphs and cuBLAS's first calls: several times a warm request's TTFT). */
static row_t measure(const config_t *c, uint32_t runs, uint32_t prompt_len, uint32_t max_tokens,
                     uint64_t seed, int gpu)
{
    row_t row;
    memset(&row, 0, sizeof(row));
    char *args[32 + 2 * (MAX_RUNS + 1)];
    char *ids[MAX_RUNS + 1]; /* and the warm-up */
    char num[5][16];
    int n = 0;
    if (c->prompt_len != 0) prompt_len = c->prompt_len;
    args[n++] = "kvstage";
    args[n++] = "generate";
    args[n++] = "--json";
    args[n++] = "--prefill-radix";
    args[n++] = "off";
    args[n++] = "--decode-radix";
    args[n++] = "off";
    args[n++] = "--max-tokens";
    snprintf(num[0], sizeof(num[0]), "%u", max_tokens);
    args[n++] = num[0];
    if (c->seeded) {
        args[n++] = "--seeded";
        args[n++] = (char *) (c->shape ? c->shape : SEEDED);
    }
    if (gpu >= 0) {
        snprintf(num[3], sizeof(num[3]), "%d", gpu);
        args[n++] = "--device";
        args[n++] = "cuda";
        args[n++] = "--gpus";
        args[n++] = num[3];
        args[n++] = "--chunk";
        args[n++] = "512";
        args[n++] = "--max-model-len";
        snprintf(num[4], sizeof(num[4]), "%u", prompt_len + max_tokens);
        args[n++] = num[4];
    }
    snprintf(num[1], sizeof(num[1]), "%u", c->prefill_tp);
    snprintf(num[2], sizeof(num[2]), "%u", c->decode_tp);
    if (c->colocated) {
        args[n++] = "--colocated";
        args[n++] = "--tp";
        args[n++] = num[1];
    } else {
        args[n++] = "--prefill-tp";
        args[n++] = num[1];
        args[n++] = "--decode-tp";
        args[n++] = num[2];
    }
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const uint32_t warm = gpu >= 0 ? 1 : 0;
    runs += warm;
    uint32_t made = 0;
    for (; made < runs; made++) {
        ids[made] = kvs_malloc((size_t) prompt_len * 6 + 1);
        if (ids[made] == NULL) break;
        size_t at = 0;
        /* Ids both vocabularies share, past SmolLM2's control tokens. */
        for (uint32_t i = 0; i < prompt_len; i++)
            at += (size_t) sprintf(ids[made] + at, "%s%u", i ? "," : "",
                                   (unsigned) kvs_rng_range(&rng, 256, 4095));
        args[n++] = "--prompt-ids";
        args[n++] = ids[made];
    }
    args[n] = NULL;
    char *out = made == runs ? run_tool(args) : NULL;
    for (uint32_t i = 0; i < made; i++) kvs_free(ids[i]);
    if (out == NULL) return row;
    double pre[MAX_RUNS], dec[MAX_RUNS], ttft[MAX_RUNS], xfer[MAX_RUNS], share[MAX_RUNS];
    int np = 0, nd = 0;
    const char *p = strstr(out, "\"requests\":[");
    for (uint32_t i = 0; i < warm && p != NULL; i++)
        if ((p = strstr(p, "{\"room\":")) != NULL) p++;
    while (p != NULL && (p = strstr(p, "{\"room\":")) != NULL && np < MAX_RUNS) {
        double gen = num_after(p, "\"generated\":", NULL);
        double prompt = num_after(p, "\"prompt_tokens\":", NULL);
        double pms = num_after(p, "\"prefill_ms\":", NULL);
        double dms = num_after(p, "\"decode_ms\":", NULL);
        ttft[np] = num_after(p, "\"ttft_ms\":", NULL);
        row.ttft_each[np] = ttft[np];
        xfer[np] = num_after(p, "\"transfer_ms\":", NULL);
        share[np] = num_after(p, "\"transfer_share\":", NULL);
        row.kv_bytes = num_after(p, "\"kv_bytes\":", &p);
        pre[np++] = pms > 0 ? prompt / (pms / 1e3) : 0;
        if (gen > 1 && dms > 0) dec[nd++] = (gen - 1) / (dms / 1e3);
    }
    row.load_s = num_after(out, "\"load_s\":", NULL);
    row.ok = np == (int) (runs - warm);
    row.n_each = np;
    row.prefill_tok_s = median(pre, np);
    row.decode_tok_s = median(dec, nd);
    row.ttft_ms = median(ttft, np);
    row.transfer_ms = median(xfer, np);
    row.share = median(share, np);
    kvs_free(out);
    return row;
}

typedef struct {
    uint32_t runs, prompt_len, max_tokens, gpu;
    uint64_t seed;
    int json, only; /* only: 0 all, 1 SmolLM2, 2 seeded */
    int device;     /* 0 cpu, 1 cuda */
} engine_opts_t;

static void engine_flags(kvs_arg_table_t *t, engine_opts_t *o)
{
    const kvs_arg_t g[] = {
        {"runs", KVS_ARG_U32, &o->runs,
         "requests per deployment, the median is reported (3; 7 with --device cuda)",
         "[1," KVS_ARGS_STR(MAX_RUNS) "]", NULL},
        {"prompt-len", KVS_ARG_U32, &o->prompt_len, "prompt tokens (128)", "[1,2048]", NULL},
        {"max-tokens", KVS_ARG_U32, &o->max_tokens, "tokens generated per request (32)",
         "[2,1048576]", NULL},
        {"seed", KVS_ARG_U64, &o->seed, "seed of the random prompts", NULL, NULL},
        {"only", KVS_ARG_CHOICE, &o->only, "which models", "all|smollm2|seeded", NULL},
        {"json", KVS_ARG_FLAG, &o->json, "one JSON object", NULL, NULL},
        {"device", KVS_ARG_CHOICE, &o->device,
         "cpu: the f32 reference engine; cuda: the CUDA forward pass of seeded Llama-3-8B and "
         "SmolLM2 shapes against the GEMM and copy limits, then 1k and 4k-token prompts colocated "
         "vs disaggregated on one GPU",
         "cpu|cuda", NULL},
        {"gpu", KVS_ARG_U32, &o->gpu, "with --device cuda: the GPU (0)", "[0,1024]", NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* The table's preamble and header, or the JSON object's opening fields. */
/* -1 when the GPU of --device cuda is not usable (said), else 0. */
static int print_begin(const engine_opts_t *o, kvs_json_t *j, const char *cpu, long cores,
                       int have_smol, int *failed_p)
{
    int rc = 0;
    if (o->device && !o->json && (rc = kvs_bench_engine_cuda_model((int) o->gpu, 0, NULL)) != 0) {
        if (rc < 0) return -1;
        *failed_p = 1;
    }
    if (o->json) {
        kvs_json_begin(j, stdout);
        if (o->device) {
            kvs_json_u64(j, "gpu", o->gpu);
            if ((rc = kvs_bench_engine_cuda_model((int) o->gpu, 1, j)) < 0) return -1;
            *failed_p |= rc;
        }
        kvs_json_str(j, "cpu", cpu);
        kvs_json_u64(j, "cores", (uint64_t) cores);
        kvs_json_u64(j, "prompt_tokens", o->prompt_len);
        kvs_json_u64(j, "new_tokens", o->max_tokens);
        kvs_json_u64(j, "runs", o->runs);
        kvs_json_str(j, "seeded_shape", SEEDED);
        kvs_json_array_begin(j, "rows");
        return 0;
    }
    if (o->device) {
        printf("deployments on GPU %u: `kvstage generate --device cuda`, both instances on it, "
               "the KV through CUDA IPC;\nprompts as the rows say, %u new tokens, radix off, "
               "median of %u requests one after another after one warm-up request\n",
               o->gpu, o->max_tokens, o->runs);
        printf("%-14s %-15s %7s %14s %13s %10s %12s %7s %10s\n", "model", "deployment", "prompt",
               "prefill tok/s", "decode tok/s", "TTFT ms", "transfer ms", "share", "KV/req KiB");
        fflush(stdout);
        return 0;
    }
    printf("kvstage bench engine: the reference engine (f32, CPU), colocated vs disaggregated "
           "through kvstage\nhardware: %s, %ld cores; every rank a process, ranks of both "
           "instances share the cores\n%u-token prompts, %u new tokens, radix caches off, "
           "median of %u requests served one after another\n%s\n",
           cpu, cores, o->prompt_len, o->max_tokens, o->runs,
           have_smol || o->only == 2 ? ""
                                     : "(SmolLM2 not found: run scripts/setup.sh; its rows are "
                                       "skipped)\n");
    printf("%-14s %-15s %14s %13s %10s %12s %7s %10s\n", "model", "deployment", "prefill tok/s",
           "decode tok/s", "TTFT ms", "transfer ms", "share", "KV/req KiB");
    fflush(stdout);
    return 0;
}

/* One deployment's row: a JSON object, or a table line. */
/* vs: a disaggregated row's TTFT against the colocated row before it (NAN: none). */
static void print_row(const engine_opts_t *o, kvs_json_t *j, const config_t *c, const row_t *r,
                      double vs)
{
    char deploy[32];
    if (c->colocated)
        snprintf(deploy, sizeof(deploy), "colocated TP%u", c->prefill_tp);
    else
        snprintf(deploy, sizeof(deploy), "TP%u -> TP%u", c->prefill_tp, c->decode_tp);
    if (o->json) {
        kvs_json_object_begin(j, NULL);
        kvs_json_str(j, "model", c->model);
        kvs_json_str(j, "deployment", deploy);
        kvs_json_bool(j, "colocated", c->colocated);
        kvs_json_u64(j, "prefill_tp", c->prefill_tp);
        kvs_json_u64(j, "decode_tp", c->colocated ? c->prefill_tp : c->decode_tp);
        kvs_json_u64(j, "prompt_tokens", c->prompt_len ? c->prompt_len : o->prompt_len);
        kvs_json_bool(j, "ok", r->ok);
        kvs_json_double(j, "prefill_tok_s", r->prefill_tok_s);
        kvs_json_double(j, "decode_tok_s", r->decode_tok_s);
        kvs_json_double(j, "ttft_ms", r->ttft_ms);
        kvs_json_double(j, "transfer_ms", r->transfer_ms);
        kvs_json_double(j, "transfer_share", r->share);
        if (!isnan(vs)) kvs_json_double(j, "ttft_vs_colocated", vs);
        kvs_json_double(j, "kv_bytes_per_request", r->kv_bytes);
        kvs_json_double(j, "load_s", r->load_s);
        kvs_json_object_end(j);
    } else if (!r->ok) {
        printf("%-14s %-15s   FAILED (run `kvstage generate` with these settings to see why)\n",
               c->model, deploy);
    } else if (o->device) {
        printf("%-14s %-15s %7u %14.1f %13.1f %10.1f %12s %7s %10s\n", c->model, deploy,
               c->prompt_len, r->prefill_tok_s, r->decode_tok_s, r->ttft_ms, "-", "-", "-");
        if (!c->colocated)
            printf("%-14s %-15s %7s %14s %13s %10s %12.2f %6.1f%% %10.0f\n", "", "", "", "", "", "",
                   r->transfer_ms, 100.0 * r->share, r->kv_bytes / 1024.0);
        if (!isnan(vs))
            printf("%-14s %-15s %7s %14s %13s %+9.1f%% vs colocated, request by request%s\n", "",
                   "", "", "", "", 100.0 * vs,
                   c->prompt_len >= TTFT_GOAL_FROM
                       ? (vs <= TTFT_GOAL ? " (goal <= 3%: met)" : " (goal <= 3%: NOT met)")
                       : "");
    } else if (c->colocated) {
        printf("%-14s %-15s %14.1f %13.1f %10.1f %12s %7s %10s\n", c->model, deploy,
               r->prefill_tok_s, r->decode_tok_s, r->ttft_ms, "-", "-", "-");
    } else {
        printf("%-14s %-15s %14.1f %13.1f %10.1f %12.2f %6.1f%% %10.0f\n", c->model, deploy,
               r->prefill_tok_s, r->decode_tok_s, r->ttft_ms, r->transfer_ms, 100.0 * r->share,
               r->kv_bytes / 1024.0);
    }
    fflush(stdout);
}

static void print_end(const engine_opts_t *o, kvs_json_t *j, int failed)
{
    if (o->json) {
        kvs_json_array_end(j);
        kvs_json_bool(j, "ok", !failed);
        kvs_json_end(j);
        return;
    }
    printf("\nprefill and decode tok/s: one request at a time (prefill: the prompt on the "
           "prefill side;\ndecode: tokens after the first); TTFT: submission to the first "
           "token on decode; transfer:\nprompt computed on prefill -> KV and first token on "
           "every decode rank.\n");
}

/* The median over requests of disaggregated TTFT / colocated TTFT - 1, request i against
 * request i: both deployments serve the same prompts in the same order, and TTFT drifts over a
 * run (about 1 ms over seven 1k-token requests on an H100) in both alike. */
static double paired_ratio(const row_t *colo, const row_t *dis)
{
    double v[MAX_RUNS];
    int n = 0;
    for (int i = 0; i < colo->n_each && i < dis->n_each; i++)
        if (colo->ttft_each[i] > 0) v[n++] = dis->ttft_each[i] / colo->ttft_each[i] - 1.0;
    return n > 0 ? median(v, n) : NAN;
}

int kvs_bench_engine(int argc, char **argv)
{
    engine_opts_t o = {.runs = 0, .prompt_len = 128, .max_tokens = 32, .seed = 1};
    kvs_arg_table_t t = {.count = 0};
    engine_flags(&t, &o);
    int rc = kvs_arg_table_parse(&t, "kvstage bench engine [flags]", argc, argv, 1);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    /* The ranges are the flag table's. On a GPU a request takes tens of ms, and the TTFT goal
     * is a few percent: more requests. */
    if (o.runs == 0) o.runs = o.device ? 7 : 3;
    char cpu[256], path[4096];
    long cores = 0;
    kvs_bench_cpu_info(cpu, sizeof(cpu), &cores);
    int have_smol = o.only != 2 && kvs_model_default_path(path, sizeof(path)) == KVS_OK;
    if (o.only == 1 && !have_smol) return 1;
    kvs_json_t j;
    int failed = 0;
    if (print_begin(&o, &j, cpu, cores, have_smol, &failed) != 0) return 1;
    const config_t *list = o.device ? gpu_configs : configs;
    const size_t count = o.device ? sizeof(gpu_configs) / sizeof(gpu_configs[0])
                                  : sizeof(configs) / sizeof(configs[0]);
    row_t colo;
    memset(&colo, 0, sizeof(colo));
    const config_t *colo_c = NULL;
    uint32_t goal_rows = 0, goal_met = 0;
    double worst = -1.0;
    for (size_t i = 0; i < count; i++) {
        const config_t *c = &list[i];
        if ((c->seeded && o.only == 1) || (!c->seeded && (o.only == 2 || !have_smol))) continue;
        row_t r =
            measure(c, o.runs, o.prompt_len, o.max_tokens, o.seed, o.device ? (int) o.gpu : -1);
        failed |= !r.ok;
        double vs = NAN;
        if (c->colocated) {
            colo = r;
            colo_c = c;
        } else if (colo_c != NULL && r.ok && colo.ok && strcmp(colo_c->model, c->model) == 0 &&
                   colo_c->prompt_len == c->prompt_len) {
            vs = paired_ratio(&colo, &r);
            if (o.device && c->prompt_len >= TTFT_GOAL_FROM) {
                goal_rows++;
                goal_met += vs <= TTFT_GOAL;
                if (vs > worst) worst = vs;
            }
        }
        print_row(&o, &j, c, &r, vs);
    }
    if (goal_rows > 0 && !o.json)
        printf("summary: %u/%u disaggregated rows from %u tokens keep TTFT within %.0f%% of "
               "colocated (median of the request-by-request ratios; worst %+.1f%%)\n",
               goal_met, goal_rows, TTFT_GOAL_FROM, 100.0 * TTFT_GOAL, 100.0 * worst);
    print_end(&o, &j, failed);
    return failed ? 1 : 0;
}
