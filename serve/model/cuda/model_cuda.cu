/* The CUDA backend of the model (model_cuda.h says what it computes): the weights on the
 * device, the element-wise kernels, the projections through cuBLAS and the forward pass that
 * strings them together on one stream. Attention is in attention.cu.
 *
 * Per forward call the host builds, once for every layer, the call's metadata (token ids,
 * positions, page tables, the attention work list) in one pinned buffer and copies it over in
 * one transfer; the layers then run without the host until the logits come back. With NCCL
 * (kvs__model_cuda_nccl_init) the TP all-reduce is on the stream too. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if KVS_HAVE_NCCL
#include <nccl.h>
#endif

#include "model/cuda/attention.cuh"
#include "model/cuda/dequant.cuh"
#include "model/cuda/gemv.cuh"
#include "model/cuda/sample.cuh"

extern "C" {
#include "base/cuda_util.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "model/cuda/model_cuda.h"
}

using kvs_cuda::attn_args_t;
using kvs_cuda::attn_combine_t;
using kvs_cuda::attn_work_t;
using kvs_cuda::sample_row;
using kvs_cuda::sample_row_t;
typedef __nv_bfloat16 bf16;

/* Every kernel is in kvs_cuda (a sanitizer can pick them by that name). */
namespace kvs_cuda
{
namespace
{

/* ---- weights ---- */

struct layer_w {
    float *attn_norm, *ffn_norm; /* [dim] */
    bf16 *wqkv;                  /* [q + 2 kv][dim]: the q rows, then k, then v */
    bf16 *wo;                    /* [dim][q] */
    bf16 *wgu;                   /* [2 f][dim]: the gate rows, then up */
    bf16 *wdown;                 /* [dim][f] */
};

/* A growable device buffer; allocs counts its allocations, so a graph key can name the
 * buffer's current memory by a number that is the same on every TP rank (they grow alike). */
struct dbuf {
    void *p;
    size_t bytes;
    uint64_t allocs;
};

/* Forward calls of one shape (tokens, sequences, attention blocks, buffers, pool) replay one
 * captured CUDA graph: a decode step is hundreds of small launches. The last GRAPHS shapes are
 * kept. */
constexpr int GRAPHS = 16;
constexpr size_t BLAS_WORKSPACE = (size_t) 32 << 20;

} // namespace
} // namespace kvs_cuda
using kvs_cuda::dbuf;
using kvs_cuda::layer_w;

struct kvs_model_cuda {
    int device;
    int sms;
    cudaStream_t stream;
    cublasHandle_t blas;
    uint32_t dim, q, kv, f, vocab, hd, q_heads, kv_heads, group, layers;
    float eps, theta;
    void *weights; /* one allocation */
    bf16 *embed, *output;
    float *output_norm;
    layer_w *layer;
    /* forward scratch */
    dbuf x, h, qkv, att, gu, partial, logits, all_logits, part_o, part_ml, meta;
    dbuf samp, samp_scratch; /* device sampling: rows and tokens, fixed-point weights */
    void *hsamp;             /* pinned twin of samp */
    size_t hsamp_bytes;
    void *hmeta; /* pinned host twin of meta */
    size_t hmeta_bytes;
    float *hpart; /* pinned [tokens][dim] for the host all-reduce */
    size_t hpart_bytes;
    double *hdbl;
    size_t hdbl_count;
    void *blas_ws; /* cuBLAS's workspace, set so that its calls can be captured */
    struct {
        uint64_t key, used;
        cudaGraphExec_t exec;
    } graphs[kvs_cuda::GRAPHS];
    uint64_t uses;
    /* kvs__model_cuda_profile */
    int profile;
    cudaEvent_t *prof_ev; /* [prof_cap] */
    uint8_t *prof_op;     /* [prof_cap]: the op each event ends */
    uint32_t prof_cap, prof_n;
    double prof_ms[KVS_CUDA_OPS];
    uint64_t prof_calls;
    /* the pool's regions (bases, strides) as of the last call, and how often they changed */
    uint64_t pool_sig, pool_gen;
    /* NCCL (kvs__model_cuda_nccl_init): partials reduced on the device when nccl is set */
    int nccl;
    int nccl_dead;       /* the communicator was aborted: every later call fails */
    uint64_t timeout_ns; /* bound of a wait for device work with NCCL calls in it */
    cudaEvent_t done;    /* recorded at the end of such work, polled */
#if KVS_HAVE_NCCL
    ncclComm_t comm;
#endif
};

namespace kvs_cuda
{
namespace
{

kvs_status_t grow(dbuf *b, size_t bytes, const char *what)
{
    if (b->bytes >= bytes) return KVS_OK;
    if (b->p != NULL) cudaFree(b->p);
    b->p = NULL;
    b->bytes = 0;
    size_t want = bytes + bytes / 4;
    b->allocs++;
    kvs_status_t st =
        KVS_CUDA_CHECK(cudaMalloc(&b->p, want), "model(cuda): %zu bytes of %s", want, what);
    if (st == KVS_OK) b->bytes = want;
    return st;
}

/* A growable pinned host buffer: when it holds fewer than need bytes, it is replaced by one of
 * alloc (>= need) bytes. */
kvs_status_t grow_pinned(void **p, size_t *cap, size_t need, size_t alloc, const char *what)
{
    if (*cap >= need) return KVS_OK;
    if (*p != NULL) cudaFreeHost(*p);
    *p = NULL;
    *cap = 0;
    kvs_status_t st = KVS_CUDA_CHECK(cudaMallocHost(p, alloc),
                                     "model(cuda): %zu pinned bytes of %s", alloc, what);
    if (st == KVS_OK) *cap = alloc;
    return st;
}

kvs_status_t blas_check(cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return KVS_OK;
    kvs_error("model(cuda): %s failed: %s", what, cublasGetStatusString(s));
    return s == CUBLAS_STATUS_ALLOC_FAILED ? KVS_ERR_NOMEM : KVS_ERR_IO;
}

__device__ __forceinline__ uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The seeded rule of model.c, without contraction so that the floats are the CPU's. */
__global__ void seed_kernel(kvs_model_seed_rule_t rule, uint64_t cols, uint64_t row0,
                            uint64_t nrows, uint64_t col0, uint64_t ncols, bf16 *dst_b,
                            float *dst_f)
{
    const uint64_t count = nrows * ncols;
    for (uint64_t i = blockIdx.x * (uint64_t) blockDim.x + threadIdx.x; i < count;
         i += (uint64_t) gridDim.x * blockDim.x) {
        const uint64_t r = i / ncols, c = i % ncols;
        const uint64_t h = mix64(rule.key + (row0 + r) * cols + col0 + c);
        const float u = __fmul_rn((float) (h >> 40), 0x1p-24f);
        const float v = __fadd_rn(rule.offset, __fmul_rn(__fmul_rn(rule.scale, 1.7320508f),
                                                         __fsub_rn(__fmul_rn(2.0f, u), 1.0f)));
        if (dst_b != NULL)
            dst_b[i] = __float2bfloat16(v);
        else
            dst_f[i] = v;
    }
}

/* x[t] = table[tok[t]] in f32. */
__global__ void embed_kernel(const bf16 *table, uint32_t dim, const uint32_t *tok, float *x)
{
    const uint32_t t = blockIdx.x;
    const bf16 *row = table + (size_t) tok[t] * dim;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        x[(size_t) t * dim + i] = __bfloat162float(row[i]);
}

/* y[r] = x[rows ? rows[r] : r] / sqrt(mean square + eps) * w, in bf16; one block per row. */
__global__ void __launch_bounds__(256)
    rmsnorm_kernel(const float *x, const uint32_t *rows, const float *w, uint32_t dim, float eps,
                   bf16 *y)
{
    __shared__ float part[8];
    const uint32_t r = blockIdx.x, src = rows != NULL ? rows[r] : r;
    const float *xr = x + (size_t) src * dim;
    const float inv = rms_scale(xr, dim, eps, part);
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        y[(size_t) r * dim + i] = __float2bfloat16(xr[i] * inv * w[i]);
}

/* RoPE and the KV write in one pass over q, k and v: a thread takes 8 elements (4 pairs) of
 * one head of one token. q heads are rotated in place (attention reads them there); k heads
 * are rotated and, like the v heads, stored as 16-byte vectors at the token's position in the
 * pool (attention reads K and V from there). */
__global__ void rope_kv_kernel(bf16 *qkv, uint32_t stride, uint32_t q_heads, uint32_t kv_heads,
                               uint32_t hd, double theta, const uint32_t *pos,
                               const uint32_t *tok_pages, const uint32_t *pages, uint32_t page_size,
                               kvs_region_t kr, kvs_region_t vr, uint32_t n)
{
    const uint32_t chunks = hd / 8, heads = q_heads + 2 * kv_heads;
    const uint64_t count = (uint64_t) n * heads * chunks;
    for (uint64_t i = blockIdx.x * (uint64_t) blockDim.x + threadIdx.x; i < count;
         i += (uint64_t) gridDim.x * blockDim.x) {
        const uint32_t ch = (uint32_t) (i % chunks);
        const uint64_t th = i / chunks;
        const uint32_t h = (uint32_t) (th % heads), t = (uint32_t) (th / heads);
        bf16 *p = qkv + (size_t) t * stride + (size_t) h * hd + 8 * ch;
        uint4 v = *reinterpret_cast<const uint4 *>(p);
        if (h < q_heads + kv_heads) {
            bf16 *e = reinterpret_cast<bf16 *>(&v);
            for (uint32_t k = 0; k < 4; k++) {
                const uint32_t j = 4 * ch + k;
                const double angle = pos[t] * pow(theta, -2.0 * j / hd);
                double sn, cs;
                sincos(angle, &sn, &cs);
                const float x0 = __bfloat162float(e[2 * k]), x1 = __bfloat162float(e[2 * k + 1]);
                e[2 * k] = __float2bfloat16((float) (x0 * cs - x1 * sn));
                e[2 * k + 1] = __float2bfloat16((float) (x0 * sn + x1 * cs));
            }
            if (h < q_heads) {
                *reinterpret_cast<uint4 *>(p) = v;
                continue;
            }
        }
        const int is_v = h >= q_heads + kv_heads;
        const uint32_t kvh = h - q_heads - (is_v ? kv_heads : 0);
        const kvs_region_t &r = is_v ? vr : kr;
        const uint64_t page = pages[tok_pages[t] + pos[t] / page_size], off = pos[t] % page_size;
        uint8_t *d = r.base + page * r.page_stride + off * r.token_stride + kvh * r.head_stride;
        reinterpret_cast<uint4 *>(d)[ch] = v;
    }
}

/* gu[t][j] = silu(gate) * up for j < f, in place over the gate half. */
__global__ void silu_mul_kernel(bf16 *gu, uint32_t f, uint32_t n)
{
    const uint64_t count = (uint64_t) n * f;
    for (uint64_t i = blockIdx.x * (uint64_t) blockDim.x + threadIdx.x; i < count;
         i += (uint64_t) gridDim.x * blockDim.x) {
        const uint64_t t = i / f, j = i % f;
        bf16 *row = gu + t * 2 * f;
        const float g = __bfloat162float(row[j]), u = __bfloat162float(row[f + j]);
        row[j] = __float2bfloat16(swiglu(g, u));
    }
}

__global__ void add_kernel(float *x, const float *d, uint64_t count)
{
    for (uint64_t i = blockIdx.x * (uint64_t) blockDim.x + threadIdx.x; i < count;
         i += (uint64_t) gridDim.x * blockDim.x)
        x[i] += d[i];
}

unsigned grid_for(uint64_t count, unsigned threads)
{
    uint64_t g = (count + threads - 1) / threads;
    return (unsigned) (g < 1 ? 1 : g > 65535 * 16 ? 65535 * 16 : g);
}

/* y[n][out] = x[n][in] w[out][in]^T (+ beta y): bf16 inputs, f32 accumulation, y bf16 or f32.
 * (A GEMV of our own for the decode rows, one warp per weight row, measured no faster than
 * cuBLAS at one row and half as fast at eight on the H200.) */
kvs_status_t gemm(kvs_model_cuda_t *c, const bf16 *x, uint32_t ldx, const bf16 *w, uint32_t in,
                  uint32_t out, uint32_t n, void *y, cudaDataType_t ytype, uint32_t ldy, float beta)
{
    const float alpha = 1.0f;
    return blas_check(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int) out, (int) n, (int) in,
                                   &alpha, w, CUDA_R_16BF, (int) in, x, CUDA_R_16BF, (int) ldx,
                                   &beta, y, ytype, (int) ldy, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT),
                      "cublasGemmEx");
}

