/* `kvstage bench transfer`: moves one request's KV cache (real model shapes, bf16) from the
 * prefill ranks' pools to the decode ranks' pools, four ways, in one run:
 *   staged   - the protocol (sender + receiver over the in-process link, real clock): gather
 *              kernel into a staging buffer, one peer copy per chunk and writer into the decode
 *              ring, scatter kernel into the decode pool;
 *   direct   - the same protocol with direct writes: the gather kernel stores straight into
 *              the granted slot of the decode ring, then the scatter;
 *   per-page - what staging replaces: one copy per page x layer x K/V x head slice, pool to
 *              pool, on one stream;
 *   bulk     - one peer copy of the same bytes between two flat buffers: the limit.
 * Prefill ranks live on one GPU and decode ranks on another (or both on one GPU when only one
 * is present). Staged and direct are timed from add_room to Success on every rank, so control
 * messages, gathers, copies and scatters all count. Every protocol and per-page result is
 * checked on sampled heads against the prefill pools. Staged and direct run with chunk
 * checksums on (the protocol's default) and, with --checksum both (the default), also off, the
 * two alternating request by request: the difference is the checksum's cost, printed beside
 * each row. --device cpu runs the same code on host
 * memory (a functional check of the benchmark, not a measurement to report). --transport ucx
 * hands over to bench_transfer_ucx.c: two processes over the net link, host memory. */
#include "bench/bench_transfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/args.h"
#include "base/mem.h"
#include "bench/bench_transfer_common.h"
#include "bench/bench_transfer_ucx.h"
#include "bench/bench_util.h"
#include "common/json.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/grid.h"
#include "kvstage/inproc.h"
#include "kvstage/log.h"
#include "kvstage/pd.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"

#if KVS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

enum { EXIT_RUN_FAILED = 1, EXIT_USAGE = 2 };

#define USAGE             "kvstage bench transfer [flags]"
#define TARGET_BULK_PCT   90.0 /* staged or direct, of the bulk copy ... */
#define TARGET_MIN_TOKENS 4096 /* ... for prompts of at least this many tokens */
#define TARGET_PP_X       20.0 /* staged or direct over per-page ... */
#define TARGET_PP_PAGE    16   /* ... at this page size */
#define TARGET_SUM_GPU    5.0  /* the checksum's cost, % of the transfer time: on GPUs ... */
#define TARGET_SUM_HOST   10.0 /* ... and in host memory (every row) */
#define MAX_LIST          KVS_BT_MAX_LIST
#define ROOM_TIMEOUT_NS   (60ull * 1000000000ull)

typedef struct {
    const char *name;
    uint32_t layers, kv_heads, head_dim;
} model_t;

static const model_t models[] = {
    {"llama3-8b", 32, 8, 128},
    {"llama3-70b", 80, 8, 128},
};

enum { M_BULK = 0, M_STAGED, M_DIRECT, M_PAGE, M_COUNT };
static const char *const method_names[M_COUNT] = {"bulk", "staged", "direct", "per_page"};

typedef struct {
    int cuda;
    int gpu_p, gpu_d; /* prefill and decode GPU */
    int model;        /* 0 all, else models[model - 1] */
    int layout;       /* 0 HND, 1 NHD (both sides) */
    uint32_t tokens[MAX_LIST], pages[MAX_LIST], ptp[MAX_LIST], dtp[MAX_LIST];
    int ntokens, npages, ntp;
    uint32_t chunk, reps, warmup, samples, window, buffers, ring_slots;
    uint64_t per_page_max;
    int checksum; /* KVS_BT_CSUM_* */
    int json;
} cfg_t;

typedef struct {
    const char *model;
    uint32_t ptp, dtp, page, tokens;
    uint64_t bytes;
    double gbs[M_COUNT];     /* 0: not run, or not available */
    double gbs_off[M_COUNT]; /* staged and direct with checksums off, beside gbs (--checksum
                                both); 0: not measured */
    uint64_t pp_copies;      /* copies of the whole per-page schedule */
    uint64_t pp_timed;       /* of which timed */
    uint64_t bad;            /* sampled heads that differ, all methods */
    int direct_unsupported;  /* the link could not map the ring for this GPU */
} row_t;

/* ---- small helpers ---- */

/* The bytes [base, base + bytes) a pool's regions span. */
static void pool_extent(const kvs_pool_t *pool, uint8_t **base_p, uint64_t *bytes_p)
{
    const kvs_pool_config_t *c = kvs_pool_config(pool);
    uint32_t comps = kvs_kv_shape_components(&c->shape);
    const kvs_region_t *first = kvs_pool_region(pool, 0, 0);
    const kvs_region_t *last = kvs_pool_region(pool, c->shape.layers - 1, comps - 1);
    *base_p = first->base;
    *bytes_p = (uint64_t) (last->base - first->base) + (uint64_t) c->num_pages * last->page_stride;
}

#if KVS_HAVE_CUDA
static int cu_ok(cudaError_t err, const char *what)
{
    if (err == cudaSuccess) return 1;
    fprintf(stderr, "error: %s: %s (%s)\n", what, cudaGetErrorName(err), cudaGetErrorString(err));
    return 0;
}
#endif

/* Fills n bytes with random data, distinct in every 64 MiB segment. On a device one random
 * segment (plus slack) is uploaded and copied along at a different 16-byte shift per segment,
 * so a page moved to a wrong place cannot compare equal. */
static int fill_random(int cuda, uint8_t *mem, uint64_t n, kvs_rng_t *rng)
{
    const uint64_t seg = 64ull << 20, slack = 4096;
    uint64_t first = (n < seg ? n : seg) + slack;
    uint8_t *host = kvs_malloc(first);
    if (host == NULL) return 0;
    for (uint64_t i = 0; i + 8 <= first; i += 8) {
        uint64_t v = kvs_rng_next(rng);
        memcpy(host + i, &v, 8);
    }
    int ok = 1;
    if (!cuda) {
        for (uint64_t off = 0; off < n; off += seg) {
            uint64_t len = n - off < seg ? n - off : seg;
            memcpy(mem + off, host + (off / seg * 16) % slack, len);
            if (off / seg % 4 == 3) { /* fresh bytes now and then, still cheap */
                for (uint64_t i = 0; i + 8 <= first; i += 8) {
                    uint64_t v = kvs_rng_next(rng);
                    memcpy(host + i, &v, 8);
                }
            }
        }
        kvs_free(host);
        return 1;
    }
    void *dev = NULL;
    int device = kvs_mem_device_of(mem);
    if (kvs_mem_alloc(KVS_MEM_DEVICE, device, first, &dev) != KVS_OK) ok = 0;
    if (ok) ok = kvs_mem_copy(dev, host, first) == KVS_OK;
    for (uint64_t off = 0; ok && off < n; off += seg) {
        uint64_t len = n - off < seg ? n - off : seg;
        ok = kvs_mem_copy(mem + off, (uint8_t *) dev + (off / seg * 16) % slack, len) == KVS_OK;
    }
    kvs_mem_free(KVS_MEM_DEVICE, device, dev);
    kvs_free(host);
    return ok;
}

/* Overwrites n bytes with 0xee, so a check cannot pass on bytes of an earlier run. */
static int poison(int cuda, uint8_t *mem, uint64_t n)
{
    if (!cuda) {
        memset(mem, 0xee, n);
        return 1;
    }
#if KVS_HAVE_CUDA
    int prev = 0;
    if (!cu_ok(cudaGetDevice(&prev), "cudaGetDevice") ||
        !cu_ok(cudaSetDevice(kvs_mem_device_of(mem)), "cudaSetDevice"))
        return 0;
    int ok = cu_ok(cudaMemset(mem, 0xee, n), "poisoning decode pools") &&
             cu_ok(cudaDeviceSynchronize(), "poisoning decode pools");
    (void) cudaSetDevice(prev);
    return ok;
#else
    return 0;
#endif
}

/* ---- one deployment: pools of every rank for one (model, TP pair, page size) ---- */

