/* `kvstage bench kernels`: throughput of the CUDA gather and scatter kernels (staging/cuda) on
 * real model KV shapes and page sizes, next to a device-to-device cudaMemcpy of the same bytes
 * timed in the same run on the same stream: the ceiling a copy kernel can approach. The same
 * gather and scatter are timed again with the region's checksum fused in (desc.checksum, as
 * the protocol runs them by default): its cost beside each row. Each row is also checked:
 * sampled heads of the region must equal their pool pages after the gather, and the pool
 * pages after a scatter to other pages; and where the region is small enough to fetch, both
 * checksums must equal kvs_csum_of() over its bytes on the host. */
#include "bench/bench_kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/args.h"

#if KVS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "bench/bench_transfer_common.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "staging/checksum.h"
#include "staging/copy.h"
#include "staging/cuda/copy_cuda.h"
#endif

enum { EXIT_RUN_FAILED = 1, EXIT_USAGE = 2 };

#define USAGE         "kvstage bench kernels [flags]"
#define TARGET_PCT    80.0 /* of the same-size device-to-device cudaMemcpy */
#define SUM_PCT       5.0  /* the checksum's cost, % of the plain gather's or scatter's time ... */
#define SUM_TOKENS    4096 /* ... from this many tokens */
#define SUM_CHECK_MAX (1ull << 30) /* largest region whose checksums are compared on the host */

#if KVS_HAVE_CUDA

typedef struct {
    const char *name;
    uint32_t layers, kv_heads, head_dim;
} model_t;

static const model_t models[] = {
    {"llama3-8b", 32, 8, 128},
    {"llama3-70b", 80, 8, 128},
};

typedef struct {
    uint32_t device, reps, warmup, samples;
    uint64_t inline_max;
    int inline_seen;
    int model;  /* 0 all, else models[model - 1] */
    int layout; /* 0 both, 1 NHD, 2 HND */
    const char *tokens;
    const char *pages;
} cfg_t;

typedef struct {
    uint32_t tokens[KVS_BT_MAX_LIST], pages[KVS_BT_MAX_LIST];
    int ntokens, npages;
} lists_t;

static int cu_ok(cudaError_t err, const char *what)
{
    if (err == cudaSuccess) return 1;
    fprintf(stderr, "error: %s: %s (%s)\n", what, cudaGetErrorName(err), cudaGetErrorString(err));
    return 0;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *) a, y = *(const float *) b;
    return (x > y) - (x < y);
}

/* What one timed operation needs: the backend (or NULL for the memcpy) and its arguments. */
typedef struct {
    const kvs_copy_backend_t *backend;
    kvs_copy_dir_t dir;
    const kvs_copy_desc_t *desc;
    void *dst;
    const void *src;
    uint64_t bytes;
} op_t;

static int op_issue(const op_t *op, cudaStream_t stream, uint64_t *ticket_p)
{
    if (op->backend == NULL)
        return cu_ok(cudaMemcpyAsync(op->dst, op->src, op->bytes, cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync");
    return kvs_copy_submit(op->backend, op->dir, op->desc, ticket_p) == KVS_OK;
}

/* Median seconds of one operation: warm-up runs, then `reps` runs back to back, each between
 * two events on the stream the operation runs on. */
static int op_time(const op_t *op, cudaStream_t stream, uint32_t warmup, uint32_t reps,
                   cudaEvent_t *ev, float *ms, double *sec_p)
{
    uint64_t ticket = 0;
    for (uint32_t i = 0; i < warmup; i++)
        if (!op_issue(op, stream, &ticket)) return 0;
    if (!cu_ok(cudaEventRecord(ev[0], stream), "cudaEventRecord")) return 0;
    for (uint32_t i = 0; i < reps; i++) {
        if (!op_issue(op, stream, &ticket)) return 0;
        if (!cu_ok(cudaEventRecord(ev[i + 1], stream), "cudaEventRecord")) return 0;
    }
    if (!cu_ok(cudaEventSynchronize(ev[reps]), "waiting for the timed runs")) return 0;
    if (op->backend != NULL) {
        kvs_status_t st;
        while ((st = kvs_copy_poll(op->backend, ticket)) == KVS_INPROGRESS) {
        }
        if (st != KVS_OK) return 0;
    }
    for (uint32_t i = 0; i < reps; i++)
        if (!cu_ok(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]), "cudaEventElapsedTime"))
            return 0;
    qsort(ms, reps, sizeof(float), cmp_float);
    float med = reps % 2 ? ms[reps / 2] : (ms[reps / 2 - 1] + ms[reps / 2]) / 2.0f;
    *sec_p = med / 1e3;
    return 1;
}

