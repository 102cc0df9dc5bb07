/* Paged causal attention kernels (attention.cuh says what they compute). Fragment layouts are
 * those of PTX's mma.m16n8k16 with bf16 inputs: lane = 4 * g + t; A (16 x 16, row major) holds
 * rows g and g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9; B (16 x 8) holds k rows 2t, 2t + 1
 * (and + 8) of column g; C (16 x 8, f32) rows g and g + 8, columns 2t, 2t + 1. An S tile's C
 * fragments are, two by two, the A fragments of P (the usual register reuse). */
#include <math.h>

#include "model/cuda/attention.cuh"

extern "C" {
#include "base/cuda_util.h"
}

namespace kvs_cuda
{
namespace
{

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four 8x8 b16 matrices, transposed, from shared memory: lanes 8i..8i+7 give matrix i's rows. */
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void *row)
{
    const uint32_t addr = (uint32_t) __cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ uint32_t ld32(const __nv_bfloat16 *p)
{
    return *reinterpret_cast<const uint32_t *>(p);
}

/* 16 bytes global -> shared without the registers; src_bytes 0 fills zeros (src unread). */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, uint32_t src_bytes)
{
    const uint32_t d = (uint32_t) __cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int HD> __host__ __device__ constexpr int tile_elems()
{
    return (int) ATTN_TILE * (HD + 8); /* padded rows: conflict-free fragment loads */
}

/* Shared memory of one block: two stages of a K tile and a V tile. */
template <int HD> __host__ __device__ constexpr size_t attention_smem()
{
    return 4 * (size_t) tile_elems<HD>() * sizeof(__nv_bfloat16);
}

/* Starts the copy of positions [kv0, kv0 + 64) of the block's KV head into one stage. */
template <int HD>
__device__ __forceinline__ void load_tile(const attn_args_t &a, const attn_work_t &w,
                                          const uint32_t *pt, uint32_t kv0, __nv_bfloat16 *ks,
                                          __nv_bfloat16 *vs)
{
    constexpr int LD = HD + 8, CHUNKS = HD / 8;
    for (int i = threadIdx.x; i < (int) ATTN_TILE * CHUNKS; i += THREADS) {
        const int p = i / CHUNKS, c = i % CHUNKS;
        const uint32_t kp = kv0 + p;
        const uint8_t *kb = a.k.base, *vb = a.v.base;
        uint32_t bytes = 0;
        if (kp < w.kv_end) {
            const uint64_t page = pt[kp / a.page_size], off = kp % a.page_size;
            kb += page * a.k.page_stride + off * a.k.token_stride +
                  (uint64_t) w.kvh * a.k.head_stride;
            vb += page * a.v.page_stride + off * a.v.token_stride +
                  (uint64_t) w.kvh * a.v.head_stride;
            bytes = 16;
        }
        cp_async16(&ks[p * LD + c * 8], kb + c * 16, bytes);
        cp_async16(&vs[p * LD + c * 8], vb + c * 16, bytes);
    }
}

template <int HD>
__global__ void __launch_bounds__(THREADS)
    attention_kernel(const attn_args_t a, const attn_work_t *__restrict__ works)
{
    constexpr int LD = HD + 8;
    extern __shared__ __align__(16) __nv_bfloat16 smem[];

    const attn_work_t w = works[blockIdx.x];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const uint32_t rows = w.ntok * a.group;
    const uint32_t r0 = warp * 16 + g, r1 = r0 + 8;
    const bool ok0 = r0 < rows, ok1 = r1 < rows;
    const uint32_t tok0 = w.tok0 + (ok0 ? r0 / a.group : 0),
                   head0 = w.qh0 + (ok0 ? r0 % a.group : 0);
    const uint32_t tok1 = w.tok0 + (ok1 ? r1 / a.group : 0),
                   head1 = w.qh0 + (ok1 ? r1 % a.group : 0);
    /* a row past the block's rows sees no position */
    const int64_t qpos0 = ok0 ? (int64_t) a.pos[tok0] : -1;
    const int64_t qpos1 = ok1 ? (int64_t) a.pos[tok1] : -1;
    const uint32_t *pt = a.pages + w.page_off;
    if (w.kv_begin < w.kv_end) load_tile<HD>(a, w, pt, w.kv_begin, smem, smem + tile_elems<HD>());
    cp_async_commit();

    uint32_t qa[HD / 16][4];
    {
        const __nv_bfloat16 *q0 = a.q + (size_t) tok0 * a.q_stride + (size_t) head0 * HD;
        const __nv_bfloat16 *q1 = a.q + (size_t) tok1 * a.q_stride + (size_t) head1 * HD;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            qa[kk][0] = ok0 ? ld32(q0 + kk * 16 + 2 * t) : 0u;
            qa[kk][1] = ok1 ? ld32(q1 + kk * 16 + 2 * t) : 0u;
            qa[kk][2] = ok0 ? ld32(q0 + kk * 16 + 8 + 2 * t) : 0u;
            qa[kk][3] = ok1 ? ld32(q1 + kk * 16 + 8 + 2 * t) : 0u;
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    int stage = 0;
    for (uint32_t kv0 = w.kv_begin; kv0 < w.kv_end; kv0 += ATTN_TILE, stage ^= 1) {
        /* the next tile streams in while this one is computed */
        if (kv0 + ATTN_TILE < w.kv_end)
            load_tile<HD>(a, w, pt, kv0 + ATTN_TILE, smem + (stage ^ 1) * 2 * tile_elems<HD>(),
                          smem + (stage ^ 1) * 2 * tile_elems<HD>() + tile_elems<HD>());
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const __nv_bfloat16 *ks = smem + stage * 2 * tile_elems<HD>();
        const __nv_bfloat16 *vs = ks + tile_elems<HD>();

        float s[ATTN_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < (int) ATTN_TILE / 8; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const __nv_bfloat16 *krow = &ks[(n * 8 + g) * LD];
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++)
                mma_bf16(s[n], qa[kk], ld32(krow + kk * 16 + 2 * t),
                         ld32(krow + kk * 16 + 8 + 2 * t));
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int n = 0; n < (int) ATTN_TILE / 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int64_t kp = (int64_t) kv0 + n * 8 + 2 * t + e;
                const bool in = kp < (int64_t) w.kv_end;
                s[n][e] = in && kp <= qpos0 ? s[n][e] * a.scale_log2 : -INFINITY;
                s[n][2 + e] = in && kp <= qpos1 ? s[n][2 + e] * a.scale_log2 : -INFINITY;
                mx0 = fmaxf(mx0, s[n][e]);
                mx1 = fmaxf(mx1, s[n][2 + e]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        /* a row that has seen no position yet keeps zeros: subtract 0, not -inf */
        const float u0 = mx0 == -INFINITY ? 0.0f : mx0, u1 = mx1 == -INFINITY ? 0.0f : mx1;
        const float f0 = exp2f(m0 - u0), f1 = exp2f(m1 - u1);
        m0 = mx0;
        m1 = mx1;
        l0 *= f0;
        l1 *= f1;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            o[n][0] *= f0;
            o[n][1] *= f0;
            o[n][2] *= f1;
            o[n][3] *= f1;
        }
#pragma unroll
        for (int n = 0; n < (int) ATTN_TILE / 8; n++) {
            s[n][0] = exp2f(s[n][0] - u0);
            s[n][1] = exp2f(s[n][1] - u0);
            s[n][2] = exp2f(s[n][2] - u1);
            s[n][3] = exp2f(s[n][3] - u1);
            l0 += s[n][0] + s[n][1];
            l1 += s[n][2] + s[n][3];
        }
#pragma unroll
        for (int kk = 0; kk < (int) ATTN_TILE / 16; kk++) {
            const uint32_t pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]),
                                    pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const int mat = lane / 8, row = kk * 16 + (mat & 1) * 8 + lane % 8;
#pragma unroll
            for (int n = 0; n < HD / 8; n += 2) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, &vs[row * LD + (n + (mat >> 1)) * 8]);
                mma_bf16(o[n], pa, b[0], b[1]);
                mma_bf16(o[n + 1], pa, b[2], b[3]);
            }
        }
        __syncthreads(); /* every warp is done with this stage before it is refilled */
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (w.part == ATTN_NO_PART) {
        const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
        __nv_bfloat16 *out0 = a.out + (size_t) tok0 * a.out_stride + (size_t) head0 * HD;
        __nv_bfloat16 *out1 = a.out + (size_t) tok1 * a.out_stride + (size_t) head1 * HD;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            if (ok0)
                *reinterpret_cast<uint32_t *>(out0 + n * 8 + 2 * t) =
                    pack_bf16(o[n][0] * i0, o[n][1] * i0);
            if (ok1)
                *reinterpret_cast<uint32_t *>(out1 + n * 8 + 2 * t) =
                    pack_bf16(o[n][2] * i1, o[n][3] * i1);
        }
        return;
    }
    float *po = a.part_o + (size_t) w.part * ATTN_ROWS * HD;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        *reinterpret_cast<float2 *>(po + (size_t) r0 * HD + n * 8 + 2 * t) =
            make_float2(o[n][0], o[n][1]);
        *reinterpret_cast<float2 *>(po + (size_t) r1 * HD + n * 8 + 2 * t) =
            make_float2(o[n][2], o[n][3]);
    }
    if (t == 0) {
        float *pm = a.part_ml + (size_t) w.part * ATTN_ROWS * 2;
        pm[r0 * 2] = m0;
        pm[r0 * 2 + 1] = l0;
        pm[r1 * 2] = m1;
        pm[r1 * 2 + 1] = l1;
    }
}

