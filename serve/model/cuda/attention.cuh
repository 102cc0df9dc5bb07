/* Paged causal attention on the device (internal to the CUDA model backend).
 *
 * One thread block (4 warps) computes 64 rows: a row is (token, query head), the query heads
 * of a row block all reading one KV head (rows token-major: row r is token tok0 + r / group,
 * head qh0 + r % group), so each K/V tile read from the pool serves every head of the group.
 * Per tile of 64 positions it computes S = Q K^T on the tensor cores (mma m16n8k16, bf16 in,
 * f32 out), masks positions past each row's own position (causal within the new tokens, all
 * of the cached prefix visible), keeps a running max and sum (online softmax, base 2) and
 * accumulates P V on the tensor cores, P rounded to bf16. Tiles stream into shared memory with
 * cp.async in two stages, the next tile's reads under this tile's math. A block covers positions
 * [kv_begin, kv_end); when one row block's positions are split over several blocks (a call
 * with few rows and a long context: decode), each writes its unnormalised output, max and sum
 * to a partial slot and a second kernel combines the slots of each row block. */
#ifndef KVSTAGE_MODEL_CUDA_ATTENTION_CUH
#define KVSTAGE_MODEL_CUDA_ATTENTION_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "kvstage/pool.h"
#include "kvstage/status.h"
}

namespace kvs_cuda
{

constexpr uint32_t ATTN_ROWS = 64;     /* rows of one block */
constexpr uint32_t ATTN_TILE = 64;     /* positions per K/V tile */
constexpr uint32_t ATTN_NO_PART = ~0u; /* work item writes the final output */

struct attn_work_t {
    uint32_t page_off;         /* the sequence's page table: pages + page_off */
    uint32_t tok0, ntok;       /* tokens (rows of q / out) of the block, ntok * group <= 64 */
    uint32_t kvh, qh0;         /* local KV head; first local query head reading it */
    uint32_t kv_begin, kv_end; /* positions this block reads */
    uint32_t part;             /* ATTN_NO_PART, or the partial slot it writes */
};

struct attn_combine_t {
    uint32_t part0, nsplit; /* slots part0 .. part0 + nsplit - 1 */
    uint32_t tok0, ntok, qh0;
};

struct attn_args_t {
    const __nv_bfloat16 *q; /* token t, head h at q + t * q_stride + h * head_dim */
    uint32_t q_stride;
    __nv_bfloat16 *out; /* token t, head h at out + t * out_stride + h * head_dim */
    uint32_t out_stride;
    kvs_region_t k, v; /* this layer's regions (device bases) */
    uint32_t page_size;
    const uint32_t *pages; /* page tables, concatenated */
    const uint32_t *pos;   /* [tokens] position of each token */
    uint32_t group;        /* query heads per KV head on this rank */
    float scale_log2;      /* log2(e) / sqrt(head_dim) */
    float *part_o;         /* [slot][64][head_dim] */
    float *part_ml;        /* [slot][64][2]: max, sum */
};

/* Launches the blocks of `work` (device memory) and then the combines, on `stream`. head_dim
 * 64 or 128 (KVS_ERR_UNSUPPORTED otherwise). */
kvs_status_t attention_launch(const attn_args_t &a, uint32_t head_dim, const attn_work_t *work,
                              uint32_t nwork, const attn_combine_t *combine, uint32_t ncombine,
                              cudaStream_t stream);

} // namespace kvs_cuda

#endif