/* Compares `samples` random heads of the region with their pool pages (both on the device);
 * returns the number that differ. */
static uint64_t check_samples(const kvs_copy_desc_t *d, kvs_rng_t *rng, uint32_t samples)
{
    const uint64_t T = (uint64_t) d->npages * d->page_size;
    uint8_t a[4096], b[4096];
    uint64_t bad = 0;
    for (uint32_t s = 0; s < samples; s++) {
        uint32_t l = (uint32_t) kvs_rng_below(rng, d->layers);
        uint32_t c = (uint32_t) kvs_rng_below(rng, d->components);
        uint64_t t = kvs_rng_below(rng, T);
        uint32_t h = (uint32_t) kvs_rng_below(rng, d->heads);
        const kvs_region_t *r = &d->regions[l * d->components + c];
        uint64_t hb = (uint64_t) r->dim * r->elem_bytes;
        if (hb > sizeof(a)) hb = sizeof(a);
        const uint8_t *pool =
            kvs_region_addr(r, d->pages[t / d->page_size], t % d->page_size, d->pool_head + h);
        const uint8_t *reg = d->region + kvs_region_block_offset(d->shape, d->heads, T, l, c) +
                             (t * d->heads + h) * hb;
        if (!cu_ok(cudaMemcpy(a, pool, hb, cudaMemcpyDeviceToHost), "sample download") ||
            !cu_ok(cudaMemcpy(b, reg, hb, cudaMemcpyDeviceToHost), "sample download") ||
            memcmp(a, b, hb) != 0)
            bad++;
    }
    return bad;
}

/* Fills n device bytes with random data: one random chunk uploaded, then copied along. */
static int fill_random(uint8_t *dev, uint64_t n, kvs_rng_t *rng)
{
    const uint64_t chunk = 64ull << 20;
    uint64_t first = n < chunk ? n : chunk;
    uint8_t *host = kvs_malloc(first);
    if (host == NULL) return 0;
    for (uint64_t i = 0; i + 8 <= first; i += 8) {
        uint64_t v = kvs_rng_next(rng);
        memcpy(host + i, &v, 8);
    }
    int ok = cu_ok(cudaMemcpy(dev, host, first, cudaMemcpyHostToDevice), "filling memory");
    kvs_free(host);
    for (uint64_t off = first; ok && off < n; off += chunk) {
        uint64_t len = n - off < chunk ? n - off : chunk;
        ok = cu_ok(cudaMemcpy(dev + off, dev, len, cudaMemcpyDeviceToDevice), "filling memory");
    }
    return ok && cu_ok(cudaDeviceSynchronize(), "filling memory");
}

typedef struct {
    int rows, rows_met, checks_failed;
    double worst_pct;
    int sum_rows, sum_met, sum_checked, sum_failed;
    double sum_worst;
} totals_t;

/* One row's median times (seconds) and what its checks found. */
typedef struct {
    double mem, g, s, gs, ss; /* memcpy, gather, scatter, gather+sum, scatter+sum */
    uint64_t bad;             /* sampled heads that differ */
    int sum_state; /* the checksums against the host's: 0 not compared, 1 equal, -1 not */
} row_times_t;

/* One (model, layout, page size): the device pool and region, and the host tables every row of
 * it shares. */
