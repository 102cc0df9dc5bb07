/* How a TP model reduces (model.h: kvs_model_reduce_choose, kvs_model_use_group): the decision
 * for every kind of placement (ranks on distinct GPUs -> NCCL when built with it; ranks sharing
 * a GPU, on the CPU, or a build without NCCL -> the host TP group) with the reason it gives,
 * and the collective set-up on CPU models over a real TP group of threads (the host path on
 * every rank, the refusals). The NCCL set-up itself needs two GPUs (test_forward_cuda). */
#include "kvs_test.h"

#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "model/model.h"
#include "model/tpgroup.h"

static kvs_model_reduce_t choose(const int *devices, uint32_t n, int nccl, char *why)
{
    return kvs_model_reduce_choose(devices, n, nccl, why, 200);
}

static void test_choose(void **state)
{
    (void) state;
    char why[200];
    const int distinct[4] = {0, 1, 2, 3}, unordered[3] = {3, 0, 7};
    assert_int_equal(choose(distinct, 2, 1, why), KVS_MODEL_REDUCE_NCCL);
    assert_non_null(strstr(why, "distinct GPUs"));
    assert_int_equal(choose(distinct, 4, 1, why), KVS_MODEL_REDUCE_NCCL);
    assert_int_equal(choose(unordered, 3, 1, why), KVS_MODEL_REDUCE_NCCL);
    /* the same placements without NCCL: the host, saying so */
    assert_int_equal(choose(distinct, 4, 0, why), KVS_MODEL_REDUCE_HOST);
    assert_non_null(strstr(why, "without NCCL"));

    /* any two ranks sharing a GPU: the host, naming the pair and the GPU */
    const int shared_all[3] = {0, 0, 0}, shared_late[4] = {2, 5, 1, 5},
              shared_far[4] = {4, 1, 2, 4};
    assert_int_equal(choose(shared_all, 3, 1, why), KVS_MODEL_REDUCE_HOST);
    assert_non_null(strstr(why, "ranks 0 and 1 share GPU 0"));
    assert_non_null(strstr(why, "host TP group"));
    assert_int_equal(choose(shared_late, 4, 1, why), KVS_MODEL_REDUCE_HOST);
    assert_non_null(strstr(why, "ranks 1 and 3 share GPU 5"));
    assert_int_equal(choose(shared_far, 4, 1, why), KVS_MODEL_REDUCE_HOST);
    assert_non_null(strstr(why, "ranks 0 and 3 share GPU 4"));

    /* a rank on the CPU: the host */
    const int cpu[2] = {-1, -1}, mixed[3] = {0, -1, 1};
    assert_int_equal(choose(cpu, 2, 1, why), KVS_MODEL_REDUCE_HOST);
    assert_non_null(strstr(why, "rank 0 is on the CPU"));
    assert_int_equal(choose(mixed, 3, 1, why), KVS_MODEL_REDUCE_HOST);
    assert_non_null(strstr(why, "rank 1 is on the CPU"));

    /* one rank: nothing to reduce; why may be NULL, or short (cut, terminated) */
    assert_int_equal(choose(distinct, 1, 1, why), KVS_MODEL_REDUCE_HOST);
    assert_int_equal(kvs_model_reduce_choose(distinct, 2, 1, NULL, 0), KVS_MODEL_REDUCE_NCCL);
    char tiny[6];
    memset(tiny, 'x', sizeof(tiny));
    assert_int_equal(kvs_model_reduce_choose(shared_all, 3, 1, tiny, sizeof(tiny)),
                     KVS_MODEL_REDUCE_HOST);
    assert_int_equal(strlen(tiny), sizeof(tiny) - 1);
}

static kvs_model_config_t tiny_config(void)
{
    kvs_model_config_t c = {.layers = 1,
                            .dim = 32,
                            .ffn_dim = 64,
                            .heads = 4,
                            .kv_heads = 2,
                            .head_dim = 8,
                            .vocab = 50,
                            .max_ctx = 64,
                            .rope_theta = 10000.0f,
                            .norm_eps = 1e-5f};
    return c;
}

typedef struct {
    const char *name;
    uint32_t size, rank;
    kvs_model_t *model;
    kvs_tpgroup_t *group;
    kvs_model_reduce_t path;
    kvs_status_t st, st_again;
} rank_t;

static void *rank_main(void *arg)
{
    rank_t *r = arg;
    kvs_tpgroup_config_t gc = {.name = r->name,
                               .size = r->size,
                               .rank = r->rank,
                               .max_doubles = 64,
                               .max_bytes = 1024,
                               .timeout_ms = 30000};
    r->st = kvs_tpgroup_join(&gc, &r->group);
    r->path = KVS_MODEL_REDUCE_NCCL; /* must be overwritten */
    if (r->st == KVS_OK) r->st = kvs_model_use_group(r->model, r->group, &r->path);
    /* once per model: a second call is refused on every rank alike, touching no group */
    if (r->st == KVS_OK) r->st_again = kvs_model_use_group(r->model, r->group, NULL);
    return NULL;
}