/* Where shard `id` goes: a bf16 matrix (and the row its rows start at) or an f32 vector. */
kvs_status_t locate(kvs_model_cuda_t *c, uint64_t id, uint64_t nrows, uint64_t ncols, bf16 **b_p,
                    float **f_p)
{
    *b_p = NULL;
    *f_p = NULL;
    uint64_t want_rows = 0, want_cols = c->dim;
    if (id == KVS_MODEL_ID_EMBED || id == KVS_MODEL_ID_OUTPUT) {
        *b_p = id == KVS_MODEL_ID_EMBED ? c->embed : c->output;
        want_rows = c->vocab;
    } else if (id == KVS_MODEL_ID_OUTPUT_NORM) {
        *f_p = c->output_norm;
        want_rows = 1;
    } else if (id / 16 < c->layers && id % 16 < KVS_MODEL_T_KINDS) {
        layer_w *L = &c->layer[id / 16];
        switch ((int) (id % 16)) {
        case KVS_MODEL_T_ATTN_NORM:
            *f_p = L->attn_norm, want_rows = 1;
            break;
        case KVS_MODEL_T_FFN_NORM:
            *f_p = L->ffn_norm, want_rows = 1;
            break;
        case KVS_MODEL_T_Q:
            *b_p = L->wqkv, want_rows = c->q;
            break;
        case KVS_MODEL_T_K:
            *b_p = L->wqkv + (size_t) c->q * c->dim, want_rows = c->kv;
            break;
        case KVS_MODEL_T_V:
            *b_p = L->wqkv + (size_t) (c->q + c->kv) * c->dim, want_rows = c->kv;
            break;
        case KVS_MODEL_T_O:
            *b_p = L->wo, want_rows = c->dim, want_cols = c->q;
            break;
        case KVS_MODEL_T_GATE:
            *b_p = L->wgu, want_rows = c->f;
            break;
        case KVS_MODEL_T_UP:
            *b_p = L->wgu + (size_t) c->f * c->dim, want_rows = c->f;
            break;
        case KVS_MODEL_T_DOWN:
            *b_p = L->wdown, want_rows = c->dim, want_cols = c->f;
            break;
        }
    }
    if ((*b_p == NULL && *f_p == NULL) || nrows != want_rows || ncols != want_cols) {
        kvs_error("model(cuda): shard %llu is [%llu x %llu], expected [%llu x %llu]",
                  (unsigned long long) id, (unsigned long long) nrows, (unsigned long long) ncols,
                  (unsigned long long) want_rows, (unsigned long long) want_cols);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

/* The metadata of one forward call, laid out in the pinned buffer and its device twin. */
struct meta_t {
    size_t tok, pos, tok_pages, pages, last, work, combine, bytes;
};

size_t align16(size_t n)
{
    return (n + 15) & ~(size_t) 15;
}

int cmp_work(const void *a, const void *b)
{
    const attn_work_t *x = (const attn_work_t *) a, *y = (const attn_work_t *) b;
    const uint32_t lx = x->kv_end - x->kv_begin, ly = y->kv_end - y->kv_begin;
    return lx < ly ? 1 : lx > ly ? -1 : 0;
}

kvs_status_t wait_stream(kvs_model_cuda_t *c, const char *what);

/* After the logits: the tokens of the sequences that sample on the device (their rows stay
 * there) into pinned memory, and the rows of the others that want them (not no_logits) copied to
 * the host, run by run. Nothing waits here: the tokens are read (take_tokens) after the pass's
 * final wait, so that wait can run the engine's hook. */
kvs_status_t sample_and_copy(kvs_model_cuda_t *c, const kvs_model_seq_t *seqs, uint32_t nseq,
                             float *logits)
{
    uint32_t nsamp = 0, hot = 0;
    for (uint32_t i = 0; i < nseq; i++)
        if (seqs[i].sample != NULL) {
            nsamp++;
            hot += seqs[i].sample->temperature > 0.0f;
        }
    const float *dl = (const float *) c->logits.p;
    kvs_status_t st = KVS_OK;
    for (uint32_t i = 0; i < nseq && st == KVS_OK;) {
        uint32_t j = i;
        while (j < nseq && seqs[j].sample == NULL && !seqs[j].no_logits) j++;
        if (j > i)
            st = KVS_CUDA_CHECK(
                cudaMemcpyAsync(logits + (size_t) i * c->vocab, dl + (size_t) i * c->vocab,
                                (size_t) (j - i) * c->vocab * 4, cudaMemcpyDeviceToHost, c->stream),
                "model(cuda): logits");
        i = j + 1;
    }
    if (st != KVS_OK || nsamp == 0) return st;
    const size_t rows_b = align16((size_t) nsamp * sizeof(sample_row_t));
    const size_t bytes = rows_b + (size_t) nsamp * sizeof(uint32_t);
    if ((st = grow_pinned(&c->hsamp, &c->hsamp_bytes, bytes, bytes, "sampling rows")) != KVS_OK ||
        (st = grow(&c->samp, bytes, "sampling rows")) != KVS_OK ||
        (hot > 0 && (st = grow(&c->samp_scratch, sample_scratch_bytes(nsamp, c->vocab),
                               "sampling scratch")) != KVS_OK))
        return st;
    sample_row_t *rows = (sample_row_t *) c->hsamp;
    for (uint32_t i = 0, k = 0; i < nseq; i++) {
        const kvs_sample_params_t *p = seqs[i].sample;
        if (p == NULL) continue;
        rows[k++] = sample_row(i, *p, seqs[i].draw);
    }
    uint8_t *d = (uint8_t *) c->samp.p;
    uint32_t *htok = (uint32_t *) ((uint8_t *) c->hsamp + rows_b);
    st = KVS_CUDA_CHECK(cudaMemcpyAsync(d, rows, rows_b, cudaMemcpyHostToDevice, c->stream),
                        "model(cuda): sampling rows");
    if (st == KVS_OK)
        st = sample_launch(dl, c->vocab, (const sample_row_t *) d, nsamp, c->samp_scratch.p,
                           (uint32_t *) (d + rows_b), c->stream);
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMemcpyAsync(htok, d + rows_b, (size_t) nsamp * 4,
                                            cudaMemcpyDeviceToHost, c->stream),
                            "model(cuda): sampled tokens");
    return st;
}

/* After the pass's final wait: the tokens sample_and_copy had sampled on the device. */
static void take_tokens(const kvs_model_cuda_t *c, const kvs_model_seq_t *seqs, uint32_t nseq)
{
    uint32_t nsamp = 0;
    for (uint32_t i = 0; i < nseq; i++) nsamp += seqs[i].sample != NULL;
    if (nsamp == 0) return;
    /* sample_and_copy's layout of hsamp: the rows, then the tokens */
    const size_t rows_b = align16((size_t) nsamp * sizeof(sample_row_t));
    const uint32_t *htok = (const uint32_t *) ((const uint8_t *) c->hsamp + rows_b);
    for (uint32_t i = 0, k = 0; i < nseq; i++)
        if (seqs[i].sample != NULL) *seqs[i].token = htok[k++];
}

kvs_status_t reduce_partial(kvs_model_cuda_t *c, uint32_t n, kvs_allreduce_fn reduce, void *arg)
{
    const size_t count = (size_t) n * c->dim;
    kvs_status_t st = grow_pinned((void **) &c->hpart, &c->hpart_bytes, count * sizeof(float),
                                  count * sizeof(float), "the host all-reduce");
    if (st != KVS_OK) return st;
    if (c->hdbl_count < count) {
        kvs_free(c->hdbl);
        c->hdbl = (double *) kvs_malloc(count * sizeof(double));
        c->hdbl_count = c->hdbl != NULL ? count : 0;
        if (c->hdbl == NULL) return KVS_ERR_NOMEM;
    }
    float *dp = (float *) c->partial.p;
    st = KVS_CUDA_CHECK(
        cudaMemcpyAsync(c->hpart, dp, count * sizeof(float), cudaMemcpyDeviceToHost, c->stream),
        "model(cuda): partial sums to the host");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaStreamSynchronize(c->stream), "model(cuda): partial sums");
    if (st != KVS_OK) return st;
    for (size_t i = 0; i < count; i++) c->hdbl[i] = c->hpart[i];
    st = reduce(arg, c->hdbl, count);
    if (st != KVS_OK) {
        kvs_error("model(cuda): all-reduce of %zu partial sums failed: %s", count,
                  kvs_status_str(st));
        return st;
    }
    for (size_t i = 0; i < count; i++) c->hpart[i] = (float) c->hdbl[i];
    st = KVS_CUDA_CHECK(
        cudaMemcpyAsync(dp, c->hpart, count * sizeof(float), cudaMemcpyHostToDevice, c->stream),
        "model(cuda): reduced sums to the device");
    if (st != KVS_OK) return st;
    add_kernel<<<grid_for(count, 256), 256, 0, c->stream>>>((float *) c->x.p, dp, count);
    return KVS_OK;
}

