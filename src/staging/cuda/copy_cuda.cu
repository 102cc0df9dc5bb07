/* The CUDA copy backend: gather pool pages into a writer region and scatter them back with one
 * kernel launch per copy, covering every layer and component, on the backend's own
 * non-blocking stream. Byte for byte the CPU reference (cpu/copy_cpu.c). A batch of copies
 * over the same pages (kvs_copy_submit_batch: the writer regions of one staging slot) goes out
 * as one launch of up to MAX_BATCH copies, each with its own checksum, so the copies' tails
 * (the last blocks, the checksum's fold) overlap instead of queueing one after another.
 *
 * Per launch, submit validates the descriptors and builds a table of the first copy's (layer,
 * component) blocks, which the others shift to their heads and region, followed by the page
 * ids. A small table (INLINE_BYTES, e.g. 1k pages of Llama-3-8B) rides in the kernel's
 * parameters, which the launch snapshots; a larger one is written into a pinned host slot and
 * copied to a device scratch buffer on the stream before the launch. Then the slot's event is
 * recorded and the ticket names it. Everything runs on one stream, so copies
 * finish in submit order and one scratch buffer suffices; the pinned slots (NSLOTS) let the
 * caller reuse its page array at once and keep several copies in flight. Backends are not
 * thread-safe: one thread submits and polls.
 *
 * The kernel sees each (layer, component) block of the region as `units` vectors of V bytes
 * (V = 16 when every address and run length allows, else 8, 4, 2 or 1) and the pool side as
 * runs of contiguous bytes: a whole page (NHD with all heads, or P = 1), one token's heads
 * (NHD), or one head (anything else). Thread blocks cover (chunk of vectors, layer x
 * component); each thread issues UNROLL independent loads before its stores. Index arithmetic
 * is 32-bit division by invariant divisors (multiply-high and shifts), precomputed on the
 * host. */
#include <assert.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "base/cuda_util.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"
#include "staging/copy.h"
#include "staging/cuda/copy_cuda.h"
}
#include "staging/checksum.h"

