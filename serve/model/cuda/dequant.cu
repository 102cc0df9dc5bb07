/* GGUF weights decoded on the device at model load (model_cuda.h, kvs__model_cuda_put_raw): a
 * shard's raw blocks go to the GPU through a pair of pinned staging buffers, a bounded piece at
 * a time (the host copies piece k + 1 out of the mapped file while the GPU copies in and decodes
 * piece k), and a kernel decodes them into the bf16 matrix or f32 vector in place.
 *
 * The floats are kvs_dequant_blocks' (quant.c) bit for bit: the same integer conversions of the
 * f16 and bf16 fields, and the same products and sums rounded one at a time (__fmul_rn and
 * __fadd_rn, which nvcc never contracts into an FMA; the host build has no FMA either, x86-64
 * without -mfma). Matrices are then rounded to bf16 by kvs_f32_to_bf16's integer rule. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "model/cuda/dequant.cuh"

extern "C" {
#include "base/cuda_util.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "model/quant.h"
}

/* Each staging buffer (one pinned, one device, twice over) holds at least this much, and at
 * least one row's blocks. */
#define STAGE_BYTES ((size_t) 8 << 20)

struct kvs_model_cuda_loader {
    kvs_model_cuda_t *c;
    int device;       /* -1 until the buffers are made */
    size_t cap;       /* bytes of each buffer below */
    uint8_t *host[2]; /* pinned */
    uint8_t *dev[2];
    cudaEvent_t copied[2]; /* host[k]'s last copy to the device is done */
    int next;              /* the pair the next piece uses */
};