#if KVS_HAVE_NCCL
kvs_status_t nccl_check(ncclResult_t r, const char *what)
{
    if (r == ncclSuccess) return KVS_OK;
    kvs_error("model(cuda): %s failed: %s (%s)", what, ncclGetErrorString(r),
              ncclGetLastError(NULL));
    return KVS_ERR_IO;
}

/* The communicator is not to be trusted any more (an error, a peer gone): abort it, which
 * returns without waiting for the peers, and fail every later call. */
void nccl_abort(kvs_model_cuda_t *c)
{
    if (c->comm != NULL) ncclCommAbort(c->comm);
    c->comm = NULL;
    c->nccl_dead = 1;
}
#endif

/* The partial sums summed over the ranks on the device (in place, f32), then added to the
 * residual; capturable. */
kvs_status_t reduce_partial_nccl(kvs_model_cuda_t *c, uint32_t n)
{
#if KVS_HAVE_NCCL
    const size_t count = (size_t) n * c->dim;
    float *dp = (float *) c->partial.p;
    kvs_status_t st = nccl_check(
        ncclAllReduce(dp, dp, count, ncclFloat32, ncclSum, c->comm, c->stream), "ncclAllReduce");
    if (st != KVS_OK) return st;
    add_kernel<<<grid_for(count, 256), 256, 0, c->stream>>>((float *) c->x.p, dp, count);
    return KVS_OK;
#else
    (void) c, (void) n;
    return KVS_ERR_UNSUPPORTED;
#endif
}

/* A wait for device work with NCCL calls in it: those can wait on a peer forever (a peer
 * process gone mid-call), so it polls, watches the communicator's errors and gives up at the
 * group's deadline, aborting the communicator. */
static kvs_status_t wait_nccl(kvs_model_cuda_t *c, const char *what)
{
#if KVS_HAVE_NCCL
    kvs_status_t st =
        KVS_CUDA_CHECK(cudaEventRecord(c->done, c->stream), "model(cuda): %s (event)", what);
    const uint64_t deadline = kvs_now_ns() + c->timeout_ns;
    while (st == KVS_OK) {
        const cudaError_t q = cudaEventQuery(c->done);
        if (q == cudaSuccess) return KVS_OK;
        if (q != cudaErrorNotReady) {
            st = KVS_CUDA_CHECK(q, "model(cuda): %s", what);
            break;
        }
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(c->comm, &async);
        if (async != ncclSuccess) {
            st = nccl_check(async, what);
            break;
        }
        if (kvs_now_ns() >= deadline) {
            kvs_error("model(cuda): %s did not finish within %llu ms: a TP peer is gone or "
                      "stuck in an NCCL all-reduce; aborting the communicator",
                      what, (unsigned long long) (c->timeout_ns / 1000000));
            st = KVS_ERR_TIMEOUT;
            break;
        }
        sched_yield();
    }
    nccl_abort(c);
    return st;
#else
    return KVS_ERR_UNSUPPORTED;
#endif
}

/* Waits for the stream's work so far (through wait_nccl when NCCL calls are in it). */
kvs_status_t wait_stream(kvs_model_cuda_t *c, const char *what)
{
    if (!c->nccl) return KVS_CUDA_CHECK(cudaStreamSynchronize(c->stream), "model(cuda): %s", what);
    return wait_nccl(c, what);
}

/* The end of a forward pass: with the model's wait hook (kvs_model_set_wait), polls the stream
 * and calls the hook between polls; else wait_stream. */
static kvs_status_t wait_pass(const kvs_model_t *m)
{
    kvs_model_cuda_t *c = m->cuda;
    if (m->wait_fn == NULL || c->nccl) return wait_stream(c, "forward pass");
    for (;;) {
        const cudaError_t q = cudaStreamQuery(c->stream);
        if (q != cudaErrorNotReady) return KVS_CUDA_CHECK(q, "model(cuda): forward pass");
        m->wait_fn(m->wait_arg);
    }
}

