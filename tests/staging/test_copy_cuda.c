/* Tests for the CUDA copy backend and device-memory pools. On a GPU: byte-exact agreement with
 * the CPU reference (whole pools and whole poisoned region buffers, guards included) over a
 * table of shapes that forces every vector width and run kind, and over seeded random shapes,
 * strides (NHD/HND), page sizes, head ranges, dims, element sizes and misaligned regions;
 * both launch paths (table and page ids in the kernel parameters, or uploaded first, with
 * buffer growth); batches of copies launched together, each with its own checksum; in-order
 * completion with more copies in flight than the backend has slots, both paths interleaved, while
 * the caller rewrites its page array; refused descriptors; device pools. Without a GPU those report
 * skipped; the launch plan and the kernels' division arithmetic are host code and are checked
 * in every CUDA build. */
#include "copy_fixture.h"

#if KVS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "staging/checksum.h"
#include "staging/cuda/copy_cuda.h"

/* Fails the test on a CUDA error in the test's own calls. */
#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            fail_msg("%s: %s (%s)", #call, cudaGetErrorName(e_), cudaGetErrorString(e_));          \
    } while (0)

static void require_gpu(void)
{
    static int told;
    if (!kvs_copy_cuda_available()) {
        if (!told++) print_message("no CUDA device on this machine: GPU tests skipped\n");
        skip();
    }
}

/* ---- pools on both sides: a host pool for the CPU reference, a device twin for CUDA ---- */

typedef struct {
    kvs_pool_t *host, *dev;
    kvs_region_t *hreg, *dreg; /* [layers][components] descriptors of each */
    uint32_t nreg;
    uint64_t extent; /* bytes from the first region's base to the end of the last */
} twin_t;

static kvs_pool_config_t config_of(kvs_kv_shape_t shape, uint32_t tp_size, uint32_t page_size,
                                   uint32_t pages, kvs_pool_layout_t layout, kvs_mem_kind_t mem)
{
    kvs_pool_config_t c;
    memset(&c, 0, sizeof(c));
    c.shape = shape;
    c.tp.tp_size = tp_size;
    c.page_size = page_size;
    c.num_pages = pages;
    c.layout = layout;
    c.mem = mem;
    c.device = 0;
    return c;
}

static kvs_region_t *regions_of(const kvs_pool_t *pool, uint32_t *n_p)
{
    const kvs_pool_config_t *c = kvs_pool_config(pool);
    uint32_t comps = kvs_kv_shape_components(&c->shape), n = c->shape.layers * comps;
    kvs_region_t *r = malloc(sizeof(kvs_region_t) * n);
    assert_non_null(r);
    for (uint32_t i = 0; i < n; i++) r[i] = *kvs_pool_region(pool, i / comps, i % comps);
    *n_p = n;
    return r;
}

static void twin_make(twin_t *t, kvs_kv_shape_t shape, uint32_t tp_size, uint32_t page_size,
                      uint32_t pages, kvs_pool_layout_t layout)
{
    memset(t, 0, sizeof(*t));
    kvs_pool_config_t c = config_of(shape, tp_size, page_size, pages, layout, KVS_MEM_HOST);
    assert_int_equal(kvs_pool_create(&c, &t->host), KVS_OK);
    c.mem = KVS_MEM_DEVICE;
    assert_int_equal(kvs_pool_create(&c, &t->dev), KVS_OK);
    uint32_t n2 = 0;
    t->hreg = regions_of(t->host, &t->nreg);
    t->dreg = regions_of(t->dev, &n2);
    assert_int_equal(n2, t->nreg);
    const kvs_region_t *last = &t->hreg[t->nreg - 1];
    t->extent = (uint64_t) (last->base - t->hreg[0].base) + (uint64_t) pages * last->page_stride;
    for (uint32_t i = 0; i < t->nreg; i++) /* same carving on both sides */
        assert_int_equal(t->hreg[i].base - t->hreg[0].base, t->dreg[i].base - t->dreg[0].base);
}

static void twin_free(twin_t *t)
{
    kvs_pool_destroy(t->host);
    kvs_pool_destroy(t->dev);
    free(t->hreg);
    free(t->dreg);
    memset(t, 0, sizeof(*t));
}

static void random_bytes(kvs_rng_t *rng, uint8_t *p, uint64_t n)
{
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = kvs_rng_next(rng);
        memcpy(p + i, &v, 8);
    }
    for (; i < n; i++) p[i] = (uint8_t) kvs_rng_next(rng);
}

/* cudaMemcpy from pageable memory may return before the data lands, and the backend's
 * non-blocking stream does not wait for the legacy stream: finish uploads explicitly. */
