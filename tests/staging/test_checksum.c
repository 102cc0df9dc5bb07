/* Tests for the writer-region checksum (src/staging/checksum.h): any split of the bytes, at
 * any offsets and in any order, sums to the checksum of the whole region (what lets copy loops
 * and GPU threads add the bytes they move); every single-bit change and every pair of
 * high-bit changes is detected; the length counts. */
#include "kvs_test.h"

#include <stdlib.h>
#include <string.h>

#include "kvstage/rng.h"
#include "staging/checksum.h"

static void fill(kvs_rng_t *rng, uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t) kvs_rng_next(rng);
}

/* Random cut points, pieces added in random order, through kvs_csum_add and kvs_csum_small. */
static void test_any_split_any_order(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(0xc5c5);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    uint8_t buf[1024];
    for (uint64_t iter = 0; iter < kvs_test_iters(2000); iter++) {
        const uint64_t n = kvs_rng_range(&rng, 0, sizeof(buf));
        fill(&rng, buf, n);
        const uint64_t want = kvs_csum_of(buf, n);
        uint64_t cuts[64];
        uint32_t ncuts = 0;
        cuts[ncuts++] = 0;
        while (ncuts < 63 && kvs_rng_chance(&rng, 7, 8)) cuts[ncuts++] = kvs_rng_range(&rng, 0, n);
        cuts[ncuts++] = n;
        for (uint32_t i = 1; i < ncuts; i++) /* sort */
            for (uint32_t j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
                uint64_t t = cuts[j];
                cuts[j] = cuts[j - 1];
                cuts[j - 1] = t;
            }
        kvs_csum_t total = {0};
        for (uint32_t k = ncuts - 1; k > 0; k--) { /* last piece first */
            kvs_csum_t part = {0};
            const uint64_t from = cuts[k - 1], len = cuts[k] - from;
            if (len <= 8 && kvs_rng_chance(&rng, 1, 2)) {
                uint64_t v = 0;
                memcpy(&v, buf + from, len);
                if (len > 0) kvs_csum_small(&part, from, v, (uint32_t) len);
            } else {
                kvs_csum_add(&part, from, buf + from, len);
            }
            kvs_csum_merge(&total, &part);
        }
        if (kvs_csum_final(&total, n) != want)
            fail_msg("seed 0x%llx iter %llu: %llu bytes in %u pieces sum differently",
                     (unsigned long long) seed, (unsigned long long) iter, (unsigned long long) n,
                     ncuts - 1);
    }
}

/* Every single-bit flip of small regions, and flips of the top bit of two words (the pattern
 * a multilinear sum without widening products would miss), change the checksum. */
static void test_changes_detected(void **state)
{
    (void) state;
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 7);
    uint8_t buf[200];
    fill(&rng, buf, sizeof(buf));
    for (size_t n = 1; n <= sizeof(buf); n += 13) {
        const uint64_t want = kvs_csum_of(buf, n);
        for (size_t bit = 0; bit < 8 * n; bit++) {
            buf[bit / 8] ^= (uint8_t) (1u << (bit % 8));
            if (kvs_csum_of(buf, n) == want)
                fail_msg("flip of bit %zu of %zu bytes missed", bit, n);
            buf[bit / 8] ^= (uint8_t) (1u << (bit % 8));
        }
    }
    const uint64_t want = kvs_csum_of(buf, sizeof(buf));
    for (size_t i = 7; i < sizeof(buf); i += 8)
        for (size_t j = i + 8; j < sizeof(buf); j += 8) {
            buf[i] ^= 0x80;
            buf[j] ^= 0x80;
            if (kvs_csum_of(buf, sizeof(buf)) == want)
                fail_msg("top-bit flips of words %zu and %zu missed", i / 8, j / 8);
            buf[i] ^= 0x80;
            buf[j] ^= 0x80;
        }
    /* The same bytes moved to another offset, and zero bytes of another length, differ. */
    assert_int_not_equal(kvs_csum_of(buf, 16), kvs_csum_of(buf + 8, 16));
    static const uint8_t zeros[64];
    assert_int_not_equal(kvs_csum_of(zeros, 32), kvs_csum_of(zeros, 64));
    assert_int_not_equal(kvs_csum_of(zeros, 0), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_any_split_any_order),
        cmocka_unit_test(test_changes_detected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
