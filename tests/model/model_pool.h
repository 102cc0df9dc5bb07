/* The model tests' pool: the model's KV shape and TP rank, in its memory (host, or device
 * memory of its CUDA device). */
#ifndef KVSTAGE_TESTS_MODEL_POOL_H
#define KVSTAGE_TESTS_MODEL_POOL_H

#include <string.h>

#include "kvs_test.h"
#include "kvstage/pool.h"
#include "model/model.h"

static inline kvs_pool_t *make_pool(const kvs_model_t *m, uint32_t page_size, uint32_t pages,
                                    kvs_pool_layout_t layout)
{
    kvs_pool_config_t c;
    memset(&c, 0, sizeof(c));
    c.shape = kvs_model_kv_shape(m);
    c.tp = kvs_model_tp(m);
    c.page_size = page_size;
    c.num_pages = pages;
    c.layout = layout;
    c.mem = kvs_model_device(m) < 0 ? KVS_MEM_HOST : KVS_MEM_DEVICE;
    c.device = kvs_model_device(m) < 0 ? 0 : kvs_model_device(m);
    kvs_pool_t *pool = NULL;
    assert_int_equal(kvs_pool_create(&c, &pool), KVS_OK);
    return pool;
}

#endif
