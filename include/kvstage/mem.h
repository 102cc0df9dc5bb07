/* Where a buffer of kvstage lives: host memory, or device memory of one CUDA device. Pools,
 * decode staging rings and prefill staging buffers of one rank all share their pool's kind. */
#ifndef KVSTAGE_MEM_H
#define KVSTAGE_MEM_H

typedef enum {
    KVS_MEM_HOST = 0,
    KVS_MEM_DEVICE = 1, /* cudaMalloc on a given device; needs a CUDA build (else unsupported) */
} kvs_mem_kind_t;

#endif