typedef struct {
    const cfg_t *cfg;
    kvs_pd_geometry_t geo;
    uint32_t num_pages;
    kvs_pool_t *pf[KVS_MAX_TP], *dc[KVS_MAX_TP];
    uint32_t *pf_pages, *dc_pages; /* [num_pages] page tables: every page, in random order */
} dep_t;

static void dep_destroy(dep_t *d)
{
    for (uint32_t r = 0; r < KVS_MAX_TP; r++) {
        kvs_pool_destroy(d->pf[r]);
        kvs_pool_destroy(d->dc[r]);
    }
    kvs_free(d->pf_pages);
    kvs_free(d->dc_pages);
    memset(d, 0, sizeof(*d));
}

/* Takes every page of the pool and lists them in random order (a long-running pool). */
static int take_pages(kvs_pool_t *pool, uint32_t n, uint32_t *pages, kvs_rng_t *rng)
{
    if (kvs_pool_alloc(pool, n, pages) != KVS_OK) return 0;
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t) kvs_rng_below(rng, i), x = pages[i - 1];
        pages[i - 1] = pages[j];
        pages[j] = x;
    }
    return 1;
}

static int dep_create(const cfg_t *cfg, const model_t *m, uint32_t ptp, uint32_t dtp, uint32_t P,
                      uint32_t max_tokens, kvs_rng_t *rng, dep_t *d)
{
    memset(d, 0, sizeof(*d));
    d->cfg = cfg;
    d->geo.shape = (kvs_kv_shape_t){.layers = m->layers,
                                    .kv_heads = m->kv_heads,
                                    .head_dim_k = m->head_dim,
                                    .head_dim_v = m->head_dim,
                                    .elem_bytes = 2, /* bf16 */
                                    .attn = KVS_ATTN_MHA};
    d->geo.prefill_tp = ptp;
    d->geo.decode_tp = dtp;
    d->geo.page_size = P;
    d->geo.chunk_tokens = cfg->chunk < P ? P : cfg->chunk / P * P;
    d->num_pages = (max_tokens + P - 1) / P;
    if (kvs_pd_geometry_validate(&d->geo) != KVS_OK) return 0;
    d->pf_pages = kvs_calloc(d->num_pages, sizeof(uint32_t));
    d->dc_pages = kvs_calloc(d->num_pages, sizeof(uint32_t));
    uint32_t *scratch = kvs_calloc(d->num_pages, sizeof(uint32_t));
    int ok = d->pf_pages && d->dc_pages && scratch;
    for (int side = 0; side < 2 && ok; side++) {
        uint32_t tp = side == 0 ? ptp : dtp;
        for (uint32_t r = 0; r < tp && ok; r++) {
            kvs_pool_config_t pc;
            memset(&pc, 0, sizeof(pc));
            pc.shape = d->geo.shape;
            pc.tp = (kvs_tp_t){.tp_size = tp, .tp_rank = r};
            pc.page_size = P;
            pc.num_pages = d->num_pages;
            pc.layout = cfg->layout ? KVS_POOL_NHD : KVS_POOL_HND;
            pc.mem = cfg->cuda ? KVS_MEM_DEVICE : KVS_MEM_HOST;
            pc.device = side == 0 ? cfg->gpu_p : cfg->gpu_d;
            kvs_pool_t **pool = side == 0 ? &d->pf[r] : &d->dc[r];
            ok = kvs_pool_create(&pc, pool) == KVS_OK;
            /* lockstep ranks: the same page ids on every rank of a side */
            uint32_t *table = side == 0 ? d->pf_pages : d->dc_pages;
            if (ok) ok = take_pages(*pool, d->num_pages, r == 0 ? table : scratch, rng);
            if (ok && side == 0) {
                uint8_t *base;
                uint64_t bytes;
                pool_extent(*pool, &base, &bytes);
                ok = fill_random(cfg->cuda, base, bytes, rng);
            }
        }
    }
    kvs_free(scratch);
    if (!ok) dep_destroy(d);
    return ok;
}

static int poison_decode(const dep_t *d)
{
    for (uint32_t r = 0; r < d->geo.decode_tp; r++) {
        uint8_t *base;
        uint64_t bytes;
        pool_extent(d->dc[r], &base, &bytes);
        if (!poison(d->cfg->cuda, base, bytes)) return 0;
    }
    return 1;
}

/* Compares `samples` random heads of tokens [0, tokens) between the prefill rank that holds
 * them and the decode rank that received them; returns how many differ. */
static uint64_t check_samples(const dep_t *d, uint64_t tokens, kvs_rng_t *rng, uint32_t samples)
{
    const kvs_kv_shape_t *s = &d->geo.shape;
    const uint32_t hp = kvs_tp_heads_per_rank(s, d->geo.prefill_tp);
    const uint32_t hd = kvs_tp_heads_per_rank(s, d->geo.decode_tp);
    const uint32_t P = d->geo.page_size;
    uint8_t a[1024], b[1024];
    uint64_t bad = 0;
    for (uint32_t i = 0; i < samples && tokens > 0; i++) {
        uint64_t t = kvs_rng_below(rng, tokens);
        uint32_t l = (uint32_t) kvs_rng_below(rng, s->layers);
        uint32_t c = (uint32_t) kvs_rng_below(rng, 2);
        uint32_t g = (uint32_t) kvs_rng_below(rng, s->kv_heads);
        const kvs_region_t *rs = kvs_pool_region(d->pf[g / hp], l, c);
        const kvs_region_t *rd = kvs_pool_region(d->dc[g / hd], l, c);
        uint64_t hb = (uint64_t) rs->dim * rs->elem_bytes;
        if (hb > sizeof(a)) hb = sizeof(a);
        const uint8_t *src = kvs_region_addr(rs, d->pf_pages[t / P], t % P, g % hp);
        const uint8_t *dst = kvs_region_addr(rd, d->dc_pages[t / P], t % P, g % hd);
        if (kvs_mem_copy(a, src, hb) != KVS_OK || kvs_mem_copy(b, dst, hb) != KVS_OK ||
            memcmp(a, b, hb) != 0)
            bad++;
    }
    return bad;
}

/* ---- the protocol path ---- */

typedef struct {
    kvs_clock_t clock;
    kvs_inproc_net_t *net;
    kvs_link_t *pl[KVS_MAX_TP], *dl[KVS_MAX_TP];
    kvs_sender_t *tx[KVS_MAX_TP];
    kvs_receiver_t *rx[KVS_MAX_TP];
    uint32_t ptp, dtp;
    uint64_t next_room;
} proto_t;

static void proto_destroy(proto_t *p)
{
    for (uint32_t r = 0; r < p->ptp; r++) {
        kvs_sender_destroy(p->tx[r]);
        kvs_link_destroy(p->pl[r]);
    }
    for (uint32_t r = 0; r < p->dtp; r++) {
        kvs_receiver_destroy(p->rx[r]);
        kvs_link_destroy(p->dl[r]);
    }
    kvs_inproc_net_destroy(p->net);
    memset(p, 0, sizeof(*p));
}