typedef struct {
    const cfg_t *cfg;
    const model_t *m;
    kvs_pool_config_t pc;
    uint32_t num_pages;
    cudaStream_t stream; /* the backend's */
    kvs_pool_t *pool;
    kvs_region_t *regions;  /* [layers x K/V] */
    uint32_t *list, *other; /* pages in a random order; the same rotated by one */
    uint8_t *region;
    uint64_t max_bytes; /* of the region */
    float *ms;
    cudaEvent_t *ev;
    uint32_t nev; /* created */
} pool_bench_t;

static void pool_config(const cfg_t *cfg, const model_t *m, kvs_pool_layout_t layout, uint32_t P,
                        uint32_t num_pages, kvs_pool_config_t *pc)
{
    memset(pc, 0, sizeof(*pc));
    pc->shape.layers = m->layers;
    pc->shape.kv_heads = m->kv_heads;
    pc->shape.head_dim_k = m->head_dim;
    pc->shape.head_dim_v = m->head_dim;
    pc->shape.elem_bytes = 2; /* bf16 */
    pc->shape.attn = KVS_ATTN_MHA;
    pc->tp.tp_size = 1;
    pc->page_size = P;
    pc->num_pages = num_pages;
    pc->layout = layout;
    pc->mem = KVS_MEM_DEVICE;
    pc->device = (int) cfg->device;
}

/* Allocates and fills b's pool, region and tables; NULL, or what failed. */
static const char *pool_setup(pool_bench_t *b, kvs_rng_t *rng)
{
    const uint32_t LC = b->m->layers * 2, num_pages = b->num_pages, reps = b->cfg->reps;
    b->max_bytes =
        kvs_copy_region_bytes(&b->pc.shape, b->m->kv_heads, (uint64_t) num_pages * b->pc.page_size);
    if (kvs_pool_create(&b->pc, &b->pool) != KVS_OK) return "creating the device pool";
    b->regions = kvs_calloc(LC, sizeof(kvs_region_t));
    b->list = kvs_calloc(num_pages, sizeof(uint32_t));
    b->other = kvs_calloc(num_pages, sizeof(uint32_t));
    b->ms = kvs_calloc(reps, sizeof(float));
    b->ev = kvs_calloc(reps + 1, sizeof(cudaEvent_t));
    if (!b->regions || !b->list || !b->other || !b->ms || !b->ev) return "out of host memory";
    for (uint32_t i = 0; i < LC; i++) b->regions[i] = *kvs_pool_region(b->pool, i / 2, i % 2);
    for (; b->nev < reps + 1; b->nev++)
        if (!cu_ok(cudaEventCreate(&b->ev[b->nev]), "cudaEventCreate")) return "creating events";
    void *p = NULL;
    if (!cu_ok(cudaMalloc(&p, b->max_bytes), "allocating the region"))
        return "allocating the region";
    b->region = p;
    /* the pool's one allocation starts at the first region and holds max_bytes at least */
    const uint64_t pool_bytes = (uint64_t) (b->regions[LC - 1].base - b->regions[0].base) +
                                (uint64_t) num_pages * b->regions[LC - 1].page_stride;
    if (!fill_random(b->regions[0].base, pool_bytes, rng) ||
        !fill_random(b->region, b->max_bytes, rng))
        return "filling the pool and region with random bytes";
    /* pages in a random order, as a long-running pool hands them out */
    for (uint32_t i = 0; i < num_pages; i++) b->list[i] = i;
    for (uint32_t i = num_pages; i > 1; i--) {
        uint32_t j = (uint32_t) kvs_rng_below(rng, i), x = b->list[i - 1];
        b->list[i - 1] = b->list[j];
        b->list[j] = x;
    }
    return NULL;
}

