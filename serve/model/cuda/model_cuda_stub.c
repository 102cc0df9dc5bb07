/* The CUDA model backend's entry points in builds without CUDA: a model asked for on a device
 * is refused at creation with one logged line, so nothing else is ever reached. With CUDA the
 * real ones live in model_cuda.cu and this file is empty. */
#include "model/cuda/model_cuda.h"

#if !KVS_HAVE_CUDA
#include "kvstage/log.h"

kvs_status_t kvs__model_cuda_create(const kvs_model_t *m, int device, int tied,
                                    kvs_model_cuda_t **cuda_p)
{
    (void) m;
    (void) tied;
    (void) cuda_p;
    kvs_error("model: CUDA device %d: this kvstage was built without CUDA (configure with nvcc "
              "available and -DKVS_CUDA=ON)",
              device);
    return KVS_ERR_UNSUPPORTED;
}

void kvs__model_cuda_destroy(kvs_model_cuda_t *c)
{
    (void) c;
}

kvs_status_t kvs__model_cuda_loader_create(kvs_model_cuda_t *c, kvs_model_cuda_loader_t **loader_p)
{
    (void) c, (void) loader_p;
    return KVS_ERR_UNSUPPORTED;
}

void kvs__model_cuda_loader_destroy(kvs_model_cuda_loader_t *l)
{
    (void) l;
}

kvs_status_t kvs__model_cuda_put_raw(kvs_model_cuda_loader_t *l, uint64_t id,
                                     const kvs_gguf_tensor_t *t, uint64_t row0, uint64_t nrows,
                                     uint64_t col0, uint64_t ncols)
{
    (void) l, (void) id, (void) t, (void) row0, (void) nrows, (void) col0, (void) ncols;
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs__model_cuda_get(kvs_model_cuda_t *c, uint64_t id, uint64_t nrows, uint64_t ncols,
                                 void *host)
{
    (void) c, (void) id, (void) nrows, (void) ncols, (void) host;
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs__model_cuda_seed(kvs_model_cuda_t *c, uint64_t id,
                                  const kvs_model_seed_rule_t *rule, uint64_t rows, uint64_t cols,
                                  uint64_t row0, uint64_t nrows, uint64_t col0, uint64_t ncols)
{
    (void) c, (void) id, (void) rule, (void) rows, (void) cols, (void) row0, (void) nrows,
        (void) col0, (void) ncols;
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs__model_cuda_forward(kvs_model_t *m, kvs_pool_t *pool, const kvs_model_seq_t *seqs,
                                     uint32_t nseq, kvs_allreduce_fn reduce, void *reduce_arg,
                                     float *logits)
{
    (void) m, (void) pool, (void) seqs, (void) nseq, (void) reduce, (void) reduce_arg,
        (void) logits;
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs__model_cuda_gemm_flops(int device, uint32_t m, uint32_t n, uint32_t k,
                                        double *flops_p)
{
    (void) device, (void) m, (void) n, (void) k, (void) flops_p;
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs__model_cuda_copy_bytes_s(int device, size_t bytes, double *bytes_s_p)
{
    (void) device, (void) bytes, (void) bytes_s_p;
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs__model_cuda_sync(kvs_model_cuda_t *c)
{
    (void) c;
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs__model_cuda_sample_rows(int device, const float *logits, uint32_t rows,
                                         uint32_t vocab, const kvs_sample_params_t *params,
                                         const double *draws, uint32_t *tokens)
{
    (void) device, (void) logits, (void) rows, (void) vocab, (void) params, (void) draws,
        (void) tokens;
    return KVS_ERR_UNSUPPORTED;
}

const char *kvs__model_cuda_op_name(kvs_cuda_op_t op)
{
    (void) op;
    return "?";
}

kvs_status_t kvs__model_cuda_profile(kvs_model_cuda_t *c, int on)
{
    (void) c, (void) on;
    return KVS_ERR_UNSUPPORTED;
}

void kvs__model_cuda_profile_read(const kvs_model_cuda_t *c, double *ms, uint64_t *calls)
{
    (void) c;
    for (int k = 0; k < KVS_CUDA_OPS; k++) ms[k] = 0;
    *calls = 0;
}

int kvs__model_cuda_have_nccl(void)
{
    return 0;
}

uint32_t kvs__model_cuda_sms(const kvs_model_cuda_t *c)
{
    (void) c;
    return 0;
}

kvs_status_t kvs__model_cuda_nccl_id(uint8_t id[KVS_MODEL_NCCL_ID_BYTES])
{
    (void) id;
    return KVS_ERR_UNSUPPORTED;
}

kvs_status_t kvs__model_cuda_nccl_init(kvs_model_cuda_t *c, const uint8_t *id, uint32_t nranks,
                                       uint32_t rank, uint32_t sms, uint64_t timeout_ns)
{
    (void) c, (void) id, (void) nranks, (void) rank, (void) sms, (void) timeout_ns;
    return KVS_ERR_UNSUPPORTED;
}
#else
/* ISO C forbids an empty translation unit. */
typedef int kvs__model_cuda_stub_unused_t;
#endif