static int proto_create(const dep_t *d, kvs_write_mode_t mode, uint32_t no_checksum, proto_t *p)
{
    const cfg_t *cfg = d->cfg;
    kvs_pd_geometry_t geo = d->geo;
    geo.no_checksum = no_checksum;
    memset(p, 0, sizeof(*p));
    p->clock = kvs_clock_monotonic();
    p->ptp = d->geo.prefill_tp;
    p->dtp = d->geo.decode_tp;
    kvs_pd_timeouts_t to;
    kvs_pd_timeouts_default(&to);
    if (kvs_inproc_net_create(p->ptp, p->dtp, NULL, &p->clock, &p->net) != KVS_OK) return 0;
    for (uint32_t r = 0; r < p->dtp; r++) {
        kvs_receiver_config_t rc = {.geo = geo,
                                    .rank = r,
                                    .timeouts = to,
                                    .ring_bytes =
                                        cfg->ring_slots * kvs_bt_full_slot_bytes(&d->geo)};
        if (kvs_inproc_link_create(p->net, KVS_SIDE_DECODE, r, &p->dl[r]) != KVS_OK ||
            kvs_receiver_create(&rc, d->dc[r], p->dl[r], &p->clock, &p->rx[r]) != KVS_OK) {
            proto_destroy(p);
            return 0;
        }
    }
    for (uint32_t r = 0; r < p->ptp; r++) {
        kvs_sender_config_t sc = {.geo = geo,
                                  .rank = r,
                                  .timeouts = to,
                                  .window_chunks = cfg->window,
                                  .staging_buffers = cfg->buffers,
                                  .write_mode = mode};
        if (kvs_inproc_link_create(p->net, KVS_SIDE_PREFILL, r, &p->pl[r]) != KVS_OK ||
            kvs_sender_create(&sc, d->pf[r], p->pl[r], &p->clock, &p->tx[r]) != KVS_OK) {
            proto_destroy(p);
            return 0;
        }
    }
    return 1;
}

/* One request of `tokens` tokens through the protocol, from add_room until every rank reports
 * Success; *sec_p is that wall time. KVS_OK, or the room's failure reason. */
static kvs_status_t proto_room(proto_t *p, const dep_t *d, uint64_t tokens, double *sec_p)
{
    const uint64_t room = ++p->next_room;
    const uint32_t final = 42;
    const uint64_t t0 = kvs_now_ns();
    kvs_status_t st = KVS_OK;
    for (uint32_t r = 0; r < p->dtp && st == KVS_OK; r++)
        st = kvs_receiver_add_room(p->rx[r], room, 0, tokens, d->dc_pages);
    for (uint32_t r = 0; r < p->ptp && st == KVS_OK; r++) {
        st = kvs_sender_add_room(p->tx[r], room, tokens, d->pf_pages);
        if (st == KVS_OK) st = kvs_sender_finish(p->tx[r], room, &final, sizeof(final));
    }
    if (st != KVS_OK) return st;
    for (;;) {
        for (uint32_t r = 0; r < p->ptp; r++) kvs_sender_progress(p->tx[r]);
        for (uint32_t r = 0; r < p->dtp; r++) kvs_receiver_progress(p->rx[r]);
        uint32_t done = 0;
        kvs_room_info_t info;
        for (uint32_t r = 0; r < p->ptp + p->dtp; r++) {
            st = r < p->ptp ? kvs_sender_poll(p->tx[r], room, &info)
                            : kvs_receiver_poll(p->rx[r - p->ptp], room, &info);
            if (st != KVS_OK) return st;
            if (info.status == KVS_ROOM_FAILED && info.quiescent)
                return info.reason != KVS_OK ? info.reason : KVS_ERR_IO;
            done += info.status == KVS_ROOM_SUCCESS && info.quiescent;
        }
        if (done == p->ptp + p->dtp) break;
        if (kvs_now_ns() - t0 > ROOM_TIMEOUT_NS) {
            fprintf(stderr, "error: a %llu-token request did not finish within %llu s\n",
                    (unsigned long long) tokens,
                    (unsigned long long) (ROOM_TIMEOUT_NS / 1000000000ull));
            return KVS_ERR_TIMEOUT;
        }
    }
    *sec_p = (double) (kvs_now_ns() - t0) / 1e9;
    for (uint32_t r = 0; r < p->ptp; r++) (void) kvs_sender_release(p->tx[r], room);
    for (uint32_t r = 0; r < p->dtp; r++) (void) kvs_receiver_release(p->rx[r], room);
    return KVS_OK;
}

/* ---- the per-page path and the bulk copy ---- */

/* Where the CUDA copies of the per-page path and the bulk copy run: a stream on the prefill
 * GPU (the copies push, as the protocol's writes do) and two timing events. */
typedef struct {
    int cuda;
#if KVS_HAVE_CUDA
    cudaStream_t stream;
    cudaEvent_t ev[2];
#endif
} xfer_t;

/* The head slice [head, head + k) of a page is one contiguous run in this region. */
static int slice_contiguous(const kvs_region_t *r, uint32_t k, uint32_t P)
{
    const uint64_t hb = (uint64_t) r->dim * r->elem_bytes;
    if (r->token_stride == hb && r->head_stride == (uint64_t) P * hb) return 1; /* HND */
    return r->head_stride == hb && (P == 1 || r->token_stride == (uint64_t) k * hb);
}

/* Copy n of the per-page schedule: pages outermost, then decode rank, writer, layer, K/V. */
typedef struct {
    const dep_t *d;
    kvs_writer_t writers[KVS_MAX_TP][KVS_MAX_WRITERS];
    uint32_t nwriters[KVS_MAX_TP];
    uint64_t per_page; /* copies per page */
} sched_t;

static int sched_init(const dep_t *d, sched_t *s)
{
    s->d = d;
    s->per_page = 0;
    for (uint32_t r = 0; r < d->geo.decode_tp; r++) {
        if (kvs_plan_writers(&d->geo.shape, d->geo.prefill_tp, d->geo.decode_tp, r, 1,
                             s->writers[r], &s->nwriters[r]) != KVS_OK)
            return 0;
        s->per_page += (uint64_t) s->nwriters[r] * d->geo.shape.layers * 2;
    }
    return 1;
}

/* Issues copy n; bytes_p receives its size. */
static int sched_copy(const sched_t *s, const xfer_t *x, uint64_t n, uint64_t *bytes_p)
{
    const dep_t *d = s->d;
    const uint32_t P = d->geo.page_size, L = d->geo.shape.layers;
    uint64_t page = n / s->per_page, k = n % s->per_page;
    uint32_t r = 0;
    while (k >= (uint64_t) s->nwriters[r] * L * 2) k -= (uint64_t) s->nwriters[r++] * L * 2;
    const kvs_writer_t *w = &s->writers[r][k / (L * 2)];
    uint32_t l = (uint32_t) (k % (L * 2)) / 2, c = (uint32_t) (k % 2);
    const kvs_region_t *rs = kvs_pool_region(d->pf[w->prefill_rank], l, c);
    const kvs_region_t *rd = kvs_pool_region(d->dc[r], l, c);
    uint8_t *src = kvs_region_addr(rs, d->pf_pages[page], 0, w->src_head);
    uint8_t *dst = kvs_region_addr(rd, d->dc_pages[page], 0, w->dst_head);
    const uint64_t row = (uint64_t) w->heads * rs->dim * rs->elem_bytes;
    *bytes_p = row * P;
    const int contiguous = slice_contiguous(rs, w->heads, P) && slice_contiguous(rd, w->heads, P);
    if (!x->cuda) {
        if (contiguous) {
            memcpy(dst, src, row * P);
        } else {
            for (uint32_t t = 0; t < P; t++)
                memcpy(dst + t * rd->token_stride, src + t * rs->token_stride, row);
        }
        return 1;
    }
#if KVS_HAVE_CUDA
    if (contiguous)
        return cu_ok(cudaMemcpyAsync(dst, src, row * P, cudaMemcpyDefault, x->stream),
                     "per-page cudaMemcpyAsync");
    /* NHD with a head subset: P rows of the slice, one 2D copy */
    return cu_ok(cudaMemcpy2DAsync(dst, rd->token_stride, src, rs->token_stride, row, P,
                                   cudaMemcpyDefault, x->stream),
                 "per-page cudaMemcpy2DAsync");
#else
    return 0;
#endif
}