uint64_t mix_key(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

/* Launches the graph of `key`, capturing `enqueue` into it first when it is not kept (the
 * least recently used one makes room). */
template <typename F> kvs_status_t replay(kvs_model_cuda_t *c, uint64_t key, F &enqueue)
{
    int at = -1, lru = 0;
    for (int i = 0; i < GRAPHS; i++) {
        if (c->graphs[i].exec != NULL && c->graphs[i].key == key) at = i;
        if (c->graphs[i].used < c->graphs[lru].used) lru = i;
    }
    if (at < 0) {
        at = lru;
        if (c->graphs[at].exec != NULL) cudaGraphExecDestroy(c->graphs[at].exec);
        c->graphs[at].exec = NULL;
        kvs_status_t st =
            KVS_CUDA_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal),
                           "model(cuda): capturing a forward pass");
        if (st != KVS_OK) return st;
        st = enqueue();
        cudaGraph_t graph = NULL;
        kvs_status_t end = KVS_CUDA_CHECK(cudaStreamEndCapture(c->stream, &graph),
                                          "model(cuda): capturing a forward pass");
        if (st == KVS_OK) st = end;
        if (st == KVS_OK)
            st = KVS_CUDA_CHECK(cudaGraphInstantiate(&c->graphs[at].exec, graph, 0),
                                "model(cuda): instantiating a forward pass");
        if (graph != NULL) cudaGraphDestroy(graph);
        if (st != KVS_OK) {
            c->graphs[at].exec = NULL;
            return st;
        }
        c->graphs[at].key = key;
    }
    c->graphs[at].used = ++c->uses;
    return KVS_CUDA_CHECK(cudaGraphLaunch(c->graphs[at].exec, c->stream),
                          "model(cuda): launching a forward pass");
}

} // namespace

kvs_status_t weight_target(kvs_model_cuda_t *c, uint64_t id, uint64_t nrows, uint64_t ncols,
                           weight_dst_t *dst_p)
{
    weight_dst_t d;
    kvs_status_t st = locate(c, id, nrows, ncols, &d.b, &d.f);
    if (st != KVS_OK) return st;
    d.device = c->device;
    d.stream = c->stream;
    *dst_p = d;
    return KVS_OK;
}

} // namespace kvs_cuda
using namespace kvs_cuda;

extern "C" kvs_status_t kvs__model_cuda_create(const kvs_model_t *m, int device, int tied,
                                               kvs_model_cuda_t **cuda_p)
{
    const kvs_model_config_t *cfg = &m->config;
    if (cfg->head_dim != 64 && cfg->head_dim != 128) {
        kvs_error("model(cuda): head dim %u is not supported on CUDA (64 or 128)", cfg->head_dim);
        return KVS_ERR_UNSUPPORTED;
    }
    const uint32_t group = m->q_heads / m->kv_heads;
    if (group == 0 || group > kvs_cuda::ATTN_ROWS || group * m->kv_heads != m->q_heads) {
        kvs_error("model(cuda): %u query heads over %u KV heads per rank are not supported",
                  m->q_heads, m->kv_heads);
        return KVS_ERR_UNSUPPORTED;
    }
    for (uint32_t j = 0; j < m->q_heads; j++) {
        if (m->q_kv[j] != j / group) {
            kvs_error("model(cuda): query head %u reads KV head %u, not %u", j, m->q_kv[j],
                      j / group);
            return KVS_ERR_UNSUPPORTED;
        }
    }
    int count = 0;
    kvs_status_t st = KVS_CUDA_CHECK(cudaGetDeviceCount(&count), "model(cuda): device %d", device);
    if (st != KVS_OK) return st;
    if (device >= count) {
        kvs_error("model(cuda): device %d does not exist (%d CUDA devices)", device, count);
        return KVS_ERR_UNSUPPORTED;
    }
    st = KVS_CUDA_CHECK(cudaSetDevice(device), "model(cuda): device %d", device);
    if (st != KVS_OK) return st;
    kvs_model_cuda_t *c = (kvs_model_cuda_t *) kvs_calloc(1, sizeof(*c));
    if (c == NULL) return KVS_ERR_NOMEM;
    c->device = device;
    c->dim = cfg->dim;
    c->hd = cfg->head_dim;
    c->q_heads = m->q_heads;
    c->kv_heads = m->kv_heads;
    c->q = m->q_heads * cfg->head_dim;
    c->kv = m->kv_heads * cfg->head_dim;
    c->f = m->ffn_cols;
    c->vocab = cfg->vocab;
    c->group = group;
    c->layers = cfg->layers;
    c->eps = cfg->norm_eps;
    c->theta = cfg->rope_theta;
    cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, device);
    c->layer = (layer_w *) kvs_calloc(cfg->layers, sizeof(layer_w));
    if (c->layer == NULL) {
        kvs_free(c);
        return KVS_ERR_NOMEM;
    }
    /* one arena: every piece on a 256-byte boundary */
    const size_t dim = c->dim;
    size_t off = 0;
    auto take = [&](size_t bytes) {
        size_t at = off;
        off += (bytes + 255) & ~(size_t) 255;
        return at;
    };
    const size_t o_embed = take((size_t) c->vocab * dim * 2);
    const size_t o_output = tied ? o_embed : take((size_t) c->vocab * dim * 2);
    const size_t o_onorm = take(dim * 4);
    size_t *o_layer = (size_t *) kvs_malloc(cfg->layers * 6 * sizeof(size_t));
    if (o_layer == NULL) {
        kvs__model_cuda_destroy(c);
        return KVS_ERR_NOMEM;
    }
    for (uint32_t l = 0; l < cfg->layers; l++) {
        o_layer[l * 6 + 0] = take(dim * 4 * 2); /* both norms */
        o_layer[l * 6 + 1] = take((size_t) (c->q + 2 * c->kv) * dim * 2);
        o_layer[l * 6 + 2] = take(dim * c->q * 2);
        o_layer[l * 6 + 3] = take((size_t) 2 * c->f * dim * 2);
        o_layer[l * 6 + 4] = take(dim * c->f * 2);
    }
    st = KVS_CUDA_CHECK(cudaMalloc(&c->weights, off),
                        "model(cuda): %zu MiB of weights on device %d", off >> 20, device);
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
                            "model(cuda): stream");
    if (st == KVS_OK) st = kvs_cuda::gemv_prepare();
    if (st == KVS_OK) st = blas_check(cublasCreate(&c->blas), "cublasCreate");
    if (st == KVS_OK) st = blas_check(cublasSetStream(c->blas, c->stream), "cublasSetStream");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMalloc(&c->blas_ws, BLAS_WORKSPACE),
                            "model(cuda): cuBLAS workspace");
    if (st == KVS_OK)
        st = blas_check(cublasSetWorkspace(c->blas, c->blas_ws, BLAS_WORKSPACE),
                        "cublasSetWorkspace");
    if (st != KVS_OK) {
        kvs_free(o_layer);
        kvs__model_cuda_destroy(c);
        return st;
    }
    uint8_t *base = (uint8_t *) c->weights;
    c->embed = (bf16 *) (base + o_embed);
    c->output = (bf16 *) (base + o_output);
    c->output_norm = (float *) (base + o_onorm);
    for (uint32_t l = 0; l < cfg->layers; l++) {
        layer_w *L = &c->layer[l];
        L->attn_norm = (float *) (base + o_layer[l * 6]);
        L->ffn_norm = L->attn_norm + dim;
        L->wqkv = (bf16 *) (base + o_layer[l * 6 + 1]);
        L->wo = (bf16 *) (base + o_layer[l * 6 + 2]);
        L->wgu = (bf16 *) (base + o_layer[l * 6 + 3]);
        L->wdown = (bf16 *) (base + o_layer[l * 6 + 4]);
    }
    kvs_free(o_layer);
    kvs_debug("model(cuda): %zu MiB of bf16 weights on device %d", off >> 20, device);
    *cuda_p = c;
    return KVS_OK;
}

extern "C" void kvs__model_cuda_destroy(kvs_model_cuda_t *c)
{
    if (c == NULL) return;
    cudaSetDevice(c->device);
    if (c->stream != NULL) cudaStreamSynchronize(c->stream);
    dbuf *bufs[] = {&c->x,       &c->h,      &c->qkv,         &c->att,    &c->gu,
                    &c->partial, &c->logits, &c->all_logits,  &c->part_o, &c->part_ml,
                    &c->meta,    &c->samp,   &c->samp_scratch};
    for (dbuf *b : bufs)
        if (b->p != NULL) cudaFree(b->p);
    if (c->hmeta != NULL) cudaFreeHost(c->hmeta);
    if (c->hsamp != NULL) cudaFreeHost(c->hsamp);
    if (c->hpart != NULL) cudaFreeHost(c->hpart);
    kvs_free(c->hdbl);
    for (int i = 0; i < GRAPHS; i++)
        if (c->graphs[i].exec != NULL) cudaGraphExecDestroy(c->graphs[i].exec);
    kvs__model_cuda_profile(c, 0);
#if KVS_HAVE_NCCL
    /* Abort, not destroy: the stream is idle, and an abort never waits on the peers, which
     * may be gone already. */
    if (c->comm != NULL) ncclCommAbort(c->comm);
#endif
    if (c->done != NULL) cudaEventDestroy(c->done);
    if (c->blas != NULL) cublasDestroy(c->blas);
    if (c->blas_ws != NULL) cudaFree(c->blas_ws);
    if (c->stream != NULL) cudaStreamDestroy(c->stream);
    if (c->weights != NULL) cudaFree(c->weights);
    kvs_free(c->layer);
    kvs_free(c);
}