namespace
{

constexpr uint32_t THREADS = 256;                   /* threads per block */
constexpr uint32_t UNROLL = 4;                      /* independent vectors per thread */
constexpr uint32_t CHUNK = THREADS * UNROLL;        /* vectors per block */
constexpr uint32_t NSLOTS = 16;                     /* copies in flight before submit waits */
constexpr size_t SLOT_MIN_BYTES = 64 * 1024;        /* first pinned size of a slot */
constexpr uint32_t MAX_UNITS = 0x7fffffffu - CHUNK; /* per block, so 32-bit indices never wrap */
constexpr size_t INLINE_BYTES = 16384; /* table + page ids passed as kernel parameters */
/* Checksum lanes per copy: each block adds its sum into lane (block index % CSUM_LANES), as two
 * words that each carry a count of the blocks added in their top CSUM_COUNT_BITS: the low
 * word adds the sum's low 32 bits, the high word its high 32 bits (mod 2^64 only these matter).
 * The copy's last block (in launch order) reads the lanes until every count is complete, folds
 * them into the result and clears them for the next copy through this slot. No block waits for
 * its own additions, and nothing orders them: a lane's value and its count change in the same
 * atomic addition. */
constexpr uint32_t CSUM_LANES = 64;
constexpr uint32_t CSUM_COUNT_BITS = 16;
constexpr uint32_t CSUM_COUNT_SHIFT = 64 - CSUM_COUNT_BITS;
constexpr unsigned long long CSUM_ONE = 1ull << CSUM_COUNT_SHIFT; /* one block, counted */
constexpr uint32_t CSUM_WORDS = 2 * CSUM_LANES; /* per copy: its low words, then its high */
/* Blocks of one copy: no lane counts more than 2^16 - 1 of them, so neither word's sum of 32-bit
 * halves reaches its count. */
constexpr uint64_t CSUM_MAX_BLOCKS = (uint64_t) CSUM_LANES * ((1u << CSUM_COUNT_BITS) - 1);
/* Copies one launch may carry (kvs_copy_submit_batch), each with its own checksum lanes and
 * result; larger batches go out as several launches. */
constexpr uint32_t MAX_BATCH = 8;

/* ---- division by an invariant 32-bit divisor ----
 * q = (t + ((n - t) >> s1)) >> s2 with t = mulhi(m, n), exact for every n, d < 2^32
 * (Granlund and Montgomery, "Division by invariant integers using multiplication"). */
struct fastdiv_t {
    uint32_t d, m, s1, s2;
};

fastdiv_t fastdiv_make(uint32_t d)
{
    assert(d > 0);
    uint32_t l = 0;
    while (l < 32 && (uint64_t) 1 << l < d) l++;
    fastdiv_t f;
    f.d = d;
    f.m = (uint32_t) (((((uint64_t) 1 << l) - d) << 32) / d + 1);
    f.s1 = l < 1 ? l : 1;
    f.s2 = l > 1 ? l - 1 : 0;
    return f;
}

__host__ __device__ __forceinline__ uint32_t fastdiv_div(const fastdiv_t &f, uint32_t n)
{
#ifdef __CUDA_ARCH__
    const uint32_t t = __umulhi(f.m, n);
#else
    const uint32_t t = (uint32_t) (((uint64_t) f.m * n) >> 32);
#endif
    return (t + ((n - t) >> f.s1)) >> f.s2;
}

/* One (layer, component) of a copy, as the kernel reads it. */
struct entry_t {
    uint8_t *pool;  /* region base + pool_head * head_stride */
    uint8_t *block; /* this (layer, component)'s block of the writer region: [T][heads][D] */
    uint64_t page_stride, token_stride, head_stride;
    fastdiv_t run;  /* vectors per contiguous pool run */
    uint32_t units; /* vectors in the block */
    uint32_t pad;
};
static_assert(sizeof(entry_t) == 64, "entry_t is one 64-byte record");

/* A launch carries gridDim.z copies of one table: copy 0's (layer, component) blocks, which the
 * other copies shift to their own heads of the same pool and their own writer region. */
struct launch_t {
    const entry_t *entries;        /* [layers * components] of copy 0, in the device scratch */
    const uint32_t *pages;         /* [npages], in the device scratch after the entries */
    fastdiv_t heads;               /* selected heads */
    fastdiv_t page_size;           /* P */
    unsigned long long *csum;      /* [MAX_BATCH][CSUM_WORDS] checksum lanes; NULL: none */
    unsigned long long *csum_out;  /* [MAX_BATCH] the sums, in host memory mapped into the device */
    uint8_t *region[MAX_BATCH];    /* each copy's writer region */
    int32_t head_shift[MAX_BATCH]; /* each copy's first pool head, less copy 0's */
};

/* Small copies carry their table and page ids inside the launch's parameters (up to 32 KB
 * are allowed on sm_70+ since CUDA 12.1): no upload, no wait for a copy engine, and the
 * launch itself snapshots them. */
struct launch_inline_t {
    launch_t p;                                   /* entries and pages unused */
    alignas(16) unsigned char data[INLINE_BYTES]; /* [entries][pages] */
};
static_assert(sizeof(launch_inline_t) <= 32764, "kernel parameters are limited to 32764 bytes");

template <int V> struct vec_of;
template <> struct vec_of<16> {
    typedef uint4 type;
};
template <> struct vec_of<8> {
    typedef uint2 type;
};
template <> struct vec_of<4> {
    typedef unsigned int type;
};
template <> struct vec_of<2> {
    typedef unsigned short type;
};
template <> struct vec_of<1> {
    typedef unsigned char type;
};

/* Plain global stores: the destination pointers come out of the entry table, so without this
 * the compiler can only emit generic stores. */
__device__ __forceinline__ void store_global(uint4 *p, uint4 v)
{
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ void store_global(uint2 *p, uint2 v)
{
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void store_global(unsigned int *p, unsigned int v)
{
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void store_global(unsigned short *p, unsigned short v)
{
    asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory");
}
__device__ __forceinline__ void store_global(unsigned char *p, unsigned char v)
{
    asm volatile("st.global.u8 [%0], %1;" ::"l"(p), "r"((unsigned int) v) : "memory");
}

/* Where vector u of the block lies in the pool: entry `index` of the page list, plus
 * `rest` bytes from the start of that page (relative to e.pool). */
template <int V, int RUN>
__device__ __forceinline__ void pool_split(const entry_t &e, const launch_t &p, uint32_t u,
                                           uint32_t &index, uint64_t &rest)
{
    const uint32_t r = fastdiv_div(e.run, u); /* run index within the block */
    const uint32_t in_run = u - r * e.run.d;
    uint32_t tok = 0, head = 0;
    if (RUN == KVS_CUDA_RUN_PAGE) {
        index = r;
    } else if (RUN == KVS_CUDA_RUN_TOKEN) {
        index = fastdiv_div(p.page_size, r);
        tok = r - index * p.page_size.d;
    } else {
        const uint32_t t = fastdiv_div(p.heads, r); /* region token */
        head = r - t * p.heads.d;
        index = fastdiv_div(p.page_size, t);
        tok = t - index * p.page_size.d;
    }
    rest =
        (uint64_t) tok * e.token_stride + (uint64_t) head * e.head_stride + (uint64_t) in_run * V;
}

/* Adds one vector, at region offset off, to the checksum (staging/checksum.h). Vectors of 4
 * bytes and more sit on word boundaries (the plan aligns them, and regions start aligned), so
 * they are whole words: one widening multiply-add each. */
__device__ __forceinline__ void csum_vec(kvs_csum_t &c, uint64_t off, uint4 v)
{
    const uint32_t k = kvs_csum_key(off >> 2);
    c.a += (uint64_t) v.x * k + (uint64_t) v.y * (k + KVS_CSUM_D) +
           (uint64_t) v.z * (k + 2 * KVS_CSUM_D) + (uint64_t) v.w * (k + 3 * KVS_CSUM_D);
}
__device__ __forceinline__ void csum_vec(kvs_csum_t &c, uint64_t off, uint2 v)
{
    const uint32_t k = kvs_csum_key(off >> 2);
    c.a += (uint64_t) v.x * k + (uint64_t) v.y * (k + KVS_CSUM_D);
}
__device__ __forceinline__ void csum_vec(kvs_csum_t &c, uint64_t off, unsigned int v)
{
    if ((off & 3) == 0)
        c.a += (uint64_t) v * kvs_csum_key(off >> 2);
    else
        kvs_csum_small(&c, off, v, 4);
}
__device__ __forceinline__ void csum_vec(kvs_csum_t &c, uint64_t off, unsigned short v)
{
    kvs_csum_small(&c, off, v, 2);
}
__device__ __forceinline__ void csum_vec(kvs_csum_t &c, uint64_t off, unsigned char v)
{
    kvs_csum_small(&c, off, v, 1);
}

/* Hands this block's part of its copy's checksum (thread 0's `part`; every thread calls it) to
 * its lane; the copy's last block instead waits for every other block's part and writes the
 * result, to host memory, leaving the lanes cleared.
 *
 * The other blocks add and leave: two reductions from thread 0, no answer awaited and no fence,
 * so a checksummed copy's blocks live no longer than plain ones. (The design before had each
 * block count itself on one counter with release and acquire order and the last to count fold,
 * which kept every block alive for its own stores and the atomic's round trip: bench/RESULTS.md,
 * "Checksum lanes".) The waiting block is the copy's last in launch order, which the GPU starts
 * after all the others; and even where it started earlier, at most MAX_BATCH blocks of a launch
 * wait, so the others still find room to run. It knows a lane is complete from the lane's own
 * counts. The host reads the result only after the copy's event, which follows the kernel's
 * completion and so its writes. */
__device__ __forceinline__ void csum_finish(const launch_t &p, uint32_t copy,
                                            unsigned long long part)
{
    static_assert(CSUM_LANES == 64 && THREADS >= CSUM_LANES, "the fold uses two full warps");
    __shared__ unsigned long long fold[2];
    unsigned long long *const lo = p.csum + (size_t) copy * CSUM_WORDS;
    unsigned long long *const hi = lo + CSUM_LANES;
    const uint32_t b = blockIdx.y * gridDim.x + blockIdx.x, last = gridDim.x * gridDim.y - 1;
    if (b != last) {
        if (threadIdx.x == 0) {
            const uint32_t g = b % CSUM_LANES;
            asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(&lo[g]),
                         "l"((part & 0xffffffffull) + CSUM_ONE)
                         : "memory");
            asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(&hi[g]),
                         "l"((part >> 32) + CSUM_ONE)
                         : "memory");
        }
        return;
    }
    if (threadIdx.x >= CSUM_LANES) return;
    const uint32_t g = threadIdx.x;
    const unsigned long long want =
        (unsigned long long) (last / CSUM_LANES + (g < last % CSUM_LANES ? 1 : 0))
        << CSUM_COUNT_SHIFT;
    unsigned long long l, h;
    for (;;) {
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(l) : "l"(&lo[g]) : "memory");
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(h) : "l"(&hi[g]) : "memory");
        if ((l & ~(CSUM_ONE - 1)) == want && (h & ~(CSUM_ONE - 1)) == want) break;
        __nanosleep(32);
    }
    lo[g] = 0; /* every block of this copy has added: none touches the lane again */
    hi[g] = 0;
    unsigned long long sum = (l & (CSUM_ONE - 1)) + ((h & (CSUM_ONE - 1)) << 32);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if ((threadIdx.x & 31) == 0) fold[threadIdx.x / 32] = sum;
    asm volatile("bar.sync 1, %0;" ::"r"(CSUM_LANES)); /* the two folding warps only */
    if (threadIdx.x != 0) return;
    *(volatile unsigned long long *) &p.csum_out[copy] = fold[0] + fold[1] + part;
}

