/* `kvstage bench transfer --transport ucx`: one request's KV between two processes over the net
 * link (ZeroMQ control + UCX data, host memory, CPU copy backend): the staged protocol against
 * one raw bulk link write of the same bytes and one link write per page. */
#ifndef KVSTAGE_TOOLS_BENCH_TRANSFER_UCX_H
#define KVSTAGE_TOOLS_BENCH_TRANSFER_UCX_H

#include <stdint.h>

#include "bench/bench_transfer_common.h"

typedef struct {
    uint32_t tokens[KVS_BT_MAX_LIST]; /* request sizes */
    int ntokens;
    uint32_t prefill_tp, decode_tp;
    uint32_t page_size, chunk, window, buffers, ring_slots;
    uint32_t head_dim; /* of the scaled 8B shape: 32 layers, 8 KV heads, bf16 */
    uint32_t reps, warmup;
    uint64_t per_page_max; /* per-page writes timed per row */
    int tcp;               /* UCX data over tcp on loopback instead of shared memory */
    int nhd;               /* NHD pools (TP 1:1 only) instead of HND */
    int checksum;          /* KVS_BT_CSUM_*: protocol runs with chunk checksums on, off or both */
    int json;
} kvs_bench_ucx_cfg_t;

/* Runs the benchmark (forks the prefill process). Returns the exit code: 0 ok, 1 failed run or
 * failed check. */
int kvs_bench_transfer_ucx(const kvs_bench_ucx_cfg_t *cfg);

#endif