static void pool_teardown(pool_bench_t *b)
{
    for (uint32_t i = 0; i < b->nev; i++) (void) cudaEventDestroy(b->ev[i]);
    if (b->region) (void) cudaFree(b->region);
    kvs_free(b->ev);
    kvs_free(b->ms);
    kvs_free(b->other);
    kvs_free(b->list);
    kvs_free(b->regions);
    kvs_pool_destroy(b->pool);
}

/* The copy of the first npages of b's page list between the pool and the region. */
static void row_desc(const pool_bench_t *b, uint32_t npages, kvs_copy_desc_t *d)
{
    const uint32_t P = b->pc.page_size;
    memset(d, 0, sizeof(*d));
    d->regions = b->regions;
    d->layers = b->m->layers;
    d->components = 2;
    d->shape = &kvs_pool_config(b->pool)->shape;
    d->pages = b->list;
    d->npages = npages;
    d->pool_pages = b->num_pages;
    d->page_size = P;
    d->pool_head = 0;
    d->heads = b->m->kv_heads;
    d->region = b->region;
    d->region_bytes = kvs_copy_region_bytes(&b->pc.shape, d->heads, (uint64_t) npages * P);
}

/* Scatters the region once more to other pages (d's list rotated by one page) and adds the
 * sampled heads that differ there to *bad_p; NULL, or what failed. */
static const char *checked_scatter(pool_bench_t *b, const kvs_copy_desc_t *d,
                                   const kvs_copy_backend_t *gpu, kvs_rng_t *rng, uint64_t *bad_p)
{
    for (uint32_t i = 0; i < d->npages; i++) b->other[i] = b->list[(i + 1) % d->npages];
    kvs_copy_desc_t d2 = *d;
    d2.pages = b->other;
    uint64_t ticket = 0;
    kvs_status_t st = kvs_copy_submit(gpu, KVS_COPY_SCATTER, &d2, &ticket);
    if (st == KVS_OK) {
        while ((st = kvs_copy_poll(gpu, ticket)) == KVS_INPROGRESS) {
        }
    }
    if (st != KVS_OK) return "the checked scatter";
    *bad_p += check_samples(&d2, rng, b->cfg->samples);
    return NULL;
}

/* Compares the checksums the gather and the scatter computed with kvs_csum_of() over the
 * region's bytes fetched to the host (the scatter reads the region the gather wrote, so both
 * sum the same bytes): 1 equal, -1 not, 0 not compared (too large to fetch, or no memory). */
static int check_checksums(const kvs_copy_desc_t *d, uint64_t sum_g, uint64_t sum_s)
{
    if (d->region_bytes > SUM_CHECK_MAX) return 0;
    uint8_t *host = kvs_malloc(d->region_bytes);
    if (host == NULL) return 0;
    int state = 0;
    if (cu_ok(cudaMemcpy(host, d->region, d->region_bytes, cudaMemcpyDeviceToHost),
              "fetching the region")) {
        const uint64_t want = kvs_csum_of(host, d->region_bytes);
        state = sum_g == want && sum_s == want ? 1 : -1;
        if (state < 0)
            fprintf(
                stderr, "error: checksum mismatch: gather %016llx, scatter %016llx, host %016llx\n",
                (unsigned long long) sum_g, (unsigned long long) sum_s, (unsigned long long) want);
    }
    kvs_free(host);
    return state;
}

/* Times the memcpy, the gather and the scatter of d, plain and with the checksum, into t, and
 * checks them; NULL, or what failed. */