/* One block per row block: out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s. */
template <int HD>
__global__ void __launch_bounds__(256)
    combine_kernel(const attn_args_t a, const attn_combine_t *__restrict__ combines)
{
    const attn_combine_t c = combines[blockIdx.x];
    const uint32_t rows = c.ntok * a.group;
    for (uint32_t i = threadIdx.x; i < rows * HD; i += blockDim.x) {
        const uint32_t r = i / HD, d = i % HD;
        float mx = -INFINITY;
        for (uint32_t s = 0; s < c.nsplit; s++)
            mx = fmaxf(mx, a.part_ml[((size_t) (c.part0 + s) * ATTN_ROWS + r) * 2]);
        const float u = mx == -INFINITY ? 0.0f : mx;
        float num = 0.0f, den = 0.0f;
        for (uint32_t s = 0; s < c.nsplit; s++) {
            const size_t slot = (size_t) (c.part0 + s) * ATTN_ROWS + r;
            const float f = exp2f(a.part_ml[slot * 2] - u);
            den += f * a.part_ml[slot * 2 + 1];
            num += f * a.part_o[slot * HD + d];
        }
        const uint32_t tok = c.tok0 + r / a.group, head = c.qh0 + r % a.group;
        a.out[(size_t) tok * a.out_stride + (size_t) head * HD + d] =
            __float2bfloat16(den > 0.0f ? num / den : 0.0f);
    }
}