static void upload(void *dst, const void *src, uint64_t n)
{
    CU(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
    CU(cudaDeviceSynchronize());
}

static void twin_fill(twin_t *t, kvs_rng_t *rng)
{
    random_bytes(rng, t->hreg[0].base, t->extent);
    upload(t->dreg[0].base, t->hreg[0].base, t->extent);
}

/* Offset of the first differing byte, or UINT64_MAX. */
static uint64_t first_diff(const uint8_t *a, const uint8_t *b, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (a[i] != b[i]) return i;
    return UINT64_MAX;
}

/* Downloads the device pool; UINT64_MAX when it equals the host pool byte for byte. */
static uint64_t twin_diff(const twin_t *t)
{
    uint8_t *got = malloc(t->extent);
    assert_non_null(got);
    CU(cudaMemcpy(got, t->dreg[0].base, t->extent, cudaMemcpyDeviceToHost));
    uint64_t d = first_diff(got, t->hreg[0].base, t->extent);
    free(got);
    return d;
}

/* ---- one region buffer on both sides, poisoned, with guards and a chosen misalignment ---- */

enum { GUARD = 256 };

typedef struct {
    uint8_t *hbuf, *dbuf; /* [GUARD + misalign + rbytes + GUARD] */
    uint64_t size, misalign, rbytes;
} rbuf_t;

static void rbuf_make(rbuf_t *b, uint64_t rbytes, uint64_t misalign, kvs_rng_t *rng)
{
    b->rbytes = rbytes;
    b->misalign = misalign;
    b->size = GUARD + misalign + rbytes + GUARD;
    b->hbuf = malloc(b->size);
    assert_non_null(b->hbuf);
    void *d = NULL;
    CU(cudaMalloc(&d, b->size));
    b->dbuf = d;
    random_bytes(rng, b->hbuf, b->size); /* poison: an unwritten byte keeps it, on both sides */
    upload(b->dbuf, b->hbuf, b->size);
}

static uint64_t rbuf_diff(const rbuf_t *b)
{
    uint8_t *got = malloc(b->size);
    assert_non_null(got);
    CU(cudaMemcpy(got, b->dbuf, b->size, cudaMemcpyDeviceToHost));
    uint64_t d = first_diff(got, b->hbuf, b->size);
    free(got);
    return d;
}

static void rbuf_free(rbuf_t *b)
{
    free(b->hbuf);
    CU(cudaFree(b->dbuf));
    memset(b, 0, sizeof(*b));
}

/* ---- one gather + scatter case, compared with the CPU reference ---- */

typedef struct {
    kvs_kv_shape_t shape;
    uint32_t page_size, npages;
    uint32_t tp_a, tp_b; /* pool heads = H / tp */
    kvs_pool_layout_t lay_a, lay_b;
    uint32_t heads, head_a, head_b; /* selected heads and where they start in each pool */
    uint32_t misalign;              /* region pointer offset from a 256-byte boundary */
} case_t;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr,                                                                        \
                    "cuda copy failed (KVS_SEED=0x%llx, case %llu: L=%u H=%u Dk=%u Dv=%u E=%u "    \
                    "%s P=%u pages=%u tp %u/%u %s/%s heads %u at %u/%u misalign %u): ",            \
                    (unsigned long long) seed, (unsigned long long) iter, c->shape.layers,         \
                    c->shape.kv_heads, c->shape.head_dim_k, c->shape.head_dim_v,                   \
                    c->shape.elem_bytes, c->shape.attn == KVS_ATTN_MLA ? "MLA" : "MHA",            \
                    c->page_size, c->npages, c->tp_a, c->tp_b,                                     \
                    c->lay_a == KVS_POOL_HND ? "HND" : "NHD",                                      \
                    c->lay_b == KVS_POOL_HND ? "HND" : "NHD", c->heads, c->head_a, c->head_b,      \
                    c->misalign);                                                                  \
            fail_msg(__VA_ARGS__);                                                                 \
        }                                                                                          \
    } while (0)

/* Gathers pool A -> region and scatters region -> pool B on both backends; every byte of both
 * pools and of the whole region buffer must agree. Returns the gather's plan. */
static kvs_cuda_plan_t run_case(const case_t *c, const kvs_copy_backend_t *cpu,
                                const kvs_copy_backend_t *gpu, kvs_rng_t *rng, uint64_t seed,
                                uint64_t iter)
{
    twin_t a, b;
    const uint32_t pages_a = c->npages + (uint32_t) kvs_rng_below(rng, 3);
    const uint32_t pages_b = c->npages + (uint32_t) kvs_rng_below(rng, 3);
    twin_make(&a, c->shape, c->tp_a, c->page_size, pages_a, c->lay_a);
    twin_make(&b, c->shape, c->tp_b, c->page_size, pages_b, c->lay_b);
    twin_fill(&a, rng);
    twin_fill(&b, rng);
    uint32_t *list_a = malloc(sizeof(uint32_t) * c->npages);
    uint32_t *list_b = malloc(sizeof(uint32_t) * c->npages);
    assert_true(list_a != NULL && list_b != NULL);
    pick_pages(rng, pages_a, c->npages, list_a);
    pick_pages(rng, pages_b, c->npages, list_b);

    const uint64_t T = (uint64_t) c->npages * c->page_size;
    const uint64_t rbytes = kvs_copy_region_bytes(&c->shape, c->heads, T);
    rbuf_t r;
    rbuf_make(&r, rbytes, c->misalign, rng);
    uint8_t *hregion = r.hbuf + GUARD + c->misalign, *dregion = r.dbuf + GUARD + c->misalign;

    kvs_copy_desc_t hd =
        copy_desc(a.host, a.hreg, list_a, c->npages, c->head_a, c->heads, hregion, rbytes);
    kvs_copy_desc_t dd =
        copy_desc(a.dev, a.dreg, list_a, c->npages, c->head_a, c->heads, dregion, rbytes);
    kvs_cuda_plan_t plan;
    assert_int_equal(kvs__copy_cuda_plan(&dd, &plan), KVS_OK);
    /* Every other case with the fused checksums: they must agree with the CPU's and with the
     * reference over the region's bytes. */
    uint64_t hsum = 0, dsum = 0;
    if (iter % 2 == 0) {
        hd.checksum = &hsum;
        dd.checksum = &dsum;
    }
    run_copy(cpu, KVS_COPY_GATHER, &hd);
    run_copy(gpu, KVS_COPY_GATHER, &dd);
    if (iter % 2 == 0) {
        CHECK(hsum == kvs_csum_of(hregion, rbytes), "CPU gather checksum");
        CHECK(dsum == hsum, "GPU gather checksum %llx, CPU %llx (%u-byte vectors)",
              (unsigned long long) dsum, (unsigned long long) hsum, plan.vec_bytes);
    }
    uint64_t diff = rbuf_diff(&r);
    CHECK(diff == UINT64_MAX,
          "gather (%u-byte vectors, run %d): region buffer byte %lld differs (region starts at "
          "%u, ends at %llu)",
          plan.vec_bytes, (int) plan.run, (long long) diff, GUARD + c->misalign,
          (unsigned long long) (GUARD + c->misalign + rbytes));
    diff = twin_diff(&a);
    CHECK(diff == UINT64_MAX, "gather wrote pool A at byte %llu", (unsigned long long) diff);

    hd = copy_desc(b.host, b.hreg, list_b, c->npages, c->head_b, c->heads, hregion, rbytes);
    dd = copy_desc(b.dev, b.dreg, list_b, c->npages, c->head_b, c->heads, dregion, rbytes);
    kvs_cuda_plan_t splan;
    assert_int_equal(kvs__copy_cuda_plan(&dd, &splan), KVS_OK);
    uint64_t hsum2 = 0, dsum2 = 0;
    if (iter % 2 == 0) {
        hd.checksum = &hsum2;
        dd.checksum = &dsum2;
    }
    run_copy(cpu, KVS_COPY_SCATTER, &hd);
    run_copy(gpu, KVS_COPY_SCATTER, &dd);
    if (iter % 2 == 0) {
        CHECK(hsum2 == hsum, "CPU scatter checksum differs from its gather's");
        CHECK(dsum2 == hsum, "GPU scatter checksum %llx, CPU %llx (%u-byte vectors)",
              (unsigned long long) dsum2, (unsigned long long) hsum, splan.vec_bytes);
    }
    diff = twin_diff(&b);
    CHECK(diff == UINT64_MAX, "scatter (%u-byte vectors, run %d): pool B byte %llu differs",
          splan.vec_bytes, (int) splan.run, (unsigned long long) diff);
    diff = rbuf_diff(&r);
    CHECK(diff == UINT64_MAX, "scatter wrote the region buffer at byte %llu",
          (unsigned long long) diff);

    rbuf_free(&r);
    free(list_a);
    free(list_b);
    twin_free(&a);
    twin_free(&b);
    return plan;
}

