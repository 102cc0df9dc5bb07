/* Internal extras of the CUDA copy backend for its benchmark and tests: the stream it enqueues
 * on, and its launch plan and index arithmetic exposed as pure host functions so they can be
 * checked on machines without a GPU. The constructor is declared in staging/copy.h. */
#ifndef KVSTAGE_STAGING_CUDA_COPY_CUDA_H
#define KVSTAGE_STAGING_CUDA_COPY_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "staging/copy.h" /* a C header without its own C++ guards */

/* How one copy is cut for the kernel. */
typedef enum {
    KVS_CUDA_RUN_HEAD = 0,  /* general strides: a contiguous run is one head (D*E bytes) */
    KVS_CUDA_RUN_TOKEN = 1, /* the selected heads of a token are contiguous (NHD) */
    KVS_CUDA_RUN_PAGE = 2,  /* the selected heads of a whole page are contiguous (NHD, all heads) */
} kvs_cuda_run_t;

typedef struct {
    uint32_t vec_bytes; /* bytes each thread moves per access: 16, 8, 4, 2 or 1 */
    kvs_cuda_run_t run; /* the coarsest run every (layer, component) allows */
    uint32_t entries;   /* (layer, component) blocks: the grid's y extent */
    uint32_t blocks_x;  /* thread blocks per (layer, component) */
} kvs_cuda_plan_t;

/* The plan the backend would launch for a validated descriptor with npages > 0; logs and
 * returns KVS_ERR_UNSUPPORTED for copies too large for one launch. Pure host code. */
kvs_status_t kvs__copy_cuda_plan(const kvs_copy_desc_t *desc, kvs_cuda_plan_t *plan_p);

/* Checks the kernels' 32-bit division by invariant divisors against plain division on `iters`
 * random (dividend, divisor) pairs plus the edge cases; returns the number of mismatches and
 * prints the first. Pure host code. */
uint64_t kvs__copy_cuda_fastdiv_check(uint64_t seed, uint64_t iters);

/* Copies whose (layer, component) table and page ids take at most `bytes` (capped at the
 * backend's limit, 16 KiB) travel inside the kernel's parameters instead of being uploaded
 * first; 0 sends every copy through the upload. For tests and benchmarks of both paths. */
kvs_status_t kvs__copy_cuda_set_inline_max(const kvs_copy_backend_t *backend, size_t bytes);

/* The cudaStream_t a CUDA backend enqueues its copies on, so a benchmark can bracket copies
 * with events; NULL for any other backend. */
void *kvs_copy_cuda_stream(const kvs_copy_backend_t *backend);

#ifdef __cplusplus
}
#endif

#endif