/* Runs copies [0, count) of the schedule; *sec_p is their time (events on the stream). */
static int sched_run(const sched_t *s, const xfer_t *x, uint64_t count, uint64_t *bytes_p,
                     double *sec_p)
{
    uint64_t bytes = 0, b = 0;
    uint64_t t0 = kvs_now_ns();
#if KVS_HAVE_CUDA
    /* the stream belongs to the prefill GPU: make it current for its copies */
    if (x->cuda && (!cu_ok(cudaSetDevice(s->d->cfg->gpu_p), "cudaSetDevice") ||
                    !cu_ok(cudaEventRecord(x->ev[0], x->stream), "cudaEventRecord")))
        return 0;
#endif
    for (uint64_t n = 0; n < count; n++) {
        if (!sched_copy(s, x, n, &b)) return 0;
        bytes += b;
    }
    double sec = (double) (kvs_now_ns() - t0) / 1e9;
#if KVS_HAVE_CUDA
    if (x->cuda) {
        float ms = 0;
        if (!cu_ok(cudaEventRecord(x->ev[1], x->stream), "cudaEventRecord") ||
            !cu_ok(cudaEventSynchronize(x->ev[1]), "waiting for per-page copies") ||
            !cu_ok(cudaEventElapsedTime(&ms, x->ev[0], x->ev[1]), "cudaEventElapsedTime"))
            return 0;
        sec = ms / 1e3;
    }
#endif
    *bytes_p = bytes;
    *sec_p = sec;
    return 1;
}

/* One bulk copy of `bytes` from src (prefill GPU) to dst (decode GPU); median of reps. */
static int bulk_time(const cfg_t *cfg, const xfer_t *x, uint8_t *dst, const uint8_t *src,
                     uint64_t bytes, double *sec_p)
{
    double t[1000];
    for (uint32_t i = 0; i < cfg->warmup + cfg->reps; i++) {
        double sec = 0;
        if (!x->cuda) {
            uint64_t t0 = kvs_now_ns();
            memcpy(dst, src, bytes);
            sec = (double) (kvs_now_ns() - t0) / 1e9;
        } else {
#if KVS_HAVE_CUDA
            float ms = 0;
            if (!cu_ok(cudaSetDevice(cfg->gpu_p), "cudaSetDevice") ||
                !cu_ok(cudaEventRecord(x->ev[0], x->stream), "cudaEventRecord") ||
                !cu_ok(
                    cfg->gpu_p == cfg->gpu_d
                        ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, x->stream)
                        : cudaMemcpyPeerAsync(dst, cfg->gpu_d, src, cfg->gpu_p, bytes, x->stream),
                    "bulk copy") ||
                !cu_ok(cudaEventRecord(x->ev[1], x->stream), "cudaEventRecord") ||
                !cu_ok(cudaEventSynchronize(x->ev[1]), "waiting for the bulk copy") ||
                !cu_ok(cudaEventElapsedTime(&ms, x->ev[0], x->ev[1]), "cudaEventElapsedTime"))
                return 0;
            sec = ms / 1e3;
#endif
        }
        if (i >= cfg->warmup) t[i - cfg->warmup] = sec;
    }
    *sec_p = kvs_bt_median(t, cfg->reps);
    return 1;
}

/* ---- one deployment's rows ---- */

typedef struct {
    row_t *rows;
    uint32_t nrows, cap;
    uint8_t *bulk_src, *bulk_dst; /* [max bytes] flat buffers on the prefill and decode GPU */
    uint64_t bulk_cap;
} run_t;

/* One row of measure_protocol: n protocols (checksums on, then off) take turns request by
 * request, so drift on a shared machine lands on both alike; then each checks a
 * poisoned-then-transferred run. */
static int protocol_row(const dep_t *d, proto_t *p, int n, int method, row_t *row, kvs_rng_t *rng)
{
    const cfg_t *cfg = d->cfg;
    double t[2][1000], sec = 0;
    kvs_status_t st = KVS_OK;
    for (uint32_t i = 0; i < cfg->warmup + cfg->reps && st == KVS_OK; i++) {
        for (int k = 0; k < n && st == KVS_OK; k++) {
            st = proto_room(&p[k], d, row->tokens, &sec);
            if (i >= cfg->warmup) t[k][i - cfg->warmup] = sec;
        }
    }
    if (st == KVS_ERR_UNSUPPORTED && method == M_DIRECT) {
        row->direct_unsupported = 1;
        return 1;
    }
    if (st != KVS_OK) {
        fprintf(stderr, "error: %s transfer failed: %s\n", method_names[method],
                kvs_status_str(st));
        return 0;
    }
    for (int k = 0; k < n; k++) {
        double *gbs = k == 0 ? &row->gbs[method] : &row->gbs_off[method];
        *gbs = (double) row->bytes / 1e9 / kvs_bt_median(t[k], cfg->reps);
        if (!poison_decode(d) || proto_room(&p[k], d, row->tokens, &sec) != KVS_OK) return 0;
        row->bad += check_samples(d, row->tokens, rng, cfg->samples);
    }
    return 1;
}

/* Times the protocol in one write mode for every token count of the deployment, in the
 * checksum settings --checksum names (both: on into gbs, off into gbs_off). gbs[i] stays 0
 * when the mode is unavailable. */
static int measure_protocol(const dep_t *d, kvs_write_mode_t mode, int method, row_t *rows,
                            kvs_rng_t *rng)
{
    const cfg_t *cfg = d->cfg;
    const int n = cfg->checksum == KVS_BT_CSUM_BOTH ? 2 : 1;
    proto_t p[2];
    memset(p, 0, sizeof(p));
    int ok = 1;
    for (int k = 0; k < n && ok; k++)
        ok = proto_create(d, mode, k == 1 || cfg->checksum == KVS_BT_CSUM_OFF, &p[k]);
    for (int ti = 0; ti < cfg->ntokens && ok; ti++)
        ok = protocol_row(d, p, n, method, &rows[ti], rng);
    for (int k = 0; k < n; k++) proto_destroy(&p[k]);
    return ok;
}

static int measure_per_page(const dep_t *d, const xfer_t *x, row_t *rows, kvs_rng_t *rng)
{
    const cfg_t *cfg = d->cfg;
    sched_t *s = kvs_calloc(1, sizeof(*s));
    if (s == NULL || !sched_init(d, s)) {
        kvs_free(s);
        return 0;
    }
    int ok = 1;
    for (int ti = 0; ti < cfg->ntokens && ok; ti++) {
        row_t *row = &rows[ti];
        const uint64_t pages = (cfg->tokens[ti] + d->geo.page_size - 1) / d->geo.page_size;
        row->pp_copies = pages * s->per_page;
        /* whole pages only, so the check below covers exactly what was copied */
        uint64_t count = row->pp_copies;
        if (count > cfg->per_page_max)
            count = (cfg->per_page_max / s->per_page > 0 ? cfg->per_page_max / s->per_page : 1) *
                    s->per_page;
        uint64_t bytes = 0, warm = count < 64 ? count : 64;
        double sec = 0;
        ok = poison_decode(d) && sched_run(s, x, warm, &bytes, &sec) &&
             sched_run(s, x, count, &bytes, &sec);
        if (!ok) break;
        row->pp_timed = count;
        row->gbs[M_PAGE] = (double) bytes / 1e9 / sec;
        uint64_t covered = count / s->per_page * d->geo.page_size;
        row->bad += check_samples(d, covered < cfg->tokens[ti] ? covered : cfg->tokens[ti], rng,
                                  cfg->samples);
    }
    kvs_free(s);
    return ok;
}