template <int HD>
kvs_status_t launch(const attn_args_t &a, const attn_work_t *work, uint32_t nwork,
                    const attn_combine_t *combine, uint32_t ncombine, cudaStream_t stream)
{
    static int configured; /* per process: the attribute is a property of the function */
    if (!configured) {
        kvs_status_t st = KVS_CUDA_CHECK(
            cudaFuncSetAttribute(attention_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int) attention_smem<HD>()),
            "model(cuda): attention's %zu bytes of shared memory", attention_smem<HD>());
        if (st != KVS_OK) return st;
        configured = 1;
    }
    if (nwork > 0) attention_kernel<HD><<<nwork, THREADS, attention_smem<HD>(), stream>>>(a, work);
    if (ncombine > 0) combine_kernel<HD><<<ncombine, 256, 0, stream>>>(a, combine);
    return KVS_CUDA_CHECK(cudaGetLastError(), "model(cuda): attention over %u blocks", nwork);
}

} // namespace

kvs_status_t attention_launch(const attn_args_t &a, uint32_t head_dim, const attn_work_t *work,
                              uint32_t nwork, const attn_combine_t *combine, uint32_t ncombine,
                              cudaStream_t stream)
{
    switch (head_dim) {
    case 64:
        return launch<64>(a, work, nwork, combine, ncombine, stream);
    case 128:
        return launch<128>(a, work, nwork, combine, ncombine, stream);
    default:
        kvs_error("model(cuda): attention for head dim %u is not built (64 and 128 are)", head_dim);
        return KVS_ERR_UNSUPPORTED;
    }
}

} // namespace kvs_cuda