/* grid = (ceil(max units / CHUNK), layers * components, copies); a thread moves vectors
 * base + tid, base + tid + THREADS, ... of its block's chunk. The phases are written out so
 * that all page-id loads are in flight together, then all data loads, then the stores: no
 * thread waits twice for memory. Source and destination never overlap, so sources go through
 * the read-only path. INLINE: the table and page ids live in the kernel parameters, which
 * the read-only global path cannot address. */
template <int V, int RUN, bool GATHER, bool INLINE>
__device__ __forceinline__ void copy_body(const entry_t *entries, const uint32_t *pages,
                                          const launch_t &p)
{
    typedef typename vec_of<V>::type vec_t;
    const uint32_t copy = blockIdx.z;
    entry_t e = entries[blockIdx.y];
    if (copy != 0) { /* the same (layer, component) block of another copy */
        e.pool += (int64_t) p.head_shift[copy] * (int64_t) e.head_stride;
        e.block = p.region[copy] + (e.block - p.region[0]);
    }
    const uint32_t base = blockIdx.x * CHUNK + threadIdx.x;
    if (blockIdx.x * CHUNK >= e.units) {
        if (p.csum != nullptr) csum_finish(p, copy, 0); /* every block counts */
        return;
    }
    uint32_t index[UNROLL];
    uint64_t off[UNROLL];
#pragma unroll
    for (uint32_t k = 0; k < UNROLL; k++) {
        const uint32_t u = base + k * THREADS;
        if (u < e.units) pool_split<V, RUN>(e, p, u, index[k], off[k]);
    }
#pragma unroll
    for (uint32_t k = 0; k < UNROLL; k++) {
        const uint32_t u = base + k * THREADS;
        if (u < e.units) index[k] = INLINE ? pages[index[k]] : __ldg(&pages[index[k]]);
    }
    vec_t v[UNROLL];
#pragma unroll
    for (uint32_t k = 0; k < UNROLL; k++) {
        const uint32_t u = base + k * THREADS;
        if (u < e.units) {
            off[k] += (uint64_t) index[k] * e.page_stride;
            const vec_t *src =
                GATHER ? (const vec_t *) (e.pool + off[k]) : (const vec_t *) e.block + u;
            v[k] = __ldg(src);
        }
    }
#pragma unroll
    for (uint32_t k = 0; k < UNROLL; k++) {
        const uint32_t u = base + k * THREADS;
        if (u < e.units) {
            vec_t *dst = GATHER ? (vec_t *) e.block + u : (vec_t *) (e.pool + off[k]);
            store_global(dst, v[k]);
        }
    }
    /* The checksum of the bytes just moved, from the registers that moved them: summed per
     * thread, then per warp and per block, then once per block into one of the partial sums. */
    if (p.csum != nullptr) {
        kvs_csum_t c = {0};
        const uint64_t block_off = (uint64_t) (e.block - p.region[copy]);
#pragma unroll
        for (uint32_t k = 0; k < UNROLL; k++) {
            const uint32_t u = base + k * THREADS;
            if (u < e.units) csum_vec(c, block_off + (uint64_t) u * V, v[k]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) c.a += __shfl_down_sync(0xffffffffu, c.a, o);
        __shared__ unsigned long long warp_sums[THREADS / 32];
        if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = c.a;
        __syncthreads();
        unsigned long long total = 0;
        if (threadIdx.x == 0) {
#pragma unroll
            for (uint32_t w = 0; w < THREADS / 32; w++) total += warp_sums[w];
        }
        csum_finish(p, copy, total);
    }
}

/* __grid_constant__ keeps the parameters in place (no per-thread copy) so they can be indexed
 * (a copy's region and head shift). */
template <int V, int RUN, bool GATHER>
__global__ void __launch_bounds__(THREADS) copy_kernel(const __grid_constant__ launch_t p)
{
    copy_body<V, RUN, GATHER, false>(p.entries, p.pages, p);
}

template <int V, int RUN, bool GATHER>
__global__ void __launch_bounds__(THREADS)
    copy_kernel_inline(const __grid_constant__ launch_inline_t p)
{
    const entry_t *entries = (const entry_t *) p.data;
    copy_body<V, RUN, GATHER, true>(entries, (const uint32_t *) (entries + gridDim.y), p.p);
}

template <int V, int RUN, bool GATHER> const void *pick_inline(bool inline_params)
{
    return inline_params ? (const void *) copy_kernel_inline<V, RUN, GATHER>
                         : (const void *) copy_kernel<V, RUN, GATHER>;
}

template <int V> const void *pick_run(kvs_cuda_run_t run, bool gather, bool inl)
{
    switch (run) {
    case KVS_CUDA_RUN_PAGE:
        return gather ? pick_inline<V, KVS_CUDA_RUN_PAGE, true>(inl)
                      : pick_inline<V, KVS_CUDA_RUN_PAGE, false>(inl);
    case KVS_CUDA_RUN_TOKEN:
        return gather ? pick_inline<V, KVS_CUDA_RUN_TOKEN, true>(inl)
                      : pick_inline<V, KVS_CUDA_RUN_TOKEN, false>(inl);
    default:
        return gather ? pick_inline<V, KVS_CUDA_RUN_HEAD, true>(inl)
                      : pick_inline<V, KVS_CUDA_RUN_HEAD, false>(inl);
    }
}

const void *pick_kernel(const kvs_cuda_plan_t *plan, kvs_copy_dir_t dir, bool inl)
{
    const bool gather = dir == KVS_COPY_GATHER;
    switch (plan->vec_bytes) {
    case 16:
        return pick_run<16>(plan->run, gather, inl);
    case 8:
        return pick_run<8>(plan->run, gather, inl);
    case 4:
        return pick_run<4>(plan->run, gather, inl);
    case 2:
        return pick_run<2>(plan->run, gather, inl);
    default:
        return pick_run<1>(plan->run, gather, inl);
    }
}

/* ---- the plan: run kind, vector width and grid, from the descriptor alone ---- */

kvs_cuda_run_t entry_run(const kvs_copy_desc_t *d, const kvs_region_t *r)
{
    const uint64_t hb = (uint64_t) r->dim * r->elem_bytes;
    const bool token_contig = d->heads == 1 || r->head_stride == hb;
    if (!token_contig) return KVS_CUDA_RUN_HEAD;
    if (d->page_size == 1 || r->token_stride == d->heads * hb) return KVS_CUDA_RUN_PAGE;
    return KVS_CUDA_RUN_TOKEN;
}

uint64_t run_bytes(const kvs_copy_desc_t *d, const kvs_region_t *r, kvs_cuda_run_t run)
{
    const uint64_t hb = (uint64_t) r->dim * r->elem_bytes;
    if (run == KVS_CUDA_RUN_PAGE) return (uint64_t) d->page_size * d->heads * hb;
    if (run == KVS_CUDA_RUN_TOKEN) return d->heads * hb;
    return hb;
}

uint8_t *block_ptr(const kvs_copy_desc_t *d, uint32_t l, uint32_t c)
{
    const uint64_t tokens = (uint64_t) d->npages * d->page_size;
    return d->region + kvs_region_block_offset(d->shape, d->heads, tokens, l, c);
}

} // namespace