static const char *time_row(pool_bench_t *b, const kvs_copy_desc_t *d,
                            const kvs_copy_backend_t *gpu, kvs_rng_t *rng, row_times_t *t)
{
    const cfg_t *cfg = b->cfg;
    uint64_t sum_g = 0, sum_s = 0;
    kvs_copy_desc_t dg = *d, ds = *d;
    dg.checksum = &sum_g;
    ds.checksum = &sum_s;
    op_t mem = {NULL, KVS_COPY_GATHER, NULL, b->region, b->regions[0].base, d->region_bytes};
    op_t gat = {gpu, KVS_COPY_GATHER, d, NULL, NULL, d->region_bytes};
    op_t sca = {gpu, KVS_COPY_SCATTER, d, NULL, NULL, d->region_bytes};
    op_t gat_sum = {gpu, KVS_COPY_GATHER, &dg, NULL, NULL, d->region_bytes};
    op_t sca_sum = {gpu, KVS_COPY_SCATTER, &ds, NULL, NULL, d->region_bytes};
    if (!op_time(&mem, b->stream, cfg->warmup, cfg->reps, b->ev, b->ms, &t->mem) ||
        !op_time(&gat, b->stream, cfg->warmup, cfg->reps, b->ev, b->ms, &t->g))
        return "timing the memcpy or the gather";
    /* the region now holds the gather of the list: check it */
    t->bad = check_samples(d, rng, cfg->samples);
    if (!op_time(&gat_sum, b->stream, cfg->warmup, cfg->reps, b->ev, b->ms, &t->gs))
        return "timing the gather with its checksum";
    if (!op_time(&sca, b->stream, cfg->warmup, cfg->reps, b->ev, b->ms, &t->s) ||
        !op_time(&sca_sum, b->stream, cfg->warmup, cfg->reps, b->ev, b->ms, &t->ss))
        return "timing the scatter";
    t->sum_state = check_checksums(d, sum_g, sum_s);
    return checked_scatter(b, d, gpu, rng, &t->bad);
}

/* One row: memcpy, gather and scatter of `tokens` tokens timed and checked, printed and added
 * to tot; NULL, or what failed. */
static const char *bench_row(pool_bench_t *b, uint32_t tokens, const kvs_copy_backend_t *gpu,
                             kvs_rng_t *rng, totals_t *tot)
{
    const uint32_t P = b->pc.page_size;
    kvs_copy_desc_t d;
    row_desc(b, (tokens + P - 1) / P, &d);
    const uint64_t bytes = d.region_bytes;
    kvs_cuda_plan_t plan;
    if (kvs__copy_cuda_plan(&d, &plan) != KVS_OK) return "planning the copy";
    row_times_t t;
    const char *failed = time_row(b, &d, gpu, rng, &t);
    if (failed) return failed;

    const double gb = (double) bytes / 1e9;
    const double g_mem = gb / t.mem, g_g = gb / t.g, g_s = gb / t.s;
    const double pg = 100.0 * g_g / g_mem, ps = 100.0 * g_s / g_mem;
    const double cg = 100.0 * (t.gs / t.g - 1.0), cs = 100.0 * (t.ss / t.s - 1.0);
    const int met = pg >= TARGET_PCT && ps >= TARGET_PCT;
    const int sum_row = tokens >= SUM_TOKENS, sum_met = cg <= SUM_PCT && cs <= SUM_PCT;
    static const char *runs[] = {"head", "token", "page"};
    static const char *sum_checks[] = {"BAD", "-", "ok"};
    printf("%-10s %-3s %4u %6u %9.1f %7.0f (%5.0f) %7.0f %5.1f%% %7.0f %5.1f%% %3u %-5s %-3s "
           "%8.0f %5.1f%% %8.0f %5.1f%% %-6s %-4s%s\n",
           b->m->name, b->pc.layout == KVS_POOL_HND ? "HND" : "NHD", P, tokens,
           (double) bytes / (1 << 20), g_mem, 2 * g_mem, g_g, pg, g_s, ps, plan.vec_bytes,
           runs[plan.run], met ? "yes" : "NO", gb / t.gs, cg, gb / t.ss, cs,
           !sum_row  ? "-"
           : sum_met ? "yes"
                     : "NO",
           sum_checks[t.sum_state + 1], t.bad ? "  CHECK FAILED" : "");
    fflush(stdout);
    tot->rows++;
    tot->rows_met += met;
    tot->checks_failed += t.bad != 0;
    if (pg < tot->worst_pct) tot->worst_pct = pg;
    if (ps < tot->worst_pct) tot->worst_pct = ps;
    tot->sum_checked += t.sum_state != 0;
    tot->sum_failed += t.sum_state < 0;
    if (!sum_row) return NULL;
    tot->sum_rows++;
    tot->sum_met += sum_met;
    if (cg > tot->sum_worst) tot->sum_worst = cg;
    if (cs > tot->sum_worst) tot->sum_worst = cs;
    return NULL;
}

