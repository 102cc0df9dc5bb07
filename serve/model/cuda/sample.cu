/* Token sampling on the device (sample.cuh). */
#include "model/cuda/sample.cuh"

extern "C" {
#include "base/cuda_util.h"
}

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <math.h>

namespace kvs_cuda
{
namespace
{

constexpr int THREADS = 1024;
constexpr double FIXED_ONE = 0x1p40; /* the top token's weight, 1, in fixed point */

/* sample.c's order-preserving key, with -0 as +0 (they compare equal, so a cut keeps both). */
__device__ __forceinline__ uint32_t float_key(float f)
{
    uint32_t b = __float_as_uint(f);
    if (b == 0x80000000u) b = 0;
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

__device__ __forceinline__ float key_float(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

struct amax_t {
    float v;
    uint32_t i; /* UINT32_MAX: none */
};

/* The larger logit, the lower id on ties: sample.c's argmax in any order of combination. */
struct amax_op {
    __device__ __forceinline__ amax_t operator()(const amax_t &a, const amax_t &b) const
    {
        if (a.i == UINT32_MAX) return b;
        if (b.i == UINT32_MAX) return a;
        return b.v > a.v || (b.v == a.v && b.i < a.i) ? b : a;
    }
};

struct min_op {
    __device__ __forceinline__ float operator()(float a, float b) const
    {
        return b < a ? b : a;
    }
};

typedef cub::BlockReduce<amax_t, THREADS> reduce_max_t;
typedef cub::BlockReduce<unsigned long long, THREADS> reduce_sum_t;
typedef cub::BlockReduce<float, THREADS> reduce_min_t;
typedef cub::BlockScan<unsigned long long, THREADS> scan_t;

struct shared_t {
    union {
        reduce_max_t::TempStorage max;
        reduce_sum_t::TempStorage sum;
        reduce_min_t::TempStorage min;
        scan_t::TempStorage scan;
    } tmp;
    unsigned long long hist[256];
    unsigned long long u64;
    uint32_t prefix;
    float f32;
    amax_t best;
};

/* Sum over the block, the same in every thread. */
__device__ unsigned long long block_sum(shared_t &sh, unsigned long long v)
{
    v = reduce_sum_t(sh.tmp.sum).Sum(v);
    if (threadIdx.x == 0) sh.u64 = v;
    __syncthreads();
    v = sh.u64;
    __syncthreads();
    return v;
}

/* The key of the highest logit c >= low such that the count (w NULL) or fixed-point mass w of
 * the logits >= c reaches target (> 0; the logits >= low must reach it). */
__device__ uint32_t radix_cut(shared_t &sh, const float *lg, const unsigned long long *w,
                              uint32_t vocab, float low, unsigned long long target)
{
    uint32_t prefix = 0;
    unsigned long long above = 0; /* the count or mass of the keys above the prefix's bins */
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += THREADS) sh.hist[b] = 0;
        __syncthreads();
        const uint32_t high = shift == 24 ? 0 : ~0u << (shift + 8);
        for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) {
            const float l = lg[i];
            if (!(l >= low)) continue;
            const uint32_t k = float_key(l);
            if ((k & high) != (prefix & high)) continue;
            atomicAdd(&sh.hist[(k >> shift) & 255], w != NULL ? w[i] : 1ull);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int b = 255;
            for (; b > 0 && above + sh.hist[b] < target; b--) above += sh.hist[b];
            sh.prefix = prefix | (uint32_t) b << shift;
            sh.u64 = above;
        }
        __syncthreads();
        prefix = sh.prefix;
        above = sh.u64;
        __syncthreads();
    }
    return prefix;
}

__global__ void __launch_bounds__(THREADS)
    sample_kernel(const float *logits, uint32_t vocab, const sample_row_t *rows,
                  unsigned long long *scratch, uint32_t *tokens)
{
    __shared__ shared_t sh;
    const sample_row_t R = rows[blockIdx.x];
    const float *lg = logits + (size_t) R.row * vocab;
    unsigned long long *wfx = scratch + (size_t) blockIdx.x * vocab;

    amax_t m = {0.0f, UINT32_MAX};
    for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) {
        const float l = lg[i];
        if (!isnan(l)) m = amax_op()(m, amax_t{l, i});
    }
    m = reduce_max_t(sh.tmp.max).Reduce(m, amax_op());
    if (threadIdx.x == 0) sh.best = m;
    __syncthreads();
    m = sh.best;
    __syncthreads();
    const uint32_t best = m.i == UINT32_MAX ? 0 : m.i;
    if (!(R.temperature > 0.0f) || m.i == UINT32_MAX || !isfinite(m.v)) {
        if (threadIdx.x == 0) tokens[blockIdx.x] = best;
        return;
    }
    const float max = m.v;
    const double inv_temp = 1.0 / R.temperature;

