/* The CUDA backend of the model (internal; model.c and forward.c call it for a model created on
 * a device). Weights live on the device in bf16 (norm weights in f32); the q/k/v rows of a
 * layer are one matrix, and so are the gate/up rows, so each is one projection. The forward
 * pass runs on the device: cuBLAS (bf16 inputs, f32 accumulation) for every projection, our
 * kernels for embedding, RMSNorm, RoPE, the KV write into the paged pool (bf16), paged
 * attention (tensor-core tiles with an online softmax, split over the positions when a call
 * has too few tiles to fill the GPU, then a reduction) and SwiGLU. The residual stream stays
 * f32; the logits come back to the host in f32, or stay on the device for the sequences that
 * sample there (kvs_model_seq_t.sample: sample.cuh) and only their tokens come back.
 *
 * Tolerances instead of the CPU's bitwise rules (ops.h): every matrix input is rounded to bf16
 * (a relative error of at most 2^-9 per element), sums are f32, and results do not depend on
 * batching or chunking beyond that rounding. The logits are held to 0.05 + 3% of the largest
 * CPU logit's magnitude against the CPU reference (tests/model/test_forward_cuda.c; measured:
 * at most half of that bound on SmolLM2, a sixth on seeded shapes). Calls of one shape
 * (tokens, sequences, attention blocks, buffers and pool) replay a captured CUDA graph.
 *
 * Tensor parallelism (kvs_model_use_group decides, every rank alike): ranks on pairwise distinct
 * GPUs, in a build with NCCL, all-reduce the row-split partials (f32) in place on the device
 * with ncclAllReduce on the model's stream and add them to the residual there, so TP calls
 * replay CUDA graphs as TP1 calls do (the graph key holds only values equal on every rank: a
 * graph with NCCL calls must be captured and launched by all ranks together). NCCL sums in its
 * own order, not rank order: the logits are not bitwise the host path's (both stay within the
 * tolerance above), but they are identical on every rank, as an all-reduce leaves every rank
 * the same sum, which is what the engine needs (every rank samples the same token). The wait
 * for a call's end is bounded by the group's deadline: a peer that is gone mid-call aborts the
 * communicator and fails the call (KVS_ERR_TIMEOUT) instead of hanging. Ranks that share a GPU
 * (or a build without NCCL) reduce through the caller's host all-reduce (copied out and back,
 * rank order, the CPU's rule): correct, and slow; those calls are not graphed. */
#ifndef KVSTAGE_MODEL_CUDA_H
#define KVSTAGE_MODEL_CUDA_H

#include <stdint.h>

#include "model/model_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Allocates the weights of model m's rank (its config, slices and q_kv set) on `device`;
 * KVS_ERR_UNSUPPORTED without CUDA, without the device, or for a head dim other than 64/128. */
kvs_status_t kvs__model_cuda_create(const kvs_model_t *m, int device, int tied,
                                    kvs_model_cuda_t **cuda_p);
void kvs__model_cuda_destroy(kvs_model_cuda_t *c);

/* Loading from GGUF (dequant.cu): the raw tensor bytes go to the device and are decoded there.
 * A loader holds the staging buffers (pinned host and device, made on first use) that every
 * shard of one load reuses; destroy it when the load is done. */
typedef struct kvs_model_cuda_loader kvs_model_cuda_loader_t;
kvs_status_t kvs__model_cuda_loader_create(kvs_model_cuda_t *c, kvs_model_cuda_loader_t **loader_p);
void kvs__model_cuda_loader_destroy(kvs_model_cuda_loader_t *l);
/* Stores shard `id` (KVS_MODEL_T_* of a layer, or KVS_MODEL_ID_*) from GGUF tensor t of any
 * supported type: rows [row0, row0 + nrows) and columns [col0, col0 + ncols) of t viewed as
 * rows of ne[0], as kvs_gguf_dequant cuts them. Only the blocks that cover the columns are
 * copied, a bounded piece at a time, so no host memory grows with the shard. The device
 * computes kvs_dequant_blocks' floats bit for bit (a NaN a quantised block's arithmetic makes
 * may carry another payload than the host's) and stores a matrix rounded to bf16 as
 * kvs_f32_to_bf16 does, a norm vector in f32. The shard is in place when this returns. */
kvs_status_t kvs__model_cuda_put_raw(kvs_model_cuda_loader_t *l, uint64_t id,
                                     const kvs_gguf_tensor_t *t, uint64_t row0, uint64_t nrows,
                                     uint64_t col0, uint64_t ncols);
/* For tests: copies shard `id` [nrows][ncols] back to host, bf16 bits (uint16_t) for a matrix,
 * f32 for a norm vector. */
kvs_status_t kvs__model_cuda_get(kvs_model_cuda_t *c, uint64_t id, uint64_t nrows, uint64_t ncols,
                                 void *host);