/* Every kernel is in kvs_cuda (a sanitizer can pick them by that name). */
namespace kvs_cuda
{
namespace
{

__device__ __forceinline__ uint32_t ld_u16(const uint8_t *p)
{
    return (uint32_t) p[0] | (uint32_t) p[1] << 8;
}

__device__ __forceinline__ uint32_t ld_u32(const uint8_t *p)
{
    return ld_u16(p) | ld_u16(p + 2) << 16;
}

/* kvs_f16_to_f32: exact, NaN payloads kept. */
__device__ __forceinline__ float f16_to_f32(uint32_t h)
{
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp != 0) return __uint_as_float(sign | ((exp + 127 - 15) << 23) | (man << 13));
    if (man == 0) return __uint_as_float(sign);
    /* subnormal: shift the leading one (bit 31 - clz) up to bit 10 */
    const uint32_t s = (uint32_t) __clz(man) - 21;
    return __uint_as_float(sign | ((127 - 14 - s) << 23) | (((man << s) & 0x3ffu) << 13));
}

/* kvs_f32_to_bf16: round to nearest even, a NaN made quiet. */
__device__ __forceinline__ uint16_t f32_to_bf16(float f)
{
    const uint32_t x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t) ((x >> 16) | 0x40u);
    return (uint16_t) ((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Element e of a row of blocks of type T (quant.h has the layouts). */
template <int T> __device__ __forceinline__ float element(const uint8_t *row, uint64_t e)
{
    if constexpr (T == KVS_GGML_F32) {
        return __uint_as_float(ld_u32(row + 4 * e));
    } else if constexpr (T == KVS_GGML_F16) {
        return f16_to_f32(ld_u16(row + 2 * e));
    } else if constexpr (T == KVS_GGML_BF16) {
        return __uint_as_float(ld_u16(row + 2 * e) << 16);
    } else if constexpr (T == KVS_GGML_Q8_0) {
        const uint8_t *b = row + e / KVS_QK * KVS_Q8_0_BYTES;
        const float d = f16_to_f32(ld_u16(b));
        return __fmul_rn((float) (int8_t) b[2 + e % KVS_QK], d);
    } else {
        const uint32_t j = (uint32_t) (e % KVS_QK);
        const int q1 = T == KVS_GGML_Q4_1;
        const uint8_t *b = row + e / KVS_QK * (q1 ? KVS_Q4_1_BYTES : KVS_Q4_0_BYTES);
        const uint8_t byte = b[(q1 ? 4 : 2) + j % (KVS_QK / 2)];
        const int q = j < KVS_QK / 2 ? byte & 0x0f : byte >> 4;
        const float d = f16_to_f32(ld_u16(b));
        if (q1) return __fadd_rn(__fmul_rn(d, (float) q), f16_to_f32(ld_u16(b + 2)));
        return __fmul_rn((float) (q - 8), d);
    }
}

/* dst[r][c] (bf16 bits, or f32) = element skip + c of staged row r, for r < nrows, c < ncols:
 * src is [nrows][row_bytes], each row the blocks that cover its slice. */
template <int T>
__global__ void dequant_kernel(const uint8_t *src, uint64_t row_bytes, uint32_t skip,
                               uint64_t nrows, uint64_t ncols, __nv_bfloat16 *dst_b, float *dst_f)
{
    const uint64_t count = nrows * ncols;
    for (uint64_t i = blockIdx.x * (uint64_t) blockDim.x + threadIdx.x; i < count;
         i += (uint64_t) gridDim.x * blockDim.x) {
        const uint64_t r = i / ncols, c = i % ncols;
        const float v = element<T>(src + r * row_bytes, skip + c);
        if (dst_b != NULL)
            dst_b[i] = __ushort_as_bfloat16(f32_to_bf16(v));
        else
            dst_f[i] = v;
    }
}

void launch(kvs_ggml_type_t type, const uint8_t *src, uint64_t row_bytes, uint32_t skip,
            uint64_t nrows, uint64_t ncols, __nv_bfloat16 *dst_b, float *dst_f, cudaStream_t stream)
{
    const uint64_t count = nrows * ncols;
    const uint64_t want = (count + 255) / 256;
    const unsigned blocks = (unsigned) (want < (1u << 20) ? want : (1u << 20));
#define KVS_DEQUANT_LAUNCH(T)                                                                      \
    dequant_kernel<T><<<blocks, 256, 0, stream>>>(src, row_bytes, skip, nrows, ncols, dst_b, dst_f)
    switch (type) {
    case KVS_GGML_F32:
        KVS_DEQUANT_LAUNCH(KVS_GGML_F32);
        break;
    case KVS_GGML_F16:
        KVS_DEQUANT_LAUNCH(KVS_GGML_F16);
        break;
    case KVS_GGML_BF16:
        KVS_DEQUANT_LAUNCH(KVS_GGML_BF16);
        break;
    case KVS_GGML_Q8_0:
        KVS_DEQUANT_LAUNCH(KVS_GGML_Q8_0);
        break;
    case KVS_GGML_Q4_0:
        KVS_DEQUANT_LAUNCH(KVS_GGML_Q4_0);
        break;
    case KVS_GGML_Q4_1:
        KVS_DEQUANT_LAUNCH(KVS_GGML_Q4_1);
        break;
    }
#undef KVS_DEQUANT_LAUNCH
}

void free_buffers(kvs_model_cuda_loader_t *l)
{
    for (int k = 0; k < 2; k++) {
        if (l->host[k] != NULL) cudaFreeHost(l->host[k]);
        if (l->dev[k] != NULL) cudaFree(l->dev[k]);
        if (l->copied[k] != NULL) cudaEventDestroy(l->copied[k]);
        l->host[k] = l->dev[k] = NULL;
        l->copied[k] = NULL;
    }
    l->cap = 0;
}

/* Staging of at least `bytes` per buffer on `device`; the stream is idle (every shard ends with
 * a synchronize), so smaller buffers can simply be replaced. */
kvs_status_t reserve(kvs_model_cuda_loader_t *l, int device, size_t bytes)
{
    if (l->cap >= bytes && l->device == device) return KVS_OK;
    free_buffers(l);
    l->device = device;
    const size_t cap = bytes > STAGE_BYTES ? bytes : STAGE_BYTES;
    kvs_status_t st = KVS_OK;
    for (int k = 0; k < 2 && st == KVS_OK; k++) {
        st = KVS_CUDA_CHECK(cudaMallocHost((void **) &l->host[k], cap),
                            "model(cuda): %zu bytes of pinned weight staging", cap);
        if (st == KVS_OK)
            st = KVS_CUDA_CHECK(cudaMalloc((void **) &l->dev[k], cap),
                                "model(cuda): %zu bytes of weight staging on device %d", cap,
                                device);
        if (st == KVS_OK)
            st = KVS_CUDA_CHECK(cudaEventCreateWithFlags(&l->copied[k], cudaEventDisableTiming),
                                "model(cuda): staging event");
    }
    if (st != KVS_OK) {
        free_buffers(l);
        return st;
    }
    l->cap = cap;
    l->next = 0;
    return KVS_OK;
}

} // namespace
} // namespace kvs_cuda
using namespace kvs_cuda;

extern "C" kvs_status_t kvs__model_cuda_loader_create(kvs_model_cuda_t *c,
                                                      kvs_model_cuda_loader_t **loader_p)
{
    kvs_model_cuda_loader_t *l =
        (kvs_model_cuda_loader_t *) kvs_calloc(1, sizeof(kvs_model_cuda_loader_t));
    if (l == NULL) {
        kvs_error("model(cuda): out of memory for a weight loader");
        return KVS_ERR_NOMEM;
    }
    l->c = c;
    l->device = -1;
    *loader_p = l;
    return KVS_OK;
}

extern "C" void kvs__model_cuda_loader_destroy(kvs_model_cuda_loader_t *l)
{
    if (l == NULL) return;
    if (l->device >= 0) cudaSetDevice(l->device);
    free_buffers(l);
    kvs_free(l);
}

extern "C" kvs_status_t kvs__model_cuda_put_raw(kvs_model_cuda_loader_t *l, uint64_t id,
                                                const kvs_gguf_tensor_t *t, uint64_t row0,
                                                uint64_t nrows, uint64_t col0, uint64_t ncols)
{
    if (l == NULL || t == NULL) {
        kvs_error("model(cuda): NULL loader or tensor");
        return KVS_ERR_INVALID;
    }
    uint64_t row_bytes;
    kvs_status_t st = kvs_gguf_check_slice(t, row0, nrows, col0, ncols, &row_bytes);
    if (st != KVS_OK) return st;
    weight_dst_t dst;
    if ((st = weight_target(l->c, id, nrows, ncols, &dst)) != KVS_OK) return st;
    if (nrows == 0 || ncols == 0) return KVS_OK;
    /* The blocks [b0, b1) of each row cover the columns; the slice starts `skip` into b0. */
    const uint32_t be = kvs_ggml_block_elems(t->type), bb = kvs_ggml_block_bytes(t->type);
    const uint64_t b0 = col0 / be, b1 = (col0 + ncols + be - 1) / be;
    const uint64_t slice = (b1 - b0) * bb;
    const uint32_t skip = (uint32_t) (col0 % be);
    if ((st = KVS_CUDA_CHECK(cudaSetDevice(dst.device), "model(cuda): device %d", dst.device)) !=
            KVS_OK ||
        (st = reserve(l, dst.device, (size_t) slice)) != KVS_OK)
        return st;
    const uint64_t per = l->cap / slice; /* rows per piece, >= 1 */
    for (uint64_t r = 0; r < nrows && st == KVS_OK; r += per) {
        const uint64_t n = nrows - r < per ? nrows - r : per;
        const int k = l->next;
        l->next ^= 1;
        /* host[k] is free once its previous copy (two pieces ago) has reached the device */
        st = KVS_CUDA_CHECK(cudaEventSynchronize(l->copied[k]), "model(cuda): weight staging");
        if (st != KVS_OK) break;
        const uint8_t *from = t->data + (row0 + r) * row_bytes + b0 * bb;
        if (slice == row_bytes) {
            memcpy(l->host[k], from, (size_t) (n * slice));
        } else {
            for (uint64_t i = 0; i < n; i++)
                memcpy(l->host[k] + i * slice, from + i * row_bytes, (size_t) slice);
        }
        st = KVS_CUDA_CHECK(cudaMemcpyAsync(l->dev[k], l->host[k], (size_t) (n * slice),
                                            cudaMemcpyHostToDevice, dst.stream),
                            "model(cuda): weights to device %d", dst.device);
        if (st == KVS_OK)
            st = KVS_CUDA_CHECK(cudaEventRecord(l->copied[k], dst.stream),
                                "model(cuda): weight staging");
        if (st != KVS_OK) break;
        /* dev[k]'s next copy is queued behind this kernel on the same stream */
        launch(t->type, l->dev[k], slice, skip, n, ncols, dst.b != NULL ? dst.b + r * ncols : NULL,
               dst.f != NULL ? dst.f + r * ncols : NULL, dst.stream);
        st = KVS_CUDA_CHECK(cudaGetLastError(), "model(cuda): decoding weights");
    }
    kvs_status_t st2 =
        KVS_CUDA_CHECK(cudaStreamSynchronize(dst.stream), "model(cuda): decoding weights");
    return st != KVS_OK ? st : st2;
}

extern "C" kvs_status_t kvs__model_cuda_get(kvs_model_cuda_t *c, uint64_t id, uint64_t nrows,
                                            uint64_t ncols, void *host)
{
    weight_dst_t dst;
    kvs_status_t st = weight_target(c, id, nrows, ncols, &dst);
    if (st != KVS_OK) return st;
    const void *from = dst.b != NULL ? (const void *) dst.b : (const void *) dst.f;
    const size_t bytes = (size_t) (nrows * ncols) * (dst.b != NULL ? 2 : 4);
    if ((st = KVS_CUDA_CHECK(cudaSetDevice(dst.device), "model(cuda): device %d", dst.device)) !=
            KVS_OK ||
        (st = KVS_CUDA_CHECK(cudaMemcpyAsync(host, from, bytes, cudaMemcpyDeviceToHost, dst.stream),
                             "model(cuda): weights back from device %d", dst.device)) != KVS_OK)
        return st;
    return KVS_CUDA_CHECK(cudaStreamSynchronize(dst.stream), "model(cuda): weights back");
}
