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
template <gemv_input_t INPUT>
__device__ void prepare_row(const gemv_args_t &a, __nv_bfloat16 *xs, float *part)
{
    const uint32_t in = a.in;
    if (INPUT == GEMV_BF16) {
        const uint4 *src = reinterpret_cast<const uint4 *>(a.x);
        for (uint32_t i = threadIdx.x; i < in / 8; i += THREADS)
            reinterpret_cast<uint4 *>(xs)[i] = src[i];
    } else {
        const float *xr = reinterpret_cast<const float *>(a.x) + (size_t) (a.row ? *a.row : 0) * in;
        const float inv = rms_scale(xr, in, a.eps, part); /* as the RMSNorm kernel */
        for (uint32_t i = threadIdx.x; i < in; i += THREADS)
            xs[i] = __float2bfloat16(xr[i] * inv * a.norm_w[i]);
    }
    __syncthreads();
}

/* R rows of a warp (SwiGLU: gate row j and up row f + j) against the shared row: each lane's
 * dot products over the 16-byte vectors v, v + 32, ... The first UNROLL vectors of the first
 * rows were loaded before the row was prepared (w0), so the weights stream from the start. */
template <int R>
__device__ __forceinline__ void dot_rows(const uint4 *const wr[R], const uint4 *xv, uint32_t nv,
                                         uint32_t lane, uint4 (&w0)[R][UNROLL], bool preloaded,
                                         float (&acc)[R])
{
    for (uint32_t v = lane; v < nv; v += 32 * UNROLL) {
        uint4 wv[R][UNROLL];
        if (preloaded) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int u = 0; u < UNROLL; u++) wv[r][u] = w0[r][u];
            preloaded = false;
        } else {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
                    wv[r][u] =
                        v + u * 32 < nv ? __ldcs(wr[r] + v + u * 32) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (v + u * 32 >= nv) break;
            const uint4 xq = xv[v + u * 32];
            const __nv_bfloat162 *xh = reinterpret_cast<const __nv_bfloat162 *>(&xq);
#pragma unroll
            for (int r = 0; r < R; r++) {
                const __nv_bfloat162 *wh = reinterpret_cast<const __nv_bfloat162 *>(&wv[r][u]);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 wf = __bfloat1622float2(wh[e]), xf = __bfloat1622float2(xh[e]);
                    acc[r] += wf.x * xf.x + wf.y * xf.y;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
        for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}

template <gemv_input_t INPUT, bool SWIGLU>
__global__ void __launch_bounds__(THREADS) gemv_kernel(const gemv_args_t a)
{
    constexpr int R = SWIGLU ? 2 : 1;
    extern __shared__ uint4 smem[];
    __shared__ float part[WARPS];
    const uint32_t nv = a.in / 8, lane = threadIdx.x % 32;
    const uint32_t rows = SWIGLU ? a.out / 2 : a.out; /* SwiGLU: output j from rows j, j + f */
    const uint32_t stride = gridDim.x * WARPS;
    uint32_t row = blockIdx.x * WARPS + threadIdx.x / 32;
    const uint4 *wr[R];
    uint4 w0[R][UNROLL];
    if (row < rows) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            wr[r] = reinterpret_cast<const uint4 *>(a.w) + (size_t) (row + r * rows) * nv;
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                w0[r][u] =
                    lane + u * 32 < nv ? __ldcs(wr[r] + lane + u * 32) : make_uint4(0, 0, 0, 0);
        }
    }
    prepare_row<INPUT>(a, reinterpret_cast<__nv_bfloat16 *>(smem), part);
    for (bool first = true; row < rows; row += stride, first = false) {
#pragma unroll
        for (int r = 0; r < R; r++)
            wr[r] = reinterpret_cast<const uint4 *>(a.w) + (size_t) (row + r * rows) * nv;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] = 0.0f;
        dot_rows<R>(wr, smem, nv, lane, w0, first, acc);
        if (lane != 0) continue;
        if (SWIGLU) {
            /* the SwiGLU kernel's arithmetic on the bf16-rounded gate and up */
            const float g = __bfloat162float(__float2bfloat16(acc[0]));
            const float u = __bfloat162float(__float2bfloat16(acc[1]));
            reinterpret_cast<__nv_bfloat16 *>(a.y)[row] = __float2bfloat16(swiglu(g, u));
        } else if (!a.y_f32) {
            reinterpret_cast<__nv_bfloat16 *>(a.y)[row] = __float2bfloat16(acc[0]);
        } else if (a.accumulate) {
            reinterpret_cast<float *>(a.y)[row] += acc[0];
        } else {
            reinterpret_cast<float *>(a.y)[row] = acc[0];
        }
    }
}

template <gemv_input_t INPUT, bool SWIGLU> kvs_status_t allow_smem(void)
{
    return KVS_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<INPUT, SWIGLU>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int) (GEMV_MAX_IN * sizeof(__nv_bfloat16))),
                          "model(cuda): one-token projection shared memory");
}

} // namespace

kvs_status_t gemv_prepare(void)
{
    kvs_status_t st = allow_smem<GEMV_BF16, false>();
    if (st == KVS_OK) st = allow_smem<GEMV_NORM, false>();
    if (st == KVS_OK) st = allow_smem<GEMV_NORM, true>();
    return st;
}

kvs_status_t gemv_launch(const gemv_args_t &a, int sms, cudaStream_t stream)
{
    if (a.in % 8 != 0 || a.in > GEMV_MAX_IN || a.out == 0 || (a.accumulate && !a.y_f32) ||
        (a.swiglu && (a.out % 2 != 0 || a.y_f32 || a.input != GEMV_NORM))) {
        kvs_error("model(cuda): a one-token projection of [%u x %u] is not supported", a.out, a.in);
        return KVS_ERR_UNSUPPORTED;
    }
    const size_t smem = (size_t) a.in * sizeof(__nv_bfloat16);
    const uint32_t rows = a.swiglu ? a.out / 2 : a.out;
    const void *k = a.swiglu               ? (const void *) gemv_kernel<GEMV_NORM, true>
                    : a.input == GEMV_NORM ? (const void *) gemv_kernel<GEMV_NORM, false>
                                           : (const void *) gemv_kernel<GEMV_BF16, false>;
    /* Whole rows per warp, and no more blocks than fit on the GPU at once (registers and shared
     * memory decide: 2 to 4 per SM here), each preparing the row once and then streaming rows
     * to the end. A grid of several waves (it was up to 8 blocks per SM) prepared the row again
     * in every wave, with the weights idle meanwhile: 8B decode at batch 1 took 5.41 ms that
     * way, 5.01-5.06 ms this way (H200). */
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, THREADS, smem) != cudaSuccess ||
        per_sm < 1)
        per_sm = 1;
    uint32_t blocks = (rows + WARPS - 1) / WARPS;
    const uint32_t cap = (uint32_t) (sms > 0 ? sms : 1) * (uint32_t) per_sm;
    if (blocks > cap) blocks = cap;
    void *args[] = {(void *) &a};
    return KVS_CUDA_CHECK(cudaLaunchKernel(k, dim3(blocks), dim3(THREADS), args, smem, stream),
                          "model(cuda): one-token projection launch");
}

} // namespace kvs_cuda