extern "C" kvs_status_t kvs__model_cuda_seed(kvs_model_cuda_t *c, uint64_t id,
                                             const kvs_model_seed_rule_t *rule, uint64_t rows,
                                             uint64_t cols, uint64_t row0, uint64_t nrows,
                                             uint64_t col0, uint64_t ncols)
{
    (void) rows;
    bf16 *b;
    float *f;
    kvs_status_t st = locate(c, id, nrows, ncols, &b, &f);
    if (st != KVS_OK) return st;
    seed_kernel<<<grid_for(nrows * ncols, 256), 256, 0, c->stream>>>(*rule, cols, row0, nrows, col0,
                                                                     ncols, b, f);
    return KVS_CUDA_CHECK(cudaStreamSynchronize(c->stream), "model(cuda): seeded weights");
}

extern "C" kvs_status_t kvs__model_cuda_sample_rows(int device, const float *logits, uint32_t rows,
                                                    uint32_t vocab,
                                                    const kvs_sample_params_t *params,
                                                    const double *draws, uint32_t *tokens)
{
    kvs_status_t st = KVS_CUDA_CHECK(cudaSetDevice(device), "model(cuda): device %d", device);
    if (st != KVS_OK) return st;
    const size_t lb = (size_t) rows * vocab * 4, rb = align16((size_t) rows * sizeof(sample_row_t));
    sample_row_t *h = (sample_row_t *) kvs_calloc(rows, sizeof(sample_row_t));
    void *d = NULL, *scratch = NULL;
    if (h == NULL) return KVS_ERR_NOMEM;
    for (uint32_t i = 0; i < rows; i++) h[i] = sample_row(i, params[i], draws[i]);
    st = KVS_CUDA_CHECK(cudaMalloc(&d, lb + rb + (size_t) rows * 4), "model(cuda): sampling test");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMalloc(&scratch, sample_scratch_bytes(rows, vocab)),
                            "model(cuda): sampling test");
    uint8_t *dl = (uint8_t *) d;
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMemcpy(dl, logits, lb, cudaMemcpyHostToDevice), "sampling test");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(
            cudaMemcpy(dl + lb, h, rows * sizeof(sample_row_t), cudaMemcpyHostToDevice),
            "sampling test");
    if (st == KVS_OK)
        st = sample_launch((const float *) dl, vocab, (const sample_row_t *) (dl + lb), rows,
                           scratch, (uint32_t *) (dl + lb + rb), 0);
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(
            cudaMemcpy(tokens, dl + lb + rb, (size_t) rows * 4, cudaMemcpyDeviceToHost),
            "sampling test");
    cudaFree(d);
    cudaFree(scratch);
    kvs_free(h);
    return st;
}

extern "C" const char *kvs__model_cuda_op_name(kvs_cuda_op_t op)
{
    static const char *names[KVS_CUDA_OPS] = {
        "embedding",    "rmsnorm", "qkv gemm",  "rope + kv write", "attention",   "wo gemm",
        "gate/up gemm", "silu",    "down gemm", "tp all-reduce",   "output head", "sampling"};
    return op < KVS_CUDA_OPS ? names[op] : "?";
}

extern "C" kvs_status_t kvs__model_cuda_profile(kvs_model_cuda_t *c, int on)
{
    for (uint32_t i = 0; i < c->prof_cap; i++) cudaEventDestroy(c->prof_ev[i]);
    kvs_free(c->prof_ev);
    kvs_free(c->prof_op);
    c->prof_ev = NULL;
    c->prof_op = NULL;
    c->prof_cap = c->prof_n = 0;
    c->profile = 0;
    memset(c->prof_ms, 0, sizeof(c->prof_ms));
    c->prof_calls = 0;
    if (!on) return KVS_OK;
    const uint32_t cap = c->layers * 16 + 16;
    c->prof_ev = (cudaEvent_t *) kvs_calloc(cap, sizeof(cudaEvent_t));
    c->prof_op = (uint8_t *) kvs_calloc(cap, 1);
    if (c->prof_ev == NULL || c->prof_op == NULL) {
        kvs__model_cuda_profile(c, 0);
        return KVS_ERR_NOMEM;
    }
    cudaSetDevice(c->device);
    for (; c->prof_cap < cap; c->prof_cap++) {
        kvs_status_t st = KVS_CUDA_CHECK(cudaEventCreate(&c->prof_ev[c->prof_cap]),
                                         "model(cuda): profile events");
        if (st != KVS_OK) {
            kvs__model_cuda_profile(c, 0);
            return st;
        }
    }
    c->profile = 1;
    return KVS_OK;
}

extern "C" void kvs__model_cuda_profile_read(const kvs_model_cuda_t *c, double *ms, uint64_t *calls)
{
    memcpy(ms, c->prof_ms, sizeof(c->prof_ms));
    *calls = c->prof_calls;
}

extern "C" kvs_status_t kvs__model_cuda_sync(kvs_model_cuda_t *c)
{
    return KVS_CUDA_CHECK(cudaStreamSynchronize(c->stream), "model(cuda): sync");
}

/* ---- NCCL ---- */

extern "C" int kvs__model_cuda_have_nccl(void)
{
#if KVS_HAVE_NCCL
    return 1;
#else
    return 0;
#endif
}

extern "C" uint32_t kvs__model_cuda_sms(const kvs_model_cuda_t *c)
{
    return (uint32_t) c->sms;
}

#if KVS_HAVE_NCCL
static_assert(sizeof(ncclUniqueId) == KVS_MODEL_NCCL_ID_BYTES, "the TP group carries 128 bytes");

extern "C" kvs_status_t kvs__model_cuda_nccl_id(uint8_t id[KVS_MODEL_NCCL_ID_BYTES])
{
    ncclUniqueId u;
    kvs_status_t st = nccl_check(ncclGetUniqueId(&u), "ncclGetUniqueId");
    if (st == KVS_OK) memcpy(id, &u, sizeof(u));
    return st;
}

extern "C" kvs_status_t kvs__model_cuda_nccl_init(kvs_model_cuda_t *c, const uint8_t *id,
                                                  uint32_t nranks, uint32_t rank, uint32_t sms,
                                                  uint64_t timeout_ns)
{
    if (c->nccl || c->nccl_dead) {
        kvs_error("model(cuda): the NCCL communicator is set up once per model");
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = KVS_CUDA_CHECK(cudaSetDevice(c->device), "model(cuda): device %d", c->device);
    if (st == KVS_OK && c->done == NULL)
        st = KVS_CUDA_CHECK(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming),
                            "model(cuda): event");
    if (st != KVS_OK) return st;
    int version = 0;
    ncclGetVersion(&version);
    ncclUniqueId u;
    memcpy(&u, id, sizeof(u));
    st = nccl_check(ncclCommInitRank(&c->comm, (int) nranks, u, (int) rank), "ncclCommInitRank");
    if (st != KVS_OK) {
        c->comm = NULL;
        kvs_error("model(cuda): TP rank %u of %u on GPU %d: no NCCL communicator (NCCL %d)", rank,
                  nranks, c->device, version);
        return st;
    }
    c->nccl = 1;
    c->timeout_ns = timeout_ns;
    if (sms > 0) c->sms = (int) sms;
    /* One all-reduce of known values: rank r gives (r + 1) * (i % 7 + 1) for element i, so
     * every element must come back as nranks (nranks + 1) / 2 * (i % 7 + 1), exactly. */
    enum { CHECK = 4096 };
    float *host = (float *) kvs_malloc(CHECK * sizeof(float));
    void *dev = NULL;
    if (host == NULL) st = KVS_ERR_NOMEM;
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMalloc(&dev, CHECK * sizeof(float)), "model(cuda): NCCL check");
    if (st == KVS_OK) {
        for (uint32_t i = 0; i < CHECK; i++) host[i] = (float) ((rank + 1) * (i % 7 + 1));
        st = KVS_CUDA_CHECK(
            cudaMemcpyAsync(dev, host, CHECK * sizeof(float), cudaMemcpyHostToDevice, c->stream),
            "model(cuda): NCCL check");
    }
    if (st == KVS_OK)
        st = nccl_check(ncclAllReduce(dev, dev, CHECK, ncclFloat32, ncclSum, c->comm, c->stream),
                        "the NCCL check's ncclAllReduce");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(
            cudaMemcpyAsync(host, dev, CHECK * sizeof(float), cudaMemcpyDeviceToHost, c->stream),
            "model(cuda): NCCL check");
    if (st == KVS_OK) st = wait_stream(c, "the NCCL check");
    const float ranks_sum = (float) nranks * (float) (nranks + 1) / 2.0f;
    for (uint32_t i = 0; i < CHECK && st == KVS_OK; i++) {
        const float want = ranks_sum * (float) (i % 7 + 1);
        if (host[i] != want) {
            kvs_error("model(cuda): TP rank %u: the NCCL check all-reduce gave %g at element %u, "
                      "not %g",
                      rank, (double) host[i], i, (double) want);
            st = KVS_ERR_IO;
        }
    }
    if (dev != NULL) cudaFree(dev);
    kvs_free(host);
    if (st != KVS_OK) {
        if (c->comm != NULL) nccl_abort(c);
        c->nccl = 0;
        return st == KVS_ERR_NOMEM || st == KVS_ERR_TIMEOUT ? st : KVS_ERR_IO;
    }
    kvs_debug("model(cuda): TP rank %u of %u on GPU %d reduces through NCCL %d", rank, nranks,
              c->device, version);
    return KVS_OK;
}
#else
extern "C" kvs_status_t kvs__model_cuda_nccl_id(uint8_t id[KVS_MODEL_NCCL_ID_BYTES])
{
    (void) id;
    kvs_error("model(cuda): this kvstage was built without NCCL");
    return KVS_ERR_UNSUPPORTED;
}