static int bench_dep(const cfg_t *cfg, const model_t *m, uint32_t ti_tp, uint32_t P,
                     uint32_t max_tokens, const xfer_t *x, run_t *run, kvs_rng_t *rng)
{
    const uint32_t ptp = cfg->ptp[ti_tp], dtp = cfg->dtp[ti_tp];
    dep_t d;
    if (!dep_create(cfg, m, ptp, dtp, P, max_tokens, rng, &d)) {
        fprintf(stderr, "error: setting up %s TP%u -> TP%u, page %u failed\n", m->name, ptp, dtp,
                P);
        return 0;
    }
    row_t *rows = &run->rows[run->nrows];
    const uint64_t bpt = (uint64_t) m->layers * 2 * m->kv_heads * m->head_dim * 2;
    for (int ti = 0; ti < cfg->ntokens; ti++) {
        row_t *row = &rows[ti];
        memset(row, 0, sizeof(*row));
        row->model = m->name;
        row->ptp = ptp;
        row->dtp = dtp;
        row->page = P;
        row->tokens = cfg->tokens[ti];
        row->bytes = (uint64_t) cfg->tokens[ti] * bpt;
    }
    int ok = 1;
    for (int ti = 0; ti < cfg->ntokens && ok; ti++) {
        double sec = 0;
        ok = bulk_time(cfg, x, run->bulk_dst, run->bulk_src, rows[ti].bytes, &sec);
        if (ok) rows[ti].gbs[M_BULK] = (double) rows[ti].bytes / 1e9 / sec;
    }
    if (ok) ok = measure_protocol(&d, KVS_WRITE_STAGED, M_STAGED, rows, rng);
    if (ok && cfg->cuda) ok = measure_protocol(&d, KVS_WRITE_DIRECT, M_DIRECT, rows, rng);
    if (ok) ok = measure_per_page(&d, x, rows, rng);
    dep_destroy(&d);
    if (ok) run->nrows += (uint32_t) cfg->ntokens;
    return ok;
}

/* ---- output ---- */

static double best_of(const row_t *r)
{
    return r->gbs[M_STAGED] > r->gbs[M_DIRECT] ? r->gbs[M_STAGED] : r->gbs[M_DIRECT];
}

static void print_row(const row_t *r)
{
    char tp[16], direct[32], sum_st[16], sum_dir[16];
    snprintf(tp, sizeof(tp), "%u->%u", r->ptp, r->dtp);
    const double bulk = r->gbs[M_BULK];
    if (r->gbs[M_DIRECT] > 0)
        snprintf(direct, sizeof(direct), "%8.1f %5.1f%%", r->gbs[M_DIRECT],
                 100.0 * r->gbs[M_DIRECT] / bulk);
    else
        snprintf(direct, sizeof(direct), "%14s", "n/a");
    kvs_bt_csum_cell(sum_st, sizeof(sum_st), 7, r->gbs[M_STAGED], r->gbs_off[M_STAGED], "-");
    kvs_bt_csum_cell(sum_dir, sizeof(sum_dir), 7, r->gbs[M_DIRECT], r->gbs_off[M_DIRECT],
                     r->gbs[M_DIRECT] > 0 ? "-" : "n/a");
    printf("%-10s %-5s %4u %6u %9.1f %8.1f %8.1f %5.1f%% %s %8.2f %5.2f%% %7.0fx %-6s %s %s\n",
           r->model, tp, r->page, r->tokens, (double) r->bytes / (1 << 20), bulk, r->gbs[M_STAGED],
           100.0 * r->gbs[M_STAGED] / bulk, direct, r->gbs[M_PAGE], 100.0 * r->gbs[M_PAGE] / bulk,
           r->gbs[M_PAGE] > 0 ? best_of(r) / r->gbs[M_PAGE] : 0.0, r->bad ? "FAILED" : "ok", sum_st,
           sum_dir);
    fflush(stdout);
}

/* The rows against the targets. */
typedef struct {
    int rows_bulk, met_bulk, rows_pp, met_pp, rows_sum, met_sum, failed_checks;
    double worst_bulk, worst_pp, worst_sum;
} summary_t;

static const char *const csum_names[] = {"both", "on", "off"};

/* The checksum's cost in row r's staged and direct runs, where measured (JSON keys
 * <method>_gbs_no_checksum and <method>_checksum_cost_pct). */
static void json_csum(kvs_json_t *j, const row_t *r)
{
    for (int m = M_STAGED; m <= M_DIRECT; m++) {
        char key[48];
        double pct = 0;
        if (!kvs_bt_csum_cost(r->gbs[m], r->gbs_off[m], &pct)) continue;
        snprintf(key, sizeof(key), "%s_gbs_no_checksum", method_names[m]);
        kvs_json_double(j, key, r->gbs_off[m]);
        snprintf(key, sizeof(key), "%s_checksum_cost_pct", method_names[m]);
        kvs_json_double(j, key, pct);
    }
}

static void print_json(const cfg_t *cfg, const run_t *run, const char *hw, const summary_t *s)
{
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_str(&j, "device", cfg->cuda ? "cuda" : "cpu");
    kvs_json_str(&j, "hardware", hw);
    kvs_json_i64(&j, "prefill_gpu", cfg->gpu_p);
    kvs_json_i64(&j, "decode_gpu", cfg->gpu_d);
    kvs_json_str(&j, "layout", cfg->layout ? "nhd" : "hnd");
    kvs_json_u64(&j, "chunk_tokens", cfg->chunk);
    kvs_json_u64(&j, "reps", cfg->reps);
    kvs_json_str(&j, "checksum", csum_names[cfg->checksum]);
    kvs_json_array_begin(&j, "rows");
    for (uint32_t i = 0; i < run->nrows; i++) {
        const row_t *r = &run->rows[i];
        kvs_json_object_begin(&j, NULL);
        kvs_json_str(&j, "model", r->model);
        kvs_json_u64(&j, "prefill_tp", r->ptp);
        kvs_json_u64(&j, "decode_tp", r->dtp);
        kvs_json_u64(&j, "page_size", r->page);
        kvs_json_u64(&j, "tokens", r->tokens);
        kvs_json_u64(&j, "bytes", r->bytes);
        for (int m = 0; m < M_COUNT; m++) {
            char key[32];
            snprintf(key, sizeof(key), "%s_gbs", method_names[m]);
            kvs_json_double(&j, key, r->gbs[m]);
        }
        kvs_json_u64(&j, "per_page_copies", r->pp_copies);
        kvs_json_u64(&j, "per_page_copies_timed", r->pp_timed);
        json_csum(&j, r);
        kvs_json_bool(&j, "check_ok", r->bad == 0);
        kvs_json_object_end(&j);
    }
    kvs_json_array_end(&j);
    kvs_json_object_begin(&j, "targets");
    kvs_json_u64(&j, "bulk_rows", (uint64_t) s->rows_bulk);
    kvs_json_u64(&j, "bulk_rows_met", (uint64_t) s->met_bulk);
    kvs_json_u64(&j, "per_page_rows", (uint64_t) s->rows_pp);
    kvs_json_u64(&j, "per_page_rows_met", (uint64_t) s->met_pp);
    kvs_json_double(&j, "checksum_cost_max_pct", cfg->cuda ? TARGET_SUM_GPU : TARGET_SUM_HOST);
    kvs_json_u64(&j, "checksum_min_tokens", cfg->cuda ? TARGET_MIN_TOKENS : 0);
    kvs_json_u64(&j, "checksum_rows", (uint64_t) s->rows_sum);
    kvs_json_u64(&j, "checksum_rows_met", (uint64_t) s->met_sum);
    kvs_json_object_end(&j);
    kvs_json_end(&j);
}

/* ---- the command ---- */