    float cut = -INFINITY;
    if (R.top_k > 0) {
        unsigned long long n = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) n += !isnan(lg[i]);
        if (block_sum(sh, n) > R.top_k)
            cut = key_float(radix_cut(sh, lg, NULL, vocab, cut, R.top_k));
    }
    /* the weights of the survivors, and min-p's lowest logit that is still likely enough */
    float low = max;
    for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) {
        const float l = lg[i];
        unsigned long long fx = 0;
        if (l >= cut) {
            const double w = exp(((double) l - (double) max) * inv_temp);
            fx = __double2ull_rn(w * FIXED_ONE);
            if (l < low && w >= R.min_p) low = l;
        }
        wfx[i] = fx;
    }
    if (R.min_p > 0.0f) {
        low = reduce_min_t(sh.tmp.min).Reduce(low, min_op());
        if (threadIdx.x == 0) sh.f32 = low;
        __syncthreads();
        cut = sh.f32;
        __syncthreads();
    } else {
        __syncthreads(); /* wfx written */
    }
    if (!(R.top_p >= 1.0f)) {
        unsigned long long total = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += THREADS)
            if (lg[i] >= cut) total += wfx[i];
        total = block_sum(sh, total);
        const unsigned long long target =
            R.top_p > 0.0f ? (unsigned long long) ((double) R.top_p * (double) total) : 0;
        /* a tiny target keeps the top logit alone */
        cut = target == 0 ? max : key_float(radix_cut(sh, lg, wfx, vocab, cut, target));
    }

    /* the draw, walked in id order: each thread sums a contiguous range, a scan places them */
    const uint32_t per = (vocab + THREADS - 1) / THREADS;
    const uint32_t i0 = threadIdx.x * per < vocab ? threadIdx.x * per : vocab;
    const uint32_t i1 = i0 + per < vocab ? i0 + per : vocab;
    unsigned long long mine = 0;
    for (uint32_t i = i0; i < i1; i++)
        if (lg[i] >= cut) mine += wfx[i];
    unsigned long long before = 0, kept = 0;
    scan_t(sh.tmp.scan).ExclusiveSum(mine, before, kept);
    unsigned long long r = (unsigned long long) (R.draw * (double) kept);
    if (r >= kept) r = kept - 1; /* kept >= 1: the top token weighs 2^40 */
    if (before <= r && r < before + mine) {
        unsigned long long acc = before;
        for (uint32_t i = i0; i < i1; i++) {
            if (!(lg[i] >= cut)) continue;
            acc += wfx[i];
            if (r < acc) {
                tokens[blockIdx.x] = i;
                break;
            }
        }
    }
}

} // namespace

size_t sample_scratch_bytes(uint32_t rows, uint32_t vocab)
{
    return (size_t) rows * vocab * sizeof(unsigned long long);
}

kvs_status_t sample_launch(const float *logits, uint32_t vocab, const sample_row_t *rows,
                           uint32_t nrows, void *scratch, uint32_t *tokens, cudaStream_t stream)
{
    if (nrows == 0) return KVS_OK;
    /* A runtime call that failed earlier in this thread (and was answered there) leaves its
     * error as the last one; clear it so that the check below sees this launch's alone. */
    (void) cudaGetLastError();
    sample_kernel<<<nrows, THREADS, 0, stream>>>(logits, vocab, rows,
                                                 (unsigned long long *) scratch, tokens);
    return KVS_CUDA_CHECK(cudaGetLastError(), "model(cuda): sampling %u rows", nrows);
}

} // namespace kvs_cuda