extern "C" kvs_status_t kvs__model_cuda_nccl_init(kvs_model_cuda_t *c, const uint8_t *id,
                                                  uint32_t nranks, uint32_t rank, uint32_t sms,
                                                  uint64_t timeout_ns)
{
    (void) c, (void) id, (void) nranks, (void) rank, (void) sms, (void) timeout_ns;
    kvs_error("model(cuda): this kvstage was built without NCCL");
    return KVS_ERR_UNSUPPORTED;
}
#endif

extern "C" kvs_status_t kvs__model_cuda_forward(kvs_model_t *m, kvs_pool_t *pool,
                                                const kvs_model_seq_t *seqs, uint32_t nseq,
                                                kvs_allreduce_fn reduce, void *reduce_arg,
                                                float *logits)
{
    kvs_model_cuda_t *c = m->cuda;
    if (c->nccl_dead) {
        kvs_error("model(cuda): the NCCL communicator was aborted after an earlier failure");
        return KVS_ERR_STATE;
    }
    kvs_status_t st = KVS_CUDA_CHECK(cudaSetDevice(c->device), "model(cuda): device %d", c->device);
    if (st != KVS_OK) return st;
    const uint32_t P = kvs_pool_config(pool)->page_size;
    for (uint32_t l = 0; l < 2; l++) {
        const kvs_region_t *r = kvs_pool_region(pool, 0, l);
        if (((uintptr_t) r->base | r->page_stride | r->token_stride | r->head_stride) % 16 != 0) {
            kvs_error("model(cuda): the pool's regions must be 16-byte aligned");
            return KVS_ERR_INVALID;
        }
    }

    /* ---- the call's metadata ---- */
    uint32_t n = 0, npages = 0, nall = 0;
    for (uint32_t i = 0; i < nseq; i++) {
        n += seqs[i].n;
        npages += (seqs[i].pos0 + seqs[i].n + P - 1) / P;
        if (seqs[i].all_logits != NULL && seqs[i].n > nall) nall = seqs[i].n;
    }
    const uint32_t tpt = kvs_cuda::ATTN_ROWS / c->group; /* tokens per row block */
    uint32_t ntiles = 0;
    uint64_t kv_total = 0;
    for (uint32_t i = 0; i < nseq; i++) {
        const uint32_t tiles = (seqs[i].n + tpt - 1) / tpt;
        ntiles += tiles * c->kv_heads;
        for (uint32_t j = 0; j < tiles; j++) {
            const uint32_t last = j * tpt + (seqs[i].n - j * tpt < tpt ? seqs[i].n - j * tpt : tpt);
            kv_total += (uint64_t) (seqs[i].pos0 + last) * c->kv_heads;
        }
    }
    /* Too few row blocks to fill the GPU twice over: split the positions. */
    uint32_t split = UINT32_MAX;
    const uint32_t target = 2u * (uint32_t) c->sms;
    if (ntiles < target) {
        uint64_t s = (kv_total + target - 1) / target;
        s = (s + kvs_cuda::ATTN_TILE - 1) / kvs_cuda::ATTN_TILE * kvs_cuda::ATTN_TILE;
        split = (uint32_t) s; /* a tile at least (decode at batch 1: a block per tile) */
    }
    uint32_t nwork = 0, ncomb = 0, nparts = 0;
    for (uint32_t i = 0; i < nseq; i++) {
        const uint32_t tiles = (seqs[i].n + tpt - 1) / tpt;
        for (uint32_t j = 0; j < tiles; j++) {
            const uint32_t ntok = seqs[i].n - j * tpt < tpt ? seqs[i].n - j * tpt : tpt;
            const uint32_t end = seqs[i].pos0 + j * tpt + ntok;
            const uint32_t ns = split == UINT32_MAX ? 1 : (end + split - 1) / split;
            nwork += ns * c->kv_heads;
            if (ns > 1) {
                ncomb += c->kv_heads;
                nparts += ns * c->kv_heads;
            }
        }
    }
    /* The arrays whose sizes the graph key fixes first, the page tables (which grow) last, so
     * that a captured graph's pointers into the buffer stay right. */
    meta_t mt;
    mt.work = 0;
    mt.combine = align16(mt.work + (size_t) nwork * sizeof(attn_work_t));
    mt.tok = align16(mt.combine + (size_t) ncomb * sizeof(attn_combine_t));
    mt.pos = align16(mt.tok + (size_t) n * 4);
    mt.tok_pages = align16(mt.pos + (size_t) n * 4);
    mt.last = align16(mt.tok_pages + (size_t) n * 4);
    mt.pages = align16(mt.last + (size_t) nseq * 4);
    mt.bytes = align16(mt.pages + (size_t) npages * 4);
    st = grow_pinned(&c->hmeta, &c->hmeta_bytes, mt.bytes, mt.bytes * 2, "metadata");
    if (st != KVS_OK) return st;
    /* the previous call's copy out of hmeta is done: every call ends with a synchronize */
    uint8_t *hm = (uint8_t *) c->hmeta;
    uint32_t *tok = (uint32_t *) (hm + mt.tok), *pos = (uint32_t *) (hm + mt.pos);
    uint32_t *tok_pages = (uint32_t *) (hm + mt.tok_pages), *pages = (uint32_t *) (hm + mt.pages);
    uint32_t *last = (uint32_t *) (hm + mt.last);
    attn_work_t *work = (attn_work_t *) (hm + mt.work);
    attn_combine_t *comb = (attn_combine_t *) (hm + mt.combine);
    uint32_t row = 0, pg = 0, w = 0, cb = 0, part = 0;
    for (uint32_t i = 0; i < nseq; i++) {
        const kvs_model_seq_t *s = &seqs[i];
        const uint32_t np = (s->pos0 + s->n + P - 1) / P, page_off = pg;
        memcpy(pages + pg, s->pages, np * sizeof(uint32_t));
        pg += np;
        for (uint32_t j = 0; j < s->n; j++) {
            tok[row + j] = s->tokens[j];
            pos[row + j] = s->pos0 + j;
            tok_pages[row + j] = page_off;
        }
        const uint32_t tiles = (s->n + tpt - 1) / tpt;
        for (uint32_t j = 0; j < tiles; j++) {
            const uint32_t ntok = s->n - j * tpt < tpt ? s->n - j * tpt : tpt;
            const uint32_t end = s->pos0 + j * tpt + ntok;
            const uint32_t ns = split == UINT32_MAX ? 1 : (end + split - 1) / split;
            for (uint32_t h = 0; h < c->kv_heads; h++) {
                for (uint32_t k = 0; k < ns; k++) {
                    attn_work_t *x = &work[w++];
                    x->page_off = page_off;
                    x->tok0 = row + j * tpt;
                    x->ntok = ntok;
                    x->kvh = h;
                    x->qh0 = h * c->group;
                    x->kv_begin = ns > 1 ? k * split : 0;
                    x->kv_end = ns > 1 && (k + 1) * split < end ? (k + 1) * split : end;
                    x->part = ns > 1 ? part + k : kvs_cuda::ATTN_NO_PART;
                }
                if (ns > 1) {
                    comb[cb++] = attn_combine_t{part, ns, row + j * tpt, ntok, h * c->group};
                    part += ns;
                }
            }
        }
        row += s->n;
        last[i] = row - 1;
    }
    qsort(work, nwork, sizeof(*work), cmp_work); /* longest first: the tail is short */

    /* ---- scratch ---- */
    const size_t qkv_w = c->q + 2 * c->kv;
    const uint32_t hrows = n > nseq ? n : nseq;
    if ((st = grow(&c->meta, mt.bytes, "metadata")) != KVS_OK ||
        (st = grow(&c->x, (size_t) n * c->dim * 4, "the residual")) != KVS_OK ||
        (st = grow(&c->h, (size_t) hrows * c->dim * 2, "normed rows")) != KVS_OK ||
        (st = grow(&c->qkv, (size_t) n * qkv_w * 2, "q, k, v")) != KVS_OK ||
        (st = grow(&c->att, (size_t) n * c->q * 2, "attention output")) != KVS_OK ||
        (st = grow(&c->gu, (size_t) n * 2 * c->f * 2, "gate and up")) != KVS_OK ||
        (st = grow(&c->logits, (size_t) nseq * c->vocab * 4, "logits")) != KVS_OK ||
        (m->tp.tp_size > 1 &&
         (st = grow(&c->partial, (size_t) n * c->dim * 4, "partial sums")) != KVS_OK) ||
        (nall > 0 &&
         (st = grow(&c->all_logits, (size_t) nall * c->vocab * 4, "prompt logits")) != KVS_OK) ||
        (nparts > 0 && (st = grow(&c->part_o, (size_t) nparts * kvs_cuda::ATTN_ROWS * c->hd * 4,
                                  "attention partials")) != KVS_OK) ||
        (nparts > 0 && (st = grow(&c->part_ml, (size_t) nparts * kvs_cuda::ATTN_ROWS * 8,
                                  "attention partials")) != KVS_OK))
        return st;
    uint8_t *dm = (uint8_t *) c->meta.p;
    st = KVS_CUDA_CHECK(cudaMemcpyAsync(dm, hm, mt.bytes, cudaMemcpyHostToDevice, c->stream),
                        "model(cuda): call metadata");
    if (st != KVS_OK) return st;
    const uint32_t *d_tok = (const uint32_t *) (dm + mt.tok),
                   *d_pos = (const uint32_t *) (dm + mt.pos);
    const uint32_t *d_tok_pages = (const uint32_t *) (dm + mt.tok_pages);
    const uint32_t *d_pages = (const uint32_t *) (dm + mt.pages),
                   *d_last = (const uint32_t *) (dm + mt.last);
    float *x = (float *) c->x.p;
    bf16 *h = (bf16 *) c->h.p, *qkv = (bf16 *) c->qkv.p, *att = (bf16 *) c->att.p,
         *gu = (bf16 *) c->gu.p;
    const int tp = m->tp.tp_size > 1;

    /* Everything from the embedding to the logits, on the stream. */
    c->prof_n = 0;
    auto mark = [&](kvs_cuda_op_t op) {
        if (!c->profile || c->prof_n >= c->prof_cap) return;
        cudaEventRecord(c->prof_ev[c->prof_n], c->stream);
        c->prof_op[c->prof_n++] = (uint8_t) op;
    };
    /* One token: the projections are our fused one-token kernels (gemv.cuh), else cuBLAS. */
    const int one = n == 1 && c->dim <= GEMV_MAX_IN && c->f <= GEMV_MAX_IN && c->q <= GEMV_MAX_IN;
    auto gemv = [&](gemv_input_t input, const bf16 *w, uint32_t in, uint32_t out, const void *xin,
                    const uint32_t *row, const float *norm_w, void *y, int y_f32, int accumulate,
                    int swiglu = 0) {
        const gemv_args_t g = {w,      in,     out, input, xin,        row,
                               norm_w, c->eps, y,   y_f32, accumulate, swiglu};
        return gemv_launch(g, c->sms, c->stream);
    };
    auto enqueue = [&]() -> kvs_status_t {
        kvs_status_t st = KVS_OK;
        mark(KVS_CUDA_OPS); /* the start */
        embed_kernel<<<n, 256, 0, c->stream>>>(c->embed, c->dim, d_tok, x);
        mark(KVS_CUDA_OP_EMBED);
        attn_args_t aa;
        aa.q = qkv;
        aa.q_stride = (uint32_t) qkv_w;
        aa.out = att;
        aa.out_stride = c->q;
        aa.page_size = P;
        aa.pages = d_pages;
        aa.pos = d_pos;
        aa.group = c->group;
        aa.scale_log2 = (float) (1.4426950408889634 / sqrt((double) c->hd));
        aa.part_o = (float *) c->part_o.p;
        aa.part_ml = (float *) c->part_ml.p;
        for (uint32_t l = 0; l < c->layers && st == KVS_OK; l++) {
            const layer_w *L = &c->layer[l];
            const kvs_region_t kr = *kvs_pool_region(pool, l, 0), vr = *kvs_pool_region(pool, l, 1);
            if (one) {
                st = gemv(GEMV_NORM, L->wqkv, c->dim, (uint32_t) qkv_w, x, NULL, L->attn_norm, qkv,
                          0, 0);
            } else {
                rmsnorm_kernel<<<n, 256, 0, c->stream>>>(x, NULL, L->attn_norm, c->dim, c->eps, h);
                mark(KVS_CUDA_OP_NORM);
                st = gemm(c, h, c->dim, L->wqkv, c->dim, (uint32_t) qkv_w, n, qkv, CUDA_R_16BF,
                          (uint32_t) qkv_w, 0.0f);
            }
            if (st != KVS_OK) break;
            mark(KVS_CUDA_OP_QKV);
            const uint64_t vecs = (uint64_t) n * (c->q_heads + 2 * c->kv_heads) * (c->hd / 8);
            rope_kv_kernel<<<grid_for(vecs, 256), 256, 0, c->stream>>>(
                qkv, (uint32_t) qkv_w, c->q_heads, c->kv_heads, c->hd, (double) c->theta, d_pos,
                d_tok_pages, d_pages, P, kr, vr, n);
            mark(KVS_CUDA_OP_ROPE_KV);
            aa.k = kr;
            aa.v = vr;
            if ((st = kvs_cuda::attention_launch(aa, c->hd, (const attn_work_t *) (dm + mt.work),
                                                 nwork, (const attn_combine_t *) (dm + mt.combine),
                                                 ncomb, c->stream)) != KVS_OK)
                break;
            mark(KVS_CUDA_OP_ATTENTION);
            if (one)
                st = gemv(GEMV_BF16, L->wo, c->q, c->dim, att, NULL, NULL, tp ? c->partial.p : x, 1,
                          !tp);
            else
                st = gemm(c, att, c->q, L->wo, c->q, c->dim, n, tp ? c->partial.p : x, CUDA_R_32F,
                          c->dim, tp ? 0.0f : 1.0f);
            if (st != KVS_OK) break;
            mark(KVS_CUDA_OP_WO);
            if (tp && (st = c->nccl ? reduce_partial_nccl(c, n)
                                    : reduce_partial(c, n, reduce, reduce_arg)) != KVS_OK)
                break;
            mark(KVS_CUDA_OP_REDUCE);
            if (one) {
                st = gemv(GEMV_NORM, L->wgu, c->dim, 2 * c->f, x, NULL, L->ffn_norm, gu, 0, 0, 1);
                mark(KVS_CUDA_OP_GATE_UP);
                if (st == KVS_OK)
                    st = gemv(GEMV_BF16, L->wdown, c->f, c->dim, gu, NULL, NULL,
                              tp ? c->partial.p : x, 1, !tp);
            } else {
                rmsnorm_kernel<<<n, 256, 0, c->stream>>>(x, NULL, L->ffn_norm, c->dim, c->eps, h);
                mark(KVS_CUDA_OP_NORM);
                st = gemm(c, h, c->dim, L->wgu, c->dim, 2 * c->f, n, gu, CUDA_R_16BF, 2 * c->f,
                          0.0f);
                mark(KVS_CUDA_OP_GATE_UP);
                if (st == KVS_OK) {
                    silu_mul_kernel<<<grid_for((uint64_t) n * c->f, 256), 256, 0, c->stream>>>(
                        gu, c->f, n);
                    mark(KVS_CUDA_OP_SILU);
                    st = gemm(c, gu, 2 * c->f, L->wdown, c->f, c->dim, n, tp ? c->partial.p : x,
                              CUDA_R_32F, c->dim, tp ? 0.0f : 1.0f);
                }
            }
            if (st != KVS_OK) break;
            mark(KVS_CUDA_OP_DOWN);
            if (tp && (st = c->nccl ? reduce_partial_nccl(c, n)
                                    : reduce_partial(c, n, reduce, reduce_arg)) != KVS_OK)
                break;
            mark(KVS_CUDA_OP_REDUCE);
        }
        if (st == KVS_OK && nseq == 1) {
            st = gemv(GEMV_NORM, c->output, c->dim, c->vocab, x, d_last, c->output_norm,
                      c->logits.p, 1, 0);
            mark(KVS_CUDA_OP_HEAD);
        } else if (st == KVS_OK) {
            rmsnorm_kernel<<<nseq, 256, 0, c->stream>>>(x, d_last, c->output_norm, c->dim, c->eps,
                                                        h);
            st = gemm(c, h, c->dim, c->output, c->dim, c->vocab, nseq, c->logits.p, CUDA_R_32F,
                      c->vocab, 0.0f);
            mark(KVS_CUDA_OP_HEAD);
        }
        return st;
    };
    /* The pool's regions are in the graph; a change of them is counted, so that the key below
     * holds a count (equal on every rank) instead of addresses (which are not). */
    uint64_t sig = 0;
    for (uint32_t l = 0; l < c->layers; l++)
        for (uint32_t k = 0; k < 2; k++) {
            const kvs_region_t *r = kvs_pool_region(pool, l, k);
            sig = mix_key(sig, (uint64_t) (uintptr_t) r->base);
            sig = mix_key(sig, r->page_stride ^ (r->token_stride << 20) ^ (r->head_stride << 40));
        }
    if (c->pool_gen == 0 || sig != c->pool_sig) {
        c->pool_sig = sig;
        c->pool_gen++;
    }
    if ((tp && !c->nccl) || nall > 0 || c->profile) {
        st = enqueue(); /* the host takes part (the all-reduce) or the call is one of a kind */
    } else {
        /* With NCCL every rank must capture (and then launch) the same calls' graphs: the key
         * and so every hit, miss and eviction are the same on every rank, as each input is
         * (shapes, SM count agreed at set-up, allocation counts, pool changes). */
        uint64_t key = mix_key(0, n);
        key = mix_key(key, ((uint64_t) nseq << 32) | nwork);
        key = mix_key(key, ncomb);
        const dbuf *bufs[] = {&c->meta, &c->x,      &c->h,      &c->qkv,     &c->att,
                              &c->gu,   &c->logits, &c->part_o, &c->part_ml, &c->partial};
        for (const dbuf *b : bufs) key = mix_key(key, b->allocs);
        key = mix_key(key, c->pool_gen);
        key = mix_key(key, P);
        st = replay(c, key, enqueue);
    }
    if (st == KVS_OK) st = sample_and_copy(c, seqs, nseq, logits);
    mark(KVS_CUDA_OP_SAMPLE);
    /* Rows of every token, for the sequences that asked (prompt logprobs). */
    for (uint32_t i = 0, r0 = 0; i < nseq && st == KVS_OK; r0 += seqs[i].n, i++) {
        if (seqs[i].all_logits == NULL) continue;
        rmsnorm_kernel<<<seqs[i].n, 256, 0, c->stream>>>(x + (size_t) r0 * c->dim, NULL,
                                                         c->output_norm, c->dim, c->eps, h);
        st = gemm(c, h, c->dim, c->output, c->dim, c->vocab, seqs[i].n, c->all_logits.p, CUDA_R_32F,
                  c->vocab, 0.0f);
        if (st == KVS_OK)
            st = KVS_CUDA_CHECK(cudaMemcpyAsync(seqs[i].all_logits, c->all_logits.p,
                                                (size_t) seqs[i].n * c->vocab * 4,
                                                cudaMemcpyDeviceToHost, c->stream),
                                "model(cuda): prompt logits");
        if (st == KVS_OK) st = wait_stream(c, "prompt logits");
    }
    kvs_status_t st2 = wait_pass(m);
    if (st == KVS_OK) st = st2;
    if (st == KVS_OK) take_tokens(c, seqs, nseq);
    if (st == KVS_OK) st = KVS_CUDA_CHECK(cudaGetLastError(), "model(cuda): forward pass kernels");
    if (st == KVS_OK && c->profile && c->prof_n > 1) {
        for (uint32_t i = 1; i < c->prof_n; i++) {
            float ms = 0;
            cudaEventElapsedTime(&ms, c->prof_ev[i - 1], c->prof_ev[i]);
            c->prof_ms[c->prof_op[i]] += ms;
        }
        c->prof_calls++;
    }
    return st;
}