/* One (model, layout, page size): a pool sized for the largest token count, then one row per
 * token count. */
static int bench_pool(const cfg_t *cfg, const model_t *m, kvs_pool_layout_t layout, uint32_t P,
                      const uint32_t *tokens, int ntokens, const kvs_copy_backend_t *gpu,
                      kvs_rng_t *rng, totals_t *tot)
{
    uint32_t max_tokens = 0;
    for (int i = 0; i < ntokens; i++)
        if (tokens[i] > max_tokens) max_tokens = tokens[i];
    pool_bench_t b;
    memset(&b, 0, sizeof(b));
    b.cfg = cfg;
    b.m = m;
    b.num_pages = (max_tokens + P - 1) / P;
    b.stream = (cudaStream_t) kvs_copy_cuda_stream(gpu);
    pool_config(cfg, m, layout, P, b.num_pages, &b.pc);
    const char *failed = pool_setup(&b, rng);
    for (int ti = 0; failed == NULL && ti < ntokens; ti++)
        failed = bench_row(&b, tokens[ti], gpu, rng, tot);
    if (failed)
        fprintf(stderr, "error: %s failed (%s, %s, page size %u)\n", failed, m->name,
                layout == KVS_POOL_HND ? "HND" : "NHD", P);
    pool_teardown(&b);
    return failed == NULL;
}

