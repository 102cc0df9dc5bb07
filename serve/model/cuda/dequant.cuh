/* What dequant.cu needs from model_cuda.cu (internal to the CUDA model backend): where a weight
 * shard lives on the device and the stream its writes go on. */
#ifndef KVSTAGE_MODEL_CUDA_DEQUANT_CUH
#define KVSTAGE_MODEL_CUDA_DEQUANT_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "kvstage/status.h"
#include "model/cuda/model_cuda.h"
}

namespace kvs_cuda
{

/* A shard's place: a bf16 matrix [nrows][ncols] (b) or an f32 vector (f), one of them set. */
struct weight_dst_t {
    __nv_bfloat16 *b;
    float *f;
    int device;
    cudaStream_t stream; /* the model's stream: weight writes are ordered before its forward */
};

/* Shard `id` (KVS_MODEL_T_* of a layer, or KVS_MODEL_ID_*) of model c, which must be
 * [nrows][ncols] on this rank; KVS_ERR_INVALID (logged) for an unknown id or another shape. */
kvs_status_t weight_target(kvs_model_cuda_t *c, uint64_t id, uint64_t nrows, uint64_t ncols,
                           weight_dst_t *dst_p);

} // namespace kvs_cuda

#endif