/* ---- the benchmark's ceilings ---- */

extern "C" kvs_status_t kvs__model_cuda_gemm_flops(int device, uint32_t m, uint32_t n, uint32_t k,
                                                   double *flops_p)
{
    kvs_status_t st = KVS_CUDA_CHECK(cudaSetDevice(device), "model(cuda): device %d", device);
    if (st != KVS_OK) return st;
    kvs_model_cuda_t c;
    memset(&c, 0, sizeof(c));
    void *x = NULL, *w = NULL, *y = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    st = KVS_CUDA_CHECK(cudaMalloc(&x, (size_t) m * k * 2), "model(cuda): GEMM input");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMalloc(&w, (size_t) n * k * 2), "model(cuda): GEMM weights");
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaMalloc(&y, (size_t) m * n * 2), "model(cuda): GEMM output");
    if (st == KVS_OK) st = KVS_CUDA_CHECK(cudaStreamCreate(&c.stream), "model(cuda): stream");
    if (st == KVS_OK) st = blas_check(cublasCreate(&c.blas), "cublasCreate");
    if (st == KVS_OK) st = blas_check(cublasSetStream(c.blas, c.stream), "cublasSetStream");
    if (st == KVS_OK) st = KVS_CUDA_CHECK(cudaEventCreate(&e0), "model(cuda): event");
    if (st == KVS_OK) st = KVS_CUDA_CHECK(cudaEventCreate(&e1), "model(cuda): event");
    if (st == KVS_OK) {
        cudaMemsetAsync(x, 0, (size_t) m * k * 2, c.stream);
        cudaMemsetAsync(w, 0, (size_t) n * k * 2, c.stream);
    }
    double best = 0;
    for (int rep = 0; rep < 6 && st == KVS_OK; rep++) {
        cudaEventRecord(e0, c.stream);
        for (int i = 0; i < 5 && st == KVS_OK; i++)
            st = gemm(&c, (const bf16 *) x, k, (const bf16 *) w, k, n, m, y, CUDA_R_16BF, n, 0.0f);
        cudaEventRecord(e1, c.stream);
        if (st == KVS_OK) st = KVS_CUDA_CHECK(cudaEventSynchronize(e1), "model(cuda): GEMM");
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        const double f = 5.0 * 2.0 * m * n * k / (ms * 1e-3);
        if (rep > 0 && f > best) best = f; /* the first is the warm-up */
    }
    if (e0 != NULL) cudaEventDestroy(e0);
    if (e1 != NULL) cudaEventDestroy(e1);
    if (c.blas != NULL) cublasDestroy(c.blas);
    if (c.stream != NULL) cudaStreamDestroy(c.stream);
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
    *flops_p = best;
    return st;
}