extern "C" kvs_status_t kvs__copy_cuda_plan(const kvs_copy_desc_t *d, kvs_cuda_plan_t *plan_p)
{
    const uint32_t n = d->layers * d->components;
    if (n > 65535) {
        kvs_error("copy(cuda): %u layers x %u components exceed one launch's 65535 grid rows",
                  d->layers, d->components);
        return KVS_ERR_UNSUPPORTED;
    }
    kvs_cuda_run_t run = KVS_CUDA_RUN_PAGE;
    for (uint32_t i = 0; i < n; i++) {
        kvs_cuda_run_t r = entry_run(d, &d->regions[i]);
        if (r < run) run = r;
    }
    /* Every address a vector touches is a sum of these, so their common power-of-two factor
     * is the widest vector that stays aligned; run lengths keep vectors inside one run. */
    uint64_t bits = 16;
    for (uint32_t i = 0; i < n; i++) {
        const kvs_region_t *r = &d->regions[i];
        bits |= (uint64_t) (uintptr_t) kvs_region_addr(r, 0, 0, d->pool_head);
        bits |= (uint64_t) (uintptr_t) block_ptr(d, i / d->components, i % d->components);
        bits |= r->page_stride | run_bytes(d, r, run);
        if (run != KVS_CUDA_RUN_PAGE) bits |= r->token_stride;
        if (run == KVS_CUDA_RUN_HEAD) bits |= r->head_stride;
    }
    const uint32_t vec = (uint32_t) (bits & (~bits + 1)); /* lowest set bit, at most 16 */
    uint64_t max_units = 0;
    for (uint32_t i = 0; i < n; i++) {
        const kvs_region_t *r = &d->regions[i];
        uint64_t units = (uint64_t) d->npages * run_bytes(d, r, run) / vec;
        if (run == KVS_CUDA_RUN_TOKEN) units *= d->page_size;
        if (run == KVS_CUDA_RUN_HEAD) units *= (uint64_t) d->page_size * d->heads;
        if (units > max_units) max_units = units;
    }
    if (max_units > MAX_UNITS) {
        kvs_error("copy(cuda): %llu vectors of %u bytes in one (layer, component) block exceed "
                  "one launch (%u); split the copy into fewer pages",
                  (unsigned long long) max_units, vec, MAX_UNITS);
        return KVS_ERR_UNSUPPORTED;
    }
    const uint64_t blocks_x = (max_units + CHUNK - 1) / CHUNK;
    if (blocks_x * n > CSUM_MAX_BLOCKS) { /* the checksum lanes count a copy's blocks */
        kvs_error("copy(cuda): %llu thread blocks exceed the %llu one copy may have (its "
                  "checksum lanes count them); split the copy into fewer pages",
                  (unsigned long long) (blocks_x * n), (unsigned long long) CSUM_MAX_BLOCKS);
        return KVS_ERR_UNSUPPORTED;
    }
    plan_p->vec_bytes = vec;
    plan_p->run = run;
    plan_p->entries = n;
    plan_p->blocks_x = (uint32_t) blocks_x;
    return KVS_OK;
}