static kvs_kv_shape_t mha(uint32_t layers, uint32_t heads, uint32_t dk, uint32_t dv, uint32_t e)
{
    kvs_kv_shape_t s = {.layers = layers,
                        .kv_heads = heads,
                        .head_dim_k = dk,
                        .head_dim_v = dv,
                        .elem_bytes = e,
                        .attn = KVS_ATTN_MHA};
    return s;
}

#define MHA(l, h, dk, dv, e)                                                                       \
    {                                                                                              \
        (l), (h), (dk), (dv), (e), KVS_ATTN_MHA                                                    \
    }
#define MLA(l, w, e)                                                                               \
    {                                                                                              \
        (l), 1, (w), 0, (e), KVS_ATTN_MLA                                                          \
    }

/* Shapes chosen so that every vector width and run kind is planned at least once; the expected
 * plan is asserted so a change that quietly falls back to narrow copies is caught. */
typedef struct {
    case_t c;
    uint32_t vec;
    kvs_cuda_run_t run;
} plan_case_t;

static const plan_case_t plan_cases[] = {
    /* Llama-3-8B-like: NHD with all heads is one run per page, HND one run per head */
    {{MHA(2, 8, 128, 128, 2), 16, 5, 1, 1, KVS_POOL_NHD, KVS_POOL_NHD, 8, 0, 0, 0},
     16,
     KVS_CUDA_RUN_PAGE},
    {{MHA(2, 8, 128, 128, 2), 16, 5, 1, 1, KVS_POOL_HND, KVS_POOL_HND, 8, 0, 0, 0},
     16,
     KVS_CUDA_RUN_HEAD},
    /* half the heads of an NHD pool: one run per token */
    {{MHA(2, 8, 128, 128, 2), 16, 4, 1, 1, KVS_POOL_NHD, KVS_POOL_NHD, 4, 2, 4, 0},
     16,
     KVS_CUDA_RUN_TOKEN},
    /* page size 1: any head range of NHD or HND is one run per page */
    {{MHA(3, 8, 128, 64, 2), 1, 37, 1, 2, KVS_POOL_HND, KVS_POOL_NHD, 3, 1, 0, 0},
     16,
     KVS_CUDA_RUN_PAGE},
    /* misaligned region pointers narrow the vectors */
    {{MHA(2, 8, 128, 128, 2), 16, 3, 1, 1, KVS_POOL_NHD, KVS_POOL_NHD, 8, 0, 0, 8},
     8,
     KVS_CUDA_RUN_PAGE},
    {{MHA(2, 8, 128, 128, 2), 16, 3, 1, 1, KVS_POOL_NHD, KVS_POOL_HND, 8, 0, 0, 4},
     4,
     KVS_CUDA_RUN_PAGE},
    {{MHA(2, 4, 64, 64, 2), 8, 3, 1, 1, KVS_POOL_NHD, KVS_POOL_NHD, 4, 0, 0, 2},
     2,
     KVS_CUDA_RUN_PAGE},
    {{MHA(2, 4, 64, 64, 2), 8, 3, 1, 1, KVS_POOL_NHD, KVS_POOL_NHD, 4, 0, 0, 1},
     1,
     KVS_CUDA_RUN_PAGE},
    /* small heads in HND: the head size bounds the vector */
    {{MHA(2, 4, 4, 4, 2), 16, 3, 1, 1, KVS_POOL_HND, KVS_POOL_HND, 4, 0, 0, 0},
     8,
     KVS_CUDA_RUN_HEAD},
    {{MHA(2, 4, 1, 1, 4), 16, 3, 1, 1, KVS_POOL_HND, KVS_POOL_HND, 2, 1, 2, 0},
     4,
     KVS_CUDA_RUN_HEAD},
    {{MHA(2, 4, 1, 1, 2), 8, 3, 1, 1, KVS_POOL_HND, KVS_POOL_HND, 2, 0, 1, 0},
     2,
     KVS_CUDA_RUN_HEAD},
    {{MHA(1, 3, 3, 5, 1), 7, 4, 1, 1, KVS_POOL_HND, KVS_POOL_HND, 2, 1, 0, 0},
     1,
     KVS_CUDA_RUN_HEAD},
    /* odd head dims still vectorise when whole NHD pages are contiguous */
    {{MHA(2, 2, 5, 5, 1), 16, 4, 1, 1, KVS_POOL_NHD, KVS_POOL_NHD, 2, 0, 0, 0},
     16,
     KVS_CUDA_RUN_PAGE},
    /* ... but not per token */
    {{MHA(2, 4, 5, 5, 1), 16, 4, 1, 1, KVS_POOL_NHD, KVS_POOL_NHD, 2, 2, 1, 0},
     2,
     KVS_CUDA_RUN_TOKEN},
    /* MLA latent (DeepSeek-like width), HND and NHD agree with one head */
    {{MLA(3, 576, 2), 64, 2, 2, 4, KVS_POOL_HND, KVS_POOL_NHD, 1, 0, 0, 0}, 16, KVS_CUDA_RUN_PAGE},
    /* large pages, mixed K/V widths */
    {{MHA(2, 2, 96, 40, 2), 128, 2, 1, 2, KVS_POOL_HND, KVS_POOL_NHD, 1, 1, 0, 0},
     16,
     KVS_CUDA_RUN_PAGE},
    /* a page list too long to travel in the launch parameters, and longer than the first
     * pinned and device buffers: the upload path and its buffer growth */
    {{MHA(1, 1, 1, 1, 1), 1, 20000, 1, 1, KVS_POOL_NHD, KVS_POOL_HND, 1, 0, 0, 0},
     1,
     KVS_CUDA_RUN_PAGE},
};

