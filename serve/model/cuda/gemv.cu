/* One-token projections with the step before them fused in (gemv.cuh). */
#include "model/cuda/gemv.cuh"

extern "C" {
#include "base/cuda_util.h"
#include "kvstage/log.h"
}

namespace kvs_cuda
{
namespace
{

constexpr int THREADS = 256, WARPS = THREADS / 32, UNROLL = 4;

/* The input row as bf16 in xs[in]. */
__device__ void prepare_row(const gemv_args_t &a, __nv_bfloat16 *xs, float *part)
{
    const uint32_t in = a.in;
    if (a.input == GEMV_BF16) {
        const uint4 *src = reinterpret_cast<const uint4 *>(a.x);
        for (uint32_t i = threadIdx.x; i < in / 8; i += THREADS)
            reinterpret_cast<uint4 *>(xs)[i] = src[i];
    } else if (a.input == GEMV_SILU) {
        const __nv_bfloat16 *gu = reinterpret_cast<const __nv_bfloat16 *>(a.x);
        for (uint32_t i = threadIdx.x; i < in; i += THREADS) {
            const float g = __bfloat162float(gu[i]), u = __bfloat162float(gu[in + i]);
            xs[i] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
        }
    } else {
        /* rmsnorm_kernel's arithmetic, step for step (256 threads) */
        const float *xr = reinterpret_cast<const float *>(a.x) + (size_t) (a.row ? *a.row : 0) * in;
        float ss = 0.0f;
        for (uint32_t i = threadIdx.x; i < in; i += THREADS) ss += xr[i] * xr[i];
        for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
        __syncthreads();
        if (threadIdx.x < 32) {
            ss = threadIdx.x < WARPS ? part[threadIdx.x] : 0.0f;
            for (int o = 4; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (threadIdx.x == 0) part[0] = ss;
        }
        __syncthreads();
        const float inv = rsqrtf(part[0] / (float) in + a.eps);
        for (uint32_t i = threadIdx.x; i < in; i += THREADS)
            xs[i] = __float2bfloat16(xr[i] * inv * a.norm_w[i]);
    }
    __syncthreads();
}

__global__ void __launch_bounds__(THREADS) gemv_kernel(const gemv_args_t a)
{
    extern __shared__ uint4 smem[];
    __shared__ float part[WARPS];
    __nv_bfloat16 *xs = reinterpret_cast<__nv_bfloat16 *>(smem);
    prepare_row(a, xs, part);
    const uint32_t nv = a.in / 8, lane = threadIdx.x % 32;
    const uint4 *xv = smem;
    for (uint32_t row = blockIdx.x * WARPS + threadIdx.x / 32; row < a.out;
         row += gridDim.x * WARPS) {
        const uint4 *wr = reinterpret_cast<const uint4 *>(a.w) + (size_t) row * nv;
        float acc = 0.0f;
        for (uint32_t v = lane; v < nv; v += 32 * UNROLL) {
            uint4 wv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                wv[u] = v + u * 32 < nv ? __ldcs(wr + v + u * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                if (v + u * 32 >= nv) break;
                const uint4 xq = xv[v + u * 32];
                const __nv_bfloat162 *wh = reinterpret_cast<const __nv_bfloat162 *>(&wv[u]);
                const __nv_bfloat162 *xh = reinterpret_cast<const __nv_bfloat162 *>(&xq);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 wf = __bfloat1622float2(wh[e]), xf = __bfloat1622float2(xh[e]);
                    acc += wf.x * xf.x + wf.y * xf.y;
                }
            }
        }
        for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) {
            if (!a.y_f32)
                reinterpret_cast<__nv_bfloat16 *>(a.y)[row] = __float2bfloat16(acc);
            else if (a.accumulate)
                reinterpret_cast<float *>(a.y)[row] += acc;
            else
                reinterpret_cast<float *>(a.y)[row] = acc;
        }
    }
}

} // namespace

kvs_status_t gemv_prepare(void)
{
    return KVS_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int) (GEMV_MAX_IN * sizeof(__nv_bfloat16))),
                          "model(cuda): one-token projection shared memory");
}

kvs_status_t gemv_launch(const gemv_args_t &a, int sms, cudaStream_t stream)
{
    if (a.in % 8 != 0 || a.in > GEMV_MAX_IN || a.out == 0 || (a.accumulate && !a.y_f32)) {
        kvs_error("model(cuda): a one-token projection of [%u x %u] is not supported", a.out, a.in);
        return KVS_ERR_UNSUPPORTED;
    }
    const size_t smem = (size_t) a.in * sizeof(__nv_bfloat16);
    /* whole rows per warp; at most 8 blocks of 256 per SM, each preparing the row once */
    uint32_t blocks = (a.out + WARPS - 1) / WARPS;
    const uint32_t cap = (uint32_t) (sms > 0 ? sms : 1) * 8;
    if (blocks > cap) blocks = cap;
    gemv_kernel<<<blocks, THREADS, smem, stream>>>(a);
    return KVS_OK;
}

} // namespace kvs_cuda