static void kernels_flags(kvs_arg_table_t *t, cfg_t *cfg)
{
    const kvs_arg_t g[] = {
        {"device", KVS_ARG_U32, &cfg->device, "CUDA device (default 0)", NULL, NULL},
        {"model", KVS_ARG_CHOICE, &cfg->model, "KV shapes (bf16, 8 KV heads, head dim 128)",
         "all|llama3-8b|llama3-70b", NULL},
        {"layout", KVS_ARG_CHOICE, &cfg->layout, "pool layouts", "both|nhd|hnd", NULL},
        {"tokens", KVS_ARG_STR, &cfg->tokens, "token counts (default 1024,4096,16384,32768)", NULL,
         NULL},
        {"page-sizes", KVS_ARG_STR, &cfg->pages, "page sizes (default 1,16,64)", NULL, NULL},
        {"reps", KVS_ARG_U32, &cfg->reps, "timed copies per row, median reported (default 10)",
         NULL, NULL},
        {"warmup", KVS_ARG_U32, &cfg->warmup, "untimed copies first (default 3)", NULL, NULL},
        {"samples", KVS_ARG_U32, &cfg->samples, "heads checked per gather and scatter (default 64)",
         NULL, NULL},
        {"inline-max", KVS_ARG_U64, &cfg->inline_max,
         "largest table (bytes) passed in kernel parameters; 0 uploads every page list "
         "(default: the backend's)",
         NULL, &cfg->inline_seen},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* The token and page lists, into lists; 0, or EXIT_USAGE after the error and the usage. */
static int parse_lists(const cfg_t *cfg, const kvs_arg_table_t *t, lists_t *lists)
{
    lists->ntokens = kvs_bt_parse_list(cfg->tokens, lists->tokens);
    lists->npages = kvs_bt_parse_list(cfg->pages, lists->pages);
    const char *bad = NULL;
    if (lists->ntokens <= 0)
        bad = "--tokens takes up to 16 comma-separated counts in 1..16777216";
    else if (lists->npages <= 0)
        bad = "--page-sizes takes up to 16 comma-separated sizes in 1..16777216";
    else if (cfg->reps == 0 || cfg->reps > 1000)
        bad = "--reps must be in 1..1000";
    else if (cfg->warmup > 1000)
        bad = "--warmup must be at most 1000";
    if (bad == NULL) return 0;
    (void) t;
    kvs_args_error(NULL, NULL, "%s", bad);
    return EXIT_USAGE;
}

/* Makes --device current, describes it into desc and creates the copy backend on it; 0, or the
 * exit code after saying why. */
static int open_gpu(const cfg_t *cfg, kvs_copy_backend_t *gpu, char *desc, size_t cap)
{
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        fprintf(stderr,
                "kvstage bench kernels: no CUDA device here (%s); this benchmark needs a GPU\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "the runtime sees 0 devices");
        return EXIT_RUN_FAILED;
    }
    if ((int) cfg->device >= count) {
        fprintf(stderr, "error: --device %u but this machine has %d CUDA device(s)\n", cfg->device,
                count);
        return EXIT_USAGE;
    }
    struct cudaDeviceProp prop;
    int rt = 0, drv = 0;
    if (!cu_ok(cudaGetDeviceProperties(&prop, (int) cfg->device), "cudaGetDeviceProperties"))
        return EXIT_RUN_FAILED;
    (void) cudaRuntimeGetVersion(&rt);
    (void) cudaDriverGetVersion(&drv);
    if (!cu_ok(cudaSetDevice((int) cfg->device), "cudaSetDevice")) return EXIT_RUN_FAILED;
    if (kvs_copy_cuda_create((int) cfg->device, gpu) != KVS_OK) return EXIT_RUN_FAILED;
    if (cfg->inline_seen) (void) kvs__copy_cuda_set_inline_max(gpu, (size_t) cfg->inline_max);
    snprintf(desc, cap,
             "GPU %u: %s, %d SMs, %.1f GiB, L2 %d MiB, compute %d.%d; CUDA runtime %d.%d, driver "
             "%d.%d",
             cfg->device, prop.name, prop.multiProcessorCount,
             (double) prop.totalGlobalMem / (1ull << 30), prop.l2CacheSize >> 20, prop.major,
             prop.minor, rt / 1000, rt % 1000 / 10, drv / 1000, drv % 1000 / 10);
    return 0;
}

static void print_header(const cfg_t *cfg, const char *gpu_desc)
{
    printf("kvstage bench kernels: CUDA gather/scatter vs a device-to-device cudaMemcpy of the "
           "same bytes\n");
    printf("%s\n", gpu_desc);
    printf("shapes: bf16, 8 KV heads, head dim 128, all heads of a TP-1 pool, pages in random "
           "order\n");
    printf("timing: CUDA events on the backend's stream around each copy (page-list upload + "
           "one kernel), %u warm-up + %u timed, median\n",
           cfg->warmup, cfg->reps);
    printf("page lists: inside the kernel parameters while the table fits (16 KiB; "
           "--inline-max), else uploaded first\n");
    printf("GB/s counts payload bytes once (1 GB = 1e9 B); DRAM traffic is read + write = 2x, "
           "shown for the memcpy in ()\n");
    printf("target: gather and scatter >= %.0f%% of the memcpy (column ok)\n", TARGET_PCT);
    printf("+sum: the same gather and scatter computing the region's checksum (as the protocol "
           "does by default), GB/s and cost = (time with - time without) / time without; "
           "target cost <= %.0f%% from %u tokens (column sum-ok); csum: both sums equal "
           "kvs_csum_of() over the region on the host (- not compared: over %llu MiB)\n\n",
           SUM_PCT, SUM_TOKENS, (unsigned long long) (SUM_CHECK_MAX >> 20));
    printf("%-10s %-3s %4s %6s %9s %15s %14s %14s %3s %-5s %-3s %15s %15s %-6s %s\n", "model",
           "lay", "page", "tokens", "MiB", "memcpy (r+w)", "gather %", "scatter %", "vec", "run",
           "ok", "gather+sum cost", "scatter+sum cost", "sum-ok", "csum");
    fflush(stdout);
}

/* Every selected model, layout and page size; 0 when a run failed. */
static int bench_all(const cfg_t *cfg, const lists_t *lists, const kvs_copy_backend_t *gpu,
                     totals_t *tot)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 0xbe4c4);
    int ok = 1;
    for (size_t mi = 0; mi < sizeof(models) / sizeof(models[0]) && ok; mi++) {
        if (cfg->model != 0 && (size_t) cfg->model != mi + 1) continue;
        for (int li = 0; li < 2 && ok; li++) {
            if (cfg->layout != 0 && cfg->layout != li + 1) continue;
            for (int pi = 0; pi < lists->npages && ok; pi++)
                ok = bench_pool(cfg, &models[mi], li == 0 ? KVS_POOL_NHD : KVS_POOL_HND,
                                lists->pages[pi], lists->tokens, lists->ntokens, gpu, &rng, tot);
        }
    }
    return ok;
}