/* The plan is host arithmetic: checked on fake addresses in every CUDA build, GPU or not. */
static void test_plan_choices(void **state)
{
    (void) state;
    for (size_t i = 0; i < sizeof(plan_cases) / sizeof(plan_cases[0]); i++) {
        const case_t *c = &plan_cases[i].c;
        kvs_pool_config_t pc =
            config_of(c->shape, c->tp_a, c->page_size, c->npages + 2, c->lay_a, KVS_MEM_HOST);
        kvs_pool_t *pool = NULL;
        assert_int_equal(kvs_pool_create(&pc, &pool), KVS_OK);
        uint32_t n = 0;
        kvs_region_t *regs = regions_of(pool, &n);
        uint32_t *pages = calloc(c->npages, sizeof(uint32_t));
        uint8_t *region = (uint8_t *) (uintptr_t) (0x7f0000000000ull + c->misalign);
        const uint64_t T = (uint64_t) c->npages * c->page_size;
        kvs_copy_desc_t d = copy_desc(pool, regs, pages, c->npages, c->head_a, c->heads, region,
                                      kvs_copy_region_bytes(&c->shape, c->heads, T));
        assert_int_equal(kvs_copy_desc_validate(KVS_COPY_GATHER, &d), KVS_OK);
        kvs_cuda_plan_t plan;
        assert_int_equal(kvs__copy_cuda_plan(&d, &plan), KVS_OK);
        if (plan.vec_bytes != plan_cases[i].vec || plan.run != plan_cases[i].run)
            fail_msg("plan case %zu: got %u-byte vectors, run %d; want %u, %d", i, plan.vec_bytes,
                     (int) plan.run, plan_cases[i].vec, (int) plan_cases[i].run);
        assert_int_equal(plan.entries, c->shape.layers * kvs_kv_shape_components(&c->shape));
        free(pages);
        free(regs);
        kvs_pool_destroy(pool);
    }
    kvs_assert_no_leaks();
}

static void test_fastdiv(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(0xd1d1);
    uint64_t bad = kvs__copy_cuda_fastdiv_check(seed, kvs_test_iters(20000));
    if (bad != 0)
        fail_msg("fastdiv: %llu mismatches (KVS_SEED=0x%llx)", (unsigned long long) bad,
                 (unsigned long long) seed);
}

static void test_plan_cases_on_gpu(void **state)
{
    (void) state;
    require_gpu();
    const uint64_t seed = kvs_test_seed(0x9a9e5);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_copy_backend_t cpu, gpu;
    assert_int_equal(kvs_copy_cpu_create(&cpu), KVS_OK);
    assert_int_equal(kvs_copy_cuda_create(0, &gpu), KVS_OK);
    assert_string_equal(gpu.ops->name, "cuda");
    const uint64_t ncases = sizeof(plan_cases) / sizeof(plan_cases[0]);
    for (uint64_t iter = 0; iter < 2 * ncases; iter++) {
        /* every case twice: table and page ids in the launch parameters, then uploaded */
        assert_int_equal(kvs__copy_cuda_set_inline_max(&gpu, iter < ncases ? SIZE_MAX : 0), KVS_OK);
        const case_t *c = &plan_cases[iter % ncases].c;
        kvs_cuda_plan_t plan = run_case(c, &cpu, &gpu, &rng, seed, iter);
        const plan_case_t *want = &plan_cases[iter % ncases];
        CHECK(plan.vec_bytes == want->vec && plan.run == want->run,
              "planned %u-byte vectors, run %d; want %u, %d", plan.vec_bytes, (int) plan.run,
              want->vec, (int) want->run);
    }
    kvs_copy_backend_destroy(&gpu);
    kvs_copy_backend_destroy(&cpu);
    kvs_assert_no_leaks();
}

/* Copies of hundreds to thousands of thread blocks with their checksums: each of the copy's
 * checksum lanes gathers many blocks' sums (counted in the lane itself), the block count is no
 * multiple of the lanes, and in the first case the copy's last block has no vectors (V is half
 * as wide as K); every sum must equal the CPU's. Each case runs with its table in the launch
 * parameters and uploaded. */