extern "C" uint64_t kvs__copy_cuda_fastdiv_check(uint64_t seed, uint64_t iters)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    uint64_t bad = 0;
    static const uint32_t edge_d[] = {
        1,     2,     3,           7,           16,          255,         256,        1000,
        65535, 65536, 0x7fffffffu, 0x80000000u, 0x80000001u, 0xfffffffeu, 0xffffffffu};
    static const uint32_t edge_n[] = {
        0, 1, 2, 3, 255, 256, 65535, 65536, 0x7fffffffu, 0x80000000u, 0xfffffffeu, 0xffffffffu};
    for (uint64_t i = 0; i < iters + sizeof(edge_d) / sizeof(edge_d[0]); i++) {
        uint32_t d;
        if (i < sizeof(edge_d) / sizeof(edge_d[0]))
            d = edge_d[i];
        else if (kvs_rng_chance(&rng, 1, 2))
            d = (uint32_t) kvs_rng_range(&rng, 1, 4096);
        else
            d = (uint32_t) (kvs_rng_next(&rng) >> 32) | 1u;
        const fastdiv_t f = fastdiv_make(d);
        for (uint32_t k = 0; k < 64; k++) {
            uint32_t n;
            if (k < sizeof(edge_n) / sizeof(edge_n[0]))
                n = edge_n[k];
            else if (k < 40)
                n = (uint32_t) kvs_rng_next(&rng);
            else /* near multiples of d, where rounding errors would show */
                n = d * (uint32_t) kvs_rng_below(&rng, 0xffffffffu / d + 1) +
                    (uint32_t) kvs_rng_range(&rng, 0, 2) - 1;
            if (fastdiv_div(f, n) != n / d) {
                if (bad++ == 0)
                    fprintf(stderr, "fastdiv: %u / %u gave %u, want %u\n", n, d, fastdiv_div(f, n),
                            n / d);
            }
        }
    }
    return bad;
}

/* ---- the backend ---- */