int kvs_bench_kernels(int argc, char **argv)
{
    cfg_t cfg = {.device = 0, .reps = 10, .warmup = 3, .samples = 64};
    cfg.tokens = "1024,4096,16384,32768";
    cfg.pages = "1,16,64";
    kvs_arg_table_t t = {.count = 0};
    kernels_flags(&t, &cfg);
    int rc = kvs_arg_table_parse(&t, USAGE, argc, argv, 1);
    if (rc == KVS_ARGS_HELP) return 0;
    if (rc != KVS_ARGS_OK) return EXIT_USAGE;
    lists_t lists;
    if ((rc = parse_lists(&cfg, &t, &lists)) != 0) return rc;
    kvs_copy_backend_t gpu = {NULL, NULL};
    char desc[512];
    if ((rc = open_gpu(&cfg, &gpu, desc, sizeof(desc))) != 0) return rc;
    print_header(&cfg, desc);

    totals_t tot = {.worst_pct = 1e9, .sum_worst = -1e9};
    int ok = bench_all(&cfg, &lists, &gpu, &tot);
    kvs_copy_backend_destroy(&gpu);
    printf("\n");
    if (!ok) {
        printf("summary: FAILED to run (see the error above)\n");
        return EXIT_RUN_FAILED;
    }
    printf("summary: %d/%d rows meet the target (>= %.0f%% of cudaMemcpy for gather and scatter); "
           "worst %.1f%%\n",
           tot.rows_met, tot.rows, TARGET_PCT, tot.worst_pct);
    if (tot.sum_rows)
        printf("summary: %d/%d rows from %u tokens keep the checksum's cost <= %.0f%% of the "
               "gather and the scatter; worst %.1f%%\n",
               tot.sum_met, tot.sum_rows, SUM_TOKENS, SUM_PCT, tot.sum_worst);
    printf("check: %s (%u sampled heads per gather and per scatter of each row)\n",
           tot.checks_failed ? "FAILED" : "all sampled heads byte-exact", cfg.samples);
    printf("check: checksums %s (gather and scatter sums against kvs_csum_of() over the region "
           "on the host: %d/%d rows compared, regions up to %llu MiB)\n",
           tot.sum_failed         ? "FAILED"
           : tot.sum_checked == 0 ? "NOT COMPARED"
                                  : "equal the host's",
           tot.sum_checked, tot.rows, (unsigned long long) (SUM_CHECK_MAX >> 20));
    return tot.checks_failed || tot.sum_failed ? EXIT_RUN_FAILED : 0;
}

#else /* built without CUDA */

int kvs_bench_kernels(int argc, char **argv)
{
    if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        printf("usage: %s\n  (needs a CUDA build and a GPU)\n", USAGE);
        return 0;
    }
    fprintf(stderr, "kvstage bench kernels: this kvstage was built without CUDA; configure "
                    "where nvcc is available (-DKVS_CUDA=ON) and run it on a GPU machine\n");
    return EXIT_RUN_FAILED;
}

#endif