static void test_checksum_many_blocks(void **state)
{
    (void) state;
    require_gpu();
    const uint64_t seed = kvs_test_seed(0xc5b10c);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_copy_backend_t cpu, gpu;
    assert_int_equal(kvs_copy_cpu_create(&cpu), KVS_OK);
    assert_int_equal(kvs_copy_cuda_create(0, &gpu), KVS_OK);
    static const case_t cases[] = {
        {MHA(2, 8, 128, 64, 2), 16, 256, 1, 1, KVS_POOL_HND, KVS_POOL_NHD, 8, 0, 0, 0},
        {MHA(3, 8, 128, 128, 2), 16, 154, 1, 2, KVS_POOL_NHD, KVS_POOL_HND, 4, 2, 0, 0},
        {MLA(1, 576, 2), 64, 300, 1, 1, KVS_POOL_NHD, KVS_POOL_HND, 1, 0, 0, 0},
    };
    const uint64_t ncases = sizeof(cases) / sizeof(cases[0]);
    for (uint64_t k = 0; k < 2 * ncases; k++) {
        assert_int_equal(kvs__copy_cuda_set_inline_max(&gpu, k < ncases ? SIZE_MAX : 0), KVS_OK);
        const uint64_t iter = 2 * k; /* even: run_case asks for the checksums */
        const case_t *c = &cases[k % ncases];
        const kvs_cuda_plan_t plan = run_case(c, &cpu, &gpu, &rng, seed, iter);
        CHECK((uint64_t) plan.blocks_x * plan.entries >= 600, "only %u x %u blocks", plan.blocks_x,
              plan.entries);
    }
    kvs_copy_backend_destroy(&gpu);
    kvs_copy_backend_destroy(&cpu);
    kvs_assert_no_leaks();
}

static uint32_t pick_dim(kvs_rng_t *rng)
{
    static const uint32_t dims[] = {1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 33, 64, 96, 128, 130, 256};
    if (kvs_rng_chance(rng, 1, 4)) return (uint32_t) kvs_rng_range(rng, 1, 200);
    return dims[kvs_rng_below(rng, sizeof(dims) / sizeof(dims[0]))];
}

static void test_random_vs_cpu(void **state)
{
    (void) state;
    require_gpu();
    const uint64_t seed = kvs_test_seed(0xc0dac0b1);
    const uint64_t iters = kvs_test_iters(200);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_copy_backend_t cpu, gpu;
    assert_int_equal(kvs_copy_cpu_create(&cpu), KVS_OK);
    assert_int_equal(kvs_copy_cuda_create(0, &gpu), KVS_OK);
    static const uint32_t page_sizes[] = {1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 64, 100, 128, 129};
    static const uint32_t head_counts[] = {1, 2, 3, 4, 6, 8};
    static const uint32_t elems[] = {1, 2, 4};
    static const uint32_t misaligns[] = {0, 0, 0, 0, 1, 2, 4, 8, 12};
    uint32_t seen_vec = 0, seen_run = 0;
    for (uint64_t iter = 0; iter < iters; iter++) {
        case_t cs;
        memset(&cs, 0, sizeof(cs));
        case_t *c = &cs;
        c->shape.layers = (uint32_t) kvs_rng_range(&rng, 1, 4);
        c->shape.elem_bytes = elems[kvs_rng_below(&rng, 3)];
        if (kvs_rng_chance(&rng, 1, 5)) {
            c->shape.attn = KVS_ATTN_MLA;
            c->shape.kv_heads = 1;
            c->shape.head_dim_k = pick_dim(&rng) + (uint32_t) kvs_rng_below(&rng, 400);
        } else {
            c->shape.attn = KVS_ATTN_MHA;
            c->shape.kv_heads = head_counts[kvs_rng_below(&rng, 6)];
            c->shape.head_dim_k = pick_dim(&rng);
            c->shape.head_dim_v = kvs_rng_chance(&rng, 2, 3) ? c->shape.head_dim_k : pick_dim(&rng);
        }
        c->page_size = page_sizes[kvs_rng_below(&rng, sizeof(page_sizes) / sizeof(page_sizes[0]))];
        c->npages = (uint32_t) kvs_rng_range(&rng, 1, c->page_size >= 64 ? 4 : 256 / c->page_size);
        c->tp_a = pick_tp(&rng, c->shape.kv_heads);
        c->tp_b = pick_tp(&rng, c->shape.kv_heads);
        c->lay_a = (kvs_pool_layout_t) kvs_rng_below(&rng, 2);
        c->lay_b = (kvs_pool_layout_t) kvs_rng_below(&rng, 2);
        const uint32_t ha = kvs_tp_heads_per_rank(&c->shape, c->tp_a);
        const uint32_t hb = kvs_tp_heads_per_rank(&c->shape, c->tp_b);
        c->heads = (uint32_t) kvs_rng_range(&rng, 1, ha < hb ? ha : hb);
        if (kvs_rng_chance(&rng, 1, 2)) c->heads = ha < hb ? ha : hb; /* whole pools often */
        c->head_a = (uint32_t) kvs_rng_below(&rng, ha - c->heads + 1);
        c->head_b = (uint32_t) kvs_rng_below(&rng, hb - c->heads + 1);
        c->misalign = misaligns[kvs_rng_below(&rng, sizeof(misaligns) / sizeof(misaligns[0]))];
        /* odd cases upload their table; even ones pass it in the launch parameters */
        assert_int_equal(kvs__copy_cuda_set_inline_max(&gpu, iter % 2 ? 0 : SIZE_MAX), KVS_OK);
        kvs_cuda_plan_t plan = run_case(c, &cpu, &gpu, &rng, seed, iter);
        seen_vec |= plan.vec_bytes;
        seen_run |= 1u << plan.run;
    }
    print_message("random cases: %llu (seed 0x%llx), vector widths seen 0x%x, run kinds 0x%x\n",
                  (unsigned long long) iters, (unsigned long long) seed, seen_vec, seen_run);
    kvs_copy_backend_destroy(&gpu);
    kvs_copy_backend_destroy(&cpu);
    kvs_assert_no_leaks();
}

/* More copies in flight than the backend has pinned slots, alternating scatters into one pool
 * and gathers out of it (each gather must see every scatter before it), with the caller's page
 * array rewritten right after every submit. Only the last ticket is waited for. Every copy but
 * every fifth asks for its checksum, so each slot's checksum lanes serve several copies in
 * flight: each must be left cleared for the next (the sums equal the CPU's). */