/* CPU ranks over a real group: every rank takes the host path, and the forward pass still
 * needs the host all-reduce. */
static void test_use_group_cpu(void **state)
{
    (void) state;
    const kvs_model_config_t c = tiny_config();
    for (uint32_t size = 1; size <= 2; size++) {
        char name[64];
        snprintf(name, sizeof(name), "/kvs-reduce-test-%d-%u", (int) getpid(), size);
        rank_t r[2];
        pthread_t th[2];
        for (uint32_t k = 0; k < size; k++) {
            memset(&r[k], 0, sizeof(r[k]));
            r[k].name = name;
            r[k].size = size;
            r[k].rank = k;
            assert_int_equal(kvs_model_seeded(&c, 3, (kvs_tp_t){size, k}, &r[k].model), KVS_OK);
            assert_int_equal(kvs_model_reduce_path(r[k].model), KVS_MODEL_REDUCE_HOST);
            assert_int_equal(pthread_create(&th[k], NULL, rank_main, &r[k]), 0);
        }
        for (uint32_t k = 0; k < size; k++) pthread_join(th[k], NULL);
        for (uint32_t k = 0; k < size; k++) {
            assert_int_equal(r[k].st, KVS_OK);
            assert_int_equal(r[k].path, KVS_MODEL_REDUCE_HOST);
            assert_int_equal(kvs_model_reduce_path(r[k].model), KVS_MODEL_REDUCE_HOST);
            assert_int_equal(r[k].st_again, KVS_ERR_INVALID);
        }
        if (size == 2) {
            /* the host path needs the forward call's all-reduce (refused before any work) */
            kvs_pool_config_t pc = {.shape = kvs_model_kv_shape(r[0].model),
                                    .tp = {2, 0},
                                    .page_size = 16,
                                    .num_pages = 4,
                                    .layout = KVS_POOL_NHD,
                                    .mem = KVS_MEM_HOST};
            kvs_pool_t *pool = NULL;
            assert_int_equal(kvs_pool_create(&pc, &pool), KVS_OK);
            uint32_t page, tok = 1;
            assert_int_equal(kvs_pool_alloc(pool, 1, &page), KVS_OK);
            kvs_model_seq_t q = {.tokens = &tok, .n = 1, .pos0 = 0, .pages = &page, .npages = 1};
            float logits[50];
            assert_int_equal(kvs_model_forward(r[0].model, pool, &q, 1, NULL, NULL, logits),
                             KVS_ERR_INVALID);
            kvs_pool_destroy(pool);
        }
        for (uint32_t k = 0; k < size; k++) {
            kvs_tpgroup_leave(r[k].group);
            kvs_model_destroy(r[k].model);
        }
    }
    kvs_assert_no_leaks();
}

/* A group of another size or rank than the model's, or none, is refused before any call. */
static void test_use_group_refusals(void **state)
{
    (void) state;
    const kvs_model_config_t c = tiny_config();
    kvs_model_t *m2 = NULL, *m1 = NULL;
    assert_int_equal(kvs_model_seeded(&c, 3, (kvs_tp_t){2, 1}, &m2), KVS_OK);
    assert_int_equal(kvs_model_seeded(&c, 3, (kvs_tp_t){1, 0}, &m1), KVS_OK);
    kvs_tpgroup_config_t gc = {.name = "/kvs-reduce-test-unused",
                               .size = 1,
                               .rank = 0,
                               .max_doubles = 64,
                               .max_bytes = 64,
                               .timeout_ms = 1000};
    kvs_tpgroup_t *g = NULL;
    assert_int_equal(kvs_tpgroup_join(&gc, &g), KVS_OK);
    kvs_model_reduce_t path = KVS_MODEL_REDUCE_NCCL;
    assert_int_equal(kvs_model_use_group(m2, g, &path), KVS_ERR_INVALID); /* TP2 vs size 1 */
    assert_int_equal(path, KVS_MODEL_REDUCE_NCCL);                        /* untouched */
    assert_int_equal(kvs_model_use_group(m1, NULL, &path), KVS_ERR_INVALID);
    assert_int_equal(kvs_model_use_group(NULL, g, &path), KVS_ERR_INVALID);
    /* the refused model can still choose (nothing was recorded) */
    assert_int_equal(kvs_model_use_group(m1, g, &path), KVS_OK);
    assert_int_equal(path, KVS_MODEL_REDUCE_HOST);
    kvs_tpgroup_leave(g);
    kvs_model_destroy(m1);
    kvs_model_destroy(m2);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_choose),
        cmocka_unit_test(test_use_group_cpu),
        cmocka_unit_test(test_use_group_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