/* Describes the hardware and makes the GPUs ready (peer access); 0 when it cannot run. */
static int prepare_devices(cfg_t *cfg, int seen_gpus, char *hw, size_t cap)
{
    if (!cfg->cuda) {
        char model[128];
        long cores = 0;
        kvs_bench_cpu_info(model, sizeof(model), &cores);
        snprintf(hw, cap, "%s, %ld cores, host memory", model, cores);
        return 1;
    }
#if KVS_HAVE_CUDA
    int count = kvs_mem_device_count();
    if (count == 0) {
        fprintf(stderr, "kvstage bench transfer: no CUDA device here; --device cuda needs a GPU\n");
        return 0;
    }
    if (!seen_gpus) {
        cfg->gpu_p = 0;
        cfg->gpu_d = count > 1 ? 1 : 0;
    }
    if (cfg->gpu_p >= count || cfg->gpu_d >= count) {
        fprintf(stderr, "error: --gpus %d,%d but this machine has %d CUDA device(s)\n", cfg->gpu_p,
                cfg->gpu_d, count);
        return 0;
    }
    struct cudaDeviceProp pp, pd;
    int rt = 0, drv = 0;
    if (!cu_ok(cudaGetDeviceProperties(&pp, cfg->gpu_p), "cudaGetDeviceProperties") ||
        !cu_ok(cudaGetDeviceProperties(&pd, cfg->gpu_d), "cudaGetDeviceProperties"))
        return 0;
    (void) cudaRuntimeGetVersion(&rt);
    (void) cudaDriverGetVersion(&drv);
    int peer = cfg->gpu_p == cfg->gpu_d;
    if (!peer)
        peer = kvs_mem_peer_enable(cfg->gpu_p, cfg->gpu_d) == KVS_OK &&
               kvs_mem_peer_enable(cfg->gpu_d, cfg->gpu_p) == KVS_OK;
    snprintf(
        hw, cap,
        "%d CUDA device(s); prefill on GPU %d (%.64s), decode on GPU %d (%.64s)%s; CUDA runtime "
        "%d.%d, driver %d.%d",
        count, cfg->gpu_p, pp.name, cfg->gpu_d, pd.name,
        cfg->gpu_p == cfg->gpu_d ? " - ONE GPU: no interconnect is crossed"
        : peer                   ? ", peer access on"
                                 : ", NO peer access",
        rt / 1000, rt % 1000 / 10, drv / 1000, drv % 1000 / 10);
    return 1;
#else
    (void) seen_gpus;
    (void) hw;
    (void) cap;
    fprintf(stderr, "kvstage bench transfer: this kvstage was built without CUDA; --device cuda "
                    "needs a CUDA build (configure where nvcc is available) and a GPU\n");
    return 0;
#endif
}

static int xfer_init(const cfg_t *cfg, xfer_t *x)
{
    memset(x, 0, sizeof(*x));
    x->cuda = cfg->cuda;
#if KVS_HAVE_CUDA
    if (cfg->cuda)
        return cu_ok(cudaSetDevice(cfg->gpu_p), "cudaSetDevice") &&
               cu_ok(cudaStreamCreateWithFlags(&x->stream, cudaStreamNonBlocking),
                     "cudaStreamCreate") &&
               cu_ok(cudaEventCreate(&x->ev[0]), "cudaEventCreate") &&
               cu_ok(cudaEventCreate(&x->ev[1]), "cudaEventCreate");
#endif
    return 1;
}

static void xfer_fini(xfer_t *x)
{
#if KVS_HAVE_CUDA
    if (x->cuda) {
        if (x->ev[0]) (void) cudaEventDestroy(x->ev[0]);
        if (x->ev[1]) (void) cudaEventDestroy(x->ev[1]);
        if (x->stream) (void) cudaStreamDestroy(x->stream);
    }
#endif
    (void) x;
}

/* The flags as given; build_cfg checks them and turns them into cfg_t. */
typedef struct {
    cfg_t cfg;
    const char *tokens, *pages, *tps, *gpus;
    int device, transport, data; /* transport: 0 inproc, 1 ucx; data: 0 shm, 1 tcp */
    uint32_t head_dim;
    int seen_gpus, seen_device, seen_data, seen_hd, seen_reps, seen_pages, seen_tp;
} opts_t;

static void opts_default(opts_t *o)
{
    memset(o, 0, sizeof(*o));
    cfg_t *cfg = &o->cfg;
    cfg->cuda = 1;
    cfg->chunk = 512;
    cfg->reps = 5;
    cfg->warmup = 1;
    cfg->samples = 256;
    cfg->window = 4;
    cfg->buffers = 3;
    cfg->ring_slots = 8;
    cfg->per_page_max = 20000;
    o->tokens = "128,1024,4096,16384,32768";
    o->pages = "1,16,64";
    o->tps = "1:1,2:1,1:2";
    o->gpus = "0,1";
    o->device = 1;
    o->head_dim = 32;
}