static void test_in_order_many_in_flight(void **state)
{
    (void) state;
    require_gpu();
    const uint64_t seed = kvs_test_seed(0x0dde75);
    const uint64_t iter = 0;
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_copy_backend_t cpu, gpu;
    assert_int_equal(kvs_copy_cpu_create(&cpu), KVS_OK);
    assert_int_equal(kvs_copy_cuda_create(0, &gpu), KVS_OK);
    enum { COPIES = 48, NPAGES = 8, POOL_PAGES = 24 };
    case_t cs = {MHA(2, 4, 64, 64, 2), 16, NPAGES, 1, 1, KVS_POOL_HND, KVS_POOL_HND, 4, 0, 0, 0};
    const case_t *c = &cs;
    twin_t p;
    twin_make(&p, c->shape, 1, c->page_size, POOL_PAGES, c->lay_a);
    twin_fill(&p, &rng);
    const uint64_t rbytes = kvs_copy_region_bytes(&c->shape, 4, NPAGES * 16);
    rbuf_t bufs[COPIES];
    for (int k = 0; k < COPIES; k++) rbuf_make(&bufs[k], rbytes, 0, &rng);
    uint32_t caller_pages[NPAGES]; /* reused by every submit, like an engine's scratch list */
    uint64_t hsum[COPIES], dsum[COPIES];
    uint64_t last = 0;
    for (int k = 0; k < COPIES; k++) {
        kvs_copy_dir_t dir = k % 3 == 2 ? KVS_COPY_GATHER : KVS_COPY_SCATTER;
        pick_pages(&rng, POOL_PAGES, NPAGES, caller_pages);
        kvs_copy_desc_t hd =
            copy_desc(p.host, p.hreg, caller_pages, NPAGES, 0, 4, bufs[k].hbuf + GUARD, rbytes);
        kvs_copy_desc_t dd =
            copy_desc(p.dev, p.dreg, caller_pages, NPAGES, 0, 4, bufs[k].dbuf + GUARD, rbytes);
        hsum[k] = dsum[k] = 0;
        if (k % 5 != 4) {
            hd.checksum = &hsum[k];
            dd.checksum = &dsum[k];
        }
        run_copy(&cpu, dir, &hd);
        uint64_t t = 0;
        /* both launch paths, interleaved on the one stream */
        assert_int_equal(kvs__copy_cuda_set_inline_max(&gpu, k % 4 < 2 ? 0 : SIZE_MAX), KVS_OK);
        assert_int_equal(kvs_copy_submit(&gpu, dir, &dd, &t), KVS_OK);
        assert_true(t > last);
        last = t;
        memset(caller_pages, 0xff, sizeof(caller_pages)); /* must not reach the device */
    }
    kvs_status_t st;
    while ((st = kvs_copy_poll(&gpu, last)) == KVS_INPROGRESS) {
    }
    assert_int_equal(st, KVS_OK);
    for (uint64_t t = 1; t <= last; t++) assert_int_equal(kvs_copy_poll(&gpu, t), KVS_OK);
    for (int k = 0; k < COPIES; k++)
        CHECK(dsum[k] == hsum[k] && (k % 5 == 4) == (hsum[k] == 0),
              "copy %d: GPU checksum %llx, CPU %llx", k, (unsigned long long) dsum[k],
              (unsigned long long) hsum[k]);
    uint64_t diff = twin_diff(&p);
    CHECK(diff == UINT64_MAX, "pool after %d copies differs at byte %llu", COPIES,
          (unsigned long long) diff);
    for (int k = 0; k < COPIES; k++) {
        diff = rbuf_diff(&bufs[k]);
        CHECK(diff == UINT64_MAX, "region buffer of copy %d differs at byte %llu", k,
              (unsigned long long) diff);
        rbuf_free(&bufs[k]);
    }
    twin_free(&p);
    kvs_copy_backend_destroy(&gpu);
    kvs_copy_backend_destroy(&cpu);
    kvs_assert_no_leaks();
}

/* Batches (kvs_copy_submit_batch) the way the receiver submits a slot's writer regions: 1 to 11
 * copies of disjoint head slices of one pool, scatters (fan-in) and gathers (fan-out), most on
 * one page list (one launch per 8 at most) and now and then one with its own pages, its own
 * alignment or no checksum, which the backend launches apart; both launch paths. The pool, every
 * region buffer (guards included) and every checksum equal the CPU's, which runs the copies
 * one by one; a batch with one refused copy launches none of them. */
