/* Shared test helpers: cmocka includes, leak checks against the accounted allocator, and a
 * seed taken from KVS_SEED so property tests are reproducible. */
#ifndef KVSTAGE_TESTS_KVS_TEST_H
#define KVSTAGE_TESTS_KVS_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "kvstage/alloc.h"

/* Asserts that no accounted allocation is live. */
#define kvs_assert_no_leaks()                                                                      \
    do {                                                                                           \
        kvs_alloc_stats_t st_;                                                                     \
        kvs_alloc_stats(&st_);                                                                     \
        if (st_.live_blocks != 0)                                                                  \
            fail_msg("leak: %llu blocks, %llu bytes still allocated",                              \
                     (unsigned long long) st_.live_blocks, (unsigned long long) st_.live_bytes);   \
    } while (0)

/* The seed for property tests: KVS_SEED from the environment, else the given default. */
static inline uint64_t kvs_test_seed(uint64_t dflt)
{
    const char *s = getenv("KVS_SEED");
    return s ? strtoull(s, NULL, 0) : dflt;
}

/* Iteration count: KVS_ITERS from the environment (for soaks), else the given default. */
static inline uint64_t kvs_test_iters(uint64_t dflt)
{
    const char *s = getenv("KVS_ITERS");
    return s ? strtoull(s, NULL, 0) : dflt;
}

#endif