static void add_transport_flags(kvs_arg_table_t *t, opts_t *o)
{
    const kvs_arg_t g[] = {
        {"transport", KVS_ARG_CHOICE, &o->transport,
         "inproc: every rank in this process; ucx: prefill and decode in two processes over the "
         "net link (ZeroMQ + UCX, host memory; implies --device cpu)",
         "inproc|ucx", NULL},
        {"device", KVS_ARG_CHOICE, &o->device,
         "cuda: pools on GPUs (the measurement); cpu: host memory (checks the benchmark itself)",
         "cpu|cuda", &o->seen_device},
        {"data", KVS_ARG_CHOICE, &o->data, "ucx: UCX data over shared memory or tcp on loopback",
         "shm|tcp", &o->seen_data},
        {"head-dim", KVS_ARG_U32, &o->head_dim,
         "ucx: head dim of the 8B shape scaled to this machine (32 layers, 8 KV heads) (32)",
         "[1,65536]", &o->seen_hd},
        {"gpus", KVS_ARG_STR, &o->gpus,
         "prefill GPU,decode GPU (default 0,1; 0,0 when only one GPU is present)",
         "two GPU ordinals, e.g. 0,1", &o->seen_gpus},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_shape_flags(kvs_arg_table_t *t, opts_t *o)
{
    const kvs_arg_t g[] = {
        {"model", KVS_ARG_CHOICE, &o->cfg.model, "KV shapes (bf16, 8 KV heads, head dim 128)",
         "all|llama3-8b|llama3-70b", NULL},
        {"tokens", KVS_ARG_STR, &o->tokens, "prompt lengths (default 128,1024,4096,16384,32768)",
         "comma-separated counts in [1,16777216]", NULL},
        {"page-sizes", KVS_ARG_STR, &o->pages, "page sizes (default 1,16,64; ucx: one size, 16)",
         "comma-separated sizes in [1,16777216]", &o->seen_pages},
        {"tp", KVS_ARG_STR, &o->tps,
         "prefill:decode TP pairs (default 1:1,2:1,1:2; ucx: one pair, 1:1)",
         "prefill:decode pairs, e.g. 2:1", &o->seen_tp},
        {"layout", KVS_ARG_CHOICE, &o->cfg.layout,
         "pool layout of both sides (hnd: a page's head slice is one run, per-page copies are 1D)",
         "hnd|nhd", NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_protocol_flags(kvs_arg_table_t *t, opts_t *o)
{
    cfg_t *cfg = &o->cfg;
    const kvs_arg_t g[] = {
        {"chunk", KVS_ARG_U32, &cfg->chunk, "chunked-prefill tokens C, the slot size (512)",
         "[1,16777216]", NULL},
        {"window", KVS_ARG_U32, &cfg->window, "chunks per room with a slot request out (4)",
         "[1,1024]", NULL},
        {"staging-buffers", KVS_ARG_U32, &cfg->buffers, "staging buffers per prefill rank (3)",
         "[1,1024]", NULL},
        {"ring-slots", KVS_ARG_U32, &cfg->ring_slots, "decode ring size in full slots (8)",
         "[1,1024]", NULL},
        {"checksum", KVS_ARG_CHOICE, &cfg->checksum, KVS_BT_CSUM_HELP, KVS_BT_CSUM_CHOICES, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_run_flags(kvs_arg_table_t *t, opts_t *o)
{
    cfg_t *cfg = &o->cfg;
    const kvs_arg_t g[] = {
        {"reps", KVS_ARG_U32, &cfg->reps,
         "timed runs per cell, median reported (cuda: 15, where the checksum's cost needs them "
         "to be read within a point; cpu: 5; ucx: 3)",
         "[1,1000]", &o->seen_reps},
        {"warmup", KVS_ARG_U32, &cfg->warmup, "untimed runs first (1)", "[0,1000]", NULL},
        {"samples", KVS_ARG_U32, &cfg->samples, "heads checked per method and row (256)",
         "[1,1000000]", NULL},
        {"per-page-max", KVS_ARG_U64, &cfg->per_page_max,
         "per-page copies timed per row (whole pages; the rate is taken over them) (20000)",
         "[1,18446744073709551615]", NULL},
        {"json", KVS_ARG_FLAG, &cfg->json, "print one JSON object instead of the table", NULL,
         NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* "a,b": two GPU ordinals, 0 allowed (kvs_bt_parse_list takes positive numbers only). Returns
 * how many were read, or -1 for a malformed list. */
static int parse_gpus(const char *s, uint32_t g[2])
{
    int ng = 0;
    for (const char *p = s; *p != '\0';) {
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (end == p || v > 1024 || ng == 2 || (*end != ',' && *end != '\0')) return -1;
        g[ng++] = (uint32_t) v;
        p = *end == ',' ? end + 1 : end;
    }
    return ng;
}

/* What is wrong with the parsed lists and flags, or NULL. */
static const char *check_opts(const opts_t *o, int ngpus)
{
    const cfg_t *cfg = &o->cfg;
    const int ucx = o->transport == 1;
    if (cfg->ntokens <= 0) return "--tokens takes up to 16 comma-separated counts in 1..16777216";
    if (cfg->npages <= 0) return "--page-sizes takes up to 16 comma-separated sizes in 1..16777216";
    if (cfg->ntp <= 0) return "--tp takes up to 16 comma-separated pairs like 2:1";
    if (ngpus != 2) return "--gpus takes two GPU ordinals, e.g. 0,1";
    if (cfg->reps == 0 || cfg->reps > 1000 || cfg->warmup > 1000 - cfg->reps)
        return "--reps must be in 1..1000 and --warmup + --reps at most 1000";
    if (cfg->chunk == 0 || cfg->window == 0 || cfg->buffers == 0 || cfg->ring_slots == 0)
        return "--chunk, --window, --staging-buffers and --ring-slots must be > 0";
    if (o->seen_gpus && !cfg->cuda) return "--gpus needs --device cuda";
    if (ucx && cfg->cuda) return "--transport ucx moves host memory: it needs --device cpu";
    if (ucx && (cfg->npages != 1 || cfg->ntp != 1))
        return "--transport ucx takes one page size and one TP pair";
    if (ucx && cfg->layout != 0 && (cfg->ptp[0] != 1 || cfg->dtp[0] != 1))
        return "--transport ucx runs NHD pools with --tp 1:1 only (a page's slice is one run)";
    if (ucx && (o->head_dim == 0 || o->head_dim % 4 != 0 || o->head_dim > 256))
        return "--head-dim must be a multiple of 4 in 4..256";
    if (!ucx && (o->seen_data || o->seen_hd)) return "--data and --head-dim need --transport ucx";
    for (int i = 0; i < cfg->ntp; i++)
        if (cfg->ptp[i] > 8 || cfg->dtp[i] > 8 || 8 % cfg->ptp[i] != 0 || 8 % cfg->dtp[i] != 0)
            return "--tp sizes must divide the 8 KV heads (1, 2, 4 or 8)";
    return NULL;
}

/* Fills o->cfg from the flags (ucx has defaults of its own); 0, or EXIT_USAGE after the error
 * and the usage. */
static int build_cfg(opts_t *o, const kvs_arg_table_t *t)
{
    cfg_t *cfg = &o->cfg;
    if (o->transport == 1) {
        if (!o->seen_reps) cfg->reps = 3;
        if (!o->seen_pages) o->pages = "16";
        if (!o->seen_tp) o->tps = "1:1";
        if (!o->seen_device) o->device = 0;
    }
    cfg->cuda = o->device == 1;
    if (cfg->cuda && o->transport != 1 && !o->seen_reps)
        cfg->reps = 15; /* a median of 5: +-1.5 points */
    cfg->ntokens = kvs_bt_parse_list(o->tokens, cfg->tokens);
    cfg->npages = kvs_bt_parse_list(o->pages, cfg->pages);
    cfg->ntp = kvs_bt_parse_tp(o->tps, cfg->ptp, cfg->dtp);
    uint32_t g[2] = {0, 0};
    const char *bad = check_opts(o, parse_gpus(o->gpus, g));
    if (bad) {
        (void) t;
        kvs_args_error(NULL, NULL, "%s", bad);
        return EXIT_USAGE;
    }
    cfg->gpu_p = (int) g[0];
    cfg->gpu_d = (int) g[1];
    return 0;
}

/* --transport ucx: bench_transfer_ucx.c runs it; the exit code. */
static int run_ucx(const opts_t *o)
{
    const cfg_t *cfg = &o->cfg;
    kvs_bench_ucx_cfg_t u;
    memset(&u, 0, sizeof(u));
    memcpy(u.tokens, cfg->tokens, sizeof(u.tokens));
    u.ntokens = cfg->ntokens;
    u.prefill_tp = cfg->ptp[0];
    u.decode_tp = cfg->dtp[0];
    u.page_size = cfg->pages[0];
    u.chunk = cfg->chunk;
    u.window = cfg->window;
    u.buffers = cfg->buffers;
    u.ring_slots = cfg->ring_slots;
    u.head_dim = o->head_dim;
    u.reps = cfg->reps;
    u.warmup = cfg->warmup;
    u.per_page_max = cfg->per_page_max;
    u.tcp = o->data == 1;
    u.nhd = cfg->layout == 1;
    u.json = cfg->json;
    u.checksum = cfg->checksum;
    return kvs_bench_transfer_ucx(&u) ? EXIT_RUN_FAILED : 0;
}

/* What each method does and the targets, then the table's header. */
static void print_header(const cfg_t *cfg, const char *hw)
{
    printf("kvstage bench transfer: one request's KV cache, prefill pools -> decode pools\n");
    printf("hardware: %s\n", hw);
    printf("shapes: bf16, 8 KV heads, head dim 128, %s pools on both sides, pages in random "
           "order; chunk %u tokens, window %u, %u staging buffers, ring %u slots\n",
           cfg->layout ? "NHD" : "HND", cfg->chunk, cfg->window, cfg->buffers, cfg->ring_slots);
    printf("staged: the protocol over the in-process link: gather kernel -> staging buffer "
           "-> one %s per chunk and writer -> ring -> scatter kernel\n",
           cfg->cuda ? "CUDA peer copy" : "memcpy");
    printf("direct: the same, but the gather kernel stores into the granted decode slot "
           "(no staging buffer, no copy)\n");
    printf("  both timed from add_room to Success on every rank (wall clock, control "
           "included), median of %u after %u warm-up\n",
           cfg->reps, cfg->warmup);
    printf("per-page: one %s per page x layer x K/V x head slice, pool to pool, one stream; "
           "timed over up to %llu copies (whole pages)\n",
           cfg->cuda ? "cudaMemcpyAsync" : "memcpy", (unsigned long long) cfg->per_page_max);
    printf("bulk: one %s of the same bytes between flat buffers (the limit); GB/s = payload "
           "bytes / time, 1 GB = 1e9 B\n",
           cfg->cuda ? (cfg->gpu_p == cfg->gpu_d ? "device-to-device copy" : "peer copy")
                     : "memcpy");
    printf("checksums %s: staged and direct %s\n", csum_names[cfg->checksum],
           cfg->checksum == KVS_BT_CSUM_BOTH
               ? "with chunk checksums on (the default); sum-st, sum-dir: their cost, (time on - "
                 "time off) / time off, each run alternating with one of checksums off"
           : cfg->checksum == KVS_BT_CSUM_ON ? "with chunk checksums on (the default)"
                                             : "with chunk checksums OFF");
    printf("targets: staged or direct >= %.0f%% of bulk from %u tokens; >= %.0fx per-page at "
           "page %u\n",
           TARGET_BULK_PCT, TARGET_MIN_TOKENS, TARGET_PP_X, TARGET_PP_PAGE);
    if (cfg->cuda) {
        printf("  checksum cost <= %.0f%% of the transfer time from %u tokens\n", TARGET_SUM_GPU,
               TARGET_MIN_TOKENS);
        if (cfg->gpu_p == cfg->gpu_d)
            printf(
                "  (one GPU: both sides' kernels share its multiprocessors, so the costs include "
                "how they interleave; `kvstage bench kernels` times one side's kernels alone, "
                "as each GPU of a pair runs them)\n");
        printf("\n");
    } else {
        printf("  (the GPU's targets: in host memory in one process, staged is three memcpys of "
               "the bytes (gather, write, scatter) against per-page's and bulk's one, so it lands "
               "near a third of bulk; this run checks the benchmark and the checksum's host cost, "
               "`--transport ucx` measures the host path between processes)\n");
        printf("  checksum cost <= %.0f%% of the transfer time (host memory)\n\n", TARGET_SUM_HOST);
    }
    printf("%-10s %-5s %4s %6s %9s %8s %8s %6s %8s %6s %8s %6s %8s %-6s %7s %7s\n", "model", "tp",
           "page", "tokens", "MiB", "bulk", "staged", "%bulk", "direct", "%bulk", "per-page",
           "%bulk", "best/pp", "check", "sum-st", "sum-dir");
    fflush(stdout);
}

/* Every TP pair and page size of model m, rows printed as they come; 0 when a run failed. */
static int bench_model(const cfg_t *cfg, const model_t *m, uint32_t max_tokens, const xfer_t *x,
                       run_t *run, kvs_rng_t *rng)
{
    const uint64_t need = (uint64_t) max_tokens * m->layers * 2 * m->kv_heads * m->head_dim * 2;
    void *src = NULL, *dst = NULL;
    kvs_mem_kind_t kind = cfg->cuda ? KVS_MEM_DEVICE : KVS_MEM_HOST;
    int ok = kvs_mem_alloc(kind, cfg->gpu_p, need, &src) == KVS_OK &&
             kvs_mem_alloc(kind, cfg->gpu_d, need, &dst) == KVS_OK &&
             fill_random(cfg->cuda, src, need, rng);
    run->bulk_src = src;
    run->bulk_dst = dst;
    for (int ti = 0; ti < cfg->ntp && ok; ti++) {
        for (int pi = 0; pi < cfg->npages && ok; pi++) {
            uint32_t first = run->nrows;
            ok = bench_dep(cfg, m, (uint32_t) ti, cfg->pages[pi], max_tokens, x, run, rng);
            for (uint32_t i = first; ok && !cfg->json && i < run->nrows; i++)
                print_row(&run->rows[i]);
        }
    }
    kvs_mem_free(kind, cfg->gpu_p, src);
    kvs_mem_free(kind, cfg->gpu_d, dst);
    return ok;
}

/* Row r against the checksum target: its worst cost over staged and direct into *s. */
static void summarize_csum(const cfg_t *cfg, const row_t *r, summary_t *s)
{
    if (cfg->cuda && r->tokens < TARGET_MIN_TOKENS) return;
    double worst = -1e9, pct = 0;
    for (int m = M_STAGED; m <= M_DIRECT; m++)
        if (kvs_bt_csum_cost(r->gbs[m], r->gbs_off[m], &pct) && pct > worst) worst = pct;
    if (worst == -1e9) return;
    s->rows_sum++;
    s->met_sum += worst <= (cfg->cuda ? TARGET_SUM_GPU : TARGET_SUM_HOST);
    if (worst > s->worst_sum) s->worst_sum = worst;
}

static void summarize(const cfg_t *cfg, const run_t *run, summary_t *s)
{
    *s = (summary_t){.worst_bulk = 1e9, .worst_pp = 1e9, .worst_sum = -1e9};
    for (uint32_t i = 0; i < run->nrows; i++) {
        const row_t *r = &run->rows[i];
        s->failed_checks += r->bad != 0;
        if (r->tokens >= TARGET_MIN_TOKENS) {
            double pct = 100.0 * best_of(r) / r->gbs[M_BULK];
            s->rows_bulk++;
            s->met_bulk += pct >= TARGET_BULK_PCT;
            if (pct < s->worst_bulk) s->worst_bulk = pct;
        }
        if (r->page == TARGET_PP_PAGE && r->gbs[M_PAGE] > 0) {
            double xr = best_of(r) / r->gbs[M_PAGE];
            s->rows_pp++;
            s->met_pp += xr >= TARGET_PP_X;
            if (xr < s->worst_pp) s->worst_pp = xr;
        }
        summarize_csum(cfg, r, s);
    }
}

static void print_summary(const cfg_t *cfg, int ok, const summary_t *s)
{
    printf("\n");
    if (!ok) printf("summary: FAILED to run (see the error above)\n");
    if (s->rows_bulk)
        printf("summary: %d/%d rows from %u tokens reach %.0f%% of bulk with staged or direct "
               "(worst %.1f%%)\n",
               s->met_bulk, s->rows_bulk, TARGET_MIN_TOKENS, TARGET_BULK_PCT, s->worst_bulk);
    if (s->rows_pp)
        printf("summary: %d/%d rows at page %u are >= %.0fx per-page (worst %.1fx)\n", s->met_pp,
               s->rows_pp, TARGET_PP_PAGE, TARGET_PP_X, s->worst_pp);
    if (s->rows_sum && cfg->cuda)
        printf("summary: %d/%d rows from %u tokens keep the checksum's cost <= %.0f%% of the "
               "transfer time with staged and direct (worst %.1f%%)\n",
               s->met_sum, s->rows_sum, TARGET_MIN_TOKENS, TARGET_SUM_GPU, s->worst_sum);
    else if (s->rows_sum)
        printf("summary: %d/%d rows keep the checksum's cost <= %.0f%% of the transfer time "
               "with staged (worst %.1f%%)\n",
               s->met_sum, s->rows_sum, TARGET_SUM_HOST, s->worst_sum);
    printf("check: %s (%u sampled heads per method and row)\n",
           s->failed_checks ? "FAILED" : "all sampled heads byte-exact", cfg->samples);
}

/* Every rank in this process, on GPUs or host memory; the exit code. */
static int run_inproc(cfg_t *cfg, int seen_gpus)
{
    char hw[512];
    if (!prepare_devices(cfg, seen_gpus, hw, sizeof(hw))) return EXIT_RUN_FAILED;
    uint32_t max_tokens = 0;
    for (int i = 0; i < cfg->ntokens; i++)
        if (cfg->tokens[i] > max_tokens) max_tokens = cfg->tokens[i];
    if (!cfg->json) print_header(cfg, hw);

    xfer_t x;
    run_t run;
    memset(&run, 0, sizeof(run));
    int ok = xfer_init(cfg, &x);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 0x7472616e73666572ull);
    run.cap = (uint32_t) (2 * cfg->ntp * cfg->npages * cfg->ntokens);
    run.rows = kvs_calloc(run.cap, sizeof(row_t));
    if (run.rows == NULL) ok = 0;
    for (size_t mi = 0; mi < sizeof(models) / sizeof(models[0]) && ok; mi++) {
        if (cfg->model != 0 && (size_t) cfg->model != mi + 1) continue;
        ok = bench_model(cfg, &models[mi], max_tokens, &x, &run, &rng);
    }
    xfer_fini(&x);

    summary_t s;
    summarize(cfg, &run, &s);
    if (cfg->json)
        print_json(cfg, &run, hw, &s);
    else
        print_summary(cfg, ok, &s);
    kvs_free(run.rows);
    return !ok || s.failed_checks ? EXIT_RUN_FAILED : 0;
}

int kvs_bench_transfer(int argc, char **argv)
{
    opts_t o;
    opts_default(&o);
    kvs_arg_table_t t = {.count = 0};
    add_transport_flags(&t, &o);
    add_shape_flags(&t, &o);
    add_protocol_flags(&t, &o);
    add_run_flags(&t, &o);
    int prc = kvs_arg_table_parse(&t, USAGE, argc, argv, 1);
    if (prc == KVS_ARGS_HELP) return 0;
    if (prc != KVS_ARGS_OK) return EXIT_USAGE;
    if (build_cfg(&o, &t) != 0) return EXIT_USAGE;
    if (o.transport == 1) return run_ucx(&o);
    return run_inproc(&o.cfg, o.seen_gpus);
}