namespace
{

struct slot_t {
    uint64_t ticket;  /* the launch last submitted through this slot; 0 = none yet */
    cudaEvent_t done; /* recorded after that launch */
    uint8_t *pinned;  /* [entries][pages] of that launch: the source of its upload */
    size_t cap;
    uint32_t copies;                /* copies in that launch */
    uint32_t csum_pending;          /* of them, checksums not yet handed to their callers */
    uint64_t *csum_out[MAX_BATCH];  /* the callers' checksums, written once it is done */
    uint64_t csum_bytes[MAX_BATCH]; /* each region's size */
};

struct cuda_ctx_t {
    int device;
    int async_alloc; /* the device has stream-ordered allocation (cudaMallocAsync) */
    cudaStream_t stream;
    uint8_t *scratch; /* device copy of the newest slot's table; stream order protects it */
    size_t scratch_cap;
    uint64_t issued;   /* last ticket handed out */
    uint64_t done;     /* every ticket <= done has finished */
    size_t inline_max; /* copies whose table fits go inline (INLINE_BYTES; 0 = never) */
    slot_t slots[NSLOTS];
    unsigned long long *csum_dev;      /* [NSLOTS][MAX_BATCH][CSUM_WORDS] checksum lanes */
    unsigned long long *csum_host;     /* [NSLOTS][MAX_BATCH] pinned and mapped: the last sums */
    unsigned long long *csum_host_dev; /* the same, as the device sees it */
    launch_inline_t params;            /* built here, snapshotted by the launch */
};

const char *dir_name(kvs_copy_dir_t dir)
{
    return dir == KVS_COPY_GATHER ? "gather" : "scatter";
}

/* Makes the backend's device current for the calls that need it (allocation, launches); the
 * caller's device is put back by device_leave. */
kvs_status_t device_enter(const cuda_ctx_t *c, int *prev_p)
{
    int prev = 0;
    kvs_status_t st = KVS_CUDA_CHECK(cudaGetDevice(&prev), "copy(cuda): current device");
    if (st != KVS_OK) return st;
    if (prev != c->device) {
        st = KVS_CUDA_CHECK(cudaSetDevice(c->device), "copy(cuda): device %d", c->device);
        if (st != KVS_OK) return st;
    }
    *prev_p = prev;
    return KVS_OK;
}

void device_leave(const cuda_ctx_t *c, int prev)
{
    if (prev != c->device) (void) cudaSetDevice(prev);
}

/* Power of two >= need, at least SLOT_MIN_BYTES. */
size_t grown(size_t need)
{
    size_t cap = SLOT_MIN_BYTES;
    while (cap < need) cap *= 2;
    return cap;
}

/* Hands every finished copy's checksum to its caller. */
void deliver_checksums(cuda_ctx_t *c)
{
    for (uint32_t i = 0; i < NSLOTS; i++) {
        slot_t *s = &c->slots[i];
        if (s->csum_pending == 0 || s->ticket > c->done) continue;
        for (uint32_t k = 0; k < s->copies; k++) {
            if (s->csum_out[k] == NULL) continue;
            const kvs_csum_t sums = {
                ((volatile unsigned long long *) c->csum_host)[(size_t) i * MAX_BATCH + k]};
            *s->csum_out[k] = kvs_csum_final(&sums, s->csum_bytes[k]);
            s->csum_out[k] = NULL;
        }
        s->csum_pending = 0;
    }
}

/* Waits for the slot's previous copy if it is still running (more than NSLOTS in flight):
 * its pinned bytes may still be on their way to the device. */
kvs_status_t slot_reclaim(cuda_ctx_t *c, slot_t *s)
{
    if (s->ticket != 0 && s->ticket > c->done) {
        kvs_status_t st = KVS_CUDA_CHECK(cudaEventSynchronize(s->done),
                                         "copy(cuda): waiting for copy %llu to free its slot",
                                         (unsigned long long) s->ticket);
        if (st != KVS_OK) return st;
        c->done = s->ticket; /* one stream: everything before it is done too */
    }
    deliver_checksums(c); /* before the slot's lanes are reused */
    return KVS_OK;
}

kvs_status_t slot_reserve(slot_t *s, size_t need)
{
    if (s->cap >= need) return KVS_OK;
    const size_t cap = grown(need);
    if (s->pinned != NULL) {
        (void) KVS_CUDA_CHECK(cudaFreeHost(s->pinned), "copy(cuda): pinned slot");
        s->pinned = NULL;
        s->cap = 0;
    }
    void *p = NULL;
    kvs_status_t st = KVS_CUDA_CHECK(cudaMallocHost(&p, cap),
                                     "copy(cuda): %zu bytes of pinned memory for a page list", cap);
    if (st != KVS_OK) return st;
    s->pinned = (uint8_t *) p;
    s->cap = cap;
    return KVS_OK;
}

/* Grows the device scratch in stream order: the old buffer is freed after the copies already
 * queued have read it, without waiting on the host (or, without stream-ordered allocation, by
 * draining the stream first). */
kvs_status_t scratch_reserve(cuda_ctx_t *c, size_t need)
{
    if (c->scratch_cap >= need) return KVS_OK;
    const size_t cap = grown(need);
    kvs_status_t st;
    void *p = NULL;
    if (c->async_alloc) {
        if (c->scratch != NULL) {
            st = KVS_CUDA_CHECK(cudaFreeAsync(c->scratch, c->stream), "copy(cuda): scratch");
            if (st != KVS_OK) return st;
        }
        c->scratch = NULL;
        c->scratch_cap = 0;
        st = KVS_CUDA_CHECK(cudaMallocAsync(&p, cap, c->stream),
                            "copy(cuda): %zu bytes of device scratch", cap);
    } else {
        st = KVS_CUDA_CHECK(cudaStreamSynchronize(c->stream), "copy(cuda): growing scratch");
        if (st != KVS_OK) return st;
        if (c->scratch != NULL) (void) KVS_CUDA_CHECK(cudaFree(c->scratch), "copy(cuda): scratch");
        c->scratch = NULL;
        c->scratch_cap = 0;
        st = KVS_CUDA_CHECK(cudaMalloc(&p, cap), "copy(cuda): %zu bytes of device scratch", cap);
    }
    if (st != KVS_OK) return st;
    c->scratch = (uint8_t *) p;
    c->scratch_cap = cap;
    return KVS_OK;
}

/* The kernel's view of each (layer, component) block. */
void fill_table(entry_t *table, const kvs_copy_desc_t *d, const kvs_cuda_plan_t *plan)
{
    for (uint32_t i = 0; i < plan->entries; i++) {
        const kvs_region_t *r = &d->regions[i];
        entry_t *e = &table[i];
        memset(e, 0, sizeof(*e));
        e->pool = kvs_region_addr(r, 0, 0, d->pool_head);
        e->block = block_ptr(d, i / d->components, i % d->components);
        e->page_stride = r->page_stride;
        e->token_stride = r->token_stride;
        e->head_stride = r->head_stride;
        const uint64_t run = run_bytes(d, r, plan->run) / plan->vec_bytes;
        e->run = fastdiv_make((uint32_t) run);
        e->units = (uint32_t) ((uint64_t) d->npages * d->page_size * d->heads * r->dim *
                               r->elem_bytes / plan->vec_bytes);
    }
}

/* n copies that differ only in their first pool head and their writer region: one launch,
 * copy 0's table and plan. */
struct group_t {
    const kvs_copy_desc_t *d; /* [n] */
    const kvs_cuda_plan_t *plan;
    uint32_t n;
};

/* Launches the group: with its table and page ids in the kernel parameters when they fit,
 * else uploaded through the slot's pinned buffer into the device scratch first. */
kvs_status_t enqueue(cuda_ctx_t *c, slot_t *s, kvs_copy_dir_t dir, const group_t *g)
{
    const kvs_copy_desc_t *d = g->d;
    const kvs_cuda_plan_t *plan = g->plan;
    const size_t table_bytes = (size_t) plan->entries * sizeof(entry_t);
    const size_t bytes = table_bytes + (size_t) d->npages * sizeof(uint32_t);
    const bool inl = bytes <= c->inline_max;
    launch_t p;
    memset(&p, 0, sizeof(p));
    p.heads = fastdiv_make(d->heads);
    p.page_size = fastdiv_make(d->page_size);
    for (uint32_t k = 0; k < g->n; k++) {
        p.region[k] = d[k].region;
        p.head_shift[k] = (int32_t) d[k].pool_head - (int32_t) d->pool_head;
    }
    void *args[1];
    kvs_status_t st;
    if (!inl) {
        st = slot_reserve(s, bytes);
        if (st != KVS_OK) return st;
        st = scratch_reserve(c, bytes);
        if (st != KVS_OK) return st;
    }
    uint8_t *table = inl ? c->params.data : s->pinned; /* [layers][components] */
    fill_table((entry_t *) table, d, plan);
    memcpy(table + table_bytes, d->pages, (size_t) d->npages * sizeof(uint32_t));
    if (inl) {
        args[0] = &c->params;
    } else {
        st = KVS_CUDA_CHECK(
            cudaMemcpyAsync(c->scratch, s->pinned, bytes, cudaMemcpyHostToDevice, c->stream),
            "copy(cuda): uploading the page list of a %s", dir_name(dir));
        if (st != KVS_OK) return st;
        p.entries = (const entry_t *) c->scratch;
        p.pages = (const uint32_t *) (c->scratch + table_bytes);
        args[0] = &p;
    }
    if (d->checksum != NULL) { /* every copy of a group has one, or none has */
        const size_t slot = (size_t) (s - c->slots);
        p.csum = c->csum_dev + slot * MAX_BATCH * CSUM_WORDS;
        p.csum_out = c->csum_host_dev + slot * MAX_BATCH;
    }
    if (inl) c->params.p = p;
    const dim3 grid(plan->blocks_x, plan->entries, g->n), block(THREADS);
    st = KVS_CUDA_CHECK(
        cudaLaunchKernel(pick_kernel(plan, dir, inl), grid, block, args, 0, c->stream),
        "copy(cuda): %s of %u x %u pages x %u tokens x %u heads (%u-byte vectors, grid %u x %u "
        "x %u%s)",
        dir_name(dir), g->n, d->npages, d->page_size, d->heads, plan->vec_bytes, plan->blocks_x,
        plan->entries, g->n, inl ? ", inline table" : "");
    return st;
}

/* Validates a copy and plans it (a zeroed plan for a copy of no pages). */
kvs_status_t prepare(kvs_copy_dir_t dir, const kvs_copy_desc_t *d, kvs_cuda_plan_t *plan)
{
    kvs_status_t st = kvs_copy_desc_validate(dir, d);
    if (st != KVS_OK) return st;
    if (kvs_copy_desc_tokens(d) != (uint64_t) d->npages * d->page_size) {
        /* The kernels map region tokens onto whole pages; partial pages (a page size per side,
         * protocol.md §1) are the CPU backend's for now. */
        kvs_error("copy(cuda): %s of %llu tokens from token %u of %u pages: partial pages are "
                  "not supported on the GPU yet (use equal page sizes on both sides)",
                  dir_name(dir), (unsigned long long) kvs_copy_desc_tokens(d), d->first_token,
                  d->npages);
        return KVS_ERR_UNSUPPORTED;
    }
    memset(plan, 0, sizeof(*plan));
    return d->npages > 0 ? kvs__copy_cuda_plan(d, plan) : KVS_OK;
}

/* Whether copy b can join group g: the same (layer, component) blocks of the same pool over the
 * same pages, walked the same way, only other heads into another region. */
bool joins(const group_t *g, const kvs_copy_desc_t *b, const kvs_cuda_plan_t *pb)
{
    const kvs_copy_desc_t *a = g->d;
    const kvs_cuda_plan_t *pa = g->plan;
    return g->n < MAX_BATCH && a->npages > 0 && b->regions == a->regions &&
           b->layers == a->layers && b->components == a->components && b->npages == a->npages &&
           b->page_size == a->page_size && b->heads == a->heads &&
           (b->checksum == NULL) == (a->checksum == NULL) && pb->vec_bytes == pa->vec_bytes &&
           pb->run == pa->run && pb->blocks_x == pa->blocks_x &&
           (b->pages == a->pages || memcmp(b->pages, a->pages, a->npages * sizeof(uint32_t)) == 0);
}

/* Launches one group (or nothing for a copy of no pages) and hands out its ticket. */
kvs_status_t submit_group(cuda_ctx_t *c, kvs_copy_dir_t dir, const group_t *g, uint64_t *ticket_p)
{
    int prev = 0;
    kvs_status_t st = device_enter(c, &prev);
    if (st != KVS_OK) return st;
    slot_t *s = &c->slots[(c->issued + 1) % NSLOTS];
    st = slot_reclaim(c, s);
    if (st == KVS_OK && g->d->npages > 0) st = enqueue(c, s, dir, g);
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaEventRecord(s->done, c->stream), "copy(cuda): %s completion event",
                            dir_name(dir));
    if (st == KVS_OK) {
        s->ticket = ++c->issued; /* one ticket per launch: done when all its copies are */
        *ticket_p = s->ticket;
        s->copies = g->n;
        s->csum_pending = 0;
        for (uint32_t k = 0; k < g->n; k++) {
            const kvs_copy_desc_t *d = &g->d[k];
            s->csum_out[k] = NULL;
            if (d->checksum == NULL) continue;
            const uint64_t bytes =
                kvs_copy_region_bytes(d->shape, d->heads, (uint64_t) d->npages * d->page_size);
            if (d->npages == 0) {
                const kvs_csum_t none = {0};
                *d->checksum = kvs_csum_final(&none, bytes);
            } else {
                s->csum_out[k] = d->checksum;
                s->csum_bytes[k] = bytes;
                s->csum_pending++;
            }
        }
    } else {
        /* Part of the copy may be queued: let it drain so the slot's pinned bytes are free
         * again before anyone reuses them. */
        (void) cudaStreamSynchronize(c->stream);
        (void) cudaGetLastError();
    }
    device_leave(c, prev);
    return st;
}

