/* Fixtures shared by the copy-backend tests (CPU reference and CUDA): a counting log sink,
 * descriptors over a pool's regions, a blocking copy, and random page lists and TP sizes. */
#ifndef KVS_TEST_COPY_FIXTURE_H
#define KVS_TEST_COPY_FIXTURE_H

#include "kvs_test.h"

#include <stdlib.h>
#include <string.h>

#include "kvstage/layout.h"
#include "kvstage/log.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "staging/copy.h"

/* Counts messages instead of printing them, for calls that are meant to fail. */
static inline void quiet_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                              const char *msg)
{
    (void) level;
    (void) file;
    (void) line;
    (void) msg;
    (*(int *) arg)++;
}

static inline kvs_copy_desc_t copy_desc(const kvs_pool_t *pool, const kvs_region_t *regions,
                                        const uint32_t *pages, uint32_t npages, uint32_t pool_head,
                                        uint32_t heads, uint8_t *region, uint64_t region_bytes)
{
    const kvs_pool_config_t *c = kvs_pool_config(pool);
    kvs_copy_desc_t d;
    memset(&d, 0, sizeof(d));
    d.regions = regions;
    d.layers = c->shape.layers;
    d.components = kvs_kv_shape_components(&c->shape);
    d.shape = &c->shape;
    d.pages = pages;
    d.npages = npages;
    d.pool_pages = c->num_pages;
    d.page_size = c->page_size;
    d.pool_head = pool_head;
    d.heads = heads;
    d.region = region;
    d.region_bytes = region_bytes;
    return d;
}

static inline void run_copy(const kvs_copy_backend_t *b, kvs_copy_dir_t dir,
                            const kvs_copy_desc_t *d)
{
    uint64_t ticket = 0;
    assert_int_equal(kvs_copy_submit(b, dir, d, &ticket), KVS_OK);
    assert_true(ticket > 0);
    kvs_status_t st;
    while ((st = kvs_copy_poll(b, ticket)) == KVS_INPROGRESS) {
    }
    assert_int_equal(st, KVS_OK);
}

/* Picks n distinct ids from [0, total) in random order. */
static inline void pick_pages(kvs_rng_t *rng, uint32_t total, uint32_t n, uint32_t *out)
{
    uint32_t *all = malloc(sizeof(uint32_t) * total);
    assert_non_null(all);
    for (uint32_t i = 0; i < total; i++) all[i] = i;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k = i + (uint32_t) kvs_rng_below(rng, total - i);
        uint32_t t = all[i];
        all[i] = all[k];
        all[k] = t;
        out[i] = all[i];
    }
    free(all);
}

/* A TP size that divides the head count or is a multiple of it. */
static inline uint32_t pick_tp(kvs_rng_t *rng, uint32_t H)
{
    static const uint32_t tps[] = {1, 2, 3, 4, 6, 8};
    for (;;) {
        uint32_t t = tps[kvs_rng_below(rng, 6)];
        if (H % t == 0 || t % H == 0) return t;
    }
}

#endif