extern "C" kvs_status_t kvs__model_cuda_copy_bytes_s(int device, size_t bytes, double *bytes_s_p)
{
    kvs_status_t st = KVS_CUDA_CHECK(cudaSetDevice(device), "model(cuda): device %d", device);
    if (st != KVS_OK) return st;
    void *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    st = KVS_CUDA_CHECK(cudaMalloc(&a, bytes), "model(cuda): copy source");
    if (st == KVS_OK) st = KVS_CUDA_CHECK(cudaMalloc(&b, bytes), "model(cuda): copy target");
    if (st == KVS_OK) st = KVS_CUDA_CHECK(cudaEventCreate(&e0), "model(cuda): event");
    if (st == KVS_OK) st = KVS_CUDA_CHECK(cudaEventCreate(&e1), "model(cuda): event");
    double best = 0;
    for (int rep = 0; rep < 6 && st == KVS_OK; rep++) {
        cudaEventRecord(e0, 0);
        for (int i = 0; i < 5; i++) cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0);
        cudaEventRecord(e1, 0);
        st = KVS_CUDA_CHECK(cudaEventSynchronize(e1), "model(cuda): copy");
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        const double r = 5.0 * 2.0 * (double) bytes / (ms * 1e-3); /* read + written */
        if (rep > 0 && r > best) best = r;
    }
    if (e0 != NULL) cudaEventDestroy(e0);
    if (e1 != NULL) cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    *bytes_s_p = best;
    return st;
}