kvs_status_t cuda_submit_batch(void *ctx, kvs_copy_dir_t dir, const kvs_copy_desc_t *d, uint32_t n,
                               uint64_t *ticket_p)
{
    cuda_ctx_t *c = (cuda_ctx_t *) ctx;
    /* Every copy is checked and planned before any is launched: a refused one launches none. */
    kvs_cuda_plan_t stack[KVS_MAX_WRITERS]; /* a slot's writers; larger batches allocate */
    kvs_cuda_plan_t *plans =
        n <= KVS_MAX_WRITERS ? stack : (kvs_cuda_plan_t *) kvs_malloc(n * sizeof(*plans));
    if (plans == NULL) return KVS_ERR_NOMEM;
    kvs_status_t st = KVS_OK;
    for (uint32_t i = 0; i < n && st == KVS_OK; i++) st = prepare(dir, &d[i], &plans[i]);
    for (uint32_t i = 0; i < n && st == KVS_OK;) {
        group_t g = {&d[i], &plans[i], 1};
        while (i + g.n < n && joins(&g, &d[i + g.n], &plans[i + g.n])) g.n++;
        st = submit_group(c, dir, &g, ticket_p);
        i += g.n;
    }
    if (plans != stack) kvs_free(plans);
    return st;
}

kvs_status_t cuda_submit(void *ctx, kvs_copy_dir_t dir, const kvs_copy_desc_t *d,
                         uint64_t *ticket_p)
{
    return cuda_submit_batch(ctx, dir, d, 1, ticket_p);
}