static void test_batches_vs_cpu(void **state)
{
    (void) state;
    require_gpu();
    const uint64_t seed = kvs_test_seed(0xba7c4e5);
    const uint64_t iters = kvs_test_iters(60);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_copy_backend_t cpu, gpu;
    assert_int_equal(kvs_copy_cpu_create(&cpu), KVS_OK);
    assert_int_equal(kvs_copy_cuda_create(0, &gpu), KVS_OK);
    enum { MAXN = 11 };
    static const uint32_t page_sizes[] = {1, 4, 16, 64};
    static const uint32_t misaligns[] = {1, 2, 4, 8, 16};
    for (uint64_t iter = 0; iter < iters; iter++) {
        const uint32_t n = (uint32_t) kvs_rng_range(&rng, 1, MAXN);
        const uint32_t hs = (uint32_t) kvs_rng_range(&rng, 1, 2); /* heads per copy */
        case_t cs;
        memset(&cs, 0, sizeof(cs));
        case_t *c = &cs;
        c->shape = mha((uint32_t) kvs_rng_range(&rng, 1, 3), n * hs, pick_dim(&rng), 0, 2);
        c->shape.head_dim_v = kvs_rng_chance(&rng, 1, 2) ? c->shape.head_dim_k : pick_dim(&rng);
        c->page_size = page_sizes[kvs_rng_below(&rng, 4)];
        c->npages = (uint32_t) kvs_rng_range(&rng, 1, 128 / c->page_size + 1);
        c->lay_a = (kvs_pool_layout_t) kvs_rng_below(&rng, 2);
        c->tp_a = c->tp_b = 1;
        c->heads = hs;
        const uint32_t pool_pages = c->npages + 4;
        twin_t p;
        twin_make(&p, c->shape, 1, c->page_size, pool_pages, c->lay_a);
        twin_fill(&p, &rng);
        uint32_t *shared = malloc(sizeof(uint32_t) * c->npages);
        uint32_t *own = malloc(sizeof(uint32_t) * c->npages);
        assert_true(shared != NULL && own != NULL);
        pick_pages(&rng, pool_pages, c->npages, shared);
        pick_pages(&rng, pool_pages, c->npages, own);
        const kvs_copy_dir_t dir = iter % 2 ? KVS_COPY_GATHER : KVS_COPY_SCATTER;
        const uint64_t rbytes =
            kvs_copy_region_bytes(&c->shape, hs, (uint64_t) c->npages * c->page_size);
        rbuf_t bufs[MAXN];
        kvs_copy_desc_t hd[MAXN], dd[MAXN];
        uint64_t hsum[MAXN], dsum[MAXN];
        for (uint32_t w = 0; w < n; w++) {
            const uint32_t mis = kvs_rng_chance(&rng, 1, 8) ? misaligns[kvs_rng_below(&rng, 5)] : 0;
            const uint32_t *pages = kvs_rng_chance(&rng, 1, 8) ? own : shared;
            rbuf_make(&bufs[w], rbytes, mis, &rng);
            hd[w] = copy_desc(p.host, p.hreg, pages, c->npages, w * hs, hs,
                              bufs[w].hbuf + GUARD + mis, rbytes);
            dd[w] = copy_desc(p.dev, p.dreg, pages, c->npages, w * hs, hs,
                              bufs[w].dbuf + GUARD + mis, rbytes);
            hsum[w] = dsum[w] = 0;
            if (!kvs_rng_chance(&rng, 1, 10)) {
                hd[w].checksum = &hsum[w];
                dd[w].checksum = &dsum[w];
            }
        }
        assert_int_equal(kvs__copy_cuda_set_inline_max(&gpu, iter % 4 < 2 ? 0 : SIZE_MAX), KVS_OK);
        uint64_t t = 0;
        if (iter % 8 == 0) { /* a refused copy anywhere in a batch: none of it launches */
            const kvs_copy_desc_t keep = dd[n - 1];
            dd[n - 1].pool_pages = 0; /* every page id is outside the pool */
            int logged = 0;
            kvs_log_set_sink(quiet_sink, &logged);
            assert_int_equal(kvs_copy_submit_batch(&gpu, dir, dd, n, &t), KVS_ERR_INVALID);
            kvs_log_set_sink(NULL, NULL);
            dd[n - 1] = keep;
            assert_true(logged > 0);
            CU(cudaDeviceSynchronize());
            CHECK(twin_diff(&p) == UINT64_MAX, "a refused batch of %u wrote the pool", n);
            for (uint32_t w = 0; w < n; w++)
                CHECK(rbuf_diff(&bufs[w]) == UINT64_MAX, "a refused batch of %u wrote region %u", n,
                      w);
        }
        for (uint32_t w = 0; w < n; w++) run_copy(&cpu, dir, &hd[w]);
        assert_int_equal(kvs_copy_submit_batch(&gpu, dir, dd, n, &t), KVS_OK);
        kvs_status_t st;
        while ((st = kvs_copy_poll(&gpu, t)) == KVS_INPROGRESS) {
        }
        assert_int_equal(st, KVS_OK);
        uint64_t diff = twin_diff(&p);
        CHECK(diff == UINT64_MAX, "%s batch of %u: pool differs at byte %llu",
              dir == KVS_COPY_GATHER ? "gather" : "scatter", n, (unsigned long long) diff);
        for (uint32_t w = 0; w < n; w++) {
            diff = rbuf_diff(&bufs[w]);
            CHECK(diff == UINT64_MAX, "batch of %u: region buffer of copy %u differs at byte %llu",
                  n, w, (unsigned long long) diff);
            CHECK(dsum[w] == hsum[w], "batch of %u: copy %u's GPU checksum %llx, CPU %llx", n, w,
                  (unsigned long long) dsum[w], (unsigned long long) hsum[w]);
            rbuf_free(&bufs[w]);
        }
        free(shared);
        free(own);
        twin_free(&p);
    }
    kvs_copy_backend_destroy(&gpu);
    kvs_copy_backend_destroy(&cpu);
    kvs_assert_no_leaks();
}

