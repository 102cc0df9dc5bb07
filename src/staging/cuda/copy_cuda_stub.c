/* The CUDA copy backend's entry points in builds without CUDA, so callers link the same symbols
 * everywhere and learn at run time (KVS_ERR_UNSUPPORTED, one logged line) that the GPU path
 * is missing. With CUDA the real ones live in copy_cuda.cu and this file is empty. */
#include "staging/copy.h"

#if !KVS_HAVE_CUDA
#include "kvstage/log.h"

kvs_status_t kvs_copy_cuda_create(int device, kvs_copy_backend_t *backend_p)
{
    (void) backend_p;
    kvs_error("copy(cuda): device %d: this kvstage was built without CUDA (configure with "
              "nvcc available and -DKVS_CUDA=ON)",
              device);
    return KVS_ERR_UNSUPPORTED;
}

int kvs_copy_cuda_available(void)
{
    return 0;
}
#else
/* ISO C forbids an empty translation unit. */
typedef int kvs__copy_cuda_stub_unused_t;
#endif
