/* How a TP model's ranks sum their row-split partials (model.h: kvs_model_use_group): the
 * decision, a pure function of what the ranks exchanged, and the collective set-up that
 * exchanges it over the host TP group and, for NCCL, creates the communicator. */
#include <stdio.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "model/cuda/model_cuda.h"
#include "model/model_internal.h"
#include "model/tpgroup.h"

kvs_model_reduce_t kvs_model_reduce_choose(const int *devices, uint32_t n, int nccl, char *why,
                                           size_t why_len)
{
    char scratch[8];
    if (why == NULL || why_len == 0) {
        why = scratch;
        why_len = sizeof(scratch);
    }
    if (n < 2 || devices == NULL) {
        snprintf(why, why_len, "one rank: nothing to reduce");
        return KVS_MODEL_REDUCE_HOST;
    }
    for (uint32_t r = 0; r < n; r++) {
        if (devices[r] < 0) {
            snprintf(why, why_len,
                     "rank %u is on the CPU: reducing through the host TP group (rank order)", r);
            return KVS_MODEL_REDUCE_HOST;
        }
    }
    for (uint32_t r = 0; r < n; r++) {
        for (uint32_t q = 0; q < r; q++) {
            if (devices[q] == devices[r]) {
                snprintf(why, why_len,
                         "ranks %u and %u share GPU %d (NCCL takes one rank per GPU): reducing "
                         "through the host TP group (correct, slow)",
                         q, r, devices[r]);
                return KVS_MODEL_REDUCE_HOST;
            }
        }
    }
    if (!nccl) {
        snprintf(why, why_len,
                 "the ranks are on distinct GPUs but this kvstage was built without NCCL: "
                 "reducing through the host TP group (correct, slow)");
        return KVS_MODEL_REDUCE_HOST;
    }
    snprintf(why, why_len, "the %u ranks are on distinct GPUs: reducing through NCCL", n);
    return KVS_MODEL_REDUCE_NCCL;
}

kvs_model_reduce_t kvs_model_reduce_path(const kvs_model_t *m)
{
    return m->reduce;
}

/* What rank 0 broadcasts for NCCL: whether it has an id, and the id. */
typedef struct {
    uint8_t ok;
    uint8_t id[KVS_MODEL_NCCL_ID_BYTES];
} nccl_hello_t;

kvs_status_t kvs_model_use_group(kvs_model_t *m, kvs_tpgroup_t *group, kvs_model_reduce_t *path_p)
{
    if (m == NULL || group == NULL) {
        kvs_error("model: use_group needs a model and its TP group");
        return KVS_ERR_INVALID;
    }
    const uint32_t n = kvs_tpgroup_size(group), rank = kvs_tpgroup_rank(group);
    if (n != m->tp.tp_size || rank != m->tp.tp_rank) {
        kvs_error("model: TP rank %u of %u cannot use the group's rank %u of %u", m->tp.tp_rank,
                  m->tp.tp_size, rank, n);
        return KVS_ERR_INVALID;
    }
    if (m->grouped) {
        kvs_error("model: TP rank %u already chose how to reduce", rank);
        return KVS_ERR_INVALID;
    }
    m->grouped = 1;
    m->reduce = KVS_MODEL_REDUCE_HOST;
    if (path_p) *path_p = KVS_MODEL_REDUCE_HOST;
    if (n == 1) return KVS_OK;

    /* Every rank's device, NCCL and SM count, in rank r's slots of a sum (all else zero). */
    double *buf = kvs_calloc(3 * (size_t) n, sizeof(double));
    int *devices = kvs_malloc(n * sizeof(int));
    if (buf == NULL || devices == NULL) {
        kvs_free(buf);
        kvs_free(devices);
        return KVS_ERR_NOMEM;
    }
    buf[rank] = (double) m->device + 1.0;
    buf[n + rank] = m->cuda != NULL && kvs__model_cuda_have_nccl() ? 1.0 : 0.0;
    buf[2 * n + rank] = m->cuda != NULL ? (double) kvs__model_cuda_sms(m->cuda) : 0.0;
    kvs_status_t st = kvs_tpgroup_allreduce(group, buf, 3 * (size_t) n);
    if (st != KVS_OK) {
        kvs_error("model: TP rank %u: exchanging the ranks' devices over the TP group failed: %s",
                  rank, kvs_status_str(st));
        kvs_free(buf);
        kvs_free(devices);
        return st;
    }
    int nccl = 1;
    uint32_t sms = 0;
    for (uint32_t r = 0; r < n; r++) {
        devices[r] = (int) buf[r] - 1;
        if (buf[n + r] != 1.0) nccl = 0;
        const uint32_t s = (uint32_t) buf[2 * n + r];
        if (r == 0 || s < sms) sms = s;
    }
    kvs_free(buf);
    char why[160];
    kvs_model_reduce_t path = kvs_model_reduce_choose(devices, n, nccl, why, sizeof(why));
    kvs_free(devices);
    if (path == KVS_MODEL_REDUCE_HOST) {
        if (rank == 0) kvs_info("model: TP %u: %s", n, why);
        return KVS_OK;
    }

    nccl_hello_t hello;
    memset(&hello, 0, sizeof(hello));
    if (rank == 0) hello.ok = kvs__model_cuda_nccl_id(hello.id) == KVS_OK;
    if ((st = kvs_tpgroup_broadcast(group, &hello, sizeof(hello))) != KVS_OK) {
        kvs_error("model: TP rank %u: sharing the NCCL id over the TP group failed: %s", rank,
                  kvs_status_str(st));
        return st;
    }
    if (!hello.ok) {
        kvs_warn("model: TP %u on distinct GPUs: rank 0 could not make an NCCL id (its log says "
                 "why): reducing through the host TP group instead (correct, slow)",
                 n);
        return KVS_OK;
    }
    st = kvs__model_cuda_nccl_init(m->cuda, hello.id, n, rank, sms, kvs_tpgroup_timeout_ns(group));
    if (st != KVS_OK) {
        kvs_error("model: TP rank %u on GPU %d: NCCL could not be set up (above); the instance "
                  "cannot start. Ranks sharing one GPU, or a kvstage built without NCCL, reduce "
                  "through the host TP group instead",
                  rank, m->device);
        return st;
    }
    m->reduce = KVS_MODEL_REDUCE_NCCL;
    if (path_p) *path_p = KVS_MODEL_REDUCE_NCCL;
    if (rank == 0) kvs_info("model: TP %u: %s", n, why);
    return KVS_OK;
}