/* Generates shard `id` on the device by the seeded rule: rows [row0, row0 + nrows) and columns
 * [col0, col0 + ncols) of the full tensor [rows][cols]. */
kvs_status_t kvs__model_cuda_seed(kvs_model_cuda_t *c, uint64_t id,
                                  const kvs_model_seed_rule_t *rule, uint64_t rows, uint64_t cols,
                                  uint64_t row0, uint64_t nrows, uint64_t col0, uint64_t ncols);
/* kvs_model_forward for a model on the device; the arguments were checked. */
kvs_status_t kvs__model_cuda_forward(kvs_model_t *m, kvs_pool_t *pool, const kvs_model_seq_t *seqs,
                                     uint32_t nseq, kvs_allreduce_fn reduce, void *reduce_arg,
                                     float *logits);

/* The limits the engine benchmark sets beside its figures, measured on `device`: the FLOP/s
 * of a cuBLAS bf16 GEMM y[m][n] = x[m][k] w[n][k]^T (f32 accumulation, the projections' call),
 * and the HBM bytes/s of a device-to-device copy of `bytes` (read plus written). Best of a few
 * timed runs after a warm-up. */
kvs_status_t kvs__model_cuda_gemm_flops(int device, uint32_t m, uint32_t n, uint32_t k,
                                        double *flops_p);
kvs_status_t kvs__model_cuda_copy_bytes_s(int device, size_t bytes, double *bytes_s_p);
/* Where a forward call's device time goes (the engine benchmark's breakdown): while profiling
 * is on, calls run eagerly (no graph) with an event after every op, and each op's time (from the
 * event before it) is added to its kind. kvs__model_cuda_profile resets the sums. */
typedef enum {
    KVS_CUDA_OP_EMBED,
    KVS_CUDA_OP_NORM,
    KVS_CUDA_OP_QKV,
    KVS_CUDA_OP_ROPE_KV, /* RoPE and the KV write */
    KVS_CUDA_OP_ATTENTION,
    KVS_CUDA_OP_WO,
    KVS_CUDA_OP_GATE_UP,
    KVS_CUDA_OP_SILU,
    KVS_CUDA_OP_DOWN,
    KVS_CUDA_OP_REDUCE, /* the TP all-reduce */
    KVS_CUDA_OP_HEAD,   /* final norm and the output projection */
    KVS_CUDA_OP_SAMPLE,
    KVS_CUDA_OPS
} kvs_cuda_op_t;
const char *kvs__model_cuda_op_name(kvs_cuda_op_t op);
kvs_status_t kvs__model_cuda_profile(kvs_model_cuda_t *c, int on);
/* The sums since profiling was turned on: ms[KVS_CUDA_OPS] and the calls profiled. */
void kvs__model_cuda_profile_read(const kvs_model_cuda_t *c, double *ms, uint64_t *calls);
/* Tests: samples rows [rows][vocab] of host logits on `device` with the forward pass's kernel
 * (params[i] and draws[i] for row i, as kvs_model_seq_t.sample and .draw) into tokens[rows]. */
kvs_status_t kvs__model_cuda_sample_rows(int device, const float *logits, uint32_t rows,
                                         uint32_t vocab, const kvs_sample_params_t *params,
                                         const double *draws, uint32_t *tokens);

/* NCCL (kvs_model_use_group): the size of an ncclUniqueId, as the TP group carries it. */
#define KVS_MODEL_NCCL_ID_BYTES 128
/* 1 when this build has NCCL. */
int kvs__model_cuda_have_nccl(void);
/* The device's multiprocessor count, which sizes the attention split (the ranks agree on one). */
uint32_t kvs__model_cuda_sms(const kvs_model_cuda_t *c);
/* Rank 0: a fresh NCCL id. KVS_ERR_UNSUPPORTED without NCCL, KVS_ERR_IO when NCCL fails. */
kvs_status_t kvs__model_cuda_nccl_id(uint8_t id[KVS_MODEL_NCCL_ID_BYTES]);
/* Creates rank `rank` of `nranks`'s communicator from `id` on the model's device, checks it
 * with one all-reduce of known values, and from then on reduces through it; `sms` (equal on
 * every rank) replaces the device's count in the attention split, `timeout_ns` bounds every
 * wait for device work that contains NCCL calls. KVS_ERR_IO with NCCL's reason. */
kvs_status_t kvs__model_cuda_nccl_init(kvs_model_cuda_t *c, const uint8_t *id, uint32_t nranks,
                                       uint32_t rank, uint32_t sms, uint64_t timeout_ns);

/* Waits for the model's device work (for timing). */
kvs_status_t kvs__model_cuda_sync(kvs_model_cuda_t *c);

#ifdef __cplusplus
}
#endif

#endif
