/* One-token projections on the device (internal to the CUDA model backend): y = W x for a single
 * input row, with the small step before it fused into the kernel so that a decode step at batch
 * 1 is the weights' read and little else.
 *
 * W is bf16 [out][in] (row-major, in a multiple of 8), read once with streaming loads: every
 * warp takes whole rows, its lanes 16-byte vectors of them, four in flight per lane; each warp
 * issues its first loads before its block prepares the input row in shared memory as bf16, so
 * the weights stream while it is prepared. The input is one of:
 *   GEMV_BF16   a bf16 row (the attention output, the SwiGLU output);
 *   GEMV_NORM   an f32 residual row, RMS-normalised and scaled by a weight: the same floats as
 *               the model's rmsnorm kernel gives (the same reduction over 256 threads).
 * The output is f32 (optionally added to what is there) or bf16; with swiglu, W is the fused
 * gate/up matrix [2 f][in] and each warp takes rows j and f + j to write silu(gate) * up [f] in
 * bf16, the SwiGLU kernel's arithmetic on the bf16-rounded gate and up. One token at a time the
 * kernel is faster than cuBLAS's (H200: 2.7 vs 2.1 TB/s on a 4096 x 4096 matrix, 4.0 vs 3.7 on
 * 28672 x 4096) and spares the launches of the steps it absorbs; for several tokens cuBLAS is
 * faster. */
#ifndef KVSTAGE_MODEL_CUDA_GEMV_CUH
#define KVSTAGE_MODEL_CUDA_GEMV_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "kvstage/status.h"
}

namespace kvs_cuda
{

enum gemv_input_t { GEMV_BF16, GEMV_NORM };

struct gemv_args_t {
    const __nv_bfloat16 *w; /* [out][in] */
    uint32_t in, out;
    gemv_input_t input;
    const void *x;       /* bf16 [in], or f32 [rows][in] (NORM) */
    const uint32_t *row; /* NORM: the row of x to take (x + *row * in), device; NULL: 0 */
    const float *norm_w; /* NORM: [in] */
    float eps;           /* NORM */
    void *y;             /* [out] */
    int y_f32;           /* 1: float, 0: bf16 */
    int accumulate;      /* f32 only: y += W x */
    int swiglu;          /* NORM into bf16 only: W is [2 f][in], y [f] = silu(gate) * up */
};

/* 1 / sqrt(mean square of xr[dim] + eps), summed by a block of 256 threads in one fixed
 * order (part: 8 floats of shared memory): the model's RMSNorm kernel and the one-token
 * projections' fused norm share it, so both give the same floats. */
__device__ __forceinline__ float rms_scale(const float *xr, uint32_t dim, float eps, float *part)
{
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        ss = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.0f;
        for (int o = 4; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (threadIdx.x == 0) part[0] = ss;
    }
    __syncthreads();
    return rsqrtf(part[0] / (float) dim + eps);
}

/* SwiGLU of one element, silu(gate) * up, shared by the model's kernel and the fused one. */
__device__ __forceinline__ float swiglu(float g, float u)
{
    return g / (1.0f + expf(-g)) * u;
}

/* Largest `in` the shared-memory row holds (bf16). */
constexpr uint32_t GEMV_MAX_IN = 32768;

/* Once per device (the current one), before the first launch: lets the kernel's shared row
 * grow past 48 KiB. */
kvs_status_t gemv_prepare(void);
kvs_status_t gemv_launch(const gemv_args_t &a, int sms, cudaStream_t stream);

} // namespace kvs_cuda

#endif