kvs_status_t cuda_poll(void *ctx, uint64_t ticket)
{
    cuda_ctx_t *c = (cuda_ctx_t *) ctx;
    if (ticket == 0 || ticket > c->issued) {
        kvs_error("copy(cuda): poll of ticket %llu, never issued (last %llu)",
                  (unsigned long long) ticket, (unsigned long long) c->issued);
        return KVS_ERR_INVALID;
    }
    if (ticket <= c->done) {
        deliver_checksums(c);
        return KVS_OK;
    }
    /* A slot is reused only after its copy is known done, so a ticket not yet done still
     * owns its slot. Events can be queried from any current device. */
    const slot_t *s = &c->slots[ticket % NSLOTS];
    assert(s->ticket == ticket);
    const cudaError_t q = cudaEventQuery(s->done);
    if (q == cudaErrorNotReady) return KVS_INPROGRESS;
    if (q == cudaSuccess) {
        c->done = ticket;
        deliver_checksums(c);
        return KVS_OK;
    }
    return KVS_CUDA_CHECK(q, "copy(cuda): copy %llu on device %d failed",
                          (unsigned long long) ticket, c->device);
}

/* Frees what create made; safe on a partly built context. */
void release(cuda_ctx_t *c)
{
    int prev = c->device;
    const int entered = device_enter(c, &prev) == KVS_OK;
    if (c->stream != NULL) {
        (void) KVS_CUDA_CHECK(cudaStreamSynchronize(c->stream), "copy(cuda): draining copies");
        if (c->scratch != NULL)
            (void) KVS_CUDA_CHECK(c->async_alloc ? cudaFreeAsync(c->scratch, c->stream)
                                                 : cudaFree(c->scratch),
                                  "copy(cuda): scratch");
        (void) KVS_CUDA_CHECK(cudaStreamSynchronize(c->stream), "copy(cuda): freeing scratch");
        (void) KVS_CUDA_CHECK(cudaStreamDestroy(c->stream), "copy(cuda): stream");
    }
    if (c->csum_dev != NULL) (void) KVS_CUDA_CHECK(cudaFree(c->csum_dev), "copy(cuda): checksums");
    if (c->csum_host != NULL)
        (void) KVS_CUDA_CHECK(cudaFreeHost(c->csum_host), "copy(cuda): pinned checksums");
    for (uint32_t i = 0; i < NSLOTS; i++) {
        slot_t *s = &c->slots[i];
        if (s->done != NULL) (void) KVS_CUDA_CHECK(cudaEventDestroy(s->done), "copy(cuda): event");
        if (s->pinned != NULL)
            (void) KVS_CUDA_CHECK(cudaFreeHost(s->pinned), "copy(cuda): pinned slot");
    }
    if (entered) device_leave(c, prev);
    kvs_free(c);
}

void cuda_destroy(void *ctx)
{
    release((cuda_ctx_t *) ctx);
}

const kvs_copy_ops_t cuda_ops = {
    "cuda", cuda_submit, cuda_poll, cuda_destroy, cuda_submit_batch,
};

} // namespace

extern "C" int kvs_copy_cuda_available(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void) cudaGetLastError();
        return 0;
    }
    return n > 0;
}

extern "C" void *kvs_copy_cuda_stream(const kvs_copy_backend_t *b)
{
    if (b == NULL || b->ops != &cuda_ops) return NULL;
    return (void *) ((const cuda_ctx_t *) b->ctx)->stream;
}

extern "C" kvs_status_t kvs__copy_cuda_set_inline_max(const kvs_copy_backend_t *b, size_t bytes)
{
    if (b == NULL || b->ops != &cuda_ops) {
        kvs_error("copy(cuda): set_inline_max on a backend that is not CUDA");
        return KVS_ERR_INVALID;
    }
    ((cuda_ctx_t *) b->ctx)->inline_max = bytes < INLINE_BYTES ? bytes : INLINE_BYTES;
    return KVS_OK;
}

extern "C" kvs_status_t kvs_copy_cuda_create(int device, kvs_copy_backend_t *backend_p)
{
    int count = 0;
    kvs_status_t st = KVS_CUDA_CHECK(cudaGetDeviceCount(&count),
                                     "copy(cuda): device %d: no usable CUDA device", device);
    if (st != KVS_OK) return st;
    if (device < 0 || device >= count) {
        kvs_error("copy(cuda): no CUDA device %d (this machine has %d)", device, count);
        return KVS_ERR_INVALID;
    }
    cuda_ctx_t *c = (cuda_ctx_t *) kvs_calloc(1, sizeof(*c));
    if (c == NULL) {
        kvs_error("copy(cuda): out of memory creating the backend");
        return KVS_ERR_NOMEM;
    }
    c->device = device;
    c->inline_max = INLINE_BYTES;
    int prev = 0;
    st = device_enter(c, &prev);
    if (st != KVS_OK) {
        kvs_free(c);
        return st;
    }
    int pools = 0;
    st = KVS_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device),
                        "copy(cuda): device %d attributes", device);
    c->async_alloc = pools != 0;
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
                            "copy(cuda): stream on device %d", device);
    /* Cleared once here; after that each copy's last block leaves them cleared. */
    const size_t lanes = (size_t) NSLOTS * MAX_BATCH * CSUM_WORDS * sizeof(unsigned long long);
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMalloc((void **) &c->csum_dev, lanes),
                            "copy(cuda): checksum lanes on device %d", device);
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMemset(c->csum_dev, 0, lanes), "copy(cuda): checksum lanes");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaHostAlloc((void **) &c->csum_host,
                                          (size_t) NSLOTS * MAX_BATCH * sizeof(unsigned long long),
                                          cudaHostAllocMapped),
                            "copy(cuda): mapped checksum results");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaHostGetDevicePointer((void **) &c->csum_host_dev, c->csum_host, 0),
                            "copy(cuda): mapped checksum results");
    for (uint32_t i = 0; i < NSLOTS && st == KVS_OK; i++) {
        st = KVS_CUDA_CHECK(cudaEventCreateWithFlags(&c->slots[i].done, cudaEventDisableTiming),
                            "copy(cuda): event on device %d", device);
        if (st == KVS_OK) st = slot_reserve(&c->slots[i], SLOT_MIN_BYTES);
    }
    device_leave(c, prev);
    if (st != KVS_OK) {
        release(c);
        return st;
    }
    backend_p->ops = &cuda_ops;
    backend_p->ctx = c;
    return KVS_OK;
}