static void test_refusals(void **state)
{
    (void) state;
    require_gpu();
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 7);
    int logged = 0;
    kvs_copy_backend_t gpu = {NULL, NULL}, cpu;
    kvs_log_set_sink(quiet_sink, &logged);
    assert_int_equal(kvs_copy_cuda_create(-1, &gpu), KVS_ERR_INVALID);
    int count = 0;
    CU(cudaGetDeviceCount(&count));
    assert_int_equal(kvs_copy_cuda_create(count, &gpu), KVS_ERR_INVALID);
    assert_null(gpu.ops);
    assert_int_equal(logged, 2);
    kvs_alloc_fail_at(1);
    assert_int_equal(kvs_copy_cuda_create(0, &gpu), KVS_ERR_NOMEM);
    kvs_log_set_sink(NULL, NULL);
    assert_null(gpu.ops);

    assert_int_equal(kvs_copy_cuda_create(0, &gpu), KVS_OK);
    assert_int_equal(kvs_copy_cpu_create(&cpu), KVS_OK);
    assert_non_null(kvs_copy_cuda_stream(&gpu));
    assert_null(kvs_copy_cuda_stream(&cpu));
    kvs_log_set_sink(quiet_sink, &logged);
    assert_int_equal(kvs__copy_cuda_set_inline_max(&cpu, 0), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    twin_t p;
    twin_make(&p, mha(2, 4, 8, 8, 2), 2, 4, 6, KVS_POOL_NHD);
    twin_fill(&p, &rng);
    uint32_t pages[] = {5, 1, 3};
    const uint64_t need = kvs_copy_region_bytes(&kvs_pool_config(p.dev)->shape, 2, 12);
    rbuf_t r;
    rbuf_make(&r, need, 0, &rng);
    kvs_copy_desc_t good = copy_desc(p.dev, p.dreg, pages, 3, 0, 2, r.dbuf + GUARD, need), d;
    uint64_t ticket = 99;
    kvs_log_set_sink(quiet_sink, &logged);
    d = good, d.heads = 3;
    assert_int_equal(kvs_copy_submit(&gpu, KVS_COPY_GATHER, &d, &ticket), KVS_ERR_INVALID);
    d = good, d.pool_pages = 5;
    assert_int_equal(kvs_copy_submit(&gpu, KVS_COPY_SCATTER, &d, &ticket), KVS_ERR_INVALID);
    d = good, d.region_bytes = need - 1;
    assert_int_equal(kvs_copy_submit(&gpu, KVS_COPY_GATHER, &d, &ticket), KVS_ERR_INVALID);
    assert_int_equal(kvs_copy_submit(&gpu, (kvs_copy_dir_t) 3, &good, &ticket), KVS_ERR_INVALID);
    assert_int_equal(ticket, 99);
    assert_int_equal(kvs_copy_poll(&gpu, 0), KVS_ERR_INVALID);
    assert_int_equal(kvs_copy_poll(&gpu, 1), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(logged, 6 + 2 + 1 + 1);
    /* nothing moved */
    assert_int_equal(rbuf_diff(&r), UINT64_MAX);
    assert_int_equal(twin_diff(&p), UINT64_MAX);
    /* an empty copy is valid and completes in order */
    d = good, d.npages = 0, d.pages = NULL, d.region = NULL, d.region_bytes = 0;
    uint64_t t1 = 0, t2 = 0;
    assert_int_equal(kvs_copy_submit(&gpu, KVS_COPY_GATHER, &d, &t1), KVS_OK);
    assert_int_equal(kvs_copy_submit(&gpu, KVS_COPY_GATHER, &good, &t2), KVS_OK);
    assert_true(t2 > t1 && t1 > 0);
    while (kvs_copy_poll(&gpu, t2) == KVS_INPROGRESS) {
    }
    assert_int_equal(kvs_copy_poll(&gpu, t1), KVS_OK);
    assert_int_equal(rbuf_diff(&r) != UINT64_MAX, 1); /* the gather did land */
    rbuf_free(&r);
    twin_free(&p);
    kvs_copy_backend_destroy(&gpu);
    kvs_copy_backend_destroy(&gpu); /* idempotent */
    kvs_copy_backend_destroy(&cpu);
    kvs_assert_no_leaks();
}

static void test_device_pool(void **state)
{
    (void) state;
    require_gpu();
    kvs_kv_shape_t s = mha(3, 8, 128, 128, 2);
    kvs_pool_config_t c = config_of(s, 2, 16, 10, KVS_POOL_HND, KVS_MEM_DEVICE);
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_OK);
    assert_int_equal(kvs_pool_config(pool)->device, 0);
    uint32_t n = 0;
    kvs_region_t *regs = regions_of(pool, &n);
    assert_int_equal(n, 6);
    for (uint32_t i = 0; i < n; i++) {
        struct cudaPointerAttributes attr;
        CU(cudaPointerGetAttributes(&attr, regs[i].base));
        assert_int_equal(attr.type, cudaMemoryTypeDevice);
        assert_int_equal(attr.device, 0);
        assert_int_equal((uintptr_t) regs[i].base % 64, 0);
        assert_int_equal(regs[i].page_stride, 16 * 4 * 128 * 2);
    }
    /* zeroed, like host pools */
    const uint64_t extent =
        (uint64_t) (regs[n - 1].base - regs[0].base) + 10 * regs[n - 1].page_stride;
    uint8_t *host = malloc(extent);
    CU(cudaMemcpy(host, regs[0].base, extent, cudaMemcpyDeviceToHost));
    for (uint64_t i = 0; i < extent; i++)
        if (host[i] != 0)
            fail_msg("device pool byte %llu is %u, not 0", (unsigned long long) i, host[i]);
    free(host);
    /* the page allocator is the same as for host pools */
    uint32_t pages[10];
    assert_int_equal(kvs_pool_alloc(pool, 10, pages), KVS_OK);
    assert_int_equal(kvs_pool_free_pages(pool), 0);
    assert_int_equal(kvs_pool_free(pool, pages, 10), KVS_OK);
    free(regs);
    kvs_pool_destroy(pool);

    int logged = 0;
    kvs_log_set_sink(quiet_sink, &logged);
    c.device = -1;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    int count = 0;
    CU(cudaGetDeviceCount(&count));
    c.device = count;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(logged, 2);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fastdiv),
        cmocka_unit_test(test_plan_choices),
        cmocka_unit_test(test_device_pool),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_plan_cases_on_gpu),
        cmocka_unit_test(test_random_vs_cpu),
        cmocka_unit_test(test_in_order_many_in_flight),
        cmocka_unit_test(test_batches_vs_cpu),
        cmocka_unit_test(test_checksum_many_blocks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#else /* built without CUDA */

static void test_cuda_backend_absent(void **state)
{
    (void) state;
    /* The stub links and refuses cleanly; the GPU tests themselves cannot run here. */
    assert_int_equal(kvs_copy_cuda_available(), 0);
    kvs_copy_backend_t b = {NULL, NULL};
    int logged = 0;
    kvs_log_set_sink(quiet_sink, &logged);
    assert_int_equal(kvs_copy_cuda_create(0, &b), KVS_ERR_UNSUPPORTED);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(logged, 1);
    assert_null(b.ops);
    print_message("built without CUDA: GPU tests skipped\n");
    skip();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_backend_absent),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
